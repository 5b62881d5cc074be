"""rollout_groups.seed is 64-bit (the trainer draws noise seeds in [0, 2**62))

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-27 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('rollout_groups', schema=None) as batch_op:
        batch_op.alter_column('seed', existing_type=sa.Integer(), type_=sa.BigInteger(),
                              existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table('rollout_groups', schema=None) as batch_op:
        batch_op.alter_column('seed', existing_type=sa.BigInteger(), type_=sa.Integer(),
                              existing_nullable=False)
