"""Users, bearer API tokens and the UI's login sessions (stored as SHA-256 hashes; an API
token is shown once, at creation)."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, event, func, or_, select
from sqlalchemy.orm import Session

from app.db import write_lock
from app.errors import Conflict, Forbidden, Invalid, NotFound, Unauthorized
from app.models import ROLES, ApiToken, User, utcnow
from app.schemas import look_alike_difference, look_alike_key, refuse_hidden

TOKEN_PREFIX = "ngs_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_user(session: Session, name: str, role: str) -> tuple[User, str]:
    """Create a user with one token. Returns (user, plaintext token). Flushes, no commit."""
    name = name.strip()
    if not name:  # said so: "must be 1-100 characters" puzzled whoever typed three spaces
        raise Invalid("name cannot be blank or only spaces", field="name")
    if len(name) > 100:
        raise Invalid("name must be at most 100 characters", field="name")
    refuse_hidden("name", name)  # the API's UserIn says the same; the UI and the CLI come here
    if role not in ROLES:
        raise Invalid(f"role must be one of {list(ROLES)}, got {role!r}", field="role")
    # names tell annotators apart on the leaderboard and in exports: 'ann1', 'ANN1' and the
    # full-width 'ａｎｎ１' would be people no one can tell apart. Compared in Python (NFKC is
    # beyond the database's lower()); a table of people is short.
    # Under a lock every creation takes until its commit: two requests for 'ann1' and 'ANN1'
    # at once would both find the name free (and two for 'ann1' one a 500 from the unique
    # constraint).
    write_lock(session, User)
    key = look_alike_key(name)
    taken = next((n for n in session.scalars(select(User.name).order_by(User.id))
                  if look_alike_key(n) == key), None)
    if taken is not None:
        raise Conflict(f"user {taken!r} already exists" if taken == name else
                       f"user {taken!r} already exists (names differ "
                       f"{look_alike_difference(taken, name)})", field="name")
    user = User(name=name, role=role)
    session.add(user)
    session.flush()
    return user, issue_token(session, user)


def issue_token(session: Session, user: User) -> str:
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(user_id=user.id, token_hash=hash_token(token), prefix=token[:10]))
    session.flush()
    return token


# how long a UI login lasts (the cookie's Max-Age and its token's expiry)
SESSION_LIFETIME = timedelta(days=7)


def start_session(session: Session, user: User) -> str:
    """A UI login: a token of its own for the session cookie, expiring after SESSION_LIFETIME
    and revoked by `end_session`, so that the cookie never holds an API token (logging out
    must end what a copied cookie can do). The user's expired sessions are dropped. Flushes."""
    now = utcnow()
    session.execute(delete(ApiToken).where(ApiToken.user_id == user.id,
                                           ApiToken.is_session.is_(True),
                                           ApiToken.expires_at < now))
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(user_id=user.id, token_hash=hash_token(token), prefix=token[:10],
                         is_session=True, expires_at=now + SESSION_LIFETIME))
    session.flush()
    return token


def end_session(session: Session, token: str | None) -> bool:
    """Revoke the session token `token` (a logout); an API token is left alone. Whether one
    was revoked. Flushes."""
    if not token:
        return False
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(token),
                                                ApiToken.is_session.is_(True),
                                                ApiToken.revoked_at.is_(None)))
    if row is None:
        return False
    row.revoked_at = utcnow()
    session.flush()
    forget_after_commit(session)  # at once, not after the cache's few seconds
    return True


def list_users(session: Session) -> list[dict]:
    """Every user with its role, creation time and number of live (unrevoked) API tokens,
    sessions not counted; a user with none can no longer log in."""
    live = (select(ApiToken.user_id, func.count().label("n"))
            .where(ApiToken.revoked_at.is_(None), ApiToken.is_session.is_(False))
            .group_by(ApiToken.user_id).subquery())
    rows = session.execute(select(User, func.coalesce(live.c.n, 0))
                           .outerjoin(live, live.c.user_id == User.id).order_by(User.id)).all()
    return [{"id": u.id, "name": u.name, "role": u.role, "created_at": u.created_at,
             "excluded": u.excluded, "active_tokens": int(n), "revoked": not n}
            for u, n in rows]


