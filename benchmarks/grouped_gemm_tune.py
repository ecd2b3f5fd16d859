"""Check and time moekit's Triton grouped GEMM (src/moekit/ops/grouped_gemm.py and its kernels) on one GPU.

legend: M routed rows, G groups (experts), I in_features, O out_features, H hidden, F ffn size.

1. Correctness in bf16 (and fp16/fp32) at real sizes against float64 per-group references, next to
   torch's own error in the same precision (the tests' tolerance rule: ours <= 2x torch's + eps);
   edge cases: empty groups first/middle/last, all rows on one group, sum(m_splits) < M with NaN in
   the padding rows, odd dims (pointer path), prime G; dbias determinism; CUDA-graph capture and
   replay with other split values; no host sync (torch sync debug mode).
2. Timing of every candidate config per op against torch.nn.functional.grouped_mm and a dense
   8192^3 bf16 matmul in the same run: fc1/fc2 of Mixtral, DeepSeek-V3, Qwen3-30B-A3B, gpt-oss-20b,
   balanced and skewed (Dirichlet(1)) splits.

Writes $OUT/grouped_gemm_tune.json (rewritten after every cell, so a run cut short keeps its data).
Usage: python benchmarks/grouped_gemm_tune.py [--quick] [--only fwd,dgrad,wgrad] [--configs all|best]
"""

# ruff: noqa: E741
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import traceback

import runner
import torch
import torch.nn.functional as F
import triton

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = os.environ.get("OUT", ".")
# --dry (CPU, TRITON_INTERPRET=1, tiny shapes) only checks that this script runs end to end.
DRY = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cpu" if DRY else "cuda")
ROUNDS = 3


sys.path.insert(0, str(ROOT / "src"))
from moekit.ops import grouped_gemm as gg  # noqa: E402  (after the path set-up above)

RES: dict = {}


def dump():
    with open(os.path.join(OUT, "grouped_gemm_tune.json"), "w") as f:
        json.dump(RES, f, indent=1)


def bench(fn, rep=60):
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=15, rep=rep, return_mode="median")


def dense_roof():
    n = 256 if DRY else 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b, rep=200)
    return 2 * n**3 / ms / 1e9


def make_splits(M, G, kind):
    # The same counts as the benchmarks harness (runner.py), so tuning cells match run_all's cells.
    if kind == "balanced":
        return runner.balanced_splits(M, G)
    return runner.skewed_splits(M, G)


def offs_of(splits, dev):
    o = [0]
    for s in splits:
        o.append(o[-1] + s)
    return torch.tensor(o, device=dev, dtype=torch.int64)


# ------------------------------------------------------------------------------------------------
# correctness
# ------------------------------------------------------------------------------------------------


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def ref_fwd(x, w, offs, bias=None, scale=None, dtype=torch.float64):
    M, O = x.shape[0], w.shape[1]
    y = torch.zeros(M, O, device=x.device, dtype=dtype)
    o = offs.tolist()
    for g in range(w.shape[0]):
        a, b = o[g], o[g + 1]
        if b > a:
            y[a:b] = x[a:b].to(dtype) @ w[g].to(dtype).T
            if bias is not None:
                s = scale[a:b].to(dtype)[:, None] if scale is not None else 1.0
                y[a:b] += bias[g].to(dtype)[None] * s
    return y


def ref_dgrad(dy, w, offs, dtype=torch.float64):
    M, I = dy.shape[0], w.shape[2]
    dx = torch.zeros(M, I, device=dy.device, dtype=dtype)
    o = offs.tolist()
    for g in range(w.shape[0]):
        a, b = o[g], o[g + 1]
        if b > a:
            dx[a:b] = dy[a:b].to(dtype) @ w[g].to(dtype)
    return dx


def ref_wgrad(dy, x, offs, G, dtype=torch.float64):
    dw = torch.zeros(G, dy.shape[1], x.shape[1], device=dy.device, dtype=dtype)
    db = torch.zeros(G, dy.shape[1], device=dy.device, dtype=dtype)
    o = offs.tolist()
    for g in range(G):
        a, b = o[g], o[g + 1]
        if b > a:
            dw[g] = dy[a:b].to(dtype).T @ x[a:b].to(dtype)
            db[g] = dy[a:b].to(dtype).sum(0)
    return dw, db


