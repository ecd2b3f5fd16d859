"""The gated activation with both rowwise quantizations in one pass (`moekit.ops.quantize.group_quantize_gated`,
the quantized MLP's forward between its GEMMs): the bytes of `group_quantize` of the activation and of h's
held form, computed apart; refused, in one line, where the recipe's scale blocks cut across the GLU
layout; and the quantized MLP gives the same bits with and without it.

Under the interpreter (CPU) in float32 and float16 (its bfloat16 dot and conversions are not the GPU's);
on an sm_90 GPU in bfloat16 (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moekit
from helpers import assert_same_bits_without, quantized_mlp_step, rand
from moekit.ops import grouped_mlp as grouped_mlp_module
from moekit.ops import library
from moekit.ops.activations import activation_named
from moekit.ops.glu import check_interleave, gated_activation, to_held
from moekit.ops.quantize import group_quantize, group_quantize_gated
from moekit.ops.runtime import configs
from moekit.ops.runtime.backends import gated_quantize_unavailable_reason, triton_unavailable_reason
from moekit.ops.runtime.launch import arch_of, forget_plans
from moekit.ops.splits import GroupOffsets

needs_interpreter = pytest.mark.skipif(
    triton_unavailable_reason(torch.device("cpu"), torch.float32) is not None,
    reason="needs the Triton interpreter (TRITON_INTERPRET=1)",
)

# (F, glu_interleave_size, activation): [gate | up], interleaved pairs inside a scale block, GLU blocks
# of whole scale blocks; a partial last tile of columns (F = 96 for mxfp8).
LAYOUTS = [
    pytest.param((256, None, "swiglu"), id="gate|up-F256"),
    pytest.param((96, None, "swiglu"), id="gate|up-F96"),
    pytest.param((64, 1, "clamped_swiglu"), id="k1-clamped"),
    pytest.param((128, 16, "geglu"), id="k16-geglu"),
    pytest.param((256, 64, "swiglu"), id="k64"),
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _rows(device: torch.device, dtype: torch.dtype, rows: int, ffn: int, activation: str):
    """h with an empty group, padding rows (garbage in them: they read as zeros), values past the clamps,
    a NaN and an inf; probs; the offsets."""
    h = rand(rows, 2 * ffn, scale=4.0, seed=rows + ffn)
    h[1, 3], h[2, 2 * ffn - 1] = float("nan"), float("inf")
    h = h.to(device, dtype)
    probs = torch.rand(rows, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    live = rows - 3
    host = [0, live // 2, live // 2, live]
    offs = GroupOffsets.of(torch.tensor(host, device=device), host, rows)
    return h, probs, offs


def _check(recipe: str, ffn: int, k: int | None, activation: str, dtype: torch.dtype, device: torch.device, rows: int):
    glu = check_interleave(ffn, k)
    assert gated_quantize_unavailable_reason(recipe, ffn, glu) is None
    h, probs, offs = _rows(device, dtype, rows, ffn, activation)
    act = activation_named(activation)
    limits = (act.gate_limit or 0.0, act.up_limit or 0.0)
    # Against the quantize kernels it replaces (the torch path's bytes: tests/ops/test_quantize.py).
    want_a = group_quantize(gated_activation(h, probs, k, activation, True), offs, recipe, backend="triton")
    want_h = group_quantize(to_held(h, k, activation), offs, recipe, backend="triton")
    got_a, got_h = group_quantize_gated(h, offs, recipe, probs, glu, activation, *limits)
    for got, want, what in ((got_a, want_a, "a"), (got_h, want_h, "h")):
        assert got.recipe == want.recipe and got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
        assert got.columnwise_data is None and torch.equal(got.offsets, want.offsets)
        for name in ("rowwise_data", "rowwise_scale_inv"):
            g, w = getattr(got, name), getattr(want, name)
            assert g.dtype == w.dtype and g.shape == w.shape, (what, name)
            assert torch.equal(_bytes(g), _bytes(w)), f"{recipe} {what} {name}: bytes differ"
    # Every byte written: the op again over storage poisoned with 0xff (NaN in every format).
    storage = [
        t.clone() for t in (got_a.rowwise_data, got_a.rowwise_scale_inv, got_h.rowwise_data, got_h.rowwise_scale_inv)
    ]
    for t in storage:
        t.view(torch.uint8).fill_(0xFF)
    library.gated_quantize_into(h, probs, offs.offs, glu, activation, recipe, *limits, *storage)
    for t, w in zip(
        storage,
        (want_a.rowwise_data, want_a.rowwise_scale_inv, want_h.rowwise_data, want_h.rowwise_scale_inv),
        strict=True,
    ):
        assert torch.equal(_bytes(t), _bytes(w)), f"{recipe}: a byte left unwritten"
    if activation == "clamped_swiglu":  # the held form differs from h: the clamps were crossed
        assert not torch.equal(to_held(h, k, activation), h)


# The layouts each recipe takes (fp8_block refuses F = 96 in [gate | up]: test_refusals_name_the_recipe_and_the_layout).
TAKEN = [
    pytest.param(recipe, p.values[0], id=f"{recipe}-{p.id}")
    for recipe in ("fp8_block", "mxfp8")
    for p in LAYOUTS
    if gated_quantize_unavailable_reason(recipe, p.values[0][0], check_interleave(p.values[0][0], p.values[0][1]))
    is None
]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("recipe,layout", TAKEN)
def test_bytes_are_group_quantize_of_the_activation_and_of_held_h(recipe, layout, dtype):
    ffn, k, activation = layout
    _check(recipe, ffn, k, activation, dtype, torch.device("cpu"), 13)


def test_refusals_name_the_recipe_and_the_layout():
    """Whole-row scales, and scale blocks that cut across GLU blocks, are refused in one line (the
    quantized MLP then quantizes apart: the same bytes)."""
    assert "whole rows" in gated_quantize_unavailable_reason("fp8_rowwise", 256, 256)
    line = gated_quantize_unavailable_reason("fp8_block", 96, 96)
    assert line is not None and "\n" not in line and "128" in line and "96" in line
    assert gated_quantize_unavailable_reason("fp8_block", 2880, 2880) is not None  # gpt-oss's width, [gate | up]
    assert gated_quantize_unavailable_reason("fp8_block", 2880, 1) is None  # its own interleaved layout
    assert gated_quantize_unavailable_reason("mxfp8", 2880, 2880) is None


@needs_interpreter
@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
def test_quantized_mlp_is_bit_identical_with_and_without_it(recipe, monkeypatch):
    """grouped_mlp(..., quantization=recipe) on the Triton backend: output and every gradient the same
    bits whether the gated pass quantizes (its default where the layout allows) or not."""
    assert_same_bits_without(
        quantized_mlp_step(moekit.grouped_mlp, recipe), monkeypatch, (library, "gated_quantize_into"),
        (grouped_mlp_module, "gated_quantize_unavailable_reason"), "the gated pass quantizing",
    )  # fmt: skip


class _ZerosOfForms(TorchDispatchMode):
    """Records every zero-filled float8 tensor made while active (what autograd's materialized gradients
    of FP8 outputs would be)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float8_e4m3fn and "zero" in str(func):
            self.made.append(tuple(out.shape))
        return out


