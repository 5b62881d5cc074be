"""The arena: the prompt, two large images, five vote buttons with keyboard shortcuts.

Per browser session (`gr.State`): the pair on screen and the next one, prefetched with its
images inlined, so after a vote the next pair is shown from memory while the one after it is
fetched. The source of each image (checkpoint, iteration, rewards) is not in the page until
the vote is recorded; then it shows for a few seconds (a CSS fade).

One listener serves all five buttons and one handler takes the outcome as a parameter. A
vote's event shows the next pair (first yield) and then prefetches the one after it (second
yield); a click made meanwhile, on the pair already shown, is deferred until the event ends
(`trigger_mode="always_last"`), never dropped: with "once" a quick annotator's vote on the new
pair did nothing at all. The page script notes at click time which pair was on screen, so a
deferred click on a pair that has since been replaced is a no-op, not a vote on a pair the
annotator never saw. It also gives each pair one client vote id: a repeated click on the same
pair carries the same id and the server records the vote once; the second click of a double
click never leaves the page.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import gradio as gr

from app.errors import BadRequest
from app.services import rollouts, votes
from app.ui.common import caller, error_text, esc, fmt, image_src, notice, session
from trainer.rewards.outcomes import OUTCOMES, Outcome

# the key shown on each outcome's button (the page script in app.ui.common binds them)
KEYS = {Outcome.A: "1", Outcome.B: "2", Outcome.TIE: "3", Outcome.BOTH_BAD: "4",
        Outcome.SKIP: "space"}
# while no pair is on screen, how often the arena looks for one (new rollouts arrive)
POLL_SECONDS = 5.0

STALE_PAIR = ("That pair had been replaced before your vote arrived, so nothing was recorded: "
              "judge the pair now shown.")


def new_arena_state(user_id: int | None = None) -> dict[str, Any]:
    """A fresh arena session for `user_id`: a new session id, no votes, no pair yet."""
    return {"session_id": uuid.uuid4().hex, "user_id": user_id, "current": None, "next": None,
            "session_votes": 0, "my_total": 0, "all_total": 0, "last": None}


def arena_for(user_id: int, arena: dict[str, Any] | None) -> dict[str, Any]:
    """The arena session of `user_id`: the one held if it is theirs, else a fresh one. A
    logout and a login as someone else in the same tab keep the page's state: without this
    the next user took over the counter, the pairs fetched for the one before and the
    session id their votes were stored under."""
    if arena and arena.get("session_id") and arena.get("user_id") == user_id:
        return arena
    return new_arena_state(user_id)


def _fetch_pair(user_id: int, exclude: list[int]) -> dict[str, Any] | None:
    """The next unjudged pair with its images inlined (source details are not included)."""
    with session() as s:
        choice = votes.next_pair(s, user_id, exclude=exclude)
    if choice is None:
        return None
    return {"a_id": choice.a_id, "b_id": choice.b_id, "prompt": choice.prompt,
            "selection": choice.selection, "a_src": image_src(choice.a_path),
            "b_src": image_src(choice.b_path), "nonce": uuid.uuid4().hex[:16]}


def pair_html(pair: dict[str, Any] | None) -> str:
    if pair is None:
        return ('<div class="ngs-pair ngs-empty" data-nonce="">'
                + notice("No pairs left to judge. New rollouts will appear here.") + "</div>")
    return (f'<div class="ngs-prompt">{esc(pair["prompt"])}</div>'
            f'<div class="ngs-pair" data-nonce="{pair["nonce"]}">'
            f'<div class="ngs-side"><div class="ngs-side-label">A</div>'
            f'<img alt="image A" src="{pair["a_src"]}"></div>'
            f'<div class="ngs-side"><div class="ngs-side-label">B</div>'
            f'<img alt="image B" src="{pair["b_src"]}"></div></div>')


def _side_text(d: dict[str, Any] | None) -> str:
    if not d:
        return "?"
    rewards = ", ".join(f"{k} {fmt(v, 2)}" for k, v in sorted(d["rewards"].items())) or "none"
    return (f'<span class="ngs-source">{esc(d["source"])}</span> (member {d["member_index"]}; '
            f"rewards: {esc(rewards)})")


def reveal_html(last: dict[str, Any] | None) -> str:
    """The sources of the pair just judged. It shows under the next pair, so it says that it
    is about the previous one and names that pair's prompt."""
    if not last:
        return ""
    a, b = last["sources"].get(str(last["a_id"])), last["sources"].get(str(last["b_id"]))
    prompt = last.get("prompt")
    about = f" (&ldquo;{esc(prompt)}&rdquo;)" if prompt else ""
    # Gradio patches the element in place, so a CSS animation that ran once does not run
    # again for the next vote's reveal: each reveal takes the other of two identical fades
    # (a changed animation-name restarts the animation) and shows for its few seconds
    fade = f"ngs-reveal-{last.get('serial', 0) % 2}"
    return (f'<div class="ngs-reveal {fade}" data-vote="{last["vote_id"]}"><b>Previous pair</b>'
            f'{about}: you chose <b>{esc(Outcome(last["outcome"]).label)}</b>. '
            f'A: {_side_text(a)} &middot; B: {_side_text(b)}</div>')


