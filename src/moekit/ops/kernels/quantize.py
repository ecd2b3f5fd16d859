"""Triton kernels of grouped FP8 quantization (jit code only; host code in `moekit.ops.runtime.quantize`,
the formats in `moekit.grouped_tensor` and `moekit.ops.quantize`).

Legend: M rows (N groups of them, then padding rows), X columns; a slot is one block of rows of one
group (columnwise scales are kept per slot).

    quantize_tiles_kernel       (BLOCK_R, BLOCK_C) tiles of x, each read once (mxfp8 and fp8_block,
                                rowwise alone): the 1 x TILE_K scales of its rows, or one scale per
                                block (a weight's 128 x 128 blocks)
    quantize_slots_kernel       the columnwise form (mxfp8 and fp8_block; the rowwise one too if asked):
                                one slot's column strip a program, walked twice in row chunks (the
                                maxima and rowwise bytes, then the columnwise bytes from the caches)
    quantize_rows_kernel        one scale per whole row (fp8_rowwise rowwise alone): one read of rows
                                that fit a program's registers (X <= 16384), else two passes over X
    amax_spans_kernel           fp8_rowwise with the columnwise form, first pass: the whole-row and
                                whole-group column maxima of (span of one group's rows, column block)
                                tiles, by atomic max on the fp32 bits
    quantize_spans_kernel       its second pass: both forms' data and scales from one more read of
                                the same tiles (a column's scale needs the whole group's column before
                                any of its bytes: two reads of x are this form's floor)
    slot_records_kernel         each slot's rows (first row, rows left in its group, real group or not,
                                segment start) as a table, for the Gluon slots kernel
    dequantize_kernel           data * scale of either form, every recipe: one pass, the product in
                                fp32 rounded once to the output's dtype (the torch path's bytes)

The columnwise forms (quantize_slots_kernel, quantize_spans_kernel) store either as (M, X) rows, the
GroupedTensor's layout, or (SEGMENTS) straight into the FP8 wgrad's transposed operand layout (X,
pitch) (`segment_store`): the wgrad then needs no transpose pass of its own. They also take their rows
gathered from x by an index (GATHER, `_source_rows`): the backward's gathered operands are quantized
without being written out in the input's dtype first.

Every kernel reads the group offsets on the device, so one launch covers every group and the host
never reads them. Padding rows (past offs[N]) are read as zeros: their data is 0 and their scales 1.
With a noop flag, a program whose flag reads 1.0 writes nothing.

The scale rules (the same in `moekit.ops.runtime.quantize_torch`, bit for bit):
- E8M0 (mxfp8): the smallest power of two >= amax / 448, from amax's bits (exact, no division); amax 0
  -> 1 (byte 127); a non-finite amax (an inf or NaN in the block) -> NaN (byte 255). The data is
  x * 2^-e, exact.
- float32: scale = min(448 / amax, float32 max) correctly rounded, scale_inv = 1 / scale correctly
  rounded (tl.math.div_rn: a plain fp32 division on the GPU is approximate); amax 0 -> 1; non-finite ->
  NaN. The data is E4M3(x * scale).
E4M3 encoding: round to nearest even, saturating to +-448, NaN to 0x7f | sign: torch's float8_e4m3fn
conversion exactly. On CUDA sm_89+ (constexpr HW_E4M3, set by the host) by the hardware's conversion
(cvt.rn.satfinite, the same rounding and saturation) with the NaNs' sign set apart, in the quantize
kernels only for tiles that hold a non-finite block maximum (`e4m3_tile`: nowhere else can a NaN
arise); elsewhere by integer arithmetic on the fp32 bits (Triton 3.6's interpreter converts to fp8 by
other rules). Both give every device the same bytes.
"""

import triton
import triton.language as tl

from moekit.ops.kernels.grouped_wgrad_fp8 import SEGMENT_COLUMNS, segment_starts

FP8_MAX = tl.constexpr(448.0)
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def abs_for_amax(x):
    """|x| with NaN read as inf: a block holding a NaN gets a non-finite amax (tl.max drops NaN on some
    targets)."""
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def abs_bits(x):
    """|x| as the signed integer of its bits (x's width): ordered as |x| is, every NaN above inf, so
    integer maxima of them are the maxima of |x| with a NaN winning (one integer op an element)."""
    if x.dtype.primitive_bitwidth == 16:
        return x.to(tl.int16, bitcast=True) & 0x7FFF
    else:
        return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def amax_value(m, DTYPE: tl.constexpr):
    """The float32 maximum of `abs_bits` maxima m of DTYPE values, a NaN read as inf."""
    if DTYPE.primitive_bitwidth == 16:
        m = m.to(tl.int16)  # reductions of 16-bit integers come back as int32
    v = m.to(DTYPE, bitcast=True).to(tl.float32)
    return tl.where(v != v, float("inf"), v)


