"""GroupedTensor: N same-shaped tensors packed back to back in one flat buffer.

`GroupedLinear` keeps its per-expert weights (and biases) this way: member i is a view of the
buffer, so the N discrete `weight{i}` parameters can be passed to a grouped GEMM as one
`(N, out, in)` view without a copy, and writing a member writes the buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from moekit.validation import check_int


class GroupedTensor:
    """N tensors of one shape in one flat buffer.

    data: (N * prod(member_shape),) flat storage. member_shape: the shape every member has.
    """

    def __init__(self, data: torch.Tensor, num_tensors: int, member_shape: Sequence[int]) -> None:
        member_shape = tuple(int(d) for d in member_shape)
        if data.dim() != 1:
            raise ValueError(f"data must be a flat 1-D buffer, got shape {tuple(data.shape)}")
        if data.numel() != num_tensors * math.prod(member_shape):
            raise ValueError(
                f"data has {data.numel()} elements; {num_tensors} members of shape {member_shape} need "
                f"{num_tensors * math.prod(member_shape)}"
            )
        self.data = data
        self.num_tensors = num_tensors
        self.member_shape = member_shape

    @classmethod
    def empty(
        cls,
        num_tensors: int,
        shape: Sequence[int],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> GroupedTensor:
        """Uninitialised storage for `num_tensors` members of `shape`."""
        num_tensors = check_int("num_tensors", num_tensors, minimum=0)
        shape = tuple(check_int("each dimension of shape", d, minimum=0) for d in shape)
        numel = num_tensors * math.prod(shape)
        return cls(torch.empty(numel, dtype=dtype, device=device), num_tensors, shape)

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> GroupedTensor:
        """Copy same-shaped tensors (one dtype, one device) into one new buffer."""
        if not tensors:
            raise ValueError("from_tensors needs at least one tensor")
        first = tensors[0]
        for t in tensors:
            if t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"all members must share dtype and device; got {first.dtype} on {first.device} and "
                    f"{t.dtype} on {t.device}"
                )
            if t.shape != first.shape:
                raise ValueError(f"members must all have one shape; got {[tuple(t.shape) for t in tensors]}")
        out = cls.empty(len(tensors), first.shape, dtype=first.dtype, device=first.device)
        for member, t in zip(out.tensors(), tensors, strict=True):
            member.copy_(t)
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def stacked(self) -> torch.Tensor:
        """All members as one (N, *member_shape) view."""
        return self.data.view(self.num_tensors, *self.member_shape)

    def tensors(self) -> list[torch.Tensor]:
        """Views of every member."""
        stacked = self.stacked()
        return [stacked[i] for i in range(self.num_tensors)]

    def __len__(self) -> int:
        return self.num_tensors

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.num_tensors <= i < self.num_tensors:
            raise IndexError(f"member {i} out of range for {self.num_tensors} members")
        return self.stacked()[i]

    def __repr__(self) -> str:
        return (
            f"GroupedTensor(num_tensors={self.num_tensors}, member_shape={self.member_shape}, "
            f"dtype={self.dtype}, device={self.device})"
        )
