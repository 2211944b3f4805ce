#!/usr/bin/env bash
# Checking a GPU machine (docs/CLUSTER.md): from a fresh clone, one GPU; each stage prints its time (--skip leaves
# stages out when the device time is short).
#
#   bash benchmarks/gpu_check.sh [--wheels DIR] [--out DIR] [--skip tests,runs,bench,paged,decode]
#
# 1. installs what is missing (megatron-core, hydra-core, omegaconf, antlr4: from the package index, or from the
#    wheels in DIR with --wheels, for machines without internet) into a folder of its own, torch left as it is;
# 2. a 20-step tiny run on the GPU, a kill -9 during a second run and its resume (losses equal to the first run's
#    bit for bit), DMC 10 steps on the GPU resumed on the CPU, LESS 3 steps from the tiny run, and the engine's
#    greedy tokens on the GPU against the CPU's (full, H2O, LightCache, DMC caches);
# 3. benchmarks/gpu_train.py (method steps at a Llama-2-7B layer shape, DMC attention and accumulation kernels) and a
#    short benchmarks/gpu_decode.py (decode tokens/s at one KV budget: full, fixed pooling, GQA, the policies at 1/4,
#    transformers' generate; 2 layers of the Llama-2-7B shape, 512 + 256 tokens), after benchmarks/gpu_paged.py (the
#    paged decode kernel against the copy bandwidth and SDPA over a dense cache, page size 16, G 1/4/8, d 64/128);
# 4. the tests that exercise tensors on the GPU (DMC_TEST_DEVICE=cuda: kernels, models, the engine, caches,
#    policies, transformers' PolicyCache), the Triton kernels compiled;
# and prints one table last. Logs and results go to --out (default: $OUT if set, else runs/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS="" SKIP="" DEST="${OUT:-runs/gpu_check}"
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --out) DEST=$2; shift 2 ;;
    --skip) SKIP=$2; shift 2 ;;
    *) echo "error: unknown argument $1 (use --wheels DIR, --out DIR, --skip tests,runs,bench,paged,decode)" >&2; exit 2 ;;
  esac
done
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
SCRATCH=$(mktemp -d)  # run directories and installed packages; logs and results go to $DEST
trap 'rm -rf "$SCRATCH"' EXIT
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
declare -a TABLE
record() { TABLE+=("$(printf '%-34s %-8s %s' "$1" "$2" "$3")"); echo "== $1: $2 $3"; }
skipped() { [[ ",$SKIP," == *",$1,"* ]]; }

