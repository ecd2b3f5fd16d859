"""GroupedTensor: N members packed in one buffer: of one shape (how GroupedLinear keeps experts) or of any
first dims (grouped activations), high precision or quantized (`moekit.group_quantize`)."""

from __future__ import annotations

import pytest
import torch

import moekit
from helpers import rand, rel_err
from moekit import GroupedTensor
from moekit.grouped_tensor import widen


def test_members_are_views_of_one_buffer():
    gt = GroupedTensor.empty(3, (4, 5), dtype=torch.float64)
    assert len(gt) == 3 and gt.dtype == torch.float64 and gt.member_shape == (4, 5) and gt.data.shape == (60,)
    members = gt.tensors()
    for i, m in enumerate(members):
        m.fill_(float(i))
        assert m.shape == (4, 5)
        assert m.untyped_storage().data_ptr() == gt.data.untyped_storage().data_ptr()
    assert gt.data[:20].eq(0).all() and gt.data[20:40].eq(1).all() and gt.data[40:].eq(2).all()
    stacked = gt.stacked()
    assert stacked.shape == (3, 4, 5) and torch.equal(stacked[2], members[2])
    stacked[1, 0, 0] = 7.0  # and the stacked view writes the same storage
    assert gt[1][0, 0] == 7.0 and gt[-2][0, 0] == 7.0 and members[1][0, 0] == 7.0


def test_from_tensors_copies():
    a, b = rand(2, 3, seed=1), rand(2, 3, seed=2)
    gt = GroupedTensor.from_tensors([a, b])
    assert torch.equal(gt[0], a) and torch.equal(gt[1], b) and torch.equal(gt.stacked(), torch.stack([a, b]))
    gt[0].zero_()
    assert torch.equal(a, rand(2, 3, seed=1))  # a copy, not the inputs


def test_meta_device_allocates_nothing_real():
    gt = GroupedTensor.empty(8, (16, 32), dtype=torch.bfloat16, device="meta")
    assert gt.device.type == "meta" and gt.stacked().shape == (8, 16, 32)


def test_errors():
    with pytest.raises(ValueError, match="at least one"):
        GroupedTensor.from_tensors([])
    # Members may differ in their first dim only (ragged members are accepted: test_ragged_members).
    shared = r"members must share every dim but the first \(and have one\); got "
    with pytest.raises(ValueError, match=shared + r"\[\(2, 3\), \(2, 4\)\]"):
        GroupedTensor.from_tensors([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match=r"members must share every dim but the first"):
        GroupedTensor.from_tensors([torch.zeros(2, 3), torch.zeros(3)])
    with pytest.raises(ValueError, match=shared + r"\[\(\), \(\)\]"):
        GroupedTensor.from_tensors([torch.zeros(()), torch.zeros(())])
    with pytest.raises(ValueError, match="share dtype and device"):
        GroupedTensor.from_tensors([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)])
    gt = GroupedTensor.empty(2, (3,))
    with pytest.raises(IndexError, match="member 2 out of range for 2 members"):
        gt[2]
    with pytest.raises(ValueError, match="flat 1-D"):
        GroupedTensor(torch.zeros(2, 3), 2, (3,))
    with pytest.raises(ValueError, match=r"data has 5 elements; 2 members of shape \(3,\) need 6"):
        GroupedTensor(torch.zeros(5), 2, (3,))


def test_ragged_members():
    """Members of any first dims, 0 included: the first dims and offsets on the device, split() the
    members (views of the one buffer), the packed (M, K) tensor from dequantize()."""
    a, b, c = rand(3, 5, seed=1), rand(0, 5, seed=2), rand(4, 5, seed=3)
    gt = GroupedTensor.from_tensors([a, b, c])
    assert len(gt) == gt.num_tensors == 3 and gt.member_shape is None and gt.shape == (7, 5)
    assert gt.first_dims.tolist() == [3, 0, 4] and gt.first_dims.dtype == torch.int64
    assert gt.offsets.tolist() == [0, 3, 3, 7] and gt.offsets.device == a.device
    members = gt.split()
    assert [tuple(m.shape) for m in members] == [(3, 5), (0, 5), (4, 5)]
    for m, t in zip(members, (a, b, c), strict=True):
        assert torch.equal(m, t)
    members[2].fill_(9.0)  # views: writing a member writes the buffer
    assert gt.data[15:].eq(9.0).all() and gt[2].eq(9.0).all() and gt[-2].shape == (0, 5)
    assert torch.equal(gt.dequantize(), torch.cat([a, b, members[2]]))
    assert not gt.is_quantized and gt.recipe is None and gt.rowwise_data is None and gt.columnwise_scale_inv is None
    with pytest.raises(ValueError, match=r"stacked\(\) needs members of one shape; these have first dims \(3, 0, 4\)"):
        gt.stacked()
    only_empty = GroupedTensor.from_tensors([torch.zeros(0, 2), torch.zeros(0, 2)])
    assert only_empty.shape == (2, 0, 2) and only_empty.first_dims.tolist() == [0, 0]


