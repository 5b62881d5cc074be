"""benchmarks/real_models.py runs its four cases at toy size on the CPU and reports what it
measured (the same code path the H200 numbers in docs/benchmarks.md came from)."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_every_case_runs_at_toy_size_and_counts_its_work(tmp_path, capsys):
    bench = load_benchmark("real_models")
    out = tmp_path / "rows.json"
    assert bench.main(["--tiny", "--device", "cpu", "--resolution", "32", "--group-size", "4",
                       "--lora-rank", "4", "--iterations", "1", "--out", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(bench.CASES)
    G, T, B, K = 4, 8, 4, 4  # the presets' rollout steps, anchors and timesteps; P = 1
    for row in rows.values():
        assert "error" not in row, row
        parts = row["rollout_seconds"] + row["score_seconds"] + row["update_seconds"]
        assert 0 < parts <= row["seconds"] * 1.001
        if row["method"] == "neighbor":  # rollouts + trained predictions (pi_old: the rollout)
            assert (row["forward_passes"], row["backward_passes"]) == (G * T + B * K, B * K)
        else:  # every member trained on K steps
            assert (row["forward_passes"], row["backward_passes"]) == (G * T + G * K, G * K)
        if row["finetune"] == "lora":
            assert 0 < row["trainable_params"] < row["transformer_params"]
        else:
            assert row["trainable_params"] == row["transformer_params"]
    assert "| flux-lora |" in capsys.readouterr().out
