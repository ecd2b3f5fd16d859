"""The raw Triton grouped GEMM kernels (moekit.ops.grouped_gemm's launchers, called directly with
fixed configurations and operand paths) against float64 references. The public ops on the triton
backend are tested in test_triton_backend.py.

legend: M routed rows, N groups (experts), I in_features, O out_features.

On a machine without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1 is set
here, before triton is imported; run this file in its own pytest process). The Triton 3.6
interpreter gets bfloat16 wrong (dot operands as raw integers, truncating casts), so CPU tests use
float32 and float16. GPU tests (`-m gpu`) run the real kernels in bfloat16.
Tolerance (in the spirit of tests/conftest.py's rule): a low-precision result may be off the float64
reference by at most 2x the error of torch's own computation in the same precision, plus a small eps.
"""

# ruff: noqa: E741  (I and O are the legend's feature sizes)
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

gg = pytest.importorskip("moekit.ops.runtime.gemm")
import moekit  # noqa: E402
from helpers import (  # noqa: E402
    check_against_reference,
    compile_in_subprocess,
    main_loop_spills,
    rand,
    torch_glu,
    torch_grouped_mlp,
)
from moekit.ops.activations import ACTIVATIONS  # noqa: E402
from moekit.ops.glu import glu_reference  # noqa: E402
from moekit.ops.runtime import configs, launch  # noqa: E402
from moekit.ops.runtime import glu as rglu  # noqa: E402
from moekit.reference import grouped_mlp_reference  # noqa: E402

ON_CPU = launch.unavailable_reason("cpu", torch.float32) is None
cpu_only = pytest.mark.skipif(not ON_CPU, reason="needs the Triton interpreter (TRITON_INTERPRET=1 before import)")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---------------------------------------------------------------------------------------------
# references and helpers
# ---------------------------------------------------------------------------------------------


def offs_of(splits, device):
    o = [0]
    for s in splits:
        o.append(o[-1] + s)
    return torch.tensor(o, device=device, dtype=torch.int64)


def ref_forward(x, w, splits, bias=None, scale=None, dtype=torch.float64):
    """Per-group torch matmul in `dtype`; padding rows zero."""
    y = torch.zeros(x.shape[0], w.shape[1], dtype=dtype, device=x.device)
    r = 0
    for g, m in enumerate(splits):
        if m:
            y[r : r + m] = x[r : r + m].to(dtype) @ w[g].to(dtype).T
            if bias is not None:
                b = bias[g].to(dtype)[None]
                y[r : r + m] += b * scale[r : r + m].to(dtype)[:, None] if scale is not None else b
        r += m
    return y


def ref_dgrad(dy, w, splits, dtype=torch.float64):
    dx = torch.zeros(dy.shape[0], w.shape[2], dtype=dtype, device=dy.device)
    r = 0
    for g, m in enumerate(splits):
        if m:
            dx[r : r + m] = dy[r : r + m].to(dtype) @ w[g].to(dtype)
        r += m
    return dx


def ref_wgrad(dy, x, splits, dtype=torch.float64):
    N = len(splits)
    dw = torch.zeros(N, dy.shape[1], x.shape[1], dtype=dtype, device=dy.device)
    db = torch.zeros(N, dy.shape[1], dtype=dtype, device=dy.device)
    r = 0
    for g, m in enumerate(splits):
        if m:
            dw[g] = dy[r : r + m].to(dtype).T @ x[r : r + m].to(dtype)
            db[g] = dy[r : r + m].to(dtype).sum(0)
        r += m
    return dw, db


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def assert_close(out, ref64, torch_same_precision, dtype):
    """The tolerance rule: error <= 2x torch's own error in the same precision + eps."""
    assert torch.isfinite(out).all(), "non-finite values (unwritten output?)"
    err = rel_err(out, ref64)
    if dtype == torch.float32:
        assert err < 1e-5, err
    else:
        torch_err = rel_err(torch_same_precision, ref64)
        assert err <= 2 * torch_err + 1e-4, (err, torch_err)


@pytest.fixture
def nan_outputs(nan_poison):
    """Every output the runtime allocates (`launch.empty`, torch.empty) starts as NaN, so an element the
    kernels skip fails."""


def make_problem(M, N, O, I, splits, dtype, device, bias=False, scale=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, I, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(N, O, I, generator=gen) / I**0.5).to(device=device, dtype=dtype)
    dy = torch.randn(M, O, generator=gen).to(device=device, dtype=dtype)
    used = sum(splits)
    # Padding rows hold NaN: they must produce zeros and contribute nothing.
    x[used:] = float("nan")
    dy[used:] = float("nan")
    b = torch.randn(N, O, generator=gen).to(device=device, dtype=dtype) if bias else None
    s = torch.rand(M, generator=gen).to(device=device) if scale else None
    return x, w, dy, b, s


def check_all(M, N, O, I, splits, dtype, device, bias=False, scale=False, **kw):
    x, w, dy, b, s = make_problem(M, N, O, I, splits, dtype, device, bias, scale)
    offs = offs_of(splits, device)
    used = sum(splits)
    xs, dys = x[:used], dy[:used]
    # forward
    y = gg.grouped_gemm_forward(x, w, offs, b, s, **kw)
    assert y.shape == (M, O) and y.dtype == dtype
    assert (y[used:] == 0).all(), "padding rows must be exact zeros"
    assert_close(y[:used], ref_forward(xs, w, splits, b, s), ref_forward(xs, w, splits, b, s, dtype=dtype), dtype)
    # dgrad
    dx = gg.grouped_gemm_dgrad(dy, w, offs, **kw)
    assert dx.shape == (M, I) and dx.dtype == dtype
    assert (dx[used:] == 0).all()
    assert_close(dx[:used], ref_dgrad(dys, w, splits), ref_dgrad(dys, w, splits, dtype=dtype), dtype)
    # wgrad + dbias
    dw = gg.grouped_gemm_wgrad(dy, x, offs, **kw)
    db = gg.group_row_sum(dy, offs)
    assert dw.shape == (N, O, I) and db.shape == (N, O) and dw.dtype == db.dtype == dtype
    rdw, rdb = ref_wgrad(dys, xs, splits)
    tdw, tdb = ref_wgrad(dys, xs, splits, dtype=dtype)
    for g, m in enumerate(splits):
        if m == 0:
            assert (dw[g] == 0).all() and (db[g] == 0).all(), f"empty group {g} must get zeros"
    assert_close(dw, rdw, tdw, dtype)
    assert_close(db, rdb, tdb, dtype)
    dw2, db2 = gg.grouped_gemm_wgrad(dy, x, offs, **kw), gg.group_row_sum(dy, offs)
    assert torch.equal(dw, dw2) and torch.equal(db, db2), "wgrad/row sum must be deterministic"
    if s is not None:  # the probs-scaled row sum of fc2's bias gradient: products in fp32, like ours
        scaled = dys.double() * s[:used, None].double()
        assert_close(
            gg.group_row_sum(dy, offs, s),
            ref_wgrad(scaled, xs, splits)[1],
            ref_wgrad(scaled.float(), xs, splits, dtype=torch.float32)[1].to(dtype),
            dtype,
        )
    return y, dx, dw, db


# ---------------------------------------------------------------------------------------------
# CPU: the kernels under the Triton interpreter
# ---------------------------------------------------------------------------------------------

# (M rows, N groups, O, I, splits, bias, bias_scale); O, I of 97/33 take the pointer-load path
# (rows not 16-byte aligned), 72/40 the TMA-descriptor path.
CASES = {
    "empty_first": (70, 3, 72, 40, [0, 40, 30], False, False),
    "empty_middle": (70, 3, 72, 40, [33, 0, 37], True, False),
    "empty_last": (70, 3, 72, 40, [50, 20, 0], True, True),
    "all_rows_on_one": (64, 4, 72, 40, [0, 0, 64, 0], False, False),
    "one_row": (1, 2, 72, 40, [0, 1], True, True),
    "sum_lt_rows": (90, 3, 72, 40, [20, 0, 31], True, True),
    "prime_N_odd_dims": (60, 7, 97, 33, [5, 0, 17, 9, 0, 20, 3], True, True),
    "odd_dims_sum_lt_rows": (50, 2, 33, 97, [0, 37], False, False),
    "small_dims": (40, 3, 8, 4, [10, 25, 5], True, False),
}


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_interpreter_matches_reference(case, dtype, nan_outputs):
    M, N, O, I, splits, bias, scale = CASES[case]
    check_all(M, N, O, I, splits, dtype, "cpu", bias, scale)


# Every code path of the kernels: TMA or pointer loads, fused (flattened) or nested tile loops,
# TMA-store or masked-store epilogues.
PATHS = [
    pytest.param(
        use_tma,
        flatten,
        epi,
        id=f"{'tma' if use_tma else 'ptr'}-{'flat' if flatten else 'nested'}-{'tmastore' if epi else 'store'}",
    )
    for use_tma in (True, False)
    for flatten in (True, False)
    for epi in (True, False)
    if use_tma or not epi
]


@cpu_only
@pytest.mark.parametrize("use_tma,flatten,epi", PATHS)
def test_interpreter_code_paths(use_tma, flatten, epi, nan_outputs):
    # 32 rows: whole K tiles and interior m-tiles (whole-tensor descriptors); 1 and 33 rows:
    # ragged groups (descriptors bounded at the group's end); rows 66..74: padding.
    cfg = configs.GemmConfig(16, 32, 16, 2, 1, 4, flatten, epi)
    check_all(75, 4, 48, 40, [0, 32, 1, 33], torch.float32, "cpu", True, True, cfg=cfg, use_tma=use_tma)


