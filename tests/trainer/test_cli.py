"""`python -m trainer ...` as a user runs it: real subprocesses, real files."""

import json
import subprocess
import sys

import pytest
from cli_helpers import cli_errors
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


def test_train_refuses_the_fields_only_studio_jobs_act_on(tmp_path, capsys):
    """train_nnodes and preference_refit_every were stored and ignored (one process, never a
    refit, exit 0). Given on the command line they are refused, saying where they work; the
    shapes-preference preset's refit cadence is dropped with a note, so the README's
    `train --config shapes-preference --set preference_model=...` still runs."""
    from trainer.cli import build_parser, train_config_of

    out = tmp_path / "run"
    proc = run_cli("train", "--config", "tiny", "--set", "train_nnodes=2", "--set",
                   "preference_refit_every=5", "--out", str(out))
    assert proc.returncode == 2 and not out.exists()
    assert "'train_nnodes': multi-host training runs in the studio's train jobs" in proc.stderr
    assert "'preference_refit_every': online refits run in the studio's train" in proc.stderr
    config = train_config_of(build_parser().parse_args(
        ["train", "--config", "shapes-preference", "--set", "preference_model=p.safetensors",
         "--out", str(out)]))
    assert config.preference_refit_every == 0 and config.reward_weights["preference"] == 1.0
    assert "preset 'shapes-preference' sets preference_refit_every=50" in capsys.readouterr().err
    # the off values say nothing
    assert train_config_of(build_parser().parse_args(
        ["train", "--config", "tiny", "--set", "train_nnodes=1", "--set",
         "preference_refit_every=0", "--out", str(out)])).train_nnodes == 1


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
    # --no-progress: no bar, a plain line for the last iteration (and every 10th, the first)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("iteration ")]
    assert lines == [f"iteration 5/5: reward {records[-1]['reward_mean']:.4f}, loss "
                     f"{records[-1]['loss']:.4g}, {records[-1]['seconds']:.2f} s"], proc.stderr
    assert "it/s" not in proc.stderr and "s/it" not in proc.stderr


