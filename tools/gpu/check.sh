#!/usr/bin/env bash
# ../shared/GPU.md's checklist on a lent GPU machine, in two parts that each fit one 10-minute device call:
#   part a: versions and gptkit doctor; the kernel tests and the notebooks' gpu cells on the device; benchmarks/kernels.py;
#           bench_train at 125m (ZeRO 0 and 1) and 350m; tools/gpu/probe.py (where a step's and a token's time goes)
#   part b: gptkit train --preset 125m on the built-in books (validated on Wikipedia), gptkit profile, generate (batch 1
#           and 8), serve; bench_generate on the GPU against transformers; bench_train at 1.3b
# Before: bash tools/gpu/wheels.sh here (once). Then, through the device tool, carrying .whl:
#   bash tools/gpu/check.sh a      and      bash tools/gpu/check.sh b
# Every step has its own time limit, so one that hangs costs only its share; the log goes to $OUT/gpu-PART.log.
# On a CPU (DEV=cpu PRESET=tiny ITERS=10 BIG_A=none BIG_B=none) it runs end to end too, as a check of the script.
set -uo pipefail
cd "$(dirname "$0")/../.."
PART=${1:-a}
OUT=${OUT:-/tmp/gpu-check}
PRESET=${PRESET:-125m}
ITERS=${ITERS:-150}
BIG_A=${BIG_A:-350m}
BIG_B=${BIG_B:-1.3b}
DEV=${DEV:-cuda}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-$PART.log") 2>&1
T0=$(date +%s)
step() { echo; echo "======== [$(( $(date +%s) - T0 )) s] $*"; }
limit() { local s=$1; shift; local t; t=$(date +%s); timeout -k 20 "$s" "$@"; echo "-------- rc=$? in $(( $(date +%s) - t )) s: $*"; }
big() {   # bench_train at the larger presets named (none: skip)
  for p in "$@"; do
    [ "$p" = none ] && continue
    step "bench_train $p bf16"
    limit 150 python3 benchmarks/bench_train.py --preset "$p" --dtype bf16 --vocab 50304 --batch 8 --rounds 2 --steps 3
  done
}

step setup
if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/site && ln -sfn "$PWD/cli" /tmp/site/gptkit_cli        # the CLI's package, as setup.py maps it
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 GPTKIT_CACHE=/tmp/gptkit-cache COLUMNS=160
G="python3 -m gptkit_cli.main"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | head -3
python3 -c "import sys, torch, triton, deepspeed, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1

if [ "$PART" = a ]; then
  step doctor
  limit 120 $G doctor --steps 20
  step "kernel tests on the device (no interpreter)"
  limit 120 python3 -m pytest -q --tb=short -p no:cacheprovider -o addopts= tests/kernels_interpreted.py tests/test_kernels_moe.py
  step "the notebooks' gpu cells"
  for nb in 09_kernels.fused 09b_kernels.qk; do
    python3 tools/gpu/nb_cells.py "nbs/$nb.ipynb" "/tmp/$nb.py" && (cd nbs && limit 90 python3 "/tmp/$nb.py" 2>&1 | tail -4)
  done
  step "benchmarks/kernels.py"
  limit 90 python3 benchmarks/kernels.py --rounds 5
  for zero in 0 1; do
    step "bench_train $PRESET bf16 ZeRO $zero"
    limit 120 python3 benchmarks/bench_train.py --preset "$PRESET" --dtype bf16 --vocab 50304 --batch 8 --rounds 3 --steps 5 --zero $zero
  done
  step "probe: where a step's and a token's time goes"
  limit 120 python3 tools/gpu/probe.py --preset "$PRESET" --device "$DEV"
  big $BIG_A
fi

if [ "$PART" = b ]; then
  step "data: the quickstart's books for training, Wikipedia held out (GPT-2's tokenizer)"
  limit 60 $G data prepare -i builtin:shakespeare -i builtin:milton -i builtin:kjv --output-prefix /tmp/books --tokenizer gpt2 --overwrite
  limit 60 $G data prepare -i builtin:wikipedia --output-prefix /tmp/wiki --tokenizer gpt2 --overwrite
  step "train $PRESET, $ITERS steps"
  rm -rf /tmp/run1
  limit 200 $G train --preset "$PRESET" --train-data /tmp/books_text_document --valid-data /tmp/wiki_text_document \
    --tokenizer gpt2 --out /tmp/run1 --iters "$ITERS" --set train.global_batch=32 --set train.micro_batch=16 \
    --set train.eval_interval=50 --set train.eval_iters=4 --set train.log_interval=25 --set optim.warmup=20
  cp /tmp/run1/metrics.jsonl "$OUT/" 2>/dev/null
  step "gptkit profile $PRESET: where a training step's time goes, by category"
  limit 150 $G profile --preset "$PRESET" --data /tmp/books_text_document --tokenizer gpt2 --out /tmp/profile1 \
    --set train.micro_batch=8 --set train.global_batch=8 --top 12
  cp /tmp/profile1/summary.json "$OUT/profile-summary.json" 2>/dev/null
  step "generate, batch 1 and 8"
  limit 90 $G generate --checkpoint /tmp/run1 --prompt "And God said" --max-new-tokens 128 --greedy --device "$DEV"
  limit 90 $G generate --checkpoint /tmp/run1 --prompt "And God said" --num-samples 8 --batch-size 8 \
    --max-new-tokens 128 --seed 1 --device "$DEV" | tail -3
  step serve
  (timeout 150 $G serve --checkpoint /tmp/run1 --port 5077 --device "$DEV" > /tmp/serve.log 2>&1 &)
  limit 140 python3 tools/gpu/serve_probe.py http://127.0.0.1:5077
  pkill -f "gptkit_cli.main serve"; sleep 2; tail -5 /tmp/serve.log
  step "bench_generate on the device: gptkit against transformers generate"
  limit 150 python3 benchmarks/bench_generate.py --device "$DEV" --preset "$PRESET" --skip-server --rounds 3
  big $BIG_B
fi
step done
