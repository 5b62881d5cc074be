"""The built-in shapes model: a small pixel-space DiT (adaLN-Zero) conditioned on prompt tokens.

Images are their own latents: (3, 32, 32) in [-1, 1]. The three prompt tokens (count, colour,
shape) join the 4x4 image patches in one attention sequence, and their mean plus the time
embedding drives the adaLN modulation.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from trainer.models.base import FlowModel
from trainer.shapes.world import IMAGE_SIZE, PROMPT_LENGTH, VOCAB, tokenize
from trainer.write_errors import readable_as_umask_allows


@dataclass
class ShapesDiTConfig:
    image_size: int = IMAGE_SIZE
    patch_size: int = 4
    channels: int = 3
    width: int = 128
    depth: int = 6
    heads: int = 4
    mlp_ratio: float = 4.0
    # The defaults are the shipped base's recipe. "sincos": fixed 2D sine-cosine patch
    # positions as in DiT; "learned": a trained table per patch (the first base).
    position_embedding: str = "sincos"
    # a depthwise 3x3 convolution over the patch grid between the MLP's two layers (image
    # tokens only), so neighbouring patches mix in every block. Without it the first bases'
    # attention stayed uniform over all tokens after 6,000 steps, each patch was drawn from its
    # own noise alone, and the samples came out as patch-sized specks.
    mlp_conv: bool = True
    # DiT's initialisation (xavier-uniform linear layers, zero biases) instead of PyTorch's
    # default: larger query/key weights, so attention is not uniform at the start
    xavier_init: bool = True


# what a checkpoint written before these options existed was built with: its metadata's
# config lacks the keys, and it must load as it was trained
LEGACY_CONFIG = {"position_embedding": "learned", "mlp_conv": False, "xavier_init": False}


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of t in [0, 1] (scaled to 0..1000 like diffusion timesteps)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_positions(grid: int, dim: int) -> torch.Tensor:
    """(grid * grid, dim) fixed 2D sine-cosine position embedding, row-major: half of the
    channels encode the patch's row, half its column (DiT / MAE)."""
    quarter = dim // 4
    freqs = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coords = torch.arange(grid, dtype=torch.float64)[:, None] * freqs[None]  # (grid, dim/4)
    axis = torch.cat([torch.sin(coords), torch.cos(coords)], dim=1)  # (grid, dim/2)
    rows = axis[:, None, :].expand(grid, grid, dim // 2)
    cols = axis[None, :, :].expand(grid, grid, dim // 2)
    return torch.cat([rows, cols], dim=-1).reshape(grid * grid, dim).float()


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float, grid: int = 0) -> None:
        """`grid` > 0: the MLP convolves the last grid * grid tokens (the image patches) with
        a depthwise 3x3 kernel between its layers."""
        super().__init__()
        self.grid = grid
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        hidden = int(width * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(hidden, width))
        self.mlp_conv = (nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden) if grid else None)
        self.modulation = nn.Linear(width, 6 * width)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.mlp_conv is None:
            return self.mlp(h)
        h = self.mlp[0](h)
        n, length, hidden = h.shape
        # contiguous: a channels-last view here makes the depthwise weight's gradient
        # channels-last too, which DDP copies into its buckets each step (and warns about)
        image = (h[:, length - self.grid**2:].transpose(1, 2)
                 .reshape(n, hidden, self.grid, self.grid).contiguous())
        image = self.mlp_conv(image).flatten(2).transpose(1, 2)
        h = torch.cat([h[:, :length - self.grid**2], image], dim=1)
        return self.mlp[2](self.mlp[1](h))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(c)).chunk(6, dim=-1)
        n, length, width = x.shape
        h = modulate(self.norm1(x), shift1, scale1)
        q, k, v = self.qkv(h).view(n, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)  # (N, heads, L, width/heads)
        x = x + gate1[:, None] * self.proj(attn.transpose(1, 2).reshape(n, length, width))
        x = x + gate2[:, None] * self.feed_forward(modulate(self.norm2(x), shift2, scale2))
        return x


