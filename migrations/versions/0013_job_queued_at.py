"""jobs.queued_at: when the job last entered the queue (submitted, resumed, requeued). A job
queued for longer than JOB_STALE_SECONDS while a live worker that takes it has run nothing for
as long lost its broker message (a Redis restart: it keeps nothing on disk; a worker killed
while it held the message); a worker's reaper sends the message again (worker/reaper.py).
Jobs of earlier revisions count from their creation.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05 17:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('queued_at', sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE jobs SET queued_at = created_at")


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('queued_at')
