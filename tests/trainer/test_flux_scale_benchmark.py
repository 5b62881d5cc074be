"""benchmarks/flux_scale.py runs its four cases at toy size on the CPU and writes the figures
file the FLUX-scale comparison is read from (the same code path as the GPU run)."""

from __future__ import annotations

import json
import math

import pytest
from benchmark_scripts import load_benchmark

# the whole benchmark once (model build, four cases, a FLOP count): seconds on a CPU, but
# `make check` keeps to the unit tests
pytestmark = pytest.mark.slow


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_every_case_runs_at_toy_size_and_writes_the_figures(tmp_path, capsys):
    bench = load_benchmark("flux_scale")
    out = tmp_path / "flux_scale.json"
    assert bench.main(["--tiny", "--device", "cpu", "--group-size", "4", "--lora-rank", "4",
                       "--steps-scale", "0.5", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["card"]
    for key in ("neighbor_s_per_iteration", "sde_s_per_iteration", "update_mfu",
                "peak_memory_gb", "speedup", "matmul_peak_tflops"):
        assert _positive(report[key]), (key, report[key])
    assert report["scaling"] == {"1": pytest.approx(1 / report["neighbor_s_per_iteration"])}
    assert report["update_mfu"] < 1
    neighbor = next(r for r in report["cases"] if r["case"] == "neighbor-8")
    assert report["neighbor_peak_memory_gb"] == neighbor["peak_memory_gb"]
    assert report["peak_memory_gb"] >= report["neighbor_peak_memory_gb"]
    assert _positive(report["flops_counted"]["forward_flops_per_sample"])
    assert (report["flops_counted"]["forward_backward_flops_per_sample"]
            > report["flops_counted"]["forward_flops_per_sample"])

    rows = {row["case"]: row for row in report["cases"]}
    assert list(rows) == list(bench.CASES)  # in the budget's order
    G = 4
    for row in rows.values():
        assert "error" not in row, row
        parts = row["rollout_seconds"] + row["reward_seconds"] + row["update_seconds"]
        assert 0 < parts <= row["seconds"] * 1.001
        for key in ("update_mfu", "update_hfu", "rollout_mfu", "peak_memory_gb"):
            assert _positive(row[key]), (row["case"], key, row[key])
        T, K, B = row["rollout_steps"], row["num_train_timesteps"], row["num_anchors"]
        if row["method"] == "neighbor":  # rollouts + trained predictions (pi_old: the rollout)
            assert (row["forward_passes"], row["backward_passes"]) == (G * T + B * K, B * K)
        else:  # every member trained on K steps
            assert B == G
            assert (row["forward_passes"], row["backward_passes"]) == (G * T + G * K, G * K)
    # the steps were halved for speed: 8 -> 4, 25 -> 12 (K = 14 capped at 12), 16 -> 8
    assert [rows[n]["rollout_steps"] for n in bench.CASES] == [4, 12, 8, 8]
    assert rows["sde-25"]["backward_passes"] > rows["neighbor-8"]["backward_passes"]
    assert rows["sde-25"]["update_hfu"] > rows["sde-25"]["update_mfu"]  # checkpointing recomputes
    assert "| neighbor-8 | 4 |" in capsys.readouterr().out


def test_a_memory_cap_needs_a_cuda_card(capsys):
    bench = load_benchmark("flux_scale")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--tiny", "--device", "cpu", "--memory-cap-gb", "80"])
    assert exit_.value.code == 2
    assert "--memory-cap-gb needs a CUDA device" in capsys.readouterr().err


def test_a_failing_case_is_recorded_and_the_next_one_still_runs(tmp_path, monkeypatch):
    bench = load_benchmark("flux_scale")
    real_run_case = bench.run_case

    def run_case(name, *args, **kwargs):
        if name == "sde-25":
            raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED (simulated)")
        return real_run_case(name, *args, **kwargs)

    monkeypatch.setattr(bench, "run_case", run_case)
    out = tmp_path / "flux_scale.json"
    assert bench.main(["--tiny", "--device", "cpu", "--group-size", "4", "--lora-rank", "4",
                       "--steps-scale", "0.25", "--cases", "sde-25,neighbor-8",
                       "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    first, second = report["cases"]
    assert "CUBLAS_STATUS_EXECUTION_FAILED" in first["error"]
    assert "error" not in second and _positive(second["update_mfu"])
    assert report["sde_s_per_iteration"] is None and report["speedup"] is None
    assert _positive(report["neighbor_s_per_iteration"])


def test_half_the_blocks_checkpointed_and_the_sync_report(tmp_path):
    """--checkpoint-fraction 0.5: the recomputation counted in the hardware FLOPs is half of
    full checkpointing's; --sync-report runs one more iteration under the sync debug mode (on
    a CPU nothing waits, so it finds nothing; on a GPU it lists where the host waits: the
    check that holds on a CPU is test_the_update_loop_never_reads_a_tensor_on_the_host)."""
    bench = load_benchmark("flux_scale")
    rows = {}
    for fraction in ("1.0", "0.5"):
        out = tmp_path / f"{fraction}.json"
        assert bench.main(["--tiny", "--device", "cpu", "--group-size", "4", "--lora-rank",
                           "4", "--steps-scale", "0.25", "--cases", "neighbor-8",
                           "--checkpoint-fraction", fraction, "--sync-report",
                           "--out", str(out)]) == 0
        report = json.loads(out.read_text())
        rows[fraction] = report["cases"][0]
        assert report["settings"]["gradient_checkpointing_fraction"] == float(fraction)
        assert report["host_syncs"]["case"] == "neighbor-8"
        assert report["host_syncs"]["total"] == 0 and report["host_syncs"]["sites"] == []
    assert [rows[f]["gradient_checkpointing_fraction"] for f in rows] == [1.0, 0.5]
    full, half = (rows[f]["update_hfu"] / rows[f]["update_mfu"] - 1 for f in ("1.0", "0.5"))
    assert half == pytest.approx(full / 2, rel=1e-6)


def test_a_rerun_keeps_the_data_parallel_scaling_it_cannot_measure(tmp_path):
    """flux_ddp_scaling.py --figures puts 1, 2 and 4 GPUs measured in one run into the figures
    file; a later single-card run rewrites everything else and keeps those, so re-running the
    documented command does not throw the multi-GPU numbers away."""
    bench = load_benchmark("flux_scale")
    out = tmp_path / "flux_scale.json"
    measured = {"1": 0.159, "2": 0.305, "4": 0.602}
    out.write_text(json.dumps({"scaling": measured, "scaling_runs": {"2": {"processes": 2}},
                               "neighbor_s_per_iteration": 9.9}))
    row = {"case": bench.HEADLINE_NEIGHBOR, "seconds": 6.0, "iterations_per_second": 1 / 6.0,
           "update_mfu": 0.5, "peak_memory_gb": 50.0, "peak_memory_gib": 46.6}
    bench.write({"cases": [row]}, out)
    written = json.loads(out.read_text())
    assert written["scaling"] == measured and written["scaling_runs"] == {"2": {"processes": 2}}
    assert written["neighbor_s_per_iteration"] == 6.0
    single = tmp_path / "single.json"  # a file with one card only gets this run's figure
    single.write_text(json.dumps({"scaling": {"1": 0.1}}))
    bench.write({"cases": [row]}, single)
    assert json.loads(single.read_text())["scaling"] == {"1": pytest.approx(1 / 6.0)}


# what makes the host wait for the device when called on a device tensor
HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


def test_the_update_loop_never_reads_a_tensor_on_the_host(monkeypatch, tiny_model):
    """The CPU stand-in for --sync-report's GPU count (the CUDA sync debug mode never engages
    on a CPU): while update_policy runs (neighbor_grpo, its helpers, optimizer_step), no
    trainer code reads a tensor's value on the host, which on a GPU would wait for every
    queued kernel. torch's own code is left out (Adam reads its CPU step count)."""
    import inspect
    from pathlib import Path

    import torch

    from trainer import neighbor_grpo
    from trainer.config import TrainConfig
    from trainer.shapes.world import all_prompts

    trainer_dir = str(Path(neighbor_grpo.__file__).resolve().parent)
    updating, reads = [False], []

    def recorded(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = inspect.currentframe().f_back
            if updating[0] and caller.f_code.co_filename.startswith(trainer_dir):
                reads.append(f"{name} at {Path(caller.f_code.co_filename).name}:"
                             f"{caller.f_lineno}")
            return original(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, recorded(name))
    update_policy = neighbor_grpo.update_policy

    def update_only(*args, **kwargs):  # rollouts and scoring read rewards: not recorded
        updating[0] = True
        try:
            return update_policy(*args, **kwargs)
        finally:
            updating[0] = False

    monkeypatch.setattr(neighbor_grpo, "update_policy", update_only)
    config = TrainConfig(device="cpu", group_size=4, rollout_steps=4, num_anchors=2,
                         num_train_timesteps=2, prompts_per_iteration=2, train_batch_size=3,
                         rollout_batch_size=8, kl_coefficient=0.1)
    optimizer = torch.optim.Adam(tiny_model.trainable_parameters(), lr=1e-4)
    result = neighbor_grpo.neighbor_grpo_iteration(
        tiny_model, optimizer, all_prompts()[:2], config, torch.Generator().manual_seed(0),
        reference=tiny_model.reference_model())
    assert result.metrics["optimizer_steps"] == 2  # the update ran, micro-batched
    assert reads == []
