"""The backward's columnwise quantization written straight into the FP8 wgrad's operand layout
(`moekit.ops.quantize.group_quantize_for_wgrad`, `SegmentedColumns`; the kernels' SEGMENTS stores and
the torch path's `segment_transposed`), and the wgrad, grouped_linear and the quantized MLP on it.

The layout's contract is `segment_transpose(group_quantize(...).columnwise_data, offs)` byte for byte on
every column in use (each group's segment, its tail of zeros up to 128 columns included); the scales and the
rowwise form of the same launch are `group_quantize`'s bytes. Checked on bytes: padding rows hold NaN
(never read: a NaN byte inside a segment shows), outputs are NaN-poisoned (an unwritten byte in use
shows). Then the products on it: the same bytes give the same dw, bit for bit, as the (M, X) form
transposed by the wgrad itself (what ran before).

Legend: M rows, N groups, X columns, I/O a linear's in/out features, H hidden, F ffn."""

# ruff: noqa: E741  (I and O are the legend's feature sizes)
from __future__ import annotations

import json

import pytest
import torch

import moekit
from helpers import assert_no_host_sync, compile_in_subprocess
from moekit.ops import grouped_mlp as grouped_mlp_module
from moekit.ops import library, quantized_mlp
from moekit.ops.kernels.grouped_wgrad_fp8 import SEGMENT_COLUMNS as KERNEL_SEGMENT_COLUMNS
from moekit.ops.quantize import SegmentedColumns, group_quantize_for_wgrad
from moekit.ops.runtime.backends import triton_unavailable_reason
from moekit.ops.runtime.quantize_torch import SEGMENT_COLUMNS, segment_pitch

qg = pytest.importorskip("moekit.ops.runtime.quantized_gemm")

ON_CPU = triton_unavailable_reason(torch.device("cpu"), torch.float32) is None
cpu_only = pytest.mark.skipif(not ON_CPU, reason="needs the Triton interpreter (TRITON_INTERPRET=1 before import)")
RECIPES = ["fp8_block", "fp8_rowwise", "mxfp8"]
WGRAD_RECIPES = ["fp8_block", "fp8_rowwise"]

# (m_splits, M, X): groups without rows first, in the middle and last, one row, sizes not multiples of
# 16, 32 or 128 (segment tails, partial scale blocks), groups across several 128-row blocks, padding
# rows, odd widths across several column tiles and the kernels' column loops.
LAYOUTS = {
    "empty-first-middle-last": ([0, 300, 0, 1, 129, 37, 0], 480, 200),
    "one-row-padding": ([1, 33, 16], 60, 70),
    "odd-width": ([5, 0, 17], 22, 33),
    "all-padding": ([0, 0], 9, 48),
    "one-group": ([64], 64, 16),
}


