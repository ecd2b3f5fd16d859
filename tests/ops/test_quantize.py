"""group_quantize / group_dequantize: the formats byte for byte against the per-group reference
(`moekit.ops.quantize.group_quantize_reference`), the Triton kernels byte for byte against the torch
path under the interpreter, out= in place with every address kept, the noop flag, a group against its
members alone, no host reads of device offsets, refusals in one line, and torch.compile.

Legend: N groups, M rows, K columns; an (N, R, C) weight."""

from __future__ import annotations

import contextlib

import pytest
import torch

import moekit
from helpers import assert_no_host_sync, rand, rel_err
from moekit.grouped_tensor import RECIPES, GroupedTensor
from moekit.ops.quantize import (
    TRANSPOSED_RECIPES,
    group_quantize_gathered,
    group_quantize_reference,
    group_quantize_transposed,
    transposed_weight,
)
from moekit.ops.runtime.backends import triton_unavailable_reason
from moekit.ops.runtime.configs import QUANTIZE_SLOTS, QUANTIZE_TILES
from moekit.ops.splits import GroupOffsets

RECIPE_NAMES = list(RECIPES)
TRITON_OK = triton_unavailable_reason(torch.device("cpu"), torch.float32) is None
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")

# (m_splits, rows, cols): members of 0 rows, sizes not multiples of 32 or 128, padding rows.
LAYOUTS = [
    pytest.param([40, 0, 97, 3], 140, 150, id="empty-middle-odd"),
    pytest.param([0, 130, 1], 131, 70, id="empty-first-130"),
    pytest.param([33, 64, 0], 100, 128, id="empty-last-padding"),
    pytest.param([0, 0], 5, 33, id="nothing-routed"),
    pytest.param([1], 1, 1, id="one-element"),
    pytest.param([3, 2], 5, 0, id="no-columns"),
]


def as_bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_same_bytes(got: GroupedTensor, want: GroupedTensor, what: str = "") -> None:
    names = ("first_dims", "offsets", "rowwise_data", "rowwise_scale_inv", "columnwise_data")
    names += ("columnwise_scale_inv", "columnwise_scale_offsets")
    assert got.recipe == want.recipe and tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype
    for name, a, b in zip(names, got.storage(), want.storage(), strict=True):
        if b is None:
            assert a is None, f"{what} {name}: stored but not asked"
            continue
        assert a is not None and a.dtype == b.dtype and a.shape == b.shape, f"{what} {name}: {a} vs {b}"
        a, b = as_bits(a.cpu()), as_bits(b.cpu())
        assert torch.equal(a, b), f"{what} {name}: {(a != b).sum()} bytes differ"


