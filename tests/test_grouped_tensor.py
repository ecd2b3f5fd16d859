"""GroupedTensor: N members packed in one flat buffer."""

from __future__ import annotations

import pytest
import torch

from helpers import rand
from moekit import GroupedTensor


def test_uniform_members_are_views_of_one_buffer():
    gt = GroupedTensor.empty(3, (4, 5), dtype=torch.float64)
    assert gt.is_uniform and len(gt) == 3 and gt.dtype == torch.float64 and gt.rest_shape == (5,)
    assert gt.data.shape == (60,) and gt.offsets.tolist() == [0, 20, 40, 60]
    members = gt.tensors()
    for i, m in enumerate(members):
        m.fill_(float(i))
        assert m.shape == (4, 5)
        assert m.untyped_storage().data_ptr() == gt.data.untyped_storage().data_ptr()
    assert gt.data[:20].eq(0).all() and gt.data[20:40].eq(1).all() and gt.data[40:].eq(2).all()
    stacked = gt.stacked()
    assert stacked.shape == (3, 4, 5) and torch.equal(stacked[2], members[2])
    stacked[1, 0, 0] = 7.0  # and the stacked view writes the same storage
    assert gt[1][0, 0] == 7.0 and gt[-2][0, 0] == 7.0
    assert torch.equal(gt.view(3, 20)[1], members[1].reshape(-1))


def test_varying_first_dim():
    gt = GroupedTensor.empty(4, first_dims=[2, 0, 3, 1], rest_shape=(5,))
    assert not gt.is_uniform
    assert [tuple(t.shape) for t in gt.tensors()] == [(2, 5), (0, 5), (3, 5), (1, 5)]
    assert gt.offsets.tolist() == [0, 10, 10, 25, 30] and gt.first_dims.tolist() == [2, 0, 3, 1]
    for i, t in enumerate(gt.tensors()):
        t.fill_(float(i))
    assert gt.data.tolist() == [0.0] * 10 + [2.0] * 15 + [3.0] * 5
    with pytest.raises(ValueError, match="only a uniform GroupedTensor"):
        gt.stacked()
    # Spare capacity past the members (padding rows).
    cap = GroupedTensor.empty(2, first_dims=torch.tensor([1, 2]), rest_shape=(3,), total_first_dim=5)
    assert cap.data.shape == (15,) and cap.offsets.tolist() == [0, 3, 9]


def test_from_tensors_copies():
    a, b = rand(2, 3, seed=1), rand(2, 3, seed=2)
    gt = GroupedTensor.from_tensors([a, b])
    assert gt.is_uniform and torch.equal(gt[0], a) and torch.equal(gt[1], b)
    gt[0].zero_()
    assert not torch.equal(a, torch.zeros(2, 3))  # a copy, not the inputs
    v = GroupedTensor.from_tensors([rand(1, 3, seed=3), rand(4, 3, seed=4)])
    assert not v.is_uniform and [tuple(t.shape) for t in v.tensors()] == [(1, 3), (4, 3)]
    assert torch.equal(v[1], rand(4, 3, seed=4))


def test_device_first_dims_do_not_expose_members():
    """first_dims known only on the device (here 'meta', standing in for CUDA): no host shapes."""
    gt = GroupedTensor.empty(3, first_dims=torch.tensor([1, 2, 3], device="meta"), rest_shape=(4,),
                             total_first_dim=8)
    assert gt.member_shapes is None and gt.data.shape == (32,) and gt.offsets.device.type == "meta"
    with pytest.raises(ValueError, match="host sync"):
        gt[0]
    with pytest.raises(ValueError, match="total_first_dim"):
        GroupedTensor.empty(3, first_dims=torch.tensor([1, 2, 3], device="meta"), rest_shape=(4,))


def test_errors():
    with pytest.raises(ValueError, match="exactly one of"):
        GroupedTensor.empty(2)
    with pytest.raises(ValueError, match="exactly one of"):
        GroupedTensor.empty(2, (3,), first_dims=[1, 2])
    with pytest.raises(ValueError, match="rest_shape"):
        GroupedTensor.empty(2, first_dims=[1, 2])
    with pytest.raises(ValueError, match="non-negative"):
        GroupedTensor.empty(2, first_dims=[1, -2], rest_shape=(3,))
    with pytest.raises(ValueError, match="non-negative"):
        GroupedTensor.empty(2, first_dims=[1, 2, 3], rest_shape=(3,))
    with pytest.raises(ValueError, match="smaller than sum"):
        GroupedTensor.empty(2, first_dims=[1, 2], rest_shape=(3,), total_first_dim=2)
    with pytest.raises(ValueError, match="at least one"):
        GroupedTensor.from_tensors([])
    with pytest.raises(ValueError, match="share all but the first"):
        GroupedTensor.from_tensors([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="share dtype"):
        GroupedTensor.from_tensors([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)])
    gt = GroupedTensor.empty(2, (3,))
    with pytest.raises(IndexError):
        gt[2]
    with pytest.raises(ValueError, match="flat 1-D"):
        GroupedTensor(torch.zeros(2, 3), num_tensors=2, rest_shape=(), member_shapes=[(3,), (3,)],
                      offsets=torch.tensor([0, 3, 6]), first_dims=None)