def revoke_user(session: Session, user_id: int, *, by: User | None = None) -> int:
    """Revoke every token of a user (their votes stay). Returns how many were revoked. An
    admin cannot revoke themself (nobody might be left to undo it). Flushes, no commit."""
    user = session.get(User, user_id)
    if user is None:
        raise NotFound(f"user {user_id} not found")
    if by is not None and by.id == user.id:
        raise Invalid("you cannot revoke your own access", field="user_id")
    tokens = session.scalars(select(ApiToken).where(ApiToken.user_id == user.id,
                                                    ApiToken.revoked_at.is_(None))).all()
    now = datetime.now(UTC)
    for t in tokens:
        t.revoked_at = now
    session.flush()
    forget_after_commit(session)  # takes effect at once, not after the cache's few seconds
    return len(tokens)


def replace_token(session: Session, user_id: int, *, by: User | None = None
                  ) -> tuple[User, str, int]:
    """A new API token for a user whose token was lost or leaked (it is shown once), or to
    give a revoked user access again: every live token and UI session of theirs is revoked
    and one new token issued. Returns (user, plaintext token, tokens revoked). Not an admin's
    own (their UI session would end with it). Flushes, no commit."""
    user = session.get(User, user_id)
    if user is None:
        raise NotFound(f"user {user_id} not found")
    if by is not None and by.id == user.id:
        raise Invalid("you cannot replace your own token here (your session would end with "
                      "it): another admin can, or `python -m app create-user` makes a new "
                      "admin", field="user_id")
    revoked = revoke_user(session, user.id)
    return user, issue_token(session, user), revoked


class _TokenCache:
    """token hash -> (detached User, whether the token is a UI session's, expiry): saves a
    query on every request. A revoked token or a role change takes effect within `ttl`
    seconds (or at once after `clear()`: see `forget_after_commit`)."""

    def __init__(self, ttl: float = 10.0, max_size: int = 10_000) -> None:
        self.ttl, self.max_size = ttl, max_size
        self._items: dict[str, tuple[User, bool, float]] = {}
        self._lock = threading.Lock()
        # bumped by every clear(): a user read from the database before a clear is not put
        # back after it (the read may predate the change the clear was for)
        self.generation = 0

    def get(self, key: str) -> tuple[User, bool] | None:
        item = self._items.get(key)
        if item is None or item[2] < time.monotonic():
            return None
        return item[0], item[1]

    def put(self, key: str, user: User, is_session: bool, generation: int | None = None
            ) -> None:
        """Cache `user` for `key`; `generation`: the cache's generation when the user was
        read, so that a read older than the last clear() is not cached."""
        with self._lock:
            if generation is not None and generation != self.generation:
                return
            if len(self._items) >= self.max_size:
                self._items.clear()
            self._items[key] = (user, is_session, time.monotonic() + self.ttl)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.generation += 1


token_cache = _TokenCache()


def forget_after_commit(session: Session) -> None:
    """Drop every cached user now and again when `session` commits: a change to a token or a
    user (a revoke, a logout, excluding an annotator) is not visible to other requests until
    the commit, and one of them that reads the user in between would otherwise cache the old
    row for the cache's ttl (a revoked token that still works, votes still counted)."""
    token_cache.clear()
    event.listen(session, "after_commit", lambda _session: token_cache.clear(), once=True)

SESSION_TOKEN_REFUSED = ("a UI session's token works only where the browser sends its cookie "
                         "(the UI and its stored files); the API takes an API token "
                         "(`python -m app create-user`, or an admin's POST /api/users)")


def authenticate(session: Session, token: str | None, *, session_ok: bool = True) -> User:
    """The user owning `token`; Unauthorized if missing, unknown, revoked or expired, and if
    it is a UI session's token where `session_ok` is False (the API's bearer routes: a session
    is the browser's, so that a copied cookie cannot mint new sessions or act through the API,
    and logging out ends all it can do)."""
    if not token:
        raise Unauthorized("missing bearer token")
    key = hash_token(token)
    cached = token_cache.get(key)
    if cached is not None:
        user, is_session = cached
    else:
        generation = token_cache.generation  # before the read: see _TokenCache.put
        row = session.scalar(
            select(ApiToken).where(ApiToken.token_hash == key, ApiToken.revoked_at.is_(None),
                                   or_(ApiToken.expires_at.is_(None),
                                       ApiToken.expires_at > utcnow())))
        if row is None:
            raise Unauthorized("invalid or revoked token (or an expired session)")
        user, is_session = row.user, bool(row.is_session)
        session.expunge(user)
        token_cache.put(key, user, is_session, generation)
    if is_session and not session_ok:
        raise Unauthorized(SESSION_TOKEN_REFUSED)
    return user


def require_role(user: User, *roles: str) -> User:
    if user.role not in roles:
        raise Forbidden(f"this action needs role {' or '.join(roles)}; you are {user.role}")
    return user
