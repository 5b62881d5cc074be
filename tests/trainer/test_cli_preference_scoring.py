"""A fitted preference model in the CLI: `evaluate --preference-model` scores the reward
'preference' beside the others, and every command refuses a preference model that cannot score
its model's images before any work (as the studio's jobs do)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from cli_helpers import cli_errors
from safetensors.torch import save_file

from trainer.cli import main
from trainer.rewards.fit_config import FitConfig
from trainer.rewards.preference import PreferenceModel


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "p.txt"
    path.write_text("one red circle\ntwo blue squares\n")
    return path


@pytest.fixture
def shapes_preference(tmp_path: Path) -> Path:
    path = tmp_path / "shapes-pref.safetensors"
    PreferenceModel(FitConfig(ensemble=2, width=4, seed=3)).save(path)
    return path


def _clip_preference(path: Path, clip_path: str) -> Path:
    """A preference model whose fit settings say features 'clip' at `clip_path` (its weights
    need not match: the checks read the header alone)."""
    model = PreferenceModel(FitConfig(ensemble=1, width=4))
    fields = {**dataclasses.asdict(model.config), "features": "clip", "clip_path": clip_path}
    save_file({k: v.contiguous() for k, v in model.net.state_dict().items()}, str(path),
              metadata={"format": "preference-model", "fit_config": json.dumps(fields),
                        "report": "null"})
    return path


def _evaluate(prompts: Path, *extra: str) -> list[str]:
    return ["evaluate", "--prompts-file", str(prompts), "--seeds", "2", "--steps", "2",
            "--device", "cpu", *extra]


def test_evaluate_scores_the_preference_model_beside_the_other_rewards(
        prompts: Path, shapes_preference: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The reported 'preference' is the model's mean score on exactly the images evaluate drew
    (the same images sampled again through the library and scored by the loaded model)."""
    from trainer.evaluation import sample_images
    from trainer.models import load_flow_model

    out = tmp_path / "eval.json"
    assert main(_evaluate(prompts, "--rewards", "count,preference", "--preference-model",
                          str(shapes_preference), "--out", str(out))) == 0
    result = json.loads(out.read_text())
    assert list(result["rewards"]) == ["count", "preference"]
    assert result["setting"]["preference_model"] == str(shapes_preference.resolve())
    texts = ["one red circle"] * 2 + ["two blue squares"] * 2
    images = sample_images(load_flow_model("shapes"), texts, [0, 1, 0, 1], "dpm++", 2)
    expected = PreferenceModel.load(shapes_preference).scores(images, texts)
    assert result["rewards"]["preference"]["mean"] == pytest.approx(float(expected.mean()))
    assert result["rewards"]["preference"]["std"] == pytest.approx(float(expected.std()))
    assert result["preference_reward"] == result["rewards"]["preference"]["mean"]
    assert "mean preference: " in capsys.readouterr().err

    # --preference-model alone adds 'preference' to the model's default rewards; --rewards
    # preference scores it alone
    assert main(_evaluate(prompts, "--preference-model", str(shapes_preference))) == 0
    rewards = json.loads(capsys.readouterr().out)["rewards"]
    assert list(rewards) == ["count", "exact_count", "color", "shape", "combined", "preference"]
    assert main(_evaluate(prompts, "--rewards", "preference", "--preference-model",
                          str(shapes_preference))) == 0
    assert list(json.loads(capsys.readouterr().out)["rewards"]) == ["preference"]


def test_evaluate_names_a_preference_model_it_cannot_use_before_sampling(
        prompts: Path, shapes_preference: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    lines = cli_errors(_evaluate(prompts, "--rewards", "count,preference"), capsys)
    assert lines == ["error: --rewards: 'preference' is scored by a fitted preference model: "
                     "give its file with --preference-model (fit-preference's --out, or the "
                     "studio's STORAGE_DIR/preference/vN.safetensors)"]
    lines = cli_errors(_evaluate(prompts, "--preference-model", str(tmp_path / "gone")), capsys)
    assert len(lines) == 1 and "--preference-model" in lines[0] and "is not a file" in lines[0]
    lines = cli_errors(_evaluate(prompts, "--preference-model", str(prompts)), capsys)
    assert len(lines) == 1 and "--preference-model" in lines[0] \
        and "not a safetensors file" in lines[0]
    clip = _clip_preference(tmp_path / "clip-pref.safetensors", str(tmp_path / "no-clip"))
    lines = cli_errors(_evaluate(prompts, "--preference-model", str(clip), "--prompts-file",
                                 str(tmp_path / "gone.txt")), capsys)  # both problems named
    assert any("--prompts-file" in line and "gone.txt" in line for line in lines), lines
    assert any("--preference-model" in line and "clip_path" in line
               and "no-clip" in line for line in lines), lines


def test_a_shapes_features_preference_model_cannot_score_flux(
        prompts: Path, shapes_preference: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """evaluate and train refuse it naming the file and the model, as the studio's train job
    does (the run would fail at its first reward, or score FLUX's images as shapes)."""
    from tiny_diffusers import write_tiny_flux

    flux = tmp_path / "flux"
    write_tiny_flux(flux)
    capsys.readouterr()  # its progress bars
    lines = cli_errors(_evaluate(prompts, "--model", "flux", "--model-path", str(flux),
                                 "--preference-model", str(shapes_preference)), capsys)
    assert lines == [f"error: --preference-model: {shapes_preference} reads the shapes world's "
                     "images and prompts (features 'shapes'): it cannot score model 'flux'; "
                     "fit one with features 'clip' for it"]
    out = tmp_path / "run"
    lines = cli_errors(["train", "--config", "tiny", "--set", "model=flux", "--set",
                        f"model_path={flux}", "--set", f"preference_model={shapes_preference}",
                        "--set", 'reward_weights={"preference": 1}', "--prompts-file",
                        str(prompts), "--out", str(out)], capsys)
    assert any("'preference_model'" in line and "cannot score model 'flux'" in line
               for line in lines), lines
    assert not out.exists()


def test_train_names_a_clip_preference_model_whose_clip_is_gone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clip = _clip_preference(tmp_path / "clip-pref.safetensors", str(tmp_path / "no-clip"))
    out = tmp_path / "run"
    lines = cli_errors(["train", "--config", "tiny", "--set", f"preference_model={clip}",
                        "--set", 'reward_weights={"count": 1, "preference": 1}', "--out",
                        str(out)], capsys)
    assert any("'preference_model'" in line and "clip_path" in line for line in lines), lines
    assert not out.exists()
