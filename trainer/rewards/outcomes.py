"""What a vote outcome means, defined once: its label for people, whether it is a preference
label, and its Bradley-Terry target. The API, the votes table, the arena, the export, the
leaderboard, annotator agreement and the preference fit all read it from here.

`trainer.rewards.preference` re-exports it. It lives in its own module, free of torch, because
the app imports it at start-up and otherwise never loads torch.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """An annotator's verdict on a pair shown as A (left) and B (right). The value is what the
    API accepts and the votes table stores; a member equals its value (`Outcome.A == "a"`)."""

    # value, label for people, Bradley-Terry target P(A beats B) (None: no preference)
    A = "a", "A is better", 1.0
    B = "b", "B is better", 0.0
    TIE = "tie", "Tie", 0.5
    BOTH_BAD = "both_bad", "Both bad", None
    SKIP = "skip", "Skip", None

    label: str
    target_a: float | None

    def __new__(cls, value: str, label: str, target_a: float | None) -> Outcome:
        member = str.__new__(cls, value)
        member._value_ = value
        member.label = label
        member.target_a = target_a
        return member

    @property
    def counts(self) -> bool:
        """A preference label: fitted, rated on the leaderboard, compared between annotators.
        `both_bad` and `skip` say nothing about which image is better."""
        return self.target_a is not None

    @property
    def decisive(self) -> bool:
        """One side won (a or b), as opposed to a tie or no preference."""
        return self.target_a in (0.0, 1.0)


# Plain strings, not members: they go into SQL binds, a pydantic Literal and JSON unchanged.
OUTCOMES: tuple[str, ...] = tuple(o.value for o in Outcome)
LABELLED_OUTCOMES: tuple[str, ...] = tuple(o.value for o in Outcome if o.counts)
TARGET_A: dict[str, float] = {o.value: o.target_a for o in Outcome if o.target_a is not None}

__all__ = ["LABELLED_OUTCOMES", "OUTCOMES", "TARGET_A", "Outcome"]
