#!/usr/bin/env bash
# moekit's GPU session: the GPU tests and every benchmark the README's Performance section quotes,
# in one command, from the repository root (no .git needed), inside a wall-clock budget.
#
#   OUT=/path MOEKIT_BENCH_COMMIT=<commit> bash benchmarks/gpu_session.sh [--budget SECONDS]
#   OUT=/tmp/s bash benchmarks/gpu_session.sh --smoke      # CPU, tiny shapes: checks the plumbing
#
# Parts, in order, each run under `timeout` for min(its cap, the budget left); a part with under
# 15 s left is skipped and says so, and what a part leaves unfinished does not stop the next one:
#   a. machine and versions (nvidia-smi, GPU name, torch, CUDA, triton, transformers, liger, commit)
#   b. pytest -m gpu (4 xdist workers when xdist is installed)              cap 250 s
#   c. bench_mlp_vs_plain.py: grouped_mlp (triton, probs) vs plain_mlp, 4 shapes x
#      balanced/skewed, 3 interleaved rounds, the dense roof, peak and held memory  cap  75 s
#   d. bench_moe_layer.py: moe_experts vs plain_layer vs Liger, the 4 layers,
#      256/1024/4096 tokens, SonicMoE's shape; forward and forward+backward; JSON + PNG  cap 200 s
#   e. bench_transformers.py: Qwen3-MoE at 30B-A3B width, apply_moekit vs
#      transformers' grouped_mm, forward+backward tokens/s, peak memory              cap  60 s
#   f. bench_host_overhead.py: 256/1024/4096 tokens, host enqueue vs GPU time and
#      kernel launches per step (torch.profiler)                                     cap  35 s
#   g. summarize.py: every bar, measured / bar / verdict, and the README's tables, from the files
# The caps add up to more than the default budget (480 s), so a budget cuts the last parts first.
# With --smoke only the budget bounds the parts.
# Each benchmark rewrites its JSON after every cell and stops starting cells (--max-seconds) early
# enough to finish the one in progress, so a part cut short keeps what it measured.
#
# Leaves 8 files in $OUT:
#   session.log  gpu_tests.log  mlp_vs_plain.json  moe_layer.json  moe_layer.png
#   transformers.json  host_overhead.json  summary.md
#
# MOEKIT_BENCH_COMMIT names the commit every JSON records (a copy of the tree without .git cannot
# say). Liger-Kernel is used when importable; else, if .whl/ holds its wheel, it is installed into
# a temporary --target directory first. PY picks the interpreter (default python3).
# Exit status: 0 when every part finished with status 0; 1 otherwise.

set -uo pipefail
SMOKE=0
BUDGET=480
while (($#)); do
    case $1 in
        --smoke) SMOKE=1 ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
        *) echo "usage: OUT=DIR bash $0 [--smoke] [--budget SECONDS]" >&2; exit 2 ;;
    esac
    shift
done
: "${OUT:?set OUT to the directory for the logs and results}"
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PY:-python3}
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

