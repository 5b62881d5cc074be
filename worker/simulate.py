"""Simulated annotators: rehearse a voting campaign through the real HTTP API.

    python -m worker.simulate --api http://127.0.0.1:8000 --token ADMIN_TOKEN \
        --annotators 4 --preference larger --flip 0.1 --tie-band 0.0 --votes 300

N annotator users are created through the admin API (`POST /api/users`; or pass annotator
tokens with --annotator-token, repeated). Each draws pairs from `GET /api/votes/next`,
downloads both images from their media URLs, votes by the preference function
(`trainer.rewards.attributes.SimulatedAnnotator`: a name such as `larger`/`upper`, or
`module:callable` taking `(image uint8 (H, W, 3), prompt) -> float`, higher preferred) with a
flip probability and a tie band, and posts the vote (`POST /api/votes`) with the pair's
`selection`. Stops after --votes votes in all, or when no pair is left.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np
from PIL import Image

from trainer.rewards.attributes import PREFERENCES, SimulatedAnnotator


def load_preference(spec: str) -> str | Callable[[np.ndarray, str], float]:
    """A preference name (larger, upper) or `module:callable`."""
    if spec in PREFERENCES:
        return spec
    if ":" not in spec:
        raise SystemExit(f"--preference: {spec!r} is neither one of {sorted(PREFERENCES)} nor "
                         "module:callable")
    module, name = spec.split(":", 1)
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise SystemExit(f"--preference: {spec} is not callable")
    return fn


@dataclass
class Tally:
    votes: int = 0
    outcomes: Counter = field(default_factory=Counter)
    selections: Counter = field(default_factory=Counter)
    exhausted: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def create_annotators(client: httpx.Client, admin_token: str, n: int, prefix: str) -> list[str]:
    tokens = []
    for i in range(n):
        r = client.post("/api/users", json={"name": f"{prefix}-{i}", "role": "annotator"},
                        headers={"Authorization": f"Bearer {admin_token}"})
        r.raise_for_status()
        tokens.append(r.json()["token"])
    return tokens


def _image(client: httpx.Client, url: str, headers: dict[str, str]) -> np.ndarray:
    r = client.get(url, headers=headers)
    r.raise_for_status()
    return np.asarray(Image.open(io.BytesIO(r.content)).convert("RGB"), dtype=np.uint8)


def annotate(client: httpx.Client, token: str, annotator: SimulatedAnnotator, budget: Callable[[], bool],
             tally: Tally) -> None:
    """One annotator's loop: next pair -> images -> vote, while `budget()` grants a vote."""
    headers = {"Authorization": f"Bearer {token}"}
    session_id = uuid.uuid4().hex
    while budget():
        r = client.get("/api/votes/next", headers=headers)
        if r.status_code == 204:
            with tally.lock:
                tally.exhausted += 1
                tally.votes -= 1  # give the reserved vote back
            return
        r.raise_for_status()
        pair = r.json()
        shown = time.perf_counter()
        a = _image(client, pair["a"]["image_url"], headers)
        b = _image(client, pair["b"]["image_url"], headers)
        outcome = annotator.vote(a, b, pair["prompt"])
        body = {"client_vote_id": uuid.uuid4().hex, "sample_a_id": pair["a"]["sample_id"],
                "sample_b_id": pair["b"]["sample_id"], "outcome": outcome,
                "session_id": session_id, "selection": pair["selection"],
                "latency_ms": int((time.perf_counter() - shown) * 1000)}
        r = client.post("/api/votes", json=body, headers=headers)
        if r.status_code == 409:  # judged meanwhile (another request of ours): next pair
            with tally.lock:
                tally.votes -= 1
            continue
        r.raise_for_status()
        with tally.lock:
            tally.outcomes[outcome] += 1
            tally.selections[pair["selection"]] += 1


def simulate(*, api: str | None = None, client: httpx.Client | None = None,
             admin_token: str | None = None, annotator_tokens: list[str] | None = None,
             annotators: int = 4, preference: str | Callable = "larger", flip: float = 0.1,
             tie_band: float = 0.0, votes: int = 300, seed: int = 0,
             name_prefix: str | None = None) -> dict:
    """Run the campaign; returns a summary (votes, outcomes, selections, seconds)."""
    own = client is None
    client = client or httpx.Client(base_url=api or "http://127.0.0.1:8000", timeout=30.0)
    try:
        tokens = list(annotator_tokens or [])
        if not tokens:
            if not admin_token:
                raise SystemExit("give --token (an admin token) or --annotator-token")
            prefix = name_prefix or f"sim-{uuid.uuid4().hex[:6]}"
            tokens = create_annotators(client, admin_token, annotators, prefix)
        pref = load_preference(preference) if isinstance(preference, str) else preference
        tally = Tally()

        def budget() -> bool:
            with tally.lock:
                if tally.votes >= votes:
                    return False
                tally.votes += 1
                return True

        start = time.perf_counter()
        errors: list[BaseException] = []

        def run(i: int, tok: str) -> None:
            try:
                annotate(client, tok, SimulatedAnnotator(pref, flip=flip, tie_band=tie_band,
                                                         seed=seed + i), budget, tally)
            except BaseException as exc:  # noqa: BLE001  (raised after the join)
                errors.append(exc)

        runners = [threading.Thread(target=run, args=(i, tok)) for i, tok in enumerate(tokens)]
        for t in runners:
            t.start()
        for t in runners:
            t.join()
        if errors:
            raise errors[0]
        return {"votes": sum(tally.outcomes.values()), "annotators": len(tokens),
                "outcomes": dict(tally.outcomes), "selections": dict(tally.selections),
                "exhausted_annotators": tally.exhausted,
                "seconds": round(time.perf_counter() - start, 2)}
    finally:
        if own:
            client.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    p.add_argument("--token", help="an admin token (creates the annotator users)")
    p.add_argument("--annotator-token", action="append", default=[],
                   help="use existing annotators instead (repeat)")
    p.add_argument("--annotators", type=int, default=4,
                   help="annotator users to create with --token (default 4)")
    p.add_argument("--preference", default="larger",
                   help=f"one of {sorted(PREFERENCES)} or module:callable "
                   "(default %(default)s)")
    p.add_argument("--flip", type=float, default=0.1, help="probability a vote is flipped (default %(default)s)")
    p.add_argument("--tie-band", type=float, default=0.0,
                   help="relative difference under which a pair is a tie "
                   "(default %(default)s)")
    p.add_argument("--votes", type=int, default=300, help="votes in all, fewer when no pair is left (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random flips: annotator i uses SEED+i (default 0)")
    p.add_argument("--name-prefix", help="annotator user names: PREFIX-0, PREFIX-1, ... "
                   "(default sim-<6 random hex digits>)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summary = simulate(api=args.api, admin_token=args.token,
                       annotator_tokens=args.annotator_token, annotators=args.annotators,
                       preference=args.preference, flip=args.flip, tie_band=args.tie_band,
                       votes=args.votes, seed=args.seed, name_prefix=args.name_prefix)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
