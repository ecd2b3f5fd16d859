"""The device-side sort of an MoE layer's routed copies by expert: T tokens x K choices -> M = T*K rows
in expert order.

Legend: T tokens, K experts per token (top-k), M = T*K routed rows, N experts.

One sort for every path that orders routed copies by expert (`moe_experts`, `permute`, expert
parallelism's dispatch): a stable sort of the M expert ids (copies keep token order within an expert),
the experts' row offsets from one binary search over the sorted ids (no host read: torch.bincount would
sync to size its output), the inverse permutation and the row -> token map. Nothing here reads a value
on the host, so it can be captured in a CUDA graph.

Ids outside [0, N) are undefined input that the host cannot see without a sync. Like every id they sort
by value (read as int32: wider ids wrap), so ids >= N sort past offs[N] (padding rows, in no expert's
group) and negative ids count as expert 0's (offs[0] = 0).

Two implementations give the same `ExpertOrder`, bit for bit, for every input (the undefined one too):
torch ops (a stable sort and its bookkeeping, about nine launches) and moekit's Triton counting sort
(`moekit.ops.runtime.routing`, three launches), for host-bound small batches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moekit.ops.runtime.backends import triton_runtime
from moekit.validation import check_choice, check_index_tensor, check_int

INDEX_DTYPES = (torch.int64, torch.int32)


class ExpertOrder(NamedTuple):
    """The routed copies in expert order on the ids' device: offs int64, the three maps in the index
    dtype `sort_by_expert` was asked for (int64 by default; int32 halves what a layer holds of them).

    offs: (N+1,) expert e's rows are offs[e]:offs[e+1] of the sorted order.
    copy_of_row: (M, 1) sorted row -> flat copy t*K + k.
    row_map: (T, K) copy (t, k) -> its sorted row (what `unpermute` takes).
    token_of_row: (M, 1) sorted row -> token.
    """

    offs: torch.Tensor
    copy_of_row: torch.Tensor
    row_map: torch.Tensor
    token_of_row: torch.Tensor

    def counts(self) -> torch.Tensor:
        """(N,) int64 rows per expert."""
        return self.offs.diff()


def host_readable(t: torch.Tensor) -> bool:
    """Whether `t`'s values may be read for validation: on the CPU reading is free, elsewhere it is a host
    sync; under torch.compile the read would break the graph, so eager only."""
    return t.device.type == "cpu" and t.numel() > 0 and not torch.compiler.is_compiling()


def check_num_experts(num_experts: object) -> int:
    """A count of experts: an int >= 1."""
    return check_int("num_experts", num_experts, minimum=1)


def check_expert_ids(ids: torch.Tensor, num_experts: int, name: str) -> None:
    """An integer (T, K) tensor whose values lie in [0, N) where they can be read for free
    (`host_readable`); elsewhere out-of-range ids are undefined input (see the module docstring)."""
    check_index_tensor(name, ids)
    if ids.dim() != 2:
        raise ValueError(f"{name} must be a (tokens, top_k) tensor, got shape {tuple(ids.shape)}")
    if host_readable(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{name} must lie in [0, {num_experts}); found values in [{lo}, {hi}]")


def sort_by_expert(
    topk_ids: torch.Tensor, num_experts: int, *, use_triton: bool = False, index_dtype: torch.dtype = torch.int64
) -> ExpertOrder:
    """topk_ids: (T, K) integer experts of each token's copies -> `ExpertOrder` (device, no host read).

    use_triton=False runs torch ops, on any device. use_triton=True runs the Triton counting sort: CUDA
    tensors (or CPU ones under TRITON_INTERPRET=1, for tests), integer ids of 8 to 64 bits, fewer than
    2^31 rows; three kernel launches instead of about nine torch ops. Both give the same result for every
    input. index_dtype: the maps' dtype, int64 (torch's index dtype, what scatter and gather take) or
    int32 (what the row kernels read as well; fewer than 2^31 rows)."""
    check_index_tensor("topk_ids", topk_ids)
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a (tokens, top_k) tensor, got shape {tuple(topk_ids.shape)}")
    num_experts = check_int("num_experts", num_experts, minimum=0)
    index_dtype = check_choice("index_dtype", index_dtype, INDEX_DTYPES)
    if index_dtype == torch.int32 and topk_ids.numel() >= 2**31:
        raise ValueError(f"index_dtype int32 holds fewer than 2^31 rows, got {topk_ids.numel()} routed rows")
    if use_triton:
        runtime = triton_runtime()
        if runtime is None:
            raise ValueError("use_triton=True needs triton, which cannot be imported")
        return ExpertOrder(*runtime.routing.sort_by_expert(topk_ids, num_experts, index_dtype))
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    # int32 keys sort faster than int64 (radix passes); the expert count always fits.
    sorted_ids, copy_of_row = torch.sort(flat_ids.to(torch.int32), stable=True)
    # offs[j] = rows with id < j: the offsets themselves, in one search (no counts to sum again).
    offs = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, dtype=torch.int32, device=flat_ids.device))
    offs[:1] = 0  # negative ids sort first: they count as expert 0's
    rows = torch.arange(copy_of_row.numel(), device=copy_of_row.device)
    row_map = torch.empty_like(copy_of_row).scatter_(0, copy_of_row, rows)
    token_of_row = torch.div(copy_of_row, top_k, rounding_mode="floor")
    maps = (copy_of_row[:, None], row_map.view(num_tokens, top_k), token_of_row[:, None])
    return ExpertOrder(offs, *(m.to(index_dtype) for m in maps))
