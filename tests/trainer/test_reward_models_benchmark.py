"""benchmarks/reward_models.py writes each reward's network in its adapter's layout, loads it
through the registry and times batches (the code path of the GPU numbers in
docs/benchmarks.md), here at toy size on the CPU for the transformers rewards (the CLIP ones and
ImageReward's BLIP, written as ImageReward.pt with a local vocab.txt)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from benchmark_scripts import load_benchmark

from trainer.rewards import models as reward_models


def test_transformers_rewards_are_written_loaded_and_timed(tmp_path, monkeypatch, capsys):
    bench = load_benchmark("reward_models")
    assert "imagereward" in bench.REWARDS  # a default run covers every published reward
    monkeypatch.setenv(reward_models.ENV_DIR, str(tmp_path / "unused"))  # main() sets its own
    out = tmp_path / "rows.json"
    try:
        assert bench.main(["--tiny", "--device", "cpu",
                           "--rewards", "pickscore,clip_score,imagereward",
                           "--batch", "5", "--image-size", "40", "--repeats", "1",
                           "--out", str(out)]) == 0
    finally:
        reward_models.configure_reward_models({}, "cpu")
        reward_models.clear_cache()
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["card"] == "cpu"
    rows = {r["reward"]: r for r in report["rows"]}
    assert set(rows) == {"pickscore", "clip_score", "imagereward"}
    for name, row in rows.items():
        assert "error" not in row, row
        assert f"| {name} | cpu | 5 |" in printed
        assert row["finite"] and row["batch"] == 5
        assert row["images_per_second"] > 0
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


def _served_clip_score(bench, tmp_path, monkeypatch, *extra: str) -> dict:
    """The benchmark's report for clip_score at toy size, scored in process and through the
    reward server (2 concurrent clients), with `extra` flags; the registry left as it was."""
    monkeypatch.setenv(reward_models.ENV_DIR, str(tmp_path / "unused"))  # main() sets its own
    out = tmp_path / "rows.json"
    try:
        assert bench.main(["--tiny", "--device", "cpu", "--rewards", "clip_score", "--server",
                           *extra, "--repeats", "1", "--batch", "4", "--image-size", "40",
                           "--clients", "2", "--out", str(out)]) == 0
    finally:
        reward_models.configure_reward_models({}, "cpu")
        reward_models.clear_cache()
    return json.loads(out.read_text())


def test_server_rows_compare_the_reward_server_with_in_process_scoring(tmp_path, monkeypatch):
    """--server: the same rewards through the reward server started in the run (the job's
    client, then concurrent clients of 12 images); its scores are the in-process ones."""
    report = _served_clip_score(load_benchmark("reward_models"), tmp_path, monkeypatch)
    (row,) = report["rows"]
    assert "error" not in row and "server_error" not in row, row
    assert row["server_batch"] == 4 and row["server_clients"] == 2
    assert row["server_client_batch"] == 12
    for key in ("server_one_client_images_per_second", "server_concurrent_images_per_second"):
        assert row[key] > 0
    assert np.isclose(row["server_one_client_ratio"],
                      row["server_one_client_images_per_second"] / row["images_per_second"])
    assert row["server_max_abs_diff"] < 1e-3  # fp32 on the CPU: the same numbers
    # warm-up and timed: 2 requests of the one client, 2 of each concurrent client
    health = report["server"]["health"]
    assert health["rewards"] == ["clip_score"] and health["requests"] == 2 + 2 * 2
    assert health["images"] == 2 * 4 + 2 * 2 * 12


def test_a_reward_whose_package_is_missing_is_skipped_with_a_note(monkeypatch, capsys, tmp_path):
    bench = load_benchmark("reward_models")
    monkeypatch.setitem(reward_models.MODEL_REWARDS, "hpsv2", dataclasses.replace(
        reward_models.MODEL_REWARDS["hpsv2"], unavailable=lambda: "open_clip does not import"))
    monkeypatch.setenv(reward_models.ENV_DIR, str(tmp_path / "unused"))  # main() sets its own
    out = tmp_path / "rows.json"
    assert bench.main(["--tiny", "--device", "cpu", "--rewards", "hpsv2", "--server",
                       "--out", str(out)]) == 0
    assert "| hpsv2 | cpu | skipped: open_clip does not import |" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == [
        {"reward": "hpsv2", "skipped": "open_clip does not import", "card": "cpu"}]


def test_server_process_serves_the_same_scores_from_its_own_process(tmp_path, monkeypatch):
    """--server-process: `python -m trainer.rewards.serve` as its own process loads the run's
    written weights (REWARD_MODELS_DIR, inherited) and answers as the in-thread server does;
    the process is gone when the benchmark returns."""
    bench = load_benchmark("reward_models")
    started: list = []
    real_popen = bench.subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    report = _served_clip_score(bench, tmp_path, monkeypatch, "--server-process")
    (row,) = report["rows"]
    assert "error" not in row and "server_error" not in row, row
    assert row["server_max_abs_diff"] < 1e-3
    (process,) = started
    assert "trainer.rewards.serve" in process.args and process.poll() is not None
    health = report["server"]["health"]
    assert health["rewards"] == ["clip_score"] and health["requests"] == 2 + 2 * 2
    assert report["server"]["load_seconds"] > 0
