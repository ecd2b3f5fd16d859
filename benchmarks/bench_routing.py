"""moekit.ops.routing.sort_by_expert: the torch path against the Triton counting sort (use_triton=True).

Legend: T tokens, K experts per token (top-k), M = T*K routed rows, N experts.

Small MoE batches are host-bound: each launch costs host time. For each shape (T, K, N), ids as a
router gives them (top-k of random scores: K distinct experts per token), both paths:
- host_us: the host's enqueue time per call, mean over `--calls` calls enqueued back to back with no
  synchronization (the GPU runs behind);
- gpu_us: GPU time per call, triton.testing.do_bench (median; the L2 flushed between calls);
- kernels, memsets, memcpys: the launches of one call (torch.profiler), with the kernels' names;
- exact: both paths' four outputs are equal on the shape's ids and on the same ids with undefined
  entries (negative ids and ids >= N, several values of each): asserted, the run stops otherwise.

With --sweep, also the Triton path's GPU and host time under other tile sizes (rows per sub-block,
target number of chunks, warps of the scatter kernel) at 2048 and 262144 rows: records with a
"config" entry, for choosing the defaults of `moekit.ops.runtime.configs.ROUTING_TILES`.

With --topk, also the router's top-k + softmax before the sort (`moekit.topk_softmax`) on bf16 logits
at 32768 tokens: GPU time of the forward and of forward+backward, moekit's kernel with the column
packed into the keys and without (`configs.TOPK_PACKED_KEYS`; their ids and weights asserted equal),
and torch's topk then softmax over the K: records with "part": "topk".

    python benchmarks/bench_routing.py --out $OUT/routing.json
    python benchmarks/bench_routing.py --sweep --out $OUT/routing.json
    python benchmarks/bench_routing.py --topk --out $OUT/routing.json
    python benchmarks/bench_routing.py --smoke --sweep --topk --out /tmp/routing.json   # CPU interpreter, tiny

Writes the JSON (machine, versions, commit: runner.machine) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import time
from pathlib import Path

import torch

# (T, K, N): M = 2048, 8192, 32768 and 262144 rows at Qwen3-30B-A3B's 128 experts, top-8; one
# 32-expert top-4 shape.
SHAPES = ((256, 8, 128), (1024, 8, 128), (4096, 8, 128), (32768, 8, 128), (2048, 4, 32))
SMOKE_SHAPES = ((3, 2, 5), (40, 4, 7))
SWEEP_SHAPES = ((256, 8, 128), (32768, 8, 128))
# (T, K, N) of --topk: SonicMoE's 256-expert top-16, Qwen3-30B-A3B's 128 top-8, 512 top-8.
TOPK_SHAPES = ((32768, 16, 256), (32768, 8, 128), (32768, 8, 512))
SMOKE_TOPK_SHAPES = ((9, 3, 20),)
# Tile sizes tried by --sweep (the first is the default): fields of configs.RoutingTiles.
SWEEP_CONFIGS = (
    {"sub": 32, "target_chunks": 2048, "scatter_warps": 4},
    {"sub": 16, "target_chunks": 2048, "scatter_warps": 4},
    {"sub": 64, "target_chunks": 2048, "scatter_warps": 8},
    {"sub": 32, "target_chunks": 512, "scatter_warps": 4},
    {"sub": 32, "target_chunks": 8192, "scatter_warps": 4},
    {"sub": 32, "target_chunks": 2048, "scatter_warps": 2},
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--calls", type=int, default=300, help="calls per host-time measurement")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    p.add_argument("--sweep", action="store_true", help="also time the Triton path under other tile sizes")
    p.add_argument("--topk", action="store_true", help="also time the router's top-k + softmax (bf16 logits)")
    return p.parse_args(argv)


def host_us(fn, calls: int, device: torch.device) -> float:
    """Mean host time of one call, `calls` calls enqueued back to back (the GPU runs behind)."""
    for _ in range(10):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e6
    _sync(device)
    return elapsed


def gpu_us(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def launches(fn, device: torch.device) -> dict:
    """Kernels, memsets and memcpys of one call, from torch.profiler (CUDA only)."""
    if device.type != "cuda":
        return {"kernels": None, "memsets": None, "memcpys": None, "kernel_names": None}
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    kinds: collections.Counter = collections.Counter()
    names = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            continue
        kind = "memcpys" if e.name.startswith("Memcpy") else "memsets" if e.name.startswith("Memset") else "kernels"
        kinds[kind] += 1
        if kind == "kernels":
            names.append(e.name[:80])
    return {**{k: kinds[k] for k in ("kernels", "memsets", "memcpys")}, "kernel_names": names}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def router_ids(tokens: int, top_k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(tokens * 131 + num_experts)
    scores = torch.randn(tokens, num_experts, device=device, generator=gen)
    return scores.topk(top_k, dim=-1).indices


def with_undefined_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """About 1 in 16 ids made negative (-1 or -3) and 1 in 16 made N or N + 2."""
    gen = torch.Generator(device=ids.device).manual_seed(7)
    pick = torch.randint(0, 64, ids.shape, device=ids.device, generator=gen)
    out = torch.where(pick < 2, -1 - 2 * pick, ids)
    return torch.where((pick >= 2) & (pick < 4), num_experts + 2 * (pick - 2), out)


def assert_same(ids: torch.Tensor, num_experts: int, what: str) -> None:
    from moekit.ops.routing import sort_by_expert as route

    expected = route(ids, num_experts)
    ours = route(ids, num_experts, use_triton=True)
    for name, a, b in zip(expected._fields, ours, expected, strict=True):
        if not torch.equal(a, b):
            raise SystemExit(f"{what}: the Triton path's {name} differs from the torch path's")


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda:
        if not args.smoke:
            raise SystemExit("the full shapes need a CUDA device; use --smoke on CPU")
        # Before triton is imported (moekit imports it): kernels then run on the CPU.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import runner

    from moekit.ops.routing import sort_by_expert as route

    device = torch.device("cuda" if cuda else "cpu")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    calls = min(args.calls, 3) if args.smoke else args.calls
    meta = {**runner.machine(device), "calls": calls, "smoke": args.smoke}
    records = []
    for tokens, top_k, num_experts in shapes:
        ids = router_ids(tokens, top_k, num_experts, device)
        assert_same(ids, num_experts, f"T={tokens} K={top_k} N={num_experts}")
        assert_same(
            with_undefined_ids(ids, num_experts), num_experts, f"T={tokens} K={top_k} N={num_experts}, undefined ids"
        )
        for path, use_triton in (("torch", False), ("triton", True)):
            call = functools.partial(route, ids, num_experts, use_triton=use_triton)

            records.append(
                {
                    "tokens": tokens,
                    "top_k": top_k,
                    "num_experts": num_experts,
                    "rows": tokens * top_k,
                    "path": path,
                    "host_us": host_us(call, calls, device),
                    "gpu_us": gpu_us(call, device),
                    **launches(call, device),
                    "exact": True,
                }
            )
            runner.write_json(args.out, {"meta": meta, "records": records, "partial": True})
    if args.sweep:
        records += sweep(
            SMOKE_SHAPES[:1] if args.smoke else SWEEP_SHAPES,
            calls,
            device,
            lambda: runner.write_json(args.out, {"meta": meta, "records": records, "partial": True}),
        )
    if args.topk:
        records += topk(
            SMOKE_TOPK_SHAPES if args.smoke else TOPK_SHAPES,
            device,
            lambda: runner.write_json(args.out, {"meta": meta, "records": records, "partial": True}),
        )
    payload = {"meta": meta, "records": records}
    runner.write_json(args.out, payload)
    print_table([r for r in records if "config" not in r and "part" not in r])
    for r in records:
        if r.get("part") == "topk":
            fwd, both = (f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("gpu_us", "gpu_us_fwd_bwd"))
            print(f"topk T={r['tokens']} N={r['num_experts']} K={r['top_k']} {r['form']:>13}: GPU {fwd} / {both} us")
    for r in records:
        if "config" in r:
            gpu = f"{r['gpu_us']:.1f}" if r["gpu_us"] is not None else "-"
            print(f"sweep M={r['rows']:>7} {r['config']}: GPU {gpu} us, host {r['host_us']:.1f} us")
    return payload


def topk(shapes, device: torch.device, checkpoint) -> list[dict]:
    """moekit.topk_softmax (forward, forward+backward) with packed keys on and off, and torch's topk with a
    softmax over the K, on the same bf16 logits: one record per form and shape."""
    records = []
    for tokens, top_k, num_experts in shapes:
        records += topk_shape(tokens, top_k, num_experts, device)
        checkpoint()
    return records


def topk_shape(tokens: int, top_k: int, num_experts: int, device: torch.device) -> list[dict]:
    """One shape of `topk`. The two kernel forms must give the same ids and weights (asserted)."""
    import runner

    import moekit

    gen = torch.Generator(device=device).manual_seed(tokens + num_experts)
    logits = torch.randn(tokens, num_experts, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    d_weights = torch.randn(tokens, top_k, device=device, generator=gen)

    def torch_router():
        values, ids = logits.topk(top_k, dim=-1)
        return torch.softmax(values.float(), dim=-1), ids

    def moekit_router():
        return moekit.topk_softmax(logits, top_k, backend="triton")

    def step(fwd):
        torch.autograd.backward(fwd()[0], d_weights)

    records, outputs = [], {}
    saved = runner.saved_tables({"packed": {"TOPK_PACKED_KEYS": {}}})
    for form, packed in (("moekit_packed", True), ("moekit", False), ("torch", None)):
        fwd = moekit_router if packed is not None else torch_router
        runner.apply_tables({"TOPK_PACKED_KEYS": dict(ON=bool(packed))}, saved)
        try:
            with torch.no_grad():
                outputs[form] = fwd()
                fwd_us = gpu_us(fwd, device)
            both_us = gpu_us(functools.partial(step, fwd), device)
        finally:
            runner.apply_tables({}, saved)
        shape = {"part": "topk", "tokens": tokens, "top_k": top_k, "num_experts": num_experts}
        records.append({**shape, "dtype": "bfloat16", "form": form, "gpu_us": fwd_us, "gpu_us_fwd_bwd": both_us})
    (w_packed, ids_packed), (w_plain, ids_plain) = outputs["moekit_packed"], outputs["moekit"]
    if not (torch.equal(ids_packed, ids_plain) and torch.equal(w_packed, w_plain)):
        raise SystemExit(f"topk T={tokens} N={num_experts} K={top_k}: the packed keys chose otherwise")
    return records


def sweep(shapes, calls: int, device: torch.device, checkpoint) -> list[dict]:
    """The Triton path under each of SWEEP_CONFIGS (checked exact against the torch path first)."""
    import dataclasses

    from moekit.ops.routing import sort_by_expert
    from moekit.ops.runtime import configs, launch

    arch = launch.arch_of(device)
    default = configs.ROUTING_TILES[arch]
    records = []
    try:
        for changes in SWEEP_CONFIGS:
            configs.ROUTING_TILES[arch] = dataclasses.replace(default, **changes)
            for tokens, top_k, num_experts in shapes:
                ids = router_ids(tokens, top_k, num_experts, device)
                assert_same(ids, num_experts, f"T={tokens} K={top_k} N={num_experts}, config {changes}")
                call = functools.partial(sort_by_expert, ids, num_experts, use_triton=True)
                records.append(
                    {
                        "tokens": tokens,
                        "top_k": top_k,
                        "num_experts": num_experts,
                        "rows": tokens * top_k,
                        "path": "triton",
                        "config": changes,
                        "host_us": host_us(call, calls, device),
                        "gpu_us": gpu_us(call, device),
                        "exact": True,
                    }
                )
                checkpoint()
    finally:
        configs.ROUTING_TILES[arch] = default
    return records


def print_table(records: list[dict]) -> None:
    """One line per shape: host us, GPU us and kernels of the torch path / the Triton path."""

    def pair(torch_rec, triton_rec, key, spec):
        return " / ".join(format(r[key], spec) if r[key] is not None else "-" for r in (torch_rec, triton_rec))

    print(f"{'T':>6} {'K':>2} {'N':>4} {'M':>7} | host us torch / triton | GPU us torch / triton | kernels")
    by_shape = collections.defaultdict(dict)
    for r in records:
        by_shape[(r["tokens"], r["top_k"], r["num_experts"], r["rows"])][r["path"]] = r
    for (tokens, top_k, num_experts, rows), paths in by_shape.items():
        if set(paths) != {"torch", "triton"}:
            continue
        t, tr = paths["torch"], paths["triton"]
        print(
            f"{tokens:>6} {top_k:>2} {num_experts:>4} {rows:>7} | {pair(t, tr, 'host_us', '.1f'):>22} | "
            f"{pair(t, tr, 'gpu_us', '.1f'):>21} | {pair(t, tr, 'kernels', 'd')}"
        )


if __name__ == "__main__":
    main()