def counters_html(state: dict[str, Any]) -> str:
    pairs = "pair" if state["session_votes"] == 1 else "pairs"
    return (f'<div class="ngs-counters" id="arena-counter-values" '
            f'data-session="{state["session_votes"]}" data-total="{state["my_total"]}" '
            # a skip is an answer too (stored as a vote, outcome skip), so these count pairs
            # answered, not preferences: "votes" read as one too many after a skip
            f'title="skips and both-bad answers count too">This session: '
            f'<b>{state["session_votes"]}</b> {pairs} answered &middot; yours in total: '
            f'<b>{state["my_total"]}</b> &middot; all annotators: <b>{state["all_total"]}</b>'
            f"</div>")


def _poll(state: dict[str, Any] | None) -> gr.Timer:
    """The arena's timer runs while no pair is on screen, so that new rollouts show up."""
    return gr.Timer(active=bool(state) and state.get("current") is None)


def load(user_state: dict | None, arena: dict | None):
    """Show a pair (on login, when the arena tab opens, and while none is on screen, every
    POLL_SECONDS) and prefetch the next one. Outputs: pair, reveal, counters, state, timer.

    A logout (no token) ends the arena session: the page is emptied and the state dropped,
    so the next login, the same user's or another's, starts a fresh one (`arena_for`)."""
    if not (user_state or {}).get("token"):
        return "", "", "", None, gr.Timer(active=False)
    try:
        user = caller(user_state)
    except Exception as exc:  # noqa: BLE001 - shown to the user
        # a revoked token: nothing of the session stays for whoever logs in next
        return notice(error_text(exc), "error"), "", "", None, gr.Timer(active=False)
    state = arena_for(user.id, arena)
    with session() as s:
        state["my_total"] = votes.count_votes(s, user.id)
        state["all_total"] = votes.count_votes(s)
    if state["current"] is None:
        state["current"] = _fetch_pair(user.id, [])
    if state["current"] is not None and state["next"] is None:
        cur = state["current"]
        state["next"] = _fetch_pair(user.id, [cur["a_id"], cur["b_id"]])
    state["shown_at"] = datetime.now(UTC).isoformat()
    return pair_html(state["current"]), "", counters_html(state), state, _poll(state)


def _current_totals(user_state: dict | None, arena: dict[str, Any]) -> Any:
    """The counters with the totals as the database has them now, `arena` updated; skipped
    (as they stand) for anyone but the arena session's own user (a login racing this)."""
    try:
        user = caller(user_state)
    except Exception:  # noqa: BLE001 - the next vote or load shows what is wrong
        return gr.skip()
    if user.id != arena.get("user_id"):
        return gr.skip()
    with session() as s:
        arena["my_total"] = votes.count_votes(s, user.id)
        arena["all_total"] = votes.count_votes(s)
    return counters_html(arena)


