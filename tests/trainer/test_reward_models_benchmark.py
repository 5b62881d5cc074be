"""benchmarks/reward_models.py writes each reward's network in its adapter's layout, loads it
through the registry and times batches (the code path of the GPU numbers in
docs/benchmarks.md), here at toy size on the CPU for the transformers-CLIP rewards."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

from trainer.rewards import models as reward_models

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "reward_models.py"


def _load():
    spec = importlib.util.spec_from_file_location("reward_models_bench", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["reward_models_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_transformers_rewards_are_written_loaded_and_timed(tmp_path, monkeypatch):
    bench = _load()
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
    bench = _load()
    try:
        bench.main(["--tiny", "--rewards", "beauty"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("an unknown reward must stop the benchmark")
    assert "unknown ['beauty']" in capsys.readouterr().err
