"""Host side of the fused MLP kernels: fc1 with the gated activation in its epilogue (`glu_forward`), and
fc2's dgrad with the activation's backward in its epilogue (`glu_backward`), planned and launched by the
one recipe of `moekit.ops.runtime.launch`.

Legend: M routed rows, N experts, H hidden size, F ffn size.

Two kernels compute each: the Triton kernels of `moekit.ops.kernels.glu` (every GPU, the interpreter,
every layout) and, on sm_90 with 16-bit operands through TMA and the library's own configuration, the
warp-specialised Gluon kernels of `moekit.ops.kernels.glu_hopper` (`hopper_kernels_take` says when).
Both give the same bits, so which one runs is a matter of speed only, never of results.

`glu_forward_gathered` is the forward of x's rows in expert order, x (T, H) and the token of each routed
row: by definition `glu_forward` of the gathered rows x[token_of_row]. Where the Hopper kernel takes the
call it reads the token rows itself (its GATHER variant, no (M, H) copy of x); elsewhere the rows are
gathered first and `glu_forward` runs on them. Both give the same bits (a gather is exact, and the
gathered kernel computes the same products in the same order). `moe_experts` takes it where
`gathered_fc1_pays` (narrow experts: elsewhere the GATHER kernel's cp.async main loop is slower than the
TMA kernel's by more than the gather costs; notes/moe_experts.md, "The gathered forms").
`glu_backward_gathered_partials` is the backward's counterpart over d out's token rows
(`gathered_backward_pays`).

The activation is a name of the registry (`moekit.ops.activations`); its jit pair is the function of
that name and `<name>_grad` in `moekit.ops.kernels.activations`, passed to the kernels as constexprs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton

from moekit.ops.kernels import activations as jit_activations
from moekit.ops.kernels.glu import glu_backward_kernel, glu_forward_kernel
from moekit.ops.kernels.glu_hopper import glu_backward_ws_kernel, glu_forward_ws_kernel
from moekit.ops.runtime.configs import (
    GATHERED_DOUT_MAX_FFN,
    GATHERED_FC1_MAX_FFN,
    WS_BACKWARD,
    WS_BACKWARD_GATHER,
    WS_FORWARD,
    WS_FORWARD_GATHER,
    Arch,
    GemmConfig,
    glu_candidates,
    glu_widths,
)
from moekit.ops.runtime.device import capability
from moekit.ops.runtime.launch import (
    INTERPRET,
    Launcher,
    LaunchPlan,
    Plan,
    block_groups,
    device_ctx,
    device_index,
    dot_precision,
    empty,
    next_power_of_2,
    pick_config,
    plan_launch,
    row_tiled_grid,
    tensor_key,
    use_tma,
    within_widest,
)
from moekit.ops.runtime.rows import checked_row_map, gather_sum_rows

_FORWARD = Launcher(glu_forward_kernel)
_BACKWARD = Launcher(glu_backward_kernel)
_FORWARD_WS = Launcher(glu_forward_ws_kernel)
_BACKWARD_WS = Launcher(glu_backward_ws_kernel)


def _tile_schedule(c: GemmConfig, N: int, nprog: int) -> dict[str, Any]:
    """The tile and schedule constexprs both Triton GLU kernels take from their config."""
    return dict(
        BLOCK_M=c.block_rows,
        BLOCK_C=c.block_cols,
        BLOCK_RED=c.block_red,
        GROUP_M=c.group_rows,
        BLOCK_GROUPS=block_groups(N + 2),
        NUM_PROGRAMS=nprog,
        FLATTEN=c.flatten,
    )


@functools.cache
def jit_pair(activation: str) -> dict:
    """The kernels' ACT and ACT_GRAD constexprs of a registered activation."""
    return {"ACT": getattr(jit_activations, activation), "ACT_GRAD": getattr(jit_activations, activation + "_grad")}


def transposed_weight(w: torch.Tensor, what: str) -> bool:
    """Whether a 3-D weight view is read through the tensor under it: False for a unit last stride, True
    for a unit middle stride (a transposed view of an (N, in, out) tensor, as transformers' gpt-oss
    experts keep theirs); anything else is refused."""
    if w.dim() == 3 and w.stride(2) == 1:
        return False
    if w.dim() == 3 and w.stride(1) == 1:
        return True
    raise ValueError(
        f"{what} must be a 3-D tensor with a unit stride in its last or middle dimension, got shape "
        f"{tuple(w.shape)} strides {w.stride()}"
    )


def _stored(w: torch.Tensor) -> torch.Tensor:
    """The weight as stored: itself, or the tensor under a transposed view."""
    return w.transpose(1, 2) if transposed_weight(w, "the weight") else w


