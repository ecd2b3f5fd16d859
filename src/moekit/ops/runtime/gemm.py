# ruff: noqa: E741  (I and O are the legend's in/out feature sizes)
"""Host side of the grouped GEMM kernels (`moekit.ops.kernels.grouped_gemm`): the three products of a
grouped linear and the per-group row sums of the bias gradients, planned and launched by the one recipe
of `moekit.ops.runtime.launch`.

Legend: M routed rows, N groups (experts), I in_features, O out_features.

    forward  y[r]  = x[r] @ w[g]^T (+ bias[g] (* bias_scale[r]))   x (M, I), w (N, O, I) -> y (M, O)
    dgrad    dx[r] = dy[r] @ w[g]                                   dy (M, O), w (N, O, I) -> dx (M, I)
    wgrad    dw[g] = dy[rows of g]^T @ x[rows of g]                 dy (M, O), x (M, I) -> dw (N, O, I)
    row sum  db[g] = sum of dy[r] (* scale[r]) over rows r of g     dy (M, O) -> db (N, O)

Rows of group g are `offs[g]:offs[g+1]`, `offs` a device int64 tensor of N+1 entries that the host
never reads: every kernel derives its tile schedule from it on the device, so the launches are free of
host syncs and can be captured in a CUDA graph and replayed with other split sizes. Rows past offs[N]
are padding: outputs there are zeros and they take part in no reduction.

A weight may be any (N, O, I) view with a unit stride in its last or its middle dimension: a view of
an (N, I, O) tensor (transformers' `is_transposed` experts) is read in place, as the other operand
order of the same kernel, never copied.
"""

from __future__ import annotations

from typing import overload

import torch
import triton

from moekit.ops.kernels.grouped_gemm import group_row_sum_kernel, grouped_mm_kernel, wgrad_kernel
from moekit.ops.kernels.grouped_gemm_hopper import grouped_mm_ws_kernel, wgrad_gathered_ws_kernel
from moekit.ops.runtime.configs import (
    GATHERED_WGRAD_EXTRA_STAGES,
    GATHERED_WGRAD_MAX_FFN,
    MM_PINGPONG,
    MM_SCHEDULE,
    MM_WS,
    MM_WS_512_GROUPS,
    ROW_SUM_TILES,
    WGRAD_GATHERED_DY_ROWS,
    WGRAD_GATHERED_WS,
    GemmConfig,
    gemm_candidates,
)
from moekit.ops.runtime.device import cuda_capability
from moekit.ops.runtime.launch import (
    INTERPRET,
    Launcher,
    LaunchPlan,
    Plan,
    arch_of,
    block_groups,
    check_triton_device,
    device_ctx,
    dot_precision,
    empty,
    grid_size,
    next_power_of_2,
    pick_config,
    plan_launch,
    row_tiled_grid,
    tensor_key,
    use_tma,
    within_widest,
)
from moekit.ops.runtime.rows import checked_row_map

_GROUPED_MM = Launcher(grouped_mm_kernel)
_GROUPED_MM_WS = Launcher(grouped_mm_ws_kernel)
_WGRAD = Launcher(wgrad_kernel)
_WGRAD_GATHERED_WS = Launcher(wgrad_gathered_ws_kernel)
_ROW_SUM = Launcher(group_row_sum_kernel)


def check_offs(offs: torch.Tensor, groups: int, device: torch.device) -> torch.Tensor:
    """`offs` as the kernels take it: (groups + 1,) int32/int64 on `device`."""
    if offs.dim() != 1 or offs.shape[0] != groups + 1:
        raise ValueError(f"offs must have shape ({groups + 1},), got {tuple(offs.shape)}")
    if offs.device != device:
        raise ValueError(f"offs is on {offs.device}, inputs on {device}")
    if offs.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"offs must be int64 or int32, got {offs.dtype}")
    return offs


