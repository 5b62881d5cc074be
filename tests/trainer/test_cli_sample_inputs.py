"""`sample` and `evaluate`'s inputs and outputs: an interrupted sample keeps nothing half-written,
--seeds and --steps are bounded, and a bad prompts, votes or --set input is named in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer import cli
from trainer.cli import MAX_SEEDS, MAX_SOLVER_STEPS, build_parser, main


def _errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """main(argv) refuses with exit code 2 and no traceback; its error lines."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal (a type= check)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return [line for line in err.strip().splitlines() if line.startswith("error: ")
            or ": error: " in line]


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "p.txt"
    path.write_text("one red circle\ntwo blue squares\n")
    return path


def _sample(prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["sample", "--prompts", str(prompts), "--seeds", "2", "--steps", "1", "--device",
            "cpu", "--out", str(out), *extra]


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Ctrl-C as the (n+1)th PNG is written."""
    real = cli._save_png
    written = []

    def save(image, path: Path) -> None:
        if len(written) == n:
            raise KeyboardInterrupt
        written.append(path)
        real(image, path)

    monkeypatch.setattr(cli, "_save_png", save)


@pytest.mark.parametrize("existing", [False, True])
def test_an_interrupted_sample_keeps_nothing_and_runs_again(
        tmp_path: Path, prompts: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], existing: bool) -> None:
    """Ctrl-C while sample wrote its PNGs left 381 of 960 and a 381-line manifest.jsonl, and
    the same command was then refused ("holds an earlier sample")."""
    out = tmp_path / "runs" / "o"
    if existing:  # an empty --out the user made stays, empty
        out.mkdir(parents=True)
    _interrupt_after(monkeypatch, 3)
    assert main(_sample(prompts, out)) == 130
    err = capsys.readouterr().err
    assert "interrupted after 3 of 4 images: nothing was kept" in err, err
    assert ("left as it was" if existing else "not created") in err, err
    if existing:
        assert list(out.iterdir()) == []
    else:
        assert not (tmp_path / "runs").exists()  # not even --out's parent was made
    assert [p.name for p in tmp_path.rglob(".*partial*")] == []  # the staging is gone too
    monkeypatch.undo()
    assert main(_sample(prompts, out)) == 0
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["seed"]) for r in manifest] == [
        ("one red circle", 0), ("one red circle", 1), ("two blue squares", 0),
        ("two blue squares", 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [r["file"] for r in manifest] + ["manifest.jsonl"])


def test_a_sample_killed_outright_is_cleaned_up_by_the_next_run(
        tmp_path: Path, prompts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL runs no handler: the hidden staging directory stayed beside --out for good.
    The next sample into the same --out removes those of this host whose process is gone,
    and leaves one whose process still runs (another sample writing) alone."""
    import subprocess
    import sys

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "o"
        prefix = cli._staging_prefix("o")
        abandoned = tmp_path / f"{prefix}{killed.pid}-0badf00d"
        in_use = tmp_path / f"{prefix}{running.pid}-0000beef"
        other = tmp_path / f".other.partial-x-{killed.pid}-1"  # another --out's: not ours
        for path in (abandoned, in_use, other):
            path.mkdir()
            (path / "000000.png").write_bytes(b"half")
        assert main(_sample(prompts, out)) == 0
        err = capsys.readouterr().err
        assert "removed 1 unfinished sample directory of an earlier run that was killed" in err
        assert not abandoned.exists() and in_use.is_dir() and other.is_dir()
        assert len(list(out.glob("*.png"))) == 4
    finally:
        running.kill()
        running.wait()


def test_sample_holds_one_batch_of_images_at_a_time(
        tmp_path: Path, prompts: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every image was sampled before the first was written: memory grew with --seeds."""
    from trainer import evaluation

    real, sizes = evaluation.sample_images, []

    def counting(model, prompt_list, seeds, *args, **kwargs):
        sizes.append(len(prompt_list))
        return real(model, prompt_list, seeds, *args, **kwargs)

    monkeypatch.setattr(evaluation, "sample_images", counting)
    assert main(_sample(prompts, tmp_path / "o", "--seeds", "3", "--batch-size", "4")) == 0
    assert sizes == [4, 2]
    assert len((tmp_path / "o" / "manifest.jsonl").read_text().splitlines()) == 6


@pytest.mark.parametrize("command", ["sample", "evaluate"])
@pytest.mark.parametrize(("flag", "limit"), [("--seeds", MAX_SEEDS),
                                             ("--steps", MAX_SOLVER_STEPS)])
def test_seeds_and_steps_have_an_upper_bound(command: str, flag: str, limit: int,
                                             prompts: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`--seeds 100000000` was killed for memory at 23 GB; `--steps 100000` ran on."""
    extra = ["--prompts", str(prompts), "--out", str(tmp_path / "o")] \
        if command == "sample" else []
    lines = _errors([command, flag, str(limit + 1), *extra], capsys)
    assert f"argument {flag}: must be an integer in [1, {limit}]" in lines[-1], lines
    assert getattr(build_parser().parse_args([command, flag, str(limit), *extra]),
                   flag[2:]) == limit
    assert not (tmp_path / "o").exists()


def test_the_bounds_are_the_configs_and_the_evaluate_jobs() -> None:
    import dataclasses

    from app.job_kinds import EvaluateConfig
    from trainer.config import TrainConfig

    rollout = next(f for f in dataclasses.fields(TrainConfig) if f.name == "rollout_steps")
    assert MAX_SOLVER_STEPS == rollout.metadata["max"] == 1000
    seeds = EvaluateConfig.model_fields["seeds"].metadata
    assert MAX_SEEDS in [getattr(m, "max_length", None) for m in seeds]


def test_a_directory_given_as_the_prompts_file_is_said_to_be_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _errors(["sample", "--prompts", str(tmp_path), "--out", str(tmp_path / "o")], capsys)
    assert lines == [f"error: --prompts: {tmp_path} is a directory, not a file: give the "
                     "prompts file in it (.txt, .jsonl or .json)"]
    lines = _errors(["train", "--config", "tiny", "--prompts-file", str(tmp_path), "--out",
                     str(tmp_path / "run")], capsys)
    assert lines == [f"error: --prompts-file: {tmp_path} is a directory, not a file: give "
                     "the prompts file in it (.txt, .jsonl or .json)"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl", "p.json"])
def test_a_prompts_file_not_in_utf8_names_the_file_and_line(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was "--prompts-file: 'utf-8' codec can't decode byte 0xff in position 15"."""
    path = tmp_path / name
    first = {"p.txt": b"one red circle\n", "p.jsonl": b'{"prompt": "one red circle"}\n',
             "p.json": b'["one red circle",\n'}[name]
    path.write_bytes(first + b'"a \xff cat"\n')
    lines = _errors(["evaluate", "--prompts-file", str(path), "--device", "cpu"], capsys)
    assert lines == [f"error: --prompts-file: {path}: line 2: bad encoding (not UTF-8: byte "
                     f"0xff at offset {len(first) + 3})"]


def test_every_bad_line_of_a_jsonl_prompts_file_is_listed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only the first bad line was said ("weird.jsonl:1"): one fix, one run, per line."""
    path = tmp_path / "weird.jsonl"
    rows = [b"not json", b'{"text": "a cat"}', b'{"prompt": "one red circle"}', b"\xfe\xff",
            b'["a list"]'] + [b"{"] * 30
    path.write_bytes(b"\n".join(rows) + b"\n")
    lines = _errors(["sample", "--prompts", str(path), "--out", str(tmp_path / "o")], capsys)
    assert len(lines) == 1, lines
    listed = lines[0].removeprefix(f"error: --prompts: {path}: ").split("; ")
    assert listed[:4] == ["line 1: not JSON (Expecting value)",
                          'line 2: no "prompt" text field',
                          "line 4: bad encoding (not UTF-8: byte 0xfe at offset 56)",
                          'line 5: no "prompt" text field'], listed
    assert len(listed) == 21 and listed[-1] == "... and 14 more", listed


def test_a_votes_file_not_in_utf8_names_the_flag_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was "error: 'utf-8' codec can't decode byte ...", naming nothing."""
    votes = tmp_path / "votes.jsonl"
    votes.write_bytes(b'{"prompt": "a \xff"}\n')
    lines = _errors(["fit-preference", "--votes", str(votes), "--out",
                     str(tmp_path / "m.safetensors"), "--device", "cpu"], capsys)
    assert lines == [f"error: --votes {votes}: line 1: bad encoding (not UTF-8: byte 0xff at "
                     "offset 14)"]


@pytest.mark.parametrize("rewards", ["", " "])
def test_an_empty_rewards_list_is_refused(rewards: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`--rewards ""` (an unset shell variable) scored the default rewards instead."""
    lines = _errors(["evaluate", "--rewards", rewards, "--device", "cpu"], capsys)
    assert lines[0].startswith(f"error: --rewards: {rewards!r} names no reward; known: "), lines


@pytest.mark.parametrize("command", ["sample", "evaluate"])
def test_the_shapes_model_takes_no_model_path(command: str, tmp_path: Path, prompts: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """It was ignored: the user believed the directory's model had drawn the images."""
    extra = ["--prompts", str(prompts), "--out", str(tmp_path / "o")] \
        if command == "sample" else []
    lines = _errors([command, "--model-path", str(tmp_path), "--device", "cpu", *extra],
                    capsys)
    assert lines == ["error: --model-path: the shapes model takes no --model-path (its "
                     "weights are the checkpoint's or built in); it is for --model flux or "
                     "sd3"]


def test_set_with_no_key_or_an_unknown_key_says_what_to_give(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "run")
    assert _errors(["train", "--set", "=3", "--out", out], capsys) == [
        "error: --set =3: give KEY=VALUE (a config field's name, then its value as JSON or "
        "text)"]
    lines = _errors(["train", "--config", "tiny", "--set", "foo=1", "--out", out], capsys)
    assert len(lines) == 1 and lines[0].startswith(
        "error: config field 'foo': unknown field; the fields are model, "), lines
    assert "rollout_steps" in lines[0] and "learning_rate" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train", "fit-preference"])
def test_every_malformed_set_is_named_with_the_fields_problems(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first malformed --set stopped the command alone: the next run met the next one,
    and a bad field's value after them. Now all are named in one refusal."""
    field = "sigma=5" if command == "train" else "epochs=0"
    (tmp_path / "v.jsonl").write_text("")  # there: a missing one is named too
    args = (["train", "--config", "tiny"] if command == "train"
            else ["fit-preference", "--votes", str(tmp_path / "v.jsonl")])
    lines = _errors([*args, "--set", "=3", "--set", "foo", "--set", 'x={"a": 1, "a": 2}',
                     "--set", field, "--out", str(tmp_path / "o")], capsys)
    assert lines[:3] == [
        "error: --set =3: give KEY=VALUE (a config field's name, then its value as JSON or "
        "text)",
        "error: --set: 'foo': must look like key=value (a config field's name, then its value "
        "as JSON or text)",
        "error: --set: x=...: key 'a' given twice in one object (which value is meant?)"]
    assert len(lines) == 4 and f"'{field.split('=')[0]}'" in lines[3], lines
    assert not (tmp_path / "o").exists()


def test_every_option_argparse_refuses_is_said_at_once(prompts: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong --steps no longer hides a wrong --seeds and --guidance-scale behind it."""
    out = tmp_path / "o"
    lines = _errors(["sample", "--seeds", "0", "--steps", "0", "--guidance-scale", "500",
                     "--model", "dalle", "--prompts", str(prompts), "--out", str(out)], capsys)
    assert [line.split("error: argument ")[1].split(":")[0] for line in lines] == [
        "--seeds", "--steps", "--guidance-scale", "--model"], lines
    assert "must be a finite number in [0, 100]" in lines[2]
    assert not out.exists()


@pytest.mark.parametrize("command", ["sample", "evaluate"])
def test_a_checkpoint_given_twice_is_refused_not_dropped(command: str, prompts: Path,
                                                        tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """argparse kept the last --checkpoint: `evaluate --checkpoint A --checkpoint B` scored B
    alone and said nothing of A."""
    extra = ["--prompts", str(prompts), "--out", str(tmp_path / "o")] \
        if command == "sample" else ["--out", str(tmp_path / "e.json")]
    lines = _errors([command, "--checkpoint", "runs/a", "--checkpoint", "runs/b", *extra],
                    capsys)
    assert len(lines) == 1 and "argument --checkpoint: given more than once (runs/a, runs/b)" \
        in lines[0], lines
    assert not (tmp_path / "o").exists() and not (tmp_path / "e.json").exists()


def test_prompts_the_shapes_model_cannot_draw_are_named_with_the_flag_and_the_rest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """sample said "not a shapes prompt: 'a cat'" when the model loaded, after every other
    check had passed, naming neither --prompts nor the file, and the first bad prompt alone;
    evaluate likewise. Now each names its flag, the file and every bad prompt, beside the
    command's other problems."""
    cats = tmp_path / "cats.txt"
    cats.write_text("a cat\none red circle\na dog\nfive red circles\n")
    taken = tmp_path / "taken.txt"
    taken.write_text("x")
    said = (f"{cats}: model 'shapes' draws only shapes prompts ('<one..four> "
            "<red|green|blue|yellow> <circle|square|triangle>[s]'); 3 of 4 are not: 'a cat', "
            "'a dog', 'five red circles'")
    lines = _errors(["sample", "--prompts", str(cats), "--out", str(taken)], capsys)
    assert lines == [f"error: --out: {taken} is an existing file, not a directory",
                     f"error: --prompts: {said}"], lines
    lines = _errors(["evaluate", "--prompts-file", str(cats), "--seeds", "1",
                     "--rewards", "count,nope"], capsys)
    assert f"error: --prompts-file: {said}" in lines, lines
    assert any(line.startswith("error: --rewards: unknown reward(s) ['nope']")
               for line in lines), lines


def test_evaluate_says_every_reward_problem_and_the_device_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown reward hid a bad --reward-model-path and the missing weights until the next
    run, and a refused --device was said twice (by the command and by the reward loader)."""
    empty = tmp_path / "hps"
    empty.mkdir()
    lines = _errors(["evaluate", "--rewards", "hpsv2,nope", "--reward-model-path", "bad",
                     "--reward-model-path", f"hpsv2={empty}", "--device", "cuda:99"], capsys)
    assert sum(line.startswith("error: --device: ") for line in lines) == 1, lines
    assert any(line.startswith("error: --rewards: unknown reward(s) ['nope']")
               for line in lines), lines
    assert "error: --reward-model-path: must look like NAME=DIR, got 'bad'" in lines, lines
    assert any(line.startswith(f"error: reward 'hpsv2': weights directory '{empty}'")
               for line in lines), lines


def test_evaluate_names_missing_prompts_beside_a_bad_resolution(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`evaluate --model sd3 --resolution 500` without --prompts-file said the resolution, and
    the missing prompts only once it was fixed (the check waited for the model's spec)."""
    lines = _errors(["evaluate", "--model", "sd3", "--model-path", str(tmp_path),
                     "--resolution", "500", "--device", "cpu"], capsys)
    flags = [line.split(":")[1].strip() for line in lines]
    assert "--resolution" in flags and flags[-1] == "--prompts-file", lines
    assert "model 'sd3' is evaluated on prompts you give" in lines[-1]


def test_train_refuses_a_field_given_twice_two_ways(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`--set method=sde --method neighbor` trained neighbor, and `--set prompts=[...]` beside
    --prompts-file took the file, each without a word."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("one red circle\n")
    out = tmp_path / "run"
    lines = _errors(["train", "--config", "tiny", "--set", "method=sde", "--method", "neighbor",
                     "--set", 'prompts=["two blue squares"]', "--prompts-file", str(prompts),
                     "--out", str(out)], capsys)
    assert lines == ["error: --method: 'neighbor' contradicts --set method='sde': give one of "
                     "them", "error: --prompts-file: --set prompts=... gives the prompts too: "
                     "give one of them"], lines
    assert not out.exists()
    # the same value both ways is no contradiction
    config = cli.train_config_of(build_parser().parse_args(
        ["train", "--config", "tiny", "--set", "method=sde", "--method", "sde", "--out", str(out)]))
    assert config.method == "sde"


def test_sample_says_every_model_option_problem_at_once(
        prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--mixed-precision bf16, --resolution 64 and --model-path on the shapes model were said
    one a run, three runs for three problems."""
    lines = _errors(["sample", "--prompts", str(prompts), "--out", str(tmp_path / "s"),
                     "--model-path", str(tmp_path), "--mixed-precision", "bf16",
                     "--resolution", "64", "--device", "cpu"], capsys)
    assert [line.split(":")[1].strip() for line in lines] == [
        "--mixed-precision", "--resolution", "--model-path"], lines
    assert not (tmp_path / "s").exists()


def test_fit_preference_says_every_field_and_file_problem_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad field, an --out that is a directory, a missing votes file, images directory and
    warm-start model were said one a run: five runs for five problems."""
    lines = _errors(["fit-preference", "--votes", str(tmp_path / "nope.jsonl"), "--out",
                     str(tmp_path), "--images", str(tmp_path / "nodir"), "--warm-start",
                     str(tmp_path / "nofile"), "--set", "epochs=0", "--device", "cpu"], capsys)
    assert [line.split(":")[1].strip() for line in lines] == [
        "config field 'epochs'", "--out", "--votes", "--images",
        f"--warm-start {tmp_path / 'nofile'}"], lines
