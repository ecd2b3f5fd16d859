"""The FP8 grouped wgrad (`moekit.ops.runtime.quantized_gemm.quantized_gemm_wgrad`, fp8_block and
fp8_rowwise) and the quantized grouped linear's weight gradient on it.

As tests/ops/test_quantized_gemm.py: the kernel against float64 products of the DEQUANTIZED columnwise
operands (data * scale_inv in float64, exact), so that only the kernel's fp32 sums in its own order, the
scale products and the one rounding to the output's dtype remain:

    rel_err(dw, ref64) <= u(out dtype) + 16 * sqrt(L) * u(float32),   L the longest group,

and exact zeros for groups without rows. Padding rows of both operands hold NaN bytes (E4M3 0xFF) and
fresh allocations are NaN-poisoned (the transposed operands' buffers included): a NaN in dw means a
padding row or an unwritten byte was read.

Under the interpreter (CPU; the root conftest sets TRITON_INTERPRET=1 before triton is imported): its
fp8 tl.dot is exact and it runs the kernel itself (TMA descriptors and pointer loads), in float32 and
float16 outputs. GPU tests (`-m gpu`) run it at realistic shapes in bfloat16 with no host sync.

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
    main_loop_spills,
    rel_err,
    run_on_kernel,
    tolerance_floor,
)
from moekit.grouped_tensor import FP8_DTYPE, RECIPES, dequantize_columnwise
from moekit.ops import library
from moekit.ops.runtime.backends import backend_named, quantized_gemm_of, triton_unavailable_reason
from moekit.ops.runtime.quantize_torch import SEGMENT_COLUMNS
from moekit.reference import grouped_linear_reference

qg = pytest.importorskip("moekit.ops.runtime.quantized_gemm")
from moekit.ops.runtime.configs import GemmConfig, fp8_wgrad_candidates  # noqa: E402
from moekit.ops.runtime.launch import forget_plans  # noqa: E402

ON_CPU = triton_unavailable_reason(torch.device("cpu"), torch.float32) is None
cpu_only = pytest.mark.skipif(not ON_CPU, reason="needs the Triton interpreter (TRITON_INTERPRET=1 before import)")
gpu = pytest.mark.gpu
RECIPE = "fp8_rowwise"
WGRAD_RECIPES = ["fp8_block", "fp8_rowwise"]
BOUND = 0.08  # tests/test_quantized_compute.py's FP8 bound against float64

# (m_splits, M, I, O): groups without rows (first, middle, last), one row, sizes not multiples of 16
# (segments with a tail, tiles past I and O), padding rows, groups longer than one step and one tile,
# and groups across several of fp8_block's 128-row scale blocks (whole, ragged, one row past a block).
LAYOUTS = {
    "several-scale-blocks": ([300, 0, 129, 1, 256], 700, 40, 24),
    "odd-empty-middle-padding": ([10, 0, 25], 40, 72, 56),
    "empty-first-one-row": ([0, 1, 33], 37, 40, 48),
    "many-steps-ragged": ([70, 3, 0], 80, 33, 20),
    "all-padding": ([0, 0], 9, 32, 16),
    "no-rows": ([0, 0, 0], 0, 32, 16),
    "whole-steps": ([32, 16, 48], 96, 64, 32),
}


def offs_of(splits: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(splits, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def columnwise_operands(splits, M, I, O, device, dtype=torch.float32, seed=0, recipe=RECIPE):
    """(dy data, dy scales, x data, x scales, dy64, x64): `recipe`'s columnwise quantizations of dy (M, O)
    and x (M, I) with device splits, padding rows' data set to NaN bytes, and the dequantized float64
    operands (padding rows zero). fp8_block: the rows also vary in magnitude, so that every 128-row
    block of a group has its own scales."""
    info = RECIPES[recipe]
    gen = torch.Generator(device=device).manual_seed(seed)
    # Columns of very different magnitudes: the per-(group, column) scales matter.
    dy = (torch.randn(M, O, device=device, generator=gen) * torch.logspace(-2, 0.5, O, device=device)).to(dtype)
    x = (torch.randn(M, I, device=device, generator=gen) * torch.logspace(0.5, -2, I, device=device)).to(dtype)
    if recipe == "fp8_block":
        rows = torch.logspace(-1, 1, M, device=device)[torch.randperm(M, generator=gen, device=device)]
        dy, x = (dy * rows[:, None]).to(dtype), (x * rows.flip(0)[:, None]).to(dtype)
    m_splits = torch.tensor(splits, device=device)
    dq = moekit.group_quantize(dy, m_splits, recipe, rowwise=False, columnwise=True, backend="triton")
    xq = moekit.group_quantize(x, m_splits, recipe, rowwise=False, columnwise=True, backend="triton")
    offs = offs_of(splits).to(device)
    d64 = dequantize_columnwise(
        info, dq.columnwise_data, dq.columnwise_scale_inv, offs, dq.columnwise_scale_offsets, torch.float64
    )
    x64 = dequantize_columnwise(
        info, xq.columnwise_data, xq.columnwise_scale_inv, offs, xq.columnwise_scale_offsets, torch.float64
    )
    used = sum(splits)
    dy_data, x_data = dq.columnwise_data.clone(), xq.columnwise_data.clone()
    dy_data.view(torch.uint8)[used:] = 0xFF  # E4M3 NaN: padding rows must never be read
    x_data.view(torch.uint8)[used:] = 0xFF
    d64[used:] = 0
    x64[used:] = 0
    return dy_data, dq.columnwise_scale_inv, x_data, xq.columnwise_scale_inv, d64, x64


def reference64(d64, x64, splits) -> torch.Tensor:
    bounds = offs_of(splits).tolist()
    out = torch.zeros(len(splits), d64.shape[1], x64.shape[1], dtype=torch.float64, device=d64.device)
    for g in range(len(splits)):
        lo, hi = bounds[g], bounds[g + 1]
        if hi > lo:
            out[g] = d64[lo:hi].T @ x64[lo:hi]
    return out


def check_wgrad(dw, ref, splits, what: str) -> None:
    assert dw.shape == ref.shape, f"{what}: shape {tuple(dw.shape)}, want {tuple(ref.shape)}"
    assert not torch.isnan(dw).any(), f"{what}: NaN in dw (a padding row or an unwritten byte read?)"
    for g, count in enumerate(splits):
        if count == 0:
            assert torch.count_nonzero(dw[g]) == 0, f"{what}: group {g} has no rows but a nonzero dw"
    if ref.numel() and ref.abs().max() > 0:
        err, floor = rel_err(dw, ref), fp8_product_floor(dw.dtype, max(splits, default=1), dw.device)
        assert err <= floor, f"{what}: relative error {err:.3e} against the dequantized float64 product > {floor:.2e}"
    # Per group too: a small group's error must not hide under a large one's norm.
    for g, count in enumerate(splits):
        if count and ref[g].abs().max() > 0:
            err, floor = rel_err(dw[g], ref[g]), fp8_product_floor(dw.dtype, count, dw.device)
            assert err <= floor, f"{what}: group {g} ({count} rows) relative error {err:.3e} > {floor:.2e}"


# --------------------------------------------------------------------------------------------------
# The kernel, under the interpreter
# --------------------------------------------------------------------------------------------------


@cpu_only
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_kernel_against_dequantized_float64(recipe, layout, nan_poison):
    splits, M, I, O = LAYOUTS[layout]
    dy, dy_s, x, x_s, d64, x64 = columnwise_operands(splits, M, I, O, torch.device("cpu"), recipe=recipe)
    dw = qg.quantized_gemm_wgrad(recipe, dy, dy_s, x, x_s, offs_of(splits), out_dtype=torch.float32)
    assert dw.dtype == torch.float32
    check_wgrad(dw, reference64(d64, x64, splits), splits, f"{recipe} {layout}")


@cpu_only
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_segment_transpose_layout(layout, nan_poison):
    """The wgrad's operand layout byte for byte: each group's rows transposed from a multiple of 128
    columns, zeros to the segment's end (the buffer is NaN-poisoned, so an unwritten byte shows), padding
    rows nowhere. Checked on the bytes because the interpreter's FP8 tl.dot takes a NaN byte times
    zero as zero (the GPU's does not), so the kernel tests alone would not see an unwritten zero."""
    splits, M, I, _ = LAYOUTS[layout]
    dy, _, x, _, _, _ = columnwise_operands(splits, M, I, 16, torch.device("cpu"))
    out = qg.segment_transpose(x, offs_of(splits)).view(torch.uint8)
    c = SEGMENT_COLUMNS
    assert out.shape[0] == I and out.shape[1] % c == 0 and out.shape[1] >= M + (c - 1) * len(splits)
    src, col = x.view(torch.uint8), 0
    bounds = offs_of(splits).tolist()
    for g, count in enumerate(splits):
        width = -(-count // c) * c
        assert torch.equal(out[:, col : col + count], src[bounds[g] : bounds[g + 1]].T), f"group {g}'s rows"
        assert torch.count_nonzero(out[:, col + count : col + width]) == 0, f"group {g}'s segment tail"
        col += width
    assert not (out[:, :col] == 0xFF).any()  # no padding row (NaN bytes) inside a segment


@cpu_only
@pytest.mark.parametrize(
    "cfg, use_tma",
    [
        pytest.param(GemmConfig(16, 32, 32, 1, 1, 4, True, True), True, id="tma-32-row-steps-tma-stores"),
        pytest.param(GemmConfig(32, 16, 16, 2, 1, 4, True, False), True, id="tma-pointer-stores"),
        pytest.param(GemmConfig(32, 32, 16, 4, 1, 4, True, False), False, id="pointer-loads"),
        pytest.param(GemmConfig(16, 16, 128, 4, 1, 4, False, True), True, id="tma-128-row-steps"),
    ],
)
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_kernel_paths_and_float16_output(recipe, cfg, use_tma, nan_poison):
    """The operand paths and tile shapes (TMA or pointer loads, TMA or pointer stores, 16-, 32- and
    128-row steps: fp8_block's steps a quarter, an eighth of or a whole scale block) on one ragged
    layout, with a float16 output."""
    splits, M, I, O = [0, 45, 19, 1, 300], 380, 48, 40
    dy, dy_s, x, x_s, d64, x64 = columnwise_operands(splits, M, I, O, torch.device("cpu"), seed=5, recipe=recipe)
    dw = qg.quantized_gemm_wgrad(
        recipe, dy, dy_s, x, x_s, offs_of(splits), out_dtype=torch.float16, cfg=cfg, use_tma=use_tma
    )
    assert dw.dtype == torch.float16
    check_wgrad(dw, reference64(d64, x64, splits), splits, f"{recipe} {cfg} tma={use_tma}")


@cpu_only
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_kernel_strided_rows_and_plan_reuse(recipe, nan_poison):
    """Rows with a row stride above their width (a view) give the same dw as contiguous ones; a second
    call of the same problem with other split sizes (device offsets, same shapes) reuses the plan and
    follows the new splits."""
    splits, M, I, O = [5, 0, 150], 160, 40, 24
    dy, dy_s, x, x_s, d64, x64 = columnwise_operands(splits, M, I, O, torch.device("cpu"), seed=7, recipe=recipe)
    wide = torch.zeros(M, I + 16, dtype=FP8_DTYPE)
    wide[:, :I] = x
    dense = qg.quantized_gemm_wgrad(recipe, dy, dy_s, x, x_s, offs_of(splits), out_dtype=torch.float32)
    strided = qg.quantized_gemm_wgrad(recipe, dy, dy_s, wide[:, :I], x_s, offs_of(splits), out_dtype=torch.float32)
    assert torch.equal(dense, strided)
    other = [130, 13, 0]
    dy2, dy2_s, x2, x2_s, d2, x2_64 = columnwise_operands(other, M, I, O, torch.device("cpu"), seed=8, recipe=recipe)
    dw2 = qg.quantized_gemm_wgrad(recipe, dy2, dy2_s, x2, x2_s, offs_of(other), out_dtype=torch.float32)
    check_wgrad(dw2, reference64(d2, x2_64, other), other, "second split")


@cpu_only
def test_plan_makes_no_full_size_stand_ins(monkeypatch):
    """Planning a new problem allocates nothing of the operands' size (only where configurations are
    timed, on a GPU with the search on, does it make operands to time them on): a new problem arrives in
    the backward, at the layer's peak."""
    splits, M, I, O = [70, 0, 90], 160, 40, 24
    dy, dy_s, x, x_s, *_ = columnwise_operands(splits, M, I, O, torch.device("cpu"), seed=9)
    made = []
    original = qg.empty
    monkeypatch.setattr(qg, "empty", lambda shape, *a: made.append(tuple(shape)) or original(shape, *a))
    forget_plans()
    qg.quantized_gemm_wgrad(RECIPE, dy, dy_s, x, x_s, offs_of(splits), out_dtype=torch.float32)
    pitch = dy.shape[1]
    assert made and all(shape[0] <= 1 for shape in made if shape[-1] == pitch), made


@cpu_only
def test_kernel_refuses_in_one_line():
    splits, M, I, O = [3, 2], 5, 32, 16
    dy, dy_s, x, x_s, _, _ = columnwise_operands(splits, M, I, O, torch.device("cpu"))
    offs = offs_of(splits)
    f32 = torch.float32

    def wgrad(recipe=RECIPE, dy=dy, dy_s=dy_s, x=x, x_s=x_s, out_dtype=f32):
        return qg.quantized_gemm_wgrad(recipe, dy, dy_s, x, x_s, offs, out_dtype=out_dtype)

    cases = [
        (ValueError, "dy_scale", lambda: wgrad("fp8_block")),  # fp8_rowwise's scales given to fp8_block
        (ValueError, "mxfp8", lambda: wgrad("mxfp8")),
        (TypeError, "x_data", lambda: wgrad(x=x.float())),
        (TypeError, "dy_scale", lambda: wgrad(dy_s=dy_s.double())),
        (ValueError, "x_scale", lambda: wgrad(x_s=x_s[:, :-1])),
        (ValueError, "dy_data", lambda: wgrad(dy=dy[:-1])),
        (ValueError, "out_dtype", lambda: wgrad(out_dtype=torch.int32)),
    ]
    for exc, word, call in cases:
        with pytest.raises(exc, match=word) as info:
            call()
        assert "\n" not in str(info.value), str(info.value)
    bdy, bdy_s, bx, bx_s, _, _ = columnwise_operands(splits, M, I, O, torch.device("cpu"), recipe="fp8_block")
    with pytest.raises(ValueError, match="block_red") as info:
        qg.quantized_gemm_wgrad(
            "fp8_block", bdy, bdy_s, bx, bx_s, offs, out_dtype=f32, cfg=GemmConfig(32, 32, 48, 1, 1, 4, False)
        )
    assert "\n" not in str(info.value), str(info.value)


# --------------------------------------------------------------------------------------------------
# grouped_linear: which path runs the wgrad, and its results
# --------------------------------------------------------------------------------------------------


def _spy(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("quantized_linear_wgrad", "grouped_linear_wgrad"):
        inner = getattr(library, name)
        monkeypatch.setattr(library, name, lambda *a, _n=name, _f=inner: calls.append(_n) or _f(*a))
    return calls


def test_capability_has_the_wgrad():
    fp8 = quantized_gemm_of(backend_named("triton"))
    assert fp8 is not None and callable(fp8.quantized_wgrad)


@cpu_only
def test_fp8_recipes_take_the_fp8_wgrad_and_mxfp8_the_reference_path(monkeypatch):
    """fp8_rowwise's and fp8_block's wgrad on the FP8 kernels; mxfp8 dequantizes and takes the GEMM; so
    do the FP8 recipes where the capability says the FP8 wgrad cannot run. Nothing silent: the spy sees
    which."""
    calls = _spy(monkeypatch)
    x, w = torch.randn(12, 32).requires_grad_(True), torch.randn(2, 16, 32).requires_grad_(True)
    for recipe, want in (
        ("fp8_rowwise", "quantized_linear_wgrad"),
        ("fp8_block", "quantized_linear_wgrad"),
        ("mxfp8", "grouped_linear_wgrad"),
    ):
        calls.clear()
        moekit.grouped_linear(x, w, [5, 7], quantization=recipe, backend="triton").sum().backward()
        assert calls == [want], (recipe, calls)
    monkeypatch.setattr(qg, "fp8_wgrad_unavailable_reason", lambda *a: "no FP8 wgrad here")
    for recipe in WGRAD_RECIPES:
        calls.clear()
        moekit.grouped_linear(x, w, [5, 7], quantization=recipe, backend="triton").sum().backward()
        assert calls == ["grouped_linear_wgrad"], (recipe, calls)


@cpu_only
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_grouped_linear_dw_matches_reference_path_and_float64(recipe):
    """dw of the FP8 wgrad against the reference path (the same quantized operands dequantized, then
    the backend's GEMM: in float32 only the order of the sums differs, so the kernel floor, doubled for
    the two sides) and against float64 within the FP8 bound; groups without rows exact zeros. (float16
    outputs: the kernel tests, against float64.)"""
    splits, padding, I, O = [9, 0, 30, 1, 140], 4, 40, 24
    M, N = sum(splits) + padding, len(splits)
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(M, I, generator=gen), torch.randn(N, O, I, generator=gen) / I**0.5
    upstream = torch.randn(M, O, generator=gen)
    device_splits = torch.tensor(splits)
    grads = {}
    for backend in ("triton", "torch"):
        leaves = [t.clone().requires_grad_(True) for t in (x, w)]
        moekit.grouped_linear(*leaves, device_splits, quantization=recipe, backend=backend).backward(upstream)
        grads[backend] = leaves[1].grad
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    grouped_linear_reference(x64, w64, splits).backward(upstream.double())
    ours = grads["triton"]
    assert not torch.isnan(ours).any()
    floor = 2 * tolerance_floor(torch.float32, M)
    assert rel_err(ours, grads["torch"]) <= floor, f"{rel_err(ours, grads['torch']):.3e} off the reference path"
    assert rel_err(ours, w64.grad) <= BOUND, f"{rel_err(ours, w64.grad):.3e} off float64 (> {BOUND})"
    assert torch.count_nonzero(ours[1]) == 0


@cpu_only
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_transposed_weight_view_gets_its_fp8_wgrad_in_its_own_layout(recipe):
    """A weight that is a transposed view of an (N, I, O) tensor (gpt-oss's experts) gets the FP8 wgrad
    computed as x^T dy, so the gradient reaching the stored tensor is dense in its layout (no copy of the
    whole gradient per backward), and equal to the contiguous weight's gradient up to the order of sums."""
    splits, I, O = [9, 0, 30, 1], 40, 24
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(sum(splits), I, generator=gen), torch.randn(len(splits), O, I, generator=gen) / I**0.5
    upstream = torch.randn(sum(splits), O, generator=gen)
    stored = w.transpose(1, 2).contiguous().requires_grad_(True)  # (N, I, O)
    plain = w.clone().requires_grad_(True)
    seen = []
    stored.register_hook(lambda g: seen.append(g.stride()))
    moekit.grouped_linear(x, stored.transpose(1, 2), splits, quantization=recipe, backend="triton").backward(upstream)
    moekit.grouped_linear(x, plain, splits, quantization=recipe, backend="triton").backward(upstream)
    assert seen == [stored.stride()]
    assert not torch.isnan(stored.grad).any()
    assert rel_err(stored.grad.transpose(1, 2), plain.grad) <= 2 * tolerance_floor(torch.float32, sum(splits))


@cpu_only
def test_compile_fullgraph_matches_eager():
    """The FP8 wgrad is a custom op (`moekit::quantized_linear_wgrad`, with a fake): torch.compile traces
    it as an opaque node and computes exactly what eager does."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(31)
    x, w = torch.randn(20, 48, generator=gen), torch.randn(2, 24, 48, generator=gen)
    up = torch.randn(20, 24, generator=gen)

    def step(fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, w)]
        fn(*leaves).backward(up)
        return [t.grad for t in leaves]

    def linear(x, w):
        return moekit.grouped_linear(x, w, [8, 12], quantization=RECIPE, backend="triton")

    eager = step(linear)
    compiled = step(torch.compile(linear, fullgraph=True, backend="aot_eager"))
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------
# GPU (-m gpu): the real kernel at realistic shapes, no host sync
# --------------------------------------------------------------------------------------------------

GPU_SHAPES = [
    # M, I, O, splits (skewed, empty experts, one row, padding rows; groups of whole, ragged and odd
    # numbers of 128-row steps)
    pytest.param(4096, 2048, 1536, [0, 700, 512, 1300, 900, 333, 1, 48], id="M4096-I2048-O1536-skewed-empty-padding"),
    pytest.param(8192, 7168, 4096, [256] * 32, id="M8192-I7168-O4096-32-experts-balanced"),
    pytest.param(16384, 7168, 2048, [384, 640, 129, 0, 1, 3000, 2047, 127] * 2, id="M16384-I7168-O2048-ragged"),
    pytest.param(1000, 200, 136, [0, 400, 1, 0, 500, 33, 0, 50], id="odd-sizes"),
]


def wgrad_on_device(device, M, I, O, splits, out_dtype, recipe=RECIPE) -> None:
    """`recipe`'s FP8 wgrad on `device` with device offsets against the float64 product of the
    dequantized columnwise operands; on CUDA with no host sync (after a warm-up call)."""
    dy, dy_s, x, x_s, d64, x64 = columnwise_operands(splits, M, I, O, device, dtype=out_dtype, recipe=recipe)
    offs = offs_of(splits).to(device)
    result = {}

    def step():
        result["dw"] = qg.quantized_gemm_wgrad(recipe, dy, dy_s, x, x_s, offs, out_dtype=out_dtype)

    if device.type == "cuda":
        assert_no_host_sync(step)
    else:
        step()
    check_wgrad(result["dw"], reference64(d64, x64, splits), splits, f"{recipe} wgrad on {device}")


@cpu_only
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_gpu_test_body_on_cpu(recipe):
    """The GPU test's own code, at a small shape under the interpreter (so that it is known to run)."""
    wgrad_on_device(torch.device("cpu"), 50, 48, 40, [0, 20, 1, 0, 25], torch.float32, recipe)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M, I, O, splits", GPU_SHAPES)
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_gpu_wgrad_against_dequantized_float64(recipe, M, I, O, splits, nan_poison, gpu_to_itself):
    cuda = torch.device("cuda")
    reason = qg.fp8_wgrad_unavailable_reason(recipe, cuda, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    wgrad_on_device(cuda, M, I, O, splits, torch.bfloat16, recipe)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_block_wgrad_every_sm90_candidate(nan_poison):
    """Every configuration the sm90 table offers fp8_block's wgrad (the tuner may pick any), on ragged
    groups (whole, odd and partial 128-row steps, one row, none) and padding rows."""
    cuda = torch.device("cuda")
    reason = qg.fp8_wgrad_unavailable_reason("fp8_block", cuda, torch.bfloat16)
    if reason is not None or torch.cuda.get_device_capability(cuda)[0] != 9:
        pytest.skip(reason or "the sm90 table is for Hopper")
    M, I, O, splits = 4096, 2880, 1408, [384, 640, 129, 0, 1, 1500, 1000, 127]
    dy, dy_s, x, x_s, d64, x64 = columnwise_operands(splits, M, I, O, cuda, torch.bfloat16, recipe="fp8_block")
    for cfg in fp8_wgrad_candidates("fp8_block", True, "sm90"):
        dw = qg.quantized_gemm_wgrad(
            "fp8_block", dy, dy_s, x, x_s, offs_of(splits).to(cuda), out_dtype=torch.bfloat16, cfg=cfg, use_tma=True
        )
        check_wgrad(dw, reference64(d64, x64, splits), splits, f"fp8_block wgrad {cfg}")


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_gpu_grouped_linear_takes_the_fp8_wgrad_within_bound(recipe, monkeypatch):
    """grouped_linear(recipe) on the H200: the wgrad on the FP8 kernel (asserted), dw within the FP8
    bound of float64, no host sync in the forward and backward."""
    cuda = torch.device("cuda")
    reason = qg.fp8_wgrad_unavailable_reason(recipe, cuda, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    calls = _spy(monkeypatch)
    splits, M, I, O = [0, 700, 512, 1300, 900, 333, 3, 48], 4096, 2048, 1536
    gen = torch.Generator(device=cuda).manual_seed(1)
    x = torch.randn(M, I, device=cuda, generator=gen).bfloat16().requires_grad_(True)
    w = (torch.randn(len(splits), O, I, device=cuda, generator=gen) / I**0.5).bfloat16().requires_grad_(True)
    upstream = torch.randn(M, O, device=cuda, generator=gen).bfloat16()
    m_splits = torch.tensor(splits, device=cuda)

    def step():
        x.grad = w.grad = None
        moekit.grouped_linear(x, w, m_splits, quantization=recipe, backend="triton").backward(upstream)

    assert_no_host_sync(step)
    assert set(calls) == {"quantized_linear_wgrad"}
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    grouped_linear_reference(x64, w64, m_splits.cpu()).backward(upstream.double())
    assert rel_err(w.grad, w64.grad) <= BOUND, f"dw: {rel_err(w.grad, w64.grad):.3e} > {BOUND}"
    assert torch.count_nonzero(w.grad[0]) == 0


# --------------------------------------------------------------------------------------------------
# fp8_block's Gluon wgrad on Hopper (kernels.grouped_gemm_fp8_hopper.grouped_wgrad_fp8_block_ws_kernel)
# --------------------------------------------------------------------------------------------------


def hopper_wgrad_case(device, M, I, O, splits, out_dtype) -> None:
    """fp8_block's wgrad on `device` as the runtime picks its kernel, against the float64 product of the
    dequantized columnwise operands (padding rows NaN bytes, exact zeros for groups without rows) and
    against the Triton wgrad at its default configuration for the architecture, bit for bit: on an H200
    the runtime runs the Gluon kernel (asserted from the profile, with no host sync), which computes
    the Triton kernel's fp32 operations in its order (the same m64n128k32 FP8 product of each 128-row
    step, then per element s_dy * s_x and one fma into the accumulator, steps in order; the Triton
    kernel's extra promotions add products of scale 0 or of zeros, exact), then the one rounding."""
    dy, dy_s, x, x_s, d64, x64 = columnwise_operands(splits, M, I, O, device, dtype=out_dtype, recipe="fp8_block")
    offs = offs_of(splits).to(device)

    def run(**kw):
        return qg.quantized_gemm_wgrad("fp8_block", dy, dy_s, x, x_s, offs, out_dtype=out_dtype, **kw)

    if device.type == "cuda":
        dw = run_on_kernel(run, "grouped_wgrad_fp8_block_ws_kernel")
        triton_dw = run(cfg=fp8_wgrad_candidates("fp8_block", True, "sm90")[0], use_tma=True)
    else:
        dw = run()
        triton_dw = run(cfg=fp8_wgrad_candidates("fp8_block", True, "interpreter")[0])
    check_wgrad(dw, reference64(d64, x64, splits), splits, f"fp8_block wgrad {out_dtype} on {device}")
    assert torch.equal(dw, triton_dw), (
        f"not the Triton wgrad's bits ({(dw != triton_dw).sum().item()} of {dw.numel()} differ, "
        f"largest difference {(dw.double() - triton_dw.double()).abs().max().item():.3e})"
    )


@cpu_only
def test_hopper_wgrad_test_body_on_cpu(nan_poison):
    """The Gluon wgrad's GPU test code, at a small shape under the interpreter (where the Triton kernel runs)."""
    hopper_wgrad_case(torch.device("cpu"), 50, 48, 40, [0, 20, 1, 0, 25], torch.float32)


def test_hopper_wgrad_only_where_it_applies():
    """The runtime keeps the Triton wgrad for fp8_rowwise, a fixed cfg, operands without TMA, dw's of O or
    I not a multiple of 4 and devices other than sm_90 (here: the CPU); on an sm_90 device it takes
    fp8_block's wgrad."""
    cpu = torch.device("cpu")
    assert not qg.hopper_wgrad_takes("fp8_block", cpu, True, None, 4, 256, 64)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        cuda = torch.device("cuda")
        assert qg.hopper_wgrad_takes("fp8_block", cuda, True, None, 4, 256, 64)
        assert not qg.hopper_wgrad_takes("fp8_rowwise", cuda, True, None, 4, 256, 64)
        assert not qg.hopper_wgrad_takes("fp8_block", cuda, False, None, 4, 256, 64)
        cfg = fp8_wgrad_candidates("fp8_block", True, "sm90")[0]
        assert not qg.hopper_wgrad_takes("fp8_block", cuda, True, cfg, 4, 256, 64)
        assert not qg.hopper_wgrad_takes("fp8_block", cuda, True, None, 2**16, 2**15, 64)
        # Scale rows (TMA boxes) need 16-byte row strides: O and I multiples of 4.
        assert not qg.hopper_wgrad_takes("fp8_block", cuda, True, None, 4, 258, 64)
        assert not qg.hopper_wgrad_takes("fp8_block", cuda, True, None, 4, 256, 66)


_COMPILE_WGRAD_FOR_SM90 = """
import json, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource
from moekit.ops.kernels.grouped_gemm_fp8_hopper import grouped_wgrad_fp8_block_ws_kernel as kernel
from moekit.ops.runtime.configs import FP8_BLOCK_WGRAD_WS, FP8_BLOCK_WGRAD_WS_STAGES

out_ty, epi_tma = json.loads(sys.argv[1])
options = {"num_warps": FP8_BLOCK_WGRAD_WS["num_warps"], "maxnreg": FP8_BLOCK_WGRAD_WS["maxnreg"]}
const = {k: v for k, v in FP8_BLOCK_WGRAD_WS.items() if k not in options}
const.update(EPI_TMA=epi_tma, BLOCK_GROUPS=256, NUM_PROGRAMS=132,
             STAGES=FP8_BLOCK_WGRAD_WS_STAGES[4 if out_ty == "fp32" else 2])
pointer = {"dyt_ptr": "*fp8e4nv", "xt_ptr": "*fp8e4nv", "dy_scale_ptr": "*fp32", "x_scale_ptr": "*fp32",
           "offs_ptr": "*i64"}
sig = {n: "constexpr" if n in const else pointer.get(n, "*" + out_ty) if n.endswith("_ptr") else "i32"
       for n in kernel.arg_names}
src = GluonASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()})
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
ptx = compiled.asm["ptx"]
with open(sys.argv[2], "w") as f:
    f.write(ptx)
log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", sys.argv[2], "-o", sys.argv[3]],
                     capture_output=True, text=True).stderr
nvdisasm = get_ptxas(90).path.replace("ptxas", "nvdisasm")
with open(sys.argv[4], "w") as f:
    f.write(subprocess.run([nvdisasm, "-c", sys.argv[3]], capture_output=True, text=True).stdout)
print(json.dumps({"shared": compiled.metadata.shared,
                  "waits": re.findall(r"wgmma\\.wait_group\\.sync\\.aligned (\\d+)", ptx),
                  "mma": sorted(set(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.([\\w.]+)", ptx))),
                  "serialized": [l for l in log.splitlines() if "C7514" in l or "C7515" in l]}))
"""


@pytest.mark.parametrize(
    "out_ty, epi_tma, max_spills",
    # 16-bit dw by pointer stores (rows of I not 16-byte aligned: rare): the worker warp group's main loop
    # reloads a few loop invariants from the stack each step (8 local-memory instructions of ~700).
    [("bf16", True, 0), ("fp32", True, 0), ("fp32", False, 0), ("fp16", False, 8)],
    ids=["bf16", "fp32", "fp32-pointer-stores", "fp16-pointer-stores"],
)
def test_hopper_wgrad_kernel_compiles_for_sm90(out_ty, epi_tma, max_spills, tmp_path):
    """The Gluon wgrad's configurations compile for sm_90a inside Hopper's 227 KB of shared memory, with
    FP8 wgmma (m64n128k32), only `wgmma.wait_group 0` (two per math warp group and step), no wgmma
    serialization by ptxas (C7514 / C7515) and no spills in the main loops (each math warp group's: the
    shortest loops of the SASS that hold wgmma) but the named few. In its own process (Gluon cannot compile where
    TRITON_INTERPRET=1 is set)."""
    sass = tmp_path / "k.sass"
    got = compile_in_subprocess(
        _COMPILE_WGRAD_FOR_SM90, json.dumps([out_ty, epi_tma]), str(tmp_path / "k.ptx"), str(tmp_path / "k.cubin"),
        str(sass),
    )  # fmt: skip
    spills = main_loop_spills(sass.read_text(), "QGMMA")
    assert 0 < got["shared"] <= 227 * 1024
    assert got["mma"] == ["m64n128k32.f32.e4m3.e4m3"]
    assert got["waits"] == ["0"] * 4, got["waits"]
    assert not got["serialized"], got["serialized"]
    assert max(spills) <= max_spills, spills


def _hopper_or_skip() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon wgrad runs on sm_90")


HOPPER_WGRAD_SHAPES = [
    # M, I, O, splits: empty groups (first, middle, last), one row, groups not multiples of 128 (and of
    # 16: segment tails), a group of exactly 128, padding rows; widths not multiples of 128 / 256.
    pytest.param(4096, 2048, 1536, [0, 700, 512, 1300, 900, 333, 1, 48], id="M4096-I2048-O1536-skewed"),
    pytest.param(8192, 7168, 4096, [256] * 32, id="M8192-I7168-O4096-balanced"),
    pytest.param(3000, 2880, 1408, [128, 0, 1, 129, 1500, 1000, 127, 0], id="gpt-oss-widths-ragged"),
    pytest.param(1000, 200, 136, [0, 400, 1, 0, 500, 33, 0, 50], id="odd-widths"),
]


@gpu
@pytest.mark.parametrize("M, I, O, splits", HOPPER_WGRAD_SHAPES)
def test_gpu_hopper_wgrad_against_float64_and_triton_bits(M, I, O, splits, nan_poison):
    _hopper_or_skip()
    hopper_wgrad_case(torch.device("cuda"), M, I, O, splits, torch.bfloat16)


@gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gpu_hopper_wgrad_output_dtypes(out_dtype, nan_poison):
    _hopper_or_skip()
    hopper_wgrad_case(torch.device("cuda"), 2048, 2880, 1040, [300, 0, 900, 548, 1, 199], out_dtype)


@gpu
def test_gpu_hopper_wgrad_pointer_stores(nan_poison):
    """dw rows of 1036 bf16 (2072 bytes, not 16-byte aligned): every tile leaves by pointer stores."""
    _hopper_or_skip()
    hopper_wgrad_case(torch.device("cuda"), 1500, 1036, 520, [0, 600, 3, 700], torch.bfloat16)


@gpu
def test_gpu_hopper_wgrad_all_groups_empty(nan_poison):
    """Rows but no group owns any (all padding): every dw is zeros, from the kernel's empty tiles."""
    _hopper_or_skip()
    hopper_wgrad_case(torch.device("cuda"), 300, 256, 128, [0, 0, 0], torch.bfloat16)
