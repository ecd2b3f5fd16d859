"""Rows-per-group bookkeeping shared by every grouped op.

Legend: N groups (experts), M rows.

`m_splits` arrives as a host sequence, a CPU integer tensor, or an integer tensor on the input's
device. Host values are validated once and copied to the device once; device values are never read
by the host (no `.item()`, `.tolist()`, `.cpu()`), so a forward and backward over device splits stay
free of host syncs and capturable in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MSplits = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class GroupOffsets:
    """Where each group's rows start and end.

    offs: (N+1,) int64 on the rows' device. offs[0] = 0, offs[i+1] - offs[i] = rows of group i,
        clamped to `rows` so that no kernel can be pointed outside its buffers even when device
        splits sum past the rows (such input is invalid; it cannot be detected without a sync).
    host: the same offsets as a Python list when the caller gave host values, else None.
    rows: M, the number of rows of the operand the splits describe.
    """

    offs: torch.Tensor
    host: tuple[int, ...] | None
    rows: int

    @staticmethod
    def of(offs: torch.Tensor, host_offs: Sequence[int] | None, rows: int) -> GroupOffsets:
        """The offsets as the library ops pass them: the device tensor, the host list or None, the rows."""
        return GroupOffsets(offs=offs, host=tuple(host_offs) if host_offs is not None else None, rows=rows)

    @property
    def num_groups(self) -> int:
        return self.offs.numel() - 1

    def host_offsets(self) -> tuple[int, ...]:
        """Host offsets; for device splits this syncs, which only the `loop` reference accepts."""
        if self.host is not None:
            return self.host
        return tuple(int(v) for v in self.offs.tolist())

    def row_group(self) -> torch.Tensor:
        """(M,) int64: the group of every row; padding rows (past the last offset) get N."""
        rows = torch.arange(self.rows, device=self.offs.device)
        return torch.searchsorted(self.offs[1:], rows, right=True)


def resolve_splits(m_splits: MSplits | GroupOffsets, num_groups: int, rows: int, device: torch.device) -> GroupOffsets:
    """Validate `m_splits` and turn it into `GroupOffsets` on `device`.

    Raises ValueError/TypeError naming what was wrong and what is expected.
    """
    if isinstance(m_splits, GroupOffsets):
        if m_splits.num_groups != num_groups or m_splits.rows != rows:
            raise ValueError(
                f"offsets describe {m_splits.num_groups} groups over {m_splits.rows} rows; "
                f"expected {num_groups} groups over {rows} rows"
            )
        return m_splits
    if isinstance(m_splits, torch.Tensor) and m_splits.device.type != "cpu":
        return device_offsets(m_splits, num_groups, rows, device)
    if isinstance(m_splits, torch.Tensor) and torch.compiler.is_compiling():
        # A traced graph cannot read a tensor's values on the host: CPU splits take the device path.
        return device_offsets(m_splits.to(device), num_groups, rows, device)
    host = _host_splits(m_splits, num_groups, rows)
    offs_host = [0]
    for count in host:
        offs_host.append(offs_host[-1] + count)
    offs = torch.tensor(offs_host, dtype=torch.int64).to(device, non_blocking=True)
    return GroupOffsets(offs=offs, host=tuple(offs_host), rows=rows)


def _host_splits(m_splits: MSplits, num_groups: int, rows: int) -> list[int]:
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"m_splits must be an integer tensor (int32 or int64), got {m_splits.dtype}")
        if m_splits.dim() != 1:
            raise ValueError(f"m_splits must be 1-D with one entry per group, got shape {tuple(m_splits.shape)}")
        values = [int(v) for v in m_splits.tolist()]
    elif isinstance(m_splits, (list, tuple)):
        values = []
        for v in m_splits:
            if isinstance(v, bool) or not isinstance(v, int):
                if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point():
                    v = int(v)
                else:
                    raise TypeError(f"m_splits entries must be Python ints, got {type(v).__name__} ({v!r})")
            values.append(int(v))
    else:
        raise TypeError(
            "m_splits must be a list/tuple of ints, a CPU integer tensor or an integer tensor on the "
            f"input's device; got {type(m_splits).__name__}"
        )
    if len(values) != num_groups:
        raise ValueError(f"m_splits has {len(values)} entries; expected one per group ({num_groups})")
    negative = [i for i, v in enumerate(values) if v < 0]
    if negative:
        raise ValueError(f"m_splits must be non-negative; entries {negative} are negative: {values}")
    total = sum(values)
    if total > rows:
        raise ValueError(f"m_splits sums to {total} but the input has only {rows} rows (sum must be <= rows)")
    return values


def device_offsets(m_splits: torch.Tensor, num_groups: int, rows: int, device: torch.device) -> GroupOffsets:
    if m_splits.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"device m_splits must be int32 or int64, got {m_splits.dtype}")
    if _canonical(m_splits.device) != _canonical(torch.device(device)):
        raise ValueError(
            f"m_splits is on {m_splits.device} but the input is on {device}; pass it on the input's "
            "device, on the CPU, or as a list"
        )
    if m_splits.shape != (num_groups,):
        raise ValueError(f"m_splits has shape {tuple(m_splits.shape)}; expected ({num_groups},), one per group")
    offs = torch.zeros(num_groups + 1, dtype=torch.int64, device=device)
    # Clamping keeps kernels inside their buffers; negative counts would break monotonicity, so
    # they are clamped to zero rows (invalid input that cannot be detected without a sync).
    torch.cumsum(m_splits.to(torch.int64).clamp(min=0), 0, out=offs[1:])
    offs.clamp_(max=rows)
    return GroupOffsets(offs=offs, host=None, rows=rows)


def _canonical(device: torch.device) -> torch.device:
    """`cuda` and `cuda:<current>` are the same device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype elementwise math runs in: fp32 for low-precision inputs, float64 stays float64."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype
