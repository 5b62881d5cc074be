"""api_tokens.is_session and expires_at: the UI's session cookie holds a token of its own,
issued at login, expiring with the cookie and revoked at logout. Before, the cookie held the
user's API token itself, so logging out left it valid and a copied cookie was a permanent
token.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 16:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('is_session', sa.Boolean(), nullable=False,
                                      server_default=sa.false()))
        batch_op.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # sessions would become tokens that never expire: drop them first
    api_tokens = sa.table('api_tokens', sa.column('is_session', sa.Boolean))
    op.get_bind().execute(api_tokens.delete().where(api_tokens.c.is_session.is_(True)))
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.drop_column('expires_at')
        batch_op.drop_column('is_session')
