# ruff: noqa: E741  (I and O are the legend's in/out feature sizes)
"""Host side of the FP8 grouped GEMM kernel (`moekit.ops.kernels.grouped_gemm_fp8`): the forward and
the dgrad of a quantized grouped linear, planned and launched by the one recipe of
`moekit.ops.runtime.launch`.

Legend: M routed rows, N groups (experts), I in_features, O out_features.

    forward  y[r]  = x_q[r] @ w_q[g]^T (+ bias[g] (* bias_scale[r]))   -> y (M, O)
    dgrad    dx[r] = dy_q[r] @ w_q[g] = dy_q[r] @ (w_q^T)[g]^T           -> dx (M, I)

The operands are the storage of quantized `moekit.GroupedTensor`s (`moekit.group_quantize`; the
formats in `moekit.ops.quantize`), float8 E4M3 data and float32 `scale_inv`:

    recipe       rows operand (x_q, dy_q)          weight, forward               weight, dgrad: w_q^T
    fp8_block    rowwise (M, X), scales            rowwise (N, O, I), scales     (N, I, O), scales
                 (M, ceil(X / 128))                (N, ceil(O / 128), ceil(I / 128))   (N, ceil(I / 128), ceil(O / 128))
    fp8_rowwise  rowwise (M, X), scales (M, 1)     rowwise (N, O, I), scales     columnwise form transposed:
                                                   (N, O, 1): per output chan.   (N, I, O), scales (N, I, 1)

(X: the reduction, I for the forward and O for the dgrad.) The dgrad takes the weight transposed
(`moekit.ops.quantize.TransposedWeight`, kept by `QuantizedWeightCache` beside the quantization) so
that both GEMMs are the same forward-shaped problem, out[r] = a[r] @ b[g]^T with b (N, COLS, RED)
row-major: B is K-major, which FP8 wgmma requires of a shared-memory operand on Hopper (an (O, I)
weight reduced over O would be transposed tile by tile through registers in the kernel). fp8_block's
128 x 128 tiles transpose with their scales; fp8_rowwise's dgrad needs the weight's columnwise form
(its reduction runs over O, and a rowwise scale per output channel would change along it), whose
per-input-channel scales become per-output-column scales of the dgrad. Products accumulate in fp32;
the output is in `out_dtype` (the unquantized input's dtype). mxfp8 (1 x 32 blocks, E8M0 scales) has
no kernel here: Hopper's FP8 tensor cores have no block-32 scaling, so its products stay on the
reference path.

Rows of group g are `offs[g]:offs[g+1]` (device int64, never read on the host: no sync, CUDA-graph
capturable); rows past offs[N] are padding, written as zeros.

Which kernel runs the forward and the dgrad (`hopper_kernel_takes`): fp8_block on an sm_90 device with
both operands through TMA and no fixed `cfg` runs the warp-specialised Gluon kernel
(`moekit.ops.kernels.grouped_gemm_fp8_hopper`, `FP8_BLOCK_WS`: every step's promotion beside an MMA in
flight), bias and its row scale included, any output dtype (TMA stores where the output's rows are
16-byte aligned, pointer stores otherwise). The Triton kernel (`grouped_mm_fp8_kernel`) runs the rest:
fp8_rowwise, the CPU interpreter, GPUs other than sm_90 (Ada's FP8 tensor cores, pointer loads),
operands TMA cannot take (unaligned bases or row strides, an empty reduction), a weight of N * COLS >=
2**31 rows, and a fixed `cfg` (a configuration names one of the Triton kernel's). Both compute the same
fp32 operations in the same order, so they give the same bits. fp8_block's wgrad likewise
(`hopper_wgrad_takes`: the Gluon `grouped_wgrad_fp8_block_ws_kernel` on sm_90 with TMA and no fixed cfg,
dw of fewer than 2**31 rows of I; the Triton `grouped_wgrad_fp8_block_kernel` elsewhere).
"""

from __future__ import annotations

import torch
import triton

from moekit.grouped_tensor import FP8_DTYPE
from moekit.ops.kernels.grouped_gemm_fp8 import grouped_mm_fp8_kernel
from moekit.ops.kernels.grouped_gemm_fp8_hopper import (
    grouped_glu_fp8_block_ws_kernel,
    grouped_mm_fp8_block_ws_kernel,
    grouped_wgrad_fp8_block_ws_kernel,
)
from moekit.ops.kernels.grouped_wgrad_fp8 import (
    grouped_wgrad_fp8_block_kernel,
    grouped_wgrad_fp8_kernel,
    transpose_rows_kernel,
)
from moekit.ops.runtime.configs import (
    FP8_BLOCK_RED,
    FP8_BLOCK_WGRAD_WS,
    FP8_BLOCK_WGRAD_WS_STAGES,
    FP8_BLOCK_WS,
    FP8_BLOCK_WS_STAGES,
    GATED_FC1_EPILOGUE,
    TRANSPOSE_TILES,
    GemmConfig,
    fp8_gemm_candidates,
    fp8_wgrad_candidates,
)
from moekit.ops.runtime.device import cuda_capability
from moekit.ops.runtime.gemm import check_bias, check_offs, mm_schedule
from moekit.ops.runtime.glu import jit_pair
from moekit.ops.runtime.launch import (
    INTERPRET,
    TL_DTYPES,
    Launcher,
    LaunchPlan,
    Plan,
    arch_of,
    block_groups,
    device_ctx,
    empty,
    grid_size,
    next_power_of_2,
    pick_config,
    plan_launch,
    row_tiled_grid,
    tensor_key,
    unavailable_reason,
    use_tma,
)
from moekit.ops.runtime.quantize_torch import segment_pitch

