"""Grouped MLP: fc1 (H -> 2F) + gated activation (x router probability) + fc2 (F -> H), per expert.

Legend: M rows, N experts, H hidden size, F ffn size.

Per row r of expert e with probability p_r:
    y_r = fc2_e(act(fc1_e(x_r)) * p_r) + b2_e * p_r
so the probability scales both the activation output and the fc2 bias, and `probs` gets a gradient.

Backends. `loop` and `torch` compose `grouped_linear`, `swiglu` and `grouped_linear`. `triton` (and
`auto` where it resolves to triton) runs the fused path of `_fused_mlp`, kernels in
`moekit.ops.grouped_mlp_kernels` (on Hopper both fused kernels' in
`moekit.ops.grouped_mlp_hopper_kernels`, same h, act, dh and act_p bits; `_glu_forward_ws_ok` and
`_glu_backward_ws_ok` say when):

    forward   fc1 GEMM + bias + activation (+ probs) in one kernel -> h (M, 2F) (saved), act (M, F)
              fc2 GEMM with the probs-scaled bias                   -> y (M, H); act is freed
    backward  fc2 dgrad + the activation's backward in one kernel   -> dh (M, 2F), act_p (M, F),
                                                                       d probs partials
              fc2 wgrad (dy, act_p), fc1 dgrad (dh), fc1 wgrad (dh, x), bias sums (group_row_sum)

Held between forward and backward: x (the caller's tensor itself, saved as is, so saved-tensor hooks
can replace it), h in x's dtype, probs, and the weights. No fp32 (M, F) or (M, 2F) tensor anywhere.
The forward is two autograd nodes (fc1 + activation, fc2): h is released when fc2's backward
(which yields dh) has run, before fc1's dgrad and wgrad.
"""

from __future__ import annotations

import functools

import torch

from moekit._splits import GroupOffsets, MSplits, resolve_splits
from moekit.ops import library
from moekit.ops.gemm_config import GemmConfig
from moekit.ops.grouped_linear import (
    Weight,
    _as_list,
    _check_params,
    _probe_weight,
    _row_major,
    _stack_weights,
    grouped_linear,
    grouped_linear_reference,
    select_backend,
)
from moekit.ops.swiglu import ACTIVATIONS, check_activation, check_interleave, swiglu, swiglu_reference


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_mlp(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias):
    n1, two_f = _check_params(x, _as_list(fc1_weight), _as_list(fc1_bias))
    if two_f % 2:
        raise ValueError(f"fc1 must map to 2F features (gate and up), got out_features={two_f}")
    ffn = two_f // 2
    fc2_in = [w.shape[-1] for w in _as_list(fc2_weight)]
    if fc2_in and fc2_in[0] != ffn:
        # Checked here so the message names fc2, not the activation that _check_params would call x.
        raise ValueError(f"fc2 takes {fc2_in[0]} input features; fc1's 2F = {two_f} outputs give F = {ffn}")
    probe = x.new_empty(0, ffn)
    n2, h_out = _check_params(probe, _as_list(fc2_weight), _as_list(fc2_bias))
    if n1 != n2:
        raise ValueError(f"fc1 has {n1} experts but fc2 has {n2}")
    if h_out != x.shape[1]:
        raise ValueError(f"fc2 maps to {h_out} features; expected the hidden size {x.shape[1]}")
    return n1, ffn