def check_case(name, M, G, O, I, splits, dtype, bias=False, scale=False, nan_pad=True):
    dev = DEV
    offs = offs_of(splits, dev)
    used = sum(splits)
    x = torch.randn(M, I, device=dev, dtype=dtype)
    w = torch.randn(G, O, I, device=dev, dtype=dtype) / I**0.5
    dy = torch.randn(M, O, device=dev, dtype=dtype)
    if nan_pad and used < M:
        x[used:] = float("nan")
        dy[used:] = float("nan")
    b = torch.randn(G, O, device=dev, dtype=dtype) if bias else None
    s = torch.rand(M, device=dev, dtype=torch.float32) if scale else None
    out = {"M": M, "G": G, "O": O, "I": I, "dtype": str(dtype), "splits_head": splits[:8], "used": used}
    xs, dys = x[:used], dy[:used]
    offs_l = offs.tolist()
    # forward
    y = gg.grouped_gemm_forward(x, w, offs, b, s)
    r = ref_fwd(x, w, offs, b, s)[:used]
    rt = ref_fwd(x, w, offs, b, s, dtype=dtype)[:used]  # torch's own computation in the same precision
    out["fwd_err"], out["fwd_torch_err"] = rel(y[:used], r), rel(rt, r)
    out["fwd_pad_zero"] = bool((y[used:] == 0).all()) if used < M else True
    out["fwd_finite"] = bool(torch.isfinite(y[:used]).all())
    # dgrad
    dx = gg.grouped_gemm_dgrad(dy, w, offs)
    r = ref_dgrad(dy, w, offs)[:used]
    rt = ref_dgrad(dy, w, offs, dtype=dtype)[:used]
    out["dgrad_err"], out["dgrad_torch_err"] = rel(dx[:used], r), rel(rt, r)
    out["dgrad_pad_zero"] = bool((dx[used:] == 0).all()) if used < M else True
    # wgrad + dbias
    dw, db = gg.grouped_gemm_wgrad(dy, x, offs), gg.group_row_sum(dy, offs)
    dw2, db2 = gg.grouped_gemm_wgrad(dy, x, offs), gg.group_row_sum(dy, offs)
    r, rb = ref_wgrad(dys, xs, offs, G)
    rt, rbt = ref_wgrad(dys, xs, offs, G, dtype=dtype)
    out["wgrad_err"], out["wgrad_torch_err"] = rel(dw, r), rel(rt, r)
    out["dbias_err"], out["dbias_torch_err"] = rel(db, rb), rel(rbt, rb)
    out["wgrad_deterministic"] = bool(torch.equal(dw, dw2)) and bool(torch.equal(db, db2))
    empty = [g for g in range(G) if offs_l[g + 1] == offs_l[g]]
    out["empty_groups_zero"] = bool(all((dw[g] == 0).all() and (db[g] == 0).all() for g in empty))
    out["wgrad_finite"] = bool(torch.isfinite(dw).all())
    ok = out["fwd_pad_zero"] and out["dgrad_pad_zero"] and out["empty_groups_zero"] and out["wgrad_finite"]
    ok = ok and out["fwd_finite"] and out["wgrad_deterministic"]
    eps = 1e-6 if dtype == torch.float32 else 1e-4
    for k in ("fwd", "dgrad", "wgrad", "dbias"):
        ok = ok and out[f"{k}_err"] <= 2 * out[f"{k}_torch_err"] + eps
    out["ok"] = bool(ok)
    print(
        f"[check] {name}: ok={ok} "
        + " ".join(
            f"{k}={out[k + '_err']:.2e}/{out[k + '_torch_err']:.2e}" for k in ("fwd", "dgrad", "wgrad", "dbias")
        ),
        flush=True,
    )
    return out


def check_graph_and_sync():
    dev = DEV
    M, G, O, I = 4096, 8, 1024, 768
    x = torch.randn(M, I, device=dev, dtype=torch.bfloat16)
    w = torch.randn(G, O, I, device=dev, dtype=torch.bfloat16) / I**0.5
    dy = torch.randn(M, O, device=dev, dtype=torch.bfloat16)
    b = torch.randn(G, O, device=dev, dtype=torch.bfloat16)
    offs = offs_of([512] * 8, dev)
    # warm up (compiles + autotunes outside capture)
    for _ in range(2):
        gg.grouped_gemm_forward(x, w, offs, b)
        gg.grouped_gemm_dgrad(dy, w, offs)
        gg.grouped_gemm_wgrad(dy, x, offs)
        gg.group_row_sum(dy, offs)
    torch.cuda.synchronize()
    res = {}
    try:
        torch.cuda.set_sync_debug_mode("error")
        gg.grouped_gemm_forward(x, w, offs, b)
        gg.grouped_gemm_dgrad(dy, w, offs)
        gg.grouped_gemm_wgrad(dy, x, offs)
        gg.group_row_sum(dy, offs)
        torch.cuda.set_sync_debug_mode(0)
        res["sync_free"] = True
    except Exception as exc:
        torch.cuda.set_sync_debug_mode(0)
        res["sync_free"] = str(exc)[:300]
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            y = gg.grouped_gemm_forward(x, w, offs, b)
            dx = gg.grouped_gemm_dgrad(dy, w, offs)
            dw, db = gg.grouped_gemm_wgrad(dy, x, offs), gg.group_row_sum(dy, offs)
    torch.cuda.current_stream().wait_stream(s)
    errs = []
    for splits in ([0, 1000, 0, 1500, 3, 0, 1000, 500], [4000, 0, 0, 0, 0, 0, 0, 0], [100] * 8):
        offs.copy_(offs_of(splits, dev))
        graph.replay()
        torch.cuda.synchronize()
        ye = gg.grouped_gemm_forward(x, w, offs, b)
        dxe = gg.grouped_gemm_dgrad(dy, w, offs)
        dwe, dbe = gg.grouped_gemm_wgrad(dy, x, offs), gg.group_row_sum(dy, offs)
        errs.append(bool(torch.equal(y, ye) and torch.equal(dx, dxe) and torch.equal(dw, dwe) and torch.equal(db, dbe)))
    res["graph_replay_matches_eager"] = errs
    print("[check] graph/sync:", res, flush=True)
    return res


