#!/usr/bin/env bash
# The whole GPU suite on one GPU in one call (<= 10 min, from the repository root, no .git needed):
# `pytest -m gpu` of tests/ with xdist workers sharing the GPU (tests that need tens of GiB take the
# suite's one-at-a-time lock, `gpu_to_itself`), stopped by SIGINT at TESTS_S so that pytest still
# prints what failed and how many passed; the 40 slowest tests' durations at the end.
#
#   OUT=/path C=<commit> bash benchmarks/gpu_tests_all.sh
#
# Leaves $OUT/${P}_gpu_tests_all_$C.log (P: h100 / h200 by the GPU's name). Settings by environment:
# TESTS_S (540: a call's 600 s less the start), W (workers, 8; each holds a CUDA context and its
# tests' memory: on an 80 GB H100 at 03c87cf, 8 workers ran 480 of 483 tests in 400 s, 13 of them
# out of memory beside others before the lock covered them), ARGS (more pytest arguments, e.g. -k).
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=benchmarks/gpu_prelude.sh
. benchmarks/gpu_prelude.sh
LOG=$OUT/${P}_gpu_tests_all_$C.log
t0=$(date +%s)
# shellcheck disable=SC2086
PYTHONPATH=$PWD/src timeout -s INT -k 20 "${TESTS_S:-540}" python3 -m pytest -q -m gpu -n "${W:-8}" \
    -p no:cacheprovider --durations=40 -rfEs ${ARGS:-} tests > "$LOG" 2>&1
echo "pytest rc=$? $(($(date +%s) - t0)) s (124 or 130: stopped at TESTS_S)"
grep -E "^(FAILED|ERROR)" "$LOG" | head -30
tail -1 "$LOG"
