#!/usr/bin/env bash
# One GPU session for moekit, run from the repository root on the device machine with $OUT set:
#   1. the machine and versions, 2. the GPU tests (pytest -m gpu), 3. every benchmark for the
#   loop, torch and triton backends. Everything is bounded to stay inside 10 minutes.
#
# Leaves in $OUT (4 files; the device tool returns at most 8 per call):
#   gpu_tests.log    pytest's output
#   bench.log        machine/versions, then the benchmarks' progress and table
#   bench_all.json   every benchmark cell (see benchmarks/runner.py for the fields)
#   bench_all.png    TFLOP/s per op, shape and backend against the dense roof
#
# Without network or a build there: moekit is imported from src/ through PYTHONPATH.
# Without .git there: set MOEKIT_BENCH_COMMIT=<commit> so the JSON names the code it measured.
# PY picks the interpreter (default python3, the one that holds PyTorch there).
# Exit status: 0 when the tests passed and the benchmarks finished; 1 otherwise (both always run).

set -uo pipefail
: "${OUT:?set OUT to the directory for the logs and results}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
status=0

{
    echo "== $(date -u +%FT%TZ) moekit GPU session in $PWD"
    nvidia-smi
    $PY - <<'EOF'
import platform, torch, triton, numpy
print(f"python {platform.python_version()}  torch {torch.__version__} (cuda {torch.version.cuda})  "
      f"triton {triton.__version__}  numpy {numpy.__version__}")
print("devices:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
    git rev-parse HEAD 2>/dev/null || echo "no git here; MOEKIT_BENCH_COMMIT=${MOEKIT_BENCH_COMMIT:-unset}"
} 2>&1 | tee "$OUT/bench.log"

# 2. GPU tests: every test marked gpu (the library on CUDA and the Triton kernels at real sizes);
#    the kernels compile here first (the benchmarks reuse the cache).
echo "== pytest -m gpu" | tee "$OUT/gpu_tests.log"
timeout --kill-after=10 270 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests 2>&1 \
    | tee -a "$OUT/gpu_tests.log" || { rc=$?; status=1; echo "!! GPU tests failed or timed out (status $rc)"; }

# 3. Benchmarks: torch+triton in one worker process (so that each cell times them in interleaved
#    rounds, at the same clocks), the slow loop backend in another, each bounded; a worker that
#    overruns is killed and what it measured so far is kept.
#    MOEKIT_BENCH_ARGS adds options (e.g. "--quick" or "--shapes mixtral-8x7b"; "--smoke" for a dry run on CPU).
# shellcheck disable=SC2086  # MOEKIT_BENCH_ARGS is a list of options
timeout --kill-after=10 300 $PY benchmarks/run_all.py --backends loop,torch,triton --isolate loop \
    --worker-timeout 200 \
    --out "$OUT" ${MOEKIT_BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" \
    || { rc=$?; status=1; echo "!! benchmarks failed or timed out (status $rc)"; }

ls -la "$OUT"
exit $status