@cpu_only
def test_interpreter_wgrad_ragged_tails(nan_outputs):
    # A ragged group's last K step reads past the group: its dy rows must come in as zeros (per-
    # group descriptor) and the padding rows of x (NaN here) as zeros too (x's descriptor ends at
    # offs[N]). Six tiles per group over four programs: programs meet a group on consecutive tiles
    # (descriptor reuse). Groups: ragged, empty, whole K steps, one row, ragged into the padding.
    cfg = configs.GemmConfig(16, 32, 16, 2, 1, 4, True, True)
    splits = [35, 0, 32, 1, 24]
    x, w, dy, _, _ = make_problem(100, 5, 96, 64, splits, torch.float32, "cpu", False, False)
    used = sum(splits)
    dw = gg.grouped_gemm_wgrad(dy, x, offs_of(splits, "cpu"), cfg=cfg, use_tma=True)
    rdw, _ = ref_wgrad(dy[:used], x[:used], splits)
    tdw, _ = ref_wgrad(dy[:used], x[:used], splits, dtype=torch.float32)
    assert (dw[1] == 0).all()
    for g in (0, 2, 3, 4):
        assert_close(dw[g], rdw[g], tdw[g], torch.float32)


def gathered_wgrad_problem(splits, pad, T, O, I, dtype, device, seed=1):
    """Operands of a wgrad over sum(splits) + pad routed rows whose dy and x rows are read through row
    maps: dy_T (T, O) and x_T (T, I) source rows (row T - 1 NaN: no valid map entry points at it), maps
    into them (padding entries point at the NaN row: they must not be read), and the gathered
    (M, O) / (M, I) operands with NaN padding rows."""
    gen = torch.Generator().manual_seed(seed)
    used = sum(splits)
    M = used + pad
    dy_T = torch.randn(T, O, generator=gen).to(device=device, dtype=dtype)
    x_T = torch.randn(T, I, generator=gen).to(device=device, dtype=dtype)
    dy_T[T - 1] = float("nan")
    x_T[T - 1] = float("nan")
    dy_rows = torch.randint(0, T - 1, (M,), generator=gen)
    x_rows = torch.randint(0, T - 1, (M,), generator=gen)
    dy_rows[used:] = T - 1
    x_rows[used:] = T - 1
    dy_rows, x_rows = dy_rows.to(device), x_rows.to(device)
    return dy_T, x_T, dy_rows, x_rows, dy_T[dy_rows], x_T[x_rows]


@cpu_only
@pytest.mark.parametrize(
    "use_tma,flatten", [(True, True), (True, False), (False, True)], ids=["tma-flat", "tma-nested", "ptr"]
)
@pytest.mark.parametrize("gathered", ["x", "dy", "both"])
def test_interpreter_wgrad_gathered_rows(use_tma, flatten, gathered, nan_outputs):
    """wgrad with an operand read through a row map (x's token rows in the layer's fc1 wgrad, d out's in
    fc2's): bit for bit the wgrad of the gathered rows (same configuration), within the rule of float64.
    Groups: ragged, empty, whole K steps, one row, ragged into the padding (whose map entries point at a
    NaN row, never to be read); the non-gathered operand's padding rows are NaN too."""
    cfg = configs.GemmConfig(16, 32, 16, 2, 1, 4, flatten, use_tma)
    splits = [35, 0, 32, 1, 24]
    dy_T, x_T, dy_rows, x_rows, dy_M, x_M = gathered_wgrad_problem(splits, 9, 50, 96, 64, torch.float32, "cpu")
    offs = offs_of(splits, "cpu")
    maps = {
        "x": dict(x_rows=x_rows),
        "dy": dict(dy_rows=dy_rows.to(torch.int32)),
        "both": dict(dy_rows=dy_rows, x_rows=x_rows),
    }[gathered]
    dy_in = dy_T if "dy_rows" in maps else dy_M
    x_in = x_T if "x_rows" in maps else x_M
    dw = gg.grouped_gemm_wgrad(dy_in, x_in, offs, cfg=cfg, use_tma=use_tma, **maps)
    assert torch.equal(dw, gg.grouped_gemm_wgrad(dy_M, x_M, offs, cfg=cfg, use_tma=use_tma))
    used = sum(splits)
    rdw, _ = ref_wgrad(dy_M[:used], x_M[:used], splits)
    tdw, _ = ref_wgrad(dy_M[:used], x_M[:used], splits, dtype=torch.float32)
    assert (dw[1] == 0).all()
    for g in (0, 2, 3, 4):
        assert_close(dw[g], rdw[g], tdw[g], torch.float32)


@cpu_only
def test_interpreter_wgrad_gathered_no_rows_and_one_row(nan_outputs):
    """Edges of the gathered wgrad: no routed rows at all (an empty map: every group's gradient zeros,
    the source rows never read), and one routed row in one group."""
    x_T, dy = torch.randn(7, 16), torch.randn(0, 8)
    dw = gg.grouped_gemm_wgrad(dy, x_T, offs_of([0, 0, 0], "cpu"), x_rows=torch.zeros(0, dtype=torch.int64))
    assert dw.shape == (3, 8, 16) and (dw == 0).all()
    dy1, rows = torch.randn(1, 8), torch.tensor([5])
    dw = gg.grouped_gemm_wgrad(dy1, x_T, offs_of([0, 1], "cpu"), x_rows=rows)
    assert (dw[0] == 0).all()
    assert_close(dw[1], dy1.double().T @ x_T[5:6].double(), dy1.T @ x_T[5:6], torch.float32)


def test_wgrad_row_maps_are_checked():
    x, dy = torch.randn(10, 8), torch.randn(6, 4)
    offs = offs_of([3, 3], "cpu")
    rows = torch.arange(6)
    with pytest.raises(ValueError, match="x_rows must be int32 or int64"):
        gg.grouped_gemm_wgrad(dy, x, offs, x_rows=rows.float())
    with pytest.raises(ValueError, match=r"x_rows must be \(M,\) or \(M, 1\)"):
        gg.grouped_gemm_wgrad(dy, x, offs, x_rows=rows.view(2, 3))
    with pytest.raises(ValueError, match="must have the same number of rows"):
        gg.grouped_gemm_wgrad(dy, x, offs, x_rows=rows[:5])
    with pytest.raises(ValueError, match="must have the same number of rows"):
        gg.grouped_gemm_wgrad(dy, x, offs)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gathered", [False, True])
def test_interpreter_row_sum_and_dot(dtype, gathered, nan_outputs):
    """fc2's bias gradient and d probs' bias term from one pass (`group_row_sum_and_dot`): per-group sums
    of src's rows times the row scale, and <src[r], vec[group of r]>, against float64; an empty group,
    rows past sum(splits) (padding: never read, their dot 0) and an odd width. Gathered: the rows are
    src[rows[r]] of (T, C) token rows read through the map, bit for bit the sums of the gathered copy; the
    token rows no used row names are NaN, so a row read wrongly shows."""
    splits, M, C, T = [7, 0, 19, 5], 35, 37, 13
    gen = torch.Generator().manual_seed(3)
    offs = offs_of(splits, "cpu")
    used = sum(splits)
    vec = torch.randn(len(splits), C, generator=gen).to(dtype)
    scale = torch.rand(M, generator=gen).to(dtype)
    if gathered:
        tokens = torch.randn(T, C, generator=gen).to(dtype)
        rows = torch.randint(0, T - 2, (M,), generator=gen)
        rows[used:] = T - 1  # padding rows name a NaN row
        tokens[T - 2 :] = float("nan")  # the rows only padding rows name (or none)
        src, src_M = tokens, tokens[rows]
    else:
        src = src_M = torch.randn(M, C, generator=gen).to(dtype)
        src[used:] = float("nan")  # padding rows: never read
        rows = None
    sums, dots = gg.group_row_sum_and_dot(src, offs, vec, scale, rows=rows)
    assert sums.shape == (len(splits), C) and sums.dtype == dtype and dots.shape == (M,) and dots.dtype == torch.float32
    group = torch.repeat_interleave(torch.arange(len(splits)), torch.tensor(splits))
    x64 = src_M[:used].double()
    want_dots = (x64 * vec.double()[group]).sum(-1)
    want_sums = torch.zeros(len(splits), C, dtype=torch.float64).index_add_(0, group, x64 * scale[:used, None].double())
    same_sums = torch.zeros(len(splits), C, dtype=dtype).index_add_(0, group, src_M[:used] * scale[:used, None])
    assert_close(sums, want_sums, same_sums, dtype)
    assert (dots[used:] == 0).all(), "padding rows get no dot"
    assert_close(dots[:used], want_dots, (src_M[:used] * vec[group]).sum(-1), torch.float32)
    assert (sums[1] == 0).all(), "the empty group sums to zero"
    if gathered:
        copy_sums, copy_dots = gg.group_row_sum_and_dot(src_M, offs, vec, scale)
        assert torch.equal(sums, copy_sums) and torch.equal(dots, copy_dots)


@cpu_only
def test_interpreter_many_tiles_per_program(nan_outputs):
    # More tiles than programs, groups that end mid-tile, and a padding pseudo-group: the
    # persistent schedule must visit every tile exactly once.
    cfg = configs.GemmConfig(16, 16, 16, 2, 1, 4, True, True)
    check_all(130, 5, 40, 24, [17, 0, 50, 33, 9], torch.float32, "cpu", True, False, cfg=cfg, use_tma=True)


@cpu_only
def test_interpreter_empty_inputs(nan_outputs):
    offs = torch.zeros(4, dtype=torch.int64)
    x = torch.randn(0, 8)
    w = torch.randn(3, 16, 8)
    assert gg.grouped_gemm_forward(x, w, offs).shape == (0, 16)
    dw, db = gg.grouped_gemm_wgrad(torch.randn(0, 16), x, offs), gg.group_row_sum(torch.randn(0, 16), offs)
    assert (dw == 0).all() and (db == 0).all() and dw.shape == (3, 16, 8)
    # all rows padding
    x = torch.randn(5, 8)
    y = gg.grouped_gemm_forward(x, w, offs)
    assert (y == 0).all()


@cpu_only
def test_interpreter_strided_weight_view(nan_outputs):
    # w may be any 3D view whose last dim has stride 1 (here: every other expert of a bigger stack).
    x = torch.randn(30, 16)
    big = torch.randn(6, 24, 16)
    w = big[::2]
    offs = offs_of([10, 0, 20], "cpu")
    y = gg.grouped_gemm_forward(x, w, offs)
    torch.testing.assert_close(y.double(), ref_forward(x, w, [10, 0, 20]), rtol=1e-5, atol=1e-5)
    dy = torch.randn(30, 24)
    dx = gg.grouped_gemm_dgrad(dy, w, offs)
    torch.testing.assert_close(dx.double(), ref_dgrad(dy, w, [10, 0, 20]), rtol=1e-5, atol=1e-5)


