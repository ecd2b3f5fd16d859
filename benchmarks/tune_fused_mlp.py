"""Where the fused MLP's time goes, product by product, and which kernel configuration wins (GPU).

Legend: M routed rows, N experts, H hidden size, F ffn size. bf16, balanced splits.

Per shape, each timed with do_bench (median):
- forward parts: plain fc1 (`torch._grouped_mm`), plain activation pass (silu(g) * u * p), plain fc2,
  moekit's fc2 (`grouped_gemm_forward`, tuned), and `glu_forward` (fc1 + activation) per config;
- backward parts: plain fc2 dgrad + the activation's backward (autograd of the plain pass), the
  plain wgrads / fc1 dgrad (`torch._grouped_mm` on the transposed operands), moekit's
  (`grouped_gemm_wgrad` / `grouped_gemm_dgrad`), and `glu_backward` per config;
- the layer at small batches (Qwen3-30B-A3B width, 256 / 1024 / 4096 tokens): host time to enqueue
  forward+backward (no sync) and GPU time, moekit.moe_experts against the plain layer, and kernel
  launches per forward+backward.
Writes $OUT/tune_fused_mlp.json (commit from MOEKIT_BENCH_COMMIT). Usage: python
benchmarks/tune_fused_mlp.py [--shapes name,...] [--skip-layer]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import time

import torch
import torch.nn.functional as F
import triton
from bench_moe_layer import plain_layer

import moekit
from moekit.ops import grouped_gemm as gg
from moekit.ops import grouped_mlp as gm
from moekit.ops.gemm_config import GemmConfig

SHAPES = {  # name: (M, N, H, F)
    "mixtral-8x7b": (32768, 8, 4096, 14336),
    "deepseek-v3-32e": (16384, 32, 7168, 2048),
    "qwen3-30b-a3b": (131072, 128, 2048, 768),
    "gpt-oss-20b": (65536, 32, 2880, 2880),
}

# (block_rows, block_cols, block_red, group_rows, stages, warps, flatten, epi_tma[, programs_per_sm]); the first of each
# list is the configuration moekit uses. The forward's sweeps (flatten, 2 programs per SM, deeper
# pipelines, narrower tiles) are in benchmarks/results/h200_tune_fused_mlp_558d69b.json and
# _6081fb1.json; notes/grouped_mlp.md v2-v3 sums them up.
FWD_CONFIGS = [
    (128, 128, 64, 8, 3, 8, False, True),
]
# The backward's epilogue moves h, dh and act_p by pointer (its TMA-box variants are in
# benchmarks/results/h200_tune_fused_mlp_a5aa50b.json, the pointer variants, 5 stages and a
# 128 x 256 tile in h200_glu_bwd_variants_3ed272b.json); the first entry is moekit's, the second
# the fused tile+reduction pipeline. The earlier sweeps (2 programs per SM, 5 stages) are in
# _558d69b.json and _6081fb1.json.
BWD_CONFIGS = [
    (128, 128, 64, 8, 4, 8, False),
    (128, 128, 64, 8, 4, 8, True),
]
TOP_K = {"mixtral-8x7b": 2, "deepseek-v3-32e": 8, "qwen3-30b-a3b": 8, "gpt-oss-20b": 4}


def bench(fn, rep=40) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def tflops(flop: float, ms: float) -> float:
    return flop / ms / 1e9


def shape_cell(name: str) -> dict:
    M, N, H, Fd = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(M, H, device="cuda", dtype=bf, generator=gen)
    w1 = (torch.randn(N, 2 * Fd, H, device="cuda", generator=gen) * H**-0.5).to(bf)
    w2 = (torch.randn(N, H, Fd, device="cuda", generator=gen) * Fd**-0.5).to(bf)
    probs = torch.rand(M, device="cuda", generator=gen)
    dy = torch.randn(M, H, device="cuda", dtype=bf, generator=gen)
    splits = torch.full((N,), M // N, dtype=torch.int64, device="cuda")
    offs32 = torch.cumsum(splits, 0).to(torch.int32)
    offs = torch.cat([splits.new_zeros(1), torch.cumsum(splits, 0)])
    fc1, fc2 = 2 * M * H * 2 * Fd, 2 * M * H * Fd
    cell: dict = {"shape": name, "M": M, "N": N, "H": H, "F": Fd, "parts": {}, "glu_fwd": [], "glu_bwd": []}
    parts = cell["parts"]

    h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs32)
    parts["plain_fc1"] = bench(lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs32))
    g, u = h.chunk(2, -1)
    parts["plain_act"] = bench(lambda: F.silu(g) * u * probs[:, None].to(bf))
    act = F.silu(g) * u * probs[:, None].to(bf)
    parts["plain_fc2"] = bench(lambda: torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs32))
    parts["moekit_fc2"] = bench(lambda: gg.grouped_gemm_forward(act, w2, offs))
    # The plain backward of the activation pass and fc2's dgrad, as autograd runs them.
    hg = h.detach().requires_grad_()
    pr = probs.detach().requires_grad_()

    def plain_act_bwd():
        gg_, uu = hg.chunk(2, -1)
        a = F.silu(gg_) * uu * pr[:, None].to(bf)
        da = torch._grouped_mm(dy, w2, offs=offs32)
        torch.autograd.grad(a, (hg, pr), da)

    parts["plain_dgrad2_act_bwd"] = bench(plain_act_bwd)
    parts["plain_dgrad2"] = bench(lambda: torch._grouped_mm(dy, w2, offs=offs32))
    dh = torch.randn_like(h)
    parts["plain_wgrad2"] = bench(lambda: torch._grouped_mm(dy.t(), act, offs=offs32))
    parts["moekit_wgrad2"] = bench(lambda: gg.grouped_gemm_wgrad(dy, act, offs))
    parts["plain_dgrad1"] = bench(lambda: torch._grouped_mm(dh, w1, offs=offs32))
    parts["moekit_dgrad1"] = bench(lambda: gg.grouped_gemm_dgrad(dh, w1, offs))
    parts["plain_wgrad1"] = bench(lambda: torch._grouped_mm(dh.t(), x, offs=offs32))
    parts["moekit_wgrad1"] = bench(lambda: gg.grouped_gemm_wgrad(dh, x, offs))
    flop = {
        "plain_fc1": fc1,
        "plain_fc2": fc2,
        "moekit_fc2": fc2,
        "plain_dgrad2": fc2,
        "plain_wgrad2": fc2,
        "moekit_wgrad2": fc2,
        "plain_dgrad1": fc1,
        "moekit_dgrad1": fc1,
        "plain_wgrad1": fc1,
        "moekit_wgrad1": fc1,
    }
    cell["tflops"] = {k: tflops(f, parts[k]) for k, f in flop.items()}
    print(name, {k: round(v, 3) for k, v in parts.items()}, flush=True)
    print(name, "TFLOP/s", {k: round(v) for k, v in cell["tflops"].items()}, flush=True)

    for c in FWD_CONFIGS:
        cfg = GemmConfig(*c)
        try:
            ms = bench(lambda cfg=cfg: gm.glu_forward(x, w1, offs, None, probs, None, "swiglu", cfg=cfg))
            cell["glu_fwd"].append({"cfg": list(c), "ms": ms, "tflops": tflops(fc1, ms)})
            print(name, "glu_fwd", c, f"{ms:.3f} ms {tflops(fc1, ms):.0f} TFLOP/s", flush=True)
        except Exception as exc:  # a config that does not compile or fit
            cell["glu_fwd"].append({"cfg": list(c), "error": str(exc)[:200]})
            print(name, "glu_fwd", c, "ERROR", str(exc)[:200], flush=True)
    # Gather fused into fc1's loads needs pointer (cp.async) loads of x's rows: the pointer path of
    # the same kernel (weights by pointer too, so a pessimistic proxy) against TMA + a separate
    # gather of x into expert order at HBM speed.
    cfg0 = GemmConfig(*FWD_CONFIGS[0])
    try:
        ms = bench(lambda: gm.glu_forward(x, w1, offs, None, probs, None, "swiglu", cfg=cfg0, use_tma=False))
        cell["glu_fwd_pointer_loads"] = {"ms": ms, "tflops": tflops(fc1, ms)}
        print(name, "glu_fwd pointer loads", f"{ms:.3f} ms {tflops(fc1, ms):.0f} TFLOP/s", flush=True)
    except Exception as exc:
        cell["glu_fwd_pointer_loads"] = {"error": str(exc)[:200]}
    from moekit.ops.moe_experts import _sum_rows

    tokens = M // TOP_K[name]
    x_tokens = torch.randn(tokens, H, device="cuda", dtype=bf, generator=gen)
    token_of_row = torch.sort(torch.randperm(M, device="cuda") % tokens).values[torch.randperm(M, device="cuda")]
    token_of_row = token_of_row[:, None].contiguous()
    ms = bench(lambda: _sum_rows(x_tokens, token_of_row, True))
    cell["gather_x"] = {"ms": ms, "GBps": 2 * M * H * 2 / ms / 1e6}
    print(name, "gather x", f"{ms:.3f} ms {cell['gather_x']['GBps']:.0f} GB/s", flush=True)
    reference = gm.glu_backward(dy, w2, h, offs, probs, None, "swiglu", cfg=GemmConfig(*BWD_CONFIGS[0]))
    for c in BWD_CONFIGS:
        cfg = GemmConfig(*c)
        try:
            # Every variant computes the same dh and act_p bit for bit; d probs up to the order of
            # its fp32 partial sums.
            dh_c, act_c, dprobs_c = gm.glu_backward(dy, w2, h, offs, probs, None, "swiglu", cfg=cfg)
            same = (
                torch.equal(dh_c, reference[0])
                and torch.equal(act_c, reference[1])
                and torch.allclose(dprobs_c, reference[2], rtol=1e-5, atol=1e-6)
            )
            del dh_c, act_c, dprobs_c
            ms = bench(lambda cfg=cfg: gm.glu_backward(dy, w2, h, offs, probs, None, "swiglu", cfg=cfg))
            cell["glu_bwd"].append({"cfg": list(c), "ms": ms, "tflops": tflops(fc2, ms), "matches_default": same})
            print(
                name,
                "glu_bwd",
                c,
                f"{ms:.3f} ms {tflops(fc2, ms):.0f} TFLOP/s",
                "same" if same else "DIFFERS",
                flush=True,
            )
        except Exception as exc:
            cell["glu_bwd"].append({"cfg": list(c), "error": str(exc)[:200]})
            print(name, "glu_bwd", c, "ERROR", str(exc)[:200], flush=True)
    return cell


def layer_cell(tokens: int) -> dict:
    N, K, H, Fd = 128, 8, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(tokens, H, device="cuda", dtype=bf, generator=gen).requires_grad_()
    w1 = (torch.randn(N, 2 * Fd, H, device="cuda", generator=gen) * H**-0.5).to(bf).requires_grad_()
    w2 = (torch.randn(N, H, Fd, device="cuda", generator=gen) * Fd**-0.5).to(bf).requires_grad_()
    logits = torch.randn(tokens, N, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(K, -1)
    weights = weights.requires_grad_()
    dy = torch.randn(tokens, H, device="cuda", dtype=bf, generator=gen)
    leaves = [x, w1, w2, weights]
    fns = {
        "plain": lambda: plain_layer(x, w1, w2, ids, weights),
        "moekit": lambda: moekit.moe_experts(x, ids, weights, w1, w2, backend="triton"),
    }
    cell: dict = {"tokens": tokens}
    for name, fn in fns.items():

        def step(fn=fn):
            for t in leaves:
                t.grad = None
            fn().backward(dy)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        host_ms = (time.perf_counter() - t0) * 1e3 / reps  # enqueue time while the GPU runs behind
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / reps
        gpu_ms = bench(step, rep=100)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        if tokens == 256:
            # Where the host time goes (Python functions, by own time and by cumulative time).
            prof_py = cProfile.Profile()
            prof_py.enable()
            for _ in range(20):
                step()
            prof_py.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            stats = pstats.Stats(prof_py, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumtime").print_stats(40)
            cell[f"{name}_host_profile"] = text.getvalue()
            print(text.getvalue()[:6000], flush=True)
        cell[name] = {"host_enqueue_ms": host_ms, "wall_ms": wall_ms, "do_bench_ms": gpu_ms, "cuda_events": launches}
        print(
            f"layer T={tokens} {name}: host {host_ms:.3f} ms, wall {wall_ms:.3f} ms, do_bench {gpu_ms:.3f} ms, "
            f"{launches} device events",
            flush=True,
        )
    return cell


def roof() -> float:
    sq = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return tflops(2 * 8192**3, bench(lambda: sq @ sq, rep=100))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--skip-layer", action="store_true")
    args = p.parse_args()
    out = os.path.join(os.environ.get("OUT", "."), "tune_fused_mlp.json")
    res = {
        "meta": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "git_commit": os.environ.get("MOEKIT_BENCH_COMMIT"),
        },
        "shapes": [],
        "layer": [],
    }
    res["meta"]["roof_tflops"] = roof()
    print("roof", res["meta"]["roof_tflops"], flush=True)
    if not args.skip_layer:
        for tokens in (256, 1024, 4096):
            res["layer"].append(layer_cell(tokens))
            with open(out, "w") as f:
                json.dump(res, f, indent=1)
    for name in args.shapes.split(","):
        try:
            res["shapes"].append(shape_cell(name))
        except Exception as exc:  # keep the other shapes of a scarce run
            res["shapes"].append({"shape": name, "error": repr(exc)[:300]})
            print(name, "ERROR", repr(exc)[:300], flush=True)
        torch.cuda.empty_cache()
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
