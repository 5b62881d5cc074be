"""The trainer as a library: its public API, the README's example, and its boundaries."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainer
from trainer.config import TrainConfig
from trainer.grpo import UpdateStats, optimizer_step
from trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "trainer"


def readme_library_example() -> str:
    """The python block of README.md's "### As a library" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n### As a library\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section should hold exactly one python example"
    return blocks[0]


def test_the_readme_example_trains_and_saves_a_checkpoint(tmp_path, monkeypatch, capsys):
    code = readme_library_example()
    # the same code at tiny size, writing under tmp_path
    for old, new in [('"shapes-quick-demo"', '"tiny"'),
                     ('"runs/notebook/checkpoints"', repr(str(tmp_path / "checkpoints")))]:
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)

    iterations = namespace["config"].iterations
    assert namespace["trainer"].iteration == iterations == 3
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == iterations + 1 and lines[0].strip().startswith("1 reward")
    checkpoint = namespace["checkpoint"]
    assert checkpoint == tmp_path / "checkpoints" / "iter-000003"
    assert (checkpoint / "model.safetensors").is_file()
    assert (checkpoint / "trainer_state.safetensors").is_file()


def test_public_api_names_resolve():
    assert set(trainer.__all__) == set(trainer._EXPORTS)
    for name in trainer.__all__:
        assert getattr(trainer, name) is not None, name
        assert name in dir(trainer)
    assert trainer.Trainer is Trainer and trainer.TrainConfig is TrainConfig
    assert issubclass(trainer.ShapesDiT, trainer.FlowModel)
    assert "tiny" in trainer.PRESETS and "count" in trainer.reward_names()
    # what load_config raises (the README names it) is importable from the package
    with pytest.raises(trainer.ConfigErrors) as raised:
        trainer.load_config("tiny", {"sigma": 3, "group_size": 0})
    assert {e.field for e in raised.value.errors} == {"sigma", "group_size"}
    assert all(isinstance(e, trainer.ConfigError) for e in raised.value.errors)
    with pytest.raises(AttributeError, match="no_such_name"):
        trainer.no_such_name  # noqa: B018


@pytest.mark.subprocess
def test_import_trainer_is_cheap_and_star_import_gives_the_api():
    code = ("import sys, trainer; assert 'torch' not in sys.modules, 'torch imported'; "
            "from trainer import *; print(Trainer.__name__, neighbor_grpo_iteration.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.split() == ["Trainer", "neighbor_grpo_iteration"]


def _trainer_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def test_the_methods_share_grpo_and_not_each_other():
    assert "trainer.neighbor_grpo" not in _trainer_imports(TRAINER / "sde_grpo.py")
    assert "trainer.sde_grpo" not in _trainer_imports(TRAINER / "neighbor_grpo.py")
    grpo = _trainer_imports(TRAINER / "grpo.py")
    assert not grpo & {"trainer.neighbor_grpo", "trainer.sde_grpo", "trainer.loop"}


def test_the_trainer_knows_nothing_of_the_app_or_the_worker():
    for path in TRAINER.rglob("*.py"):
        imports = _trainer_imports(path)
        assert not any(m.split(".")[0] in ("app", "worker") for m in imports), path
        # torch's DataLoader names its processes "workers": those are not the studio's
        text = re.sub(r"get_worker_info|num_workers|\bworker_id\b", "", path.read_text())
        assert "worker" not in text.lower(), path
        # nor do its comments and docstrings point into the app's modules
        assert not re.search(r"\bapp\.(job_kinds|services|models|config|db|ui|api)\b",
                             text), path


def test_update_stats_only_record_and_optimizer_step_steps():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    logp_old = torch.log_softmax(torch.randn(2, 4), -1)
    logp_new = torch.log_softmax(net(torch.randn(2, 4, 3)).squeeze(-1), -1)
    loss = -(logp_new * torch.randn(2, 4)).mean()

    stats = UpdateStats(clip_range=0.2)
    stats.record(loss, logp_new, logp_old, grad_norm=1.5)
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))
    assert all(p.grad is None for p in net.parameters())
    m = stats.metrics()
    assert m["grad_norm"] == 1.5 and m["loss"] == pytest.approx(loss.item())
    assert m["abs_log_ratio"] == pytest.approx((logp_new - logp_old).abs().mean().item())

    grad_norm = optimizer_step(net, optimizer, loss, max_grad_norm=1e-3)
    expected = torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item()
    assert grad_norm > 1e-3 and expected == pytest.approx(1e-3, rel=1e-4)  # clipped after
    assert not all(torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))


@pytest.mark.parametrize("name", ["latest", "v3", "7", "no/such/file.safetensors"])
def test_a_preference_model_that_is_not_a_file_is_left_to_the_caller(name):
    config = TrainConfig(device="cpu", preference_model=name,
                         reward_weights={"count": 1.0, "preference": 1.0})
    tr = Trainer(config)  # the caller attaches one with set_preference_model
    assert tr.preference_version is None


