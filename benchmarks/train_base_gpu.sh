#!/usr/bin/env bash
# Train the shapes base model on a GPU and evaluate intermediate checkpoints (device tool).
# Usage (on the GPU machine, repo root): bash benchmarks/train_base_gpu.sh OUT_DIR [STEPS]
set -euo pipefail
out=${1:?out dir}; steps=${2:-8000}
python3 -m trainer train-base --out "$out" --steps "$steps" --save-every 1000 --device cuda --bf16
for f in "$out"/base*.safetensors; do
  python3 -m trainer evaluate --checkpoint "$f" --device cuda --out "$out/eval-$(basename "$f" .safetensors).json" >/dev/null
done
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("eval-*.json"))}
(out / "eval_summary.json").write_text(json.dumps(rows, indent=1))
for name, r in rows.items():
    print(name, "acc", round(r["exact_count_accuracy"], 3), "count", round(r["count_reward"], 3),
          "color", round(r["color_reward"], 3), "shape", round(r["shape_reward"], 3), r["exact_count_accuracy_by_count"])
PY