def grouped_mlp(
    x: torch.Tensor,
    fc1_weight: Weight,
    fc2_weight: Weight,
    m_splits: MSplits,
    *,
    probs: torch.Tensor | None = None,
    fc1_bias: Weight | None = None,
    fc2_bias: Weight | None = None,
    activation: str = "swiglu",
    glu_interleave_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Expert MLP over rows sorted by expert.

    x: (M, H). fc1_weight: (N, 2F, H) or N x (2F, H), rows in `[gate | up]` order or interleaved
    with `glu_interleave_size`. fc2_weight: (N, H, F) or N x (H, F). probs: optional (M,).
    Biases: (N, out), N x (out,) or None. Returns (M, H) in x's dtype; padding rows are zero.
    """
    check_activation(activation)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, hidden), got shape {tuple(x.shape)}")
    num_experts, ffn = _check_mlp(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias)
    check_interleave(ffn, glu_interleave_size)
    # Resolve once: one host->device copy for host splits, shared by both GEMMs and the backward.
    go = resolve_splits(m_splits, num_experts, x.shape[0], x.device)
    if probs is not None:
        probs = _check_probs(probs, x.shape[0], x.device)
    w1s, w2s = _as_list(fc1_weight), _as_list(fc2_weight)
    fc1_impl = select_backend(backend, x, _probe_weight(w1s))
    fc2_impl = select_backend(backend, x.new_empty(0, ffn), _probe_weight(w2s))
    if fc1_impl.name == "triton" and fc2_impl.name == "triton":
        return _fused_mlp(
            go,
            probs,
            glu_interleave_size,
            activation,
            _row_major(x),
            tuple(w1s),
            tuple(w2s),
            tuple(_as_list(fc1_bias)),
            tuple(_as_list(fc2_bias)),
        )
    h = grouped_linear(x, fc1_weight, go, fc1_bias, backend=backend)
    a = swiglu(h, probs=probs, glu_interleave_size=glu_interleave_size, activation=activation)
    scale = probs.reshape(-1) if probs is not None and fc2_bias is not None else None
    return grouped_linear(a, fc2_weight, go, fc2_bias, backend=backend, bias_scale=scale)


def grouped_mlp_reference(
    x: torch.Tensor,
    fc1_weight: Weight,
    fc2_weight: Weight,
    m_splits: MSplits,
    *,
    probs: torch.Tensor | None = None,
    fc1_bias: Weight | None = None,
    fc2_bias: Weight | None = None,
    activation: str = "swiglu",
    glu_interleave_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """float64 reference of `grouped_mlp`; returns float64."""
    h = grouped_linear_reference(x, fc1_weight, m_splits, fc1_bias)
    a = swiglu_reference(h, probs=probs, glu_interleave_size=glu_interleave_size, activation=activation)
    return grouped_linear_reference(a, fc2_weight, m_splits, fc2_bias, bias_scale=probs)


# --------------------------------------------------------------------------------------------------
# The fused triton path
# --------------------------------------------------------------------------------------------------


def _check_probs(probs: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    if probs.shape not in ((rows,), (rows, 1)):
        raise ValueError(f"probs must have shape ({rows},) or ({rows}, 1), one per row; got {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise TypeError(f"probs must be floating point, got {probs.dtype}")
    if probs.device != device:
        raise ValueError(f"probs is on {probs.device} but x is on {device}")
    return probs.reshape(rows)


@functools.cache
def _glu_widths(ffn: int, glu_block: int) -> tuple[int, ...]:
    """Activation-column widths BLOCK_C of the fused kernels for this ffn size and GLU block, widest
    first. The weight box of a tile needs k | BLOCK_C or BLOCK_C | k (or k = F); no width above the
    next power of two of F (a wider tile would be all padding)."""
    widths = (16, 8) if _interpreting() else (128, 64, 32, 16)
    cap = max(1 << (ffn - 1).bit_length(), widths[-1])
    fits = [w for w in widths if w <= cap and (glu_block == ffn or glu_block % w == 0 or w % glu_block == 0)]
    return tuple(fits) or (min(cap, widths[0]),)


def _interpreting() -> bool:
    from moekit.ops import grouped_gemm as gg

    return gg._INTERPRET


@functools.cache
def _glu_candidates(kernel: str, dtype: torch.dtype, ffn: int, glu_block: int, use_tma: bool) -> list[GemmConfig]:
    """Configurations of the fused kernel `kernel` ("fwd" or "bwd"), the first one the default.

    GemmConfig's fields here: block_rows = BLOCK_M, block_cols = BLOCK_C (activation columns: the
    forward's tile is twice as wide in h), block_red = BLOCK_RED, epi_tma = the forward's TMA
    epilogue where the layout allows it (the backward's epilogue moves h, dh and act_p by pointer).
    Both kernels use 128 x 128 activation columns: the forward holds two fp32 accumulators (gate and
    up, the register budget of one 128 x 256 tile of the plain GEMM), the backward one. Measured on
    the H200 over the README's four shapes (benchmarks/results/h200_tune_fused_mlp_558d69b.json,
    notes/grouped_mlp.md): the forward is fastest with the tile loop and the reduction loop left
    unfused (flatten=False: 1.25-1.46x the fused pipeline, whose TMA-store epilogue stalls it) and
    3 stages (4 do not fit in shared memory); the backward with 4 stages and the loops unfused too
    (benchmarks/results/h200_glu_bwd_variants_3ed272b.json, against this one: the fused pipeline
    0.91-1.02x, 5 stages 0.96-1.03x, a 128 x 256 tile 0.94-1.0x). Narrower tiles and 64-row tiles
    lost everywhere (0.5-0.7x). One candidate each: no tuning sync."""
    widths = _glu_widths(ffn, glu_block)
    if _interpreting():
        return [GemmConfig(16, widths[0], 16, 8, 1, 4, False, True)]
    if not use_tma or dtype == torch.float32:
        return [GemmConfig(128, widths[0], 64, 8, 3, 8, True, True)]
    if kernel == "fwd":
        return [GemmConfig(128, widths[0], 64, 8, 3, 8, False, True)]
    return [GemmConfig(128, widths[0], 64, 8, 4, 8, False)]


def _glu_epilogue_tma(cfg: GemmConfig, x: torch.Tensor, ffn: int, glu_block: int, use_tma: bool) -> bool:
    """Whether the forward's h and act leave through TMA: boxes of a tile's BLOCK_C consecutive gate
    (or up) columns need BLOCK_C | k or k = F, at least 16 bytes per box row, and 16-byte aligned
    rows of h and act."""
    return (
        cfg.epi_tma
        and use_tma
        and (glu_block == ffn or glu_block % cfg.block_cols == 0)
        and cfg.block_cols * x.element_size() >= 16
        and (ffn * x.element_size()) % 16 == 0
    )


def _glu_weight_box(glu_block: int, ffn: int, block_cols: int) -> tuple[int, int]:
    """(BOX_BLOCKS, BOX_ROWS) of the forward's weight box in the 5-D view (N, F/k, 2, k, H): whole GLU
    blocks when k divides BLOCK_C and F has more than one, else a run of BLOCK_C rows inside one
    block (power-of-two box; rows past a block that is narrower than the tile, k = F < BLOCK_C,
    read as zeros)."""
    if glu_block < block_cols and glu_block < ffn:
        return block_cols // glu_block, glu_block
    return 1, block_cols


def _glu_use_tma(use_tma: bool, ffn: int, glu_block: int, *operands: torch.Tensor) -> bool:
    """Operands through TMA: as the plain GEMM decides, and a weight box the narrowest width allows."""
    from moekit.ops import grouped_gemm as gg

    widths = _glu_widths(ffn, glu_block)
    box_ok = all(glu_block == ffn or glu_block % w == 0 or w % glu_block == 0 for w in widths)
    ok, _ = gg._resolve_tma(None if use_tma else False, operands[0].shape[1] > 0, *operands)
    return ok and box_ok


def _glu_pick(
    kind: str, key: tuple, cands: list[GemmConfig], launch, device: torch.device, cfg: GemmConfig | None
) -> GemmConfig:
    from moekit.ops import grouped_gemm as gg

    return cfg if cfg is not None else gg._pick((kind, *key), cands, launch, device)


@functools.cache
def _glu_launchers():
    """(forward, backward) kernel launchers; imported on first use, the module itself needs no triton."""
    from moekit.ops.grouped_mlp_kernels import glu_backward_kernel, glu_forward_kernel
    from moekit.ops.triton_launch import Launcher

    return Launcher(glu_forward_kernel), Launcher(glu_backward_kernel)


# The Hopper forward's one configuration (grouped_mlp_hopper_kernels): a 128 x (128 + 128) tile,
# 3 slots of 64 reduction columns (4 do not fit in shared memory beside the two h staging tiles),
# the epilogue partition 16 columns at a time with 88 registers a thread (32 columns spill), the
# load partition 24 registers, the mma partition the rest of the 128 per thread of 16 warps.
# Measured on the H200 (notes/grouped_mlp.md, v8).
WS_FORWARD = dict(
    BLOCK_M=128, BLOCK_C=128, BLOCK_RED=64, GROUP_M=8, STAGES=3, EPI_COLS=16, EPI_REGS=88, num_warps=8, maxnreg=128
)


@functools.cache
def _ws_forward_launcher():
    from moekit.ops.grouped_mlp_hopper_kernels import glu_forward_ws_kernel
    from moekit.ops.triton_launch import Launcher

    return Launcher(glu_forward_ws_kernel)


def _glu_forward_ws_ok(
    x_MH: torch.Tensor, w1_N2FH: torch.Tensor, glu_block: int, use_tma: bool, cfg: GemmConfig | None
) -> bool:
    """Whether the forward runs the warp-specialised Hopper kernel: an sm_90 device, 16-bit operands
    through TMA, the library's own configuration (cfg None; a given cfg names a glu_forward_kernel
    configuration), the gate and up rows of a tile's columns in one run of 128 rows of w1 (k = F or
    128 | k), w1's experts one after the other (its 2-D view (N * 2F, H)) and a tile's element
    offsets in int32 (BLOCK_M rows of h). Everything else runs glu_forward_kernel, which computes
    the same bits."""
    return _hopper_ws_ok(x_MH, w1_N2FH, w1_N2FH.shape[1] // 2, glu_block, use_tma, cfg, WS_FORWARD)


def _hopper_ws_ok(
    rows: torch.Tensor,
    weight: torch.Tensor,
    ffn: int,
    glu_block: int,
    use_tma: bool,
    cfg: GemmConfig | None,
    config: dict,
) -> bool:
    """What both Hopper kernels need (`config`: WS_FORWARD or WS_BACKWARD; rows: x or dy (M, H);
    weight: w1 (N, 2F, H) or w2 (N, H, F)): an sm_90 device, 16-bit row operands through TMA, no
    fixed cfg, k = F or BLOCK_C | k, the weight's experts one after the other with a unit last
    stride (its 2-D view), and a tile's element offsets in int32."""
    if cfg is not None or not use_tma or _interpreting() or rows.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(rows.device) != (9, 0):
        return False
    return (
        rows.dtype in (torch.bfloat16, torch.float16)
        and (glu_block == ffn or glu_block % config["BLOCK_C"] == 0)
        and weight.stride(2) == 1
        and weight.stride(0) == weight.shape[1] * weight.stride(1)
        and config["BLOCK_M"] * 2 * ffn < 2**31
    )