def _epilogue_tma(cfg: GemmConfig, x: torch.Tensor, ffn: int, glu_block: int, tma: bool) -> bool:
    """Whether the forward's h and act leave through TMA: boxes of a tile's BLOCK_C consecutive gate (or
    up) columns need BLOCK_C | block or block = F, at least 16 bytes per box row, and 16-byte aligned rows
    of h and act."""
    return (
        cfg.epi_tma
        and tma
        and (glu_block == ffn or glu_block % cfg.block_cols == 0)
        and cfg.block_cols * x.element_size() >= 16
        and (ffn * x.element_size()) % 16 == 0
    )


def _weight_box(glu_block: int, ffn: int, block_cols: int) -> tuple[int, int]:
    """(BOX_BLOCKS, BOX_ROWS) of the forward's weight box in the 5-D view (N, F/block, 2, block, H): whole
    GLU blocks when block divides BLOCK_C and F has more than one, else a run of BLOCK_C rows inside one
    block (power-of-two box; rows past a block narrower than the tile, block = F < BLOCK_C, read as
    zeros)."""
    if glu_block < block_cols and glu_block < ffn:
        return block_cols // glu_block, glu_block
    return 1, block_cols


def _use_tma(
    forced: bool, ffn: int, glu_block: int, rows: torch.Tensor, weight: torch.Tensor, blocks_innermost: bool = False
) -> tuple[bool, bool, Arch]:
    """(operands through TMA as the plain GEMM decides, `weight` as stored; that and a Triton kernel's
    weight box every width allows; the configuration table). blocks_innermost: the GLU blocks are the
    weight's innermost dimension (fc1 stored (N, H, 2F)), whose box rows must then span 16 bytes."""
    tma, arch = use_tma(None if forced else False, rows.shape[1] > 0, rows, weight)
    box_ok = all(glu_block == ffn or glu_block % w == 0 or w % glu_block == 0 for w in glu_widths(ffn, glu_block, arch))
    if blocks_innermost and glu_block < ffn and (glu_block * weight.element_size()) % 16:
        box_ok = False
    return tma, tma and box_ok, arch


def hopper_layout_ok(kind: str, weight: torch.Tensor, ffn: int, glu_block: int, hidden: int) -> bool:
    """Whether the Hopper kernel `kind` ("fwd": weight w1 (N, 2F, H); "bwd": w2 (N, H, F)) takes this
    weight and GLU block k (F for `[gate | up]`), either orientation (`transposed_weight`).

    The weight as stored must hold its experts one after the other with a unit last stride (the
    kernels read its 2-D view), and where H is the stored middle dimension (w1 stored (N, H, 2F), w2
    (N, H, F)) BLOCK_RED | H, so that a box never reaches into the next expert. GLU blocks: the
    forward's tile of 128 activation columns needs the gate rows and the up rows as two runs of 128
    rows of fc1 (k = F or 128 | k) or its 2 x 128 gate and up rows as one run (k | 128); the
    backward's h and dh chunks of 16 columns need one GLU block per chunk (k = F, 128 | k, or
    16 | k below 128) or whole blocks inside a thread's 8 columns (k | 8). Other k (a block that
    neither divides nor is divided by the tile) run the Triton kernels."""
    config = WS_FORWARD if kind == "fwd" else WS_BACKWARD
    transposed = transposed_weight(weight, "the weight")
    stored = _stored(weight)
    block_c, epi = config["BLOCK_C"], config["EPI_COLS"]
    if kind == "fwd":
        blocks_ok = glu_block == ffn or glu_block % block_c == 0 or block_c % glu_block == 0
    else:
        narrow = glu_block < block_c and (glu_block % epi == 0 or 8 % glu_block == 0)
        blocks_ok = glu_block == ffn or glu_block % block_c == 0 or narrow
    h_middle = transposed == (kind == "fwd")
    return (
        blocks_ok
        and stored.stride(2) == 1
        and stored.stride(0) == stored.shape[1] * stored.stride(1)
        and (not h_middle or hidden % config["BLOCK_RED"] == 0)
        and config["BLOCK_M"] * 2 * ffn < 2**31
    )


