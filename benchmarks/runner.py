"""Shared machinery of moekit's benchmarks: shapes, splits, timing, memory, correctness checks,
machine and versions, JSON.

Legend: M routed rows, N experts, H hidden size, F expert ffn size.

The benchmark scripts (see benchmarks/README.md) use: `machine()` (GPU, versions, commit: every
JSON's meta), `measure_roof` (the dense matmul roof timed in the same process), `measure_fp8_roof`
(the same with torch._scaled_mm on float8 e4m3), `measure_copy_bandwidth` (HBM: a device-to-device
copy), `time_ms`, `time_steps` (a fixed number of calls, CUDA events around each), `time_rounds`
(interleaved rounds), `memory_of` (peak and held memory), `rel_errors` / `check_summary` (errors
against a float32 reference), `write_json`, `pyplot` / `save_figure` (the plots).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import moekit

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results"


# --------------------------------------------------------------------------------------------------
# Shapes and splits
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEShape:
    """One expert layer: `rows` routed rows (tokens x top-k) over `experts` experts."""

    name: str
    rows: int
    experts: int
    hidden: int
    ffn: int


# The shapes of the README's performance tables.
SHAPES = (
    MoEShape("mixtral-8x7b", rows=32768, experts=8, hidden=4096, ffn=14336),
    MoEShape("deepseek-v3-32e", rows=16384, experts=32, hidden=7168, ffn=2048),
    MoEShape("qwen3-30b-a3b", rows=131072, experts=128, hidden=2048, ffn=768),
    MoEShape("gpt-oss-20b", rows=65536, experts=32, hidden=2880, ffn=2880),
)

# Tiny stand-ins for --smoke (CPU checks that the scripts work end to end); dims are multiples of 8
# so that torch's grouped_mm accepts them in every dtype.
SMOKE_SHAPES = (
    MoEShape("smoke-4e", rows=96, experts=4, hidden=32, ffn=48),
    MoEShape("smoke-7e", rows=200, experts=7, hidden=64, ffn=40),
)

DISTS = ("balanced", "skewed")
SKEW_SEED = 0


def balanced_splits(rows: int, experts: int) -> list[int]:
    """Equal counts; the remainder goes one row each to the first experts."""
    base, extra = divmod(rows, experts)
    return [base + (1 if e < extra else 0) for e in range(experts)]


def skewed_splits(rows: int, experts: int, seed: int = SKEW_SEED) -> list[int]:
    """Counts from expert shares drawn from Dirichlet(alpha=1) (uniform over the simplex), rounded to
    integers that sum to `rows` by the largest-remainder rule. Zero counts are allowed."""
    shares = np.random.default_rng(seed).dirichlet(np.ones(experts))
    exact = shares * rows
    counts = np.floor(exact).astype(np.int64)
    short = rows - int(counts.sum())
    # The experts with the largest dropped fractions get the missing rows (stable order for ties).
    for e in np.argsort(-(exact - counts), kind="stable")[:short]:
        counts[e] += 1
    return [int(c) for c in counts]


def make_splits(shape: MoEShape, dist: str) -> list[int]:
    if dist == "balanced":
        return balanced_splits(shape.rows, shape.experts)
    if dist == "skewed":
        return skewed_splits(shape.rows, shape.experts)
    raise ValueError(f"unknown split distribution {dist!r}; expected one of {DISTS}")


def mlp_inputs(shape: MoEShape, device: torch.device, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    """The grouped MLP's leaves {x (M, H), w1 (N, 2F, H), w2 (N, H, F), probs (M,) fp32}, requiring
    grad, and the output gradient dy (M, H), drawn in that order from one generator seeded 0."""
    M, N, H, F = shape.rows, shape.experts, shape.hidden, shape.ffn
    gen = torch.Generator(device=device).manual_seed(0)
    leaves = {
        "x": torch.randn(M, H, device=device, dtype=dtype, generator=gen),
        "w1": (torch.randn(N, 2 * F, H, device=device, generator=gen) * H**-0.5).to(dtype),
        "w2": (torch.randn(N, H, F, device=device, generator=gen) * F**-0.5).to(dtype),
        "probs": torch.rand(M, device=device, generator=gen),
    }
    for t in leaves.values():
        t.requires_grad_()
    return leaves, torch.randn(M, H, device=device, dtype=dtype, generator=gen)


def splits_table(cfg: BenchConfig) -> dict[str, dict[str, list[int]]]:
    """The exact counts of every (shape, dist) measured, for the JSON (to reproduce a cell)."""
    return {s.name: {d: make_splits(s, d) for d in cfg.dists} for s in cfg.shapes}


def select_by_name(items: Sequence, names: str | None, what: str, all_names: Iterable[str]) -> list:
    """Filter `items` (things with .name, or strings) by a comma list; error on unknown names."""
    if not names:
        return list(items)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = list(all_names)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; known: {known}")
    return [it for it in items if (it if isinstance(it, str) else it.name) in wanted]


# --------------------------------------------------------------------------------------------------
# Configuration shared by the scripts
# --------------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    device: torch.device
    dtype: torch.dtype
    warmup_ms: float
    rep_ms: float
    smoke: bool
    quick: bool
    # Timing rounds per cell: the implementations compared in one cell are timed in interleaved
    # rounds and each keeps its median (time_rounds).
    rounds: int
    shapes: list[MoEShape]
    dists: list[str]
    backends: list[str]
    out: Path
    plot: bool


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], object], cfg: BenchConfig, grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
    """Median milliseconds of one call of `fn`.

    CUDA: triton.testing.do_bench (CUDA events around each call, L2 flushed between calls, no CUDA
    graph), so what is timed is the eager launch sequence a training step runs; a call that syncs
    with the host pays for it here too. CPU (--smoke only): a few wall-clock calls.
    """
    if cfg.device.type == "cuda":
        import triton.testing

        return float(
            triton.testing.do_bench(
                fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, grad_to_none=grad_to_none, return_mode="median"
            )
        )
    times = []
    for _ in range(3):
        for t in grad_to_none or ():
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def event_median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `reps` calls of `fn` after one warm-up call, each between two CUDA events
    (no L2 flush: the kernel sweeps' repeated calls of one product); 0.0 without CUDA (--smoke: the
    plumbing only)."""
    fn()
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def saved_tables(variants: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """A copy of every configuration table (`moekit.ops.runtime.configs`) that `variants` (variant name
    -> table name -> entries) changes, for `apply_tables` to put back."""
    from moekit.ops.runtime import configs  # here, not at the top: importing it imports triton

    return {table: dict(getattr(configs, table)) for changes in variants.values() for table in changes}


# Named changes to the configuration tables (table name -> entries) that more than one script times:
# the sweeps' variants of these names and the layer A/Bs' builds (`write_tables`, gpu_prelude.sh's
# `changed_src`). Each is a change from the tables as they are (one, `staged_rows`, now their default
# for the shared tile, beside its reverse); what a GPU timing kept is written into configs.py itself.
TABLE_CHANGES: dict[str, dict[str, dict]] = {
    # The forward/dgrad's ping-pong schedule at every reduction.
    "pingpong": {"MM_SCHEDULE": dict(PINGPONG_MAX_RED=1 << 30)},
    # The tiles a group's rows end inside stored through the staging tile as 16-byte row pieces (the
    # shared tile's default since the layer A/B at 232e5fc), and the reverse: as the accumulator's pairs.
    "staged_rows": {"MM_WS": dict(STAGED_ROWS=True), "MM_PINGPONG": dict(STAGED_ROWS=True)},
    "unstaged": {"MM_WS": dict(STAGED_ROWS=False), "MM_PINGPONG": dict(STAGED_ROWS=False)},
    # Registers moved from the shared tile's math warp groups to its load warp at every group count
    # (at 255+ experts, whose 512-entry group vectors spill at 56, MM_WS_512_GROUPS has them already).
    "regs208": {"MM_WS": dict(MATH_REGS=208, LOAD_REGS=88)},
    # The shared tile's load partition a warp group (those vectors over 128 lanes).
    "load4": {"MM_WS": dict(LOAD_WARPS=4)},
    # A wgrad whose dy rows come through a row map (fc2's in the layer) on the Gluon kernel, operands
    # swapped and dw stored transposed, instead of the Triton kernel.
    "wgrad_dy_rows": {"WGRAD_GATHERED_DY_ROWS": dict(SWAPPED=True)},
    # fc1's weight gradient reading x's token rows in its loads up to F 768 (Qwen3-30B-A3B's width)
    # instead of 512, where it gathers them into an (M, H) tensor first.
    "gathered_wgrad_768": {"GATHERED_WGRAD_MAX_FFN": {"sm90": 768}},
    # The fused MLP's TMA forms loading from a warp group of 40 registers, as their GATHER forms.
    "glu_load4": {"WS_FORWARD": dict(LOAD_WARPS=4, LOAD_REGS=40), "WS_BACKWARD": dict(LOAD_WARPS=4, LOAD_REGS=40)},
    # The quantized fc1 (fp8_block) with the gated activation and both FP8 forms in its epilogue, h never
    # written, instead of the FP8 GEMM and the gated pass apart (for `ab_builds.py --quantization`).
    "gated_fc1_epilogue": {"GATED_FC1_EPILOGUE": {"sm90": True}},
}


def write_tables(configs_py: Path, changes: dict[str, dict]) -> None:
    """`changes` (table name -> entries) written into the source of a copy of configs.py, for a build a
    layer A/B times beside src: each entry's `KEY=value,` line inside its table's `NAME = dict(` block,
    or its `KEY=value` in a one-line `NAME = dict(...)`, or its `"KEY": value` in a one-line literal
    `NAME: type = {...}` (the tables by architecture). An entry the source does not hold exactly once
    is refused, so that no build is timed with a change that did not apply."""
    lines = configs_py.read_text().splitlines(keepends=True)
    for table, entries in changes.items():
        literal = re.compile(rf"^{table}(: [^=]+)? = {{.*}}$")
        starts = [i for i, line in enumerate(lines) if line.startswith(f"{table} = dict(") or literal.match(line)]
        if len(starts) != 1:
            raise SystemExit(f"write_tables: the table {table} is in {configs_py} {len(starts)} times, not once")
        start = starts[0]
        end = (
            start
            if lines[start].rstrip().endswith((")", "}"))
            else next(i for i in range(start, len(lines)) if lines[i].startswith(")"))
        )
        for key, value in entries.items():
            if literal.match(lines[start]):
                pattern = re.compile(rf"""(['"]{re.escape(key)}['"]: )[^,{{}}\n]+""")
            else:
                pattern = re.compile(rf"(\b{key}=)[^,()\n]+")
            hits = [i for i in range(start, end + 1) if pattern.search(lines[i])]
            if len(hits) != 1:
                raise SystemExit(f"write_tables: {table}'s {key} is in {configs_py} {len(hits)} times, not once")
            lines[hits[0]] = pattern.sub(lambda m, v=value: f"{m.group(1)}{v!r}", lines[hits[0]], count=1)
    configs_py.write_text("".join(lines))


def apply_tables(changes: dict[str, dict], saved: dict[str, dict]) -> None:
    """The sweeps' table variants: the configuration tables as `saved` holds them, then `changes` (table
    name -> entries) on top, every kept launch plan dropped so the next calls plan from the tables."""
    from moekit.ops.runtime import configs
    from moekit.ops.runtime.launch import forget_plans

    for table, values in saved.items():
        getattr(configs, table).update(values)
    for table, values in changes.items():
        getattr(configs, table).update(values)
    forget_plans()


def copy_relative_cells(
    name: str,
    times: dict[tuple[str, str], list[float]],
    equal: dict[tuple[str, str], bool],
    moved: dict[str, int],
    copy: tuple[str, str] = ("copy", "torch"),
) -> dict[str, dict]:
    """The kernel sweeps' cells "name/kind/variant" from per-round times (kind, variant) -> ms: the
    median of rounds, GB/s of the kind's `moved` bytes, and `vs_copy`, that bandwidth over the copy's
    (the `copy` cell's time on moved["copy"] bytes: 1.0 = the copy's bandwidth), with each cell's bit
    check from `equal` (None where none was made); one printed line a cell, "BITS DIFFER" marked."""
    copy_ms = statistics.median(times[copy])
    copy_gbs = moved[copy[0]] / (copy_ms * 1e-3) / 1e9 if copy_ms > 0 else 0.0
    cells = {}
    for (kind, variant), samples in times.items():
        ms = statistics.median(samples)
        gbs = moved[kind] / (ms * 1e-3) / 1e9 if ms > 0 else 0.0
        share = gbs / copy_gbs if copy_gbs > 0 else 0.0
        cells[f"{name}/{kind}/{variant}"] = {
            "ms": ms,
            "ms_rounds": samples,
            "gb_per_s": gbs,
            "vs_copy": share,
            "equal": equal.get((kind, variant)),
        }
        differ = "" if equal.get((kind, variant), True) else "  BITS DIFFER"
        print(
            f"{name:20s} {kind:16s} {variant:18s} {ms:8.3f} ms  {gbs:7.0f} GB/s  {share:.2f} of the copy{differ}",
            flush=True,
        )
    return cells


def table_sweep_parser(doc: str, shapes: Sequence[str], variants: Iterable[str]) -> argparse.ArgumentParser:
    """The kernel table sweeps' shared options (--out, --shapes, --variants, --reps, --rounds, --smoke);
    a sweep adds its own before parsing."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shapes", default=",".join(shapes))
    parser.add_argument("--variants", default=",".join(variants), help="comma list of " + ", ".join(variants))
    parser.add_argument("--reps", type=int, default=10, help="timed calls a cell and round (their median)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the variants (the median of rounds)")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (interpreter): the plumbing")
    return parser


def run_table_sweep(
    script: str,
    args: argparse.Namespace,
    cells_of: Callable[..., dict[str, dict]],
    pools: tuple[dict[str, tuple], dict[str, tuple]],
    variants_table: dict[str, object],
    meta_extra: dict | None = None,
) -> None:
    """A kernel table sweep's run: every selected shape of pools (full, smoke) through
    cells_of(name, shape, variants, reps, rounds, device), "base" first (the bits every variant is
    checked against), refused where a variant's bits differ, the cells written to args.out with the
    machine's meta (plus meta_extra) and each variant's table changes."""
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA device (or --smoke)")
    # In the table's order, so "base" comes first.
    variants = select_by_name(list(variants_table), "base," + args.variants, "variants", variants_table)
    pool = pools[1] if args.smoke else pools[0]
    device = "cpu" if args.smoke else "cuda"
    cells: dict[str, dict] = {}
    for name in select_by_name(list(pool), None if args.smoke else args.shapes, "shapes", pool):
        cells.update(cells_of(name, pool[name], variants, 1 if args.smoke else args.reps, args.rounds, device))
        if device == "cuda":
            torch.cuda.empty_cache()
    if any(cell["equal"] is False for cell in cells.values()):
        raise SystemExit("a variant's bits differ from the base table's (see BITS DIFFER above)")
    if args.out is not None:
        meta = {**machine(torch.device(device)), **(meta_extra or {})}
        write_json(args.out, {"meta": meta, "variants": {v: variants_table[v] for v in variants}, "cells": cells})


def measure_roof(cfg: BenchConfig) -> dict:
    """The dense matmul roof of this process: bf16 8192^3 on CUDA (smaller and cfg's dtype on CPU)."""
    size = 8192 if cfg.device.type == "cuda" else 256
    dtype = torch.bfloat16 if cfg.device.type == "cuda" else cfg.dtype
    gen = torch.Generator(device=cfg.device).manual_seed(0)
    a = torch.randn(size, size, device=cfg.device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=cfg.device, dtype=dtype, generator=gen)
    a @ b  # cuBLAS heuristics and handle creation outside the timing
    ms = time_ms(lambda: a @ b, cfg)
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "ms": ms, "tflops": 2 * size**3 / ms / 1e9}


def time_steps(
    fn: Callable[[], object], steps: int, device: torch.device, grad_to_none: Sequence[torch.Tensor] | None = None
) -> list[float]:
    """Milliseconds of each of `steps` calls of `fn`, for steps too long for `time_ms`'s repetitions
    (a training step of a large layer). CUDA: an event recorded before and after each call, one
    synchronization at the end (no L2 flush, no CUDA graph); the gradients of `grad_to_none` are cleared
    before each call, outside the timed span. Elsewhere: wall clock around each call."""
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            for t in grad_to_none or ():
                t.grad = None
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    torch.cuda.synchronize(device)
    for start, end in events:
        for t in grad_to_none or ():
            t.grad = None
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def measure_fp8_roof(cfg: BenchConfig, scaling: str = "rowwise") -> dict:
    """The dense FP8 matmul roof: torch._scaled_mm of two 8192^2 float8 e4m3 operands (256^2 on the
    CPU), output bf16, with `scaling` "rowwise" (float32 (M, 1) and (1, N) scales) or "tensorwise"
    (one float32 scale each)."""
    size = 8192 if cfg.device.type == "cuda" else 256
    gen = torch.Generator(device=cfg.device).manual_seed(0)
    a = torch.randn(size, size, device=cfg.device, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=cfg.device, generator=gen).to(torch.float8_e4m3fn).t()  # column-major
    if scaling == "rowwise":
        scale_a = torch.ones(size, 1, device=cfg.device)
        scale_b = torch.ones(1, size, device=cfg.device)
    elif scaling == "tensorwise":
        scale_a = scale_b = torch.ones((), device=cfg.device)
    else:
        raise ValueError(f"unknown scaling {scaling!r}; expected 'rowwise' or 'tensorwise'")

    def mm() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)

    mm()  # cuBLASLt heuristics outside the timing
    ms = time_ms(mm, cfg)
    return {"size": size, "dtype": "float8_e4m3fn", "scaling": scaling, "ms": ms, "tflops": 2 * size**3 / ms / 1e9}


