"""Pick the shapes base model from a base_variants_gpu.sh run: among the checkpoints whose
exact-count accuracy on the 48 x 20 evaluation (DPM++ 8 steps) lies in [0.30, 0.70], the range
issue 18 asks for (recognisable shapes, room above for RL), the cheapest to run on a CPU (the
largest patches, then the smallest file), then the best combined reward (count, colour, shape).
Copies it with its training log and evaluation into DEST.

Usage: python benchmarks/pick_base.py OUT DEST (see --help)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.models.shapes_dit import checkpoint_config  # noqa: E402


def pick(out: Path, dest: Path) -> int:
    """Pick the base among OUT's evaluated checkpoints and copy it into DEST; 0 when one was
    picked, 1 when no checkpoint's accuracy lies in [0.30, 0.70]."""
    candidates = []
    for path in out.glob("*/eval-*.json"):
        result = json.loads(path.read_text())
        if 0.30 <= result["exact_count_accuracy"] <= 0.70:
            weights = path.parent / (path.stem.removeprefix("eval-") + ".safetensors")
            patch = checkpoint_config(weights).patch_size
            candidates.append((-patch, weights.stat().st_size, -result["combined_reward"],
                               str(weights), str(path)))
    if not candidates:
        print("no checkpoint in [0.30, 0.70]")
        return 1
    _, size, _, weights, evaluation = min(candidates)
    weights, evaluation = Path(weights), Path(evaluation)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(weights, dest / "base.safetensors")
    shutil.copy(weights.parent / "train_base_log.jsonl", dest / "train_base_log.jsonl")
    shutil.copy(evaluation, dest / "base_eval.json")
    euler = weights.parent / f"euler16-{weights.stem}.json"
    if euler.exists():
        shutil.copy(euler, dest / "base_eval_euler16.json")
    print(f"picked {weights} ({size / 1e6:.1f} MB): "
          f"{json.loads(evaluation.read_text())['exact_count_accuracy']:.3f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pick_base.py",
        description="Pick the shapes base model from a benchmarks/base_variants_gpu.sh run: among "
                    "the checkpoints whose exact-count accuracy (48 x 20 evaluation, DPM++ 8 steps) "
                    "lies in [0.30, 0.70], the cheapest on a CPU (largest patches, then smallest "
                    "file), then the best combined reward. Copies it to DEST/base.safetensors, with "
                    "train_base_log.jsonl, base_eval.json and, when present, "
                    "base_eval_euler16.json. Exits 1 when no checkpoint is in range.")
    parser.add_argument("out", type=Path, metavar="OUT",
                        help="the base_variants_gpu.sh output directory: one subdirectory per "
                             "variant holding its checkpoints (NAME.safetensors), their "
                             "evaluations (eval-NAME.json, optionally euler16-NAME.json) and "
                             "train_base_log.jsonl")
    parser.add_argument("dest", type=Path, metavar="DEST",
                        help="where to copy the picked base (created if missing), e.g. "
                             "trainer/shapes/assets")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return pick(args.out, args.dest)


if __name__ == "__main__":
    raise SystemExit(main())