def test_bad_arguments():
    x = torch.randn(10, 8)
    w = torch.randn(3, 16, 8)
    if ON_CPU:
        with pytest.raises(ValueError, match="offs"):
            gg.grouped_gemm_forward(x, w, torch.zeros(3, dtype=torch.int64))
        with pytest.raises(ValueError, match="columns"):
            gg.grouped_gemm_forward(torch.randn(10, 7), w, torch.zeros(4, dtype=torch.int64))
        with pytest.raises(ValueError):
            gg.grouped_gemm_forward(x, w.double(), torch.zeros(4, dtype=torch.int64))
    assert "int32" in launch.unavailable_reason("cpu", torch.int32)
    assert launch.unavailable_reason("meta", torch.float32) is not None


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernels in bfloat16
# ---------------------------------------------------------------------------------------------

GPU_CASES = {
    "gptoss_dims_edges": (4096, 8, 2880, 2880, [0, 700, 0, 1000, 377, 901, 1000, 0], True, True),
    "prime_N_skewed": (3000, 7, 1536, 1024, [1, 1499, 0, 500, 17, 600, 300], True, False),
    "all_rows_on_one": (2048, 4, 512, 768, [0, 0, 2048, 0], False, False),
    "one_row": (64, 3, 256, 128, [0, 1, 0], True, True),
    "odd_dims_pointer_path": (1000, 5, 97, 33, [0, 300, 0, 450, 200], True, True),
    "small_dims": (500, 6, 16, 8, [10, 0, 90, 300, 0, 50], False, False),
}


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
def test_gpu_matches_reference(case, dtype, nan_outputs):
    M, N, O, I, splits, bias, scale = GPU_CASES[case]
    check_all(M, N, O, I, splits, dtype, "cuda", bias, scale)


@gpu
@needs_cuda
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_gpu_every_candidate(op, nan_outputs):
    # Each tuning candidate (loop structure, epilogue) must be exact on its own: the autotuner may
    # pick any of them. Ragged, empty and one-row groups, NaN padding rows.
    splits = [1000, 0, 777, 1, 2048, 63, 65, 0, 1500]
    M, N, O, I = 6000, len(splits), 1024, 768
    x, w, dy, b, _ = make_problem(M, N, O, I, splits, torch.bfloat16, "cuda", bias=True)
    offs = offs_of(splits, "cuda")
    used = sum(splits)
    # op -> (reference in a dtype, our product with a config, its output width N)
    products = {
        "fwd": (
            lambda d: ref_forward(x[:used], w, splits, b, dtype=d),
            lambda cfg: gg.grouped_gemm_forward(x, w, offs, b, cfg=cfg, use_tma=True),
            O,
        ),
        "dgrad": (
            lambda d: ref_dgrad(dy[:used], w, splits, dtype=d),
            lambda cfg: gg.grouped_gemm_dgrad(dy, w, offs, cfg=cfg, use_tma=True),
            I,
        ),
        "wgrad": (
            lambda d: ref_wgrad(dy[:used], x[:used], splits, dtype=d)[0],
            lambda cfg: gg.grouped_gemm_wgrad(dy, x, offs, cfg=cfg, use_tma=True),
            I,
        ),
    }
    ref, run, n = products[op]
    ref64, ref_bf16 = ref(torch.float64), ref(torch.bfloat16)
    for cfg in configs.gemm_candidates(op, torch.bfloat16, True, "sm90", n):
        out = run(cfg)
        if op == "wgrad":
            assert (out[1] == 0).all() and (out[7] == 0).all(), cfg
            for g in range(N):
                if splits[g]:  # per group: a wrong one-row group would hide in a global norm
                    assert_close(out[g], ref64[g], ref_bf16[g], torch.bfloat16)
        else:
            assert (out[used:] == 0).all(), cfg
            assert_close(out[:used], ref64, ref_bf16, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("gathered", ["x", "dy"])
def test_gpu_wgrad_gathered_rows_bit_for_bit(gathered, nan_outputs):
    """On the GPU (TMA for the other operand, cp.async pointer loads for the gathered one): the wgrad of
    the rows read through a row map equals the wgrad of the gathered rows bit for bit, at the layer's
    shapes (fc1: O = 2F, I = H, x gathered; fc2: O = H, I = F, dy gathered), ragged, empty and one-row
    groups, padding map entries pointing at a NaN row."""
    splits = [1000, 0, 777, 1, 2048, 63, 65, 0, 1500]
    O, I = (512, 2048) if gathered == "x" else (2048, 256)
    dy_T, x_T, dy_rows, x_rows, dy_M, x_M = gathered_wgrad_problem(splits, 37, 3000, O, I, torch.bfloat16, "cuda")
    offs = offs_of(splits, "cuda")
    if gathered == "x":
        dw = gg.grouped_gemm_wgrad(dy_M, x_T, offs, x_rows=x_rows)
    else:
        dw = gg.grouped_gemm_wgrad(dy_T, x_M, offs, dy_rows=dy_rows)
    assert torch.equal(dw, gg.grouped_gemm_wgrad(dy_M, x_M, offs))
    used = sum(splits)
    ref64, ref_bf16 = (ref_wgrad(dy_M[:used], x_M[:used], splits, dtype=d)[0] for d in (torch.float64, torch.bfloat16))
    for g in range(len(splits)):
        if splits[g]:
            assert_close(dw[g], ref64[g], ref_bf16[g], torch.bfloat16)


# 300 groups of 0-96 rows: group vectors of 512 entries, whose launches take MM_WS_512_GROUPS' registers.
SPLITS_300 = [(37 * g) % 97 for g in range(300)]
# (op, weight stored (N, O, I) or under a transposed view of (N, I, O), bias, bias row scale, O, I, splits):
# the layer's products (fc2's forward, fc1's dgrad) and sizes no tile divides, ragged, empty and one-row
# groups, a last group ending inside a tile, 255 groups or more.
MM_WS_CASES = {
    "fwd": ("fwd", False, False, False, 2048, 256, [1000, 0, 777, 1, 2048, 63, 65, 0, 1500]),
    "fwd_bias_scale_odd": ("fwd", False, True, True, 200, 320, [0, 700, 1, 0, 377, 901, 64]),
    "fwd_transposed": ("fwd", True, False, False, 1536, 512, [129, 0, 3000, 1, 17]),
    "dgrad": ("dgrad", False, False, False, 512, 2048, [1000, 0, 777, 1, 2048, 63, 65, 0, 1500]),
    "dgrad_odd_cols": ("dgrad", False, False, False, 320, 200, [0, 700, 1, 0, 377, 901, 64]),
    "dgrad_transposed": ("dgrad", True, False, False, 1536, 320, [129, 0, 3000, 1, 17]),
    "fwd_300_groups": ("fwd", False, False, False, 512, 256, SPLITS_300),
    "dgrad_300_groups": ("dgrad", False, False, False, 256, 512, SPLITS_300),
}


# The Hopper forward/dgrad's schedules: the name it compiles to (and a variant's) -> the reductions up
# to which the ping-pong runs (configs.MM_SCHEDULE["PINGPONG_MAX_RED"]: 0 the shared 128 x 256 tile
# everywhere, any larger the ping-pong at every reduction of these tests) and changes to both tables: the
# variants' two switches together (the tiles a group's rows end inside stored through the staging tile
# or not, the other way from each table's own; a load partition of a warp group), each a code path of
# its own.
MM_SCHEDULES = {
    "grouped_mm_ws_kernel": (0, {}),
    "grouped_mm_pingpong_kernel": (1 << 30, {}),
    "grouped_mm_ws_kernel-unstaged-load4": (0, {"STAGED_ROWS": False, "LOAD_WARPS": 4}),
    "grouped_mm_pingpong_kernel-staged_rows-load4": (1 << 30, {"STAGED_ROWS": True, "LOAD_WARPS": 4}),
}


@pytest.fixture(params=list(MM_SCHEDULES))
def mm_kernel(request, monkeypatch):
    """The Hopper forward/dgrad kernel a test runs, selected in `configs.MM_SCHEDULE` and the tables
    (plans made afresh before and after)."""
    max_red, changes = MM_SCHEDULES[request.param]
    monkeypatch.setitem(configs.MM_SCHEDULE, "PINGPONG_MAX_RED", max_red)
    for table in (configs.MM_WS, configs.MM_WS_512_GROUPS, configs.MM_PINGPONG):
        for key, value in changes.items():
            if key in table:
                monkeypatch.setitem(table, key, value)
    launch.forget_plans()
    yield request.param.split("-")[0]
    monkeypatch.undo()
    launch.forget_plans()


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(MM_WS_CASES), ids=list(MM_WS_CASES))
def test_gpu_forward_dgrad_run_the_hopper_kernel(case, dtype, mm_kernel, nan_outputs):
    """On sm_90 the forward and the dgrad run the Gluon kernel of each schedule (profiled, no host sync)
    and give the Triton kernel's bits (its first candidate: the same reduction order), within the
    tolerance rule of the float64 reference, padding rows (NaN inputs) exact zeros."""
    from helpers import run_on_kernel

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward/dgrad runs on sm_90")
    op, transposed, bias, scale, O, I, splits = MM_WS_CASES[case]
    M = sum(splits) + 100
    x, w, dy, b, s = make_problem(M, len(splits), O, I, splits, dtype, "cuda", bias, scale)
    if transposed:  # an (N, I, O) tensor under its transposed view, as transformers stores experts
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    offs = offs_of(splits, "cuda")
    used = sum(splits)
    cols = O if op == "fwd" else I
    if op == "fwd":
        run = lambda cfg=None: gg.grouped_gemm_forward(x, w, offs, b, s, cfg=cfg)  # noqa: E731
        ref = lambda d: ref_forward(x[:used], w, splits, b, s, dtype=d)  # noqa: E731
    else:
        run = lambda cfg=None: gg.grouped_gemm_dgrad(dy, w, offs, cfg=cfg)  # noqa: E731
        ref = lambda d: ref_dgrad(dy[:used], w, splits, dtype=d)  # noqa: E731
    out = run_on_kernel(run, mm_kernel)
    assert torch.equal(out, run(configs.gemm_candidates(op, dtype, True, "sm90", cols)[0]))
    assert (out[used:] == 0).all()
    assert_close(out[:used], ref(torch.float64), ref(dtype), dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "op,O,I,dtype",
    [("dgrad", 200, 512, torch.bfloat16), ("fwd", 128, 512, torch.bfloat16), ("fwd", 512, 256, torch.float32)],
    ids=["dgrad-reduction-not-64", "fwd-128-columns", "fwd-fp32"],
)
def test_gpu_products_the_hopper_kernel_does_not_take_run_triton(op, O, I, dtype, nan_outputs):
    """Products the Gluon forward/dgrad does not take run the Triton kernel, correctly: a dgrad whose
    reduction (O) is not a multiple of 64 (a box would reach the next expert's rows), outputs of 128
    columns or fewer, fp32."""
    from helpers import run_on_kernel

    splits = [300, 0, 211]
    M = sum(splits)
    offs = offs_of(splits, "cuda")
    x, w, dy, _, _ = make_problem(M, len(splits), O, I, splits, dtype, "cuda")
    a, cols = (x, O) if op == "fwd" else (dy, I)
    assert not gg.hopper_mm_takes(a, w, cols, op == "fwd", None, True)
    if op == "fwd":
        out = run_on_kernel(lambda: gg.grouped_gemm_forward(x, w, offs), "grouped_mm_kernel")
        assert_close(out, ref_forward(x, w, splits), ref_forward(x, w, splits, dtype=dtype), dtype)
    else:
        out = run_on_kernel(lambda: gg.grouped_gemm_dgrad(dy, w, offs), "grouped_mm_kernel")
        assert_close(out, ref_dgrad(dy, w, splits), ref_dgrad(dy, w, splits, dtype=dtype), dtype)


