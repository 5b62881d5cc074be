#!/usr/bin/env bash
# Train several shapes base-model variants side by side on one GPU and evaluate each.
# Usage: bash benchmarks/base_variants_gpu.sh OUT_DIR STEPS
set -uo pipefail
out=${1:?}; steps=${2:-6000}
mkdir -p "$out"
train() { name=$1; shift; python3 -m trainer train-base --out "$out/$name" --steps "$steps" --save-every 2000 --device cuda "$@" > "$out/$name.log" 2>&1; }
train A --width 128 --patch-size 4 &
train B --width 128 --patch-size 4 --time-sampling logit_normal &
train C --width 192 --patch-size 4 &
train D --width 96 --patch-size 2 &
wait
for v in A B C D; do for f in "$out/$v"/base*.safetensors; do
  python3 -m trainer evaluate --checkpoint "$f" --device cuda --out "$out/$v/eval-$(basename "$f" .safetensors).json" >/dev/null &
done; done; wait
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); rows = {}
for p in sorted(out.glob("*/eval-*.json")):
    r = json.loads(p.read_text()); key = f"{p.parent.name}/{p.stem}"; rows[key] = r
    print(key, "acc", round(r["exact_count_accuracy"], 3), "count", round(r["count_reward"], 3),
          "color", round(r["color_reward"], 3), "shape", round(r["shape_reward"], 3),
          {k: round(v, 2) for k, v in r["exact_count_accuracy_by_count"].items()})
(out / "summary.json").write_text(json.dumps(rows, indent=1))
PY
