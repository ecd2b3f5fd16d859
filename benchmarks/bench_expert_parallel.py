"""Expert parallelism on several GPUs of one host: MoELayer forward+backward tokens/s at EP=world
against one GPU at the same per-GPU batch, the share of the step spent in all-to-all kernels, with
and without the chunked overlap (`ExpertParallelMoE(num_chunks=2)`), and capacity mode (eager and
replayed from a CUDA graph).

    python benchmarks/bench_expert_parallel.py --out results.json         # every visible GPU, NCCL
    python benchmarks/bench_expert_parallel.py --smoke --out smoke.json   # the script itself, CPU gloo

Per shape: every rank holds T tokens (bf16); "one_gpu" is a plain MoELayer with all N experts on
T tokens (each rank runs it on its own GPU at the same time; its experts run `moekit.moe_experts`);
"one_gpu_ep_path" is ExpertParallelMoE with EP=1 (the EP code path: routing, an all-to-all within
one rank, the local experts, the combine; all experts local); "ep_*" hold N/EP experts per rank and
route each rank's T tokens; "ep_capacity1.25_graph" replays the capacity variant's forward+backward
from one CUDA graph (no host work per step). tokens/s is per GPU (T / step time). Variants of one
shape are timed in interleaved rounds (median of rounds), CUDA events around `iters` steps. The
all-to-all share is the summed device time of NCCL kernels over the step time, from torch.profiler
over a few steps (the NCCL kernels include waiting for the peer; with overlap they run beside the
experts; kernels inside a graph replay may not be attributed). Host syncs per step are counted with
torch.cuda's sync debug mode and waits on CUDA events after warm-up (dropless: 1 expected, the
split sizes; capacity: 0).

Legend: T tokens per GPU, K top-k, N experts, H hidden size, F expert ffn size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {
    # name: (T per GPU, N, K, H, F)
    "qwen3-30b-a3b": (8192, 128, 8, 2048, 768),
    "gpt-oss-20b": (8192, 32, 4, 2880, 2880),
    "tiny": (256, 8, 2, 64, 32),  # a smoke test of the script (e.g. --device cpu)
}


def _variants(layer, mesh, solo_mesh, tokens):
    from moekit.distributed import ExpertParallelMoE

    return {
        "one_gpu": layer,
        # The EP code path (routing, all-to-all within one rank, local experts, combine) on one GPU:
        # what EP=world costs beyond it is the transfer and the wait for the other ranks.
        "one_gpu_ep_path": ExpertParallelMoE(layer, solo_mesh),
        "ep_dropless": ExpertParallelMoE(layer, mesh),
        "ep_dropless_overlap2": ExpertParallelMoE(layer, mesh, num_chunks=2),
        # capacity_tokens: C fixed by the per-rank batch, so nothing is read by the host (no
        # all-reduce of the token counts) and the step replays from a CUDA graph.
        "ep_capacity1.25": ExpertParallelMoE(
            layer, mesh, mode="capacity", capacity_factor=1.25, capacity_tokens=tokens
        ),
    }


def _module_step(module, x, d_y):
    """One forward+backward from cleared gradients (set to None, as a training step's zero_grad and as
    the captured graph's step): without it each step would add its gradients to the last one's."""
    leaves = [x, *module.parameters()]

    def step():
        for t in leaves:
            t.grad = None
        module(x).backward(d_y)

    return step


def _graph_step(module, x, d_y):
    """The module's forward+backward captured in one CUDA graph (capacity mode: fixed shapes, no
    host sync); the step is a replay. Warm-up on a side stream first, as torch.cuda.graphs asks."""
    leaves = [x, *module.parameters()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            module(x).backward(d_y)
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module(x).backward(d_y)
    return graph.replay


def _time(step, device, iters):
    if device.type == "cpu":
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - t0) * 1000 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _host_syncs(step) -> int:
    """Host synchronisations in one forward+backward: those torch.cuda's sync debug mode reports (as
    warnings) plus waits on CUDA events (dropless mode's read of the split sizes waits on one; the
    debug mode does not report event waits)."""
    torch.cuda.synchronize()
    event_waits = []
    event_synchronize = torch.cuda.Event.synchronize

    def counted(event):
        event_waits.append(event)
        return event_synchronize(event)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = counted
        try:
            step()
        finally:
            torch.cuda.Event.synchronize = event_synchronize
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught) + len(event_waits)


def _nccl_share(step, iters=3):
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
    step_us = start.elapsed_time(end) * 1000
    nccl_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages() if "nccl" in e.key.lower())
    return nccl_us / step_us


def run(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    import moekit

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    solo_mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("ep", "dp"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = []
    for name in args.shapes:
        tokens, experts, top_k, hidden, ffn = SHAPES[name]
        torch.manual_seed(0)
        layer = moekit.MoELayer(hidden, ffn, experts, top_k, device=device, dtype=dtype)
        modules = _variants(layer, mesh, solo_mesh, tokens)
        g = torch.Generator(device=device).manual_seed(1 + rank)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g).requires_grad_()
        d_y = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
        steps = {v: _module_step(m, x, d_y) for v, m in modules.items()}
        for step in steps.values():  # compile / autotune / NCCL setup outside the timing
            for _ in range(2):
                step()
        if device.type == "cuda":
            # The point of capacity mode: no host sync, so the whole step replays from a graph.
            modules["ep_capacity1.25_graph"] = modules["ep_capacity1.25"]
            steps["ep_capacity1.25_graph"] = _graph_step(modules["ep_capacity1.25"], x, d_y)
        times = {v: [] for v in steps}
        for _ in range(args.rounds):
            for v, step in steps.items():
                times[v].append(_time(step, device, args.iters))
        cuda = device.type == "cuda"
        shares = {v: _nccl_share(step) for v, step in steps.items()} if cuda else {}
        syncs = {v: _host_syncs(step) for v, step in steps.items() if not v.endswith("_graph")} if cuda else {}
        for v in steps:
            ms = statistics.median(times[v])
            dropped = getattr(modules[v], "dropped_copies", None)
            results.append(
                {
                    "shape": name,
                    "tokens_per_gpu": tokens,
                    "experts": experts,
                    "top_k": top_k,
                    "hidden": hidden,
                    "ffn": ffn,
                    "variant": v,
                    "rank": rank,
                    "world": world,
                    "ms": ms,
                    "ms_rounds": times[v],
                    "tokens_per_s_per_gpu": tokens / ms * 1000,
                    "all_to_all_share": shares.get(v),
                    "dropped_copies": None if dropped is None else int(dropped),
                    "host_syncs_per_step": syncs.get(v),
                }
            )
        del steps, modules, layer, x, d_y
        if device.type == "cuda":
            torch.cuda.empty_cache()
    queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def _versions(device: str):
    import triton

    commit = os.environ.get("MOEKIT_BENCH_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = None
    cuda = device == "cuda"
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="shapes to run")
    parser.add_argument("--iters", type=int, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo, a smoke test")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: every GPU; 2 on cpu)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a check of the script itself: 2 CPU ranks (gloo), the tiny shape, 1 round of 2 steps",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.shapes, args.iters, args.rounds = "cpu", ["tiny"], 2, 1
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 2:
        sys.exit("bench_expert_parallel: needs at least 2 ranks (GPUs)")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=run, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [row for _ in procs for row in queue.get(timeout=900)]
    for p in procs:
        p.join()
        if p.exitcode:
            sys.exit(f"bench_expert_parallel: rank exited with {p.exitcode}")
    results.sort(key=lambda r: (r["shape"], r["variant"], r["rank"]))
    out = {"versions": _versions(args.device), "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'shape':16} {'variant':22} {'rank':>4} {'ms':>8} {'tok/s/GPU':>11} {'a2a share':>9} {'syncs':>5}")
    for r in out["results"]:
        share = "" if r["all_to_all_share"] is None else f"{r['all_to_all_share']:.2f}"
        syncs = "" if r["host_syncs_per_step"] is None else str(r["host_syncs_per_step"])
        print(
            f"{r['shape']:16} {r['variant']:22} {r['rank']:>4} {r['ms']:8.2f} {r['tokens_per_s_per_gpu']:11.0f} "
            f"{share:>9} {syncs:>5}" + (f" dropped {r['dropped_copies']}" if r["dropped_copies"] is not None else "")
        )
    for line in _ratios(results):
        print(line)


# (label, variant, baseline): tokens/s of the variant over the baseline's, each the slowest rank's
# (the ranks of one step wait for each other).
RATIOS = (
    ("EP path at EP=1 / one GPU", "one_gpu_ep_path", "one_gpu"),
    ("EP dropless / one GPU", "ep_dropless", "one_gpu"),
    ("2 chunks overlapped / 1 chunk", "ep_dropless_overlap2", "ep_dropless"),
    ("capacity 1.25 / dropless", "ep_capacity1.25", "ep_dropless"),
    ("capacity 1.25 graph / dropless", "ep_capacity1.25_graph", "ep_dropless"),
    ("capacity 1.25 graph / eager", "ep_capacity1.25_graph", "ep_capacity1.25"),
)


def _ratios(results: list[dict]) -> list[str]:
    slowest = {}
    for r in results:
        key = (r["shape"], r["variant"])
        slowest[key] = min(slowest.get(key, float("inf")), r["tokens_per_s_per_gpu"])
    lines = []
    for shape in sorted({r["shape"] for r in results}):
        for label, variant, baseline in RATIOS:
            if (shape, variant) in slowest and (shape, baseline) in slowest:
                lines.append(f"{shape:16} {label:32} {slowest[shape, variant] / slowest[shape, baseline]:.2f}x")
    return lines


if __name__ == "__main__":
    main()
