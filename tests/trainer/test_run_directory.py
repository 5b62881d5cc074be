"""`python -m trainer train --out` against a directory that already holds a run: a new run is
refused there (the old checkpoints would stay, and a later --resume would load them), and a
resume keeps the saved config, refusing changes it would drop and budgets already reached."""

import json

from trainer.cli import _fresh_run_directory, main
from trainer.config import TrainConfig, load_config
from trainer.run_dir import RunDirectory


def _saved_run(out, iterations=3, **fields):
    """A run directory as `train` leaves it (config.json, metrics, the newest checkpoint),
    without training: only the files the checks read."""
    config = load_config("tiny", {"iterations": iterations, **fields})
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i}) + "\n"
                                               for i in range(1, iterations + 1)))
    newest = out / "checkpoints" / f"iter-{iterations:06d}"
    newest.mkdir(parents=True)
    (newest / "trainer_state.safetensors").write_bytes(b"")
    return config


def _tree(path):
    return sorted((p.relative_to(path).as_posix(), p.stat().st_size) for p in path.rglob("*"))


def test_a_new_run_is_refused_in_a_directory_that_holds_one(tmp_path, capsys):
    out = tmp_path / "run"
    _saved_run(out, seed=0)
    before = _tree(out)
    assert main(["train", "--config", "tiny", "--set", "seed=5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out: {out} holds an earlier run (config.json, metrics.jsonl, " \
           "checkpoints); --resume continues it, or give a new --out" in err
    assert _tree(out) == before  # nothing written, nothing emptied
    # an empty directory (or one of other files) takes a run
    (tmp_path / "empty").mkdir()
    assert RunDirectory.run_problems(tmp_path / "empty", TrainConfig(), resume=False) == []


def test_a_resume_refuses_what_it_would_drop_and_budgets_it_has_reached(tmp_path, capsys):
    out = tmp_path / "run"
    saved = _saved_run(out, iterations=3, seed=0)
    before = _tree(out)
    # every problem at once: a changed seed and a budget the run has reached
    assert main(["train", "--config", "tiny", "--set", "seed=5", "--set", "iterations=3",
                 "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "config field 'seed': is 0 in the run being resumed" in err and "given 5" in err
    assert "config field 'iterations': the run in" in err
    assert "is at iteration 3 already (iter-000003); --set iterations=N with N > 3" in err
    assert _tree(out) == before
    # a --config is held against the saved run field by field (the preset's seed is 0)
    other = saved.to_dict() | {"learning_rate": saved.learning_rate * 2, "iterations": 9}
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["train", "--config", str(tmp_path / "other.json"), "--out", str(out),
                 "--resume"]) == 2
    err = capsys.readouterr().err
    assert "config field 'learning_rate': is " in err
    assert f"given {saved.learning_rate * 2!r} by --config {tmp_path / 'other.json'}: " in err
    # the budget and the device may change; a field set to its saved value is no change
    given = {"iterations", "device", "seed"}
    config = load_config("tiny", {"iterations": 9, "device": "cpu", "seed": 0})
    assert RunDirectory.run_problems(out, config, resume=True, given=given) == []
    resumed = RunDirectory.run_config(out, config, resume=True, given=given)
    assert (resumed.iterations, resumed.device) == (9, "cpu")
    # a budget left out is the saved one (reached here), not the preset's
    assert RunDirectory.run_config(out, load_config("tiny", {"iterations": 50}), True,
                                   given=()).iterations == 3
    assert [e.field for e in RunDirectory.run_problems(
        out, load_config("tiny", {"iterations": 50}), resume=True, given=())] == ["iterations"]


def test_a_resume_holds_only_the_fields_given_against_the_run(tmp_path, capsys):
    """A run started with --set learning_rate=1e-5 was refused on `--config tiny --resume`:
    every field of the preset (its default learning rate among them) was held against the
    run, as if the user had given it. Now only the fields the command line gives are: --set's
    and a JSON file's keys; a preset's defaults are not the user's, and the run's config.json
    stays its config."""
    out = tmp_path / "run"
    started = ["--set", "device=cpu", "--set", "sigma=0.1", "--set", "learning_rate=1e-5"]
    assert main(["train", "--config", "tiny", *started, "--set", "iterations=1",
                 "--out", str(out), "--no-progress"]) == 0
    assert main(["train", "--config", "tiny", "--out", str(out), "--resume",
                 "--set", "iterations=2", "--no-progress"]) == 0, capsys.readouterr().err
    assert [json.loads(line)["iteration"]
            for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    saved = json.loads((out / "config.json").read_text())
    assert (saved["learning_rate"], saved["sigma"], saved["iterations"]) == (1e-5, 0.1, 2)
    capsys.readouterr()
    # a field the user does give, changed, is refused, naming it and the option that gave it
    assert main(["train", "--config", "tiny", "--out", str(out), "--resume",
                 "--set", "iterations=3", "--set", "learning_rate=2e-5"]) == 2
    err = capsys.readouterr().err
    assert "config field 'learning_rate': is 1e-05 in the run being resumed " \
           f"({out / 'config.json'}), given 2e-05 by --set: " in err
    assert "sigma" not in err  # the preset's 0.3 is not the user's
    # a JSON file's keys are the user's: its budget is taken, its fields held against the run
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"iterations": 3, "sigma": 0.1}))
    assert RunDirectory.run_problems(out, load_config(str(partial), {"device": "cpu"}), True,
                                     given={"iterations", "sigma", "device"}) == []
    partial.write_text(json.dumps({"iterations": 3, "sigma": 0.2}))
    assert main(["train", "--config", str(partial), "--out", str(out), "--resume"]) == 2
    assert f"config field 'sigma': is 0.1 in the run being resumed ({out / 'config.json'}), " \
           f"given 0.2 by --config {partial}: " in capsys.readouterr().err


def test_a_relative_path_saved_before_paths_were_absolute_is_the_same_path(tmp_path,
                                                                           monkeypatch):
    # runs saved before the CLI stored paths absolute hold them as typed; retyping the same
    # relative path from the same directory (the CLI makes it absolute) is no change
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base.safetensors").write_bytes(b"")
    out = tmp_path / "run"
    _saved_run(out, iterations=3, base_checkpoint="base.safetensors")
    same = load_config("tiny", {"iterations": 9,
                                "base_checkpoint": str(tmp_path / "base.safetensors")})
    given = {"iterations", "base_checkpoint"}
    assert RunDirectory.run_problems(out, same, resume=True, given=given) == []
    other = load_config("tiny", {"iterations": 9,
                                 "base_checkpoint": str(tmp_path / "other.safetensors")})
    assert [e.field for e in RunDirectory.run_problems(out, other, resume=True,
                                                       given=given)] == ["base_checkpoint"]


def test_the_demo_takes_the_next_free_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _fresh_run_directory("runs/demo") == "runs/demo"
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    assert _fresh_run_directory("runs/demo") == "runs/demo"  # empty: free
    (tmp_path / "runs" / "demo" / "metrics.jsonl").write_text("")
    assert _fresh_run_directory("runs/demo") == "runs/demo-2"


def test_a_resume_takes_smaller_micro_batches(tmp_path, capsys):
    """`--set rollout_batch_size=2 --set train_batch_size=1` on --resume was refused ("only
    iterations, device can change"), though batching never changes the results: a run that
    ran out of memory could not go on with smaller batches."""
    out = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--set", "device=cpu", "--set", "iterations=1",
                 "--out", str(out), "--no-progress"]) == 0
    assert main(["train", "--config", "tiny", "--out", str(out), "--resume", "--set",
                 "iterations=2", "--set", "rollout_batch_size=2", "--set",
                 "train_batch_size=1", "--set", "torch_compile=false", "--no-progress"]) == 0, \
        capsys.readouterr().err
    saved = json.loads((out / "config.json").read_text())
    assert (saved["rollout_batch_size"], saved["train_batch_size"]) == (2, 1)
    assert [json.loads(line)["iteration"]
            for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_resume_follows_its_model_directory_to_a_new_place(tmp_path, tiny_flux_path,
                                                              capsys):
    """`--resume --set model_path=/new/place` was refused ("is '/old' in the run being
    resumed"): a run whose model directory moved could not go on. The new directory must
    hold the run's model (the same transformer config.json)."""
    import shutil

    old = shutil.copytree(tiny_flux_path, tmp_path / "old")
    fields = {"model": "flux", "model_path": str(old), "finetune": "lora", "lora_rank": 4,
              "resolution": 32, "prompts": ["a red apple"], "device": "cpu",
              "reward_weights": {"jpeg_compressibility": 1.0}}
    out = tmp_path / "run"
    _saved_run(out, iterations=3, **fields)
    given = {"iterations", "model_path"}
    # another transformer than the old directory's is refused, by name
    other = shutil.copytree(old, tmp_path / "other")
    transformer = json.loads((other / "transformer" / "config.json").read_text())
    (other / "transformer" / "config.json").write_text(
        json.dumps({**transformer, "num_layers": transformer["num_layers"] + 1}))
    config = load_config("tiny", {**fields, "iterations": 9, "model_path": str(other)})
    problems = RunDirectory.run_problems(out, config, resume=True, given=given)
    assert [e.field for e in problems] == ["model_path"]
    assert "holds another flux transformer than the run's" in problems[0].message
    assert "differs in num_layers" in problems[0].message
    # another model's directory is named as such, not by a dozen config differences
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "StableDiffusion3Pipeline"}))
    problems = RunDirectory.run_problems(out, config, resume=True, given=given)
    assert [(e.field, e.message) for e in problems] == [("model_path", (
        f"{other} holds a 'sd3' model (its model_index.json), not the run's 'flux'; a resumed "
        "run moves to a directory of the same model only"))]
    # and the command says it once (the model directory check said it again)
    from trainer.cli import main

    assert main(["train", "--out", str(out), "--resume", "--set", "iterations=9", "--set",
                 f"model_path={other}"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert [line for line in errors if "model_path" in line] == [
        f"error: config field 'model_path': {problems[0].message}"], errors
    # the same model, moved: taken
    moved = old.rename(tmp_path / "new")
    config = load_config("tiny", {**fields, "iterations": 9, "model_path": str(moved)})
    assert RunDirectory.run_problems(out, config, resume=True, given=given) == []
    assert RunDirectory.run_config(out, config, True, given=given).model_path == str(moved)


def test_a_resume_that_changes_the_method_names_the_method_not_the_runs_own_fields(
        tmp_path, capsys):
    """`--method sde` on a run trained with sigma 0.1: the merged config did not parse
    ("sigma: applies only to method 'neighbor'", a field this command never gave), so the
    refusal of the change itself, and the other changes given with it, went unsaid."""
    out = tmp_path / "run"
    _saved_run(out, iterations=3, sigma=0.1)
    before = _tree(out)
    assert main(["train", "--out", str(out), "--resume", "--set", "iterations=5",
                 "--method", "sde", "--set", "learning_rate=2e-5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("error: config field 'learning_rate': is ")
    assert err[1].startswith("error: config field 'method': is 'neighbor' in the run being "
                             "resumed") and "given 'sde' by --method" in err[1]
    assert not any("sigma" in line for line in err)
    assert _tree(out) == before
    # a problem of a field the command gave is still said beside them
    assert main(["train", "--out", str(out), "--resume", "--method", "sde",
                 "--set", "iterations=-1"]) == 2
    err = capsys.readouterr().err
    assert "config field 'method'" in err and "config field 'iterations'" in err
