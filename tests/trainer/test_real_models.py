"""Correctness of the FLUX.1 / SD3 adapters (trainer/models/diffusers_flow.py) on the tiny
diffusers-format directories of tests/tiny_diffusers.py (issue 16): what trains in LoRA
and full mode, LoRA checkpoints that the stock diffusers pipelines load and that reproduce the
trainer's own samples, the prompt-embedding cache, full and LoRA checkpoints restored, config
and model-directory errors naming what is wrong, the CLI's `sample` on FLUX, its `train` of a
FLUX LoRA (checkpoints, model cards, resume) and `evaluate` / `sample` of its checkpoints in
batches, and micro-batched rollouts and updates giving the results of unbatched ones.

Everything runs in float32 on the CPU (mixed_precision 'auto' is fp32 off CUDA).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainer import solvers
from trainer.cli import main as cli_main
from trainer.config import PRESETS, ConfigError, ConfigErrors, TrainConfig
from trainer.evaluation import sample_images
from trainer.loop import Trainer, model_card
from trainer.models import (
    LORA_WEIGHTS,
    ModelSpec,
    checkpoint_spec,
    load_checkpoint_model,
    load_flow_model,
    model_dir_problem,
)

PROMPTS = ["one red circle", "two blue squares"]
SIZE = 32
# sd35: SD3.5-medium's MMDiT-X (qk norm, a second image attention) at tiny size
VARIANTS = {"flux_dev": "flux", "flux_schnell": "flux", "sd3": "sd3", "sd35": "sd3"}
# diffusers' pipeline classes by model, imported when a test needs one: importing diffusers
# takes seconds, which every collection (and every xdist worker) would pay
PIPELINES = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline"}


def _pipeline_class(model_name: str):
    import diffusers

    return getattr(diffusers, PIPELINES[model_name])
# fp32 on the CPU: the trainer's rollout and the stock pipeline run the same transformer on the
# same latents; they differ only in float rounding (the pipeline's sigmas pass through numpy
# float32, FLUX's timestep through * 1000 / 1000): at most ~1e-6 on final latents of magnitude
# ~4, where the trained LoRA itself moves them by 0.3 to 0.7. 1e-4 leaves room for other BLAS.
SAMPLE_ATOL = 1e-4


def _config(directory: Path, model: str, **overrides) -> TrainConfig:
    # lora_alpha = 2 x rank, as the presets have it (64 / 32): the adapters' scale is not 1
    data = {**PRESETS["tiny"], "device": "cpu", "model": model, "model_path": str(directory),
            "finetune": "lora", "resolution": SIZE, "lora_rank": 4, "lora_alpha": 8.0,
            "reward_weights": {"jpeg_compressibility": 1.0}, "learning_rate": 1e-3,
            "prompts": PROMPTS}
    return TrainConfig.from_dict({**data, **overrides})


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    assert before.keys() == after.keys()
    return {k for k in before if not torch.equal(before[k], after[k])}


def _frozen_parts(model) -> dict[str, torch.nn.Module]:
    names = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    parts = {n: getattr(model.pipeline, n) for n in names if getattr(model.pipeline, n, None)}
    assert {"vae", "text_encoder", "text_encoder_2"} <= parts.keys()
    return parts


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ---------------------------------------------------------------------------------------
# 1. One iteration: what trains in LoRA and full mode
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("finetune", ["lora", "full"])
@pytest.mark.parametrize("method", ["neighbor", "sde"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_iteration_trains_only_what_it_should(variant, method, finetune, request):
    trainer = Trainer(_config(request.getfixturevalue(variant), VARIANTS[variant],
                              method=method, finetune=finetune))
    model = trainer.model
    frozen = {name: _state(part) for name, part in _frozen_parts(model).items()}
    before = _state(model.transformer)
    result = trainer.step()
    after = _state(model.transformer)
    changed = _changed(before, after)

    assert result.images.shape == (len(PROMPTS), PRESETS["tiny"]["group_size"], SIZE, SIZE, 3)
    assert np.isfinite(result.metrics["loss"])
    if finetune == "lora":
        lora_keys = {k for k in before if "lora" in k}
        assert lora_keys and {k for k in before if "lora_B" in k}
        assert changed and all("lora" in k for k in changed), sorted(changed - lora_keys)
        assert any("lora_B" in k for k in changed)
        if variant == "sd35":  # MMDiT-X's second image attention is adapted and trains too
            assert any(".attn2." in k for k in changed), sorted(changed)
        # the optimizer holds the adapters alone
        lora_params = {id(p) for n, p in model.transformer.named_parameters() if "lora" in n}
        optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        assert optimized and all(id(p) in lora_params for p in optimized)
        base = [p for n, p in model.transformer.named_parameters() if "lora" not in n]
        assert base and not any(p.requires_grad for p in base)
    else:
        assert not any("lora" in k for k in before)
        params = dict(model.transformer.named_parameters())
        assert all(p.requires_grad for p in params.values())
        assert changed <= params.keys()  # buffers (SD3's pos_embed) stay
        # every weight the loss reached moved; only weights that feed no output stay (the
        # text queries of SD3's last, context-pre-only block): 36 of 38 move there
        reached = {n for n, p in params.items() if p.grad is not None and p.grad.any()}
        assert reached <= changed, sorted(reached - changed)
        assert len(changed) >= 0.9 * len(params), sorted(params.keys() - changed)
    for name, part in _frozen_parts(model).items():
        assert not _changed(frozen[name], _state(part)), f"{name} changed"
        assert not any(p.requires_grad for p in part.parameters()), name


# ---------------------------------------------------------------------------------------
# 2. A LoRA checkpoint loads into the stock pipeline and reproduces the trainer's samples
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, request):
    """Per variant: a LoRA trained 3 iterations at a high learning rate (far from zero),
    its checkpoint directory and the trainer."""
    runs = {}
    for variant, model in VARIANTS.items():
        trainer = Trainer(_config(request.getfixturevalue(variant), model, learning_rate=1e-2))
        for _ in range(3):
            trainer.step()
        runs[variant] = (trainer, trainer.save_checkpoint(tmp_path_factory.mktemp(variant)))
    return runs


def _noise(model, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(len(PROMPTS), *model.latent_shape, generator=generator)


def _our_samples(model, noise: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        return solvers.rollout("euler", model, noise, model.encode_prompts(PROMPTS), steps,
                               shift=model.flow_shift, timesteps=model.sigmas(steps)).final


def _pipeline_samples(pipe, model_name: str, noise: torch.Tensor, steps: int,
                      guidance_scale: float) -> torch.Tensor:
    """The stock pipeline's samples with its own default schedule (no sigmas passed)."""
    with torch.no_grad():
        return pipe(PROMPTS, latents=noise, height=SIZE, width=SIZE, num_inference_steps=steps,
                    guidance_scale=guidance_scale, output_type="latent").images


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_saved_lora_loads_into_the_stock_pipeline_and_reproduces_samples(variant, lora_runs,
                                                                          request):
    trainer, checkpoint = lora_runs[variant]
    model_name, steps, config = VARIANTS[variant], 3, trainer.config
    model = trainer.model
    assert (checkpoint / LORA_WEIGHTS).is_file()
    noise = _noise(model)
    ours = _our_samples(model, noise, steps)

    pipe = _pipeline_class(model_name).from_pretrained(request.getfixturevalue(variant),
                                                 local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    base = _pipeline_samples(pipe, model_name, noise, steps, config.guidance_scale)
    pipe.load_lora_weights(checkpoint)
    stock = _pipeline_samples(pipe, model_name, noise, steps, config.guidance_scale)

    assert stock.shape == ours.shape == (len(PROMPTS), *model.latent_shape)
    # the trained LoRA matters: far above the tolerance the comparison below uses
    assert (stock - base).abs().max() > 100 * SAMPLE_ATOL
    torch.testing.assert_close(ours, stock, rtol=0, atol=SAMPLE_ATOL)

    # the checkpoint loaded back (resume / sampling path) samples the same
    reloaded = load_checkpoint_model(checkpoint)
    assert reloaded.spec.finetune == "lora" and reloaded.spec.path == config.model_path
    torch.testing.assert_close(_our_samples(reloaded, noise, steps), ours, rtol=0,
                               atol=SAMPLE_ATOL)


@pytest.mark.parametrize("variant", ["flux_dev", "sd3"])
def test_rollouts_step_on_the_grid_the_stock_pipeline_samples_with(variant, request):
    """FLUX's pipeline passes sigmas from 1 to 1/steps through its dynamic shift; SD3's lets
    the scheduler lay them out (from 1 to its shifted sigma_min, not evenly spaced to 0): the
    adapter's grid is the one the pipeline used, and Neighbor GRPO's and the SDE baseline's
    rollouts step on it."""
    from trainer.neighbor_grpo import rollout_neighborhoods
    from trainer.sde_grpo import sde_rollout

    model_name = VARIANTS[variant]
    config = _config(request.getfixturevalue(variant), model_name, rollout_solver="euler")
    model = Trainer(config).model
    steps = config.rollout_steps
    pipe = _pipeline_class(model_name).from_pretrained(request.getfixturevalue(variant),
                                                       local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    _pipeline_samples(pipe, model_name, _noise(model), steps, config.guidance_scale)
    used = pipe.scheduler.sigmas.float()  # the scheduler keeps the grid it stepped on
    torch.testing.assert_close(model.sigmas(steps), used)
    evenly = solvers.linear_timesteps(steps, shift=model.flow_shift)
    assert (model_name == "flux") == torch.allclose(used, evenly, atol=1e-5)
    groups = rollout_neighborhoods(model, PROMPTS[:1], config, torch.Generator().manual_seed(0))
    torch.testing.assert_close(groups.timesteps, used)
    noise = _noise(model)[:1]
    cond = model.encode_prompts(PROMPTS[:1])
    _, timesteps, _ = sde_rollout(model, noise, cond, steps, 0.7, torch.Generator().manual_seed(0))
    torch.testing.assert_close(timesteps.cpu(), used)


# ---------------------------------------------------------------------------------------
# 3. Prompt embeddings are computed once per prompt
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["flux_dev", "sd3"])
def test_text_encoders_run_once_per_prompt(variant, request):
    trainer = Trainer(_config(request.getfixturevalue(variant), VARIANTS[variant]))
    model = trainer.model
    encoders = {n: p for n, p in _frozen_parts(model).items() if n != "vae"}
    calls: dict[str, list[int]] = {name: [] for name in encoders}

    def hook(name):
        def record(module, args, kwargs, output):
            ids = args[0] if args else kwargs["input_ids"]
            calls[name].append(ids.shape[0])
        return record

    for name, encoder in encoders.items():
        encoder.register_forward_hook(hook(name), with_kwargs=True)

    trainer.step()
    first = {name: list(batches) for name, batches in calls.items()}
    # each encoder ran, on the two prompts at once (SD3 also encodes the empty negative prompt)
    assert all(batches and batches[0] == len(PROMPTS) for batches in first.values()), first
    assert model.encoder_batches == 1
    trainer.step()  # the same prompts: served from the cache
    assert calls == first and model.encoder_batches == 1

    cond = model.encode_prompts([PROMPTS[1], "three green triangles", PROMPTS[0]])
    assert model.encoder_batches == 2
    for name in encoders:  # one more pass per encoder call, over the new prompt alone
        new = calls[name][len(first[name]):]
        assert new and new[0] == 1 and len(new) == len(first[name]), (name, new)
    # the cached rows are what the pipeline computes for those prompts, in the order asked
    with torch.no_grad():
        expected = model.pipeline.encode_prompt(
            [PROMPTS[1], "three green triangles", PROMPTS[0]], prompt_2=None,
            **({"prompt_3": None} if variant == "sd3" else {}), device=torch.device("cpu"))[0]
    torch.testing.assert_close(cond["prompt_embeds"], expected, rtol=0, atol=1e-6)


def test_prompt_cache_keeps_the_most_recent_prompts_within_its_bytes(flux_dev):
    """A 100k-prompt set at 4 MB a FLUX prompt does not fit in host memory: the cache keeps
    the most recently used prompts up to prompt_cache_bytes and encodes the others again."""
    model = Trainer(_config(flux_dev, "flux")).model
    model.encode_prompts(PROMPTS)
    rows = model._prompt_cache[PROMPTS[0]]
    one = sum(t.numel() * t.element_size() for t in rows.values())
    model.prompt_cache_bytes = 2 * one
    batches = model.encoder_batches
    model.encode_prompts(["three green triangles"])  # the oldest (PROMPTS[0]) makes room
    assert list(model._prompt_cache) == [PROMPTS[1], "three green triangles"]
    model.encode_prompts([PROMPTS[1]])  # still cached: no encoder pass, and now the newest
    assert model.encoder_batches == batches + 1
    cond = model.encode_prompts([PROMPTS[0], "four red squares", PROMPTS[0]])
    assert model.encoder_batches == batches + 2  # one pass for both new prompts
    # this call's prompts are never dropped, even past the bound; the older ones are
    assert set(model._prompt_cache) == {PROMPTS[0], "four red squares"}
    assert cond["prompt_embeds"].shape[0] == 3
    torch.testing.assert_close(cond["prompt_embeds"][0], cond["prompt_embeds"][2])


def test_text_encoders_visit_a_device_and_come_back_to_their_host_copy():
    """The trip back from the GPU points the encoder at its host copy (no copy: the weights
    are frozen); the meta device stands in for a GPU on this CPU-only machine."""
    from trainer.models.host_resident import HostResident

    encoder = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    encoder.register_buffer("position_ids", torch.arange(4))
    before = {n: t.clone() for n, t in encoder.state_dict().items()}
    pointers = {n: t.data_ptr() for n, t in encoder.state_dict().items()}
    resident = HostResident(encoder, pin=False)
    with resident.visit(torch.device("meta")) as on_device:
        assert all(t.device.type == "meta" for t in on_device.state_dict().values())
    after = encoder.state_dict()
    assert {n: t.data_ptr() for n, t in after.items()} == pointers  # the same host memory
    for name, tensor in after.items():
        assert tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)
    assert resident.visits == 1
    with resident.visit(torch.device("cpu")):  # on a CPU run there is no trip
        pass
    assert resident.visits == 1


