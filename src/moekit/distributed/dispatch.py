"""Where the routed copies of an expert-parallel layer go, as device index maps, and the rows moved
along them.

Legend: T tokens (this rank's), K top-k, M = T*K routed copies, N experts in all, EP ranks in the
expert-parallel group, L = N/EP experts per rank, C slots per (source rank, expert) in capacity
mode, S = EP * (L*C + 1) slots of a capacity buffer, R rows received.

Every map is computed on the device from the router's expert ids, with no host read (sort,
searchsorted, cumsum, gathers; the only scatter writes the integer inverse of a permutation). Rows
move with one primitive, `move_rows(src, index_fwd, index_bwd)`: out[r] = sum_j src[index_fwd[r, j]],
summed in fixed j order, whose backward is the same gather-sum along `index_bwd` (the transposed
map). No step scatters floating-point values, so results and gradients are bit-identical run to run;
on CUDA the gathers are moekit's row kernel (the one `moekit.moe_experts` uses). Here index_bwd may
leave out a pair of index_fwd only where that pair's gradient is exactly zero (a padding row's),
and index_fwd may read any row for an output row whose value is never used (an empty slot's): that
is how fixed-size buffers do without a zero row.

Capacity buffers have one more slot per destination rank than the experts' C each: a sentinel
that never holds a copy, so it arrives as a padding row (zero output, zero gradient) on the
receiving rank. A dropped copy points there: it contributes nothing forward or backward, and no
map needs a zero row appended to a tensor (which would copy it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The device routing and moe_experts' row primitive: one implementation for the single-process
# layer and the expert-parallel one.
from moekit.ops.routing import sort_by_expert
from moekit.ops.rows import move_rows
from moekit.ops.runtime import backends

__all__ = [
    "CapacityMaps",
    "DroplessMaps",
    "capacity_maps",
    "dropless_maps",
    "move_rows",
    "received_local_ids",
    "sentinel_slots",
    "use_triton_rows",
]


def use_triton_rows(backend: str, x: torch.Tensor) -> bool:
    """Whether the rows of experts on `backend` (a name, as GroupedMLP keeps it) move with moekit's row
    kernel, as `moe_experts` decides it."""
    return backends.use_triton_rows(backends.select_backend(backend, x, x.new_empty(1, 1, x.shape[1])), x)


@dataclass(frozen=True)
class DroplessMaps:
    """The T*K copies sorted by global expert, so grouped by destination rank (experts r*L..(r+1)*L-1
    live on rank r).

    counts: (N,) int64 copies per expert. token_of_row: (M, 1) token of sorted row r (sends x rows).
    copy_of_row: (M, 1) flat copy t*K + k of sorted row r (sends the router weights).
    row_of_copy: (T, K) sorted row of copy (t, k) (the backward of both, and the combine)."""

    counts: torch.Tensor
    token_of_row: torch.Tensor
    copy_of_row: torch.Tensor
    row_of_copy: torch.Tensor


def dropless_maps(expert_ids: torch.Tensor, num_experts: int) -> DroplessMaps:
    """expert_ids: (T, K) integer -> DroplessMaps (device, no host read)."""
    routing = sort_by_expert(expert_ids, num_experts)
    return DroplessMaps(
        counts=routing.counts(),
        token_of_row=routing.token_of_row,
        copy_of_row=routing.copy_of_row,
        row_of_copy=routing.row_map,
    )


@dataclass(frozen=True)
class CapacityMaps:
    """A fixed buffer of S slots laid out (destination rank d, local expert e, slot p), then one
    sentinel per destination: slot d*(L*C+1) + e*C + p holds the p-th copy (in token order) of expert
    d*L + e when p < its count; slot d*(L*C+1) + L*C is d's sentinel.

    counts: (N,) copies per expert before dropping. token_of_slot / copy_of_slot: (S, 1) the token /
    flat copy in each slot (0 for empty slots: read, never used). slot_of_copy: (T, K) the slot of
    copy (t, k), or its destination's sentinel when the copy is dropped. dropped: () int64, copies
    past their expert's C slots."""

    counts: torch.Tensor
    token_of_slot: torch.Tensor
    copy_of_slot: torch.Tensor
    slot_of_copy: torch.Tensor
    dropped: torch.Tensor