@triton.jit
def _e4m3_bits(v):
    """The float8 E4M3 byte of fp32 v: round to nearest even, saturate to +-448, NaN -> 0x7f | sign."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    # Normal results: round the mantissa to 3 bits (ties to even) and rebias 127 -> 7.
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = tl.minimum(rounded - 960, 126)
    # Subnormal results (|v| < 2^-6): k * 2^-9, k rounded to nearest even from the 24-bit mantissa.
    mant = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - exp, 21), 31)
    sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
    sub = tl.where(exp < 117, 0, sub)
    byte = tl.where(exp < 121, sub, normal)
    byte = tl.where(mag > 0x7F800000, 0x7F, byte)
    return (byte | (sign << 7)).to(tl.uint8)


@triton.jit
def _e4m3(v, HW_E4M3: tl.constexpr):
    """`_e4m3_bits`'s byte of fp32 v. HW_E4M3 (CUDA sm_89+): by the hardware's conversion (cvt.rn.satfinite
    to e4m3: round to nearest even, saturate to +-448, inf included), one instruction per two elements
    instead of the integer sequence; its NaN loses the sign, so NaNs are set to 0x7f | sign here."""
    if HW_E4M3:
        byte = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        nan = ((v.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F
        return tl.where(v != v, nan.to(tl.uint8), byte)
    else:
        return _e4m3_bits(v)


@triton.jit
def e8m0_scales(amax):
    """(E8M0 byte, 2^-e as fp32) of block maxima amax >= 0: the smallest power of two >= amax / 448."""
    bits = amax.to(tl.int32, bitcast=True)
    exp = bits >> 23
    mant = bits & 0x7FFFFF
    byte = exp - 8 + (mant > 0x600000).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, 0), 254)
    byte = tl.where(amax == 0.0, 127, byte)
    byte = tl.where(exp == 255, 255, byte)
    recip = ((254 - byte) << 23).to(tl.float32, bitcast=True)
    recip = tl.where(byte == 255, float("nan"), recip)
    return byte.to(tl.uint8), recip


@triton.jit
def fp32_scales(amax):
    """(scale, scale_inv) of block maxima amax >= 0: min(448 / amax, fp32 max) and its inverse, both
    correctly rounded; amax 0 -> 1, non-finite -> NaN."""
    zero = tl.where(amax == 0.0, 0.0, 0.0)  # zeros in amax's layout (tl.zeros_like has none in Gluon)
    scale = tl.minimum(tl.math.div_rn(zero + FP8_MAX, tl.where(amax == 0.0, 1.0, amax)), FLOAT32_MAX)
    scale = tl.where(amax == 0.0, 1.0, scale)
    scale = tl.where(amax == float("inf"), float("nan"), scale)
    # The NaN itself, not 1 / NaN: the GPU's division returns its own NaN bits (0x7fffffff), and the
    # stored bytes are the torch path's (0x7fc00000) on every device.
    return scale, tl.where(scale != scale, scale, tl.math.div_rn(zero + 1.0, scale))


@triton.jit
def e4m3_tile(x, s, any_nan, HW_E4M3: tl.constexpr):
    """`_e4m3`'s bytes of fp32 x * s. With HW_E4M3 the NaN fix-up (four integer ops and a select an
    element) runs only where `any_nan` (a scalar: the tile holds a non-finite block maximum): x * s is
    NaN only in a block whose maximum is non-finite (finite x times a finite scale is finite, at most
    448 up to rounding), and elsewhere the hardware's byte is already torch's. The product is formed
    again inside that branch, so that it is not kept in registers across it."""
    if HW_E4M3:
        byte = (x * s).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        if any_nan:
            v = x * s
            nan = ((v.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F
            byte = tl.where(v != v, nan.to(tl.uint8), byte)
        return byte
    else:
        return _e4m3_bits(x * s)


@triton.jit
def store_e4m3(ptrs, x, s, keep, mask, any_nan, HW_E4M3: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Stores `_e4m3`'s bytes of fp32 x * s, zeros where not `keep` (broadcast against x), at ptrs
    under mask; with TRANSPOSE the (rows, columns) tile is stored as its transpose (ptrs and mask then
    index (columns, rows)). x must be zero where not `keep` (the callers load it so).

    Why the store is inside: with HW_E4M3 a tile with no non-finite block maximum (`any_nan` False, a
    runtime scalar) is the hardware's conversion as it is (finite x times a finite scale, and 0 times
    one is the zero byte), and only the others take `e4m3_tile`'s NaN fix-up and the zeros. Had the two
    branches returned their bytes, the compiler would join them byte by byte (one register a byte,
    split from the conversion's pairs and packed again for the stores: about 10 more instructions an
    element in every tile, sm_90 SASS of Triton 3.6); each branch storing its own bytes keeps them
    packed."""
    if HW_E4M3:
        if any_nan:
            q = tl.where(keep, e4m3_tile(x, s, True, True), 0)
            if TRANSPOSE:
                q = tl.trans(q)
            tl.store(ptrs, q, mask=mask)
        else:
            q = (x * s).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
            if TRANSPOSE:
                q = tl.trans(q)
            tl.store(ptrs, q, mask=mask)
    else:
        q = tl.where(keep, _e4m3_bits(x * s), 0).to(tl.uint8)
        if TRANSPOSE:
            q = tl.trans(q)
        tl.store(ptrs, q, mask=mask)


@triton.jit
def _block_multipliers(amax, scale_ptrs, scale_mask, MX: tl.constexpr):
    """The multipliers of block maxima `amax`; stores their scales (E8M0 bytes, or fp32 scale_inv) at
    scale_ptrs."""
    if MX:
        byte, mult = e8m0_scales(amax)
        tl.store(scale_ptrs, byte, mask=scale_mask)
    else:
        mult, scale_inv = fp32_scales(amax)
        tl.store(scale_ptrs, scale_inv, mask=scale_mask)
    return mult


@triton.jit
def _runs(noop_ptr, HAS_NOOP: tl.constexpr):
    """Whether this launch writes (it writes nothing where its noop flag reads 1.0)."""
    if HAS_NOOP:
        return tl.load(noop_ptr) != 1.0
    else:
        return True


@triton.jit
def _group_of_slot(slot, slot_offs_ptr, num_groups, BLOCK_GROUPS: tl.constexpr):
    """The group g with slot_offs[g] <= slot < slot_offs[g+1] (N for slots past the groups')."""
    g = tl.arange(0, BLOCK_GROUPS)
    starts = tl.load(slot_offs_ptr + 1 + g, mask=g < num_groups, other=2**62)
    return tl.sum((starts <= slot).to(tl.int32), axis=0)