def hopper_kernels_take(
    kind: str,
    rows: torch.Tensor,
    weight: torch.Tensor,
    ffn: int,
    glu_block: int,
    tma: bool,
    cfg: GemmConfig | None,
) -> bool:
    """Whether the warp-specialised Hopper kernel `kind` ("fwd" or "bwd"; rows: x or dy (M, H); weight:
    w1 (N, 2F, H) or w2 (N, H, F), either orientation) runs: an sm_90 device, 16-bit row operands and
    the stored weight through TMA (`tma`), no fixed cfg (a given cfg names a Triton kernel's
    configuration), and a layout `hopper_layout_ok` takes: every `glu_interleave_size` that divides 128
    or that 128 divides, `[gate | up]`, both weight orientations. Everything else runs the Triton
    kernel, which computes the same bits."""
    if cfg is not None or not tma or INTERPRET or rows.device.type != "cuda":
        return False
    if capability(device_index(rows.device)) != (9, 0):
        return False
    return rows.dtype in (torch.bfloat16, torch.float16) and hopper_layout_ok(
        kind, weight, ffn, glu_block, rows.shape[1]
    )


def _checked_out(
    out: tuple[torch.Tensor, ...], like: torch.Tensor, shapes: tuple[tuple[int, int], ...]
) -> tuple[torch.Tensor, ...]:
    """The caller's output tensors of a fused kernel, which must be row-major (M, X) in `like`'s dtype and
    on its device with row stride X: the kernels take the row strides as the widths. Rows of a larger
    row-major buffer qualify (a row is addressed as row * stride from the tensor's start); whether their
    start is 16-byte aligned is part of the plan's key."""
    for t, shape in zip(out, shapes, strict=True):
        if tuple(t.shape) != shape or t.dtype != like.dtype or t.device != like.device or t.stride() != (shape[1], 1):
            raise ValueError(
                f"out: expected a row-major {shape} {like.dtype} tensor on {like.device} with row stride "
                f"{shape[1]}, got {tuple(t.shape)} {t.dtype} on {t.device}, strides {t.stride()}"
            )
    return out


# --------------------------------------------------------------------------------------------------
# Forward: h = x @ w1^T (+ b1), act = ACT(gate(h), up(h)) (* probs)
# --------------------------------------------------------------------------------------------------


def _forward_launch(
    x_MH: torch.Tensor,
    w1_N2FH: torch.Tensor,
    bias_N2F: torch.Tensor | None,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    tma: bool,
    c: GemmConfig,
    aligned_out: bool,
) -> LaunchPlan:
    """glu_forward_kernel; tensors: (x, w1, h, act, bias or h, probs or h, offs). aligned_out: whether h
    and act start 16-byte aligned (TMA stores need it)."""
    M, H = x_MH.shape
    N, two_f, _ = w1_N2FH.shape
    ffn = two_f // 2
    nprog = row_tiled_grid(x_MH.device, M, N, ffn, c.block_rows, c.block_cols, c.programs_per_sm)
    box_blocks, box_rows = _weight_box(glu_block, ffn, c.block_cols)
    ints: tuple[int, ...] = (M, ffn, H, N, x_MH.stride(0), *w1_N2FH.stride(), two_f, ffn)
    ints += (bias_N2F.stride(0) if bias_N2F is not None else 0,)
    return LaunchPlan(
        _FORWARD,
        (nprog,),
        ints,
        dict(
            **jit_pair(activation),
            GLU_BLOCK=glu_block,
            HAS_BIAS=bias_N2F is not None,
            HAS_PROBS=probs_M is not None,
            USE_TMA=tma,
            UPCAST=INTERPRET,
            W_TRANSPOSED=transposed_weight(w1_N2FH, "fc1_weight"),
            DOT_PRECISION=dot_precision(x_MH.dtype),
            **_tile_schedule(c, N, nprog),
            BOX_BLOCKS=box_blocks,
            BOX_ROWS=box_rows,
            EPI_TMA=_epilogue_tma(c, x_MH, ffn, glu_block, tma and aligned_out),
            num_stages=c.stages,
            num_warps=c.warps,
        ),
    )


def _forward_ws_launch(
    x_MH: torch.Tensor,
    w1_N2FH: torch.Tensor,
    bias_N2F: torch.Tensor | None,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    gathered_rows: int | None = None,
) -> LaunchPlan:
    """glu_forward_ws_kernel; tensors as `_forward_launch`'s, then the token of each row (`offs` where
    the rows are not gathered: not read). PAIRED (k | BLOCK_C, k < F): a tile's two accumulators are
    its 2 BLOCK_C gate and up rows of fc1 in their own order. gathered_rows: None for x_MH in expert
    order; M, the rows of the token map, where x_MH is x (T, H) and the kernel gathers (GATHER)."""
    M, H = x_MH.shape
    if gathered_rows is not None:
        M = gathered_rows
    N, two_f, _ = w1_N2FH.shape
    ffn = two_f // 2
    nprog = row_tiled_grid(x_MH.device, M, N, ffn, WS_FORWARD["BLOCK_M"], WS_FORWARD["BLOCK_C"])
    w1 = _stored(w1_N2FH)  # (N, 2F, H), or the (N, H, 2F) tensor under a transposed view
    ints: tuple[int, ...] = (M, ffn, H, N, x_MH.stride(0), w1.stride(1), two_f, ffn)
    ints += (bias_N2F.stride(0) if bias_N2F is not None else 0,)
    constexprs = dict(
        **jit_pair(activation),
        GLU_BLOCK=glu_block,
        W_TRANSPOSED=transposed_weight(w1_N2FH, "fc1_weight"),
        PAIRED=glu_block != ffn and glu_block < WS_FORWARD["BLOCK_C"],
        HAS_BIAS=bias_N2F is not None,
        HAS_PROBS=probs_M is not None,
        BLOCK_GROUPS=block_groups(N + 2),
        NUM_PROGRAMS=nprog,
        **(WS_FORWARD if gathered_rows is None else WS_FORWARD_GATHER),
    )
    return LaunchPlan(_FORWARD_WS, (nprog,), ints, constexprs)