def _glu_forward_ws_launch(x_MH, w1_N2FH, bias_N2F, probs_M, k: int, activation: str):
    """The launch of the Hopper forward; tensors as `_glu_forward_launch`'s."""
    from moekit.ops import grouped_gemm as gg
    from moekit.ops.triton_launch import LaunchPlan

    M, H = x_MH.shape
    N, two_f, _ = w1_N2FH.shape
    ffn = two_f // 2
    bound = (_cdiv(M, WS_FORWARD["BLOCK_M"]) + N + 1) * _cdiv(ffn, WS_FORWARD["BLOCK_C"])
    nprog = gg._grid_size(x_MH.device, bound)
    ints = (
        M,
        ffn,
        H,
        N,
        x_MH.stride(0),
        w1_N2FH.stride(1),
        two_f,
        ffn,
        bias_N2F.stride(0) if bias_N2F is not None else 0,
    )
    return LaunchPlan(
        _ws_forward_launcher(),
        (nprog,),
        ints,
        dict(
            ACTIVATION=ACTIVATIONS.index(activation),
            GLU_BLOCK=k,
            HAS_BIAS=bias_N2F is not None,
            HAS_PROBS=probs_M is not None,
            BLOCK_GROUPS=gg._block_groups(N + 2),
            NUM_PROGRAMS=nprog,
            **WS_FORWARD,
        ),
    )


