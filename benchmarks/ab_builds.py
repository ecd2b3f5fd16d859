"""Two builds of moekit, kernel by kernel: grouped_mlp forward+backward (triton backend, router probs)
at the README's four MLP shapes, balanced and skewed, each build in its own processes, alternating
(A, B, A, B, ...), so that a kernel change is timed against the code it replaces on one machine.

For each build and cell: the CUDA time of every kernel (torch.profiler, median over the profiled
steps, and calls per step) and a hash of the output and every gradient, so that a change meant to
be bit-identical is checked to be. A build is a source tree holding `moekit/` (e.g. a copy of
`src/` with one kernel edited); Triton's cache keys on the source, so the two never share binaries.

    python benchmarks/ab_builds.py --a src --b /tmp/variant/src --rounds 2 --out ab.json
    python benchmarks/ab_builds.py --a src --b src --smoke --out /tmp/ab.json   # CPU: the plumbing

The JSON records the machine and versions (`runner.machine`), the commit (`--commit`, else
`MOEKIT_BENCH_COMMIT`, else git) and, per cell, each build's per-round kernel times, their ratio
B / A (mean of rounds) per kernel, and whether all hashes agree.
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


def probe(shape_names: str | None, steps: int, smoke: bool) -> dict:
    """In this process (moekit from PYTHONPATH): per cell, kernel times and the results' hash."""
    import runner
    import torch
    from torch.profiler import ProfilerActivity, profile

    import moekit

    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    pool = runner.SMOKE_SHAPES if smoke else runner.SHAPES
    shapes = runner.select_by_name(pool, shape_names, "shapes", [s.name for s in pool]) if shape_names else pool
    cells = {}
    for shape in shapes:
        for dist in runner.DISTS:
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

            digest = hashlib.sha1()
            for t in (step(), *(t.grad for t in leaves)):
                digest.update(t.detach().float().cpu().numpy().tobytes())
            kernels = {}
            if device.type == "cuda":
                step()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        step()
                    torch.cuda.synchronize()
                by_name: dict[str, list[float]] = {}
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
                        by_name.setdefault(e.name, []).append(e.device_time / 1000)
                kernels = {
                    name: {"ms": statistics.median(ts), "calls_per_step": len(ts) / steps}
                    for name, ts in by_name.items()
                }
            cells[f"{shape.name}/{dist}"] = {"hash": digest.hexdigest()[:16], "kernels": kernels}
            del leaves, dy
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return cells


def run_build(src: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(BENCHMARKS)])}
    if args.smoke:
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    command = [sys.executable, str(Path(__file__).resolve()), "--probe", "--steps", str(args.steps)]
    command += (["--shapes", args.shapes] if args.shapes else []) + (["--smoke"] if args.smoke else [])
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PROBE_TAG)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"build {src}: probe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(PROBE_TAG))


def compare(runs: dict[str, list[dict]]) -> dict:
    """Per cell: each build's per-round times of every kernel, the B / A ratio, bit-equality."""
    cells = {}
    for cell in runs["a"][0]:
        hashes = {r[cell]["hash"] for build in runs.values() for r in build}
        kernels = {}
        for name in runs["a"][0][cell]["kernels"]:
            times = {b: [r[cell]["kernels"].get(name, {}).get("ms") for r in runs[b]] for b in runs}
            entry = {f"{b}_ms": t for b, t in times.items()}
            if all(t is not None for ts in times.values() for t in ts):
                entry["b_over_a"] = statistics.mean(times["b"]) / statistics.mean(times["a"])
            kernels[name] = entry
        cells[cell] = {"bit_identical": len(hashes) == 1, "kernels": kernels}
    return cells


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, help="build A: a source tree holding moekit/ (the baseline)")
    parser.add_argument("--b", type=Path, help="build B: a source tree holding moekit/ (the change)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per build, alternating (default 2)")
    parser.add_argument("--steps", type=int, default=7, help="profiled forward+backward steps per cell")
    parser.add_argument("--shapes", default=None, help="comma list of shape names (default: the four)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write")
    parser.add_argument("--commit", default=None, help="the commit build A is (for a tree without .git)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per probe process")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter): hashes only")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(PROBE_TAG + json.dumps(probe(args.shapes, args.steps, args.smoke)), flush=True)
        return None
    for name in ("a", "b"):
        src = getattr(args, name)
        if src is None or not (src / "moekit" / "__init__.py").is_file():
            parser.error(f"--{name} must be a source tree holding moekit/__init__.py, got {src}")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    # runner imports moekit for the version it records: build A's.
    sys.path[:0] = [str(args.a.resolve()), str(BENCHMARKS)]
    import runner

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
            "rounds": args.rounds,
            "steps": args.steps,
            "smoke": args.smoke,
            "order": ["a", "b"] * args.rounds,
        },
        "cells": cells,
    }
    for cell, c in cells.items():
        ratios = "  ".join(
            f"{n[:22]} {k['b_over_a']:.3f}"
            for n, k in c["kernels"].items()
            if "b_over_a" in k and ("glu" in n or "grouped" in n or "wgrad" in n)
        )
        print(f"{cell:28} {'same' if c['bit_identical'] else 'DIFFER'}  B/A: {ratios}")
    if args.out:
        runner.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