def _plan_forward(
    x_MH: torch.Tensor,
    w1_N2FH: torch.Tensor,
    offs: torch.Tensor,
    bias_N2F: torch.Tensor | None,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
    forced_tma: bool,
    cfg: GemmConfig | None,
    aligned: bool,
) -> Plan:
    M, H = x_MH.shape
    N, two_f, _ = w1_N2FH.shape
    ffn = two_f // 2
    if M == 0 or ffn == 0:
        return Plan(None, ffn)
    glu_block = ffn if glu_interleave_size is None else glu_interleave_size
    transposed = transposed_weight(w1_N2FH, "fc1_weight")
    hopper_tma, tma, arch = _use_tma(forced_tma, ffn, glu_block, x_MH, _stored(w1_N2FH), blocks_innermost=transposed)
    if hopper_kernels_take("fwd", x_MH, w1_N2FH, ffn, glu_block, hopper_tma, cfg):
        return Plan(_forward_ws_launch(x_MH, w1_N2FH, bias_N2F, probs_M, glu_block, activation), ffn)

    def trial(c: GemmConfig) -> None:
        h, act = empty((M, two_f), x_MH.device, x_MH.dtype), empty((M, ffn), x_MH.device, x_MH.dtype)
        _forward_launch(x_MH, w1_N2FH, bias_N2F, probs_M, glu_block, activation, tma, c, aligned)(
            x_MH, w1_N2FH, h, act, bias_N2F if bias_N2F is not None else h, probs_M if probs_M is not None else h, offs
        )

    if cfg is None:
        with device_ctx(x_MH.device):
            problem: tuple = ("glu_fwd", x_MH.dtype, ffn, H, N, glu_block, next_power_of_2(M), tma)
            problem += (bias_N2F is not None, probs_M is not None, activation)
            candidates = glu_candidates("fwd", x_MH.dtype, ffn, glu_block, tma, arch)
            cfg = pick_config(problem, candidates, trial, x_MH.device)
    return Plan(_forward_launch(x_MH, w1_N2FH, bias_N2F, probs_M, glu_block, activation, tma, cfg, aligned), ffn)


def _forward_outputs(
    out: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor, rows: int, ffn: int
) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """(h (rows, 2F), act (rows, F), their plan keys): fresh tensors in x's dtype (keys None: fresh
    tensors are 16-byte aligned, as a plan assumes without keys) or the caller's `out`, checked."""
    if out is None:
        return empty((rows, 2 * ffn), x.device, x.dtype), empty((rows, ffn), x.device, x.dtype), None
    h, act = _checked_out(out, x, ((rows, 2 * ffn), (rows, ffn)))
    return h, act, (tensor_key(h), tensor_key(act))


