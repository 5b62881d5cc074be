#!/usr/bin/env bash
# Train shapes base-model variants side by side on the GPUs of one machine (round-robin) and
# evaluate every saved checkpoint on the 48 prompts x 20 seeds (DPM++ 8 steps, as
# `trainer evaluate` does, and Euler 16 steps). Each training renders its 300,000 images once
# and draws batches from them on the GPU (--pool-size). Usage (GPU machine, repo root):
#   TRAIN_SECONDS=330 bash benchmarks/base_variants_gpu.sh OUT STEPS
set -uo pipefail
out=${1:?}; steps=${2:-4000}
mkdir -p "$out"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
# name, then train-base flags (a variant's own --steps wins over STEPS). The first round
# (widths 128/192, uniform/logit-normal timesteps, learned/sincos positions, patch 4/2) all
# drew patch-sized specks: attention stayed uniform. This round adds locality to the blocks
# (--mlp-conv) and DiT's initialisation (--xavier-init), alone and together.
variants=(  # every option spelled out: the defaults are now the shipped recipe (CXS8k)
  "X --no-mlp-conv --xavier-init --position-embedding learned"
  "XS --no-mlp-conv --xavier-init --position-embedding sincos"
  "C --mlp-conv --no-xavier-init --position-embedding learned"
  "CS --mlp-conv --no-xavier-init --position-embedding sincos"
  "CXS --mlp-conv --xavier-init --position-embedding sincos"
  "CXSl --mlp-conv --xavier-init --position-embedding sincos --time-sampling logit_normal"
  "CXS192 --mlp-conv --xavier-init --position-embedding sincos --width 192"
  "CXS8k --mlp-conv --xavier-init --position-embedding sincos --steps 8000"
)
# VARIANTS_FILE: one variant per line in the same form, replacing the list above
if [ -n "${VARIANTS_FILE:-}" ]; then mapfile -t variants < "$VARIANTS_FILE"; fi
i=0
for spec in "${variants[@]}"; do
  set -- $spec; name=$1; shift
  # each training stops after TRAIN_SECONDS (default 400) so the evaluation fits the same call
  CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout "${TRAIN_SECONDS:-400}" python3 -m trainer train-base \
    --out "$out/$name" --steps "$steps" --save-every 1000 --device cuda --bf16 \
    --pool-size 300000 "$@" > "$out/$name.log" 2>&1 &
  i=$((i + 1))
done
wait
jobs=()
for f in "$out"/*/base*.safetensors; do
  d=$(dirname "$f"); n=$(basename "$f" .safetensors)
  jobs+=("--checkpoint $f --out $d/eval-$n.json")
  # EULER=0 skips the Euler 16-step evaluation (half the evaluation time)
  [ "${EULER:-1}" = 0 ] || jobs+=("--checkpoint $f --solver euler --steps 16 --out $d/euler16-$n.json")
done
printf '%s\n' "${jobs[@]}" | nl -v0 -w1 -s' ' | xargs -P 12 -L 1 sh -c \
  'CUDA_VISIBLE_DEVICES=$(($0 % '"$gpus"')) python3 -m trainer evaluate --device cuda "$@" >/dev/null 2>&1'
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); rows = {}
for p in sorted(out.glob("*/eval-*.json")) + sorted(out.glob("*/euler16-*.json")):
    r = json.loads(p.read_text()); key = f"{p.parent.name}/{p.stem}"; rows[key] = r
    print(key, "acc", round(r["exact_count_accuracy"], 3), "count", round(r["count_reward"], 3),
          "color", round(r["color_reward"], 3), "shape", round(r["shape_reward"], 3),
          {k: round(v, 2) for k, v in r.get("shape_reward_by_shape", {}).items()},
          {k: round(v, 2) for k, v in r["exact_count_accuracy_by_count"].items()})
for log in sorted(out.glob("*/train_base_log.jsonl")):
    last = json.loads(log.read_text().splitlines()[-1])
    print(log.parent.name, "last logged", last)
(out / "summary.json").write_text(json.dumps(rows, indent=1))
PY