_COMPILE_MM_FOR_SM90 = """
import json, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource
from moekit.ops.kernels.grouped_gemm_hopper import grouped_mm_ws_kernel as kernel
from moekit.ops.runtime import configs

table, changes, dtype, trans_b, bias, scale, epi_tma = json.loads(sys.argv[1])
cfg = {**getattr(configs, table), **changes}  # a copy: the compile server's configs stay as imported
options = {k: cfg[k] for k in ("num_warps", "maxnreg")}
const = {k: v for k, v in cfg.items() if k not in options}
const = {"BLOCK_GROUPS": 256, **const}  # changes may name another group vector's length
const.update(TRANS_B=trans_b, HAS_BIAS=bias, HAS_SCALE=scale, EPI_TMA=epi_tma, NUM_PROGRAMS=132)
pointer = {"offs_ptr": "*i64", "scale_ptr": "*fp32"}
sig = {n: "constexpr" if n in const else pointer.get(n, dtype) if n.endswith("_ptr") else "i32"
       for n in kernel.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n not in const}
src = GluonASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()},
                     attrs=attrs)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
ptx = compiled.asm["ptx"]
with open(sys.argv[2], "w") as f:
    f.write(ptx)
log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", sys.argv[2], "-o", sys.argv[3]],
                     capture_output=True, text=True).stderr
nvdisasm = get_ptxas(90).path.replace("ptxas", "nvdisasm")
with open(sys.argv[4], "w") as f:
    f.write(subprocess.run([nvdisasm, "-c", sys.argv[3]], capture_output=True, text=True).stdout)
print(json.dumps({"name": compiled.metadata.name, "num_warps": compiled.metadata.num_warps,
                  "shared": compiled.metadata.shared, "wgmma": sorted(set(re.findall(r"wgmma\\.mma_async\\S*", ptx))),
                  "spills": re.findall(r"(\\d+) bytes spill stores", log),
                  "serialized": [l for l in log.splitlines() if "C7514" in l or "C7515" in l]}))
"""


# The Hopper forward/dgrad's configuration tables and changes to them -> (table, changes, the name it
# compiles to, the wgmma shapes its accumulators take, whether ptxas spills nothing at the table's
# registers anywhere in it, else in its main loops only). The ping-pong's 192 accumulator registers a
# thread leave its tile set-up and epilogue a few spills, once a tile. At 255 groups or more the group
# vectors are 512 long and the shared tile's one-warp load partition would spill them (128 bytes at
# 56 registers); the launch then takes MM_WS_512_GROUPS' registers, which hold them, and a load
# partition of a warp group (load4) nearly does (4 bytes, outside the main loops).
MM_COMPILES = {
    "MM_WS": ("MM_WS", {}, "grouped_mm_ws_kernel", ["m64n128k16"], True),
    "MM_WS-unstaged": ("MM_WS", {"STAGED_ROWS": False}, "grouped_mm_ws_kernel", ["m64n128k16"], True),
    "MM_WS-512_groups": (
        "MM_WS",
        {**configs.MM_WS_512_GROUPS, "BLOCK_GROUPS": 512},
        "grouped_mm_ws_kernel",
        ["m64n128k16"],
        True,
    ),
    "MM_WS-load4-512_groups": (
        "MM_WS",
        {"LOAD_WARPS": 4, "BLOCK_GROUPS": 512},
        "grouped_mm_ws_kernel",
        ["m64n128k16"],
        False,
    ),
    "MM_PINGPONG": ("MM_PINGPONG", {}, "grouped_mm_pingpong_kernel", ["m64n128k16", "m64n64k16"], False),
    "MM_PINGPONG-load4-512_groups": (
        "MM_PINGPONG",
        {"LOAD_WARPS": 4, "BLOCK_GROUPS": 512},
        "grouped_mm_pingpong_kernel",
        ["m64n128k16", "m64n64k16"],
        False,
    ),
}


def test_hopper_forward_dgrad_table_by_reduction_and_groups(monkeypatch):
    """The launch's table: the ping-pong's up to MM_SCHEDULE's reduction, else the shared tile's, whose
    registers are MM_WS_512_GROUPS' from 255 groups on (group vectors of 512 entries) and its own below."""
    monkeypatch.setitem(configs.MM_SCHEDULE, "PINGPONG_MAX_RED", 0)
    assert gg.mm_ws_table(256, 128) is configs.MM_WS
    assert gg.mm_ws_table(4096, 254) is configs.MM_WS
    for groups in (255, 256, 1000):
        table = gg.mm_ws_table(256, groups)
        assert table == {**configs.MM_WS, **configs.MM_WS_512_GROUPS}
    monkeypatch.setitem(configs.MM_SCHEDULE, "PINGPONG_MAX_RED", 256)
    assert gg.mm_ws_table(256, 256) is configs.MM_PINGPONG
    assert gg.mm_ws_table(320, 256) == {**configs.MM_WS, **configs.MM_WS_512_GROUPS}


@pytest.mark.parametrize("table", list(MM_COMPILES))
@pytest.mark.parametrize(
    "dtype,trans_b,bias,scale,epi_tma",
    [
        ("*bf16", True, False, False, True),
        ("*bf16", False, False, False, True),
        ("*fp16", True, True, True, False),
    ],
    ids=["fwd", "dgrad", "fwd-fp16-bias-scale-pointer-stores"],
)
def test_hopper_forward_dgrad_kernel_compiles_for_sm90(table, dtype, trans_b, bias, scale, epi_tma, tmp_path):
    """The Gluon forward/dgrad compiles for sm_90a under each schedule's table (in its own process, as the
    other Gluon kernels), named by its schedule: 12 warps (two math warp groups and the load warp's),
    inside 227 KB of shared memory, the wgmma shapes of its accumulators only, no wgmma serialized by
    ptxas (C7514 / C7515), no spills in the main loops and, on the shared tile, none at all; 16-byte
    stores exactly where the tiles a group's rows end inside go through the staging tile."""
    base, changes, name, shapes, no_spills = MM_COMPILES[table]
    args = json.dumps([base, changes, dtype, trans_b, bias, scale, epi_tma])
    ptx, cubin, sass = (str(tmp_path / f"k.{ext}") for ext in ("ptx", "cubin", "sass"))
    got = compile_in_subprocess(_COMPILE_MM_FOR_SM90, args, ptx, cubin, sass)
    assert got["name"] == name
    assert got["num_warps"] == 12 and 0 < got["shared"] <= 227 * 1024
    kind = dtype.strip("*").replace("fp16", "f16")
    assert got["wgmma"] == sorted(f"wgmma.mma_async.sync.aligned.{s}.f32.{kind}.{kind}" for s in shapes)
    assert not got["serialized"], got["serialized"]
    if no_spills:
        assert got["spills"] and set(got["spills"]) == {"0"}, got["spills"]
    with open(sass) as f:
        listing = f.read()
    spills = main_loop_spills(listing, "HGMMA")
    assert len(spills) == 2 and set(spills) == {0}, spills  # each math warp group's main loop
    # A group's last rows leave as 16-byte row pieces only when staged (through the TMA staging tile).
    staged = {**getattr(configs, base), **changes}["STAGED_ROWS"]
    assert ("STG.E.128" in listing) == (staged and epi_tma)


_COMPILE_WGRAD_FOR_SM90 = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moekit.ops.kernels.grouped_gemm_hopper import wgrad_gathered_ws_kernel as kernel
from moekit.ops.runtime.configs import WGRAD_GATHERED_WS

dtype, idx, trans_out = json.loads(sys.argv[1])
options = {k: WGRAD_GATHERED_WS[k] for k in ("num_warps", "maxnreg")}
const = {k: v for k, v in WGRAD_GATHERED_WS.items() if k not in options}
const.update(NUM_PROGRAMS=132, TRANS_OUT=trans_out)
pointer = {"offs_ptr": "*i64", "unused_ptr": "*i64", "idx_ptr": idx}
sig = {n: "constexpr" if n in const else pointer.get(n, dtype) if n.endswith("_ptr") else "i32"
       for n in kernel.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n not in const}
src = GluonASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()},
                     attrs=attrs)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
