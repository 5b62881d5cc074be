#!/usr/bin/env bash
# Train several shapes base-model variants side by side on one GPU and evaluate each saved
# checkpoint on the 48 prompts x 20 seeds (DPM++ 8 steps, as `trainer evaluate` does, and
# Euler 16 steps). Usage (GPU machine, repo root): bash benchmarks/base_variants_gpu.sh OUT STEPS
set -uo pipefail
out=${1:?}; steps=${2:-8000}
mkdir -p "$out"
# each training stops after TRAIN_SECONDS (default 400) so that the evaluation still runs on
# what was saved within one device call
train() { name=$1; shift; timeout "${TRAIN_SECONDS:-400}" python3 -m trainer train-base --out "$out/$name" --steps "$steps" \
  --save-every 2000 --device cuda --bf16 --render-processes 3 "$@" > "$out/$name.log" 2>&1; }
train u192 --width 192 --patch-size 4 --time-sampling uniform &
train l192 --width 192 --patch-size 4 --time-sampling logit_normal &
train u128 --width 128 --patch-size 4 --time-sampling uniform &
train l128 --width 128 --patch-size 4 --time-sampling logit_normal &
wait
for d in "$out"/*/; do for f in "$d"base*.safetensors; do
  [ -e "$f" ] || continue
  n=$(basename "$f" .safetensors)
  python3 -m trainer evaluate --checkpoint "$f" --device cuda --out "$d/eval-$n.json" >/dev/null &
  python3 -m trainer evaluate --checkpoint "$f" --device cuda --solver euler --steps 16 \
    --out "$d/euler16-$n.json" >/dev/null &
done; wait; done
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); rows = {}
for p in sorted(out.glob("*/eval-*.json")) + sorted(out.glob("*/euler16-*.json")):
    r = json.loads(p.read_text()); key = f"{p.parent.name}/{p.stem}"; rows[key] = r
    print(key, "acc", round(r["exact_count_accuracy"], 3), "count", round(r["count_reward"], 3),
          "color", round(r["color_reward"], 3), "shape", round(r["shape_reward"], 3),
          {k: round(v, 2) for k, v in r["exact_count_accuracy_by_count"].items()})
(out / "summary.json").write_text(json.dumps(rows, indent=1))
PY
