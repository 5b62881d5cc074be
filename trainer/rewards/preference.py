"""A human-preference reward model r(image, prompt) fitted to pairwise votes (Bradley-Terry).

P(a beats b) = sigmoid(r(a) - r(b)). Votes `a`/`b` are wins, `tie` is half a win each;
`both_bad` and `skip` carry no preference and stay out of the fit (they are counted).
Nothing here knows which attribute an annotator cares about: the network sees pixels and the
prompt, and learns whatever the votes reward.

Each model is an ensemble of `ensemble` scorers trained on the same votes, scoring with their
mean: a few thousand noisy comparisons of near-identical images leave one network's ranking of
close pairs to chance, and averaging removes much of that variance (measured in
docs/benchmarks.md). With `shared_features` (the default) the first network is trained whole
and the others are heads on its frozen pooled features, each on its own bootstrap resample of
the votes: the convolutions, which cost nearly all of a fit, run for one network, and the
heads' disagreement still marks images unlike the voted ones.

Features:
- `shapes`: a small convolutional network on the 32x32 image with coordinate channels (so
  "where" is as learnable as "what") and the prompt's tokens, trained end to end on the votes.
- `clip`: an image-text embedding (transformers CLIP, weights from a local path) frozen, with a
  small head on [image embedding, image * text embedding] trained on the votes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from trainer.rewards.fit_config import MIN_FIT_VOTES, FitConfig
from trainer.rewards.outcomes import LABELLED_OUTCOMES, OUTCOMES, TARGET_A, Outcome
from trainer.shapes.world import IMAGE_SIZE, PROMPT_LENGTH, VOCAB, not_shapes_prompts, tokenize
from trainer.write_errors import as_os_error, readable_as_umask_allows


@dataclass
class PreferencePair:
    image_a: np.ndarray  # (H, W, 3) uint8
    image_b: np.ndarray
    prompt: str
    outcome: str  # an Outcome value
    # a stable identity (the studio passes the vote's id): when every pair has one, the votes
    # are held out by a hash of the two images they compare, the same in every refit of the
    # same seed, so a refit that starts from an earlier model is never judged on votes (or
    # pairs) that model trained on
    key: str | None = None


@dataclass
class FitReport:
    version: int
    votes_total: int
    votes_fitted: int
    votes_ignored: dict[str, int]
    train_pairs: int
    heldout_pairs: int
    heldout_accuracy: float | None  # on decisive held-out pairs
    heldout_log_loss: float | None
    train_accuracy: float | None  # None: no decisive (a or b) vote among those trained on
    seconds: float
    # on the decisive held-out pairs, against the votes: how far the model's confidence is
    # from how often it is right (0: calibrated); None in files fitted before it was reported
    heldout_calibration_error: float | None = None
    extra: dict = field(default_factory=dict)


def expected_calibration_error(p: np.ndarray, truth: np.ndarray, bins: int = 10) -> float:
    """ECE of the side the model picks: its confidence max(p, 1 - p) in `bins` equal-width
    bins of [0, 1], |accuracy - mean confidence| per bin, weighted by the bin's share of the
    pairs. The pick is a where p > 0.5, else b, as the accuracy counts it; `truth`: a won."""
    p, truth = np.asarray(p, float), np.asarray(truth, bool)
    picks_a = p > 0.5
    confidence = np.where(picks_a, p, 1 - p)
    right = picks_a == truth
    index = np.minimum((confidence * bins).astype(int), bins - 1)
    ece = 0.0
    for b in np.unique(index):
        in_bin = index == b
        ece += in_bin.mean() * abs(right[in_bin].mean() - confidence[in_bin].mean())
    return float(ece)


class ShapesPreferenceNet(nn.Module):
    """Per-pixel conv features (with coordinate channels), attention-pooled, with the prompt.

    Attention pooling (softmax weights over pixels) makes normalised averages, "the mean of
    some local property over the pixels that matter", as easy to express as sums, so
    per-object properties do not get confused with how many objects there are.
    """

    def __init__(self, width: int = 32, heads: int = 4, spread: bool = False) -> None:
        super().__init__()
        self.spread = spread
        pooled = heads * width * (2 if spread else 1)
        self.convs = nn.Sequential(
            nn.Conv2d(5, width, 3, padding=1), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=2, dilation=2), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=4, dilation=4), nn.GELU(),
        )
        self.heads = heads
        self.score = nn.Conv2d(width, heads, 1)
        self.value = nn.Conv2d(width, width, 1)
        self.prompt = nn.Embedding(len(VOCAB), pooled)
        self.head = nn.Sequential(nn.Linear(pooled, 64), nn.GELU(), nn.Linear(64, 1))

    def pooled(self, images: torch.Tensor) -> torch.Tensor:
        """(N, heads*C): the attention-pooled features a head scores."""
        n, _, h, w = images.shape
        ys = torch.linspace(-1, 1, h, device=images.device).view(1, 1, h, 1).expand(n, 1, h, w)
        xs = torch.linspace(-1, 1, w, device=images.device).view(1, 1, 1, w).expand(n, 1, h, w)
        features = self.convs(torch.cat([images, ys, xs], 1))  # (N, C, H, W)
        weights = self.score(features).flatten(2).softmax(-1)  # (N, heads, HW)
        values = self.value(features).flatten(2)  # (N, C, HW)
        mean = torch.einsum("nkp,ncp->nkc", weights, values)  # (N, heads, C)
        if not self.spread:
            return mean.flatten(1)  # (N, heads*C)
        # and how far the attended pixels' values spread around that mean: with a value that
        # follows a coordinate channel, how spread out the attended objects lie (centre to
        # centre), which a mean alone cannot say
        second = torch.einsum("nkp,ncp->nkc", weights, values.square())
        spread = (second - mean.square()).clamp_min(1e-6).sqrt()
        return torch.cat([mean, spread], -1).flatten(1)  # (N, heads*2C)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return _prompted_score(self.prompt, self.head, self.pooled(images), tokens)


def _prompted_score(prompt: nn.Embedding, head: nn.Module, pooled: torch.Tensor,
                    tokens: torch.Tensor) -> torch.Tensor:
    """(N,): the head on the pooled features, modulated by the prompt's mean token embedding."""
    return head(pooled * (1 + prompt(tokens).mean(1))).squeeze(-1)


