"""`python -m trainer ...` as a user runs it: real subprocesses, real files."""

import json
import subprocess
import sys

import pytest
from PIL import Image


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_bad_config_names_the_field_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--config", "tiny", "--set", "sigma=3", "--set",
                   'reward_weights={"beauty": 1}', "--out", str(out))
    assert proc.returncode == 2
    assert "sigma" in proc.stderr and "[0.0, 1.0]" in proc.stderr
    assert "'reward_weights'" in proc.stderr and "'beauty'" in proc.stderr  # both at once
    assert not out.exists()
    bad_file = tmp_path / "bad.json"
    bad_file.write_text(json.dumps({"learning_rat": 1e-5}))
    proc = run_cli("train", "--config", str(bad_file), "--out", str(out))
    assert proc.returncode == 2 and "learning_rat" in proc.stderr and not out.exists()


def test_train_writes_metrics_curve_samples_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--config", "tiny", "--set", "device=\"cpu\"", "--out", str(out),
                   "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "reward curve" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert sorted(p.name for p in (out / "samples").iterdir()) == [
        "iter-000001.png", "iter-000002.png", "iter-000003.png"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter-000002", "iter-000003"]
    # resume with a larger budget continues from iteration 3 and keeps the history
    proc = run_cli("train", "--config", "tiny", "--set", "iterations=5", "--set", "device=\"cpu\"",
                   "--out", str(out), "--resume", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]


