"""workers table: each worker's queues and devices, as it reports them (issue 14)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('workers',
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('queues', sa.JSON(), nullable=False),
    sa.Column('cuda_devices', sa.Integer(), nullable=False),
    sa.Column('device_names', sa.JSON(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_workers'))
    )
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_workers_last_seen_at'), ['last_seen_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_workers_last_seen_at'))
    op.drop_table('workers')