def glu_forward(
    x_MH: torch.Tensor,
    w1_N2FH: torch.Tensor,
    offs: torch.Tensor,
    bias_N2F: torch.Tensor | None,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_tma: bool = True,
    cfg: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1 + activation in one kernel: (h (M, 2F), act (M, F)), both in x's dtype; padding rows 0.

    x_MH (M, H) row-major; w1_N2FH (N, 2F, H) with a unit last or middle stride (`transposed_weight`);
    offs (N+1,) device int64; bias_N2F (N, 2F) or None; probs_M (M,) or None. out: (h, act) to write
    into instead of fresh tensors (rows of larger row-major buffers; `moe_experts` writes the rows of
    one launch into part of a buffer).
    use_tma=False forces the pointer path (tests); cfg a fixed Triton kernel configuration (tests,
    tuning), else the table's. The activation is computed from h as stored (rounded to the output
    dtype), so the backward, which recomputes it from the saved h, sees the forward's values.
    """
    M = x_MH.shape[0]
    ffn = w1_N2FH.shape[1] // 2
    h, act, out_keys = _forward_outputs(out, x_MH, M, ffn)
    key: tuple = (tensor_key(x_MH), tensor_key(w1_N2FH), tensor_key(offs), tensor_key(bias_N2F), tensor_key(probs_M))
    key += (glu_interleave_size, activation, use_tma, cfg, out_keys)
    aligned = h.data_ptr() % 16 == 0 and act.data_ptr() % 16 == 0
    plan = plan_launch(
        "glu_fwd",
        key,
        lambda: _plan_forward(
            x_MH, w1_N2FH, offs, bias_N2F, probs_M, glu_interleave_size, activation, use_tma, cfg, aligned
        ),
    )
    if plan.launch is not None:
        # The Hopper kernel's token map: not read where the rows are not gathered.
        tokens = (offs,) if plan.launch.launcher is _FORWARD_WS else ()
        with device_ctx(x_MH.device):
            plan.launch(
                x_MH,
                w1_N2FH,
                h,
                act,
                bias_N2F if bias_N2F is not None else h,
                probs_M if probs_M is not None else h,
                offs,
                *tokens,
            )
    return h, act


def _gather_variant_takes(
    kind: str, rows_TH: torch.Tensor, weight: torch.Tensor, ffn: int, glu_interleave_size: int | None, use_tma: bool
) -> bool:
    """Whether the Hopper kernel `kind` ("fwd": x's rows, w1; "bwd": d out's rows, w2) runs its GATHER
    variant over the token rows rows_TH: wherever `hopper_kernels_take` takes the call, rows_TH standing
    for the gathered rows (the same dtype, device and H), and rows_TH's row stride a multiple of 16
    elements on a 16-byte aligned base: Triton proves the 16-byte alignment of the copies' addresses only
    from those (its argument specialisation), and cp.async's 16-byte copies do not compile without it (an
    sm_90 compile error at H = 200, 400-byte rows, on the H200). Every real model's H qualifies (2048,
    2880, 4096, 7168)."""
    if ffn == 0 or rows_TH.dim() != 2 or rows_TH.stride(0) % 16 != 0 or rows_TH.data_ptr() % 16 != 0:
        return False
    glu_block = ffn if glu_interleave_size is None else glu_interleave_size
    blocks_innermost = kind == "fwd" and transposed_weight(weight, "fc1_weight")
    hopper_tma, _, _ = _use_tma(use_tma, ffn, glu_block, rows_TH, _stored(weight), blocks_innermost=blocks_innermost)
    return hopper_kernels_take(kind, rows_TH, weight, ffn, glu_block, hopper_tma, None)


def gathered_kernel_takes(
    x_TH: torch.Tensor, w1_N2FH: torch.Tensor, glu_interleave_size: int | None, use_tma: bool = True
) -> bool:
    """Whether `glu_forward_gathered` runs the Hopper kernel's GATHER variant (x's token rows read by the
    kernel) rather than gathering the rows first (`_gather_variant_takes`)."""
    return _gather_variant_takes("fwd", x_TH, w1_N2FH, w1_N2FH.shape[1] // 2, glu_interleave_size, use_tma)


def gathered_fc1_pays(x_TH: torch.Tensor, w1_N2FH: torch.Tensor, glu_interleave_size: int | None) -> bool:
    """Whether the layer's fc1 should read x's token rows in its loads: the GATHER variant takes the call
    (`gathered_kernel_takes`) and F is within `configs.GATHERED_FC1_MAX_FFN` for the device's
    architecture (where reading the rows by cp.async costs less than gathering them first)."""
    return within_widest(GATHERED_FC1_MAX_FFN, x_TH.device, w1_N2FH.shape[1] // 2) and gathered_kernel_takes(
        x_TH, w1_N2FH, glu_interleave_size
    )


def glu_forward_gathered(
    x_TH: torch.Tensor,
    token_of_row: torch.Tensor,
    w1_N2FH: torch.Tensor,
    offs: torch.Tensor,
    bias_N2F: torch.Tensor | None,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_tma: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`glu_forward` of the routed rows x_TH[token_of_row] (M rows in expert order), by definition and
    bit for bit: (h (M, 2F), act (M, F)) in x's dtype, padding rows 0.

    x_TH (T, H) row-major, the tokens; token_of_row (M,) or (M, 1) int32 / int64, each routed row's
    token (`ExpertOrder.token_of_row`), values in [0, T) (not checked: they stay on the device); rows
    past offs[N] are padding: the Hopper kernel never reads their tokens, the gather-first path does
    (it gathers every row), so they must be valid too. The other
    arguments as `glu_forward`'s, their rows the M routed rows. Where `gathered_kernel_takes` the call,
    the Hopper kernel reads the token rows itself; elsewhere the rows are gathered into an (M, H)
    tensor first (moekit's row kernel, exact) and `glu_forward` runs on it: the same result by the same
    definition, not a fallback to other values. use_tma=False forces the gather-first path (tests).
    """
    if x_TH.dim() != 2 or x_TH.stride(1) != 1:
        raise ValueError(f"x_TH must be 2-D (tokens, hidden), row-major, got shape {tuple(x_TH.shape)}")
    index = checked_row_map(token_of_row, "token_of_row", x_TH, "x_TH")
    M = index.shape[0]
    if not gathered_kernel_takes(x_TH, w1_N2FH, glu_interleave_size, use_tma):
        x_MH = gather_sum_rows(x_TH, index)
        return glu_forward(x_MH, w1_N2FH, offs, bias_N2F, probs_M, glu_interleave_size, activation, out=out)
    ffn = w1_N2FH.shape[1] // 2
    h, act, out_keys = _forward_outputs(out, x_TH, M, ffn)
    if M == 0 or ffn == 0:
        return h, act
    tokens = index.view(-1)
    key: tuple = (tensor_key(x_TH), tensor_key(tokens), tensor_key(w1_N2FH), tensor_key(offs))
    key += (tensor_key(bias_N2F), tensor_key(probs_M), glu_interleave_size, activation, out_keys)
    glu_block = ffn if glu_interleave_size is None else glu_interleave_size
    plan = plan_launch(
        "glu_fwd_gathered",
        key,
        lambda: Plan(_forward_ws_launch(x_TH, w1_N2FH, bias_N2F, probs_M, glu_block, activation, M), ffn),
    )
    assert plan.launch is not None  # M and F are not 0
    with device_ctx(x_TH.device):
        plan.launch(
            x_TH,
            w1_N2FH,
            h,
            act,
            bias_N2F if bias_N2F is not None else h,
            probs_M if probs_M is not None else h,
            offs,
            tokens,
        )
    return h, act


