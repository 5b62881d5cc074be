"""checkpoints.scores: each checkpoint's automatic-reward evaluation (issue 17)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # nullable: existing checkpoints have no evaluation yet, and a JSON server default would
    # need dialect-specific literals
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.add_column(sa.Column('scores', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_column('scores')