def run_checks():
    out = {}
    torch.manual_seed(0)
    cases = [
        (
            "gptoss_dims_edges_bias_scale",
            8192,
            8,
            2880,
            2880,
            [0, 1500, 0, 2000, 777, 1901, 1000, 0],
            torch.bfloat16,
            True,
            True,
        ),
        ("prime_G_skewed", 6000, 7, 1536, 2048, [1, 2999, 0, 1000, 17, 1200, 700], torch.bfloat16, True, False),
        ("all_rows_one_group", 4096, 4, 1024, 512, [0, 0, 4096, 0], torch.bfloat16, False, False),
        ("one_row", 64, 3, 256, 128, [0, 1, 0], torch.bfloat16, True, True),
        ("odd_dims_pointer_path", 1000, 5, 97, 33, [0, 300, 0, 450, 200], torch.bfloat16, True, True),
        ("fp16", 3000, 5, 640, 384, [100, 0, 1999, 800, 0], torch.float16, True, False),
        ("fp32", 2000, 3, 320, 192, [0, 1500, 400], torch.float32, True, True),
        ("small_dims", 500, 6, 16, 8, [10, 0, 90, 300, 0, 50], torch.bfloat16, False, False),
    ]
    if DRY:
        cases = [c for c in cases if c[1] <= 1000]
    for name, M, G, O, I, splits, dt, bias, scale in cases:
        try:
            out[name] = check_case(name, M, G, O, I, splits, dt, bias, scale)
        except Exception:
            out[name] = {"error": traceback.format_exc()[-2000:]}
            print(f"[check] {name}: ERROR\n{traceback.format_exc()}", flush=True)
        RES["checks"] = out
        dump()
    if DRY:
        return
    gg.set_autotune(True)
    try:
        out["graph_sync"] = check_graph_and_sync()
    except Exception:
        out["graph_sync"] = {"error": traceback.format_exc()[-2000:]}
        print(traceback.format_exc(), flush=True)
    RES["checks"] = out
    dump()


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

MODELS = {
    "mixtral": (32768, 8, 4096, 14336),
    "deepseek_v3": (16384, 32, 7168, 2048),
    "qwen3_30b_a3b": (131072, 128, 2048, 768),
    "gpt_oss_20b": (65536, 32, 2880, 2880),
}


def op_fns(op, x, w, dy, offs, offs32):
    """(torch callable, config -> our callable, N of the op) for one op on one problem."""
    if op == "fwd":
        return (
            lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs32),
            lambda cfg: lambda: gg.grouped_gemm_forward(x, w, offs, cfg=cfg, use_tma=True),
            w.shape[1],
        )
    if op == "dgrad":
        return (
            lambda: F.grouped_mm(dy, w, offs=offs32),
            lambda cfg: lambda: gg.grouped_gemm_dgrad(dy, w, offs, cfg=cfg, use_tma=True),
            w.shape[2],
        )
    return (
        lambda: F.grouped_mm(dy.t(), x, offs=offs32),
        lambda cfg: lambda: gg.grouped_gemm_wgrad(dy, x, offs, cfg=cfg, use_tma=True),
        x.shape[1],
    )


