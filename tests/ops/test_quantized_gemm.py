"""The FP8 grouped GEMM (`moekit.ops.runtime.quantized_gemm`, forward and dgrad) and the quantized
grouped linear on it.

Kernel tests: the kernels against float64 products of the DEQUANTIZED operands (data * scale_inv in
float64, exact), which isolates the kernel from the quantization. FP8 x FP8 products are exact in
fp32, so the kernel's only errors are its fp32 sums (and the scale products) in its own order and the
one rounding to the output's dtype: the rule is tests/conftest.py's floor,

    rel_err(out, ref64) <= u(out dtype) + 16 * sqrt(L) * u(float32),   L the reduction length,

and exact zeros where the reference is zero (padding rows, groups without rows). End to end:
grouped_linear(quantization=..., backend="triton") against the reference path (backend="torch", the same
quantized operands dequantized; only the order of the sums differs, so the same floor, doubled for the
two sides' errors) and against float64 within the FP8 bound of tests/test_quantized_compute.py.

Under the interpreter (CPU; the root conftest sets TRITON_INTERPRET=1 before triton is imported) in
float32 and float16 (the 3.6 interpreter computes bf16 tl.dot wrongly; its fp8 tl.dot is exact).
GPU tests (`-m gpu`) run the real kernels at realistic shapes in bfloat16, with no host sync.

Legend: M routed rows, N groups (experts), I in_features, O out_features."""

# ruff: noqa: E741  (I and O are the legend's feature sizes)
from __future__ import annotations

import json

import pytest
import torch

import moekit
from helpers import (
    assert_no_host_sync,
    compile_in_subprocess,
    fp8_product_floor,
    rand,
    rel_err,
    run_on_kernel,
    tolerance_floor,
)
from moekit.grouped_tensor import RECIPES, dequantize_columnwise, dequantize_rowwise
from moekit.ops import library
from moekit.ops.quantize import QuantizedWeightCache, transposed_weight
from moekit.ops.runtime.backends import backend_named, quantized_gemm_of, triton_unavailable_reason
from moekit.ops.splits import device_offsets
from moekit.reference import grouped_linear_reference

qg = pytest.importorskip("moekit.ops.runtime.quantized_gemm")
from moekit.ops.runtime.configs import GemmConfig, fp8_gemm_candidates  # noqa: E402

ON_CPU = triton_unavailable_reason(torch.device("cpu"), torch.float32) is None
cpu_only = pytest.mark.skipif(not ON_CPU, reason="needs the Triton interpreter (TRITON_INTERPRET=1 before import)")
gpu = pytest.mark.gpu
FP8_RECIPES = ["fp8_block", "fp8_rowwise"]
BOUND = 0.08  # tests/test_quantized_compute.py's FP8 bound against float64

# (m_splits, M, I, O): sizes not multiples of 128 (or of 16: pointer loads), groups without rows,
# padding rows, one row, no rows.
LAYOUTS = {
    "odd-empty-middle-padding": ([10, 0, 25], 40, 200, 72),
    "tma-empty-first-padding": ([0, 30, 34], 70, 256, 96),
    "over-128-rows-and-cols": ([130, 3], 140, 144, 160),
    "three-steps-each-way": ([50, 0, 77], 140, 300, 264),
    "one-row": ([0, 1], 1, 130, 33),
    "no-rows": ([0, 0], 0, 64, 48),
    "all-padding": ([0, 0, 0], 5, 64, 48),
}


