"""workers.holding: why a live worker takes no job for now (its STORAGE_DIR cannot be written:
a full or read-only disk), or NULL when it takes jobs. A queued job that only such workers
could take says so on its page (app.services.workers.waiting_for), where it said nothing and
seemed to wait for no reason.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 04:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('holding', sa.String(length=1000), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('holding')
