"""Triton kernels of the routing (jit code only; host code in `moekit.ops.runtime.routing`): a stable
counting sort of the M routed rows by expert.

Legend: M routed rows (flat copy t*K + k), T tokens, K top-k, N experts. The rows are cut into chunks of
CHUNK rows (num_chunks of them).

Rows go to N + 2 buckets, clamp(id, -1, N) + 1: bucket 0 holds the (undefined) negative ids, which
count as expert 0's rows, buckets 1..N the experts, bucket N + 1 the (undefined) ids >= N, sorted
past offs[N]. Three launches, no atomics, no host read:

1. `chunk_histogram_kernel`, one program per chunk: rows per (bucket, chunk), and the smallest and
   largest undefined id of each side in the chunk.
2. `bucket_scan_kernel`, one program per SCAN_BUCKETS buckets: the exclusive scan over chunks of each
   bucket's counts (in place) and the bucket's total; the first and last program also say whether
   the negative ids, and the ids >= N, are not all equal.
3. `scatter_rows_kernel`, one program per chunk: each row's sorted position, the first row of its
   bucket (a scan of the totals) + its chunk's earlier rows in the bucket (step 2) + the rows of
   the bucket before it inside the chunk; then copy_of_row, row_map and token_of_row are written there.

Undefined ids among themselves: the torch path sorts every id by value, so negative ids (and ids
>= N) go by value, then by flat row. Where a side holds one value (the usual -1 of dropped copies)
the counting order is already that. Where it holds several, step 3 ranks those rows by (id, row)
against every chunk that holds undefined ids: O(M) work per such row, on undefined input only.

Scratch, one int32 buffer: counts [N + 2, num_chunks] (bucket-major; the chunk prefix after step 2),
totals [N + 2], extremes [4, num_chunks] (lowest and highest negative id, lowest and highest id >= N), flags [2].
"""

import triton
import triton.language as tl

_INT32_MIN = tl.constexpr(-(2**31))
_INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _load_ids(ids_ptr, offs_row, mask_row, top_k, stride_t, stride_k, num_experts):
    """Ids of flat rows offs_row (row t*K + k is topk_ids[t, k]) as int32, and their buckets.

    The int32 cast truncates wider ids as torch's `.to(torch.int32)` does, so that both routing
    paths see the same keys for every input."""
    offs_token = offs_row // top_k
    offs_k = offs_row - offs_token * top_k
    ids_ptrs = ids_ptr + offs_token.to(tl.int64) * stride_t + offs_k.to(tl.int64) * stride_k
    ids = tl.load(ids_ptrs, mask=mask_row, other=0)
    ids = ids.to(tl.int32)
    buckets = tl.minimum(tl.maximum(ids, -1), num_experts) + 1
    return ids, buckets


@triton.jit
def chunk_histogram_kernel(
    ids_ptr,
    scratch_ptr,
    num_rows,
    top_k,
    stride_t,
    stride_k,
    num_experts,
    num_chunks,
    CHUNK: tl.constexpr,
    BUCKET_TILE: tl.constexpr,
):
    """counts[b, c] = rows of chunk c in bucket b; extremes[:, c] of the chunk's undefined ids."""
    pid_c = tl.program_id(0)
    num_buckets = num_experts + 2
    offs_row = pid_c * CHUNK + tl.arange(0, CHUNK)
    mask_row = offs_row < num_rows
    ids, buckets = _load_ids(ids_ptr, offs_row, mask_row, top_k, stride_t, stride_k, num_experts)
    # Buckets in tiles of BUCKET_TILE bins, so that any number of experts fits in registers.
    for tile_start in range(0, num_buckets, BUCKET_TILE):
        offs_b = tile_start + tl.arange(0, BUCKET_TILE)
        offs_local = buckets - tile_start
        mask_tile = mask_row & (offs_local >= 0) & (offs_local < BUCKET_TILE)
        acc = tl.histogram(tl.where(mask_tile, offs_local, 0), BUCKET_TILE, mask=mask_tile)
        tl.store(scratch_ptr + offs_b * num_chunks + pid_c, acc, mask=offs_b < num_buckets)
    # Extremes with neutral values where a side is empty (lowest > highest): step 2 needs them to
    # tell whether a side holds different ids, which must then be ordered by value.
    extremes_ptr = scratch_ptr + num_buckets * num_chunks + num_buckets
    mask_neg = mask_row & (ids < 0)
    mask_over = mask_row & (ids >= num_experts)
    tl.store(extremes_ptr + pid_c, tl.min(tl.where(mask_neg, ids, 0), axis=0))
    tl.store(extremes_ptr + num_chunks + pid_c, tl.max(tl.where(mask_neg, ids, _INT32_MIN), axis=0))
    tl.store(extremes_ptr + 2 * num_chunks + pid_c, tl.min(tl.where(mask_over, ids, _INT32_MAX), axis=0))
    tl.store(extremes_ptr + 3 * num_chunks + pid_c, tl.max(tl.where(mask_over, ids, _INT32_MIN), axis=0))