def data_with_specials(rows: int, cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Unit-variance data with a wide row, a zero row, a tiny row (subnormal results) and an inf and a
    NaN (their blocks get NaN scales)."""
    x = rand(rows, cols, seed=seed)
    if rows >= 30 and cols >= 8:
        x[3] *= 1000.0
        x[4] = 0.0
        x[5] = 1e-30 * x[5]
        x[20, 5] = float("inf")
        x[25, 7] = float("nan")
    return x.to(dtype)


# --------------------------------------------------------------------------------------------------
# The E4M3 conversion the formats rely on
# --------------------------------------------------------------------------------------------------


def test_torch_e4m3_conversion_rounds_to_nearest_even_and_saturates():
    """What the module docstring says of torch's float8_e4m3fn cast (and the kernels reproduce): ties to
    even, +-448 for anything larger (inf included), NaN kept; float64 is cast through float32 (two
    roundings), which is why group_quantize rounds float64 to float32 itself first."""
    values = torch.tensor([1.0625, 1.1875, 3 * 2.0**-10, 2.0**-10, 448.0, 464.0, 1e4, float("inf"), -500.0])
    want = [1.0, 1.25, 2.0**-8, 0.0, 448.0, 448.0, 448.0, 448.0, -448.0]
    assert values.to(torch.float8_e4m3fn).float().tolist() == want
    assert torch.isnan(torch.tensor([float("nan")]).to(torch.float8_e4m3fn).float()).all()
    just_above_tie = torch.tensor([1.0625 + 2.0**-40], dtype=torch.float64)
    assert just_above_tie.to(torch.float8_e4m3fn).item() == 1.0  # double rounding (through float32)
    assert just_above_tie.float().to(torch.float8_e4m3fn).item() == 1.0


def test_scale_rules():
    """mxfp8: the smallest power of two >= amax / 448 (amax 0 -> byte 127); fp32 recipes: scale_inv =
    1 / min(448 / amax, fp32 max), amax 0 -> 1; no element passes 448; non-finite blocks -> NaN."""
    x = torch.zeros(6, 32)
    x[0, 0], x[1, 0], x[2, 0], x[3, 0], x[4, 0] = 448.0, 449.0, 1.0, 1e-40, float("inf")
    gt = moekit.group_quantize(x, [6], "mxfp8")
    assert gt.rowwise_scale_inv.view(torch.uint8)[:, 0].tolist() == [127, 128, 119, 0, 255, 127]
    assert gt.rowwise_data[:3, 0].float().tolist() == [448.0, 224.0, 256.0]  # 449 / 2 rounds to 224
    block = moekit.group_quantize(x[:3], [3], "fp8_rowwise")
    scale_inv = block.rowwise_scale_inv[:, 0]
    assert scale_inv[0].item() == 1.0 and block.rowwise_data[:, 0].float().abs().max() == 448.0
    # Correctly rounded divisions (a scalar / tensor in torch is a reciprocal times the scalar: not that).
    amax = x[:3, 0]
    assert torch.equal(scale_inv, torch.ones_like(amax) / (torch.full_like(amax, 448.0) / amax))
    zeros = moekit.group_quantize(torch.zeros(2, 5), [2], "fp8_block", columnwise=True)
    assert zeros.rowwise_scale_inv.eq(1).all() and zeros.columnwise_scale_inv.eq(1).all()
    assert torch.isnan(gt.dequantize()[4]).all() and not torch.isnan(gt.dequantize()[:4]).any()


# --------------------------------------------------------------------------------------------------
# The formats against the reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize(("m_splits", "rows", "cols"), LAYOUTS)
def test_formats_match_the_reference(recipe, m_splits, rows, cols):
    x = data_with_specials(rows, cols, seed=rows + cols)
    got = moekit.group_quantize(x, m_splits, recipe, rowwise=True, columnwise=True, backend="torch")
    assert_same_bytes(got, group_quantize_reference(x, m_splits, recipe, rowwise=True, columnwise=True), recipe)
    valid = sum(m_splits)
    clean = rand(rows, cols, seed=rows + cols + 1)
    quantized = moekit.group_quantize(clean, m_splits, recipe, rowwise=True, columnwise=True)
    for columnwise in (False, True):
        deq = quantized.dequantize(columnwise=columnwise)
        assert deq.shape == x.shape and deq.dtype == x.dtype
        assert deq[valid:].eq(0).all()  # padding rows: zeros
        if valid and cols:
            assert rel_err(deq[:valid], clean[:valid]) < 0.04
    specials = got.dequantize()
    if rows >= 30 and cols >= 8:  # a block with an inf or a NaN: NaN (scale and data); others finite
        assert torch.isnan(specials[20]).any() and torch.isnan(specials[25]).any()
        assert torch.isfinite(specials[:valid][torch.isfinite(x[:valid]).all(1)]).all()


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("shape", [(3, 130, 70), (2, 1, 33), (1, 0, 5), (2, 256, 128)])
def test_weight_formats_match_the_reference(recipe, shape):
    w = rand(*shape, seed=sum(shape))
    columnwise = recipe != "fp8_block"  # 128 x 128 tiles serve both orientations
    got = moekit.group_quantize(w, None, recipe, columnwise=columnwise)
    assert_same_bytes(got, group_quantize_reference(w, None, recipe, columnwise=columnwise), recipe)
    assert got.dequantize().shape == shape
    if w.numel():
        assert rel_err(got.dequantize(), w) < 0.04
        if columnwise:
            assert rel_err(got.dequantize(columnwise=True), w) < 0.04


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_float64_input_quantizes_its_float32_rounding(recipe):
    x = rand(70, 40, seed=3, dtype=torch.float64)
    got = moekit.group_quantize(x, [30, 40], recipe, columnwise=True)
    want = moekit.group_quantize(x.float(), [30, 40], recipe, columnwise=True)
    for a, b in zip(got.storage()[2:], want.storage()[2:], strict=True):
        assert torch.equal(as_bits(a), as_bits(b))
    assert got.dtype == torch.float64 and got.dequantize().dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    x = data_with_specials(60, 70, seed=9, dtype=dtype)
    for recipe in RECIPE_NAMES:
        got = moekit.group_quantize(x, [20, 0, 35], recipe, columnwise=True)
        assert_same_bytes(got, group_quantize_reference(x, [20, 0, 35], recipe, columnwise=True), recipe)
        assert got.dequantize().dtype == dtype


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_a_group_equals_its_members_alone(recipe):
    """Quantizing all groups at once gives each member the bytes it gets alone (blocks restart at every
    group's first row)."""
    m_splits = [40, 0, 97, 3, 33]
    x = rand(sum(m_splits), 150, seed=5)
    whole = moekit.group_quantize(x, m_splits, recipe, columnwise=True)
    slots = whole.columnwise_scale_offsets.tolist()
    lo = 0
    for i, rows in enumerate(m_splits):
        alone = moekit.group_quantize(x[lo : lo + rows], [rows], recipe, columnwise=True)
        for a, b in (
            (whole.rowwise_data[lo : lo + rows], alone.rowwise_data),
            (whole.columnwise_data[lo : lo + rows], alone.columnwise_data),
        ):
            assert torch.equal(as_bits(a), as_bits(b)), f"member {i}"
        assert torch.equal(as_bits(whole.rowwise_scale_inv[lo : lo + rows]), as_bits(alone.rowwise_scale_inv))
        count = slots[i + 1] - slots[i]
        assert count == alone.columnwise_scale_offsets[1].item()
        assert torch.equal(
            as_bits(whole.columnwise_scale_inv[slots[i] : slots[i + 1]]), as_bits(alone.columnwise_scale_inv[:count])
        )
        member = whole.split()[i]
        assert torch.equal(member.dequantize(columnwise=True), alone.dequantize(columnwise=True))
        lo += rows
    w = rand(4, 130, 70, seed=6)
    columnwise = recipe != "fp8_block"
    weight = moekit.group_quantize(w, None, recipe, columnwise=columnwise)
    for i in range(4):
        alone = moekit.group_quantize(w[i : i + 1], None, recipe, columnwise=columnwise)
        for a, b in zip(weight.storage()[2:], alone.storage()[2:], strict=True):
            if b is not None and a.dim() == 3:
                assert torch.equal(as_bits(a[i : i + 1]), as_bits(b)), f"weight member {i}"


# --------------------------------------------------------------------------------------------------
# Device offsets: never read by the host
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_host_reads():
    """Reading a tensor's values on the host (what a device tensor would sync for) raises inside."""

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor's values were read on the host")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("tolist", "item", "__int__", "__bool__", "__index__", "cpu", "numpy"):
            patch.setattr(torch.Tensor, name, refuse)
        yield


def device_offsets(m_splits: list[int], rows: int) -> GroupOffsets:
    """Offsets as device splits give them (no host copy), for the CPU."""
    bounds = [0]
    for c in m_splits:
        bounds.append(bounds[-1] + c)
    return GroupOffsets(offs=torch.tensor(bounds), host=None, rows=rows)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_device_offsets_are_never_read_by_the_host(recipe, backend):
    m_splits, rows = [40, 0, 47, 3], 100
    x = rand(rows, 70, seed=2)
    want = moekit.group_quantize(x, m_splits, recipe, columnwise=True)
    offs = device_offsets(m_splits, rows)
    out = moekit.group_quantize(x * 2, offs, recipe, columnwise=True, backend=backend)
    noop = torch.zeros((), dtype=torch.float32)
    with no_host_reads():
        got = moekit.group_quantize(x, offs, recipe, columnwise=True, backend=backend)
        moekit.group_quantize(x, offs, recipe, columnwise=True, backend=backend, out=out, noop_flag=noop)
        got.dequantize(columnwise=True)
        got.dequantize()
        moekit.group_dequantize(got, columnwise=True, backend=backend)
        moekit.group_dequantize(got, backend=backend)
    assert got.known_host_first_dims is None
    assert_same_bytes(got, want, recipe)
    assert_same_bytes(out, want, recipe)


# --------------------------------------------------------------------------------------------------
# out= and the noop flag
# --------------------------------------------------------------------------------------------------


def addresses(gt: GroupedTensor) -> list[int | None]:
    return [t.data_ptr() if t is not None else None for t in gt.storage()]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_out_rewrites_in_place(recipe, backend):
    x1, x2 = rand(100, 70, seed=1), rand(100, 70, seed=2)
    out = moekit.group_quantize(x1, [40, 60], recipe, columnwise=True, backend=backend)
    before = addresses(out)
    result = moekit.group_quantize(x2, torch.tensor([0, 97]), recipe, columnwise=True, out=out, backend=backend)
    assert result is out and addresses(out) == before
    assert out.first_dims.tolist() == [0, 97] and out.offsets.tolist() == [0, 0, 97]
    assert_same_bytes(out, moekit.group_quantize(x2, [0, 97], recipe, columnwise=True), recipe)
    w = rand(3, 130, 40, seed=3)
    columnwise = recipe != "fp8_block"
    w_out = moekit.group_quantize(w, None, recipe, columnwise=columnwise, backend=backend)
    before = addresses(w_out)
    moekit.group_quantize(w * 3, None, recipe, columnwise=columnwise, out=w_out, backend=backend)
    assert addresses(w_out) == before
    assert_same_bytes(w_out, moekit.group_quantize(w * 3, None, recipe, columnwise=columnwise), recipe)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_noop_flag(recipe, backend):
    x1, x2 = rand(80, 40, seed=1), rand(80, 40, seed=2)
    out = moekit.group_quantize(x1, [30, 50], recipe, columnwise=True, backend=backend)
    kept = [as_bits(t).clone() for t in out.storage()]
    before = addresses(out)
    skip = torch.ones(1, dtype=torch.float32)
    moekit.group_quantize(x2, [0, 77], recipe, columnwise=True, out=out, noop_flag=skip, backend=backend)
    assert addresses(out) == before
    for a, b in zip(out.storage(), kept, strict=True):
        assert torch.equal(as_bits(a), b), "noop_flag 1.0 changed out"
    assert out.known_host_first_dims is None  # which split holds is the device's to know
    moekit.group_quantize(x2, [0, 77], recipe, columnwise=True, out=out, noop_flag=torch.tensor(0.0), backend=backend)
    assert_same_bytes(out, moekit.group_quantize(x2, [0, 77], recipe, columnwise=True), recipe)


class _SavesStorage(torch.autograd.Function):
    """Identity on w that saves a quantized GroupedTensor's storage, as the quantized compute does."""

    @staticmethod
    def forward(ctx, w, *storage):
        ctx.save_for_backward(*storage)
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018  (unpacking is where autograd checks the versions)
        return (grad,) + (None,) * len(ctx.needs_input_grad[1:])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_rewriting_storage_a_backward_saved_is_refused(recipe, backend):
    """out= counts as an in-place write for autograd (also where a kernel wrote): a node that saved the
    storage before refuses to run on the rewritten one."""
    out = moekit.group_quantize(rand(10, 8, seed=1), [10], recipe, backend=backend)
    w = torch.ones(3, requires_grad=True)
    y = _SavesStorage.apply(w, *(t for t in out.storage() if t is not None)).sum()
    moekit.group_quantize(rand(10, 8, seed=2), [10], recipe, out=out, backend=backend)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


# --------------------------------------------------------------------------------------------------
# The Triton kernels under the interpreter: byte for byte the torch path
# --------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_triton_kernels_match_the_torch_path(recipe, dtype):
    for m_splits, rows, cols in (([40, 0, 37, 3], 90, 70), ([0, 33], 33, 130)):
        x = data_with_specials(rows, cols, seed=rows, dtype=dtype)
        for forms in ((True, False), (False, True), (True, True)):
            got = moekit.group_quantize(x, m_splits, recipe, rowwise=forms[0], columnwise=forms[1], backend="triton")
            want = moekit.group_quantize(x, m_splits, recipe, rowwise=forms[0], columnwise=forms[1], backend="torch")
            assert_same_bytes(got, want, f"{recipe} {dtype} {forms}")
    w = rand(2, 130, 40, seed=7, dtype=dtype)
    columnwise = recipe != "fp8_block"
    got = moekit.group_quantize(w, None, recipe, columnwise=columnwise, backend="triton")
    assert_same_bytes(got, moekit.group_quantize(w, None, recipe, columnwise=columnwise, backend="torch"), recipe)


def test_quantize_tile_configs_fit_the_blocks():
    """Every architecture's tiles fit the formats' blocks (the host refuses one that does not): whole
    blocks along the columns, one block for a weight tile; the slots' chunks divide the slot and are
    multiples of 16 (the wgrad layout's stores); power-of-two sides (Triton's aranges), at least one
    step and stage; the slots kernel's entries for every layout, its band 0 (2-D launch) or more."""
    blocks = {RECIPES[name].block_cols: RECIPES[name].block_rows for name in ("mxfp8", "fp8_block")}
    assert set(QUANTIZE_TILES) == set(QUANTIZE_SLOTS)
    for arch, table in QUANTIZE_TILES.items():
        assert {form for _, form in table} == {"rows", "tile"} and {k for k, _ in table} == set(blocks)
        for (tile_k, form), (block_r, block_c, warps, steps, stages, maxnreg) in table.items():
            what = f"{arch} {(tile_k, form)}"
            assert block_c % tile_k == 0 and block_r & (block_r - 1) == 0 and block_c & (block_c - 1) == 0, what
            assert form != "tile" or (block_c == tile_k and block_r == blocks[tile_k]), what
            assert warps >= 1 and steps >= 1 and stages >= 1, what
            assert maxnreg == 0 or (24 <= maxnreg <= 255 and maxnreg % 8 == 0), what
        layouts = ("rows", "segments", "segments-gathered")
        assert set(QUANTIZE_SLOTS[arch]) == {(k, layout) for k in blocks for layout in layouts}
        for (tile_k, layout), (block_c, chunk, warps, stages, band, maxnreg) in QUANTIZE_SLOTS[arch].items():
            what = f"{arch} slots {(tile_k, layout)}"
            assert block_c % tile_k == 0 and block_c & (block_c - 1) == 0, what
            assert blocks[tile_k] % chunk == 0 and chunk % 16 == 0 and chunk & (chunk - 1) == 0, what
            assert warps >= 1 and stages >= 1 and band >= 0, what
            assert maxnreg == 0 or (24 <= maxnreg <= 255 and maxnreg % 8 == 0), what  # ptxas's range, whole steps


def poison(gt: GroupedTensor) -> None:
    """Every storage byte 0xff (NaN in float8, E8M0 and float32): a byte the kernels leave unwritten shows."""
    for t in gt.storage()[2:6]:  # data and scales
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)


# (m_splits, rows, cols) for the kernels' paths: groups not multiples of the 32 / 128-row blocks, empty
# groups first, in the middle and last, padding rows, no routed rows, no rows at all, odd and prime
# widths, rows past the interpreter's whole-row width (128: fp8_rowwise's two-pass rows, several column
# tiles and column blocks of the span kernels), several spans of a group, one row.
KERNEL_LAYOUTS = [
    pytest.param([0, 45, 0, 130, 7, 0], 200, 67, id="empties-odd"),
    pytest.param([33, 1], 40, 257, id="wide-prime"),
    pytest.param([0, 0, 0], 9, 40, id="nothing-routed"),
    pytest.param([0, 0], 0, 36, id="no-rows"),
    pytest.param([1], 1, 1, id="one-element"),
    pytest.param([129, 2], 131, 128, id="block-plus-one"),
]


@needs_triton
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize(("m_splits", "rows", "cols"), KERNEL_LAYOUTS)
def test_triton_kernels_write_every_byte(recipe, m_splits, rows, cols):
    """Each form alone and both, into NaN-poisoned `out=` storage and freshly allocated, with and without
    a noop flag of 0: the torch path's bytes (specials included), so every output byte is written."""
    x = data_with_specials(rows, cols, seed=rows + cols, dtype=torch.bfloat16)
    for forms in ((True, False), (False, True), (True, True)):
        want = moekit.group_quantize(x, m_splits, recipe, rowwise=forms[0], columnwise=forms[1], backend="torch")
        got = moekit.group_quantize(x, m_splits, recipe, rowwise=forms[0], columnwise=forms[1], backend="triton")
        assert_same_bytes(got, want, f"{recipe} {forms}")
        poison(got)
        noop = torch.zeros((), dtype=torch.float32)
        moekit.group_quantize(
            x, m_splits, recipe, rowwise=forms[0], columnwise=forms[1], out=got, noop_flag=noop, backend="triton"
        )
        assert_same_bytes(got, want, f"{recipe} {forms} out=")


@needs_triton
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_triton_kernels_with_more_groups_than_a_group_vector_block(recipe):
    """300 groups (DeepSeek-V3 has 256 experts): the group vectors of the slot and span searches take
    512 lanes; most groups empty or a few rows, device splits, both forms and the rowwise alone."""
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 4, (300,), generator=gen) * torch.randint(0, 2, (300,), generator=gen)
    counts[7], counts[299] = 40, 33
    rows = int(counts.sum()) + 5
    x = data_with_specials(rows, 36, seed=9, dtype=torch.bfloat16)
    for columnwise in (False, True):
        want = moekit.group_quantize(x, counts.tolist(), recipe, columnwise=columnwise, backend="torch")
        offs = device_offsets(counts.tolist(), rows)
        got = moekit.group_quantize(x, offs, recipe, columnwise=columnwise, backend="triton")
        assert_same_bytes(got, want, f"{recipe} {columnwise}")


