"""fc2's wgrad operand made from the held h in one pass (`moekit.ops.quantize.group_quantize_held_columns`,
the quantized MLP's backward): the bytes of `group_quantize_for_wgrad` of the activation recomputed
from the held h (`held_gated_activation`), computed apart; every byte of the segments in use and every
scale written; the recipe whose columnwise scales span whole groups refused in one line; and the
quantized MLP gives the same bits with and without it.

Under the interpreter (CPU) in float32 and float16 (its bfloat16 conversions are not the GPU's); on an
sm_90 GPU in bfloat16 (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

import moekit
from helpers import assert_same_bits_without, quantized_mlp_step, rand
from moekit.ops import grouped_mlp as grouped_mlp_module
from moekit.ops import library
from moekit.ops.activations import activation_named
from moekit.ops.glu import check_interleave, held_gated_activation, to_held
from moekit.ops.quantize import group_quantize, group_quantize_for_wgrad, group_quantize_held_columns
from moekit.ops.runtime.backends import held_columns_unavailable_reason, triton_unavailable_reason
from moekit.ops.runtime.gated import narrowed, tile_scale_span
from moekit.ops.runtime.quantize_torch import SEGMENT_COLUMNS
from moekit.ops.splits import GroupOffsets

needs_interpreter = pytest.mark.skipif(
    triton_unavailable_reason(torch.device("cpu"), torch.float32) is not None,
    reason="needs the Triton interpreter (TRITON_INTERPRET=1)",
)

# (F, glu_interleave_size, activation): [gate | up] with a partial last tile of columns, interleaved
# pairs (gpt-oss's clamped layout), GLU blocks of 16.
LAYOUTS = [
    pytest.param((40, None, "swiglu"), id="gate|up-F40"),
    pytest.param((32, 1, "clamped_swiglu"), id="k1-clamped"),
    pytest.param((48, 16, "geglu"), id="k16-geglu"),
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _case(device: torch.device, dtype: torch.dtype, ffn: int, k: int | None, activation: str, recipe: str,
          splits: list[int], padding: int, probs: bool):  # fmt: skip
    """h's held quantization over groups `splits` and `padding` rows past them (their values garbage:
    they read as zeros), values past the clamps, a NaN and an inf; probs or None; the offsets."""
    rows = sum(splits) + padding
    h = rand(rows, 2 * ffn, scale=4.0, seed=rows + ffn).to(device, dtype)
    if rows > 140:
        h[2, 3], h[140, 2 * ffn - 1] = float("nan"), float("inf")
    host = [0]
    for s in splits:
        host.append(host[-1] + s)
    offs = GroupOffsets.of(torch.tensor(host, device=device), host, rows)
    h_q = group_quantize(to_held(h, k, activation), offs, recipe, backend="triton")
    p = torch.rand(rows, generator=torch.Generator().manual_seed(1)).to(device, dtype) if probs else None
    return h_q, p, offs, host


def _check(recipe, ffn, k, activation, dtype, device, splits, padding, probs):
    glu = check_interleave(ffn, k)
    h_q, p, offs, host = _case(device, dtype, ffn, k, activation, recipe, splits, padding, probs)
    act = activation_named(activation)
    limits = (act.gate_limit or 0.0, act.up_limit or 0.0)
    # Against the two launches it replaces (their bytes are the torch path's: tests/ops/test_quantize_for_wgrad.py).
    _, want = group_quantize_for_wgrad(held_gated_activation(h_q, p, k, activation), offs, recipe, backend="triton")
    got = group_quantize_held_columns(h_q, offs, p, glu, activation, *limits)
    used = sum(-(-(hi - lo) // SEGMENT_COLUMNS) * SEGMENT_COLUMNS for lo, hi in zip(host, host[1:], strict=False))
    assert got.rows == want.rows and got.data.shape == want.data.shape and got.data.dtype == want.data.dtype
    assert got.scale_inv.shape == want.scale_inv.shape and got.scale_inv.dtype == want.scale_inv.dtype
    assert torch.equal(_bytes(got.scale_inv), _bytes(want.scale_inv)), f"{recipe}: scales differ"
    assert torch.equal(_bytes(got.data[:, :used]), _bytes(want.data[:, :used])), f"{recipe}: bytes differ"
    if host[-1] > 140:  # the NaN and the inf reached the activation: NaN scales (E8M0 byte 255)
        nan_scale = got.scale_inv.view(torch.uint8) == 255 if recipe == "mxfp8" else torch.isnan(got.scale_inv)
        assert nan_scale.any()
    # Every byte in use written: the op again over storage poisoned with 0xff (NaN in every format).
    data, scale = got.data.clone(), got.scale_inv.clone()
    data.view(torch.uint8).fill_(0xFF)
    scale.view(torch.uint8).fill_(0xFF)
    slot_offs = torch.tensor(_slot_firsts(host, 32 if recipe == "mxfp8" else 128), device=device)
    library.held_columns_into(
        h_q.rowwise_data, h_q.rowwise_scale_inv, p, offs.offs, slot_offs, glu, activation, recipe, h_q.dtype,
        *limits, data, scale,
    )  # fmt: skip
    assert torch.equal(_bytes(scale), _bytes(want.scale_inv)), f"{recipe}: a scale left unwritten"
    assert torch.equal(_bytes(data[:, :used]), _bytes(want.data[:, :used])), f"{recipe}: a byte left unwritten"


def _slot_firsts(host: list[int], block: int) -> list[int]:
    firsts = [0]
    for lo, hi in zip(host, host[1:], strict=False):
        firsts.append(firsts[-1] + -(-(hi - lo) // block))
    return firsts


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
def test_bytes_are_the_wgrad_quantization_of_the_recomputed_activation(recipe, layout, dtype):
    """Groups of 1 row, none, 150 (two 128-row slots, the second partial) and 37, 5 padding rows."""
    ffn, k, activation = layout
    _check(recipe, ffn, k, activation, dtype, torch.device("cpu"), [1, 0, 150, 37], 5, True)


@needs_interpreter
@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
def test_without_probs_and_without_rows(recipe):
    _check(recipe, 40, None, "swiglu", torch.float32, torch.device("cpu"), [3, 0, 20], 0, False)
    _check(recipe, 40, None, "swiglu", torch.float32, torch.device("cpu"), [0, 0], 0, True)


def test_both_ways_of_reading_the_scales_are_covered():
    """The interpreter's 16-column tiles of LAYOUTS read one scale block's scales a row for a tile's
    gates and for its ups where each lies in one (fp8_block's 128 columns), and two blocks' where they
    cross one (mxfp8's 32 at F 40: the ups of columns 16-31 are h's columns 56-71); at the real widths
    sm90's 64-column tiles of fp8_block take one block; a tile whose runs would span more is narrowed."""
    assert tile_scale_span(40, 40, 16, 128) == 1 and tile_scale_span(32, 1, 16, 32) == 1
    assert tile_scale_span(40, 40, 16, 32) == 2
    for ffn, k in ((768, 768), (2048, 2048), (2880, 1), (14336, 14336), (2880, 2880)):
        assert tile_scale_span(ffn, k, 64, 128) == 1, (ffn, k)
    assert tile_scale_span(96, 96, 64, 128) == 2 and tile_scale_span(128, 1, 128, 128) == 2
    assert tile_scale_span(128, 128, 64, 0) == 0  # one scale a row: not this kernel's form
    # Narrowed to one block a run down to 16 columns, then to two: the rows are the caller's to keep.
    assert tile_scale_span(128, 1, 64, 32) == 4 and narrowed(128, 64, 128, 1, 32, 16) == (512, 16, 1)
    assert narrowed(128, 64, 40, 40, 32, 16) == (512, 16, 2)
    assert narrowed(8, 128, 2880, 2880, 128, 128) == (8, 128, 2)  # two blocks a run at the wider tile


@needs_interpreter
def test_refusal_names_the_recipe():
    """fp8_rowwise's columnwise scales span a whole group: refused in one line (the quantized MLP then
    recomputes the activation and quantizes it apart: the same bytes)."""
    cpu = torch.device("cpu")
    line = held_columns_unavailable_reason("fp8_rowwise", cpu)
    assert line is not None and "\n" not in line and "fp8_rowwise" in line
    for recipe in ("fp8_block", "mxfp8"):  # the table's choice under the interpreter: on
        assert held_columns_unavailable_reason(recipe, cpu) is None


@needs_interpreter
def test_quantized_mlp_is_bit_identical_with_and_without_it(monkeypatch):
    """grouped_mlp(..., quantization="fp8_block") on the Triton backend: output and every gradient the
    same bits whether the backward's gated kernel quantizes fc2's wgrad operand (its default where the
    FP8 wgrad runs: fp8_block; mxfp8's wgrad is the reference path, which takes the (M, F) form) or the
    activation is recomputed and quantized apart."""
    assert_same_bits_without(
        quantized_mlp_step(moekit.grouped_mlp, "fp8_block"), monkeypatch, (library, "held_columns_into"),
        (grouped_mlp_module, "held_columns_unavailable_reason"), "the backward's gated kernel quantizing fc2's operand",
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "layout",
    [
        *LAYOUTS,
        pytest.param((768, None, "swiglu"), id="qwen3"),
        pytest.param((2880, 1, "clamped_swiglu"), id="gpt-oss"),
    ],
)
@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
def test_bytes_on_the_gpu(recipe, layout):
    """The same bytes on the GPU in bfloat16 (hardware E4M3 conversion), groups across several slots."""
    ffn, k, activation = layout
    _check(recipe, ffn, k, activation, torch.bfloat16, torch.device("cuda"), [1, 0, 700, 129, 2000], 7, True)
