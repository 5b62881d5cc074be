"""datasets.blank_lines_skipped: how many blank lines an upload skipped, kept beside
duplicates_dropped (issue 14: blank lines are skipped and reported as duplicates are)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29 03:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # datasets uploaded before this skipped blank lines too but did not keep the count: 0
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.add_column(sa.Column('blank_lines_skipped', sa.Integer(), nullable=False,
                                      server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_column('blank_lines_skipped')