def _weight_operand(a: torch.Tensor, w: torch.Tensor, trans_b: bool) -> tuple[torch.Tensor, bool]:
    """The weight as the kernel reads it: (N, O, I) with unit last stride as is; a view with unit
    middle stride (an (N, I, O) tensor transposed) as that tensor, with the other operand order."""
    if a.dim() != 2:
        raise ValueError(f"expected a 2-D input (rows, features), got shape {tuple(a.shape)}")
    if w.dtype != a.dtype or w.device != a.device:
        raise ValueError(f"the weight is {w.dtype} on {w.device}, the input is {a.dtype} on {a.device}")
    if w.dim() == 3 and w.stride(2) == 1:
        return w, trans_b
    if w.dim() == 3 and w.stride(1) == 1:
        return w.transpose(1, 2), not trans_b
    raise ValueError(
        "the weight must be a 3-D (groups, out, in) tensor with a unit stride in its last or middle dimension, "
        f"got shape {tuple(w.shape)} strides {w.stride()}"
    )


def check_bias(
    bias_NO: torch.Tensor | None,
    bias_scale_M: torch.Tensor | None,
    x: torch.Tensor,
    N: int,
    O: int,
    dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A grouped forward's optional bias (N, O) (of `dtype` unless None) and its optional per-row
    factor (M,) for the rows x (M, X), checked (ValueError) and made as the kernels read them: a
    unit-stride bias row and a contiguous factor (copies otherwise). A factor needs a bias."""
    if bias_NO is None and bias_scale_M is not None:
        raise ValueError("bias_scale given without bias: it scales the bias")
    if bias_NO is not None:
        if tuple(bias_NO.shape) != (N, O):
            raise ValueError(f"bias must have shape ({N}, {O}), got {tuple(bias_NO.shape)}")
        if dtype is not None and bias_NO.dtype != dtype:
            raise ValueError(f"bias must be {dtype} (the output's dtype), got {bias_NO.dtype}")
        if bias_NO.device != x.device:
            raise ValueError(f"bias is on {bias_NO.device}, x on {x.device}")
        if bias_NO.stride(-1) != 1:
            bias_NO = bias_NO.contiguous()
    if bias_scale_M is not None:
        if bias_scale_M.dim() != 1 or bias_scale_M.shape[0] != x.shape[0]:
            raise ValueError(f"bias_scale must have shape ({x.shape[0]},), got {tuple(bias_scale_M.shape)}")
        if bias_scale_M.device != x.device:
            raise ValueError(f"bias_scale is on {bias_scale_M.device}, x on {x.device}")
        bias_scale_M = bias_scale_M.contiguous()
    return bias_NO, bias_scale_M


def mm_schedule(M: int, N: int, out_cols: int, out_size: int, cfg: GemmConfig, tma: bool, device: torch.device) -> dict:
    """The schedule and tiling constexprs (with the launch's num_stages / num_warps) of a persistent
    row-tiled grouped GEMM kernel (`grouped_mm_kernel`, `grouped_mm_fp8_kernel`: the same parameter
    names) for M rows, N groups and a fresh contiguous (M, out_cols) output of out_size-byte elements
    under `cfg`, with (tma) or without TMA operand loads. NUM_PROGRAMS is the launch's grid size: one
    program per multiprocessor at most, fewer when the tile bound (each group's row tiles, plus a
    partial tile per group and the padding pseudo-group) is smaller."""
    nprog = row_tiled_grid(device, M, N, out_cols, cfg.block_rows, cfg.block_cols, cfg.programs_per_sm)
    # TMA stores need a 16-byte aligned row stride of the (contiguous, fresh) output.
    epi_tma = bool(cfg.epi_tma and tma and (out_cols * out_size) % 16 == 0)
    return dict(
        USE_TMA=tma,
        BLOCK_M=cfg.block_rows,
        BLOCK_C=cfg.block_cols,
        BLOCK_RED=cfg.block_red,
        GROUP_M=cfg.group_rows,
        BLOCK_GROUPS=block_groups(N + 2),
        NUM_PROGRAMS=nprog,
        FLATTEN=cfg.flatten,
        EPI_TMA=epi_tma,
        num_stages=cfg.stages,
        num_warps=cfg.warps,
    )


def _mm_launch(
    a: torch.Tensor,
    b: torch.Tensor,
    out_cols: int,
    bias: torch.Tensor | None,
    has_scale: bool,
    trans_b: bool,
    cfg: GemmConfig,
    tma: bool,
) -> LaunchPlan:
    """grouped_mm_kernel for a (M, red) row-major input, a fresh (M, out_cols) output and b (N, b_rows,
    b_cols) (b_rows = out_cols when trans_b); tensors: (a, b, out, bias or out, scale or out, offs)."""
    M, red = a.shape
    N, b_rows, b_cols = b.shape
    schedule = mm_schedule(M, N, out_cols, a.element_size(), cfg, tma, a.device)
    ints: tuple[int, ...] = (M, out_cols, red, N, b_rows, b_cols, a.stride(0), b.stride(0), b.stride(1), out_cols)
    ints += (bias.stride(0) if bias is not None else 0,)
    return LaunchPlan(
        _GROUPED_MM,
        (schedule["NUM_PROGRAMS"],),
        ints,
        dict(
            TRANS_B=trans_b,
            HAS_BIAS=bias is not None,
            HAS_SCALE=has_scale,
            UPCAST=INTERPRET,
            DOT_PRECISION=dot_precision(a.dtype),
            **schedule,
        ),
    )


def hopper_mm_takes(
    a: torch.Tensor, b: torch.Tensor, cols: int, trans_b: bool, cfg: GemmConfig | None, tma: bool
) -> bool:
    """Whether the Gluon forward/dgrad (`grouped_mm_ws_kernel`) runs a product of the row operand a and
    the weight b (N, b_rows, b_cols) as the kernel reads it (`_weight_operand`): an sm_90 CUDA device (not
    the interpreter), 16-bit operands through TMA (`tma`: aligned bases and row strides, a non-empty
    reduction), no fixed cfg (a given cfg names one of the Triton kernel's configurations), more output
    columns than half its tile (narrower outputs take the Triton kernel's 128-column tile), the groups one
    after the other in b (its 2-D view), fewer than 2**31 rows in that view, and where b[g] is (RED, COLS)
    (the dgrad of an (N, O, I) weight) RED a multiple of the kernel's reduction step (a box must not reach
    the next group's rows). Elsewhere the Triton kernel runs, with the same bits."""
    if cfg is not None or not tma or INTERPRET or a.device.type != "cuda":
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or cuda_capability(a.device) != (9, 0):
        return False
    if cols <= MM_WS["BLOCK_C0"]:
        return False
    N, b_rows, _ = b.shape
    if b.stride(0) != b_rows * b.stride(1) or N * b_rows >= 2**31:
        return False
    return trans_b or b_rows % MM_WS["BLOCK_RED"] == 0


def mm_ws_table(red: int, num_groups: int) -> dict:
    """The table of the Hopper forward/dgrad's launch for a reduction of `red` columns over `num_groups`
    groups: the ping-pong (MM_PINGPONG) at reductions up to MM_SCHEDULE["PINGPONG_MAX_RED"], else the
    shared tile (MM_WS), with MM_WS_512_GROUPS' registers where the tile schedule's group vectors are
    512 entries or more (their kernel holds them in its load warp)."""
    if red <= MM_SCHEDULE["PINGPONG_MAX_RED"]:
        return MM_PINGPONG
    return {**MM_WS, **MM_WS_512_GROUPS} if block_groups(num_groups + 2) >= 512 else MM_WS


def _mm_ws_launch(
    a: torch.Tensor, b: torch.Tensor, out_cols: int, bias: torch.Tensor | None, has_scale: bool, trans_b: bool
) -> LaunchPlan:
    """grouped_mm_ws_kernel for a (M, red) row-major input, a fresh (M, out_cols) output and b as
    `_mm_launch`'s, the same tensors, under `mm_ws_table`'s table; the same bits under every one."""
    M, red = a.shape
    N = b.shape[0]
    cfg = mm_ws_table(red, N)
    nprog = row_tiled_grid(a.device, M, N, out_cols, cfg["BLOCK_M"], cfg["BLOCK_C0"] + cfg["BLOCK_C1"])
    ints = (M, out_cols, red, N, a.stride(0), b.stride(1), out_cols, bias.stride(0) if bias is not None else 0)
    return LaunchPlan(
        _GROUPED_MM_WS,
        (nprog,),
        ints,
        dict(
            TRANS_B=trans_b,
            HAS_BIAS=bias is not None,
            HAS_SCALE=has_scale,
            # TMA stores need a 16-byte aligned row stride of the (contiguous, fresh) output.
            EPI_TMA=(out_cols * a.element_size()) % 16 == 0,
            BLOCK_GROUPS=block_groups(N + 2),
            NUM_PROGRAMS=nprog,
            **cfg,
        ),
    )


def _plan_mm(
    op: str,
    a: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    cfg: GemmConfig | None,
    forced_tma: bool | None,
) -> Plan:
    check_triton_device(a)
    b, trans_b = _weight_operand(a, w, op == "fwd")
    contiguous = a.stride(1) != 1
    if contiguous:
        a = a.contiguous()
    N, O, I = w.shape
    red, cols = (I, O) if op == "fwd" else (O, I)
    if a.shape[1] != red:
        raise ValueError(f"the input has {a.shape[1]} columns; a weight of shape {tuple(w.shape)} needs {red}")
    offs = check_offs(offs, N, a.device)
    M = a.shape[0]
    if M == 0 or cols == 0 or N == 0:
        return Plan(None, cols, contiguous, zero=N == 0)
    tma, arch = use_tma(forced_tma, red > 0, a, b)
    if hopper_mm_takes(a, b, cols, trans_b, cfg, tma):
        return Plan(_mm_ws_launch(a, b, cols, bias, scale is not None, trans_b), cols, contiguous)
    with device_ctx(a.device):
        if cfg is None:

            def trial(c: GemmConfig) -> None:
                out = empty((M, cols), a.device, a.dtype)
                _mm_launch(a, b, cols, bias, scale is not None, trans_b, c, tma)(
                    a, b, out, bias if bias is not None else out, scale if scale is not None else out, offs
                )

            problem = ("mm", op, a.dtype, cols, red, N, next_power_of_2(M), tma, bias is not None, scale is not None)
            cfg = pick_config(problem, gemm_candidates(op, a.dtype, tma, arch, cols), trial, a.device)
    return Plan(_mm_launch(a, b, cols, bias, scale is not None, trans_b, cfg, tma), cols, contiguous)


def _mm(
    op: str,
    a: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    cfg: GemmConfig | None,
    forced_tma: bool | None,
) -> torch.Tensor:
    """forward (op "fwd": out (M, O)) and dgrad (op "dgrad": out (M, I))."""
    key = (op, tensor_key(a), tensor_key(w), tensor_key(offs), tensor_key(bias), tensor_key(scale), cfg, forced_tma)
    plan = plan_launch(
        "grouped_mm", (*key, dot_precision(a.dtype)), lambda: _plan_mm(op, a, w, offs, bias, scale, cfg, forced_tma)
    )
    if plan.contiguous:
        a = a.contiguous()
    out = empty((a.shape[0], plan.cols), a.device, a.dtype)
    if plan.launch is None:
        return out.zero_() if plan.zero else out
    b = w if w.stride(2) == 1 else w.transpose(1, 2)
    with device_ctx(a.device):
        plan.launch(a, b, out, bias if bias is not None else out, scale if scale is not None else out, offs)
    return out


def grouped_gemm_forward(
    x_MI: torch.Tensor,
    w_NOI: torch.Tensor,
    offs: torch.Tensor,
    bias_NO: torch.Tensor | None = None,
    bias_scale_M: torch.Tensor | None = None,
    *,
    cfg: GemmConfig | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """Grouped forward: y (M, O) with y[r] = x[r] @ w[g]^T (+ bias[g] (* bias_scale[r])).

    x_MI: (M, I) fp32/bf16/fp16, unit column stride preferred (copied otherwise). w_NOI: (N, O, I),
    same dtype, unit stride in its last or middle dimension. offs: (N+1,) int64 device tensor,
    offs[0] = 0, non-decreasing, offs[N] <= M. bias_NO: optional (N, O); bias_scale_M: optional (M,)
    per-row factor of the bias (router probabilities), any float dtype. Rows r >= offs[N] are written
    as 0. cfg / use_tma: a fixed kernel configuration and operand path (tests and tuning); None =
    chosen here. Returns a fresh (M, O) tensor of x's dtype; accumulation and epilogue math in fp32.
    M and every feature size must stay below 2**31 (TMA coordinates are int32).
    """
    bias_NO, bias_scale_M = check_bias(bias_NO, bias_scale_M, x_MI, w_NOI.shape[0], w_NOI.shape[1], None)
    return _mm("fwd", x_MI, w_NOI, offs, bias_NO, bias_scale_M, cfg, use_tma)


def grouped_gemm_dgrad(
    dy_MO: torch.Tensor,
    w_NOI: torch.Tensor,
    offs: torch.Tensor,
    *,
    cfg: GemmConfig | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """Grouped dgrad: dx (M, I) with dx[r] = dy[r] @ w[g]; rows r >= offs[N] are 0. Arguments as
    `grouped_gemm_forward`'s."""
    return _mm("dgrad", dy_MO, w_NOI, offs, None, None, cfg, use_tma)


def _wgrad_launch(
    dy: torch.Tensor, x: torch.Tensor, rows: int, num_groups: int, cfg: GemmConfig, tma: bool, gather: tuple[bool, bool]
) -> LaunchPlan:
    """wgrad_kernel for row-major dy, x and a fresh dw (N, O, I) over `rows` routed rows, dy's (x's) read
    through a row map where gather[0] (gather[1]); tensors: (dy, x, dw, offs, dy's map, x's map), a map
    that is not read replaced by offs."""
    O, I = dy.shape[1], x.shape[1]
    bound = num_groups * triton.cdiv(O, cfg.block_rows) * triton.cdiv(I, cfg.block_cols)
    nprog = grid_size(dy.device, bound)
    epi_tma = bool(cfg.epi_tma and tma and (I * dy.element_size()) % 16 == 0)
    return LaunchPlan(
        _WGRAD,
        (nprog,),
        (rows, O, I, num_groups, dy.stride(0), x.stride(0), O * I, I),
        dict(
            USE_TMA=tma,
            GATHER_DY=gather[0],
            GATHER_X=gather[1],
            UPCAST=INTERPRET,
            DOT_PRECISION=dot_precision(dy.dtype),
            BLOCK_O=cfg.block_rows,
            BLOCK_I=cfg.block_cols,
            BLOCK_M=cfg.block_red,
            GROUP_O=cfg.group_rows,
            BLOCK_GROUPS=block_groups(num_groups + 1),
            NUM_PROGRAMS=nprog,
            FLATTEN=cfg.flatten,
            EPI_TMA=epi_tma,
            num_stages=cfg.stages + (GATHERED_WGRAD_EXTRA_STAGES if any(gather) else 0),
            num_warps=cfg.warps,
        ),
    )


def hopper_wgrad_takes(
    dy: torch.Tensor, x: torch.Tensor, gather: tuple[bool, bool], cfg: GemmConfig | None, tma: bool
) -> bool:
    """Whether the Gluon wgrad (`wgrad_gathered_ws_kernel`) runs a wgrad whose x rows come through a row
    map (and dy's do not): an sm_90 CUDA device (not the interpreter), 16-bit operands through TMA
    (`tma`), no fixed cfg (a given cfg names one of the Triton kernel's configurations), and x's rows
    copyable 16 bytes at a time (row stride a multiple of 16 elements on a 16-byte aligned base, I a
    multiple of 8: the alignment Triton must prove for cp.async's 16-byte copies). Elsewhere the
    Triton kernel reads the rows by pointer loads, with the same bits."""
    if gather != (False, True) or cfg is not None or not tma or INTERPRET or dy.device.type != "cuda":
        return False
    if dy.dtype not in (torch.bfloat16, torch.float16) or cuda_capability(dy.device) != (9, 0):
        return False
    return x.stride(0) % 16 == 0 and x.data_ptr() % 16 == 0 and x.shape[1] % 8 == 0


def _wgrad_ws_launch(dy: torch.Tensor, x: torch.Tensor, rows: int, num_groups: int, trans_out: bool) -> LaunchPlan:
    """wgrad_gathered_ws_kernel over `rows` routed rows, tensors as `_wgrad_launch`'s (dy's map slot not
    read); with trans_out dw's transpose (N, I, O) is stored."""
    O, I = dy.shape[1], x.shape[1]
    cfg = WGRAD_GATHERED_WS
    bound = num_groups * triton.cdiv(O, cfg["BLOCK_O"]) * triton.cdiv(I, cfg["BLOCK_I"])
    nprog = grid_size(dy.device, bound)
    ints = (rows, O, I, num_groups, dy.stride(0), x.stride(0))
    return LaunchPlan(_WGRAD_GATHERED_WS, (nprog,), ints, dict(NUM_PROGRAMS=nprog, TRANS_OUT=trans_out, **cfg))


def _plan_wgrad(
    dy_MO: torch.Tensor,
    x_MI: torch.Tensor,
    offs: torch.Tensor,
    maps: tuple[torch.Tensor | None, torch.Tensor | None],
    cfg: GemmConfig | None,
    forced_tma: bool | None,
) -> Plan:
    check_triton_device(dy_MO)
    if dy_MO.dim() != 2 or x_MI.dim() != 2:
        raise ValueError(f"dy {tuple(dy_MO.shape)} and x {tuple(x_MI.shape)} must be (M, O) and (M, I)")
    # The routed rows: a row map's length where an operand is read through one, else the operand's rows.
    lengths = {m.shape[0] if m is not None else t.shape[0] for m, t in zip(maps, (dy_MO, x_MI), strict=True)}
    if len(lengths) != 1:
        raise ValueError(
            f"dy {tuple(dy_MO.shape)} and x {tuple(x_MI.shape)} (or their row maps) must have the same number of rows"
        )
    if dy_MO.dtype != x_MI.dtype or dy_MO.device != x_MI.device:
        raise ValueError(f"dy is {dy_MO.dtype} on {dy_MO.device}, x is {x_MI.dtype} on {x_MI.device}")
    # Operands at unit column stride: .contiguous() on both where either is not (a no-op for one that
    # already is; the fused path's operands are row-major).
    contiguous = dy_MO.stride(1) != 1 or x_MI.stride(1) != 1
    dy = dy_MO.contiguous() if contiguous else dy_MO
    x = x_MI.contiguous() if contiguous else x_MI
    if offs.dim() != 1 or offs.shape[0] < 1:
        raise ValueError(f"offs must be a 1-D tensor of N+1 group offsets, got shape {tuple(offs.shape)}")
    N = offs.shape[0] - 1
    offs = check_offs(offs, N, dy.device)
    M = lengths.pop()
    O, I = dy.shape[1], x.shape[1]
    if N == 0 or O == 0 or I == 0:
        return Plan(None, I, contiguous)
    tma, arch = use_tma(forced_tma, M > 0, dy, x)
    gather = (maps[0] is not None, maps[1] is not None)
    if hopper_wgrad_takes(dy, x, gather, cfg, tma):
        return Plan(_wgrad_ws_launch(dy, x, M, N, False), I, contiguous)
    if WGRAD_GATHERED_DY_ROWS["SWAPPED"] and hopper_wgrad_takes(x, dy, gather[::-1], cfg, tma):
        # dy's rows through the map: the same kernel computes x^T dy, dy's rows as its gathered operand,
        # and stores the transpose, dw.
        return Plan(_wgrad_ws_launch(x, dy, M, N, True), I, contiguous, swapped=True)
    with device_ctx(dy.device):
        if cfg is None:

            def trial(c: GemmConfig) -> None:
                dw = empty((N, O, I), dy.device, dy.dtype)
                tensors = (m if m is not None else offs for m in maps)
                _wgrad_launch(dy, x, M, N, c, tma, gather)(dy, x, dw, offs, *tensors)

            # The problem does not name the gathers: a gathered call and a plain one of the same shapes share
            # one configuration, so they give the same bits (the same products in the same order).
            problem = ("wgrad", dy.dtype, O, I, N, next_power_of_2(M), tma)
            cfg = pick_config(problem, gemm_candidates("wgrad", dy.dtype, tma, arch, I), trial, dy.device)
    return Plan(_wgrad_launch(dy, x, M, N, cfg, tma, gather), I, contiguous)


def grouped_gemm_wgrad(
    dy_MO: torch.Tensor,
    x_MI: torch.Tensor,
    offs: torch.Tensor,
    *,
    dy_rows: torch.Tensor | None = None,
    x_rows: torch.Tensor | None = None,
    cfg: GemmConfig | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """Grouped wgrad in one launch: dw (N, O, I) with dw[g] = dy[rows of g]^T @ x[rows of g].

    dy_MO: (M, O), x_MI: (M, I), same dtype; offs: (N+1,) int64 device tensor (N = its length - 1).
    Groups with no rows get zeros. Rows r >= offs[N] take part in nothing. cfg, use_tma as in
    grouped_gemm_forward.

    dy_rows / x_rows: an (M,) int32/int64 row map: routed row r of dy (x) is dy_MO[dy_rows[r]]
    (x_MI[x_rows[r]]), and that operand may have any number of rows: the wgrad of the gathered rows,
    bit for bit, without writing them (the kernel reads them; `moe_experts` passes x's token rows and
    each sorted row's token). Values must be valid rows below offs[N] (not checked: they stay on the
    device); entries at or past offs[N] are not read. On sm_90 x's rows come through the Gluon kernel
    where `hopper_wgrad_takes` says so (the same bits as the Triton kernel's), and dy's where it takes
    the swapped problem and `configs.WGRAD_GATHERED_DY_ROWS` says so (x^T dy stored transposed: the
    bits of the Triton kernel's wgrad of the swapped operands).
    """
    maps = (
        None if dy_rows is None else checked_row_map(dy_rows, "dy_rows", dy_MO, "dy").view(-1),
        None if x_rows is None else checked_row_map(x_rows, "x_rows", x_MI, "x").view(-1),
    )
    key: tuple = (tensor_key(dy_MO), tensor_key(x_MI), tensor_key(offs), cfg, use_tma, dot_precision(dy_MO.dtype))
    key += (tensor_key(maps[0]), tensor_key(maps[1]))
    plan = plan_launch("wgrad", key, lambda: _plan_wgrad(dy_MO, x_MI, offs, maps, cfg, use_tma))
    dy = dy_MO.contiguous() if plan.contiguous else dy_MO
    x = x_MI.contiguous() if plan.contiguous else x_MI
    N = offs.shape[0] - 1
    dw = empty((N, dy.shape[1], x.shape[1]), dy.device, dy.dtype)
    if plan.launch is not None:
        with device_ctx(dy.device):
            if plan.swapped:  # x as the kernel's dy, dy's rows through the map as its x rows
                dy_map = maps[0]
                assert dy_map is not None  # a swapped plan reads dy's rows through its map
                plan.launch(x, dy, dw, offs, offs, dy_map)
            else:
                plan.launch(dy, x, dw, offs, *(m if m is not None else offs for m in maps))
    return dw


def gathered_wgrad_pays(x_TH: torch.Tensor, ffn: int) -> bool:
    """Whether the layer's fc1 weight gradient should read x's token rows x_TH through the row map in its
    loads rather than gather them first: F within `configs.GATHERED_WGRAD_MAX_FFN` for the device's
    architecture (the same bits either way)."""
    return within_widest(GATHERED_WGRAD_MAX_FFN, x_TH.device, ffn)


def group_row_sum(src_MC: torch.Tensor, offs: torch.Tensor, row_scale_M: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group row sums (the bias gradient of a grouped linear): (N, X) in src's dtype, src (M, X),
    with out[g] = sum over rows r of group g of src[r] (* row_scale[r]), summed in fp32.

    Deterministic (fixed-order partial sums over row slices per group, then a fixed-shape sum; no
    atomics) and reads no padding row. offs: (N+1,) device int64; row_scale_M: optional (M,) float
    (router probabilities for fc2's bias).
    """
    return _row_sums(src_MC, offs, row_scale_M, None)[0]


def group_row_sum_and_dot(
    src_MC: torch.Tensor,
    offs: torch.Tensor,
    vec_NC: torch.Tensor,
    row_scale_M: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_row_sum` and, from the same pass over src, dot (M,) fp32 with dot[r] = <src[r], vec[g]> for
    the group g of row r (0 for padding rows): fc2's bias gradient and the bias term of d probs.

    rows: None, or (M,) / (M, 1) int32 / int64 rows of src (values in range, not checked: they stay on the
    device): row r of the groups is then src[rows[r]], read where it lies (d out's token rows through the
    route's token_of_row), never gathered into an (M, C) copy; the sums and dots are those of the gathered
    rows, bit for bit."""
    if vec_NC.dim() != 2 or vec_NC.shape != (offs.shape[0] - 1, src_MC.shape[1]):
        raise ValueError(f"vec must have shape ({offs.shape[0] - 1}, {src_MC.shape[1]}), got {tuple(vec_NC.shape)}")
    return _row_sums(src_MC, offs, row_scale_M, vec_NC, rows)


@overload
def _row_sums(
    src_MC: torch.Tensor,
    offs: torch.Tensor,
    row_scale_M: torch.Tensor | None,
    vec_NC: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def _row_sums(
    src_MC: torch.Tensor,
    offs: torch.Tensor,
    row_scale_M: torch.Tensor | None,
    vec_NC: None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]: ...
def _row_sums(
    src_MC: torch.Tensor,
    offs: torch.Tensor,
    row_scale_M: torch.Tensor | None,
    vec_NC: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_triton_device(src_MC)
    if src_MC.dim() != 2:
        raise ValueError(f"expected a 2-D (rows, columns) tensor, got shape {tuple(src_MC.shape)}")
    src = src_MC if src_MC.stride(1) == 1 else src_MC.contiguous()
    index = None if rows is None else checked_row_map(rows, "rows", src, "src")
    N = offs.shape[0] - 1
    offs = check_offs(offs, N, src.device)
    M = src.shape[0] if index is None else index.shape[0]
    C = src.shape[1]
    splits, block_c = ROW_SUM_TILES[arch_of(src.device)]
    dots = None
    if vec_NC is not None:
        vec_NC = vec_NC if vec_NC.stride(-1) == 1 else vec_NC.contiguous()
        # Padding rows are never visited: their dot stays 0.
        dots = torch.zeros((triton.cdiv(C, block_c), M), device=src.device, dtype=torch.float32)
    if N == 0 or C == 0:
        sums = torch.zeros((N, C), device=src.device, dtype=src.dtype)
        return sums, (torch.zeros(M, device=src.device) if vec_NC is not None else None)
    part = torch.empty((splits, N, C), device=src.device, dtype=torch.float32)
    with device_ctx(src.device):
        _ROW_SUM[(triton.cdiv(C, block_c), N, splits)](
            src,
            row_scale_M if row_scale_M is not None else src,
            part,
            vec_NC if vec_NC is not None else src,
            dots if dots is not None else part,
            offs,
            index if index is not None else offs,
            M,
            C,
            N,
            src.stride(0),
            vec_NC.stride(0) if vec_NC is not None else 0,
            HAS_SCALE=row_scale_M is not None,
            ROW_DOT=vec_NC is not None,
            GATHER=index is not None,
            SPLITS=splits,
            BLOCK_M=32,
            BLOCK_C=block_c,
            num_warps=4,
        )
    # Fixed-shape torch sums have a fixed reduction order: deterministic.
    return part.sum(0).to(src.dtype), (dots.sum(0) if dots is not None else None)
