"""Benchmark of the MoE layer's routed experts given the routing: moekit.moe_experts against the plain
PyTorch a user would write (`plain_layer`) and Liger-Kernel's fused MoE, with the dense 8192^3 bf16
matmul roof measured in the same process.

Legend: T tokens, N experts, K experts per token, M = T*K routed rows, H hidden size, F ffn size.

Every cell (shape x routing) times the implementations' forward and forward+backward in
interleaved rounds (the order rotates each round; each keeps its median of the rounds), so they are
compared at the same clocks. Inputs require grad (a training forward). FLOPs: forward =
2*M*H*2F + 2*M*F*H, forward+backward = 3x forward. Memory per implementation: the peak allocated
during one forward+backward above what was allocated before it, and the activation memory held for
the backward (allocated after the forward, its output excluded, minus before). Each
implementation's output and gradients (x, weights, fc1, fc2) are compared with plain_layer's.

Routing: "balanced" draws each token's K distinct experts uniformly; "skewed" draws them with
probabilities from Dirichlet(1) expert shares (seed runner.SKEW_SEED), as the MLP benchmark's
skewed splits. Weights: a softmax over K of random logits, in the tokens' dtype.

Router included (`--router`): the cell draws a router weight (N, H) instead of the routing, and every
column routes inside its timed call with SonicMoE's rule: logits = x @ router_w.T in x's dtype, the
top-K logits, a softmax over those K in fp32 = softmax over all N experts, top-K, renormalised; the
weights cast to x's dtype for moekit, plain and Liger. plain and Liger route with torch
(`softmax_topk`: torch.topk and a softmax); the moekit column with moekit's own router op
(`moekit_softmax_topk`: `moekit.topk_softmax`, one kernel each way on CUDA, with int32 ids as
SonicMoE's router keeps them: what it saves for its backward is then the same size), as a moekit user
would.
The router weight is then a leaf whose gradient is compared too, and the FLOPs count the router GEMM
(2*T*H*N forward). "skewed" under --router: the tokens share an offset along which the logits gain
log(Dirichlet(1) shares) per expert (SonicMoE's router has no bias), so the counts differ from the
experts-only skew (see each record's expert_counts_min_max). Ties among bf16 logits may route a few
tokens to different experts in SonicMoE's kernel, moekit's op (the lower expert first) and
torch.topk (unspecified order): a small error vs plain, not the O(1) of a wrong weight layout.

SonicMoE (Dao-AILab/sonic-moe, `moe_TC_softmax_topk_layer`: router + experts, SwiGLU, no bias) is a
column under --router when importable on CUDA (the bundle of benchmarks/README.md; not on the package
index): same x, router weight and experts as the others, its fc1 converted once, outside the timing,
to its gate/up interleave-1 layout (`moekit.interleave_glu(w1, 1, dim=1)`, its gradient converted back
for the comparison). Every column's first forward+backward (compilation, autotuning; SonicMoE's JIT,
10-110 s per shape) is timed apart as `first_call_s`. Without --router, or where it cannot import, the
column is recorded "unavailable" with the reason. `--impls` selects columns (plain, the reference,
always runs).

Liger-Kernel (`pip install 'moekit[bench]'`) is timed when importable. Its autotuner benchmarks
32 configs per kernel and shape; `--liger-autotune` turns that on, by default it runs its one
pinned config (LIGER_FUSED_MOE_AUTOTUNE=0, Liger's own setting), which the JSON records.

    python benchmarks/bench_moe_layer.py --out $OUT --commit <git commit>
    python benchmarks/bench_moe_layer.py --quick --shapes qwen3-30b-a3b,mixtral-8x7b
    python benchmarks/bench_moe_layer.py --smoke --backend torch   # tiny shapes, CPU is fine
    python benchmarks/bench_moe_layer.py --router --shapes sonicmoe --dists balanced   # + SonicMoE

Writes OUT/moe_layer.json (rewritten after every cell, so a run cut short keeps its cells) and
OUT/moe_layer.png. The commit recorded is --commit's, else MOEKIT_BENCH_COMMIT's, else git's.
"""

from __future__ import annotations

import argparse
import os
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import runner
import torch
import torch.nn.functional as F

import moekit

NAME = "moe_layer"
IMPLS = ("moekit", "plain", "liger", "sonicmoe")
OPS = ("forward", "forward+backward")


