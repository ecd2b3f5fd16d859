"""Grouped FP8 quantization: `group_quantize` / `group_dequantize`, their plain-PyTorch reference
(`group_quantize_reference`), and the quantized weights a layer keeps across calls
(`QuantizedWeightCache`).

Legend: N groups (experts), M rows (tokens x top-k, sorted by group), X columns (a linear's in
features); an (N, O, I) weight's members are (O, I) (out, in).

`group_quantize(x, m_splits, recipe)` quantizes x (M, X) whose rows are sorted into N groups
(`m_splits` as `grouped_linear` takes them: a list, a CPU tensor or a device tensor that the host never
reads), or an (N, O, I) weight with `m_splits=None`, into a quantized `moekit.GroupedTensor`, in one
launch for every group. The formats (`moekit.grouped_tensor.RECIPES`):

    recipe       rowwise blocks               columnwise blocks               scales
    mxfp8        1 x 32 along X               32 x 1 along M, per group       E8M0 (a power of two)
    fp8_block    1 x 128; weights 128 x 128   128 x 1 along M, per group      float32
    fp8_rowwise  one per row (output channel) one per column of each group    float32

A weight's members are its groups (columnwise blocks run along O, per member); fp8_block's weight tiles
serve both orientations, so an fp8_block weight has no columnwise form. Columnwise blocks restart at
every group's first row, so no block holds two groups' rows; a last partial block is a block.

The rules (decided here where the formats leave a choice; `moekit.ops.kernels.quantize` is the same):
- data = E4M3(x * s) rounded to nearest even, s the block's quantization multiplier; `scale_inv` (what
  is stored, TransformerEngine's name) is the dequantization multiplier: x ~= data * scale_inv.
- mxfp8: scale_inv = the smallest power of two >= amax / 448 (so nothing saturates), s = 1 / scale_inv
  exactly; amax 0 -> 1.0 (byte 127).
- fp8_block, fp8_rowwise: s = min(448 / amax, float32 max), scale_inv = 1 / s, each a correctly rounded
  float32 division (TransformerEngine's order); amax 0 -> s = scale_inv = 1. |x * s| can pass 448 by a
  rounding only, which rounds to 448: nothing saturates.
- The arithmetic is float32 whatever x's dtype: float16 and bfloat16 widen exactly, float64 is rounded
  to float32 first. Integer, boolean, complex and float8 inputs are refused.
- A block holding an inf or a NaN gets a NaN scale (E8M0 byte 255) and NaN data: nothing non-finite is
  quantized into finite values silently.
- Rows past sum(m_splits) are padding: their data is 0 and their scales 1 (scale slots past the groups'
  blocks, in the columnwise scales' upper bound of ceil(M / 32 or 128) + N slots, hold 1 too).
- torch's float8_e4m3fn conversion rounds to nearest even and saturates to +-448 (inf included); the
  kernels encode by integer arithmetic to exactly those bytes. With the rules above only inputs that
  are not finite reach the saturation, as NaN.

`out=` rewrites an existing GroupedTensor of the same recipe, shape, dtype, device and forms in place:
every tensor it holds keeps its address (the first dims and offsets too), so a captured CUDA graph can
re-quantize into it on replay. `noop_flag` (a float32 scalar tensor on x's device) equal to 1.0 leaves
`out` byte for byte as it was, read on the device (the kernels read it; the torch path selects with
torch.where): no host sync either way. Quantizing the whole group gives the same bytes as quantizing
each member alone. Quantization is not differentiable: the quantized compute paths (`quantization=` of
`grouped_linear`, `grouped_mlp`, `moe_experts` and the modules) differentiate straight through it.

Backends (`backend=`, as the GEMMs'): "loop" and "torch" quantize in plain torch
(`moekit.ops.runtime.quantize_torch`), "triton" with moekit's kernels (CUDA, or the CPU under
TRITON_INTERPRET=1), "auto" the first of the GEMMs' order that can (moekit's kernels on Hopper, plain
torch elsewhere); every one writes the same bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

import torch

from moekit.grouped_tensor import (
    FP8_DTYPE,
    FP8_MAX,
    RECIPES,
    GroupedTensor,
    Recipe,
    columnwise_defined,
    columnwise_scale_shape,
    recipe_named,
    rowwise_scale_shape,
)
from moekit.ops import library
from moekit.ops.runtime.backends import select_quantizer
from moekit.ops.runtime.quantize_torch import segment_pitch, transposed_source
from moekit.ops.splits import GroupOffsets, MSplits, resolve_splits
from moekit.validation import check_bool, check_choice, check_compute_dtype, check_tensor

__all__ = [
    "QUANTIZATIONS",
    "RECIPES",
    "QuantizedWeightCache",
    "SegmentedColumns",
    "TRANSPOSED_RECIPES",
    "TransposedWeight",
    "check_quantization",
    "dequantize_with",
    "group_dequantize",
    "group_quantize",
    "group_quantize_for_wgrad",
    "group_quantize_reference",
    "group_quantize_transposed",
    "transposed_weight",
]

# The values of the compute paths' `quantization=` argument.
QUANTIZATIONS: tuple[str | None, ...] = (None, *RECIPES)


def check_quantization(quantization: object) -> str | None:
    """None or a recipe name; one line naming the choices otherwise."""
    if quantization is None:
        return None
    return check_choice("quantization", quantization, tuple(RECIPES))


# --------------------------------------------------------------------------------------------------
# Layout: groups, slots, storage
# --------------------------------------------------------------------------------------------------


def _num_groups(m_splits: MSplits | GroupOffsets) -> int:
    if isinstance(m_splits, GroupOffsets):
        return m_splits.num_groups
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1:
            raise ValueError(f"m_splits must be 1-D with one entry per group, got shape {tuple(m_splits.shape)}")
        return int(m_splits.shape[0])
    if isinstance(m_splits, (list, tuple)):
        return len(m_splits)
    raise TypeError(
        "m_splits must be a list/tuple of ints, a CPU integer tensor or an integer tensor on the input's "
        f"device (or None for an (N, rows, cols) weight); got {type(m_splits).__name__}"
    )


def _layout(x: torch.Tensor, m_splits: MSplits | GroupOffsets | None, rows: int | None = None) -> GroupOffsets:
    """The groups of x's rows: m_splits for (M, X) rows (M = `rows` where they are gathered from x by an
    index, else x's), the members of an (N, O, I) weight for None."""
    if m_splits is None:
        if x.dim() != 3:
            raise ValueError(
                f"m_splits=None quantizes an (N, rows, cols) weight, but x has shape {tuple(x.shape)}; pass "
                "m_splits for (rows, cols) inputs"
            )
        num, rows = x.shape[0], x.shape[1]
        if num == 0:
            raise ValueError("the weight has no members (N = 0); group_quantize needs at least one")
        return _equal_groups(num, rows, x.device)
    if x.dim() != 2:
        raise ValueError(
            f"x must be 2-D (rows, cols) with m_splits, or an (N, rows, cols) weight with m_splits=None; got "
            f"shape {tuple(x.shape)}"
        )
    num = _num_groups(m_splits)
    if num == 0:
        raise ValueError("m_splits has no groups; group_quantize needs at least one")
    return resolve_splits(m_splits, num, x.shape[0] if rows is None else rows, x.device)