@needs_triton
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("shape", [(3, 130, 70), (2, 1, 257), (2, 0, 5), (1, 129, 128)])
def test_triton_weight_kernels_write_every_byte(recipe, shape):
    w = rand(*shape, seed=sum(shape), dtype=torch.bfloat16)
    for columnwise in (False, True) if recipe != "fp8_block" else (False,):
        want = moekit.group_quantize(w, None, recipe, columnwise=columnwise, backend="torch")
        got = moekit.group_quantize(w, None, recipe, columnwise=columnwise, backend="triton")
        poison(got)
        moekit.group_quantize(w, None, recipe, columnwise=columnwise, out=got, backend="triton")
        assert_same_bytes(got, want, f"{recipe} {shape} {columnwise}")


def assert_same_values(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Equal dtype, shape and values, NaN where NaN (a NaN's payload bits are the device's arithmetic)."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {got.shape} vs {want.shape}"
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{what}: values differ")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_triton_dequantize_matches_the_torch_path(recipe, dtype):
    """The one-pass kernel writes the torch path's values (the product in fp32, one rounding) for both
    forms of rows (empty groups, odd sizes, padding rows, inf/NaN blocks) and of weights."""
    for m_splits, rows, cols in [p.values for p in LAYOUTS]:
        x = data_with_specials(rows, cols, seed=rows + cols, dtype=dtype)
        gt = moekit.group_quantize(x, m_splits, recipe, columnwise=True, backend="torch")
        for columnwise in (False, True):
            got = moekit.group_dequantize(gt, columnwise=columnwise, backend="triton")
            assert_same_values(got, gt.dequantize(columnwise=columnwise), f"{recipe} {m_splits} {columnwise=}")
            assert_same_values(got, moekit.group_dequantize(gt, columnwise=columnwise, backend="torch"))
    for shape in [(3, 130, 70), (2, 1, 33), (1, 0, 5), (2, 256, 128)]:
        w = rand(*shape, seed=sum(shape)) * 100
        if shape[1] > 4:
            w[1, 3, 2] = float("nan")
        w = w.to(dtype)
        columnwise = recipe != "fp8_block"
        gw = moekit.group_quantize(w, None, recipe, columnwise=columnwise, backend="torch")
        for form in (False, True) if columnwise else (False,):
            got = moekit.group_dequantize(gw, columnwise=form, backend="triton")
            assert_same_values(got, gw.dequantize(columnwise=form), f"{recipe} weight {shape} {form=}")


def assert_same_transposed(got, want, what: str = "") -> None:
    assert got.data.shape == want.data.shape and got.scale_inv.shape == want.scale_inv.shape, what
    assert got.data.is_contiguous() and got.scale_inv.is_contiguous(), what
    assert torch.equal(got.data.cpu().view(torch.uint8), want.data.cpu().view(torch.uint8)), f"{what}: data differ"
    assert torch.equal(got.scale_inv.cpu().view(torch.int32), want.scale_inv.cpu().view(torch.int32)), what


@needs_triton
@pytest.mark.parametrize("recipe", TRANSPOSED_RECIPES)
def test_triton_transposed_weight_matches_the_torch_path(recipe):
    """The transpose kernel writes the torch path's bytes (data and scales, NaN blocks included) for
    row counts that are multiples of 4 (the packed-word path) and not, partial tiles, and in place into
    out= (every address kept)."""
    columnwise = recipe == "fp8_rowwise"
    for shape in [(3, 200, 136), (2, 33, 70), (1, 130, 129), (2, 1, 5), (2, 256, 128)]:
        w = rand(*shape, seed=sum(shape)) * 30
        w[-1, 0, -1] = float("nan")
        w_q = moekit.group_quantize(w, None, recipe, rowwise=not columnwise, columnwise=columnwise, backend="torch")
        want = transposed_weight(w_q, backend="torch")
        assert_same_transposed(transposed_weight(w_q, backend="triton"), want, f"{recipe} {shape}")
        out = transposed_weight(w_q, backend="triton")
        for t in out:
            t.view(torch.uint8).fill_(0xFF)
        ptrs = (out.data.data_ptr(), out.scale_inv.data_ptr())
        assert transposed_weight(w_q, out=out, backend="triton") is out
        assert (out.data.data_ptr(), out.scale_inv.data_ptr()) == ptrs
        assert_same_transposed(out, want, f"{recipe} {shape} out=")


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_float64_dequantizes_on_the_torch_path(recipe):
    """A float64 quantization's product is float64 (exact): "auto" takes the torch path, "triton" refuses."""
    gt = moekit.group_quantize(rand(40, 70, seed=3).double(), [30, 10], recipe, columnwise=True)
    for columnwise in (False, True):
        got = moekit.group_dequantize(gt, columnwise=columnwise)
        assert got.dtype == torch.float64
        assert torch.equal(got, gt.dequantize(columnwise=columnwise))
    with pytest.raises(ValueError, match="float64"):
        moekit.group_dequantize(gt, backend="triton")


# --------------------------------------------------------------------------------------------------
# Refusals: one line each
# --------------------------------------------------------------------------------------------------


def _out(recipe="mxfp8", rows=10, cols=8, columnwise=False, dtype=torch.float32):
    return moekit.group_quantize(torch.ones(rows, cols, dtype=dtype), [rows], recipe, columnwise=columnwise)


x8 = torch.ones(10, 8)
REFUSALS = [
    (
        lambda: moekit.group_quantize(x8, [10], "fp8"),
        ValueError,
        r"unknown recipe 'fp8'; expected one of \('mxfp8', 'fp8_block', 'fp8_rowwise'\)",
    ),
    (lambda: moekit.group_quantize(x8, [10], None), TypeError, r"recipe must be one of"),
    (
        lambda: moekit.group_quantize(x8.int(), [10], "mxfp8"),
        TypeError,
        r"x is torch.int32, not a floating dtype moekit computes in",
    ),
    (lambda: moekit.group_quantize(x8.bool(), [10], "mxfp8"), TypeError, r"x is torch.bool, not a floating dtype"),
    (
        lambda: moekit.group_quantize(x8.to(torch.float8_e4m3fn), [10], "mxfp8"),
        TypeError,
        r"x is torch.float8_e4m3fn, a float8 storage type",
    ),
    (lambda: moekit.group_quantize(x8.numpy(), [10], "mxfp8"), TypeError, r"x must be a torch.Tensor, got ndarray"),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", rowwise=False),
        ValueError,
        r"needs rowwise=True or columnwise=True",
    ),
    (lambda: moekit.group_quantize(x8, [10], "mxfp8", columnwise=1), TypeError, r"columnwise must be a bool"),
    (
        lambda: moekit.group_quantize(x8, [6, 6], "mxfp8"),
        ValueError,
        r"m_splits sums to 12 but the input has only 10 rows",
    ),
    (lambda: moekit.group_quantize(x8, [], "mxfp8"), ValueError, r"m_splits has no groups"),
    (
        lambda: moekit.group_quantize(x8, None, "mxfp8"),
        ValueError,
        r"m_splits=None quantizes an \(N, rows, cols\) weight, but x has shape \(10, 8\)",
    ),
    (
        lambda: moekit.group_quantize(torch.ones(2, 3, 4), [2], "mxfp8"),
        ValueError,
        r"x must be 2-D \(rows, cols\) with m_splits",
    ),
    (lambda: moekit.group_quantize(torch.ones(0, 3, 4), None, "mxfp8"), ValueError, r"the weight has no members"),
    (
        lambda: moekit.group_quantize(torch.ones(2, 3, 4), None, "fp8_block", columnwise=True),
        ValueError,
        r"fp8_block has no columnwise form for an \(N, rows, cols\) weight",
    ),
    (lambda: moekit.group_quantize(x8, [10], "mxfp8", backend="fast"), ValueError, r"unknown backend 'fast'"),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", out=x8),
        TypeError,
        r"out must be a quantized GroupedTensor \(from group_quantize\), got Tensor",
    ),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", out=_out("fp8_block")),
        ValueError,
        r"out does not match this quantization: its recipe is fp8_block, asked mxfp8",
    ),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", out=_out(rows=9)),
        ValueError,
        r"its shape is \(9, 8\), asked \(10, 8\)",
    ),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", out=_out(dtype=torch.float16)),
        ValueError,
        r"its dtype is torch.float16, asked torch.float32",
    ),
    (lambda: moekit.group_quantize(x8, [5, 5], "mxfp8", out=_out()), ValueError, r"its number of groups is 1, asked 2"),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", out=_out(columnwise=True)),
        ValueError,
        r"its forms is rowwise\+columnwise, asked rowwise",
    ),
    (lambda: moekit.group_quantize(x8, [10], "mxfp8", out=_out(), noop_flag=torch.ones(())), None, None),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", out=_out(), noop_flag=torch.ones((), dtype=torch.float64)),
        ValueError,
        r"noop_flag must be a float32 scalar tensor \(shape \(\) or \(1,\)\), got torch.float64",
    ),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", out=_out(), noop_flag=torch.ones(2)),
        ValueError,
        r"noop_flag must be a float32 scalar tensor .* of shape \(2,\)",
    ),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", out=_out(), noop_flag=1.0),
        TypeError,
        r"noop_flag must be a torch.Tensor",
    ),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", out=_out(), noop_flag=torch.ones((), device="meta")),
        ValueError,
        r"noop_flag is on meta but x is on cpu; pass it on x's device",
    ),
    (
        lambda: moekit.group_quantize(x8, [10], "mxfp8", noop_flag=torch.ones(())),
        ValueError,
        r"noop_flag leaves out= unchanged when it is 1.0; it needs out=",
    ),
    (lambda: moekit.group_dequantize(x8), TypeError, r"gt must be a quantized GroupedTensor"),
]


