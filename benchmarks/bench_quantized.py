"""Benchmark of moekit's quantized experts: the MoE layer's forward+backward in bf16 and FP8 against the
plain PyTorch layer and torchao's FP8 grouped mm, `group_quantize`'s bandwidth, and the roofs they are
read against, all in one process.

Legend: T tokens, E experts, K experts per token, M = T*K routed rows, H hidden size, F ffn size.

Four parts (`--parts`), in this order:

roofs      the dense bf16 matmul 8192^3 (torch.mm, runner.measure_roof), the dense FP8 matmul 8192^3
           (torch._scaled_mm on e4m3 operands, rowwise and tensorwise float32 scales, bf16 out) and the
           HBM bandwidth (a 4 GiB device-to-device copy, GB/s counting read + write), each timed with
           triton's do_bench (median, L2 flushed). Always measured: the bandwidth fractions need it.
quantize   moekit.group_quantize(x, m_splits, recipe, rowwise=True, columnwise=...) for each recipe
           (fp8_block, fp8_rowwise, mxfp8) on the activations x (M, H) bf16 of each layer shape (m_splits
           a device tensor of balanced counts) and on a (E, 2F, H) weight (m_splits=None), rowwise only
           and rowwise+columnwise (fp8_block weights have no columnwise form: "unsupported"); and the
           backward's wgrad operands as the FP8 wgrad takes them (`group_quantize_for_wgrad`, the
           columnwise data written in the wgrad's segments layout): `segments` with both forms (dy,
           dh), `segments_columnwise` the columnwise form alone (x, a); their bytes written count the
           columnwise data's M x X (not the layout's padding columns), and they have no out= (a
           backward's operands are fresh: "unsupported"), their graph replays the allocating call;
           `segments_gathered` / `segments_columnwise_gathered` the same from the (T, H) token rows and
           the routing's index (`index=`, as the layer's backward hands it d out and x; bytes read
           count the M gathered rows; a build without `index` records "unsupported").
           `--splits routed` takes the groups' counts from bench_moe_layer's balanced routing (random
           draws: counts not multiples of 16 or 128, what ab_builds.py's layer cells and real routing
           give) instead of equal counts. Three
           modes per cell, timed in interleaved rounds: `alloc` (a new GroupedTensor per call), `out`
           (out= an earlier result, rewritten in place) and `graph` (the out= call captured once in a
           torch.cuda.CUDAGraph and replayed; CUDA only). Bytes moved = x's bytes read + the fp8 data and
           the scales written (the storage the call fills); GB/s and its fraction of the copy bandwidth
           (the issue's bar: >= 0.8). `same_bytes_as_alloc`: out= and the replayed graph wrote exactly
           the bytes of the allocating call (their outputs are zeroed before the call and the
           capture).
gemm       each linear's three grouped GEMMs on their own, kernel by kernel, at each layer shape's fc1
           (I = H, O = 2F) and fc2 (I = F, O = H) with M = T*K rows in E balanced groups: moekit's FP8
           kernels (the "triton" backend's `moekit.ops.library.quantized_linear_forward`, `_dgrad` on the
           weight's transposed copy, `_wgrad` from the columnwise forms) for fp8_block and fp8_rowwise,
           from operands quantized beforehand (not timed), against torch._grouped_mm in bf16 (the wgrad
           as dy^T x on the strided view). TFLOP/s count 2*M*I*O per GEMM; times as runner.time_ms
           (do_bench median, L2 flushed). Where a kernel cannot run (a CPU without the Triton
           interpreter, torch._grouped_mm off CUDA): "skipped" with the reason.
layer      the routed experts given their routing, forward+backward, at four shapes (T, E, K, H, F):
           DeepSeek-V3 EP8, Mixtral 8x7B, Qwen3-30B-A3B, gpt-oss-20b (bench_moe_layer.SHAPES), routing
           balanced: ids = (arange(T*K) % E).reshape(T, K) (every expert gets M/E rows, a multiple of 16
           as torchao needs; `--routing skewed`: bench_moe_layer's Dirichlet(1) shares over the
           experts, groups of any count, torchao's column skipped), weights a softmax over K of random
           logits. x, w1 (E, 2F, H) gate|up, w2 (E, H, F) and the weights require grad; SwiGLU. Columns:
             plain_bf16          bench_moe_layer.plain_layer (torch._grouped_mm, F.silu(g) * u)
             moekit_bf16         moekit.moe_experts(...), backend "auto"
             moekit_fp8_block    the same with quantization="fp8_block", as MoELayer runs it: the
                                 weights' caches refreshed in place every step (`moekit_column`;
                                 their bytes in `weight_cache_bytes`, not in `held_bytes`)
             moekit_fp8_rowwise  the same with quantization="fp8_rowwise"
             moekit_fp8_*_hpw    the same with quantized_wgrad=False: the weight gradients from the
                                 unquantized operands in bf16 (no columnwise quantization)
             torchao_fp8         the plain layer on torchao's differentiable FP8 rowwise grouped mm
                                 (_to_fp8_rowwise_then_scaled_grouped_mm), the routing weights applied
                                 to fc2's input; CUDA only, imported only here (absent: "skipped")
           moekit runs whatever path the installed moekit has for a quantization; moekit does not
           report which ran, so the records keep what backend="auto" selects for the GEMMs and the
           quantizer (`moekit_backends`). Per column: the median time of one forward+backward (CUDA
           events around each of --steps steps per round, --rounds interleaved rounds whose order
           rotates, the median of the rounds' medians; gradients cleared between steps, outside the
           timing), TFLOP/s counting 3 x the forward's 2*M*H*2F + 2*M*F*H, the first call's wall time
           (compilation, autotuning; timed apart), peak memory of one step above what was allocated
           before it (`peak_extra_bytes`, weights' gradients included) and the memory the forward keeps
           for the backward (`held_bytes`: allocated after the forward minus before, the output
           excluded; runner.memory_of), and the output's relative Frobenius error against a float64
           reference computed once per shape, one expert at a time (bf16 ~0.005, FP8 ~0.06).

`--budget-s` (default 330) starts no new cell (a column of a shape, a quantize cell) after that many
seconds: the cells not started are recorded as "skipped" with the reason, and the run ends with
whatever was started (a default run on an H200 takes about 5-7 minutes, Triton compilation
included). The JSON is rewritten after every shape (`"partial": true` until the end), and a
markdown summary is printed and written next to it, and where the layer part ran a plot of it
(`quantized.png`: each shape's step time per column, with the FP8 columns' ratio to moekit's bf16, and
the memory held for the backward and the peak; `--replot` draws it again from a run's JSON).

    python benchmarks/bench_quantized.py --out $OUT                 # H200: OUT/quantized.{json,md}
    python benchmarks/bench_quantized.py --out $OUT --parts layer --shapes qwen3-30b-a3b
    python benchmarks/bench_quantized.py --smoke --out /tmp/q       # tiny shapes, CPU, a few seconds
    python benchmarks/bench_quantized.py --replot benchmarks/results/h100_quantized_layer_3eaa03f.json \
        --out /tmp/q                                                 # the layer's plot of a run, no GPU
    python benchmarks/bench_quantized.py --out $OUT --parts quantize --roofs hbm_copy \
        --baseline benchmarks/results/h200_quantized_99508e5.json   # group_quantize, before beside after
    python benchmarks/bench_quantized.py --out $OUT --parts quantize --roofs hbm_copy --recipes fp8_block \
        --operands segments,segments_columnwise --splits routed    # the backward's wgrad operands

`--kernels` adds to each layer record where one step's time goes: one more forward+backward after the
timing under torch.profiler, the device time of its kernels summed by name (`kernels`: name, ms,
launches, largest first; `kernel_ms`: their sum). On the CPU (smoke) the operators' own CPU time
instead (`kernels_of: "cpu ops"`): it proves the code runs, not where a GPU's time goes. `--shapes` also
takes bench_moe_layer's SONICMOE_SHAPES by name (the fine-grained shapes of the SonicMoE comparison).

`--roofs` picks the roofs measured (default all four; the quantize part needs only hbm_copy).
`--baseline` adds an earlier run's CUDA-graph GB/s per group_quantize cell as a "before" column (its
fractions are of that run's own HBM copy).

--smoke runs every path the CPU has (plain torch quantizers, moekit's torch backend, _scaled_mm on
the CPU, wall-clock timing); the CUDA-only parts (CUDA events, graphs, torchao's kernels) are
recorded as skipped with the reason, and torchao's layer code runs with torch._grouped_mm standing
in for its FP8 mm (`stand_in_rel_err_fro`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import bench_moe_layer
import runner
import torch
import torch.nn.functional as F
from bench_moe_layer import LayerShape, plain_layer

import moekit
from moekit import QuantizedWeightCache
from moekit.ops import library
from moekit.ops.quantize import group_quantize_for_wgrad, transposed_weight
from moekit.ops.runtime.backends import backend_named, quantized_gemm_of

NAME = "quantized"
PARTS = ("quantize", "gemm", "layer")
ROOFS = ("bf16_mm", "fp8_mm_rowwise", "fp8_mm_tensorwise", "hbm_copy")
GEMM_RECIPES = ("fp8_block", "fp8_rowwise")
GEMM_OPS = ("fwd", "dgrad", "wgrad")
COLUMNS = (
    "plain_bf16",
    "moekit_bf16",
    "moekit_fp8_block",
    "moekit_fp8_rowwise",
    "moekit_fp8_block_hpw",
    "moekit_fp8_rowwise_hpw",
    "torchao_fp8",
)
# moekit's quantized columns: (quantization, quantized_wgrad)
QUANTIZED_COLUMNS = {
    "moekit_fp8_block": ("fp8_block", True),
    "moekit_fp8_rowwise": ("fp8_rowwise", True),
    "moekit_fp8_block_hpw": ("fp8_block", False),
    "moekit_fp8_rowwise_hpw": ("fp8_rowwise", False),
}
RECIPES = ("fp8_block", "fp8_rowwise", "mxfp8")
OPERANDS = (
    "activations",
    "weight",
    "segments",
    "segments_columnwise",
    "segments_gathered",
    "segments_columnwise_gathered",
)
# The backward's operands of the FP8 wgrad (`group_quantize_for_wgrad`, columnwise data in the wgrad's
# segments layout): both forms (dy, dh) and the columnwise form alone (x, a); "_gathered": the same rows
# given as the (T, H) token rows and the routing's index (`index=`: the layer's d out and x).
SEGMENTS_ROWWISE = {
    "segments": True,
    "segments_columnwise": False,
    "segments_gathered": True,
    "segments_columnwise_gathered": False,
}
SPLITS = ("balanced", "routed")
MODES = ("alloc", "out", "graph")
SHAPE_NAMES = ("deepseek-v3-ep8", "mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b")
SHAPES = tuple(s for name in SHAPE_NAMES for s in bench_moe_layer.SHAPES if s.name == name)
# M/E rows per expert, a multiple of 16 (torchao's grouped mm) in both.
SMOKE_SHAPES = (LayerShape("smoke", 64, 4, 2, 32, 48), LayerShape("smoke-top1", 48, 3, 1, 64, 32))
DEFAULT_BUDGET_S = 330.0


# --------------------------------------------------------------------------------------------------
# Time budget
# --------------------------------------------------------------------------------------------------


class Budget:
    """Seconds since the start, and whether a new cell may still start."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def exhausted(self) -> bool:
        return self.seconds is not None and self.elapsed() > self.seconds

    def reason(self) -> str:
        return f"not run: {self.elapsed():.0f} s into the run, past --budget-s {self.seconds:g}"