def test_a_first_ctrl_c_ends_the_iteration_with_a_checkpoint_and_a_second_stops_at_once(
        tmp_path):
    """Ctrl-C printed a 30-line KeyboardInterrupt traceback and lost the iterations since the
    last checkpoint. A first one now ends the run at the end of its iteration with a
    checkpoint there (exit 130, saying how to continue); a second stops at once."""
    import signal
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "train", "--config", "tiny", "--set", "iterations=500",
         "--set", "checkpoint_every=1000", "--set", 'device="cpu"', "--out", str(out),
         "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "stopping at the end of this iteration" in err
    done = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()]
    assert f"interrupted at iteration {done[-1]}: checkpoint " in err
    # the command it names, as written (a demo's run said `--resume`, which demo lacks)
    assert f"continue with `python -m trainer train --resume --out {out}`" in err, err
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"iter-{done[-1]:06d}"]
    # the run continues from there
    proc = run_cli("train", "--set", f"iterations={done[-1] + 1}", "--out", str(out),
                   "--resume", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == \
        list(range(1, done[-1] + 2))

    # two presses: the second interrupts the iteration, one line, no traceback. Iterations of
    # seconds (a tiny one took 0.6 s: a first press late in one let it end, and the run with
    # it, before a second 0.3 s later), the second press sent once the first was taken
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "train", "--config", "tiny", "--set", "iterations=500",
         "--set", "checkpoint_every=1000", "--set", "rollout_steps=40", "--set", "group_size=16",
         "--set", 'device="cpu"', "--out", str(tmp_path / "two"), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not ((tmp_path / "two" / "metrics.jsonl").exists()
               and (tmp_path / "two" / "metrics.jsonl").read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(0.5)  # into the second iteration, past the border where a first press ends it
    proc.send_signal(signal.SIGINT)
    taken = []
    while not any("stopping at the end of this iteration" in line for line in taken):
        assert (line := proc.stderr.readline()), "".join(taken)
        taken.append(line)
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=300)
    err = "".join(taken) + rest
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.rstrip().endswith("interrupted"), err


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


def test_sample_errors_name_the_problem(tmp_path, capsys):
    proc = run_cli("sample", "--checkpoint", str(tmp_path / "missing.safetensors"), "--prompts",
                   str(tmp_path / "p.txt"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "prompts" in proc.stderr
    # a second sample into the same directory would leave the first's images unlisted
    from trainer.cli import main

    (tmp_path / "p.txt").write_text("one red circle\n")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "manifest.jsonl").write_text("")
    assert main(["sample", "--prompts", str(tmp_path / "p.txt"), "--out",
                 str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (f"error: --out: {tmp_path / 'o'} holds an earlier "
                                       "sample (manifest.jsonl); give a new --out, or empty "
                                       "it first\n")


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
    # what it was measured with travels with the numbers
    assert result["setting"] == {"model": "shapes", "model_path": None,
                                 "resolution": 32, "guidance_scale": None,
                                 "mixed_precision": None, "dtype": "float32", "solver": "dpm++",
                                 "steps": 2, "preference_model": None}
    for name in ("count", "clip_score"):
        assert f"mean {name}: " in proc.stderr


def test_evaluate_refuses_unknown_rewards_and_missing_weights_before_sampling(tmp_path):
    proc = run_cli("evaluate", "--rewards", "count,beauty", "--device", "cpu")
    assert proc.returncode == 2 and "'beauty'" in proc.stderr and "rewards" in proc.stderr
    proc = run_cli("evaluate", "--rewards", "pickscore", "--device", "cpu",
                   "--reward-model-path", f"pickscore={tmp_path / 'none'}")
    assert proc.returncode == 2
    assert "'pickscore'" in proc.stderr and "config.json" in proc.stderr
    # named by the flag typed, not by the config field a job's path comes from
    assert "(from --reward-model-path pickscore=...)" in proc.stderr, proc.stderr
    assert "reward_model_paths" not in proc.stderr


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


def test_help_lists_the_fields_that_set_can_change(capsys, monkeypatch):
    """`train --help` and `fit-preference --help` end with every field `--set` takes: its
    default, bounds or choices and help text, from the fields' own metadata (a user found
    the names only in trainer/config.py). fit-preference leaves out `device`, --device's."""
    import dataclasses

    from trainer.cli import main
    from trainer.config import TrainConfig
    from trainer.rewards.fit_config import FitConfig

    monkeypatch.setenv("COLUMNS", "100")

    def help_of(command: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
        return " ".join(capsys.readouterr().out.split())  # wrapping undone

    text = help_of("train")
    for row in TrainConfig.describe():
        assert f" {row['name']} (default " in text, row["name"]
        assert " ".join(row["help"].split()) in text, row["name"]
    assert "sigma (default 0.3; [0.0, 1.0])" in text
    assert "method (default \"neighbor\"; one of neighbor, sde)" in text
    assert "seed (default 0; [0, 2147483647])" in text  # a bound in full, not 2.14748e+09
    text = help_of("fit-preference")
    for f in dataclasses.fields(FitConfig):
        assert (f" {f.name} (default " in text) is (f.name != "device"), f.name
    assert "holdout_fraction (default 0.2; [0.0, 1.0))" in text  # lt: an open bound
    assert "features (default \"shapes\"; one of shapes, clip)" in text


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


# ---------------------------------------------------------------------------------------
# A new user's mistakes: each an `error: ...` line and exit code 2, naming the option, before
# any model loads or anything is written (in-process: main(), argparse's SystemExit(2) or the
# 2 main returns for a config error)
# ---------------------------------------------------------------------------------------
BASE = "trainer/shapes/assets/base.safetensors"


def cli_error(argv: list[str], capsys) -> str:
    """main(argv) refuses with exit code 2 and no traceback; its error line."""
    from trainer.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal (a type= check)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.strip(), err
    line = err.strip().splitlines()[-1]  # argparse prints its usage lines first
    assert "error: " in line, err
    return line


def test_a_misspelt_command_is_one_error_line_with_the_nearest_command(capsys):
    """`python -m trainer trian` printed two error lines for one typo (argparse's "invalid
    choice" and then its subparsers' "unknown parser")."""
    from trainer.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["trian", "--out", "x"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert [x for x in err.splitlines() if "error:" in x] == [
        "python -m trainer: error: argument command: invalid choice: 'trian' (choose from "
        "train, sample, evaluate, train-base, demo, fit-preference); did you mean 'train'?"]


def _argparse_refusal(argv: list[str], capsys) -> str:
    """What `main(argv)` writes to stderr as argparse refuses it (exit 2)."""
    from trainer.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, lines", [
    # a required option misspelt was said as missing alone: the typo was never named
    (["sample", "--promts", "p.txt", "--seeds", "1", "--out", "o"], [
        "python -m trainer sample: error: the following arguments are required: "
        "--prompts/--prompts-file",
        "python -m trainer sample: error: unrecognized arguments: --promts; did you mean "
        "--prompts?"]),
    # a value with a space that starts with dashes is a value, as argparse takes it
    (["sample", "--prompts", "--my prompts.txt"], [
        "python -m trainer sample: error: the following arguments are required: --out"]),
    # an abbreviation argparse takes is no typo; one with no near option gets no hint
    (["sample", "--prompts", "p.txt", "--see", "1", "--zzz=1"], [
        "python -m trainer sample: error: the following arguments are required: --out",
        "python -m trainer sample: error: unrecognized arguments: --zzz"]),
])
def test_a_misspelt_option_is_named_beside_the_required_one_it_leaves_out(argv, lines, capsys):
    err = _argparse_refusal(argv, capsys)
    assert [x for x in err.splitlines() if "error:" in x] == lines


def test_the_reward_server_names_a_misspelt_rewards_option(capsys):
    from trainer.rewards.serve import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--rewadrs", "count"])
    assert [x.split(": error: ")[1] for x in capsys.readouterr().err.splitlines()
            if ": error: " in x] == ["the following arguments are required: --rewards",
                                      "unrecognized arguments: --rewadrs; did you mean "
                                      "--rewards?"]


@pytest.mark.parametrize("argv, lines", [
    # said by the top parser, in its usage, the value with it: "python -m trainer: error:
    # unrecognized arguments: --confg tiny", naming none of train's options
    (["train", "--confg", "tiny", "--out", "x"], [
        "python -m trainer train: error: unrecognized arguments: --confg tiny; did you mean "
        "--config?"]),
    # one line each, beside the command's type errors; a stray word as argparse says it
    (["sample", "--prompts", "p.txt", "--out", "o", "--stesp", "2", "--seeds", "0",
      "--modle=flux"], [
        "python -m trainer sample: error: argument --seeds: must be an integer >= 1, got '0'",
        "python -m trainer sample: error: unrecognized arguments: --stesp 2; did you mean "
        "--steps?",
        "python -m trainer sample: error: unrecognized arguments: --modle=flux; did you "
        "mean --model?"]),
    (["evaluate", "stray"], [
        "python -m trainer evaluate: error: unrecognized arguments: stray"]),
    # nothing near: no hint (a loose match offered --host for --bogus); a stray word and a
    # one-dash option are said too, each on its line
    (["sample", "--prompts", "p.txt", "stray", "--out", "o", "--bogus", "-x"], [
        "python -m trainer sample: error: unrecognized arguments: stray",
        "python -m trainer sample: error: unrecognized arguments: --bogus",
        "python -m trainer sample: error: unrecognized arguments: -x"]),
])
def test_a_misspelt_option_is_said_by_its_command(argv, lines, capsys):
    err = _argparse_refusal(argv, capsys)
    assert err.startswith(f"usage: python -m trainer {argv[0]} "), err  # the command's usage
    assert [x for x in err.splitlines() if "error:" in x] == lines


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("one red circle\n")
    return path


@pytest.mark.parametrize("argv", [
    ["sample", "--steps", "0"], ["sample", "--steps", "-1"], ["evaluate", "--steps", "0"],
    ["sample", "--seeds", "0"], ["evaluate", "--seeds", "-3"], ["sample", "--resolution", "0"],
    ["sample", "--steps", "two"]])
def test_steps_seeds_and_resolution_must_be_positive_integers(argv, prompts_file, tmp_path,
                                                              capsys):
    out = tmp_path / "x"
    extra = ["--prompts", str(prompts_file), "--out", str(out)] if argv[0] == "sample" else []
    line = cli_error([*argv, *extra, "--device", "cpu"], capsys)
    assert f"argument {argv[1]}: must be an integer" in line and repr(argv[2]) in line
    assert not out.exists()


def test_an_unreadable_checkpoint_is_named(tmp_path, prompts_file, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# not weights\n" * 100)
    line = cli_error(["evaluate", "--checkpoint", str(readme), "--seeds", "1", "--device", "cpu"],
                     capsys)
    assert f"--checkpoint: {readme} is not a readable checkpoint" in line
    # a checkpoint directory whose weights file is not safetensors: that file is named
    directory = tmp_path / "iter-000001"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"\x00" * 4)
    line = cli_error(["sample", "--checkpoint", str(directory), "--prompts", str(prompts_file),
                      "--out", str(tmp_path / "x"), "--device", "cpu"], capsys)
    assert f"{directory / 'model.safetensors'} is not a readable checkpoint" in line


def test_cuda_asked_for_without_cuda_is_a_config_error(tmp_path, prompts_file, capsys,
                                                       monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    sample = ["sample", "--prompts", str(prompts_file), "--out", str(tmp_path / "x"),
              "--steps", "1", "--seeds", "1"]
    line = cli_error([*sample, "--device", "cuda"], capsys)
    # the option the user gave is named (a command's --device is not a config field)
    assert line == "error: --device: device 'cuda' requested but CUDA is not available"
    line = cli_error([*sample, "--device", "cuda:1"], capsys)
    assert "--device: device 'cuda:1' requested but this machine has 0 CUDA device(s)" in line
    out = tmp_path / "run"
    line = cli_error(["train", "--config", "tiny", "--set", "device=cuda", "--out", str(out),
                      "--no-progress"], capsys)
    assert "config field 'device': device 'cuda' requested but CUDA is not available" in line
    assert not out.exists()


@pytest.mark.parametrize("command", ["sample", "evaluate", "train-base", "fit-preference"])
def test_an_unknown_device_names_the_choices(command, tmp_path, prompts_file, capsys):
    required = {"sample": ["--prompts", str(prompts_file), "--out", str(tmp_path / "x")],
                "train-base": ["--out", str(tmp_path / "x")],
                "fit-preference": ["--votes", str(tmp_path / "v.jsonl"), "--out",
                                   str(tmp_path / "p.safetensors")]}
    line = cli_error([command, *required.get(command, []), "--device", "bogus"], capsys)
    assert "argument --device: must be one of auto, cpu, cuda or cuda:N" in line
    assert "'bogus'" in line and not (tmp_path / "x").exists()


def test_out_in_the_way_of_a_file_or_directory_is_refused_before_any_work(tmp_path, capsys,
                                                                         prompts_file):
    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    sample = ["sample", "--prompts", str(prompts_file), "--steps", "1", "--seeds", "1",
              "--device", "cpu", "--out"]
    line = cli_error([*sample, str(taken)], capsys)
    assert line == f"error: --out: {taken} is an existing file, not a directory"
    line = cli_error([*sample, str(taken / "under")], capsys)
    assert f"--out: {taken} is an existing file, not a directory, so {taken / 'under'}" in line
    line = cli_error(["train", "--config", "tiny", "--set", "device=cpu", "--out", str(taken),
                      "--no-progress"], capsys)
    assert f"--out: {taken} is an existing file, not a directory" in line
    line = cli_error(["train-base", "--out", str(taken), "--steps", "1", "--batch-size", "2",
                      "--pool-size", "0", "--width", "8", "--depth", "1", "--device", "cpu"],
                     capsys)
    assert f"--out: {taken} is an existing file, not a directory" in line
    # evaluate writes its JSON to a file: a directory there is refused before sampling
    line = cli_error(["evaluate", "--seeds", "1", "--steps", "1", "--device", "cpu", "--out",
                      str(tmp_path)], capsys)
    assert f"--out: {tmp_path} is an existing directory, not a file" in line
    assert taken.read_text() == "a file\n"


@pytest.mark.parametrize("bad, option", [
    (["--steps", "0"], "--steps"), (["--steps", "-5", "--batch-size", "0"], "--steps"),
    (["--steps", "-5", "--batch-size", "0"], "--batch-size"),  # each said, at once
    (["--batch-size", "0"], "--batch-size"), (["--lr", "0"], "--lr"), (["--lr", "nan"], "--lr"),
    (["--ema-decay", "1"], "--ema-decay"), (["--depth", "0"], "--depth"),
    (["--width", "-8"], "--width"), (["--seed", "-1"], "--seed"),
    (["--pool-size", "-1"], "--pool-size"), (["--save-every", "-1"], "--save-every")])
def test_train_base_refuses_values_that_train_nothing(bad, option, tmp_path, capsys):
    out = tmp_path / "base"
    # a tiny recipe: without the checks, a bad value would train it (fast) and exit 0
    tiny = ["--steps", "1", "--batch-size", "2", "--pool-size", "0", "--width", "8", "--depth",
            "1", "--device", "cpu"]
    from trainer.cli import main

    with pytest.raises(SystemExit) as exit_:  # argparse's refusal, every option it refuses
        main(["train-base", "--out", str(out), *tiny, *bad])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert any(f"error: argument {option}: must be" in line for line in err.splitlines()), err
    assert not out.exists()


def test_an_interrupted_train_base_keeps_the_ema_so_far_and_says_where(tmp_path):
    """Ctrl-C on train-base exited with "interrupted" alone: no base written, nothing said
    about what was kept, and the same command then refused the directory it had left."""
    import signal
    import time

    from safetensors import safe_open

    out = tmp_path / "base"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "train-base", "--out", str(out), "--steps", "100000",
         "--batch-size", "2", "--pool-size", "0", "--width", "8", "--depth", "1",
         "--save-every", "3", "--device", "cpu"],  # a file every 3 steps: progress seen
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # started as a background job's child is (SIGINT ignored, which Python keeps): the
        # Ctrl-C still stops it (it ran on until killed)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 300
    while not (out / "base-step3.safetensors").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err, err

    def training(path):
        with safe_open(str(path), "pt") as f:
            return json.loads(f.metadata()["base_training"])

    kept = [p for p in out.glob("base-step*.safetensors") if training(p).get("interrupted")]
    assert len(kept) == 1, sorted(p.name for p in out.iterdir())
    assert f"interrupted: the EMA of the steps done is in {kept[0]}" in err, err
    assert "base.safetensors was not written" in err and not (out / "base.safetensors").exists()
    steps = int(kept[0].stem.removeprefix("base-step"))
    assert training(kept[0])["steps"] == steps and steps >= 3


def test_train_base_width_must_split_into_its_heads(tmp_path, capsys):
    out = tmp_path / "base"
    line = cli_error(["train-base", "--out", str(out), "--steps", "1", "--batch-size", "2",
                      "--pool-size", "0", "--width", "6", "--depth", "1", "--device", "cpu"],
                     capsys)
    assert line == "error: --width: must be a multiple of 4, got 6"
    assert not out.exists()


def test_the_shapes_model_samples_at_its_one_resolution(tmp_path, prompts_file, capsys):
    from trainer.cli import main

    sample = ["sample", "--prompts", str(prompts_file), "--seeds", "1", "--steps", "1",
              "--device", "cpu"]
    for spec in ([], ["--checkpoint", BASE]):
        out = tmp_path / "64"
        line = cli_error([*sample, *spec, "--resolution", "64", "--out", str(out)], capsys)
        # the CLI refuses 0 (positive_int), so the message names leaving the option out
        assert ("--resolution: the shapes model draws 32x32 images; use 32 (or --resolution "
                "left out, the same)") in line
        assert "got 64" in line and not out.exists()
    assert "must be an integer >= 1" in cli_error(
        [*sample, "--resolution", "0", "--out", str(tmp_path / "0")], capsys)
    out = tmp_path / "32"
    assert main([*sample, "--resolution", "32", "--out", str(out)]) == 0
    assert [Image.open(f).size for f in out.glob("*.png")] == [(32, 32)]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "x", "100.5"])
def test_guidance_scale_must_be_a_finite_number_in_the_train_configs_range(value, tmp_path, prompts_file,
                                                             capsys):
    out = tmp_path / "x"
    line = cli_error(["sample", "--prompts", str(prompts_file), "--out", str(out), "--steps",
                      "1", "--seeds", "1", "--device", "cpu", f"--guidance-scale={value}"],
                     capsys)  # "=": argparse takes a lone "-inf" for an option
    assert "argument --guidance-scale: must be a" in line and repr(value) in line
    assert not out.exists()


@pytest.mark.parametrize("text, kind", [("[1, 2]", "array"), ("3", "number"), ("null", "null"),
                                        ('"tiny"', "string")])
def test_a_config_file_that_is_not_a_json_object_is_one_line(text, kind, tmp_path, capsys):
    config = tmp_path / "list.json"
    config.write_text(text)
    out = tmp_path / "y1"
    line = cli_error(["train", "--config", str(config), "--out", str(out), "--no-progress"],
                     capsys)
    assert line == (f"error: --config: {config} must be a JSON object of config "
                    f"fields, got a JSON {kind}")
    assert not out.exists()


def test_train_says_a_missing_prompts_file_and_model_directory_together(tmp_path, capsys):
    """The README's FLUX command with neither file there: both said in one line (the prompts
    file alone was said, and the directory after it was fixed)."""
    out = tmp_path / "run"
    lines = cli_errors(["train", "--config", "flux-lora", "--set",
                        f"model_path={tmp_path / 'm'}", "--prompts-file",
                        str(tmp_path / "p.json"), "--out", str(out)], capsys)
    assert len(lines) == 2, lines  # the prompts field's "required" is not said as well
    assert lines[0] == f"error: --prompts-file: {tmp_path / 'p.json'} does not exist"
    assert lines[1].startswith(f"error: config field 'model_path': model directory "
                               f"{tmp_path / 'm'} does not exist"), lines
    assert not out.exists()


def test_evaluate_says_every_missing_input_at_once(tmp_path, capsys, monkeypatch):
    """The README's evaluate command on a machine that has none of it: the checkpoint, the
    model directory, the reward weights and the prompts file, each said in one answer (only
    the checkpoint was, then the next after it was fixed)."""
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path / "rewards"))
    lines = cli_errors(["evaluate", "--model", "flux", "--model-path", str(tmp_path / "flux"),
                        "--checkpoint", str(tmp_path / "iter-000300"), "--prompts-file",
                        str(tmp_path / "test.jsonl"), "--seeds", "1", "--rewards",
                        "hpsv2,jpeg_compressibility", "--device", "cpu"], capsys)
    assert [line.split(":")[1].strip() for line in lines] == [
        "--checkpoint", "--model-path", "reward 'hpsv2'", "--prompts-file"], lines
    assert "does not exist" in lines[1] and "HPS_v2.1_compressed.pt" in lines[2], lines


