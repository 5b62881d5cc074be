"""benchmarks/out_of_memory.py runs its two trainers at toy size on the CPU (where nothing runs
out of memory) and writes its figures: the code path of the GPU run that shows a FLUX run
failing with TrainingOutOfMemory and then fitting with the change its message names."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.slow  # a model build and two iterations: seconds, beyond `make check`


def test_every_trainer_runs_at_toy_size_and_the_figures_say_so(tmp_path):
    bench = load_benchmark("out_of_memory")
    out = tmp_path / "oom.json"
    assert bench.main(["--tiny", "--device", "cpu", "--group-size", "4", "--lora-rank", "4",
                       "--then", "gradient_checkpointing_fraction=1.0",
                       "--then", "gradient_checkpointing_fraction=1.0,rollout_batch_size=2",
                       "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["resolution"] == 32 and report["card"]
    first, then, last = report["attempts"]
    assert first["changes"] == {} and first["gradient_checkpointing_fraction"] == 0.25
    assert then["gradient_checkpointing_fraction"] == 1.0 and then["rollout_batch_size"] == 4
    assert last["changes"] == {"gradient_checkpointing_fraction": 1.0, "rollout_batch_size": 2}
    assert last["rollout_batch_size"] == 2
    for row in report["attempts"]:
        assert row["outcome"] == "ran" and row["iteration_after"] == 1 and row["seconds"] > 0


def test_a_memory_cap_needs_cuda(tmp_path):
    bench = load_benchmark("out_of_memory")
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--device", "cpu", "--memory-cap-gb", "1",
                    "--out", str(tmp_path / "x.json")])
