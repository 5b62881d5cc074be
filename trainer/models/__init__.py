"""Model adapters by name: what `TrainConfig.model` (and a rollout or evaluate job's `model`)
selects. A loader takes a `ModelSpec` (the config's model fields) and a device and returns a
`FlowModel`. Built in: `shapes` (the tiny DiT), `flux` and `sd3` (diffusers, from a local
model directory); more plug in with `register_model`."""

from __future__ import annotations

import inspect
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch stays unimported until a model is loaded
    import torch

    from trainer.models.base import FlowModel

SHAPES_BASE = Path(__file__).parent.parent / "shapes" / "assets" / "base.safetensors"

# the files a checkpoint directory's weights live in, by training mode
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' name: load_lora_weights finds it
FULL_TRANSFORMER = Path("transformer") / "diffusion_pytorch_model.safetensors"
SHAPES_WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer_state.safetensors"


@dataclass
class ModelSpec:
    """Everything a loader needs: the model fields of a TrainConfig (see its help texts),
    plus `weights`, a weights file or checkpoint directory loaded on top of the base."""

    name: str = "shapes"
    path: str = ""  # model_path: the diffusers-format directory (flux, sd3)
    weights: str = ""  # base_checkpoint, or the checkpoint being sampled
    finetune: str = "full"
    lora_rank: int = 32
    lora_alpha: float = 64.0
    lora_target_modules: list[str] = field(default_factory=list)
    resolution: int = 0
    guidance_scale: float = 3.5
    mixed_precision: str = "auto"
    gradient_checkpointing: bool = False
    gradient_checkpointing_fraction: float = 1.0
    torch_compile: bool = False
    seed: int = 0  # the run's seed: the LoRA adapters' initial weights come from it
    # sampling only (sample, evaluate, the studio's rollout and evaluate jobs): the weights
    # keep the dtype they load in and take no gradients, and neither gradient checkpointing
    # nor compilation is set up (a full fine-tune's fp32 masters doubled FLUX's 24 GB)
    inference_only: bool = False

    @classmethod
    def base(cls, name: str, path: str = "") -> ModelSpec:
        """The base model `name` (at `path`) as its runs sample it: at the guidance of the
        model's LoRA preset (sd3-lora's 4.5, where the field default is FLUX.1-dev's 3.5),
        so that the base and the checkpoints of a run compare at one guidance."""
        from trainer.config import PRESETS, model_preset

        spec = cls(name=name, path=path)
        spec.guidance_scale = PRESETS.get(model_preset(name) or "", {}).get(
            "guidance_scale", spec.guidance_scale)
        return spec

    @classmethod
    def from_config(cls, config: Any, weights: str | Path | None = None) -> ModelSpec:
        """From a TrainConfig (or its dict); `weights` replaces its base_checkpoint."""
        data = config if isinstance(config, dict) else config.to_dict()
        spec = cls(name=data.get("model", "shapes"), path=data.get("model_path", ""),
                   weights=str(weights) if weights else data.get("base_checkpoint", ""))
        for f in fields(cls):
            if f.name not in ("name", "path", "weights") and f.name in data:
                setattr(spec, f.name, data[f.name])
        return spec


ModelLoader = Callable[[ModelSpec, "torch.device | str"], "FlowModel"]


def _load_shapes(spec: ModelSpec, device: torch.device | str) -> FlowModel:
    from trainer.models.shapes_dit import ShapesDiT

    path = Path(spec.weights) if spec.weights else SHAPES_BASE
    if path.is_dir():
        path = path / SHAPES_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"base checkpoint {path} not found; train one with "
                                "`python -m trainer train-base --out DIR`")
    return ShapesDiT.load(path, device)


def _load_flux(spec: ModelSpec, device: torch.device | str,
               stage_on_cpu: bool = False) -> FlowModel:
    from trainer.models.diffusers_flow import FluxFlowModel

    return FluxFlowModel.load(spec, device, stage_on_cpu=stage_on_cpu)


