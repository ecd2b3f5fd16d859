"""GroupedTensor: N member tensors packed back to back in one flat buffer.

Two kinds:
- uniform: every member has the same shape (expert weights `[N, out, in]` viewed as N `[out, in]`);
- varying first dimension: member i is `(first_dims[i], *rest)` (routed rows of expert i).

Host code knows the member shapes when they were given on the host; the device always holds the
element offsets `(N+1,)` int64 (and, varying case, `first_dims (N,)`), which is what kernels read.
Members are views of the one buffer, so writing a member writes the buffer.

Quantized storage (a later step) adds per-block scale buffers beside `data`; every accessor here
goes through `data` and `member_shapes`, so scales can be added as a second buffer with its own
offsets without changing how members are addressed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GroupedTensor:
    """N tensors in one flat buffer.

    data: (total_elements,) flat storage.
    member_shapes: host shapes of the members, or None when the first dims live only on the device.
    offsets: (N+1,) int64 element offsets on data's device.
    first_dims: (N,) int64 on data's device for the varying kind, None for uniform.
    rest_shape: the trailing dims every member shares.
    """

    def __init__(
        self,
        data: torch.Tensor,
        *,
        num_tensors: int,
        rest_shape: Sequence[int],
        member_shapes: Sequence[tuple[int, ...]] | None,
        offsets: torch.Tensor,
        first_dims: torch.Tensor | None,
    ) -> None:
        if data.dim() != 1:
            raise ValueError(f"data must be a flat 1-D buffer, got shape {tuple(data.shape)}")
        if offsets.shape != (num_tensors + 1,) or offsets.dtype != torch.int64:
            raise ValueError(f"offsets must be ({num_tensors + 1},) int64, got {tuple(offsets.shape)} {offsets.dtype}")
        self.data = data
        self.num_tensors = num_tensors
        self.rest_shape = tuple(int(d) for d in rest_shape)
        self.member_shapes = None if member_shapes is None else [tuple(int(d) for d in s) for s in member_shapes]
        self.offsets = offsets
        self.first_dims = first_dims

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def empty(
        cls,
        num_tensors: int,
        shape: Sequence[int] | None = None,
        *,
        first_dims: Sequence[int] | torch.Tensor | None = None,
        rest_shape: Sequence[int] | None = None,
        total_first_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> GroupedTensor:
        """Allocate uninitialised storage.

        Uniform: `shape` is every member's shape. Varying: `first_dims` (host sequence, or a device
        tensor together with `total_first_dim`, the buffer's capacity in rows) and `rest_shape`.
        """
        if (shape is None) == (first_dims is None):
            raise ValueError("give exactly one of `shape` (uniform members) or `first_dims` (varying first dim)")
        if shape is not None:
            shape = tuple(int(d) for d in shape)
            numel = _prod(shape)
            offsets = torch.arange(num_tensors + 1, dtype=torch.int64, device=device) * numel
            data = torch.empty(num_tensors * numel, dtype=dtype, device=device)
            return cls(data, num_tensors=num_tensors, rest_shape=shape[1:], member_shapes=[shape] * num_tensors,
                       offsets=offsets, first_dims=None)
        if rest_shape is None:
            raise ValueError("a varying-first-dim GroupedTensor needs rest_shape")
        rest = tuple(int(d) for d in rest_shape)
        row_numel = _prod(rest)
        if isinstance(first_dims, torch.Tensor) and first_dims.device.type != "cpu":
            if total_first_dim is None:
                raise ValueError("device first_dims need total_first_dim (the buffer's row capacity)")
            if first_dims.shape != (num_tensors,):
                raise ValueError(f"first_dims must be ({num_tensors},), got {tuple(first_dims.shape)}")
            fd = first_dims.to(torch.int64)
            offsets = torch.zeros(num_tensors + 1, dtype=torch.int64, device=fd.device)
            torch.cumsum(fd * row_numel, 0, out=offsets[1:])
            data = torch.empty(total_first_dim * row_numel, dtype=dtype, device=fd.device)
            return cls(data, num_tensors=num_tensors, rest_shape=rest, member_shapes=None,
                       offsets=offsets, first_dims=fd)
        dims = [int(d) for d in (first_dims.tolist() if isinstance(first_dims, torch.Tensor) else first_dims)]
        if len(dims) != num_tensors or any(d < 0 for d in dims):
            raise ValueError(f"first_dims must be {num_tensors} non-negative ints, got {dims}")
        capacity = sum(dims) if total_first_dim is None else total_first_dim
        if capacity < sum(dims):
            raise ValueError(f"total_first_dim {capacity} is smaller than sum(first_dims) = {sum(dims)}")
        offs = [0]
        for d in dims:
            offs.append(offs[-1] + d * row_numel)
        offsets = torch.tensor(offs, dtype=torch.int64, device=device)
        data = torch.empty(capacity * row_numel, dtype=dtype, device=device)
        return cls(data, num_tensors=num_tensors, rest_shape=rest, member_shapes=[(d, *rest) for d in dims],
                   offsets=offsets, first_dims=torch.tensor(dims, dtype=torch.int64, device=device))

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> GroupedTensor:
        """Copy tensors into one new buffer (uniform if all shapes agree, else varying first dim)."""
        if not tensors:
            raise ValueError("from_tensors needs at least one tensor")
        first = tensors[0]
        for t in tensors:
            if t.dtype != first.dtype or t.device != first.device:
                raise ValueError("all members must share dtype and device")
            if t.dim() < 1 or t.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"members must share all but the first dimension; got {[tuple(t.shape) for t in tensors]}"
                )
        if all(t.shape == first.shape for t in tensors):
            out = cls.empty(len(tensors), first.shape, dtype=first.dtype, device=first.device)
        else:
            out = cls.empty(len(tensors), first_dims=[t.shape[0] for t in tensors], rest_shape=first.shape[1:],
                            dtype=first.dtype, device=first.device)
        for member, t in zip(out.tensors(), tensors, strict=True):
            member.copy_(t)
        return out

    # ---- access ------------------------------------------------------------------------------

    @property
    def is_uniform(self) -> bool:
        return self.first_dims is None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def view(self, *shape: int) -> torch.Tensor:
        """A view of the whole storage, e.g. `view(-1)`; for uniform members also `(N, *shape)`."""
        return self.data.view(*shape)

    def stacked(self) -> torch.Tensor:
        """Uniform members as one (N, *shape) view."""
        if not self.is_uniform:
            raise ValueError("only a uniform GroupedTensor has a stacked (N, ...) view")
        return self.data.view(self.num_tensors, *self.member_shapes[0])

    def tensors(self) -> list[torch.Tensor]:
        """Zero-copy views of every member."""
        return [self[i] for i in range(self.num_tensors)]

    def __len__(self) -> int:
        return self.num_tensors

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.member_shapes is None:
            raise ValueError(
                "member shapes live only on the device (device first_dims); reading them needs a host sync. "
                "Use view(-1) with offsets in a kernel, or build the GroupedTensor from host first_dims."
            )
        if not -self.num_tensors <= i < self.num_tensors:
            raise IndexError(f"member {i} out of range for {self.num_tensors} members")
        i %= self.num_tensors
        shape = self.member_shapes[i]
        start = sum(_prod(s) for s in self.member_shapes[:i])
        return self.data[start:start + _prod(shape)].view(shape)

    def __repr__(self) -> str:
        kind = "uniform" if self.is_uniform else "varying-first-dim"
        return (f"GroupedTensor({kind}, n={self.num_tensors}, rest_shape={self.rest_shape}, "
                f"dtype={self.dtype}, device={self.device})")


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
