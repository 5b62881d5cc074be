"""Votes throughput: PostgreSQL seeded with 10,000 samples and 100,000 votes, the API under
uvicorn, concurrent clients on loopback looping GET /api/votes/next then POST /api/votes for a
fixed time. Prints votes per second, p50/p99 latency, and checks that every acknowledged vote
is in the database exactly once (and nothing else is).

    .venv/bin/python benchmarks/api_votes.py [--seconds 30] [--clients 8] [--workers 2]

Needs the PostgreSQL at 127.0.0.1:5432 (user postgres, trust); creates and drops its own
database. The load generator is a minimal asyncio HTTP/1.1 keep-alive client in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from itertools import combinations
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PG_ADMIN = os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def seed(url: str, n_samples: int, n_votes: int, group_size: int, n_annotators: int,
         clients: int, preference_model: bool = False) -> list[str]:
    """Bulk-load users, groups, samples and votes with COPY; return the clients' tokens."""
    from app.services.auth import TOKEN_PREFIX, hash_token

    rng = random.Random(0)
    pg = url.replace("postgresql+psycopg://", "postgresql://")
    n_groups = n_samples // group_size
    tokens = [TOKEN_PREFIX + uuid.uuid4().hex for _ in range(n_annotators)]
    with psycopg.connect(pg) as conn, conn.cursor() as cur:
        with cur.copy("COPY users (id, name, role, excluded, created_at) FROM STDIN") as cp:
            for i in range(n_annotators):
                cp.write_row((i + 1, f"annotator{i}", "annotator", False, "2026-01-01"))
        with cur.copy("COPY api_tokens (user_id, token_hash, prefix, created_at) FROM STDIN") as cp:
            for i, t in enumerate(tokens):
                cp.write_row((i + 1, hash_token(t), t[:10], "2026-01-01"))
        with cur.copy("COPY rollout_groups (id, iteration, purpose, prompt_text, solver, steps, "
                      "sigma, seed, created_at) FROM STDIN") as cp:
            for g in range(n_groups):
                cp.write_row((g + 1, g // 16, "train", f"prompt {g % 300}", "dpm++", 8, 0.3, g,
                              "2026-01-01"))
        version = 1 if preference_model else None  # cached scores switch on active selection
        with cur.copy("COPY samples (id, group_id, member_index, image_path, rewards, "
                      "is_anchor, preference_score, preference_version) FROM STDIN") as cp:
            for s in range(n_groups * group_size):
                g, m = divmod(s, group_size)
                cp.write_row((s + 1, g + 1, m, f"rollouts/{g + 1}/{m:03d}.png",
                              json.dumps({"count": rng.random()}), m == 0,
                              rng.gauss(0, 1) if version else None, version))
        if preference_model:
            cur.execute("INSERT INTO preference_models (version, path, votes_used, last_vote_id, "
                        "checkpoint_ids, report, created_at) VALUES (1, 'preference/v1.safetensors', "
                        "%s, 0, '[]', '{}', '2026-01-01')", (n_votes,))
        pairs = [(g * group_size + a + 1, g * group_size + b + 1)
                 for g in range(n_groups) for a, b in combinations(range(group_size), 2)]
        per = n_votes // n_annotators
        with cur.copy("COPY votes (client_vote_id, annotator_id, session_id, sample_a_id, "
                      "sample_b_id, pair_lo_id, pair_hi_id, outcome, latency_ms, selection, "
                      "excluded, created_at) FROM STDIN") as cp:
            for u in range(n_annotators):
                for lo, hi in rng.sample(pairs, per):
                    a, b = (lo, hi) if rng.random() < 0.5 else (hi, lo)
                    cp.write_row((uuid.uuid4().hex, u + 1, "seed", a, b, lo, hi,
                                  rng.choice("ab"), 1500, "within_group", False, "2026-01-01"))
        for table in ("users", "api_tokens", "rollout_groups", "samples", "votes"):
            cur.execute(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                        f"(SELECT max(id) FROM {table}))")
        cur.execute("ANALYZE")
    return tokens[:clients]


class Client:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {self.token}"
                f"\r\n")
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + (body or b""))
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.partition(b":")
            if k.lower() == b"content-length":
                length = int(v)
        data = await self.reader.readexactly(length) if length else b""
        return status, data


