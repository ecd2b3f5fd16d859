"""Two builds of moekit, kernel by kernel: grouped_mlp forward+backward (triton backend, router probs)
at the README's four MLP shapes (`--op mlp`), or moe_experts forward+backward at the README's four
layer shapes (`--op layer`), balanced (drawn with equal shares) and skewed, or `exact` (every expert
M / E rows: the quantized table's and `--op qgemm`'s groups), or the gated kernels on h held in FP8 at HELD_CASES
(`--op held`: their output, dh and d probs), or the quantized forward and dgrad GEMMs alone at the layer
shapes' fc1 and fc2 (`--op qgemm`, with --quantization's recipe, fp8_block by default), each build in its
own processes, alternating (A, B, A, B, ...), so that a change is timed against the code it replaces on
one machine.

For each build and cell: the CUDA time of every kernel either build launches (torch.profiler, the
median call, a step's share: the sum of its calls a step, and each call by its position in the step:
one kernel may run problems of several sizes a step), the whole step's time (CUDA events,
median), and a hash of the output and
every gradient, so that a change meant to be bit-identical is checked to be. A build is a source
tree holding `moekit/` (e.g. a copy of `src/` with one kernel edited); Triton's cache keys on the
source, so the two never share binaries.

    python benchmarks/ab_builds.py --a src --b /tmp/variant/src --rounds 2 --out ab.json
    python benchmarks/ab_builds.py --a src --b src --smoke --out /tmp/ab.json   # CPU: the plumbing
    python benchmarks/ab_builds.py --a /tmp/old/src --b src --op layer --quantization fp8_block --out ab.json
    python benchmarks/ab_builds.py --a src --b /tmp/variant/src --op qgemm --shapes qwen3-30b-a3b --out ab.json

The JSON records the machine and versions (`runner.machine`), build A's commit (`--commit`, else
`MOEKIT_BENCH_COMMIT`, else git) as `git_commit`, build B's (`--commit-b`) as `b_commit`, and, per
cell, each build's per-round kernel times, their ratio B / A (mean of rounds) per kernel, and
whether all hashes agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
PROBE_TAG = "AB_PROBE_RESULT "


def _mlp_cells(shape_names: str | None, smoke: bool, device, dtype, dists: tuple[str, ...] = ()):
    """(cell name, step, leaves) of grouped_mlp at the MLP shapes."""
    import runner
    import torch

    import moekit

    pool = runner.SMOKE_SHAPES if smoke else runner.SHAPES
    shapes = runner.select_by_name(pool, shape_names, "shapes", [s.name for s in pool]) if shape_names else pool
    for shape in shapes:
        for dist in dists or runner.DISTS:
            inputs, dy = runner.mlp_inputs(shape, device, dtype)
            leaves = list(inputs.values())
            m_splits = torch.tensor(runner.make_splits(shape, dist), device=device)

            def step(leaves=leaves, dy=dy, m_splits=m_splits):
                for t in leaves:
                    t.grad = None
                x, w1, w2, probs = leaves
                y = moekit.grouped_mlp(x, w1, w2, m_splits, probs=probs, backend="triton")
                y.backward(dy)
                return y

            yield f"{shape.name}/{dist}", step, leaves


def _layer_cells(
    shape_names: str | None, smoke: bool, device, dtype, quantization: str | None = None, dists: tuple[str, ...] = ()
):
    """(cell name, step, leaves) of moe_experts at the layer shapes (bench_moe_layer's first four, or any of
    its shapes and SonicMoE's by name); with `quantization`, as MoELayer runs it: the weights' caches kept
    across steps and refreshed in place at every step (`track_versions=False`), so the weights'
    quantization is timed in every step."""
    import bench_moe_layer as layer
    import runner
    import torch
    from bench_quantized import balanced_ids

    import moekit

    named = layer.SHAPES + layer.SONICMOE_SHAPES
    pool = layer.SMOKE_SHAPES if smoke else (named if shape_names else layer.SHAPES[:4])
    shapes = runner.select_by_name(pool, shape_names, "shapes", [s.name for s in pool]) if shape_names else pool
    for shape in shapes:
        for dist in dists or runner.DISTS:
            base = layer.make_inputs(shape, device, dtype)
            ids, weights = layer.make_routing(shape, "balanced" if dist == "exact" else dist, device, dtype)
            if dist == "exact":  # bench_quantized's table: every expert exactly M / E rows
                ids = balanced_ids(shape, device)
            leaves = [base["x"].requires_grad_(True), weights.requires_grad_(True), base["w1"], base["w2"]]
            leaves[2].requires_grad_(True)
            leaves[3].requires_grad_(True)
            gen = torch.Generator(device=device).manual_seed(1)
            dy = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype, generator=gen)
            kw: dict = {}
            if quantization:
                caches = tuple(moekit.QuantizedWeightCache(track_versions=False) for _ in range(2))
                kw = dict(quantization=quantization, weight_caches=caches)

            def step(leaves=leaves, dy=dy, ids=ids, kw=kw):
                for t in leaves:
                    t.grad = None
                x, w, w1, w2 = leaves
                y = moekit.moe_experts(x, ids, w, w1, w2, backend="triton", **kw)
                y.backward(dy)
                return y

            yield f"{shape.name}/{dist}", step, leaves


# Edge cases of the fused MLP (`--op cases`, hashes only): M, splits, H, F, glu_interleave_size, bias,
# probs, activation. Padding rows, empty experts, one row, all padding, gpt-oss's partial tile, an
# interleaved layout, odd rows: where two builds must agree bit for bit beyond the benchmark shapes.
CASES = {
    "padding_empty_bias": (1000, [0, 300, 1, 0, 500], 256, 384, None, True, True, "swiglu"),
    "clamped_no_probs": (1000, [0, 300, 1, 0, 500], 256, 384, None, True, False, "clamped_swiglu"),
    "one_row": (64, [0, 1, 0], 64, 128, None, False, True, "swiglu"),
    "all_padding": (300, [0, 0, 0], 64, 128, None, False, True, "swiglu"),
    "gptoss_partial_tile": (4096, [1000, 0, 2000, 1096], 2880, 2880, None, True, True, "clamped_swiglu"),
    "interleave_k128": (2048, [500, 700, 848], 512, 768, 128, False, True, "swiglu"),
    "interleave_k1": (1024, [500, 500, 0], 256, 256, 1, True, True, "clamped_swiglu"),
    "odd_rows": (777, [100, 233, 0, 444], 192, 256, None, False, True, "swiglu"),
}


def _case_cells(shape_names: str | None, smoke: bool, device, dtype):
    """(cell name, step, leaves) of grouped_mlp at CASES (scaled down to tiny sizes with --smoke)."""
    import torch

    import moekit

    for name, (rows, splits, hidden, ffn, block, bias, probs, activation) in CASES.items():
        if shape_names and name not in shape_names.split(","):
            continue
        if smoke:
            rows, splits, hidden, ffn = 40, [s * 40 // max(rows, 1) for s in splits], 16, 16
            block = None if block is None else min(block, 4)
        gen = torch.Generator().manual_seed(11)
        n = len(splits)
        x = (torch.randn(rows, hidden, generator=gen) * 3).to(device, dtype).requires_grad_(True)
        w1 = (torch.randn(n, 2 * ffn, hidden, generator=gen) / hidden**0.5).to(device, dtype).requires_grad_(True)
        w2 = (torch.randn(n, hidden, ffn, generator=gen) / ffn**0.5).to(device, dtype).requires_grad_(True)
        b1 = torch.randn(n, 2 * ffn, generator=gen).to(device, dtype).requires_grad_(True) if bias else None
        b2 = torch.randn(n, hidden, generator=gen).to(device, dtype).requires_grad_(True) if bias else None
        p = torch.rand(rows, generator=gen).to(device).requires_grad_(True) if probs else None
        dy = torch.randn(rows, hidden, generator=gen).to(device, dtype)
        leaves = [t for t in (x, w1, w2, b1, b2, p) if t is not None]
        m_splits = torch.tensor(splits, device=device)
        kw = dict(fc1_bias=b1, fc2_bias=b2, probs=p, activation=activation, glu_interleave_size=block)

        def step(leaves=leaves, x=x, w1=w1, w2=w2, dy=dy, m_splits=m_splits, kw=kw):
            for t in leaves:
                t.grad = None
            y = moekit.grouped_mlp(x, w1, w2, m_splits, backend="triton", **kw)
            y.backward(dy)
            return y

        yield name, step, leaves


# The gated kernels on h held in FP8 (`--op held`: held_gated_activation and its backward, out, dh and
# d probs hashed): (recipe, glu_interleave_size, F). fp8_block at `[gate | up]` and interleave 1, at a
# width whose ups start off a 128-column block (gpt-oss's 2880), mxfp8, fp8_rowwise's one scale a row,
# mxfp8 where no tile aligns with its 32-column blocks (760). 8192 rows in two groups (--smoke: 24 rows,
# F a tenth, at least 8).
HELD_CASES = {
    "fp8_block_k0_F768": ("fp8_block", None, 768),
    "fp8_block_k1_F768": ("fp8_block", 1, 768),
    "fp8_block_k0_F2880": ("fp8_block", None, 2880),
    "mxfp8_k0_F768": ("mxfp8", None, 768),
    "fp8_rowwise_k0_F768": ("fp8_rowwise", None, 768),
    "mxfp8_k0_F760": ("mxfp8", None, 760),
}


def _held_cells(shape_names: str | None, smoke: bool, device, dtype):
    """(cell name, step, no leaves) of the held-h gated kernels at HELD_CASES: a step returns its
    forward's output, dh and d probs as one flat float tensor (what the hash covers)."""
    import torch

    import moekit
    from moekit.ops.glu import held_gated_activation, held_gated_activation_backward, to_held

    for name, (recipe, k, ffn) in HELD_CASES.items():
        if shape_names and name not in shape_names.split(","):
            continue
        rows, ffn = (24, max(8, ffn // 10)) if smoke else (8192, ffn)
        gen = torch.Generator().manual_seed(0)
        h = (torch.randn(rows, 2 * ffn, generator=gen) * 4).to(device, dtype)
        probs = torch.rand(rows, generator=gen).to(device, dtype)
        d_out = torch.randn(rows, ffn, generator=gen).to(device, dtype)
        act = "clamped_swiglu" if k == 1 else "swiglu"
        h_q = moekit.group_quantize(to_held(h, k, act), [rows // 2, rows - rows // 2], recipe, backend="triton")

        def step(h_q=h_q, probs=probs, d_out=d_out, k=k, act=act):
            out = held_gated_activation(h_q, probs, k, act)
            dh, d_probs = held_gated_activation_backward(h_q, probs, d_out, k, act, True)
            return torch.cat([t.float().flatten() for t in (out, dh, d_probs)])

        yield name, step, []


def _qgemm_cells(shape_names: str | None, smoke: bool, device, dtype, quantization: str, dists: tuple[str, ...] = ()):
    """(cell name, step, no leaves) of the quantized forward and dgrad GEMMs alone (the triton backend's
    `quantized_linear_forward` / `_dgrad` on operands quantized once) at each layer shape's fc1 (I = H,
    O = 2F) and fc2 (I = F, O = H), M = T*K rows in E groups: where a change to the FP8 GEMM kernels is
    timed without the rest of the layer. The groups (`dists`): `exact` (the default: M / E rows each),
    or the counts of `--op layer`'s drawn `balanced` or `skewed` routing (groups of any count, so a
    group's last row tile is partial); cells of another routing than `exact` name it."""
    import bench_moe_layer as layer
    import runner
    import torch
    from bench_quantized import fp8_gemm_calls

    pool = layer.SMOKE_SHAPES if smoke else layer.SHAPES
    shapes = runner.select_by_name(pool, shape_names, "shapes", [s.name for s in pool]) if shape_names else pool[:4]
    for shape in shapes:
        M = shape.tokens * shape.top_k
        for dist in dists or ("exact",):
            if dist == "exact":
                splits = torch.tensor(runner.balanced_splits(M, shape.experts), device=device)
            else:
                ids = layer.make_routing(shape, dist, device, dtype)[0]
                splits = torch.bincount(ids.flatten(), minlength=shape.experts)
            offs = torch.cat([splits.new_zeros(1), splits.cumsum(0)])
            cell = shape.name if dist == "exact" else f"{shape.name}/{dist}"
            for linear, n_in, n_out in (("fc1", shape.hidden, 2 * shape.ffn), ("fc2", shape.ffn, shape.hidden)):
                gen = torch.Generator(device=device).manual_seed(3)
                x = torch.randn(M, n_in, device=device, dtype=dtype, generator=gen)
                dy = torch.randn(M, n_out, device=device, dtype=dtype, generator=gen)
                w = (torch.randn(shape.experts, n_out, n_in, device=device, generator=gen) / n_in**0.5).to(dtype)
                fwd, dgrad, _ = fp8_gemm_calls(quantization, x, dy, w, splits, offs)
                del x, dy, w
                yield f"{cell}/{linear}/fwd", fwd, []
                yield f"{cell}/{linear}/dgrad", dgrad, []


def probe(
    op: str,
    shape_names: str | None,
    steps: int,
    smoke: bool,
    quantization: str | None = None,
    dists: tuple[str, ...] = (),
) -> dict:
    """In this process (moekit from PYTHONPATH): per cell, kernel times, step time and the results' hash."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    cells = {}
    if op == "layer":
        cells_of = _layer_cells(shape_names, smoke, device, dtype, quantization, dists)
    elif op == "mlp":
        cells_of = _mlp_cells(shape_names, smoke, device, dtype, dists)
    elif op == "held":
        cells_of = _held_cells(shape_names, smoke, device, dtype)
    elif op == "qgemm":
        cells_of = _qgemm_cells(shape_names, smoke, device, dtype, quantization or "fp8_block", dists)
    else:
        cells_of = _case_cells(shape_names, smoke, device, dtype)
    for cell, step, leaves in cells_of:
        digest = hashlib.sha1()
        for t in (step(), *(t.grad for t in leaves)):
            digest.update(t.detach().float().cpu().numpy().tobytes())
        kernels, step_ms = {}, None
        if device.type == "cuda" and op != "cases":
            import triton

            step_ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step()
                torch.cuda.synchronize()
            by_name: dict[str, list[float]] = {}
            launched = (
                e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0
            )
            for e in sorted(launched, key=lambda e: e.time_range.start):
                by_name.setdefault(e.name, []).append(e.device_time / 1000)
            kernels = {name: kernel_times(ts, steps) for name, ts in by_name.items()}
        cells[cell] = {"hash": digest.hexdigest()[:16], "kernels": kernels, "step_ms": step_ms}
        del leaves, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return cells


def kernel_times(ts: list[float], steps: int) -> dict:
    """One kernel's times over `steps` profiled steps, `ts` in launch order (ms): the median call, the
    calls a step, a step's share (their sum over the steps / steps) and, where every step launched it
    the same number of times, each call's median by its position in the step (`per_call_ms`): a
    kernel that runs problems of several sizes a step (fc1's and fc2's forward and dgrad on one
    kernel) is compared call by call, not by one median over calls of different sizes."""
    times: dict = {"ms": statistics.median(ts), "calls_per_step": len(ts) / steps, "step_ms": sum(ts) / steps}
    calls, rest = divmod(len(ts), steps)
    if calls > 1 and not rest:
        times["per_call_ms"] = [statistics.median(ts[s * calls + i] for s in range(steps)) for i in range(calls)]
    return times


def run_build(src: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(BENCHMARKS)])}
    if args.smoke:
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    command = [sys.executable, str(Path(__file__).resolve()), "--probe", "--steps", str(args.steps), "--op", args.op]
    command += (["--shapes", args.shapes] if args.shapes else []) + (["--smoke"] if args.smoke else [])
    command += ["--quantization", args.quantization] if args.quantization else []
    command += ["--dists", args.dists] if args.dists else []
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PROBE_TAG)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"build {src}: probe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(PROBE_TAG))


def compare(runs: dict[str, list[dict]]) -> dict:
    """Per cell: each build's per-round times of every kernel either build launched (`{b}_ms`: the median
    call; `{b}_step_ms`: a step's share, its calls' sum a step, 0 where the build does not launch it),
    the B / A ratio of the steps' shares (where both builds launch it: a change that moves work into
    another kernel shows as one kernel's ratio below 1 and another's appearing), where both launch it
    the same number of times a step the B / A ratio of each call by its position in the step
    (`per_call_b_over_a`), and bit-equality."""
    cells = {}
    for cell in runs["a"][0]:
        hashes = {r[cell]["hash"] for build in runs.values() for r in build}
        names = dict.fromkeys(name for build in runs.values() for r in build for name in r[cell]["kernels"])
        kernels = {}
        for name in names:
            got = {b: [r[cell]["kernels"].get(name) for r in runs[b]] for b in runs}
            entry: dict = {f"{b}_ms": [k["ms"] if k else None for k in ks] for b, ks in got.items()}
            shares = {b: [k["step_ms"] if k else 0.0 for k in ks] for b, ks in got.items()}
            entry.update({f"{b}_step_ms": ts for b, ts in shares.items()})
            if all(k is not None for ks in got.values() for k in ks):
                entry["b_over_a"] = statistics.mean(shares["b"]) / statistics.mean(shares["a"])
                per_call = {b: [k.get("per_call_ms") for k in ks] for b, ks in got.items()}
                if len({len(c) if c else 0 for cs in per_call.values() for c in cs}) == 1 and per_call["a"][0]:
                    mean_of = {
                        b: [statistics.mean(c[i] for c in cs) for i in range(len(cs[0]))] for b, cs in per_call.items()
                    }
                    entry["per_call_b_over_a"] = [b / a for a, b in zip(mean_of["a"], mean_of["b"], strict=True)]
            kernels[name] = entry
        steps = {b: [r[cell].get("step_ms") for r in runs[b]] for b in runs}
        step = {f"{b}_step_ms": t for b, t in steps.items()}
        if all(t is not None for ts in steps.values() for t in ts):
            step["step_b_over_a"] = statistics.mean(steps["b"]) / statistics.mean(steps["a"])
        cells[cell] = {"bit_identical": len(hashes) == 1, **step, "kernels": kernels}
    return cells


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, help="build A: a source tree holding moekit/ (the baseline)")
    parser.add_argument("--b", type=Path, help="build B: a source tree holding moekit/ (the change)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per build, alternating (default 2)")
    parser.add_argument("--steps", type=int, default=7, help="profiled forward+backward steps per cell")
    parser.add_argument(
        "--op",
        choices=("mlp", "layer", "cases", "held", "qgemm"),
        default="mlp",
        help="grouped_mlp at the MLP shapes, moe_experts at the layer shapes, grouped_mlp at CASES (hashes "
        "only), the held-h gated kernels at HELD_CASES, or the quantized forward and dgrad GEMMs alone at the "
        "layer shapes",
    )
    parser.add_argument("--shapes", default=None, help="comma list of shape names (default: the four)")
    parser.add_argument(
        "--quantization",
        choices=("fp8_block", "fp8_rowwise", "mxfp8"),
        default=None,
        help="--op layer: moe_experts with this quantization (weights' caches refreshed every step); --op "
        "qgemm: the recipe (default fp8_block)",
    )
    parser.add_argument(
        "--dists",
        default=None,
        help="comma list of the groups: --op mlp balanced (equal counts) and skewed (both by default); --op "
        "layer and --op qgemm balanced (each token's experts drawn with equal shares: groups of about M / E "
        "rows), skewed and exact (every expert exactly M / E rows, bench_quantized's balanced table; qgemm's "
        "default, layer's default balanced and skewed)",
    )
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write")
    parser.add_argument("--commit", default=None, help="the commit build A is (for a tree without .git)")
    parser.add_argument("--commit-b", default=None, help="the commit build B is (recorded as b_commit)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per probe process")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter): hashes only")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dists = tuple(d.strip() for d in (args.dists or "").split(",") if d.strip())
    if args.probe:
        cells = probe(args.op, args.shapes, args.steps, args.smoke, args.quantization, dists)
        print(PROBE_TAG + json.dumps(cells), flush=True)
        return None
    if args.dists and args.op in ("cases", "held"):
        parser.error("--dists is for --op mlp, --op layer and --op qgemm")
    if args.quantization and args.op not in ("layer", "qgemm"):
        parser.error("--quantization is for --op layer and --op qgemm")
    if args.op == "qgemm" and not args.quantization:
        args.quantization = "fp8_block"  # recorded in the JSON and passed to the probes
    for name in ("a", "b"):
        src = getattr(args, name)
        if src is None or not (src / "moekit" / "__init__.py").is_file():
            parser.error(f"--{name} must be a source tree holding moekit/__init__.py, got {src}")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    # runner imports moekit for the version it records: build A's.
    sys.path[:0] = [str(args.a.resolve()), str(BENCHMARKS)]
    import runner

    known = (*runner.DISTS, "exact") if args.op in ("layer", "qgemm") else runner.DISTS
    unknown = [d for d in dists if d not in known]
    if unknown:
        parser.error(f"--dists for --op {args.op} takes {', '.join(known)}, got {unknown}")

    start = time.monotonic()
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for name in ("a", "b"):
            runs[name].append(run_build(getattr(args, name), args))
            print(
                f"[{time.monotonic() - start:6.1f} s] round {r + 1}/{args.rounds} build {name.upper()} done", flush=True
            )
    meta = runner.machine()
    if args.commit:
        meta.update(git_commit=args.commit, git_commit_from="--commit", git_dirty=None, git_dirty_paths=[])
    cells = compare(runs)
    payload = {
        "meta": {
            **meta,
            "a": str(args.a),
            "b": str(args.b),
            "b_commit": args.commit_b,
            "rounds": args.rounds,
            "steps": args.steps,
            "smoke": args.smoke,
            "op": args.op,
            "quantization": args.quantization,
            "dists": list(dists) or None,
            "order": ["a", "b"] * args.rounds,
        },
        "cells": cells,
    }
    for cell, c in cells.items():
        ratios = "  ".join(
            f"{n[:22]} {k['b_over_a']:.3f}"
            + (f" [{' '.join(f'{r:.3f}' for r in k['per_call_b_over_a'])}]" if "per_call_b_over_a" in k else "")
            for n, k in c["kernels"].items()
            if "b_over_a" in k and ("glu" in n or "grouped" in n or "wgrad" in n)
        )
        step = f"step {c['step_b_over_a']:.3f}" if "step_b_over_a" in c else ""
        only = "  ".join(
            f"{'+' if b == 'b' else '-'}{n[:22]} {statistics.mean(k[f'{b}_step_ms']):.3f} ms"
            for n, k in c["kernels"].items()
            for b, other in (("a", "b"), ("b", "a"))
            if not any(k[f"{other}_step_ms"]) and any(k[f"{b}_step_ms"])
        )
        print(f"{cell:28} {'same' if c['bit_identical'] else 'DIFFER'}  {step}  B/A: {ratios}  {only}".rstrip())
    if args.out:
        runner.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
