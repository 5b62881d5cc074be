#!/usr/bin/env bash
# One device call: longer base-model variants in the background (setsid, they outlive the
# call while the machine stays warm) and the RL benchmark from the shipped base in front.
set -uo pipefail
iters=${1:-1000}
mkdir -p /tmp/bv
[ -d /tmp/bv/L ] || for spec in "L --width 128 --time-sampling logit_normal" "W --width 192 --depth 8 --time-sampling logit_normal"; do
  set -- $spec; name=$1; shift
  setsid nohup python3 -m trainer train-base --out /tmp/bv/$name --steps 14000 --save-every 2000 --device cuda "$@" > /tmp/bv/$name.log 2>&1 < /dev/null &
done
python3 benchmarks/shapes_neighbor_vs_sde.py --out /tmp/bench --iterations "$iters" --eval-every 100 \
  --seeds 0 1 --ablations --parallel 12 --timing-iterations 20