class ShapesDiT(FlowModel):
    def __init__(self, config: ShapesDiTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or ShapesDiTConfig()
        p, w = config.patch_size, config.width
        self.grid = config.image_size // p
        self.patch_in = nn.Linear(config.channels * p * p, w)
        if config.position_embedding == "learned":
            self.patch_pos = nn.Parameter(torch.randn(1, self.grid**2, w) * 0.02)
        elif config.position_embedding == "sincos":
            # a buffer kept out of the checkpoint: it is a function of the config
            self.register_buffer("patch_pos", sincos_positions(self.grid, w)[None], persistent=False)
        else:
            raise ValueError(f"position_embedding must be 'learned' or 'sincos', "
                             f"got {config.position_embedding!r}")
        self.token_embed = nn.Embedding(len(VOCAB), w)
        self.token_pos = nn.Parameter(torch.randn(1, PROMPT_LENGTH, w) * 0.02)
        self.time_mlp = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.blocks = nn.ModuleList(
            DiTBlock(w, config.heads, config.mlp_ratio, self.grid if config.mlp_conv else 0)
            for _ in range(config.depth))
        self.final_norm = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Linear(w, 2 * w)
        self.patch_out = nn.Linear(w, config.channels * p * p)
        self._init_zero()

    def _init_zero(self) -> None:
        if self.config.xavier_init:
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.xavier_uniform_(module.weight)
                    nn.init.zeros_(module.bias)
        # adaLN-Zero: every block starts as the identity and the output as zero velocity.
        for block in self.blocks:
            nn.init.zeros_(block.modulation.weight)
            nn.init.zeros_(block.modulation.bias)
        for layer in (self.final_modulation, self.patch_out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    # -- FlowModel --------------------------------------------------------------------------
    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Pixels are the latents: (3, 32, 32)."""
        return (self.config.channels, self.config.image_size, self.config.image_size)

    @property
    def resolution(self) -> int:
        """The image side it draws, in pixels, as the diffusers models' `resolution` (what
        evaluate's result records)."""
        return self.config.image_size

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        return torch.from_numpy(tokenize(prompts)).to(self.patch_pos.device)  # (N, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        n, ch, size, _ = x.shape
        p, g = self.config.patch_size, self.grid
        patches = x.reshape(n, ch, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, ch * p * p)
        image_tokens = self.patch_in(patches) + self.patch_pos  # (N, 64, W)
        prompt_tokens = self.token_embed(cond) + self.token_pos  # (N, 3, W)
        t = t.expand(n) if t.dim() == 0 else t
        c = self.time_mlp(timestep_embedding(t, self.config.width).to(x.dtype)) + prompt_tokens.mean(1)
        h = torch.cat([prompt_tokens, image_tokens], dim=1)
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final_modulation(F.silu(c)).chunk(2, dim=-1)
        out = self.patch_out(modulate(self.final_norm(h[:, PROMPT_LENGTH:]), shift, scale))
        return out.reshape(n, g, g, ch, p, p).permute(0, 3, 1, 4, 2, 5).reshape(n, ch, size, size)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents in [-1, 1] are the images: (N, 3, H, W) in [0, 1]."""
        return (latents.detach().float().clamp(-1, 1) + 1) / 2

    # -- weights ------------------------------------------------------------------------------
    def save(self, path: str | Path, extra_metadata: dict[str, str] | None = None,
             state: dict[str, torch.Tensor] | None = None) -> None:
        metadata = {"format": "shapes-dit", "config": json.dumps(asdict(self.config))}
        metadata.update(extra_metadata or {})
        state = self.state_dict() if state is None else state
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path),
                  metadata=metadata)
        readable_as_umask_allows(path)  # safetensors' own files are 0600 (train-base's base)

    def save_weights(self, directory: Path, metadata: dict[str, str],
                     state: dict[str, torch.Tensor] | None = None) -> Path:
        path = Path(directory) / "model.safetensors"
        self.save(path, extra_metadata=metadata, state=state)
        return path

    def read_weights(self, directory: Path) -> dict[str, torch.Tensor]:
        path = Path(directory)
        return load_file(str(path / "model.safetensors" if path.is_dir() else path))

    def load_weights(self, directory: Path) -> None:
        self.load_state_dict({k: v.to(self.patch_pos.device)
                              for k, v in self.read_weights(directory).items()})

    def shard_units(self) -> list[nn.Module]:
        return list(self.blocks)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> ShapesDiT:
        model = cls(checkpoint_config(path))
        model.load_state_dict(load_file(str(path), device=str(device)))
        return model.to(device)


def checkpoint_config(path: str | Path) -> ShapesDiTConfig:
    """The architecture a shapes checkpoint was saved with (its metadata), without its weights."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != "shapes-dit":
        # the format, not the whole metadata (a preference model's is a kilobyte of JSON)
        raise ValueError(f"{path} is not a shapes-dit checkpoint (its format is "
                         f"{metadata.get('format')!r})")
    return ShapesDiTConfig(**{**LEGACY_CONFIG, **json.loads(metadata["config"])})


def images_to_latents(images: np.ndarray) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, 3, H, W) float in [-1, 1]."""
    return pixels_to_latents(torch.from_numpy(images).permute(0, 3, 1, 2))


def pixels_to_latents(pixels: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) uint8 on any device -> float in [-1, 1]: the images are the latents."""
    return pixels.float() / 127.5 - 1.0
