"""preference_models table; cached preference scores on samples (issue 6)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-28 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('preference_models',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=True),
    sa.Column('votes_used', sa.Integer(), nullable=False),
    sa.Column('last_vote_id', sa.Integer(), nullable=False),
    sa.Column('checkpoint_ids', sa.JSON(), nullable=False),
    sa.Column('heldout_accuracy', sa.Float(), nullable=True),
    sa.Column('heldout_log_loss', sa.Float(), nullable=True),
    sa.Column('report', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_preference_models_job_id_jobs'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_preference_models')),
    sa.UniqueConstraint('version', name=op.f('uq_preference_models_version'))
    )
    with op.batch_alter_table('preference_models', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_preference_models_job_id'), ['job_id'], unique=False)
    with op.batch_alter_table('samples', schema=None) as batch_op:
        batch_op.add_column(sa.Column('preference_score', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('preference_version', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('samples', schema=None) as batch_op:
        batch_op.drop_column('preference_version')
        batch_op.drop_column('preference_score')
    with op.batch_alter_table('preference_models', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_preference_models_job_id'))
    op.drop_table('preference_models')