def run_timing(ops, config_mode, dists):
    dev = DEV
    cells = []
    RES["cells"] = cells
    torch.manual_seed(1)
    models = {"tiny": (256, 4, 64, 48)} if DRY else MODELS
    for model, (M, G, H, Fd) in models.items():
        for layer, (I, O) in (("fc1", (H, 2 * Fd)), ("fc2", (Fd, H))):
            x = torch.randn(M, I, device=dev, dtype=torch.bfloat16)
            w = torch.randn(G, O, I, device=dev, dtype=torch.bfloat16) / I**0.5
            dy = torch.randn(M, O, device=dev, dtype=torch.bfloat16)
            flops = 2.0 * M * O * I
            for dist in dists:
                splits = make_splits(M, G, dist)
                offs = offs_of(splits, dev)
                offs32 = offs[1:].to(torch.int32)
                for op in ops:
                    cell = {
                        "model": model,
                        "layer": layer,
                        "dist": dist,
                        "op": op,
                        "M": M,
                        "G": G,
                        "I": I,
                        "O": O,
                        "max_split": max(splits),
                        "empty": sum(1 for s in splits if s == 0),
                    }
                    try:
                        tfn, mk, n = op_fns(op, x, w, dy, offs, offs32)
                        cands = gg._candidates(op, torch.bfloat16, True, (9, 0), n)
                        if config_mode == "best":
                            cands = cands[:1]
                        # The H200's clocks drift during a run (dense roof 790 -> 665 TFLOP/s seen in
                        # one), so torch and every config are timed in ROUNDS interleaved rounds, each
                        # round in a rotated order, and each keeps its median.
                        runs = {"torch": tfn, **{str(cfg): mk(cfg) for cfg in cands}}
                        times = {name: [] for name in runs}
                        names = list(runs)
                        for rnd in range(ROUNDS):
                            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                                try:
                                    times[name].append(bench(runs[name]))
                                except Exception as exc:
                                    times[name].append(f"error: {str(exc)[:300]}")
                        tflops = {
                            name: [flops / t / 1e9 if isinstance(t, float) else t for t in ts]
                            for name, ts in times.items()
                        }
                        cell["torch_tflops_runs"] = tflops.pop("torch")
                        cell["torch_tflops"] = statistics.median(cell["torch_tflops_runs"])
                        cell["ours_runs"] = tflops
                        cell["ours"] = {
                            name: (
                                statistics.median(v)
                                if all(isinstance(t, float) for t in v)
                                else next(t for t in v if isinstance(t, str))
                            )
                            for name, v in tflops.items()
                        }
                        good = [v for v in cell["ours"].values() if isinstance(v, float)]
                        cell["best_tflops"] = max(good) if good else None
                        cell["ratio"] = cell["best_tflops"] / cell["torch_tflops"] if good else None
                    except Exception:
                        cell["error"] = traceback.format_exc()[-1500:]
                    cells.append(cell)
                    dump()
                    ours = " ".join(
                        f"{v:6.1f}" if isinstance(v, float) else "ERR" for v in cell.get("ours", {}).values()
                    )
                    print(
                        f"[time] {model:14s} {layer} {dist:8s} {op:5s} torch={cell.get('torch_tflops', 0):6.1f} "
                        f"{ours}  ratio={cell.get('ratio') or 0:.3f}",
                        flush=True,
                    )
            del x, w, dy
            if not DRY:
                torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="fwd,dgrad,wgrad")
    p.add_argument("--configs", default="all", choices=["all", "best"])
    p.add_argument("--dists", default="balanced,skewed")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args()
    t0 = time.time()
    RES["env"] = {
        "gpu": "dry" if DRY else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": os.environ.get("MOEKIT_BENCH_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
    }
    RES["dense_roof_tflops_before"] = dense_roof()
    print("dense roof", RES["dense_roof_tflops_before"], flush=True)
    if not args.skip_checks:
        # One config per kernel variant here (compiles cost device time); the graph/sync check
        # turns autotuning back on so that the tuning path runs too.
        gg.set_autotune(False)
        run_checks()
        gg.set_autotune(True)
    print(f"checks done at {time.time() - t0:.0f}s", flush=True)
    if not args.skip_timing:
        run_timing(args.only.split(","), args.configs, args.dists.split(","))
    RES["dense_roof_tflops_after"] = dense_roof()
    RES["wall_s"] = time.time() - t0
    dump()
    cells = [c for c in RES.get("cells", []) if c.get("ratio")]
    if cells:
        import math

        geo = math.exp(sum(math.log(c["ratio"]) for c in cells) / len(cells))
        RES["geomean_ratio"] = geo
        RES["min_ratio"] = min(c["ratio"] for c in cells)
        dump()
        print(
            f"geomean ratio vs torch {geo:.3f}, min {RES['min_ratio']:.3f}; roof "
            f"{RES['dense_roof_tflops_before']:.0f}/{RES['dense_roof_tflops_after']:.0f}; wall {RES['wall_s']:.0f}s"
        )


if __name__ == "__main__":
    main()