ptx = compiled.asm["ptx"]
print(json.dumps({"num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
                  "wgmma": re.findall(r"wgmma\\.mma_async\\S*", ptx),
                  "cp_async_16": len(re.findall(r"cp\\.async\\.\\w+\\.shared\\.global \\[[^]]*\\], \\[[^]]*\\], 0x10",
                                                ptx)),
                  "stores": sorted(set(re.findall(r"st\\.global\\S*", ptx))),
                  "setmaxnreg": "setmaxnreg" in ptx}))
"""


@pytest.mark.parametrize("trans_out", [False, True], ids=["dw", "dw_transposed"])
@pytest.mark.parametrize("dtype,idx", [("*bf16", "*i64"), ("*fp16", "*i32")])
def test_hopper_gathered_wgrad_compiles_for_sm90(dtype, idx, trans_out):
    """The Gluon gathered wgrad's configuration compiles for sm_90 (in its own process, as the fused
    MLP's kernels): 16 warps (8 for the main loop, the load partition's two warp groups), inside 227 KB
    of shared memory, m64n128k16 wgmma on both operands MN-major, x's rows by 16-byte cp.async copies;
    dw stored in pairs of elements along its rows, and with TRANS_OUT (dw's transpose) in 16-byte
    pieces along the transposed rows."""
    got = compile_in_subprocess(_COMPILE_WGRAD_FOR_SM90, json.dumps([dtype, idx, trans_out]))
    assert got["num_warps"] == 16 and got["setmaxnreg"] and 0 < got["shared"] <= 227 * 1024
    kind = dtype.strip("*").replace("fp16", "f16")
    assert got["wgmma"] and set(got["wgmma"]) == {f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{kind}.{kind}"}
    assert got["cp_async_16"] > 0, got
    assert got["stores"] == (["st.global.v4.b32"] if trans_out else ["st.global.b32"]), got["stores"]


@gpu
@needs_cuda
@pytest.mark.parametrize("O,I", [(512, 2048), (200, 272)], ids=["fc1", "odd"])
def test_gpu_wgrad_gathered_runs_the_hopper_kernel(O, I, nan_outputs):
    """On sm_90 the gathered wgrad of x's rows runs the Gluon kernel (profiled, no host sync) and gives the
    Triton wgrad's bits over the gathered rows, at fc1's shape and at sizes no tile divides; x rows
    cp.async cannot copy 16 bytes at a time (a row stride of 8 mod 16 elements) run the Triton kernel,
    with the same bits."""
    from helpers import run_on_kernel

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon wgrad runs on sm_90")
    splits = [1000, 0, 777, 1, 2048, 63, 65, 0, 1500]
    dy_T, x_T, _, x_rows, dy_M, x_M = gathered_wgrad_problem(splits, 37, 3000, O, I, torch.bfloat16, "cuda")
    offs = offs_of(splits, "cuda")
    dw = run_on_kernel(lambda: gg.grouped_gemm_wgrad(dy_M, x_T, offs, x_rows=x_rows), "wgrad_gathered_ws_kernel")
    assert torch.equal(dw, gg.grouped_gemm_wgrad(dy_M, x_M, offs))
    wide = torch.full((x_T.shape[0], I + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    wide[:, :I] = x_T
    x_odd = wide[:, :I]  # row stride I + 8: 16-byte rows, not 16-element ones
    assert not gg.hopper_wgrad_takes(dy_M, x_odd, (False, True), None, True)
    odd = run_on_kernel(lambda: gg.grouped_gemm_wgrad(dy_M, x_odd, offs, x_rows=x_rows), "wgrad_kernel")
    assert torch.equal(odd, dw)


@gpu
@needs_cuda
@pytest.mark.parametrize("O,I", [(2048, 256), (272, 200)], ids=["fc2", "odd"])
def test_gpu_wgrad_gathered_dy_rows_swapped(O, I, monkeypatch, nan_outputs):
    """On sm_90 with configs.WGRAD_GATHERED_DY_ROWS' SWAPPED, the wgrad of dy's rows through a row map (fc2's
    in the layer) runs the Gluon kernel on the swapped operands (profiled, no host sync), storing dw's
    transpose: the bits of the kernel's x-rows form on those operands, transposed (its GPU test above
    holds that form to the Triton kernel's bits), and within the rule of float64; off, the Triton kernel
    with dy's row map runs."""
    from helpers import assert_within_tolerance, run_on_kernel

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon wgrad runs on sm_90")
    splits = [1000, 0, 777, 1, 2048, 63, 65, 0, 1500]
    dy_T, x_T, dy_rows, _, dy_M, x_M = gathered_wgrad_problem(splits, 37, 3000, O, I, torch.bfloat16, "cuda")
    x_M[sum(splits) :] = float("nan")  # padding rows of the plain operand: never read
    offs = offs_of(splits, "cuda")
    launch.forget_plans()
    plain = run_on_kernel(lambda: gg.grouped_gemm_wgrad(dy_T, x_M, offs, dy_rows=dy_rows), "wgrad_kernel")
    monkeypatch.setitem(configs.WGRAD_GATHERED_DY_ROWS, "SWAPPED", True)
    launch.forget_plans()
    try:
        dw = run_on_kernel(lambda: gg.grouped_gemm_wgrad(dy_T, x_M, offs, dy_rows=dy_rows), "wgrad_gathered_ws_kernel")
    finally:
        monkeypatch.undo()
        launch.forget_plans()
    assert dw.shape == (len(splits), O, I) and dw.is_contiguous()
    assert torch.equal(dw, gg.grouped_gemm_wgrad(x_M, dy_T, offs, x_rows=dy_rows).transpose(1, 2))
    bounds = [0, *torch.tensor(splits).cumsum(0).tolist()]
    ref = torch.stack([dy_M[a:b].double().T @ x_M[a:b].double() for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    lowp = torch.stack([dy_M[a:b].T @ x_M[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    assert_within_tolerance(dw, ref, lowp, "dw", reduction_length=max(splits))
    assert_within_tolerance(plain, ref, lowp, "dw (Triton)", reduction_length=max(splits))


@gpu
@needs_cuda
def test_gpu_fp32(nan_outputs):
    check_all(1000, 3, 320, 192, [0, 700, 200], torch.float32, "cuda", True, True)


@gpu
@needs_cuda
@pytest.mark.parametrize("ffn", [256, 96])
def test_gpu_fused_mlp_fp32(ffn, nan_outputs):
    """The fused MLP in float32 on the GPU (the demo's dtype): its configuration fits sm_90's shared
    memory, and output and every gradient pass the rule against float64."""
    splits = [0, 37, 300, 5]
    inputs = {
        "x": rand(sum(splits), 192, seed=1).cuda(),
        "fc1_weight": rand(4, 2 * ffn, 192, seed=2).cuda(),
        "fc2_weight": rand(4, 192, ffn, seed=3).cuda(),
        "probs": rand(sum(splits), seed=4).abs().cuda(),
    }

    def call(fn, **kw):
        return lambda x, fc1_weight, fc2_weight, probs: fn(x, fc1_weight, fc2_weight, splits, probs=probs, **kw)

    check_against_reference(
        call(moekit.grouped_mlp, backend="triton"),
        call(torch_grouped_mlp),
        call(grouped_mlp_reference),
        inputs,
        torch.float32,
    )


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay_with_new_splits():
    dev = "cuda"
    M, N, O, I = 2048, 8, 512, 384
    x, w, dy, b, _ = make_problem(M, N, O, I, [M // N] * N, torch.bfloat16, dev, bias=True)
    offs = offs_of([M // N] * N, dev)
    for _ in range(2):  # compile and autotune outside the capture
        gg.grouped_gemm_forward(x, w, offs, b)
        gg.grouped_gemm_dgrad(dy, w, offs)
        gg.grouped_gemm_wgrad(dy, x, offs)
        gg.group_row_sum(dy, offs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        y = gg.grouped_gemm_forward(x, w, offs, b)
        dx = gg.grouped_gemm_dgrad(dy, w, offs)
        dw, db = gg.grouped_gemm_wgrad(dy, x, offs), gg.group_row_sum(dy, offs)
    torch.cuda.current_stream().wait_stream(stream)
    for splits in ([0, 500, 0, 700, 3, 0, 500, 300], [2000, 0, 0, 0, 0, 0, 0, 0], [100] * 8):
        offs.copy_(offs_of(splits, dev))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, gg.grouped_gemm_forward(x, w, offs, b))
        assert torch.equal(dx, gg.grouped_gemm_dgrad(dy, w, offs))
        dwe, dbe = gg.grouped_gemm_wgrad(dy, x, offs), gg.group_row_sum(dy, offs)
        assert torch.equal(dw, dwe) and torch.equal(db, dbe)
        used = sum(splits)
        assert (y[used:] == 0).all() and (dx[used:] == 0).all()


@gpu
@needs_cuda
def test_gpu_no_host_sync():
    dev = "cuda"
    x, w, dy, b, s = make_problem(1024, 4, 256, 512, [256] * 4, torch.bfloat16, dev, bias=True, scale=True)
    offs = offs_of([256] * 4, dev)
    gg.grouped_gemm_forward(x, w, offs, b, s)
    gg.grouped_gemm_dgrad(dy, w, offs)
    gg.grouped_gemm_wgrad(dy, x, offs)
    gg.group_row_sum(dy, offs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gg.grouped_gemm_forward(x, w, offs, b, s)
        gg.grouped_gemm_dgrad(dy, w, offs)
        gg.grouped_gemm_wgrad(dy, x, offs)
        gg.group_row_sum(dy, offs)
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---------------------------------------------------------------------------------------------
# The fused MLP kernels (moekit.ops.grouped_mlp.glu_forward / glu_backward), both operand paths
# ---------------------------------------------------------------------------------------------


@cpu_only
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "ptr"])
@pytest.mark.parametrize("interleave", [None, 2], ids=["gate|up", "k2"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_interpreter_glu_kernels(activation, use_tma, interleave, nan_poison):
    from moekit.ops.glu import glu_reference

    splits, M, N, H, F = [9, 0, 14], 27, 3, 24, 40
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(M, H, generator=gen) * 3
    w1 = torch.randn(N, 2 * F, H, generator=gen) / H**0.5
    w2 = torch.randn(N, H, F, generator=gen) / F**0.5
    b1 = torch.randn(N, 2 * F, generator=gen)
    probs = torch.rand(M, generator=gen)
    dy = torch.randn(M, H, generator=gen)
    x[23:], probs[23:], dy[23:] = float("nan"), float("nan"), float("nan")  # padding rows hold NaN
    offs = offs_of(splits, "cpu")
    used = sum(splits)
    h, act = rglu.glu_forward(x, w1, offs, b1, probs, interleave, activation, use_tma=use_tma)
    h_ref = ref_forward(x[:used], w1, splits, b1)
    h64 = h[:used].double().requires_grad_()
    p64 = probs[:used].double().requires_grad_()
    act_ref = glu_reference(h64, probs=p64, glu_interleave_size=interleave, activation=activation)
    assert rel_err(h[:used], h_ref) < 1e-6 and rel_err(act[:used], act_ref) < 1e-6
    assert not h[used:].any() and not act[used:].any(), "padding rows must be exact zeros"

    dh, act_p, dprobs = rglu.glu_backward(dy, w2, h, offs, probs, interleave, activation, use_tma=use_tma)
    d_act = ref_dgrad(dy[:used], w2, splits)  # dA = dy @ w2[g]
    act_ref.backward(d_act)
    assert rel_err(dh[:used], h64.grad) < 1e-6 and rel_err(dprobs[:used], p64.grad) < 1e-6
    assert rel_err(act_p[:used], act_ref) < 1e-6
    assert not dh[used:].any() and not act_p[used:].any() and not dprobs[used:].any()


@cpu_only
@pytest.mark.parametrize("interleave", [None, 8], ids=["gate|up", "k8"])
@pytest.mark.parametrize("ffn", [64, 72], ids=["F64", "F72"])
def test_interpreter_glu_backward_column_tiles(interleave, ffn, nan_poison):
    """The backward's epilogue over several column tiles, each in four quarters with h loaded one
    quarter ahead and d probs summed over the quarters then over the tiles: F = 64 in four 16-column
    tiles, F = 72 with a last tile of 8 columns (its last quarters past F)."""
    from moekit.ops.glu import glu_reference

    splits, M, N, H = [9, 0, 14], 27, 3, 24
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(M, 2 * ffn, generator=gen) * 2
    w2 = torch.randn(N, H, ffn, generator=gen) / ffn**0.5
    probs = torch.rand(M, generator=gen)
    dy = torch.randn(M, H, generator=gen)
    used = sum(splits)
    h[used:] = 0.0  # the forward writes zeros to padding rows
    dy[used:], probs[used:] = float("nan"), float("nan")
    cfg = configs.GemmConfig(16, 16, 16, 8, 1, 4, False)
    dh, act_p, dprobs = rglu.glu_backward(dy, w2, h, offs_of(splits, "cpu"), probs, interleave, "swiglu", cfg=cfg)
    h64 = h[:used].double().requires_grad_()
    p64 = probs[:used].double().requires_grad_()
    act_ref = glu_reference(h64, probs=p64, glu_interleave_size=interleave, activation="swiglu")
    act_ref.backward(ref_dgrad(dy[:used], w2, splits))
    assert rel_err(dh[:used], h64.grad) < 1e-6 and rel_err(dprobs[:used], p64.grad) < 1e-6
    assert rel_err(act_p[:used], act_ref) < 1e-6
    assert not dh[used:].any() and not act_p[used:].any() and not dprobs[used:].any()


@cpu_only
def test_launch_plans_are_per_layout(nan_outputs):
    """A plan is made per layout of its inputs: the same shapes with other strides or another
    alignment, in any order of calls, each get their own plan and the right answer (a reused plan
    would launch with the first layout's strides or TMA decision)."""
    splits, M, N, I, O = [5, 0, 9], 16, 3, 24, 20
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(N, O, I, generator=gen)
    base = torch.randn(M * I + 4, generator=gen)
    contiguous = base[: M * I].view(M, I)
    unaligned = base[1 : 1 + M * I].view(M, I)  # 4-byte offset: no TMA, another plan
    column_major = torch.randn(I, M, generator=gen).t()  # stride(1) != 1: copied first
    offs = offs_of(splits, "cpu")
    dy_wide = torch.randn(M, 2 * O, generator=gen)
    dy_strided = dy_wide[:, ::2]
    before = launch.planned_count()
    for x in (contiguous, unaligned, column_major, contiguous, unaligned):
        assert rel_err(gg.grouped_gemm_forward(x, w, offs)[:14], ref_forward(x[:14], w, splits)) < 1e-6
    for dy in (dy_wide[:, :O], dy_strided, dy_wide[:, :O].contiguous()):
        dw_ref, _ = ref_wgrad(dy[:14], contiguous[:14], splits)
        assert rel_err(gg.grouped_gemm_wgrad(dy, contiguous, offs), dw_ref) < 1e-6
    assert launch.planned_count() >= before + 3, "each forward layout is its own plan"


# ---------------------------------------------------------------------------------------------
# The warp-specialised Hopper forward (Gluon: no interpreter runs it). On the CPU it is compiled for
# sm_90; on an sm_90 GPU it must give glu_forward_kernel's bits.
# ---------------------------------------------------------------------------------------------


_COMPILE_FOR_SM90 = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moekit.ops.kernels.glu_hopper import glu_backward_ws_kernel, glu_forward_ws_kernel
from moekit.ops.runtime.configs import WS_BACKWARD, WS_FORWARD
from moekit.ops.runtime.glu import jit_pair

kind, activation, glu_block, bias, probs, transposed, paired, changes = json.loads(sys.argv[1])
kernel, config = (glu_forward_ws_kernel, WS_FORWARD) if kind == "forward" else (glu_backward_ws_kernel, WS_BACKWARD)
config = {"BLOCK_GROUPS": 256, **config, **changes}  # a copy: the compile server's configs stay as imported
options = {"num_warps": config["num_warps"], "maxnreg": config["maxnreg"]}
const = {k: v for k, v in config.items() if k not in options}
const.update(**jit_pair(activation), GLU_BLOCK=glu_block, HAS_PROBS=probs, NUM_PROGRAMS=132, W_TRANSPOSED=transposed)
if kind == "forward":
    const.update(HAS_BIAS=bias, PAIRED=paired)
pointer = {"probs_ptr": "*fp32", "dprobs_ptr": "*fp32", "offs_ptr": "*i64"}
sig = {n: "constexpr" if n in const else pointer.get(n, "*bf16") if n.endswith("_ptr") else "i32"
       for n in kernel.arg_names}
src = GluonASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()})
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
ptx = compiled.asm["ptx"]
print(json.dumps({"num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
                  "wgmma": "wgmma.mma_async" in ptx, "setmaxnreg": "setmaxnreg" in ptx}))
"""


# The fused MLP's TMA forms with their load partition a warp group (gpu_prelude.sh's glu_load4: spills
# at 512 groups 36 / 0 bytes instead of 488 / 468, notes/grouped_gemm.md), at 255+ experts' group vectors.
LOAD4_512 = {"LOAD_WARPS": 4, "LOAD_REGS": 40, "BLOCK_GROUPS": 512}


@pytest.mark.parametrize(
    "kind,activation,glu_block,bias,probs,transposed,paired,warps,changes",
    [
        ("forward", "swiglu", 14336, False, True, False, False, 16, {}),
        ("forward", "clamped_swiglu", 128, True, False, False, False, 16, {}),
        ("backward", "swiglu", 14336, False, True, False, False, 12, {}),
        ("backward", "clamped_swiglu", 128, False, False, False, False, 12, {}),
        ("forward", "geglu", 2048, True, True, False, False, 16, {}),
        ("backward", "geglu_tanh", 2048, False, True, False, False, 12, {}),
        ("backward", "reglu", 256, False, False, False, False, 12, {}),
        ("forward", "clamped_swiglu", 1, True, True, True, True, 16, {}),
        ("forward", "swiglu", 4, False, True, False, True, 16, {}),
        ("forward", "swiglu", 32, True, False, True, True, 16, {}),
        ("forward", "swiglu", 2880, True, True, True, False, 16, {}),
        ("backward", "clamped_swiglu", 1, False, True, True, False, 12, {}),
        ("backward", "swiglu", 8, False, False, False, False, 12, {}),
        ("backward", "swiglu", 16, False, True, True, False, 12, {}),
        ("forward", "swiglu", 14336, False, True, False, False, 16, LOAD4_512),
        ("backward", "swiglu", 14336, False, True, False, False, 12, LOAD4_512),
    ],
    ids=[
        "fwd-swiglu-gate|up-probs",
        "fwd-clamped-k128-bias",
        "bwd-swiglu-gate|up-probs",
        "bwd-clamped-k128",
        "fwd-geglu-bias-probs",
        "bwd-geglu_tanh-probs",
        "bwd-reglu-k256",
        "fwd-clamped-k1-transposed-bias-probs",
        "fwd-swiglu-k4-probs",
        "fwd-swiglu-k32-transposed-bias",
        "fwd-swiglu-gate|up-transposed",
        "bwd-clamped-k1-transposed-probs",
        "bwd-swiglu-k8",
        "bwd-swiglu-k16-transposed-probs",
        "fwd-swiglu-load4-512_groups",
        "bwd-swiglu-load4-512_groups",
    ],
)
def test_hopper_kernels_compile_for_sm90(kind, activation, glu_block, bias, probs, transposed, paired, warps, changes):
    """The library's configurations compile for sm_90 with wgmma and register reallocation, inside
    Hopper's 227 KB of shared memory per block: the forward into 16 warps (8 mma, 4 epilogue, the
    load warp rounded up to a warp group), the backward into 12 (8 for the main loop and the
    epilogue, the load warp's group); also for the interleaved layouts (fc1's rows in pairs, h and
    dh split in registers, whose reorders must stay in every thread's registers) and transposed
    weights; and with a load partition of a warp group at 512 groups. In its own process: Gluon's
    standard functions cannot be compiled where TRITON_INTERPRET=1 has turned them into interpreted
    ones."""
    args = json.dumps([kind, activation, glu_block, bias, probs, transposed, paired, changes])
    got = compile_in_subprocess(_COMPILE_FOR_SM90, args)
    assert got["num_warps"] == warps and got["wgmma"] and got["setmaxnreg"]
    assert 0 < got["shared"] <= 227 * 1024


_TRITON_GLU_SHARED_SM90 = """
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moekit.ops.runtime import glu as rglu
from moekit.ops.runtime.configs import glu_candidates

kind, dtype_name, ffn, block = json.loads(sys.argv[1])
dt = getattr(torch, dtype_name)
M, H, N = 342, 192, 4
offs, probs = torch.tensor([0, 0, 37, 337, 342]), torch.rand(M, dtype=dt)
cfg = glu_candidates("fwd" if kind == "forward" else "bwd", dt, ffn, block, True, "sm90")[0]
if kind == "forward":
    x, w1 = torch.randn(M, H, dtype=dt), torch.randn(N, 2 * ffn, H, dtype=dt)
    h, act = torch.empty(M, 2 * ffn, dtype=dt), torch.empty(M, ffn, dtype=dt)
    plan = rglu._forward_launch(x, w1, None, probs, block, "swiglu", True, cfg, True)
    tensors = (x, w1, h, act, h, probs, offs)
else:
    dy, w2, h = torch.randn(M, H, dtype=dt), torch.randn(N, H, ffn, dtype=dt), torch.randn(M, 2 * ffn, dtype=dt)
    dh, act_p, part = torch.empty(M, 2 * ffn, dtype=dt), torch.empty(M, ffn, dtype=dt), torch.empty(8, M)
    plan = rglu._backward_launch(dy, w2, h, probs, block, "swiglu", True, cfg)
    tensors = (dy, w2, h, dh, act_p, probs, part, offs)
kernel = plan.launcher.kernel
const = {n: v for n, v in plan.constexprs.items() if n in kernel.arg_names}
options = {n: v for n, v in plan.constexprs.items() if n not in kernel.arg_names}
values = iter([*tensors, *plan.ints])
names = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int64: "*i64"}
sig = {}
for n in kernel.arg_names:
    if n in const:
        sig[n] = "constexpr"
    else:
        v = next(values)
        sig[n] = names[v.dtype] if isinstance(v, torch.Tensor) else "i32"
src = ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(n),): v for n, v in const.items()})
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
print(json.dumps({"shared": compiled.metadata.shared}))
"""


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("dtype_name,ffn,block", [("float32", 256, 256), ("float32", 96, 1), ("bfloat16", 256, 256)])
def test_triton_glu_configs_fit_sm90_shared_memory(kind, dtype_name, ffn, block):
    """The fused MLP's Triton kernels at the configuration table's sm90 entry (the one the GPU launches
    where the Hopper kernels do not run: float32 among others), compiled for sm_90, ask for at most
    Hopper's 227 KB of shared memory per block. (float32 once asked for 352 KB and failed to launch.)
    In its own process: the kernels are compiled, not interpreted."""
    shared = compile_in_subprocess(_TRITON_GLU_SHARED_SM90, json.dumps([kind, dtype_name, ffn, block]))["shared"]
    assert 0 < shared <= 227 * 1024, shared


HOPPER_CASES = {
    # M, splits, H, F, glu_interleave_size, bias, probs, activation
    "padding_empty_bias": (1000, [0, 300, 1, 0, 500], 256, 384, None, True, True, "swiglu"),
    "clamped_no_probs": (1000, [0, 300, 1, 0, 500], 256, 384, None, True, False, "clamped_swiglu"),
    "one_row": (64, [0, 1, 0], 64, 128, None, False, True, "swiglu"),
    "all_padding": (300, [0, 0, 0], 64, 128, None, False, True, "swiglu"),
    "gptoss_partial_tile": (4096, [1000, 0, 2000, 1096], 2880, 2880, None, True, True, "clamped_swiglu"),
    "interleave_k128": (2048, [500, 700, 848], 512, 768, 128, False, True, "swiglu"),
    "odd_rows": (777, [100, 233, 0, 444], 192, 256, None, False, True, "swiglu"),
}


def hopper_cases(test):
    """A GPU test on an sm_90 device over HOPPER_CASES x (bf16, fp16)."""
    for mark in reversed(
        [
            gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                reason="needs an sm_90 GPU",
            ),
            pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"]),
            pytest.mark.parametrize("case", list(HOPPER_CASES), ids=list(HOPPER_CASES)),
        ]
    ):
        test = mark(test)
    return test


@hopper_cases
def test_gpu_hopper_forward_matches_triton_kernel(case, dtype, nan_outputs):

    M, splits, H, F, k, bias, probs, activation = HOPPER_CASES[case]
    gen = torch.Generator().manual_seed(11)
    N = len(splits)
    x = (torch.randn(M, H, generator=gen) * 3).to("cuda", dtype)
    w1 = (torch.randn(N, 2 * F, H, generator=gen) / H**0.5).to("cuda", dtype)
    b1 = torch.randn(N, 2 * F, generator=gen).to("cuda", dtype) if bias else None
    p = torch.rand(M, generator=gen).cuda() if probs else None
    offs = offs_of(splits, "cuda")
    glu_block = F if k is None else k
    assert rglu.hopper_kernels_take("fwd", x, w1, F, glu_block, True, None)
    h, act = rglu.glu_forward(x, w1, offs, b1, p, k, activation)
    cfg = configs.glu_candidates("fwd", dtype, F, glu_block, True, "sm90")[0]  # a given cfg: glu_forward_kernel
    h_ref, act_ref = rglu.glu_forward(x, w1, offs, b1, p, k, activation, cfg=cfg)
    assert torch.equal(h, h_ref) and torch.equal(act, act_ref)


@hopper_cases
def test_gpu_hopper_backward_matches_triton_kernel(case, dtype, nan_outputs):
    """The Hopper backward gives glu_backward_kernel's dh and act_p bit for bit; its d probs sums the
    same products over 256-column tiles instead of 128 (another fp32 summation order)."""

    M, splits, H, F, k, _, probs, activation = HOPPER_CASES[case]
    gen = torch.Generator().manual_seed(12)
    N = len(splits)
    h = (torch.randn(M, 2 * F, generator=gen) * 2).to("cuda", dtype)
    dy = torch.randn(M, H, generator=gen).to("cuda", dtype)
    w2 = (torch.randn(N, H, F, generator=gen) / F**0.5).to("cuda", dtype)
    p = torch.rand(M, generator=gen).cuda() if probs else None
    offs = offs_of(splits, "cuda")
    glu_block = F if k is None else k
    assert rglu.hopper_kernels_take("bwd", dy, w2, F, glu_block, True, None)
    dh, act_p, dprobs = rglu.glu_backward(dy, w2, h, offs, p, k, activation)
    cfg = configs.glu_candidates("bwd", dtype, F, glu_block, True, "sm90")[0]  # a given cfg: glu_backward_kernel
    dh_ref, act_ref, dprobs_ref = rglu.glu_backward(dy, w2, h, offs, p, k, activation, cfg=cfg)
    assert torch.equal(dh, dh_ref) and torch.equal(act_p, act_ref)
    if probs:
        torch.testing.assert_close(dprobs, dprobs_ref, rtol=1e-4, atol=1e-4 * float(dprobs_ref.abs().max()))


# ---------------------------------------------------------------------------------------------
# Every GLU layout on the Hopper kernels: glu_interleave_size 1 ... 128 and [gate | up], fc1's and
# fc2's weights stored as (N, out, in) or under transposed views of (N, in, out) tensors.
# ---------------------------------------------------------------------------------------------


def transposed_view(w):
    """w's values as a transposed view of an (N, in, out) tensor (transformers' gpt-oss storage)."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("transposed", [False, True], ids=["stored", "transposed"])
def test_hopper_layout_ok_takes_every_power_of_two_interleave(kind, transposed):
    """The Hopper kernels take [gate | up], 128 | k and every k | 128, either weight orientation; the
    forward no block that neither divides nor is divided by its 128-column tile, the backward none
    whose 16-column chunks cross a block; H must give whole reduction steps only where it is the
    stored middle dimension; the experts must lie one after the other."""
    N, H, F = 3, 192, 384
    w = torch.randn(N, 2 * F, H) if kind == "fwd" else torch.randn(N, H, F)
    w = transposed_view(w) if transposed else w
    for k in (1, 2, 4, 8, 16, 32, 64, 128, F):
        assert rglu.hopper_layout_ok(kind, w, F, k, H), k
    for k in (3, 24, 192):
        assert not rglu.hopper_layout_ok(kind, w, F, k, H), k
    assert rglu.hopper_layout_ok(kind, w, F, 48, H) == (kind == "bwd")
    odd_h = torch.randn(N, 2 * F, 200) if kind == "fwd" else torch.randn(N, 200, F)
    odd_h = transposed_view(odd_h) if transposed else odd_h
    assert rglu.hopper_layout_ok(kind, odd_h, F, 1, 200) == (transposed == (kind == "bwd"))
    spread = (torch.randn(N, 2 * F + 8, H)[:, : 2 * F]) if kind == "fwd" else torch.randn(N, H + 8, F)[:, :H]
    spread = transposed_view(spread) if transposed else spread
    assert rglu.hopper_layout_ok(kind, spread, F, 1, H) == transposed  # a transposed copy is contiguous


# M (padding rows past the splits' sum), splits (odd counts, an empty expert), H (whole 64-column steps), F
LAYOUT_SHAPES = {"F384": (800, [100, 0, 233, 444], 192, 384), "F320": (300, [1, 0, 276], 128, 320)}
LAYOUT_CASES = [("F384", k) for k in (1, 2, 4, 8, 16, 32, 64, 128, None)] + [("F320", k) for k in (1, 8, 64, None)]


def layout_cases(test):
    """A GPU test on an sm_90 device over LAYOUT_CASES x weight orientation, bf16. Bias and probs
    alternate over the cases (both in each orientation), and so do swiglu and clamped_swiglu."""
    for mark in reversed(
        [
            gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                reason="needs an sm_90 GPU",
            ),
            pytest.mark.parametrize("transposed", [False, True], ids=["stored", "transposed"]),
            pytest.mark.parametrize(
                "shape,interleave", LAYOUT_CASES, ids=[f"{s}-k{k or 'F'}" for s, k in LAYOUT_CASES]
            ),
        ]
    ):
        test = mark(test)
    return test


def layout_case(shape, interleave):
    """(M, splits, H, F, with bias and probs, activation, seed) of a LAYOUT_CASES entry."""
    i = LAYOUT_CASES.index((shape, interleave))
    return (*LAYOUT_SHAPES[shape], i % 2 == 0, "clamped_swiglu" if i % 3 == 0 else "swiglu", 21 + i)


@layout_cases
def test_gpu_hopper_forward_every_layout(shape, interleave, transposed, nan_outputs):
    """glu_forward_ws_kernel takes the layout and gives glu_forward_kernel's bits, within the rule of
    the float64 reference, with exact zeros on padding rows."""
    M, splits, H, F, extras, activation, seed = layout_case(shape, interleave)
    dtype, used, N = torch.bfloat16, sum(splits), len(splits)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, H, generator=gen) * 3).to("cuda", dtype)
    w1 = (torch.randn(N, 2 * F, H, generator=gen) / H**0.5).to("cuda", dtype)
    w1 = transposed_view(w1) if transposed else w1
    b1 = torch.randn(N, 2 * F, generator=gen).to("cuda", dtype) if extras else None
    p = torch.rand(M, generator=gen).cuda() if extras else None
    offs = offs_of(splits, "cuda")
    glu_block = F if interleave is None else interleave
    assert rglu.hopper_kernels_take("fwd", x, w1, F, glu_block, True, None)
    h, act = rglu.glu_forward(x, w1, offs, b1, p, interleave, activation)
    cfg = configs.glu_candidates("fwd", dtype, F, glu_block, True, "sm90")[0]  # a given cfg: glu_forward_kernel
    h_tri, act_tri = rglu.glu_forward(x, w1, offs, b1, p, interleave, activation, cfg=cfg)
    assert torch.equal(h, h_tri) and torch.equal(act, act_tri)
    assert not h[used:].any() and not act[used:].any(), "padding rows must be exact zeros"
    h_lowp = ref_forward(x[:used], w1, splits, b1, dtype=dtype)
    assert_close(h[:used], ref_forward(x[:used], w1, splits, b1), h_lowp, dtype)
    # act from the stored h (what the kernels compute it from)
    p_used = p[:used] if extras else None
    act64 = glu_reference(h[:used], probs=p_used, glu_interleave_size=interleave, activation=activation)
    act_lowp = torch_glu(h[:used], probs=p_used, glu_interleave_size=interleave, activation=activation)
    assert_close(act[:used], act64, act_lowp.to(dtype), dtype)


@layout_cases
def test_gpu_hopper_backward_every_layout(shape, interleave, transposed, nan_outputs):
    """glu_backward_ws_kernel takes the layout and gives glu_backward_kernel's dh and act_p bits (d
    probs: another fp32 summation order), within the rule of the float64 reference, zeros on padding
    rows."""
    M, splits, H, F, probs, activation, seed = layout_case(shape, interleave)
    probs = not probs  # the forward's cases without probs have them here
    dtype, used, N = torch.bfloat16, sum(splits), len(splits)
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(M, 2 * F, generator=gen) * 2).to("cuda", dtype)
    h[used:] = 0.0  # the forward's padding rows
    dy = torch.randn(M, H, generator=gen).to("cuda", dtype)
    w2 = (torch.randn(N, H, F, generator=gen) / F**0.5).to("cuda", dtype)
    w2 = transposed_view(w2) if transposed else w2
    p = torch.rand(M, generator=gen).cuda() if probs else None
    offs = offs_of(splits, "cuda")
    glu_block = F if interleave is None else interleave
    assert rglu.hopper_kernels_take("bwd", dy, w2, F, glu_block, True, None)
    dh, act_p, dprobs = rglu.glu_backward(dy, w2, h, offs, p, interleave, activation)
    cfg = configs.glu_candidates("bwd", dtype, F, glu_block, True, "sm90")[0]  # a given cfg: glu_backward_kernel
    dh_tri, act_tri, dprobs_tri = rglu.glu_backward(dy, w2, h, offs, p, interleave, activation, cfg=cfg)
    assert torch.equal(dh, dh_tri) and torch.equal(act_p, act_tri)
    assert not dh[used:].any() and not act_p[used:].any(), "padding rows must be exact zeros"
    h64 = h[:used].double().requires_grad_()
    p64 = p[:used].double().requires_grad_() if probs else None
    act64 = glu_reference(h64, probs=p64, glu_interleave_size=interleave, activation=activation)
    act64.backward(ref_dgrad(dy[:used], w2, splits))
    h_lowp = h[:used].clone().requires_grad_()
    p_lowp = p[:used].to(dtype).requires_grad_() if probs else None
    act_lowp = torch_glu(h_lowp, probs=p_lowp, glu_interleave_size=interleave, activation=activation)
    act_lowp.backward(ref_dgrad(dy[:used], w2, splits, dtype=dtype))
    assert_close(dh[:used], h64.grad, h_lowp.grad, dtype)
    assert_close(act_p[:used], act64.detach(), act_lowp.detach(), dtype)
    if probs:
        torch.testing.assert_close(dprobs, dprobs_tri, rtol=1e-4, atol=1e-4 * float(dprobs_tri.abs().max()))
        assert not dprobs[used:].any()
        assert_close(dprobs[:used], p64.grad, p_lowp.grad, dtype)
    else:
        assert dprobs is None and dprobs_tri is None