def test_sample_says_every_bad_input_at_once(tmp_path, capsys):
    lines = cli_errors(["sample", "--model", "sd3", "--model-path", str(tmp_path / "sd3"),
                        "--prompts", str(tmp_path / "p.txt"),
                        "--out", str(tmp_path / "out"), "--device", "cpu"], capsys)
    assert [line.split(":")[1].strip() for line in lines] == ["--prompts", "--model-path"], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["sample", "evaluate"])
def test_a_batch_size_below_one_is_said_with_the_other_options_type_errors(command, tmp_path,
                                                                          prompts_file, capsys):
    """--batch-size -1 was the command's own check, said only once argparse's refusals (a
    --steps 0 beside it) were fixed."""
    from trainer.cli import main

    out = tmp_path / "x"
    extra = ["--prompts", str(prompts_file), "--out", str(out)] if command == "sample" else []
    with pytest.raises(SystemExit) as exc:
        main([command, *extra, "--steps", "0", "--batch-size", "-1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and not out.exists()
    assert [line.split(": error: ")[1] for line in err.splitlines() if ": error: " in line] == [
        "argument --steps: must be an integer >= 1, got '0'",
        "argument --batch-size: must be an integer >= 1, got '-1'"], err


def test_a_bad_config_or_set_option_names_the_option(tmp_path, capsys):
    out = tmp_path / "run"
    line = cli_error(["train", "--config", "nosuchpreset", "--out", str(out)], capsys)
    assert line.startswith("error: --config: 'nosuchpreset' is neither a preset ("), line
    line = cli_error(["train", "--set", "iterations", "--out", str(out)], capsys)
    assert line.startswith("error: --set: 'iterations': must look like key=value"), line
    assert not out.exists()


@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_evaluate_refuses_shapes_only_rewards_for_real_models(model, tmp_path, capsys):
    """The rule train's config applies (shapes_only_problem), before any model loads."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red apple\n")
    line = cli_error(["evaluate", "--model", model, "--model-path", str(tmp_path), "--rewards",
                      "jpeg_compressibility,count", "--device", "cpu", "--seeds", "1",
                      "--prompts-file", str(prompts)], capsys)
    assert line.startswith("error: --rewards: ['count'] score only the shapes "
                           "model's 32x32 images"), line
    assert f"for model {model!r} use image rewards" in line
    # 'preference' is a train job's blend, not a reward evaluate can score: not offered here
    assert "or 'preference'" not in line and "train job's reward_weights" in line


@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_evaluate_of_a_real_model_needs_a_prompts_file(model, tmp_path, capsys):
    """As train refuses it: the 48 shapes prompts (evaluate's default) are the shapes model's,
    and FLUX was evaluated on them without a word ("prompts": "the shapes prompts")."""
    line = cli_error(["evaluate", "--model", model, "--model-path", str(tmp_path),
                      "--device", "cpu", "--seeds", "1"], capsys)
    assert line.startswith(f"error: --prompts-file: model {model!r} is evaluated on prompts "
                           "you give: --prompts-file; the 48 shapes prompts are the shapes "
                           "model's"), line


def test_train_refuses_lora_fields_a_full_fine_tune_would_ignore(tmp_path, capsys):
    """`--config tiny --set model=flux --set lora_rank=4` would train every weight and drop
    the rank: a config error naming the field, before anything is written."""
    out = tmp_path / "run"
    lines = cli_errors(["train", "--config", "tiny", "--set", "model=flux", "--set",
                        f"model_path={tmp_path}", "--set", "lora_rank=4", "--set", "device=cpu",
                        "--set", "resolution=32", "--out", str(out)], capsys)
    assert lines[0].startswith("error: config field 'lora_rank': applies only to "
                               "finetune='lora'; this run has finetune='full'"), lines
    # and, in the same answer, the empty model directory
    assert lines[1].startswith(f"error: config field 'model_path': model directory {tmp_path} "
                               "is incomplete"), lines
    assert not out.exists()


@pytest.mark.parametrize("config", [["--set", "model=flux"], ["--config", "flux-lora"]])
def test_train_names_missing_prompts_beside_the_fields_problems(tmp_path, capsys, config):
    """A flux run with no model_path and no prompts said the model_path alone; the prompts
    came on the next try. Both in one answer, with a bad field beside them, nothing written."""
    out = tmp_path / "run"
    lines = cli_errors(["train", *config, "--set", "learning_rate=-1", "--out", str(out)],
                       capsys)
    fields = [line.split("'")[1] for line in lines]
    assert fields == ["learning_rate", "model_path", "prompts"], lines
    assert "model 'flux' trains on prompts you give" in lines[2]
    assert not out.exists()
    # a prompts file given is not called missing, though the other problems stay
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n")
    lines = cli_errors(["train", *config, "--set", "learning_rate=-1", "--prompts-file",
                        str(prompts), "--out", str(out)], capsys)
    assert [line.split("'")[1] for line in lines] == ["learning_rate", "model_path"], lines


def test_train_says_the_run_directory_files_device_and_reward_weights_at_once(tmp_path,
                                                                              capsys):
    """An --out holding a run, a preference model that is no safetensors file, a device this
    machine lacks and a reward's missing weights were each said only once the ones before
    them were fixed (five tries for five problems)."""
    import torch

    # a CUDA device where there is none (on a machine with one, the rest are still said)
    device = [] if torch.cuda.is_available() else ["--set", "device=cuda"]
    said_device = [] if torch.cuda.is_available() else ["config field 'device'"]
    taken = tmp_path / "taken"
    (taken / "checkpoints").mkdir(parents=True)
    (taken / "config.json").write_text("{}")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"x")
    lines = cli_errors(["train", "--config", "tiny", *device, "--set",
                        f"preference_model={junk}", "--set",
                        'reward_weights={"preference": 1, "aesthetic": 1}', "--set",
                        f"reward_model_paths={{\"aesthetic\": \"{tmp_path / 'none'}\"}}",
                        "--out", str(taken)], capsys)
    assert [line.split(":")[1].strip() for line in lines] == [
        "--out", "config field 'preference_model'", "reward 'aesthetic'", *said_device], lines
    assert f"{taken} holds an earlier run" in lines[0]
    assert f"weights directory '{tmp_path / 'none'}'" in lines[2]
    # a bad field beside them: the run there is still said, and the device
    lines = cli_errors(["train", "--config", "tiny", "--set", "sigma=9", *device,
                        "--out", str(taken)], capsys)
    assert [line.split(":")[1].strip() for line in lines] == [
        "config field 'sigma'", "--out", *said_device], lines
    assert sorted(p.name for p in taken.iterdir()) == ["checkpoints", "config.json"]


def test_train_names_reward_weights_that_do_not_load_before_any_rollout(tmp_path,
                                                                        tiny_clip_path, capsys):
    """As evaluate: a train run whose clip_score weights are whole files of the wrong shapes
    stops at its start with one line naming the reward and its directory, and writes no run
    directory (before, the first scoring raised the loader's traceback after a rollout)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = shutil.copytree(tiny_clip_path, tmp_path / "clip")
    for weights in broken.glob("*.safetensors"):
        save_file({k: torch.zeros(1) for k in load_file(str(weights))}, str(weights))
    out = tmp_path / "run"
    line = cli_error(["train", "--config", "tiny", "--set", "device=cpu", "--set",
                      'reward_weights={"count": 1, "clip_score": 1}', "--set",
                      f'reward_model_paths={{"clip_score": "{broken}"}}', "--out", str(out),
                      "--no-progress"], capsys)
    assert line.startswith(f"error: reward 'clip_score': the weights in {str(broken)!r} (from "
                           "reward_model_paths['clip_score']: "), line
    assert "cannot be loaded: " in line and not out.exists()


def test_evaluate_names_reward_weights_that_do_not_load_before_sampling(tmp_path,
                                                                         tiny_clip_path, capsys,
                                                                         monkeypatch):
    """Files that are there but do not load: one line naming the reward and its directory,
    before the model samples anything. A whole safetensors file of the wrong shapes fails in
    the loader; garbage bytes are found damaged from the header, before loading."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from trainer import evaluation

    broken = shutil.copytree(tiny_clip_path, tmp_path / "clip")
    for weights in broken.glob("*.safetensors"):
        save_file({k: torch.zeros(1) for k in load_file(str(weights))}, str(weights))
    sampled = []
    monkeypatch.setattr(evaluation, "sample_images", lambda *a, **k: sampled.append(1))
    args = ["evaluate", "--rewards", "clip_score", "--reward-model-path", f"clip_score={broken}",
            "--device", "cpu", "--seeds", "1", "--steps", "1"]
    line = cli_error(args, capsys)
    assert line.startswith(f"error: reward 'clip_score': the weights in {str(broken)!r} (from "
                           "--reward-model-path clip_score=...: "), line
    assert "model.safetensors" in line and "cannot be loaded: " in line and not sampled

    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not safetensors at all")
    line = cli_error(args, capsys)
    assert line.startswith(f"error: reward 'clip_score': weights directory {str(broken)!r} "
                           "(from --reward-model-path clip_score=...) has damaged files: "), line
    assert "model.safetensors: not a safetensors file" in line and not sampled


def test_an_interrupt_that_comes_back_as_another_error_still_ends_in_one_line(monkeypatch,
                                                                              capsys):
    """A second Ctrl-C inside an import (matplotlib loading its backend as the first reward
    curve is drawn) came back as "ImportError: initialization failed", caused by the
    KeyboardInterrupt: a traceback and exit 1, not the one line and 130."""
    from trainer import cli

    def interrupted_import(_args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise ImportError("initialization failed") from exc

    monkeypatch.setattr(cli, "cmd_sample", interrupted_import)
    argv = ["sample", "--checkpoint", "c.safetensors", "--prompts", "p.txt", "--out", "o"]
    assert cli.main(argv) == 130
    assert capsys.readouterr().err.strip() == "interrupted"

    def failing_import(_args):  # an ImportError of its own is not an interruption
        raise ImportError("no module named x")

    monkeypatch.setattr(cli, "cmd_sample", failing_import)
    with pytest.raises(ImportError, match="no module named x"):
        cli.main(argv)


def test_a_json_key_given_twice_is_refused_not_the_last_one_taken(tmp_path, capsys):
    """Python's json keeps the last of two equal keys: --set reward_weights={"count": 1,
    "count": 0} trained on nothing and said "every weight is 0"; the config file alike."""
    out = tmp_path / "run"
    line = cli_error(["train", "--config", "tiny", "--set",
                      'reward_weights={"count": 1, "count": 0}', "--out", str(out)], capsys)
    assert line == ("error: --set: reward_weights=...: key 'count' given twice in one "
                    "object (which value is meant?)"), line
    config = tmp_path / "twice.json"
    config.write_text('{"iterations": 2, "iterations": 3}')
    line = cli_error(["train", "--config", str(config), "--out", str(out)], capsys)
    assert line.startswith(f"error: --config: {config} is not valid JSON: key 'iterations' "
                           "given twice in one object"), line
    assert not out.exists()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "one red circle", "prompt": "two red circles"}\n')
    line = cli_error(["evaluate", "--prompts-file", str(prompts), "--device", "cpu"], capsys)
    assert "key 'prompt' given twice" in line, line


def test_evaluate_refuses_a_rewards_list_naming_none_and_a_stray_weights_path(tmp_path,
                                                                                capsys):
    line = cli_error(["evaluate", "--rewards", ",", "--device", "cpu"], capsys)
    assert line.startswith("error: --rewards: ',' names no reward; known: ["), line
    line = cli_error(["evaluate", "--rewards", "count", "--device", "cpu",
                      "--reward-model-path", f"pickscore={tmp_path}"], capsys)
    assert line == ("error: --reward-model-path: 'pickscore' is not among the rewards "
                    "evaluated (count)"), line


def test_evaluate_says_every_reward_weights_problem_at_once(tmp_path, capsys):
    """A stray --reward-model-path was said alone: the incomplete directory of a reward
    evaluated came out only once that was fixed."""
    partial = tmp_path / "pick"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    lines = cli_errors(["evaluate", "--rewards", "count,pickscore", "--device", "cpu",
                        "--reward-model-path", f"aesthetic={tmp_path}",
                        "--reward-model-path", "nonsense",
                        "--reward-model-path", f"pickscore={partial}"], capsys)
    assert lines[:2] == ["error: --reward-model-path: 'aesthetic' is not among the rewards "
                         "evaluated (count, pickscore)",
                         "error: --reward-model-path: must look like NAME=DIR, got 'nonsense'"]
    assert len(lines) == 3 and lines[2].startswith(
        f"error: reward 'pickscore': weights directory {str(partial)!r} (from "
        "--reward-model-path pickscore=...) lacks "), lines


def test_sample_reads_a_jsonl_prompts_file_and_a_byte_order_mark_stays_out(tmp_path):
    """sample --prompts took a .jsonl's lines as prompts (the model was conditioned on
    '{"prompt": ...}'), and a .txt saved with a byte-order mark kept it in its first prompt."""
    import json

    from trainer.cli import main
    from trainer.evaluation import read_prompts

    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfone red circle\r\ntwo blue squares\r\n")
    assert read_prompts(bom) == ["one red circle", "two blue squares"]
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "one red circle", "id": 3}\n\n{"prompt": "two red circles"}\n')
    out = tmp_path / "o"
    assert main(["sample", "--prompts", str(lines), "--seeds", "1", "--steps", "2",
                 "--device", "cpu", "--out", str(out)]) == 0
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in manifest] == ["one red circle", "two red circles"]


def test_a_list_or_object_field_given_as_plain_text_says_to_write_json(tmp_path, capsys):
    """`--set prompts=a,b` was "must be of type list, got 'a,b'", with no hint that a list
    is written as JSON; each such field now says so, with an example, all at once."""
    from trainer.cli import main

    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--set", "prompts=a,b", "--set",
                 "reward_weights=count", "--set", "iterations=x"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "error: config field 'prompts': must be a JSON array, e.g. [\"one\", \"two\"], " \
        "got 'a,b'" in lines, lines
    assert "error: config field 'reward_weights': must be a JSON object, e.g. " \
        "{\"count\": 1.0}, got 'count'" in lines, lines
    assert "error: config field 'iterations': must be a whole number, got 'x'" in lines, lines
    assert not out.exists()


@pytest.fixture
def mixed_prompts(tmp_path):
    """A prompts file whose second prompt the shapes model cannot draw."""
    path = tmp_path / "p.txt"
    path.write_text("two red circles\nseven purple hexagons\n")
    return path


@pytest.mark.parametrize("model_option, said", [
    (["--resolution", "64"], "--resolution"), (["--mixed-precision", "bf16"], "--mixed-precision"),
    (["--model-path", "/nonexistent-flux"], "--model-path")])
def test_evaluate_says_the_rewards_and_prompts_beside_a_refused_model_option(
        model_option, said, mixed_prompts, tmp_path, capsys, monkeypatch):
    """A refused option of the (default shapes) model hid every rewards and prompts problem:
    they were judged only once the model's options passed."""
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path / "rewards"))
    lines = cli_errors(["evaluate", "--rewards", "count,foo,hpsv2", "--seeds", "1",
                        "--prompts-file", str(mixed_prompts), *model_option, "--device", "cpu",
                        "--reward-model-path", f"pickscore={tmp_path / 'none'}",
                        "--reward-model-path", "bad"], capsys)
    assert [line.split(":")[1].strip() for line in lines] == [
        said, "--rewards", "--reward-model-path", "--reward-model-path", "reward 'hpsv2'",
        "--prompts-file"], lines
    assert "unknown reward(s) ['foo']" in lines[1]
    assert "'pickscore' is not among the rewards evaluated" in lines[2]
    assert "must look like NAME=DIR, got 'bad'" in lines[3]
    assert "'seven purple hexagons'" in lines[5]