@pytest.mark.parametrize(("call", "error", "message"), REFUSALS, ids=[f"refusal-{i}" for i in range(len(REFUSALS))])
def test_refusals_are_one_line(call, error, message):
    if error is None:
        call()  # accepted
        return
    with pytest.raises(error, match=message) as info:
        call()
    assert "\n" not in str(info.value)


@pytest.mark.skipif(TRITON_OK, reason="the Triton backend runs here")
def test_triton_backend_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match=r"backend='triton' cannot quantize here: .*Usable here: \['loop', 'torch'\]"):
        moekit.group_quantize(x8, [10], "mxfp8", backend="triton")


# --------------------------------------------------------------------------------------------------
# Quantized from the token rows, then gathered (the layer's fc1 operand)
# --------------------------------------------------------------------------------------------------

# (tokens, index rows' sources, m_splits over the gathered rows, cols): tokens read many times and
# never, empty groups, one row, nothing routed, widths whose rows are 1, 2 or 4-byte multiples.
GATHERED = [
    pytest.param(40, [3, 3, 0, 39, 7] * 13 + [1], [20, 0, 41, 5], 150, id="repeats-empty-group-150"),
    pytest.param(33, list(range(32, -1, -1)) * 2, [0, 66], 257, id="every-token-twice-odd-width"),
    pytest.param(5, [4], [1], 130, id="one-row"),
    pytest.param(0, [], [0, 0], 64, id="no-tokens"),
]


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("tokens, sources, m_splits, cols", GATHERED)
def test_quantized_then_gathered_is_gathered_then_quantized(tokens, sources, m_splits, cols, recipe, use_triton):
    """`group_quantize_gathered(x, index, offs)`: byte for byte `group_quantize(x[index], offs)` for
    rows that all lie in groups (a rowwise block never leaves its row), specials included (the NaN's
    and inf's blocks), the bytes moved by the row kernel (integer words) or torch."""
    x = data_with_specials(tokens, cols, seed=tokens + cols)
    index = torch.tensor(sources, dtype=torch.int64).reshape(-1, 1)
    offs_host = [0]
    for count in m_splits:
        offs_host.append(offs_host[-1] + count)
    offs = GroupOffsets(torch.tensor(offs_host), tuple(offs_host), len(sources))
    got = group_quantize_gathered(x, index, offs, recipe, "triton" if use_triton else "torch", use_triton)
    want = moekit.group_quantize(x[index.view(-1)], m_splits, recipe, backend="torch")
    assert_same_bytes(got, want, f"{recipe} {m_splits}")