# --------------------------------------------------------------------------------------------------
# Backward: dA = dy @ w2, dh = ACT_GRAD(gate(h), up(h), dA (* probs)), act_p, d probs partials
# --------------------------------------------------------------------------------------------------


def _backward_launch(
    dy_MH: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    tma: bool,
    c: GemmConfig,
) -> LaunchPlan:
    """glu_backward_kernel; tensors: (dy, w2, h, dh, act_p, probs or dh, partials or dh, offs)."""
    M, H = dy_MH.shape
    N, _, ffn = w2_NHF.shape
    nprog = row_tiled_grid(dy_MH.device, M, N, ffn, c.block_rows, c.block_cols, c.programs_per_sm)
    w2 = _stored(w2_NHF)  # (N, H, F), or the (N, F, H) tensor under a transposed view
    ints = (M, ffn, H, N, dy_MH.stride(0), w2.stride(0), w2.stride(1), h_M2F.stride(0), 2 * ffn, ffn)
    return LaunchPlan(
        _BACKWARD,
        (nprog,),
        ints,
        dict(
            **jit_pair(activation),
            GLU_BLOCK=glu_block,
            HAS_PROBS=probs_M is not None,
            USE_TMA=tma,
            UPCAST=INTERPRET,
            W_TRANSPOSED=transposed_weight(w2_NHF, "fc2_weight"),
            DOT_PRECISION=dot_precision(dy_MH.dtype),
            **_tile_schedule(c, N, nprog),
            num_stages=c.stages,
            num_warps=c.warps,
        ),
    )


def _backward_ws_launch(
    dy_MH: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    gathered_rows: int | None = None,
) -> LaunchPlan:
    """glu_backward_ws_kernel; tensors as `_backward_launch`'s, then the token of each row (`offs` where
    the rows are not gathered: not read). gathered_rows as `_forward_ws_launch`'s: None for dy_MH in
    expert order; M, the rows of the token map, where dy_MH is d out (T, H) and the kernel gathers."""
    M, H = dy_MH.shape
    if gathered_rows is not None:
        M = gathered_rows
    N, _, ffn = w2_NHF.shape
    nprog = row_tiled_grid(dy_MH.device, M, N, ffn, WS_BACKWARD["BLOCK_M"], 2 * WS_BACKWARD["BLOCK_C"])
    w2 = _stored(w2_NHF)  # (N, H, F), or the (N, F, H) tensor under a transposed view
    ints = (M, ffn, H, N, dy_MH.stride(0), w2.stride(1), h_M2F.stride(0), 2 * ffn, ffn)
    constexprs = dict(
        **jit_pair(activation),
        GLU_BLOCK=glu_block,
        W_TRANSPOSED=transposed_weight(w2_NHF, "fc2_weight"),
        HAS_PROBS=probs_M is not None,
        BLOCK_GROUPS=block_groups(N + 2),
        NUM_PROGRAMS=nprog,
        **(WS_BACKWARD if gathered_rows is None else WS_BACKWARD_GATHER),
    )
    return LaunchPlan(_BACKWARD_WS, (nprog,), ints, constexprs)