class ShapesHead(nn.Module):
    """A ShapesPreferenceNet's prompt embedding and head alone, on another net's features."""

    def __init__(self, width: int = 32, heads: int = 4, spread: bool = False) -> None:
        super().__init__()
        pooled = heads * width * (2 if spread else 1)
        self.prompt = nn.Embedding(len(VOCAB), pooled)
        self.head = nn.Sequential(nn.Linear(pooled, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, pooled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return _prompted_score(self.prompt, self.head, pooled, tokens)


class SharedFeatureEnsemble(nn.Module):
    """One ShapesPreferenceNet and heads on its features; (1 + heads, N) scores."""

    def __init__(self, first: ShapesPreferenceNet, heads: list[ShapesHead]) -> None:
        super().__init__()
        self.first = first
        self.heads = nn.ModuleList(heads)

    @property
    def members(self) -> list[nn.Module]:
        return [self.first, *self.heads]

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        pooled = self.first.pooled(images)
        first = _prompted_score(self.first.prompt, self.first.head, pooled, tokens)
        return torch.stack([first, *(head(pooled, tokens) for head in self.heads)])


class ClipPreferenceHead(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(2 * dim, 256), nn.GELU(), nn.Linear(256, 1))

    def forward(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([image_emb, image_emb * text_emb], -1)).squeeze(-1)


class Ensemble(nn.Module):
    """Several networks with the same inputs; (members, N) scores."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return torch.stack([member(*inputs) for member in self.members])


def features_problem(features: str, prompt: str, image_shape: tuple[int, ...] | None = None
                     ) -> str | None:
    """Why a preference model with `features` cannot score an image made for `prompt` (of
    `image_shape`, when given: None checks the prompt alone, before any image is loaded), or
    None. The shapes features tokenize the shapes world's prompts and read its 32x32 images;
    CLIP's take any text and image (its processor resizes each image)."""
    if features != "shapes":
        return None
    if not_shapes_prompts([prompt]):
        return f"not a shapes prompt: {prompt[:60]!r}"
    if image_shape is not None and tuple(image_shape[:2]) != (IMAGE_SIZE, IMAGE_SIZE):
        return (f"a {image_shape[1]}x{image_shape[0]} image (the shapes features read the "
                f"shapes world's {IMAGE_SIZE}x{IMAGE_SIZE} ones)")
    return None


V = TypeVar("V")  # a vote, in whatever form its caller holds it


def readable_votes(votes: Sequence[V], features: str, prompt_of: Callable[[V], str],
                      image_shapes_of: Callable[[V], Iterable[tuple[int, ...]]]
                      ) -> tuple[list[V], int]:
    """The votes whose prompt and two images a fit with `features` reads (features_problem:
    the shapes features read the shapes world's prompts and 32x32 images alone), and how many
    were left out; the rule the studio's fit_preference job and `fit-preference` share, so a
    vote the job leaves out the CLI leaves out too. `image_shapes_of(vote)`: its images'
    (H, W, ...), iterated only once its prompt passed (lazily: a shape may mean reading a
    file header)."""
    readable = [vote for vote in votes if features_problem(features, prompt_of(vote)) is None
                and all(features_problem(features, prompt_of(vote), shape) is None
                        for shape in image_shapes_of(vote))]
    return readable, len(votes) - len(readable)


def saved_fit_fields(path: str | Path) -> dict[str, Any]:
    """The fit settings (FitConfig's fields) of the preference model saved at `path`, read
    from its header alone (ValueError when it is not a preference model)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != "preference-model":
        raise ValueError(f"{path} is not a preference model")
    return dict(json.loads(meta["fit_config"]))


def saved_features(path: str | Path) -> str:
    """The features ('shapes' or 'clip') of the preference model saved at `path`, read from
    its header alone (ValueError when it is not a preference model)."""
    return str(saved_fit_fields(path).get("features", "shapes"))


def model_features_problem(features: str, model: str) -> str | None:
    """Why a preference model with `features` cannot score flow model `model`'s images (the
    rule the studio's jobs and the CLI share; the caller names the preference model before
    it), or None."""
    if features == "shapes" and model != "shapes":
        return (f"reads the shapes world's images and prompts (features 'shapes'): it cannot "
                f"score model {model!r}; fit one with features 'clip' for it")
    return None


def image_batch(images: Sequence[np.ndarray]) -> np.ndarray | list[np.ndarray]:
    """Images as one array where they share a size (what the shapes features need), else as
    a list (CLIP's processor resizes each; samples of several models or resolutions)."""
    if len({image.shape for image in images}) <= 1:
        return np.stack(images) if len(images) else np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3),
                                                              np.uint8)
    return list(images)