def glu_forward(
    x_MH,
    w1_N2FH,
    offs,
    bias_N2F,
    probs_M,
    glu_interleave_size,
    activation,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_tma=True,
    cfg: GemmConfig | None = None,
):
    """fc1 + activation in one kernel: (h (M, 2F), act (M, F)), both in x's dtype; padding rows 0.

    x_MH (M, H) row-major; w1_N2FH (N, 2F, H) with unit last stride; offs (N+1,) device int64;
    bias_N2F (N, 2F) or None; probs_M (M,) or None. out: (h, act) to write into instead of fresh
    tensors, see `_checked_out` (moe_experts writes the rows of one launch into part of a buffer).
    use_tma=False forces the pointer path (tests); cfg a fixed kernel configuration (tests, tuning),
    else the tuned one of `_glu_candidates`. The launch is planned once per problem
    (`_plan_glu_forward`, cached by the tensors' keys).
    """
    from moekit.ops import grouped_gemm as gg
    from moekit.ops.triton_launch import tensor_key

    M = x_MH.shape[0]
    ffn = w1_N2FH.shape[1] // 2
    if out is None:
        h = gg._empty((M, 2 * ffn), x_MH.device, x_MH.dtype)
        act = gg._empty((M, ffn), x_MH.device, x_MH.dtype)
        out_keys = None  # fresh tensors: 16-byte aligned, as the plan assumes without keys
    else:
        h, act = _checked_out(out, x_MH, ((M, 2 * ffn), (M, ffn)))
        out_keys = (tensor_key(h), tensor_key(act))
    key = gg._plan_key(
        "glu_fwd",
        tensor_key(x_MH),
        tensor_key(w1_N2FH),
        tensor_key(offs),
        tensor_key(bias_N2F),
        tensor_key(probs_M),
        glu_interleave_size,
        activation,
        use_tma,
        cfg,
        out_keys,
    )
    plan = gg._planned(
        key,
        lambda: _plan_glu_forward(
            x_MH, w1_N2FH, offs, bias_N2F, probs_M, glu_interleave_size, activation, use_tma, cfg, _aligned(h, act)
        ),
    )
    if plan.launch is not None:
        with gg._device_ctx(x_MH.device):
            plan.launch(
                x_MH,
                w1_N2FH,
                h,
                act,
                bias_N2F if bias_N2F is not None else h,
                probs_M if probs_M is not None else h,
                offs,
            )
    return h, act


def _checked_out(
    out: tuple[torch.Tensor, ...], like: torch.Tensor, shapes: tuple[tuple[int, int], ...]
) -> tuple[torch.Tensor, ...]:
    """The caller's output tensors of a fused kernel, which must be row-major (M, C) in `like`'s dtype
    and on its device with row stride C: the kernels take the row strides as the widths. Rows of a
    larger row-major buffer qualify (a row is addressed as row * stride from the tensor's start);
    whether their start is 16-byte aligned is part of the plan's key."""
    for t, shape in zip(out, shapes, strict=True):
        if tuple(t.shape) != shape or t.dtype != like.dtype or t.device != like.device or t.stride() != (shape[1], 1):
            raise ValueError(
                f"out: expected a row-major {shape} {like.dtype} tensor on {like.device} with row "
                f"stride {shape[1]}, got {tuple(t.shape)} {t.dtype} on {t.device}, strides {t.stride()}"
            )
    return out


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _glu_forward_launch(
    x_MH, w1_N2FH, bias_N2F, probs_M, k: int, activation: str, use_tma: bool, c: GemmConfig, aligned_out: bool
):
    """The launch of the forward kernel; tensors: (x, w1, h, act, bias or h, probs or h, offs).
    aligned_out: whether h and act start 16-byte aligned (TMA stores need it)."""
    from moekit.ops import grouped_gemm as gg
    from moekit.ops.triton_launch import LaunchPlan

    M, H = x_MH.shape
    N, two_f, _ = w1_N2FH.shape
    ffn = two_f // 2
    bound = (_cdiv(M, c.block_rows) + N + 1) * _cdiv(ffn, c.block_cols)
    nprog = gg._grid_size(x_MH.device, bound, c.programs_per_sm)
    box_blocks, box_rows = _glu_weight_box(k, ffn, c.block_cols)
    ints = (
        M,
        ffn,
        H,
        N,
        x_MH.stride(0),
        w1_N2FH.stride(0),
        w1_N2FH.stride(1),
        two_f,
        ffn,
        bias_N2F.stride(0) if bias_N2F is not None else 0,
    )
    return LaunchPlan(
        _glu_launchers()[0],
        (nprog,),
        ints,
        dict(
            ACTIVATION=ACTIVATIONS.index(activation),
            GLU_BLOCK=k,
            HAS_BIAS=bias_N2F is not None,
            HAS_PROBS=probs_M is not None,
            USE_TMA=use_tma,
            UPCAST=gg._INTERPRET,
            DOT_PRECISION=gg._dot_precision(x_MH.dtype),
            BLOCK_M=c.block_rows,
            BLOCK_C=c.block_cols,
            BLOCK_RED=c.block_red,
            GROUP_M=c.group_rows,
            BLOCK_GROUPS=gg._block_groups(N + 2),
            NUM_PROGRAMS=nprog,
            FLATTEN=c.flatten,
            BOX_BLOCKS=box_blocks,
            BOX_ROWS=box_rows,
            EPI_TMA=_glu_epilogue_tma(c, x_MH, ffn, k, use_tma and aligned_out),
            num_stages=c.stages,
            num_warps=c.warps,
        ),
    )


