"""Triton kernels of grouped FP8 quantization (jit code only; host code in `moekit.ops.runtime.quantize`,
the formats in `moekit.grouped_tensor` and `moekit.ops.quantize`).

Legend: M rows (N groups of them, then padding rows), X columns; a slot is one block of rows of one
group (columnwise scales are kept per slot).

    quantize_tiles_kernel       one program per (slot, STEPS x BLOCKS_K column blocks), a pipelined loop
                                over its steps: the rowwise 1 x TILE_K scales of its rows, the columnwise
                                TILE_M x 1 scales of its columns, or one scale per block (a weight's
                                128 x 128 blocks); mxfp8 and fp8_block
    quantize_rows_kernel        one scale per whole row (fp8_rowwise rowwise): one read of rows that fit
                                a program's registers (X <= 16384), else two passes over X
    quantize_group_cols_kernel  one scale per column of a whole group (fp8_rowwise columnwise): two
                                passes over the group's rows
    dequantize_kernel           data * scale of either form, every recipe: one pass, the product in
                                fp32 rounded once to the output's dtype (the torch path's bytes)

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
(cvt.rn.satfinite, the same rounding and saturation) with the NaNs' sign set apart; elsewhere by integer
arithmetic on the fp32 bits (Triton 3.6's interpreter converts to fp8 by other rules). Both give every
device the same bytes.
"""

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _abs_for_amax(x):
    """|x| with NaN read as inf: a block holding a NaN gets a non-finite amax (tl.max drops NaN on some
    targets)."""
    return tl.where(x != x, float("inf"), tl.abs(x))


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
def _e8m0_scales(amax):
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
def _fp32_scales(amax):
    """(scale, scale_inv) of block maxima amax >= 0: min(448 / amax, fp32 max) and its inverse, both
    correctly rounded; amax 0 -> 1, non-finite -> NaN."""
    zero = tl.zeros_like(amax)
    scale = tl.minimum(tl.math.div_rn(zero + FP8_MAX, tl.where(amax == 0.0, 1.0, amax)), FLOAT32_MAX)
    scale = tl.where(amax == 0.0, 1.0, scale)
    scale = tl.where(amax == float("inf"), float("nan"), scale)
    # The NaN itself, not 1 / NaN: the GPU's division returns its own NaN bits (0x7fffffff), and the
    # stored bytes are the torch path's (0x7fc00000) on every device.
    return scale, tl.where(scale != scale, scale, tl.math.div_rn(zero + 1.0, scale))


