"""The tile schedule and operand loads every row-tiled kernel of moekit shares (jit code only):
the grouped GEMM's, the fused MLP's (Triton) and the Hopper kernels' (Gluon, which calls these Triton
functions: a Gluon caller passes them tensors that carry its layouts, e.g. `offs_g`).

Legend: M routed rows, N groups (experts). A row-tiled kernel's output tile is BLOCK_M rows by
BLOCK_C columns; COLS is the output width, RED the reduction length, stepped BLOCK_RED at a time.

The flat tile space of a persistent kernel is the (row-tile, column-tile) grid of each group in
turn, then a padding pseudo-group N (rows offs[N]:M, which kernels write as zeros). Every program
derives it on the device from the group offsets (`offs`, N + 1 int64 values), so no launch needs a
host copy of them: no host sync, CUDA-graph capturable with other split sizes.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@triton.jit
def _min_tuple(a0, a1, a2, a3, b0, b1, b2, b3):
    # Combine of the tile-locating reduction: (#groups ending at or before the tile, the largest
    # such end = the group's first tile, smallest start / end among the groups not yet ended =
    # the tile's group's row range, because starts and ends are non-decreasing).
    return a0 + b0, tl.maximum(a1, b1), tl.minimum(a2, b2), tl.minimum(a3, b3)


@triton.jit
def group_rows(offs_ptr, offs_g, M, N, PAD_GROUP: tl.constexpr):
    """Row range [start, end) of every group, as int32 vectors shaped like `offs_g` (the caller's
    `arange(0, BLOCK_GROUPS)`, in its layout; BLOCK_GROUPS > N; entries past the last group are
    empty ranges at M). With PAD_GROUP, entry N is the padding pseudo-group offs[N]:M. Values are
    clamped into [0, M] and made non-decreasing, so a bad offs tensor can make results wrong but can
    never send a load or store outside its buffer."""
    start = tl.load(offs_ptr + offs_g, mask=offs_g <= N, other=0).to(tl.int32)
    end = tl.load(offs_ptr + offs_g + 1, mask=offs_g < N, other=0).to(tl.int32)
    start = tl.minimum(tl.maximum(start, 0), M)
    end = tl.minimum(tl.maximum(end, start), M)
    if PAD_GROUP:
        end = tl.where(offs_g == N, M, end)
    n_groups = N + 1 if PAD_GROUP else N
    start = tl.where(offs_g < n_groups, start, M)
    end = tl.where(offs_g < n_groups, end, M)
    return start, end


@triton.jit
def locate_tile(tile_id, tile_end, row_start, row_end):
    """(group, first tile id of that group, group's row start, group's row end) of a flat tile id.
    tile_end: inclusive prefix sum of tiles per group (non-decreasing)."""
    done = tile_end <= tile_id
    n_done, first_tile, r0, r1 = tl.reduce(
        (
            done.to(tl.int32),
            tl.where(done, tile_end, 0),
            tl.where(done, 2147483647, row_start),
            tl.where(done, 2147483647, row_end),
        ),
        0,
        _min_tuple,
    )
    return n_done, first_tile, r0, r1


@triton.jit
def tile_schedule(offs_ptr, offs_g, M, N, COLS, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """The flat tile space of a persistent row-tiled kernel: the (row-tile, column-tile) grid of each
    group in turn, then the padding pseudo-group N (`offs_g` as `group_rows`). Returns (num_pid_c,
    row_start, row_end, tile_end, num_tiles): column tiles, each group's row range, the inclusive
    cumsum of tiles per group (for `tile_coords`) and the total."""
    num_pid_c = tl.cdiv(COLS, BLOCK_C)
    row_start, row_end = group_rows(offs_ptr, offs_g, M, N, True)
    tiles = tl.cdiv(row_end - row_start, BLOCK_M) * num_pid_c
    return num_pid_c, row_start, row_end, tl.cumsum(tiles, 0), tl.sum(tiles, 0)


@triton.jit
def swizzle(t, num_pid_m, num_pid_c, GROUP_M: tl.constexpr):
    """Local tile index -> (pid_m, pid_c), GROUP_M row tiles at a time, so that the programs running
    at one moment share a few A row-blocks and B column-blocks in L2."""
    num_in_band = GROUP_M * num_pid_c
    band = t // num_in_band
    first_m = band * GROUP_M
    band_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (t % num_in_band) % band_m
    pid_c = (t % num_in_band) // band_m
    return pid_m, pid_c


@triton.jit
def tile_coords(
    tile_id,
    num_pid_c,
    row_start,
    row_end,
    tile_end,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Where flat tile `tile_id` of `tile_schedule`'s space lies: (group g (N: the padding rows), the
    group's rows [row_lo, row_hi), the tile's first row row0 and column c0, its column tile pid_c)."""
    g, first_tile, row_lo, row_hi = locate_tile(tile_id, tile_end, row_start, row_end)
    pid_m, pid_c = swizzle(tile_id - first_tile, tl.cdiv(row_hi - row_lo, BLOCK_M), num_pid_c, GROUP_M)
    return g, row_lo, row_hi, row_lo + pid_m * BLOCK_M, pid_c * BLOCK_C, pid_c