def test_evaluate_says_the_rewards_given_beside_a_missing_checkpoint(tmp_path, capsys):
    """The checkpoint names the model: while it is missing, the rewards given are still
    judged (the ones a model decides, and its prompts, wait for it)."""
    missing = tmp_path / "iter-000005"
    lines = cli_errors(["evaluate", "--checkpoint", str(missing), "--rewards", "count,foo",
                        "--seeds", "1", "--device", "cpu"], capsys)
    assert len(lines) == 2 and lines[0] == f"error: --checkpoint: {missing} does not exist"
    assert lines[1].startswith("error: --rewards: unknown reward(s) ['foo']"), lines


def test_sample_says_the_prompts_beside_a_refused_model_option(mixed_prompts, tmp_path,
                                                                capsys):
    out = tmp_path / "s3"
    lines = cli_errors(["sample", "--prompts", str(mixed_prompts), "--out", str(out),
                        "--seeds", "1", "--device", "cpu", "--resolution", "64"], capsys)
    assert [line.split(":")[1].strip() for line in lines] == ["--resolution", "--prompts"]
    assert "'seven purple hexagons'" in lines[1] and not out.exists()


def test_train_says_missing_reward_weights_beside_bad_fields_or_out(mixed_prompts, tmp_path,
                                                                    capsys, monkeypatch):
    """The reward models' weights were judged once the config and --out were valid: a bad
    field hid them (three runs for three problems)."""
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path / "rewards"))
    out = tmp_path / "run"
    weights = ["--set", 'reward_weights={"count": 1, "hpsv2": 1}']
    lines = cli_errors(["train", "--config", "tiny", "--out", str(out), "--set", "sigma=5",
                        *weights, "--prompts-file", str(mixed_prompts)], capsys)
    assert [line.split(":")[1].strip() for line in lines] == [
        "config field 'sigma'", "--prompts-file", "reward 'hpsv2'"], lines
    assert not out.exists()
    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    lines = cli_errors(["train", "--config", "tiny", "--out", str(taken), *weights], capsys)
    assert [line.split(":")[1].strip() for line in lines] == ["--out", "reward 'hpsv2'"], lines