def offs_of(splits: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(splits, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def rows_of(M: int, X: int, used: int, device, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Rows whose columns and rows vary in magnitude (every scale block its own scale), padding rows NaN
    (never read)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, X, device=device, generator=gen) * torch.logspace(-2, 1, X, device=device)
    x = x * torch.logspace(1, -1, M, device=device)[:, None]
    x[used:] = float("nan")
    return x.to(dtype)


def check_segments(cols: SegmentedColumns, want_MX: torch.Tensor, splits: list[int], what: str) -> None:
    """cols.data against the segment layout of want_MX on every column in use (each group's rows as
    columns, then a zero tail to the segment's end), and no padding row's NaN byte inside them. Written
    out group by group here, not through `segment_transpose` (an interpreted kernel: test_quantized_wgrad
    checks it on its own)."""
    want = want_MX.view(torch.uint8)
    got = cols.data.view(torch.uint8)
    assert got.shape == (want_MX.shape[1], segment_pitch(want_MX.shape[0], len(splits))), what
    assert got.is_contiguous(), what
    col = row = 0
    for g, count in enumerate(splits):  # the layout by its definition, group by group
        width = -(-count // SEGMENT_COLUMNS) * SEGMENT_COLUMNS
        assert torch.equal(got[:, col : col + count], want[row : row + count].T), f"{what}: group {g}'s segment"
        assert torch.count_nonzero(got[:, col + count : col + width]) == 0, f"{what}: group {g}'s tail"
        col += width
        row += count
    assert not (got[:, :col] == 0xFF).any(), f"{what}: a padding row's NaN inside a segment"


def test_one_segment_width():
    """The kernels and the host agree on the layout's segment width (two constants: the torch side
    imports no triton), a whole 128-byte line, and the pitch has room for any split."""
    assert int(KERNEL_SEGMENT_COLUMNS) == SEGMENT_COLUMNS == 128
    for rows, groups in [(0, 1), (1, 1), (300, 7), (262144, 128)]:
        pitch = segment_pitch(rows, groups)
        assert pitch % SEGMENT_COLUMNS == 0
        worst = rows + (SEGMENT_COLUMNS - 1) * groups  # each segment rounds its rows up by at most 127
        assert pitch >= worst


@cpu_only
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_segments_are_segment_transpose_of_the_columnwise_form(recipe, backend, layout, nan_poison):
    """The SEGMENTS stores (triton) and the torch path write `segment_transpose` of group_quantize's
    columnwise data, its scales and, from the same launch, its rowwise form, byte for byte."""
    splits, M, X = LAYOUTS[layout]
    x = rows_of(M, X, sum(splits), torch.device("cpu"))
    if splits[0] > 2:
        # An inf: its column's block gets a NaN scale, and the segment's tail must still be zeros.
        x[2, 3] = float("inf")
    m_splits = torch.tensor(splits)  # device splits: the host never reads them
    ref = moekit.group_quantize(x, m_splits, recipe, rowwise=True, columnwise=True, backend="torch")
    row_q, cols = group_quantize_for_wgrad(x, m_splits, recipe, rowwise=True, backend=backend)
    assert isinstance(cols, SegmentedColumns) and row_q is not None and cols.rows == M
    what = f"{recipe} {backend} {layout}"
    check_segments(cols, ref.columnwise_data, splits, what)
    assert torch.equal(cols.scale_inv.view(torch.uint8), ref.columnwise_scale_inv.view(torch.uint8)), what
    assert torch.equal(row_q.rowwise_data.view(torch.uint8), ref.rowwise_data.view(torch.uint8)), what
    assert torch.equal(row_q.rowwise_scale_inv.view(torch.uint8), ref.rowwise_scale_inv.view(torch.uint8)), what
    assert row_q.columnwise_data is None and torch.equal(row_q.offsets, ref.offsets)
    # Columnwise alone: the same bytes.
    none, alone = group_quantize_for_wgrad(x, m_splits, recipe, backend=backend)
    assert none is None and isinstance(alone, SegmentedColumns)
    check_segments(alone, ref.columnwise_data, splits, what + " columnwise alone")
    # Rowwise alone (a backward whose weight needs no gradient): group_quantize's rowwise form, no columns.
    row_alone, no_cols = group_quantize_for_wgrad(x, m_splits, recipe, rowwise=True, columnwise=False, backend=backend)
    assert no_cols is None and row_alone is not None and row_alone.columnwise_data is None
    assert torch.equal(row_alone.rowwise_data.view(torch.uint8), ref.rowwise_data.view(torch.uint8)), what
    assert torch.equal(row_alone.rowwise_scale_inv.view(torch.uint8), ref.rowwise_scale_inv.view(torch.uint8)), what


@cpu_only
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_gathered_rows_are_the_gathered_tensors_bytes(recipe, backend, layout, nan_poison):
    """index=: the rows x[index] quantized where they lie in x (the kernels' GATHER loads), byte for
    byte what the same call on the gathered tensor writes, both forms and the columnwise form alone,
    with and without segments; token rows that no index names hold NaN (never read), rows named
    twice and out of order."""
    splits, M, X = LAYOUTS[layout]
    T = max(M // 2, 1) + 3
    tokens = rows_of(T, X, T, torch.device("cpu"), seed=4)
    gen = torch.Generator().manual_seed(5)
    index = torch.randint(0, T - 2, (M,), generator=gen, dtype=torch.int32)
    tokens[T - 2 :] = float("nan")  # no index names them
    gathered = tokens.index_select(0, index)
    m_splits = torch.tensor(splits)
    what = f"{recipe} {backend} {layout}"
    for rowwise in (True, False):
        want_row, want_cols = group_quantize_for_wgrad(gathered, m_splits, recipe, rowwise=rowwise, backend=backend)
        got_row, got_cols = group_quantize_for_wgrad(
            tokens, m_splits, recipe, rowwise=rowwise, index=index[:, None], backend=backend
        )
        assert isinstance(got_cols, SegmentedColumns) and isinstance(want_cols, SegmentedColumns) and got_cols.rows == M
        ref = moekit.group_quantize(gathered, m_splits, recipe, rowwise=True, columnwise=True, backend="torch")
        check_segments(got_cols, ref.columnwise_data, splits, what)
        assert torch.equal(got_cols.scale_inv.view(torch.uint8), want_cols.scale_inv.view(torch.uint8)), what
        if rowwise:
            assert got_row is not None and want_row is not None
            assert tuple(got_row.shape) == (M, X) and torch.equal(got_row.offsets, want_row.offsets), what
            for name in ("rowwise_data", "rowwise_scale_inv"):
                a, b = getattr(got_row, name).view(torch.uint8), getattr(want_row, name).view(torch.uint8)
                assert torch.equal(a, b), f"{what} {name}"
        else:
            assert got_row is None
    # Without segments (the reference path's wgrad) the rows are gathered first: the same GroupedTensor.
    got, _ = group_quantize_for_wgrad(tokens, m_splits, recipe, rowwise=True, segments=False, index=index)
    want = moekit.group_quantize(gathered, m_splits, recipe, rowwise=True, columnwise=True, backend="torch")
    assert got is not None
    assert torch.equal(got.columnwise_data.view(torch.uint8), want.columnwise_data.view(torch.uint8)), what


def test_gathered_rows_refuse_a_bad_index_in_one_line():
    x = torch.randn(8, 16)
    with pytest.raises(TypeError, match="index must be an int32 or int64 tensor"):
        group_quantize_for_wgrad(x, [4], "fp8_block", index=torch.zeros(4), backend="torch")
    with pytest.raises(ValueError, match=r"index must be \(M,\) or \(M, 1\) rows of x"):
        group_quantize_for_wgrad(x, [4], "fp8_block", index=torch.zeros(2, 2, dtype=torch.int64), backend="torch")


@cpu_only
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_layer_gathers_its_wgrad_operands_in_the_quantizer(recipe, bias, monkeypatch):
    """moe_experts' quantized backward hands the quantizer the token rows and their index for x (fc1's
    wgrad) and d out (fc2's; with an fc2 bias too, whose gradient and d probs' bias term then read d out
    through the same map): output and every gradient bit for bit those of the same layer whose wgrad
    operands are gathered first."""
    tokens, top_k, experts, hidden, ffn = 21, 3, 5, 40, 24
    g = torch.Generator().manual_seed(9)
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, 1] = -1.0  # expert 1 gets no token
    ids = scores.topk(top_k, dim=-1).indices
    inputs = dict(
        x=torch.randn(tokens, hidden, generator=g),
        topk_weights=torch.rand(tokens, top_k, generator=g),
        fc1_weight=torch.randn(experts, 2 * ffn, hidden, generator=g) / hidden**0.5,
        fc2_weight=torch.randn(experts, hidden, ffn, generator=g) / ffn**0.5,
    )
    if bias:
        inputs.update(
            fc1_bias=torch.randn(experts, 2 * ffn, generator=g), fc2_bias=torch.randn(experts, hidden, generator=g)
        )
    dy = torch.randn(tokens, hidden, generator=g)
    real = quantized_mlp.group_quantize_for_wgrad
    seen = []

    def gathered_first(x, m_splits, recipe, *, index=None, **kw):
        seen.append(index is not None)
        return real(x if index is None else x.index_select(0, index.reshape(-1)), m_splits, recipe, **kw)

    def run():
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        biases = {k: leaves[k] for k in ("fc1_bias", "fc2_bias") if k in leaves}
        y = moekit.moe_experts(
            leaves["x"], ids, leaves["topk_weights"], leaves["fc1_weight"], leaves["fc2_weight"], **biases,
            quantization=recipe, backend="triton",
        )  # fmt: skip
        y.backward(dy)
        return [y, *(leaves[k].grad for k in inputs)]

    monkeypatch.setattr(
        quantized_mlp,
        "group_quantize_for_wgrad",
        lambda *a, **kw: seen.append(kw.get("index") is not None) or real(*a, **kw),
    )
    fused = run()
    assert seen.count(True) == 2, seen  # x's and d out's
    seen.clear()
    monkeypatch.setattr(quantized_mlp, "group_quantize_for_wgrad", gathered_first)
    apart = run()
    assert seen.count(True) == 2, seen
    for name, a, b in zip(["out", *inputs], fused, apart, strict=True):
        assert torch.equal(a, b), f"{name}: {(a != b).sum()} values differ"


@cpu_only
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_without_segments_it_is_group_quantize(recipe):
    """segments=False (the reference path's wgrad): one GroupedTensor with both forms, given twice."""
    x, splits = rows_of(40, 24, 37, torch.device("cpu")), [10, 0, 27]
    row_q, cols = group_quantize_for_wgrad(x, splits, recipe, rowwise=True, segments=False, backend="triton")
    ref = moekit.group_quantize(x, splits, recipe, rowwise=True, columnwise=True, backend="triton")
    assert row_q is cols and isinstance(cols, moekit.GroupedTensor)
    assert torch.equal(cols.columnwise_data.view(torch.uint8), ref.columnwise_data.view(torch.uint8))


def test_bad_inputs_refused_in_one_line():
    w = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="x must be \\(rows, cols\\)"):
        group_quantize_for_wgrad(w, [4, 4], "fp8_block", backend="torch")
    with pytest.raises(ValueError, match="recipe"):
        group_quantize_for_wgrad(torch.randn(8, 16), [8], "fp9", backend="torch")
    with pytest.raises(ValueError, match="needs rowwise or columnwise"):
        group_quantize_for_wgrad(torch.randn(8, 16), [8], "fp8_block", columnwise=False, backend="torch")


@cpu_only
def test_wgrad_refuses_operands_not_in_the_layout():
    x = rows_of(40, 24, 40, torch.device("cpu"))
    _, cols = group_quantize_for_wgrad(x, [10, 30], "fp8_rowwise", backend="triton")
    assert isinstance(cols, SegmentedColumns)
    offs = offs_of([10, 30])
    with pytest.raises(ValueError, match=r"must be a contiguous \(X, \d+\) operand"):
        qg.quantized_gemm_wgrad(
            "fp8_rowwise", cols.data[:, :16], cols.scale_inv, cols.data, cols.scale_inv, offs,
            out_dtype=torch.float32, segmented_rows=40,
        )  # fmt: skip
    with pytest.raises(ValueError, match="segmented_rows"):
        qg.quantized_gemm_wgrad(
            "fp8_rowwise", cols.data, cols.scale_inv, cols.data, cols.scale_inv, offs,
            out_dtype=torch.float32, segmented_rows=40 + SEGMENT_COLUMNS,
        )  # fmt: skip


def wgrad_both_ways(recipe, splits, M, I, O, device, dtype, out_dtype):
    """dw from SegmentedColumns (no transpose pass) and from the (M, X) columnwise forms (the wgrad
    transposes them: what ran before), on the same quantizations."""
    used = sum(splits)
    dy, x = rows_of(M, O, used, device, dtype, seed=1), rows_of(M, I, used, device, dtype, seed=2)
    m_splits = torch.tensor(splits, device=device)
    offs = offs_of(splits).to(device)
    dq = moekit.group_quantize(dy, m_splits, recipe, rowwise=False, columnwise=True, backend="triton")
    xq = moekit.group_quantize(x, m_splits, recipe, rowwise=False, columnwise=True, backend="triton")
    old = qg.quantized_gemm_wgrad(
        recipe, dq.columnwise_data, dq.columnwise_scale_inv, xq.columnwise_data, xq.columnwise_scale_inv, offs,
        out_dtype=out_dtype,
    )  # fmt: skip
    result = {}

    def step():
        _, dyc = group_quantize_for_wgrad(dy, m_splits, recipe, backend="triton")
        _, xc = group_quantize_for_wgrad(x, m_splits, recipe, backend="triton")
        assert isinstance(dyc, SegmentedColumns) and isinstance(xc, SegmentedColumns)
        result["cols"] = (dyc, xc)
        result["dw"] = qg.quantized_gemm_wgrad(
            recipe, dyc.data, dyc.scale_inv, xc.data, xc.scale_inv, offs, out_dtype=out_dtype, segmented_rows=M
        )

    if device.type == "cuda":
        assert_no_host_sync(step)
    else:
        step()
    dyc, xc = result["cols"]
    check_segments(dyc, dq.columnwise_data, splits, f"{recipe} dy")
    check_segments(xc, xq.columnwise_data, splits, f"{recipe} x")
    return result["dw"], old


@cpu_only
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_wgrad_on_segments_is_bit_equal_to_the_transposing_wgrad(recipe, nan_poison):
    dw, old = wgrad_both_ways(
        recipe, [0, 130, 1, 0, 37], 180, 40, 24, torch.device("cpu"), torch.float32, torch.float32
    )
    assert not torch.isnan(dw).any()
    assert torch.equal(dw, old)


@cpu_only
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_grouped_linear_takes_segments_and_dw_is_bit_equal(recipe, monkeypatch):
    """grouped_linear's FP8 wgrad gets SegmentedColumns (the op sees segmented_rows = M) and gives the dw
    that the wgrad on the (M, X) forms gives, bit for bit; dx unchanged."""
    seen = []
    real = library.quantized_linear_wgrad
    monkeypatch.setattr(library, "quantized_linear_wgrad", lambda *a: seen.append(a[-1]) or real(*a))
    splits, padding, I, O = [9, 0, 130, 1], 4, 40, 24
    M = sum(splits) + padding
    x, up = rows_of(M, I, M, torch.device("cpu"), seed=3), rows_of(M, O, M, torch.device("cpu"), seed=4)
    w = (torch.randn(len(splits), O, I, generator=torch.Generator().manual_seed(5)) / I**0.5).requires_grad_(True)
    m_splits = torch.tensor(splits)
    xl = x.clone().requires_grad_(True)
    moekit.grouped_linear(xl, w, m_splits, quantization=recipe, backend="triton").backward(up)
    assert seen == [M]
    offs = offs_of(splits)
    xq = moekit.group_quantize(x, m_splits, recipe, rowwise=False, columnwise=True, backend="triton")
    dq = moekit.group_quantize(up, m_splits, recipe, rowwise=True, columnwise=True, backend="triton")
    want = qg.quantized_gemm_wgrad(
        recipe, dq.columnwise_data, dq.columnwise_scale_inv, xq.columnwise_data, xq.columnwise_scale_inv, offs,
        out_dtype=torch.float32,
    )  # fmt: skip
    assert torch.equal(w.grad, want)
    assert xl.grad is not None and not torch.isnan(xl.grad[: sum(splits)]).any()


def _forced_old_layout(
    x, m_splits, recipe, *, rowwise=False, columnwise=True, segments=True, index=None, backend="auto"
):
    return group_quantize_for_wgrad(
        x, m_splits, recipe, rowwise=rowwise, columnwise=columnwise, segments=False, index=index, backend=backend
    )


@cpu_only
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_quantized_mlp_grads_are_bit_equal_to_the_transposing_wgrad(recipe, monkeypatch):
    """The quantized MLP's two backward nodes give the same gradients, bit for bit, with the segments
    as with the old (M, X) forms that the wgrad transposes itself; the op sees which. (fc2's activation
    operand, which the gated kernel writes into the segments itself where it runs, is made by
    `group_quantize_for_wgrad` in the old-layout run.)"""
    seen = []
    real = library.quantized_linear_wgrad
    monkeypatch.setattr(library, "quantized_linear_wgrad", lambda *a: seen.append(a[-1]) or real(*a))
    splits, H, F = [7, 0, 40, 1], 32, 24
    M = sum(splits) + 3
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(M, H, generator=gen)
    w1, w2 = torch.randn(4, 2 * F, H, generator=gen) / H**0.5, torch.randn(4, H, F, generator=gen) / F**0.5
    probs, up = torch.rand(M, generator=gen), torch.randn(M, H, generator=gen)

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2, probs)]
        y = moekit.grouped_mlp(
            leaves[0], leaves[1], leaves[2], torch.tensor(splits), probs=leaves[3], quantization=recipe,
            backend="triton",
        )  # fmt: skip
        y.backward(up)
        return [t.grad for t in leaves]

    new = grads()
    assert seen == [M, M], seen
    seen.clear()
    monkeypatch.setattr(quantized_mlp, "group_quantize_for_wgrad", _forced_old_layout)
    monkeypatch.setattr(grouped_mlp_module, "held_columns_unavailable_reason", lambda *a: "the old layout")
    old = grads()
    assert seen == [None, None], seen
    for name, a, b in zip(("x", "w1", "w2", "probs"), new, old, strict=True):
        assert torch.equal(a, b), name