@dataclass(frozen=True)
class LayerShape:
    name: str
    tokens: int
    experts: int
    top_k: int
    hidden: int
    ffn: int


# In the order they are run (a run cut short by --max-seconds keeps the first ones).
SHAPES = (
    LayerShape("qwen3-30b-a3b", 32768, 128, 8, 2048, 768),
    LayerShape("deepseek-v3-ep8", 16384, 32, 8, 7168, 2048),
    LayerShape("gpt-oss-20b", 16384, 32, 4, 2880, 2880),
    LayerShape("mixtral-8x7b", 16384, 8, 2, 4096, 14336),
    LayerShape("qwen3-1024tok", 1024, 128, 8, 2048, 768),
    LayerShape("qwen3-256tok", 256, 128, 8, 2048, 768),
    LayerShape("qwen3-4096tok", 4096, 128, 8, 2048, 768),
    LayerShape("sonicmoe", 32768, 128, 8, 4096, 512),
)
# Other real MoE models' layers (16384 tokens, all experts on one GPU), run with `--shapes other`
# (or by name): the bars must hold beyond the four shapes above, at other hidden and ffn sizes,
# expert counts (60 and 160 too) and top-k.
OTHER_SHAPES = (
    LayerShape("qwen3-235b-a22b", 16384, 128, 8, 4096, 1536),
    LayerShape("deepseek-v2", 16384, 160, 6, 5120, 1536),
    LayerShape("dbrx", 16384, 16, 4, 6144, 10752),
    LayerShape("mixtral-8x22b", 16384, 8, 2, 6144, 16384),
    LayerShape("qwen2-57b-a14b", 16384, 64, 8, 3584, 2560),
    LayerShape("phi-3.5-moe", 16384, 16, 2, 4096, 6400),
    LayerShape("olmoe-1b-7b", 16384, 64, 8, 2048, 1024),
    LayerShape("qwen1.5-moe-a2.7b", 16384, 60, 4, 2048, 1408),
    LayerShape("granite-3.0-3b-a800m", 16384, 40, 8, 1536, 512),
)
# SonicMoE's fine-grained configurations (its paper's 30B and 7B settings and E64/K4/F1024), by name.
SONICMOE_SHAPES = (
    LayerShape("sonicmoe-e256-k16", 32768, 256, 16, 4096, 256),
    LayerShape("sonicmoe-e64-k4", 32768, 64, 4, 4096, 1024),
    LayerShape("sonicmoe-7b", 24576, 128, 8, 1536, 256),
)
SMOKE_SHAPES = (LayerShape("smoke", 64, 6, 2, 32, 48), LayerShape("smoke-top1", 40, 4, 1, 64, 32))


# --------------------------------------------------------------------------------------------------
# The implementations: (x, fc1_weight, fc2_weight, topk_ids, topk_weights) -> (T, H)
# --------------------------------------------------------------------------------------------------


