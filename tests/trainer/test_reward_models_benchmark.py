"""benchmarks/reward_models.py writes each reward's network in its adapter's layout, loads it
through the registry and times batches (the code path of the GPU numbers in
docs/benchmarks.md), here at toy size on the CPU for the transformers-CLIP rewards."""

from __future__ import annotations

import json

import numpy as np
from benchmark_scripts import load_benchmark

from trainer.rewards import models as reward_models


def test_transformers_rewards_are_written_loaded_and_timed(tmp_path, monkeypatch):
    bench = load_benchmark("reward_models")
    monkeypatch.setenv(reward_models.ENV_DIR, str(tmp_path / "unused"))  # main() sets its own
    out = tmp_path / "rows.json"
    try:
        assert bench.main(["--tiny", "--device", "cpu", "--rewards", "pickscore,clip_score",
                           "--batch", "5", "--image-size", "40", "--repeats", "1",
                           "--out", str(out)]) == 0
    finally:
        reward_models.configure_reward_models({}, "cpu")
        reward_models.clear_cache()
    report = json.loads(out.read_text())
    assert report["card"] == "cpu"
    rows = {r["reward"]: r for r in report["rows"]}
    assert set(rows) == {"pickscore", "clip_score"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["finite"] and row["batch"] == 5
        assert np.isclose(row["images_per_second"], 5 / row["seconds_per_batch"])
        assert row["load_seconds"] > 0


def test_an_unknown_reward_is_a_cli_error(capsys):
    bench = load_benchmark("reward_models")
    try:
        bench.main(["--tiny", "--rewards", "beauty"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("an unknown reward must stop the benchmark")
    assert "unknown ['beauty']" in capsys.readouterr().err