def _plan_backward(
    dy_MH: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    offs: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
    forced_tma: bool,
    cfg: GemmConfig | None,
) -> Plan:
    """The backward's plan; its `cols` are the rows of the d probs partials."""
    M, H = dy_MH.shape
    N, _, ffn = w2_NHF.shape
    if M == 0 or ffn == 0:
        return Plan(None, 0)
    glu_block = ffn if glu_interleave_size is None else glu_interleave_size
    hopper_tma, tma, arch = _use_tma(forced_tma, ffn, glu_block, dy_MH, _stored(w2_NHF))
    if hopper_kernels_take("bwd", dy_MH, w2_NHF, ffn, glu_block, hopper_tma, cfg):
        launch = _backward_ws_launch(dy_MH, w2_NHF, h_M2F, probs_M, glu_block, activation)
        return Plan(launch, triton.cdiv(ffn, 2 * WS_BACKWARD["BLOCK_C"]))

    def trial(c: GemmConfig) -> None:
        dh, act = empty((M, 2 * ffn), dy_MH.device, dy_MH.dtype), empty((M, ffn), dy_MH.device, dy_MH.dtype)
        part = empty((triton.cdiv(ffn, c.block_cols), M), dy_MH.device, torch.float32)
        _backward_launch(dy_MH, w2_NHF, h_M2F, probs_M, glu_block, activation, tma, c)(
            dy_MH, w2_NHF, h_M2F, dh, act, probs_M if probs_M is not None else dh, part, offs
        )

    if cfg is None:
        with device_ctx(dy_MH.device):
            problem: tuple = ("glu_bwd", dy_MH.dtype, ffn, H, N, glu_block, next_power_of_2(M), tma)
            problem += (probs_M is not None, activation)
            candidates = glu_candidates("bwd", dy_MH.dtype, ffn, glu_block, tma, arch)
            cfg = pick_config(problem, candidates, trial, dy_MH.device)
    launch = _backward_launch(dy_MH, w2_NHF, h_M2F, probs_M, glu_block, activation, tma, cfg)
    return Plan(launch, triton.cdiv(ffn, cfg.block_cols))