async def load(port: int, tokens: list[str], seconds: float, warmup: float) -> dict:
    lat_next: list[float] = []
    lat_vote: list[float] = []
    acked: list[str] = []
    errors: dict[str, int] = {}
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + seconds

    async def worker(token: str) -> None:
        c = Client(port, token)
        await c.open()
        while (now := time.perf_counter()) < t_end:
            t0 = now
            st, data = await c.request("GET", "/api/votes/next")
            t1 = time.perf_counter()
            if st != 200:
                errors[f"next {st}"] = errors.get(f"next {st}", 0) + 1
                continue
            pair = json.loads(data)
            vid = uuid.uuid4().hex
            body = json.dumps({"client_vote_id": vid, "sample_a_id": pair["a"]["sample_id"],
                               "sample_b_id": pair["b"]["sample_id"], "outcome": "a",
                               "selection": pair["selection"], "latency_ms": 900,
                               "session_id": "bench"}).encode()
            st, data = await c.request("POST", "/api/votes", body)
            t2 = time.perf_counter()
            if st == 201:
                acked.append(vid)
            else:
                errors[f"vote {st}"] = errors.get(f"vote {st}", 0) + 1
            if t0 >= t_measure:
                lat_next.append(t1 - t0)
                lat_vote.append(t2 - t1)
        c.writer.close()

    await asyncio.gather(*(worker(t) for t in tokens))
    return {"lat_next": lat_next, "lat_vote": lat_vote, "acked": acked, "errors": errors}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--votes", type=int, default=100_000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--annotators", type=int, default=20)
    ap.add_argument("--keep", action="store_true", help="do not drop the database")
    ap.add_argument("--preference-model", action="store_true",
                    help="seed a preference model and cached scores: /votes/next selects actively")
    args = ap.parse_args()

    name = f"ngrpo_bench_{uuid.uuid4().hex[:8]}"
    url = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + "/" + name
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    server = None
    try:
        from app.migrate import upgrade

        upgrade(url)
        t0 = time.time()
        tokens = seed(url, args.samples, args.votes, args.group_size, args.annotators,
                      args.clients, preference_model=args.preference_model)
        print(f"seeded {args.samples} samples, {args.votes} votes in {time.time() - t0:.1f}s")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "DATABASE_URL": url, "DATA_DIR": f"/tmp/{name}"}
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory",
             "--host", "127.0.0.1", "--port", str(port), "--workers", str(args.workers),
             "--log-level", "warning", "--no-access-log"], cwd=ROOT, env=env)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(1.0)
        try:
            import uvloop

            run = uvloop.run
        except ImportError:  # pragma: no cover
            run = asyncio.run
        res = run(load(port, tokens, args.seconds, args.warmup))
        server.terminate()
        server.wait(timeout=30)
        server = None

        pg = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(pg) as conn:
            rows = conn.execute("SELECT client_vote_id FROM votes WHERE session_id = 'bench'"
                                ).fetchall()
            dup_pairs = conn.execute(
                "SELECT count(*) FROM (SELECT 1 FROM votes GROUP BY annotator_id, pair_lo_id, "
                "pair_hi_id HAVING count(*) > 1) d").fetchone()[0]
        in_db = [r[0] for r in rows]
        acked = res["acked"]
        lost = set(acked) - set(in_db)
        extra = set(in_db) - set(acked)
        measured = len(res["lat_vote"])
        print(f"machine: {os.cpu_count()}-core CPU box, uvicorn workers={args.workers}, "
              f"clients={args.clients}, load generator in the same box")
        print(f"votes/s (measured window {args.seconds:.0f}s): {measured / args.seconds:.1f}")
        print(f"GET /api/votes/next  p50 {pct(res['lat_next'], .5):.1f} ms  "
              f"p99 {pct(res['lat_next'], .99):.1f} ms")
        print(f"POST /api/votes      p50 {pct(res['lat_vote'], .5):.1f} ms  "
              f"p99 {pct(res['lat_vote'], .99):.1f} ms")
        print(f"acknowledged {len(acked)}, rows {len(in_db)}, lost {len(lost)}, "
              f"unacknowledged rows {len(extra)}, duplicate client ids "
              f"{len(in_db) - len(set(in_db))}, repeated pairs {dup_pairs}, "
              f"errors {res['errors']}")
        ok = not lost and len(in_db) == len(set(in_db)) and dup_pairs == 0
        return 0 if ok else 1
    finally:
        if server is not None:
            server.kill()
        if not args.keep:
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    sys.exit(main())
