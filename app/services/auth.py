"""Users and bearer API tokens (stored as SHA-256 hashes; shown once at creation)."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.errors import Conflict, Forbidden, Invalid, Unauthorized
from app.models import ROLES, ApiToken, User

TOKEN_PREFIX = "ngs_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_user(session: Session, name: str, role: str) -> tuple[User, str]:
    """Create a user with one token. Returns (user, plaintext token). Flushes, no commit."""
    name = name.strip()
    if not name or len(name) > 100:
        raise Invalid("name must be 1-100 characters", field="name")
    if role not in ROLES:
        raise Invalid(f"role must be one of {list(ROLES)}, got {role!r}", field="role")
    if session.scalar(select(User.id).where(User.name == name)) is not None:
        raise Conflict(f"user {name!r} already exists")
    user = User(name=name, role=role)
    session.add(user)
    session.flush()
    return user, issue_token(session, user)


def issue_token(session: Session, user: User) -> str:
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(user_id=user.id, token_hash=hash_token(token), prefix=token[:10]))
    session.flush()
    return token


def authenticate(session: Session, token: str | None) -> User:
    """The user owning `token`; Unauthorized if missing, unknown or revoked."""
    if not token:
        raise Unauthorized("missing bearer token")
    row = session.scalar(
        select(ApiToken).where(ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None))
    )
    if row is None:
        raise Unauthorized("invalid or revoked token")
    return row.user


def require_role(user: User, *roles: str) -> User:
    if user.role not in roles:
        raise Forbidden(f"this action needs role {' or '.join(roles)}; you are {user.role}")
    return user