def capacity_maps(expert_ids: torch.Tensor, num_experts: int, ep_size: int, slots: int) -> CapacityMaps:
    """expert_ids: (T, K) integer, T >= 0; `slots` = C per expert -> CapacityMaps (device, no host
    read, shapes fixed by T, K, N, EP and C alone). The first C copies of an expert in (token, k)
    order are kept. With T = 0 every slot is empty and reads row 0: the caller gives the gathers a
    source with a row there (`sentinel_slots` says where its gradient may come from)."""
    num_tokens, top_k = expert_ids.shape
    local_L = num_experts // ep_size
    device = expert_ids.device
    if num_tokens == 0:
        empty = torch.zeros(ep_size * (local_L * slots + 1), 1, dtype=torch.int64, device=device)
        return CapacityMaps(
            counts=torch.zeros(num_experts, dtype=torch.int64, device=device),
            token_of_slot=empty,
            copy_of_slot=empty,
            slot_of_copy=expert_ids.new_empty((0, top_k), dtype=torch.int64),
            dropped=torch.zeros((), dtype=torch.int64, device=device),
        )
    routing = sort_by_expert(expert_ids, num_experts)
    counts, row_of_copy = routing.counts(), routing.row_map
    starts = routing.offs[:-1]
    # Copy side: position of each copy among its expert's copies, then its slot or the sentinel.
    ids = expert_ids.to(torch.int64)
    pos = row_of_copy - starts[ids]
    block = (ids // local_L) * (local_L * slots + 1)
    slot_of_copy = torch.where(pos < slots, block + (ids % local_L) * slots + pos, block + local_L * slots)
    # Slot side: (N, C) grid of sorted rows, then a sentinel column per destination.
    pos_C = torch.arange(slots, device=device)
    filled = pos_C[None, :] < counts[:, None]
    row = (starts[:, None] + pos_C[None, :]).clamp(max=num_tokens * top_k - 1)

    def per_slot(values_M1: torch.Tensor) -> torch.Tensor:
        grid = torch.where(filled, values_M1.view(-1)[row], 0).view(ep_size, local_L * slots)
        return torch.cat([grid, grid.new_zeros(ep_size, 1)], 1).view(-1, 1)

    dropped = (counts - slots).clamp_min(0).sum()
    return CapacityMaps(
        counts=counts,
        token_of_slot=per_slot(routing.token_of_row),
        copy_of_slot=per_slot(routing.copy_of_row),
        slot_of_copy=slot_of_copy,
        dropped=dropped,
    )


def sentinel_slots(num_experts: int, ep_size: int, slots: int, rows: int, device: torch.device) -> torch.Tensor:
    """(rows, 1) the first destination's sentinel slot: a backward map for source rows that no slot
    holds (the row an empty buffer reads when a rank has no tokens), whose gradient is exactly zero."""
    return torch.full((rows, 1), num_experts // ep_size * slots, dtype=torch.int64, device=device)


def received_local_ids(recv_counts: torch.Tensor, slots: int) -> torch.Tensor:
    """Capacity mode, receiving side: recv_counts (EP, L) copies each source rank routed to each local
    expert (before dropping) -> (S,) local expert of every received slot, L for empty slots and
    sentinels (padding)."""
    ep_size, local_L = recv_counts.shape
    pos_C = torch.arange(slots, device=recv_counts.device)
    kept = pos_C[None, None, :] < recv_counts[:, :, None]
    local = torch.arange(local_L, device=recv_counts.device)[None, :, None]
    grid = torch.where(kept, local, local_L).view(ep_size, local_L * slots)
    return torch.cat([grid, grid.new_full((ep_size, 1), local_L)], 1).view(-1)
