"""Host side of the routing kernels (`moekit.ops.kernels.routing`): the stable counting sort of T x K
routed copies by expert in three launches, planned once per problem by the recipe of
`moekit.ops.runtime.launch`.

Legend: T tokens, K top-k, M = T*K routed rows, N experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from moekit.ops.kernels.routing import bucket_scan_kernel, chunk_histogram_kernel, scatter_rows_kernel
from moekit.ops.runtime.configs import ROUTING_TILES, RoutingTiles
from moekit.ops.runtime.launch import (
    Launcher,
    LaunchPlan,
    arch_of,
    device_ctx,
    next_power_of_2,
    plan_launch,
    tensor_key,
)


class RoutingLaunchers(NamedTuple):
    histogram: Launcher
    scan: Launcher
    scatter: Launcher


LAUNCHERS = RoutingLaunchers(
    Launcher(chunk_histogram_kernel), Launcher(bucket_scan_kernel), Launcher(scatter_rows_kernel)
)

ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def chunk_rows(num_rows: int, tiles: RoutingTiles) -> int:
    """Rows per chunk: a power of two from `sub` to `max_chunk` rows, about `target_chunks` chunks."""
    return min(max(next_power_of_2(-(-num_rows // tiles.target_chunks)), tiles.sub), tiles.max_chunk)


def _plan(
    topk_ids: torch.Tensor, num_experts: int, tiles: RoutingTiles, launchers: RoutingLaunchers
) -> tuple[int, LaunchPlan, LaunchPlan, LaunchPlan]:
    """(scratch size, the three launches) of one problem, all but their tensor arguments fixed."""
    num_tokens, top_k = topk_ids.shape
    num_rows = num_tokens * top_k
    chunk = chunk_rows(num_rows, tiles)
    num_chunks = max(1, triton.cdiv(num_rows, chunk))  # one program even without rows: it writes offs
    num_buckets = num_experts + 2  # negative ids, the N experts, ids >= N
    scratch_size = num_buckets * num_chunks + num_buckets + 4 * num_chunks + 2
    # Row indices (up to the last chunk's end) and scratch offsets are int32 in the kernels.
    if num_chunks * chunk >= 2**31 or scratch_size >= 2**31:
        raise ValueError(
            f"the Triton routing indexes rows in int32: {num_tokens} tokens x top_k {top_k} with {num_experts} "
            "experts are too many for it"
        )
    bucket_tile = min(next_power_of_2(num_buckets), tiles.max_bucket_tile)
    stride_t, stride_k = topk_ids.stride()
    top_k_div = max(top_k, 1)  # no rows when top_k is 0; the kernels still divide by it
    ids_args = (num_rows, top_k_div, stride_t, stride_k, num_experts, num_chunks)
    histogram = LaunchPlan(
        launchers.histogram, (num_chunks,), ids_args, {"CHUNK": chunk, "BUCKET_TILE": bucket_tile, "num_warps": 4}
    )
    scan = LaunchPlan(
        launchers.scan,
        (-(-num_buckets // tiles.scan_buckets),),
        (num_experts, num_chunks),
        {"SCAN_BUCKETS": tiles.scan_buckets, "SCAN_BLOCK": tiles.scan_block, "num_warps": 8},
    )
    scatter = LaunchPlan(
        launchers.scatter,
        (num_chunks,),
        ids_args,
        {"CHUNK": chunk, "SUB": tiles.sub, "BUCKET_TILE": bucket_tile, "num_warps": tiles.scatter_warps},
    )
    return scratch_size, histogram, scan, scatter


def sort_by_expert(
    topk_ids: torch.Tensor, num_experts: int, index_dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(offs (N+1,) int64, copy_of_row (M, 1), row_map (T, K), token_of_row (M, 1) in index_dtype (int64
    or int32, the caller's check)) on the ids' device, as `moekit.ops.routing.sort_by_expert` defines
    them, in three launches and no host read. topk_ids: (T, K) of an integer dtype of `ID_DTYPES`, on
    CUDA (or the CPU under the interpreter)."""
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(
            f"topk_ids must be int8, int16, int32, int64 or uint8 for the Triton routing, got {topk_ids.dtype}"
        )
    device = topk_ids.device
    arch = arch_of(device)
    if device.type != "cuda" and arch != "interpreter":
        raise ValueError(
            "the Triton routing runs on CUDA tensors (or CPU ones when TRITON_INTERPRET=1 was set before triton "
            f"was imported), got a tensor on {device}"
        )
    tiles = ROUTING_TILES[arch]
    launchers = LAUNCHERS
    # index_dtype too: the scatter stores into the maps, and a plan's binary is specialized on their dtype.
    key = (tensor_key(topk_ids), num_experts, index_dtype, tiles, launchers)
    plan = plan_launch("routing", key, lambda: _plan(topk_ids, num_experts, tiles, launchers))
    scratch_size, histogram, scan, scatter = plan
    num_tokens, top_k = topk_ids.shape
    scratch = torch.empty(scratch_size, dtype=torch.int32, device=device)
    offs = torch.empty(num_experts + 1, dtype=torch.int64, device=device)
    copy_of_row = torch.empty((num_tokens * top_k, 1), dtype=index_dtype, device=device)
    row_map = torch.empty((num_tokens, top_k), dtype=index_dtype, device=device)
    token_of_row = torch.empty((num_tokens * top_k, 1), dtype=index_dtype, device=device)
    with device_ctx(device):
        histogram(topk_ids, scratch)
        scan(scratch)
        scatter(topk_ids, scratch, offs, copy_of_row, row_map, token_of_row)
    return offs, copy_of_row, row_map, token_of_row