def poll(user_state: dict | None, arena: dict | None):
    """The timer's tick and the tab's opening: look for a pair if none is on screen (the reveal
    of a vote just made stays). Outputs as `load`. With a pair on screen the totals are
    re-read: votes made elsewhere (another tab, another device, other annotators) since the
    last one here left "yours in total" behind until the next vote.

    Before the arena is set up it does nothing: the login sets it up (`load`, on the user's
    change), and the login's selection of the arena tab fires this at the same moment. Two
    events that both set the arena up each drew a pair; the page could show one event's pair
    while the session kept the other's state, and every vote on it was then taken for a
    repeat of an old one: the arena ignored every key until a reload."""
    if not (arena and arena.get("session_id")):
        # the state is left as it is, not written back: this event read it before the login's
        # `load` set it up, and on a loaded server its None landed after `load`'s arena and
        # dropped it (the page kept `load`'s pair; the first vote on it was lost)
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
    if arena.get("current") is not None:
        return gr.skip(), gr.skip(), _current_totals(user_state, arena), arena, _poll(arena)
    pair, _, counters, state, timer = load(user_state, arena)
    return pair, gr.skip(), counters, state, timer


def vote(outcome: str, meta: str, user_state: dict | None, arena: dict | None):
    """Record `outcome` for the pair on screen, show the prefetched pair at once (first yield),
    then prefetch the one after it (second yield). With no pair on screen, a vote (a click,
    a key) looks for one instead. Outputs: pair, reveal, counters, state, timer."""
    try:
        user = caller(user_state)
        if outcome not in OUTCOMES:
            raise BadRequest(f"unknown outcome {outcome!r}")
        info = json.loads(meta or "{}")
    except Exception as exc:  # noqa: BLE001 - shown to the user
        yield gr.skip(), notice(error_text(exc), "error"), gr.skip(), gr.skip(), gr.skip()
        return
    # a session of someone else (a vote racing a login as another user) holds no pair of
    # this user's: a fresh one, which looks for a pair below instead of recording a vote
    state = arena_for(user.id, arena)
    cur = state.get("current")
    if cur is None:
        # nothing on screen to judge ("No pairs left"): look again, new rollouts may be in.
        # A page that showed a pair (a nonce) the session does not hold (its arena was set
        # up again since) is told that its vote did not count, as for a replaced pair
        pair, _, counters, state, timer = load(user_state, state)
        said = (notice(STALE_PAIR, "error")
                if info.get("nonce") and state and state.get("current") else gr.skip())
        yield pair, said, counters, state, timer
        return
    if info.get("nonce") != cur["nonce"]:
        if info.get("shown", cur["nonce"]) == cur["nonce"]:
            # a repeat of a vote already handled (the page shows the pair that replaced the
            # one clicked): nothing to do
            yield gr.skip(), gr.skip(), gr.skip(), state, gr.skip()
            return
        # the page shows a pair this session does not hold (an event that set the arena up
        # or looked for a pair raced another): show the one it holds, so that the next vote
        # counts, and say that this one did not. A new nonce: the page renders only a changed
        # value
        cur["nonce"] = uuid.uuid4().hex[:16]
        state["shown_at"] = datetime.now(UTC).isoformat()
        yield (pair_html(cur), notice(STALE_PAIR, "error"), counters_html(state), state,
               _poll(state))
        return
    shown_at = datetime.fromisoformat(state["shown_at"]) if state.get("shown_at") else None
    now = datetime.now(UTC)
    latency = int((now - shown_at).total_seconds() * 1000) if shown_at else None
    try:
        with session() as s:
            row, created = votes.record_vote(
                s, user, client_vote_id=info.get("client_vote_id") or uuid.uuid4().hex,
                sample_a_id=cur["a_id"], sample_b_id=cur["b_id"], outcome=outcome,
                session_id=state["session_id"], shown_at=shown_at, latency_ms=latency,
                selection=cur["selection"])
            vote_id = row.id
            sources = rollouts.sample_details(s, [cur["a_id"], cur["b_id"]])
    except Exception as exc:  # noqa: BLE001 - e.g. the pair was judged in another tab
        state["current"], state["next"] = state.get("next"), None
        yield (pair_html(state["current"]), notice(error_text(exc), "error"),
               counters_html(state), state, _poll(state))
        return
    if created:
        state["session_votes"] += 1
        state["my_total"] += 1
        state["all_total"] += 1
    previous = state.get("last") or {}
    state["last"] = {"vote_id": vote_id, "outcome": outcome, "a_id": cur["a_id"],
                     "b_id": cur["b_id"], "prompt": cur["prompt"],
                     "sources": {str(k): v for k, v in sources.items()},
                     # counts the reveals, whose parity picks the fade (reveal_html)
                     "serial": previous.get("serial", 0) + 1}
    nxt = state.get("next")
    if nxt is None:
        nxt = _fetch_pair(user.id, [])
    state["current"], state["next"] = nxt, None
    state["shown_at"] = datetime.now(UTC).isoformat()
    yield pair_html(nxt), reveal_html(state["last"]), counters_html(state), state, _poll(state)
    if nxt is not None:
        state["next"] = _fetch_pair(user.id, [nxt["a_id"], nxt["b_id"]])
    # the totals as the database has them, once the pair is on screen (not on the click's
    # path): counted up by this session alone, "all annotators" stayed at the page's load
    # plus this session's votes while others voted, and "yours in total" missed this user's
    # other tabs
    with session() as s:
        state["my_total"] = votes.count_votes(s, user.id)
        state["all_total"] = votes.count_votes(s)
    yield gr.skip(), gr.skip(), counters_html(state), state, gr.skip()


