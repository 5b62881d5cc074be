"""`train`'s weights files, `--resume` and `--out` on the command line: a file that is no
weights (or a truncated one) is a one-line config error naming its field, said with the other
config problems before anything is written; a resume needs a run and an undamaged newest
checkpoint; train-base and demo refuse a taken --out in their own words; flags are named as
flags. Each test stops before training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import cli_errors
from safetensors.torch import save_file

from trainer.cli import build_parser, main, train_config_of
from trainer.config import ConfigError, load_config
from trainer.run_dir import RunDirectory


@pytest.fixture
def preference_file(tmp_path: Path) -> Path:
    from trainer.rewards.fit_config import FitConfig
    from trainer.rewards.preference import PreferenceModel

    path = tmp_path / "pref.safetensors"
    PreferenceModel(FitConfig(ensemble=1, width=8)).save(path)
    return path


def _truncated_safetensors(path: Path) -> Path:
    import torch

    # a shapes model cut short, as a copy or download stopped part way leaves it
    save_file({"weight": torch.zeros(64)}, str(path), metadata={"format": "shapes-dit"})
    path.write_bytes(path.read_bytes()[:-40])
    return path


def test_a_base_checkpoint_that_is_no_weights_file_is_named_with_the_other_problems(
        tmp_path: Path, preference_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "prompts.txt"
    text.write_text("one red circle\n")
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    out = tmp_path / "run"
    cases = {text: "not a safetensors file", empty: "not a safetensors file (too short)",
             _truncated_safetensors(tmp_path / "cut.safetensors"): "is truncated",
             tmp_path / "missing.safetensors": "is not a file",
             preference_file: "is not a 'shapes-dit' weights file (its format is "
                              "'preference-model')"}
    for path, why in cases.items():
        lines = cli_errors(["train", "--config", "tiny", "--set", "sigma=3", "--set",
                            f"base_checkpoint={path}", "--out", str(out)], capsys)
        # one batch: the bad sigma and the file, each on its line
        assert [line.split(":")[0] for line in lines] == ["error"] * 2
        assert "config field 'sigma'" in lines[0]
        assert lines[1].startswith(f"error: config field 'base_checkpoint': {path}"), lines
        assert why in lines[1]
        assert len(lines[1]) < 400  # not the preference model's whole metadata
        assert not out.exists()
    # alone (a valid config otherwise), the same line
    lines = cli_errors(["train", "--config", "tiny", "--set", f"base_checkpoint={text}",
                        "--out", str(out)], capsys)
    assert lines == [f"error: config field 'base_checkpoint': {text}: not a safetensors file "
                     "(header size out of range)"]
    assert not out.exists()


def test_a_diffusers_model_directory_given_as_a_checkpoint_says_where_it_goes(
        sd3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model directory (save_pretrained's) as sample's or evaluate's --checkpoint, or as
    train's base_checkpoint, passed for a full fine-tune's checkpoint (its transformer's
    weights file) of the shapes model: "is a checkpoint of model 'shapes'", or a missing
    model.safetensors. It is named as a model directory, with the option that takes it."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("one red circle\n")
    out = tmp_path / "out"
    said = (f"{sd3} is a diffusers 'sd3' model directory (it holds model_index.json), not a "
            "checkpoint of a run: give it as ")
    for argv in (["sample", "--checkpoint", str(sd3), "--prompts", str(prompts), "--out",
                  str(out)],
                 ["evaluate", "--checkpoint", str(sd3), "--model", "sd3", "--model-path",
                  str(sd3), "--prompts-file", str(prompts)]):
        lines = cli_errors(argv, capsys)
        assert lines[0].startswith(f"error: --checkpoint: {said}--model-path (with --model "
                                   "'sd3'); --checkpoint is a checkpoint of a run"), lines
        assert not any("shapes" in line for line in lines), lines
    weights = sd3 / "transformer" / "diffusion_pytorch_model.safetensors"
    lines = cli_errors(["evaluate", "--checkpoint", str(weights)], capsys)
    assert lines == [f"error: --checkpoint: {sd3} is a diffusers 'sd3' model directory (it "
                     f"holds model_index.json; {weights} is a file inside it), not a "
                     "checkpoint of a run: give it as --model-path (with --model 'sd3'); "
                     "--checkpoint is a checkpoint of a run (its checkpoints/iter-N "
                     "directory) or a LoRA file, left out for the base model alone"]
    base = (f"error: config field 'base_checkpoint': {said}model_path (with model 'sd3'); "
            "base_checkpoint is an earlier run's checkpoint, or left empty to start from the "
            "base model")
    for model in (["--config", "tiny"], ["--set", "model=sd3", "--set", f"model_path={sd3}",
                                         "--set", "resolution=64", "--prompts-file",
                                         str(prompts)]):
        lines = cli_errors(["train", *model, "--set", f"base_checkpoint={sd3}", "--out",
                            str(out)], capsys)
        assert lines == [base], lines
    assert not out.exists()


def _edited_copy(source: Path, model: Path, folder: str, key: str, value: int) -> Path:
    """A copy of the model directory `source` at `model`, its `folder`'s config.json with
    `key` set to `value` (the weights left as they were)."""
    import shutil

    shutil.copytree(source, model)
    config = model / folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), key: value}))
    return model


def _sample_refusal(model: Path, name: str, tmp_path: Path,
                    capsys: pytest.CaptureFixture[str]) -> tuple[str, Path]:
    """`sample` of the model directory `model` refused (exit 2, no traceback): its last error
    line and the --out it was given."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("one red circle\n")
    out = tmp_path / "out"
    code = main(["sample", "--model", name, "--model-path", str(model), "--resolution", "64",
                 "--prompts", str(prompts), "--seeds", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1], out


@pytest.mark.parametrize("folder, key, value, gist", [
    # diffusers' ValueError named neither the directory nor the folder ("Cannot load  because")
    ("transformer", "num_layers", 2, "transformer_blocks.0.norm1_context.linear.bias expected "
                                     "shape torch.Size([96]), but got torch.Size([32])"),
    # transformers' RuntimeError came as a traceback
    ("text_encoder", "hidden_size", 64, "tensors of other shapes than the config's"),
])
def test_a_model_directory_whose_weights_do_not_match_its_config_is_one_line(
        folder: str, key: str, value: int, gist: str, sd3: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A config.json edited to another size than its folder's weights: one error naming the
    directory, the folder and the loader's words, exit 2, nothing written."""
    model = _edited_copy(sd3, tmp_path / "sd3", folder, key, value)
    line, out = _sample_refusal(model, "sd3", tmp_path, capsys)
    assert line.startswith(f"error: model directory {model}: the weights in {folder}/ do not "
                           f"match {folder}/config.json ("), line
    assert gist in line and "restore the folder's config.json and weights" in line, line
    assert not out.exists()


@pytest.mark.parametrize("key, value, said", [
    # a layer more than the weights hold: diffusers started it random, with a logged warning
    ("num_layers", 2, "(32 tensors it builds are not in the weights and would start random, "
                      "e.g. transformer_blocks.1."),
    # a layer fewer: the weights of the one left out were dropped, with a logged warning
    ("num_single_layers", 0, "(the weights hold 14 tensors it has no place for, "
                             "e.g. single_transformer_blocks.0."),
])
def test_a_model_directory_whose_config_has_another_layer_count_is_refused(
        key: str, value: int, said: str, tiny_flux_path: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A config.json edited to another layer count than its weights (no tensor of another
    shape, so no loader error): the load is refused in one line naming the directory, the
    folder and what would have been random or dropped, nothing written."""
    model = _edited_copy(tiny_flux_path, tmp_path / "flux", "transformer", key, value)
    line, out = _sample_refusal(model, "flux", tmp_path, capsys)
    assert line.startswith(f"error: model directory {model}: the weights in transformer/ do "
                           "not match transformer/config.json ("), line
    assert said in line and "restore the folder's config.json and weights" in line, line
    assert not out.exists()


def test_a_layer_count_refusal_keeps_warnings_the_user_silenced_silent(
        tiny_flux_path: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Under DIFFUSERS_VERBOSITY=error the refusal is the one thing said (diffusers' warning
    it is read from stays off the terminal), and diffusers' logger is left as it was."""
    import logging

    from diffusers.utils import logging as diffusers_logging

    from trainer.models import ModelSpec, load_flow_model

    model = _edited_copy(tiny_flux_path, tmp_path / "flux", "transformer", "num_layers", 2)
    logger = logging.getLogger("diffusers.models.modeling_utils")
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    before = (logger.level, logger.propagate, list(logger.handlers))
    try:
        with pytest.raises(ValueError, match="would start random"):
            load_flow_model(ModelSpec("flux", path=str(model), resolution=64), device="cpu")
        after = (logger.level, logger.propagate, list(logger.handlers))
    finally:
        diffusers_logging.set_verbosity(verbosity)
    assert "Some weights" not in capfd.readouterr().err
    assert after == before


def test_a_preference_model_that_is_no_preference_model_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text("no weights here\n")
    out = tmp_path / "run"
    lines = cli_errors(["train", "--config", "tiny", "--set",
                        'reward_weights={"count": 1, "preference": 1}', "--set",
                        f"preference_model={text}", "--out", str(out)], capsys)
    assert lines == [f"error: config field 'preference_model': {text}: not a safetensors "
                     "file (header size out of range)"]
    base = tmp_path / "base.safetensors"
    save_file({}, str(base), metadata={"format": "shapes-dit"})
    lines = cli_errors(["train", "--config", "tiny", "--set",
                        'reward_weights={"count": 1, "preference": 1}', "--set",
                        f"preference_model={base}", "--out", str(out)], capsys)
    assert lines == [f"error: config field 'preference_model': {base} is not a "
                     "'preference-model' weights file (its format is 'shapes-dit')"]
    assert not out.exists()


def test_a_preference_model_without_a_preference_weight_is_refused_with_the_other_problems(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--set preference_model=...` with no 'preference' in reward_weights was stored and
    never read (the run trained on the other rewards alone, exit 0); the studio refuses it.
    Said with the config's other problems, from --set or a config file."""
    out = tmp_path / "run"
    why = ("names a preference model, but reward_weights has no 'preference' weight to blend "
           "it with: add one (e.g. \"preference\": 1) or leave preference_model empty")
    lines = cli_errors(["train", "--config", "tiny", "--set", "preference_model=p.safetensors",
                        "--out", str(out)], capsys)
    assert lines == [f"error: config field 'preference_model': {why}"]
    lines = cli_errors(["train", "--config", "tiny", "--set", "preference_model=p.safetensors",
                        "--set", "sigma=9", "--out", str(out)], capsys)
    assert [line.split(":")[1].strip() for line in lines] == [
        "config field 'sigma'", "config field 'preference_model'"], lines
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"preference_model": "p.safetensors",
                                  "reward_weights": {"count": 1}}))
    lines = cli_errors(["train", "--config", str(config), "--set", "iterations=0",
                        "--out", str(out)], capsys)
    assert [line.split(":")[1].strip() for line in lines] == [
        "config field 'iterations'", "config field 'preference_model'"], lines
    assert not out.exists()


def test_a_relative_preference_model_is_stored_absolute_and_the_same_file_is_no_change(
        tmp_path: Path, preference_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    argv = ["train", "--config", "tiny", "--set", 'reward_weights={"count": 1, '
            '"preference": 1}', "--set", f"preference_model={preference_file.name}",
            "--out", str(out)]
    config = train_config_of(build_parser().parse_args(argv))
    # config.json then finds it from any directory a --resume runs in
    assert config.preference_model == str(preference_file)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    link = elsewhere / "same.safetensors"
    link.symlink_to(preference_file)
    given = {"iterations", "preference_model"}
    for spelling in ("../pref.safetensors", str(link), str(preference_file)):
        resumed = load_config("tiny", {**config.to_dict(), "iterations": 9,
                                       "preference_model": spelling})
        assert RunDirectory.run_problems(out, resumed, resume=True, given=given) == [], spelling
    other = tmp_path / "other.safetensors"
    other.write_bytes(preference_file.read_bytes())  # a copy is another file
    resumed = load_config("tiny", {**config.to_dict(), "iterations": 9,
                                   "preference_model": str(other)})
    assert [e.field for e in RunDirectory.run_problems(out, resumed, resume=True,
                                                       given=given)] == ["preference_model"]


def _run_with_checkpoint(out: Path, iterations: int = 1) -> Path:
    """A run directory as train leaves it, with a whole (small) newest checkpoint; no
    training: the checks read the files' headers only."""
    import torch

    out.mkdir()
    config = load_config("tiny", {"iterations": iterations, "device": "cpu"})
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    (out / "metrics.jsonl").write_text("")
    checkpoint = out / "checkpoints" / f"iter-{iterations:06d}"
    checkpoint.mkdir(parents=True)
    save_file({"w": torch.zeros(8)}, str(checkpoint / "model.safetensors"),
              metadata={"format": "shapes-dit"})
    save_file({"rng_state": torch.zeros(8, dtype=torch.uint8)},
              str(checkpoint / "trainer_state.safetensors"),
              metadata={"iteration": str(iterations), "optimizer": "{}"})
    return checkpoint


def _tree(path: Path) -> list[tuple[str, int]]:
    return sorted((p.relative_to(path).as_posix(), p.stat().st_size) for p in path.rglob("*"))


def test_a_resume_from_a_damaged_checkpoint_names_the_file_and_the_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    checkpoint = _run_with_checkpoint(out)
    state = checkpoint / "trainer_state.safetensors"
    state.write_bytes(state.read_bytes()[:-5])
    before = _tree(out)
    lines = cli_errors(["train", "--resume", "--out", str(out), "--set", "iterations=4",
                        "--no-progress"], capsys)
    assert len(lines) == 1 and lines[0].startswith(
        f"error: --resume: the newest checkpoint, iter-000001, is damaged: {state} is "
        "truncated: its header describes"), lines
    assert f"delete {checkpoint} to resume from the checkpoint before it" in lines[0]
    assert _tree(out) == before  # nothing written, metrics and config.json included
    state.write_bytes(b"")
    lines = cli_errors(["train", "--resume", "--out", str(out), "--set", "iterations=4"],
                       capsys)
    assert lines[0].startswith("error: --resume: the newest checkpoint, iter-000001, is "
                               f"damaged: {state} is empty;")


@pytest.mark.parametrize("damage", ["state removed", "emptied"])
def test_a_resume_names_a_newest_checkpoint_missing_its_trainer_state(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    """A checkpoint is written whole (beside, then renamed), so an iter-N directory without its
    trainer state was damaged after. The resume passed over it to the one before without a
    word and then wrote over it; it is refused, naming it, and nothing is written."""
    out = tmp_path / "run"
    checkpoint = _run_with_checkpoint(out)
    state = checkpoint / "trainer_state.safetensors"
    for path in ([state] if damage == "state removed" else
                 sorted(checkpoint.rglob("*"), reverse=True)):
        path.unlink() if path.is_file() else path.rmdir()
    before = _tree(out)
    lines = cli_errors(["train", "--resume", "--out", str(out), "--set", "iterations=4",
                        "--no-progress"], capsys)
    assert lines == [f"error: --resume: the newest checkpoint, {checkpoint.name}, is damaged: "
                     f"{state} is missing; delete {checkpoint} to resume from the checkpoint "
                     "before it (or from the start when there is none)"], lines
    assert _tree(out) == before


@pytest.mark.parametrize(("saved", "why"), [
    ("{not json", "Expecting property name"),
    ("[1, 2]", "config: must be a JSON object"),
    ({"old_field": 1}, "old_field: unknown field")])
def test_a_resume_names_a_saved_config_that_cannot_be_the_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], saved, why: str) -> None:
    """An edited or damaged config.json said "Expecting property name ...", or named a field
    (`config`, `old_field`) the command line never gave. It names the file and --resume, with
    a bad --set beside it, and nothing is written."""
    out = tmp_path / "run"
    _run_with_checkpoint(out)
    config = out / "config.json"
    if isinstance(saved, dict):
        saved = json.dumps({**json.loads(config.read_text()), **saved})
    config.write_text(saved)
    before = _tree(out)
    lines = cli_errors(["train", "--resume", "--out", str(out), "--set", "iterations=4",
                        "--set", "sigma=7"], capsys)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"error: --resume: {config}, the config of the run being "
                               f"resumed, cannot be read ({why}"), lines
    assert lines[1].startswith("error: config field 'sigma': must be in [0.0, 1.0]"), lines
    assert _tree(out) == before


def test_a_preset_given_on_resume_is_said_to_be_not_applied(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`train --config shapes-benchmark --resume` went on with the run's saved config without a
    word, as if the preset's settings were now in force; it says so once the resume passes
    its checks (a refused resume prints its errors alone)."""
    out = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--set", "iterations=1", "--out", str(out),
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", "--config", "shapes-benchmark", "--set", "iterations=2", "--resume",
                 "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert (f"note: --config shapes-benchmark is not applied on --resume: the run goes on with "
            f"its saved {out / 'config.json'}") in err, err
    assert json.loads((out / "config.json").read_text())["prompts_per_iteration"] == \
        load_config("tiny").prompts_per_iteration  # the saved run's, not the preset's
    assert main(["train", "--resume", "--set", "iterations=3", "--out", str(out),
                 "--no-progress"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_a_resume_turning_checkpointing_off_drops_the_saved_fraction(tmp_path: Path) -> None:
    """`train --resume --set gradient_checkpointing=false` of a run begun from flux-lora was
    refused over the saved gradient_checkpointing_fraction 0.25, a value this command did not
    give; a fraction given beside it is still held to the rule."""
    out = tmp_path / "run"
    out.mkdir()
    saved = load_config("flux-lora", {"model_path": str(tmp_path / "flux"), "prompts": ["a"]})
    assert saved.gradient_checkpointing and saved.gradient_checkpointing_fraction == 0.25
    (out / "config.json").write_text(json.dumps(saved.to_dict()))

    def config_of(*sets: str):
        argv = ["train", "--resume", "--out", str(out)]
        for pair in sets:
            argv += ["--set", pair]
        return train_config_of(build_parser().parse_args(argv))

    config = config_of("gradient_checkpointing=false")
    assert not config.gradient_checkpointing and config.gradient_checkpointing_fraction == 1.0
    assert config.lora_rank == saved.lora_rank  # the rest is the run's
    assert config_of().gradient_checkpointing_fraction == 0.25  # left on: the run's share
    with pytest.raises(ConfigError, match="gradient_checkpointing_fraction"):
        config_of("gradient_checkpointing=false", "gradient_checkpointing_fraction=0.5")


def test_load_checkpoint_names_a_damaged_file_instead_of_safetensors_error(
        tmp_path: Path) -> None:
    from trainer.loop import Trainer, checkpoint_files_problem

    checkpoint = _run_with_checkpoint(tmp_path / "run")
    assert checkpoint_files_problem(checkpoint) is None
    state = checkpoint / "trainer_state.safetensors"
    state.write_bytes(state.read_bytes()[:20])
    assert f"{state}" in checkpoint_files_problem(checkpoint)
    trainer = Trainer.__new__(Trainer)  # the check comes first: no model needed
    with pytest.raises(ValueError, match=f"checkpoint {checkpoint} is damaged: "):
        trainer.load_checkpoint(checkpoint)


def test_a_resume_where_there_is_no_run_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nothing"
    lines = cli_errors(["train", "--config", "tiny", "--out", str(out), "--resume"], capsys)
    assert lines == [f"error: --resume: {out} holds no run to continue (it does not exist); "
                     "leave --resume out to start one"]
    assert not out.exists()
    out.mkdir()
    lines = cli_errors(["train", "--config", "tiny", "--out", str(out), "--resume"], capsys)
    assert lines == [f"error: --resume: {out} holds no run to continue (no config.json); "
                     "leave --resume out to start one"]
    assert list(out.iterdir()) == []
    # a run interrupted inside its first iteration (config.json, no checkpoint) starts again
    config = load_config("tiny", {})
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    assert RunDirectory.run_problems(out, config, resume=True, given=()) == []


@pytest.mark.parametrize("files", [["base.safetensors", "train_base_log.jsonl"],
                                   ["base-step1000.safetensors"]])
def test_train_base_refuses_an_out_that_holds_an_earlier_run(
        files: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "base"
    out.mkdir()
    for name in files:
        (out / name).write_text("earlier run\n")
    lines = cli_errors(["train-base", "--out", str(out), "--steps", "1", "--batch-size", "2",
                        "--pool-size", "0", "--width", "8", "--depth", "1", "--device", "cpu"],
                       capsys)
    assert lines == [f"error: --out: {out} holds an earlier train-base run "
                     f"({', '.join(sorted(files))}); give a new --out, or delete it to train "
                     "there again"]
    assert sorted(os.listdir(out)) == sorted(files)
    assert all((out / name).read_text() == "earlier run\n" for name in files)


def test_out_and_prompts_file_are_named_as_the_flags_they_are(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one red circle\n")
    for argv in (["train", "--config", "tiny"], ["sample", "--prompts", str(prompts)],
                 ["train-base"], ["demo"]):
        assert cli_errors([*argv, "--out", str(taken)], capsys) == [
            f"error: --out: {taken} is an existing file, not a directory"], argv
    assert cli_errors(["fit-preference", "--votes", str(prompts), "--out", str(tmp_path)],
                      capsys)[0] == f"error: --out: {tmp_path} is an existing directory, not a file"
    dragons = tmp_path / "dragons.txt"
    dragons.write_text("a purple dragon\n")
    lines = cli_errors(["train", "--config", "tiny", "--prompts-file", str(dragons), "--out",
                        str(tmp_path / "run")], capsys)
    assert lines[0].startswith("error: --prompts-file: model 'shapes' draws only shapes prompts")


def test_demo_on_a_taken_out_says_what_demo_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    out.mkdir()
    (out / "config.json").write_text("{}")
    lines = cli_errors(["demo", "--out", str(out)], capsys)
    assert len(lines) == 1 and "--resume continues it" not in lines[0]
    assert lines[0] == (f"error: --out: {out} holds an earlier run (config.json); demo starts "
                        "a new run each time: give a new --out, or leave --out out (runs/demo, "
                        f"then runs/demo-2, -3 ...); `train --out {out} --resume` continues "
                        "that one")


def test_a_resume_onto_another_networks_checkpoint_is_one_line_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A newest checkpoint of another network (a run from a narrower train-base base, copied
    in) stopped the resume with torch's size-mismatch traceback."""
    import shutil

    small = tmp_path / "small"
    assert main(["train-base", "--out", str(small), "--steps", "1", "--batch-size", "2",
                 "--pool-size", "0", "--width", "8", "--depth", "1", "--device", "cpu"]) == 0
    other, run = tmp_path / "other", tmp_path / "run"
    tiny = ["--config", "tiny", "--set", "iterations=1", "--set", "device=cpu", "--no-progress"]
    assert main(["train", *tiny, "--set", f"base_checkpoint={small / 'base.safetensors'}",
                 "--out", str(other)]) == 0
    assert main(["train", *tiny, "--out", str(run)]) == 0
    foreign = run / "checkpoints" / "iter-000002"
    shutil.copytree(other / "checkpoints" / "iter-000001", foreign)
    capsys.readouterr()
    before = _tree(run)
    lines = cli_errors(["train", "--resume", "--out", str(run), "--set", "iterations=3",
                        "--no-progress"], capsys)
    assert len(lines) == 1 and lines[0].startswith(
        f"error: checkpoint {foreign} does not fit this run's model"), lines
    assert "delete it to resume from the checkpoint before it" in lines[0]
    assert _tree(run) == before


def test_a_config_files_relative_paths_are_stored_absolute_as_sets_are(
        tmp_path: Path, preference_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON --config file's preference_model (model_path, base_checkpoint alike) was saved
    as typed: `--resume` and `sample --checkpoint` from another directory could not find it.
    Relative to the directory the command runs in, as --set's paths."""
    monkeypatch.chdir(tmp_path)
    config_file = tmp_path / "cfg" / "c.json"
    config_file.parent.mkdir()
    config_file.write_text(json.dumps({
        "reward_weights": {"count": 1, "preference": 1},
        "preference_model": preference_file.name, "iterations": 2}))
    config = train_config_of(build_parser().parse_args(
        ["train", "--config", str(config_file), "--out", str(tmp_path / "run")]))
    assert config.preference_model == str(preference_file) and config.iterations == 2