def offs_of(splits: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(splits, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def quantized_operands(op: str, recipe: str, splits: list[int], M: int, I: int, O: int, seed: int = 0):
    """(rows data, rows scale, weight data, weight scale, dequantized rows (float64), dequantized weight as
    the product reads it (float64)) for op "fwd" (x (M, I)) or "dgrad" (dy (M, O); the weight operand
    is its TransposedWeight (N, I, O), w64 the (N, O, I) weight it holds)."""
    info = RECIPES[recipe]
    rows = rand(M, I if op == "fwd" else O, seed=seed)
    w = rand(len(splits), O, I, seed=seed + 1)
    rows_q = moekit.group_quantize(rows, splits, recipe, backend="triton")
    columnwise = op == "dgrad" and recipe == "fp8_rowwise"
    w_q = moekit.group_quantize(w, None, recipe, rowwise=not columnwise, columnwise=columnwise, backend="triton")
    rows64 = dequantize_rowwise(info, rows_q.rowwise_data, rows_q.rowwise_scale_inv, torch.float64)
    if columnwise:
        w_data, w_scale = w_q.columnwise_data, w_q.columnwise_scale_inv
        offs_w = torch.arange(len(splits) + 1) * O
        w64 = dequantize_columnwise(info, w_data, w_scale, offs_w, offs_w, torch.float64)
    else:
        w_data, w_scale = w_q.rowwise_data, w_q.rowwise_scale_inv
        w64 = dequantize_rowwise(info, w_data, w_scale, torch.float64)
    if op == "dgrad":
        w_data, w_scale = transposed_weight(w_q)
    return rows_q.rowwise_data, rows_q.rowwise_scale_inv, w_data, w_scale, rows64, w64


def reference64(op: str, rows64, w64, splits, bias=None, bias_scale=None) -> torch.Tensor:
    offs = offs_of(splits).tolist()
    cols = w64.shape[1] if op == "fwd" else w64.shape[2]
    out = torch.zeros(rows64.shape[0], cols, dtype=torch.float64, device=rows64.device)
    for g in range(len(splits)):
        lo, hi = offs[g], offs[g + 1]
        if hi > lo:
            out[lo:hi] = rows64[lo:hi] @ (w64[g].T if op == "fwd" else w64[g])
            if bias is not None:
                b = bias[g].double()[None]
                out[lo:hi] += b * bias_scale[lo:hi, None].double() if bias_scale is not None else b
    return out


def check_kernel_result(out, ref, splits, red: int, what: str) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an unwritten element?)"
    used = sum(splits)
    assert torch.count_nonzero(out[used:]) == 0, f"{what}: padding rows are not exactly zero"
    err, floor = rel_err(out, ref), fp8_product_floor(out.dtype, red, out.device)
    assert err <= floor, f"{what}: relative error {err:.3e} against the dequantized float64 product > {floor:.2e}"


# --------------------------------------------------------------------------------------------------
# The kernels, under the interpreter
# --------------------------------------------------------------------------------------------------


@cpu_only
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_kernel_against_dequantized_float64(recipe, op, layout, nan_poison):
    splits, M, I, O = LAYOUTS[layout]
    a, a_s, w, w_s, a64, w64 = quantized_operands(op, recipe, splits, M, I, O)
    offs = offs_of(splits)
    if op == "fwd":
        out = qg.quantized_gemm_forward(recipe, a, a_s, w, w_s, offs, out_dtype=torch.float32)
    else:
        out = qg.quantized_gemm_dgrad(recipe, a, a_s, w, w_s, offs, out_dtype=torch.float32)
    assert out.shape == (M, O if op == "fwd" else I) and out.dtype == torch.float32
    check_kernel_result(out, reference64(op, a64, w64, splits), splits, I if op == "fwd" else O, f"{recipe} {op}")


@cpu_only
@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("with_scale", [False, True], ids=["bias", "bias-and-row-scale"])
def test_kernel_forward_with_bias(recipe, with_scale, nan_poison):
    splits, M, I, O = [7, 0, 20], 30, 136, 40
    a, a_s, w, w_s, a64, w64 = quantized_operands("fwd", recipe, splits, M, I, O, seed=3)
    bias = rand(len(splits), O, seed=7)
    scale = torch.rand(M, generator=torch.Generator().manual_seed(8)) if with_scale else None
    out = qg.quantized_gemm_forward(recipe, a, a_s, w, w_s, offs_of(splits), bias, scale, out_dtype=torch.float32)
    check_kernel_result(out, reference64("fwd", a64, w64, splits, bias, scale), splits, I, f"{recipe} bias")


@cpu_only
@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize(
    "cfg, use_tma",
    [
        pytest.param(GemmConfig(32, 64, 128, 2, 1, 4, False, False), True, id="tma-loads-pointer-stores"),
        pytest.param(GemmConfig(16, 32, 128, 1, 1, 4, True, True), True, id="flatten-tma-stores"),
        pytest.param(GemmConfig(32, 32, 128, 4, 1, 4, False, False), False, id="pointer-loads"),
    ],
)
def test_kernel_paths_and_float16_output(recipe, cfg, use_tma, nan_poison):
    """The operand paths and tile shapes (TMA or pointer loads, TMA or pointer stores, the fused tile
    loop) on one layout, with a float16 output."""
    splits, M, I, O = [0, 45, 19], 70, 256, 96
    for op in ("fwd", "dgrad"):
        a, a_s, w, w_s, a64, w64 = quantized_operands(op, recipe, splits, M, I, O, seed=5)
        fn = qg.quantized_gemm_forward if op == "fwd" else qg.quantized_gemm_dgrad
        out = fn(recipe, a, a_s, w, w_s, offs_of(splits), out_dtype=torch.float16, cfg=cfg, use_tma=use_tma)
        assert out.dtype == torch.float16
        check_kernel_result(out, reference64(op, a64, w64, splits), splits, I if op == "fwd" else O, f"{op} {cfg}")


@cpu_only
def test_kernel_refuses_in_one_line():
    splits, M, I, O = [3, 2], 5, 64, 48
    a, a_s, w, w_s, _, _ = quantized_operands("fwd", "fp8_rowwise", splits, M, I, O)
    offs = offs_of(splits)
    f32 = torch.float32

    def fwd(recipe="fp8_rowwise", a=a, a_s=a_s, w=w, w_s=w_s, out_dtype=f32, cfg=None):
        return qg.quantized_gemm_forward(recipe, a, a_s, w, w_s, offs, out_dtype=out_dtype, cfg=cfg)

    block = quantized_operands("fwd", "fp8_block", splits, M, I, O)
    cases = [
        (ValueError, "mxfp8", lambda: fwd("mxfp8")),
        (TypeError, "x_data", lambda: fwd(a=a.float())),
        (TypeError, "w_scale", lambda: fwd(w_s=w_s.double())),
        (ValueError, "out_dtype", lambda: fwd(out_dtype=torch.int32)),
        # The dgrad takes the weight transposed with a scale per row of it: (N, cols, 1), not (N, 1, cols)
        # (the columnwise form's layout, untransposed).
        (
            ValueError,
            "TransposedWeight",
            lambda: qg.quantized_gemm_dgrad("fp8_rowwise", a, a_s, w, w_s.reshape(2, 1, O), offs, out_dtype=f32),
        ),
        (ValueError, "block_red", lambda: fwd("fp8_block", *block[:4], cfg=GemmConfig(32, 32, 64, 4, 1, 4, False))),
        (ValueError, "block_cols", lambda: fwd("fp8_block", *block[:4], cfg=GemmConfig(32, 48, 128, 4, 1, 4, False))),
    ]
    for exc, word, call in cases:
        with pytest.raises(exc, match=word) as info:
            call()
        assert "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_transposed_weight_is_the_quantization_of_the_transpose(recipe):
    """fp8_block: a 128 x 128 tile's transpose has the same amax, so transposing the tiles and their
    scales gives the bytes of quantizing w^T itself. fp8_rowwise: the columnwise form (a scale per input
    channel) transposed is the rowwise quantization of w^T (a scale per row of w^T)."""
    w = rand(3, 200, 136, seed=41) * torch.tensor([1.0, 1e-3, 30.0])[:, None, None]
    columnwise = recipe == "fp8_rowwise"
    w_q = moekit.group_quantize(w, None, recipe, rowwise=not columnwise, columnwise=columnwise, backend="torch")
    wt = transposed_weight(w_q)
    direct = moekit.group_quantize(w.transpose(1, 2).contiguous(), None, recipe, backend="torch")
    assert wt.data.shape == (3, 136, 200) and wt.data.is_contiguous() and wt.scale_inv.is_contiguous()
    assert torch.equal(wt.data.view(torch.uint8), direct.rowwise_data.view(torch.uint8))
    assert torch.equal(wt.scale_inv, direct.rowwise_scale_inv)
    with pytest.raises(ValueError, match="mxfp8"):
        transposed_weight(moekit.group_quantize(w, None, "mxfp8", backend="torch"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_cache_refreshes_the_transposed_copy_in_place(recipe, backend):
    """After an optimizer-style in-place update the cache's transposed copy is rewritten in place (every
    address kept, as a captured CUDA graph needs; by the quantization's own call) and equals one made
    fresh; its version counter moves (a backward that saved the old copy refuses to run); unchanged, it
    is reused."""
    w = rand(2, 72, 160, seed=43)
    cache = QuantizedWeightCache()
    w_q, wt = cache.get_transposed(w, [w], recipe, backend)
    ptrs = (wt.data.data_ptr(), wt.scale_inv.data_ptr())
    before = wt.data.view(torch.uint8).clone()
    versions = (wt.data._version, wt.scale_inv._version)
    assert cache.get_transposed(w, [w], recipe, backend)[1] is wt and cache.refreshes == 1
    with torch.no_grad():
        w.mul_(-2.5).add_(0.01)  # what optimizer.step() does: in place, version bumped
    w_q2, wt2 = cache.get_transposed(w, [w], recipe, backend)
    assert wt2.data._version > versions[0] and wt2.scale_inv._version > versions[1]
    assert cache.refreshes == 2 and w_q2 is w_q
    assert (wt2.data.data_ptr(), wt2.scale_inv.data_ptr()) == ptrs
    assert not torch.equal(wt2.data.view(torch.uint8), before)
    fresh = transposed_weight(w_q2)
    assert torch.equal(wt2.data.view(torch.uint8), fresh.data.view(torch.uint8))
    assert torch.equal(wt2.scale_inv, fresh.scale_inv)
    # A plain get() refreshes the kept copy too: it never goes stale.
    with torch.no_grad():
        w.add_(1.0)
    cache.get(w, [w], recipe, backend)
    assert torch.equal(
        cache.transposed.data.view(torch.uint8), transposed_weight(cache.quantized).data.view(torch.uint8)
    )


# --------------------------------------------------------------------------------------------------
# grouped_linear: which path runs, and its results
# --------------------------------------------------------------------------------------------------


def test_capability_is_asked_for():
    """Only a backend with the QuantizedGemm capability computes in FP8 (the Triton backend); the loop
    and torch backends have none and run the reference path."""
    assert quantized_gemm_of(backend_named("triton")) is not None
    assert quantized_gemm_of(backend_named("torch")) is None
    assert quantized_gemm_of(backend_named("loop")) is None


def _spy(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("quantized_linear_forward", "quantized_linear_dgrad"):
        inner = getattr(library, name)
        monkeypatch.setattr(library, name, lambda *a, _n=name, _f=inner: calls.append(_n) or _f(*a))
    return calls


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_backends_without_the_capability_run_the_reference_path(backend, monkeypatch):
    calls = _spy(monkeypatch)
    x, w = rand(12, 32, seed=1).requires_grad_(True), rand(2, 16, 32, seed=2)
    moekit.grouped_linear(x, w, [5, 7], quantization="fp8_block", backend=backend).sum().backward()
    assert calls == []


@cpu_only
def test_triton_backend_runs_fp8_where_it_can_and_the_reference_path_elsewhere(monkeypatch):
    calls = _spy(monkeypatch)
    x, w = rand(12, 32, seed=1).requires_grad_(True), rand(2, 16, 32, seed=2)
    for recipe in FP8_RECIPES:
        moekit.grouped_linear(x, w, [5, 7], quantization=recipe, backend="triton").sum().backward()
    assert calls == ["quantized_linear_forward", "quantized_linear_dgrad"] * 2
    calls.clear()
    # mxfp8 (no Hopper block-32 path) and a capability that says it cannot run: the reference path.
    moekit.grouped_linear(x, w, [5, 7], quantization="mxfp8", backend="triton").sum().backward()
    monkeypatch.setattr(qg, "fp8_gemm_unavailable_reason", lambda *a: "no FP8 tensor cores here")
    moekit.grouped_linear(x, w, [5, 7], quantization="fp8_block", backend="triton").sum().backward()
    assert calls == []


# (m_splits, padding rows, I, O)
E2E = {
    "odd-empty-middle-padding": ([9, 0, 30], 4, 200, 72),
    "tma-empty-first": ([0, 26, 14], 0, 160, 48),
}


@cpu_only
@pytest.mark.parametrize("case", list(E2E))
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_grouped_linear_fp8_matches_reference_path_and_float64(recipe, case):
    splits, padding, I, O = E2E[case]
    M, N = sum(splits) + padding, len(splits)
    x, w = rand(M, I, seed=11), rand(N, O, I, seed=12) / I**0.5
    b, s = rand(N, O, seed=13), torch.rand(M, generator=torch.Generator().manual_seed(14))
    upstream = rand(M, O, seed=15)
    device_splits = torch.tensor(splits)  # a tensor: the offsets as a device would hold them
    results = {}
    for backend in ("triton", "torch"):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = moekit.grouped_linear(
            leaves[0], leaves[1], device_splits, leaves[2], bias_scale=s, quantization=recipe, backend=backend
        )
        y.backward(upstream)
        results[backend] = (y.detach(), *(t.grad for t in leaves))
    leaves64 = [t.double().requires_grad_(True) for t in (x, w, b)]
    y64 = grouped_linear_reference(leaves64[0], leaves64[1], splits, leaves64[2], bias_scale=s.double())
    y64.backward(upstream.double())
    exact = (y64.detach(), *(t.grad for t in leaves64))
    used = sum(splits)
    for name, ours, ref, ref64, red in zip(
        ("y", "dx", "dw", "db"), results["triton"], results["torch"], exact, (I, O, M, M), strict=True
    ):
        assert not torch.isnan(ours).any(), name
        floor = 2 * tolerance_floor(torch.float32, red)
        assert rel_err(ours, ref) <= floor, f"{name}: {rel_err(ours, ref):.3e} off the reference path (> {floor:.1e})"
        assert rel_err(ours, ref64) <= BOUND, f"{name}: {rel_err(ours, ref64):.3e} off float64 (> {BOUND})"
    y, dx = results["triton"][:2]
    assert torch.count_nonzero(y[used:]) == 0 and torch.count_nonzero(dx[used:]) == 0
    empty = [g for g, c in enumerate(splits) if c == 0]
    assert all(torch.count_nonzero(results["triton"][2][g]) == 0 for g in empty)


@cpu_only
def test_grouped_linear_fp8_device_offsets():
    """Offsets the host was not given (GroupOffsets built on the device): the same results."""
    splits = [6, 0, 9]
    x, w = rand(17, 48, seed=21), rand(3, 40, 48, seed=22)
    offs = device_offsets(torch.tensor(splits), 3, 17, torch.device("cpu"))
    for recipe in FP8_RECIPES:
        y_dev = moekit.grouped_linear(x, w, offs, quantization=recipe, backend="triton")
        y_host = moekit.grouped_linear(x, w, splits, quantization=recipe, backend="triton")
        assert torch.equal(y_dev, y_host)


# --------------------------------------------------------------------------------------------------
# GPU (-m gpu): the real kernels at realistic shapes, no host sync
# --------------------------------------------------------------------------------------------------

GPU_SHAPES = [
    # M, I, O, splits (8 experts: skewed, an empty one, padding rows)
    pytest.param(4096, 2048, 1536, [0, 700, 512, 1300, 900, 333, 3, 48], id="M4096-I2048-O1536-skewed-empty-padding"),
    pytest.param(4096, 1536, 2048, [512] * 8, id="M4096-I1536-O2048-balanced"),
    pytest.param(1000, 200, 136, [0, 400, 1, 0, 500, 33, 0, 50], id="odd-sizes-pointer-path"),
    # odd step counts both ways (23 and 11 steps of 128; fp8_block's loop takes two an iteration)
    pytest.param(2048, 2880, 1408, [300, 0, 900, 548, 1, 199], id="M2048-I2880-O1408-odd-steps"),
]


def kernel_on_device(device, recipe, op, M, I, O, splits, out_dtype, cfg=None, use_tma=None) -> None:
    """The FP8 kernel on `device` with device splits against the float64 product of the dequantized
    operands; on CUDA with no host sync (after a warm-up call). The rows' columns (the reduction) span
    two decades of magnitude, so that fp8_block's scale blocks along the reduction differ. cfg /
    use_tma: a fixed configuration and operand path (None: the kernel's choice)."""
    info, N = RECIPES[recipe], len(splits)
    gen = torch.Generator(device=device).manual_seed(0)
    red = I if op == "fwd" else O
    rows = torch.randn(M, red, device=device, generator=gen) * torch.logspace(-1, 1, red, device=device)
    rows = rows.to(out_dtype)
    w = (torch.randn(N, O, I, device=device, generator=gen) / I**0.5).to(out_dtype)
    m_splits = torch.tensor(splits, device=device)  # device splits: nothing read on the host
    rows_q = moekit.group_quantize(rows, m_splits, recipe, backend="triton")
    columnwise = op == "dgrad" and recipe == "fp8_rowwise"
    w_q = moekit.group_quantize(w, None, recipe, rowwise=not columnwise, columnwise=columnwise, backend="triton")
    a, a_s = rows_q.rowwise_data, rows_q.rowwise_scale_inv
    if columnwise:
        w_data, w_scale = w_q.columnwise_data, w_q.columnwise_scale_inv
        offs_w = torch.arange(N + 1, device=device) * O
        w64 = dequantize_columnwise(info, w_data, w_scale, offs_w, offs_w, torch.float64)
    else:
        w_data, w_scale = w_q.rowwise_data, w_q.rowwise_scale_inv
        w64 = dequantize_rowwise(info, w_data, w_scale, torch.float64)
    if op == "dgrad":
        w_data, w_scale = transposed_weight(w_q)
    offs = offs_of(splits).to(device)
    fn = qg.quantized_gemm_forward if op == "fwd" else qg.quantized_gemm_dgrad
    result = {}

    def step():
        result["out"] = fn(recipe, a, a_s, w_data, w_scale, offs, out_dtype=out_dtype, cfg=cfg, use_tma=use_tma)

    if device.type == "cuda":
        assert_no_host_sync(step)
    else:
        step()
    rows64 = dequantize_rowwise(info, a, a_s, torch.float64)
    ref = torch.zeros(M, O if op == "fwd" else I, dtype=torch.float64, device=device)
    bounds = offs_of(splits).tolist()
    for g in range(N):
        lo, hi = bounds[g], bounds[g + 1]
        if hi > lo:
            ref[lo:hi] = rows64[lo:hi] @ (w64[g].T if op == "fwd" else w64[g])
    check_kernel_result(result["out"], ref, splits, I if op == "fwd" else O, f"{recipe} {op} on {device}")


@cpu_only
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_gpu_test_body_on_cpu(recipe):
    """The GPU test's own code, at a small shape under the interpreter (so that it is known to run)."""
    for op in ("fwd", "dgrad"):
        kernel_on_device(torch.device("cpu"), recipe, op, 50, 144, 80, [0, 20, 1, 0, 25], torch.float32)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("M, I, O, splits", GPU_SHAPES)
def test_gpu_kernel_against_dequantized_float64(recipe, op, M, I, O, splits):
    cuda = torch.device("cuda")
    reason = qg.fp8_gemm_unavailable_reason(recipe, cuda, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    kernel_on_device(cuda, recipe, op, M, I, O, splits, torch.bfloat16)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_gpu_fp8_block_every_sm90_candidate(op):
    """Every configuration the sm90 table offers fp8_block (the tuner may pick any), at an odd step count
    with ragged groups, empty ones and padding rows."""
    cuda = torch.device("cuda")
    reason = qg.fp8_gemm_unavailable_reason("fp8_block", cuda, torch.bfloat16)
    if reason is not None or torch.cuda.get_device_capability(cuda)[0] != 9:
        pytest.skip(reason or "the sm90 table is for Hopper")
    M, I, O, splits = 2048, 2880, 1408, [300, 0, 900, 548, 1, 199]
    cols = O if op == "fwd" else I
    for cfg in fp8_gemm_candidates(op, "fp8_block", True, "sm90", cols):
        kernel_on_device(cuda, "fp8_block", op, M, I, O, splits, torch.bfloat16, cfg=cfg, use_tma=True)


def linear_on_device(device, recipe, splits, M, I, O, dtype, monkeypatch) -> None:
    """grouped_linear on the FP8 kernels (asserted) with device splits, within the FP8 bound of float64;
    on CUDA with no host sync in the forward and the backward (after a warm-up step)."""
    calls = _spy(monkeypatch)
    N = len(splits)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(M, I, device=device, generator=gen).to(dtype).requires_grad_(True)
    w = (torch.randn(N, O, I, device=device, generator=gen) / I**0.5).to(dtype).requires_grad_(True)
    upstream = torch.randn(M, O, device=device, generator=gen).to(dtype)
    m_splits = torch.tensor(splits, device=device)

    def step():
        x.grad = w.grad = None
        y = moekit.grouped_linear(x, w, m_splits, quantization=recipe, backend="triton")
        y.backward(upstream)
        return y

    if device.type == "cuda":
        assert_no_host_sync(step)
    y = step()
    assert "quantized_linear_forward" in calls and "quantized_linear_dgrad" in calls
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    y64 = grouped_linear_reference(x64, w64, m_splits.cpu())
    y64.backward(upstream.double())
    for name, ours, ref in (("y", y, y64), ("dx", x.grad, x64.grad), ("dw", w.grad, w64.grad)):
        assert rel_err(ours, ref) <= BOUND, f"{name}: {rel_err(ours, ref):.3e} > {BOUND}"
    used = sum(splits)
    assert torch.count_nonzero(y[used:]) == 0 and torch.count_nonzero(x.grad[used:]) == 0


@cpu_only
def test_gpu_linear_test_body_on_cpu(monkeypatch):
    """The GPU test's own code, at a small shape under the interpreter."""
    linear_on_device(torch.device("cpu"), "fp8_block", [0, 30, 1, 0, 25], 60, 144, 80, torch.float32, monkeypatch)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_gpu_grouped_linear_fp8_within_bound_and_without_host_sync(recipe, monkeypatch):
    cuda = torch.device("cuda")
    reason = qg.fp8_gemm_unavailable_reason(recipe, cuda, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    splits = [0, 700, 512, 1300, 900, 333, 3, 48]  # 3796 of 4096 rows: padding, empty experts
    linear_on_device(cuda, recipe, splits, 4096, 2048, 1536, torch.bfloat16, monkeypatch)


# --------------------------------------------------------------------------------------------------
# fp8_block's Gluon kernel on sm_90 (kernels.grouped_gemm_fp8_hopper): -m gpu, checked on the CPU's Triton kernel
# --------------------------------------------------------------------------------------------------

# (M, I, O, splits): skewed groups, empty ones (first and middle), padding rows; odd step counts (I 2880:
# 22.5 steps of 128) and output widths past a multiple of 128 (1040, 2880); one row; fewer columns than a
# tile; nothing but padding; a single one-row group.
HOPPER_SHAPES = [
    pytest.param(4096, 2048, 1536, [0, 700, 512, 1300, 900, 333, 3, 48], id="M4096-skewed-empty-padding"),
    pytest.param(2048, 2880, 1040, [300, 0, 900, 548, 1, 199], id="odd-steps-ragged-cols"),
    pytest.param(300, 256, 96, [0, 1, 0], id="one-row-narrow-tile"),
    pytest.param(640, 384, 208, [0, 0, 0, 0], id="all-padding"),
    pytest.param(1, 128, 128, [1], id="single-row"),
]


def hopper_case(device, op, M, I, O, splits, out_dtype, with_bias=False, nan_padding=False) -> None:
    """fp8_block's product on `device` as the runtime picks its kernel, against the float64 product of the
    dequantized operands (the floor of `check_kernel_result`, padding rows exactly zero) and against the
    Triton kernel at its default configuration for the architecture, bit for bit: on an H200 the runtime
    runs the Gluon kernel (asserted from the profile, with no host sync), which computes the Triton
    kernel's fp32 operations in its order (the same m64n128k32 products, one fma per element and step,
    the same epilogue). with_bias (forward): a bias and a per-row bias scale. nan_padding: the rows operand's
    padding rows (past offs[N]) hold NaN bytes, which must not reach the output."""
    N, red = len(splits), I if op == "fwd" else O
    cols = O if op == "fwd" else I
    gen = torch.Generator(device=device).manual_seed(11)
    rows = (torch.randn(M, red, device=device, generator=gen) * torch.logspace(-1, 1, red, device=device)).to(out_dtype)
    w = (torch.randn(N, O, I, device=device, generator=gen) / I**0.5).to(out_dtype)
    rows_q = moekit.group_quantize(rows, torch.tensor(splits, device=device), "fp8_block", backend="triton")
    w_q = moekit.group_quantize(w, None, "fp8_block", backend="triton")
    a, a_s = rows_q.rowwise_data, rows_q.rowwise_scale_inv
    used = sum(splits)
    if nan_padding:
        a = a.clone()
        a[used:].view(torch.uint8).fill_(0x7F)  # float8 E4M3 NaN
    info = RECIPES["fp8_block"]
    w64 = dequantize_rowwise(info, w_q.rowwise_data, w_q.rowwise_scale_inv, torch.float64)
    w_data, w_scale = (w_q.rowwise_data, w_q.rowwise_scale_inv) if op == "fwd" else transposed_weight(w_q)
    bias = (torch.randn(N, O, device=device, generator=gen) * 0.1).to(out_dtype) if with_bias else None
    bias_scale = torch.rand(M, device=device, generator=gen) if with_bias else None
    offs = offs_of(splits).to(device)

    def run(**kw):
        if op == "fwd":
            return qg.quantized_gemm_forward(
                "fp8_block", a, a_s, w_data, w_scale, offs, bias, bias_scale, out_dtype=out_dtype, **kw
            )
        return qg.quantized_gemm_dgrad("fp8_block", a, a_s, w_data, w_scale, offs, out_dtype=out_dtype, **kw)

    if device.type == "cuda":
        out = run_on_kernel(run, "grouped_mm_fp8_block_ws_kernel")
        triton_out = run(cfg=fp8_gemm_candidates(op, "fp8_block", True, "sm90", cols)[0], use_tma=True)
    else:
        out = run()
        triton_out = run(cfg=fp8_gemm_candidates(op, "fp8_block", True, "interpreter", cols)[0])
    ref = reference64(op, dequantize_rowwise(info, a, a_s, torch.float64), w64, splits, bias, bias_scale)
    check_kernel_result(out, ref, splits, red, f"fp8_block {op} {out_dtype} on {device}")
    assert torch.equal(out, triton_out), (
        f"{op}: not the Triton kernel's bits ({(out != triton_out).sum().item()} of {out.numel()} differ, "
        f"largest difference {(out.double() - triton_out.double()).abs().max().item():.3e})"
    )


@cpu_only
def test_hopper_test_body_on_cpu():
    """The Gluon kernel's GPU test code, at small shapes under the interpreter (where the Triton kernel runs)."""
    cpu = torch.device("cpu")
    for op in ("fwd", "dgrad"):
        hopper_case(cpu, op, 50, 144, 80, [0, 20, 1, 0, 25], torch.float32, nan_padding=True)
    hopper_case(cpu, "fwd", 40, 160, 48, [7, 0, 30], torch.float16, with_bias=True)


def test_hopper_kernel_only_where_it_applies():
    """The runtime keeps the Triton kernel for fp8_rowwise, a fixed cfg, operands without TMA and devices
    other than sm_90 (here: the CPU); on an sm_90 device it takes fp8_block's products."""
    a = torch.zeros(5, 128, dtype=torch.float8_e4m3fn)
    w = torch.zeros(2, 48, 128, dtype=torch.float8_e4m3fn)
    assert not qg.hopper_kernel_takes("fp8_block", a, w, True, None)  # not CUDA
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        a, w = a.cuda(), w.cuda()
        assert qg.hopper_kernel_takes("fp8_block", a, w, True, None)
        assert not qg.hopper_kernel_takes("fp8_rowwise", a, w, True, None)
        assert not qg.hopper_kernel_takes("fp8_block", a, w, False, None)
        assert not qg.hopper_kernel_takes("fp8_block", a, w, True, GemmConfig(128, 128, 128, 8, 2, 8, False, True))


_COMPILE_FP8_BLOCK_FOR_SM90 = """
import json, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource
from moekit.ops.kernels.grouped_gemm_fp8_hopper import grouped_mm_fp8_block_ws_kernel as kernel
from moekit.ops.runtime.configs import FP8_BLOCK_WS, FP8_BLOCK_WS_STAGES

out_ty, bias, scale, epi_tma = json.loads(sys.argv[1])
options = {"num_warps": FP8_BLOCK_WS["num_warps"], "maxnreg": FP8_BLOCK_WS["maxnreg"]}
const = {k: v for k, v in FP8_BLOCK_WS.items() if k not in options}
const.update(HAS_BIAS=bias, HAS_SCALE=scale, EPI_TMA=epi_tma, BLOCK_GROUPS=256, NUM_PROGRAMS=132,
             STAGES=FP8_BLOCK_WS_STAGES[4 if out_ty == "fp32" else 2])
pointer = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
           "scale_ptr": "*fp32", "offs_ptr": "*i64"}
sig = {n: "constexpr" if n in const else pointer.get(n, "*" + out_ty) if n.endswith("_ptr") else "i32"
       for n in kernel.arg_names}
# As the launcher specializes them: every pointer and integer argument a multiple of 16 (aligned tensors,
# the test layers' strides and sizes), which the epilogue's vectorized stores rely on.
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n not in const}
src = GluonASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()},
                     attrs=attrs)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
ptx = compiled.asm["ptx"]
with open(sys.argv[2], "w") as f:
    f.write(ptx)
log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", sys.argv[2], "-o", "/dev/null"],
                     capture_output=True, text=True).stderr
print(json.dumps({"shared": compiled.metadata.shared,
                  "waits": re.findall(r"wgmma\\.wait_group\\.sync\\.aligned (\\d+)", ptx),
                  "mma": sorted(set(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.([\\w.]+)", ptx))),
                  "serialized": [l for l in log.splitlines() if "C7514" in l or "C7515" in l],
                  "stores": sorted(set(re.findall(r"st\\.global\\.[\\w.]+", ptx)))}))
"""


@pytest.mark.parametrize(
    "out_ty, bias, scale, epi_tma",
    [
        ("bf16", False, False, True),
        ("bf16", True, True, True),
        ("fp32", True, False, True),
        ("fp16", False, False, False),
    ],
    ids=["bf16", "bf16-bias-row-scale", "fp32-bias", "fp16-pointer-stores"],
)
def test_hopper_fp8_block_kernel_compiles_for_sm90(out_ty, bias, scale, epi_tma, tmp_path):
    """The Gluon kernel's configurations compile for sm_90a inside Hopper's 227 KB of shared memory, with
    FP8 wgmma (m64n128k32), only `wgmma.wait_group 0` (two per math warp group and step: each waits for
    its own MMAs only) and no wgmma serialization by ptxas (C7514 / C7515). The masked pointer stores (a
    group's last, partial rows; every tile without EPI_TMA) store two columns at a time: the math warp
    groups take a tile's first column from the load warp's record, and where the compiler cannot see it
    a multiple of the tile width it stores one element at a time. In its own process, as
    test_gemm_kernels.py's Hopper compile test (Gluon cannot compile where TRITON_INTERPRET=1 is set)."""
    args = json.dumps([out_ty, bias, scale, epi_tma])
    got = compile_in_subprocess(_COMPILE_FP8_BLOCK_FOR_SM90, args, str(tmp_path / "k.ptx"))
    assert 0 < got["shared"] <= 227 * 1024
    assert got["mma"] == ["m64n128k32.f32.e4m3.e4m3"]
    assert got["waits"] == ["0"] * 4, got["waits"]
    assert not got["serialized"], got["serialized"]
    assert got["stores"] == ["st.global.v2.b32" if out_ty == "fp32" else "st.global.b32"], got["stores"]


def _hopper_or_skip() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on sm_90")


@gpu
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("M, I, O, splits", HOPPER_SHAPES)
def test_gpu_hopper_fp8_block_against_float64_and_triton_bits(op, M, I, O, splits, nan_poison):
    _hopper_or_skip()
    hopper_case(torch.device("cuda"), op, M, I, O, splits, torch.bfloat16)


@gpu
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gpu_hopper_fp8_block_output_dtypes(op, out_dtype, nan_poison):
    _hopper_or_skip()
    hopper_case(torch.device("cuda"), op, 2048, 2880, 1040, [300, 0, 900, 548, 1, 199], out_dtype)


@gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_hopper_fp8_block_bias_and_row_scale(out_dtype, nan_poison):
    _hopper_or_skip()
    hopper_case(torch.device("cuda"), "fwd", 2048, 2880, 1040, [300, 0, 900, 548, 1, 199], out_dtype, with_bias=True)


@gpu
def test_gpu_hopper_fp8_block_pointer_stores(nan_poison):
    """Output rows of 1036 bf16 (2072 bytes, not 16-byte aligned): every tile leaves by pointer stores."""
    _hopper_or_skip()
    hopper_case(torch.device("cuda"), "fwd", 1500, 512, 1036, [0, 600, 3, 700], torch.bfloat16, with_bias=True)


@gpu
def test_gpu_hopper_fp8_block_no_rows():
    """No rows: an empty output and no launch; no groups: zeros (the runtime's cases before any kernel)."""
    _hopper_or_skip()
    cuda, fp8 = torch.device("cuda"), torch.float8_e4m3fn
    a, a_s = torch.zeros(0, 256, dtype=fp8, device=cuda), torch.ones(0, 2, device=cuda)
    w, w_s = torch.zeros(2, 128, 256, dtype=fp8, device=cuda), torch.ones(2, 1, 2, device=cuda)
    out = qg.quantized_gemm_forward("fp8_block", a, a_s, w, w_s, offs_of([0, 0]).to(cuda), out_dtype=torch.bfloat16)
    assert out.shape == (0, 128)
    a, a_s = torch.zeros(3, 256, dtype=fp8, device=cuda), torch.ones(3, 2, device=cuda)
    w, w_s = torch.zeros(0, 128, 256, dtype=fp8, device=cuda), torch.ones(0, 1, 2, device=cuda)
    out = qg.quantized_gemm_forward("fp8_block", a, a_s, w, w_s, offs_of([]).to(cuda), out_dtype=torch.bfloat16)
    assert out.shape == (3, 128) and torch.count_nonzero(out) == 0


@gpu
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_gpu_hopper_fp8_block_nan_bytes_in_padding_rows(op, nan_poison):
    _hopper_or_skip()
    hopper_case(
        torch.device("cuda"),
        op,
        4096,
        2048,
        1536,
        [0, 700, 512, 1300, 900, 333, 3, 48],
        torch.bfloat16,
        nan_padding=True,
    )


@cpu_only
def test_compile_fullgraph_matches_eager():
    """The FP8 products are custom ops (`moekit::quantized_linear_forward` / `_dgrad`): torch.compile
    traces them as opaque nodes and computes exactly what eager does."""
    torch._dynamo.reset()
    x, w, b = rand(20, 48, seed=31), rand(2, 24, 48, seed=32), rand(2, 24, seed=33)

    def step(fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = fn(*leaves)
        y.backward(rand(*y.shape, seed=34))
        return [y.detach(), *(t.grad for t in leaves)]

    def linear(x, w, b):
        return moekit.grouped_linear(x, w, [8, 12], b, quantization="fp8_block", backend="triton")

    eager = step(linear)
    compiled = step(torch.compile(linear, fullgraph=True, backend="aot_eager"))
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)
    torch._dynamo.reset()