def _load_sd3(spec: ModelSpec, device: torch.device | str,
              stage_on_cpu: bool = False) -> FlowModel:
    from trainer.models.diffusers_flow import SD3FlowModel

    return SD3FlowModel.load(spec, device, stage_on_cpu=stage_on_cpu)


_MODELS: dict[str, ModelLoader] = {"shapes": _load_shapes, "flux": _load_flux, "sd3": _load_sd3}
# the `format` each adapter's weights files carry in their safetensors metadata
_WEIGHT_FORMATS: dict[str, str] = {"shapes": "shapes-dit"}
# what a diffusers-format directory must hold for each adapter (checked before any GPU work)
_DIRECTORY_FILES: dict[str, list[str]] = {
    "flux": ["model_index.json", "scheduler/scheduler_config.json", "transformer/config.json",
             "vae/config.json", "text_encoder/config.json", "text_encoder_2/config.json",
             "tokenizer", "tokenizer_2"],
    "sd3": ["model_index.json", "scheduler/scheduler_config.json", "transformer/config.json",
            "vae/config.json", "text_encoder/config.json", "text_encoder_2/config.json",
            "text_encoder_3/config.json", "tokenizer", "tokenizer_2", "tokenizer_3"],
}
# the pipeline class each adapter's directory names in model_index.json's `_class_name`: an
# SD3 directory holds every file a FLUX one does, so only this tells them apart before the
# model loads (and fails deep inside, e.g. on a text encoder without pooler_output)
_PIPELINE_CLASSES: dict[str, str] = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline"}
# folders whose weights must be there too (*.safetensors, or a sharded index)
_WEIGHT_FOLDERS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def register_model(name: str, loader: ModelLoader, weight_format: str | None = None,
                   directory_files: list[str] | None = None) -> None:
    """Make `loader` available as model `name` (re-registering replaces); `weight_format` is
    the safetensors metadata `format` its weights files carry, if any, and `directory_files`
    what its model directory must hold (both checked up front). `loader(spec, device)`
    returns the model on `device`; one that also takes a `stage_on_cpu` keyword can leave its
    trained weights in CPU memory for a sharded run (`load_flow_model`)."""
    _MODELS[name] = loader
    for table, value in ((_WEIGHT_FORMATS, weight_format), (_DIRECTORY_FILES, directory_files)):
        if value:
            table[name] = value
        else:
            table.pop(name, None)


def uses_model_directory(name: str) -> bool:
    """Whether model `name` loads from a diffusers-format directory (`model_path`)."""
    return name in _DIRECTORY_FILES


def resolution_limit_problem(name: str, path: str | Path, resolution: int) -> str | None:
    """Why the model directory at `path` cannot draw `resolution` px images (0: the default,
    512), or None; read from its config files alone. SD3's transformer has a learned position
    embedding for at most `pos_embed_max_size` patches a side (diffusers raises deep inside
    the first forward pass beyond it); FLUX's rotary positions have no such limit."""
    if name != "sd3":
        return None
    from trainer.config import DIFFUSERS_DEFAULT_RESOLUTION

    try:
        transformer = json.loads((Path(path) / "transformer" / "config.json").read_text())
        vae = json.loads((Path(path) / "vae" / "config.json").read_text())
        patches, patch = int(transformer["pos_embed_max_size"]), int(transformer["patch_size"])
        vae_scale = 2 ** (len(vae["block_out_channels"]) - 1)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # an incomplete directory: model_dir_problem says what is missing
    largest = patches * patch * vae_scale
    wanted = resolution or DIFFUSERS_DEFAULT_RESOLUTION
    if wanted > largest:
        return (f"this sd3 model draws at most {largest}x{largest} images (its transformer's "
                f"pos_embed_max_size {patches} x patch_size {patch} x the VAE's {vae_scale}x), "
                f"got {wanted}" + (" (the default)" if not resolution else ""))
    return None

