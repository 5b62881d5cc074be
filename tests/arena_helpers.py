"""What the arena's handler tests share: one vote click, as the page sends it."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any


def arena_vote(arena: ModuleType, user: dict[str, str], state: dict, outcome: str,
               vote_id: str) -> list[Any]:
    """A click on the pair `state` shows; every step of the vote's event (app.ui.arena)."""
    meta = json.dumps({"client_vote_id": vote_id, "nonce": state["current"]["nonce"],
                       "outcome": outcome})
    return list(arena.dispatch(meta, user, state))
