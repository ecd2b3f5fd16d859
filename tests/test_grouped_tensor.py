"""GroupedTensor: N same-shaped members packed in one flat buffer (how GroupedLinear keeps experts)."""

from __future__ import annotations

import pytest
import torch

from helpers import rand
from moekit import GroupedTensor


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
    with pytest.raises(ValueError, match=r"members must all have one shape; got \[\(2, 3\), \(2, 4\)\]"):
        GroupedTensor.from_tensors([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="share dtype and device"):
        GroupedTensor.from_tensors([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)])
    gt = GroupedTensor.empty(2, (3,))
    with pytest.raises(IndexError, match="member 2 out of range for 2 members"):
        gt[2]
    with pytest.raises(ValueError, match="flat 1-D"):
        GroupedTensor(torch.zeros(2, 3), 2, (3,))
    with pytest.raises(ValueError, match=r"data has 5 elements; 2 members of shape \(3,\) need 6"):
        GroupedTensor(torch.zeros(5), 2, (3,))
