#!/usr/bin/env bash
# CUDA smoke of the trainer's CLIs: tiny FLUX and SD3.5 pipelines built in code
# (tests/tiny_diffusers.py; real weights are not needed) trained with LoRA, sampled and
# evaluated, then the shapes model trained, evaluated and resumed. Prints one "rc STEP 0" line
# a step; a nonzero rc names the step that broke. Run from the repository root on a GPU
# machine: `bash benchmarks/cuda_smoke.sh` (DEV=cpu runs it here, slowly; MODELS="flux"
# picks the diffusers models; NOSHAPES=1 leaves shapes out; W is the scratch directory).
# Where the machine lacks diffusers/peft/transformers, wheels in .whl/ are installed first.
DEV=${DEV:-cuda}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if ! $PY -c "import diffusers, peft, transformers" 2>/dev/null && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/tests:$PWD
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
W=${W:-/tmp/cuda-smoke}; rm -rf "$W"; mkdir -p "$W"
$PY -c "from pathlib import Path; from tiny_diffusers import write_tiny_flux, write_tiny_sd3; write_tiny_flux(Path('$W/m/flux')); write_tiny_sd3(Path('$W/m/sd3'), sd35=True)"
echo "rc build $?"
printf "a red circle\na cat on a mat\n" > "$W/p.txt"
for m in ${MODELS:-flux sd3}; do
  R=""; [ "$m" = sd3 ] && R=128  # the tiny SD3's transformer draws at most 128x128
  $PY -m trainer train --config tiny --set model=$m --set model_path=$W/m/$m --set device=$DEV \
    --set finetune=lora --set lora_rank=4 ${R:+--set resolution=$R} --prompts-file "$W/p.txt" \
    --out "$W/r/$m" --no-progress > "$W/train_$m.log" 2>&1
  echo "rc train $m $?"; tail -2 "$W/train_$m.log"
  ck=$(ls -d "$W/r/$m/checkpoints/"* | tail -1)
  $PY -m trainer sample --model $m --model-path "$W/m/$m" --checkpoint "$ck" --prompts "$W/p.txt" \
    --seeds 2 --out "$W/s/$m" --device $DEV ${R:+--resolution $R} > "$W/sample_$m.log" 2>&1
  echo "rc sample $m $? ($(ls "$W/s/$m" | wc -l) files)"
  $PY -m trainer evaluate --model $m --model-path "$W/m/$m" --checkpoint "$ck" \
    --prompts-file "$W/p.txt" --rewards jpeg_compressibility --seeds 2 --device $DEV \
    ${R:+--resolution $R} > "$W/eval_$m.log" 2>&1
  echo "rc evaluate $m $?"; tail -1 "$W/eval_$m.log"
done
[ -n "$NOSHAPES" ] && exit 0
$PY -m trainer train --config shapes-quick-demo --set iterations=4 --set checkpoint_every=2 \
  --set device=$DEV --out "$W/r/shapes" --no-progress > "$W/train_shapes.log" 2>&1
echo "rc train shapes $?"
ck=$(ls -d "$W/r/shapes/checkpoints/"* | tail -1)
$PY -m trainer evaluate --checkpoint "$ck" --seeds 2 --device $DEV > "$W/eval_shapes.log" 2>&1
echo "rc evaluate shapes $?"; tail -1 "$W/eval_shapes.log"
$PY -m trainer train --config shapes-quick-demo --set iterations=6 --set checkpoint_every=2 \
  --set device=$DEV --out "$W/r/shapes" --resume --no-progress > "$W/resume.log" 2>&1
echo "rc resume shapes $?"
