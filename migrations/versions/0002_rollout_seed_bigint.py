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
    # checked before anything changes: PostgreSQL's ALTER failed with a bare "integer out
    # of range". SQLite's INTEGER holds 64 bits whatever the column says: nothing to refuse
    if op.get_bind().dialect.name != 'sqlite':
        wide = op.get_bind().execute(sa.text(
            'SELECT count(*) FROM rollout_groups WHERE seed > 2147483647 OR seed < -2147483648'
        )).scalar()
        if wide:
            raise RuntimeError(
                f'cannot downgrade revision 0002 to 0001: {wide} rollout group(s) have a seed '
                'beyond 32 bits (the trainer draws seeds in [0, 2**62)), which the 32-bit '
                'rollout_groups.seed of revision 0001 cannot hold; stay at 0002 or delete '
                'those rollout groups first')
    with op.batch_alter_table('rollout_groups', schema=None) as batch_op:
        batch_op.alter_column('seed', existing_type=sa.BigInteger(), type_=sa.Integer(),
                              existing_nullable=False)