def test_the_cli_wants_a_preference_model_file(tmp_path, capsys):
    from trainer.cli import main

    out = tmp_path / "run"
    code = main(["train", "--config", "tiny", "--set", "device=cpu", "--set",
                 'reward_weights={"count": 1, "preference": 1}', "--set",
                 "preference_model=latest", "--out", str(out), "--no-progress"])
    assert code == 2 and not out.exists()
    assert "preference_model" in capsys.readouterr().err


def test_read_prompts_takes_txt_jsonl_and_json_and_refuses_other_files(tmp_path):
    from trainer.evaluation import read_prompts

    (tmp_path / "p.txt").write_text("one red circle\n\n  two blue squares \n")
    assert read_prompts(tmp_path / "p.txt") == ["one red circle", "two blue squares"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat", "id": 1}\n\n{"prompt": "a dog"}\n')
    assert read_prompts(tmp_path / "p.jsonl") == ["a cat", "a dog"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a cat"}\n{"text": "a dog"}\n')
    with pytest.raises(ValueError, match="bad.jsonl: line 2"):
        read_prompts(tmp_path / "bad.jsonl")
    # HPDv2's test.json (objects) and HPSv2's benchmark files (strings) are JSON arrays
    (tmp_path / "test.json").write_text('[{"prompt": "a cat", "image_path": ["x.jpg"]}, '
                                        '{"prompt": " a dog "}]')
    assert read_prompts(tmp_path / "test.json") == ["a cat", "a dog"]
    (tmp_path / "anime.json").write_text('["a cat", "a dog"]')
    assert read_prompts(tmp_path / "anime.json") == ["a cat", "a dog"]
    (tmp_path / "bad.json").write_text('["a cat", {"text": "a dog"}]')
    with pytest.raises(ValueError, match="item 2"):
        read_prompts(tmp_path / "bad.json")
    (tmp_path / "obj.json").write_text('{"prompt": "a cat"}')
    with pytest.raises(ValueError, match="JSON array"):
        read_prompts(tmp_path / "obj.json")
    (tmp_path / "p.csv").write_text("prompt\na cat\n")
    with pytest.raises(ValueError, match="unsupported prompt file '.csv'"):
        read_prompts(tmp_path / "p.csv")


def test_the_readmes_train_commands_make_valid_configs(tmp_path, monkeypatch):
    """Every `python -m trainer train` command in README.md's shell blocks parses and gives a
    config TrainConfig accepts (the model directories they name are the user's; the prompt
    files they name are made here, one prompt each)."""
    import json
    import shlex

    from trainer.cli import build_parser, train_config_of

    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "-m trainer train " in line:
                commands.append(shlex.split(line.split("-m trainer ", 1)[1], comments=True))
    assert len(commands) >= 3, commands
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        if "--prompts-file" in argv:
            path = tmp_path / argv[argv.index("--prompts-file") + 1]
            path.write_text(json.dumps(["a cat"]) if path.suffix == ".json" else "a cat\n")
        config = train_config_of(build_parser().parse_args(argv))  # ConfigErrors: every field
        assert config.prompts_problem() is None, argv  # a real model is given prompts


def test_a_real_model_trains_from_its_own_preset_and_reward_when_none_is_named(tmp_path):
    """`train --set model=flux --set model_path=DIR --set finetune=lora` (issue 16's command)
    works as it does for shapes: the model's preset, a reward that reads any image."""
    from trainer.cli import build_parser, train_config_of
    from trainer.config import PRESETS, ConfigErrors, TrainConfig

    argv = ["train", "--set", "model=flux", "--set", f"model_path={tmp_path}", "--set",
            "finetune=lora", "--out", str(tmp_path / "run")]
    config = train_config_of(build_parser().parse_args(argv))
    assert config.model == "flux" and config.reward_weights == {"jpeg_compressibility": 1.0}
    assert config.group_size == PRESETS["flux-lora"]["group_size"] and config.torch_compile
    sd3 = train_config_of(build_parser().parse_args(
        ["train", "--config", "tiny", "--set", "model=sd3", "--set", f"model_path={tmp_path}",
         "--out", "x"]))
    assert sd3.reward_weights == {"jpeg_compressibility": 1.0} and sd3.iterations == 3
    assert TrainConfig.from_dict({}).reward_weights == {"count": 1.0}  # shapes as before
    # the library's load_config without a preset starts a real model where the CLI does
    from trainer.config import load_config

    lib = load_config(None, {"model": "flux", "model_path": str(tmp_path)})
    assert (lib.finetune, lib.lora_rank) == ("lora", PRESETS["flux-lora"]["lora_rank"])
    assert load_config(None, {}).to_dict() == TrainConfig().to_dict()  # shapes: the defaults
    # a reward named by the user is the user's: the shapes count on FLUX is still refused
    with pytest.raises(ConfigErrors, match="reward_weights"):
        TrainConfig.from_dict({"model": "flux", "reward_weights": {"count": 1.0}})


def test_a_real_model_trains_only_on_prompts_it_is_given(tmp_path, capsys, monkeypatch):
    """A FLUX run without prompts trained on the shapes world's "three blue triangles"
    without a word. The library, the CLI (with every other problem at once, before anything
    is written) and --prompts-file; a relative model_path is kept absolute."""
    from trainer.cli import build_parser, main, train_config_of
    from trainer.config import ConfigError, TrainConfig
    from trainer.loop import Trainer

    message = "model 'flux' trains on prompts you give: prompts (the CLI's --prompts-file)"
    config = TrainConfig.from_dict({"model": "flux", "model_path": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=re.escape(message)):
        Trainer(config)  # before any weights load (there are none here)
    assert config.prompts_problem(dataset=True) is None
    assert TrainConfig.from_dict({}).prompts_problem() is None  # shapes: its 48 prompts
    with pytest.raises(TypeError, match="Trainer takes a TrainConfig, not dict"):
        Trainer({"model": "flux"})

    out = tmp_path / "run"
    assert main(["train", "--set", "model=flux", "--set", f"model_path={tmp_path / 'nope'}",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [line.split("'")[1] for line in err] == ["prompts", "model_path"], err
    assert message in err[0] and not out.exists()

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n\na blue boat\n")
    monkeypatch.chdir(tmp_path)
    config = train_config_of(build_parser().parse_args(
        ["train", "--set", "model=flux", "--set", "model_path=models/flux", "--prompts-file",
         str(prompts), "--out", "run"]))
    assert config.prompts == ["a red fox", "a blue boat"] and config.prompts_problem() is None
    assert config.model_path == str(tmp_path / "models" / "flux")
    assert main(["train", "--prompts-file", str(tmp_path / "none.txt"), "--out", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: --prompts-file: ")


def test_the_app_starts_without_torch():
    """The API's schemas read the vote outcomes from trainer.rewards; importing the app must
    not load torch (1.4 s of the start-up, and every tool that imports the app) until a
    reward is asked for."""
    code = ("import sys, app.main; assert 'torch' not in sys.modules, 'torch loaded'; "
            "from trainer.rewards import reward_names; names = reward_names(); "
            "assert {'count', 'jpeg_compressibility', 'hpsv2'} <= set(names), names")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_a_directory_setting_that_names_a_file_says_so(tmp_path, monkeypatch):
    """`model_path=README.md` said "model directory README.md does not exist"; a reward's
    weights directory the same: the file is there, it is just not a directory."""
    from trainer.models import model_dir_problem
    from trainer.rewards.models import weights_problem

    afile = tmp_path / "README.md"
    afile.write_text("hello")
    assert f"model directory {afile} is a file, not a directory" in model_dir_problem("flux", afile)
    assert "does not exist" in model_dir_problem("flux", tmp_path / "nope")
    problem = weights_problem("hpsv2", {"hpsv2": str(afile)})
    assert problem is not None and "is a file, not a directory" in problem, problem
    # nothing set: the message says the directory is a default, and relative to what
    monkeypatch.delenv("REWARD_MODELS_DIR", raising=False)
    monkeypatch.delenv("DATA_DIR", raising=False)
    assert "(from REWARD_MODELS_DIR unset, so its default ./data/reward_models, relative to " \
           "the working directory)" in weights_problem("hpsv2", {})
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path))
    assert f"'{tmp_path / 'hpsv2'}' (from REWARD_MODELS_DIR)" in weights_problem("hpsv2", {})


def test_a_preference_reward_fits_from_the_public_api_alone():
    """Votes -> PreferencePair -> fit_preference_model -> a reward the Trainer can blend, all
    through `trainer`'s own names (no studio): a skip carries no label and is not fitted."""
    import numpy as np

    rng = np.random.default_rng(0)
    outcomes = [trainer.Outcome.A, trainer.Outcome.B, trainer.Outcome.TIE, trainer.Outcome.SKIP]
    pairs = [trainer.PreferencePair(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
                                    rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
                                    "one red circle", outcomes[i % 4], key=str(i))
             for i in range(16)]
    model = trainer.fit_preference_model(pairs, trainer.FitConfig(width=8, epochs=1, ensemble=1))
    assert isinstance(model, trainer.PreferenceModel)
    assert model.report.votes_fitted == 12 and model.report.votes_ignored == {"skip": 4}
    scores = model(np.stack([p.image_a for p in pairs[:3]]), ["one red circle"] * 3)
    assert scores.shape == (3,) and np.isfinite(scores).all()
