"""The kernels that read their rows through a row map (cp.async copies of routed rows) against the same
kernels' TMA forms on the gathered rows, with a third form that separates the two causes of a gap: the
row map set to the identity over the already-gathered rows, so the copies read exactly the TMA form's
addresses. tokens vs identity is the row pattern (routed tokens spread over x), identity vs TMA is the
copy mechanism (cp.async from a load warp group, counted arrivals, the proxy fence).

Kinds: fc1's forward with the gated activation (`glu_forward` / `glu_forward_gathered`), fc1's weight
gradient over x's rows (`grouped_gemm_wgrad`'s x_rows), fc2's backward over d out's rows
(`glu_backward_partials` / `glu_backward_gathered_partials`) and fc2's weight gradient over d out's rows
(dy_rows). The routing is a layer's: router logits, top-k, rows sorted by expert (stable), so an
expert's rows are increasing tokens. Every gathered result must equal the TMA form's bits (`equal`).
fc2's forward and fc1's dgrad (`grouped_gemm_forward` / `grouped_gemm_dgrad`, rows in expert order)
have the TMA form only. `--variants` repeats every cell with the Hopper kernels' configuration tables
changed (`VARIANTS`: e.g. "red32", half the reduction step and twice the slots, the same shared memory),
each variant's plans built afresh, the variants timed in turn over `--rounds` rounds. Times: CUDA
events, the median of the repetitions after one warm-up call, then the median of the rounds.

    python benchmarks/sweep_gathered_loads.py --out results.json [--shapes sonicmoe-e256-k16] [--reps 10]
        [--variants base,red32] [--only fc1_fwd:tma]   (one cell, e.g. under a profiler)
    TRITON_INTERPRET=1 python benchmarks/sweep_gathered_loads.py --smoke   # CPU: the plumbing
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from runner import apply_tables, event_median_ms, machine, saved_tables, select_by_name, write_json

from moekit.ops.runtime import gemm, glu

# name: (tokens T, top-k K, experts N, hidden H, ffn F)
SHAPES = {
    "sonicmoe-e256-k16": (32768, 16, 256, 4096, 256),
    "qwen3-30b-a3b": (32768, 8, 128, 2048, 768),
    "sonicmoe-e64-k4": (32768, 4, 64, 4096, 1024),
}
SMOKE_SHAPES = {"smoke": (40, 2, 3, 64, 32)}
ACTIVATION = "swiglu"
FORMS = ("tma", "tokens", "identity")


def _steps32(glu_stages: int, ring_stages: int) -> dict[str, dict[str, int]]:
    """32-column (32-row for the wgrad) reduction steps in every Hopper table: the fused MLP's kernels
    with glu_stages slots, the gathered wgrad and the forward/dgrad with ring_stages."""
    glu = dict(BLOCK_RED=32, STAGES=glu_stages)
    tables = ("WS_FORWARD", "WS_FORWARD_GATHER", "WS_BACKWARD", "WS_BACKWARD_GATHER")
    return {t: glu for t in tables} | {
        "WGRAD_GATHERED_WS": dict(BLOCK_M=32, STAGES=ring_stages),
        "MM_WS": dict(BLOCK_RED=32, STAGES=ring_stages),
    }


# Changes to the Hopper kernels' configuration tables (`configs`), by table name. "red32": 32-column
# reduction steps with twice the slots (the same shared memory a slot ring), so that the ring holds
# twice as many steps ahead of the two the main loop keeps (the one read and the one in flight);
# "red32_fewer": the same steps with fewer slots than the shared memory holds (how the time follows
# the ring's depth).
VARIANTS: dict[str, dict[str, dict[str, int]]] = {
    "base": {},
    "red32": _steps32(6, 8),
    # The gathered wgrad's copy partition as two warp groups (16 warps, 128 registers a thread at
    # launch); the table's own since `416c2cb`, so now the same as "base" (kept: results name it).
    "load8": {"WGRAD_GATHERED_WS": dict(LOAD_WARPS=8, maxnreg=128)},
    "red32_fewer": _steps32(5, 6),
}


def routed(T: int, K: int, N: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_of_row (M,) int64, offs (N + 1,) int64) of a top-K routing of random logits, the rows
    sorted by expert (stable: an expert's rows are increasing tokens)."""
    logits = torch.randn(T, N, device=device, generator=gen)
    flat = logits.topk(K, dim=1).indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=N)
    offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return order // K, offs