@triton.jit
def operand_descs(
    a_ptr,
    b_ptr,
    M,
    RED,
    N,
    B_ROWS,
    B_COLS,
    stride_am,
    stride_bg,
    stride_br,
    TRANS_B: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_RED: tl.constexpr,
):
    """(a_desc, b_desc): TMA descriptors of a row-tiled GEMM's operands for `load_a` / `load_b`;
    without USE_TMA, (a_ptr, b_ptr) as placeholders the loads never use as descriptors. a (M, RED),
    row stride stride_am, unit column stride, boxes (BLOCK_M, BLOCK_RED); b (N, B_ROWS, B_COLS),
    strides (stride_bg, stride_br, 1), boxes of one group's (BLOCK_C, BLOCK_RED) if TRANS_B (w[g]
    stored (COLS, RED)) else (BLOCK_RED, BLOCK_C). Made once per program, before its tile loop."""
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[M, RED], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_RED]
        )
        if TRANS_B:
            b_desc = tl.make_tensor_descriptor(
                b_ptr, shape=[N, B_ROWS, B_COLS], strides=[stride_bg, stride_br, 1], block_shape=[1, BLOCK_C, BLOCK_RED]
            )
        else:
            b_desc = tl.make_tensor_descriptor(
                b_ptr, shape=[N, B_ROWS, B_COLS], strides=[stride_bg, stride_br, 1], block_shape=[1, BLOCK_RED, BLOCK_C]
            )
    else:
        # Placeholders (the loads read the pointers without USE_TMA): Triton 3.6 cannot return None
        # inside a tuple.
        a_desc = a_ptr
        b_desc = b_ptr
    return a_desc, b_desc


@triton.jit
def gemm_tile(
    tile_id,
    num_pid_c,
    row_start,
    row_end,
    tile_end,
    M,
    N,
    c_ptr,
    COLS,
    stride_cm,
    EPI_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """`tile_coords` of a GEMM tile whose epilogue stores c (M, COLS) (row stride stride_cm) half a
    tile at a time (`split_halves`). Returns (g, row_lo, row_hi, row0, c0, a_row0, c_desc): a_row0 is
    the first row of the tile's A boxes, M for a padding tile (g == N), so its TMA boxes lie past
    the end of a and read zeros and no memory: every tile then runs the same reduction trip count
    (which lets Triton fuse the tile loop and the reduction loop into one software pipeline).
    c_desc (EPI_TMA; else c_ptr, a placeholder the epilogue never uses as a descriptor) ends at the
    group's last row, so a store never crosses into the next group's rows."""
    g, row_lo, row_hi, row0, c0, pid_c = tile_coords(
        tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, BLOCK_C, GROUP_M
    )
    a_row0 = tl.where(g < N, row0, M)
    if EPI_TMA:
        c_desc = tl.make_tensor_descriptor(
            c_ptr, shape=[row_hi, COLS], strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_C // 2]
        )
    else:
        c_desc = c_ptr  # placeholder, unused without EPI_TMA (Triton 3.6 cannot return None in a tuple)
    return g, row_lo, row_hi, row0, c0, a_row0, c_desc


@triton.jit
def load_a(
    a_desc,
    a_ptr,
    red0,
    row0,
    row_lo,
    row_hi,
    RED,
    stride_am,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_RED: tl.constexpr,
):
    """(BLOCK_M, BLOCK_RED) of the routed rows a[row0:, red0:]; rows outside [row_lo, row_hi) and
    columns past RED read as zeros on the pointer path (TMA callers point padding tiles' boxes past
    the end instead)."""
    if USE_TMA:
        a = a_desc.load([row0, red0])
    else:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_red = red0 + tl.arange(0, BLOCK_RED)
        mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
        a = tl.load(
            a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_red[None, :],
            mask=mask_m[:, None] & (offs_red[None, :] < RED),
            other=0.0,
        )
    if UPCAST:
        # The Triton 3.6 interpreter multiplies bf16 dot operands as raw integers.
        a = a.to(tl.float32)
    return a


@triton.jit
def load_b(
    b_desc,
    b_ptr,
    g,
    N,
    red0,
    c0,
    COLS,
    RED,
    stride_bg,
    stride_br,
    TRANS_B: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_RED: tl.constexpr,
):
    """(BLOCK_RED, BLOCK_C) of w[g]: stored (COLS, RED) when TRANS_B (forward), (RED, COLS) otherwise."""
    if USE_TMA:
        if TRANS_B:
            b = b_desc.load([g, c0, red0]).reshape(BLOCK_C, BLOCK_RED).T
        else:
            b = b_desc.load([g, red0, c0]).reshape(BLOCK_RED, BLOCK_C)
    else:
        offs_c = c0 + tl.arange(0, BLOCK_C)
        offs_red = red0 + tl.arange(0, BLOCK_RED)
        mask = (offs_red[:, None] < RED) & (offs_c[None, :] < COLS) & (g < N)
        b_base = b_ptr + g.to(tl.int64) * stride_bg
        if TRANS_B:
            b = tl.load(b_base + offs_c.to(tl.int64)[None, :] * stride_br + offs_red[:, None], mask=mask, other=0.0)
        else:
            b = tl.load(b_base + offs_red.to(tl.int64)[:, None] * stride_br + offs_c[None, :], mask=mask, other=0.0)
    if UPCAST:
        b = b.to(tl.float32)
    return b


@triton.jit
def split_halves(acc, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr):
    """(BLOCK_P, BLOCK_Q) -> two (BLOCK_P, BLOCK_Q // 2) column halves: the epilogue stores half a
    tile at a time, which halves its shared-memory staging buffer."""
    acc = tl.permute(tl.reshape(acc, (BLOCK_P, 2, BLOCK_Q // 2)), (0, 2, 1))
    return tl.split(acc)


@gluon.jit
def gluon_group_ids(BLOCK_GROUPS: gl.constexpr):
    """arange(0, BLOCK_GROUPS) over the calling Gluon partition's warps: the group vector of
    `tile_schedule`, which every partition of a warp-specialised kernel computes for itself."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.arange(0, BLOCK_GROUPS, layout=layout)
