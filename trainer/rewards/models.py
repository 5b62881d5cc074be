"""Rewards from published reward models, loaded from local weights (never downloaded).

| name         | model                                          | score                           |
|--------------|------------------------------------------------|---------------------------------|
| `hpsv2`      | HPS v2.1: open_clip ViT-H-14 + HPS checkpoint  | cos(image, text), as hpsv2's    |
|              |                                                | img_score.py (not x100)         |
| `pickscore`  | PickScore v1: transformers CLIPModel (ViT-H)   | logit_scale.exp() * cos         |
| `clip_score` | transformers CLIP (e.g. ViT-L/14)              | 100 * max(cos, 0) (CLIPScore)   |
| `aesthetic`  | LAION aesthetic predictor v2: open_clip        | MLP(normalised image embedding) |
|              | ViT-L-14 (OpenAI weights, QuickGELU) + MLP head|                                 |
| `imagereward`| ImageReward (BLIP)                             | not available yet (see below)   |

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

from trainer.rewards.registry import register_reward

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

DEFAULT_BATCH_SIZE = 32


class RewardWeightsMissing(FileNotFoundError):
    """A model-backed reward's weights directory is missing or incomplete. `reward` names it,
    `setting` says where its directory comes from (REWARD_MODELS_DIR or
    reward_model_paths[name])."""

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
_device: torch.device | None = None
_cache: dict[tuple[str, str, str], Callable[[np.ndarray, list[str]], np.ndarray]] = {}


def default_models_dir() -> Path:
    """REWARD_MODELS_DIR, else DATA_DIR/reward_models (the studio's Settings default the
    same way; the trainer reads the environment itself and does not import app/)."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    return Path(os.environ.get("DATA_DIR") or "./data") / "reward_models"


def configure_reward_models(paths: dict[str, str] | None = None,
                            device: torch.device | str | None = None) -> None:
    """Set the per-reward directories (a train config's `reward_model_paths`) and the device
    the models run on, for this process. Models already loaded stay cached by directory and
    device, so switching back costs nothing."""
    global _device
    unknown = sorted(set(paths or {}) - set(MODEL_REWARDS))
    if unknown:
        raise ValueError(f"reward_model_paths: {unknown} are not model-backed rewards; known: "
                         f"{sorted(MODEL_REWARDS)}")
    with _lock:
        _paths.clear()
        _paths.update(paths or {})
        if device is not None:
            _device = torch.device(device)


def reward_model_dir(name: str, paths: dict[str, str] | None = None,
                     default_dir: Path | None = None) -> tuple[Path, str]:
    """(directory, the setting it comes from) of the model-backed reward `name`: `paths[name]`
    (default: those configure_reward_models set), else `default_dir` (default:
    default_models_dir()) / name."""
    paths = _paths if paths is None else paths
    if paths.get(name):
        return Path(paths[name]), f"reward_model_paths[{name!r}]"
    return (default_dir or default_models_dir()) / name, ENV_DIR


def expected_files(name: str) -> list[str]:
    """What the directory of `name` must hold, one line per file ('a or b' for alternatives)."""
    return [" or ".join(alternatives) for alternatives in MODEL_REWARDS[name].files]


def weights_problem(name: str, paths: dict[str, str] | None = None,
                    default_dir: Path | None = None, check_packages: bool = True) -> str | None:
    """Why the model-backed reward `name` cannot load (its package missing, its directory
    missing or incomplete), naming the reward, the setting and the files expected; None when
    it can. `paths` and `default_dir` as reward_model_dir takes them. `check_packages=False`
    (a caller whose environment is not the one that trains) checks the files alone."""
    spec = MODEL_REWARDS[name]
    directory, setting = reward_model_dir(name, paths, default_dir)
    expected = "; ".join(expected_files(name))
    problems = []
    if ((check_packages or not spec.implemented)
            and (reason := spec.unavailable()) is not None):
        problems.append(f"reward {name!r} cannot load here: {reason}")
    if not directory.is_dir():
        problems.append(f"reward {name!r}: weights directory {str(directory)!r} (from {setting}) "
                        f"does not exist; it must hold: {expected}. Nothing is downloaded: "
                        f"put the published weights there")
    elif missing := [" or ".join(alts) for alts in spec.files
                     if not any((directory / f).is_file() for f in alts)]:
        problems.append(f"reward {name!r}: weights directory {str(directory)!r} (from {setting}) "
                        f"lacks {'; '.join(missing)} (it must hold: {expected})")
    return "; ".join(problems) or None


