#!/usr/bin/env bash
# One NCCL session for moekit.distributed on a machine with 2 GPUs, run from the repository root with
# $OUT set (the folder for its logs and results). Every step is bounded; the bounds add up to 450 s:
#   1. machine and versions; 2. bench_expert_parallel.py (EP=2 vs one GPU, all-to-all share,
#   overlap, capacity eager and replayed from a CUDA graph, dropless) per shape; 3. the distributed
#   checks of tests/distributed/distributed_worker.py over NCCL: "capacity_graph" (capacity mode on the GPU
#   kernels: no host sync, CUDA-graph replays with new routing equal eager), "train" (DDP, FSDP2, EP
#   on 2 GPUs) and the checkpoint chain (one process -> 4 ranks on CPU/gloo, as a GPU host has 2
#   GPUs -> 2 GPUs over NCCL -> one process).
#
#   OUT=/tmp/out benchmarks/gpu_distributed_session.sh --smoke   # the script itself on CPU (gloo)
#
# Leaves in $OUT: distributed_tests.log, ep_bench.log, ep_bench_<shape>.json.
# NVLink multicast is switched off (NCCL_NVLS_ENABLE=0 and friends), as the README's numbers were
# measured: not every host allows it.
# MOEKIT_BENCH_COMMIT names the commit measured (a copy of the tree without .git cannot say).
# Exit status: 0 when every check passed and every benchmark finished; 1 otherwise (all always run).

set -uo pipefail
: "${OUT:?set OUT to the directory for the logs and results}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
status=0
LOG="$OUT/distributed_tests.log"
WORK=$(mktemp -d)

port() { $PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
step() {  # step SECONDS LOGFILE COMMAND...: run bounded, log, remember a failure
    local limit=$1 log=$2
    shift 2
    echo "== $(date -u +%T) $*" | tee -a "$log"
    timeout --kill-after=5 "$limit" "$@" 2>&1 | grep -v -e "UserWarning" -e "FutureWarning" -e "_register_pre_backward_hook" -e "return func(" | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { status=1; echo "!! status $rc" | tee -a "$log"; }
}

SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1

{
    echo "== $(date -u +%FT%TZ) moekit.distributed NCCL session; commit ${MOEKIT_BENCH_COMMIT:-unset}; smoke $SMOKE"
    [ "$SMOKE" = 1 ] || nvidia-smi -L
    $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl",
torch.cuda.nccl.version() if torch.cuda.is_available() else None, "triton", triton.__version__, "gpus",
torch.cuda.device_count())'
    echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
} 2>&1 | tee "$LOG" "$OUT/ep_bench.log"

if [ "$SMOKE" = 1 ]; then
    step 120 "$OUT/ep_bench.log" $PY benchmarks/bench_expert_parallel.py --smoke --out "$OUT/ep_bench_tiny.json"
    step 120 "$LOG" $PY tests/distributed/distributed_worker.py ep 2 "$(port)" gloo "$WORK"
    echo "== $(date -u +%T) done (smoke), status $status" | tee -a "$LOG"
    exit $status
fi

step 90 "$OUT/ep_bench.log" $PY benchmarks/bench_expert_parallel.py --shapes qwen3-30b-a3b --rounds 5 \
    --out "$OUT/ep_bench_qwen3-30b-a3b.json"
step 70 "$OUT/ep_bench.log" $PY benchmarks/bench_expert_parallel.py --shapes gpt-oss-20b --rounds 5 \
    --out "$OUT/ep_bench_gpt-oss-20b.json"

# Capacity mode on moekit's GPU kernels (bf16, Triton): host syncs and CUDA-graph capture.
step 120 "$LOG" $PY tests/distributed/distributed_worker.py capacity_graph 2 "$(port)" nccl "$WORK"
# fp32 checks with the loop backend: no Triton compilation inside this session's time.
step 60 "$LOG" $PY tests/distributed/distributed_worker.py train 2 "$(port)" nccl "$WORK" loop
step 15 "$LOG" $PY tests/distributed/distributed_worker.py one_process_save "$WORK"
step 40 "$LOG" $PY tests/distributed/distributed_worker.py ckpt4 4 "$(port)" gloo "$WORK" auto
step 40 "$LOG" $PY tests/distributed/distributed_worker.py ckpt2 2 "$(port)" nccl "$WORK" loop
step 15 "$LOG" $PY tests/distributed/distributed_worker.py one_process_check "$WORK"
echo "== $(date -u +%T) done, status $status" | tee -a "$LOG"
exit $status