# ---------------------------------------------------------------------------------------
# 4. Checkpoints restore: full fine-tune, LoRA resume
# ---------------------------------------------------------------------------------------
def test_full_finetune_checkpoint_restores_the_transformer(flux_dev, tmp_path):
    config = _config(flux_dev, "flux", finetune="full")
    trainer = Trainer(config)
    base = _state(trainer.model.transformer)
    trainer.step()
    checkpoint = trainer.save_checkpoint(tmp_path)
    assert (checkpoint / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert not (checkpoint / LORA_WEIGHTS).exists()
    assert _changed(base, _state(trainer.model.transformer))

    restarted = Trainer(_config(flux_dev, "flux", finetune="full",
                                base_checkpoint=str(checkpoint)))
    _assert_same_state(restarted.model.transformer, trainer.model.transformer)
    _assert_same_state(load_checkpoint_model(checkpoint).transformer, trainer.model.transformer)
    # its model card names the checkpoint it continued from beside the base model
    card = model_card(restarted)
    assert f"from `{flux_dev}`\n- continued from the checkpoint `{checkpoint}`" in card
    # the card's snippet runs as it is, once its one line says where the directory is
    ran = run_card_snippet((checkpoint / "README.md").read_text(), checkpoint)
    _assert_same_state(ran["transformer"], trainer.model.transformer)
    assert ran["image"].size == (SIZE, SIZE)


def run_card_snippet(card: str, checkpoint: Path) -> dict:
    """The python block of a checkpoint's model card, run with its checkpoint line pointing
    at `checkpoint`: its variables (pipe, image, ...)."""
    code = card.split("```python\n", 1)[1].split("\n```", 1)[0]
    placeholder = 'checkpoint = "path/to/this/directory"'
    assert code.count(placeholder) == 1, code
    scope: dict = {}
    exec(code.replace(placeholder, f"checkpoint = {str(checkpoint)!r}"), scope)
    return scope


@pytest.mark.parametrize("method", ["neighbor", "sde"])
def test_lora_resume_continues_with_the_same_weights_and_optimizer(method, sd3, tmp_path):
    config = _config(sd3, "sd3", method=method)
    trainer = Trainer(config)
    trainer.step()
    checkpoint = trainer.save_checkpoint(tmp_path)

    resumed = Trainer(config)
    assert not torch.equal(*(next(p for n, p in t.model.transformer.named_parameters()
                                  if "lora_B" in n) for t in (trainer, resumed)))
    resumed.load_checkpoint(checkpoint)
    assert resumed.iteration == trainer.iteration == 1
    _assert_same_state(resumed.model.transformer, trainer.model.transformer)
    old, new = trainer.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert old["state"].keys() == new["state"].keys() and old["state"]
    for key, state in old["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(new["state"][key][name]))
    # and the next iteration is the one the uninterrupted run takes (same RNG, same update)
    trainer.step()
    resumed.step()
    assert resumed.iteration == 2
    for (name, a), b in zip(trainer.model.transformer.named_parameters(),
                            resumed.model.transformer.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------------------
# 4b. torch_compile: the compiled blocks compute what the eager ones do, and train
# ---------------------------------------------------------------------------------------
@pytest.mark.slow  # inductor compiles the tiny blocks' forward and backward: ~a minute on a CPU
def test_compiled_blocks_match_eager_and_train(flux_dev):
    from trainer.models.diffusers_flow import compile_blocks

    config = _config(flux_dev, "flux", torch_compile=True)
    compiled = load_flow_model(ModelSpec.from_config(config), "cpu")
    eager = load_flow_model(ModelSpec.from_config(_config(flux_dev, "flux")), "cpu")
    transformer = compiled.transformer
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert not any(b._compiled_call_impl is not None for b in eager.transformer.transformer_blocks)
    _assert_same_state(compiled.transformer, eager.transformer)  # names and LoRA unchanged

    x = torch.randn(len(PROMPTS), *compiled.latent_shape, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        v_compiled = compiled(x, t, compiled.encode_prompts(PROMPTS))
        v_eager = eager(x, t, eager.encode_prompts(PROMPTS))
    torch.testing.assert_close(v_compiled, v_eager, atol=1e-4, rtol=1e-4)

    # gradients reach the same adapters with the same values
    for model in (compiled, eager):
        model(x, t, model.encode_prompts(PROMPTS)).square().mean().backward()
    grads = {n: p.grad for n, p in compiled.transformer.named_parameters() if p.requires_grad}
    eager_grads = {n: p.grad for n, p in eager.transformer.named_parameters() if p.requires_grad}
    assert grads.keys() == eager_grads.keys() and all(g is not None for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], atol=1e-4, rtol=1e-3, msg=name)

    # and a whole iteration runs compiled (with checkpointing recomputing compiled blocks),
    # moving only the adapters
    trainer = Trainer(_config(flux_dev, "flux", torch_compile=True, gradient_checkpointing=True))
    before = _state(trainer.model.transformer)
    assert np.isfinite(trainer.step().metrics["loss"])
    changed = _changed(before, _state(trainer.model.transformer))
    assert changed and all("lora" in k for k in changed)
    with pytest.raises(ValueError, match="transformer_blocks"):
        compile_blocks(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_checkpointing_a_share_of_the_blocks_recomputes_only_those(flux_dev, fraction):
    """gradient_checkpointing_fraction: the chosen blocks run their forward again in the
    backward pass, the others once, and the gradients are those of no checkpointing."""
    from trainer.models.diffusers_flow import checkpointed_blocks, repeated_blocks

    models = {name: load_flow_model(ModelSpec.from_config(
                  _config(flux_dev, "flux", finetune="full", **extra)), "cpu")
              for name, extra in (("plain", {}), ("checkpointed", {
                  "gradient_checkpointing": True,
                  "gradient_checkpointing_fraction": fraction}))}
    blocks = repeated_blocks(models["checkpointed"].transformer)
    chosen = checkpointed_blocks(models["checkpointed"].transformer, fraction)
    assert len(chosen) == round(fraction * len(blocks)) and len(blocks) >= 2
    calls = {id(block): 0 for block in blocks}
    for block in blocks:
        block.register_forward_pre_hook(lambda module, _: calls.__setitem__(
            id(module), calls[id(module)] + 1) and None)
    x = torch.randn(len(PROMPTS), *models["plain"].latent_shape,
                    generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.3, 0.8])
    for model in models.values():
        model(x, t, model.encode_prompts(PROMPTS)).square().mean().backward()
    assert [calls[id(b)] for b in blocks] == [2 if b in chosen else 1 for b in blocks]
    plain = dict(models["plain"].transformer.named_parameters())
    for name, param in models["checkpointed"].transformer.named_parameters():
        torch.testing.assert_close(param.grad, plain[name].grad, atol=1e-6, rtol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------
# 5. Config and model-directory errors name what is wrong
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "field"), [
    ({"lora_rank": 0}, "lora_rank"),
    ({"model_path": ""}, "model_path"),
    ({"resolution": 24}, "resolution"),
    ({"model": "shapes", "model_path": "", "resolution": 0}, "finetune"),
    ({"model": "shapes", "model_path": "", "resolution": 0, "finetune": "full",
      "torch_compile": True}, "torch_compile"),
    # what only the diffusers adapters read is refused for shapes, not silently ignored
    ({"model": "shapes", "model_path": "", "resolution": 0, "finetune": "full",
      "gradient_checkpointing": True}, "gradient_checkpointing"),
    ({"model": "shapes", "model_path": "", "resolution": 0, "finetune": "full",
      "mixed_precision": "bf16"}, "mixed_precision"),
    ({"eval_every": 5}, "eval_every"),  # the periodic evaluation is the shapes world's
    # the shapes rewards count exact-colour shapes on 32x32 canvases: meaningless on FLUX's
    ({"reward_weights": {"jpeg_compressibility": 1.0, "count": 1.0}}, "reward_weights"),
    ({"reward_weights": {"attr_upper": 1.0}}, "reward_weights"),
    # a share of the blocks recomputed only means something with checkpointing on
    ({"gradient_checkpointing_fraction": 0.5}, "gradient_checkpointing_fraction"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_fraction": 0.0},
     "gradient_checkpointing_fraction"),
])
def test_config_errors_name_the_field(overrides, field, flux_dev):
    valid = {**PRESETS["tiny"], "model": "flux", "model_path": str(flux_dev), "finetune": "lora",
             "resolution": SIZE, "reward_weights": {"jpeg_compressibility": 1.0}}
    TrainConfig.from_dict(valid)
    with pytest.raises(ConfigErrors) as info:
        TrainConfig.from_dict({**valid, **overrides})
    assert [e.field for e in info.value.errors] == [field], info.value


def test_missing_or_incomplete_model_directory(flux_dev, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_flow_model(ModelSpec(name="flux", path=str(missing)))
    assert str(missing) in model_dir_problem("flux", missing)

    incomplete = shutil.copytree(flux_dev, tmp_path / "incomplete")
    assert model_dir_problem("flux", incomplete) is None
    (incomplete / "vae" / "config.json").unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_flow_model(ModelSpec(name="flux", path=str(incomplete), finetune="lora"))
    message = str(info.value)
    assert str(incomplete) in message and "vae/config.json" in message
    assert model_dir_problem("flux", incomplete) == message


def test_an_sd3_resolution_beyond_its_position_embedding_is_named_before_it_loads(
        sd3, flux_dev, tmp_path, capsys):
    """SD3's transformer embeds positions for at most pos_embed_max_size patches a side: a
    larger resolution (the tiny one's default 512 included) is said from the directory's
    config files, by the library before the weights load and by the CLI, not by diffusers in
    the first forward pass."""
    from trainer.models import resolution_limit_problem

    config = json.loads((sd3 / "transformer" / "config.json").read_text())
    vae = json.loads((sd3 / "vae" / "config.json").read_text())
    largest = (config["pos_embed_max_size"] * config["patch_size"]
               * 2 ** (len(vae["block_out_channels"]) - 1))
    assert resolution_limit_problem("sd3", sd3, largest) is None
    too_large = resolution_limit_problem("sd3", sd3, largest + 16)
    assert too_large == (f"this sd3 model draws at most {largest}x{largest} images (its "
                         f"transformer's pos_embed_max_size {config['pos_embed_max_size']} x "
                         f"patch_size {config['patch_size']} x the VAE's "
                         f"{2 ** (len(vae['block_out_channels']) - 1)}x), got {largest + 16}")
    assert resolution_limit_problem("sd3", sd3, 0).endswith("got 512 (the default)")
    assert resolution_limit_problem("flux", flux_dev, 4096) is None  # rotary positions
    with pytest.raises(ConfigError, match=re.escape(f"resolution: {too_large}")):
        load_flow_model(ModelSpec(name="sd3", path=str(sd3), resolution=largest + 16))
    load_flow_model(ModelSpec(name="sd3", path=str(sd3), resolution=largest))
    out, prompts = tmp_path / "samples", tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    assert cli_main(["sample", "--model", "sd3", "--model-path", str(sd3), "--prompts",
                     str(prompts), "--seeds", "1", "--steps", "1",
                     "--resolution", str(largest + 16), "--device", "cpu",
                     "--out", str(out)]) == 2
    assert f"--resolution: {too_large}" in capsys.readouterr().err and not out.exists()

def test_a_directory_of_the_other_model_is_named_before_it_loads(flux_dev, sd3, tmp_path,
                                                                   capsys):
    """An SD3 directory holds every file a FLUX one does: model_index.json's _class_name
    tells them apart, in model_dir_problem (the CLI's and the API's check) and the loader,
    before anything is written."""
    problem = model_dir_problem("flux", sd3)
    assert problem == (f"model directory {sd3} holds a StableDiffusion3Pipeline (model_index"
                       ".json's _class_name), not a 'flux' model (FluxPipeline); use model "
                       f"'sd3' for it, or point model_path at a 'flux' directory")
    assert "holds a FluxPipeline" in model_dir_problem("sd3", flux_dev)
    assert model_dir_problem("flux", flux_dev) is None and model_dir_problem("sd3", sd3) is None
    with pytest.raises(FileNotFoundError, match="holds a StableDiffusion3Pipeline"):
        load_flow_model(ModelSpec(name="flux", path=str(sd3)))

    out = tmp_path / "run"
    assert cli_main(["train", "--set", "model=flux", "--set", f"model_path={sd3}", "--set",
                     "device=cpu", "--set", 'prompts=["a cat"]', "--out", str(out),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: config field 'model_path': {problem}\n" and not out.exists()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    assert cli_main(["sample", "--model", "flux", "--model-path", str(sd3), "--prompts",
                     str(prompts), "--out", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: --model-path: {problem}"] and not out.exists()


def test_a_base_checkpoint_lora_that_does_not_fit_is_named(flux_dev, sd35, tmp_path, capsys):
    """A LoRA of another rank, or of another model, as base_checkpoint: a config error naming
    the field, the file and what differs, not load_state_dict's size-mismatch traceback.
    (SD3.5's LoRA: its attn2 layers are not FLUX's; the tiny SD3's layers all are, in the
    same shapes.)"""
    flux_lora = Trainer(_config(flux_dev, "flux")).save_checkpoint(tmp_path / "flux")
    sd3_lora = Trainer(_config(sd35, "sd3")).save_checkpoint(tmp_path / "sd3")
    lora_file = flux_lora / "pytorch_lora_weights.safetensors"
    with pytest.raises(ConfigError) as info:
        Trainer(_config(flux_dev, "flux", lora_rank=8, base_checkpoint=str(flux_lora)))
    assert str(info.value) == (f"base_checkpoint: {lora_file} holds a LoRA of rank 4; this "
                               "run's adapters have rank 8 (lora_rank)")
    # the same rank under another alpha would scale the adapter: not the checkpoint's model
    alpha = _config(flux_dev, "flux").lora_alpha
    with pytest.raises(ConfigError) as info:
        Trainer(_config(flux_dev, "flux", lora_alpha=alpha * 8, base_checkpoint=str(flux_lora)))
    assert str(info.value) == (f"base_checkpoint: {lora_file} holds a LoRA with lora_alpha "
                               f"{alpha:g}; this run's adapters have lora_alpha {alpha * 8:g} "
                               f"(set lora_alpha {alpha:g} to continue from it)")
    with pytest.raises(ValueError, match=re.escape(
            f"{sd3_lora / 'pytorch_lora_weights.safetensors'} holds the LoRA weights of "
            f"another model, not of this 'flux' model at {flux_dev}")):
        load_flow_model(ModelSpec(name="flux", path=str(flux_dev), finetune="lora",
                                  lora_rank=4, weights=str(sd3_lora)))

    out = tmp_path / "run"
    settings = {"model": "flux", "model_path": str(flux_dev), "finetune": "lora",
                "lora_rank": 4, "lora_alpha": 8.0, "resolution": SIZE, "device": "cpu",
                "reward_weights": {"jpeg_compressibility": 1.0}, "prompts": ["a cat"],
                "base_checkpoint": str(sd3_lora)}
    capsys.readouterr()
    assert cli_main(["train", "--config", "tiny", *_set_options(settings), "--out", str(out),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # (after diffusers' loading progress bars)
    # said from the checkpoint's headers before the model loads, as the studio's submission does
    assert "Traceback" not in err and "is a checkpoint of model 'sd3'; this run trains " \
        "'flux'" in line, err
    assert line.startswith("error: config field 'base_checkpoint': ")
    assert not out.exists()


# ---------------------------------------------------------------------------------------
# 6. The CLI samples FLUX, with and without a checkpoint
# ---------------------------------------------------------------------------------------
def test_cli_samples_flux_with_and_without_a_checkpoint(flux_dev, lora_runs, tmp_path, capsys):
    _, checkpoint = lora_runs["flux_dev"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    common = ["sample", "--model", "flux", "--model-path", str(flux_dev), "--prompts",
              str(prompts), "--seeds", "1", "--resolution", str(SIZE), "--steps", "2",
              "--device", "cpu"]

    outputs = {}
    for label, extra in (("checkpoint", ["--checkpoint", str(checkpoint)]), ("base", [])):
        out = tmp_path / label
        assert cli_main([*common, *extra, "--out", str(out)]) == 0
        files = sorted(out.glob("*.png"))
        assert [f.name for f in files] == ["00000_seed0.png", "00001_seed0.png"]
        outputs[label] = np.stack([np.asarray(Image.open(f)) for f in files])
        assert outputs[label].shape == (2, SIZE, SIZE, 3)

    # the same images as sampling the model directly (dpm++, the CLI's default solver)
    with_lora = load_checkpoint_model(checkpoint)
    base = load_flow_model(ModelSpec(name="flux", path=str(flux_dev), resolution=SIZE))
    for label, model in (("checkpoint", with_lora), ("base", base)):
        expected = sample_images(model, PROMPTS, [0, 0], "dpm++", 2)
        assert np.abs(outputs[label].astype(int) - expected.astype(int)).max() <= 1, label
    # the LoRA is applied when the checkpoint is given
    with torch.no_grad():
        noise = _noise(base)
        assert (_our_samples(with_lora, noise, 2) - _our_samples(base, noise, 2)).abs().max() \
            > 100 * SAMPLE_ATOL

    capsys.readouterr()
    assert cli_main(["sample", "--model", "flux", "--prompts", str(prompts), "--out",
                     str(tmp_path / "none"), "--device", "cpu"]) == 2
    assert "model-path" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    # an SD3 run's checkpoint under --model flux: refused, not applied to FLUX wherever the
    # tiny models' layer names happen to match
    _, sd3_checkpoint = lora_runs["sd3"]
    assert cli_main([*common, "--checkpoint", str(sd3_checkpoint), "--out",
                     str(tmp_path / "other")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --model: {sd3_checkpoint} is a checkpoint of model 'sd3', not 'flux': leave "
        "--model out (the checkpoint's run's is taken) or give a checkpoint of that model")
    assert not (tmp_path / "other").exists()


def test_cli_samples_a_checkpoint_alone_and_a_taken_away_lora(flux_dev, lora_runs, tmp_path,
                                                             capsys):
    """A checkpoint directory alone names its run's model and path; the LoRA as a user takes
    it away (the zip download: the weights and the model card, no trainer state) samples the
    same images once --model and --model-path name its base, and without them is refused."""
    from safetensors.torch import load_file, save_file

    from trainer.models import LORA_WEIGHTS, bare_lora_spec

    _, checkpoint = lora_runs["flux_dev"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    common = ["sample", "--prompts", str(prompts), "--seeds", "1", "--resolution", str(SIZE),
              "--steps", "2", "--device", "cpu"]
    away = tmp_path / "takeaway"
    away.mkdir()
    for name in (LORA_WEIGHTS, "README.md"):
        shutil.copy(checkpoint / name, away / name)
    runs = {"alone": ["--checkpoint", str(checkpoint)],
            "takeaway": ["--model", "flux", "--model-path", str(flux_dev),
                         "--checkpoint", str(away)]}
    outputs = {}
    for label, extra in runs.items():
        out = tmp_path / label
        assert cli_main([*common, *extra, "--out", str(out)]) == 0, capsys.readouterr().err
        outputs[label] = np.stack([np.asarray(Image.open(f)) for f in sorted(out.glob("*.png"))])
    expected = sample_images(load_checkpoint_model(checkpoint), PROMPTS, [0, 0], "dpm++", 2)
    for label, images in outputs.items():
        assert np.abs(images.astype(int) - expected.astype(int)).max() <= 1, label

    capsys.readouterr()
    assert cli_main([*common, "--checkpoint", str(away), "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "diffusers LoRA" in err and "--model" in err and not (tmp_path / "no").exists()

    # the adapter config comes from the file's metadata, as diffusers writes it; without
    # metadata (another tool's LoRA) from the tensors: rank and targets, alpha = rank
    trained = checkpoint_spec(checkpoint)
    spec = bare_lora_spec(away)
    assert (spec.finetune, spec.lora_rank, spec.lora_alpha) == \
        ("lora", trained.lora_rank, trained.lora_alpha)
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file(load_file(str(away / LORA_WEIGHTS)), str(bare / LORA_WEIGHTS))
    spec = bare_lora_spec(bare)
    assert (spec.lora_rank, spec.lora_alpha) == (trained.lora_rank, float(trained.lora_rank))
    model = load_flow_model(ModelSpec(name="flux", path=str(flux_dev), resolution=SIZE,
                                      finetune="lora", lora_rank=spec.lora_rank,
                                      lora_target_modules=spec.lora_target_modules))
    adapted = {n.split(".lora_A")[0] for n, _ in model.transformer.named_parameters()
               if ".lora_A." in n}
    assert adapted == set(spec.lora_target_modules)


def test_cli_samples_a_lora_file_as_the_checkpoint_download_names_it(flux_dev, lora_runs,
                                                                    tmp_path, capsys):
    """`GET /api/checkpoints/{id}/download` of a LoRA checkpoint serves its weights file as
    `job<N>-it<I>.safetensors` (load_lora_weights takes such a file as it is). As --checkpoint
    it was taken for a shapes file and then a full fine-tune of --model, failing after the
    model had loaded ("holds no transformer/...; this run has finetune='full'"): it samples
    what its checkpoint does, and without --model is refused as the zip's directory is."""
    from trainer.models import LORA_WEIGHTS

    _, checkpoint = lora_runs["flux_dev"]
    downloaded = tmp_path / "job1-it3.safetensors"
    shutil.copy(checkpoint / LORA_WEIGHTS, downloaded)
    spec = checkpoint_spec(downloaded)
    trained = checkpoint_spec(checkpoint)
    assert (spec.finetune, spec.lora_rank, spec.lora_alpha) == \
        ("lora", trained.lora_rank, trained.lora_alpha)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    common = ["sample", "--prompts", str(prompts), "--seeds", "1", "--resolution", str(SIZE),
              "--steps", "2", "--device", "cpu", "--checkpoint", str(downloaded)]
    out = tmp_path / "file"
    assert cli_main([*common, "--model", "flux", "--model-path", str(flux_dev),
                     "--out", str(out)]) == 0, capsys.readouterr().err
    images = np.stack([np.asarray(Image.open(f)) for f in sorted(out.glob("*.png"))])
    expected = sample_images(load_checkpoint_model(checkpoint), PROMPTS, [0, 0], "dpm++", 2)
    assert np.abs(images.astype(int) - expected.astype(int)).max() <= 1

    capsys.readouterr()
    assert cli_main([*common, "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "diffusers LoRA" in err and "--model" in err and not (tmp_path / "no").exists()


def test_a_lora_in_diffusers_older_key_format_samples_as_the_same_lora(flux_dev, lora_runs,
                                                                       tmp_path, capsys):
    """A LoRA whose tensors are named as diffusers' convert_state_dict_to_diffusers names them
    (`.lora.down.weight` / `.lora.up.weight`, which load_lora_weights reads) was refused as
    another model's LoRA; it samples what the same LoRA in peft's names does."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from trainer.models import LORA_WEIGHTS, bare_lora_spec

    _, checkpoint = lora_runs["flux_dev"]
    with safe_open(str(checkpoint / LORA_WEIGHTS), "pt") as f:
        metadata = f.metadata()
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    renamed = {k.replace(".lora_A.weight", ".lora.down.weight")
               .replace(".lora_B.weight", ".lora.up.weight"): v
               for k, v in load_file(str(checkpoint / LORA_WEIGHTS)).items()}
    assert not any("lora_A" in k or "lora_B" in k for k in renamed)
    save_file(renamed, str(legacy / LORA_WEIGHTS), metadata=metadata)
    trained, spec = checkpoint_spec(checkpoint), bare_lora_spec(legacy)
    assert (spec.lora_rank, spec.lora_alpha, spec.lora_target_modules) == \
        (trained.lora_rank, trained.lora_alpha, sorted(trained.lora_target_modules))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "out"
    assert cli_main(["sample", "--prompts", str(prompts), "--seeds", "1", "--resolution",
                     str(SIZE), "--steps", "2", "--device", "cpu", "--model", "flux",
                     "--model-path", str(flux_dev), "--checkpoint", str(legacy),
                     "--out", str(out)]) == 0, capsys.readouterr().err
    images = np.stack([np.asarray(Image.open(f)) for f in sorted(out.glob("*.png"))])
    expected = sample_images(load_checkpoint_model(checkpoint), PROMPTS, [0, 0], "dpm++", 2)
    assert np.abs(images.astype(int) - expected.astype(int)).max() <= 1


# ---------------------------------------------------------------------------------------
# 6b. The CLI trains a FLUX LoRA, resumes it and evaluates its checkpoints
# ---------------------------------------------------------------------------------------
# the flux-lora preset (what `train --set model=flux` starts from) cut down to seconds on a
# CPU: tiny groups and steps, no compilation (a minute of inductor), a high learning rate so
# the LoRA moves far from zero in two iterations; rollout_batch_size 3 splits each group of
# 4 into batches of 3 and 1, which `evaluate` then takes as its default batch size
CLI_RUN_ROLLOUT_BATCH = 3
CLI_FLUX_SETTINGS = {"finetune": "lora", "resolution": SIZE, "iterations": 2,
                     "checkpoint_every": 1, "sample_every": 1, "group_size": 4,
                     "num_anchors": 2, "num_train_timesteps": 2, "rollout_steps": 4,
                     "torch_compile": False, "lora_rank": 4, "lora_alpha": 8.0,
                     "learning_rate": 1e-2, "rollout_batch_size": CLI_RUN_ROLLOUT_BATCH,
                     "prompts": PROMPTS, "device": "cpu"}


def _set_options(settings: dict) -> list[str]:
    return [arg for key, value in settings.items()
            for arg in ("--set", f"{key}={json.dumps(value)}")]


@pytest.fixture(scope="module")
def cli_flux_run(flux_dev, tmp_path_factory) -> Path:
    """A run directory of `python -m trainer train --set model=flux ...`: 2 iterations, a
    checkpoint each."""
    out = tmp_path_factory.mktemp("cli-flux") / "run"
    argv = ["train", "--set", "model=flux", "--set", f"model_path={flux_dev}",
            *_set_options(CLI_FLUX_SETTINGS), "--out", str(out), "--no-progress"]
    assert cli_main(argv) == 0
    return out


def test_cli_trains_a_flux_lora_the_stock_pipeline_loads_and_resumes_it(cli_flux_run, flux_dev,
                                                                        tmp_path, capsys):
    from diffusers import FluxPipeline

    saved = json.loads((cli_flux_run / "config.json").read_text())
    # the flux-lora preset underneath the --set fields (gradient checkpointing is its own)
    assert saved["model"] == "flux" and saved["finetune"] == "lora"
    assert saved["gradient_checkpointing"] is True and saved["train_batch_size"] == 4
    checkpoints = sorted(p.name for p in (cli_flux_run / "checkpoints").iterdir())
    assert checkpoints == ["iter-000001", "iter-000002"]
    for name in checkpoints:
        directory = cli_flux_run / "checkpoints" / name
        assert (directory / LORA_WEIGHTS).is_file()
        card = (directory / "README.md").read_text()
        assert "FluxPipeline" in card and str(flux_dev) in card
        # sampled as trained: the run's guidance and size, not the pipeline's defaults
        assert (f'image = pipe("a prompt", height={saved["resolution"] or 512}, '
                f'width={saved["resolution"] or 512}, guidance_scale={saved["guidance_scale"]})'
                in card), card
        assert f"{int(name.split('-')[1])} of 2 iterations" in card
    ran = run_card_snippet(card, directory)  # the LoRA card's snippet runs as it is
    assert ran["image"].size == (saved["resolution"], saved["resolution"])
    metrics = [json.loads(line) for line in
               (cli_flux_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2]
    grid = Image.open(cli_flux_run / "samples" / "iter-000002.png")
    assert grid.size == (4 * (SIZE + 1) * 2, 1 * (SIZE + 1) * 2)  # 32 px tiles, doubled

    # the stock pipeline loads the LoRA as written, and samples what the trainer's own
    # checkpoint loader does (same noise and schedule; SAMPLE_ATOL as above)
    newest = cli_flux_run / "checkpoints" / "iter-000002"
    ours = load_checkpoint_model(newest)
    noise = _noise(ours)
    pipe = FluxPipeline.from_pretrained(flux_dev, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    base = _pipeline_samples(pipe, "flux", noise, 3, saved["guidance_scale"])
    pipe.load_lora_weights(newest)
    stock = _pipeline_samples(pipe, "flux", noise, 3, saved["guidance_scale"])
    assert (stock - base).abs().max() > 100 * SAMPLE_ATOL  # the LoRA trained
    torch.testing.assert_close(stock, _our_samples(ours, noise, 3), rtol=0, atol=SAMPLE_ATOL)

    # --resume continues from iter-2 with the run's saved config (only the new budget given):
    # iteration 1 is not redone (its files, removed here, do not come back)
    resumed = shutil.copytree(cli_flux_run, tmp_path / "run")
    shutil.rmtree(resumed / "checkpoints" / "iter-000001")
    (resumed / "samples" / "iter-000001.png").unlink()
    assert cli_main(["train", "--out", str(resumed), "--resume", "--set", "iterations=3",
                     "--no-progress"]) == 0
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == \
        ["iter-000002", "iter-000003"]
    # the command line's fields are judged as the run's, not the shapes preset's: the same
    # lora_rank again was "applies only to finetune='lora'"; a new one names the saved value
    assert cli_main(["train", "--out", str(resumed), "--resume", "--set", "iterations=3",
                     "--set", f"lora_rank={saved['lora_rank']}", "--no-progress"]) == 2
    assert "at iteration 3 already" in capsys.readouterr().err
    assert cli_main(["train", "--out", str(resumed), "--resume", "--set", "iterations=4",
                     "--set", f"lora_rank={saved['lora_rank'] * 2}", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: config field 'lora_rank': is {saved['lora_rank']} in the run being resumed")
    assert not (resumed / "samples" / "iter-000001.png").exists()
    metrics = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    third = resumed / "checkpoints" / "iter-000003"
    assert (third / LORA_WEIGHTS).is_file() and "3 of 3 iterations" in \
        (third / "README.md").read_text()
    assert checkpoint_spec(third).path == str(flux_dev)  # the saved config's model


def _spy_on_decodes(monkeypatch) -> list[int]:
    """The batch size of every VAE decode from now on (the real decode still runs)."""
    from diffusers import AutoencoderKL

    decode, batches = AutoencoderKL.decode, []

    def recording_decode(self, z, *args, **kwargs):
        batches.append(z.shape[0])
        return decode(self, z, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKL, "decode", recording_decode)
    return batches


def test_cli_evaluates_flux_lora_checkpoints_in_batches(cli_flux_run, flux_dev, tmp_path,
                                                        capsys, monkeypatch):
    checkpoint = cli_flux_run / "checkpoints" / "iter-000002"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    common = ["evaluate", "--model", "flux", "--model-path", str(flux_dev), "--prompts-file",
              str(prompts), "--seeds", "2", "--steps", "2", "--device", "cpu",
              "--resolution", str(SIZE)]  # a LoRA taken away would sample at FLUX's 512 px
    batches = _spy_on_decodes(monkeypatch)
    results = {}
    for label, extra in (("default", []), ("one", ["--batch-size", "1"])):
        out = tmp_path / f"{label}.json"
        capsys.readouterr()
        assert cli_main([*common, "--checkpoint", str(checkpoint), *extra,
                         "--out", str(out)]) == 0, capsys.readouterr().err
        results[label] = json.loads(out.read_text())
        assert results[label]["samples"] == 4 and results[label]["checkpoint"] == str(checkpoint)
        assert "mean jpeg_compressibility" in capsys.readouterr().err
    # the default is the checkpoint's run's rollout_batch_size: 4 images in batches of 3 and
    # 1 (not the 256 at once that would decode hundreds of 512 px images on a real model)
    assert results["default"]["batch_size"] == CLI_RUN_ROLLOUT_BATCH
    assert results["one"]["batch_size"] == 1
    assert batches == [CLI_RUN_ROLLOUT_BATCH, 1, 1, 1, 1, 1]
    # batching does not change the images (up to float rounding, which can move a pixel by
    # one level and a JPEG by a few bytes): the same scores
    default, one = (results[k]["rewards"]["jpeg_compressibility"] for k in ("default", "one"))
    assert np.isfinite(default["mean"])
    assert one["mean"] == pytest.approx(default["mean"], rel=0.01, abs=1e-3)

    # a LoRA taken away (no run config): the flux preset's rollout_batch_size
    away = tmp_path / "takeaway"
    away.mkdir()
    shutil.copy(checkpoint / LORA_WEIGHTS, away / LORA_WEIGHTS)
    del batches[:]
    assert cli_main([*common, "--checkpoint", str(away), "--out", str(tmp_path / "away.json")]) == 0
    preset_batch = PRESETS["flux-lora"]["rollout_batch_size"]
    assert json.loads((tmp_path / "away.json").read_text())["batch_size"] == preset_batch
    assert batches == [min(4, preset_batch)]

    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # argparse's, with the other options' types
        cli_main([*common, "--checkpoint", str(checkpoint), "--batch-size", "0"])
    assert refused.value.code == 2
    assert "error: argument --batch-size: must be an integer >= 1" in capsys.readouterr().err


def test_cli_sample_takes_a_batch_size(cli_flux_run, tmp_path, capsys, monkeypatch):
    checkpoint = cli_flux_run / "checkpoints" / "iter-000001"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    common = ["sample", "--checkpoint", str(checkpoint), "--prompts", str(prompts), "--seeds",
              "2", "--steps", "2", "--device", "cpu"]
    batches = _spy_on_decodes(monkeypatch)
    images = {}
    for label, extra in (("default", []), ("two", ["--batch-size", "2"])):
        out = tmp_path / label
        assert cli_main([*common, *extra, "--out", str(out)]) == 0, capsys.readouterr().err
        images[label] = np.stack([np.asarray(Image.open(f)) for f in sorted(out.glob("*.png"))])
    assert batches == [CLI_RUN_ROLLOUT_BATCH, 1, 2, 2]  # the run's default, then --batch-size
    assert images["default"].shape == (4, SIZE, SIZE, 3)
    assert np.abs(images["two"].astype(int) - images["default"].astype(int)).max() <= 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        cli_main([*common, "--batch-size", "0", "--out", str(tmp_path / "no")])
    assert refused.value.code == 2
    assert "error: argument --batch-size: must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_cli_train_errors_name_the_config_field(flux_dev, tmp_path, capsys):
    """A model directory that is missing or incomplete, or a LoRA rank of 0: exit code 2 and
    a message naming the field (and for the directory, the files expected), as the API's
    422, before the run directory is written."""
    out = tmp_path / "run"
    train = ["train", "--set", "model=flux", "--set", "finetune=lora", "--set", "device=cpu",
             "--set", 'prompts=["a cat"]', "--out", str(out), "--no-progress"]
    missing = tmp_path / "nope"
    incomplete = shutil.copytree(flux_dev, tmp_path / "incomplete")
    (incomplete / "vae" / "config.json").unlink()
    for path, wanted in ((missing, "does not exist"), (incomplete, "missing vae/config.json")):
        capsys.readouterr()
        assert cli_main([*train, "--set", f"model_path={path}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: config field 'model_path': model directory {path} ")
        assert wanted in err
        # the files a diffusers-format FLUX directory holds
        assert all(f in err for f in ("model_index.json", "transformer/config.json",
                                      "vae/config.json")), err
        assert not out.exists()

    assert cli_main([*train, "--set", f"model_path={flux_dev}", "--set", "lora_rank=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config field 'lora_rank': ") and "model_path" not in err
    assert not out.exists()
    # a target that names no layer: said from the weights' headers before the model loads
    # (peft's "Target modules {'nope_proj'} not found" came after, naming no field)
    assert cli_main([*train, "--set", f"model_path={flux_dev}",
                     "--set", 'lora_target_modules=["nope_proj"]']) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config field 'lora_target_modules': none of ['nope_proj'] "
                          "names a layer"), err
    assert not out.exists()
    # the library says it too, before loading
    from trainer.models import ModelSpec, load_flow_model

    with pytest.raises(ValueError, match="lora_target_modules: none of"):
        load_flow_model(ModelSpec(name="flux", path=str(flux_dev), finetune="lora",
                                  lora_target_modules=["nope_proj"]))


# ---------------------------------------------------------------------------------------
# 7. Micro-batching does not change results
# ---------------------------------------------------------------------------------------
def _params_after_one_iteration(config: TrainConfig) -> tuple[dict, dict]:
    """The trained parameters before and after one iteration."""
    trainer = Trainer(config)
    params = dict(trainer.model.transformer.named_parameters())
    names = [n for n, p in params.items() if p.requires_grad]
    before = {n: params[n].detach().clone() for n in names}
    trainer.step()
    return before, {n: params[n].detach().clone() for n in names}


@pytest.mark.parametrize("variant", ["flux_dev", "sd35"])
def test_bf16_base_trains_fp32_adapters(variant, request):
    """mixed_precision bf16 (the CUDA default, asked for here on the CPU): the frozen base
    holds bf16 weights, the LoRA adapters the optimizer updates are fp32, and an iteration's
    loss and update are finite."""
    trainer = Trainer(_config(request.getfixturevalue(variant), VARIANTS[variant],
                              mixed_precision="bf16"))
    named = dict(trainer.model.transformer.named_parameters())
    lora = {n: p for n, p in named.items() if "lora" in n}
    base = {n: p for n, p in named.items() if "lora" not in n}
    assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora.values())
    assert base and all(p.dtype == torch.bfloat16 and not p.requires_grad
                        for p in base.values())
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in lora.values()}
    before = {n: p.detach().clone() for n, p in lora.items()}
    result = trainer.step()
    assert np.isfinite(result.metrics["loss"])
    assert all(torch.isfinite(p).all() for p in lora.values())
    assert any(not torch.equal(before[n], p) for n, p in lora.items())
    assert all(p.dtype == torch.float32 for p in lora.values())  # still fp32 after the step


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_a_sampled_checkpoint_loads_in_the_compute_dtype_without_gradients(flux_dev, tmp_path,
                                                                           finetune):
    """What sample, evaluate and the studio's sampling jobs load (`inference_only`): under
    bf16 the transformer stays bf16 (a full fine-tune's fp32 masters doubled FLUX's weights
    on the card), nothing takes gradients and no block is checkpointed; a LoRA's adapters
    hold the checkpoint's values in fp32, as the run trained them."""
    trainer = Trainer(_config(flux_dev, "flux", finetune=finetune, mixed_precision="bf16",
                              gradient_checkpointing=True))
    trainer.step()
    model = load_checkpoint_model(trainer.save_checkpoint(tmp_path))
    assert model.spec.inference_only and not model.transformer.is_gradient_checkpointing
    named = dict(model.transformer.named_parameters())
    assert not any(p.requires_grad for p in named.values())
    base = {n: p for n, p in named.items() if "lora" not in n}
    assert base and all(p.dtype == torch.bfloat16 for p in base.values())
    trained = {n: p for n, p in trainer.model.transformer.named_parameters() if p.requires_grad}
    lora = {n: p for n, p in named.items() if "lora" in n}
    if finetune == "lora":
        assert lora.keys() == trained.keys()
        assert all(p.dtype == torch.float32 and torch.equal(p, trained[n])
                   for n, p in lora.items())
    else:  # the fp32 masters, rounded to the compute dtype
        assert not lora and all(torch.equal(base[n], p.detach().bfloat16())
                                for n, p in trained.items())
    # and the command line's sample / evaluate load the base the same way
    from trainer.cli import _model_spec, build_parser

    args = build_parser().parse_args(["sample", "--model", "flux", "--model-path",
                                      str(flux_dev), "--prompts", "p.txt", "--out", "out"])
    assert _model_spec(args).inference_only


def test_sample_and_evaluate_take_the_runs_precision_unless_told_otherwise(flux_dev, lora_runs,
                                                                          tmp_path, capsys):
    """--mixed-precision, as the train config's field: left out, a checkpoint's run's (here
    'auto', fp32 on the CPU); given, it decides the dtype the weights load in; evaluate's
    JSON says which; the shapes model, which has no bf16 path, refuses bf16 in one line."""
    from trainer.cli import _model_spec, build_parser

    _, checkpoint = lora_runs["flux_dev"]
    common = ["sample", "--checkpoint", str(checkpoint), "--prompts", "p.txt", "--out", "out"]
    dtypes = {}
    for given in (None, "bf16", "no"):
        spec = _model_spec(build_parser().parse_args(
            [*common, *(["--mixed-precision", given] if given else [])]))
        assert spec.mixed_precision == (given or "auto")
        model = load_flow_model(spec, device="cpu")
        dtypes[given] = {p.dtype for n, p in model.transformer.named_parameters()
                         if "lora" not in n}
    assert dtypes == {None: {torch.float32}, "bf16": {torch.bfloat16}, "no": {torch.float32}}

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "bf16.json"
    assert cli_main(["evaluate", "--checkpoint", str(checkpoint), "--prompts-file", str(prompts),
                     "--seeds", "1", "--steps", "1", "--device", "cpu", "--mixed-precision",
                     "bf16", "--out", str(out)]) == 0, capsys.readouterr().err
    setting = json.loads(out.read_text())["setting"]
    assert (setting["mixed_precision"], setting["dtype"]) == ("bf16", "bfloat16")
    assert cli_main(["evaluate", "--checkpoint", str(checkpoint), "--prompts-file", str(prompts),
                     "--seeds", "1", "--steps", "1", "--device", "cpu", "--out", str(out)]) == 0
    setting = json.loads(out.read_text())["setting"]
    assert (setting["mixed_precision"], setting["dtype"]) == ("auto", "float32")  # on a CPU

    capsys.readouterr()
    assert cli_main(["sample", "--prompts", str(prompts), "--out", str(tmp_path / "shapes"),
                     "--device", "cpu", "--mixed-precision", "bf16"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --mixed-precision: the shapes model samples in fp32; use 'auto' or 'no' "
        "('bf16' is for flux and sd3)"]
    assert not (tmp_path / "shapes").exists()


@pytest.mark.parametrize(("variant", "method"), [("flux_dev", "neighbor"), ("sd3", "neighbor"),
                                                 ("flux_schnell", "sde"), ("sd3", "sde")])
def test_micro_batches_give_the_same_update(variant, method, request):
    directory, model = request.getfixturevalue(variant), VARIANTS[variant]
    start, whole = _params_after_one_iteration(_config(directory, model, method=method))
    # the rollouts go 3 at a time (P x G = 8 rows: a ragged last batch); the SDE baseline's
    # step noise is drawn for every row at once, so its trajectories do not move either
    start_split, split = _params_after_one_iteration(_config(
        directory, model, method=method, train_batch_size=1, rollout_batch_size=3))
    assert whole.keys() == split.keys() and all("lora" in n for n in whole)
    for name in whole:
        assert torch.equal(start[name], start_split[name]), name  # the same seed, same init
        # float32 sums taken in another order: differences of rounding size (~1e-7 here),
        # far below the ~lr (1e-3) steps that the weights moved by
        torch.testing.assert_close(split[name], whole[name], rtol=0, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    moved = max((whole[n] - start[n]).abs().max().item() for n in whole)
    assert moved > 1e-4  # the iteration did update the weights compared


def test_lora_initialization_comes_from_the_run_seed(flux_schnell):
    state = torch.random.get_rng_state()
    first, again, other = (
        {n: p.detach() for n, p in Trainer(_config(flux_schnell, "flux", seed=seed))
         .model.transformer.named_parameters() if "lora_A" in n} for seed in (3, 3, 4))
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    assert first and all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)


@pytest.mark.parametrize(("variant", "mixed_precision"),
                         [("flux_dev", "bf16"), ("flux_dev", "no"), ("sd3", "bf16")])
def test_full_finetune_kl_reference_is_a_frozen_copy_in_the_compute_dtype(variant,
                                                                           mixed_precision,
                                                                           request):
    """kl_coefficient > 0 with full fine-tuning: the reference is a separate frozen copy of
    the base transformer, its weights in the compute dtype (bf16 under mixed precision, with
    no fp32 detour), that gives the policy's own velocity before training and stays the base
    while the policy trains."""
    trainer = Trainer(_config(request.getfixturevalue(variant), VARIANTS[variant],
                              finetune="full", kl_coefficient=0.1,
                              mixed_precision=mixed_precision))
    model, reference = trainer.model, trainer.reference
    frozen = reference.frozen
    compute = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    assert {p.dtype for p in frozen.parameters()} == {compute}
    assert not any(p.requires_grad for p in frozen.parameters())
    policy_state = _state(model.transformer)
    for name, value in frozen.state_dict().items():  # the base's weights, cast
        assert torch.equal(value, policy_state[name].to(value.dtype)), name
    assert {id(p) for p in frozen.parameters()}.isdisjoint(
        id(p) for p in model.trainable_parameters())

    x = _noise(model)
    t = torch.full((x.shape[0],), 0.5)
    cond = model.encode_prompts(PROMPTS[:1] * x.shape[0])
    with torch.no_grad():
        torch.testing.assert_close(reference(x, t, cond), model(x, t, cond),
                                   rtol=0.05 if compute == torch.bfloat16 else 1e-5,
                                   atol=0.05 if compute == torch.bfloat16 else 1e-5)
    base = _state(frozen)
    trainer.step()
    assert not _changed(base, _state(frozen))  # the reference did not train
    assert _changed(policy_state, _state(model.transformer))  # the policy did


@pytest.mark.parametrize("variant", ["flux_dev", "sd3"])
def test_lora_kl_reference_is_the_same_model_with_its_adapters_off(variant, request):
    """kl_coefficient > 0 with LoRA: no second transformer (TRL's way); the reference is the
    policy's own transformer with the adapters disabled, so after training it still gives
    the base's velocity while the policy's has moved, and the adapters are on again after."""
    trainer = Trainer(_config(request.getfixturevalue(variant), VARIANTS[variant],
                              kl_coefficient=0.1, learning_rate=1e-2))
    model, reference = trainer.model, trainer.reference
    assert reference.frozen is None  # no copy of the transformer
    assert {id(p) for p in reference.parameters()}.isdisjoint(id(p) for p in model.parameters())
    x = _noise(model)
    t = torch.full((x.shape[0],), 0.5)
    cond = model.encode_prompts(PROMPTS[:1] * x.shape[0])
    with torch.no_grad():
        before = model(x, t, cond)
        torch.testing.assert_close(reference(x, t, cond), before)
    for _ in range(3):
        trainer.step()
    with torch.no_grad():
        after, base = model(x, t, cond), reference(x, t, cond)
        assert (after - before).abs().max() > 1e-3  # the adapters trained away from zero
        torch.testing.assert_close(base, before)  # the reference did not move
        torch.testing.assert_close(model(x, t, cond), after)  # adapters back on


def test_a_lora_continued_from_an_earlier_lora_is_held_to_where_it_started(flux_dev, tmp_path):
    """base_checkpoint naming an earlier LoRA, with a KL penalty: the reference is that LoRA
    on the base (a frozen second adapter), as a full fine-tune's is its base_checkpoint, not
    the base alone with the adapters off; it stays so while the run trains and after a
    resume, and the checkpoints hold the trained adapter alone."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    earlier = Trainer(_config(flux_dev, "flux", learning_rate=1e-2))
    for _ in range(3):
        earlier.step()
    start = earlier.save_checkpoint(tmp_path / "earlier")
    config = _config(flux_dev, "flux", kl_coefficient=0.1, learning_rate=1e-2,
                     base_checkpoint=str(start))
    trainer = Trainer(config)
    model, reference = trainer.model, trainer.reference
    x = _noise(model)
    t = torch.full((x.shape[0],), 0.5)
    cond = model.encode_prompts(PROMPTS[:1] * x.shape[0])
    with torch.no_grad():
        started = model(x, t, cond)
        torch.testing.assert_close(reference(x, t, cond), started)  # where the run starts
        model.transformer.disable_adapters()
        base = model(x, t, cond)
        model.transformer.enable_adapters()
        assert (started - base).abs().max() > 1e-3  # the earlier LoRA moved it from the base
    trained = {n for n, p in model.transformer.named_parameters() if p.requires_grad}
    assert trained and all(".default." in n for n in trained)
    assert {id(p) for p in model.trainable_parameters()} == {
        id(p) for n, p in model.transformer.named_parameters() if n in trained}
    for _ in range(2):
        trainer.step()
    assert {n for n, p in model.transformer.named_parameters() if p.requires_grad} == trained
    with torch.no_grad():
        moved = model(x, t, cond)
        assert (moved - started).abs().max() > 1e-3
        torch.testing.assert_close(reference(x, t, cond), started)  # the reference did not
        torch.testing.assert_close(model(x, t, cond), moved)  # the trained adapter is back
    checkpoint = trainer.save_checkpoint(tmp_path / "run")
    saved = load_file(str(checkpoint / LORA_WEIGHTS))
    assert saved.keys() == load_file(str(start / LORA_WEIGHTS)).keys()
    assert not any("reference" in k for k in saved)
    # a resume loads its checkpoint into the trained adapter; the reference stays the start
    resumed = Trainer(config)
    resumed.load_checkpoint(checkpoint)
    with torch.no_grad():
        torch.testing.assert_close(resumed.model(x, t, cond), moved)
        torch.testing.assert_close(resumed.reference(x, t, cond), started)
    assert get_peft_model_state_dict(resumed.model.transformer).keys() == \
        get_peft_model_state_dict(model.transformer).keys()


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_staged_model_is_set_up_for_its_device_with_its_weights_in_cpu_memory(finetune,
                                                                              flux_dev):
    """What a sharded run's ranks load (`stage_on_cpu`): the frozen VAE on the rank's device
    and the transformer left in CPU memory, for FSDP to move one unit at a time. The meta
    device stands in for the card here: placing on it is visible without one."""
    spec = ModelSpec.from_config(_config(flux_dev, "flux", finetune=finetune))
    staged = load_flow_model(spec, device="meta", stage_on_cpu=True)
    assert {p.device.type for p in staged.parameters()} == {"cpu"}
    assert {p.device.type for p in staged.pipeline.vae.parameters()} == {"meta"}
    # the same spec loaded as a single process does: everything on the device
    placed = load_flow_model(spec, device="meta")
    assert {p.device.type for p in placed.parameters()} == {"meta"}
    assert staged.state_dict().keys() == placed.state_dict().keys()


def test_a_staged_full_fine_tune_keeps_its_weights_in_the_loaded_dtype(flux_dev):
    """Staged for sharding, full fine-tuning's weights stay in CPU memory in the dtype they
    were loaded in (bf16 here: half a whole fp32 copy of host memory; the sharded run makes
    the fp32 masters shard by shard on the card). Loaded for one process they are fp32
    masters at once; both are trainable and equal after the upcast."""
    spec = ModelSpec.from_config(_config(flux_dev, "flux", finetune="full",
                                         mixed_precision="bf16"))
    staged = load_flow_model(spec, device="cpu", stage_on_cpu=True)
    placed = load_flow_model(spec, device="cpu")
    assert {p.dtype for p in staged.trainable_parameters()} == {torch.bfloat16}
    assert {p.dtype for p in placed.trainable_parameters()} == {torch.float32}
    assert len(staged.trainable_parameters()) == len(list(staged.transformer.parameters()))
    upcast = staged.to(torch.float32).state_dict()
    assert all(torch.equal(upcast[k], v) for k, v in placed.state_dict().items())


def test_a_sharded_transformer_missing_a_shard_is_named_before_it_loads(flux_dev, tmp_path):
    """FLUX.1-dev's transformer is saved in shards with an index: one shard missing passed the
    directory check and failed inside diffusers after the others had loaded."""
    from diffusers import FluxTransformer2DModel

    sharded = shutil.copytree(flux_dev, tmp_path / "sharded")
    folder = sharded / "transformer"
    for stale in folder.glob("diffusion_pytorch_model*"):
        stale.unlink()
    FluxTransformer2DModel.from_pretrained(flux_dev, subfolder="transformer").save_pretrained(
        folder, max_shard_size="20KB")
    shards = sorted(folder.glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) >= 3 and (folder / "diffusion_pytorch_model.safetensors.index.json")
    assert model_dir_problem("flux", sharded) is None
    shards[1].unlink()
    problem = model_dir_problem("flux", sharded)
    assert problem is not None and f"missing transformer/{shards[1].name}" in problem, problem
    with pytest.raises(FileNotFoundError, match=re.escape(shards[1].name)):
        load_flow_model(ModelSpec(name="flux", path=str(sharded), finetune="lora"))


def test_a_base_model_samples_at_the_guidance_its_runs_sample_at(sd3, flux_dev):
    """sample / evaluate of the sd3 base used the field default 3.5, its runs' checkpoints
    sd3-lora's 4.5: a before-and-after comparison changed the guidance too. (The studio's base
    rows and a base's rollouts take ModelSpec.base too.)"""
    from trainer.cli import _model_spec, build_parser
    from trainer.models import ModelSpec

    assert PRESETS["sd3-lora"]["guidance_scale"] != ModelSpec().guidance_scale
    for model, path in (("sd3", sd3), ("flux", flux_dev)):
        want = PRESETS[f"{model}-lora"]["guidance_scale"]
        common = ["evaluate", "--model", model, "--model-path", str(path), "--resolution", "32",
                  "--prompts-file", "p.txt"]
        assert _model_spec(build_parser().parse_args(common)).guidance_scale == want, model
        given = _model_spec(build_parser().parse_args([*common, "--guidance-scale", "2"]))
        assert given.guidance_scale == 2.0
        assert ModelSpec.base(model, str(path)).guidance_scale == want


def test_the_library_trainer_says_a_bad_model_directory_beside_the_prompts(tmp_path):
    """Trainer(config) raised the missing prompts alone, then, with prompts, a
    FileNotFoundError for the model directory (a directory of the other model said as
    "not found" too): every problem at once, as ConfigErrors naming the fields."""
    from tiny_diffusers import write_tiny_sd3

    from trainer.config import load_config
    from trainer.loop import Trainer

    config = load_config(None, {"model": "flux", "model_path": str(tmp_path / "nope"),
                                "device": "cpu"})
    with pytest.raises(ConfigErrors) as error:
        Trainer(config)
    assert [e.field for e in error.value.errors] == ["prompts", "model_path"], error.value
    assert "does not exist" in error.value.errors[1].message
    write_tiny_sd3(tmp_path / "sd3")
    config = load_config(None, {"model": "flux", "model_path": str(tmp_path / "sd3"),
                                "device": "cpu", "prompts": ["a cat"]})
    with pytest.raises(ConfigError) as one:
        Trainer(config)
    assert one.value.field == "model_path" and "not a 'flux' model" in one.value.message