def _plan_glu_forward(
    x_MH, w1_N2FH, offs, bias_N2F, probs_M, glu_interleave_size, activation, use_tma, cfg, aligned_out: bool
):
    """The forward's launch for this problem as `_Plan` (launch None: nothing to compute), its
    config chosen once; aligned_out as `_glu_forward_launch`'s."""
    from moekit.ops import grouped_gemm as gg

    M, H = x_MH.shape
    N, two_f, _ = w1_N2FH.shape
    ffn = two_f // 2
    if M == 0 or ffn == 0:
        return gg._Plan(ffn, False, None)
    k = ffn if glu_interleave_size is None else glu_interleave_size
    use_tma = _glu_use_tma(use_tma, ffn, k, x_MH, w1_N2FH)
    if _glu_forward_ws_ok(x_MH, w1_N2FH, k, use_tma, cfg):
        return gg._Plan(ffn, False, _glu_forward_ws_launch(x_MH, w1_N2FH, bias_N2F, probs_M, k, activation))

    def trial(c: GemmConfig) -> None:
        h = gg._empty((M, two_f), x_MH.device, x_MH.dtype)
        act = gg._empty((M, ffn), x_MH.device, x_MH.dtype)
        _glu_forward_launch(x_MH, w1_N2FH, bias_N2F, probs_M, k, activation, use_tma, c, aligned_out)(
            x_MH, w1_N2FH, h, act, bias_N2F if bias_N2F is not None else h, probs_M if probs_M is not None else h, offs
        )

    with gg._device_ctx(x_MH.device):
        key = (x_MH.dtype, ffn, H, N, k, gg._bucket(M), use_tma, bias_N2F is not None, probs_M is not None, activation)
        chosen = _glu_pick("glu_fwd", key, _glu_candidates("fwd", x_MH.dtype, ffn, k, use_tma), trial, x_MH.device, cfg)
    return gg._Plan(
        ffn, False, _glu_forward_launch(x_MH, w1_N2FH, bias_N2F, probs_M, k, activation, use_tma, chosen, aligned_out)
    )


def glu_backward(
    dy_MH,
    w2_NHF,
    h_M2F,
    offs,
    probs_M,
    glu_interleave_size,
    activation,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_tma=True,
    cfg: GemmConfig | None = None,
):
    """fc2's dgrad with the activation's backward: (dh (M, 2F), act_p (M, F), dprobs (M,) fp32 or None).

    dy_MH (M, H) row-major; w2_NHF (N, H, F) with unit last stride; h_M2F the forward's saved h.
    act_p = act(h) (* probs) is fc2's wgrad operand; dprobs = sum_j act[r, j] * dA[r, j] per row
    (the activation part of d probs), summed over the F tiles in a fixed order. out: (dh, act_p) to
    write into, as glu_forward's. cfg as glu_forward's.
    """
    dh, act, part = glu_backward_partials(
        dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation, out=out, use_tma=use_tma, cfg=cfg
    )
    # A fixed-shape sum over the F tiles: a fixed order, deterministic.
    return dh, act, (part.sum(0) if part is not None else None)


def glu_backward_partials(
    dy_MH,
    w2_NHF,
    h_M2F,
    offs,
    probs_M,
    glu_interleave_size,
    activation,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_tma=True,
    cfg: GemmConfig | None = None,
):
    """`glu_backward` with dprobs left as the kernel's partials: (dh, act_p, (F tiles, M) fp32, (0, M)
    where no kernel runs, or None without probs). A caller that runs the rows in several launches
    concatenates their partials and sums them once: on the GPU a sum's association depends on its
    shape, so only the sum of the whole (F tiles, M) gives the bits of one launch."""
    from moekit.ops import grouped_gemm as gg
    from moekit.ops.triton_launch import tensor_key

    M = dy_MH.shape[0]
    ffn = w2_NHF.shape[2]
    if out is None:
        dh = gg._empty((M, 2 * ffn), dy_MH.device, dy_MH.dtype)
        act = gg._empty((M, ffn), dy_MH.device, dy_MH.dtype)
        out_keys = None
    else:
        dh, act = _checked_out(out, dy_MH, ((M, 2 * ffn), (M, ffn)))
        out_keys = (tensor_key(dh), tensor_key(act))
    key = gg._plan_key(
        "glu_bwd",
        tensor_key(dy_MH),
        tensor_key(w2_NHF),
        tensor_key(h_M2F),
        tensor_key(offs),
        tensor_key(probs_M),
        glu_interleave_size,
        activation,
        use_tma,
        cfg,
        out_keys,
    )
    plan = gg._planned(
        key,
        lambda: _plan_glu_backward(dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation, use_tma, cfg),
    )
    if plan.launch is None:
        return dh, act, (torch.zeros(0, M, device=dy_MH.device) if probs_M is not None else None)
    # One row of d probs partials per column tile.
    part = gg._empty((plan.cols, M), dy_MH.device, torch.float32) if probs_M is not None else None
    with gg._device_ctx(dy_MH.device):
        plan.launch(
            dy_MH,
            w2_NHF,
            h_M2F,
            dh,
            act,
            probs_M if probs_M is not None else dh,
            part if part is not None else dh,
            offs,
        )
    return dh, act, part


