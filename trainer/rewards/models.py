"""Rewards from published reward models, loaded from local weights (never downloaded).

| name         | model                                          | score                           |
|--------------|------------------------------------------------|---------------------------------|
| `hpsv2`      | HPS v2.1: open_clip ViT-H-14 + HPS checkpoint  | cos(image, text), as hpsv2's    |
|              |                                                | img_score.py (not x100)         |
| `pickscore`  | PickScore v1: transformers CLIPModel (ViT-H)   | logit_scale.exp() * cos         |
| `clip_score` | transformers CLIP (e.g. ViT-L/14)              | 100 * max(cos, 0) (CLIPScore)   |
| `aesthetic`  | LAION aesthetic predictor v2: open_clip        | MLP(normalised image embedding) |
|              | ViT-L-14 (OpenAI weights, QuickGELU) + MLP head|                                 |
| `imagereward`| ImageReward v1.0: BLIP ViT-L/16 + BERT-base    | (MLP(first text token) - mean)  |
|              | cross-attending to it, on transformers' BLIP   | / std, as ImageReward.py        |
|              | port (not the image-reward package: see below) |                                 |

Weights live in one directory per reward: `$REWARD_MODELS_DIR/<name>/` (REWARD_MODELS_DIR
unset: `$DATA_DIR/reward_models`, DATA_DIR unset: `./data`, as the studio's settings), or
where a train config's `reward_model_paths[name]` points. `expected_files(name)` lists what
each directory must hold; `weights_problem` says what is missing, naming the reward, the
setting and the files, and `check_reward_models` raises it (`RewardWeightsMissing`) when a job
starts. The models load on first call and stay cached per process (per directory and device).

The registry interface holds: images (N, H, W, 3) uint8, prompts N strings -> (N,) float64.
Scoring runs in chunks of `batch_size` images; on CUDA under bf16 autocast (the HPSv2
reference runs under fp16 autocast; bf16 has fp32's range, so no overflow in the towers).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from trainer.rewards.registry import register_builtin_reward

ENV_DIR = "REWARD_MODELS_DIR"

# open_clip's OPENAI_DATASET_MEAN / STD (open_clip/constants.py): the normalisation of both
# ViT-H-14 (HPSv2 builds its preprocess_val from open_clip defaults, which use these) and of
# OpenAI's ViT-L/14 (clip.load's preprocess, which the aesthetic predictor uses)
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

# HPS v2.1 as published (xswu/HPSv2 on the Hugging Face hub): a torch checkpoint whose
# "state_dict" is an open_clip ViT-H-14 state dict
HPS_CHECKPOINT = "HPS_v2.1_compressed.pt"
# the LAION aesthetic predictor v2's head (christophschuhmann/improved-aesthetic-predictor)
AESTHETIC_HEAD = "sac+logos+ava1-l14-linearMSE.pth"
# open_clip's own names for a state dict in a directory (open_clip.factory._find_checkpoint_in_dir)
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
# optional in an open_clip directory: {"model_cfg": {...}} (open_clip's hub layout) replaces
# the built-in architecture; the tests use it for tiny models
OPEN_CLIP_CONFIG = "open_clip_config.json"
# a transformers CLIPModel + CLIPProcessor save_pretrained directory (the image processor's
# settings: preprocessor_config.json as the hub's CLIP repositories hold them, or
# processor_config.json as transformers 5's save_pretrained writes them)
HF_CLIP_FILES = (("config.json",), ("model.safetensors", "pytorch_model.bin"),
                 ("preprocessor_config.json", "processor_config.json"),
                 ("tokenizer.json", "vocab.json"))

# images per forward pass of a reward network: a FLUX iteration's 4 prompts x G = 12 in one
# pass (issue 17 measures at batch 48); at 512 px under bf16 the largest, HPSv2's ViT-H-14,
# peaked at 5.6 GiB in passes of 32 on an H100 (docs/benchmarks.md)
DEFAULT_BATCH_SIZE = 48


class RewardWeightsUnloadable(ValueError):
    """A model-backed reward's weights are there but do not load (an empty or truncated file,
    another model's); the message names the reward, its directory and its files."""


class RewardWeightsMissing(FileNotFoundError):
    """A model-backed reward's weights directory is missing or incomplete. `reward` names it,
    `setting` says where its directory comes from (REWARD_MODELS_DIR, its default when
    unset, or reward_model_paths[name])."""

    def __init__(self, reward: str, setting: str, message: str) -> None:
        super().__init__(message)
        self.reward = reward
        self.setting = setting
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ModelReward:
    name: str
    # each entry: alternative file names, one of which must be in the directory
    files: tuple[tuple[str, ...], ...]
    load: Callable[[Path, torch.device], Callable[[np.ndarray, list[str]], np.ndarray]]
    # why the reward cannot load at all in this environment (a package missing), or None
    unavailable: Callable[[], str | None] = lambda: None
    # False: no adapter exists yet, anywhere (unavailable() says why)
    implemented: bool = True


