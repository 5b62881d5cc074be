"""workers.train_nproc: the TRAIN_NPROC a live worker runs train jobs with. A 'fsdp' job
shards over every process of every host, so its prompts_per_iteration must split evenly over
train_nnodes x the holder's TRAIN_NPROC; submission checks that against what the queue's live
workers report (app.services.workers.world_problem), where the job failed at its start before.
NULL for rows written by a worker from before this revision (nothing is checked against it).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 10:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('train_nproc', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('train_nproc')
