"""jobs.claimed_at: when the current run's worker claimed the job (every claim; started_at
keeps the first). A multi-host train job that has recorded no iteration since its claim is
still in its rendezvous, waiting for hosts, on a resume as on a fresh start: its waiting_for
says so (before, only a job at iteration 0 did). Jobs claimed before this revision have none,
and are judged by their iteration as before.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05 07:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('claimed_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('claimed_at')