@triton.jit
def _side_differs(extremes_ptr, side, num_chunks, SCAN_BLOCK: tl.constexpr):
    """Whether the undefined ids of a side (0: negative, 1: >= N) are not all equal: extremes rows
    2 * side and 2 * side + 1 hold each chunk's lowest and highest."""
    lowest = tl.full([], _INT32_MAX, tl.int32)
    highest = tl.full([], _INT32_MIN, tl.int32)
    for chunk_start in range(0, num_chunks, SCAN_BLOCK):
        offs_c = chunk_start + tl.arange(0, SCAN_BLOCK)
        mask_c = offs_c < num_chunks
        lo = tl.load(extremes_ptr + 2 * side * num_chunks + offs_c, mask=mask_c, other=_INT32_MAX)
        hi = tl.load(extremes_ptr + (2 * side + 1) * num_chunks + offs_c, mask=mask_c, other=_INT32_MIN)
        lowest = tl.minimum(lowest, tl.min(lo, axis=0))
        highest = tl.maximum(highest, tl.max(hi, axis=0))
    return (lowest < highest).to(tl.int32)


@triton.jit
def bucket_scan_kernel(scratch_ptr, num_experts, num_chunks, SCAN_BUCKETS: tl.constexpr, SCAN_BLOCK: tl.constexpr):
    """Per bucket b of the program's SCAN_BUCKETS: counts[b, :] -> its exclusive scan over chunks
    (in place), totals[b]. flags[side] = 1 where the side's undefined ids are not all equal."""
    pid_b = tl.program_id(0)
    num_buckets = num_experts + 2
    totals_ptr = scratch_ptr + num_buckets * num_chunks
    extremes_ptr = totals_ptr + num_buckets
    flags_ptr = extremes_ptr + 4 * num_chunks
    offs_b = pid_b * SCAN_BUCKETS + tl.arange(0, SCAN_BUCKETS)
    mask_b = offs_b < num_buckets
    acc = tl.zeros([SCAN_BUCKETS], dtype=tl.int32)
    for chunk_start in range(0, num_chunks, SCAN_BLOCK):
        offs_c = chunk_start + tl.arange(0, SCAN_BLOCK)
        mask_bc = mask_b[:, None] & (offs_c < num_chunks)[None, :]
        ptrs = scratch_ptr + offs_b[:, None] * num_chunks + offs_c[None, :]
        counts = tl.load(ptrs, mask=mask_bc, other=0)
        tl.store(ptrs, tl.cumsum(counts, axis=1) - counts + acc[:, None], mask=mask_bc)
        acc += tl.sum(counts, axis=1)
    tl.store(totals_ptr + offs_b, acc, mask=mask_b)
    if pid_b == 0:
        tl.store(flags_ptr, _side_differs(extremes_ptr, 0, num_chunks, SCAN_BLOCK))
    if pid_b == tl.num_programs(0) - 1:
        tl.store(flags_ptr + 1, _side_differs(extremes_ptr, 1, num_chunks, SCAN_BLOCK))


@triton.jit
def _rank_by_value(
    ids_ptr,
    scratch_ptr,
    ids,
    buckets,
    offs_row,
    num_rows,
    top_k,
    stride_t,
    stride_k,
    num_experts,
    num_chunks,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
):
    """For rows of the undefined buckets (0 and N + 1): how many rows of the same bucket anywhere
    sort before them by (id, flat row), as torch's stable sort of the ids orders them. Visits only
    chunks that hold undefined ids, so it costs nothing on valid input; O(M) per row otherwise."""
    num_buckets = num_experts + 2
    extremes_ptr = scratch_ptr + num_buckets * num_chunks + num_buckets
    acc = tl.zeros([SUB], dtype=tl.int32)
    for chunk in range(0, num_chunks):
        # A side is empty in a chunk exactly when its lowest id is above its highest.
        has_neg = tl.load(extremes_ptr + chunk) <= tl.load(extremes_ptr + num_chunks + chunk)
        has_over = tl.load(extremes_ptr + 2 * num_chunks + chunk) <= tl.load(extremes_ptr + 3 * num_chunks + chunk)
        if has_neg | has_over:
            for sub_start in range(0, CHUNK, SUB):
                offs_other = chunk * CHUNK + sub_start + tl.arange(0, SUB)
                mask_other = offs_other < num_rows
                ids_other, buckets_other = _load_ids(
                    ids_ptr, offs_other, mask_other, top_k, stride_t, stride_k, num_experts
                )
                before = (ids_other[None, :] < ids[:, None]) | (
                    (ids_other[None, :] == ids[:, None]) & (offs_other[None, :] < offs_row[:, None])
                )
                before = before & (buckets_other[None, :] == buckets[:, None]) & mask_other[None, :]
                acc += tl.sum(before.to(tl.int32), axis=1)
    return acc