def _equal_groups(num: int, rows: int, device: torch.device) -> GroupOffsets:
    """`num` groups of `rows` rows each, the offsets on the device and the host."""
    host = tuple(i * rows for i in range(num + 1))
    if rows:  # one launch (arange's step), not arange then a product
        offs = torch.arange(0, (num + 1) * rows, rows, dtype=torch.int64, device=device)
    else:
        offs = torch.zeros(num + 1, dtype=torch.int64, device=device)
    return GroupOffsets(offs=offs, host=host, rows=num * rows)


def _slot_offsets(info: Recipe, x: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
    """(N+1,) int64 on the device: each group's first columnwise scale slot (blocks of block_rows rows;
    one slot per whole group), from the offsets on the device."""
    num = offs.num_groups
    block = info.block_rows
    if x.dim() == 3 or block is None:
        per = 1 if block is None else -(-x.shape[1] // block)
        if per == 0:
            return torch.zeros(num + 1, dtype=torch.int64, device=x.device)
        return torch.arange(0, (num + 1) * per, per, dtype=torch.int64, device=x.device)
    if offs.host is not None:
        counts = [hi - lo for lo, hi in pairwise(offs.host)]
        firsts = [0]
        for c in counts:
            firsts.append(firsts[-1] + -(-c // block))
        return torch.tensor(firsts, dtype=torch.int64).to(x.device, non_blocking=True)
    blocks = torch.div(offs.offs[1:] - offs.offs[:-1] + (block - 1), block, rounding_mode="floor")
    slots = torch.zeros(num + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(blocks, 0, out=slots[1:])
    return slots


def _host_dims(offs: GroupOffsets) -> tuple[int, ...] | None:
    return None if offs.host is None else tuple(hi - lo for lo, hi in pairwise(offs.host))


def _storage_specs(
    info: Recipe, shape: tuple[int, ...], num: int, rowwise: bool, columnwise: bool
) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
    """(shape, dtype) of each storage tensor of a quantization of `shape` in `num` groups (None: not asked)."""
    specs: dict[str, tuple[tuple[int, ...], torch.dtype] | None] = dict.fromkeys(
        ("row_data", "row_scale", "col_data", "col_scale")
    )
    if rowwise:
        specs["row_data"] = (shape, FP8_DTYPE)
        specs["row_scale"] = (rowwise_scale_shape(info, shape), info.scale_dtype)
    if columnwise:
        specs["col_data"] = (shape, FP8_DTYPE)
        specs["col_scale"] = (columnwise_scale_shape(info, shape, num), info.scale_dtype)
    return specs


def _allocate(
    info: Recipe, shape: tuple[int, ...], device: torch.device, num: int, rowwise: bool, columnwise: bool
) -> dict[str, torch.Tensor | None]:
    specs = _storage_specs(info, shape, num, rowwise, columnwise)
    return {
        name: None if spec is None else torch.empty(spec[0], dtype=spec[1], device=device)
        for name, spec in specs.items()
    }


def _check_out(out: object, info: Recipe, x: torch.Tensor, num: int, rowwise: bool, columnwise: bool) -> GroupedTensor:
    """`out` as group_quantize rewrites it; one line naming the first mismatch otherwise."""
    if not isinstance(out, GroupedTensor) or not out.is_quantized:
        raise TypeError(f"out must be a quantized GroupedTensor (from group_quantize), got {type(out).__name__}")
    forms = lambda r, c: "+".join(f for f, on in (("rowwise", r), ("columnwise", c)) if on)  # noqa: E731
    checks = (
        ("recipe", out.recipe, info.name),
        ("shape", tuple(out.shape), tuple(x.shape)),
        ("dtype", out.dtype, x.dtype),
        ("device", out.device, x.device),
        ("number of groups", out.num_tensors, num),
        (
            "forms",
            forms(out.rowwise_data is not None, out.columnwise_data is not None),
            forms(rowwise, columnwise),
        ),
    )
    for what, have, want in checks:
        if have != want:
            raise ValueError(f"out does not match this quantization: its {what} is {have}, asked {want}")
    expected = _storage_specs(info, tuple(x.shape), num, rowwise, columnwise)
    stored = {
        "row_data": out.rowwise_data,
        "row_scale": out.rowwise_scale_inv,
        "col_data": out.columnwise_data,
        "col_scale": out.columnwise_scale_inv,
    }
    for name, spec in expected.items():
        tensor = stored[name]
        if spec is None or tensor is None:
            continue
        if tuple(tensor.shape) != spec[0] or tensor.dtype != spec[1] or not tensor.is_contiguous():
            raise ValueError(
                f"out's {name} is {tensor.dtype} {tuple(tensor.shape)}; {info.name} needs a contiguous {spec[1]} "
                f"{spec[0]}"
            )
    return out


def _check_noop(noop_flag: object, x: torch.Tensor, out: GroupedTensor | None) -> torch.Tensor | None:
    if noop_flag is None:
        return None
    noop_flag = check_tensor("noop_flag", noop_flag)
    if noop_flag.dtype != torch.float32 or noop_flag.numel() != 1 or noop_flag.dim() > 1:
        raise ValueError(
            f"noop_flag must be a float32 scalar tensor (shape () or (1,)), got {noop_flag.dtype} of shape "
            f"{tuple(noop_flag.shape)}"
        )
    if noop_flag.device != x.device:
        raise ValueError(f"noop_flag is on {noop_flag.device} but x is on {x.device}; pass it on x's device")
    if out is None:
        raise ValueError("noop_flag leaves out= unchanged when it is 1.0; it needs out=")
    return noop_flag


def _update(dst: torch.Tensor, new: torch.Tensor, noop: torch.Tensor | None) -> None:
    """dst = new in place (dst unchanged where noop reads 1.0); no host read."""
    if noop is None:
        dst.copy_(new)
    else:
        dst.copy_(torch.where(noop.reshape(()) == 1.0, dst, new))


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def _quantize_into(
    backend: str,
    info: Recipe,
    x: torch.Tensor,
    offs: GroupOffsets,
    slot_offs: torch.Tensor,
    noop: torch.Tensor | None,
    storage: dict[str, torch.Tensor | None],
    segments: bool,
    index: torch.Tensor | None = None,
    transposed: TransposedWeight | None = None,
) -> None:
    """The one launch of `group_quantize` and `group_quantize_for_wgrad`: x (made contiguous, as the
    kernels read it) into the storage's forms (`_allocate`'s keys), the columnwise data in the FP8
    wgrad's layout where `segments`, the rows x[index] where an index is given, a weight's transposed
    copy into `transposed` where given."""
    x_in = x.detach()
    x_in = x_in.contiguous() if x_in.numel() else x_in.clone(memory_format=torch.contiguous_format)
    library.group_quantize_into(
        backend,
        info.name,
        x_in,
        offs.offs,
        slot_offs,
        noop,
        storage["row_data"],
        storage["row_scale"],
        storage["col_data"],
        storage["col_scale"],
        segments,
        index,
        None if transposed is None else transposed.data,
        None if transposed is None else transposed.scale_inv,
    )


def group_quantize(
    x: torch.Tensor,
    m_splits: MSplits | GroupOffsets | None,
    recipe: str,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    out: GroupedTensor | None = None,
    noop_flag: torch.Tensor | None = None,
    backend: str = "auto",
) -> GroupedTensor:
    """Quantize x into a GroupedTensor (module docstring for the formats and rules).

    x: (M, X) rows sorted by group with `m_splits` (N,) rows per group (list, CPU tensor or device
    tensor, never read by the host; rows past the sum are padding), or an (N, O, I) weight with
    m_splits=None. recipe: "mxfp8", "fp8_block" or "fp8_rowwise". rowwise / columnwise: the forms to
    compute (both from x itself). out: a GroupedTensor from an earlier call with the same recipe, shape,
    dtype, device, number of groups and forms, rewritten in place (every address kept) and returned.
    noop_flag: a float32 scalar on x's device; 1.0 leaves `out` unchanged (needs out). backend: "auto",
    "loop", "torch" or "triton" (the same bytes). Not differentiable.
    """
    return _group_quantize(x, m_splits, recipe, rowwise, columnwise, out, noop_flag, backend)


def _group_quantize(
    x: torch.Tensor,
    m_splits: MSplits | GroupOffsets | None,
    recipe: str,
    rowwise: bool,
    columnwise: bool,
    out: GroupedTensor | None,
    noop_flag: torch.Tensor | None,
    backend: str,
    transposed: TransposedWeight | None = None,
) -> GroupedTensor:
    """`group_quantize`, and with `transposed` (an (N, O, I) weight of TRANSPOSED_RECIPES, storage from
    `transposed_weight` of the same shapes) the quantization's TransposedWeight written into it by the
    same call (fp8_block: by the kernel that quantizes the tiles, from the bytes it holds; the FP8
    weight is not read again)."""
    check_choice("recipe", recipe, tuple(RECIPES))
    info = recipe_named(recipe)
    check_tensor("x", x)
    check_compute_dtype("x", x.dtype)
    rowwise, columnwise = check_bool("rowwise", rowwise), check_bool("columnwise", columnwise)
    if not (rowwise or columnwise):
        raise ValueError("group_quantize needs rowwise=True or columnwise=True (or both); both are False")
    offs = _layout(x, m_splits)
    weight = x.dim() == 3
    if columnwise and not columnwise_defined(info, weight):
        raise ValueError(
            f"{info.name} has no columnwise form for an (N, rows, cols) weight: its {info.weight_tile} x "
            f"{info.weight_tile} blocks serve both orientations; ask rowwise only"
        )
    num = offs.num_groups
    if out is not None:
        out = _check_out(out, info, x, num, rowwise, columnwise)
    noop = _check_noop(noop_flag, x, out)
    impl = select_quantizer(backend, x)
    # The slots are the columnwise form's (and a weight's blocks'); rowwise rows need none, and their
    # device computation is five small launches, so offs stands in for them there (never read).
    slot_offs = _slot_offsets(info, x, offs) if columnwise or weight else offs.offs
    if out is None:
        storage = _allocate(info, tuple(x.shape), x.device, num, rowwise, columnwise)
    else:
        storage = {
            "row_data": out.rowwise_data,
            "row_scale": out.rowwise_scale_inv,
            "col_data": out.columnwise_data,
            "col_scale": out.columnwise_scale_inv,
        }
    if transposed is not None:
        _check_transposed(transposed, info, x)
    _quantize_into(impl.name, info, x, offs, slot_offs, noop, storage, False, transposed=transposed)
    if transposed is not None and not torch.compiler.is_compiling():
        for written in transposed:  # rewritten in place by a kernel (as `transposed_weight(out=)` says why)
            torch.autograd.graph.increment_version(written)
    first_dims = offs.offs[1:] - offs.offs[:-1]
    col_offs = slot_offs if columnwise else None
    if out is None:
        return GroupedTensor.quantized(
            info.name,
            x.dtype,
            x.shape,
            first_dims,
            offs.offs,
            host_first_dims=_host_dims(offs),
            rowwise_data=storage["row_data"],
            rowwise_scale_inv=storage["row_scale"],
            columnwise_data=storage["col_data"],
            columnwise_scale_inv=storage["col_scale"],
            columnwise_scale_offsets=col_offs,
        )
    # The bookkeeping in place too (every address kept), under the same noop flag.
    _update(out.first_dims, first_dims, noop)
    _update(out.offsets, offs.offs, noop)
    if col_offs is not None and out.columnwise_scale_offsets is not None:
        _update(out.columnwise_scale_offsets, col_offs, noop)
    new_host = _host_dims(offs)
    if noop is not None and new_host != out.known_host_first_dims:
        new_host = None  # which of the two holds is on the device
    out.set_known_host_first_dims(new_host)
    if not torch.compiler.is_compiling():
        # A kernel's writes do not count as in-place ops for autograd: say so, so that a backward that
        # saved this storage before the rewrite refuses to run on it.
        for t in out.storage():
            if t is not None:
                torch.autograd.graph.increment_version(t)
    return out


def _check_transposed(transposed: TransposedWeight, info: Recipe, x: torch.Tensor) -> None:
    """`transposed` as `_group_quantize` writes it: the copy of an (N, O, I) weight x of TRANSPOSED_RECIPES
    (`group_quantize_transposed` checked both), in the transposed shapes, contiguous on x's device."""
    want = _transposed_shapes(info, tuple(x.shape))
    have = (tuple(transposed.data.shape), tuple(transposed.scale_inv.shape))
    if have != want or not all(t.is_contiguous() and t.device == x.device for t in transposed):
        raise ValueError(f"the transposed copy holds {have}; this weight's is {want}, contiguous on {x.device}")


def group_quantize_gated(
    h_M2F: torch.Tensor,
    offs: GroupOffsets,
    recipe: str,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    gate_limit: float,
    up_limit: float,
) -> tuple[GroupedTensor, GroupedTensor]:
    """(a_q, h_q): `group_quantize(a, offs, recipe)` of a = the gated activation of h (* probs) in h's
    dtype, and `group_quantize(held_h, offs, recipe)` of h's held form (clamps gate_limit / up_limit, 0
    for none), both rowwise, the same bytes, from one read of h by moekit's gated kernel (neither a nor
    the held form is written in h's dtype). For the quantized MLP's forward, on checked arguments, where
    `gated_quantize_unavailable_reason` found the recipe and GLU layout within the kernel's reach."""
    info = recipe_named(recipe)
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    a_data, a_scale, h_data, h_scale = gated_forms_storage(info.name, rows, ffn, h_M2F.device, offs.num_groups)
    library.gated_quantize_into(
        h_M2F, probs_M, offs.offs, glu_block, activation, recipe, gate_limit, up_limit, a_data, a_scale, h_data, h_scale
    )
    first_dims = offs.offs[1:] - offs.offs[:-1]
    return (
        rowwise_grouped(info.name, h_M2F.dtype, offs, first_dims, a_data, a_scale),
        rowwise_grouped(info.name, h_M2F.dtype, offs, first_dims, h_data, h_scale),
    )


def gated_forms_storage(
    recipe: str, rows: int, ffn: int, device: torch.device, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a_data, a_scale, h_data, h_scale): fresh storage of the rowwise forms of an activation (rows, ffn)
    and of h (rows, 2 * ffn), as `group_quantize` allocates them; what the quantized MLP's fc1 fills in
    its forward (`group_quantize_gated`, or fc1's GEMM with the gated epilogue)."""
    info = recipe_named(recipe)
    a_store = _allocate(info, (rows, ffn), device, num_groups, True, False)
    h_store = _allocate(info, (rows, 2 * ffn), device, num_groups, True, False)
    a_data, a_scale = a_store["row_data"], a_store["row_scale"]
    h_data, h_scale = h_store["row_data"], h_store["row_scale"]
    assert a_data is not None and a_scale is not None and h_data is not None and h_scale is not None  # rowwise
    return a_data, a_scale, h_data, h_scale


def rowwise_grouped(
    recipe: str,
    dtype: torch.dtype,
    offs: GroupOffsets,
    first_dims: torch.Tensor,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
) -> GroupedTensor:
    """The rowwise-only GroupedTensor of `recipe` over existing FP8 data (M, X) and its scales, grouped by
    `offs` (first_dims: its device tensor's differences, made once by the caller for the tensors it
    builds; the host copy's where it has one): how the quantized MLP's nodes hand
    `group_quantize_gated`'s forms from one node to the other."""
    return GroupedTensor.quantized(
        recipe,
        dtype,
        tuple(data.shape),
        first_dims,
        offs.offs,
        host_first_dims=_host_dims(offs),
        rowwise_data=data,
        rowwise_scale_inv=scale_inv,
    )


def group_quantize_gathered(
    x_TX: torch.Tensor,
    index_M1: torch.Tensor,
    offs: GroupOffsets,
    recipe: str,
    backend: str,
    use_triton: bool,
) -> GroupedTensor:
    """The rowwise quantization of the gathered rows x[index] (M, X), grouped by `offs`, made from x's own
    T rows: one quantization of x (T rows, one group) and a gather of its FP8 bytes and scales. A rowwise
    scale block never leaves its row and a row's bytes do not depend on its group, so these are
    `group_quantize(x[index], offs, recipe)`'s bytes wherever every gathered row lies in a group (no
    padding rows: `moe_experts`' routes, where offs[-1] = M). Why: the gathered rows are K times x's; this
    reads x's bf16 once and moves 1-byte data where the gather-then-quantize order moves 2-byte rows twice
    (the gather's write, the quantizer's read). index_M1: (M, 1) integer rows of x; use_triton: the row
    kernel moves the bytes (`moekit.ops.runtime.backends.use_triton_rows`). On checked arguments."""
    x_q = group_quantize(x_TX, _equal_groups(1, x_TX.shape[0], x_TX.device), recipe, backend=backend)
    assert x_q.rowwise_data is not None and x_q.rowwise_scale_inv is not None  # rowwise
    data = _gather_bytes(x_q.rowwise_data, index_M1, use_triton)
    scale = _gather_bytes(x_q.rowwise_scale_inv, index_M1, use_triton)
    return rowwise_grouped(recipe, x_TX.dtype, offs, offs.offs[1:] - offs.offs[:-1], data, scale)


def _check_index(index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """index as the kernels take it: (M,) contiguous integers on x's device (from (M,) or (M, 1));
    one line naming what is wrong otherwise (its values are not read: no host sync)."""
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index must be an int32 or int64 tensor of x's rows, got {getattr(index, 'dtype', index)}")
    if index.device != x.device:
        raise ValueError(f"index must be on x's device {x.device}, got {index.device}")
    if index.dim() == 2 and index.shape[1] == 1:
        index = index.reshape(-1)
    if index.dim() != 1:
        raise ValueError(f"index must be (M,) or (M, 1) rows of x, got shape {tuple(index.shape)}")
    return index.contiguous()


def _gather_bytes(t: torch.Tensor, index_M1: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """t[index] for a contiguous 2-D t of any dtype, bit for bit: its rows moved as the widest integer
    words their byte count allows (the row kernel copies integers as they are)."""
    row_bytes = t.shape[1] * t.element_size()
    word = next(w for w in (torch.int32, torch.int16, torch.uint8) if row_bytes % w.itemsize == 0)
    words = t.view(torch.uint8).view(word)
    moved = library.gather_sum_rows(words, index_M1, None, use_triton)
    return moved.view(torch.uint8).view(t.dtype)


class SegmentedColumns(NamedTuple):
    """The columnwise quantization of (M, X) rows in N groups, its data in the FP8 wgrad's operand
    layout rather than (M, X) rows: the form `group_quantize_for_wgrad` gives the FP8 wgrad
    (`moekit.ops.runtime.quantized_gemm.quantized_gemm_wgrad(segmented_rows=rows)`).

    data: (X, pitch) float8, pitch = `segment_pitch(M, N)` (the smallest multiple of 128 >= M + 127 N),
    data[:, starts[g] + j] = the columnwise byte of row offs[g] + j, starts[g] the sum of the earlier
    groups' row counts each rounded up to 128 (`SEGMENT_COLUMNS`: whole cache lines for the writers at
    any split), zeros to each segment's end, columns past the last segment unspecified. scale_inv: the
    columnwise scales exactly as `GroupedTensor.columnwise_scale_inv`. rows: M.

    Why a form beside GroupedTensor and not inside it: a GroupedTensor's columnwise data is (M, X) for
    its users (dequantize, split, members), and this layout serves one consumer, the wgrad, which
    reads it only where its kernels run; kept apart, nothing else has to refuse or translate it."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    rows: int


def _segments_storage(
    info: Recipe, shape: tuple[int, int], num: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (data, scale_inv) of the columnwise form of (M, X) rows in `num` groups in the FP8 wgrad's
    segments (`SegmentedColumns`): data (X, segment_pitch(M, N)), the scales as a GroupedTensor's."""
    rows, cols = shape
    data = torch.empty((cols, segment_pitch(rows, num)), dtype=FP8_DTYPE, device=device)
    return data, torch.empty(columnwise_scale_shape(info, shape, num), dtype=info.scale_dtype, device=device)


def group_quantize_for_wgrad(
    x: torch.Tensor,
    m_splits: MSplits | GroupOffsets,
    recipe: str,
    *,
    rowwise: bool = False,
    columnwise: bool = True,
    segments: bool = True,
    index: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[GroupedTensor | None, GroupedTensor | SegmentedColumns | None]:
    """x's quantization for a quantized linear's backward: (its rowwise form as a GroupedTensor, or None
    without `rowwise`; its columnwise form, the wgrad's operand, or None without `columnwise`), in one
    launch as `group_quantize`. The two switches are the backward's needs (the dgrad reads the rowwise
    form, the wgrad the columnwise one), so every backward asks in one call whatever it needs.

    segments (where the FP8 wgrad runs: `fp8_wgrad_compute`): the columnwise form as `SegmentedColumns`,
    its data written by the quantization straight into the wgrad's operand layout, so that the wgrad
    does not transpose it again (one read and one write of the FP8 data saved per operand); the
    bytes are `segment_transpose` of `group_quantize`'s columnwise data on every column in use, the
    scales the same. Otherwise (the reference path, which dequantizes it) one GroupedTensor with both
    forms, given twice. x: (M, X) rows with m_splits as `group_quantize`'s; no out= or noop flag (a
    backward's operands are fresh). index: (M,) or (M, 1) integer rows of x (every entry a row of x):
    the rows quantized are x[index], and x is the (T, X) rows they are gathered from. With segments
    the kernels read each row where it lies in x, so the gathered rows are never written in x's dtype
    (the backward's routed operands: one write and one read of (M, X) saved); otherwise they are
    gathered first. Internal to moekit's quantized compute; no host reads."""
    if not (rowwise or columnwise):
        raise ValueError("group_quantize_for_wgrad needs rowwise or columnwise (or both), got neither")
    if index is not None:
        index = _check_index(index, x)
        if not (columnwise and segments):
            x, index = x.index_select(0, index), None
    if not columnwise:
        return group_quantize(x, m_splits, recipe, backend=backend), None
    if not segments:
        both = group_quantize(x, m_splits, recipe, rowwise=rowwise, columnwise=True, backend=backend)
        return (both if rowwise else None), both
    check_choice("recipe", recipe, tuple(RECIPES))
    info = recipe_named(recipe)
    check_tensor("x", x)
    check_compute_dtype("x", x.dtype)
    rowwise = check_bool("rowwise", rowwise)
    if x.dim() != 2:
        raise ValueError(f"x must be (rows, cols) rows in groups for the wgrad's layout, got shape {tuple(x.shape)}")
    shape = (x.shape[0] if index is None else index.shape[0], x.shape[1])  # (M, X), the rows quantized
    offs = _layout(x, m_splits, shape[0])
    num = offs.num_groups
    impl = select_quantizer(backend, x)
    slot_offs = _slot_offsets(info, x, offs)
    storage = _allocate(info, shape, x.device, num, rowwise, False)
    col_data, col_scale = _segments_storage(info, shape, num, x.device)
    storage = dict(storage, col_data=col_data, col_scale=col_scale)
    _quantize_into(impl.name, info, x, offs, slot_offs, None, storage, True, index)
    row_q = None
    if rowwise:
        row_q = GroupedTensor.quantized(
            info.name,
            x.dtype,
            shape,
            offs.offs[1:] - offs.offs[:-1],
            offs.offs,
            host_first_dims=_host_dims(offs),
            rowwise_data=storage["row_data"],
            rowwise_scale_inv=storage["row_scale"],
        )
    return row_q, SegmentedColumns(col_data, col_scale, shape[0])


def group_quantize_held_columns(
    h_q: GroupedTensor,
    offs: GroupOffsets,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    gate_limit: float,
    up_limit: float,
) -> SegmentedColumns:
    """The FP8 wgrad's columnwise operand of a = the gated activation of h (* probs) in h_q's dtype, h_q
    the rowwise quantization of h's held form (clamps gate_limit / up_limit, 0 for none): the bytes of
    `group_quantize_for_wgrad(held_gated_activation(h_q, ...), offs, recipe)[1]`, from one read of h_q's
    FP8 bytes by moekit's gated kernel, a never written in h's dtype. For the quantized MLP's backward
    (fc2's wgrad operand), on checked arguments, where `held_columns_unavailable_reason` accepts the
    recipe (mxfp8, fp8_block)."""
    data, scale, recipe = h_q.rowwise_data, h_q.rowwise_scale_inv, h_q.recipe
    assert data is not None and scale is not None and recipe is not None  # a rowwise quantization
    info = recipe_named(recipe)
    rows, ffn = data.shape[0], data.shape[1] // 2
    num = offs.num_groups
    col_data, col_scale = _segments_storage(info, (rows, ffn), num, data.device)
    slot_offs = _slot_offsets(info, data, offs)
    library.held_columns_into(
        data, scale, probs_M, offs.offs, slot_offs, glu_block, activation, recipe, h_q.dtype, gate_limit, up_limit,
        col_data, col_scale,
    )  # fmt: skip
    return SegmentedColumns(col_data, col_scale, rows)


def group_dequantize(gt: GroupedTensor, *, columnwise: bool = False, backend: str = "auto") -> torch.Tensor:
    """The quantized tensor back in its dtype and shape ((M, X) rows, or the (N, O, I) weight), data *
    scale_inv of the rowwise (or columnwise) storage: `gt.dequantize(columnwise)`'s bytes (the product in
    float32, one rounding; float64 in float64). backend: who computes it, chosen as `group_quantize`
    chooses ("auto": moekit's one-pass kernel where it runs, plain torch elsewhere; "triton" refuses a
    float64 gt, whose product the kernel does not compute). No host reads."""
    if not isinstance(gt, GroupedTensor) or not gt.is_quantized:
        raise TypeError(f"gt must be a quantized GroupedTensor (from group_quantize), got {type(gt).__name__}")
    columnwise = check_bool("columnwise", columnwise)
    # What the backends are asked about: a tensor of the result's dtype on gt's device (no storage).
    impl = select_quantizer(backend, torch.empty(0, dtype=gt.dtype, device=gt.device))
    return dequantize_with(impl.name, gt, columnwise)


def dequantize_with(backend: str, gt: GroupedTensor, columnwise: bool = False) -> torch.Tensor:
    """`group_dequantize` by a backend already resolved (its name; a quantizer that can run for gt's
    dtype and device, as `select_quantizer` returns): how the quantized compute dequantizes with the
    backend that quantized its operands."""
    if columnwise:
        data, scale, slots = gt.columnwise_data, gt.columnwise_scale_inv, gt.columnwise_scale_offsets
        if data is None or scale is None or slots is None:
            raise ValueError("dequantize(columnwise=True): this GroupedTensor has no columnwise storage")
    else:
        data, scale, slots = gt.rowwise_data, gt.rowwise_scale_inv, None
        if data is None or scale is None:
            raise ValueError("dequantize(): this GroupedTensor has no rowwise storage; use columnwise=True")
    if gt.recipe is None:
        raise TypeError("gt must be a quantized GroupedTensor (from group_quantize), not high-precision data")
    return library.group_dequantize(backend, gt.recipe, data, scale, gt.offsets, slots, columnwise, gt.dtype)


# --------------------------------------------------------------------------------------------------
# The reference: a loop over groups and blocks, reading m_splits on the host
# --------------------------------------------------------------------------------------------------


def _reference_scales(info: Recipe, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantization multiplier s (fp32), stored scale) of float32 block maxima (inf: a non-finite
    block), written from the rules: mxfp8 through frexp (amax = m 2^e, m in [0.5, 1): amax / 448 =
    (m / 0.875) 2^(e-9), so the smallest power of two >= it is 2^(e-9) for m <= 0.875, else 2^(e-8))."""
    finite = torch.isfinite(amax)
    if info.scale_dtype == torch.float32:
        largest = torch.finfo(torch.float32).max
        s = torch.where(amax > 0, (torch.full_like(amax, FP8_MAX) / amax).clamp(max=largest), 1.0)
        s = torch.where(finite, s, float("nan"))
        return s, torch.ones_like(s) / s
    mantissa, exponent = torch.frexp(amax.double())
    k = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8).clamp(-127, 127)
    k = torch.where(amax > 0, k, 0)
    s = torch.where(finite, torch.ldexp(torch.ones_like(amax, dtype=torch.float64), -k).float(), float("nan"))
    byte = torch.where(finite, k + 127, 255).to(torch.uint8)
    return s, byte.view(info.scale_dtype)


def _reference_block(info: Recipe, block: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, stored scale) of a float32 block whose maxima run over `dims`."""
    magnitude = torch.where(torch.isnan(block), float("inf"), block.abs())
    amax = magnitude.amax(dim=dims, keepdim=True) if block.numel() else block.new_zeros([1] * block.dim())
    s, stored = _reference_scales(info, amax)
    return (block * s).to(FP8_DTYPE), stored


def group_quantize_reference(
    x: torch.Tensor, m_splits: MSplits | None, recipe: str, *, rowwise: bool = True, columnwise: bool = False
) -> GroupedTensor:
    """The reference of `group_quantize` (the same arguments but out / noop / backend; the same bytes):
    a Python loop over groups and blocks, on the CPU, reading m_splits on the host."""
    info = recipe_named(recipe)
    x32 = x.detach().cpu().to(torch.float32)
    shape = tuple(x.shape)
    weight = m_splits is None
    if m_splits is None:
        counts = [shape[1]] * shape[0]
    else:
        counts = [int(c) for c in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)]
    num, cols = len(counts), shape[-1]
    rows = sum(counts) if m_splits is None else shape[0]
    rows_view = x32.reshape(rows, cols)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    specs = _storage_specs(info, shape, num, rowwise, columnwise)
    one = _reference_scales(info, torch.zeros(()))[1]

    def filled(name: str) -> torch.Tensor | None:
        """Storage as padding rows and unused slots leave it: data 0, scales 1."""
        spec = specs[name]
        if spec is None:
            return None
        t = torch.empty(spec[0], dtype=spec[1])
        if name.endswith("data"):
            t.view(torch.uint8).zero_()
        else:
            t.copy_(one.expand(t.shape))
        return t

    row_data, row_scale, col_data, col_scale = (filled(n) for n in ("row_data", "row_scale", "col_data", "col_scale"))
    if row_data is not None and row_scale is not None and cols:
        if weight and info.weight_tile is not None:
            tile = info.weight_tile
            for n in range(num):
                for i in range(0, shape[1], tile):
                    for j in range(0, cols, tile):
                        data, scale = _reference_block(info, x32[n, i : i + tile, j : j + tile], (0, 1))
                        row_data[n, i : i + tile, j : j + tile] = data
                        row_scale[n, i // tile, j // tile] = scale.reshape(())
        else:
            block_k = info.block_cols or cols
            data_rows, scale_rows = row_data.view(rows, cols), row_scale.view(rows, row_scale.shape[-1])
            for r0, r1 in pairwise(bounds):
                for j in range(0, cols, block_k):
                    data, scale = _reference_block(info, rows_view[r0:r1, j : j + block_k], (1,))
                    data_rows[r0:r1, j : j + block_k] = data
                    scale_rows[r0:r1, j // block_k] = scale.reshape(-1)
    slot_offs = None
    if col_data is not None and col_scale is not None:
        data_rows, scale_slots = col_data.view(rows, cols), col_scale.view(col_scale.numel() // max(cols, 1), cols)
        slot, firsts = 0, []
        for r0, r1 in pairwise(bounds):
            firsts.append(slot)
            # One slot per block of block_rows rows; per whole group (even an empty one) without it.
            block_m = info.block_rows or max(r1 - r0, 1)
            for i in range(r0, max(r1, r0 + 1) if info.block_rows is None else r1, block_m):
                if cols:
                    data, scale = _reference_block(info, rows_view[i : min(i + block_m, r1)], (0,))
                    data_rows[i : min(i + block_m, r1)] = data
                    scale_slots[slot] = scale.reshape(-1)
                slot += 1
        firsts.append(slot)
        slot_offs = torch.tensor(firsts, dtype=torch.int64)
    return GroupedTensor.quantized(
        info.name,
        x.dtype,
        shape,
        torch.tensor(counts, dtype=torch.int64),
        torch.tensor(bounds, dtype=torch.int64),
        host_first_dims=counts,
        rowwise_data=row_data,
        rowwise_scale_inv=row_scale,
        columnwise_data=col_data,
        columnwise_scale_inv=col_scale,
        columnwise_scale_offsets=slot_offs,
    )


# --------------------------------------------------------------------------------------------------
# Quantized weights kept across calls
# --------------------------------------------------------------------------------------------------


# Recipes whose quantized weight has a transposed FP8 copy (`transposed_weight`): those with FP8 dgrad
# kernels (`moekit.ops.runtime.quantized_gemm`).
TRANSPOSED_RECIPES = ("fp8_block", "fp8_rowwise")


class TransposedWeight(NamedTuple):
    """An (N, O, I) weight's quantization transposed to (N, I, O): the dgrad's weight operand.

    The dgrad dx[r] = dy_q[r] @ w_q[g] reduces over O; on this copy it is dx[r] = dy_q[r] @ (w_q^T)[g]^T,
    the forward's problem with a reduction-major ("K-major") weight, which is what FP8 tensor cores
    (Hopper's wgmma) take from shared memory; reading w_q (O, I) itself would transpose every tile in
    the kernel. A GroupedTensor keeps its data in its input's own layout, so the copy lives beside it.

    data: (N, I, O) float8, contiguous. scale_inv: float32, contiguous; fp8_block: (N, ceil(I / 128),
    ceil(O / 128)), the 128 x 128 tiles' scales transposed (a tile's transpose has the same amax and so
    the same scale: the copy is byte for byte the quantization of w^T); fp8_rowwise: (N, I, 1), the
    columnwise form's per-input-channel scales (one per output column of the dgrad)."""

    data: torch.Tensor
    scale_inv: torch.Tensor


def _transposed_source(w_q: GroupedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (N, O, I) data and scales that `transposed_weight` transposes."""
    if w_q.recipe not in TRANSPOSED_RECIPES:
        raise ValueError(f"a transposed weight is made for {TRANSPOSED_RECIPES}, not {w_q.recipe!r}")
    row_data, row_scale, col_data, col_scale = w_q.storage()[2:6]
    return transposed_source(w_q.recipe, row_data, row_scale, col_data, col_scale)


def transposed_weight(
    w_q: GroupedTensor, out: TransposedWeight | None = None, backend: str = "auto"
) -> TransposedWeight:
    """w_q's `TransposedWeight` (fp8_block: from its rowwise tiles; fp8_rowwise: from its columnwise
    form), fresh, or written in place into `out` (every address kept: a captured CUDA graph replays it)
    from an earlier call on a weight of the same recipe, shape and device. One read and one write of
    the FP8 weight, in one launch where moekit's kernels run (backend chosen as `group_quantize`
    chooses; every backend the same bytes); no host reads."""
    data, scale = _transposed_source(w_q)
    data_shape = (data.shape[0], data.shape[2], data.shape[1])
    scale_shape = (scale.shape[0], scale.shape[2], scale.shape[1])
    if out is None:
        out = TransposedWeight(
            torch.empty(data_shape, dtype=data.dtype, device=data.device),
            torch.empty(scale_shape, dtype=scale.dtype, device=scale.device),
        )
    elif (
        tuple(out.data.shape) != data_shape
        or tuple(out.scale_inv.shape) != scale_shape
        or out.data.device != data.device
        or out.data.dtype != data.dtype
        or out.scale_inv.dtype != scale.dtype
        or not (out.data.is_contiguous() and out.scale_inv.is_contiguous())
    ):
        raise ValueError(
            f"out holds a transposed weight of {tuple(out.data.shape)} on {out.data.device}; this one is "
            f"{data_shape} on {data.device} (contiguous, {data.dtype} with {scale.dtype} scales)"
        )
    elif not torch.compiler.is_compiling():
        # The kernel's writes are not in-place ops for autograd: a backward that saved the old copy
        # refuses to run on the new one, as with group_quantize(out=).
        torch.autograd.graph.increment_version(out.data)
        torch.autograd.graph.increment_version(out.scale_inv)
    impl = select_quantizer(backend, torch.empty(0, dtype=w_q.dtype, device=data.device))
    library.transpose_weight_into(impl.name, w_q.recipe, data.contiguous(), scale.contiguous(), out.data, out.scale_inv)
    return out


def group_quantize_transposed(
    w_NOI: torch.Tensor,
    recipe: str,
    *,
    out: GroupedTensor | None = None,
    transposed: TransposedWeight | None = None,
    noop_flag: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[GroupedTensor, TransposedWeight]:
    """`group_quantize` of an (N, O, I) weight as the FP8 layer uses it (rowwise, and columnwise where
    the recipe has a weight's columnwise form) together with its `TransposedWeight`, in one call: the
    pair `group_quantize(...)` then `transposed_weight(...)` gives, byte for byte (recipes of
    TRANSPOSED_RECIPES). out / transposed: storage from an earlier call, rewritten in place (every
    address kept); noop_flag as `group_quantize`'s (needs out, leaves both unchanged at 1.0). On moekit's
    kernels fp8_block's copy comes from the tiles kernel that quantizes the weight, from the bytes it
    holds: the FP8 weight is not read a second time."""
    check_choice("recipe", recipe, TRANSPOSED_RECIPES)
    check_tensor("w_NOI", w_NOI)
    if w_NOI.dim() != 3:
        raise ValueError(f"w_NOI must be an (N, O, I) weight, got shape {tuple(w_NOI.shape)}")
    info = recipe_named(recipe)
    if transposed is None:
        data_shape, scale_shape = _transposed_shapes(info, tuple(w_NOI.shape))
        transposed = TransposedWeight(
            torch.empty(data_shape, dtype=FP8_DTYPE, device=w_NOI.device),
            torch.empty(scale_shape, dtype=info.scale_dtype, device=w_NOI.device),
        )
    columnwise = columnwise_defined(info, True)
    w_q = _group_quantize(w_NOI, None, recipe, True, columnwise, out, noop_flag, backend, transposed=transposed)
    return w_q, transposed


def _transposed_shapes(info: Recipe, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(data, scales) shapes of the TransposedWeight of an (N, O, I) weight of `shape` in `info`'s recipe
    (fp8_block: its tiles' scales transposed; fp8_rowwise: its columnwise scales transposed)."""
    if info.weight_tile is not None:
        scale = rowwise_scale_shape(info, shape)
    else:
        scale = columnwise_scale_shape(info, shape, shape[0])
    return (shape[0], shape[2], shape[1]), (scale[0], scale[2], scale[1])


class QuantizedWeightCache:
    """The quantized form of one grouped weight, kept across calls: quantized again only when the weight
    changed, in place (`group_quantize(out=...)`: every address kept, so a captured graph sees the new
    values), else returned as it is. So a module quantizes its weights once per optimizer step.

    "Changed": another tensor object (a weakref to the weight, or to the tensor it is a view of), another
    address, shape, stride, dtype or device, or a newer version counter (`Tensor._version`, bumped by every
    in-place op: the optimizer's update, `load_state_dict`, `copy_`). All host values: no sync. Writes
    through `.data` bypass the version counter (as they bypass autograd) and are not seen. `refreshes`
    counts the quantizations made. Under torch.compile the weight is quantized at every call. While a
    CUDA stream is being captured the quantization is always captured too (in place, into the kept
    storage): a graph replays its kernels without asking the host, so a check made at capture time
    would hold the weights of that moment forever; captured, every replay quantizes the weight's values
    of that replay (after `optimizer.step()` included).

    track_versions=False quantizes at every call (in place, as above): for weights rewritten behind
    the version counter. FSDP2 is one: it all-gathers the unsharded weights anew for every forward and
    keeps their version counters unchanged, so an optimizer step on the shards is invisible here.
    `moekit.distributed.apply_fsdp` turns tracking off on every cache of the model it shards; with
    `fully_shard` directly, set it off yourself.

    `get_transposed` also keeps the quantization's `TransposedWeight` (the FP8 dgrad's operand), made
    on the first such call and from then on refreshed with the quantization, in place, under the same
    rule, by the quantization's own call (on moekit's kernels fp8_block's tiles kernel writes both from
    the bytes it holds; fp8_rowwise's copy is one more read and write of the FP8 weight).
    """

    def __init__(self, track_versions: bool = True) -> None:
        self.track_versions = track_versions
        self.quantized: GroupedTensor | None = None
        self.transposed: TransposedWeight | None = None
        self.refreshes = 0
        self._key: tuple | None = None
        self._anchors: list[weakref.ref] = []

    def __getstate__(self) -> dict:
        # A copy (copy.deepcopy, pickle) starts empty: the quantization is made again from its weight.
        return {"track_versions": self.track_versions}

    def __setstate__(self, state: dict) -> None:
        self.track_versions = state.get("track_versions", True)
        self.quantized, self.refreshes, self._key, self._anchors = None, 0, None, []
        self.transposed = None

    @staticmethod
    def _anchor(w: torch.Tensor) -> torch.Tensor:
        return w._base if w._base is not None else w

    def _fresh(self, weights: Sequence[torch.Tensor], key: tuple) -> bool:
        return (
            self._key == key
            and len(self._anchors) == len(weights)
            and all(ref() is self._anchor(w) for ref, w in zip(self._anchors, weights, strict=True))
        )

    def get(
        self, w_NOI: torch.Tensor, weights: Sequence[torch.Tensor], recipe: str, backend: str = "auto"
    ) -> GroupedTensor:
        """The quantization of w_NOI (N, O, I), the weight given as `weights` (one (N, O, I) tensor or N
        (O, I) tensors: what the version and address checks look at), rowwise and, where the recipe has
        it for weights, columnwise (the dgrad's form)."""
        columnwise = columnwise_defined(recipe_named(recipe), True)
        if torch.compiler.is_compiling():
            return group_quantize(w_NOI, None, recipe, rowwise=True, columnwise=columnwise, backend=backend)
        key = (
            recipe,
            backend,
            tuple((w._version, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device) for w in weights),
        )
        capturing = w_NOI.is_cuda and torch.cuda.is_current_stream_capturing()
        trusted = self.track_versions and not capturing
        if self.quantized is not None and self._fresh(weights, key) and trusted:
            return self.quantized
        cached = self.quantized
        kept = self._kept_transposed(w_NOI, recipe)  # written by the quantization's own call
        fits = (
            cached is not None
            and cached.recipe == recipe
            and tuple(cached.shape) == tuple(w_NOI.shape)
            and cached.dtype == w_NOI.dtype
            and cached.device == w_NOI.device
        )
        out = cached if fits else None
        if kept is not None:
            cached, _ = group_quantize_transposed(w_NOI, recipe, out=out, transposed=kept, backend=backend)
        else:
            cached = group_quantize(w_NOI, None, recipe, rowwise=True, columnwise=columnwise, out=out, backend=backend)
        self.quantized = cached
        self._key = key
        self._anchors = [weakref.ref(self._anchor(w)) for w in weights]
        self.refreshes += 1
        if kept is None:
            self._refresh_transposed(cached, backend)
        return cached

    def _kept_transposed(self, w_NOI: torch.Tensor, recipe: str) -> TransposedWeight | None:
        """The kept transposed copy where the quantization of w_NOI in `recipe` can write it in place
        (the recipe has one, same shapes and device), else None."""
        t = self.transposed
        if t is None or recipe not in TRANSPOSED_RECIPES or t.data.device != w_NOI.device:
            return None
        data_shape, scale_shape = _transposed_shapes(recipe_named(recipe), tuple(w_NOI.shape))
        return t if (tuple(t.data.shape), tuple(t.scale_inv.shape)) == (data_shape, scale_shape) else None

    def _refresh_transposed(self, cached: GroupedTensor, backend: str) -> None:
        """Bring the kept transposed copy (if any) up to `cached`: in place where it fits, anew where the
        weight's recipe, shape or device changed, dropped where the recipe has none."""
        t = self.transposed
        if t is None:
            return
        if cached.recipe not in TRANSPOSED_RECIPES:
            self.transposed = None
            return
        data, scale = _transposed_source(cached)
        fits = (
            t.data.shape == data.transpose(1, 2).shape
            and t.scale_inv.shape == scale.transpose(1, 2).shape
            and t.data.device == data.device
        )
        self.transposed = transposed_weight(cached, out=t if fits else None, backend=backend)

    def get_transposed(
        self, w_NOI: torch.Tensor, weights: Sequence[torch.Tensor], recipe: str, backend: str = "auto"
    ) -> tuple[GroupedTensor, TransposedWeight]:
        """`get`'s quantization and its `TransposedWeight` (recipes of TRANSPOSED_RECIPES), both kept and
        refreshed together (class docstring)."""
        w_q = self.get(w_NOI, weights, recipe, backend)
        if torch.compiler.is_compiling():
            return w_q, transposed_weight(w_q, backend=backend)
        if self.transposed is None:
            self.transposed = transposed_weight(w_q, backend=backend)
        return w_q, self.transposed