def dispatch(meta: str, user_state: dict | None, arena: dict | None):
    """The one listener of the five buttons: the outcome travels in the client's meta."""
    try:
        outcome = json.loads(meta or "{}").get("outcome")
    except ValueError:
        outcome = ""
    if outcome is None:
        # a deferred trigger whose click the event before it already took (two clicks in
        # one tick): nothing to record
        yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return
    yield from vote(outcome, meta, user_state, arena)


# the click's outcome and pair (noted by the page script at click time, app.ui.common)
VOTE_JS = "(meta, user, arena) => [window.ngsVoteMeta(), user, arena]"

def build_arena(user: gr.State, tab: gr.Tab | None = None) -> gr.Blocks:
    """The arena page; `user` is the login state (`app.ui.login`), `tab` the arena's tab
    (opening it looks for a pair if none is shown)."""
    with gr.Blocks() as page:
        arena = gr.State(None)
        counters = gr.HTML(elem_id="arena-counters")
        pair = gr.HTML(elem_id="arena-pair", min_height=300)
        with gr.Row(elem_id="arena-buttons"):
            buttons = [gr.Button(f"{outcome.label} [{KEYS[outcome]}]",
                                 elem_id=f"vote-{outcome.value}", elem_classes=["ngs-vote"],
                                 variant="primary" if outcome.decisive else "secondary")
                       for outcome in Outcome]
        reveal = gr.HTML(elem_id="arena-reveal")
        meta = gr.Textbox(visible=False)
        timer = gr.Timer(POLL_SECONDS, active=False)
        outputs = [pair, reveal, counters, arena, timer]
        gr.on([b.click for b in buttons], dispatch, inputs=[meta, user, arena],
              outputs=outputs, js=VOTE_JS, trigger_mode="always_last", show_progress="hidden",
              concurrency_limit=None, api_visibility="private")
        # a login (or a new token) shows the first pair
        user.change(load, inputs=[user, arena], outputs=outputs, show_progress="hidden",
                    api_visibility="private")
        # "New rollouts will appear here": while no pair is shown, look again every few
        # seconds and whenever the tab is opened
        timer.tick(poll, inputs=[user, arena], outputs=outputs, show_progress="hidden",
                   api_visibility="private")
        if tab is not None:
            tab.select(poll, inputs=[user, arena], outputs=outputs, show_progress="hidden",
                       api_visibility="private")
    return page