_GROUPED_MM_FP8 = Launcher(grouped_mm_fp8_kernel)
_GROUPED_MM_FP8_BLOCK_WS = Launcher(grouped_mm_fp8_block_ws_kernel)
_WGRAD_FP8 = Launcher(grouped_wgrad_fp8_kernel)
_WGRAD_FP8_BLOCK = Launcher(grouped_wgrad_fp8_block_kernel)
_WGRAD_FP8_BLOCK_WS = Launcher(grouped_wgrad_fp8_block_ws_kernel)
_TRANSPOSE_ROWS = Launcher(transpose_rows_kernel)

# The recipes this kernel computes, and the side of their scale blocks (None: whole rows / columns).
FP8_GEMM_RECIPES: dict[str, int | None] = {"fp8_block": 128, "fp8_rowwise": None}


def fp8_gemm_unavailable_reason(recipe: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the FP8 grouped GEMM cannot run `recipe` with outputs of `dtype` on `device`; None if it can:
    fp8_block or fp8_rowwise, moekit's Triton kernels able to run (`launch.unavailable_reason`), and on
    CUDA FP8 tensor cores (compute capability 8.9 or newer; Hopper, sm_90, is the target) or the CPU
    under TRITON_INTERPRET=1."""
    if recipe not in FP8_GEMM_RECIPES:
        return (
            f"moekit's FP8 GEMM computes {tuple(FP8_GEMM_RECIPES)}, not {recipe!r} (mxfp8's 1 x 32 blocks have no "
            "Hopper FP8 tensor-core path)"
        )
    reason = unavailable_reason(device, dtype)
    if reason is not None:
        return reason
    if device.type == "cuda" and not INTERPRET:
        major, minor = cuda_capability(device)
        if (major, minor) < (8, 9):
            return f"FP8 tensor cores need compute capability 8.9 or newer, the device has {major}.{minor}"
    return None


def _check(
    op: str,
    recipe: str,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[int, int]:
    """One line naming the first operand the kernel cannot take; (reduction, output columns) otherwise.
    The weight is (N, COLS, RED) for both ops: w_q (N, O, I) for the forward, w_q^T (N, I, O) for the
    dgrad."""
    reason = fp8_gemm_unavailable_reason(recipe, a.device, out_dtype)
    if reason is not None:
        raise ValueError(f"recipe={recipe!r}, out_dtype={out_dtype}: {reason}")
    rows_name = "x_data" if op == "fwd" else "dy_data"
    w_name = "w_data" if op == "fwd" else "wt_data"
    for name, t in ((rows_name, a), (w_name, w)):
        if not isinstance(t, torch.Tensor) or t.dtype != FP8_DTYPE:
            raise TypeError(
                f"{name} must be a {FP8_DTYPE} tensor (group_quantize's data), got {getattr(t, 'dtype', t)}"
            )
        if t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, {rows_name} on {a.device}")
    for name, t in (("x_scale" if op == "fwd" else "dy_scale", a_scale), (w_name.replace("data", "scale"), w_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(
                f"{name} must be a float32 tensor (group_quantize's scale_inv), got {getattr(t, 'dtype', t)}"
            )
        if t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, {rows_name} on {a.device}")
    w_dims = "(N, O, I)" if op == "fwd" else "(N, I, O), the weight transposed"
    if a.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{rows_name} must be (M, X) and {w_name} {w_dims}; got {tuple(a.shape)} and {tuple(w.shape)}")
    N, cols, red = w.shape
    if a.shape[1] != red:
        raise ValueError(f"{rows_name} has {a.shape[1]} columns; a weight of shape {tuple(w.shape)} needs {red}")
    block = FP8_GEMM_RECIPES[recipe]
    if block is None:
        want_a = (a.shape[0], 1)
        want_w = (N, cols, 1)
    else:
        want_a = (a.shape[0], triton.cdiv(red, block))
        want_w = (N, triton.cdiv(cols, block), triton.cdiv(red, block))
    what = "rowwise" if op == "fwd" else "transposed"
    if tuple(a_scale.shape) != want_a:
        raise ValueError(f"{recipe}'s rowwise scales of {tuple(a.shape)} rows are {want_a}, got {tuple(a_scale.shape)}")
    if tuple(w_scale.shape) != want_w:
        raise ValueError(
            f"{recipe}'s {what} weight scales of {tuple(w.shape)} are {want_w}, got {tuple(w_scale.shape)}"
            + ("" if op == "fwd" else " (the dgrad takes moekit.ops.quantize.TransposedWeight's data and scales)")
        )
    return red, cols


def _launch(
    op: str,
    recipe: str,
    a: torch.Tensor,
    w: torch.Tensor,
    out_cols: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    has_scale: bool,
    cfg: GemmConfig,
    tma: bool,
) -> LaunchPlan:
    """grouped_mm_fp8_kernel for row-major FP8 a (M, red), w (N, out_cols, red) (K-major: the kernel's
    TRANS_B orientation, for both ops), contiguous scales and a fresh (M, out_cols) output; tensors:
    (a, a_scale, w, w_scale, out, bias or out, bias_scale or out, offs)."""
    M, red = a.shape
    N, w_rows, w_cols = w.shape
    block = FP8_GEMM_RECIPES[recipe]
    schedule = mm_schedule(M, N, out_cols, torch.finfo(out_dtype).bits // 8, cfg, tma, a.device)
    del op  # both ops are the same problem (module docstring)
    # Scale strides (contiguous scales): rows operand per row; weight per member, then along the
    # reduction and the output columns (module docstring's shapes).
    stride_asm = 1 if block is None else triton.cdiv(red, block)
    if block is None:
        stride_bsg, stride_bs_red, stride_bs_col = w_rows, 0, 1
    else:
        col_blocks, red_blocks = triton.cdiv(out_cols, block), triton.cdiv(red, block)
        stride_bsg, stride_bs_red, stride_bs_col = col_blocks * red_blocks, 1, red_blocks
    ints: tuple[int, ...] = (M, out_cols, red, N, w_rows, w_cols, a.stride(0), w.stride(0), w.stride(1), out_cols)
    ints += (bias.stride(0) if bias is not None else 0, stride_asm, stride_bsg, stride_bs_red, stride_bs_col)
    return LaunchPlan(
        _GROUPED_MM_FP8,
        (schedule["NUM_PROGRAMS"],),
        ints,
        dict(
            TRANS_B=True,
            BLOCK_SCALES=block is not None,
            SCALE_BLOCK=block if block is not None else 1,
            HAS_BIAS=bias is not None,
            HAS_SCALE=has_scale,
            PINNED=not INTERPRET,
            **schedule,
        ),
    )


def hopper_kernel_takes(recipe: str, a: torch.Tensor, w: torch.Tensor, tma: bool, cfg: GemmConfig | None) -> bool:
    """Whether the Gluon kernel (`grouped_mm_fp8_block_ws_kernel`) runs this product: fp8_block, a CUDA
    device of compute capability 9.0 (its wgmma and TMA; not the interpreter), operands through TMA
    (`tma`: aligned bases and row strides, a non-empty reduction), no fixed cfg (a given cfg is one of
    the Triton kernel's configurations) and a weight of fewer than 2**31 rows (its 2-D view's TMA row
    coordinate). The module docstring lists what runs everything else."""
    if recipe != "fp8_block" or cfg is not None or not tma or INTERPRET or a.device.type != "cuda":
        return False
    if cuda_capability(a.device) != (9, 0):
        return False
    return w.shape[0] * w.shape[1] < 2**31


def _ws_launch(
    a: torch.Tensor, w: torch.Tensor, out_cols: int, out_dtype: torch.dtype, bias: torch.Tensor | None, has_scale: bool
) -> LaunchPlan:
    """grouped_mm_fp8_block_ws_kernel for row-major FP8 a (M, red), a contiguous w (N, out_cols, red),
    contiguous fp8_block scales and a fresh (M, out_cols) output; tensors as `_launch`'s."""
    M, red = a.shape
    N = w.shape[0]
    cfg = FP8_BLOCK_WS
    out_size = torch.finfo(out_dtype).bits // 8
    nprog = row_tiled_grid(a.device, M, N, out_cols, cfg["BLOCK_M"], cfg["BLOCK_C"])
    # TMA stores need a 16-byte aligned row stride of the (contiguous, fresh) output.
    epi_tma = (out_cols * out_size) % 16 == 0
    col_blocks, red_blocks = triton.cdiv(out_cols, FP8_BLOCK_RED), triton.cdiv(red, FP8_BLOCK_RED)
    ints: tuple[int, ...] = (M, out_cols, red, N, a.stride(0), w.stride(1), out_cols)
    ints += (bias.stride(0) if bias is not None else 0, red_blocks, col_blocks * red_blocks, 1, red_blocks)
    return LaunchPlan(
        _GROUPED_MM_FP8_BLOCK_WS,
        (nprog,),
        ints,
        dict(
            HAS_BIAS=bias is not None,
            HAS_SCALE=has_scale,
            EPI_TMA=epi_tma,
            BLOCK_GROUPS=block_groups(N + 2),
            NUM_PROGRAMS=nprog,
            STAGES=FP8_BLOCK_WS_STAGES[out_size],
            **cfg,
        ),
    )


def _tensors(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    bias_scale: torch.Tensor | None,
    offs: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The tensor arguments of a `_launch` plan, in the kernel's order; an absent bias or bias scale
    is passed as `out` (a valid pointer the kernel never reads: HAS_BIAS / HAS_SCALE are off)."""
    return (
        a,
        a_scale,
        w,
        w_scale,
        out,
        bias if bias is not None else out,
        bias_scale if bias_scale is not None else out,
        offs,
    )


def _plan(
    op: str,
    recipe: str,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    bias_scale: torch.Tensor | None,
    red: int,
    cols: int,
    cfg: GemmConfig | None,
    forced_tma: bool | None,
) -> Plan:
    N = w.shape[0]
    offs = check_offs(offs, N, a.device)
    M = a.shape[0]
    if M == 0 or cols == 0 or N == 0:
        return Plan(None, cols, zero=N == 0)
    has_scale = bias_scale is not None
    if cfg is not None and FP8_GEMM_RECIPES[recipe] is not None and cfg.block_red != FP8_BLOCK_RED:
        raise ValueError(f"cfg.block_red must be {FP8_BLOCK_RED} for {recipe} (one reduction step per scale block)")
    if cfg is not None and FP8_GEMM_RECIPES[recipe] is not None and FP8_BLOCK_RED % cfg.block_cols:
        raise ValueError(f"cfg.block_cols must divide {FP8_BLOCK_RED} for {recipe} (a tile in one weight scale block)")
    tma, arch = use_tma(forced_tma, red > 0, a, w)
    if hopper_kernel_takes(recipe, a, w, tma, cfg):
        return Plan(_ws_launch(a, w, cols, out_dtype, bias, has_scale), cols)
    with device_ctx(a.device):
        if cfg is None:

            def trial(c: GemmConfig) -> None:
                out = empty((M, cols), a.device, out_dtype)
                _launch(op, recipe, a, w, cols, out_dtype, bias, has_scale, c, tma)(
                    *_tensors(a, a_scale, w, w_scale, out, bias, bias_scale, offs)
                )

            problem = ("fp8", op, recipe, out_dtype, cols, red, N, next_power_of_2(M), tma, bias is not None, has_scale)
            cfg = pick_config(problem, fp8_gemm_candidates(op, recipe, tma, arch, cols), trial, a.device)
    return Plan(_launch(op, recipe, a, w, cols, out_dtype, bias, has_scale, cfg, tma), cols)


def _mm(
    op: str,
    recipe: str,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    bias_scale: torch.Tensor | None,
    cfg: GemmConfig | None,
    forced_tma: bool | None,
) -> torch.Tensor:
    red, cols = _check(op, recipe, a, a_scale, w, w_scale, out_dtype)
    # Unit stride along the reduction for the rows, a row-major weight, dense scales: what
    # group_quantize writes (a copy otherwise).
    a = a if a.stride(1) == 1 else a.contiguous()
    w = w if w.is_contiguous() else w.contiguous()
    a_scale, w_scale = a_scale.contiguous(), w_scale.contiguous()
    key: tuple = (op, recipe, tensor_key(a), tensor_key(w), tensor_key(offs), out_dtype, tensor_key(bias))
    key += (tensor_key(a_scale), tensor_key(w_scale), tensor_key(bias_scale), cfg, forced_tma)
    plan = plan_launch(
        "grouped_mm_fp8",
        key,
        lambda: _plan(
            op, recipe, a, a_scale, w, w_scale, offs, out_dtype, bias, bias_scale, red, cols, cfg, forced_tma
        ),
    )
    out = empty((a.shape[0], cols), a.device, out_dtype)
    if plan.launch is None:
        return out.zero_() if plan.zero else out
    with device_ctx(a.device):
        plan.launch(*_tensors(a, a_scale, w, w_scale, out, bias, bias_scale, offs))
    return out


def quantized_gemm_forward(
    recipe: str,
    x_data: torch.Tensor,
    x_scale: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    bias_NO: torch.Tensor | None = None,
    bias_scale_M: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype,
    cfg: GemmConfig | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """FP8 grouped forward: y (M, O) in out_dtype, y[r] = x_q[r] @ w_q[g]^T (+ bias[g] (* bias_scale[r])),
    products of the FP8 data accumulated in fp32 with the scales of the module docstring's table.

    x_data (M, I) / x_scale: x's rowwise quantization; w_data (N, O, I) / w_scale: the weight's rowwise
    quantization. offs: (N+1,) int64 device tensor, offs[0] = 0, non-decreasing, offs[N] <= M. bias_NO:
    optional (N, O) in out_dtype; bias_scale_M: optional (M,) per-row factor of the bias. Rows r >=
    offs[N] are written as 0. cfg / use_tma: a fixed kernel configuration and operand path (tests and
    tuning); None = chosen here. Returns a fresh (M, O) tensor.
    """
    bias_NO, bias_scale_M = check_bias(bias_NO, bias_scale_M, x_data, w_data.shape[0], w_data.shape[1], out_dtype)
    return _mm("fwd", recipe, x_data, x_scale, w_data, w_scale, offs, out_dtype, bias_NO, bias_scale_M, cfg, use_tma)


def quantized_gemm_dgrad(
    recipe: str,
    dy_data: torch.Tensor,
    dy_scale: torch.Tensor,
    wt_data: torch.Tensor,
    wt_scale: torch.Tensor,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    cfg: GemmConfig | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """FP8 grouped dgrad: dx (M, I) in out_dtype, dx[r] = dy_q[r] @ w_q[g]; rows r >= offs[N] are 0.

    dy_data (M, O) / dy_scale: dy's rowwise quantization; wt_data (N, I, O) / wt_scale: the weight
    transposed (`moekit.ops.quantize.transposed_weight`: fp8_block's tiles with scales (N, ceil(I/128),
    ceil(O/128)); fp8_rowwise's columnwise form with scales (N, I, 1)). So the dgrad is the forward's
    problem, dx[r] = dy_q[r] @ (w_q^T)[g]^T, on the same kernel path with a K-major B (module
    docstring). Other arguments as `quantized_gemm_forward`'s.
    """
    return _mm("dgrad", recipe, dy_data, dy_scale, wt_data, wt_scale, offs, out_dtype, None, None, cfg, use_tma)


# --------------------------------------------------------------------------------------------------
# fc1 with the gated activation and both rowwise quantizations in its epilogue (kernels'
# grouped_glu_fp8_block_ws_kernel)
# --------------------------------------------------------------------------------------------------

_GLU_FP8_BLOCK_WS = Launcher(grouped_glu_fp8_block_ws_kernel)
_H_TYPES = (torch.bfloat16, torch.float16)  # the gated epilogue's h dtypes


def fp8_glu_unavailable_reason(
    recipe: str,
    device: torch.device,
    dtype: torch.dtype,
    hidden: int,
    ffn: int,
    glu_block: int,
    gate_limit: float,
    up_limit: float,
) -> str | None:
    """Why `quantized_glu_forward_into` cannot run fc1 of this MLP (x (M, hidden) in `dtype`, h (M, 2 *
    ffn) in GLU blocks of glu_block, the activation's clamps gate_limit / up_limit, 0 for none); None if
    it can. It is the Gluon fp8_block kernel's (sm_90, not the interpreter) with a gated epilogue that
    holds the 128 gate and 128 up columns of each 1 x 128 scale block of a and of h: fp8_block, GLU
    blocks of whole 128-column blocks, h its own held form (no clamps), x's FP8 rows TMA-aligned, a
    16-bit h; and `configs.GATED_FC1_EPILOGUE` choosing it over the GEMM and the gated pass apart for
    the architecture (the same bytes either way; off on sm90, where it was measured slower).
    `quantized_glu_forward_into` itself runs wherever the kernel can (tests call it directly)."""
    if recipe != "fp8_block":
        return f"the gated FP8 epilogue computes fp8_block, not {recipe!r}"
    if dtype not in _H_TYPES:
        return f"the gated FP8 epilogue writes h's values in bfloat16 or float16, not {dtype}"
    if glu_block % FP8_BLOCK_RED:
        return f"GLU blocks of {glu_block} columns (F = {ffn}) cut across fp8_block's {FP8_BLOCK_RED}-column blocks"
    if gate_limit or up_limit:
        return "a clamped activation holds h in a clamped form, which the epilogue does not make"
    if hidden == 0 or hidden % 16:
        return f"x's FP8 rows of {hidden} bytes are not a TMA operand (a positive multiple of 16)"
    if device.type != "cuda" or INTERPRET or cuda_capability(device) != (9, 0):
        return "the gated FP8 epilogue is a Gluon kernel of sm_90 (Hopper)"
    if not GATED_FC1_EPILOGUE.get(arch_of(device), False):
        return (
            f"configs.GATED_FC1_EPILOGUE keeps fc1's GEMM and the gated pass apart on {arch_of(device)} (faster there)"
        )
    return None


def _glu_launch(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, probs: torch.Tensor | None, glu_block: int,
    activation: str, dtype: torch.dtype, a_scale: torch.Tensor, h_scale: torch.Tensor,
) -> LaunchPlan:  # fmt: skip
    """grouped_glu_fp8_block_ws_kernel for x (M, H) FP8 rows, a contiguous w (N, 2F, H), contiguous
    fp8_block scales and fresh outputs; tensors as `quantized_glu_forward_into` passes them."""
    M, H = x.shape
    N, F = w.shape[0], w.shape[1] // 2
    cfg = FP8_BLOCK_WS
    nprog = row_tiled_grid(x.device, M, N, F, cfg["BLOCK_M"], cfg["BLOCK_C"] // 2)
    col_blocks, red_blocks = 2 * F // FP8_BLOCK_RED, triton.cdiv(H, FP8_BLOCK_RED)
    ints: tuple[int, ...] = (M, F, H, N, x.stride(0), w.stride(1), bias.stride(0) if bias is not None else 0)
    ints += (red_blocks, col_blocks * red_blocks, 1, red_blocks, a_scale.stride(0), h_scale.stride(0))
    return LaunchPlan(
        _GLU_FP8_BLOCK_WS,
        (nprog,),
        ints,
        dict(
            h_ty=TL_DTYPES[dtype],
            ACT=jit_pair(activation)["ACT"],
            GLU_BLOCK=glu_block,
            HAS_BIAS=bias is not None,
            HAS_PROBS=probs is not None,
            BLOCK_GROUPS=block_groups(N + 2),
            NUM_PROGRAMS=nprog,
            STAGES=FP8_BLOCK_WS_STAGES[2],
            **cfg,
        ),
    )


def quantized_glu_forward_into(
    x_data: torch.Tensor,
    x_scale: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    bias_N2F: torch.Tensor | None,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    dtype: torch.dtype,
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
) -> None:
    """fc1 of the quantized MLP, fp8_block, with its gated activation and both rowwise quantizations in
    the epilogue, h never written: into a_data (M, F) / a_scale (M, F / 128) the rowwise form of a =
    ACT(gate(h), up(h)) (* probs) in h's dtype, into h_data (M, 2F) / h_scale (M, 2F / 128) the rowwise
    form of h = Q(x) Q(w1)^T (+ b1); the bytes of `quantized_gemm_forward` followed by
    `moekit.ops.runtime.gated.gated_quantize_into`. x_data (M, H) / x_scale: x's rowwise quantization;
    w_data (N, 2F, H) / w_scale: fc1's; offs (N + 1,) device offsets (rows past offs[N]: zeros, scale 1);
    bias (N, 2F) in `dtype` (h's, x's before quantization) and the storage as those functions take
    them; the problem one that `fp8_glu_unavailable_reason` accepts (checked arguments: the quantized
    MLP's). Scales with unit column stride, the weight's contiguous."""
    M = x_data.shape[0]
    N, F = w_data.shape[0], w_data.shape[1] // 2
    if M == 0 or F == 0:
        return
    if N == 0:  # every row is padding
        for data, scale in ((a_data, a_scale), (h_data, h_scale)):
            data.view(torch.uint8).zero_()
            scale.fill_(1.0)
        return
    key: tuple = (tensor_key(x_data), tensor_key(w_data), tensor_key(offs), tensor_key(bias_N2F), tensor_key(probs_M))
    key += (tensor_key(a_scale), tensor_key(h_scale), glu_block, activation, dtype)
    key += tuple(map(tensor_key, (x_scale, w_scale, a_data, h_data)))
    plan = plan_launch(
        "grouped_glu_fp8",
        key,
        lambda: _glu_launch(x_data, w_data, bias_N2F, probs_M, glu_block, activation, dtype, a_scale, h_scale),
    )
    with device_ctx(x_data.device):
        plan(
            x_data, x_scale, w_data, w_scale, bias_N2F if bias_N2F is not None else x_scale,
            probs_M if probs_M is not None else x_scale, offs, a_data.view(torch.uint8), a_scale,
            h_data.view(torch.uint8), h_scale,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The FP8 wgrad (kernels.grouped_wgrad_fp8)
# --------------------------------------------------------------------------------------------------

# The recipes the FP8 wgrad computes: fp8_rowwise (a scale per group and column, constant along the
# reduction: applied in the epilogue) and fp8_block (128 x 1 blocks along each group's rows: a scale per
# reduction step of 128 rows, promoted in the main loop as the forward's). mxfp8 has no Hopper path.
FP8_WGRAD_RECIPES = ("fp8_block", "fp8_rowwise")


def fp8_wgrad_unavailable_reason(recipe: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the FP8 wgrad cannot run `recipe` with outputs of `dtype` on `device`; None if it can:
    fp8_block or fp8_rowwise (FP8_WGRAD_RECIPES) where the FP8 GEMM can run (`fp8_gemm_unavailable_reason`)."""
    if recipe not in FP8_WGRAD_RECIPES:
        return (
            f"moekit's FP8 wgrad computes {FP8_WGRAD_RECIPES}, not {recipe!r} (mxfp8's 32 x 1 blocks with E8M0 "
            "scales have no Hopper FP8 tensor-core path)"
        )
    return fp8_gemm_unavailable_reason(recipe, device, dtype)


def _check_wgrad(
    recipe: str,
    dy_data: torch.Tensor,
    dy_scale: torch.Tensor,
    x_data: torch.Tensor,
    x_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    segmented_rows: int | None,
) -> tuple[int, int, int]:
    """One line naming the first operand the FP8 wgrad cannot take; (M, O, I) otherwise."""
    reason = fp8_wgrad_unavailable_reason(recipe, dy_data.device, out_dtype)
    if reason is not None:
        raise ValueError(f"recipe={recipe!r}, out_dtype={out_dtype}: {reason}")
    N = offs.shape[0] - 1 if offs.dim() == 1 else -1
    for name, t in (("dy_data", dy_data), ("x_data", x_data)):
        if not isinstance(t, torch.Tensor) or t.dtype != FP8_DTYPE:
            raise TypeError(
                f"{name} must be a {FP8_DTYPE} tensor (group_quantize's columnwise data), got {getattr(t, 'dtype', t)}"
            )
        if segmented_rows is None and (t.dim() != 2 or t.stride(1) != 1):
            raise ValueError(f"{name} must be (M, X) with unit column stride, got shape {tuple(t.shape)} {t.stride()}")
        if segmented_rows is not None:
            pitch = segment_pitch(segmented_rows, max(N, 0))
            if t.dim() != 2 or t.shape[1] != pitch or not t.is_contiguous():
                raise ValueError(
                    f"{name} must be a contiguous (X, {pitch}) operand in the wgrad's layout of {segmented_rows} rows "
                    f"(segmented_rows), got shape {tuple(t.shape)} {t.stride()}"
                )
    if segmented_rows is None:
        M, O, I = dy_data.shape[0], dy_data.shape[1], x_data.shape[1]
        if x_data.shape[0] != M:
            raise ValueError(f"x_data {tuple(x_data.shape)} and dy_data {tuple(dy_data.shape)} must have the same rows")
    else:
        M, O, I = segmented_rows, dy_data.shape[0], x_data.shape[0]
    if x_data.device != dy_data.device:
        raise ValueError(f"x_data is on {x_data.device} and dy_data on {dy_data.device}; both on one device")
    block = FP8_GEMM_RECIPES[recipe]
    # fp8_rowwise: one scale per group and column; fp8_block: one per column of each block of 128 rows of
    # a group, every split's blocks within ceil(M / 128) + N slots (`columnwise_scale_shape`).
    slots = N if block is None else triton.cdiv(M, block) + N
    what = "one per group and column" if block is None else f"one per column of each {block}-row block of a group"
    for name, t, cols in (("dy_scale", dy_scale, O), ("x_scale", x_scale, I)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(
                f"{name} must be a float32 tensor (group_quantize's columnwise scale_inv), got {getattr(t, 'dtype', t)}"
            )
        if tuple(t.shape) != (slots, cols) or t.device != dy_data.device:
            raise ValueError(
                f"{name} must be {recipe}'s columnwise scales ({slots}, {cols}) ({what}) on "
                f"{dy_data.device}, got {tuple(t.shape)} on {t.device}"
            )
    return M, O, I


def _transpose_launch(M: int, X: int, N: int, stride: int, device: torch.device) -> LaunchPlan | None:
    """transpose_rows_kernel for (M, X) bytes of row stride `stride` in N groups into (X, pitch); tensors
    (src as uint8, dst as int32 words, offs). Its group vector is the next power of two above N (the
    per-word segment search is a (BLOCK_M / 4, BLOCK_GROUPS) compare: small for small N)."""
    block_m, block_x, warps = TRANSPOSE_TILES[arch_of(device)]
    pitch = segment_pitch(M, N)
    grid = (triton.cdiv(X, block_x), triton.cdiv(pitch, block_m))
    if not (grid[0] and grid[1]):
        return None
    return LaunchPlan(
        _TRANSPOSE_ROWS,
        grid,
        (M, X, N, stride, pitch // 4),
        dict(BLOCK_M=block_m, BLOCK_X=block_x, BLOCK_GROUPS=max(16, next_power_of_2(N + 1)), num_warps=warps),
    )


def _wgrad_launch(
    recipe: str,
    M: int,
    O: int,
    I: int,
    N: int,
    pitch: int,
    out_dtype: torch.dtype,
    cfg: GemmConfig,
    tma: bool,
    device: torch.device,
) -> LaunchPlan:
    """The FP8 wgrad kernel of `recipe` (grouped_wgrad_fp8_kernel for fp8_rowwise,
    grouped_wgrad_fp8_block_kernel for fp8_block) for transposed operands (O, pitch) / (I, pitch),
    contiguous (slots, O) / (slots, I) scales and a fresh (N, O, I) output; tensors (dyt, xt, dy_scale,
    x_scale, dw, offs)."""
    bound = N * triton.cdiv(O, cfg.block_rows) * triton.cdiv(I, cfg.block_cols)
    nprog = grid_size(device, bound, cfg.programs_per_sm)
    epi_tma = bool(cfg.epi_tma and tma and (I * (torch.finfo(out_dtype).bits // 8)) % 16 == 0)
    block = FP8_GEMM_RECIPES[recipe]
    extra: dict = {} if block is None else dict(SCALE_BLOCK=block, PINNED=not INTERPRET)
    return LaunchPlan(
        _WGRAD_FP8 if block is None else _WGRAD_FP8_BLOCK,
        (nprog,),
        (M, O, I, N, pitch, pitch, O, I, O * I, I),
        dict(
            **extra,
            USE_TMA=tma,
            BLOCK_O=cfg.block_rows,
            BLOCK_I=cfg.block_cols,
            BLOCK_M=cfg.block_red,
            GROUP_O=cfg.group_rows,
            BLOCK_GROUPS=block_groups(N + 1),
            NUM_PROGRAMS=nprog,
            EPI_TMA=epi_tma,
            num_stages=cfg.stages,
            num_warps=cfg.warps,
        ),
    )


def segment_transpose(data_MX: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The FP8 wgrad's operand layout of an (M, X) float8 tensor (unit column stride) whose rows are in
    N = len(offs) - 1 groups: a fresh (X, pitch) float8 tensor, pitch = `segment_pitch(M, N)`, with
    out[:, starts[g] + j] = data[offs[g] + j, :] for the j < rows of group g, starts[g] the sum of the
    earlier groups' row counts each rounded up to SEGMENT_COLUMNS (128), and zeros from there to the
    segment's end (`moekit.ops.kernels.grouped_wgrad_fp8.segment_starts`). Columns past the last
    segment are left unwritten; rows past offs[N] are never read. One launch (one read and one write of
    the data), no host reads of offs."""
    reason = unavailable_reason(data_MX.device, torch.float32)  # the device's: data moves as bytes
    if reason is not None:
        raise ValueError(reason)
    if data_MX.dtype != FP8_DTYPE or data_MX.dim() != 2 or data_MX.stride(1) != 1:
        raise ValueError(
            f"data must be an (M, X) {FP8_DTYPE} tensor with unit column stride, got {data_MX.dtype} "
            f"{tuple(data_MX.shape)} {data_MX.stride()}"
        )
    if offs.dim() != 1 or offs.shape[0] < 1:
        raise ValueError(f"offs must be a 1-D tensor of N+1 group offsets, got shape {tuple(offs.shape)}")
    M, X = data_MX.shape
    N = offs.shape[0] - 1
    offs = check_offs(offs, N, data_MX.device)
    key = (tensor_key(data_MX), tensor_key(offs))
    plan = plan_launch(
        "fp8_segment_transpose", key, lambda: _transpose_launch(M, X, N, data_MX.stride(0), data_MX.device)
    )
    out = empty((X, segment_pitch(M, N)), data_MX.device, torch.uint8)
    if plan is not None:
        with device_ctx(data_MX.device):
            plan(data_MX.view(torch.uint8), out.view(torch.int32), offs)
    return out.view(FP8_DTYPE)


def hopper_wgrad_takes(
    recipe: str, device: torch.device, tma: bool, cfg: GemmConfig | None, N: int, O: int, I: int
) -> bool:
    """Whether the Gluon wgrad (`grouped_wgrad_fp8_block_ws_kernel`) runs this wgrad: `hopper_kernel_takes`'
    rule (fp8_block, a CUDA device of compute capability 9.0, not the interpreter, operands through TMA,
    no fixed cfg: a given cfg is one of the Triton kernel's), N * O < 2**31 (dw's rows as TMA row
    coordinates of its (N * O, I) view) and O, I multiples of 4 (the contiguous fp32 scale rows, which
    the kernel reads through TMA, need 16-byte row strides)."""
    if recipe != "fp8_block" or cfg is not None or not tma or INTERPRET or device.type != "cuda":
        return False
    return cuda_capability(device) == (9, 0) and N * O < 2**31 and O % 4 == 0 and I % 4 == 0


def _wgrad_ws_launch(
    M: int, O: int, I: int, N: int, pitch: int, out_dtype: torch.dtype, device: torch.device
) -> LaunchPlan:
    """grouped_wgrad_fp8_block_ws_kernel for transposed operands (O, pitch) / (I, pitch), contiguous
    (slots, O) / (slots, I) scales (slots = ceil(M / 128) + N) and a fresh (N, O, I) output; tensors as
    `_wgrad_launch`'s."""
    cfg = FP8_BLOCK_WGRAD_WS
    out_size = torch.finfo(out_dtype).bits // 8
    nprog = grid_size(device, N * triton.cdiv(O, cfg["BLOCK_O"]) * triton.cdiv(I, cfg["BLOCK_I"]))
    slots = triton.cdiv(M, cfg["BLOCK_RED"]) + N
    return LaunchPlan(
        _WGRAD_FP8_BLOCK_WS,
        (nprog,),
        (M, O, I, N, slots, pitch, pitch, O, I),
        dict(
            # TMA stores need a 16-byte aligned row stride of the (contiguous, fresh) dw.
            EPI_TMA=(I * out_size) % 16 == 0,
            BLOCK_GROUPS=block_groups(N + 1),
            NUM_PROGRAMS=nprog,
            STAGES=FP8_BLOCK_WGRAD_WS_STAGES[out_size],
            **cfg,
        ),
    )


def _plan_wgrad(
    recipe: str,
    M: int,
    O: int,
    I: int,
    N: int,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: GemmConfig | None,
    forced_tma: bool | None,
    device: torch.device,
    given: tuple[torch.Tensor, ...],
    scales_aligned: bool,
) -> LaunchPlan | None:
    """The wgrad launch of `recipe` on `segment_transpose`'s operands (None: nothing to compute).
    given: the segmented operands as given (their TMA check), or none where they are made fresh;
    scales_aligned: both scale tensors' bases 16-byte aligned (the Gluon wgrad loads them by TMA)."""
    if M == 0 or N == 0 or O == 0 or I == 0:
        return None
    pitch = segment_pitch(M, N)
    # Operands made here are fresh (O, pitch) and (I, pitch) allocations of the segments layout, which
    # differ only in their row count: one row of the layout stands for both in TMA's check (aligned
    # base, row pitch). Full-size stand-ins would cost both operands' bytes again at the backward's
    # peak, at every new problem.
    tma, arch = use_tma(forced_tma, True, *(given or (empty((1, pitch), device, FP8_DTYPE),)))
    if scales_aligned and hopper_wgrad_takes(recipe, device, tma, cfg, N, O, I):
        return _wgrad_ws_launch(M, O, I, N, pitch, out_dtype, device)
    with device_ctx(device):
        if cfg is None:
            block = FP8_GEMM_RECIPES[recipe]
            slots = N if block is None else triton.cdiv(M, block) + N
            operands: list[torch.Tensor] = []  # made at the first trial: only where configurations are timed

            def trial(c: GemmConfig) -> None:
                if not operands:
                    operands.extend(empty((rows, pitch), device, FP8_DTYPE) for rows in (O, I))
                    operands.extend(empty((slots, cols), device, torch.float32) for cols in (O, I))
                dw = empty((N, O, I), device, out_dtype)
                _wgrad_launch(recipe, M, O, I, N, pitch, out_dtype, c, tma, device)(*operands, dw, offs)

            problem = ("fp8_wgrad", recipe, out_dtype, O, I, N, next_power_of_2(M), tma)
            cfg = pick_config(problem, fp8_wgrad_candidates(recipe, tma, arch), trial, device)
    return _wgrad_launch(recipe, M, O, I, N, pitch, out_dtype, cfg, tma, device)


def quantized_gemm_wgrad(
    recipe: str,
    dy_data: torch.Tensor,
    dy_scale: torch.Tensor,
    x_data: torch.Tensor,
    x_scale: torch.Tensor,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    cfg: GemmConfig | None = None,
    use_tma: bool | None = None,
    segmented_rows: int | None = None,
) -> torch.Tensor:
    """FP8 grouped wgrad: dw (N, O, I) in out_dtype, dw[g] = sum over rows r of g of dy_q[r]^T x_q[r] with
    the columnwise scales, products of the FP8 data accumulated in fp32.

    recipe: fp8_block or fp8_rowwise (FP8_WGRAD_RECIPES). dy_data (M, O) / dy_scale: dy's columnwise
    quantization, float32 scales (N, O) for fp8_rowwise (one per group and column) or (ceil(M / 128) +
    N, O) for fp8_block (one per column of each 128-row block of a group, the groups' blocks one after
    another: `moekit.grouped_tensor.columnwise_scale_shape`; the kernel finds group g's first block
    from offs); x_data (M, I) / x_scale: x's likewise. offs:
    (N+1,) int64 device tensor, offs[0] = 0, non-decreasing, offs[N] <= M; groups without rows get
    zeros; rows past offs[N] (padding) take part in nothing. Both operands are first transposed
    (`segment_transpose`: K-major for FP8 wgmma, each group from a 128-byte aligned column; one read
    and one write of each), then one launch computes every group's dw (kernels.grouped_wgrad_fp8:
    fp8_rowwise's scales in the epilogue, fp8_block's per 128-row step in the main loop; fp8_block on
    sm_90 through TMA without a fixed cfg: the Gluon kernel, `hopper_wgrad_takes`). No host reads
    of offs. cfg / use_tma: a fixed kernel
    configuration and operand path (tests and tuning); None = chosen here. segmented_rows: M, where
    dy_data and x_data are already in that transposed layout, (O, pitch) and (I, pitch), contiguous,
    pitch = `segment_pitch(M, N)` (`group_quantize`'s columnwise form written there by the quantization
    itself, `moekit.ops.quantize.group_quantize_for_wgrad`): then no transpose runs here, and only the
    columns in use are read. Returns a fresh tensor.
    """
    M, O, I = _check_wgrad(recipe, dy_data, dy_scale, x_data, x_scale, offs, out_dtype, segmented_rows)
    block = FP8_GEMM_RECIPES[recipe]
    if cfg is not None and block is not None and block % cfg.block_red:
        raise ValueError(f"cfg.block_red must divide {block} for {recipe} (a reduction step lies in one scale block)")
    N = offs.shape[0] - 1
    offs = check_offs(offs, N, dy_data.device)
    dy_scale, x_scale = dy_scale.contiguous(), x_scale.contiguous()
    key: tuple = (recipe, tensor_key(dy_data), tensor_key(x_data), tensor_key(offs), out_dtype, cfg, use_tma)
    key += (segmented_rows, tensor_key(dy_scale), tensor_key(x_scale))
    given = () if segmented_rows is None else (dy_data, x_data)
    scales_aligned = dy_scale.data_ptr() % 16 == 0 and x_scale.data_ptr() % 16 == 0
    plan = plan_launch(
        "fp8_wgrad",
        key,
        lambda: _plan_wgrad(recipe, M, O, I, N, offs, out_dtype, cfg, use_tma, dy_data.device, given, scales_aligned),
    )
    dw = empty((N, O, I), dy_data.device, out_dtype)
    if plan is None:
        return dw.zero_()
    if segmented_rows is None:
        dyt, xt = segment_transpose(dy_data, offs), segment_transpose(x_data, offs)
    else:
        dyt, xt = dy_data, x_data
    with device_ctx(dy_data.device):
        plan(dyt, xt, dy_scale, x_scale, dw, offs)
    return dw