@needs_interpreter
def test_the_fp8_forms_cross_the_node_boundary_without_gradients(monkeypatch):
    """Where the gated pass quantizes, node 1 hands node 2 the FP8 forms and a carrier of h's gradient:
    the backward makes no zero gradients of the FP8 forms' sizes (autograd would materialize them for
    node 1's non-differentiable outputs), and without a gradient asked node 2 quantizes a alone (the
    pass does not run)."""
    rows, hidden, ffn, n = 21, 32, 128, 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen).requires_grad_()
    w1 = (torch.randn(n, 2 * ffn, hidden, generator=gen) / hidden**0.5).requires_grad_()
    w2 = (torch.randn(n, hidden, ffn, generator=gen) / ffn**0.5).requires_grad_()
    calls = []
    real_pass = library.gated_quantize_into
    monkeypatch.setattr(library, "gated_quantize_into", lambda *a: calls.append(1) or real_pass(*a))
    y = moekit.grouped_mlp(x, w1, w2, [9, 0, 10], backend="triton", quantization="fp8_block")
    with _ZerosOfForms() as zeros:
        y.sum().backward()
    assert calls and zeros.made == [] and x.grad is not None and w1.grad is not None
    with torch.no_grad():
        moekit.grouped_mlp(x, w1, w2, [9, 0, 10], backend="triton", quantization="fp8_block")
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "layout", [p for p in LAYOUTS if p.id != "gate|up-F96"] + [pytest.param((768, None, "swiglu"), id="qwen3")]
)
@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
@pytest.mark.parametrize("band", [None, 0, 3], ids=["table", "rows-fastest", "bands-of-3"])
def test_bytes_on_the_gpu(recipe, layout, band, monkeypatch):
    """The same bytes on the GPU in bfloat16 (hardware E4M3 conversion), rows across several tiles: at
    the architecture's table entry and in both program orders (BAND; 1003 rows end inside a band)."""
    ffn, k, activation = layout
    if band is not None:
        arch = arch_of(torch.device("cuda"))
        table = {runs: (*tile[:3], band) for runs, tile in configs.GATED_QUANTIZE_TILES[arch].items()}
        monkeypatch.setitem(configs.GATED_QUANTIZE_TILES, arch, table)
    forget_plans()
    try:
        _check(recipe, ffn, k, activation, torch.bfloat16, torch.device("cuda"), 1003)
    finally:
        forget_plans()