session() {
    local failed=()
    stamp() { printf '[%3d s]' "$SECONDS"; }

    # part NAME LIMIT COMMAND...: COMMAND under `timeout LIMIT` (LIMIT from limit_for: min(its cap,
    # the budget left)); its exit status in PART_RC (124/137: timed out).
    part() {
        local name=$1 limit=$2 start=$SECONDS
        shift 2
        if ((limit < 15)); then
            echo "!! $(stamp) $name skipped: $((BUDGET - SECONDS)) s left of the $BUDGET s budget"
            failed+=("$name (skipped)")
            PART_RC=skipped
            return
        fi
        echo "== $(stamp) $name (limit $limit s)"
        timeout --kill-after=5 "$limit" "$@"
        PART_RC=$?
        echo "== $(stamp) $name: exit $PART_RC after $((SECONDS - start)) s$( ((PART_RC == 124 || PART_RC == 137)) \
            && echo ' (timed out)')"
        ((PART_RC == 0)) || failed+=("$name (exit $PART_RC)")
    }
    # With --smoke only the budget bounds a part: the caps are sized for the GPU's shapes, and a
    # busy CPU can take longer than them on the tiny ones.
    limit_for() {
        local left=$((BUDGET - SECONDS - 5))
        ((SMOKE)) && { echo "$left"; return; }
        echo $(($1 < left ? $1 : left))
    }

    echo "== $(stamp) moekit GPU session in $PWD, budget $BUDGET s$( ((SMOKE)) && echo ', --smoke (CPU, tiny shapes)')"
    date -u +%FT%TZ
    if ((!SMOKE)); then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1
        if ! $PY -c 'import liger_kernel' 2>/dev/null && compgen -G '.whl/liger_kernel-*.whl' >/dev/null; then
            local site
            site=$(mktemp -d)/site
            $PY -m pip install -q --no-index --no-deps --target "$site" .whl/liger_kernel-*.whl \
                && export PYTHONPATH="$PYTHONPATH:$site" && echo "liger-kernel installed into $site"
        fi
    fi
    [[ -n ${MOEKIT_BENCH_COMMIT:-} ]] || [[ -d .git ]] \
        || echo "!! no .git and no MOEKIT_BENCH_COMMIT: the JSONs cannot say which commit they measured"
    timeout 60 $PY -c 'import json, runner; print(json.dumps(runner.machine(), indent=1))' \
        || failed+=("versions")

    local smoke_args=() backend_args=() limit
    if ((SMOKE)); then
        smoke_args=(--smoke)
        backend_args=(--backend torch)  # the Triton interpreter takes seconds per call
        echo "pytest -m gpu: not run with --smoke (CPU)" >"$OUT/gpu_tests.log"
    else
        local xdist=()
        $PY -c 'import xdist' 2>/dev/null && xdist=(-n 4)
        limit=$(limit_for 250)
        {
            echo "== pytest -m gpu ${xdist[*]} (limit $limit s)"
            part "pytest -m gpu" "$limit" $PY -m pytest -m gpu -v -p no:cacheprovider -rfEs --durations=15 \
                "${xdist[@]}" tests
            echo "== exit status $PART_RC"
        } >"$OUT/gpu_tests.log" 2>&1
        grep -E '^(== |!! )|(passed|failed|error).* in [0-9.]+s' "$OUT/gpu_tests.log" | tail -4
    fi

    limit=$(limit_for 75)
    part "grouped_mlp vs plain_mlp" "$limit" $PY benchmarks/bench_mlp_vs_plain.py --out "$OUT" \
        --max-seconds $((limit - 20)) "${smoke_args[@]}" "${backend_args[@]}"
    limit=$(limit_for 200)
    part "MoE layer vs plain_layer and Liger" "$limit" $PY benchmarks/bench_moe_layer.py --out "$OUT" \
        --max-seconds $((limit - 30)) "${smoke_args[@]}" "${backend_args[@]}"
    part "transformers Qwen3-MoE" "$(limit_for 60)" $PY benchmarks/bench_transformers.py --out "$OUT" "${smoke_args[@]}"
    part "small batches: host vs GPU time" "$(limit_for 35)" $PY benchmarks/bench_host_overhead.py --out "$OUT" \
        "${smoke_args[@]}" "${backend_args[@]}"

    echo "== $(stamp) summary"
    timeout 30 $PY benchmarks/summarize.py "$OUT" --write "$OUT/summary.md" || failed+=("summary")
    ls -la "$OUT"
    if ((${#failed[@]})); then
        echo "== $(stamp) done; not clean: $(IFS=';'; echo "${failed[*]}")"
        return 1
    fi
    echo "== $(stamp) done; every part finished"
}

session 2>&1 | tee "$OUT/session.log"
exit "${PIPESTATUS[0]}"
