"""moekit.grouped_mlp (triton, with probs) against the plain PyTorch of issue 10 (`plain_mlp`), in one
process, interleaved rounds (median of 3), dense 8192^3 bf16 roof measured in the same run.

Legend: M routed rows, N experts, H hidden size, F ffn size.

Per (shape, balanced/skewed splits): bf16 check of output, d x, d w1, d w2, d probs against a float32
per-group reference; forward and forward+backward TFLOP/s (fwd = 6 M H F, fwd+bwd = 3x); peak memory
of forward+backward (absolute, and above what was allocated before); memory held between forward
and backward (allocated after the forward minus before, output excluded). Writes $OUT/mlp_vs_plain.json
(commit from MOEKIT_BENCH_COMMIT). Usage: python benchmarks/bench_mlp_vs_plain.py [--quick] [--shapes a,b]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics

import runner
import torch
import torch.nn.functional as F
import triton

import moekit


def plain_mlp(x, w1, w2, offs, probs):  # offs = cumsum(m_splits) as int32 (issue 10, verbatim)
    h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, -1)
    return torch._grouped_mm(F.silu(g) * u * probs[:, None].to(x.dtype), w2.transpose(-2, -1), offs=offs)


def _errors(got: dict, ref: dict) -> dict:
    out = {}
    for k, r in ref.items():
        g = got[k].float()
        diff = (g - r).norm().item() / max(r.norm().item(), 1e-30)
        # worst over row blocks (64 rows of a vector, one expert of a weight, one row of a matrix)
        gb, rb = (g.reshape(-1, 64), r.reshape(-1, 64)) if g.dim() == 1 else (g.flatten(1), r.flatten(1))
        worst = ((gb - rb).norm(dim=1) / rb.norm(dim=1).clamp_min(1e-6 * r.norm().item() + 1e-30)).max().item()
        out[k] = {"fro": diff if math.isfinite(diff) else None, "worst_block": worst if math.isfinite(worst) else None}
    return out


def _memory(fwd, dy, leaves) -> dict:
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = fwd()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
    y.backward(dy)
    del y
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    for t in leaves:
        t.grad = None
    return {"held_bytes": held, "peak_bytes": peak, "peak_extra_bytes": peak - before}


def bench_cell(shape, dist, rounds, rep_ms):
    M, N, H, Fd = shape.rows, shape.experts, shape.hidden, shape.ffn
    splits = runner.make_splits(shape, dist)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(M, H, device="cuda", dtype=bf, generator=gen).requires_grad_()
    w1 = (torch.randn(N, 2 * Fd, H, device="cuda", generator=gen) * H**-0.5).to(bf).requires_grad_()
    w2 = (torch.randn(N, H, Fd, device="cuda", generator=gen) * Fd**-0.5).to(bf).requires_grad_()
    probs = torch.rand(M, device="cuda", generator=gen).requires_grad_()
    dy = torch.randn(M, H, device="cuda", dtype=bf, generator=gen)
    leaves = [x, w1, w2, probs]
    m_splits = torch.tensor(splits, device="cuda")
    offs32 = torch.cumsum(m_splits, 0).to(torch.int32)
    fns = {
        "plain": lambda: plain_mlp(x, w1, w2, offs32, probs),
        "moekit": lambda: moekit.grouped_mlp(x, w1, w2, m_splits, probs=probs, backend="triton"),
    }
    # float32 reference: per-group loop
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    y_ref = moekit.grouped_mlp(*ref_leaves[:3], splits, probs=ref_leaves[3], backend="loop")
    y_ref.backward(dy.float())
    ref = {"out": y_ref.detach(), **{k: t.grad for k, t in zip(("x", "w1", "w2", "probs"), ref_leaves, strict=True)}}
    del y_ref, ref_leaves
    cell = {"shape": shape.name, "dist": dist, "M": M, "N": N, "H": H, "F": Fd, "max_split": max(splits)}
    for name, fwd in fns.items():
        for t in leaves:
            t.grad = None
        y = fwd()
        y.backward(dy)
        cell[f"{name}_check"] = _errors({"out": y.detach(), "x": x.grad, "w1": w1.grad, "w2": w2.grad,
                                         "probs": probs.grad}, ref)
        del y
        cell[f"{name}_memory"] = _memory(fwd, dy, leaves)
    del ref
    flops = 6 * M * H * Fd
    for op, mult in (("fwd", 1), ("fwd+bwd", 3)):
        runs = {n: (f if op == "fwd" else (lambda f=f: f().backward(dy))) for n, f in fns.items()}
        times = {n: [] for n in runs}
        names = list(runs)
        for rnd in range(rounds):
            for n in names[rnd % 2:] + names[:rnd % 2]:
                times[n].append(triton.testing.do_bench(runs[n], warmup=25, rep=rep_ms, grad_to_none=leaves,
                                                        return_mode="median"))
        for n in names:
            ms = statistics.median(times[n])
            cell[f"{n}_{op}_ms"], cell[f"{n}_{op}_ms_rounds"] = ms, times[n]
            cell[f"{n}_{op}_tflops"] = mult * flops / ms / 1e9
        cell[f"ratio_{op}"] = cell[f"plain_{op}_ms"] / cell[f"moekit_{op}_ms"]
    pm, mm = cell["plain_memory"], cell["moekit_memory"]
    cell["ratio_peak"] = mm["peak_bytes"] / pm["peak_bytes"]
    cell["ratio_peak_extra"] = mm["peak_extra_bytes"] / pm["peak_extra_bytes"]
    cell["ratio_held"] = mm["held_bytes"] / pm["held_bytes"]
    print(f"{shape.name:16} {dist:8} fwd {cell['moekit_fwd_tflops']:6.1f} vs {cell['plain_fwd_tflops']:6.1f} "
          f"({cell['ratio_fwd']:.3f}x)  fwd+bwd {cell['moekit_fwd+bwd_tflops']:6.1f} vs "
          f"{cell['plain_fwd+bwd_tflops']:6.1f} ({cell['ratio_fwd+bwd']:.3f}x)  peak {cell['ratio_peak']:.2f}x "
          f"(extra {cell['ratio_peak_extra']:.2f}x) held {cell['ratio_held']:.2f}x  "
          f"err out {cell['moekit_check']['out']['fro']:.1e} dp {cell['moekit_check']['probs']['fro']:.1e}",
          flush=True)
    return cell


def roof():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shapes", default=None)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = runner.select_by_name(runner.SHAPES, args.shapes, "shapes", [s.name for s in runner.SHAPES])
    out = os.path.join(os.environ.get("OUT", "."), "mlp_vs_plain.json")
    res = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "python": platform.python_version(), "git_commit": os.environ.get("MOEKIT_BENCH_COMMIT"),
                    "rounds": 1 if args.quick else 3, "timer": "do_bench median, interleaved rounds"},
           "cells": []}
    res["meta"]["roof_start_tflops"] = roof()
    print(f"dense roof {res['meta']['roof_start_tflops']:.0f} TFLOP/s", flush=True)
    for shape in shapes:
        for dist in runner.DISTS:
            try:
                res["cells"].append(bench_cell(shape, dist, res["meta"]["rounds"], 40 if args.quick else 100))
            except Exception as exc:  # keep the other cells of a scarce run
                res["cells"].append({"shape": shape.name, "dist": dist, "error": runner.error_reason(exc)})
                print("ERROR", shape.name, dist, runner.error_reason(exc), flush=True)
            torch.cuda.empty_cache()
            with open(out, "w") as f:
                json.dump(res, f, indent=1)
    res["meta"]["roof_end_tflops"] = roof()
    ok = [c for c in res["cells"] if "error" not in c]
    ratios = [c[f"ratio_{op}"] for c in ok for op in ("fwd", "fwd+bwd")]
    if ratios:
        res["summary"] = {
            "geomean": math.exp(sum(math.log(r) for r in ratios) / len(ratios)), "min": min(ratios),
            "qwen_min": min([c[f"ratio_{op}"] for c in ok if c["shape"].startswith("qwen") for op in
                             ("fwd", "fwd+bwd")] or [float("nan")]),
            "max_peak_ratio": max(c["ratio_peak"] for c in ok),
            "max_peak_extra_ratio": max(c["ratio_peak_extra"] for c in ok),
            "max_held_ratio": max(c["ratio_held"] for c in ok),
        }
        print("summary", json.dumps(res["summary"]), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