def measure_copy_bandwidth(cfg: BenchConfig, nbytes: int | None = None) -> dict:
    """The memory bandwidth of this process: a device-to-device copy of `nbytes` (default 4 GiB on
    CUDA, 64 MiB elsewhere), GB/s counting the bytes read and written (2 x nbytes per copy)."""
    nbytes = nbytes or (4 * 2**30 if cfg.device.type == "cuda" else 64 * 2**20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=cfg.device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = time_ms(lambda: dst.copy_(src), cfg)
    return {"bytes_copied": nbytes, "ms": ms, "gb_per_s": 2 * nbytes / ms / 1e6}


def check_host_sync(fn: Callable[[], object], device: torch.device) -> bool | None:
    """Whether one (already warmed-up) call of `fn` synchronizes with the host. CUDA only."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError as exc:
        if "synchroniz" in str(exc):
            return True
        raise
    finally:
        torch.cuda.set_sync_debug_mode(0)


def time_rounds(
    timed: Sequence[tuple[dict, Callable[[], object]]], rounds: int, time_one: Callable[[Callable[[], object]], float]
) -> None:
    """Time every (record, fn) of one comparison `rounds` times, in rounds whose order rotates
    (round r starts at entry r), so that all are measured at the same mix of clocks: a GPU's clocks
    drift within seconds under sustained load. Each record gets
    ms_rounds, ms (their median) and tflops (record["flops"] / ms); a call that raises marks its
    record "error" and leaves the other entries' rounds alone."""
    live = list(timed)
    for rnd in range(rounds):
        k = rnd % max(len(live), 1)
        for record, fn in live[k:] + live[:k]:
            if record.get("status") == "error":
                continue
            try:
                record.setdefault("ms_rounds", []).append(time_one(fn))
            except Exception as exc:  # one broken entry must not lose the others' measurements
                record["status"], record["reason"] = "error", f"round {rnd}: {error_reason(exc)}"
    for record, _ in timed:
        if record.get("ms_rounds"):
            record["ms"] = statistics.median(record["ms_rounds"])
            record["tflops"] = record["flops"] / record["ms"] / 1e9 if record.get("flops") else None


def memory_of(
    forward: Callable[[], torch.Tensor], dy: torch.Tensor, leaves: Sequence[torch.Tensor], device: torch.device
) -> dict:
    """Memory of one forward+backward, CUDA only (None elsewhere), gradients of `leaves` cleared
    before and after:
    held_bytes        allocated after the forward minus before it, the output excluded: what the
                      forward keeps for the backward;
    peak_bytes        the peak allocated during the forward+backward (inputs and weights included);
    peak_extra_bytes  that peak minus what was allocated before (activations, temporaries, gradients)."""
    if device.type != "cuda":
        return {"held_bytes": None, "peak_bytes": None, "peak_extra_bytes": None}
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    y = forward()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - before - y.untyped_storage().nbytes()
    y.backward(dy)
    del y
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    for t in leaves:
        t.grad = None
    return {"held_bytes": held, "peak_bytes": peak, "peak_extra_bytes": peak - before}


def ratios_to(records: list[dict], baseline: str, keys: Sequence[str] = ("shape", "dist", "op")) -> None:
    """x_<baseline> = tflops / the baseline impl's tflops of the same cell, and <mem>_x_<baseline>
    for held, peak and peak_extra bytes, in place (None where either side is missing)."""
    base = {tuple(r[k] for k in keys): r for r in records if r["impl"] == baseline}
    for r in records:
        b = base.get(tuple(r[k] for k in keys), {})
        r[f"x_{baseline}"] = r["tflops"] / b["tflops"] if r.get("tflops") and b.get("tflops") else None
        for mem in ("held", "peak", "peak_extra"):
            mine, theirs = r.get(f"{mem}_bytes"), b.get(f"{mem}_bytes")
            r[f"{mem}_x_{baseline}"] = mine / theirs if mine is not None and theirs else None


# --------------------------------------------------------------------------------------------------
# Correctness checks
# --------------------------------------------------------------------------------------------------

# Bound on both errors below for a result rounded once to the dtype from an fp32 accumulator:
# bf16's unit roundoff is 2^-9 ~ 2e-3 per element, so a correct cell stays under ~5e-3 even through
# the MLP's intermediate roundings, while a wrong group, a missing or stale row gives O(1).
CHECK_BOUND = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


VECTOR_SLICE = 64


def _slices(t: torch.Tensor) -> torch.Tensor:
    """(slices, elements) of float32 `t`: its dim-0 slices, or blocks of VECTOR_SLICE elements of a
    vector (zero-padded at the end)."""
    t = t.detach().float()
    if t.dim() == 1:
        t = torch.nn.functional.pad(t, (0, -t.numel() % VECTOR_SLICE)).reshape(-1, VECTOR_SLICE)
    return t.reshape(t.shape[0], -1)


def rel_errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative errors of `got` against the float32 `ref`.

    fro: ||got - ref||_F / ||ref||_F over the whole tensor.
    worst_slice: the largest of the same ratio per slice along dim 0 (per row of an activation, per
        expert of a weight gradient; per block of 64 elements of a vector such as d probs, whose
        single elements can be near zero), so that one wrong row or one wrong expert among 131072
        rows or 128 experts cannot hide in the global norm. A slice whose reference is zero (an
        expert without rows) must be zero: its denominator is 1e-6 of the global norm.
    """
    diff = got.detach().float() - ref.float()
    ref_norm = ref.float().norm()
    fro = (diff.norm() / ref_norm.clamp_min(1e-30)).item()
    diff_rows, ref_rows = _slices(diff).norm(dim=1), _slices(ref).norm(dim=1)
    worst = (diff_rows / ref_rows.clamp_min(1e-6 * ref_norm.item() + 1e-30)).max().item() if diff.numel() else 0.0
    return {"fro": _finite_or_none(fro), "worst_slice": _finite_or_none(worst)}


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None  # NaN/inf (unwritten rows) are not JSON; None fails the check


def check_summary(errors: dict[str, dict], dtype: torch.dtype) -> dict:
    bound = CHECK_BOUND[dtype]
    ok = all(
        e["fro"] is not None and e["worst_slice"] is not None and e["fro"] <= bound and e["worst_slice"] <= bound
        for e in errors.values()
    )
    return {"bound": bound, "ok": ok, "errors": errors}


def failed_check_reason(check: dict) -> str:
    bad = {
        k: v
        for k, v in check["errors"].items()
        if v["fro"] is None or v["worst_slice"] is None or max(v["fro"], v["worst_slice"]) > check["bound"]
    }
    return f"error above {check['bound']:.0e} vs float32 reference: {bad}"


# --------------------------------------------------------------------------------------------------
# Errors and memory
# --------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_profile(step: Callable[[], object], device: torch.device, top: int = 40) -> dict:
    """One call of `step` under torch.profiler: the device time of its kernels (CUDA) or the operators'
    own CPU time (elsewhere) summed by name, largest first (the `top` largest kept), and their sum."""
    cuda = device.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    sync(device)
    with torch.profiler.profile(activities=[activity]) as prof:
        step()
        sync(device)
    totals: dict[str, list[float]] = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us <= 0 or (cuda and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        entry = totals.setdefault(event.key[:160], [0.0, 0])
        entry[0] += us / 1e3
        entry[1] += event.count
    kernels = sorted(({"name": k, "ms": v[0], "launches": v[1]} for k, v in totals.items()), key=lambda r: -r["ms"])
    return {
        "kernels_of": "cuda kernels" if cuda else "cpu ops",
        "kernel_ms": sum(r["ms"] for r in kernels),
        "kernels": kernels[:top],
    }


def error_reason(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# Environment and output
# --------------------------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    # Only trailing whitespace: `status --porcelain` lines start with a meaningful space.
    return done.stdout.rstrip() if done.returncode == 0 else None


def _version(distribution: str) -> str | None:
    """The installed version, from the package metadata (a --target install has it too)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(device: torch.device | None = None) -> dict:
    """What every result depends on: the machine, the versions and the code revision measured.

    A copy of the tree without .git (as a GPU machine may get it) cannot say which commit it is:
    the caller names it in MOEKIT_BENCH_COMMIT, which wins over git (that could be another
    repository's)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    status = _git("status", "--porcelain")
    dirty_paths = [line[3:] for line in status.splitlines()] if status else []
    commit_env = os.environ.get("MOEKIT_BENCH_COMMIT")
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": str(device),
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "moekit": moekit.__version__,
        "transformers": _version("transformers"),
        "liger_kernel": _version("liger-kernel"),
        "torchao": _version("torchao"),
        "git_commit": commit_env or _git("rev-parse", "HEAD"),
        "git_commit_from": "MOEKIT_BENCH_COMMIT" if commit_env else ("git" if status is not None else None),
        # Untracked files count: a kernel not yet committed changes what was measured.
        "git_dirty": bool(dirty_paths) if status is not None and not commit_env else None,
        "git_dirty_paths": dirty_paths[:50] if not commit_env else [],
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MOEKIT_", "TRITON_", "CUDA_VISIBLE", "LIGER_"))},
    }


def environment(cfg: BenchConfig, roof: dict) -> dict:
    """machine() and the settings of a run."""
    return {
        **machine(cfg.device),
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "smoke": cfg.smoke,
        "quick": cfg.quick,
        "rounds": cfg.rounds,
        "warmup_ms": cfg.warmup_ms,
        "rep_ms": cfg.rep_ms,
        "timer": "triton.testing.do_bench median, L2 flushed, no CUDA graph"
        if cfg.device.type == "cuda"
        else "wall clock median of 3 (smoke)",
        "check_bound": CHECK_BOUND[cfg.dtype],
        "skew_seed": SKEW_SEED,
        "roof": roof,
    }


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display): the plots' one import, made
    where a plot is drawn, so the benchmarks run where matplotlib is absent or broken."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Write a plot to `path` (its folder made) and free it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":  # gpu_prelude.sh's changed_src: python3 runner.py CHANGE CONFIGS_PY
    parser = argparse.ArgumentParser(description="write one of TABLE_CHANGES into a copy of configs.py")
    parser.add_argument("change", choices=sorted(TABLE_CHANGES))
    parser.add_argument("configs_py", type=Path)
    args = parser.parse_args()
    write_tables(args.configs_py, TABLE_CHANGES[args.change])
