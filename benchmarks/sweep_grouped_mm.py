"""The grouped forward and dgrad the fused MLP runs as plain products (fc2's forward: act (M, F) @ w2[g]^T
-> (M, H); fc1's dgrad: dh (M, 2F) @ w1[g] -> (M, H)), Hopper's warp-specialised Gluon kernel
(`grouped_mm_ws_kernel`) against every candidate of the Triton kernel (`configs.gemm_candidates`), at
the layer benchmark's fine-grained shapes, balanced routing: equal groups, and (the `_ragged`
products) each row's group drawn uniformly, as the layer's routing leaves them. Every result must be the
Triton kernel's bits (`equal`). Times: CUDA events, the median of the repetitions after one warm-up
call; the variants interleaved in `--rounds` rounds (each keeps its median of the rounds), the dense
8192^3 bf16 matmul's TFLOP/s measured in the same run as the roof.

`--variants` times the Gluon kernels again with their configuration tables (`configs.MM_WS`,
`MM_PINGPONG`, `MM_SCHEDULE`) changed (`VARIANTS`), each variant's plans built afresh, every variant's
bits checked against the Triton kernel's; `--triton first` times only the Triton candidate that gives
the reference bits.

    python benchmarks/sweep_grouped_mm.py --out results.json [--shapes sonicmoe-e256-k16]
        [--variants base,red32] [--triton first]
    python benchmarks/sweep_grouped_mm.py --pick results.json --among pingpong,staged_rows
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from runner import TABLE_CHANGES, apply_tables, event_median_ms, machine, saved_tables, select_by_name, write_json

from moekit.ops.runtime import gemm
from moekit.ops.runtime.configs import gemm_candidates
from moekit.ops.runtime.launch import arch_of

# name: (tokens T, top-k K, experts N, hidden H, ffn F): the layer benchmark's shapes.
SHAPES = {
    "sonicmoe-e256-k16": (32768, 16, 256, 4096, 256),
    "sonicmoe-7b": (24576, 8, 128, 1536, 256),
    "sonicmoe": (32768, 8, 128, 4096, 512),
    "sonicmoe-e64-k4": (32768, 4, 64, 4096, 1024),
    "qwen3-30b-a3b": (32768, 8, 128, 2048, 768),
    "gpt-oss-20b": (16384, 4, 32, 2880, 2880),
    "deepseek-v3-ep8": (16384, 8, 32, 7168, 2048),
    "mixtral-8x7b": (16384, 2, 8, 4096, 14336),
}
# Changes to the Gluon kernel's tables, by table name: the same products in the same order, another
# ring or schedule. (A 64-row ping-pong (the math warp groups on 64-row tiles of their own, in turn)
# and "staged" (two staging tiles a group, 3 slots) lived in the kernel at `9d6902c` and lost at every
# shape: benchmarks/results/h100_mm_ws_variants_9d6902c.json, notes/grouped_gemm.md.)
VARIANTS: dict[str, dict[str, dict[str, object]]] = {
    "base": {},
    # One slot fewer (what "staged" gave up for its second staging tile).
    "stages3": {"MM_WS": dict(STAGES=3)},
    # 32-deep steps and twice the slots: the same bytes in flight, in finer pieces.
    "red32": {"MM_WS": dict(BLOCK_RED=32, STAGES=8)},
    # The named changes (runner.TABLE_CHANGES) to the forward/dgrad's tables, which the layer A/Bs
    # time too: the ping-pong everywhere; the tiles a group's rows end inside (the _ragged products' ~1
    # in 17 at 256 experts) through the staging tile as 16-byte row pieces (the default) or not; the
    # load warp's registers of MM_WS_512_GROUPS at every group count; a load partition of a warp group.
    **{name: TABLE_CHANGES[name] for name in ("pingpong", "staged_rows", "unstaged", "regs208", "load4")},
    # The ping-pong schedule (`configs.MM_PINGPONG`: each math warp group a whole 128 x 192 tile in turn)
    # at every reduction with its load partition a warp group (spills at 256 / 512 groups 60 / 56 bytes
    # instead of 140 / 316), with slots of 32 reduction columns (half the bytes a slot: a group's MMAs
    # hold fewer of the ring's bytes), and at 128 x (64 + 64) tiles with six slots (the same shared
    # memory).
    "pingpong_load4": {**TABLE_CHANGES["pingpong"], "MM_PINGPONG": dict(LOAD_WARPS=4)},
    "pingpong_red32": {**TABLE_CHANGES["pingpong"], "MM_PINGPONG": dict(BLOCK_RED=32, STAGES=8)},
    "pingpong128": {**TABLE_CHANGES["pingpong"], "MM_PINGPONG": dict(BLOCK_C0=64, STAGES=6)},
}
SMOKE_SHAPES = {"smoke": (40, 2, 3, 64, 32)}


def dense_roof(reps: int) -> float | None:
    """TFLOP/s of a dense 8192^3 bf16 matmul (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = event_median_ms(lambda: a @ a, reps)
    return 2 * 8192**3 / ms / 1e9


def sweep_shape(
    name: str, reps: int, rounds: int, device: str, variants: list[str], triton_all: bool
) -> dict[str, dict[str, object]]:
    T, K, N, H, F = (SHAPES | SMOKE_SHAPES)[name]
    M = T * K
    # The interpreter's bfloat16 dot is wrong: float32 there (--smoke, which runs the Triton kernel only).
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    offs = torch.linspace(0, M, N + 1, device=device).round().to(torch.int64)
    # The layer's balanced routing: each row's expert drawn uniformly, so groups end inside tiles.
    counts = torch.bincount(torch.randint(0, N, (M,), generator=torch.Generator().manual_seed(0)), minlength=N)
    ragged = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(device)
    act = torch.randn(M, F, device=device, dtype=dtype, generator=gen)
    dh = torch.randn(M, 2 * F, device=device, dtype=dtype, generator=gen)
    w1 = torch.randn(N, 2 * F, H, device=device, dtype=dtype, generator=gen) / H**0.5
    w2 = torch.randn(N, H, F, device=device, dtype=dtype, generator=gen) / F**0.5
    products = {}
    for suffix, o in (("", offs), ("_ragged", ragged)):
        products[f"fc2_fwd{suffix}"] = (
            lambda cfg=None, o=o: gemm.grouped_gemm_forward(act, w2, o, cfg=cfg),
            2 * M * F * H,
        )
        products[f"fc1_dgrad{suffix}"] = (
            lambda cfg=None, o=o: gemm.grouped_gemm_dgrad(dh, w1, o, cfg=cfg),
            2 * M * 2 * F * H,
        )
    saved = saved_tables(VARIANTS)
    cells = {}
    for kind, (run, flops) in products.items():
        op = "fwd" if kind.startswith("fc2_fwd") else "dgrad"
        candidates = gemm_candidates(op, dtype, True, arch_of(act.device), H)
        if not triton_all:
            candidates = candidates[:1]
        # label -> (table changes applied before its timings, the call)
        cases: dict[str, tuple[dict, Callable[[], torch.Tensor]]] = {
            f"triton{i}": ({}, functools.partial(run, c)) for i, c in enumerate(candidates)
        }
        if device == "cuda":  # no cfg: the Gluon kernel where `gemm.hopper_mm_takes`
            cases.update({"ws" if v == "base" else f"ws_{v}": (VARIANTS[v], run) for v in variants})
        apply_tables({}, saved)
        reference = run(candidates[0])
        record: dict[str, object] = {"flops": flops}
        times: dict[str, list[float]] = {label: [] for label in cases}
        for round_ in range(rounds):
            for label, (changes, fn) in cases.items():
                apply_tables(changes, saved)
                times[label].append(event_median_ms(fn, reps))
                if round_ == 0:
                    record[f"{label}_equal"] = bool(torch.equal(fn(), reference))
        apply_tables({}, saved)
        for label in cases:
            ms = statistics.median(times[label])
            record[f"{label}_ms"] = ms
            record[f"{label}_ms_rounds"] = times[label]
            record[f"{label}_tflops"] = flops / ms / 1e9 if ms else None
        cells[f"{name}/{kind}"] = record
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in record.items() if not k.endswith("_rounds")}
        print(name, kind, shown, flush=True)
    return cells


