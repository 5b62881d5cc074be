"""Model adapters by name: what `TrainConfig.model` (and a rollout or evaluate job's `model`)
selects. A loader takes a weights file (None: the adapter's shipped or default base) and a
device and returns a `FlowModel`. The built-in `shapes` adapter is the tiny DiT; more plug in
with `register_model`."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays unimported until a model is loaded
    import torch

    from trainer.models.base import FlowModel

ModelLoader = Callable[["Path | None", "torch.device | str"], "FlowModel"]

SHAPES_BASE = Path(__file__).parent.parent / "shapes" / "assets" / "base.safetensors"


def _load_shapes(path: Path | None, device: torch.device | str) -> FlowModel:
    from trainer.models.shapes_dit import ShapesDiT

    path = path or SHAPES_BASE
    if not path.is_file():
        raise FileNotFoundError(f"base checkpoint {path} not found; train one with "
                                "`python -m trainer train-base --out DIR`")
    return ShapesDiT.load(path, device)


_MODELS: dict[str, ModelLoader] = {"shapes": _load_shapes}
# the `format` each adapter's weights carry in their safetensors metadata
_WEIGHT_FORMATS: dict[str, str] = {"shapes": "shapes-dit"}


def register_model(name: str, loader: ModelLoader, weight_format: str | None = None) -> None:
    """Make `loader` available as model `name` (re-registering replaces); `weight_format` is
    the safetensors metadata `format` its weights files carry, if any (checked up front)."""
    _MODELS[name] = loader
    if weight_format:
        _WEIGHT_FORMATS[name] = weight_format
    else:
        _WEIGHT_FORMATS.pop(name, None)


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, read from its header alone (no torch, no
    tensors): ValueError when the file is not safetensors."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError("not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", head)
        if size > 100_000_000:
            raise ValueError("not a safetensors file (header size out of range)")
        try:
            header = json.loads(fh.read(size))
        except (UnicodeDecodeError, ValueError):
            raise ValueError("not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (header is not a JSON object)")
    meta = header.get("__metadata__") or {}
    return meta if isinstance(meta, dict) else {}


def weights_problem(name: str, path: str | Path, weight_format: str | None = None
                    ) -> str | None:
    """Why `path` cannot be loaded as weights of model `name` (or, with `weight_format`, as a
    file of that format), or None: checked from the header before a job is accepted."""
    if weight_format is None and name not in _MODELS:
        return f"unknown model {name!r}; known: {model_names()}"
    try:
        meta = safetensors_metadata(path)
    except (OSError, ValueError) as exc:
        return f"{path}: {exc}"
    want = weight_format or _WEIGHT_FORMATS.get(name)
    if want and meta.get("format") != want:
        return f"{path} is not a {want!r} weights file (its format is {meta.get('format')!r})"
    return None


def model_names() -> list[str]:
    return sorted(_MODELS)


def load_flow_model(name: str, path: str | Path | None = None,
                    device: torch.device | str = "cpu") -> FlowModel:
    """Model `name` with the weights at `path` (None: its default base) on `device`."""
    if name not in _MODELS:
        raise KeyError(f"unknown model {name!r}; known: {model_names()}")
    return _MODELS[name](Path(path) if path else None, device)