def glu_backward_partials(
    dy_MH: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    offs: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_tma: bool = True,
    cfg: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fc2's dgrad with the activation's backward: (dh (M, 2F), act_p (M, F), d probs partials (F tiles,
    M) fp32 ((0, M) where no kernel runs; None without probs)).

    dy_MH (M, H) row-major; w2_NHF (N, H, F) with a unit last or middle stride; h_M2F the forward's
    saved h. act_p = ACT(h) (* probs) is fc2's wgrad operand; the partials hold, per column tile,
    sum_j act[r, j] * dA[r, j] (the activation part of d probs). A caller that runs the rows in several
    launches concatenates their partials and sums them once: on the GPU a sum's association depends on
    its shape, so only the sum of the whole (F tiles, M) gives the bits of one launch. out, use_tma, cfg
    as glu_forward's.
    """
    M = dy_MH.shape[0]
    ffn = w2_NHF.shape[2]
    if out is None:
        dh, act = empty((M, 2 * ffn), dy_MH.device, dy_MH.dtype), empty((M, ffn), dy_MH.device, dy_MH.dtype)
        out_keys = None
    else:
        dh, act = _checked_out(out, dy_MH, ((M, 2 * ffn), (M, ffn)))
        out_keys = (tensor_key(dh), tensor_key(act))
    key: tuple = (tensor_key(dy_MH), tensor_key(w2_NHF), tensor_key(h_M2F), tensor_key(offs), tensor_key(probs_M))
    key += (glu_interleave_size, activation, use_tma, cfg, out_keys)
    plan = plan_launch(
        "glu_bwd",
        key,
        lambda: _plan_backward(dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation, use_tma, cfg),
    )
    if plan.launch is None:
        return dh, act, (torch.zeros(0, M, device=dy_MH.device) if probs_M is not None else None)
    part = empty((plan.cols, M), dy_MH.device, torch.float32) if probs_M is not None else None
    # The Hopper kernel's token map: not read where the rows are not gathered.
    tokens = (offs,) if plan.launch.launcher is _BACKWARD_WS else ()
    with device_ctx(dy_MH.device):
        plan.launch(
            dy_MH,
            w2_NHF,
            h_M2F,
            dh,
            act,
            probs_M if probs_M is not None else dh,
            part if part is not None else dh,
            offs,
            *tokens,
        )
    return dh, act, part


def gathered_backward_kernel_takes(
    d_out_TH: torch.Tensor, w2_NHF: torch.Tensor, glu_interleave_size: int | None, use_tma: bool = True
) -> bool:
    """Whether `glu_backward_gathered_partials` runs the Hopper backward's GATHER variant (d out's token
    rows read by the kernel) rather than gathering the rows first (`_gather_variant_takes`)."""
    return _gather_variant_takes("bwd", d_out_TH, w2_NHF, w2_NHF.shape[2], glu_interleave_size, use_tma)


def gathered_backward_pays(d_out_TH: torch.Tensor, w2_NHF: torch.Tensor, glu_interleave_size: int | None) -> bool:
    """Whether the layer's fc2 backward should read d out's token rows in its loads (the backward's GATHER
    variant and fc2's weight gradient through the row map): the GATHER variant takes the call and F is
    within `configs.GATHERED_DOUT_MAX_FFN` for the device's architecture."""
    return within_widest(GATHERED_DOUT_MAX_FFN, d_out_TH.device, w2_NHF.shape[2]) and gathered_backward_kernel_takes(
        d_out_TH, w2_NHF, glu_interleave_size
    )


def glu_backward_gathered_partials(
    d_out_TH: torch.Tensor,
    token_of_row: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    offs: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
    *,
    use_tma: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`glu_backward_partials` of the routed rows d_out_TH[token_of_row] (M rows in expert order), by
    definition and bit for bit: (dh (M, 2F), act_p (M, F), d probs partials or None).

    d_out_TH (T, H) row-major, the layer's output gradient; token_of_row as `glu_forward_gathered`'s
    (values in [0, T), not checked). Where `gathered_backward_kernel_takes` the call, the Hopper kernel
    reads the token rows itself; elsewhere they are gathered first (moekit's row kernel, exact) and
    `glu_backward_partials` runs on them. use_tma=False forces the gather-first path (tests)."""
    if d_out_TH.dim() != 2 or d_out_TH.stride(1) != 1:
        raise ValueError(f"d_out_TH must be 2-D (tokens, hidden), row-major, got shape {tuple(d_out_TH.shape)}")
    index = checked_row_map(token_of_row, "token_of_row", d_out_TH, "d_out_TH")
    if not gathered_backward_kernel_takes(d_out_TH, w2_NHF, glu_interleave_size, use_tma):
        dy_MH = gather_sum_rows(d_out_TH, index)
        return glu_backward_partials(dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation)
    M, ffn = index.shape[0], w2_NHF.shape[2]
    dh, act = empty((M, 2 * ffn), d_out_TH.device, d_out_TH.dtype), empty((M, ffn), d_out_TH.device, d_out_TH.dtype)
    if M == 0:
        return dh, act, (torch.zeros(0, M, device=d_out_TH.device) if probs_M is not None else None)
    tokens = index.view(-1)
    key: tuple = (tensor_key(d_out_TH), tensor_key(tokens), tensor_key(w2_NHF), tensor_key(h_M2F), tensor_key(offs))
    key += (tensor_key(probs_M), glu_interleave_size, activation)
    glu_block = ffn if glu_interleave_size is None else glu_interleave_size
    plan = plan_launch(
        "glu_bwd_gathered",
        key,
        lambda: Plan(
            _backward_ws_launch(d_out_TH, w2_NHF, h_M2F, probs_M, glu_block, activation, M),
            triton.cdiv(ffn, 2 * WS_BACKWARD["BLOCK_C"]),
        ),
    )
    assert plan.launch is not None  # M and F are not 0
    part = empty((plan.cols, M), d_out_TH.device, torch.float32) if probs_M is not None else None
    with device_ctx(d_out_TH.device):
        plan.launch(
            d_out_TH,
            w2_NHF,
            h_M2F,
            dh,
            act,
            probs_M if probs_M is not None else dh,
            part if part is not None else dh,
            offs,
            tokens,
        )
    return dh, act, part


def glu_backward(
    dy_MH: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    offs: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_tma: bool = True,
    cfg: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`glu_backward_partials` with the partials summed: (dh, act_p, d probs (M,) fp32 or None), the sum
    over the column tiles taken in a fixed order (deterministic)."""
    dh, act, part = glu_backward_partials(
        dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation, out=out, use_tma=use_tma, cfg=cfg
    )
    return dh, act, (part.sum(0) if part is not None else None)