_COMPILE_SEGMENTS_FOR_SM90 = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moekit.ops.kernels import quantize as K

PT = {"x_ptr": "*bf16", "offs_ptr": "*i64", "slot_offs_ptr": "*i64", "noop_ptr": "*fp32", "row_data_ptr": "*u8",
      "row_scale_ptr": "*fp32", "col_data_ptr": "*u8", "col_scale_ptr": "*fp32", "row_amax_ptr": "*i32",
      "col_amax_ptr": "*i32", "index_ptr": "*i32", "rec_ptr": "*i32"}
DIV16 = {"cols", "stride_x", "pitch", "stride_row_scale"}  # as the launcher specializes them (multiples of 16)

def stores(kernel, const, warps):
    sig, attrs = {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n], attrs[(i,)] = PT[n], [["tt.divisibility", 16]]
        else:
            sig[n] = "i32"
            if n in DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    # x's loads: 16-byte ld.global or cp.async (the pipelined loops' copies to shared memory), by kind and size.
    copies = re.findall(r"(cp\.async\.c[ag])\.shared\.global [^;]*, (0x[0-9a-f]+), ", ptx)
    wide = {f"{kind}.{int(size, 16)}" for kind, size in copies if int(size, 16) == 16}
    wide |= {op for op in re.findall(r"ld\.global[\w.]*", ptx) if "v4" in op}
    return {"st": sorted(set(re.findall(r"st\.global[\w.]*", ptx))), "wide_loads": sorted(wide)}