@triton.jit
def _slot_rows(slot, offs_ptr, slot_offs_ptr, rows, num_groups, TILE_M: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """(rows r, r inside the slot's group, the slot's group is a real one, g, j0, rows of g) of slot
    `slot`: the rows [offs[g] + j0, + TILE_M), j0 = (slot - slot_offs[g]) * TILE_M, of its group g, cut
    at the group's end (g = N: the padding rows up to `rows`; no rows for an unused slot)."""
    g = _group_of_slot(slot, slot_offs_ptr, num_groups, BLOCK_GROUPS)
    live_group = g < num_groups
    group_start = tl.load(offs_ptr + g)
    group_end = tl.load(offs_ptr + g + 1, mask=live_group, other=rows)
    j0 = (slot - tl.load(slot_offs_ptr + g)) * TILE_M
    r = group_start + j0 + tl.arange(0, TILE_M)
    return r, r < group_end, live_group, g, j0, group_end - group_start


@triton.jit
def _source_rows(index_ptr, r64, mask, GATHER: tl.constexpr):
    """The rows of x that the problem's rows r64 read (int64): index[r64] with GATHER (the problem's
    (M, X) rows gathered from x's by an index, never written out), else r64 itself; masked rows read
    x's row 0 (their values are masked too)."""
    if GATHER:
        return tl.load(index_ptr + r64, mask=mask, other=0).to(tl.int64)
    else:
        return r64


@triton.jit
def _segment_start(offs_ptr, g, rows, num_groups, BLOCK_GROUPS: tl.constexpr):
    """The first column of group g's segment in the FP8 wgrad's transposed operand layout
    (`moekit.ops.kernels.grouped_wgrad_fp8.segment_starts`, from the device offsets; BLOCK_GROUPS >= N)."""
    gi = tl.arange(0, BLOCK_GROUPS)
    starts_v, _ = segment_starts(offs_ptr, gi, rows, num_groups)
    return tl.sum(tl.where(gi == g, starts_v, 0), axis=0)


@triton.jit
def segment_store(col_ptr, x, mult, any_nan, keep, c, cmask, j0, count, seg0, live, pitch, BLOCK_ROWS: tl.constexpr,
                  HW_E4M3: tl.constexpr):  # fmt: skip
    """Columnwise bytes (`store_e4m3` of x * mult, x zero outside `keep`; BLOCK_ROWS rows j0 + i of a
    group of `count` rows, columns c) stored into the FP8 wgrad's transposed operand layout, (X, pitch):
    out[c, seg0 + i] (seg0 = the group's segment start + j0, a multiple of 16), the rows not `keep`ed
    (past the group's last row) as zeros up to the segment's end (count rounded up to SEGMENT_COLUMNS),
    nothing past it and nothing for a group that is not `live`. Stored as (columns, rows) tiles along
    the rows, the contiguous dimension of the destination: the compiler moves the tile through shared
    memory into a row-contiguous register layout, 16-byte stores where it can prove seg0 and the mask's
    edges multiples of 16 (hence `seg0 // 16 * 16`), rather than one byte a column at a time. A writer
    whose blocks are shorter than a segment also stores the zeros past its last block (`segment_tail`)."""
    i = tl.arange(0, BLOCK_ROWS)
    smask = live & (j0 + i < tl.cdiv(count, SEGMENT_COLUMNS) * SEGMENT_COLUMNS)
    dst = seg0 // 16 * 16 + i  # seg0 itself, written so that the compiler sees a multiple of 16
    ptrs = col_ptr + c.to(tl.int64)[:, None] * pitch + dst[None, :]
    store_e4m3(ptrs, x, mult, keep[:, None], cmask[:, None] & smask[None, :], any_nan, HW_E4M3, True)


@triton.jit
def segment_tail(col_ptr, c, cmask, j0, count, seg0, live, pitch, BLOCK: tl.constexpr, STORE_ROWS: tl.constexpr):
    """The zeros of a group's segment (of `count` rows) past a writer's block of BLOCK rows from row j0
    of the group (column seg0 = the segment's start + j0, a multiple of 16), where that block holds the
    group's last row and the group is `live`: out[c, seg0 + BLOCK + t] = 0 for the t with j0 + BLOCK + t
    below count rounded up to SEGMENT_COLUMNS, STORE_ROWS columns a store. Nothing for a block as long
    as a segment, whose writer reaches the segment's end itself; for shorter ones (mxfp8's 32-row
    slots, fp8_rowwise's spans) no other program's block reaches those columns."""
    if BLOCK < SEGMENT_COLUMNS:
        BLOCK_C: tl.constexpr = c.shape[0]
        i = tl.arange(0, STORE_ROWS)
        last = live & (j0 < count) & (count <= j0 + BLOCK)
        end = tl.cdiv(count, SEGMENT_COLUMNS) * SEGMENT_COLUMNS - (j0 + BLOCK)
        zeros = tl.zeros((BLOCK_C, STORE_ROWS), col_ptr.dtype.element_ty)
        ptrs = col_ptr + c.to(tl.int64)[:, None] * pitch + ((seg0 + BLOCK) // 16 * 16 + i)[None, :]
        for t in tl.static_range(0, SEGMENT_COLUMNS - BLOCK, STORE_ROWS):
            tl.store(ptrs + t, zeros, mask=cmask[:, None] & (last & (t + i < end))[None, :])


@triton.jit
def slot_records_kernel(
    offs_ptr,
    slot_offs_ptr,
    rec_ptr,
    rows,
    num_groups,
    num_slots,
    SLOT_ROWS: tl.constexpr,
    SEGMENTS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """Each slot's rows as four int32 words, rec[slot] = (r0, n, live, seg0): its first row in x
    (offs[g] + j0), its rows in the group from there (rows of g - j0: >= SLOT_ROWS for a whole slot,
    <= 0 for an unused one), whether g is a real group (not the padding rows), and (SEGMENTS) its first
    column in the FP8 wgrad's layout (the group's segment start + j0; 0 otherwise); g and j0 as
    `_slot_rows`'. Why a table: a persistent kernel walking many slots a program (the Gluon
    `quantize_slots_tma_kernel`) then finds a slot's rows with one independent load it can issue an item
    ahead, instead of a chain of dependent loads and cross-warp reductions on its critical path."""
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    smask = s < num_slots
    gi = tl.arange(0, BLOCK_GROUPS)
    starts = tl.load(slot_offs_ptr + 1 + gi, mask=gi < num_groups, other=2**62)
    g = tl.sum((starts[None, :] <= s[:, None]).to(tl.int32), axis=1)
    live = g < num_groups
    group_start = tl.load(offs_ptr + g, mask=smask, other=0)
    count = tl.load(offs_ptr + g + 1, mask=smask & live, other=rows) - group_start
    j0 = (s - tl.load(slot_offs_ptr + g, mask=smask, other=0)) * SLOT_ROWS
    seg0 = j0 * 0
    if SEGMENTS:
        starts_v, _ = segment_starts(offs_ptr, gi, rows, num_groups)
        seg0 = tl.sum(tl.where(gi[None, :] == g[:, None], starts_v[None, :], 0), axis=1) + j0
    rec = rec_ptr + s.to(tl.int64) * 4
    tl.store(rec, (group_start + j0).to(tl.int32), mask=smask)
    tl.store(rec + 1, (count - j0).to(tl.int32), mask=smask)
    tl.store(rec + 2, live.to(tl.int32), mask=smask)
    tl.store(rec + 3, seg0.to(tl.int32), mask=smask)


@triton.jit
def program_order(column_programs, BAND: tl.constexpr):
    """(row program p, column program q) of a 1-D launch over both (1-D: the row programs can pass the
    65535 limit of a grid's second dimension), in bands of BAND row programs: a band's programs run
    one after the other, its row programs fastest. What runs at one time is then a few row programs'
    whole width: reads of whole stretches of x's rows (DRAM pages, rather than a thin column strip of
    every row) and a row's scales written together (BAND = 1: column programs fastest); a larger band
    keeps more row programs side by side (the slots kernel's FP8 wgrad layout, whose output rows are
    x's columns, runs a 2-D launch, slots fastest, instead: its BAND = 0)."""
    pid = tl.program_id(0)
    per_band = BAND * column_programs
    first = pid // per_band * BAND
    height = tl.minimum(tl.num_programs(0) // column_programs - first, BAND)
    within = pid % per_band
    return first + within % height, within // height


@triton.jit
def rowwise_blocks(
    x,
    a,
    r64,
    rmask,
    cb,
    cbmask,
    row_scale_ptr,
    stride_row_scale,
    data_ptrs,
    data_mask,
    MX: tl.constexpr,
    TILE_K: tl.constexpr,
    HW_E4M3: tl.constexpr,
    X_DTYPE: tl.constexpr,
):
    """Stores the rowwise bytes of a (rows, BLOCK_C) tile x at data_ptrs (under data_mask), 1 x TILE_K
    blocks along its rows, and their scales at row_scale[row, cb] (rows r64 where rmask, column blocks
    cb where cbmask). a: `abs_bits` of x's values as they were in X_DTYPE (x itself is float32).
    The blocks' maxima reduce a (rows, NB, TILE_K) view of the tile, which keeps its layout."""
    BLOCK_R: tl.constexpr = x.shape[0]
    BLOCK_C: tl.constexpr = x.shape[1]
    NB: tl.constexpr = BLOCK_C // TILE_K
    row_scales = row_scale_ptr + r64[:, None] * stride_row_scale + cb[None, :]
    row_scale_mask = rmask[:, None] & cbmask[None, :]
    if NB == 1:
        amax_r = amax_value(tl.max(a, axis=1), X_DTYPE)[:, None]
        mult = _block_multipliers(amax_r, row_scales, row_scale_mask, MX)
    else:
        amax_r = amax_value(tl.max(tl.reshape(a, (BLOCK_R, NB, TILE_K)), axis=2), X_DTYPE)
        mult3 = _block_multipliers(amax_r, row_scales, row_scale_mask, MX)[:, :, None]
        mult = tl.reshape(tl.broadcast_to(mult3, (BLOCK_R, NB, TILE_K)), (BLOCK_R, BLOCK_C))
    any_nan = tl.max(tl.max(amax_r, axis=1), axis=0) == float("inf")
    store_e4m3(data_ptrs, x, mult, data_mask, data_mask, any_nan, HW_E4M3, False)


@triton.jit
def _transposed_tile(row_data, scales, r64, rmask, member, c, cmask, cb, cbmask, t_data_ptr, t_scale_ptr, cols,
                     member_rows, stride_x, BLOCK_R: tl.constexpr):  # fmt: skip
    """A weight block's bytes (rows r64 = j0 + i of member n, columns c) and its scale, just stored at
    row_data and scales[cb], also into the transposed weight: t_data[n, c, j0 + i] (an (N, I, O)
    tensor, O = member_rows) and t_scale[n, cb, j0 / BLOCK_R] ((N, SI, SO)): the bytes
    `transpose_weight_kernel` makes from the stored form. Both are read back from where the program
    stored them, after a CTA barrier (other threads stored most of them; L2 hits, no HBM read), the
    bytes as a (columns, rows) tile stored along O, the destination's contiguous dimension (16-byte
    stores where the compiler can prove O a multiple of 16). Why not transpose the quantized tile in
    registers: the compiler then moves x's bf16 tile through shared memory and quantizes it twice."""
    n, j0 = member
    tl.debug_barrier()
    back = tl.load(row_data + r64[None, :] * stride_x + c[:, None], mask=cmask[:, None] & rmask[None, :])
    o = j0 // 16 * 16 + tl.arange(0, BLOCK_R)  # j0 itself (a multiple of BLOCK_R), so that the compiler sees 16 | o
    ptrs = t_data_ptr + n.to(tl.int64) * member_rows * cols + c.to(tl.int64)[:, None] * member_rows + o[None, :]
    tl.store(ptrs, back, mask=cmask[:, None] & (o < member_rows)[None, :])  # rmask, by o's alignment
    scale_rows = tl.cdiv(member_rows, BLOCK_R)
    t_scales = t_scale_ptr + (n.to(tl.int64) * tl.cdiv(cols, BLOCK_R) + cb) * scale_rows + j0 // BLOCK_R
    tl.store(t_scales, tl.load(scales + cb, mask=cbmask), mask=cbmask)


@triton.jit
def _tiles_step(
    qi,
    pid,
    r64,
    rmask,
    lmask,
    member,
    x_ptr,
    row_data_ptr,
    row_scale_ptr,
    t_data_ptr,
    t_scale_ptr,
    cols,
    stride_x,
    stride_row_scale,
    member_rows,
    MX: tl.constexpr,
    ROWWISE: tl.constexpr,
    TILE: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    TILE_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HW_E4M3: tl.constexpr,
):
    """Column tile qi of `quantize_tiles_kernel`'s program pid (rows r64, rmask inside the weight block
    or row block, lmask also live; member: (n, j0), the weight's member and the block's first row in it)."""
    NB: tl.constexpr = BLOCK_C // TILE_K
    cb = qi * NB + tl.arange(0, NB)
    cbmask = cb < stride_row_scale
    c = qi * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < cols
    elem = r64[:, None] * stride_x + c[None, :]
    mask = rmask[:, None] & cmask[None, :]
    # Loaded under the tile's own bounds and the rows outside a live group zeroed after: the load does
    # not wait for offs[N] (rowwise rows).
    x_in = tl.load(x_ptr + elem, mask=mask, other=0.0)
    x_in = tl.where(lmask[:, None], x_in, tl.zeros_like(x_in))
    a = abs_bits(x_in)
    x = x_in.to(tl.float32)
    if TILE:
        amax_t = amax_value(tl.max(tl.max(a, axis=1), axis=0), x_ptr.dtype.element_ty)
        mult = _block_multipliers(amax_t, row_scale_ptr + pid * stride_row_scale + cb, cbmask, MX)
        store_e4m3(row_data_ptr + elem, x, mult, mask, mask, amax_t == float("inf"), HW_E4M3, False)
        if TRANSPOSED:
            scales = row_scale_ptr + pid * stride_row_scale
            _transposed_tile(row_data_ptr, scales, r64, rmask, member, c, cmask, cb, cbmask, t_data_ptr, t_scale_ptr,
                             cols, member_rows, stride_x, BLOCK_R)  # fmt: skip
    if ROWWISE:
        rowwise_blocks(x, a, r64, rmask, cb, cbmask, row_scale_ptr, stride_row_scale, row_data_ptr + elem, mask,
                       MX, TILE_K, HW_E4M3, x_ptr.dtype.element_ty)  # fmt: skip


@triton.jit
def quantize_tiles_kernel(
    x_ptr,
    offs_ptr,
    slot_offs_ptr,
    noop_ptr,
    row_data_ptr,
    row_scale_ptr,
    t_data_ptr,
    t_scale_ptr,
    rows,
    cols,
    num_groups,
    stride_x,
    stride_row_scale,
    member_rows,
    MX: tl.constexpr,
    TILE: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    TILE_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STEPS: tl.constexpr,
    STAGES: tl.constexpr,
    HAS_NOOP: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    HW_E4M3: tl.constexpr,
):
    """The rowwise form alone (mxfp8, fp8_block) or a weight's 128 x 128 blocks: program (p, q) quantizes
    (BLOCK_R, BLOCK_C) tiles of x, each read once and held as one 2-D tile (the columns contiguous a
    thread, 16-byte loads and stores), columns [q * STEPS * BLOCK_C, ...), STEPS tiles in a pipelined loop
    of STAGES stages (STEPS = 1: one tile, no loop).
    - TILE (NB = BLOCK_C / TILE_K = 1): p is a weight's block of BLOCK_R rows (a slot, `_slot_rows`);
      one scale per BLOCK_R x TILE_K block, row_scale[slot, cb]. With TRANSPOSED the block's bytes and
      scale also go to the weight's transposed copy (`_transposed_tile`; member_rows = O), so that the
      FP8 dgrad's operand needs no second pass over the FP8 weight.
    - otherwise rows [p * BLOCK_R, + BLOCK_R): a row block needs no group (rowwise blocks never cross
      rows), only offs[N], past which rows are padding (zeros); a 1 x TILE_K scale per row and column
      block, row_scale[row, cb]."""
    if _runs(noop_ptr, HAS_NOOP):
        pid, q = program_order(tl.cdiv(tl.cdiv(cols, BLOCK_C), STEPS), 1)
        if TILE:
            r, rmask, live_group, g, j0, _ = _slot_rows(
                pid, offs_ptr, slot_offs_ptr, rows, num_groups, BLOCK_R, BLOCK_GROUPS
            )
            lmask = rmask & live_group
            member = (g, j0)
        else:
            r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
            rmask = r < rows
            lmask = rmask & (r < tl.load(offs_ptr + num_groups))
            member = (pid, pid)  # unused
        # int64 addresses: rows * stride passes 2^31 elements at real sizes.
        r64 = r.to(tl.int64)
        q0 = q * STEPS
        args = (x_ptr, row_data_ptr, row_scale_ptr, t_data_ptr, t_scale_ptr, cols, stride_x, stride_row_scale)
        if STEPS == 1:
            _tiles_step(q0, pid, r64, rmask, lmask, member, *args, member_rows,
                        MX, not TILE, TILE, TRANSPOSED, TILE_K, BLOCK_R, BLOCK_C, HW_E4M3)  # fmt: skip
        else:
            for qi in tl.range(q0, tl.minimum(q0 + STEPS, tl.cdiv(cols, BLOCK_C)), num_stages=STAGES):
                _tiles_step(qi, pid, r64, rmask, lmask, member, *args, member_rows,
                            MX, not TILE, TILE, TRANSPOSED, TILE_K, BLOCK_R, BLOCK_C, HW_E4M3)  # fmt: skip


@triton.jit
def _slot_chunk(x_ptr, index_ptr, r0, k, i, j0, count, live, c, cmask, stride_x, GATHER: tl.constexpr):
    """The slots kernel's chunk of rows k + i of its slot (problem rows r0 + k + i, of a group of `count`
    rows from its row j0), columns c, in float32 with its `abs_bits` (of the input's dtype), the rows
    (int64) and the rows' mask; rows past the group and columns past the edge read as zeros."""
    rmask = j0 + k + i < count
    r64 = r0 + k + i
    src = _source_rows(index_ptr, r64, rmask & live, GATHER)[:, None] * stride_x + c[None, :]
    x = tl.load(x_ptr + src, mask=rmask[:, None] & cmask[None, :] & live, other=0.0)
    return x.to(tl.float32), abs_bits(x), r64, rmask


@triton.jit
def column_scales(amax_c, col_scales, cmask, MX: tl.constexpr):
    """A slot's column scales from their maxima amax_c, stored at col_scales (E8M0 bytes or float32
    scale_inv): the multipliers and whether any column holds an inf or NaN."""
    any_nan = tl.max(amax_c, axis=0) == float("inf")
    if MX:
        byte, mult = e8m0_scales(amax_c)
        tl.store(col_scales, byte, mask=cmask)
    else:
        mult, scale_inv = fp32_scales(amax_c)
        tl.store(col_scales, scale_inv, mask=cmask)
    return mult, any_nan


@triton.jit
def quantize_slots_kernel(
    x_ptr,
    index_ptr,
    rec_ptr,
    noop_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    cols,
    stride_x,
    stride_row_scale,
    pitch,
    MX: tl.constexpr,
    ROWWISE: tl.constexpr,
    SEGMENTS: tl.constexpr,
    GATHER: tl.constexpr,
    TILE_K: tl.constexpr,
    SLOT_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CHUNK: tl.constexpr,
    STAGES: tl.constexpr,
    BAND: tl.constexpr,
    HAS_NOOP: tl.constexpr,
    HW_E4M3: tl.constexpr,
):
    """The columnwise form (mxfp8, fp8_block), with or without the rowwise one: program (slot, q) owns
    columns [q * BLOCK_C, + BLOCK_C) of one slot (SLOT_ROWS = the format's block of rows, of one group:
    `slot_records_kernel`), a SLOT_ROWS x 1 scale per column, col_scale[slot, col].

    It walks the slot's strip twice in (CHUNK, BLOCK_C) chunks. Walk 1 (a pipelined loop of STAGES)
    reads each chunk from memory, writes its rowwise bytes and scales (ROWWISE: 1 x TILE_K blocks along
    a row lie in the chunk) and folds it into an elementwise running maximum, reduced over the rows once
    at the end: the column scales. Walk 2 reads the chunks again (just read by this program: from the
    caches) and writes the columnwise bytes, as (M, X) rows or (SEGMENTS) straight into the FP8 wgrad's
    operand layout (`segment_store`, `segment_tail`; CHUNK a multiple of 16). Why two walks: a
    column's scale needs all of the slot's rows before any of its bytes, and holding the whole slot
    (and both forms' intermediates) costs the registers that decide how many programs share an SM; a
    chunk's registers do not grow with the slot. A chunk of the whole slot (CHUNK == SLOT_ROWS) is one
    walk: the strip stays in registers from its load to its columnwise bytes, and its rows are read once.
    Padding rows (group N) are read as zeros; unused slots store scale 1. A slot shorter than a segment
    (mxfp8's 32 rows) that holds its group's last row also stores the segment's zeros past it
    (`segment_tail`).

    A slot's rows come from `slot_records_kernel`'s table (rec_ptr), four independent loads, rather than
    from the offsets through dependent loads and cross-warp reductions over every group in each program
    before its first row can be read. The stores need the slot's place in its segment only modulo a
    segment (segments start on multiples of SEGMENT_COLUMNS): j0 = seg0 % SEGMENT_COLUMNS, the group's
    rows counted from there.

    GATHER: row r of the problem is x's row index[r] (`_source_rows`; x the rows it is gathered from),
    so a gather before it is not written."""
    if _runs(noop_ptr, HAS_NOOP):
        if BAND == 0:  # a 2-D launch, slots fastest
            slot, qc = tl.program_id(0), tl.program_id(1)
        else:
            slot, qc = program_order(tl.cdiv(cols, BLOCK_C), BAND)
        rec = rec_ptr + slot.to(tl.int64) * 4
        r0, n, live, seg0 = tl.load(rec).to(tl.int64), tl.load(rec + 1), tl.load(rec + 2) != 0, tl.load(rec + 3)
        # A slot starts a multiple of SLOT_ROWS into its segment: written so that the compiler sees it, and
        # the stores' masks keep 16-byte runs.
        j0 = seg0 % SEGMENT_COLUMNS // SLOT_ROWS * SLOT_ROWS
        count = n + j0
        NB: tl.constexpr = BLOCK_C // TILE_K
        cb = qc * NB + tl.arange(0, NB)
        cbmask = cb < stride_row_scale
        c = qc * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < cols
        i = tl.arange(0, CHUNK)
        col_scales = col_scale_ptr + slot.to(tl.int64) * cols + c
        ONE_WALK: tl.constexpr = CHUNK == SLOT_ROWS  # the chunk held from its load to its columnwise bytes
        held = tl.zeros((CHUNK, BLOCK_C), x_ptr.dtype.element_ty)
        # two walks: `abs_bits` folded elementwise, reduced once
        amax_ic = abs_bits(tl.zeros((CHUNK, BLOCK_C), x_ptr.dtype.element_ty))
        amax_c = tl.zeros((BLOCK_C,), tl.float32)  # one walk: the chunk's reduction itself
        for k in tl.range(0, SLOT_ROWS, CHUNK, num_stages=STAGES):
            x, a, r64, rmask = _slot_chunk(x_ptr, index_ptr, r0, k, i, j0, count, live, c, cmask, stride_x, GATHER)
            if ONE_WALK:  # held in the input's dtype (exact): half the registers of float32 for 16-bit input
                amax_c = amax_value(tl.max(a, axis=0), x_ptr.dtype.element_ty)
                held = x.to(x_ptr.dtype.element_ty)
            else:
                amax_ic = tl.maximum(amax_ic, a)
            if ROWWISE:
                row_data = row_data_ptr + r64[:, None] * stride_x + c[None, :]
                row_mask = rmask[:, None] & cmask[None, :]
                rowwise_blocks(x, a, r64, rmask, cb, cbmask, row_scale_ptr, stride_row_scale, row_data, row_mask,
                               MX, TILE_K, HW_E4M3, x_ptr.dtype.element_ty)  # fmt: skip
        if not ONE_WALK:
            amax_c = amax_value(tl.max(amax_ic, axis=0), x_ptr.dtype.element_ty)
        mult, any_nan = column_scales(amax_c, col_scales, cmask, MX)
        for k in tl.range(0, SLOT_ROWS, CHUNK):
            if ONE_WALK:
                x = held.to(tl.float32)
            else:
                x, _, _, _ = _slot_chunk(x_ptr, index_ptr, r0, k, i, j0, count, live, c, cmask, stride_x, GATHER)
            rmask = j0 + k + i < count
            if SEGMENTS:
                segment_store(col_data_ptr, x, mult[None, :], any_nan, rmask, c, cmask, j0 + k, count, seg0 + k, live,
                              pitch, CHUNK, HW_E4M3)  # fmt: skip
            else:
                elem = (r0 + k + i)[:, None] * stride_x + c[None, :]
                mask = rmask[:, None] & cmask[None, :]
                store_e4m3(col_data_ptr + elem, x, mult[None, :], mask, mask, any_nan, HW_E4M3, False)
        if SEGMENTS:
            segment_tail(col_data_ptr, c, cmask, j0, count, seg0, live, pitch, SLOT_ROWS, CHUNK)


@triton.jit
def quantize_rows_kernel(
    x_ptr,
    offs_ptr,
    noop_ptr,
    data_ptr,
    scale_ptr,
    rows,
    cols,
    num_groups,
    stride_x,
    HAS_NOOP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ONE_PASS: tl.constexpr,
    HW_E4M3: tl.constexpr,
):
    """One fp32 scale per whole row (scale[row]), rows past offs[N] zeros: BLOCK_ROWS rows a program.
    ONE_PASS (cols <= BLOCK_COLS): the rows are read once, held in registers while their maxima are
    taken, and quantized from there; otherwise the row maxima in a first pass over X, the data in a
    second (a second read of x)."""
    if _runs(noop_ptr, HAS_NOOP):
        r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        valid_end = tl.load(offs_ptr + num_groups)
        rmask = r < rows
        live = rmask & (r < valid_end)
        r64 = r.to(tl.int64)
        if ONE_PASS:
            c = tl.arange(0, BLOCK_COLS)
            cmask = (c < cols)[None, :]
            elem = r64[:, None] * stride_x + c[None, :]
            # Masked by rmask alone, so that the load does not wait for offs[N]; padding rows -> zeros.
            x_in = tl.load(x_ptr + elem, mask=rmask[:, None] & cmask, other=0.0)
            x_in = tl.where(live[:, None], x_in, tl.zeros_like(x_in))
            amax = amax_value(tl.max(abs_bits(x_in), axis=1), x_ptr.dtype.element_ty)
            scale, scale_inv = fp32_scales(amax)
            tl.store(scale_ptr + r64, scale_inv, mask=rmask)
            mask = rmask[:, None] & cmask
            any_nan = tl.max(amax, axis=0) == float("inf")
            store_e4m3(data_ptr + elem, x_in.to(tl.float32), scale[:, None], mask, mask, any_nan, HW_E4M3, False)
        else:
            amax = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
            for k0 in range(0, cols, BLOCK_COLS):
                c = k0 + tl.arange(0, BLOCK_COLS)
                mask = live[:, None] & (c < cols)[None, :]
                x = tl.load(x_ptr + r64[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
                amax = tl.maximum(amax, tl.max(abs_for_amax(x.to(tl.float32)), axis=1))
            scale, scale_inv = fp32_scales(amax)
            tl.store(scale_ptr + r64, scale_inv, mask=rmask)
            for k0 in range(0, cols, BLOCK_COLS):
                c = k0 + tl.arange(0, BLOCK_COLS)
                cmask = (c < cols)[None, :]
                elem = r64[:, None] * stride_x + c[None, :]
                x = tl.load(x_ptr + elem, mask=live[:, None] & cmask, other=0.0).to(tl.float32)
                tl.store(data_ptr + elem, _e4m3(x * scale[:, None], HW_E4M3), mask=rmask[:, None] & cmask)


@triton.jit
def _span_of(p, offs_ptr, rows, num_groups, SPAN: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """(g, first row, end row, first span of g) of span p: group g in 0..N (N: the padding rows
    [offs[N], rows)) has max(1, ceil(rows of g / SPAN)) spans of SPAN rows, numbered group after group
    (every group, empty ones too, has a first span; at most ceil(M / SPAN) + N + 1 in all). A p past
    the last span gets g = N + 1 and no rows. From the device offsets alone (BLOCK_GROUPS > N)."""
    gi = tl.arange(0, BLOCK_GROUPS)
    real = gi <= num_groups
    starts = tl.load(offs_ptr + gi, mask=real, other=rows)
    ends = tl.load(offs_ptr + gi + 1, mask=gi < num_groups, other=rows)
    spans = tl.where(real, tl.maximum(tl.cdiv(ends - starts, SPAN), 1), 0)
    after = tl.cumsum(spans, axis=0)
    g = tl.sum((after <= p).to(tl.int32), axis=0)
    mine = gi == g
    first = tl.sum(tl.where(mine, after - spans, 0), axis=0)
    end = tl.sum(tl.where(mine, ends, 0), axis=0)
    row0 = tl.sum(tl.where(mine, starts, 0), axis=0) + (p - first) * SPAN
    return g, row0, tl.minimum(row0 + SPAN, end), first


@triton.jit
def _span_tile(
    p,
    q,
    offs_ptr,
    rows,
    cols,
    num_groups,
    SPAN: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """The (SPAN, BLOCK_COLS) tile (span p, column block q) of `_span_of`'s spans: (g, rows r (int64),
    columns c, row mask, column mask)."""
    g, row0, row_end, _ = _span_of(p, offs_ptr, rows, num_groups, SPAN, BLOCK_GROUPS)
    r = row0 + tl.arange(0, SPAN)
    c = q * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    return g, r.to(tl.int64), c, r < row_end, c < cols


@triton.jit
def amax_spans_kernel(
    x_ptr,
    index_ptr,
    offs_ptr,
    noop_ptr,
    row_amax_ptr,
    col_amax_ptr,
    rows,
    cols,
    num_groups,
    stride_x,
    ROWWISE: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_NOOP: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """fp8_rowwise's first pass when the columnwise form is asked: program (p, q) reads the (SPAN,
    BLOCK_COLS) tile of span p (`_span_of`: rows of one group g) once and folds its maxima (NaN read as
    inf) into the whole-row maxima row_amax[row] (ROWWISE) and the whole-group column maxima
    col_amax[g, col] (int32, zeroed by the host): one atomic max on the fp32 bits per row and per
    column of the tile. The maxima are >= 0, so their bits order as the values: the result is exact
    whatever the order of the programs. Padding rows (g = N): no maxima (their rows read as zeros).
    GATHER: the problem's row r is x's row index[r] (`_source_rows`)."""
    if _runs(noop_ptr, HAS_NOOP):
        g, r64, c, rmask, cmask = _span_tile(
            tl.program_id(0), tl.program_id(1), offs_ptr, rows, cols, num_groups, SPAN, BLOCK_COLS, BLOCK_GROUPS
        )
        live = g < num_groups
        src = _source_rows(index_ptr, r64, rmask & live, GATHER)[:, None] * stride_x + c[None, :]
        x = tl.load(x_ptr + src, mask=rmask[:, None] & cmask[None, :] & live, other=0.0).to(tl.float32)
        a = abs_for_amax(x)
        col_at = col_amax_ptr + g.to(tl.int64) * cols + c
        tl.atomic_max(col_at, tl.max(a, axis=0).to(tl.int32, bitcast=True), mask=cmask & live, sem="relaxed")
        if ROWWISE:
            row_amax = tl.max(a, axis=1).to(tl.int32, bitcast=True)
            tl.atomic_max(row_amax_ptr + r64, row_amax, mask=rmask & live, sem="relaxed")


@triton.jit
def _spans_step(
    q,
    p,
    g,
    first,
    live,
    r64,
    src_rows,
    rmask,
    scale_r,
    row_nan,
    x_ptr,
    col_amax_ptr,
    row_data_ptr,
    col_data_ptr,
    col_scale_ptr,
    cols,
    stride_x,
    seg,
    ROWWISE: tl.constexpr,
    SEGMENTS: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    HW_E4M3: tl.constexpr,
):
    """Column block q of `quantize_spans_kernel`'s span p (group g, rows r64 read from x's rows
    src_rows; seg: SEGMENTS' (j0, rows of the group, segment column of j0, pitch))."""
    c = q * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    cmask = c < cols
    elem = r64[:, None] * stride_x + c[None, :]
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + src_rows[:, None] * stride_x + c[None, :], mask=mask & live, other=0.0).to(tl.float32)
    col_at = g.to(tl.int64) * cols + c
    col_amax = tl.load(col_amax_ptr + col_at, mask=cmask & live, other=0).to(tl.float32, bitcast=True)
    scale, scale_inv = fp32_scales(col_amax)
    tl.store(col_scale_ptr + col_at, scale_inv, mask=cmask & live & (p == first))
    col_nan = tl.max(col_amax, axis=0) == float("inf")
    if SEGMENTS:
        j0, count, seg0, pitch = seg
        segment_store(col_data_ptr, x, scale[None, :], col_nan, rmask, c, cmask, j0, count, seg0, live, pitch, SPAN,
                      HW_E4M3)  # fmt: skip
        segment_tail(col_data_ptr, c, cmask, j0, count, seg0, live, pitch, SPAN, SPAN)
    else:
        store_e4m3(col_data_ptr + elem, x, scale[None, :], mask, mask, col_nan, HW_E4M3, False)
    if ROWWISE:
        store_e4m3(row_data_ptr + elem, x, scale_r[:, None], mask, mask, row_nan, HW_E4M3, False)


@triton.jit
def quantize_spans_kernel(
    x_ptr,
    index_ptr,
    offs_ptr,
    noop_ptr,
    row_amax_ptr,
    col_amax_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    rows,
    cols,
    num_groups,
    stride_x,
    pitch,
    ROWWISE: tl.constexpr,
    SEGMENTS: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_NOOP: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    STEPS: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    HW_E4M3: tl.constexpr,
):
    """fp8_rowwise's second pass (after `amax_spans_kernel`): program (p, k) reads the (SPAN,
    BLOCK_COLS) tiles of span p (group g) in column blocks [k * STEPS, + STEPS) once more (STEPS > 1:
    a software-pipelined loop of STAGES stages) and writes both forms from them: ROWWISE the data
    under the whole-row scales of row_amax (the programs of k = 0 store scale[row]), and the
    columnwise data under group g's column scales of col_amax (the group's first span stores
    scale[g, col]). Padding rows (g = N): zeros, rowwise scale 1, no columnwise scale. SEGMENTS (SPAN a
    divisor of SEGMENT_COLUMNS, a multiple of 16): the columnwise data straight into the FP8 wgrad's
    operand layout, col_data (X, pitch), as `quantize_slots_kernel`'s SEGMENTS (padding rows:
    nothing). GATHER as `quantize_slots_kernel`'s (and `amax_spans_kernel`'s: the same rows)."""
    if _runs(noop_ptr, HAS_NOOP):
        p = tl.program_id(0)
        k = tl.program_id(1)
        g, row0, row_end, first = _span_of(p, offs_ptr, rows, num_groups, SPAN, BLOCK_GROUPS)
        live = g < num_groups
        r64 = (row0 + tl.arange(0, SPAN)).to(tl.int64)
        rmask = r64 < row_end
        src_rows = _source_rows(index_ptr, r64, rmask & live, GATHER)
        row_amax = tl.zeros((SPAN,), dtype=tl.float32)
        if ROWWISE:
            row_amax = tl.load(row_amax_ptr + r64, mask=rmask & live, other=0).to(tl.float32, bitcast=True)
        scale_r, scale_inv_r = fp32_scales(row_amax)
        if ROWWISE:
            tl.store(row_scale_ptr + r64, scale_inv_r, mask=rmask & (k == 0))
        row_nan = tl.max(row_amax, axis=0) == float("inf")
        seg = (0, 0, 0, pitch)
        if SEGMENTS:
            j0 = (p - first) * SPAN
            count = tl.load(offs_ptr + g + 1, mask=live, other=0) - tl.load(offs_ptr + g, mask=live, other=0)
            seg = (j0, count, _segment_start(offs_ptr, g, rows, num_groups, BLOCK_GROUPS) + j0, pitch)
        args = (x_ptr, col_amax_ptr, row_data_ptr, col_data_ptr, col_scale_ptr, cols, stride_x, seg)
        if STEPS == 1:
            _spans_step(
                k, p, g, first, live, r64, src_rows, rmask, scale_r, row_nan, *args, ROWWISE, SEGMENTS, SPAN,
                BLOCK_COLS, HW_E4M3,
            )  # fmt: skip
        else:
            q0 = k * STEPS
            for q in tl.range(q0, tl.minimum(q0 + STEPS, tl.cdiv(cols, BLOCK_COLS)), num_stages=STAGES):
                _spans_step(
                    q, p, g, first, live, r64, src_rows, rmask, scale_r, row_nan, *args, ROWWISE, SEGMENTS, SPAN,
                    BLOCK_COLS, HW_E4M3,
                )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Dequantization: data * scale in fp32, one rounding to the output's dtype
# --------------------------------------------------------------------------------------------------


@triton.jit
def e4m3_value(byte):
    """The fp32 value of float8 E4M3 bytes (uint8), exactly (torch's float8_e4m3fn -> float32): integer
    arithmetic on the bits, the same on every device (the interpreter's fp8 casts follow other rules)."""
    b = byte.to(tl.int32)
    sign = (b >> 7) & 1
    exp = (b >> 3) & 0xF
    mant = b & 0x7
    normal = ((sign << 31) | ((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * 0.001953125  # mant * 2^-9, exact
    sub = tl.where(sign == 1, -sub, sub)
    value = tl.where(exp == 0, sub, normal)
    return tl.where((exp == 15) & (mant == 7), float("nan"), value)


@triton.jit
def e8m0_value(byte):
    """The fp32 value of E8M0 bytes (uint8): 2^(byte - 127) (byte 0: 2^-127, an fp32 subnormal), byte
    255 NaN; torch's float8_e8m0fnu -> float32."""
    b = byte.to(tl.int32)
    value = tl.where(b == 0, 0x400000, b << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), value)


@triton.jit
def bf16_rne(v):
    """fp32 v rounded to the nearest bfloat16 (ties to even), still fp32 (its low 16 bits zero), so that
    any conversion to bfloat16 after it is exact: the interpreter's conversion truncates, the GPU's
    rounds to nearest even (the same result). NaN kept."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))


@triton.jit
def dequantize_kernel(
    data_ptr,
    scale_ptr,
    offs_ptr,
    slot_offs_ptr,
    out_ptr,
    rows,
    cols,
    num_groups,
    member_rows,
    member_slots,
    scale_cols,
    max_slot,
    MX: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_X: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    BF16_RNE: tl.constexpr,
):
    """Program (row block, column block) of the (M, X) data (an (N, O, I) weight as (N * O, I)): out =
    data * scale, the product in fp32, one rounding to out's dtype. The scale of element (r, c) is
    scale[srow(r), c // BLOCK_C] (column 0 for BLOCK_C 0: whole rows), scale_cols a row, where SCALE_ROWS
    picks srow:
      0  r itself (rowwise scales of rows, or of a weight's rows)
      1  a weight's blocks along O: member n = r // member_rows, n * member_slots + (r % member_rows) //
         BLOCK_R (0 for BLOCK_R 0: whole members); a weight's rowwise tiles and its columnwise blocks
      2  columnwise slots of rows in groups: g the group of r (N for padding rows), slot_offs[g] + (r -
         offs[g]) // BLOCK_R (g itself for BLOCK_R 0: whole groups), capped at max_slot
    (`moekit.grouped_tensor.dequantize_rowwise` / `dequantize_columnwise`, whose bytes this writes).
    BF16_RNE (the host sets it for a bfloat16 out under the interpreter): round to bfloat16 by `bf16_rne`."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    rmask = r < rows
    cmask = c < cols
    r64 = r.to(tl.int64)
    if SCALE_ROWS == 0:
        srow = r64
    elif SCALE_ROWS == 1:
        member = r64 // member_rows
        srow = member * member_slots
        if BLOCK_R > 0:
            srow += (r64 - member * member_rows) // BLOCK_R
    else:
        g = tl.arange(0, BLOCK_GROUPS)
        ends = tl.load(offs_ptr + 1 + g, mask=g < num_groups, other=2**62)
        # The groups of the tile's first and last rows; where they agree (all but the tiles that hold
        # a group boundary) every row's slot follows from that one group, with no per-row search.
        first = tl.program_id(0) * BLOCK_M
        last = tl.minimum(first + BLOCK_M, rows) - 1
        g_first = tl.sum((ends <= first).to(tl.int32), axis=0)
        if g_first == tl.sum((ends <= last).to(tl.int32), axis=0):
            if BLOCK_R > 0:
                g_start = tl.load(offs_ptr + g_first)
                srow = tl.load(slot_offs_ptr + g_first) + (r64 - g_start) // BLOCK_R
            else:
                srow = r64 * 0 + g_first
        else:
            group = tl.sum((ends[None, :] <= r64[:, None]).to(tl.int32), axis=1)
            if BLOCK_R > 0:
                start = tl.load(offs_ptr + group, mask=rmask, other=0)
                srow = tl.load(slot_offs_ptr + group, mask=rmask, other=0) + (r64 - start) // BLOCK_R
            else:
                srow = group.to(tl.int64)
        srow = tl.minimum(srow, max_slot)
    if BLOCK_C > 0:
        scol = c // BLOCK_C
    else:
        scol = c * 0
    mask = rmask[:, None] & cmask[None, :]
    scale_at = scale_ptr + srow[:, None] * scale_cols + scol[None, :]
    if MX:
        scale = e8m0_value(tl.load(scale_at, mask=mask, other=127))
    else:
        scale = tl.load(scale_at, mask=mask, other=1.0)
    elem = r64[:, None] * cols + c[None, :]
    x = e4m3_value(tl.load(data_ptr + elem, mask=mask, other=0))
    y = x * scale
    if BF16_RNE:
        y = bf16_rne(y)
    tl.store(out_ptr + elem, y.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# The transposed FP8 weight: (N, O, I) bytes and scales -> (N, I, O)
# --------------------------------------------------------------------------------------------------


@triton.jit
def transpose_weight_kernel(
    data_ptr,
    scale_ptr,
    data_t_ptr,
    scale_t_ptr,
    rows,
    cols,
    row_words,
    scale_rows,
    scale_cols,
    TILE_SCALES: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """Program (column tile, row tile, member n) of an (N, O, I) FP8 weight (O = rows, I = cols):
    data_t[n, i, o] = data[n, o, i] over its BLOCK_O x BLOCK_I tile, read along I and written along O,
    and the scales (N, scale_rows, scale_cols) -> (N, scale_cols, scale_rows): TILE_SCALES, one scale
    per BLOCK_O x BLOCK_I tile (fp8_block: the tile is the 128 x 128 block, its scale moves with it);
    else scale_rows is 1 (fp8_rowwise's per-column scales, whose bytes keep their order) and the
    programs of the first row tile copy their columns' scales. Bytes only: no arithmetic on values.

    WORDS (O a multiple of 4, row_words = O / 4; data_t_ptr then addresses int32 words): the tile is
    read as four (BLOCK_O / 4, BLOCK_I) loads of the rows o = 4q + k, k = 0..3, which lay out alike, so
    a thread packs its 4 bytes of (q, i) in registers into the word data_t[n, i, 4q : 4q + 4] (byte k
    at o = 4q + k, little-endian) and the transpose through shared memory moves words, not bytes.
    Otherwise bytes."""
    ib = tl.program_id(0)
    ob = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
    member = n * rows * cols
    if WORDS:
        q = ob * (BLOCK_O // 4) + tl.arange(0, BLOCK_O // 4)
        mask = (q < row_words)[:, None] & (i < cols)[None, :]
        row0 = data_ptr + member + (q * 4)[:, None] * cols + i[None, :]
        words = tl.load(row0, mask=mask, other=0).to(tl.int32)
        for k in tl.static_range(1, 4):
            words |= tl.load(row0 + k * cols, mask=mask, other=0).to(tl.int32) << (8 * k)
        mask_t = (i < cols)[:, None] & (q < row_words)[None, :]
        words_at = n * row_words * cols + i[:, None] * row_words + q[None, :]
        tl.store(data_t_ptr + words_at, tl.trans(words), mask=mask_t)
    else:
        o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
        mask = (o < rows)[:, None] & (i < cols)[None, :]
        tile = tl.load(data_ptr + member + o[:, None] * cols + i[None, :], mask=mask)
        mask_t = (i < cols)[:, None] & (o < rows)[None, :]
        tl.store(data_t_ptr + member + i[:, None] * rows + o[None, :], tl.trans(tile), mask=mask_t)
    if TILE_SCALES:
        s = tl.load(scale_ptr + (n * scale_rows + ob) * scale_cols + ib)
        tl.store(scale_t_ptr + (n * scale_cols + ib) * scale_rows + ob, s)
    elif ob == 0:
        scale_at = n * scale_cols + i
        tl.store(scale_t_ptr + scale_at, tl.load(scale_ptr + scale_at, mask=i < cols), mask=i < cols)