def pick(results: dict, among: list[str], margin: float = 1.02) -> str:
    """The variant of `among` that a sweep's results (`main`'s JSON) found fastest on the _ragged products
    (the layer's routing): the base kernel's time over the variant's, the geometric mean over the shapes,
    at least `margin`, its bits the reference's in every product; "" where none is."""
    best, best_gain = "", margin
    for variant in among:
        ratios = []
        for key, record in results["cells"].items():
            if not record.get(f"ws_{variant}_equal", False):
                ratios = []
                break
            if key.endswith("_ragged"):
                ratios.append(record["ws_ms"] / record[f"ws_{variant}_ms"])
        gain = statistics.geometric_mean(ratios) if ratios else 0.0
        if gain >= best_gain:
            best, best_gain = variant, gain
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--pick", type=Path, help="print the variant (of --among) a sweep's JSON found fastest by `pick`, and stop"
    )
    parser.add_argument("--among", default="pingpong,regs208,load4")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (interpreter): the plumbing")
    parser.add_argument("--variants", default="base", help="comma list of " + ", ".join(VARIANTS))
    parser.add_argument(
        "--triton", choices=("all", "first"), default="all", help="time every Triton candidate or the first"
    )
    args = parser.parse_args()
    if args.pick is not None:
        among = select_by_name(list(VARIANTS), args.among, "among", VARIANTS)
        print(pick(json.loads(args.pick.read_text()), among))
        return
    if args.out is None:
        raise SystemExit("--out: the results' path is needed (or --pick)")
    variants = select_by_name(list(VARIANTS), args.variants, "variants", VARIANTS)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("sweep_grouped_mm.py needs a CUDA device (or --smoke)")
    pool = SMOKE_SHAPES if args.smoke else SHAPES
    cells: dict[str, dict[str, object]] = {}
    roof = dense_roof(args.reps)
    for name in list(pool) if args.smoke else args.shapes.split(","):
        if name not in pool:
            raise SystemExit(f"--shapes: unknown shape {name!r}; expected some of {sorted(pool)}")
        device = "cpu" if args.smoke else "cuda"
        cells.update(sweep_shape(name, args.reps, args.rounds, device, variants, args.triton == "all"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_json(args.out, {"meta": machine(), "dense_bf16_tflops": roof, "cells": cells})


if __name__ == "__main__":
    main()
