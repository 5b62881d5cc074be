"""Deterministic ODE sampling and evaluation: the fixed shapes set (48 prompts x 20 seeds) or
any prompts scored with any registered rewards."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainer.config import SHAPES_EVAL_REWARDS
from trainer.models.base import FlowModel, to_uint8
from trainer.rewards import compute_rewards
from trainer.shapes.world import all_prompts, parse_prompt
from trainer.solvers import rollout
from trainer.strict_json import loads_strict
from trainer.text_files import decode_lines

if TYPE_CHECKING:
    from trainer.rewards.remote import Scorer

EVAL_SEEDS = tuple(range(20))


def seed_noise(seed: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """The initial noise of one seed; the same seed gives the same noise for every prompt."""
    return torch.randn(latent_shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def sample_images(model: FlowModel, prompts: list[str], seeds: list[int], solver: str = "dpm++",
                  steps: int = 8, batch_size: int = 256,
                  before_step: Callable[[], None] | None = None,
                  on_batch: Callable[[int], None] | None = None) -> np.ndarray:
    """(N, H, W, 3) uint8 for each (prompt, seed) pair, in the order given. `before_step`:
    called before every solver step (a job's runner raises from it to stop, on a cancel:
    a batch of a large model's images can take minutes). `on_batch`: called after each
    batch with the number of images done so far (a job's progress)."""
    if len(prompts) != len(seeds):
        raise ValueError("prompts and seeds must have the same length")
    device = next(model.parameters()).device
    model.eval()
    timesteps = model.sigmas(steps)  # the model's grid: laid out once, not per chunk
    images = []
    for i in range(0, len(prompts), batch_size):
        chunk_prompts, chunk_seeds = prompts[i:i + batch_size], seeds[i:i + batch_size]
        noise = torch.stack([seed_noise(s, model.latent_shape) for s in chunk_seeds]).to(device)
        traj = rollout(solver, stepping(model, before_step), noise,
                       model.encode_prompts(chunk_prompts), steps, shift=model.flow_shift,
                       timesteps=timesteps)
        images.append(to_uint8(model.decode(traj.final)))
        if on_batch is not None:
            on_batch(i + len(chunk_prompts))
    return np.concatenate(images)


def stepping(velocity_fn: Callable[..., torch.Tensor], before_step: Callable[[], None] | None
             ) -> Callable[..., torch.Tensor]:
    """`velocity_fn` with `before_step` called before each of its evaluations (itself when
    there is none)."""
    if before_step is None:
        return velocity_fn

    def velocity(x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        before_step()
        return velocity_fn(x, t, cond)

    return velocity


# the most bad lines or items a prompts file's error lists (then "and N more"), as
# fit-preference's votes reader and the studio's upload list theirs
MAX_LISTED_PROBLEMS = 20


def listed_problems(problems: list[str]) -> str:
    """`problems` joined with "; ", the first MAX_LISTED_PROBLEMS and how many more."""
    more = len(problems) - MAX_LISTED_PROBLEMS
    return "; ".join(problems[:MAX_LISTED_PROBLEMS] + ([f"... and {more} more"] if more > 0
                                                        else []))


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a file as a user brings it (HPDv2-style): .jsonl, one JSON object per
    line with a "prompt" field (other fields ignored); .json, one array of strings or of such
    objects (HPDv2's test.json, HPSv2's benchmark files); .txt or no suffix, one prompt per
    line. Blank lines are skipped. ValueError naming the file and every malformed line or item
    (the first MAX_LISTED_PROBLEMS), a line that is not UTF-8 among them, and refusing other
    formats (a .csv or .parquet read as lines would be garbage prompts)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in ("", ".txt", ".jsonl", ".json"):
        raise ValueError(f"{path}: unsupported prompt file {suffix!r}; use .txt (one prompt "
                         "per line), .jsonl (objects with a \"prompt\" field) or .json (an "
                         "array of strings or such objects)")
    # a byte-order mark (a file saved by Notepad) is dropped: it would otherwise stay in the
    # first prompt ("\ufeffa cat") and be trained and scored on
    data = path.read_bytes()
    lines, bad = decode_lines(data)
    problems = dict(bad)  # by line number: said in file order
    if suffix == ".json":
        if problems:  # the array is parsed whole: its text with U+FFFD in it would mislead
            raise ValueError(f"{path}: {listed_problems(list(problems.values()))}")
        return _json_array_prompts(path, data.decode("utf-8-sig"))
    if suffix != ".jsonl":
        if problems:
            raise ValueError(f"{path}: {listed_problems(list(problems.values()))}")
        return [line.strip() for line in lines if line.strip()]
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or number in bad:
            continue
        try:
            record = loads_strict(line)
        except json.JSONDecodeError as exc:
            problems[number] = f"line {number}: not JSON ({exc.msg})"
            continue
        try:
            prompts.append(_prompt_of(record, f"line {number}"))
        except ValueError as exc:
            problems[number] = str(exc)
    if problems:  # every bad line at once, in file order: fixed in one pass, not one a run
        raise ValueError(f"{path}: {listed_problems([problems[n] for n in sorted(problems)])}")
    return prompts


def _prompt_of(record: Any, where: str, *, strings: bool = False) -> str:
    prompt = record if strings and isinstance(record, str) else (
        record.get("prompt") if isinstance(record, dict) else None)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f'{where}: no "prompt" text field')
    return prompt.strip()


def _json_array_prompts(path: Path, text: str) -> list[str]:
    try:
        items = loads_strict(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: line {exc.lineno}: not JSON ({exc.msg})") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON array of prompts (strings or objects with "
                         f'a "prompt" field), got a {type(items).__name__}')
    prompts, problems = [], []
    for i, item in enumerate(items, start=1):
        try:
            prompts.append(_prompt_of(item, f"item {i}", strings=True))
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError(f"{path}: {listed_problems(problems)}")
    return prompts


def evaluate(model: FlowModel, prompts: list[str] | None = None,
             seeds: tuple[int, ...] = EVAL_SEEDS, solver: str = "dpm++", steps: int = 8,
             rewards: Sequence[str] | None = None, batch_size: int = 256,
             scorer: Scorer | None = None,
             before_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Every (prompt, seed) sampled and scored with `rewards` (registry names; default: the
    shapes rewards, SHAPES_EVAL_REWARDS). `rewards` holds {name: {"mean", "std"}}; each
    reward's mean is also `<name>_reward`, except exact_count, which is reported as
    `exact_count_accuracy` with a breakdown by the prompt's count word (shapes prompts); the
    shape reward is also broken down by the prompt's shape (`shape_reward_by_shape`).
    `scorer` scores them (trainer.rewards.remote.prepare_scorer: a reward server's client, or
    by default compute_rewards, in this process). `before_step`: as for sample_images (a
    caller raises from it to stop the pass)."""
    prompts = prompts or all_prompts()
    names = list(dict.fromkeys(rewards or SHAPES_EVAL_REWARDS))
    pairs = [(p, s) for p in prompts for s in seeds]
    images = sample_images(model, [p for p, _ in pairs], [s for _, s in pairs], solver, steps,
                           batch_size=batch_size, before_step=before_step)
    texts = [p for p, _ in pairs]
    scores = (scorer or compute_rewards)(names, images, texts)
    out: dict[str, Any] = {"samples": len(pairs), "solver": solver, "steps": steps,
                           "rewards": {n: {"mean": float(scores[n].mean()),
                                           "std": float(scores[n].std())} for n in names}}
    for name in names:
        if name != "exact_count":
            out[f"{name}_reward"] = float(scores[name].mean())
    if "exact_count" in scores:
        by_count: dict[str, list[float]] = {}
        for text, hit in zip(texts, scores["exact_count"], strict=True):
            by_count.setdefault(text.split()[0], []).append(float(hit))
        out["exact_count_accuracy"] = float(scores["exact_count"].mean())
        out["exact_count_accuracy_by_count"] = {k: float(np.mean(v)) for k, v in by_count.items()}
    if "shape" in scores:  # which shapes the model draws recognisably, and which it does not
        by_shape: dict[str, list[float]] = {}
        for text, value in zip(texts, scores["shape"], strict=True):
            by_shape.setdefault(parse_prompt(text).shape, []).append(float(value))
        out["shape_reward_by_shape"] = {k: float(np.mean(v)) for k, v in sorted(by_shape.items())}
    return out