def plain_layer(x, w1, w2, topk_ids, topk_weights):
    """The plain PyTorch layer a user would write: x (T, H), ids/weights (T, K)."""
    T, K = topk_ids.shape
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    offs = torch.bincount(topk_ids.reshape(-1), minlength=w1.shape[0]).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[order // K], w1.transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, -1)
    y = torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, order // K, y)


def moekit_layer(backend: str):
    def run(x, w1, w2, topk_ids, topk_weights):
        return moekit.moe_experts(x, topk_ids, topk_weights, w1, w2, backend=backend)

    return run


def liger_layer():
    """Liger-Kernel's fused MoE, or the reason it cannot run here."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as exc:
        return None, f"liger_kernel not importable ({exc}); pip install 'moekit[bench]'"

    def run(x, w1, w2, topk_ids, topk_weights):
        return LigerFusedMoEFunction.apply(x, w1, w2, topk_ids, topk_weights)

    return run, None


def softmax_topk(x, router_w, top_k):
    """SonicMoE's routing rule (its TC_Softmax_Topk_Router_Function after F.linear(x, router_w)): the
    top-k logits and a softmax over them in fp32, which is the softmax over all experts, top-k and
    renormalised. Weights returned in x's dtype (the experts-only columns take them so)."""
    top, ids = F.linear(x, router_w).topk(top_k, dim=-1)
    return ids, top.softmax(-1, dtype=torch.float32).to(x.dtype)


def moekit_softmax_topk(x, router_w, top_k):
    """The same rule with moekit's router op (`moekit.topk_softmax`: the top-k logits and their softmax in
    fp32 in one kernel on CUDA, torch ops on the CPU). Weights returned in x's dtype."""
    weights, ids = moekit.topk_softmax(F.linear(x, router_w), top_k, ids_dtype=torch.int32)
    return ids, weights.to(x.dtype)


def with_router(fn, ids_dtype=torch.int64, route=softmax_topk):
    """An experts-only column with the router `route` in front: (x, fc1, fc2, router_w, top_k) -> (T, H)."""

    def run(x, w1, w2, router_w, top_k):
        ids, weights = route(x, router_w, top_k)
        return fn(x, w1, w2, ids.to(ids_dtype), weights)

    return run


def sonicmoe_layer():
    """SonicMoE's router + experts call, or the reason it cannot run here. Takes fc1 in its layout:
    (N, 2F, H) with gate/up interleaved by 1 (moekit.interleave_glu(w1, 1, dim=1)); fc2 (N, H, F) as
    moekit's. Both are passed as w.permute(1, 2, 0), as SonicMoE's own benchmark and MoE module do."""
    try:
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_TC_softmax_topk_layer
    except Exception as exc:  # ImportError, or CuTeDSL / quack failing to load
        return None, (
            f"sonicmoe not importable ({runner.error_reason(exc)}); "
            "see benchmarks/README.md (SonicMoE bundle, PYTHONPATH)"
        )

    def run(x, w1_interleaved, w2, router_w, top_k):
        out, _router_logits, _expert_frequency = moe_TC_softmax_topk_layer(
            x,
            router_w,
            w1_interleaved.permute(1, 2, 0),
            None,
            w2.permute(1, 2, 0),
            None,
            top_k,
            torch.cuda.current_stream().cuda_stream,
            ActivationType.SWIGLU,
            False,  # is_inference_mode_enabled: a training forward, as the other columns
        )
        return out

    return run, None


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def make_routing(shape: LayerShape, dist: str, device, dtype, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    if dist == "balanced":
        shares = torch.ones(shape.experts, dtype=torch.float64)
    else:
        shares = torch.from_numpy(np.random.default_rng(runner.SKEW_SEED).dirichlet(np.ones(shape.experts)))
    probs = shares.to(device=device, dtype=torch.float32).expand(shape.tokens, shape.experts)
    ids = torch.multinomial(probs, shape.top_k, replacement=False, generator=gen)
    logits = torch.randn(shape.tokens, shape.top_k, device=device, generator=gen)
    return ids, logits.softmax(-1).to(dtype)


def make_router(shape: LayerShape, dist: str, device, dtype, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Router weight (N, H), and the offset (H,) added to every token: zero for "balanced"; for
    "skewed" the least-norm m with router_w @ m = log(Dirichlet(1) shares), so the logits gain a
    per-expert bias (SonicMoE's router has none)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    N, H = shape.experts, shape.hidden
    router_w = (torch.randn(N, H, device=device, generator=gen) * H**-0.5).to(dtype)
    if dist == "balanced":
        return router_w, torch.zeros(H, device=device, dtype=dtype)
    shares = np.random.default_rng(runner.SKEW_SEED).dirichlet(np.ones(N))
    bias = torch.from_numpy(np.log(shares))
    w = router_w.cpu().double()
    offset = w.T @ torch.linalg.solve(w @ w.T, bias)
    return router_w, offset.to(device=device, dtype=dtype)


def make_inputs(shape: LayerShape, device, dtype, seed: int = 0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    T, N, H, Fs = shape.tokens, shape.experts, shape.hidden, shape.ffn
    return {
        "x": torch.randn(T, H, device=device, dtype=dtype, generator=gen),
        "w1": (torch.randn(N, 2 * Fs, H, device=device, generator=gen) * H**-0.5).to(dtype),
        "w2": (torch.randn(N, H, Fs, device=device, generator=gen) * Fs**-0.5).to(dtype),
    }


# --------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------


def outputs_and_grads(fn_fwd, dy, leaves: dict) -> dict:
    for t in leaves.values():
        t.grad = None
    y = fn_fwd()
    y.backward(dy)
    res = {"out": y.detach().float(), **{k: t.grad.float() for k, t in leaves.items()}}
    for t in leaves.values():
        t.grad = None
    return res


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float | None:
    err = ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if np.isfinite(err) else None


def bench_cell(args, cfg: runner.BenchConfig, shape: LayerShape, dist: str, impls: dict, reasons: dict) -> list[dict]:
    device, dtype = args.device, args.dtype
    start = time.monotonic()
    base = make_inputs(shape, device, dtype)
    dy = torch.randn(
        shape.tokens, shape.hidden, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(1)
    )
    M = shape.tokens * shape.top_k
    flops_fwd = 2 * M * shape.hidden * 2 * shape.ffn + 2 * M * shape.ffn * shape.hidden
    if args.router:
        router_w, offset = make_router(shape, dist, device, dtype)
        x = (base["x"] + offset).requires_grad_(True)
        leaves = {"x": x, "router_weight": router_w.requires_grad_(True)}
        with torch.no_grad():
            ids, _ = softmax_topk(x, router_w, shape.top_k)  # the routing every column computes (the counts)
        flops_fwd += 2 * shape.tokens * shape.hidden * shape.experts
    else:
        ids, weights = make_routing(shape, dist, device, dtype)
        ids32 = ids.to(torch.int32)  # Liger takes int32 ids; converted once, outside the timing
        leaves = {"x": base["x"].requires_grad_(True), "topk_weights": weights.requires_grad_(True)}
    leaves.update(fc1_weight=base["w1"].requires_grad_(True), fc2_weight=base["w2"].requires_grad_(True))
    w1_interleaved = None
    if "sonicmoe" in impls and not reasons.get("sonicmoe"):
        # SonicMoE's fc1 layout (gate/up interleaved by 1), converted once outside the timing.
        w1_interleaved = moekit.interleave_glu(base["w1"].detach(), 1, dim=1).requires_grad_(True)
    grads = list(leaves.values()) + ([w1_interleaved] if w1_interleaved is not None else [])
    counts = torch.bincount(ids.reshape(-1), minlength=shape.experts)
    records, timed = [], []
    ref = None
    # plain first: its output and gradients are what the others are compared with.
    for impl, fn in sorted(impls.items(), key=lambda item: item[0] != "plain"):
        impl_leaves = dict(leaves, fc1_weight=w1_interleaved) if impl == "sonicmoe" else leaves
        if args.router:

            def fwd(fn=fn, lv=impl_leaves):
                return fn(lv["x"], lv["fc1_weight"], lv["fc2_weight"], lv["router_weight"], shape.top_k)
        else:
            call_ids = ids32 if impl == "liger" else ids

            def fwd(fn=fn, call_ids=call_ids, lv=impl_leaves):
                return fn(lv["x"], lv["fc1_weight"], lv["fc2_weight"], call_ids, lv["topk_weights"])

        def fwd_bwd(fwd=fwd):
            fwd().backward(dy)

        recs = {
            op: {
                "bench": NAME,
                **asdict(shape),
                "shape": shape.name,
                "dist": dist,
                "op": op,
                "impl": impl,
                "router": args.router,
                "flops": flops_fwd * (1 if op == "forward" else 3),
                "status": None,
                "reason": None,
                "ms": None,
                "ms_rounds": [],
                "tflops": None,
            }
            for op in OPS
        }
        records += recs.values()
        if reasons.get(impl):
            for r in recs.values():
                r["status"], r["reason"] = "unavailable", reasons[impl]
            continue
        try:
            runner.sync(device)
            t0 = time.perf_counter()
            got = outputs_and_grads(fwd, dy, impl_leaves)  # first call: compilation, autotuning, JIT
            runner.sync(device)
            first_call_s = round(time.perf_counter() - t0, 3)
            if impl == "sonicmoe":  # its fc1 gradient back to moekit's gate|up layout for the comparison
                got["fc1_weight"] = moekit.deinterleave_glu(got["fc1_weight"], 1, dim=1)
            if impl == "plain":
                ref = got
            errors = {k: rel_err(got[k], ref[k]) for k in got} if ref is not None else None
            # Only the reference stays allocated while memory is measured, so every implementation
            # starts from the same allocation (a second set of fp32 gradients would not).
            del got
            sync = runner.check_host_sync(fwd_bwd, device)
            mem = runner.memory_of(fwd, dy, list(impl_leaves.values()), device)
            for r in recs.values():
                r.update(status="ok", errors_vs_plain=errors, host_sync=sync, first_call_s=first_call_s, **mem)
            timed += [(recs["forward"], fwd), (recs["forward+backward"], fwd_bwd)]
        except Exception as exc:  # one broken cell must not lose the rest of the run
            for r in recs.values():
                r["status"], r["reason"] = "error", runner.error_reason(exc)
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    for op in OPS:
        runner.time_rounds(
            [(r, fn) for r, fn in timed if r["op"] == op], args.rounds, lambda fn: runner.time_ms(fn, cfg, grads)
        )
    if args.kernels:
        for r, fn in timed:
            for t in grads:  # as before every timed call: the backward does not accumulate
                t.grad = None
            try:
                r.update(runner.kernel_profile(fn, device))
            except Exception as exc:  # the timing stands without the profile
                r["kernels_error"] = runner.error_reason(exc)
        for t in grads:
            t.grad = None
    runner.ratios_to(records, "plain")
    for r in records:
        r["expert_counts_min_max"] = [int(counts.min()), int(counts.max())]
        r["cell_seconds"] = round(time.monotonic() - start, 1)  # the whole cell's wall time (budgeting)
        print_record(r)
    return records


def skipped_records(shape: LayerShape, dist: str, reason: str) -> list[dict]:
    return [
        {
            "bench": NAME,
            **asdict(shape),
            "shape": shape.name,
            "dist": dist,
            "op": op,
            "impl": impl,
            "status": "skipped",
            "reason": reason,
            "ms": None,
            "tflops": None,
        }
        for impl in IMPLS
        for op in OPS
    ]


def print_record(r: dict) -> None:
    t = f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TF" if r["ms"] else " " * 21
    ratio = f" x{r['x_plain']:.2f}" if r.get("x_plain") else "      "
    held = r.get("held_bytes")
    mem = f" held {held / 2**30:5.2f} GiB peak+ {r['peak_extra_bytes'] / 2**30:5.2f} GiB" if held is not None else ""
    note = f"  [{r['status']}: {r['reason'][:120]}]" if r["reason"] else ""
    print(f"  {r['shape']:<16} {r['dist']:<8} {r['op']:<16} {r['impl']:<7} {t}{ratio}{mem}{note}", flush=True)


def print_kernels(records: list[dict], top: int = 12) -> None:
    """Each profiled cell's largest kernels (names cut to 70 characters)."""
    for r in records:
        if not r.get("kernels"):
            continue
        print(f"\n{r['shape']} {r['dist']} {r['op']} {r['impl']}: {r['kernel_ms']:.3f} ms of {r['kernels_of']}")
        for k in r["kernels"][:top]:
            print(f"  {k['ms']:8.3f} ms {k['launches']:4d}x  {k['name'][:70]}")


# --------------------------------------------------------------------------------------------------
# Table and plot
# --------------------------------------------------------------------------------------------------


def print_table(records: list[dict], roofs: list[dict]) -> None:
    print("\ndense roof: " + ", ".join(f"{r['tflops']:.1f}" for r in roofs) + " TFLOP/s (bf16 8192^3)")
    header = (
        f"{'shape':<16} {'dist':<8} {'op':<16} "
        + " ".join(f"{i + ' TF':>10}" for i in IMPLS)
        + f" {'moekit/plain':>12} {'liger/plain':>11} {'sonic/plain':>11}"
        f" {'held GiB m/p/l/s':>22} {'peak+ m/p/l/s':>22} {'max err':>8}"
    )
    print(header)
    print("-" * len(header))
    cells = list(dict.fromkeys((r["shape"], r["dist"], r["op"]) for r in records))
    by = {(r["shape"], r["dist"], r["op"], r["impl"]): r for r in records}

    def f(v, spec):
        return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0])

    for cell in cells:
        rs = [by.get((*cell, i), {}) for i in IMPLS]
        tf = " ".join(f(r.get("tflops"), "10.1f") for r in rs)
        gib = [r.get("held_bytes") for r in rs]
        peak = [r.get("peak_extra_bytes") for r in rs]
        errs = [v for r in rs for v in (r.get("errors_vs_plain") or {}).values()]
        worst = max((e if e is not None else float("inf")) for e in errs) if errs else None
        print(
            f"{cell[0]:<16} {cell[1]:<8} {cell[2]:<16} {tf} {f(rs[0].get('x_plain'), '12.2f')} "
            f"{f(rs[2].get('x_plain'), '11.2f')} {f(rs[3].get('x_plain'), '11.2f')} "
            f"{'/'.join(f(g / 2**30 if g is not None else None, '.2f') for g in gib):>22} "
            f"{'/'.join(f(p / 2**30 if p is not None else None, '.2f') for p in peak):>22} {f(worst, '8.1e')}"
        )


def plot(records: list[dict], roofs: list[dict], path: Path, title: str) -> None:
    plt = runner.pyplot()

    cells = list(dict.fromkeys((r["shape"], r["dist"]) for r in records))
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(cells) + 2), 7.5), squeeze=False)
    width = 0.8 / len(IMPLS)
    by = {(r["shape"], r["dist"], r["op"], r["impl"]): r for r in records}
    for ax, op in zip(axes[:, 0], OPS, strict=True):
        for i, impl in enumerate(IMPLS):
            xs, hs = [], []
            for c, (shape, dist) in enumerate(cells):
                r = by.get((shape, dist, op, impl))
                if r and r["tflops"]:
                    xs.append(c + (i - (len(IMPLS) - 1) / 2) * width)
                    hs.append(r["tflops"])
            ax.bar(xs, hs, width, label=impl, color=f"C{i}")
        for j, roof in enumerate(roofs):
            ax.axhline(
                roof["tflops"], color="k", linestyle="--", linewidth=0.8, label="dense 8192^3" if j == 0 else None
            )
        what = "router + routed experts" if any(r.get("router") for r in records) else "routed experts"
        ax.set_title(f"MoE layer ({what}), {op}", fontsize=10)
        ax.set_ylabel("TFLOP/s")
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"{s}\n{d}" for s, d in cells], fontsize=7)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=8, x=0.01, y=0.995, ha="left", va="top")
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.955), ncols=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    runner.save_figure(fig, path)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes", default=None, help="comma list of shape names, or 'other' for OTHER_SHAPES (default: SHAPES)"
    )
    parser.add_argument("--dists", default="balanced,skewed")
    parser.add_argument("--backend", default="auto", help="moekit's GEMM backend (auto, triton, torch)")
    parser.add_argument("--out", type=Path, default=runner.DEFAULT_OUT)
    parser.add_argument("--commit", default=None, help="the git commit measured (for a tree without .git)")
    parser.add_argument("--quick", action="store_true", help="one round, short repetitions (noisier)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: proves the script runs")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3, quick 1)")
    parser.add_argument("--liger-autotune", action="store_true", help="let Liger autotune (slow: 32 configs)")
    parser.add_argument(
        "--router",
        action="store_true",
        help="router included: every column routes in its timed call with SonicMoE's softmax top-k rule "
        "(needed for the sonicmoe column)",
    )
    parser.add_argument(
        "--impls", default=",".join(IMPLS), help=f"comma list of columns (default all: {','.join(IMPLS)})"
    )
    parser.add_argument(
        "--sonicmoe-commit",
        default=None,
        help="the git commit of the SonicMoE source imported (recorded in the JSON; its bundle has no metadata)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="start no new cell after this many seconds (the rest are recorded as skipped)",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also profile one call of every timed cell (torch.profiler): its kernels' device time by name",
    )
    parser.add_argument("--no-plot", dest="plot", action="store_false")
    args = parser.parse_args(argv)
    args.device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.device.type == "cpu" and not args.smoke:
        raise SystemExit("the full shapes need a CUDA device; use --smoke on CPU")
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    pool = SMOKE_SHAPES if args.smoke else SHAPES + OTHER_SHAPES + SONICMOE_SHAPES
    if args.shapes == "other":
        args.shape_list = list(OTHER_SHAPES)
    else:
        default = SMOKE_SHAPES if args.smoke else SHAPES
        args.shape_list = (
            runner.select_by_name(pool, args.shapes, "shapes", [s.name for s in pool]) if args.shapes else list(default)
        )
    args.dist_list = runner.select_by_name(runner.DISTS, args.dists, "dists", runner.DISTS)
    args.impl_list = runner.select_by_name(IMPLS, args.impls, "impls", IMPLS)
    if "plain" not in args.impl_list:
        args.impl_list = ["plain", *args.impl_list]  # the reference of every error and ratio
    args.rounds = args.rounds or (1 if args.quick or args.smoke else 3)
    args.warmup_ms, args.rep_ms = (10.0, 30.0) if args.quick or args.smoke else (20.0, 60.0)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.liger_autotune:
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # read when liger_kernel is imported
    impls = {"moekit": moekit_layer(args.backend), "plain": plain_layer}
    reasons = {}
    if "liger" in args.impl_list:
        impls["liger"], reasons["liger"] = liger_layer()
        if args.device.type != "cuda" and impls["liger"] is not None:
            reasons["liger"] = "Liger's kernels run on CUDA only"
    if args.router:
        impls = {
            name: with_router(
                fn,
                torch.int32 if name in ("liger", "moekit") else torch.int64,
                moekit_softmax_topk if name == "moekit" else softmax_topk,
            )
            for name, fn in impls.items()
        }
    if "sonicmoe" in args.impl_list:
        if not args.router:
            impls["sonicmoe"] = None
            reasons["sonicmoe"] = "SonicMoE routes inside its call (softmax top-k router): run with --router"
        else:
            impls["sonicmoe"], reasons["sonicmoe"] = sonicmoe_layer()
            if args.device.type != "cuda" and impls["sonicmoe"] is not None:
                reasons["sonicmoe"] = "SonicMoE's kernels run on CUDA (Hopper or later) only"
    impls = {name: fn for name, fn in impls.items() if name in args.impl_list}
    cfg = runner.BenchConfig(
        device=args.device,
        dtype=args.dtype,
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        smoke=args.smoke,
        quick=args.quick,
        rounds=args.rounds,
        shapes=[],
        dists=args.dist_list,
        backends=[args.backend],
        out=args.out,
        plot=args.plot,
    )
    start = time.monotonic()
    roofs = [runner.measure_roof(cfg)]
    env = runner.environment(cfg, roofs[0])
    if args.commit:  # before the first partial JSON: a copied tree's git (if any) may not be the repo's
        env.update(git_commit=args.commit, git_commit_from="--commit", git_dirty=None, git_dirty_paths=[])
    records = []
    # Shape by shape (both routings share the shape's kernel compilations, the larger first cost).
    for shape in args.shape_list:
        for dist in args.dist_list:
            if args.max_seconds is not None and time.monotonic() - start > args.max_seconds:
                records += skipped_records(shape, dist, f"not run: past --max-seconds {args.max_seconds:g}")
                continue
            records += bench_cell(args, cfg, shape, dist, impls, reasons)
            runner.write_json(args.out / f"{NAME}.json", {"meta": env, "records": records, "partial": True})
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    roofs.append(runner.measure_roof(cfg))
    env.update(
        roofs=roofs,
        moekit_backend=args.backend,
        liger=_liger_version(),
        liger_autotune=os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1") != "0",
        router=args.router,
        routing_rule=(
            "router included in every column: softmax over the top-K of x @ router_w.T (SonicMoE's rule); "
            "moekit routes with moekit.topk_softmax, plain and Liger with torch.topk"
            if args.router
            else "routing given (ids, weights), router not timed"
        ),
        impls=list(impls),
        sonicmoe=_sonicmoe_info(args.sonicmoe_commit) if "sonicmoe" in impls else None,
        shapes=[asdict(s) for s in args.shape_list],
    )
    print_table(records, roofs)
    if args.kernels:
        print_kernels(records)
    payload = {"meta": env, "records": records}
    runner.write_json(args.out / f"{NAME}.json", payload)
    if args.plot:
        gpu = env["gpu"]["name"] if env.get("gpu") else env["device"]
        title = (
            f"moe_experts ({args.backend}) vs plain_layer vs Liger {env['liger']}, {env['dtype']} on {gpu}, "
            f"torch {env['torch']}, triton {env['triton']}, {(env['git_commit'] or '?')[:10]}, {env['date']}"
        )
        try:
            plot(records, roofs, args.out / f"{NAME}.png", title)
        except Exception as exc:  # a broken matplotlib must not lose the run: the JSON is written
            print(f"plot not drawn ({runner.error_reason(exc)}); the JSON holds every number")
    return payload


def _sonicmoe_info(commit: str | None) -> dict | None:
    """Where sonicmoe was imported from, the commit of its source (--sonicmoe-commit: the bundle has
    no package metadata of its own) and the CuTeDSL version beside it."""
    import sys

    module = sys.modules.get("sonicmoe")
    if module is None:
        return None
    try:
        from importlib.metadata import version

        cutlass_dsl = version("nvidia-cutlass-dsl")
    except Exception:
        cutlass_dsl = None
    return {"path": os.path.dirname(module.__file__), "commit": commit, "nvidia_cutlass_dsl": cutlass_dsl}


def _liger_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return None


if __name__ == "__main__":
    main()