def model_dir_problem(name: str, path: str | Path) -> str | None:
    """Why `path` is not a complete model directory for `name`, or None: every missing file
    named, with what the directory should hold."""
    expected = _DIRECTORY_FILES.get(name)
    if expected is None:
        return None
    path = Path(path)
    try:
        if not path.is_dir():
            what = "is a file, not a directory" if path.exists() else "does not exist"
            return (f"model directory {path} {what} (a diffusers-format {name!r} "
                    f"directory holds {', '.join(expected)}, with weights in each model folder)")
        if (problem := _pipeline_problem(name, path)) is not None:
            return problem
        missing = [f for f in expected if not (path / f).exists()]
        weights = []
        for folder in _WEIGHT_FOLDERS:
            sub = path / folder
            found = [*sub.glob("*.safetensors"), *sub.glob("*.bin")] if sub.is_dir() else []
            if sub.is_dir() and not found:
                missing.append(f"{folder}/*.safetensors")
            missing += _missing_shards(sub, folder) if found else []
            weights += found
    except OSError as exc:  # a name too long (ENAMETOOLONG), no permission: not a model here
        return f"model directory {path} cannot be read ({exc.strerror or exc})"
    checked = [*(path / f for f in expected if f.endswith(".json")), *sorted(weights)]
    damaged = {} if missing else {f: problem for f in checked
                                  if (problem := weights_file_problem(f)) is not None}
    # a file deleted while the directory was being checked is missing, not damaged
    missing += [str(f.relative_to(path)) for f in damaged if not f.exists()]
    if missing:
        return (f"model directory {path} is incomplete for {name!r}: missing "
                f"{', '.join(missing)} (a diffusers-format directory holds "
                f"{', '.join(expected)}, with weights in each model folder)")
    if damaged:
        return f"model directory {path} has damaged files: {'; '.join(damaged.values())}"
    return None


def _missing_shards(folder: Path, label: str) -> list[str]:
    """The shards a model folder's index (`*.safetensors.index.json`, as FLUX.1-dev's
    transformer is saved) names and the folder lacks: the loader would fail on the first
    after loading the others, deep inside diffusers."""
    out = []
    for index in sorted(folder.glob("*.index.json")):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            shards = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, ValueError, AttributeError, TypeError):
            out.append(f"{label}/{index.name} (not a shard index: unreadable JSON)")
            continue
        out += [f"{label}/{shard}" for shard in shards
                if isinstance(shard, str) and not (folder / shard).is_file()]
    return out


def _pipeline_problem(name: str, path: Path) -> str | None:
    """Why model directory `path` is another adapter's model, going by model_index.json's
    `_class_name`, or None. Only another adapter's pipeline class is refused: a variant
    pipeline of the same model (FluxFillPipeline ...) or an index without the field is let
    through to the files check and the loader."""
    index = path / "model_index.json"
    if not index.is_file():
        return None  # the files check names it as missing
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"model directory {path}: model_index.json is not JSON ({exc})"
    found = data.get("_class_name") if isinstance(data, dict) else None
    others = [other for other, cls in _PIPELINE_CLASSES.items()
              if other != name and cls == found]
    if not others:
        return None
    return (f"model directory {path} holds a {found} (model_index.json's _class_name), not "
            f"a {name!r} model ({_PIPELINE_CLASSES.get(name, name)}); use model "
            f"{others[0]!r} for it, or point model_path at a {name!r} directory")