def check_reward_models(names: list[str] | dict[str, Any],
                        paths: dict[str, str] | None = None) -> None:
    """Raise RewardWeightsMissing for the first model-backed reward among `names` whose
    weights cannot load; other names are ignored."""
    for name in names:
        if name in MODEL_REWARDS and (problem := weights_problem(name, paths)) is not None:
            setting = reward_model_dir(name, paths)[1]
            raise RewardWeightsMissing(name, setting, problem)


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
    resize when the longest side is already `size`. Batched: every image of one call has one
    shape."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
    height, width = x.shape[-2:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        new_h, new_w = round(height * scale), round(width * scale)
        # torchvision.transforms.functional.resize on a float tensor is exactly this call
        x = torch.nn.functional.interpolate(x, size=(new_h, new_w), mode="bicubic",
                                            align_corners=False, antialias=True)
        pad_h, pad_w = size - new_h, size - new_w
        x = torch.nn.functional.pad(x, (pad_w // 2, pad_w - pad_w // 2,
                                        pad_h // 2, pad_h - pad_h // 2), value=0.0)
    mean = torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def _open_clip_model(directory: Path, architecture: dict[str, Any], weights: Path,
                     device: torch.device):
    """An open_clip CLIP of `architecture` (or the directory's open_clip_config.json
    model_cfg) with the state dict in `weights`, in eval mode on `device`."""
    import open_clip
    from open_clip.model import CLIP

    config_file = directory / OPEN_CLIP_CONFIG
    cfg = json.loads(config_file.read_text())["model_cfg"] if config_file.is_file() \
        else architecture
    model = CLIP(**cfg)
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
        pixels = processor(images=list(images[part]), return_tensors="pt")["pixel_values"]
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

def _imagereward_unavailable() -> str | None:
    # `pip install --dry-run image-reward` (1.5, its latest release) against this project's
    # environment: it pins timm==0.6.13 and fairscale==0.4.13, which would downgrade the
    # timm 1.x that open-clip-torch needs. Until an adapter that does without the package
    # exists, the name is registered and says so.
    return ("the 'image-reward' package is not installed: it pins timm==0.6.13, which would "
            "downgrade the timm that open-clip-torch (the 'rewards' extra) needs, so it is not "
            "part of the extra; an ImageReward adapter without it is not implemented yet")


def _load_imagereward(directory: Path, device: torch.device):
    raise RuntimeError(_imagereward_unavailable())


# ---------------------------------------------------------------------------------------------

MODEL_REWARDS: dict[str, ModelReward] = {
    "hpsv2": ModelReward("hpsv2", ((HPS_CHECKPOINT,),), _load_hpsv2, _open_clip_unavailable),
    "pickscore": ModelReward("pickscore", HF_CLIP_FILES, _load_pickscore,
                             _transformers_unavailable),
    "clip_score": ModelReward("clip_score", HF_CLIP_FILES, _load_clip_score,
                              _transformers_unavailable),
    "aesthetic": ModelReward("aesthetic", (OPEN_CLIP_WEIGHTS, (AESTHETIC_HEAD,)),
                             _load_aesthetic, _open_clip_unavailable),
    "imagereward": ModelReward("imagereward", (("ImageReward.pt",), ("med_config.json",)),
                               _load_imagereward, _imagereward_unavailable,
                               implemented=False),
}

for _name in MODEL_REWARDS:
    register_reward(_name, _LazyReward(_name))
