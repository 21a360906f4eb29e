#!/usr/bin/env bash
# Issue 33's GPU checks as ONE prepared command, for a session lent an H100/H200 (no network).
#
# Here, before the device call (from the project root):  bash ../shared/gpu-check/prepare.sh
#   (fills the git-ignored .gpu/ with the wheels the GPU machine lacks; carry it: carry=[".gpu"])
# On the GPU machine (from the project root):               bash benchmarks/gpu_session.sh
#
# Steps, each under its own timeout, all within 9.5 minutes (a device command may run 10):
#   1. the wheels into $TMPDIR/site (gpu-check's installer: nothing newer is shadowed; 60 s)
#   2. the CUDA-marked tests and the device-parametrised ones (-m cuda; 150 s), the batch-
#      invariant Triton ones included: if they pass, drop TOKENWEIR_BATCH_INVARIANT_CUDA's opt-in
#   3. benchmarks/gpu_throughput.py (tokenweir vs transformers, roofline, GPU busy;
#      $BUDGET_S (300) s budget, killed 60 s later: what it printed by then stays)
#   4. benchmarks/gpu_step_profile.py (host vs device time of a decode step; $PROFILE_S, 90)
#   5. (only when STEPS names `suite`) the whole suite with CUDA visible, -n 8 ($SUITE_S, 300):
#      test files needing what the machine lacks (openai, schemathesis, ...) skip or fail there
# STEPS (default tests,profile,bench) picks some of 2-4; BENCH_ARGS adds flags to step 3
# (e.g. "--models smollm2-135m --skip-transformers"); TESTS_S caps step 2, TESTS_N its workers (4).
# Output under $OUT (default /tmp/gpu-out): env.txt, cuda_tests.txt, step_profile.txt,
# gpu_throughput.txt/.json.
set -u
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
SITE="${TMPDIR:-/tmp}/site"
PY="${PY:-python3}"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-${TMPDIR:-/tmp}/tokenweir_torch_ext}"

if [ -f .gpu/install_wheels.py ]; then
  timeout 60 "$PY" .gpu/install_wheels.py "$SITE" > "$OUT/install.txt" 2>&1
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$OUT/env.txt" 2>&1

STEPS="${STEPS:-tests,profile,bench}"
BUDGET_S="${BUDGET_S:-300}"
if [[ "$STEPS" == *tests* ]]; then
timeout "${TESTS_S:-150}" "$PY" -m pytest -q -m cuda -p no:cacheprovider -n "${TESTS_N:-4}" -rfE \
  tests/model/test_attention_backends.py tests/model/test_triton_ops.py tests/model/test_cuda_parity.py tests/model/test_transfer.py tests/engine/test_host_swap.py \
  tests/engine/test_cuda_graphs.py tests/engine/test_cuda_engine.py tests/engine/test_warm_up.py \
  tests/model/test_triton_batch_invariant.py tests/engine/test_batch_invariance.py \
  > "$OUT/cuda_tests.txt" 2>&1
echo "cuda tests rc=$?" >> "$OUT/cuda_tests.txt"
fi

if [[ "$STEPS" == *bench* ]]; then
timeout $((BUDGET_S + 60)) "$PY" benchmarks/gpu_throughput.py --budget-s "$BUDGET_S" \
  --json "$OUT/gpu_throughput.json" ${BENCH_ARGS:-} > "$OUT/gpu_throughput.txt" 2>&1
echo "gpu_throughput rc=$?" >> "$OUT/gpu_throughput.txt"
fi

if [[ "$STEPS" == *profile* ]]; then  # after the benchmark: diagnostics, cut first
timeout "${PROFILE_S:-90}" "$PY" benchmarks/gpu_step_profile.py --steps 20 --top 15 \
  --batches 1,64,512 > "$OUT/step_profile.txt" 2>&1
echo "step profile rc=$?" >> "$OUT/step_profile.txt"
fi
if [[ "$STEPS" == *suite* ]]; then
timeout "${SUITE_S:-300}" "$PY" -m pytest -q -n 8 -m "not soak" -p no:cacheprovider -rfE tests \
  > "$OUT/suite.txt" 2>&1
echo "suite rc=$?" >> "$OUT/suite.txt"
tail -n 30 "$OUT/suite.txt"
fi
tail -n 25 "$OUT"/cuda_tests.txt; tail -n 40 "$OUT"/gpu_throughput.txt 2>/dev/null
