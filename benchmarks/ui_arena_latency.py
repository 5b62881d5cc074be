"""Arena latency in a real browser: from a click on a vote button to the next pair fully shown
(new pair in the DOM, both images decoded, one animation frame), with 100,000 votes in the
database. Prints the median, p90, mean, min and max over `--votes` votes.

    .venv/bin/python benchmarks/ui_arena_latency.py [--seed-votes 100000] [--votes 60]

Serves the app with uvicorn in a subprocess on a fresh SQLite file (as `make demo` does; no
worker is needed for voting), seeds rollout groups and votes with bulk inserts, and drives
Debian's chromium (/usr/bin/chromium) with Playwright. Each vote follows the previous one
after `--think-ms` (an annotator looks at the pair before voting; the prefetch of the pair
after the next runs meanwhile).
"""

from __future__ import annotations

import argparse
import base64
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

MEASURE_JS = """
async (id) => {
  const box = document.getElementById('arena-pair');
  const old = box.querySelector('.ngs-pair').dataset.nonce;
  const t0 = performance.now();
  document.getElementById(id).click();
  await new Promise((resolve) => {
    const check = () => {
      const p = box.querySelector('.ngs-pair');
      if (!p || !p.dataset.nonce || p.dataset.nonce === old) return false;
      const imgs = [...box.querySelectorAll('img')];
      Promise.all(imgs.map((i) => i.decode().catch(() => {}))).then(resolve);
      return true;
    };
    if (check()) return;
    const obs = new MutationObserver(() => { if (check()) obs.disconnect(); });
    obs.observe(box, {childList: true, subtree: true, attributes: true});
  });
  await new Promise((r) => requestAnimationFrame(() => r()));
  return performance.now() - t0;
}
"""


def seed(n_votes: int, groups: int, g: int, annotators: int) -> None:
    """Bulk-insert `groups` rollout groups of `g` members (sharing 64 image files) and
    `n_votes` votes spread over `annotators` users plus the benchmark's annotator 'bob'."""
    from sqlalchemy import insert, select
    from ui_helpers import shape_png

    from app.db import session_scope
    from app.models import RolloutGroup, Sample, User, Vote
    from app.services import storage

    rng = random.Random(0)
    paths = []
    for k in range(64):
        rel = f"bench/img-{k:02d}.png"
        storage.write_bytes(rel, shape_png(rng))
        paths.append(rel)
    now = datetime.now(UTC)
    prompts = ["two red circles", "one blue square", "three green circles", "a yellow square"]
    with session_scope() as s:
        s.execute(insert(RolloutGroup), [
            {"id": i + 1, "job_id": None, "iteration": 0, "purpose": "rollout",
             "prompt_text": prompts[i % 4], "solver": "dpm++", "steps": 8, "sigma": 0.3,
             "seed": i, "created_at": now} for i in range(groups)])
        s.execute(insert(Sample), [
            {"id": i * g + m + 1, "group_id": i + 1, "member_index": m,
             "image_path": paths[(i * g + m) % 64], "rewards": {"count": rng.random()},
             "advantage": 0.0, "is_anchor": m < 2} for i in range(groups) for m in range(g)])
        s.execute(insert(User), [{"name": f"bench{u}", "role": "annotator", "excluded": False,
                                  "created_at": now} for u in range(annotators)])
        user_ids = list(s.scalars(select(User.id).where(User.name.like("bench%"))))
        user_ids.append(s.scalar(select(User.id).where(User.name == "bob")))
        pairs = [(i * g + a + 1, i * g + b + 1) for i in range(groups)
                 for a in range(g) for b in range(a + 1, g)]
        per_user = -(-n_votes // len(user_ids))
        assert per_user <= len(pairs), "not enough pairs for the votes"
        rows = []
        for uid in user_ids:
            for lo, hi in rng.sample(pairs, per_user):
                if len(rows) == n_votes:
                    break
                a, b = (lo, hi) if rng.random() < 0.5 else (hi, lo)
                rows.append({"client_vote_id": uuid.uuid4().hex, "annotator_id": uid,
                             "sample_a_id": a, "sample_b_id": b, "pair_lo_id": lo,
                             "pair_hi_id": hi, "outcome": rng.choice("ab"),
                             "selection": "within_group", "excluded": False,
                             "latency_ms": rng.randint(500, 5000), "created_at": now})
        for start in range(0, len(rows), 10_000):
            s.execute(insert(Vote), rows[start:start + 10_000])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed-votes", type=int, default=100_000)
    ap.add_argument("--groups", type=int, default=4000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--annotators", type=int, default=50)
    ap.add_argument("--votes", type=int, default=60, help="votes to time")
    ap.add_argument("--think-ms", type=int, default=400)
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright
    from sqlalchemy import func, select
    from ui_helpers import CHROMIUM, CHROMIUM_ARGS, login, start_server

    from app.db import session_scope
    from app.models import Vote

    tmp = Path(tempfile.mkdtemp(prefix="ui-bench-"))
    t = time.perf_counter()
    server = start_server(tmp, worker=False)
    seed(args.seed_votes, args.groups, args.group_size, args.annotators)
    with session_scope() as s:
        total = s.scalar(select(func.count()).select_from(Vote))
    print(f"seeded {total} votes, {args.groups} groups of {args.group_size} in "
          f"{time.perf_counter() - t:.1f} s (server up)")
    times = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(30_000)
            login(page, server, server.annotator_token)
            page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
            page.wait_for_timeout(1000)
            buttons = ["vote-a", "vote-b", "vote-tie", "vote-both_bad", "vote-skip"]
            for k in range(args.votes + 3):
                ms = page.evaluate(MEASURE_JS, buttons[k % len(buttons)])
                if k >= 3:  # warm-up: first compiles, first queries
                    times.append(ms)
                page.wait_for_timeout(args.think_ms)
            size = len(base64.b64decode(page.locator("#arena-pair img").first.get_attribute(
                "src").split(",", 1)[1]))
            browser.close()
        with session_scope() as s:
            after = s.scalar(select(func.count()).select_from(Vote))
    finally:
        server.stop()
    times.sort()
    p90 = times[int(0.9 * (len(times) - 1))]
    print(f"votes recorded during the run: {after - total} (expected {args.votes + 3})")
    print(f"image size: {size} bytes (32x32 PNG, inlined)")
    print(f"click -> next pair fully shown, {len(times)} votes with {total} votes in the "
          f"database: median {statistics.median(times):.1f} ms, p90 {p90:.1f} ms, "
          f"mean {statistics.mean(times):.1f} ms, min {times[0]:.1f} ms, "
          f"max {times[-1]:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
