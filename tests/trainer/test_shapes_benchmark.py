"""The shapes benchmark (Neighbor GRPO against the SDE baseline and the shuffled control)
runs end to end at smoke size on the CPU: every run from the same base, the passes per
iteration each method's config implies, the timing table, and the files it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "shapes_neighbor_vs_sde.py"


@pytest.mark.subprocess
def test_the_shapes_benchmark_runs_every_method_from_one_base_and_counts_their_passes(tmp_path):
    out = tmp_path / "bench"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--iterations", "2", "--eval-every", "2",
         "--seeds", "0", "--methods", "neighbor", "sde", "shuffled", "--timing-iterations", "1",
         "--eval-prompts", "4", "--eval-seeds", "2", "--parallel", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    runs = {r["name"]: r for r in results["runs"]}
    assert sorted(runs) == ["neighbor", "sde", "shuffled"]
    for run in runs.values():
        assert [c["iteration"] for c in run["curve"]] == [0, 2]
        assert run["curve"][1]["train_seconds"] > 0
    # every method starts from the same shipped base, evaluated on the same prompts and seeds
    starts = {json.dumps({k: v for k, v in r["curve"][0].items() if k != "train_seconds"})
              for r in runs.values()}
    assert len(starts) == 1
    # P = 4 prompts, G = 12, 8 rollout steps (384 forwards); Neighbor GRPO trains B = 4
    # anchors at K = 4 timesteps, the SDE baseline every member at K = 4
    assert (runs["neighbor"]["forward_passes"], runs["neighbor"]["backward_passes"]) == (448, 64)
    assert (runs["sde"]["forward_passes"], runs["sde"]["backward_passes"]) == (576, 192)
    assert runs["shuffled"]["backward_passes"] == 64
    assert runs["shuffled"]["config"]["shuffle_advantages"] is True
    assert runs["neighbor"]["config"]["shuffle_advantages"] is False
    timing = results["timing"]
    assert set(timing) == {"neighbor", "sde", "sde-16step"}
    assert timing["neighbor"]["relative_to_neighbor"] == 1.0
    assert all(t["seconds_per_iteration"] > 0 and t["device"] == "cpu" for t in timing.values())
    assert timing["sde-16step"]["backward_passes"] == 4 * 12 * 10  # DanceGRPO's 60% of 16
    summary = (out / "summary.md").read_text()
    assert all(f"| {name} | 0 |" in summary for name in runs)
    assert (out / "curves.png").stat().st_size > 1000