def directory_model(path: str | Path) -> tuple[str | None, str | None]:
    """The adapter (flux, sd3) whose pipeline class model_index.json's `_class_name` at
    `path` names (`_PIPELINE_CLASSES`), and None; or None and why no adapter can be told
    (no model_index.json, one that does not parse, another pipeline). Whether the directory
    is complete for that adapter is `model_dir_problem`'s question."""
    path = Path(path)
    known = ", ".join(f"{cls} ({name})" for name, cls in _PIPELINE_CLASSES.items())
    index = path / "model_index.json"
    try:
        if not index.is_file():
            return None, (f"model directory {path} has no model_index.json (a diffusers-format "
                          f"directory names its pipeline there: {known})")
        data = json.loads(index.read_text(encoding="utf-8"))
    except OSError as exc:
        return None, f"model directory {path} cannot be read ({exc.strerror or exc})"
    except (UnicodeDecodeError, ValueError) as exc:
        return None, f"model directory {path}: model_index.json is not JSON ({exc})"
    found = data.get("_class_name") if isinstance(data, dict) else None
    for name, cls in _PIPELINE_CLASSES.items():
        if cls == found:
            return name, None
    return None, (f"model directory {path} holds a {found!r} pipeline (model_index.json's "
                  f"_class_name), not one a job can load: {known}")


# what a model directory given as base_checkpoint is to be given as instead
BASE_CHECKPOINT_TAKES = ("model_path (with model {model}); base_checkpoint is an earlier "
                         "run's checkpoint, or left empty to start from the base model")