# ---------------------------------------------------------------------------------------------
# Weights read through transposed views (transformers' gpt-oss keeps (N, H, 2F) and (N, F, H)):
# the same bits as the contiguous weights, through TMA boxes or pointers, no copy.
# ---------------------------------------------------------------------------------------------


@cpu_only
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "ptr"])
@pytest.mark.parametrize("interleave", [None, 1, 4, 8], ids=["gate|up", "k1", "k4", "k8"])
def test_interpreter_glu_kernels_take_transposed_weights(interleave, use_tma, nan_poison):
    splits, M, N, H, F = [9, 0, 14], 27, 3, 24, 32
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(M, H, generator=gen) * 3
    w1 = torch.randn(N, 2 * F, H, generator=gen) / H**0.5
    w2 = torch.randn(N, H, F, generator=gen) / F**0.5
    b1, probs = torch.randn(N, 2 * F, generator=gen), torch.rand(M, generator=gen)
    dy = torch.randn(M, H, generator=gen)
    offs = offs_of(splits, "cpu")
    w1_t = w1.transpose(1, 2).contiguous().transpose(1, 2)  # (N, 2F, H) view of an (N, H, 2F) tensor
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    assert w1_t.stride(1) == 1 and w2_t.stride(1) == 1
    kw = dict(use_tma=use_tma)
    h, act = rglu.glu_forward(x, w1, offs, b1, probs, interleave, "swiglu", **kw)
    h_t, act_t = rglu.glu_forward(x, w1_t, offs, b1, probs, interleave, "swiglu", **kw)
    assert torch.equal(h, h_t) and torch.equal(act, act_t)
    dh, act_p, dprobs = rglu.glu_backward(dy, w2, h, offs, probs, interleave, "swiglu", **kw)
    dh_t, act_p_t, dprobs_t = rglu.glu_backward(dy, w2_t, h, offs, probs, interleave, "swiglu", **kw)
    assert torch.equal(dh, dh_t) and torch.equal(act_p, act_p_t) and torch.equal(dprobs, dprobs_t)


@gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
)
@pytest.mark.parametrize("interleave", [None, 4], ids=["gate|up", "k4"])
def test_gpu_transposed_weight_grads_are_bit_equal(interleave):
    """moe_experts with fc1 and fc2 as transposed views of (N, H, 2F) and (N, F, H) leaves: the weight
    gradients reach autograd in those layouts (dw^T = x^T dy, no copy into the parameters' layout
    afterwards) and hold the bits of the stored weights' gradients (the same products summed in the
    same order: wgmma's operands swapped)."""
    T, N, K, H, F = 300, 4, 2, 192, 384
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(T)]).cuda()
    weights = torch.rand(T, K, generator=gen).to("cuda", torch.bfloat16)
    w1 = (torch.randn(N, 2 * F, H, generator=gen) / H**0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(N, H, F, generator=gen) / F**0.5).to("cuda", torch.bfloat16)
    dy = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    grads, strides = [], []
    for transposed in (False, True):
        s1 = (w1.transpose(1, 2).contiguous() if transposed else w1.clone()).requires_grad_()
        s2 = (w2.transpose(1, 2).contiguous() if transposed else w2.clone()).requires_grad_()
        v1, v2 = (s1.transpose(1, 2), s2.transpose(1, 2)) if transposed else (s1, s2)
        if transposed:
            for v in (v1, v2):
                v.register_hook(lambda g, v=v: strides.append(g.stride() == v.stride()))
        y = moekit.moe_experts(x, ids, weights, v1, v2, glu_interleave_size=interleave)
        y.backward(dy)
        grads.append(
            (s1.grad.transpose(1, 2) if transposed else s1.grad, s2.grad.transpose(1, 2) if transposed else s2.grad)
        )
    assert strides == [True, True], "a transposed weight's gradient arrived in another layout (a copy follows)"
    for name, a, b in zip(("fc1", "fc2"), *grads, strict=True):
        assert torch.equal(a, b), f"{name} gradient of the transposed weight differs from the stored one's"


@cpu_only
def test_interpreter_weights_of_other_strides_are_refused():
    offs = offs_of([2, 2], "cpu")
    w1 = torch.randn(8, 2, 16).permute(1, 2, 0)[:, ::2]  # (2, 8, 8): no unit stride in dims 1 and 2
    assert w1.stride(1) != 1 and w1.stride(2) != 1
    with pytest.raises(ValueError, match=r"fc1_weight must be a 3-D tensor with a unit stride in its last or middle"):
        rglu.glu_forward(torch.randn(4, 8), w1, offs, None, None, None, "swiglu")