seg, gather = json.loads(sys.argv[1]), json.loads(sys.argv[2])
from moekit.ops.runtime.configs import QUANTIZE_SLOTS
out = {}
for recipe, tile_k in (("fp8_block", 128), ("mxfp8", 32)):
    layout = ("segments-gathered" if gather else "segments") if seg else "rows"
    block_c, chunk, warps, stages, band, _ = QUANTIZE_SLOTS["sm90"][(tile_k, layout)]
    slots = dict(MX=tile_k == 32, ROWWISE=True, SEGMENTS=seg, TILE_K=tile_k, SLOT_ROWS=128 if tile_k == 128 else 32,
                 BLOCK_C=block_c, CHUNK=chunk, STAGES=stages, BAND=band, HAS_NOOP=False, HW_E4M3=True,
                 GATHER=gather)
    out[recipe] = stores(K.quantize_slots_kernel, slots, warps)
spans = dict(ROWWISE=True, SEGMENTS=seg, HAS_NOOP=False, SPAN=32, BLOCK_COLS=128, STEPS=8, STAGES=2,
             BLOCK_GROUPS=256, HW_E4M3=True, GATHER=gather)
out["fp8_rowwise"] = stores(K.quantize_spans_kernel, spans, 8)
print(json.dumps(out))
"""


def test_segment_stores_are_16_bytes_wide_on_sm90():
    """On sm_90 (the sm90 configurations, bf16 input, both forms) the SEGMENTS stores are as wide as the
    (M, X) form's: 16-byte st.global (plus the scales' 4-byte stores), no byte stores, so the
    transposed columnwise bytes go out coalesced along the destination's contiguous rows; with rows
    gathered by an index (GATHER) the same stores, and x's rows still loaded 16 bytes at a time. In its
    own process (compiling for a GPU needs TRITON_INTERPRET unset)."""
    for seg in (False, True):
        plain, gathered = (
            compile_in_subprocess(_COMPILE_SEGMENTS_FOR_SM90, json.dumps(seg), json.dumps(gather))
            for gather in (False, True)
        )
        for recipe, kinds in plain.items():
            assert kinds["st"] == ["st.global.b32", "st.global.v4.b32"], (seg, recipe, kinds)
            assert gathered[recipe]["st"] == kinds["st"], (seg, recipe, gathered[recipe])
            # 16-byte loads both (cp.async where a pipelined walk stages them, else ld.global.v4)
            assert kinds["wide_loads"] and gathered[recipe]["wide_loads"], (seg, recipe, kinds, gathered[recipe])


# --------------------------------------------------------------------------------------------------
# GPU (-m gpu): the same bytes at realistic sizes, skewed splits, no host sync
# --------------------------------------------------------------------------------------------------

GPU_SHAPES = [
    pytest.param(4096, 2048, 1536, [0, 700, 512, 1300, 900, 333, 1, 48], id="M4096-skewed-empty-padding"),
    pytest.param(16384, 7168, 2048, [384, 640, 129, 0, 1, 3000, 2047, 127] * 2, id="M16384-ragged"),
    pytest.param(65536, 2048, 768, [8000, 0, 1, 17, 30000, 4095, 129, 0] + [2800] * 8, id="M65536-skewed-16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("M, I, O, splits", GPU_SHAPES)
@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
def test_gpu_segments_bytes_and_wgrad_bit_equal(recipe, M, I, O, splits):
    """On the GPU, bf16 rows: the SEGMENTS bytes are segment_transpose of the (M, X) form on every column
    in use (padding rows NaN, never read), with no host sync, and the wgrad on them is bit-equal to the
    wgrad that transposes the (M, X) forms itself."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    dw, old = wgrad_both_ways(recipe, splits, M, I, O, device, torch.bfloat16, torch.bfloat16)
    assert not torch.isnan(dw).any()
    assert torch.equal(dw, old)
