"""Pick the shapes base model from a base_variants_gpu.sh run: among the checkpoints whose
exact-count accuracy on the 48 x 20 evaluation (DPM++ 8 steps) lies in [0.30, 0.70], the range
issue 18 asks for (recognisable shapes, room above for RL), the cheapest to run on a CPU (the
largest patches, then the smallest file), then the best combined reward (count, colour, shape).
Copies it with its training log and evaluation into DEST. Usage: pick_base.py OUT DEST"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.models.shapes_dit import checkpoint_config  # noqa: E402


def main(out: Path, dest: Path) -> int:
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


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