# ---------------------------------------------------------------------------------------------
# where the weights are

_lock = threading.Lock()
_paths: dict[str, str] = {}  # reward_model_paths of the running job
# how a message names where _paths came from, `{name}` the reward: the config field for a
# job, the flag the user typed for the CLI and the reward server (configure_reward_models)
PATHS_SETTING = "reward_model_paths[{name!r}]"
_paths_setting = PATHS_SETTING
_device: torch.device | None = None
_cache: dict[tuple[str, str, str], Callable[[np.ndarray, list[str]], np.ndarray]] = {}


def default_models_dir() -> Path:
    """REWARD_MODELS_DIR, else DATA_DIR/reward_models (the studio's Settings default the
    same way; the trainer reads the environment itself and does not import app/)."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    return Path(os.environ.get("DATA_DIR") or "./data") / "reward_models"


def configure_reward_models(paths: dict[str, str] | None = None,
                            device: torch.device | str | None = None,
                            paths_setting: str = PATHS_SETTING) -> None:
    """Set the per-reward directories (a train config's `reward_model_paths`) and the device
    the models run on, for this process. Models already loaded stay cached by directory and
    device, so switching back costs nothing. `paths_setting`: how messages name where a
    directory of `paths` came from, `{name}` the reward (default the config field; a command
    line passes its flag, e.g. "--reward-model-paths {name}=...")."""
    global _device, _paths_setting
    unknown = sorted(set(paths or {}) - set(MODEL_REWARDS))
    if unknown:
        raise ValueError(f"reward_model_paths: {unknown} are not model-backed rewards; known: "
                         f"{sorted(MODEL_REWARDS)}")
    with _lock:
        _paths.clear()
        _paths.update(paths or {})
        _paths_setting = paths_setting
        if device is not None:
            _device = torch.device(device)


def reward_model_dir(name: str, paths: dict[str, str] | None = None,
                     default_dir: Path | None = None, paths_setting: str | None = None
                     ) -> tuple[Path, str]:
    """(directory, the setting it comes from) of the model-backed reward `name`: `paths[name]`
    (default: those configure_reward_models set), else `default_dir` (default:
    default_models_dir()) / name. `paths_setting` names where `paths` came from, `{name}` the
    reward (default: the configured paths' label, or the config field for `paths` given)."""
    if paths_setting is None:
        paths_setting = _paths_setting if paths is None else PATHS_SETTING
    paths = _paths if paths is None else paths
    if paths.get(name):
        return Path(paths[name]), paths_setting.format(name=name)
    if default_dir is None and not os.environ.get(ENV_DIR):
        # said as it is: nothing was set, and a relative default hangs on where one stands
        where = ("DATA_DIR/reward_models" if os.environ.get("DATA_DIR") else
                 "./data/reward_models, relative to the working directory")
        return default_models_dir() / name, f"{ENV_DIR} unset, so its default {where}"
    return (default_dir or default_models_dir()) / name, ENV_DIR


def expected_files(name: str) -> list[str]:
    """What the directory of `name` must hold, one line per file ('a or b' for alternatives)."""
    return [" or ".join(alternatives) for alternatives in MODEL_REWARDS[name].files]


def weights_problem(name: str, paths: dict[str, str] | None = None,
                    default_dir: Path | None = None, check_packages: bool = True,
                    paths_setting: str | None = None) -> str | None:
    """Why the model-backed reward `name` cannot load (its package missing, its directory
    missing or incomplete), naming the reward, the setting and the files expected; None when
    it can. `paths`, `default_dir` and `paths_setting` as reward_model_dir takes them.
    `check_packages=False` (a caller whose environment is not the one that trains) checks the
    files alone."""
    spec = MODEL_REWARDS[name]
    directory, setting = reward_model_dir(name, paths, default_dir, paths_setting)
    expected = "; ".join(expected_files(name))
    problems = []
    if ((check_packages or not spec.implemented)
            and (reason := spec.unavailable()) is not None):
        problems.append(f"reward {name!r} cannot load here: {reason}")
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        problems.append(f"reward {name!r}: weights directory {str(directory)!r} (from {setting}) "
                        f"{what}; it must hold: {expected}. Nothing is downloaded: "
                        f"put the published weights there")
    elif missing := [" or ".join(alts) for alts in spec.files
                     if not any((directory / f).is_file() for f in alts)]:
        problems.append(f"reward {name!r}: weights directory {str(directory)!r} (from {setting}) "
                        f"lacks {'; '.join(missing)} (it must hold: {expected})")
    else:
        from trainer.models import weights_file_problem

        present = [directory / f for alts in spec.files for f in alts if (directory / f).is_file()]
        if damaged := [p for f in present if (p := weights_file_problem(f)) is not None]:
            problems.append(f"reward {name!r}: weights directory {str(directory)!r} (from "
                            f"{setting}) has damaged files: {'; '.join(damaged)}")
    return "; ".join(problems) or None


def check_reward_models(names: list[str] | dict[str, Any],
                        paths: dict[str, str] | None = None) -> None:
    """Raise RewardWeightsMissing when a model-backed reward among `names` cannot load its
    weights, naming every such reward at once (its reward and setting: the first's); other
    names are ignored."""
    missing = [(name, problem) for name in names if name in MODEL_REWARDS
               and (problem := weights_problem(name, paths)) is not None]
    if missing:
        first = missing[0][0]
        raise RewardWeightsMissing(first, reward_model_dir(first, paths)[1],
                                   "; ".join(problem for _, problem in missing))


def load_reward_models(names: list[str] | dict[str, Any]) -> None:
    """Load (and cache) the model-backed rewards among `names` now, on the configured device:
    a job calls it before minutes of sampling, so that weights that are there but do not load
    (an empty or truncated file, another model's) fail at its start. ValueError naming the
    reward, its directory and the files it read (RewardWeightsUnloadable); missing files are
    RewardWeightsMissing, as check_reward_models raises."""
    for name in names:
        if name not in MODEL_REWARDS:
            continue
        try:
            _LazyReward(name).scorer()  # (the cache is shared by directory and device)
        except RewardWeightsMissing:
            raise
        except Exception as exc:  # whatever the loader trips on (torch.load, safetensors,
            # transformers): the user's file, named in one line rather than a traceback
            directory, setting = reward_model_dir(name)
            present = [f for alternatives in MODEL_REWARDS[name].files for f in alternatives
                       if (directory / f).is_file()]
            detail = " ".join(str(exc).split())[:300]  # one line, however long the original
            raise RewardWeightsUnloadable(
                f"reward {name!r}: the weights in {str(directory)!r} (from {setting}: "
                f"{', '.join(present)}) cannot be loaded: {type(exc).__name__}: {detail}"
            ) from None


def _current_device() -> torch.device:
    if _device is not None:
        return _device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _LazyReward:
    """The registered reward: loads its model on first call (per directory and device)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__name__ = name

    def scorer(self) -> Callable[[np.ndarray, list[str]], np.ndarray]:
        directory, setting = reward_model_dir(self.name)
        device = _current_device()
        key = (self.name, str(directory.resolve()), str(device))
        with _lock:
            if key not in _cache:
                if (problem := weights_problem(self.name)) is not None:
                    raise RewardWeightsMissing(self.name, setting, problem)
                _cache[key] = MODEL_REWARDS[self.name].load(directory, device)
            return _cache[key]

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        if not len(prompts):
            return np.zeros(0, dtype=np.float64)
        return np.asarray(self.scorer()(np.asarray(images, dtype=np.uint8), list(prompts)),
                          dtype=np.float64)


def clear_cache() -> None:
    """Forget every loaded model (tests; or to free GPU memory)."""
    with _lock:
        _cache.clear()


# ---------------------------------------------------------------------------------------------
# shared pieces

def _autocast(device: torch.device):
    # bf16 autocast on CUDA; CPU stays fp32 (bf16 matmuls there are slow and only approximate)
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def _chunks(n: int, size: int = DEFAULT_BATCH_SIZE):
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def _openai_clip_pixels(images: np.ndarray, size: int) -> torch.Tensor:
    """(N, 3, size, size) float32, exactly as torchvision's Resize(size, BICUBIC) +
    CenterCrop(size) + ToTensor + Normalize(OPENAI mean/std) do on a PIL image: OpenAI's
    clip.load preprocess (the aesthetic predictor's), which is also open_clip's eval
    transform. Done with PIL per image, as the reference does, so the resampling is PIL's
    bicubic filter bit for bit."""
    out = np.empty((len(images), size, size, 3), dtype=np.float32)
    for i, array in enumerate(images):
        image = Image.fromarray(array).convert("RGB")
        w, h = image.size
        # torchvision's _compute_resized_output_size: the short side becomes `size`, the
        # long side int(size * long / short)
        if w <= h:
            new_w, new_h = size, int(size * h / w)
        else:
            new_w, new_h = int(size * w / h), size
        if (new_w, new_h) != (w, h):
            image = image.resize((new_w, new_h), Image.BICUBIC)
        # torchvision's center_crop: top/left = int(round((dim - size) / 2))
        top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
        image = image.crop((left, top, left + size, top + size))
        out[i] = np.asarray(image, dtype=np.float32) / 255.0  # ToTensor
    x = torch.from_numpy(out).permute(0, 3, 1, 2)
    mean = torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def _hpsv2_pixels(images: np.ndarray, size: int) -> torch.Tensor:
    """(N, 3, size, size) float32 as HPSv2's preprocess_val: img_score.py builds it with
    light_augmentation=True, for which hpsv2/src/open_clip/factory.py takes
    image_transform(..., is_train=False, resize_longest_max=True), i.e. (transform.py)
    convert RGB, ToTensor, ResizeMaxSize(size, fill=0), Normalize(OPENAI mean/std): the
    *longest* side scaled to `size` (round(dim * scale)) with torchvision's tensor resize
    (bicubic; antialiased, torchvision's default since 0.17 - hpsv2 does not pin it), then
    zero-padded to a square (pad // 2 before, the rest after), before the normalisation. No
    resize when the longest side is already `size`; a non-square image of that longest side is
    still padded (the reference's ResizeMaxSize skips its pad there too and hands the model a
    non-square image, which a ViT of fixed position embeddings fails on). Batched: every
    image of one call has one shape."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
    height, width = x.shape[-2:]
    scale = size / float(max(height, width))
    new_h, new_w = height, width
    if scale != 1.0:
        # at least one pixel: an image over size:1 in aspect (1x300 at 224) would round its
        # short side to 0, which the reference's own resize fails on too
        new_h, new_w = max(1, round(height * scale)), max(1, round(width * scale))
        # torchvision.transforms.functional.resize on a float tensor is exactly this call
        x = torch.nn.functional.interpolate(x, size=(new_h, new_w), mode="bicubic",
                                            align_corners=False, antialias=True)
    pad_h, pad_w = size - new_h, size - new_w
    if pad_h or pad_w:
        x = torch.nn.functional.pad(x, (pad_w // 2, pad_w - pad_w // 2,
                                        pad_h // 2, pad_h - pad_h // 2), value=0.0)
    mean = torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def _open_clip_model(directory: Path, architecture: dict[str, Any], weights: Path,
                     device: torch.device):
    """An open_clip CLIP of `architecture` (or the directory's open_clip_config.json
    model_cfg) with the state dict in `weights`, in eval mode on `device`. The activation is
    `architecture`'s whatever the file says: it belongs to how the weights were trained
    (OpenAI's CLIP, the aesthetic predictor's backbone, with QuickGELU; HPSv2's LAION ViT-H-14
    with GELU), and a hub config copied beside them without `quick_gelu` loaded without a
    complaint and scored with the wrong one."""
    import open_clip
    from open_clip.model import CLIP

    config_file = directory / OPEN_CLIP_CONFIG
    cfg = json.loads(config_file.read_text())["model_cfg"] if config_file.is_file() \
        else architecture
    model = CLIP(**{**cfg, "quick_gelu": bool(architecture.get("quick_gelu", False))})
    # open_clip's loader: takes a checkpoint's "state_dict", strips DDP's "module." prefix,
    # reads safetensors or torch files (weights_only)
    open_clip.factory.load_checkpoint(model, str(weights), strict=True)
    return model.to(device).eval()


def _first_file(directory: Path, names: tuple[str, ...]) -> Path:
    return next(directory / n for n in names if (directory / n).is_file())


# ---------------------------------------------------------------------------------------------
# hpsv2

@functools.cache  # an import attempt costs seconds; its answer does not change in a process
def _open_clip_unavailable() -> str | None:
    try:
        import open_clip  # noqa: F401
    except Exception as error:  # ImportError, or a torchvision that does not match torch
        return (f"open_clip does not import ({type(error).__name__}: {error}); install the "
                "'rewards' extra: pip install 'neighbor-grpo-studio[rewards]' (open-clip-torch "
                "needs a torchvision built for the installed torch)")
    return None


def _load_hpsv2(directory: Path, device: torch.device):
    import open_clip

    # HPSv2's img_score.py: create_model_and_transforms('ViT-H-14', ...) then
    # model.load_state_dict(checkpoint['state_dict']) from HPS_v2.1_compressed.pt
    model = _open_clip_model(directory, open_clip.get_model_config("ViT-H-14"),
                             directory / HPS_CHECKPOINT, device)
    # get_tokenizer('ViT-H-14') is open_clip's SimpleTokenizer at the model's context length
    # (77); its BPE vocabulary ships inside the package
    tokenizer = open_clip.SimpleTokenizer(context_length=model.context_length)
    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size

    @torch.no_grad()
    def score(images: np.ndarray, prompts: list[str]) -> np.ndarray:
        out = []
        for part in _chunks(len(prompts)):
            pixels = _hpsv2_pixels(images[part], size).to(device)
            tokens = tokenizer(prompts[part]).to(device)
            with _autocast(device):
                image = model.encode_image(pixels, normalize=True).float()
                text = model.encode_text(tokens, normalize=True).float()
            # HPSv2 (img_score.py): diagonal of image_features @ text_features.T, the cosine
            # of the normalised features, not scaled (the hpsv2 benchmark prints it x100)
            out.append((image * text).sum(-1).cpu())
        return torch.cat(out).double().numpy()

    return score


# ---------------------------------------------------------------------------------------------
# aesthetic

class AestheticHead(torch.nn.Module):
    """The LAION aesthetic predictor v2's MLP (improved-aesthetic-predictor, simple_inference.py):
    Linear(768, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64),
    Dropout(0.1), Linear(64, 16), Linear(16, 1); no activations (they are commented out in the
    reference), so the state dict's keys are layers.{0,2,4,6,7}.*"""

    def __init__(self, input_size: int = 768) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(input_size, 1024), torch.nn.Dropout(0.2),
            torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
            torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _load_aesthetic(directory: Path, device: torch.device):
    import open_clip

    # the reference embeds with OpenAI's ViT-L/14 (clip.load("ViT-L/14")), which uses
    # QuickGELU: open_clip's ViT-L-14 config with quick_gelu, and those weights converted to
    # an open_clip state dict (as open_clip and timm publish them)
    architecture = {**open_clip.get_model_config("ViT-L-14"), "quick_gelu": True}
    model = _open_clip_model(directory, architecture,
                             _first_file(directory, OPEN_CLIP_WEIGHTS), device)
    head = AestheticHead(model.visual.output_dim)
    head.load_state_dict(torch.load(directory / AESTHETIC_HEAD, map_location="cpu",
                                    weights_only=True))
    head = head.to(device).eval()  # eval: the Dropouts off
    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size

    @torch.no_grad()
    def score(images: np.ndarray, prompts: list[str]) -> np.ndarray:
        out = []
        for part in _chunks(len(images)):
            pixels = _openai_clip_pixels(images[part], size).to(device)
            with _autocast(device):
                embedding = model.encode_image(pixels).float()
            # the reference L2-normalises the embedding (normalized(), numpy) and runs the
            # head in fp32 (type(torch.cuda.FloatTensor))
            embedding = torch.nn.functional.normalize(embedding, dim=-1)
            out.append(head(embedding).squeeze(-1).cpu())
        return torch.cat(out).double().numpy()

    return score


# ---------------------------------------------------------------------------------------------
# pickscore, clip_score (transformers CLIP)

def _transformers_unavailable() -> str | None:
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        return (f"transformers does not import ({error}); install the 'clip' extra: pip "
                "install 'neighbor-grpo-studio[clip]'")
    return None


def _load_hf_clip(directory: Path, device: torch.device):
    import transformers
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(directory, local_files_only=True).to(device).eval()
    # the PIL image processor, as PickScore's reference ran (transformers 4's slow
    # CLIPImageProcessor): where torchvision is installed transformers would otherwise pick
    # its torchvision backend, whose bicubic resize differs from PIL's
    pil = {"backend": "pil"} if int(transformers.__version__.split(".")[0]) >= 5 \
        else {"use_fast": False}
    processor = CLIPProcessor.from_pretrained(directory, local_files_only=True, **pil)
    return model, processor


def _features(output: Any) -> torch.Tensor:
    # get_image_features / get_text_features return the projected embeddings (a tensor, or
    # in newer transformers an output whose pooler_output holds them)
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _hf_clip_cosine(model, processor, device: torch.device, images: np.ndarray,
                    prompts: list[str]) -> torch.Tensor:
    """(N,) cosine of each image with its prompt. Preprocessing is the directory's
    CLIPProcessor (resize the short side, centre crop, normalise, from its
    preprocessor_config.json), text padded and truncated to 77 tokens: PickScore's reference
    (the model card's calc_probs) calls the processor exactly so."""
    out = []
    for part in _chunks(len(prompts)):
        # channels_last said, not guessed: transformers guesses from the array's shape and
        # takes a 1- or 3-pixel-high image for channels-first
        pixels = processor(images=list(images[part]), return_tensors="pt",
                           input_data_format="channels_last")["pixel_values"]
        text = processor(text=prompts[part], padding=True, truncation=True, max_length=77,
                         return_tensors="pt")
        with _autocast(device):
            image = _features(model.get_image_features(pixel_values=pixels.to(device))).float()
            text = _features(model.get_text_features(
                input_ids=text["input_ids"].to(device),
                attention_mask=text["attention_mask"].to(device))).float()
        image = torch.nn.functional.normalize(image, dim=-1)
        text = torch.nn.functional.normalize(text, dim=-1)
        out.append((image * text).sum(-1).cpu())
    return torch.cat(out)


def _load_pickscore(directory: Path, device: torch.device):
    model, processor = _load_hf_clip(directory, device)

    @torch.no_grad()
    def score(images: np.ndarray, prompts: list[str]) -> np.ndarray:
        # PickScore's model card: scores = model.logit_scale.exp() * (text_embs @ image_embs.T)
        scale = model.logit_scale.exp().float().cpu()
        return (scale * _hf_clip_cosine(model, processor, device, images, prompts)).double().numpy()

    return score


def _load_clip_score(directory: Path, device: torch.device):
    model, processor = _load_hf_clip(directory, device)

    @torch.no_grad()
    def score(images: np.ndarray, prompts: list[str]) -> np.ndarray:
        # CLIPScore (Hessel et al., 2021) is w * max(cos, 0); w = 100 as torchmetrics'
        # CLIPScore reports it (the paper's w = 2.5 only rescales)
        cosine = _hf_clip_cosine(model, processor, device, images, prompts)
        return (100.0 * cosine.clamp(min=0)).double().numpy()

    return score


# ---------------------------------------------------------------------------------------------
# imagereward
#
# ImageReward (Xu et al. 2023, github.com/THUDM/ImageReward) is BLIP's ViT-L/16 image encoder and
# BLIP's BERT-base text encoder, whose layers cross-attend to the image tokens, then an MLP on the
# text encoder's first token. The `image-reward` package pins timm==0.6.13 (open-clip-torch needs
# timm 1.x), so this adapter rebuilds the model from transformers' port of BLIP (BlipVisionModel is
# BLIP's vit.py, BlipTextModel its med.py) and converts the published ImageReward.pt to it.

IMAGEREWARD_CHECKPOINT = "ImageReward.pt"
IMAGEREWARD_MED_CONFIG = "med_config.json"
# bert-base-uncased's tokenizer, which ImageReward's blip.py init_tokenizer downloads and we do not:
# a tokenizer directory (the hub's bert-base-uncased files, or a save_pretrained) or its vocab.txt
IMAGEREWARD_TOKENIZER = ("tokenizer/vocab.txt", "tokenizer/tokenizer.json", "vocab.txt")
# ImageReward/ImageReward.py, ImageReward.__init__: the reward is standardised with these
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
# ImageReward/ImageReward.py, score and inference_rank: tokenizer(prompt, padding="max_length",
# truncation=True, max_length=35)
IMAGEREWARD_MAX_LENGTH = 35
# blip.py create_vit: ViT-B is 768 wide with 12 heads, ViT-L 1024 wide with 16: 64 per head in both
# (the head count is not in the state dict)
BLIP_VIT_HEAD_DIM = 64
# vit.py VisionTransformer: norm_layer = partial(nn.LayerNorm, eps=1e-6)
BLIP_VIT_LAYER_NORM_EPS = 1e-6


def _imagereward_unavailable() -> str | None:
    # the adapter needs transformers alone (its BLIP port and BERT tokenizer), not the
    # image-reward package, timm or open_clip
    return _transformers_unavailable()


class ImageRewardHead(AestheticHead):
    """ImageReward/ImageReward.py's MLP: the aesthetic predictor's stack (ImageReward credits
    improved-aesthetic-predictor), Linear(768, 1024) ... Linear(16, 1) with Dropouts and no
    activations; the checkpoint's keys are mlp.layers.{0,2,4,6,7}.*"""


class ImageRewardModel(torch.nn.Module):
    """ImageReward's forward on transformers' BLIP: `vision` (BlipVisionModel: patch embedding,
    pre-norm ViT blocks, final LayerNorm), `text` (BlipTextModel without pooler: BERT layers
    with self-attention, cross-attention to the image tokens, feed-forward) and `head`."""

    def __init__(self, vision_config: Any, text_config: Any) -> None:
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        self.vision = BlipVisionModel(vision_config)
        # blip_pretrain.py: BertModel(config=encoder_config, add_pooling_layer=False)
        self.text = BlipTextModel(text_config, add_pooling_layer=False)
        self.head = ImageRewardHead(text_config.hidden_size)
        self.image_size = int(vision_config.image_size)

    def features(self, pixels: torch.Tensor, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor) -> torch.Tensor:
        """(N, hidden) the text encoder's first-token state, cross-attending to the image."""
        image = self.vision(pixel_values=pixels).last_hidden_state
        # ImageReward.py: encoder_attention_mask all ones (every image token is attended to);
        # is_decoder=False: bidirectional self-attention, BLIP med.py's default encoder mode
        text = self.text(input_ids=input_ids, attention_mask=attention_mask,
                         encoder_hidden_states=image,
                         encoder_attention_mask=torch.ones(image.shape[:2], dtype=torch.long,
                                                           device=image.device),
                         is_decoder=False)
        # ImageReward.py: text_output.last_hidden_state[:, 0, :]
        return text.last_hidden_state[:, 0, :]

    def reward(self, features: torch.Tensor) -> torch.Tensor:
        """(N,) ImageReward.py: (mlp(features) - mean) / std."""
        return (self.head(features).squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


def _imagereward_vision_config(state: dict[str, torch.Tensor]):
    """BlipVisionConfig of the checkpoint's visual encoder, read from its shapes: width and patch
    size from patch_embed.proj, image size from pos_embed (1 + (size / patch)^2 positions; 224
    for ImageReward.pt, as ImageReward.py builds BLIP_Pretrain(image_size=224, vit='large')),
    depth from the block count, MLP width from fc1, heads at BLIP's 64 per head."""
    from transformers import BlipVisionConfig

    prefix = "blip.visual_encoder."
    patch = state[prefix + "patch_embed.proj.weight"]  # (width, 3, patch, patch)
    width, patch_size = int(patch.shape[0]), int(patch.shape[-1])
    positions = int(state[prefix + "pos_embed"].shape[1]) - 1  # less the cls token's
    grid = int(round(positions ** 0.5))
    if grid * grid != positions:
        raise ValueError(f"{IMAGEREWARD_CHECKPOINT}: pos_embed holds {positions} patch positions, "
                         "not a square grid")
    depth = 1 + max(int(key[len(prefix):].split(".")[1]) for key in state
                    if key.startswith(prefix + "blocks."))
    return BlipVisionConfig(
        hidden_size=width, patch_size=patch_size, image_size=grid * patch_size,
        num_hidden_layers=depth,
        intermediate_size=int(state[prefix + "blocks.0.mlp.fc1.weight"].shape[0]),
        num_attention_heads=max(1, width // BLIP_VIT_HEAD_DIM),
        # vit.py: nn.GELU (the exact, erf form: transformers' "gelu"), LayerNorm eps 1e-6
        hidden_act="gelu", layer_norm_eps=BLIP_VIT_LAYER_NORM_EPS, attention_dropout=0.0)


def _imagereward_text_config(med_config: Path, vision_width: int):
    """BlipTextConfig from BLIP's med_config.json (a transformers BertConfig json, read the way
    blip_pretrain.py reads it: BertConfig.from_json_file, so BERT's defaults fill what it omits)."""
    from transformers import BertConfig, BlipTextConfig

    bert = BertConfig.from_json_file(str(med_config))
    if not getattr(bert, "add_cross_attention", False):
        raise ValueError(f"{med_config}: add_cross_attention is not true; ImageReward's text "
                         "encoder cross-attends to the image (BLIP's med_config.json sets it)")
    if getattr(bert, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{med_config}: position_embedding_type "
                         f"{bert.position_embedding_type!r}; only BLIP's absolute one is supported")
    return BlipTextConfig(
        vocab_size=bert.vocab_size, hidden_size=bert.hidden_size,
        num_hidden_layers=bert.num_hidden_layers, num_attention_heads=bert.num_attention_heads,
        intermediate_size=bert.intermediate_size,
        max_position_embeddings=bert.max_position_embeddings, hidden_act=bert.hidden_act,
        layer_norm_eps=bert.layer_norm_eps, pad_token_id=bert.pad_token_id,
        # blip_pretrain.py: encoder_config.encoder_width = vision_width. The file's own
        # encoder_width (768 in BLIP's med_config.json) is overridden by the ViT-L's 1024.
        encoder_hidden_size=vision_width,
        # transformers builds the crossattention modules only for is_decoder configs; forward
        # passes is_decoder=False, so the self-attention stays bidirectional
        is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        # generation's token ids (BlipTextConfig's defaults are BLIP's 30522 / 102 / 2): the
        # encoder never reads them, and with a smaller vocabulary they only warn
        bos_token_id=None, eos_token_id=None, sep_token_id=None)


# ImageReward.pt's names -> ImageRewardModel's, as (original prefix, ours) per kind of key;
# a block's or layer's index is kept. Vision: BLIP's vit.py (timm's VisionTransformer names) ->
# BlipVisionModel; text: BLIP's med.py BertModel -> BlipTextModel, whose names are the same.
_IMAGEREWARD_VIT_TOP = {
    "cls_token": "embeddings.class_embedding",  # (1, 1, width)
    "pos_embed": "embeddings.position_embedding",  # (1, 1 + patches, width)
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",  # Conv2d, stride = patch
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_IMAGEREWARD_VIT_BLOCK = {
    "norm1": "layer_norm1",
    # the fused qkv Linear maps as it is: both reshape its output to (3, heads, head_dim)
    # (vit.py Attention.forward, transformers' BlipAttention.forward)
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
# in ImageReward.pt but not used by the score: BLIP_Pretrain's contrastive projections, and
# med.py's position_ids buffer (arange; transformers rebuilds it)
_IMAGEREWARD_UNUSED = ("blip.vision_proj.", "blip.text_proj.",
                       "blip.text_encoder.embeddings.position_ids")


def imagereward_state_dict(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ImageReward.pt's state dict renamed to ImageRewardModel's. Every key is either mapped or
    one of the known unused ones; any other raises (a different model, not a silent partial
    load: the reference loads with strict=False)."""
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in original.items():
        if key.startswith(_IMAGEREWARD_UNUSED):
            continue
        if key.startswith("blip.visual_encoder."):
            name = key[len("blip.visual_encoder."):]
            if name in _IMAGEREWARD_VIT_TOP:
                out["vision." + _IMAGEREWARD_VIT_TOP[name]] = value
                continue
            parts = name.split(".")
            # blocks.<i>.<module path>.<weight|bias>
            module = ".".join(parts[2:-1])
            if parts[0] == "blocks" and len(parts) >= 4 and module in _IMAGEREWARD_VIT_BLOCK:
                out[f"vision.encoder.layers.{parts[1]}.{_IMAGEREWARD_VIT_BLOCK[module]}."
                    f"{parts[-1]}"] = value
                continue
        elif key.startswith("blip.text_encoder."):
            out["text." + key[len("blip.text_encoder."):]] = value
            continue
        elif key.startswith("mlp.layers."):
            out["head." + key[len("mlp."):]] = value
            continue
        unknown.append(key)
    if unknown:
        raise ValueError(f"{IMAGEREWARD_CHECKPOINT}: keys that are not ImageReward's: "
                         f"{sorted(unknown)[:10]}{' ...' if len(unknown) > 10 else ''}")
    return out


def _imagereward_tokenizer(directory: Path):
    """blip.py init_tokenizer without the download: bert-base-uncased's tokenizer from
    `directory`/tokenizer/ or `directory`/vocab.txt, then BLIP's added tokens: [DEC] as the bos
    token, [ENC] as an additional special token (ids 30522 and 30523 after bert-base-uncased's
    30522, within med_config's vocab_size 30524), so a prompt that spells them tokenizes as the
    reference's does."""
    from transformers import BertTokenizer

    source = directory / "tokenizer" if (directory / "tokenizer").is_dir() else directory
    tokenizer = BertTokenizer.from_pretrained(str(source), local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


def _imagereward_tokens(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (N, 35). The reference passes input_ids as the
    tokenizer gives them, [CLS] first: unlike BLIP's image-text matching head, ImageReward does
    not put enc_token_id there (ImageReward.py score, inference_rank, score_gard)."""
    text = tokenizer(prompts, padding="max_length", truncation=True,
                     max_length=IMAGEREWARD_MAX_LENGTH, return_tensors="pt")
    return text["input_ids"], text["attention_mask"]


def load_imagereward_model(directory: Path) -> ImageRewardModel:
    """ImageRewardModel from `directory`'s ImageReward.pt and med_config.json, on the CPU in
    eval mode (Dropouts off), loaded strictly after imagereward_state_dict's renaming."""
    # ImageReward/utils.py load: torch.load of ImageReward.pt, a plain state dict of
    # ImageReward (blip.* and mlp.*)
    original = torch.load(directory / IMAGEREWARD_CHECKPOINT, map_location="cpu",
                          weights_only=True)
    vision_config = _imagereward_vision_config(original)
    text_config = _imagereward_text_config(directory / IMAGEREWARD_MED_CONFIG,
                                           vision_config.hidden_size)
    model = ImageRewardModel(vision_config, text_config)
    model.load_state_dict(imagereward_state_dict(original), strict=True)
    return model.eval()


def _load_imagereward(directory: Path, device: torch.device):
    model = load_imagereward_model(directory).to(device)
    tokenizer = _imagereward_tokenizer(directory)
    if len(tokenizer) > model.text.config.vocab_size:
        raise ValueError(f"reward 'imagereward': the tokenizer in {str(directory)!r} has "
                         f"{len(tokenizer)} tokens with BLIP's [DEC] and [ENC], more than "
                         f"{IMAGEREWARD_MED_CONFIG}'s vocab_size {model.text.config.vocab_size}")

    @torch.no_grad()
    def score(images: np.ndarray, prompts: list[str]) -> np.ndarray:
        out = []
        for part in _chunks(len(prompts)):
            # ImageReward.py _transform(224): Resize(224, BICUBIC), CenterCrop(224), RGB,
            # ToTensor, Normalize with OpenAI CLIP's mean/std (the same numbers as OPENAI_MEAN
            # / OPENAI_STD): _openai_clip_pixels is that transform, PIL's bicubic included
            pixels = _openai_clip_pixels(images[part], model.image_size).to(device)
            input_ids, attention_mask = _imagereward_tokens(tokenizer, prompts[part])
            with _autocast(device):
                features = model.features(pixels, input_ids.to(device),
                                          attention_mask.to(device))
            # ImageReward.py: the features .float() before the MLP; the head runs in fp32
            out.append(model.reward(features.float()).cpu())
        return torch.cat(out).double().numpy()

    return score


# ---------------------------------------------------------------------------------------------

MODEL_REWARDS: dict[str, ModelReward] = {
    "hpsv2": ModelReward("hpsv2", ((HPS_CHECKPOINT,),), _load_hpsv2, _open_clip_unavailable),
    "pickscore": ModelReward("pickscore", HF_CLIP_FILES, _load_pickscore,
                             _transformers_unavailable),
    "clip_score": ModelReward("clip_score", HF_CLIP_FILES, _load_clip_score,
                              _transformers_unavailable),
    "aesthetic": ModelReward("aesthetic", (OPEN_CLIP_WEIGHTS, (AESTHETIC_HEAD,)),
                             _load_aesthetic, _open_clip_unavailable),
    "imagereward": ModelReward("imagereward", ((IMAGEREWARD_CHECKPOINT,), (IMAGEREWARD_MED_CONFIG,),
                                               IMAGEREWARD_TOKENIZER),
                               _load_imagereward, _imagereward_unavailable),
}

for _name in MODEL_REWARDS:
    register_builtin_reward(_name, _LazyReward(_name))
