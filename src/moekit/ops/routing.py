"""Device-side routing of an MoE layer: T tokens x K expert choices -> M = T*K rows sorted by expert.

Legend: T tokens, K experts per token (top-k), M = T*K routed rows, N experts.

One module for every path that sorts routed copies by expert (`moe_experts`, `permute`, expert
parallelism's dispatch): a stable sort of the M expert ids (so copies keep token order
within an expert), the experts' row offsets from one binary search over the sorted ids (no host
read: torch.bincount would sync to size its output), the inverse permutation and the row -> token
map. Nothing here reads a value on the host, so it can be captured in a CUDA graph.

Ids outside [0, N) are undefined input that the host cannot see without a sync. Like every id they
sort by value (read as int32: wider ids wrap), so ids >= N sort past offs[N] (padding rows, in no
expert's group) and negative ids count as expert 0's (offs[0] = 0).

Two implementations give the same `Routing`, bit for bit, for every input (the undefined one too):
torch ops (a stable sort and its bookkeeping, about nine launches) and moekit's Triton counting sort
(`moekit.ops.routing_kernels`, three launches). Small batches are host-bound, and each launch costs
host time, which is what the Triton path saves.
"""

from __future__ import annotations

import contextlib
import functools
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


def route(topk_ids: torch.Tensor, num_experts: int, *, use_triton: bool = False) -> Routing:
    """topk_ids: (T, K) integer experts of each token's copies -> `Routing` (device, no host read).

    use_triton=False (the default) runs torch ops, on any device. use_triton=True runs the Triton
    counting sort: CUDA tensors (or CPU ones under TRITON_INTERPRET=1, for tests), integer ids of
    8 to 64 bits, fewer than 2^31 rows; three kernel launches instead of about nine torch ops, for
    host-bound small batches. Both give the same result for every input. Undefined ids (see the
    module docstring) cost the Triton path nothing extra while each side holds one value (the -1 of
    dropped copies); several different values on a side are ordered by value, as torch's sort does,
    at O(M) work per such row."""
    if use_triton:
        return _route_triton(topk_ids, num_experts)
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


_TRITON_ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class _TritonRouting(NamedTuple):
    """The routing kernels' launchers and tile sizes (rows per sub-block SUB, chunks of CHUNK rows,
    buckets per tile) and the scatter kernel's warps."""

    histogram: object
    scan: object
    scatter: object
    interpret: bool
    sub: int
    max_chunk: int
    target_chunks: int
    max_bucket_tile: int
    scan_buckets: int
    scan_block: int
    scatter_warps: int