def _median_of_steps(steps: int, device: torch.device, grads=None) -> Callable[[Callable[[], object]], float]:
    return lambda fn: statistics.median(runner.time_steps(fn, steps, device, grads))


# --------------------------------------------------------------------------------------------------
# The layer's columns: (x, w1, w2, topk_ids, topk_weights) -> (T, H)
# --------------------------------------------------------------------------------------------------


def weights_before_fc2_layer(mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
    """The plain layer around a grouped mm `mm(a (rows, in), b (E, in, out), offs (E,) int32 group ends)`,
    with the routing weights scaling fc2's input (torchao's recipe for its FP8 grouped mm)."""

    def layer(x, w1, w2, topk_ids, topk_weights):
        T, K = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.bincount(flat, minlength=w1.shape[0]).cumsum(0).to(torch.int32)
        token = order // K
        h = mm(x[token], w1.transpose(-2, -1), offs)
        gate, up = h.chunk(2, -1)
        a = F.silu(gate) * up * topk_weights.reshape(-1)[order, None].to(h.dtype)
        y = mm(a, w2.transpose(-2, -1), offs)
        return torch.zeros_like(x).index_add_(0, token, y)

    return layer


def _bf16_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


def moekit_column(quantization: str | None, quantized_wgrad: bool = True):
    """moekit's layer as `MoELayer` runs it: with quantization, each weight's `QuantizedWeightCache`
    kept across steps and refreshed at every step (`track_versions=False`: in place, as after every
    optimizer step of training), so the weights' quantization (and the dgrad's transposed copy) is
    timed in every step and lives in the caches, not among the activations held for the backward
    (the caches' size is recorded apart: `weight_cache_bytes`)."""
    caches = (QuantizedWeightCache(track_versions=False), QuantizedWeightCache(track_versions=False))

    def run(x, w1, w2, topk_ids, topk_weights):
        kw = {"weight_caches": caches, "quantized_wgrad": quantized_wgrad} if quantization else {}
        return moekit.moe_experts(x, topk_ids, topk_weights, w1, w2, quantization=quantization, **kw)

    run.caches = caches if quantization else ()  # type: ignore[attr-defined]
    return run


def cache_bytes(caches) -> int:
    """Bytes of the quantized weights (and transposed copies) the caches keep."""
    total = 0
    for cache in caches:
        if cache.quantized is not None:
            total += sum(t.nbytes for t in cache.quantized.storage() if isinstance(t, torch.Tensor))
        if cache.transposed is not None:
            total += sum(t.nbytes for t in cache.transposed if isinstance(t, torch.Tensor))
    return total


def torchao_column(device: torch.device):
    """torchao's FP8 rowwise layer, or None and why it cannot run here."""
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    except Exception as exc:  # absent, or built for another torch
        return None, f"torchao not importable ({runner.error_reason(exc)}); pip install 'moekit[bench]'"
    if device.type != "cuda":
        return None, (
            f"torchao {runner._version('torchao')} imports, but its FP8 grouped mm (Triton kernels, "
            "torch._scaled_grouped_mm) runs on CUDA only"
        )

    def fp8_mm(a, b, offs):
        return _to_fp8_rowwise_then_scaled_grouped_mm(
            a, b, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
        )

    return weights_before_fc2_layer(fp8_mm), None


def moekit_backends(x: torch.Tensor, w1: torch.Tensor, quantization: str | None) -> dict | None:
    """What backend="auto" selects here for the GEMMs and (quantized) the quantizer."""
    try:
        from moekit.ops.runtime.backends import select_backend, select_quantizer

        return {
            "gemm": select_backend("auto", x, w1).name,
            "quantizer": select_quantizer("auto", x).name if quantization else None,
        }
    except Exception as exc:  # internal API: its absence must not cost the measurement
        return {"unknown": runner.error_reason(exc)}


def quantizer_name(x: torch.Tensor) -> str | None:
    """The quantizer group_quantize's backend="auto" selects for x."""
    try:
        from moekit.ops.runtime.backends import select_quantizer

        return select_quantizer("auto", x).name
    except Exception as exc:  # internal API: its absence must not cost the measurement
        return f"unknown ({runner.error_reason(exc)})"


@dataclass
class Column:
    name: str
    fn: Callable | None
    reason: str | None = None
    info: dict = field(default_factory=dict)
    # Runs in the column's place where it cannot (its code around a bf16 mm), for the error only.
    stand_in: Callable | None = None


def build_columns(names: list[str], device: torch.device) -> list[Column]:
    columns = []
    for name in names:
        if name == "plain_bf16":
            columns.append(Column(name, plain_layer, info={"impl": "bench_moe_layer.plain_layer"}))
        elif name == "moekit_bf16":
            columns.append(Column(name, moekit_column(None), info={"quantization": None}))
        elif name in QUANTIZED_COLUMNS:
            q, quantized_wgrad = QUANTIZED_COLUMNS[name]
            info = {"quantization": q, "quantized_wgrad": quantized_wgrad}
            columns.append(Column(name, moekit_column(q, quantized_wgrad), info=info))
        elif name == "torchao_fp8":
            fn, reason = torchao_column(device)
            stand_in = weights_before_fc2_layer(_bf16_grouped_mm) if device.type != "cuda" else None
            info = {"impl": "torchao _to_fp8_rowwise_then_scaled_grouped_mm", "torchao": runner._version("torchao")}
            columns.append(Column(name, fn, reason, info, stand_in))
    return columns


# --------------------------------------------------------------------------------------------------
# The layer part
# --------------------------------------------------------------------------------------------------


def balanced_ids(shape: LayerShape, device: torch.device) -> torch.Tensor:
    return (torch.arange(shape.tokens * shape.top_k, device=device) % shape.experts).reshape(shape.tokens, shape.top_k)


ROUTINGS = ("balanced", "skewed")


def layer_ids(shape: LayerShape, routing: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The layer's expert ids: "balanced" (every expert M / E rows) or "skewed" (bench_moe_layer's
    Dirichlet(1) shares over the experts: groups of any count)."""
    if routing == "balanced":
        return balanced_ids(shape, device)
    return bench_moe_layer.make_routing(shape, routing, device, dtype)[0]


def layer_inputs(shape: LayerShape, device: torch.device, dtype: torch.dtype, routing: str = "balanced"):
    """Leaves {x, w1, w2, wts} requiring grad, the routing's ids and the output gradient dy."""
    base = bench_moe_layer.make_inputs(shape, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    wts = torch.randn(shape.tokens, shape.top_k, device=device, generator=gen).softmax(-1).to(dtype)
    dy = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype, generator=gen)
    leaves = {"x": base["x"], "w1": base["w1"], "w2": base["w2"], "wts": wts}
    for t in leaves.values():
        t.requires_grad_(True)
    return leaves, layer_ids(shape, routing, device, dtype), dy


@torch.no_grad()
def reference_output(x, w1, w2, topk_ids, topk_weights) -> torch.Tensor:
    """The layer's output in float64, one expert at a time (only its rows and weights in float64)."""
    x64 = x.detach().double()
    out = torch.zeros_like(x64)
    for e in range(w1.shape[0]):
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate, up = (x64[tokens] @ w1[e].detach().double().t()).chunk(2, -1)
        y = (F.silu(gate) * up) @ w2[e].detach().double().t()
        out.index_add_(0, tokens, y * topk_weights.detach()[tokens, slots].double()[:, None])
    return out


def rel_fro(y: torch.Tensor, ref: torch.Tensor) -> float | None:
    err = ((y.detach().double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()
    return runner._finite_or_none(err)


def layer_record(shape: LayerShape, column: Column, flops: int, routing: str) -> dict:
    return {
        "bench": NAME,
        "part": "layer",
        "shape": shape.name,
        **asdict(shape),
        "routing": routing,
        "column": column.name,
        **column.info,
        "flops": flops,
        "status": None,
        "reason": None,
        "ms": None,
        "ms_rounds": [],
        "tflops": None,
        "x_plain_bf16": None,
        "first_call_s": None,
        "rel_err_fro": None,
        "held_bytes": None,
        "peak_bytes": None,
        "peak_extra_bytes": None,
    }


def bench_layer_shape(args, shape: LayerShape, columns: list[Column], budget: Budget) -> list[dict]:
    device = args.device
    M, H, Fs = shape.tokens * shape.top_k, shape.hidden, shape.ffn
    flops = 3 * (2 * M * H * 2 * Fs + 2 * M * Fs * H)
    if budget.exhausted():  # not even the inputs and the reference
        records = [layer_record(shape, column, flops, args.routing) for column in columns]
        for r, column in zip(records, columns, strict=True):
            r.update(status="skipped", reason=column.reason or budget.reason())
            print_layer_record(r)
        return records
    start = time.monotonic()
    leaves, ids, dy = layer_inputs(shape, device, args.dtype, args.routing)
    grads = list(leaves.values())
    t0 = time.monotonic()
    ref = reference_output(leaves["x"], leaves["w1"], leaves["w2"], ids, leaves["wts"])
    runner.sync(device)
    reference_s = time.monotonic() - t0
    records, timed = [], []
    for column in columns:
        rec = layer_record(shape, column, flops, args.routing)
        records.append(rec)
        if "quantization" in column.info:  # a moekit column
            rec["moekit_backends"] = moekit_backends(leaves["x"], leaves["w1"], column.info["quantization"])
        if column.stand_in is not None:
            with torch.no_grad():
                y = column.stand_in(leaves["x"], leaves["w1"], leaves["w2"], ids, leaves["wts"])
            rec["stand_in"] = "the column's layer code with torch._grouped_mm (bf16) in place of its mm"
            rec["stand_in_rel_err_fro"] = rel_fro(y, ref)
            del y
        if column.fn is None:
            rec.update(status="skipped", reason=column.reason)
            continue
        if column.name == "torchao_fp8" and args.routing != "balanced":
            rec.update(status="skipped", reason="torchao's FP8 grouped mm needs every group a multiple of 16 rows")
            continue
        if budget.exhausted():
            rec.update(status="skipped", reason=budget.reason())
            continue

        def fwd(fn=column.fn):
            return fn(leaves["x"], leaves["w1"], leaves["w2"], ids, leaves["wts"])

        def step(fwd=fwd):
            fwd().backward(dy)

        try:
            for t in grads:
                t.grad = None
            runner.sync(device)
            t0 = time.monotonic()
            y = fwd()
            y.backward(dy)
            runner.sync(device)
            rec["first_call_s"] = round(time.monotonic() - t0, 3)
            rec["rel_err_fro"] = rel_fro(y, ref)
            del y
            rec.update(runner.memory_of(fwd, dy, grads, device))
            if getattr(column.fn, "caches", ()):
                rec["weight_cache_bytes"] = cache_bytes(column.fn.caches)
            rec["status"] = "ok"
            timed.append((rec, step))
        except Exception as exc:  # one broken column must not lose the others
            rec.update(status="error", reason=runner.error_reason(exc))
        for t in grads:
            t.grad = None
        runner.release_memory(device)
    runner.time_rounds(timed, args.rounds, _median_of_steps(args.steps, device, grads))
    if args.kernels:
        for rec, step in timed:
            # As before every timed step: without it the profiled backward would add its gradients to
            # the last timed step's (one elementwise add a leaf that the timed steps never run).
            for t in grads:
                t.grad = None
            try:
                rec.update(runner.kernel_profile(step, device))
            except Exception as exc:  # the timing stands without the profile
                rec["kernels_error"] = runner.error_reason(exc)
        for t in grads:
            t.grad = None
    base = next((r for r in records if r["column"] == "plain_bf16" and r.get("tflops")), None)
    for r in records:
        if base and r.get("tflops"):
            r["x_plain_bf16"] = r["tflops"] / base["tflops"]
        r["reference_s"] = round(reference_s, 3)
        r["shape_seconds"] = round(time.monotonic() - start, 1)
        print_layer_record(r)
    return records  # the caller releases the memory of this shape's tensors


def print_layer_record(r: dict) -> None:
    t = f"{r['ms']:9.3f} ms {r['tflops']:6.1f} TF" if r.get("ms") else " " * 22
    ratio = f" x{r['x_plain_bf16']:.2f}" if r.get("x_plain_bf16") else "      "
    err = f" err {r['rel_err_fro']:.2e}" if r.get("rel_err_fro") is not None else ""
    mem = ""
    if r.get("held_bytes") is not None:
        mem = f" held {r['held_bytes'] / 2**30:6.2f} GiB peak+ {r['peak_extra_bytes'] / 2**30:6.2f} GiB"
    first = f" first {r['first_call_s']:.1f} s" if r.get("first_call_s") is not None else ""
    note = f"  [{r['status']}: {r['reason'][:140]}]" if r.get("reason") else ""
    print(f"  {r['shape']:<16} {r['column']:<19} {t}{ratio}{err}{mem}{first}{note}", flush=True)


# --------------------------------------------------------------------------------------------------
# The quantize part
# --------------------------------------------------------------------------------------------------


def _written(gt) -> list[torch.Tensor]:
    """The fp8 data and scales a quantization wrote (the forms asked for): a GroupedTensor's, or the
    (rowwise GroupedTensor or None, SegmentedColumns, group counts) of `group_quantize_for_wgrad` (the
    segments' data on the columns in use: `segment_bytes`)."""
    if isinstance(gt, tuple):
        rows, cols, counts = gt
        return (_written(rows) if rows is not None else []) + [segment_bytes(cols, counts), cols.scale_inv]
    tensors = (gt.rowwise_data, gt.rowwise_scale_inv, gt.columnwise_data, gt.columnwise_scale_inv)
    return [t for t in tensors if t is not None]


def segment_bytes(cols, counts: list[int]) -> torch.Tensor:
    """The columns of SegmentedColumns' (X, pitch) data that the segments of groups of `counts` rows use
    (the rest is unspecified). The segments' alignment is the build's (`SEGMENT_COLUMNS`; builds
    before that constant aligned them to 16 columns, and ab_builds.py times both kinds)."""
    from moekit.ops.runtime import quantize_torch

    align = getattr(quantize_torch, "SEGMENT_COLUMNS", 16)
    return cols.data[:, : sum(-(-n // align) * align for n in counts)]


def zero_bytes(gt) -> None:
    for t in _written(gt):
        t.view(torch.uint8).zero_()


def same_bytes(a, b) -> bool:
    wa, wb = _written(a), _written(b)
    return len(wa) == len(wb) and all(
        x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(wa, wb, strict=True)
    )


def columnwise_supported(recipe: str, operand: str) -> bool:
    from moekit.grouped_tensor import columnwise_defined, recipe_named

    return columnwise_defined(recipe_named(recipe), operand == "weight")


def bench_quantize_cell(
    args, shape: LayerShape, operand: str, x: torch.Tensor, splits, recipe: str, columnwise: bool, hbm, budget: Budget
) -> list[dict]:
    device = args.device
    segments = operand in SEGMENTS_ROWWISE
    index = None
    if operand.endswith("_gathered"):  # (token rows, the token of each routed row)
        x, index = x
    recs = {
        mode: {
            "bench": NAME,
            "part": "quantize",
            "shape": shape.name,
            "operand": operand,
            "x_shape": list(x.shape),
            "index_rows": None if index is None else index.shape[0],
            "recipe": recipe,
            "rowwise": SEGMENTS_ROWWISE.get(operand, True),
            "columnwise": columnwise,
            "splits": args.splits if splits is not None else None,
            "mode": mode,
            "status": None,
            "reason": None,
            "ms": None,
            "ms_rounds": [],
            "gb_per_s": None,
            "fraction_of_hbm": None,
            "same_bytes_as_alloc": None,
        }
        for mode in MODES
    }
    records = list(recs.values())

    def mark(modes, status, reason):
        for m in modes:
            recs[m].update(status=status, reason=reason)

    if columnwise and not columnwise_supported(recipe, operand):
        mark(MODES, "unsupported", f"{recipe} has no columnwise form for an (E, rows, cols) weight")
        return records
    if budget.exhausted():
        mark(MODES, "skipped", budget.reason())
        return records

    counts = splits.tolist() if segments else None
    if index is not None and "index" not in inspect.signature(group_quantize_for_wgrad).parameters:
        mark(MODES, "unsupported", "this build's group_quantize_for_wgrad takes no index")
        return records
    rows_read = x.nbytes if index is None else index.shape[0] * x.shape[1] * x.element_size()

    def quantize(out=None):
        if segments:  # the backward's call: no out= (its operands are fresh)
            rowwise = SEGMENTS_ROWWISE[operand]
            extra = {} if index is None else {"index": index}
            rows, cols = group_quantize_for_wgrad(x, splits, recipe, rowwise=rowwise, **extra)
            return rows, cols, counts
        return moekit.group_quantize(x, splits, recipe, rowwise=True, columnwise=columnwise, out=out)

    try:
        runner.sync(device)
        t0 = time.monotonic()
        expected = quantize()
        runner.sync(device)
        first_call_s = time.monotonic() - t0
    except Exception as exc:
        mark(MODES, "error", runner.error_reason(exc))
        return records
    written = sum(t.nbytes for t in _written(expected))
    if segments:  # the columnwise data's M x X bytes, not the segments' padding columns
        written += rows_read // x.element_size() - segment_bytes(expected[1], counts).nbytes
    quantizer = quantizer_name(x)
    for r in records:
        r.update(bytes_read=rows_read, bytes_written=written, first_call_s=round(first_call_s, 3), quantizer=quantizer)
    recs["alloc"].update(status="ok", same_bytes_as_alloc=True)
    timed = [(recs["alloc"], quantize)]
    if segments:
        mark(["out"], "unsupported", "group_quantize_for_wgrad has no out= (a backward's operands are fresh)")
    else:
        try:
            out = quantize()
            zero_bytes(out)  # what the in-place call writes, not what the allocating call left
            quantize(out=out)
            recs["out"].update(status="ok", same_bytes_as_alloc=same_bytes(out, expected))
            timed.append((recs["out"], lambda: quantize(out=out)))
        except Exception as exc:
            mark(["out"], "error", runner.error_reason(exc))
    if device.type != "cuda":
        mark(["graph"], "skipped", "CUDA graphs need a CUDA device")
    else:
        try:
            graph_out = quantize()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up on a side stream, as capture wants
                for _ in range(2):
                    quantize(out=None if segments else graph_out)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            runner.sync(device)
            t0 = time.monotonic()
            if segments:  # the allocating call captured: its outputs live in the graph's pool
                with torch.cuda.graph(graph):
                    graph_out = quantize()
            else:
                zero_bytes(graph_out)  # what the replay writes, not what the warm-up left
                with torch.cuda.graph(graph):
                    quantize(out=graph_out)
            runner.sync(device)
            if segments:
                zero_bytes(graph_out)  # what the replay writes, not what the capture left
            recs["graph"]["capture_s"] = round(time.monotonic() - t0, 3)
            graph.replay()
            runner.sync(device)
            recs["graph"].update(status="ok", same_bytes_as_alloc=same_bytes(graph_out, expected))
            timed.append((recs["graph"], graph.replay))
        except Exception as exc:
            mark(["graph"], "error", runner.error_reason(exc))
    runner.time_rounds(timed, args.rounds, _median_of_steps(args.quant_steps, device))
    for r in records:
        if r.get("ms"):
            r["gb_per_s"] = (r["bytes_read"] + r["bytes_written"]) / r["ms"] / 1e6
            r["fraction_of_hbm"] = r["gb_per_s"] / hbm["gb_per_s"] if hbm and hbm.get("gb_per_s") else None
    return records  # the caller releases the graph and the outputs


def group_counts(args, shape: LayerShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups' row counts of the quantize part on the device, equal ("balanced": ids = arange(T*K) %
    E) or those of bench_moe_layer's balanced routing ("routed": random draws), and the token of each
    row in expert order (int32, the layer's gather index: the gathered operands' `index`)."""
    if args.splits == "balanced":
        ids = torch.arange(shape.tokens * shape.top_k, device=args.device) % shape.experts
    else:
        ids, _ = bench_moe_layer.make_routing(shape, "balanced", args.device, args.dtype)
    flat = ids.reshape(-1)
    token_of_row = (torch.argsort(flat, stable=True) // shape.top_k).to(torch.int32)
    return torch.bincount(flat, minlength=shape.experts), token_of_row


def bench_quantize_shape(args, shape: LayerShape, hbm, budget: Budget) -> list[dict]:
    device, dtype = args.device, args.dtype
    M = shape.tokens * shape.top_k
    gen = torch.Generator(device=device).manual_seed(2)
    splits, token_of_row = group_counts(args, shape)
    rows = torch.randn(M, shape.hidden, device=device, dtype=dtype, generator=gen)
    tokens = rows[: shape.tokens]  # the gathered operands' (T, H) token rows
    operands = {
        "activations": (rows, splits),
        "segments": (rows, splits),
        "segments_columnwise": (rows, splits),
        "segments_gathered": ((tokens, token_of_row), splits),
        "segments_columnwise_gathered": ((tokens, token_of_row), splits),
        "weight": (
            (torch.randn(shape.experts, 2 * shape.ffn, shape.hidden, device=device, generator=gen) * 0.02).to(dtype),
            None,
        ),
    }
    records = []
    for operand in args.operand_list:
        x, m_splits = operands[operand]
        for recipe in args.recipe_list:
            for columnwise in (True,) if operand in SEGMENTS_ROWWISE else (False, True):
                cell = bench_quantize_cell(args, shape, operand, x, m_splits, recipe, columnwise, hbm, budget)
                for r in cell:
                    print_quantize_record(r)
                records += cell
                runner.release_memory(device)
    del operands
    runner.release_memory(device)
    return records


def print_quantize_record(r: dict) -> None:
    forms = "+".join(name for name, on in (("row", r["rowwise"]), ("col", r["columnwise"])) if on)
    t = f"{r['ms']:8.3f} ms {r['gb_per_s']:7.1f} GB/s" if r.get("ms") else " " * 24
    frac = f" {r['fraction_of_hbm']:.2f} HBM" if r.get("fraction_of_hbm") else ""
    same = "" if r.get("same_bytes_as_alloc") is None else f" same={r['same_bytes_as_alloc']}"
    note = f"  [{r['status']}: {r['reason'][:120]}]" if r.get("reason") else ""
    print(f"  {r['shape']:<16} {r['operand']:<19} {r['recipe']:<11} {forms:<7} {r['mode']:<5} {t}{frac}{same}{note}")


# --------------------------------------------------------------------------------------------------
# GEMMs, kernel by kernel
# --------------------------------------------------------------------------------------------------


def _fp8_reason(recipe: str, x: torch.Tensor, op: str) -> str | None:
    """Why moekit's FP8 kernel for `op` cannot run here (None: it can)."""
    fp8 = quantized_gemm_of(backend_named("triton"))
    if fp8 is None:
        return "the triton backend has no QuantizedGemm capability"
    if op == "wgrad":
        return fp8.quantized_wgrad_unavailable_reason(recipe, x)
    return fp8.quantized_gemm_unavailable_reason(recipe, x)


def fp8_gemm_calls(
    recipe: str, x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, splits: torch.Tensor, offs: torch.Tensor
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """moekit's FP8 forward, dgrad and wgrad of one linear (the triton backend's library ops) on x (M, I),
    dy (M, O) and w (N, O, I), quantized here once with `recipe` (both forms of x and dy, the weight's
    transposed copy for the dgrad): what the `gemm` part times, and ab_builds' `--op qgemm`."""
    x_q = moekit.group_quantize(x, splits, recipe, columnwise=True)
    dy_q = moekit.group_quantize(dy, splits, recipe, columnwise=True)
    w_q = moekit.group_quantize(w, None, recipe, columnwise=recipe == "fp8_rowwise")
    wt = transposed_weight(w_q)
    dtype = x.dtype

    def fwd() -> torch.Tensor:
        return library.quantized_linear_forward(
            "triton", recipe, x_q.rowwise_data, x_q.rowwise_scale_inv, w_q.rowwise_data, w_q.rowwise_scale_inv,
            offs, None, None, None, dtype,
        )  # fmt: skip

    def dgrad() -> torch.Tensor:
        return library.quantized_linear_dgrad(
            "triton", recipe, dy_q.rowwise_data, dy_q.rowwise_scale_inv, wt.data, wt.scale_inv, offs, None, dtype
        )

    def wgrad() -> torch.Tensor:
        return library.quantized_linear_wgrad(
            "triton", recipe, dy_q.columnwise_data, dy_q.columnwise_scale_inv, x_q.columnwise_data,
            x_q.columnwise_scale_inv, offs, None, dtype, None,
        )  # fmt: skip

    return fwd, dgrad, wgrad


def bench_gemm_shape(args, cfg: runner.BenchConfig, shape: LayerShape, budget: Budget) -> list[dict]:
    device, dtype = args.device, args.dtype
    M = shape.tokens * shape.top_k
    counts = runner.balanced_splits(M, shape.experts)
    splits = torch.tensor(counts, device=device)
    offs = torch.tensor([0, *counts], device=device).cumsum(0)
    offs32 = offs[1:].to(torch.int32)
    records = []
    for linear, n_in, n_out in (("fc1", shape.hidden, 2 * shape.ffn), ("fc2", shape.ffn, shape.hidden)):
        gen = torch.Generator(device=device).manual_seed(3)
        x = torch.randn(M, n_in, device=device, dtype=dtype, generator=gen)
        dy = torch.randn(M, n_out, device=device, dtype=dtype, generator=gen)
        w = (torch.randn(shape.experts, n_out, n_in, device=device, generator=gen) / n_in**0.5).to(dtype)
        calls: dict[tuple[str, str], tuple[Callable[[], object] | None, str | None]] = {}
        cuda_reason = None if device.type == "cuda" else "torch._grouped_mm runs on CUDA only"
        bf16 = (
            lambda x=x, w=w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs32),
            lambda dy=dy, w=w: torch._grouped_mm(dy, w, offs=offs32),
            lambda dy=dy, x=x: torch._grouped_mm(dy.t(), x, offs=offs32),
        )
        calls.update({("torch_bf16", op): (fn, cuda_reason) for op, fn in zip(GEMM_OPS, bf16, strict=True)})
        for recipe in GEMM_RECIPES:
            impl = f"moekit_{recipe}"
            reasons = {op: _fp8_reason(recipe, x, op) for op in GEMM_OPS}
            if all(reasons.values()):
                calls.update({(impl, op): (None, reasons[op]) for op in GEMM_OPS})
                continue
            fns = fp8_gemm_calls(recipe, x, dy, w, splits, offs)
            calls.update({(impl, op): (fn, reasons[op]) for op, fn in zip(GEMM_OPS, fns, strict=True)})
        flops = 2 * M * n_in * n_out
        for (impl, op), (fn, reason) in calls.items():
            r = {"shape": shape.name, "linear": linear, "rows": M, "in": n_in, "out": n_out, "impl": impl, "op": op}
            if budget.exhausted():
                r.update(status="skipped", reason=budget.reason())
            elif reason is not None or fn is None:
                r.update(status="skipped", reason=reason)
            else:
                try:
                    fn()  # compilation and tuning, outside the timing
                    ms = runner.time_ms(fn, cfg)
                    r.update(status="ok", reason=None, ms=ms, tflops=flops / ms / 1e9)
                except Exception as exc:  # one failing kernel must not lose the others
                    r.update(status="error", reason=runner.error_reason(exc))
            t = f"{r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s" if r.get("ms") else " " * 27
            note = f"  [{r['status']}: {(r['reason'] or '')[:100]}]" if r.get("reason") else ""
            print(f"  {shape.name:<16} {linear} {impl:<19} {op:<5} {t}{note}", flush=True)
            records.append(r)
        del calls, bf16
        runner.release_memory(device)
    return records


# --------------------------------------------------------------------------------------------------
# Roofs
# --------------------------------------------------------------------------------------------------


def measure_roofs(cfg: runner.BenchConfig, names: Sequence[str] = ROOFS) -> dict:
    roofs = {}
    for name, measure in (
        ("bf16_mm", lambda: runner.measure_roof(cfg)),
        ("fp8_mm_rowwise", lambda: runner.measure_fp8_roof(cfg, "rowwise")),
        ("fp8_mm_tensorwise", lambda: runner.measure_fp8_roof(cfg, "tensorwise")),
        ("hbm_copy", lambda: runner.measure_copy_bandwidth(cfg)),
    ):
        if name not in names:
            continue
        try:
            roofs[name] = {"status": "ok", **measure()}
        except Exception as exc:  # e.g. _scaled_mm not on this device
            roofs[name] = {"status": "error", "reason": runner.error_reason(exc)}
        runner.release_memory(cfg.device)
        print(f"  roof {name}: {roofs[name]}", flush=True)
    return roofs


# --------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------


def baseline_of(path: Path) -> dict:
    """An earlier run's group_quantize GB/s per cell and mode ("shape/operand/recipe/columnwise" ->
    "GB/s (fraction of that run's own HBM copy)"), with the file and commit it came from."""
    earlier = json.loads(Path(path).read_text())
    table: dict[str, dict[str, str]] = {}
    for r in earlier.get("quantize", []):
        if r.get("gb_per_s"):
            key = f"{r['shape']}/{r['operand']}/{r['recipe']}/{int(r['columnwise'])}"
            table.setdefault(r["mode"], {})[key] = f"{r['gb_per_s']:.0f} ({_f(r.get('fraction_of_hbm'), '.2f')})"
    return {"file": str(path), "commit": earlier.get("meta", {}).get("git_commit"), **table}


def _f(v, spec: str) -> str:
    return format(v, spec) if v is not None else "-"


def summary_markdown(payload: dict) -> str:
    meta, roofs = payload["meta"], payload.get("roofs", {})
    gpu = meta["gpu"]["name"] if meta.get("gpu") else meta["device"]
    routing = meta.get("routing", "balanced").split(":")[0]
    lines = [
        f"# bench_quantized on {gpu}",
        "",
        f"torch {meta['torch']}, CUDA {meta['cuda']}, Triton {meta['triton']}, torchao {meta['torchao']}, "
        f"commit {meta['git_commit']}, {meta['date']}" + (" (partial)" if payload.get("partial") else ""),
        "",
        "| roof | value |",
        "|---|---|",
    ]
    for name, unit, key in (
        ("bf16_mm", "TFLOP/s", "tflops"),
        ("fp8_mm_rowwise", "TFLOP/s", "tflops"),
        ("fp8_mm_tensorwise", "TFLOP/s", "tflops"),
        ("hbm_copy", "GB/s", "gb_per_s"),
    ):
        r = roofs.get(name, {})
        value = f"{r[key]:.1f} {unit}" if r.get(key) else f"{r.get('status', 'not run')}: {r.get('reason') or ''}"
        lines.append(f"| {name} | {value} |")
    lines += [
        "",
        f"Layer forward+backward ({routing} routing):",
        "",
        "| shape | column | ms | TFLOP/s | x plain_bf16 | rel. error | peak+ GiB | held GiB | weight caches GiB | "
        "first call s | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def gib(v):
        return _f(v / 2**30 if v is not None else None, ".2f")

    for r in payload.get("layer", []):
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r['reason'] or '')[:90]}"
        lines.append(
            f"| {r['shape']} | {r['column']} | {_f(r.get('ms'), '.2f')} | {_f(r.get('tflops'), '.1f')} | "
            f"{_f(r.get('x_plain_bf16'), '.2f')} | {_f(r.get('rel_err_fro'), '.2e')} | "
            f"{gib(r.get('peak_extra_bytes'))} | {gib(r.get('held_bytes'))} | {gib(r.get('weight_cache_bytes'))} | "
            f"{_f(r.get('first_call_s'), '.1f')} | "
            f"{status} |"
        )
    lines += [
        "",
        "group_quantize: GB/s (fraction of the HBM copy bandwidth; bar >= 0.8);"
        " same = the bytes of the allocating call:",
        "",
        "| shape | operand | recipe | forms | alloc | out= | CUDA graph | same (out/graph) |"
        + (" before: CUDA graph |" if payload.get("baseline") else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if payload.get("baseline") else ""),
    ]
    before = payload.get("baseline", {}).get("graph", {})
    cells: dict[tuple, dict] = {}
    for r in payload.get("quantize", []):
        cells.setdefault((r["shape"], r["operand"], r["recipe"], r["rowwise"], r["columnwise"]), {})[r["mode"]] = r

    def bw(r):
        if r.get("gb_per_s"):
            return f"{r['gb_per_s']:.0f} ({_f(r.get('fraction_of_hbm'), '.2f')})"
        return f"{r['status']}: {(r['reason'] or '')[:60]}" if r.get("reason") else (r.get("status") or "-")

    for (shape, operand, recipe, rowwise, columnwise), modes in cells.items():
        same = "/".join(str(modes[m].get("same_bytes_as_alloc")) for m in ("out", "graph"))
        forms = "+".join(name for name, on in (("row", rowwise), ("col", columnwise)) if on)
        lines.append(
            f"| {shape} | {operand} | {recipe} | {forms} | "
            f"{bw(modes['alloc'])} | {bw(modes['out'])} | {bw(modes['graph'])} | {same} |"
            + (f" {before.get(f'{shape}/{operand}/{recipe}/{int(columnwise)}', '-')} |" if before else "")
        )
    if payload.get("gemm"):
        lines += [
            "",
            "Grouped GEMMs alone: TFLOP/s (2*M*I*O per GEMM), balanced groups:",
            "",
            "| shape | linear | op | " + " | ".join(("torch_bf16", *(f"moekit_{r}" for r in GEMM_RECIPES))) + " |",
            "|---|---|---|" + "---|" * (1 + len(GEMM_RECIPES)),
        ]
        gemms: dict[tuple, dict] = {}
        for r in payload["gemm"]:
            gemms.setdefault((r["shape"], r["linear"], r["op"]), {})[r["impl"]] = r

        def tf(r):
            return f"{r['tflops']:.1f}" if r and r.get("tflops") else (r or {}).get("status", "-")

        for (shape, linear, op), impls in gemms.items():
            cols = [tf(impls.get(name)) for name in ("torch_bf16", *(f"moekit_{r}" for r in GEMM_RECIPES))]
            lines.append(f"| {shape} | {linear} | {op} | " + " | ".join(cols) + " |")
    skipped = payload.get("skipped_cells", 0)
    if skipped:
        lines += ["", f"{skipped} cells not run: past --budget-s (see the records' reasons)."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# The layer's plot
# --------------------------------------------------------------------------------------------------


def plot_layer(payload: dict, path: Path) -> bool:
    """Draw the layer part of a run: each shape's forward+backward step time per column (ms, lower is
    better; the FP8 columns labelled with their speed against moekit's bf16 step), and per column the
    memory held for the backward (bars) and the peak above the start (markers), GiB. False, nothing
    written, where the run has no timed layer cell."""
    records = [r for r in payload.get("layer", []) if r.get("status") == "ok" and r.get("ms")]
    if not records:
        return False
    plt = runner.pyplot()

    shapes = list(dict.fromkeys(r["shape"] for r in records))
    columns = [c for c in COLUMNS if any(r["column"] == c for r in records)]
    by = {(r["shape"], r["column"]): r for r in records}
    width = 0.8 / len(columns)
    fig, (ax_ms, ax_mem) = plt.subplots(2, 1, figsize=(max(8.0, 2.2 * len(shapes) + 2), 8.0))
    gib = 2**30
    for i, column in enumerate(columns):
        xs = [s + (i - (len(columns) - 1) / 2) * width for s in range(len(shapes))]
        cells = [by.get((shape, column)) for shape in shapes]
        ms = [r["ms"] if r else 0.0 for r in cells]
        bars = ax_ms.bar(xs, ms, width, label=column, color=f"C{i}")
        for bar, shape, r in zip(bars, shapes, cells, strict=True):
            bf16 = by.get((shape, "moekit_bf16"))
            if r and bf16 and column.startswith("moekit_fp8"):
                ax_ms.annotate(
                    f"{bf16['ms'] / r['ms']:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90,
                )
        held = [r["held_bytes"] / gib if r and r.get("held_bytes") is not None else 0.0 for r in cells]
        ax_mem.bar(xs, held, width, label=column, color=f"C{i}")
        peaks = [
            (x, r["peak_extra_bytes"] / gib)
            for x, r in zip(xs, cells, strict=True)
            if r and r.get("peak_extra_bytes") is not None
        ]
        if peaks:
            ax_mem.plot(*zip(*peaks, strict=True), "v", color=f"C{i}", markeredgecolor="k", markersize=6)
    labels = [f"{shape}\n{_dims_of(by, shape)}" for shape in shapes]
    for ax in (ax_ms, ax_mem):
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(labels, fontsize=7)
    ax_ms.set_ylabel("ms a forward+backward step (lower is better)")
    ax_ms.set_title("moe_experts forward+backward; FP8 columns: speed against moekit bf16", fontsize=9)
    ax_mem.set_ylabel("GiB")
    ax_mem.set_title("held for the backward (bars) and peak above the start (markers)", fontsize=9)
    meta = payload.get("meta", {})
    roofs = payload.get("roofs", {})
    roof = ", ".join(
        f"{name} {roofs[name]['tflops']:.0f} TFLOP/s"
        for name in ("bf16_mm", "fp8_mm_rowwise")
        if isinstance(roofs.get(name), dict) and roofs[name].get("tflops")
    )
    title = (
        f"{(meta.get('gpu') or {}).get('name', meta.get('device', '?'))}, moekit {str(meta.get('git_commit'))[:7]}, "
        f"routing {str(meta.get('routing', '?')).split(':')[0]}; dense roofs in the run: {roof or 'not measured'}"
    )
    fig.suptitle(title, fontsize=8, x=0.01, ha="left")
    handles, names = ax_ms.get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.965), ncols=len(names), fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    runner.save_figure(fig, path)
    return True


def _dims_of(by: dict, shape: str) -> str:
    r = next(v for (s, _), v in by.items() if s == shape)
    return f"T {r['tokens']} E {r['experts']} K {r['top_k']} H {r['hidden']} F {r['ffn']}"


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=runner.DEFAULT_OUT, help="directory of quantized.{json,md}")
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"comma list of shape names (default: {','.join(SHAPE_NAMES)}; also SonicMoE's by name)",
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma list of quantize, gemm, layer (roofs always run)"
    )
    parser.add_argument("--columns", default=",".join(COLUMNS), help="comma list of the layer's columns")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma list of group_quantize's recipes")
    parser.add_argument(
        "--operands",
        default=",".join(OPERANDS[:4]),
        help="group_quantize on activations, weight; the wgrad's segments with both forms, columnwise alone "
        "(default: these four); the same two gathered from token rows by an index (by name)",
    )
    parser.add_argument(
        "--splits", choices=SPLITS, default="balanced", help="the quantize part's group counts (default balanced)"
    )
    parser.add_argument(
        "--routing", choices=ROUTINGS, default="balanced", help="the layer part's routing (default balanced)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3, smoke 1)")
    parser.add_argument("--steps", type=int, default=None, help="layer steps timed per round (default 5, smoke 1)")
    parser.add_argument(
        "--quant-steps", type=int, default=None, help="group_quantize calls timed per round (default 20, smoke 1)"
    )
    parser.add_argument(
        "--budget-s",
        "--max-seconds",
        dest="budget_s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="start no new cell after this many seconds (the rest recorded as skipped); <0: no limit",
    )
    parser.add_argument("--commit", default=None, help="the git commit measured (for a tree without .git)")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="an earlier quantized.json: its group_quantize CUDA-graph GB/s (and fraction of its own HBM copy) "
        "beside this run's, as a 'before' column",
    )
    parser.add_argument(
        "--roofs", default=",".join(ROOFS), help=f"comma list of the roofs measured (default: {','.join(ROOFS)})"
    )
    parser.add_argument(
        "--kernels", action="store_true", help="the layer part also profiles one step per column (kernels by name)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: proves the script runs")
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="draw the layer's plot of an earlier run's JSON into --out (as <its name>.png) and measure nothing",
    )
    args = parser.parse_args(argv)
    if args.replot is not None:
        return args
    args.device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.device.type == "cpu" and not args.smoke:
        raise SystemExit("the full shapes need a CUDA device; use --smoke on CPU")
    args.dtype = torch.bfloat16
    pool = SMOKE_SHAPES if args.smoke else SHAPES + bench_moe_layer.SONICMOE_SHAPES
    default = SMOKE_SHAPES if args.smoke else SHAPES  # SonicMoE's shapes only when named
    args.shape_list = (
        runner.select_by_name(pool, args.shapes, "shapes", [s.name for s in pool]) if args.shapes else list(default)
    )
    args.part_list = runner.select_by_name(PARTS, args.parts, "parts", PARTS)
    args.column_list = runner.select_by_name(COLUMNS, args.columns, "columns", COLUMNS)
    args.recipe_list = runner.select_by_name(RECIPES, args.recipes, "recipes", RECIPES)
    args.operand_list = runner.select_by_name(OPERANDS, args.operands, "operands", OPERANDS)
    args.roof_list = runner.select_by_name(ROOFS, args.roofs, "roofs", ROOFS)
    args.rounds = args.rounds or (1 if args.smoke else 3)
    args.steps = args.steps or (1 if args.smoke else 5)
    args.quant_steps = args.quant_steps or (1 if args.smoke else 20)
    if args.budget_s is not None and args.budget_s < 0:
        args.budget_s = None
    return args


def replot(source: Path, out: Path) -> Path:
    """The layer's plot of a run's JSON (a bench_quantized payload), written to out/<source's stem>.png."""
    if not source.is_file():
        raise SystemExit(f"--replot must be a bench_quantized JSON file, got {source}")
    payload = json.loads(source.read_text())
    path = out / f"{source.stem}.png"
    if not plot_layer(payload, path):
        raise SystemExit(f"--replot: {source} has no timed layer cell to plot")
    return path


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot is not None:
        replot(args.replot, args.out)
        return {}
    budget = Budget(args.budget_s)
    cfg = runner.BenchConfig(
        device=args.device,
        dtype=args.dtype,
        warmup_ms=20.0,
        rep_ms=60.0,
        smoke=args.smoke,
        quick=False,
        rounds=args.rounds,
        shapes=[],
        dists=["balanced"],
        backends=["auto"],
        out=args.out,
        plot=False,
    )
    meta = runner.machine(args.device)
    if args.commit:  # before the first partial JSON: a copied tree's git (if any) may not be the repo's
        meta.update(git_commit=args.commit, git_commit_from="--commit", git_dirty=None, git_dirty_paths=[])
    cuda = args.device.type == "cuda"
    meta.update(
        dtype=str(args.dtype).removeprefix("torch."),
        smoke=args.smoke,
        rounds=args.rounds,
        steps=args.steps,
        quant_steps=args.quant_steps,
        budget_s=args.budget_s,
        parts=args.part_list,
        shapes=[asdict(s) for s in args.shape_list],
        columns=args.column_list,
        recipes=args.recipe_list,
        routing=(
            "balanced: ids = (arange(T*K) % E).reshape(T, K)"
            if args.routing == "balanced"
            else "skewed: bench_moe_layer.make_routing's Dirichlet(1) shares over the experts"
        ),
        timer_layer=(
            "CUDA events around each step, median of steps per round, median of rounds"
            if cuda
            else "wall clock per step (smoke)"
        ),
        timer_roofs="triton.testing.do_bench median, L2 flushed" if cuda else "wall clock median of 3 (smoke)",
        not_on_this_device=[]
        if cuda
        else ["CUDA events (wall clock instead)", "CUDA graphs", "torchao's FP8 grouped mm", "memory"],
    )
    payload = {"meta": meta, "roofs": {}, "quantize": [], "gemm": [], "layer": [], "partial": True}
    path = args.out / f"{NAME}.json"
    print(f"roofs ({args.device}):", flush=True)
    payload["roofs"] = measure_roofs(cfg, args.roof_list)
    if args.baseline is not None:
        payload["baseline"] = baseline_of(args.baseline)
    runner.write_json(path, payload)
    if "quantize" in args.part_list:
        print("group_quantize:", flush=True)
        for shape in args.shape_list:
            payload["quantize"] += bench_quantize_shape(args, shape, payload["roofs"].get("hbm_copy"), budget)
            runner.write_json(path, payload)
    if "gemm" in args.part_list:
        print("grouped GEMMs:", flush=True)
        for shape in args.shape_list:
            payload["gemm"] += bench_gemm_shape(args, cfg, shape, budget)
            runner.write_json(path, payload)
    if "layer" in args.part_list:
        print("layer forward+backward:", flush=True)
        columns = build_columns(args.column_list, args.device)
        for shape in args.shape_list:
            payload["layer"] += bench_layer_shape(args, shape, columns, budget)
            runner.release_memory(args.device)
            runner.write_json(path, payload)
    payload["skipped_cells"] = sum(
        1
        for r in payload["quantize"] + payload["gemm"] + payload["layer"]
        if (r.get("reason") or "").startswith("not run:")
    )
    payload["seconds"] = round(budget.elapsed(), 1)
    del payload["partial"]
    runner.write_json(path, payload)
    summary = summary_markdown(payload)
    print("\n" + summary, flush=True)
    (args.out / f"{NAME}.md").write_text(summary)
    print(f"wrote {args.out / f'{NAME}.md'}", flush=True)
    try:
        plot_layer(payload, args.out / f"{NAME}.png")
    except Exception as exc:  # a broken matplotlib must not lose the run: the JSON and the summary are written
        print(f"no plot: {type(exc).__name__}: {exc}", flush=True)
    return payload


if __name__ == "__main__":
    main()
