"""moekit.grouped_mlp (with router probs) against the plain PyTorch a user would write (`plain_mlp`), in one
process, interleaved rounds, dense 8192^3 bf16 roof measured in the same run (start and end).

Legend: M routed rows, N experts, H hidden size, F ffn size.

Per (shape, balanced/skewed splits) and implementation: output, d x, d w1, d w2 and d probs against
a float32 per-group reference (relative Frobenius error and the worst row/expert); forward and
forward+backward TFLOP/s (forward = 6 M H F, forward+backward = 3x) and the ratio to plain; memory
of one forward+backward: the peak (absolute, and above what was allocated before) and what the
forward holds for the backward (allocated after it, output excluded, minus before), and their
ratios to plain. One record per (shape, dist, op, impl); the JSON is rewritten after every cell.

    python benchmarks/bench_mlp_vs_plain.py --out $OUT [--shapes a,b] [--max-seconds 60]
    python benchmarks/bench_mlp_vs_plain.py --smoke --backend torch --out /tmp/b   # tiny, CPU

The commit recorded is MOEKIT_BENCH_COMMIT's, else git's (runner.machine).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import runner
import torch
import torch.nn.functional as F

import moekit

NAME = "mlp_vs_plain"
IMPLS = ("moekit", "plain")
OPS = ("forward", "forward+backward")
GRAD_NAMES = ("x", "w1", "w2", "probs")


def plain_mlp(x, w1, w2, offs, probs):  # offs = cumsum(m_splits) as int32
    h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, -1)
    return torch._grouped_mm(F.silu(g) * u * probs[:, None].to(x.dtype), w2.transpose(-2, -1), offs=offs)


def reference(leaves: dict, splits: list[int], dy: torch.Tensor) -> dict:
    """float32 output and gradients of a per-group loop (moekit's loop backend on float32 copies)."""
    ref = {k: t.detach().float().requires_grad_() for k, t in leaves.items()}
    y = moekit.grouped_mlp(ref["x"], ref["w1"], ref["w2"], splits, probs=ref["probs"], backend="loop")
    y.backward(dy.float())
    return {"out": y.detach(), **{k: ref[k].grad for k in GRAD_NAMES}}


def bench_cell(args, cfg: runner.BenchConfig, shape: runner.MoEShape, dist: str) -> list[dict]:
    M, N, H, Fd = shape.rows, shape.experts, shape.hidden, shape.ffn
    device, dtype = cfg.device, cfg.dtype
    start = time.monotonic()
    splits = runner.make_splits(shape, dist)
    leaves, dy = runner.mlp_inputs(shape, device, dtype)
    grads = list(leaves.values())
    m_splits = torch.tensor(splits, device=device)
    offs32 = torch.cumsum(m_splits, 0).to(torch.int32)
    x, w1, w2, probs = (leaves[k] for k in GRAD_NAMES)
    forwards = {
        "moekit": lambda: moekit.grouped_mlp(x, w1, w2, m_splits, probs=probs, backend=args.backend),
        "plain": lambda: plain_mlp(x, w1, w2, offs32, probs),
    }
    ref = reference(leaves, splits, dy)
    flops_fwd = 6 * M * H * Fd
    records, timed = [], []
    for impl, fwd in forwards.items():
        recs = {
            op: {
                "bench": NAME,
                "shape": shape.name,
                "dist": dist,
                "rows": M,
                "experts": N,
                "hidden": H,
                "ffn": Fd,
                "max_split": max(splits),
                "op": op,
                "impl": impl,
                "backend": args.backend if impl == "moekit" else "torch._grouped_mm",
                "flops": flops_fwd * (1 if op == "forward" else 3),
                "status": None,
                "reason": None,
                "ms": None,
                "tflops": None,
            }
            for op in OPS
        }
        records += recs.values()

        def fwd_bwd(fwd=fwd):
            fwd().backward(dy)

        try:
            for t in grads:
                t.grad = None
            y = fwd()  # first call: compilation and tuning happen here, outside the timing
            y.backward(dy)
            got = {"out": y.detach(), **{k: leaves[k].grad for k in GRAD_NAMES}}
            check = runner.check_summary({k: runner.rel_errors(got[k], ref[k]) for k in ref}, dtype)
            del y, got
            sync = runner.check_host_sync(fwd_bwd, device)
            mem = runner.memory_of(fwd, dy, grads, device)
            for r in recs.values():
                r.update(status="ok" if check["ok"] else "check_failed", check=check, host_sync=sync, **mem)
                if not check["ok"]:
                    r["reason"] = runner.failed_check_reason(check)
            timed += [(recs["forward"], fwd), (recs["forward+backward"], fwd_bwd)]
        except Exception as exc:  # one broken implementation must not lose the cell
            for r in recs.values():
                r["status"], r["reason"] = "error", runner.error_reason(exc)
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    del ref
    for op in OPS:
        runner.time_rounds(
            [(r, fn) for r, fn in timed if r["op"] == op], cfg.rounds, lambda fn: runner.time_ms(fn, cfg, grads)
        )
    runner.ratios_to(records, "plain")
    for r in records:
        r["cell_seconds"] = round(time.monotonic() - start, 1)  # the whole cell's wall time (budgeting)
        print_record(r)
    return records


def print_record(r: dict) -> None:
    t = f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TF" if r["ms"] else " " * 21
    ratio = f" x{r['x_plain']:.3f}" if r.get("x_plain") else "       "
    mem = (
        f" held {r['held_bytes'] / 2**30:5.2f} GiB ({r['held_x_plain']:.2f}x) peak+ "
        f"{r['peak_extra_bytes'] / 2**30:5.2f} GiB ({r['peak_extra_x_plain']:.2f}x)"
        if r.get("held_x_plain") is not None and r.get("peak_extra_x_plain") is not None
        else ""
    )
    errors = (r.get("check") or {}).get("errors") or {}
    worst = max(
        (
            math.inf if None in (e["fro"], e["worst_slice"]) else max(e["fro"], e["worst_slice"])
            for e in errors.values()
        ),
        default=None,
    )
    err = f" err {worst:.1e}" if worst is not None else ""
    note = f"  [{r['status']}: {r['reason'][:160]}]" if r["reason"] else ""
    print(f"  {r['shape']:<16} {r['dist']:<8} {r['op']:<16} {r['impl']:<7} {t}{ratio}{mem}{err}{note}", flush=True)


def summary(records: list[dict]) -> dict:
    """The MLP bars (summarize.py's) over the measured cells (the ratios of moekit to plain)."""
    mine = [r for r in records if r["impl"] == "moekit" and r.get("x_plain")]
    if not mine:
        return {}
    ratios = [r["x_plain"] for r in mine]
    qwen = [r["x_plain"] for r in mine if r["shape"].startswith("qwen")]

    def worst(key):
        values = [r[key] for r in mine if r.get(key) is not None]
        return max(values) if values else None

    return {
        "cells": len(mine),
        "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
        "min": min(ratios),
        "qwen_min": min(qwen) if qwen else None,
        "max_peak_x_plain": worst("peak_x_plain"),
        "max_peak_extra_x_plain": worst("peak_extra_x_plain"),
        "max_held_x_plain": worst("held_x_plain"),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    p.add_argument("--dists", default=",".join(runner.DISTS))
    p.add_argument("--backend", default="triton", help="moekit's backend (triton, auto, torch, loop)")
    p.add_argument("--out", type=Path, default=Path("."), help="directory for mlp_vs_plain.json")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median kept)")
    p.add_argument("--quick", action="store_true", help="short do_bench repetitions (noisier)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="start no new cell after this many seconds (the rest are recorded as skipped)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes, float32, CPU: proves the script runs")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("the full shapes need a CUDA device; use --smoke on CPU")
    pool = runner.SMOKE_SHAPES if args.smoke else runner.SHAPES
    warmup_ms, rep_ms = (10.0, 30.0) if args.quick or args.smoke else (25.0, 100.0)
    cfg = runner.BenchConfig(
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        warmup_ms=warmup_ms,
        rep_ms=rep_ms,
        smoke=args.smoke,
        quick=args.quick,
        rounds=args.rounds,
        shapes=runner.select_by_name(pool, args.shapes, "shapes", [s.name for s in pool]),
        dists=runner.select_by_name(runner.DISTS, args.dists, "dists", runner.DISTS),
        backends=[args.backend],
        out=args.out,
        plot=False,
    )
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be float32
    start = time.monotonic()
    roofs = [runner.measure_roof(cfg)]
    print(f"dense roof {roofs[0]['tflops']:.0f} TFLOP/s", flush=True)
    meta = {
        **runner.environment(cfg, roofs[0]),
        "moekit_backend": args.backend,
        "splits": runner.splits_table(cfg),
        "baseline": "plain_mlp: grouped_mm, silu(g) * u * probs, grouped_mm",
    }
    records: list[dict] = []
    path = args.out / f"{NAME}.json"
    for shape in cfg.shapes:
        for dist in cfg.dists:
            if args.max_seconds is not None and time.monotonic() - start > args.max_seconds:
                records += [
                    {
                        "bench": NAME,
                        "shape": shape.name,
                        "dist": dist,
                        "op": op,
                        "impl": impl,
                        "status": "skipped",
                        "reason": f"not run: past --max-seconds {args.max_seconds:g}",
                        "ms": None,
                        "tflops": None,
                    }
                    for impl in IMPLS
                    for op in OPS
                ]
                continue
            records += bench_cell(args, cfg, shape, dist)
            runner.write_json(path, {"meta": meta, "records": records, "partial": True})
            runner.release_memory(device)
    roofs.append(runner.measure_roof(cfg))
    meta.update(roofs=roofs, wall_s=round(time.monotonic() - start, 1))
    payload = {"meta": meta, "records": records, "summary": summary(records)}
    print("summary", payload["summary"], flush=True)
    runner.write_json(path, payload)
    return payload


if __name__ == "__main__":
    main()