def cells_of(
    name: str,
    only: str | None,
    reps: int,
    rounds: int,
    variants: list[str],
    kinds_wanted: list[str] | None,
    device: str = "cuda",
) -> dict[str, dict[str, object]]:
    T, K, N, H, F = (SHAPES | SMOKE_SHAPES)[name]
    M = T * K
    # The interpreter's bfloat16 dot is wrong: float32 there (--smoke).
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    tokens, offs = routed(T, K, N, device, gen)
    identity = torch.arange(M, device=device)
    x_T = torch.randn(T, H, device=device, dtype=dtype, generator=gen)
    x_M = x_T[tokens]
    w1 = torch.randn(N, 2 * F, H, device=device, dtype=dtype, generator=gen) / H**0.5
    w2 = torch.randn(N, H, F, device=device, dtype=dtype, generator=gen) / F**0.5
    probs = torch.rand(M, device=device, generator=gen, dtype=torch.float32).to(dtype)
    h = torch.randn(M, 2 * F, device=device, dtype=dtype, generator=gen)
    dh = torch.randn(M, 2 * F, device=device, dtype=dtype, generator=gen)
    act = torch.randn(M, F, device=device, dtype=dtype, generator=gen)
    # x_T / x_M stand for d out's token rows / its gathered rows in fc2's kinds (the same shape).
    kinds: dict[str, dict[str, Callable[[], object]]] = {
        "fc2_fwd": {"tma": lambda: gemm.grouped_gemm_forward(act, w2, offs)},
        "fc1_dgrad": {"tma": lambda: gemm.grouped_gemm_dgrad(dh, w1, offs)},
        "fc1_fwd": {
            "tma": lambda: glu.glu_forward(x_M, w1, offs, None, probs, None, ACTIVATION),
            "tokens": lambda: glu.glu_forward_gathered(x_T, tokens, w1, offs, None, probs, None, ACTIVATION),
            "identity": lambda: glu.glu_forward_gathered(x_M, identity, w1, offs, None, probs, None, ACTIVATION),
        },
        "fc1_wgrad": {
            "tma": lambda: gemm.grouped_gemm_wgrad(dh, x_M, offs),
            "tokens": lambda: gemm.grouped_gemm_wgrad(dh, x_T, offs, x_rows=tokens),
            "identity": lambda: gemm.grouped_gemm_wgrad(dh, x_M, offs, x_rows=identity),
        },
        "fc2_bwd": {
            "tma": lambda: glu.glu_backward_partials(x_M, w2, h, offs, probs, None, ACTIVATION),
            "tokens": lambda: glu.glu_backward_gathered_partials(x_T, tokens, w2, h, offs, probs, None, ACTIVATION),
            "identity": lambda: glu.glu_backward_gathered_partials(x_M, identity, w2, h, offs, probs, None, ACTIVATION),
        },
        "fc2_wgrad": {
            "tma": lambda: gemm.grouped_gemm_wgrad(x_M, act, offs),
            "tokens": lambda: gemm.grouped_gemm_wgrad(x_T, act, offs, dy_rows=tokens),
            "identity": lambda: gemm.grouped_gemm_wgrad(x_M, act, offs, dy_rows=identity),
        },
    }
    flops = {"fc1_fwd": 2 * M * H * 2 * F, "fc1_wgrad": 2 * M * H * 2 * F, "fc2_bwd": 2 * M * H * F}
    flops.update(fc2_wgrad=2 * M * H * F, fc2_fwd=2 * M * H * F, fc1_dgrad=2 * M * H * 2 * F)
    saved = saved_tables(VARIANTS)
    cells: dict[str, dict[str, object]] = {}
    for kind, forms in kinds.items():
        if only is not None and not only.startswith(kind + ":") or kinds_wanted and kind not in kinds_wanted:
            continue
        record: dict[str, object] = {"flops": flops[kind]}
        apply_tables(VARIANTS["base"], saved)
        # Every variant's bits against the base tables' TMA form.
        reference = None if only is not None else forms["tma"]()
        times: dict[str, list[float]] = {}
        # Rounds over the variants in turn, so that a drift of the clocks during the run lands on all of
        # them alike (in one pass, base first, an untouched kernel moved by up to 12 % between variants).
        for round_ in range(rounds):
            for variant in variants:
                apply_tables(VARIANTS[variant], saved)
                label = "" if variant == "base" else variant + "_"
                for form, fn in forms.items():
                    if only is not None and only != f"{kind}:{form}" or f"{label}{form}_error" in record:
                        continue
                    try:
                        times.setdefault(f"{label}{form}", []).append(event_median_ms(fn, reps))
                    except Exception as exc:  # a variant the kernel refuses: recorded, the sweep goes on
                        record[f"{label}{form}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        continue
                    if round_ == 0 and reference is not None and (form != "tma" or variant != "base"):
                        got, ref = fn(), reference
                        pairs = zip(got, ref, strict=True) if isinstance(ref, tuple) else [(got, ref)]
                        equal = all(a is None and b is None or torch.equal(a, b) for a, b in pairs)
                        record[f"{label}{form}_equal"] = equal
        for key, per_round in times.items():
            ms = statistics.median(per_round)
            record[f"{key}_ms"] = ms
            record[f"{key}_ms_rounds"] = per_round
            record[f"{key}_tflops"] = flops[kind] / ms / 1e9 if ms else None
        apply_tables(VARIANTS["base"], saved)
        del reference
        cells[f"{name}/{kind}"] = record
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in record.items() if not k.endswith("_rounds")}
        print(name, kind, shown, flush=True)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--reps", type=int, default=10, help="timed calls a form and round (their median)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the variants (the median of rounds)")
    parser.add_argument("--kinds", default="", help="comma list of the kinds to time (all by default)")
    parser.add_argument("--variants", default="base", help="comma list of " + ", ".join(VARIANTS))
    parser.add_argument("--only", default=None, help="one cell, KIND:FORM (forms: " + ", ".join(FORMS) + ")")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (interpreter): the plumbing")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("sweep_gathered_loads.py needs a CUDA device (or --smoke)")
    variants = select_by_name(list(VARIANTS), args.variants, "variants", VARIANTS)
    pool = SMOKE_SHAPES if args.smoke else SHAPES
    device = "cpu" if args.smoke else "cuda"
    cells: dict[str, dict[str, object]] = {}
    for name in select_by_name(list(pool), None if args.smoke else args.shapes, "shapes", pool):
        kinds = [k for k in args.kinds.split(",") if k]
        cells.update(cells_of(name, args.only, args.reps, args.rounds, variants, kinds, device))
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.out is not None:
        meta = machine(torch.device(device))
        write_json(args.out, {"meta": meta, "variants": {v: VARIANTS[v] for v in variants}, "cells": cells})


if __name__ == "__main__":
    main()