def test_uniform_members_keep_their_first_dims_on_the_device():
    gt = GroupedTensor.empty(3, (4, 5), dtype=torch.float32)
    assert gt.first_dims.tolist() == [4, 4, 4] and gt.offsets.tolist() == [0, 4, 8, 12]
    assert gt.dequantize().shape == (3, 4, 5)
    with pytest.raises(ValueError, match="0-d members have no first dim, so no first_dims"):
        _ = GroupedTensor.empty(2, ()).first_dims


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block", "fp8_rowwise"])
def test_quantized_storage(recipe):
    """A quantized GroupedTensor: the storage attributes (None where a form was not asked), its recipe,
    members (one-member quantized views) and dequantize() in the original dtype and shape."""
    x = rand(70, 40, seed=4, dtype=torch.float64)
    splits = torch.tensor([33, 0, 30])  # 7 padding rows
    gt = moekit.group_quantize(x, splits, recipe)
    assert gt.is_quantized and gt.recipe == recipe and gt.num_tensors == 3 and gt.shape == (70, 40)
    assert gt.rowwise_data.dtype == torch.float8_e4m3fn and gt.rowwise_data.shape == (70, 40)
    assert gt.rowwise_scale_inv is not None and gt.columnwise_data is None and gt.columnwise_scale_inv is None
    assert gt.data is None and gt.first_dims.tolist() == [33, 0, 30] and gt.offsets.tolist() == [0, 33, 33, 63]
    deq = moekit.group_dequantize(gt)
    assert deq.dtype == torch.float64 and deq.shape == (70, 40) and torch.equal(deq, gt.dequantize())
    assert rel_err(deq[:63], x[:63]) < 0.04 and deq[63:].eq(0).all()
    with pytest.raises(ValueError, match=r"this GroupedTensor has no columnwise storage"):
        gt.dequantize(columnwise=True)
    both = moekit.group_quantize(x, splits, recipe, rowwise=False, columnwise=True)
    assert both.rowwise_data is None and both.columnwise_data.shape == (70, 40)
    assert rel_err(both.dequantize(columnwise=True)[:63], x[:63]) < 0.04
    with pytest.raises(ValueError, match=r"dequantize\(\): this GroupedTensor has no rowwise storage; use columnwise"):
        both.dequantize()
    full = moekit.group_quantize(x, splits, recipe, columnwise=True)
    members = full.split()
    assert [m.shape for m in members] == [(33, 40), (0, 40), (30, 40)]
    for m, lo, hi in zip(members, (0, 33, 33), (33, 33, 63), strict=True):
        assert m.recipe == recipe and m.num_tensors == 1
        assert m.rowwise_data.data_ptr() == full.rowwise_data[lo:].data_ptr() or hi == lo  # a view
        assert torch.equal(m.dequantize(), full.dequantize()[lo:hi])
        assert torch.equal(m.dequantize(columnwise=True), full.dequantize(columnwise=True)[lo:hi])
    assert f"recipe={recipe!r}, rowwise+columnwise" in repr(full)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block", "fp8_rowwise"])
def test_quantized_weight_members(recipe):
    w = rand(3, 130, 40, seed=5, dtype=torch.bfloat16)
    gt = moekit.group_quantize(w, None, recipe, columnwise=recipe != "fp8_block")
    assert gt.member_shape == (130, 40) and gt.first_dims.tolist() == [130] * 3 and gt.shape == (3, 130, 40)
    deq = gt.dequantize()
    assert deq.shape == (3, 130, 40) and deq.dtype == torch.bfloat16
    for i, m in enumerate(gt.split()):
        assert m.shape == (1, 130, 40) and torch.equal(m.dequantize()[0], deq[i])


@pytest.mark.parametrize("byte_dtype", [torch.float8_e4m3fn, torch.float8_e8m0fnu])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_widen_gives_torchs_conversion_of_every_byte(byte_dtype, dtype):
    """The dequantization's one-byte widening (a table lookup on the CPU) is torch's conversion, bit for
    bit, for every byte (NaNs, zeros of both signs, subnormals) and any strides and shape."""
    every = torch.arange(256, dtype=torch.uint8).view(byte_dtype)
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    for t in (every, every.reshape(16, 16).t(), every[::3], every[:0], every[7]):
        got, want = widen(t, dtype), t.to(dtype)
        assert got.dtype == dtype and got.shape == t.shape
        assert torch.equal(got.view(bits), want.view(bits))
