"""The tiny FLUX and SD3 directories (tests/tiny_diffusers.py) load and run in the stock
diffusers pipelines, and the pipelines' calling conventions that a model adapter copies
(timestep scaling, packing, shift, CFG, latent scaling, LoRA file) hold: each is redone by hand
here and checked against the pipeline's own result."""

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_diffusers import write_tiny_flux, write_tiny_sd3

PROMPTS = ["one red circle", "Two blue squares, left!"]
SIZE = 32


def _flux(path):
    from diffusers import FluxPipeline  # lazily: importing diffusers costs every collection seconds

    pipe = FluxPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sd3(path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _weights(directory) -> dict[str, dict[str, torch.Tensor]]:
    return {f.relative_to(directory).as_posix(): load_file(f)
            for f in sorted(directory.rglob("*.safetensors"))}


@pytest.mark.parametrize("variant", ["flux_dev", "flux_schnell"])
def test_flux_loads_and_generates_images_of_the_asked_size(variant, request):
    pipe = _flux(request.getfixturevalue(variant))
    assert pipe.transformer.config.guidance_embeds == (variant == "flux_dev")
    assert pipe.scheduler.config.use_dynamic_shifting == (variant == "flux_dev")
    assert pipe.vae_scale_factor == 2 and pipe.tokenizer_max_length == 77
    images = pipe(PROMPTS, height=SIZE, width=SIZE, num_inference_steps=2, guidance_scale=3.5,
                  generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (2, SIZE, SIZE, 3)
    assert np.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    assert not np.allclose(images[0], images[1])  # different prompts and noise
    pil = pipe(PROMPTS[0], height=SIZE, width=2 * SIZE, num_inference_steps=2,
               generator=torch.Generator().manual_seed(0)).images[0]
    assert pil.size == (2 * SIZE, SIZE)


def test_sd3_loads_and_generates_images_of_the_asked_size(sd3):
    pipe = _sd3(sd3)
    assert pipe.vae_scale_factor == 2 and pipe.patch_size == 2
    images = pipe(PROMPTS, height=SIZE, width=SIZE, num_inference_steps=2, guidance_scale=4.0,
                  generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (2, SIZE, SIZE, 3)
    assert np.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    pil = pipe(PROMPTS[0], height=2 * SIZE, width=SIZE, num_inference_steps=2,
               generator=torch.Generator().manual_seed(0)).images[0]
    assert pil.size == (SIZE, 2 * SIZE)


def test_encode_prompt_shapes(flux_dev, sd3):
    flux = _flux(flux_dev)
    embeds, pooled, text_ids = flux.encode_prompt(PROMPTS, prompt_2=None, num_images_per_prompt=2)
    assert embeds.shape == (4, 512, 32)  # T5 padded to max_sequence_length, d_model 32
    assert pooled.shape == (4, 32)  # CLIPTextModel pooler_output
    assert text_ids.shape == (512, 3) and not text_ids.any()
    assert torch.equal(embeds[0], embeds[1]) and not torch.equal(embeds[1], embeds[2])

    pipe = _sd3(sd3)
    embeds, neg, pooled, neg_pooled = pipe.encode_prompt(PROMPTS, None, None,
                                                         do_classifier_free_guidance=True)
    assert embeds.shape == neg.shape == (2, 77 + 256, 64)  # CLIP tokens then T5 tokens
    assert pooled.shape == neg_pooled.shape == (2, 64)  # two CLIP projections side by side
    assert torch.equal(neg[0], neg[1])  # the empty negative prompt
    embeds, neg, _, _ = pipe.encode_prompt(PROMPTS, None, None, do_classifier_free_guidance=False,
                                           max_sequence_length=16)
    assert embeds.shape == (2, 77 + 16, 64) and neg is None


def test_tokenizers_cover_prompts_and_pad_to_the_pipeline_lengths(flux_dev):
    pipe = _flux(flux_dev)
    clip = pipe.tokenizer(PROMPTS, padding="max_length", max_length=77, truncation=True)
    t5 = pipe.tokenizer_2(PROMPTS, padding="max_length", max_length=512, truncation=True)
    assert {len(ids) for ids in clip.input_ids} == {77} and {len(ids) for ids in t5.input_ids} == {512}
    for ids in pipe.tokenizer(PROMPTS).input_ids:
        assert pipe.tokenizer.unk_token_id not in ids[1:-1]  # every character known
    for ids in pipe.tokenizer_2(PROMPTS).input_ids:
        assert pipe.tokenizer_2.unk_token_id not in ids and ids[-1] == pipe.tokenizer_2.eos_token_id
    assert len(pipe.tokenizer) <= pipe.text_encoder.config.vocab_size
    assert len(pipe.tokenizer_2) <= pipe.text_encoder_2.config.vocab_size


def test_rebuilding_gives_identical_weights_and_leaves_the_rng_alone(tmp_path, flux_dev, sd3):
    state = torch.random.get_rng_state()
    again_flux = write_tiny_flux(tmp_path / "flux")
    again_sd3 = write_tiny_sd3(tmp_path / "sd3")
    assert torch.equal(torch.random.get_rng_state(), state)
    for first, second in ((flux_dev, again_flux), (sd3, again_sd3)):
        a, b = _weights(first), _weights(second)
        assert sorted(a) == sorted(b) and "transformer/diffusion_pytorch_model.safetensors" in a
        for name in a:
            assert a[name].keys() == b[name].keys()
            assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    assert (tmp_path / "flux" / "model_index.json").read_text() == (flux_dev / "model_index.json").read_text()


def test_the_loaded_transformer_is_trainable(flux_dev):
    from diffusers import FluxPipeline

    transformer = _flux(flux_dev).transformer
    params = list(transformer.parameters())
    assert params and all(p.requires_grad and p.dtype == torch.float32 for p in params)
    hidden = torch.randn(1, 64, 16)
    out = transformer(hidden_states=hidden, encoder_hidden_states=torch.randn(1, 8, 32),
                      pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                      guidance=torch.tensor([3.5]), txt_ids=torch.zeros(8, 3),
                      img_ids=FluxPipeline._prepare_latent_image_ids(1, 8, 8, "cpu", torch.float32),
                      return_dict=False)[0]
    assert out.shape == hidden.shape
    out.square().mean().backward()
    assert all(p.grad is not None for p in params if p.requires_grad)


@pytest.mark.parametrize("variant", ["flux_dev", "flux_schnell"])
def test_flux_conventions_redone_by_hand_match_the_pipeline(variant, request):
    pipe, steps, batch, guidance_scale = _flux(request.getfixturevalue(variant)), 2, 2, 3.5
    expected = pipe(PROMPTS, height=SIZE, width=SIZE, num_inference_steps=steps,
                    guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(0),
                    output_type="latent").images
    embeds, pooled, text_ids = pipe.encode_prompt(PROMPTS, prompt_2=None)
    side = 2 * (SIZE // (pipe.vae_scale_factor * 2))  # latent side, even for 2x2 packing
    noise = torch.randn(batch, 4, side, side, generator=torch.Generator().manual_seed(0))
    latents = pipe._pack_latents(noise, batch, 4, side, side)  # (B, (side/2)^2, 16)
    img_ids = pipe._prepare_latent_image_ids(batch, side // 2, side // 2, "cpu", torch.float32)
    assert latents.shape == (batch, (side // 2) ** 2, 16) and img_ids.shape == ((side // 2) ** 2, 3)
    # sigmas linspace(1, 1/n, n), shifted by mu = calculate_shift(seq_len) when dynamic
    sigmas = np.linspace(1.0, 1 / steps, steps)
    if pipe.scheduler.config.use_dynamic_shifting:
        seq_len = latents.shape[1]
        slope = (1.15 - 0.5) / (4096 - 256)
        mu = 0.5 + slope * (seq_len - 256)
        sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
    sigmas = [*sigmas.tolist(), 0.0]
    guidance = torch.full((batch,), guidance_scale) if pipe.transformer.config.guidance_embeds else None
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:], strict=True):
            velocity = pipe.transformer(
                hidden_states=latents, timestep=torch.full((batch,), sigma),  # = t / 1000
                guidance=guidance, pooled_projections=pooled, encoder_hidden_states=embeds,
                txt_ids=text_ids, img_ids=img_ids, return_dict=False)[0]
            latents = latents + (sigma_next - sigma) * velocity
        torch.testing.assert_close(latents, expected, rtol=1e-4, atol=1e-5)
        image = pipe.vae.decode(pipe._unpack_latents(latents, SIZE, SIZE, pipe.vae_scale_factor)
                                / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor,
                                return_dict=False)[0]
    decoded = pipe(PROMPTS, height=SIZE, width=SIZE, num_inference_steps=steps,
                   guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(0),
                   output_type="pt").images
    torch.testing.assert_close((image / 2 + 0.5).clamp(0, 1), decoded, rtol=1e-4, atol=1e-5)


def test_sd3_conventions_redone_by_hand_match_the_pipeline(sd3):
    pipe, steps, batch, scale, shift = _sd3(sd3), 2, 2, 4.0, 3.0
    expected = pipe(PROMPTS, height=SIZE, width=SIZE, num_inference_steps=steps, guidance_scale=scale,
                    generator=torch.Generator().manual_seed(0), output_type="latent").images
    embeds, neg, pooled, neg_pooled = pipe.encode_prompt(PROMPTS, None, None)
    side = SIZE // pipe.vae_scale_factor
    latents = torch.randn(batch, 4, side, side, generator=torch.Generator().manual_seed(0))

    def shifted(s):
        return shift * s / (1 + (shift - 1) * s)

    # the scheduler's ends are shift(1) = 1 and shift(1/1000); set_timesteps shifts once more
    ends = np.linspace(1.0, shifted(1 / 1000), steps)
    sigmas = [*shifted(ends).tolist(), 0.0]
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:], strict=True):
            both = pipe.transformer(
                hidden_states=torch.cat([latents, latents]),
                timestep=torch.full((2 * batch,), sigma * 1000),  # in [0, 1000], not scaled
                encoder_hidden_states=torch.cat([neg, embeds]),
                pooled_projections=torch.cat([neg_pooled, pooled]), return_dict=False)[0]
            uncond, cond = both.chunk(2)
            velocity = uncond + scale * (cond - uncond)
            latents = latents + (sigma_next - sigma) * velocity
    torch.testing.assert_close(latents, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["flux_dev", "sd3"])
def test_lora_saved_by_the_pipeline_class_loads_back(variant, request, tmp_path):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    directory = request.getfixturevalue(variant)
    load = _flux if variant == "flux_dev" else _sd3
    pipe = load(directory)
    pipe.transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian",
                                            target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    with torch.no_grad():
        for name, p in pipe.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    call = {"height": SIZE, "width": SIZE, "num_inference_steps": 2, "output_type": "np"}
    adapted = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), **call).images
    type(pipe).save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    assert [f.name for f in tmp_path.iterdir()] == ["pytorch_lora_weights.safetensors"]
    assert all(k.startswith("transformer.") for k in load_file(tmp_path / "pytorch_lora_weights.safetensors"))
    fresh = load(directory)
    base = fresh(PROMPTS[0], generator=torch.Generator().manual_seed(0), **call).images
    fresh.load_lora_weights(tmp_path)
    loaded = fresh(PROMPTS[0], generator=torch.Generator().manual_seed(0), **call).images
    np.testing.assert_allclose(loaded, adapted, atol=1e-5)
    assert not np.allclose(base, adapted, atol=1e-3)