def test_sample_is_deterministic_and_writes_a_manifest(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one red circle\nthree blue squares\n")
    outs = []
    for name in ("a", "b"):
        proc = run_cli("sample", "--checkpoint", "trainer/shapes/assets/base.safetensors", "--prompts",
                       str(prompts), "--seeds", "2", "--out", str(tmp_path / name), "--device", "cpu")
        assert proc.returncode == 0, proc.stderr
        outs.append(tmp_path / name)
    manifest = [json.loads(line) for line in (outs[0] / "manifest.jsonl").read_text().splitlines()]
    assert [(m["prompt"], m["seed"]) for m in manifest] == [
        ("one red circle", 0), ("one red circle", 1), ("three blue squares", 0), ("three blue squares", 1)]
    for m in manifest:
        a, b = Image.open(outs[0] / m["file"]), Image.open(outs[1] / m["file"])
        assert a.size == (32, 32) and a.tobytes() == b.tobytes()


def test_sample_errors_name_the_problem(tmp_path):
    proc = run_cli("sample", "--checkpoint", str(tmp_path / "missing.safetensors"), "--prompts",
                   str(tmp_path / "p.txt"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "prompts" in proc.stderr


@pytest.mark.slow
def test_evaluate_reports_accuracy_on_48x20(tmp_path):
    out = tmp_path / "eval.json"
    proc = run_cli("evaluate", "--checkpoint", "trainer/shapes/assets/base.safetensors", "--device",
                   "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["samples"] == 48 * 20
    # the shipped base draws the prompt's shapes and colour and often the right count, with
    # room above for RL: issue 18's range (0.644 measured here and on an H200)
    assert 0.3 <= result["exact_count_accuracy"] <= 0.7, result
    assert result["color_reward"] > 0.85 and result["count_reward"] > 0.6, result
    # objects of the prompt's shape, corners included (the second base's squares: 0.16)
    assert min(result["shape_reward_by_shape"].values()) > 0.6, result
    assert set(result["exact_count_accuracy_by_count"]) == {"one", "two", "three", "four"}
    # the shape reward per prompted shape: the prompts hold each shape equally often
    by_shape = result["shape_reward_by_shape"]
    assert set(by_shape) == {"circle", "square", "triangle"}
    assert sum(by_shape.values()) / 3 == pytest.approx(result["shape_reward"])


def test_evaluate_scores_held_out_prompts_with_any_rewards(tmp_path, tiny_clip_path):
    """`evaluate --rewards` on a .jsonl prompt file (HPDv2-style, a "prompt" field): each
    reward's mean printed (JSON on stdout, one line per reward on stderr) and written."""
    prompts = tmp_path / "test.jsonl"
    prompts.write_text('{"prompt": "one red circle", "source": "held-out"}\n\n'
                       '{"prompt": "three blue squares"}\n')
    out = tmp_path / "eval.json"
    proc = run_cli("evaluate", "--checkpoint", "trainer/shapes/assets/base.safetensors",
                   "--device", "cpu", "--steps", "2", "--seeds", "2", "--prompts-file",
                   str(prompts), "--rewards", "count,clip_score", "--reward-model-path",
                   f"clip_score={tiny_clip_path}", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result == json.loads(out.read_text())
    assert result["samples"] == 2 * 2 and set(result["rewards"]) == {"count", "clip_score"}
    assert 0.0 <= result["rewards"]["count"]["mean"] <= 1.0
    assert result["clip_score_reward"] == result["rewards"]["clip_score"]["mean"]
    assert "exact_count_accuracy" not in result  # not asked for
    for name in ("count", "clip_score"):
        assert f"mean {name}: " in proc.stderr


def test_evaluate_refuses_unknown_rewards_and_missing_weights_before_sampling(tmp_path):
    proc = run_cli("evaluate", "--rewards", "count,beauty", "--device", "cpu")
    assert proc.returncode == 2 and "'beauty'" in proc.stderr and "rewards" in proc.stderr
    proc = run_cli("evaluate", "--rewards", "pickscore", "--device", "cpu",
                   "--reward-model-path", f"pickscore={tmp_path / 'none'}")
    assert proc.returncode == 2
    assert "'pickscore'" in proc.stderr and "config.json" in proc.stderr
    assert "reward_model_paths['pickscore']" in proc.stderr


def test_every_subcommand_and_option_says_what_it_does():
    """`python -m trainer CMD --help` is the CLI's documentation: no bare option."""
    import argparse

    from trainer.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    undocumented = []
    for name, parser in sub.choices.items():
        if not parser.description:
            undocumented.append(f"{name}: no description")
        undocumented += [f"{name} {action.option_strings[0]}" for action in parser._actions
                         if action.option_strings and action.dest != "help" and not action.help]
    assert sorted(sub.choices) == ["demo", "evaluate", "fit-preference", "sample", "train",
                                   "train-base"]
    assert not undocumented, undocumented


def test_the_servers_cli_explains_itself_too():
    """`python -m app CMD --help`: every subcommand described, every argument explained."""
    import argparse

    from app.__main__ import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == ["create-user", "migrate", "serve"]
    bare = [f"{name}: no description" for name, p in sub.choices.items() if not p.description]
    bare += [f"{name} {action.dest}" for name, p in sub.choices.items() for action in p._actions
             if action.dest != "help" and not action.help]
    assert not bare, bare


def test_model_choices_are_the_registrys_and_train_base_help_states_the_real_defaults():
    """`--model` lists what `trainer.models` registers, and every `(default X)` that
    `train-base --help` prints is the recipe `BaseTrainingConfig` / `ShapesDiTConfig` holds
    (the parser states them without importing torch, so they are written out: kept true here)."""
    import argparse
    import re

    from trainer.cli import build_parser
    from trainer.models import model_names
    from trainer.models.shapes_dit import ShapesDiTConfig
    from trainer.shapes.base_training import BaseTrainingConfig

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("sample", "evaluate"):
        model = next(a for a in sub.choices[name]._actions if a.dest == "model")
        assert list(model.choices) == model_names()
    field_of = {"lr": "learning_rate"}
    recipe = {**vars(BaseTrainingConfig()), **vars(ShapesDiTConfig())}
    stated = {}
    for action in sub.choices["train-base"]._actions:
        found = re.search(r"default ([^):;]+)", action.help or "")
        if action.option_strings and found and action.dest in recipe | field_of:
            stated[field_of.get(action.dest, action.dest)] = found.group(1).strip()
    assert len(stated) >= 12, stated  # every recipe option's help states its default
    for field_name, text in stated.items():
        value = recipe[field_name]
        if isinstance(value, bool):
            assert text == ("on" if value else "off"), (field_name, text, value)
        elif isinstance(value, (int, float)):
            assert float(text.replace(",", "")) == value, (field_name, text, value)
        else:
            assert text == str(value), (field_name, text, value)
