"""Grouped FP8 quantization in plain torch: the `torch` (and `loop`) backends' `group_quantize_into`, on
any device, with the group offsets on the device and never read by the host. Bit for bit what the
Triton kernels write (`moekit.ops.kernels.quantize`, whose docstring states the scale rules); the
formats are `moekit.grouped_tensor.RECIPES`.

Legend: M rows (N groups of them, then padding rows), K columns; an (N, R, C) weight's members are
(R, C). Plain torch: importing this module needs no triton.
"""

from __future__ import annotations

import torch

from moekit.grouped_tensor import E8M0_DTYPE, FP8_DTYPE, FP8_MAX, Recipe, column_slots, recipe_named

_FLOAT32_MAX = torch.finfo(torch.float32).max


def abs_for_amax(x32: torch.Tensor) -> torch.Tensor:
    """|x| with NaN read as inf (a block holding a NaN gets a non-finite amax)."""
    return torch.where(torch.isnan(x32), torch.full_like(x32, float("inf")), x32.abs())


def e8m0_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E8M0 bytes as uint8, 2^-e as fp32) of fp32 block maxima: the smallest power of two >= amax /
    448, from amax's bits; amax 0 -> byte 127 (1.0); non-finite -> byte 255 (NaN)."""
    bits = amax.contiguous().view(torch.int32)
    exp, mant = bits >> 23, bits & 0x7FFFFF
    byte = (exp - 8 + (mant > 0x600000).to(torch.int32)).clamp(0, 254)
    byte = torch.where(amax == 0, torch.full_like(byte, 127), byte)
    byte = torch.where(exp == 255, torch.full_like(byte, 255), byte)
    recip = ((254 - byte) << 23).view(torch.float32)
    recip = torch.where(byte == 255, torch.full_like(recip, float("nan")), recip)
    return byte.to(torch.uint8), recip


def fp32_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) of fp32 block maxima: min(448 / amax, fp32 max) and 1 / scale, each one
    correctly rounded fp32 division; amax 0 -> 1, non-finite -> NaN."""
    scale = (torch.full_like(amax, FP8_MAX) / amax).clamp(max=_FLOAT32_MAX)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale = torch.where(torch.isinf(amax), torch.full_like(scale, float("nan")), scale)
    return scale, torch.ones_like(scale) / scale


def quantize_block(recipe: Recipe, x32: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 data, stored scales) of x32 under the scales of `amax` (broadcast against x32): E8M0 for
    mxfp8, fp32 scale_inv otherwise."""
    if recipe.scale_dtype == torch.float32:
        scale, scale_inv = fp32_scales(amax)
        return (x32 * scale).to(FP8_DTYPE), scale_inv
    byte, recip = e8m0_scales(amax)
    return (x32 * recip).to(FP8_DTYPE), byte.view(E8M0_DTYPE)


def stored_scales(recipe: Recipe, amax: torch.Tensor) -> torch.Tensor:
    """The stored scales of block maxima amax (E8M0 or fp32 scale_inv)."""
    if recipe.scale_dtype == torch.float32:
        return fp32_scales(amax)[1]
    return e8m0_scales(amax)[0].view(E8M0_DTYPE)


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return torch.nn.functional.pad(t, pad)


