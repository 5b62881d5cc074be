"""`python -m trainer fit-preference`: a preference model fitted from a votes file in the
studio's export format, outside the web app, and the errors a bad file or field gets."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from trainer.cli import main
from trainer.rewards.attributes import SimulatedAnnotator
from trainer.rewards.fit_config import fit_config_problems
from trainer.rewards.preference import PreferenceModel
from trainer.shapes.world import COLORS, parse_prompt, shape_mask


def _draw(prompt: str, row: int, col: int) -> np.ndarray:
    image = np.full((32, 32, 3), 250, dtype=np.uint8)
    p = parse_prompt(prompt)
    image[row:row + 8, col:col + 8][shape_mask(p.shape, 8)] = COLORS[p.color]
    return image


def _export(tmp_path, n: int = 160) -> tuple:
    """Images under tmp_path/storage and a votes.jsonl as GET /api/votes/export writes it,
    voted by an annotator who prefers the object higher up."""
    storage = tmp_path / "storage"
    (storage / "samples").mkdir(parents=True)
    rng = np.random.default_rng(0)
    annotator = SimulatedAnnotator("upper", flip=0.0, seed=0)
    prompt = "one red square"
    lines = []
    for i in range(n):
        a = _draw(prompt, int(rng.integers(0, 24)), int(rng.integers(0, 24)))
        b = _draw(prompt, int(rng.integers(0, 24)), int(rng.integers(0, 24)))
        paths = []
        for side, image in (("a", a), ("b", b)):
            rel = f"samples/{i}-{side}.png"
            Image.fromarray(image).save(storage / rel)
            paths.append(rel)
        lines.append({"vote_id": i + 1, "prompt": prompt, "image_0_path": paths[0],
                      "image_1_path": paths[1], "outcome": annotator.vote(a, b, prompt),
                      "excluded": False, "annotator": "sim", "label_0": None})
    lines[0]["excluded"] = True
    votes = tmp_path / "votes.jsonl"
    votes.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return votes, storage, lines


def test_fit_preference_from_an_exported_votes_file(tmp_path, capsys):
    votes, storage, lines = _export(tmp_path)
    out = tmp_path / "pref.safetensors"
    code = main(["fit-preference", "--votes", str(votes), "--images", str(storage),
                 "--out", str(out), "--device", "cpu", "--set", "epochs=15", "--set",
                 "ensemble=2", "--set", "learning_rate=3e-3"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the excluded vote is left out; vote ids split the held-out votes as the studio does
    assert report["out"] == str(out) and report["votes_total"] == len(lines) - 1
    assert report["extra"]["split"] == "pair" and report["heldout_pairs"] > 10
    assert report["heldout_accuracy"] > 0.75, report
    model = PreferenceModel.load(out)
    high, low = _draw("one red square", 2, 12), _draw("one red square", 22, 12)
    scores = model(np.stack([high, low]), ["one red square"] * 2)
    assert scores[0] > scores[1]  # it learned "higher is better"
    # a refit from it trains warm_start_epochs on the votes, as the studio's refits do
    again = tmp_path / "pref2.safetensors"
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage),
                 "--out", str(again), "--device", "cpu", "--set", "ensemble=2",
                 "--set", "warm_start_epochs=2", "--warm-start", str(out)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["extra"]["warm_start"] and report["extra"]["epochs"] == 2


def test_fit_preference_names_every_bad_field_and_line(tmp_path, capsys):
    votes, storage, _ = _export(tmp_path, n=6)
    out = tmp_path / "pref.safetensors"
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                 str(out), "--set", "epochs=0", "--set", "features=pixels", "--set",
                 "colour=red"]) == 2
    err = capsys.readouterr().err
    assert "'epochs': must be >= 1" in err and "'features': must be one of" in err
    assert "'colour': unknown field" in err and not out.exists()
    assert "did you mean" not in err  # nothing like "colour" among the fields
    # the fields --set takes: device is --device's
    listed = err.split("'colour': unknown field; the fields are ")[1].splitlines()[0]
    assert "features" in listed.split(", ") and "device" not in listed.split(", ")
    # --set device was overwritten by --device's default: `device=banana` fitted on the CPU
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                 str(out), "--set", "device=banana", "--set", "epochs=1"]) == 2
    err = capsys.readouterr().err
    assert "'device': give it with --device (auto, cpu, cuda or cuda:N), not --set " \
           "device=banana" in err and not out.exists()
    # and FitConfig checks its device as TrainConfig does (a library caller's, the worker's)
    assert [name for name, _ in fit_config_problems({"device": "banana"})] == ["device"]
    assert fit_config_problems({"device": "cuda:1"}) == fit_config_problems({"device": "cpu"}) \
        == []
    text = votes.read_text().splitlines()
    bad = [text[0], "not json", json.dumps({"prompt": "x", "outcome": "a"}),
           json.dumps({**json.loads(text[1]), "outcome": "maybe"}),
           json.dumps({**json.loads(text[2]), "image_0_path": "samples/missing.png"})]
    votes.write_text("\n".join(bad) + "\n")
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                 str(out)]) == 2
    err = capsys.readouterr().err
    assert "line 2: not JSON" in err and "line 3: needs string fields image_0_path" in err
    assert "line 4: outcome must be one of" in err and "line 5: image" in err
    assert "missing.png" in err and not out.exists()


def test_fit_preference_says_a_bad_set_and_the_votes_files_lines_at_once(tmp_path, capsys):
    """A bad --set hid every problem of the votes file: its lines were read only once the
    fields passed."""
    votes, storage, _ = _export(tmp_path, n=4)
    votes.write_text(votes.read_text() + "not json\n")
    out = tmp_path / "pref.safetensors"
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                 str(out), "--device", "cpu", "--set", "epochs=0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: config field 'epochs': "), lines
    assert lines[1].startswith(f"error: --votes {votes}: ") and "line 5: not JSON" in lines[1]
    assert not out.exists()


def test_fit_preference_refuses_repeated_vote_ids(tmp_path, capsys):
    # two exports concatenated: every vote_id twice. Each copy falls on the same side of the
    # split by key, and a fit could be left with nothing to train on; the lines are named
    votes, storage, _ = _export(tmp_path, n=12)
    text = votes.read_text()
    votes.write_text(text + text)
    out = tmp_path / "pref.safetensors"
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                 str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "line 13: vote_id 1 repeats line 1's" in err
    assert "line 24: vote_id 12 repeats line 12's" in err and not out.exists()


def test_fit_preference_names_a_warm_start_that_is_no_preference_model(tmp_path, capsys):
    votes, storage, _ = _export(tmp_path, n=12)
    out = tmp_path / "pref.safetensors"
    junk = tmp_path / "notes.txt"
    junk.write_text("not a safetensors file at all\n")
    for warm, says in ((junk, "not a preference model file (Error while deserializing header"),
                       (tmp_path / "missing.safetensors", "is not a file")):
        assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                     str(out), "--device", "cpu", "--warm-start", str(warm)]) == 2
        err = capsys.readouterr().err
        assert f"error: --warm-start {warm}: {says}" in err and not out.exists()


def test_fit_preference_refuses_a_warm_start_damaged_inside(tmp_path, capsys):
    """A warm start with NaN weights (its header whole) fitted an all-NaN model, exit 0."""
    from safetensors.torch import load_file, save_file

    from trainer.rewards.preference import FitConfig, PreferenceModel, saved_fit_fields

    votes, storage, _ = _export(tmp_path, n=12)
    good = tmp_path / "good.safetensors"
    PreferenceModel(FitConfig()).save(good)
    warm = tmp_path / "nan.safetensors"
    save_file({k: v.fill_(float("nan")) for k, v in load_file(str(good)).items()}, str(warm),
              metadata={"format": "preference-model", "report": "null",
                        "fit_config": json.dumps(saved_fit_fields(good))})
    out = tmp_path / "pref.safetensors"
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                 str(out), "--device", "cpu", "--warm-start", str(warm)]) == 2
    err = capsys.readouterr().err
    assert "is a damaged preference model: NaN or infinite weights" in err and not out.exists()


def test_fit_preference_leaves_out_votes_the_shapes_features_cannot_read(tmp_path, capsys):
    """As the studio's fit_preference job does (worker/preference.py): a vote on images that
    are not the shapes world's 32x32 ones is left out and counted as unreadable_images. The CLI
    fitted the shapes features on 64x64 images instead (rc 0, every vote fitted)."""
    votes, storage, lines = _export(tmp_path, n=24)
    for i in range(10):  # 64x64 images of a shapes prompt, as another model's samples
        paths = []
        for side in "ab":
            rel = f"samples/big-{i}-{side}.png"
            Image.fromarray(np.full((64, 64, 3), 40 * i % 250, np.uint8)).save(storage / rel)
            paths.append(rel)
        lines.append({"vote_id": 100 + i, "prompt": "one red square", "image_0_path": paths[0],
                      "image_1_path": paths[1], "outcome": "a", "excluded": False})
    votes.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["fit-preference", "--votes", str(votes), "--images", str(storage), "--device",
            "cpu", "--set", "epochs=1", "--set", "ensemble=1"]
    assert main([*args, "--out", str(tmp_path / "p.safetensors")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["votes_ignored"]["unreadable_images"] == 10
    assert report["votes_total"] == len(lines) - 1  # the excluded vote alone is not counted
    assert report["votes_fitted"] == 23 - report["votes_ignored"].get("skip", 0) - \
        report["votes_ignored"].get("both_bad", 0)
    # votes on 64x64 images alone: no vote to fit on, and the message says why
    votes.write_text("".join(json.dumps(line) + "\n" for line in lines[24:]))
    assert main([*args, "--out", str(tmp_path / "q.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "10 more votes are on images its 'shapes' features cannot read" in err, err
    assert not (tmp_path / "q.safetensors").exists()


def test_fit_preference_says_what_it_left_out_and_what_it_could_not_do(tmp_path, capsys):
    """A missing --images directory was one error per image; "excluded": "yes" read as true;
    the excluded votes vanished without a word; a --warm-start that could not be used was
    ignored (a fit from scratch, warm_start false in the report); features 'clip' with no
    clip_path named '.', which nobody gave."""
    votes, storage, lines = _export(tmp_path, n=12)
    out = tmp_path / "pref.safetensors"
    base = ["fit-preference", "--votes", str(votes), "--out", str(out), "--device", "cpu"]
    assert main([*base, "--images", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert f"--images: {tmp_path / 'nowhere'} is not a directory" in err
    assert err.count("\n") == 1 and not out.exists()

    lines[3]["excluded"] = "yes"
    votes.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main([*base, "--images", str(storage)]) == 2
    assert "line 4: excluded must be true or false, got 'yes'" in capsys.readouterr().err
    lines[3]["excluded"] = True
    votes.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main([*base, "--images", str(storage), "--set", "epochs=2"]) == 0
    assert "left out 2 vote(s) the file marks excluded" in capsys.readouterr().err

    # a warm start from a model of another width: refused, naming why, nothing written
    other = tmp_path / "other.safetensors"
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                 str(other), "--device", "cpu", "--set", "epochs=2", "--set", "width=8"]) == 0
    capsys.readouterr()
    again = tmp_path / "again.safetensors"
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                 str(again), "--device", "cpu", "--warm-start", str(other)]) == 2
    err = capsys.readouterr().err
    assert "cannot start from it: width differs" in err and not again.exists()
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                 str(again), "--device", "cpu", "--warm-start", str(out), "--set",
                 "warm_start_epochs=0"]) == 2
    assert "warm_start_epochs is 0" in capsys.readouterr().err and not again.exists()

    from trainer.rewards.preference import clip_dir_problem

    assert clip_dir_problem("").startswith("clip_path is empty: features 'clip' needs")


def test_fit_preference_replaces_only_a_preference_model_at_out(tmp_path, capsys):
    """A refit replaces its model in place; `--out notes.txt` was overwritten as well."""
    votes, storage, _ = _export(tmp_path, n=12)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    common = ["fit-preference", "--votes", str(votes), "--images", str(storage), "--device",
              "cpu", "--set", "epochs=1", "--set", "ensemble=1"]
    assert main([*common, "--out", str(notes)]) == 2
    err = capsys.readouterr().err
    assert f"error: --out: {notes} exists and is not a safetensors file" in err, err
    assert notes.read_text() == "my notes\n"
    model = tmp_path / "pref.safetensors"
    assert main([*common, "--out", str(model)]) == 0
    first = model.read_bytes()
    assert main([*common, "--set", "seed=1", "--out", str(model)]) == 0  # refitted in place
    assert model.read_bytes() != first


def test_fit_preference_names_a_parquet_export_in_one_line(tmp_path, capsys):
    """The studio's parquet export was read as text: a wall of "line N: bad encoding"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    votes = tmp_path / "votes.parquet"
    pq.write_table(pa.table({"vote_id": [1, 2], "outcome": ["a", "b"]}), votes)
    out = tmp_path / "pref.safetensors"
    assert main(["fit-preference", "--votes", str(votes), "--images", str(tmp_path), "--out",
                 str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --votes: {votes} is a Parquet file; fit-preference reads JSON "
                   "lines: export the votes with format=jsonl (GET /api/votes/export?"
                   "format=jsonl)") and not out.exists()


def test_fit_preference_refuses_a_vote_id_that_is_no_id(tmp_path, capsys):
    """1.5, true and [1] were taken as ids (their str()), and "1" beside 1 was a second vote."""
    votes, storage, _ = _export(tmp_path, n=12)
    rows = [json.loads(line) for line in votes.read_text().splitlines()]
    for row, bad in zip(rows, (1.5, True, [1], " ", "7"), strict=False):
        row["vote_id"] = bad
    votes.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "pref.safetensors"
    assert main(["fit-preference", "--votes", str(votes), "--images", str(storage), "--out",
                 str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    for line, bad in ((1, "1.5"), (2, "True"), (3, "[1]"), (4, "' '")):
        assert f"line {line}: vote_id must be an integer (or a non-empty string), got {bad}" \
            in err, err
    assert "line 7: vote_id 7 repeats line 5's" in err  # "7" and 7: one id
    assert not out.exists()
