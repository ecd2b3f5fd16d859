"""Device-side routing of an MoE layer: T tokens x K expert choices -> M = T*K rows sorted by expert.

Legend: T tokens, K experts per token (top-k), M = T*K routed rows, N experts.

One implementation for every path that sorts routed copies by expert (`moe_experts`, `permute`,
expert parallelism's dispatch): a stable sort of the M expert ids (so copies keep token order
within an expert), the experts' row offsets from one binary search over the sorted ids (no host
read: torch.bincount would sync to size its output), the inverse permutation and the row -> token
map. Nothing here reads a value on the host, so it can be captured in a CUDA graph.

Ids outside [0, N) are undefined input that the host cannot see without a sync: ids >= N sort past
offs[N] (padding rows, in no expert's group), negative ids count as expert 0's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def host_readable(t: torch.Tensor) -> bool:
    """Whether `t`'s values may be read for validation: on the CPU reading is free, elsewhere it is
    a host sync; under torch.compile the read would break the graph, so eager only."""
    return t.device.type == "cpu" and t.numel() > 0 and not torch.compiler.is_compiling()


def check_expert_ids(ids: torch.Tensor, num_experts: int, name: str) -> None:
    """Refuse ids outside [0, N) where they can be read for free (`host_readable`); elsewhere they
    are undefined input (see the module docstring)."""
    if host_readable(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{name} must lie in [0, {num_experts}); found values in [{lo}, {hi}]")


class Routing(NamedTuple):
    """offs: (N+1,) int64, expert e's rows are offs[e]:offs[e+1] of the sorted order. order: (M, 1)
    sorted row -> flat copy t*K + k. inverse: (T, K) copy (t, k) -> sorted row. token_of_row:
    (M, 1) sorted row -> token. All int64 on the ids' device."""

    offs: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    token_of_row: torch.Tensor

    def counts(self) -> torch.Tensor:
        """(N,) int64 rows per expert."""
        return self.offs.diff()


def route(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    """topk_ids: (T, K) integer experts of each token's copies -> `Routing` (device, no host read)."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    # int32 keys sort faster than int64 (radix passes); the expert count always fits.
    sorted_ids, order = torch.sort(flat_ids.to(torch.int32), stable=True)
    # offs[j] = rows with id < j: the offsets themselves, in one search (no counts to sum again).
    offs = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, dtype=torch.int32, device=flat_ids.device))
    offs[:1] = 0  # negative ids sort first: they count as expert 0's
    rows = torch.arange(order.numel(), device=order.device)
    inverse = torch.empty_like(order).scatter_(0, order, rows)
    token_of_row = torch.div(order, top_k, rounding_mode="floor")
    return Routing(offs, order[:, None], inverse.view(num_tokens, top_k), token_of_row[:, None])