def _rowwise_blocks(recipe: Recipe, x32: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise 1 x block quantization of x32 (..., K) (block None: whole rows)."""
    cols = x32.shape[-1]
    if block is None:
        amax = abs_for_amax(x32).amax(-1, keepdim=True) if cols else x32.new_zeros(*x32.shape[:-1], 1)
        return quantize_block(recipe, x32, amax)
    padded = _pad_to(x32, x32.dim() - 1, block)
    blocks = padded.view(*padded.shape[:-1], -1, block)
    amax = abs_for_amax(blocks).amax(-1, keepdim=True) if blocks.numel() else blocks.new_zeros(blocks.shape[:-1] + (1,))
    data, scale = quantize_block(recipe, blocks, amax)
    return data.view(padded.shape)[..., :cols], scale.squeeze(-1)


def _weight_tiles(recipe: Recipe, w32: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Square tile x tile blocks of each member of an (N, R, C) weight."""
    n, r, c = w32.shape
    padded = _pad_to(_pad_to(w32, 1, tile), 2, tile)
    blocks = padded.view(n, padded.shape[1] // tile, tile, padded.shape[2] // tile, tile)
    if blocks.numel():
        amax = abs_for_amax(blocks).amax(dim=(2, 4), keepdim=True)
    else:
        amax = blocks.new_zeros(n, blocks.shape[1], 1, blocks.shape[3], 1)
    data, scale = quantize_block(recipe, blocks, amax)
    return data.view(padded.shape)[:, :r, :c], scale[:, :, 0, :, 0]


def _weight_columns(recipe: Recipe, w32: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Columnwise block x 1 quantization of each member of an (N, R, C) weight (None: whole members)."""
    if block is None:
        amax = abs_for_amax(w32).amax(1, keepdim=True) if w32.shape[1] else w32.new_zeros(w32.shape[0], 1, w32.shape[2])
        return quantize_block(recipe, w32, amax)
    n, r, c = w32.shape
    padded = _pad_to(w32, 1, block)
    blocks = padded.view(n, -1, block, c)
    amax = abs_for_amax(blocks).amax(2, keepdim=True) if blocks.numel() else blocks.new_zeros(n, blocks.shape[1], 1, c)
    data, scale = quantize_block(recipe, blocks, amax)
    return data.view(padded.shape)[:, :r], scale.squeeze(2)


def _row_columns(
    recipe: Recipe, x32: torch.Tensor, offs: torch.Tensor, slot_offs: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Columnwise quantization of rows x32 (M, K) in groups `offs`: per column of each block of
    block_rows rows of a group (slots from `slot_offs`), or of each whole group (slot = group; the
    padding rows' slot N is dropped). Maxima by scatter_reduce (order-free, so deterministic)."""
    rows, cols = x32.shape
    slots = column_slots(offs, slot_offs, rows, recipe.block_rows)
    total = num_slots + 1 if recipe.block_rows is None else num_slots
    amax = x32.new_zeros(total, cols)
    if rows and cols:
        amax.scatter_reduce_(0, slots[:, None].expand(rows, cols), abs_for_amax(x32), "amax", include_self=True)
    data, _ = quantize_block(recipe, x32, amax.index_select(0, slots))
    return data, stored_scales(recipe, amax)[:num_slots]


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as an integer tensor of its element size (where() keeps them bit for bit)."""
    return t.view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def _write(dst: torch.Tensor | None, new: torch.Tensor, skip: torch.Tensor | None) -> None:
    """dst = new, or dst unchanged where the noop flag `skip` (a 0-d bool tensor) is set; no host read."""
    if dst is None:
        return
    if skip is None:
        dst.copy_(new)
    else:
        _as_bits(dst).copy_(torch.where(skip, _as_bits(dst), _as_bits(new.contiguous())))


def group_quantize_into(
    recipe: str,
    x: torch.Tensor,
    offs: torch.Tensor,
    slot_offs: torch.Tensor,
    noop: torch.Tensor | None,
    row_data: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    col_data: torch.Tensor | None,
    col_scale: torch.Tensor | None,
) -> None:
    """Quantize x into the given storage (allocated by `moekit.ops.quantize.group_quantize` in the shapes
    of `moekit.grouped_tensor`). x: (M, K) rows whose groups are `offs` (N+1,), rows past offs[N] padding
    (data 0, scale 1), columnwise scale slots from `slot_offs` (N+1,); or an (N, R, C) weight. noop: a
    float32 scalar; 1.0 leaves every output unchanged. Every argument on x's device; nothing is read
    by the host."""
    info = recipe_named(recipe)
    skip = None if noop is None else noop.reshape(()) == 1.0
    x32 = x.to(torch.float32)
    if x.dim() == 3:
        if row_data is not None:
            if info.weight_tile is not None:
                data, scale = _weight_tiles(info, x32, info.weight_tile)
            else:
                data, scale = _rowwise_blocks(info, x32, info.block_cols)
            _write(row_data, data, skip)
            _write(row_scale, scale, skip)
        if col_data is not None:
            data, scale = _weight_columns(info, x32, info.block_rows)
            _write(col_data, data, skip)
            _write(col_scale, scale, skip)
        return
    rows = x32.shape[0]
    live = torch.arange(rows, device=x.device) < offs[-1]
    x32 = torch.where(live[:, None], x32, x32.new_zeros(()))  # padding rows quantize as zeros
    if row_data is not None:
        data, scale = _rowwise_blocks(info, x32, info.block_cols)
        _write(row_data, data, skip)
        _write(row_scale, scale, skip)
    if col_data is not None:
        data, scale = _row_columns(info, x32, offs, slot_offs, col_scale.shape[0])
        _write(col_data, data, skip)
        _write(col_scale, scale, skip)