def model_directory_as_checkpoint_problem(path: str | Path, takes: str) -> str | None:
    """Why `path`, given where a checkpoint of a run goes (base_checkpoint, --checkpoint), is
    a diffusers model directory instead (one holding model_index.json, or a weights file in
    one of its model folders), naming `takes`, what to give it as; None when it is not one.
    `{model}` in `takes` becomes the model it is ('sd3'), or the models that load one. Its
    transformer/diffusion_pytorch_model.safetensors made it look like a full fine-tune's
    checkpoint without its run's state, which was then taken for a shapes checkpoint."""
    path = Path(path)
    try:
        candidates = [path] if path.is_dir() else [path.parent, path.parent.parent]
        directory = next((d for d in candidates if (d / "model_index.json").is_file()), None)
    except OSError:  # unreadable: the checks that follow say why
        return None
    if directory is None:
        return None
    name, _ = directory_model(directory)
    what = f"a diffusers {name!r} model directory" if name else "a diffusers model directory"
    inside = "" if directory == path else f"; {path} is a file inside it"
    model = repr(name) if name else " or ".join(repr(n) for n in _PIPELINE_CLASSES)
    return (f"{directory} is {what} (it holds model_index.json{inside}), not a checkpoint of "
            f"a run: give it as {takes.format(model=model)}")


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (every tensor's dtype and shape, and
    `__metadata__`), read alone (no torch, no tensors): ValueError when it is not safetensors."""
    return _safetensors_header_and_size(path)[0]


def _safetensors_header_and_size(path: str | Path) -> tuple[dict[str, Any], int]:
    """The header, and its length in bytes (the tensors' data starts 8 bytes after it)."""
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
    return header, size


def weights_file_problem(path: str | Path) -> str | None:
    """Why the weights or config file `path` is damaged, or None, judged without loading it:
    an empty file; a safetensors file whose header does not parse or whose tensors run past
    its end; a torch zip checkpoint that lost its closing directory; JSON that does not parse.
    A truncated copy or download is what this catches before a job starts; a file
    that is whole but wrong is the loader's to find."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size == 0:
            return f"{path} is empty"
        if path.suffix == ".safetensors":
            header, header_size = _safetensors_header_and_size(path)
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"
                    and isinstance(t, dict) and isinstance(t.get("data_offsets"), list)
                    and len(t["data_offsets"]) == 2 and isinstance(t["data_offsets"][1], int)]
            needed = 8 + header_size + max(ends, default=0)
            if size < needed:
                return (f"{path} is truncated: its header describes {needed:,} bytes, the file "
                        f"has {size:,}")
        elif path.suffix == ".json":
            json.loads(path.read_bytes())
        elif path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
            import zipfile

            with open(path, "rb") as fh:
                zipped = fh.read(4) == b"PK\x03\x04"  # torch.save's format since 1.6
            if zipped and not zipfile.is_zipfile(path):
                return f"{path} is truncated: a torch checkpoint without its closing directory"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    except ValueError as exc:  # json's errors and safetensors_header's
        return f"{path}: {' '.join(str(exc).split())[:200]}"
    return None


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, read from its header alone."""
    meta = safetensors_header(path).get("__metadata__") or {}
    return meta if isinstance(meta, dict) else {}


def checkpoint_weights_file(directory: str | Path) -> Path | None:
    """The main weights file of a checkpoint directory (what a download serves): the LoRA,
    the shapes model or the full transformer; None when it holds none."""
    directory = Path(directory)
    for name in (LORA_WEIGHTS, SHAPES_WEIGHTS, FULL_TRANSFORMER):
        if (directory / name).is_file():
            return directory / name
    return None


def checkpoint_directory(path: str | Path) -> Path:
    """The checkpoint directory a weights file belongs to (a directory is its own): the
    parent of a LoRA or shapes file, two levels up from a full fine-tune's transformer file."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.parent.name == FULL_TRANSFORMER.parent.name and (
            path.parent.parent / TRAINER_STATE).is_file():
        return path.parent.parent
    return path.parent


def weights_problem(name: str, path: str | Path, weight_format: str | None = None
                    ) -> str | None:
    """Why `path` cannot be loaded as weights of model `name` (or, with `weight_format`, as a
    file of that format), or None: checked from the header before a job is accepted. Models
    with a directory take a checkpoint directory of an earlier run."""
    if weight_format is None and name not in _MODELS:
        return f"unknown model {name!r}; known: {model_names()}"
    if weight_format is None and uses_model_directory(name):
        if not Path(path).is_dir() or (weights := checkpoint_weights_file(path)) is None:
            return (f"{path} is not a checkpoint directory (one holding {LORA_WEIGHTS} or "
                    f"{FULL_TRANSFORMER})")
        return weights_file_problem(weights)
    try:
        meta = safetensors_metadata(path)
    except (OSError, ValueError) as exc:
        return f"{path}: {exc}"
    want = weight_format or _WEIGHT_FORMATS.get(name)
    if want and meta.get("format") != want:
        return f"{path} is not a {want!r} weights file (its format is {meta.get('format')!r})"
    return weights_file_problem(path)


def base_checkpoint_problem(spec: ModelSpec, path: str | Path, *, fits_run: bool = True
                            ) -> str | None:
    """Why `path` cannot be the base_checkpoint of the run `spec` describes, or None, from
    the files' headers alone: weights that are not the model's or are damaged
    (weights_problem) and, with `fits_run` for a model with a directory, weights that do not
    fit the run's adapters (starting_weights_problem). Asked before a run is accepted and
    again when it starts: the file may have changed in between."""
    problem = model_directory_as_checkpoint_problem(path, BASE_CHECKPOINT_TAKES)
    if problem is None:
        problem = weights_problem(spec.name, path)
    if problem is None and fits_run and uses_model_directory(spec.name):
        problem = starting_weights_problem(spec, path)
    return problem


def model_names() -> list[str]:
    return sorted(_MODELS)


def load_flow_model(spec: ModelSpec | str, path: str | Path | None = None,
                    device: torch.device | str = "cpu", *,
                    stage_on_cpu: bool = False) -> FlowModel:
    """The model a spec describes on `device`; `load_flow_model(name, path)` is short for a
    spec of that name with the weights at `path` (None: its default base).

    `stage_on_cpu`: everything is set up for `device` (the weights' dtype, the frozen VAE and
    text encoders placed there) except the trained module's weights, which stay in CPU memory,
    in the dtype they were loaded in, for FSDP to move to `device` one unit at a time as it
    shards them: no card ever holds the whole model, and the sharded run makes full
    fine-tuning's fp32 master weights from each rank's shard on its card
    (`trainer.distributed.DistributedFlowModel`), so no host holds a whole fp32 copy. Loaders
    without a `stage_on_cpu` keyword (shapes: it is small) load on `device`."""
    if isinstance(spec, str):
        spec = ModelSpec(name=spec, weights=str(path) if path else "")
    if spec.name not in _MODELS:
        raise KeyError(f"unknown model {spec.name!r}; known: {model_names()}")
    if spec.path and (problem := model_dir_problem(spec.name, spec.path)):
        raise FileNotFoundError(problem)
    if spec.path and spec.finetune == "lora" and (
            problem := lora_targets_problem(spec.path, list(spec.lora_target_modules))):
        # said from the weights' headers, before the model loads (peft's own error came
        # after, naming no field)
        raise ValueError(f"lora_target_modules: {problem}")
    loader = _MODELS[spec.name]
    if stage_on_cpu and "stage_on_cpu" in inspect.signature(loader).parameters:
        return loader(spec, device, stage_on_cpu=True)
    return loader(spec, device)


def checkpoint_spec(path: str | Path) -> ModelSpec:
    """How to rebuild the model of a checkpoint (its directory or its weights file): the
    run's config is in the checkpoint's trainer state (or, for shapes, its model file); a
    shapes weights file without one (a base model) is taken as it is."""
    path = Path(path)
    directory = checkpoint_directory(path)
    for source in (directory / TRAINER_STATE, directory / SHAPES_WEIGHTS):
        if source.is_file():
            config = safetensors_metadata(source).get("train_config")
            if config:
                return ModelSpec.from_config(json.loads(config), weights=directory)
    if path.is_file() and _is_diffusers_lora(path):
        # a LoRA file under any name: the studio's download (`job1-it3.safetensors`) or
        # another tool's, which load_lora_weights takes as it is; taken as a shapes file, it
        # became a full fine-tune of --model that failed after the model had loaded
        return bare_lora_spec(path)
    if (directory / LORA_WEIGHTS).is_file():
        return bare_lora_spec(directory)
    return ModelSpec(name="shapes", weights=str(path))


# diffusers' older LoRA key format (what convert_state_dict_to_diffusers writes, and
# load_lora_weights still reads): `<module>.lora.down.weight` / `.lora.up.weight` for peft's
# `<module>.lora_A.weight` / `.lora_B.weight`
_LEGACY_LORA_SUFFIXES = {".lora.down.weight": ".lora_A.weight", ".lora.up.weight": ".lora_B.weight"}


def peft_lora_key(key: str) -> str:
    """A LoRA tensor's name as peft keys it: one in diffusers' older format (`lora.down` /
    `lora.up`) renamed, any other as it is. A LoRA another tool saved that way loads as
    load_lora_weights loads it (it was refused as "another model's" LoRA)."""
    for old, new in _LEGACY_LORA_SUFFIXES.items():
        if key.endswith(old):
            return key[:-len(old)] + new
    return key


def lora_down_modules(keys: Any) -> dict[str, str]:
    """The transformer layers a diffusers LoRA file adapts, from its tensors' names (`keys`,
    e.g. its safetensors header): {layer: the key of its down (lora_A) matrix}, in either key
    format."""
    modules = {}
    for key in keys:
        name = peft_lora_key(key)
        if name.startswith("transformer.") and name.endswith(".lora_A.weight"):
            modules[name.removeprefix("transformer.").removesuffix(".lora_A.weight")] = key
    return modules


def _is_diffusers_lora(path: Path) -> bool:
    """Whether the safetensors file `path` holds a transformer LoRA as diffusers saves one
    (keys 'transformer.<module>.lora_A.weight', or the older '.lora.down.weight'), from its
    header alone."""
    try:
        header = safetensors_header(path)
    except (OSError, ValueError):
        return False
    return bool(lora_down_modules(header))


def lora_weights_path(path: str | Path) -> Path:
    """The LoRA weights file of `path`: a checkpoint directory's LORA_WEIGHTS, or `path`
    itself when it is a file (a LoRA downloaded or taken away under another name)."""
    path = Path(path)
    return path if path.is_file() else path / LORA_WEIGHTS


def config_rollout_batch_size(config: Any) -> int:
    """A run config's rollout_batch_size when it is a positive whole number, else 0 (none
    recorded, or one that solved everything at once)."""
    size = config.get("rollout_batch_size") if isinstance(config, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0


def run_rollout_batch_size(checkpoint: str | Path | None) -> int:
    """The rollout_batch_size of the run that wrote `checkpoint` (its directory or weights
    file), from its trainer state; 0 when none is recorded (no checkpoint, a bare diffusers
    LoRA, a shapes file, or a run that solved everything at once)."""
    if checkpoint is None:
        return 0
    state = checkpoint_directory(checkpoint) / TRAINER_STATE
    if not state.is_file():
        return 0
    try:
        return config_rollout_batch_size(json.loads(
            safetensors_metadata(state).get("train_config") or "{}"))
    except (OSError, ValueError):
        return 0


# the safetensors metadata key diffusers' save_lora_weights writes the adapter's config under
LORA_ADAPTER_METADATA = "lora_adapter_metadata"


def bare_lora_spec(directory: str | Path) -> ModelSpec:
    """The spec of a diffusers LoRA directory without its run's trainer state (a checkpoint's
    zip download, or another tool's LoRA), or of such a LoRA's weights file (a checkpoint's
    download). Its base model is not recorded there, so `name`
    is left empty for the caller to fill in; rank, alpha and targets come from the adapter
    config diffusers stores in the file's metadata, else from the tensors' names and shapes
    (alpha = rank, as load_lora_weights assumes without metadata). ValueError when the file
    holds no LoRA layers of a transformer."""
    lora = lora_weights_path(directory)
    header = safetensors_header(lora)
    down = {module: header[key]["shape"] for module, key in lora_down_modules(header).items()}
    if not down:
        raise ValueError(f"{lora} holds no transformer LoRA layers (keys "
                         "'transformer.<module>.lora_A.weight', as diffusers saves them, or "
                         "diffusers' older '.lora.down.weight')")
    rank = int(next(iter(down.values()))[0])
    spec = ModelSpec(name="", weights=str(directory), finetune="lora", lora_rank=rank,
                     lora_alpha=float(rank), lora_target_modules=sorted(down))
    adapter = safetensors_metadata(lora).get(LORA_ADAPTER_METADATA)
    if adapter:  # {"transformer.r": 64, "transformer.lora_alpha": 64, ...}: the component's
        config = {k.removeprefix("transformer."): v for k, v in json.loads(adapter).items()
                  if k.startswith("transformer.")}
        spec.lora_rank = int(config.get("r", rank))
        spec.lora_alpha = float(config.get("lora_alpha", spec.lora_rank))
        targets = config.get("target_modules")
        if isinstance(targets, list) and targets:  # (a string is a regex: the names above)
            spec.lora_target_modules = sorted(targets)
    return spec


def lora_alpha_problem(saved: float, run: float) -> str | None:
    """Why a LoRA saved with lora_alpha `saved` cannot start a run whose adapters have `run`:
    the same tensors under another alpha scale the adapter by alpha / rank, so the run would
    not start from the model the checkpoint was."""
    if math.isclose(saved, run):
        return None
    return (f"holds a LoRA with lora_alpha {saved:g}; this run's adapters have lora_alpha "
            f"{run:g} (set lora_alpha {saved:g} to continue from it)")


def _targeted(module: str, targets: list[str]) -> bool:
    """Whether peft's list form of `target_modules` gives `module` an adapter: the whole
    name, or its last dotted parts."""
    return any(module == t or module.endswith("." + t) for t in targets)


def transformer_layer_names(model_dir: str | Path) -> set[str] | None:
    """The names of the layers that hold weights in a diffusers model directory's
    transformer, read from its safetensors headers (or the shard index) alone; None when
    they cannot be read that way (.bin weights, a damaged file: the loader's to say)."""
    folder = Path(model_dir) / "transformer"
    try:
        index = folder / "diffusion_pytorch_model.safetensors.index.json"
        if index.is_file():
            keys = list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        else:
            keys = [k for f in sorted(folder.glob("*.safetensors"))
                    for k in safetensors_header(f) if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {k.rsplit(".", 1)[0] for k in keys if "." in k} or None


def lora_targets_problem(model_dir: str | Path, targets: list[str]) -> str | None:
    """Why LoRA adapters on `targets` (lora_target_modules; peft's list form: a layer's whole
    name or its last dotted parts) cannot be placed in the model at `model_dir`, or None:
    peft refuses a run when no target names a layer, and a target the default list does not
    hold that names none is a typo whose adapters would be silently missing."""
    from trainer.config import DEFAULT_LORA_TARGETS

    layers = transformer_layer_names(model_dir)
    if layers is None or not targets:
        return None
    unmatched = [t for t in targets if not any(_targeted(m, [t]) for m in layers)]
    if len(unmatched) == len(targets):
        return (f"none of {targets} names a layer of the transformer at {model_dir} (a target "
                "is a layer's name or its last dotted parts, e.g. 'to_q', 'attn.to_q')")
    typos = [t for t in unmatched if t not in DEFAULT_LORA_TARGETS]
    if typos:
        return (f"{typos} name no layer of the transformer at {model_dir}; the others do (a "
                "target is a layer's name or its last dotted parts, e.g. 'to_q')")
    return None


def starting_weights_problem(spec: ModelSpec, directory: str | Path) -> str | None:
    """Why the checkpoint directory `directory` (a run's base_checkpoint) cannot start the
    run `spec` describes, read from its headers alone so that submission can say it: another
    model's checkpoint, a full fine-tune's weights for a LoRA run or the reverse, a LoRA of
    another rank, or adapters on layers the run's lora_target_modules leave alone. The
    loader checks the tensors against the built model again (`load_weights`)."""
    directory = Path(directory)
    trained = checkpoint_spec(directory)
    if trained.name and trained.name != spec.name:
        return (f"{directory} is a checkpoint of model {trained.name!r}; this run trains "
                f"{spec.name!r}")
    if spec.finetune != "lora":
        if not (directory / FULL_TRANSFORMER).is_file():
            return (f"{directory} holds no {FULL_TRANSFORMER} (a full fine-tune's checkpoint); "
                    "this run has finetune='full' (a LoRA checkpoint starts a finetune='lora' run)")
        return None
    if not (directory / LORA_WEIGHTS).is_file():
        return (f"{directory} holds no {LORA_WEIGHTS} (a LoRA run's checkpoint); this run has "
                "finetune='lora' (a full fine-tune's checkpoint starts a finetune='full' run)")
    try:
        lora = bare_lora_spec(directory)
    except ValueError as exc:
        return str(exc)
    if lora.lora_rank != spec.lora_rank:
        return (f"{directory / LORA_WEIGHTS} holds a LoRA of rank {lora.lora_rank}; this run's "
                f"adapters have rank {spec.lora_rank} (lora_rank)")
    if (problem := lora_alpha_problem(lora.lora_alpha, spec.lora_alpha)) is not None:
        return f"{directory / LORA_WEIGHTS} {problem}"
    modules = sorted(lora_down_modules(safetensors_header(directory / LORA_WEIGHTS)))
    from trainer.config import DEFAULT_LORA_TARGETS

    targets = list(spec.lora_target_modules) or list(DEFAULT_LORA_TARGETS)
    untargeted = [m for m in modules if not _targeted(m, targets)]
    if untargeted:
        return (f"{directory / LORA_WEIGHTS} holds adapters on layers this run's "
                f"lora_target_modules do not train (e.g. {untargeted[0]}); this run targets "
                f"{targets}")
    return None


def load_checkpoint_model(path: str | Path, device: torch.device | str = "cpu") -> FlowModel:
    """The model of a checkpoint directory or weights file, ready to sample (loaded
    `inference_only`: to train on from a checkpoint, load its `checkpoint_spec`)."""
    spec = checkpoint_spec(path)
    spec.inference_only = True
    return load_flow_model(spec, device=device)