@functools.cache
def _triton_routing() -> _TritonRouting:
    """Built on first use: the torch path needs no triton."""
    from triton.runtime.interpreter import InterpretedFunction

    from moekit.ops import routing_kernels as kernels
    from moekit.ops.triton_launch import Launcher

    interpret = isinstance(kernels.scatter_rows_kernel, InterpretedFunction)
    launchers = (
        Launcher(kernels.chunk_histogram_kernel),
        Launcher(kernels.bucket_scan_kernel),
        Launcher(kernels.scatter_rows_kernel),
    )
    if interpret:
        # Tiny tiles, so that CPU tests cover several sub-blocks, chunks, bucket tiles and scan
        # blocks quickly.
        return _TritonRouting(
            *launchers,
            True,
            sub=16,
            max_chunk=64,
            target_chunks=4,
            max_bucket_tile=128,
            scan_buckets=64,
            scan_block=2,
            scatter_warps=4,
        )
    # 32-row sub-blocks: the 32 x 32 rank comparison of a step is 8 values a thread, so the scatter
    # kernel needs 56 registers (compiled for sm_90; 64-row sub-blocks need 177 with 8 warps, one
    # program per SM). About 2048 chunks at large M: programs for every SM, while the scan over
    # chunks stays one or two (4 buckets, 1024 chunks) tiles a program (one compiled variant for
    # every M; 101 registers with 8 warps).
    return _TritonRouting(
        *launchers,
        False,
        sub=32,
        max_chunk=2048,
        target_chunks=2048,
        max_bucket_tile=1024,
        scan_buckets=4,
        scan_block=1024,
        scatter_warps=4,
    )


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _chunk_rows(num_rows: int, config: _TritonRouting) -> int:
    """Rows per chunk: a power of two of SUB to max_chunk rows, about target_chunks chunks."""
    return min(max(_next_power_of_2(-(-num_rows // config.target_chunks)), config.sub), config.max_chunk)


class _RoutingPlan(NamedTuple):
    """The three launches of one problem (ids' shape, strides, dtype, device, alignment; N), all but
    their tensor arguments fixed, and the scratch size."""

    scratch_size: int
    histogram: object
    scan: object
    scatter: object


@functools.cache
def _plan_cache():
    from moekit.ops.triton_launch import PlanCache

    return PlanCache()


def _make_plan(topk_ids: torch.Tensor, num_experts: int, config: _TritonRouting) -> _RoutingPlan:
    from moekit.ops.triton_launch import LaunchPlan

    num_tokens, top_k = topk_ids.shape
    num_rows = num_tokens * top_k
    chunk = _chunk_rows(num_rows, config)
    num_chunks = max(1, -(-num_rows // chunk))  # one program even without rows: it writes offs
    num_buckets = num_experts + 2  # negative ids, the N experts, ids >= N
    scratch_size = num_buckets * num_chunks + num_buckets + 4 * num_chunks + 2
    # Row indices (up to the last chunk's end) and scratch offsets are int32 in the kernels.
    if num_chunks * chunk >= 2**31 or scratch_size >= 2**31:
        raise ValueError(
            f"the Triton routing indexes rows in int32: {num_tokens} tokens x top_k {top_k} with "
            f"{num_experts} experts are too many; use use_triton=False"
        )
    bucket_tile = min(_next_power_of_2(num_buckets), config.max_bucket_tile)
    stride_t, stride_k = topk_ids.stride()
    top_k_div = max(top_k, 1)  # no rows when top_k is 0; the kernels still divide by it
    ids_args = (num_rows, top_k_div, stride_t, stride_k, num_experts, num_chunks)
    return _RoutingPlan(
        scratch_size,
        LaunchPlan(
            config.histogram, (num_chunks,), ids_args, {"CHUNK": chunk, "BUCKET_TILE": bucket_tile, "num_warps": 4}
        ),
        LaunchPlan(
            config.scan,
            (-(-num_buckets // config.scan_buckets),),
            (num_experts, num_chunks),
            {"SCAN_BUCKETS": config.scan_buckets, "SCAN_BLOCK": config.scan_block, "num_warps": 8},
        ),
        LaunchPlan(
            config.scatter,
            (num_chunks,),
            ids_args,
            {"CHUNK": chunk, "SUB": config.sub, "BUCKET_TILE": bucket_tile, "num_warps": config.scatter_warps},
        ),
    )


def _route_triton(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a (tokens, top_k) tensor, got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in _TRITON_ID_DTYPES:
        raise TypeError(
            f"topk_ids must be int8, int16, int32, int64 or uint8 for the Triton routing, got {topk_ids.dtype}"
        )
    if num_experts < 0:
        raise ValueError(f"num_experts must be >= 0, got {num_experts}")
    config = _triton_routing()
    device = topk_ids.device
    if device.type != "cuda" and not (device.type == "cpu" and config.interpret):
        raise ValueError(
            f"the Triton routing runs on CUDA tensors (or CPU ones when TRITON_INTERPRET=1 was set "
            f"before triton was imported), got a tensor on {device}"
        )
    from moekit.ops.triton_launch import tensor_key

    # Plans by everything Triton specializes the launches on (at small M the host time of each call
    # is what counts): the ids' shape, strides, dtype, device and alignment, N and the tile sizes.
    cache = _plan_cache()
    key = (tensor_key(topk_ids), num_experts, config)
    plan = cache.get(key)
    if plan is None:
        plan = cache.put(key, _make_plan(topk_ids, num_experts, config))
    num_tokens, top_k = topk_ids.shape
    scratch = torch.empty(plan.scratch_size, dtype=torch.int32, device=device)
    offs = torch.empty(num_experts + 1, dtype=torch.int64, device=device)
    order = torch.empty((num_tokens * top_k, 1), dtype=torch.int64, device=device)
    inverse = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    token_of_row = torch.empty((num_tokens * top_k, 1), dtype=torch.int64, device=device)
    switch = (
        device.type == "cuda"
        and not config.interpret
        and device.index is not None
        and device.index != torch.cuda.current_device()
    )
    with torch.cuda.device(device) if switch else contextlib.nullcontext():
        plan.histogram(topk_ids, scratch)
        plan.scan(scratch)
        plan.scatter(topk_ids, scratch, offs, order, inverse, token_of_row)
    return Routing(offs, order, inverse, token_of_row)