def _glu_backward_launch(dy_MH, w2_NHF, h_M2F, probs_M, k: int, activation: str, use_tma: bool, c: GemmConfig):
    """The launch of the backward kernel; tensors: (dy, w2, h, dh, act_p, probs or dh, partials or
    dh, offs)."""
    from moekit.ops import grouped_gemm as gg
    from moekit.ops.triton_launch import LaunchPlan

    M, H = dy_MH.shape
    N, _, ffn = w2_NHF.shape
    bound = (_cdiv(M, c.block_rows) + N + 1) * _cdiv(ffn, c.block_cols)
    nprog = gg._grid_size(dy_MH.device, bound, c.programs_per_sm)
    ints = (M, ffn, H, N, dy_MH.stride(0), w2_NHF.stride(0), w2_NHF.stride(1), h_M2F.stride(0), 2 * ffn, ffn)
    return LaunchPlan(
        _glu_launchers()[1],
        (nprog,),
        ints,
        dict(
            ACTIVATION=ACTIVATIONS.index(activation),
            GLU_BLOCK=k,
            HAS_PROBS=probs_M is not None,
            USE_TMA=use_tma,
            UPCAST=gg._INTERPRET,
            DOT_PRECISION=gg._dot_precision(dy_MH.dtype),
            BLOCK_M=c.block_rows,
            BLOCK_C=c.block_cols,
            BLOCK_RED=c.block_red,
            GROUP_M=c.group_rows,
            BLOCK_GROUPS=gg._block_groups(N + 2),
            NUM_PROGRAMS=nprog,
            FLATTEN=c.flatten,
            num_stages=c.stages,
            num_warps=c.warps,
        ),
    )


# The Hopper backward's one configuration (grouped_mlp_hopper_kernels.glu_backward_ws_kernel): a
# 128 x (128 + 128) tile, 3 slots of 64 reduction columns beside the fp32 staging tile, the epilogue
# 16 columns at a time (32 spill), the load warp 24 registers and the 8 warps of the main loop and
# the epilogue 240 of the 168 per thread of 12 warps. Measured on the H200 (notes/grouped_mlp.md, v9).
WS_BACKWARD = dict(
    BLOCK_M=128, BLOCK_C=128, BLOCK_RED=64, GROUP_M=8, STAGES=3, EPI_COLS=16, LOAD_REGS=24, num_warps=8, maxnreg=168
)


@functools.cache
def _ws_backward_launcher():
    from moekit.ops.grouped_mlp_hopper_kernels import glu_backward_ws_kernel
    from moekit.ops.triton_launch import Launcher

    return Launcher(glu_backward_ws_kernel)


def _glu_backward_ws_ok(
    dy_MH: torch.Tensor, w2_NHF: torch.Tensor, glu_block: int, use_tma: bool, cfg: GemmConfig | None
) -> bool:
    """Whether the backward runs the warp-specialised Hopper kernel: as `_glu_forward_ws_ok`, with
    w2's experts one after the other and whole reduction steps per expert (its 2-D view (N * H, F),
    BLOCK_RED | H). Everything else runs glu_backward_kernel (the same dh and act_p bits)."""
    _, hidden, ffn = w2_NHF.shape
    return hidden % WS_BACKWARD["BLOCK_RED"] == 0 and _hopper_ws_ok(
        dy_MH, w2_NHF, ffn, glu_block, use_tma, cfg, WS_BACKWARD
    )


def _glu_backward_ws_launch(dy_MH, w2_NHF, h_M2F, probs_M, k: int, activation: str):
    """The launch of the Hopper backward; tensors as `_glu_backward_launch`'s."""
    from moekit.ops import grouped_gemm as gg
    from moekit.ops.triton_launch import LaunchPlan

    M, H = dy_MH.shape
    N, _, ffn = w2_NHF.shape
    bound = (_cdiv(M, WS_BACKWARD["BLOCK_M"]) + N + 1) * _cdiv(ffn, 2 * WS_BACKWARD["BLOCK_C"])
    nprog = gg._grid_size(dy_MH.device, bound)
    ints = (M, ffn, H, N, dy_MH.stride(0), w2_NHF.stride(1), h_M2F.stride(0), 2 * ffn, ffn)
    return LaunchPlan(
        _ws_backward_launcher(),
        (nprog,),
        ints,
        dict(
            ACTIVATION=ACTIVATIONS.index(activation),
            GLU_BLOCK=k,
            HAS_PROBS=probs_M is not None,
            BLOCK_GROUPS=gg._block_groups(N + 2),
            NUM_PROGRAMS=nprog,
            **WS_BACKWARD,
        ),
    )


