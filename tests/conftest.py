"""Fixtures shared by the trainer, app and worker tests."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest


def save_tiny_clip(directory: Path) -> Path:
    """A 1-layer CLIP for 32x32 images and a character-level tokenizer, in the transformers
    format (save_pretrained) that a preference fit's `clip_path` names. Random weights."""
    import torch
    import transformers  # the clip extra, which `make setup` installs

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in string.ascii_lowercase + string.digits:  # no merges: one token per character
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(str(directory / "vocab.json"),
                                           str(directory / "merges.txt"))
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                             crop_size={"height": 32, "width": 32})
    transformers.CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(directory)
    torch.manual_seed(0)
    layer = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2}
    config = transformers.CLIPConfig(
        text_config={**layer, "vocab_size": len(vocab), "max_position_embeddings": 40,
                     "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={**layer, "image_size": 32, "patch_size": 4}, projection_dim=32)
    transformers.CLIPModel(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_clip_path(tmp_path_factory) -> Path:
    return save_tiny_clip(tmp_path_factory.mktemp("clip"))