# -- 1. install ---------------------------------------------------------------------------------
t0=$SECONDS
if ! $PY -c "import megatron.core, hydra, omegaconf" 2>/dev/null; then
  SITE="$SCRATCH/site"
  if [ -n "$WHEELS" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
  else
    $PY -m pip install -q --no-deps --target "$SITE" megatron-core==0.16.1 hydra-core==1.3.2 omegaconf==2.3.1 \
      antlr4-python3-runtime==4.9.3
  fi
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
if $PY -c "import torch, megatron.core, hydra, omegaconf, triton; assert torch.cuda.is_available()" 2>"$DEST/install.log"; then
  record install ok "$($PY -c 'import torch, triton; print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)') ($((SECONDS - t0)) s)"
else
  record install FAILED "$(tail -1 "$DEST/install.log")"
  printf '%s\n' "${TABLE[@]}"; exit 1
fi

losses() {  # losses of metrics.jsonl: "step loss" per line
  $PY -c "import json,sys; [print(r['step'], repr(r['lm_loss'])) for r in map(json.loads, open(sys.argv[1])) if 'lm_loss' in r]" "$1"
}
train() {  # train RUN_NAME LOG [overrides...]
  local name=$1 log=$2; shift 2
  $PY launch/pretrain.py +recipe=tiny_pretrain run_dir="$SCRATCH/$name" train.max_steps=20 logging.progress=false "$@" \
    >>"$DEST/$log" 2>&1
}

# -- 2. runs ------------------------------------------------------------------------------------
if ! skipped runs; then
  t0=$SECONDS
  if train tiny tiny.log checkpoint.save_interval=10; then
    record "tiny run, 20 steps" ok "loss $(losses "$SCRATCH/tiny/metrics.jsonl" | tail -1 | cut -d' ' -f2) ($((SECONDS - t0)) s)"
  else
    record "tiny run, 20 steps" FAILED "$(tail -1 "$DEST/tiny.log")"
  fi

  t0=$SECONDS
  train killed killed.log checkpoint.save_interval=5 &
  pid=$!
  while kill -0 $pid 2>/dev/null && [ ! -e "$SCRATCH/killed/checkpoints/iter_0000010/meta.json" ]; do sleep 0.2; done
  pkill -9 -f "run_dir=$SCRATCH/killed" 2>/dev/null; wait $pid 2>/dev/null
  if train killed killed.log checkpoint.save_interval=5 && \
     diff <(losses "$SCRATCH/tiny/metrics.jsonl" | tail -5) <(losses "$SCRATCH/killed/metrics.jsonl" | tail -5) >"$DEST/killed.diff"; then
    record "kill -9 and resume" ok "last 5 losses equal the uninterrupted run's ($((SECONDS - t0)) s)"
  else
    record "kill -9 and resume" FAILED "$(tail -1 "$DEST/killed.log") $(head -3 "$DEST/killed.diff" | tr '\n' ' ')"
  fi

  t0=$SECONDS
  dmc=(method=dmc method.target_cr=2 train.max_steps=12)
  if train dmc dmc.log "${dmc[@]}" train.max_steps_per_job=10 && \
     CUDA_VISIBLE_DEVICES="" train dmc dmc.log "${dmc[@]}"; then
    record "DMC on GPU, resumed on CPU" ok "loss $(losses "$SCRATCH/dmc/metrics.jsonl" | tail -1 | cut -d' ' -f2) ($((SECONDS - t0)) s)"
  else
    record "DMC on GPU, resumed on CPU" FAILED "$(tail -1 "$DEST/dmc.log")"
  fi

  t0=$SECONDS
  if train less less.log method=less method.budget=16 train.max_steps=3 checkpoint.init_from="$SCRATCH/tiny"; then
    record "LESS from the tiny run" ok "($((SECONDS - t0)) s)"
  else
    record "LESS from the tiny run" FAILED "$(tail -1 "$DEST/less.log")"
  fi

  # the engine on the GPU: greedy tokens of the tiny run and of the DMC run equal the CPU's (several caches)
  for case in "tiny full" "tiny h2o --budget 0.25" "tiny lightcache" "dmc auto"; do
    set -- $case
    run=$1; shift
    t0=$SECONDS
    gen=(launch/generate.py --checkpoint "$SCRATCH/$run" --token-ids --prompt "5 17 42 8 99 3 61 20" --prompt "7 7 1"
         --max-new-tokens 24 --dtype fp32 --cache "$@")
    name="generate on cuda: $run $1"
    if $PY "${gen[@]}" --device cuda --json "$DEST/gen_cuda.json" >>"$DEST/generate.log" 2>&1 && \
       $PY "${gen[@]}" --device cpu --json "$DEST/gen_cpu.json" >>"$DEST/generate.log" 2>&1; then
      same=$($PY -c "import json,sys; t=[[o['tokens'] for o in json.load(open(f))['outputs']] for f in sys.argv[1:]]; print('tokens equal the CPU' if t[0] == t[1] else f'tokens differ: {t[0]} vs {t[1]}')" "$DEST/gen_cuda.json" "$DEST/gen_cpu.json")
      [[ $same == "tokens equal"* ]] && record "$name" ok "$same ($((SECONDS - t0)) s)" || record "$name" FAILED "$same"
    else
      record "$name" FAILED "$(tail -1 "$DEST/generate.log")"
    fi
  done
fi

# -- 3. benchmark -------------------------------------------------------------------------------
if ! skipped bench; then
  t0=$SECONDS
  if timeout "${DMC_CHECK_BENCH_SECONDS:-330}" $PY benchmarks/gpu_train.py --layers 2 --seq 4096 --steps 2 --out "$DEST" 2>&1 | tee "$DEST/gpu_train.log"; then
    record "benchmarks/gpu_train.py" ok "($((SECONDS - t0)) s; goals below)"
  else
    record "benchmarks/gpu_train.py" FAILED "$(tail -1 "$DEST/gpu_train.log")"
  fi
fi

if ! skipped paged; then
  t0=$SECONDS
  if timeout "${DMC_CHECK_PAGED_SECONDS:-120}" $PY benchmarks/gpu_paged.py --out "$DEST" 2>&1 | tee "$DEST/gpu_paged.log"; then
    record "benchmarks/gpu_paged.py" ok "($((SECONDS - t0)) s; goals below)"
  else
    record "benchmarks/gpu_paged.py" FAILED "$(tail -1 "$DEST/gpu_paged.log")"
  fi
fi

if ! skipped decode; then
  t0=$SECONDS
  if timeout "${DMC_CHECK_DECODE_SECONDS:-180}" $PY benchmarks/gpu_decode.py --device cuda --layers 2 --prompt 512 \
      --new 256 --rounds 1 --caches full pool2 pool4 gqa2 gqa4 h2o_1of4 tova_1of4 streaming_llm_1of4 --out "$DEST" \
      2>&1 | tee "$DEST/gpu_decode.log"; then
    record "benchmarks/gpu_decode.py" ok "($((SECONDS - t0)) s; goals below)"
  else
    record "benchmarks/gpu_decode.py" FAILED "$(tail -1 "$DEST/gpu_decode.log")"
  fi
fi

# -- 4. tests on the GPU ------------------------------------------------------------------------
if ! skipped tests; then
  t0=$SECONDS
  DMC_TEST_DEVICE=cuda timeout "${DMC_CHECK_TEST_SECONDS:-300}" $PY -m pytest -q -p no:cacheprovider \
    tests/kernels/dmc tests/kernels/less tests/kernels/paged/test_paged_triton.py tests/test_dmc_method.py \
    tests/models tests/test_device_resume.py tests/test_device_errors.py tests/inference/test_engine.py \
    tests/inference/test_inference_caches.py tests/inference/test_policy_caches.py tests/inference/test_hf_policy_cache.py \
    tests/inference/test_backends_agree.py tests/inference/test_no_tensor_off_device.py \
    tests/inference/test_no_host_sync.py \
    >"$DEST/tests.log" 2>&1
  rc=$?
  summary=$(grep -E "passed|failed|error" "$DEST/tests.log" | tail -1)
  [ $rc -eq 0 ] && record "tests on cuda" ok "$summary ($((SECONDS - t0)) s)" \
                || record "tests on cuda" FAILED "rc $rc: ${summary:-timed out} ($((SECONDS - t0)) s)"
fi

echo
echo "GPU check ($DEST):"
printf '  %s\n' "${TABLE[@]}"
if [ -e "$DEST/gpu_train.log" ]; then sed -n '/^goals/,$p' "$DEST/gpu_train.log" | sed 's/^/  /'; fi
if [ -e "$DEST/gpu_paged.log" ]; then sed -n '/^goals/,/^wrote/p' "$DEST/gpu_paged.log" | sed 's/^/  /'; fi
if [ -e "$DEST/gpu_decode.log" ]; then sed -n '/^goals/,/^wrote/p' "$DEST/gpu_decode.log" | sed 's/^/  /'; fi
