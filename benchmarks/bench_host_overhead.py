"""Where the time of a small MoE layer goes: host work or GPU work (the small-batch bar).

Legend: T tokens, N experts, K experts per token, H hidden size, F ffn size.

At Qwen3-30B-A3B's width (N 128, K 8, H 2048, F 768) with 256, 1024 and 4096 tokens, for
moekit.moe_experts, plain_layer (bench_moe_layer's) and Liger-Kernel's fused MoE when
importable, forward and forward+backward, after warm-up:
- host_ms: wall time of the Python calls per step, `steps` steps enqueued back to back with no
  synchronization (the host's enqueue cost; a step that syncs with the host waits for the GPU here);
- gpu_wall_ms: CUDA events around the same steps, per step (what a training loop sees: the larger
  of host and GPU work when they overlap);
- kernel_ms: the sum of the step's kernel durations (torch.profiler, ProfilerActivity.CUDA): the
  GPU's busy time;
- launches per step: kernels, memcpys and memsets (profiler events), with each kernel's name;
- the host time of a profiled run split into the time inside profiled events (ops, CUDA API calls,
  autograd nodes and custom ops, whose Python runs inside them) and between them (Python glue:
  moekit's wrappers, Triton's launchers), with the events of most self time.
`bound` says which side is longer: "host" when host_ms > kernel_ms (the GPU waits for launches:
cut launches and Python work), else "gpu" (make the kernels faster).

    python benchmarks/bench_host_overhead.py --out $OUT
    python benchmarks/bench_host_overhead.py --smoke --backend torch --out /tmp/b   # tiny, CPU

Writes OUT/host_overhead.json (machine, versions, commit: runner.machine).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from pathlib import Path

import bench_moe_layer as layer
import runner
import torch

NAME = "host_overhead"
SHAPES = tuple(s for s in layer.SHAPES if s.name in ("qwen3-256tok", "qwen3-1024tok", "qwen3-4096tok"))
OPS = ("forward", "forward+backward")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def enqueue_times(step, leaves, steps: int, device: torch.device) -> tuple[float, float | None]:
    """(host ms, GPU wall ms) per step over `steps` steps enqueued without synchronizing."""
    _sync(device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
    if events:
        events[0].record()
    start = time.perf_counter()
    for _ in range(steps):
        for t in leaves:
            t.grad = None
        step()
    host = (time.perf_counter() - start) * 1e3 / steps
    if events:
        events[1].record()
    _sync(device)
    return host, events[0].elapsed_time(events[1]) / steps if events else None


def census(step, leaves, steps: int, device: torch.device) -> dict:
    """One profiled run of `steps` steps (torch.profiler), per step: kernel, memcpy and memset
    launches and the kernels' busy time (CUDA only); the host side: in_events_ms, the self CPU time
    of every profiled CPU event (aten ops, CUDA API calls, autograd Function nodes and custom ops,
    with the Python that runs inside them; the backward's thread included), between_events_ms, the
    rest of the wall time (Python glue outside any event: moekit's wrappers, Triton's launchers),
    and the events of most self time. Profiling slows the host, so these are larger than host_ms;
    their split is what they are for."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            for t in leaves:
                t.grad = None
            step()
        host_us = (time.perf_counter() - start) * 1e6
        _sync(device)
    kinds: collections.Counter = collections.Counter()
    names: collections.Counter = collections.Counter()
    busy_us = in_events_us = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            in_events_us += e.self_cpu_time_total
            continue
        kind = "memcpys" if e.name.startswith("Memcpy") else "memsets" if e.name.startswith("Memset") else "kernels"
        kinds[kind] += 1
        if kind == "kernels":
            names[e.name[:100]] += 1
            busy_us += e.time_range.elapsed_us()
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
    per_step = {
        "profiled_host_ms": host_us / 1e3 / steps,
        "in_events_ms": in_events_us / 1e3 / steps,
        "between_events_ms": (host_us - in_events_us) / 1e3 / steps,
        "top_host_events": [
            {"name": a.key[:100], "calls": a.count / steps, "self_ms": a.self_cpu_time_total / 1e3 / steps} for a in top
        ],
    }
    if not cuda:
        return {
            **per_step,
            "launches": None,
            "kernels": None,
            "memcpys": None,
            "memsets": None,
            "kernel_ms": None,
            "kernel_names": None,
        }
    return {
        **per_step,
        "launches": sum(kinds.values()) / steps,
        **{k: kinds[k] / steps for k in ("kernels", "memcpys", "memsets")},
        "kernel_ms": busy_us / 1e3 / steps,
        "kernel_names": {n: c / steps for n, c in names.most_common()},
    }


def measure(args, shape, impl: str, fn, device, dtype) -> list[dict]:
    base = layer.make_inputs(shape, device, dtype)
    ids, weights = layer.make_routing(shape, args.dist, device, dtype)
    if impl == "liger":
        ids = ids.to(torch.int32)
    leaves = [
        base["x"].requires_grad_(),
        weights.requires_grad_(),
        base["w1"].requires_grad_(),
        base["w2"].requires_grad_(),
    ]
    dy = torch.randn_like(base["x"])

    def forward():
        return fn(leaves[0], leaves[2], leaves[3], ids, leaves[1])

    def forward_backward():
        forward().backward(dy)

    records = []
    for op, step in (("forward", forward), ("forward+backward", forward_backward)):
        r = {
            "bench": NAME,
            "shape": shape.name,
            "tokens": shape.tokens,
            "dist": args.dist,
            "op": op,
            "impl": impl,
            "status": "ok",
            "reason": None,
        }
        try:
            for _ in range(args.warmup):  # the first calls compile and tune
                step()
            _sync(device)
            r["host_sync"] = runner.check_host_sync(step, device)
            rounds = [enqueue_times(step, leaves, args.steps, device) for _ in range(args.rounds)]
            r["host_ms"] = statistics.median(h for h, _ in rounds)
            r["gpu_wall_ms"] = statistics.median(g for _, g in rounds) if device.type == "cuda" else None
            r["host_ms_rounds"], r["gpu_wall_ms_rounds"] = [h for h, _ in rounds], [g for _, g in rounds]
            try:
                r.update(census(step, leaves, args.profile_steps, device))
            except Exception as exc:  # the profiler (CUPTI) failing keeps the timings above
                r["census_error"] = runner.error_reason(exc)
            if r.get("kernel_ms") is not None:
                r["bound"] = "host" if r["host_ms"] > r["kernel_ms"] else "gpu"
                r["host_us_per_launch"] = r["host_ms"] * 1e3 / r["launches"] if r["launches"] else None
        except Exception as exc:  # keep the other variants' measurements
            r["status"], r["reason"] = "error", runner.error_reason(exc)
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        print_record(r)
        records.append(r)
    return records


def print_record(r: dict) -> None:
    def f(key, spec):
        v = r.get(key)
        return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0])

    note = f"  [{r['status']}: {r['reason'][:160]}]" if r["reason"] else ""
    print(
        f"  {r['shape']:<14} {r['op']:<16} {r['impl']:<7} host {f('host_ms', '7.3f')} ms  gpu wall "
        f"{f('gpu_wall_ms', '7.3f')} ms  kernels {f('kernel_ms', '7.3f')} ms  launches {f('launches', '5.1f')}  "
        f"profiled host: in events {f('in_events_ms', '6.3f')} ms between {f('between_events_ms', '6.3f')} ms  "
        f"sync {r.get('host_sync')}  bound {r.get('bound', '-')}{note}",
        flush=True,
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    p.add_argument("--dist", default="balanced", choices=runner.DISTS)
    p.add_argument("--backend", default="auto", help="moekit's GEMM backend (auto, triton, torch)")
    p.add_argument("--out", type=Path, default=Path("."), help="directory for host_overhead.json")
    p.add_argument("--steps", type=int, default=20, help="steps per enqueue timing (few: the launch queue is finite)")
    p.add_argument("--rounds", type=int, default=3, help="enqueue timings per variant (median kept)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, few steps: proves the script runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds, args.warmup = 2, 1, 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("the full shapes need a CUDA device; use --smoke on CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pool = layer.SMOKE_SHAPES if args.smoke else SHAPES
    shapes = runner.select_by_name(pool, args.shapes, "shapes", [s.name for s in pool])
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # as bench_moe_layer: Liger's pinned config
    impls = {"moekit": layer.moekit_layer(args.backend), "plain": layer.plain_layer}
    liger, liger_reason = layer.liger_layer()
    if liger is not None and device.type == "cuda":
        impls["liger"] = liger
    meta = {
        **runner.machine(device),
        "dtype": str(dtype).removeprefix("torch."),
        "moekit_backend": args.backend,
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "profile_steps": args.profile_steps,
        "liger": "timed" if "liger" in impls else liger_reason or "CUDA only",
    }
    records = []
    path = args.out / f"{NAME}.json"
    for shape in shapes:
        for impl, fn in impls.items():
            records += measure(args, shape, impl, fn, device, dtype)
            runner.write_json(path, {"meta": meta, "records": records, "partial": True})
            runner.release_memory(device)
    payload = {"meta": meta, "records": records}
    runner.write_json(path, payload)
    return payload


if __name__ == "__main__":
    main()
