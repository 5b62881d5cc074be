"""votes.pixel_difference: how far apart the two images of a judged pair are (the fraction of
their pixels that differ, the distance the near-identical rule of pair selection uses), measured
when the vote is recorded (issue 18: the distance is kept on the vote beside its selection)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # votes recorded before this were not measured: null, as for a pair whose image is unreadable
    with op.batch_alter_table('votes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('pixel_difference', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('votes', schema=None) as batch_op:
        batch_op.drop_column('pixel_difference')
