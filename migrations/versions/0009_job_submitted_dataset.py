"""jobs.submitted_dataset_id: the dataset a job was submitted with, kept when the dataset is
deleted (jobs.dataset_id is then set null). Without it a stopped train job whose dataset was
deleted resumed on the built-in prompts as if it had never had one; with it the resume is
refused, naming the dataset.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 16:05:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # no foreign key: the point is to outlive the dataset
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('submitted_dataset_id', sa.Integer(), nullable=True))
    jobs = sa.table('jobs', sa.column('dataset_id', sa.Integer),
                    sa.column('submitted_dataset_id', sa.Integer))
    # jobs whose dataset was deleted before this revision cannot be told apart: left null
    op.get_bind().execute(jobs.update().values(submitted_dataset_id=jobs.c.dataset_id))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('submitted_dataset_id')