def test_train_base_says_the_width_out_and_device_at_once(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "base"
    out.mkdir()
    (out / "base.safetensors").write_bytes(b"earlier")
    lines = cli_errors(["train-base", "--out", str(out), "--width", "10", "--device", "cuda"],
                       capsys)
    assert lines == ["error: --width: must be a multiple of 4, got 10",
                     f"error: --out: {out} holds an earlier train-base run (base.safetensors); "
                     "give a new --out, or delete it to train there again",
                     "error: --device: device 'cuda' requested but CUDA is not available"]
    assert [p.name for p in out.iterdir()] == ["base.safetensors"]


def test_train_under_torchrun_is_refused_before_anything_is_written(tmp_path, monkeypatch,
                                                                    capsys):
    """`torchrun --nproc_per_node 2 -m trainer train` ran the whole run once per process into
    the one --out (metrics written twice, the same checkpoint files renamed by both)."""
    from trainer.cli import main

    out = tmp_path / "run"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--config", "tiny", "--set", "device=cpu", "--set", "iterations=0",
                 "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("error: train runs as one process, not under torchrun "
                               "(WORLD_SIZE=2)"), lines
    assert any("'iterations'" in line for line in lines[1:]), lines  # said beside the rest
    assert not out.exists()
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun's one process: a run as any other
    assert main(["train", "--config", "tiny", "--set", "device=cpu", "--set", "iterations=1",
                 "--out", str(out), "--no-progress"]) == 0


def test_sample_takes_prompts_file_as_train_and_evaluate_spell_it(tmp_path):
    """--prompts-file (train's and evaluate's name) was refused by sample with "the following
    arguments are required: --prompts"."""
    from trainer.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("one red circle\n")
    out = tmp_path / "o"
    assert main(["sample", "--prompts-file", str(prompts), "--seeds", "1", "--steps", "2",
                 "--device", "cpu", "--out", str(out)]) == 0
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in manifest] == ["one red circle"]


def test_a_gpu_index_in_the_train_config_says_how_to_pick_the_gpu(tmp_path, capsys):
    out = tmp_path / "run"
    line = cli_error(["train", "--config", "tiny", "--set", "device=cuda:1", "--out", str(out),
                      "--no-progress"], capsys)
    assert "config field 'device': must be one of ['auto', 'cpu', 'cuda'], got 'cuda:1'" in line
    assert "CUDA_VISIBLE_DEVICES=1" in line and not out.exists()