@triton.jit
def _quantize_block(x, amax, scale_ptrs, scale_mask, MX: tl.constexpr, HW_E4M3: tl.constexpr):
    """The E4M3 bytes of x under the scales of `amax` (broadcast against x); stores the scales (E8M0
    bytes or fp32 scale_inv) at scale_ptrs."""
    if MX:
        byte, recip = _e8m0_scales(amax)
        tl.store(scale_ptrs, byte, mask=scale_mask)
        return _e4m3(x * recip, HW_E4M3)
    else:
        scale, scale_inv = _fp32_scales(amax)
        tl.store(scale_ptrs, scale_inv, mask=scale_mask)
        return _e4m3(x * scale, HW_E4M3)


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
def quantize_tiles_kernel(
    x_ptr,
    offs_ptr,
    slot_offs_ptr,
    noop_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    rows,
    cols,
    num_groups,
    stride_x,
    stride_row_scale,
    MX: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    TILE: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
    BLOCKS_K: tl.constexpr,
    STEPS: tl.constexpr,
    STAGES: tl.constexpr,
    HAS_NOOP: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    HW_E4M3: tl.constexpr,
):
    """Program (slot, kc): rows [offs[g] + (slot - slot_offs[g]) * TILE_M, + TILE_M) of group g, cut at
    the group's end (padding rows for g = N: zeros; no rows for an unused slot), and STEPS column steps
    kb in [kc * STEPS, + STEPS), step kb the column blocks cb in [kb * BLOCKS_K, + BLOCKS_K), block cb
    the columns [cb * TILE_K, + TILE_K): BLOCKS_K blocks a step, so that a step moves enough bytes when
    the format's block is small (mxfp8's 32 x 32). ROWWISE: a 1 x TILE_K scale per row and block,
    row_scale[row, cb]; COLWISE: a TILE_M x 1 scale per column, col_scale[slot, col]; TILE: one scale
    per TILE_M x TILE_K block, row_scale[slot, cb] (data rowwise). A step's tile is held as (TILE_M,
    BLOCKS_K, TILE_K): each block's maxima are reductions over axes.

    The slot's rows are found once (device offsets), so the steps' loads depend on the loop index
    alone: the loop is software-pipelined (STAGES: the tiles of later steps are loaded into shared
    memory while a step computes), which keeps HBM busy with one or two programs an SM."""
    if _runs(noop_ptr, HAS_NOOP):
        slot = tl.program_id(0)
        g = _group_of_slot(slot, slot_offs_ptr, num_groups, BLOCK_GROUPS)
        live_group = g < num_groups
        group_start = tl.load(offs_ptr + g)
        group_end = tl.load(offs_ptr + g + 1, mask=live_group, other=rows)
        row0 = group_start + (slot - tl.load(slot_offs_ptr + g)) * TILE_M
        r = row0 + tl.arange(0, TILE_M)
        rmask = r < group_end
        # int64 addresses: rows * stride passes 2^31 elements at real sizes.
        r64 = r.to(tl.int64)
        steps = tl.cdiv(stride_row_scale, BLOCKS_K)
        kb0 = tl.program_id(1) * STEPS
        for kb in tl.range(kb0, tl.minimum(kb0 + STEPS, steps), num_stages=STAGES):
            cb = kb * BLOCKS_K + tl.arange(0, BLOCKS_K)
            cbmask = cb < stride_row_scale
            c = cb[None, :, None] * TILE_K + tl.arange(0, TILE_K)[None, None, :]
            cmask = c < cols
            mask = rmask[:, None, None] & cmask
            elem = r64[:, None, None] * stride_x + c
            x = tl.load(x_ptr + elem, mask=mask & live_group, other=0.0).to(tl.float32)
            a = _abs_for_amax(x)
            if TILE:
                amax = tl.max(tl.max(a, axis=2), axis=0)[None, :, None]
                tile_scales = row_scale_ptr + slot * stride_row_scale + cb[None, :, None]
                q = _quantize_block(x, amax, tile_scales, cbmask[None, :, None], MX, HW_E4M3)
                tl.store(row_data_ptr + elem, q, mask=mask)
            if ROWWISE:
                amax_r = tl.max(a, axis=2)[:, :, None]
                row_scales = row_scale_ptr + r64[:, None, None] * stride_row_scale + cb[None, :, None]
                q = _quantize_block(x, amax_r, row_scales, rmask[:, None, None] & cbmask[None, :, None], MX, HW_E4M3)
                tl.store(row_data_ptr + elem, q, mask=mask)
            if COLWISE:
                amax_c = tl.max(a, axis=0)[None, :, :]
                col_scales = col_scale_ptr + slot.to(tl.int64) * cols + c
                q = _quantize_block(x, amax_c, col_scales, cmask, MX, HW_E4M3)
                tl.store(col_data_ptr + elem, q, mask=mask)


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
            x = tl.load(x_ptr + elem, mask=rmask[:, None] & cmask, other=0.0).to(tl.float32)
            x = tl.where(live[:, None], x, 0.0)
            scale, scale_inv = _fp32_scales(tl.max(_abs_for_amax(x), axis=1))
            tl.store(scale_ptr + r64, scale_inv, mask=rmask)
            tl.store(data_ptr + elem, _e4m3(x * scale[:, None], HW_E4M3), mask=rmask[:, None] & cmask)
        else:
            amax = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
            for k0 in range(0, cols, BLOCK_COLS):
                c = k0 + tl.arange(0, BLOCK_COLS)
                mask = live[:, None] & (c < cols)[None, :]
                x = tl.load(x_ptr + r64[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
                amax = tl.maximum(amax, tl.max(_abs_for_amax(x.to(tl.float32)), axis=1))
            scale, scale_inv = _fp32_scales(amax)
            tl.store(scale_ptr + r64, scale_inv, mask=rmask)
            for k0 in range(0, cols, BLOCK_COLS):
                c = k0 + tl.arange(0, BLOCK_COLS)
                cmask = (c < cols)[None, :]
                elem = r64[:, None] * stride_x + c[None, :]
                x = tl.load(x_ptr + elem, mask=live[:, None] & cmask, other=0.0).to(tl.float32)
                tl.store(data_ptr + elem, _e4m3(x * scale[:, None], HW_E4M3), mask=rmask[:, None] & cmask)


@triton.jit
def quantize_group_cols_kernel(
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
    HW_E4M3: tl.constexpr,
):
    """One fp32 scale per column of each whole group (scale[g, col]): program (g, column block), the
    column maxima in a first pass over the group's rows, the data in a second. g = N: the padding rows,
    written as zeros (no scale)."""
    if _runs(noop_ptr, HAS_NOOP):
        g = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        cmask = c < cols
        start = tl.load(offs_ptr + g)
        end = tl.load(offs_ptr + g + 1, mask=g < num_groups, other=rows)
        live = g < num_groups
        amax = tl.zeros((BLOCK_COLS,), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_ROWS):
            r = (r0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
            mask = (r < end)[:, None] & cmask[None, :]
            x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=mask & live, other=0.0)
            amax = tl.maximum(amax, tl.max(_abs_for_amax(x.to(tl.float32)), axis=0))
        scale, scale_inv = _fp32_scales(amax)
        tl.store(scale_ptr + g.to(tl.int64) * cols + c, scale_inv, mask=cmask & live)
        for r0 in range(start, end, BLOCK_ROWS):
            r = (r0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
            mask = (r < end)[:, None] & cmask[None, :]
            elem = r[:, None] * stride_x + c[None, :]
            x = tl.load(x_ptr + elem, mask=mask & live, other=0.0).to(tl.float32)
            tl.store(data_ptr + elem, _e4m3(x * scale[None, :], HW_E4M3), mask=mask)


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
