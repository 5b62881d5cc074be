"""Tiny FLUX and SD3 model directories in the diffusers format, built in code. Shared by the
trainer, app and worker tests, which import it as `tiny_diffusers` (tests/ is on sys.path as
the directory of the root conftest.py).

`write_tiny_flux(dir)` / `write_tiny_sd3(dir)` write what `FluxPipeline.from_pretrained(dir,
local_files_only=True)` / `StableDiffusion3Pipeline.from_pretrained(...)` load: the stock
component classes (FluxTransformer2DModel / SD3Transformer2DModel, AutoencoderKL, CLIP and T5
text encoders, FlowMatchEulerDiscreteScheduler) from small configs with random weights, and
tokenizers written from a vocabulary made here. Nothing downloads. The shapes follow the real
models so that code written against them runs unchanged: FLUX packs 2x2 latent patches
(in_channels = 4 latent channels * 4), SD3 concatenates two CLIP projections into the pooled
embedding (2 * 32 = pooled_projection_dim 64). Weights come from a fixed seed, so writing twice
gives identical files; the caller's torch RNG state is left as it was.
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

import torch

# CLIP's context length: both pipelines pad CLIP prompts to tokenizer.model_max_length.
CLIP_MAX_LENGTH = 77
# FLUX pads T5 prompts to 512 tokens (SD3 to 256); T5's relative positions allow any length.
T5_MAX_LENGTH = 512
# The real VAEs' latent statistics, so that a scaling/shift mix-up changes the numbers.
FLUX_VAE_SCALING, FLUX_VAE_SHIFT = 0.3611, 0.1159
SD3_VAE_SCALING, SD3_VAE_SHIFT = 1.5305, 0.0609
# Characters the tokenizers know; everything else maps to the unknown token.
CHARACTERS = string.ascii_lowercase + string.digits + string.punctuation
T5_CHARACTERS = string.ascii_letters + string.digits + string.punctuation


def write_tiny_flux(directory: Path, guidance_embeds: bool = True, *,
                    dynamic_shifting: bool | None = None) -> Path:
    """A FLUX.1-dev-like (guidance_embeds=True) or FLUX.1-schnell-like (False) model directory.

    The scheduler follows the real repositories: dev shifts sigmas by image size
    (use_dynamic_shifting, mu from calculate_shift), schnell does not (shift 1.0). Pass
    `dynamic_shifting` to choose otherwise.
    """
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if dynamic_shifting is None:
        dynamic_shifting = guidance_embeds
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tokenizer = _clip_tokenizer()
        text_encoder = CLIPTextModel(_clip_text_config(CLIPTextConfig, tokenizer)).eval()
        tokenizer_2 = _t5_tokenizer()
        text_encoder_2 = _t5_encoder(tokenizer_2, d_model=32)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            guidance_embeds=guidance_embeds, axes_dims_rope=(2, 2, 4)).eval()
        pipe = FluxPipeline(
            scheduler=_flux_scheduler(dynamic_shifting),
            vae=_tiny_vae(FLUX_VAE_SCALING, FLUX_VAE_SHIFT),
            text_encoder=text_encoder, tokenizer=tokenizer,
            text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
        pipe.save_pretrained(directory, safe_serialization=True)
    return directory


def write_tiny_sd3(directory: Path, *, sd35: bool = False) -> Path:
    """An SD3-like model directory: MMDiT with two CLIPs (with projection) and a T5.
    `sd35`: SD3.5-medium's transformer (MMDiT-X): RMS-normalised queries and keys, and a second
    image self-attention (`attn2`) in its first block, as its dual_attention_layers have it.

    T5's width is 64 (= joint_attention_dim), the two CLIP hidden sizes side by side, so the
    pipeline's zero-padding of the CLIP features up to T5's width is a no-op rather than a crop.
    """
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tokenizer = _clip_tokenizer()
        text_encoder = CLIPTextModelWithProjection(
            _clip_text_config(CLIPTextConfig, tokenizer)).eval()
        text_encoder_2 = CLIPTextModelWithProjection(
            _clip_text_config(CLIPTextConfig, tokenizer)).eval()
        tokenizer_3 = _t5_tokenizer()
        text_encoder_3 = _t5_encoder(tokenizer_3, d_model=64)
        transformer = SD3Transformer2DModel(
            sample_size=32, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=16,
            pooled_projection_dim=64, out_channels=4, pos_embed_max_size=32,
            **({"qk_norm": "rms_norm", "dual_attention_layers": (0,)} if sd35 else {})).eval()
        pipe = StableDiffusion3Pipeline(
            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=_tiny_vae(SD3_VAE_SCALING, SD3_VAE_SHIFT),
            text_encoder=text_encoder, tokenizer=tokenizer,
            text_encoder_2=text_encoder_2, tokenizer_2=tokenizer,
            text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3)
        pipe.save_pretrained(directory, safe_serialization=True)
    return directory


def _flux_scheduler(dynamic_shifting: bool):
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1-dev's scheduler_config.json; FLUX.1-schnell's is the same with shift 1.0 and no
    # dynamic shifting (the pipeline still computes mu; the scheduler then ignores it).
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0 if dynamic_shifting else 1.0,
        use_dynamic_shifting=dynamic_shifting, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)


def _tiny_vae(scaling_factor: float, shift_factor: float):
    from diffusers import AutoencoderKL

    # Two blocks: vae_scale_factor = 2 ** (len(block_out_channels) - 1) = 2, so a 32x32 image
    # is a 16x16 latent. No quant convs, as in the FLUX and SD3 VAEs.
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=32, scaling_factor=scaling_factor,
        shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False).eval()


def _clip_tokenizer():
    """CLIP's byte-level BPE over single characters (no merges): every character alone and with
    the end-of-word mark "</w>", then the two specials last, where real CLIP has them (so
    <|endoftext|> is the highest id, as CLIP's pooling on the eos token expects)."""
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    for char in CHARACTERS:
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    # Read from files as a released CLIP is; the pipeline saves its own copy under tokenizer/.
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "vocab.json").write_text(json.dumps(vocab))
        (Path(scratch) / "merges.txt").write_text("#version: 0.2\n")
        return CLIPTokenizer(str(Path(scratch) / "vocab.json"), str(Path(scratch) / "merges.txt"),
                             model_max_length=CLIP_MAX_LENGTH)


def _clip_text_config(config_class, tokenizer):
    # Two layers so that SD3's hidden_states[-2] is a transformer layer's output, as in CLIP-L/G.
    return config_class(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH, projection_dim=32,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)


def _t5_tokenizer():
    """T5's layout (<pad>=0, </s>=1, <unk>=2, a Unigram over SentencePiece pieces, "</s>" appended
    to every sequence), over single characters, each also as a word start "▁c"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -3.0) for c in T5_CHARACTERS] + [(c, -4.0) for c in T5_CHARACTERS]
    backend = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)])
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=T5_MAX_LENGTH)


def _t5_encoder(tokenizer, d_model: int):
    from transformers import T5Config, T5EncoderModel

    # T5 v1.1 (FLUX's and SD3's T5-XXL): gated-GELU feed-forward, relative position buckets.
    config = T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=1,
        num_heads=d_model // 8, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
        is_encoder_decoder=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(config).eval()

