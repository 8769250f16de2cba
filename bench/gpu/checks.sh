#!/usr/bin/env bash
# The GPU checks of issue 32, as one script for a lent GPU machine (the repo at its root, wheels for
# what its image lacks in .whl/, a pre-exported GPT-2-124M in .dev/): calibrate on the GPU, `run` a
# zoo plan in amp (bf16 autocast over fp32 weights), examples/train_hf.py on GPT-2-124M in amp, and
# the native steps of bench/gpu/configs in amp the same hour. Everything it prints and writes lands
# in $OUT (profile, its measurements, logs). CALIBRATE=0: the committed preset h100-sxm-calibrated;
# DTYPES: the precisions run and trained (default "amp mixed"); RUN=0: no `meshplan run`; RUNTIMES: the
# runtimes train_hf.py plans and trains in (default "eager"; "compiled": the module through torch.compile,
# issue 34); NATIVE=0: no native steps; VOCAB=1: whole steps at vocab 32000 and 32001
# (configs/runs-vocab.json); OFFLOAD=1: the host link, AdamW on the host and FSDP2's CPU offload
# (measure_offload.py, issue 35).
set -uo pipefail
export PYTHONUNBUFFERED=1 MESHPLAN_ZOO_DIR=/tmp/zoo
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
printf '#!/bin/sh\nexec python3 %s/cli.py "$@"\n' "$PWD" > /usr/local/bin/meshplan && chmod +x /usr/local/bin/meshplan
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
step() { echo "=== $1 ($(date +%T))"; }
P=$OUT/h100-sxm-calibrated.json

if [ "${CALIBRATE:-1}" = 1 ]; then
  step calibrate
  meshplan profile calibrate --backend nccl --nproc 1 --compute-only --base h100-sxm --name h100-sxm-calibrated \
    --out "$P" 2>&1 | tee "$OUT/calibrate.log"
fi
[ -f "$P" ] || P=h100-sxm-calibrated

for D in ${DTYPES:-amp mixed}; do
  if [ "${RUN:-1}" = 1 ]; then
    step "plan + run, gpt2-124m 16x1024 $D"
    meshplan plan .dev/gpt2-124m.onnx --devices 1 --dim batch=16 --dim seq=1024 --profile "$P" --dtype $D \
      -o /tmp/gpt2-$D.strategy.json 2>&1 | grep -E "step time|at the peak"
    meshplan run /tmp/gpt2-$D.strategy.json --model .dev/gpt2-124m.onnx --nproc 1 --steps 5 --json > "$OUT/run-$D.json"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r[k] for k in ('loss','measured_step_s','predicted_step_s','measured_phases_s','measured_memory_bytes','predicted_memory_bytes')})" "$OUT/run-$D.json"
  fi
  for R in ${RUNTIMES:-eager}; do
    step "examples/train_hf.py, gpt2-124m 16x1024 $D $R"
    timeout ${TRAIN_TIMEOUT:-200} python3 -m torch.distributed.run --nproc-per-node 1 examples/train_hf.py --config bench/gpu/configs/gpt2-124m.json \
      --batch 16 --seq 1024 --profile "$P" --dtype $D --runtime $R --steps ${STEPS:-8} --workdir /tmp/hf-$D-$R 2>&1 \
      | grep -E "^apply|^step|^error|Error" | tee "$OUT/train_hf-$D-$R.log"
  done
done
if [ "${OFFLOAD:-0}" = 1 ]; then
  step "offload: host link, AdamW on the host, FSDP2 CPU offload (bench/gpu/measure_offload.py)"
  timeout 240 python3 bench/gpu/measure_offload.py 2>&1 | tail -30
fi

if [ "${NATIVE:-1}" = 1 ]; then
  step "native steps, amp (bench/gpu/measure_steps.py)"
  PRECISIONS=amp NATIVE_OUT=native-amp.json timeout 200 python3 bench/gpu/measure_steps.py 2>&1 | tail -5
fi
if [ "${VOCAB:-0}" = 1 ]; then
  step "native steps, vocab 32000 against 32001 (Llama-2-7B widths, 2 layers), amp and fp32"
  RUNS=runs-vocab.json PRECISIONS=amp,fp32 NATIVE_OUT=native-vocab.json timeout 200 python3 bench/gpu/measure_steps.py 2>&1 | tail -5
fi
[ -f .dev/sustained.py ] && { step "GEMMs: burst against sustained"; PYTHONPATH=$PYTHONPATH:$PWD python3 .dev/sustained.py; }
step done