def _plan_glu_backward(dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation, use_tma, cfg):
    """The backward's launch for this problem, as `_Plan` (cols: rows of d probs partials)."""
    from moekit.ops import grouped_gemm as gg

    M, H = dy_MH.shape
    N, _, ffn = w2_NHF.shape
    if M == 0 or ffn == 0:
        return gg._Plan(0, False, None)
    k = ffn if glu_interleave_size is None else glu_interleave_size
    use_tma = _glu_use_tma(use_tma, ffn, k, dy_MH, w2_NHF)
    if _glu_backward_ws_ok(dy_MH, w2_NHF, k, use_tma, cfg):
        return gg._Plan(
            _cdiv(ffn, 2 * WS_BACKWARD["BLOCK_C"]),
            False,
            _glu_backward_ws_launch(dy_MH, w2_NHF, h_M2F, probs_M, k, activation),
        )

    def partial_rows(c: GemmConfig) -> int:
        return _cdiv(ffn, c.block_cols)

    def trial(c: GemmConfig) -> None:
        dh = gg._empty((M, 2 * ffn), dy_MH.device, dy_MH.dtype)
        act = gg._empty((M, ffn), dy_MH.device, dy_MH.dtype)
        part = gg._empty((partial_rows(c), M), dy_MH.device, torch.float32)
        _glu_backward_launch(dy_MH, w2_NHF, h_M2F, probs_M, k, activation, use_tma, c)(
            dy_MH, w2_NHF, h_M2F, dh, act, probs_M if probs_M is not None else dh, part, offs
        )

    with gg._device_ctx(dy_MH.device):
        key = (dy_MH.dtype, ffn, H, N, k, gg._bucket(M), use_tma, probs_M is not None, activation)
        chosen = _glu_pick(
            "glu_bwd", key, _glu_candidates("bwd", dy_MH.dtype, ffn, k, use_tma), trial, dy_MH.device, cfg
        )
    return gg._Plan(
        partial_rows(chosen), False, _glu_backward_launch(dy_MH, w2_NHF, h_M2F, probs_M, k, activation, use_tma, chosen)
    )


def _unstack(grad: torch.Tensor | None, params: tuple[torch.Tensor, ...], grouped_dim: int):
    """A (N, ...) gradient as the parameters came: one grouped tensor, or N per-expert tensors."""
    if params[0].dim() == grouped_dim:
        return (grad,)
    return tuple(grad.unbind(0)) if grad is not None else (None,) * len(params)


def _grouped(params: tuple[torch.Tensor, ...], grouped_dim: int, what: str) -> torch.Tensor | None:
    """One (N, ...) tensor of a grouped parameter or N per-expert ones; None for no parameter."""
    if not params:
        return None
    return params[0] if params[0].dim() == grouped_dim else _stack_weights(params, what)


def _unstack_bias(grad: torch.Tensor | None, bias_dims: tuple[int, ...]):
    """A (N, out) bias gradient as the biases came: none, one grouped tensor, or N per-expert ones
    (`bias_dims`: the dims of the biases given)."""
    if not bias_dims:
        return ()
    if bias_dims[0] == 2:
        return (grad,)
    return tuple(grad.unbind(0)) if grad is not None else (None,) * len(bias_dims)


def _fused_mlp(go: GroupOffsets, probs_M, glu_interleave_size, activation, x_MH, w1s, w2s, b1s, b2s):
    """The triton path: two autograd nodes, so that h is released once fc2's backward has run.

    Node 1 (`_FusedFc1Fn`): fc1 + activation -> h (M, 2F), act (M, F); saves x and fc1's weights.
    Node 2 (`_FusedFc2Fn`): fc2 on act -> y (M, H); saves h, probs, fc2's weights and bias.
    Autograd runs node 2's backward first (fc2 dgrad + the activation's backward -> dh, fc2 wgrad,
    d probs) and frees what it saved, h and dy among them, before node 1's backward (fc1 dgrad and
    wgrad from dh and x) runs: the peak of the backward holds h or dh, not both, as plain PyTorch's
    composition does. `moe_experts` runs the same steps (`fc1_step`, `fc2_step`, `fc2_backward_step`,
    `fc1_backward_step`) in two nodes of its own that also move the rows.
    """
    h, act = _FusedFc1Fn.apply(go.offs, probs_M, glu_interleave_size, activation, len(w1s), x_MH, *w1s, *b1s)
    return _FusedFc2Fn.apply(go.offs, glu_interleave_size, activation, len(w2s), h, act, probs_M, *w2s, *b2s)


def fc1_step(x_MH, offs, probs_M, glu_interleave_size, activation, w1s, b1s):
    """fc1 + bias + activation (* probs) in one kernel: (h (M, 2F), act (M, F)) in x's dtype."""
    return library.glu_forward(
        x_MH,
        _grouped(w1s, 3, "fc1 weight"),
        offs,
        _grouped(b1s, 2, "fc1 bias"),
        probs_M,
        glu_interleave_size,
        activation,
    )


def fc2_step(act_MF, offs, probs_M, w2s, b2):
    """fc2 with the probs-scaled bias: y (M, H)."""
    return library.grouped_gemm_forward(
        act_MF, _grouped(w2s, 3, "fc2 weight"), offs, b2, probs_M if b2 is not None else None
    )


def fc2_backward_step(
    dy_MH,
    h_M2F,
    offs,
    probs_M,
    b2,
    w2s,
    glu_interleave_size,
    activation,
    need_probs: bool,
    need_w2: bool,
    need_b2: bool,
):
    """fc2's backward and the activation's: (dh (M, 2F), d probs (M,) in probs' dtype or None,
    d fc2 weight (N, H, F) or None, d fc2 bias (N, H) or None). The caller drops h once this returns."""
    dy_MH = _row_major(dy_MH)
    dh, act_p, dprobs = library.glu_backward(
        dy_MH, _grouped(w2s, 3, "fc2 weight"), h_M2F, offs, probs_M, glu_interleave_size, activation
    )
    return (dh, *fc2_params_backward_step(dy_MH, act_p, dprobs, offs, probs_M, b2, need_probs, need_w2, need_b2))