# --------------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_compile_fullgraph_traces_group_quantize(recipe):
    torch._dynamo.reset()
    x = rand(70, 40, seed=1)
    splits = torch.tensor([30, 0, 37])

    def quantize_dequantize(x, splits):
        gt = moekit.group_quantize(x, splits, recipe, columnwise=True)
        return gt.dequantize(), gt.dequantize(columnwise=True), gt.rowwise_data, gt.columnwise_scale_inv

    compiled = torch.compile(quantize_dequantize, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(x, splits), quantize_dequantize(x, splits), strict=True):
        assert torch.equal(as_bits(got), as_bits(want))
    out = moekit.group_quantize(rand(70, 40, seed=2), splits, recipe)

    def rewrite(x, splits, flag):
        moekit.group_quantize(x, splits, recipe, out=out, noop_flag=flag)
        return out.dequantize()

    compiled = torch.compile(rewrite, fullgraph=True, backend="aot_eager")
    before = addresses(out)
    skipped = compiled(x, splits, torch.ones(()))
    assert torch.equal(skipped, moekit.group_quantize(rand(70, 40, seed=2), splits, recipe).dequantize())
    done = compiled(x, splits, torch.zeros(()))
    assert torch.equal(done, moekit.group_quantize(x, splits, recipe).dequantize())
    assert addresses(out) == before
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_compile_fullgraph_traces_group_dequantize(recipe, backend):
    torch._dynamo.reset()
    splits = torch.tensor([30, 0, 37])
    gt = moekit.group_quantize(rand(70, 40, seed=1), splits, recipe, columnwise=True)

    def dequantize(gt):
        return moekit.group_dequantize(gt, backend=backend), moekit.group_dequantize(
            gt, columnwise=True, backend=backend
        )

    compiled = torch.compile(dequantize, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(gt), (gt.dequantize(), gt.dequantize(columnwise=True)), strict=True):
        assert_same_values(got, want, recipe)
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu): the kernels byte for byte the CPU path, no host sync, out= and the noop
# flag inside a captured CUDA graph replayed many times
# --------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# 3545 of 4096 rows routed: empty experts first, in the middle and last, and padding rows.
CUDA_SPLITS = [0, 700, 512, 0, 900, 333, 1100, 0]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_cuda_kernels_match_the_cpu_path(recipe, dtype):
    for m_splits, rows, cols in ((CUDA_SPLITS, 4096, 1000), ([40, 0, 37, 3], 90, 70), ([0, 33], 33, 130)):
        x = data_with_specials(rows, cols, seed=rows, dtype=dtype)
        want = moekit.group_quantize(x, m_splits, recipe, columnwise=True, backend="torch")
        offs = torch.tensor(m_splits, device="cuda")
        got = moekit.group_quantize(x.cuda(), offs, recipe, columnwise=True, backend="triton")
        assert_same_bytes(got, want, f"{recipe} {dtype} {m_splits}")
        for columnwise in (False, True):
            # Equal values, NaN where NaN: a NaN's bits are the device's arithmetic (data NaN x scale).
            a, b = got.dequantize(columnwise=columnwise).cpu(), want.dequantize(columnwise=columnwise)
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f"dequantize({columnwise=})")
    w = rand(8, 520, 300, seed=4).to(dtype)
    columnwise = recipe != "fp8_block"
    want = moekit.group_quantize(w, None, recipe, columnwise=columnwise, backend="torch")
    got = moekit.group_quantize(w.cuda(), None, recipe, columnwise=columnwise, backend="triton")
    assert_same_bytes(got, want, f"{recipe} {dtype} weight")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_cuda_quantized_then_gathered_matches_the_cpu_path(recipe):
    """The layer's fc1 operand on the GPU (the Triton quantizer on the token rows, the row kernel moving
    the bytes as integer words): the CPU path's bytes for the gathered rows."""
    tokens, top_k, experts, cols = 3000, 8, 32, 7168
    ids = (torch.arange(tokens * top_k) % experts).reshape(tokens, top_k)
    index = ids.reshape(-1).argsort(stable=True).div(top_k, rounding_mode="floor").reshape(-1, 1)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    x = data_with_specials(tokens, cols, seed=3, dtype=torch.bfloat16)
    want = moekit.group_quantize(x[index.view(-1)], counts, recipe, backend="torch")
    offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).cuda()
    got = group_quantize_gathered(
        x.cuda(), index.cuda(), GroupOffsets(offs, None, tokens * top_k), recipe, "triton", True
    )
    assert_same_bytes(got, want, recipe)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_torch_path_on_cuda_writes_the_cpu_bytes(recipe):
    """The torch path on CUDA writes the CPU's bytes, NaN scales included (the NaN itself as scale_inv,
    0x7fc00000, not the GPU division's 1 / NaN, 0x7fffffff)."""
    x = data_with_specials(90, 70, seed=90, dtype=torch.bfloat16)
    want = moekit.group_quantize(x, [40, 0, 37, 3], recipe, columnwise=True, backend="torch")
    offs = torch.tensor([40, 0, 37, 3], device="cuda")
    got = moekit.group_quantize(x.cuda(), offs, recipe, columnwise=True, backend="torch")
    assert_same_bytes(got, want, recipe)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("forms", [(True, False), (False, True), (True, True)], ids=["rowwise", "columnwise", "both"])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_cuda_each_form_matches_the_cpu_path_at_width(recipe, forms):
    """Each form alone and both on CUDA at widths of real layers and past them (the rowwise rows' own
    kernels: tiles without slots, fp8_rowwise's whole rows in one pass and, past 16384 columns, two;
    the pipelined column-tile loops with a partial last step), bf16 with specials (tiles with and
    without the NaN fix-up), into NaN-poisoned out= storage: the CPU torch path's bytes."""
    for m_splits, rows, cols in ((CUDA_SPLITS, 4096, 1000), ([100, 0, 300], 512, 7168), ([7, 50], 64, 16500)):
        x = data_with_specials(rows, cols, seed=cols, dtype=torch.bfloat16)
        want = moekit.group_quantize(x, m_splits, recipe, rowwise=forms[0], columnwise=forms[1], backend="torch")
        offs = torch.tensor(m_splits, device="cuda")
        got = moekit.group_quantize(x.cuda(), offs, recipe, rowwise=forms[0], columnwise=forms[1], backend="triton")
        assert_same_bytes(got, want, f"{recipe} {forms} {cols}")
        poison(got)
        moekit.group_quantize(x.cuda(), offs, recipe, rowwise=forms[0], columnwise=forms[1], out=got, backend="triton")
        assert_same_bytes(got, want, f"{recipe} {forms} {cols} out=")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_cuda_group_quantize_has_no_host_sync(recipe):
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor(CUDA_SPLITS, device="cuda")
    out = moekit.group_quantize(x, offs, recipe, columnwise=True, backend="triton")
    noop = torch.zeros((), device="cuda")

    def step():
        moekit.group_quantize(x, offs, recipe, columnwise=True, backend="triton").dequantize(columnwise=True)
        moekit.group_dequantize(out, columnwise=True, backend="triton")
        moekit.group_dequantize(out, backend="triton")
        moekit.group_quantize(x, offs, recipe, columnwise=True, backend="triton", out=out, noop_flag=noop)

    assert_no_host_sync(step)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_out_and_noop_flag_under_cuda_graph_replay(recipe):
    """One captured group_quantize(out=, noop_flag=) replayed 12 times with new inputs, new split sizes
    and the flag alternating: after each replay `out` holds exactly the eager quantization of that
    replay's inputs (flag 0) or the previous bytes (flag 1), at the same addresses."""
    rows, cols = 2048, 520
    x_static = torch.zeros(rows, cols, device="cuda", dtype=torch.bfloat16)
    splits_static = torch.tensor([rows // 4] * 4, device="cuda")
    flag = torch.zeros((), device="cuda")
    out = moekit.group_quantize(x_static, splits_static, recipe, columnwise=True, backend="triton")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moekit.group_quantize(x_static, splits_static, recipe, columnwise=True, out=out, noop_flag=flag)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moekit.group_quantize(x_static, splits_static, recipe, columnwise=True, out=out, noop_flag=flag)
    before = addresses(out)
    gen = torch.Generator().manual_seed(7)
    expected = None
    for i in range(12):
        x = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
        cuts = torch.sort(torch.randint(0, rows - 100, (3,), generator=gen)).values.tolist()
        m_splits = [cuts[0], cuts[1] - cuts[0], cuts[2] - cuts[1], rows - 100 - cuts[2]]  # 100 padding rows
        skip = i % 3 == 2
        x_static.copy_(x)
        splits_static.copy_(torch.tensor(m_splits))
        flag.fill_(1.0 if skip else 0.0)
        graph.replay()
        torch.cuda.synchronize()
        assert addresses(out) == before
        if not skip:
            expected = moekit.group_quantize(x, m_splits, recipe, columnwise=True, backend="torch")
        assert_same_bytes(out, expected, f"{recipe} replay {i} ({'noop' if skip else 'quantize'})")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_cuda_dequantize_matches_the_cpu_path(recipe, dtype):
    """The one-pass kernel at a realistic size (8192 rows of 7168 in 8 groups with empty ones and padding
    rows; 4 experts of 2048 x 7168) writes the CPU torch path's values, and replays in a CUDA graph."""
    m_splits = [0, 1400, 1024, 0, 1800, 666, 2200, 0]  # 7090 of 8192 rows routed
    x = data_with_specials(8192, 7168, seed=5, dtype=dtype)
    want = moekit.group_quantize(x, m_splits, recipe, columnwise=True, backend="torch")
    got = moekit.group_quantize(x.cuda(), torch.tensor(m_splits, device="cuda"), recipe, columnwise=True)
    assert_same_bytes(got, want, recipe)
    for columnwise in (False, True):
        out = moekit.group_dequantize(got, columnwise=columnwise, backend="triton")
        assert_same_values(out.cpu(), want.dequantize(columnwise=columnwise), f"{recipe} {columnwise=}")
    w = rand(4, 2048, 7168, seed=6).to(dtype)
    columnwise = recipe != "fp8_block"
    want_w = moekit.group_quantize(w, None, recipe, columnwise=columnwise, backend="torch")
    got_w = moekit.group_quantize(w.cuda(), None, recipe, columnwise=columnwise, backend="triton")
    for form in (False, True) if columnwise else (False,):
        out = moekit.group_dequantize(got_w, columnwise=form, backend="triton")
        assert_same_values(out.cpu(), want_w.dequantize(columnwise=form), f"{recipe} weight {form=}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moekit.group_dequantize(got, columnwise=True, backend="triton")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moekit.group_dequantize(got, columnwise=True, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    assert_same_values(captured.cpu(), want.dequantize(columnwise=True), f"{recipe} graph replay")


# The noop flag is read once a program, whatever the shape: checked at a ragged and an aligned one.
NOOP_SHAPES = [(3, 200, 136), (2, 256, 128)]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("recipe", TRANSPOSED_RECIPES)
def test_quantize_with_the_transposed_copy_in_one_call(recipe, backend, monkeypatch):
    """`group_quantize_transposed` gives the pair group_quantize + transposed_weight byte for byte (fp8_block
    on the Triton backend: the tiles kernel writes the copy from the bytes it holds, no transpose launch)
    at partial tiles, odd and 16-aligned member heights, NaN blocks; into NaN-poisoned storage, fresh and
    in place (every address kept); with the noop flag at 1.0 both are left as they are, at 0.0 rewritten
    (`NOOP_SHAPES`)."""
    columnwise = recipe == "fp8_rowwise"
    if backend == "triton" and recipe == "fp8_block":

        def no_second_pass(*args):
            raise AssertionError("fp8_block's transposed copy took a second pass over the FP8 weight")

        monkeypatch.setattr("moekit.ops.runtime.quantize.transpose_weight_into", no_second_pass)
    for shape in [(3, 200, 136), (2, 33, 70), (1, 130, 129), (2, 1, 5), (2, 256, 128), (2, 144, 272)]:
        w = rand(*shape, seed=sum(shape)) * 30
        w[-1, 0, -1] = float("nan")
        want_q = moekit.group_quantize(w, None, recipe, rowwise=not columnwise, columnwise=columnwise, backend="torch")
        if not columnwise:  # fp8_block: the rowwise tiles (a weight has no columnwise form there)
            want_q = moekit.group_quantize(w, None, recipe, backend="torch")
        want_t = transposed_weight(want_q, backend="torch")
        fresh_q, fresh_t = group_quantize_transposed(w, recipe, backend=backend)
        assert_same_transposed(fresh_t, want_t, f"{recipe} {shape} fresh")
        for t in (*fresh_q.storage()[2:6], *fresh_t):
            if t is not None:
                t.view(torch.uint8).fill_(0xFF)  # NaN in float8 and float32: an unwritten byte shows
        ptrs = [t.data_ptr() for t in (*fresh_q.storage()[2:6], *fresh_t) if t is not None]
        got_q, got_t = group_quantize_transposed(w, recipe, out=fresh_q, transposed=fresh_t, backend=backend)
        assert got_q is fresh_q and got_t is fresh_t
        assert [t.data_ptr() for t in (*got_q.storage()[2:6], *got_t) if t is not None] == ptrs
        assert_same_transposed(got_t, want_t, f"{recipe} {shape} out=")
        form = "columnwise" if columnwise else "rowwise"
        assert torch.equal(as_bits(getattr(got_q, f"{form}_data")), as_bits(getattr(want_q, f"{form}_data")))
        if shape not in NOOP_SHAPES:
            continue
        other = rand(*shape, seed=7) * 3
        for flag, kept in ((1.0, True), (0.0, False)):
            before = [t.clone() for t in got_t]
            noop = torch.tensor(flag)
            group_quantize_transposed(other, recipe, out=got_q, transposed=got_t, noop_flag=noop, backend=backend)
            same = all(torch.equal(as_bits(a), as_bits(b)) for a, b in zip(got_t, before, strict=True))
            assert same == kept, f"{recipe} {shape} noop {flag}"
        other_q = moekit.group_quantize(other, None, recipe, rowwise=not columnwise, columnwise=columnwise)
        assert_same_transposed(got_t, transposed_weight(other_q, backend="torch"), f"{recipe} {shape} noop 0")


def test_quantize_with_the_transposed_copy_refuses_in_one_line():
    """A recipe without a transposed copy, rows instead of a weight, a copy of other shapes: refused before
    any launch, naming what is wrong."""
    w = rand(2, 64, 32)
    with pytest.raises(ValueError, match="recipe"):
        group_quantize_transposed(w, "mxfp8", backend="torch")
    with pytest.raises(ValueError, match=r"w_NOI must be an \(N, O, I\) weight"):
        group_quantize_transposed(w[0], "fp8_block", backend="torch")
    _, wrong = group_quantize_transposed(rand(2, 32, 64), "fp8_block", backend="torch")
    with pytest.raises(ValueError, match="the transposed copy holds"):
        group_quantize_transposed(w, "fp8_block", transposed=wrong, backend="torch")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", TRANSPOSED_RECIPES)
def test_cuda_quantize_with_the_transposed_copy_matches_the_cpu_path(recipe):
    """`group_quantize_transposed` on the GPU at DeepSeek-V3-like member sizes (and an odd one) writes the
    CPU torch path's bytes for the weight and its transposed copy, in place without a host sync, and
    under a CUDA graph replay."""
    for shape in [(4, 4096, 7168), (4, 130, 300), (3, 2048, 7168)]:
        w = rand(*shape, seed=sum(shape)).to(torch.bfloat16)
        w[1, 3, 2] = float("nan")
        want_q, want_t = group_quantize_transposed(w, recipe, backend="torch")
        got_q, got_t = group_quantize_transposed(w.cuda(), recipe)
        assert_same_transposed(got_t, want_t, f"{recipe} {shape}")
        form = "columnwise" if recipe == "fp8_rowwise" else "rowwise"
        assert torch.equal(as_bits(getattr(got_q, f"{form}_data").cpu()), as_bits(getattr(want_q, f"{form}_data")))
        for t in got_t:
            t.view(torch.uint8).fill_(0xFF)
        wc = w.cuda()
        assert_no_host_sync(lambda wc=wc, q=got_q, t=got_t: group_quantize_transposed(wc, recipe, out=q, transposed=t))
        assert_same_transposed(got_t, want_t, f"{recipe} {shape} out=")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        group_quantize_transposed(wc, recipe, out=got_q, transposed=got_t)
    torch.cuda.current_stream().wait_stream(side)
    for t in got_t:
        t.view(torch.uint8).fill_(0xFF)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        group_quantize_transposed(wc, recipe, out=got_q, transposed=got_t)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_transposed(got_t, want_t, f"{recipe} graph replay")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", TRANSPOSED_RECIPES)
def test_cuda_transposed_weight_matches_the_cpu_path(recipe):
    """The transpose kernel on the GPU at a DeepSeek-V3-like member size (4 members of 4096 x 7168, and
    an odd 4 x 130 x 300) writes the CPU torch path's bytes, into out= under a CUDA graph replay too,
    without a host sync."""
    columnwise = recipe == "fp8_rowwise"
    for shape in [(4, 4096, 7168), (4, 130, 300), (3, 2048, 7168)]:
        w = rand(*shape, seed=sum(shape)).to(torch.bfloat16)
        w[1, 3, 2] = float("nan")
        w_q = moekit.group_quantize(w.cuda(), None, recipe, rowwise=not columnwise, columnwise=columnwise)
        want = transposed_weight(moekit.group_quantize(w, None, recipe, rowwise=not columnwise, columnwise=columnwise))
        got = transposed_weight(w_q, backend="triton")
        assert_same_transposed(got, want, f"{recipe} {shape}")
        for t in got:
            t.view(torch.uint8).fill_(0xFF)
        assert_no_host_sync(lambda w_q=w_q, got=got: transposed_weight(w_q, out=got, backend="triton"))
        assert_same_transposed(got, want, f"{recipe} {shape} out=")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        transposed_weight(w_q, out=got, backend="triton")
    torch.cuda.current_stream().wait_stream(side)
    for t in got:
        t.view(torch.uint8).fill_(0xFF)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        transposed_weight(w_q, out=got, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    assert_same_transposed(got, want, f"{recipe} graph replay")