class PreferenceModel:
    """A fitted preference reward; callable as a registry reward `(images, prompts) -> (N,)`."""

    def __init__(self, config: FitConfig, net: nn.Module | None = None,
                 report: FitReport | None = None) -> None:
        self.config = config
        self.report = report
        self.uncertainty_penalty = 0.0  # set by the trainer that blends it in
        self._clip = None
        if net is None:
            count = max(1, config.ensemble)
            if config.features == "shapes" and config.shared_features:
                net = SharedFeatureEnsemble(
                    ShapesPreferenceNet(config.width, spread=config.spread_pooling),
                    [ShapesHead(config.width, spread=config.spread_pooling)
                     for _ in range(count - 1)])
            else:
                net = Ensemble([self._new_member() for _ in range(count)])
        self.net = net.to(config.device)

    def _new_member(self) -> nn.Module:
        if self.config.features == "shapes":
            return ShapesPreferenceNet(self.config.width, spread=self.config.spread_pooling)
        return ClipPreferenceHead(self._clip_encoder().dim)

    # -- features -------------------------------------------------------------------------------
    def _clip_encoder(self) -> _ClipEncoder:
        if self._clip is None:
            self._clip = clip_encoder(self.config.clip_path, self.config.device)
        return self._clip

    def _inputs(self, images: np.ndarray, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config.features == "shapes":
            x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 127.5 - 1
            return x.to(self.config.device), torch.from_numpy(tokenize(prompts)).to(self.config.device)
        return self._clip_encoder().encode(images, prompts)

    @torch.no_grad()
    def member_scores(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        """(ensemble, N): every network's score."""
        self.net.eval()
        chunks = [self.net(*self._inputs(images[i:i + 512], prompts[i:i + 512])).float().cpu()
                  for i in range(0, len(prompts), 512)]
        return torch.cat(chunks, 1).numpy().astype(np.float64)

    def scores(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        """The ensemble's mean score r(image, prompt), the Bradley-Terry utility."""
        return self.member_scores(images, prompts).mean(0)

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        """The reward: the mean score less `uncertainty_penalty` standard deviations between
        the networks. They agree on images like those voted on and drift apart on images
        unlike them, which a policy optimising the mean would otherwise seek out."""
        members = self.member_scores(images, prompts)
        if self.uncertainty_penalty and len(members) > 1:
            return members.mean(0) - self.uncertainty_penalty * members.std(0)
        return members.mean(0)

    def prob_a_beats_b(self, images_a: np.ndarray, images_b: np.ndarray, prompts: list[str]) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(self.scores(images_a, prompts) - self.scores(images_b, prompts))))

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> None:
        meta = {"format": "preference-model", "fit_config": json.dumps(asdict(self.config)),
                "report": json.dumps(asdict(self.report)) if self.report else "null"}
        meta.update(metadata or {})
        state = {k: v.detach().contiguous().cpu() for k, v in self.net.state_dict().items()}
        # written beside `path`, then renamed over it: a full disk or an interrupt mid-write
        # leaves the model already there (fit-preference --out refits in place) whole
        path = Path(path)
        partial = path.with_name(f".{path.name}.partial")
        try:
            save_file(state, str(partial), metadata=meta)
            readable_as_umask_allows(partial)  # safetensors' own files are 0600
            os.replace(partial, path)
        except BaseException as exc:  # a full disk or a read-only one: the OSError it is
            partial.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno is not None:  # the rename's: path named
                raise OSError(exc.errno, exc.strerror, str(path)) from exc
            if (os_error := as_os_error(exc, path)) is not None:
                raise os_error from exc
            raise

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu") -> PreferenceModel:
        """The model saved at `path`; ValueError naming the file when it is not a preference
        model or is damaged inside (settings that do not parse, weights of another network,
        NaN or infinite weights): a whole header passed every check before, and the
        traceback of load_state_dict came only once a job or a command had started."""
        config, report, state = _read_saved(path, device)
        model = cls(config, report=report)
        try:
            model.net.load_state_dict(state)
        except RuntimeError as exc:  # missing, unexpected or differently shaped tensors
            detail = str(exc).splitlines()[-1].strip() if str(exc) else "?"
            raise ValueError(f"{path} is a damaged preference model: its weights are not of "
                             f"the network its fit settings describe ({detail})") from None
        return model


def _read_saved(path: str | Path, device: str) -> tuple[FitConfig, FitReport | None,
                                                         dict[str, torch.Tensor]]:
    """The fit settings, report and weights saved at `path`, each checked (ValueError naming
    the file and what is wrong)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != "preference-model":
        raise ValueError(f"{path} is not a preference model")
    try:
        fields = json.loads(meta["fit_config"])
        # saved before shared features: whole networks; before ensembles: one network
        fields.setdefault("shared_features", False)
        fields.setdefault("label_smoothing", 0.0)
        fields.setdefault("spread_pooling", False)
        state = load_file(str(path), device=device)
        if not any(k.startswith(("members.", "first.")) for k in state):
            state = {f"members.0.{k}": v for k, v in state.items()}
            fields["ensemble"] = 1
        config = FitConfig(**{**fields, "device": device})
        report_data = json.loads(meta.get("report", "null"))
        report = FitReport(**report_data) if report_data else None
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        # a field this version does not know (a newer version's file), or a header edited
        raise ValueError(f"{path} is a damaged preference model: its saved settings do not "
                         f"read ({type(exc).__name__}: {exc})") from None
    if bad := [k for k, v in state.items() if v.is_floating_point() and not v.isfinite().all()]:
        raise ValueError(f"{path} is a damaged preference model: NaN or infinite weights in "
                         f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} (a diverged "
                         "fit?); refit it")
    return config, report, state


def model_file_problem(path: str | Path) -> str | None:
    """Why the preference model at `path` would not load (PreferenceModel.load's message),
    or None. One on CLIP features is read without its network: building that loads the CLIP
    encoder (clip_dir_problem checks its directory)."""
    from safetensors import SafetensorError

    try:
        config, _, _ = _read_saved(path, "cpu")
        if config.features == "shapes":
            PreferenceModel.load(path, "cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        return str(exc)
    return None


# what CLIPModel.from_pretrained and CLIPProcessor.from_pretrained read from a local directory
# (transformers' save_pretrained writes them): each entry is satisfied by any one of its names
_CLIP_FILES = (
    ("config.json",),
    ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
     "pytorch_model.bin.index.json"),
    ("preprocessor_config.json", "processor_config.json"),  # older and newer processor files
    ("tokenizer.json", "vocab.json"),  # a fast tokenizer's file, or the BPE vocabulary
)


def clip_dir_problem(path: str | Path) -> str | None:
    """Why `path` is not a CLIP directory `features="clip"` can load (every missing file
    named), or None. For callers to check before a fit starts: transformers' own error comes
    only once the fit loads the encoder, as a traceback."""
    if not str(path).strip():  # Path("") is ".", which the message named as if given
        return ("clip_path is empty: features 'clip' needs a local CLIP directory (what "
                "transformers' CLIPModel and CLIPProcessor save_pretrained write)")
    path = Path(path)
    try:
        if not path.is_dir():
            return f"clip_path {str(path)!r} is not a directory (weights load from a local path)"
        missing = [" or ".join(names) for names in _CLIP_FILES
                   if not any((path / name).exists() for name in names)]
    except OSError as exc:  # a name too long, no permission
        return f"clip_path {str(path)!r} cannot be read ({exc.strerror or exc})"
    if missing:
        return (f"clip_path {str(path)!r} is not a complete CLIP directory: missing "
                f"{'; '.join(missing)} (what transformers' CLIPModel and CLIPProcessor "
                "save_pretrained write)")
    return None


class _ClipEncoder:
    """Frozen transformers CLIP from a local path (never downloads), with its embeddings kept
    by image content and prompt: a long-lived process refits on mostly the same voted images, and only
    the new ones need the network (the encoders themselves are kept too, `clip_encoder`)."""

    cache_size = 50_000  # embeddings of each kind kept (about 100 MB at CLIP's 512 dims)

    def __init__(self, path: str, device: str) -> None:
        if (problem := clip_dir_problem(path or "")) is not None:
            raise FileNotFoundError(problem)
        try:
            from transformers import CLIPModel, CLIPProcessor
        except ImportError as error:
            raise ImportError("features='clip' needs transformers: pip install "
                              "'neighbor-grpo-studio[clip]'") from error

        self.model = CLIPModel.from_pretrained(path, local_files_only=True).to(device).eval()
        self.processor = CLIPProcessor.from_pretrained(path, local_files_only=True)
        self.dim = self.model.config.projection_dim
        self.device = device
        self.image_embeddings: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.text_embeddings: OrderedDict[str, torch.Tensor] = OrderedDict()

    @staticmethod
    def _image_key(image: np.ndarray) -> bytes:
        image = np.ascontiguousarray(image)
        return hashlib.sha1(image.tobytes() + str(image.shape).encode()).digest()

    @staticmethod
    def _projected(output: Any) -> torch.Tensor:
        # get_*_features return the projected embedding (a tensor; newer transformers an
        # output whose pooler_output holds it)
        return output if isinstance(output, torch.Tensor) else output.pooler_output

    def _fill(self, cache: OrderedDict, keys: list, items: list, embed) -> None:
        new = {key: item for key, item in zip(keys, items, strict=True) if key not in cache}
        pending = list(new.items())
        for start in range(0, len(pending), 256):
            chunk = pending[start:start + 256]
            vectors = F.normalize(embed([item for _, item in chunk]).float(), dim=-1).cpu()
            cache.update(zip([key for key, _ in chunk], vectors, strict=True))
        for key in keys:  # the ones asked for now are the freshest
            cache.move_to_end(key)
        while len(cache) > max(self.cache_size, len(set(keys))):
            cache.popitem(last=False)

    @torch.no_grad()
    def encode(self, images: np.ndarray, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, dim) unit image and text embeddings."""
        image_keys = [self._image_key(image) for image in images]

        def embed_images(batch: list[np.ndarray]) -> torch.Tensor:
            # channels_last said, not guessed from the shape (trainer.rewards.models)
            pixels = self.processor(images=batch, return_tensors="pt",
                                    input_data_format="channels_last")["pixel_values"]
            return self._projected(self.model.get_image_features(
                pixel_values=pixels.to(self.device)))

        def embed_texts(batch: list[str]) -> torch.Tensor:
            tokens = self.processor(text=batch, return_tensors="pt", padding=True)
            return self._projected(self.model.get_text_features(
                **{k: v.to(self.device) for k, v in tokens.items()}))

        self._fill(self.image_embeddings, image_keys, list(images), embed_images)
        self._fill(self.text_embeddings, list(prompts), list(prompts), embed_texts)
        image = torch.stack([self.image_embeddings[k] for k in image_keys])
        text = torch.stack([self.text_embeddings[p] for p in prompts])
        return image.to(self.device), text.to(self.device)


_clip_encoders: dict[tuple[str, str], _ClipEncoder] = {}


def clip_encoder(path: str, device: str) -> _ClipEncoder:
    """The process's encoder for (path, device), loaded once: refits reuse its embeddings."""
    key = (str(Path(path).resolve()) if path else "", str(device))
    if key not in _clip_encoders:
        _clip_encoders[key] = _ClipEncoder(path, device)
    return _clip_encoders[key]


def mirror_augment(images: torch.Tensor, config: FitConfig) -> torch.Tensor:
    """A random left-right mirror of a batch of shapes images (when `config.mirror_augment`).

    It doubles the variety of the votes but assumes that nobody prefers left over right, which
    the model may not assume: with it, 3,000 votes for "left" fit to chance. Turn it on only
    for a campaign known to be mirror-blind.
    """
    if config.features == "shapes" and config.mirror_augment and torch.rand(()) < 0.5:
        return images.flip(-1)
    return images


class FitStopped(Exception):
    """A fit given up part-way because its `should_stop` said so (a cancelled job)."""


def _train_member(net: nn.Module, inputs_a, inputs_b, labels: torch.Tensor, config: FitConfig,
                  seed: int, rows: torch.Tensor | None = None,
                  should_stop: Callable[[], bool] | None = None,
                  on_epoch: Callable[[], None] | None = None) -> None:
    """Minimise the Bradley-Terry log-loss of one network (its own batch order) on the votes
    `rows` (default: all; a bootstrap resample may repeat some), with smoothed targets.
    `should_stop` is asked before each epoch; True raises FitStopped. `on_epoch` is called
    after each."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(net.parameters(), lr=config.learning_rate,
                                  weight_decay=config.weight_decay)
    rows = torch.arange(len(labels)) if rows is None else rows
    targets = labels * (1 - config.label_smoothing) + 0.5 * config.label_smoothing
    n = len(rows)
    steps_per_epoch = max(1, math.ceil(n / config.batch_size))
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, config.learning_rate,
                                                   total_steps=config.epochs * steps_per_epoch)
    net.train()
    for _ in range(config.epochs):
        if should_stop is not None and should_stop():
            raise FitStopped("the fit was stopped before it finished")
        perm = rows[torch.randperm(n, generator=generator)]
        for i in range(0, n, config.batch_size):
            idx = perm[i:i + config.batch_size].to(config.device)
            ra = net(mirror_augment(inputs_a[0][idx], config), inputs_a[1][idx])
            rb = net(mirror_augment(inputs_b[0][idx], config), inputs_b[1][idx])
            loss = F.binary_cross_entropy_with_logits(ra - rb, targets[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        if on_epoch is not None:
            on_epoch()


def fit_preference_model(pairs: list[PreferencePair], config: FitConfig | None = None,
                         version: int = 1, warm_start: PreferenceModel | None = None,
                         should_stop: Callable[[], bool] | None = None,
                         on_epoch: Callable[[int, int], None] | None = None
                         ) -> PreferenceModel:
    """Bradley-Terry fit with a held-out split; the report says how well it predicts.

    `should_stop`: asked before every epoch of every network; True ends the fit with
    FitStopped (a job cancelled mid-fit need not wait for all of it).

    `on_epoch(done, total)`: called after every epoch of every network, with the epochs
    done and to do over all the ensemble's networks (a job's progress).

    `warm_start`: the model in use. With `config.warm_start_epochs` and a compatible model
    (`warm_start_problem`; the pairs keyed), the fit starts from its weights and trains
    warm_start_epochs on every vote, old and new: a refit after a round of votes costs a
    fraction of a fit from scratch. Training on the new votes alone would forget the old ones.
    """
    config = config or FitConfig()
    start = time.perf_counter()
    ignored: dict[str, int] = {}
    usable = []
    for pair in pairs:
        if pair.outcome in TARGET_A:  # the outcomes that count, each with its target
            usable.append(pair)
        else:
            ignored[pair.outcome] = ignored.get(pair.outcome, 0) + 1
    if len(usable) < MIN_FIT_VOTES:
        raise ValueError(f"need at least {MIN_FIT_VOTES} votes with a preference (a, b or tie), "
                         f"got {len(usable)}")
    held, train, split = _heldout_split(usable, config)
    if not train:  # e.g. every vote on one pair of images, that pair held out
        raise ValueError(f"no vote left to train on: all {len(usable)} usable votes are held out "
                         f"(split {split!r}, holdout_fraction {config.holdout_fraction}); "
                         "are they votes on one pair of images?")

    torch.manual_seed(config.seed)  # each member's initialisation differs: drawn in turn
    model = PreferenceModel(config)
    warm_from = None
    if config.warm_start_epochs and warm_start is not None and split == "pair" \
            and warm_start_problem(warm_start, config) is None:
        model.net.load_state_dict(warm_start.net.state_dict())
        warm_from = warm_start.report.version if warm_start.report else None
        config = replace(config, epochs=config.warm_start_epochs)

    def tensors(subset: list[PreferencePair]):
        images_a = image_batch([p.image_a for p in subset])
        images_b = image_batch([p.image_b for p in subset])
        prompts = [p.prompt for p in subset]
        labels = torch.tensor([TARGET_A[p.outcome] for p in subset], device=config.device)
        return model._inputs(images_a, prompts), model._inputs(images_b, prompts), labels

    inputs_a, inputs_b, labels = tensors(train)
    networks = len(model.net.members)  # a shared-feature ensemble's: its first and its heads
    epochs_done = 0

    def epoch_done() -> None:
        nonlocal epochs_done
        epochs_done += 1
        if on_epoch is not None:
            on_epoch(epochs_done, networks * config.epochs)

    if isinstance(model.net, SharedFeatureEnsemble):
        first = model.net.first
        _train_member(first, inputs_a, inputs_b, labels, config, seed=config.seed,
                      should_stop=should_stop, on_epoch=epoch_done)
        first.eval()
        with torch.no_grad():  # the features every head scores, computed once
            pooled_a = torch.cat([first.pooled(x) for x in inputs_a[0].split(512)])
            pooled_b = torch.cat([first.pooled(x) for x in inputs_b[0].split(512)])
        for index, head in enumerate(model.net.heads, start=1):
            resample = torch.randint(len(labels), (len(labels),),
                                     generator=torch.Generator().manual_seed(config.seed + index))
            _train_member(head, (pooled_a, inputs_a[1]), (pooled_b, inputs_b[1]), labels,
                          replace(config, mirror_augment=False), seed=config.seed + index,
                          rows=resample, should_stop=should_stop, on_epoch=epoch_done)
    else:
        for index, member in enumerate(model.net.members):
            _train_member(member, inputs_a, inputs_b, labels, config, seed=config.seed + index,
                          should_stop=should_stop, on_epoch=epoch_done)
    model.net.eval()

    def evaluate(subset: list[PreferencePair]
                 ) -> tuple[float | None, float | None, float | None]:
        if not subset:
            return None, None, None
        p = model.prob_a_beats_b(image_batch([q.image_a for q in subset]),
                                 image_batch([q.image_b for q in subset]),
                                 [q.prompt for q in subset])
        y = np.array([TARGET_A[q.outcome] for q in subset])
        decisive = np.array([Outcome(q.outcome).decisive for q in subset])
        accuracy = float(((p > 0.5) == (y > 0.5))[decisive].mean()) if decisive.any() else None
        calibration = (expected_calibration_error(p[decisive], y[decisive] > 0.5)
                       if decisive.any() else None)
        pc = np.clip(p, 1e-6, 1 - 1e-6)
        log_loss = float(-(y * np.log(pc) + (1 - y) * np.log(1 - pc)).mean())
        return accuracy, log_loss, calibration

    held_acc, held_loss, held_calibration = evaluate(held)
    train_acc, _, _ = evaluate(train)
    model.report = FitReport(
        version=version, votes_total=len(pairs), votes_fitted=len(usable), votes_ignored=ignored,
        train_pairs=len(train), heldout_pairs=len(held), heldout_accuracy=held_acc,
        heldout_log_loss=held_loss, train_accuracy=train_acc,
        seconds=time.perf_counter() - start, heldout_calibration_error=held_calibration,
        extra={"split": split, "epochs": config.epochs, "warm_start": warm_from is not None,
               "warm_start_version": warm_from})
    return model


def _pair_identity(pair: PreferencePair, digests: dict[int, bytes]) -> bytes:
    """The unordered pair of images a vote compares, by a digest of each image's pixels: the
    same for every vote on those two images, by any annotator, either way round. `digests`
    keeps each image array's digest by its id (the votes on one image share its array)."""
    def digest(image: np.ndarray) -> bytes:
        if id(image) not in digests:
            digests[id(image)] = hashlib.blake2b(np.ascontiguousarray(image).tobytes(),
                                                 digest_size=16).digest()
        return digests[id(image)]

    a, b = digest(pair.image_a), digest(pair.image_b)
    return min(a, b) + max(a, b)


def _held_out_pair(identity: bytes, config: FitConfig) -> bool:
    """Whether the votes on the pair `identity` are held out: a hash of (seed, pair) below
    holdout_fraction, the same answer in every fit of that seed however many votes come."""
    digest = hashlib.blake2b(f"{config.seed}:".encode() + identity, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < config.holdout_fraction


def _heldout_split(usable: list[PreferencePair], config: FitConfig
                   ) -> tuple[list[PreferencePair], list[PreferencePair], str]:
    """(held out, trained on, how): when every vote has a key (the studio's and an export's
    votes: a stable identity), by the pair of images it compares ("pair"): the arena shows
    one pair to several annotators, and a split by vote put one annotator's vote on a pair in
    training and another's on it in the held-out votes, so the held-out accuracy measured
    memory in part. Else a seeded random permutation with round(n * holdout_fraction) held
    out ("random"); none held out under 10 usable votes."""
    if len(usable) >= 10 and all(pair.key is not None for pair in usable):
        digests: dict[int, bytes] = {}
        held = [_held_out_pair(_pair_identity(pair, digests), config) for pair in usable]
        return ([p for p, h in zip(usable, held, strict=True) if h],
                [p for p, h in zip(usable, held, strict=True) if not h], "pair")
    order = np.random.default_rng(config.seed).permutation(len(usable))
    n_hold = int(round(len(usable) * config.holdout_fraction)) if len(usable) >= 10 else 0
    return ([usable[i] for i in order[:n_hold]], [usable[i] for i in order[n_hold:]],
            "random" if n_hold else "none")


def warm_start_problem(previous: PreferenceModel, config: FitConfig) -> str | None:
    """Why a fit with `config` cannot start from `previous`, or None when it can: the same
    network (features, width, spread pooling, ensemble, shared features, CLIP weights) and the
    same held-out votes (split by pair with the same seed and fraction), so that the new
    model's held-out accuracy is measured on votes neither model trained on."""
    old = previous.config
    for name in ("features", "width", "spread_pooling", "ensemble", "shared_features",
                 "clip_path", "seed", "holdout_fraction"):
        if getattr(old, name) != getattr(config, name):
            return f"{name} differs ({getattr(old, name)!r} -> {getattr(config, name)!r})"
    split = (previous.report.extra or {}).get("split") if previous.report else None
    if split != "pair":  # "key": by vote, before the split by pair
        return f"its held-out votes were not chosen by pair (split {split!r})"
    return None


__all__ = ["MIN_FIT_VOTES", "clip_dir_problem", "FitConfig", "warm_start_problem", "FitReport",
           "FitStopped", "PreferenceModel", "PreferencePair", "fit_preference_model",
           "ShapesPreferenceNet", "readable_votes", "ShapesHead", "SharedFeatureEnsemble",
           "PROMPT_LENGTH", "Outcome", "OUTCOMES", "LABELLED_OUTCOMES", "TARGET_A"]