def fc2_params_backward_step(
    dy_MH, act_p_MF, dprobs_M, offs, probs_M, b2, need_probs: bool, need_w2: bool, need_b2: bool
):
    """What follows glu_backward in fc2's backward, from its act_p (M, F) and dprobs (M,) fp32 or None:
    (d probs (M,) in probs' dtype or None, d fc2 weight (N, H, F) or None, d fc2 bias (N, H) or None)."""
    dw2 = library.grouped_gemm_wgrad(dy_MH, act_p_MF, offs) if need_w2 else None
    db2 = d_probs = None
    if probs_M is not None and need_probs and b2 is not None:
        # One pass over dy gives fc2's bias gradient and the bias term of d probs,
        # <dy[r], b2[group of r]> (y = ... + b2 * p).
        db2, bias_dot = library.group_row_sum_and_dot(dy_MH, offs, b2, probs_M)
        dprobs_M = dprobs_M + bias_dot
    elif need_b2:
        db2 = library.group_row_sum(dy_MH, offs, probs_M)
    if probs_M is not None and need_probs:
        d_probs = dprobs_M.to(probs_M.dtype)
    return d_probs, dw2, db2


def fc1_backward_step(dh_M2F, x_rows, offs, w1s, need_x: bool, need_w1: bool, need_b1: bool):
    """fc1's backward: (dx (M, H) or None, d fc1 weight (N, 2F, H) or None, d fc1 bias (N, 2F) or
    None). `x_rows()` gives fc1's input rows; it is called once, for the weight gradient, which runs
    first so that the rows are released before dx is allocated (the backward's peak holds one of
    them, not both)."""
    dw1 = library.grouped_gemm_wgrad(dh_M2F, x_rows(), offs) if need_w1 else None
    db1 = library.group_row_sum(dh_M2F, offs) if need_b1 else None
    dx = library.grouped_gemm_dgrad(dh_M2F, _grouped(w1s, 3, "fc1 weight"), offs) if need_x else None
    return dx, dw1, db1


class _FusedFc1Fn(torch.autograd.Function):
    """fc1 + activation (the `glu_forward` kernel). Inputs after the fixed ones: n_w1 fc1 weights
    then the fc1 biases, each one grouped tensor or N per-expert tensors. Returns (h, act).

    act is not differentiable here: it is act(h) * probs, a function of h, and `_FusedFc2Fn`'s
    backward already returns the gradient of h through act (glu_backward computes dh from fc2's
    dgrad via the activation's derivative, and d probs). Letting autograd also route a gradient
    through act into this node would count that path twice."""

    @staticmethod
    def forward(ctx, offs, probs_M, glu_interleave_size, activation, n_w1, x_MH, *params):
        w1s, b1s = params[:n_w1], params[n_w1:]
        h, act = fc1_step(x_MH, offs, probs_M, glu_interleave_size, activation, w1s, b1s)
        ctx.mark_non_differentiable(act)
        ctx.set_materialize_grads(False)
        ctx.n_w1 = n_w1
        ctx.b1_dims = tuple(b.dim() for b in b1s)
        # x is saved as the caller's tensor itself: saved-tensor hooks (moe_experts') may replace it.
        ctx.save_for_backward(x_MH, offs, *w1s)
        return h, act

    @staticmethod
    def backward(ctx, dh_M2F, _d_act):
        x_MH, offs, *w1s = ctx.saved_tensors
        w1s = tuple(w1s)
        n_w1 = ctx.n_w1
        need = ctx.needs_input_grad  # forward's inputs: offs, probs, glu, activation, n_w1, x, *params
        dx, dw1, db1 = fc1_backward_step(
            dh_M2F, lambda: x_MH, offs, w1s, need[5], any(need[6 : 6 + n_w1]), any(need[6 + n_w1 :])
        )
        return (None, None, None, None, None, dx, *_unstack(dw1, w1s, 3), *_unstack_bias(db1, ctx.b1_dims))


class _FusedFc2Fn(torch.autograd.Function):
    """fc2 with the probs-scaled bias, whose backward also runs the activation's backward (the
    `glu_backward` kernel) and so returns h's gradient. Inputs after the fixed ones: n_w2 fc2
    weights then the fc2 biases."""

    @staticmethod
    def forward(ctx, offs, glu_interleave_size, activation, n_w2, h_M2F, act_MF, probs_M, *params):
        w2s, b2s = params[:n_w2], params[n_w2:]
        b2 = _grouped(b2s, 2, "fc2 bias")
        y = fc2_step(act_MF, offs, probs_M, w2s, b2)
        ctx.glu, ctx.activation, ctx.n_w2 = glu_interleave_size, activation, n_w2
        ctx.b2_dims = tuple(b.dim() for b in b2s)
        ctx.save_for_backward(h_M2F, offs, probs_M, b2, *w2s)
        return y

    @staticmethod
    def backward(ctx, dy_MH):
        h, offs, probs_M, b2, *w2s = ctx.saved_tensors
        w2s = tuple(w2s)
        n_w2 = ctx.n_w2
        need = ctx.needs_input_grad  # forward's inputs: offs, glu, activation, n_w2, h, act, probs, *params
        dh, d_probs, dw2, db2 = fc2_backward_step(
            dy_MH,
            h,
            offs,
            probs_M,
            b2,
            w2s,
            ctx.glu,
            ctx.activation,
            need[6],
            any(need[7 : 7 + n_w2]),
            any(need[7 + n_w2 :]),
        )
        return (None, None, None, None, dh, None, d_probs, *_unstack(dw2, w2s, 3), *_unstack_bias(db2, ctx.b2_dims))