@triton.jit
def scatter_rows_kernel(
    ids_ptr,
    scratch_ptr,
    offs_ptr,
    copy_of_row_ptr,
    row_map_ptr,
    token_of_row_ptr,
    num_rows,
    top_k,
    stride_t,
    stride_k,
    num_experts,
    num_chunks,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BUCKET_TILE: tl.constexpr,
):
    """Each flat row r of chunk pid_c at its sorted position p: copy_of_row[p] = r, token_of_row[p] = r // K,
    row_map[r] = p. Program 0 also writes offs (N + 1 entries)."""
    pid_c = tl.program_id(0)
    num_buckets = num_experts + 2
    totals_ptr = scratch_ptr + num_buckets * num_chunks
    flags_ptr = totals_ptr + num_buckets + 4 * num_chunks
    exact_neg = tl.load(flags_ptr) != 0
    exact_over = tl.load(flags_ptr + 1) != 0
    overflow_start = num_rows - tl.load(totals_ptr + num_buckets - 1)
    offs_sub = tl.arange(0, SUB)
    rows_before_tile = tl.full([], 0, tl.int32)
    for tile_start in range(0, num_buckets, BUCKET_TILE):
        offs_b = tile_start + tl.arange(0, BUCKET_TILE)
        mask_b = offs_b < num_buckets
        totals = tl.load(totals_ptr + offs_b, mask=mask_b, other=0)
        bucket_start = tl.cumsum(totals, axis=0) - totals + rows_before_tile
        rows_before_tile += tl.sum(totals, axis=0)
        if pid_c == 0:
            # offs[e] = rows with id < e = first row of bucket e + 1 for e >= 1; offs[0] = 0, since
            # negative ids count as expert 0's rows.
            tl.store(
                offs_ptr + offs_b - 1, tl.where(offs_b == 1, 0, bucket_start).to(tl.int64), mask=mask_b & (offs_b >= 1)
            )
        # Next free sorted row of each bucket for this chunk, advanced after every sub-block.
        cursor = bucket_start + tl.load(scratch_ptr + offs_b * num_chunks + pid_c, mask=mask_b, other=0)
        for sub_start in range(0, CHUNK, SUB):
            offs_row = pid_c * CHUNK + sub_start + offs_sub
            mask_row = offs_row < num_rows
            ids, buckets = _load_ids(ids_ptr, offs_row, mask_row, top_k, stride_t, stride_k, num_experts)
            offs_local = buckets - tile_start
            mask_tile = mask_row & (offs_local >= 0) & (offs_local < BUCKET_TILE)
            offs_local = tl.where(mask_tile, offs_local, 0)
            # Rank inside the sub-block among the earlier rows of the same bucket: stable order.
            same_before = (buckets[:, None] == buckets[None, :]) & (offs_sub[None, :] < offs_sub[:, None])
            rank = tl.sum((same_before & mask_tile[None, :]).to(tl.int32), axis=1)
            pos = tl.gather(cursor, offs_local, 0) + rank
            cursor += tl.histogram(offs_local, BUCKET_TILE, mask=mask_tile)
            # Undefined ids that differ within a side: ordered by value like torch's sort (rare, slow).
            mask_exact = mask_tile & (((buckets == 0) & exact_neg) | ((buckets == num_buckets - 1) & exact_over))
            if tl.sum(mask_exact.to(tl.int32), axis=0) > 0:
                rank_exact = _rank_by_value(
                    ids_ptr,
                    scratch_ptr,
                    ids,
                    buckets,
                    offs_row,
                    num_rows,
                    top_k,
                    stride_t,
                    stride_k,
                    num_experts,
                    num_chunks,
                    CHUNK,
                    SUB,
                )
                pos = tl.where(mask_exact, tl.where(buckets == 0, rank_exact, overflow_start + rank_exact), pos)
            rows = offs_row.to(tl.int64)
            tl.store(copy_of_row_ptr + pos, rows, mask=mask_tile)
            tl.store(token_of_row_ptr + pos, rows // top_k, mask=mask_tile)
            tl.store(row_map_ptr + offs_row, pos.to(tl.int64), mask=mask_tile)
