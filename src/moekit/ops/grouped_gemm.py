# ruff: noqa: E741  (I and O are the legend's in/out feature sizes)
"""Grouped GEMM on moekit's Triton kernels (host side): the three products of a grouped linear,
for Hopper first, plus the per-group row sum of the bias gradients.

Legend: M routed rows, N groups (experts), I in_features, O out_features.

    forward  y[r]  = x[r] @ w[g]^T (+ bias[g] (* bias_scale[r]))   x (M, I), w (N, O, I) -> y (M, O)
    dgrad    dx[r] = dy[r] @ w[g]                                   dy (M, O), w (N, O, I) -> dx (M, I)
    wgrad    dw[g] = dy[rows of g]^T @ x[rows of g]                 dy (M, O), x (M, I) -> dw (N, O, I)
    row sum  db[g] = sum of dy[r] (* scale[r]) over rows r of g     dy (M, O) -> db (N, O)

Rows of group g are `offs[g]:offs[g+1]` where `offs` is a device int64 tensor of N+1 entries. The
host never reads `offs`: every kernel derives its tile schedule from it on the device, so the
launches are free of host syncs and can be captured in a CUDA graph and replayed with other split
sizes (as long as the buffers keep their shapes). Rows past offs[N] are padding: outputs there are
zeros and they take part in no reduction.

This module validates arguments, picks a kernel configuration (`GemmConfig`: a few candidates per
problem class, benchmarked once per process unless `set_autotune(False)`) and launches the kernels
of `moekit.ops.grouped_gemm_kernels`. notes/grouped_gemm.md has the design and the measurements.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import triton

from moekit._device import capability as _capability
from moekit._device import multiprocessor_count
from moekit.ops.gemm_config import GemmConfig
from moekit.ops.grouped_gemm_kernels import group_row_sum_kernel, grouped_mm_kernel, wgrad_kernel
from moekit.ops.triton_launch import Launcher, LaunchPlan, PlanCache, tensor_key

try:  # Triton >= 3.0; the interpreter class tells whether kernels run on the CPU.
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - very old triton
    _InterpretedFunction = ()

__all__ = [
    "GemmConfig",
    "group_row_sum",
    "group_row_sum_and_dot",
    "grouped_gemm_dgrad",
    "grouped_gemm_forward",
    "grouped_gemm_wgrad",
    "set_autotune",
    "triton_unavailable_reason",
]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_INTERPRET = isinstance(grouped_mm_kernel, _InterpretedFunction) if _InterpretedFunction else False

_grouped_mm = Launcher(grouped_mm_kernel)
_wgrad = Launcher(wgrad_kernel)
_group_row_sum = Launcher(group_row_sum_kernel)


def triton_unavailable_reason(device, dtype) -> str | None:
    """Why the triton backend cannot run for tensors of ``dtype`` on ``device``; None if it can.

    CUDA: compute capability 8.0 or newer (Hopper, sm_90, gets the TMA path; Ampere/Ada run the
    pointer-load path of the same kernels, correct but not tuned). CPU: only when the environment
    variable TRITON_INTERPRET=1 was set before triton was imported (slow; for tests).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and not _INTERPRET and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if torch.compiler.is_compiling():  # dynamo traces through caches anyway (and warns)
        return _unavailable_reason.__wrapped__(device, dtype)
    return _unavailable_reason(device, dtype)


@functools.lru_cache(maxsize=64)
def _unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    # Cached: every launch asks, the answer is fixed for the process (device capability,
    # interpreter mode) and the CUDA queries behind it cost microseconds of host time each.
    if dtype not in _SUPPORTED_DTYPES:
        return f"triton grouped GEMM supports float32, bfloat16 and float16, not {dtype}"
    if device.type == "cpu":
        if _INTERPRET:
            return None
        return (
            "triton kernels need a CUDA device; on CPU they run only under the Triton "
            "interpreter (set TRITON_INTERPRET=1 before triton is imported)"
        )
    if device.type != "cuda":
        return f"triton grouped GEMM runs on CUDA devices (or CPU under TRITON_INTERPRET=1), not {device.type}"
    if _INTERPRET:
        return None
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = _capability(device.index)
    if major < 8:
        return f"triton grouped GEMM needs compute capability 8.0 or newer, device has {major}.{minor}"
    return None


def _check_device(t: torch.Tensor) -> None:
    reason = triton_unavailable_reason(t.device, t.dtype)
    if reason is not None:
        raise ValueError(reason)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and 16-byte multiples for every non-unit stride."""
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16:
            return False
        if any((s * es) % 16 for s in t.stride()[:-1]):
            return False
        if t.numel() == 0:
            return False
    return True


@functools.cache
def _candidates(op: str, dtype: torch.dtype, use_tma: bool, cap: tuple[int, int], cols: int) -> list[GemmConfig]:
    """Small tuning space per problem class; the first entry is the untuned default."""
    if _INTERPRET:
        return [GemmConfig(32, 32, 16, 4, 1, 4, False)]
    if dtype == torch.float32:
        return [GemmConfig(64, 64, 32, 8, 3, 4, False)]
    if cap[0] >= 9 and use_tma:
        # Variants of the 128x256x64 / 8-warp tile that won on the H200 (notes/grouped_gemm.md):
        # (flatten, epi_tma, stages). 128x128 only for narrow outputs.
        if op == "wgrad":
            # One config: the 4-stage and whole-tile-store variants measured within noise of it
            # with interleaved timing (notes), and a single candidate means no autotuning sync.
            return [GemmConfig(128, 256, 64, 8, 3, 8, True, True)]
        big = [
            GemmConfig(128, 256, 64, 8, 3, 8, True, False),
            GemmConfig(128, 256, 64, 8, 3, 8, True, True),
            GemmConfig(128, 256, 64, 8, 3, 8, False, False),
        ]
        return big if cols > 128 else [GemmConfig(128, 128, 64, 8, 4, 8, True, False), big[0]]
    # Pointer path (unaligned operands, or Ampere/Ada): conservative shapes that fit 100 KB smem.
    return [GemmConfig(128, 128, 32, 8, 3, 8, False), GemmConfig(128, 64, 32, 8, 4, 4, False)]


_TUNED: dict[tuple, GemmConfig] = {}


_AUTOTUNE = {"enabled": True}


def set_autotune(enabled: bool) -> None:
    """Turn the per-problem-class config search on (default) or off (first candidate config).

    The search benchmarks a few configs on the first call of each problem class, which synchronizes
    with the host once; turn it off for runs that must not sync even on their first step."""
    _AUTOTUNE["enabled"] = bool(enabled)


def _pick(key: tuple, cands: list[GemmConfig], launch, device: torch.device) -> GemmConfig:
    """Best config of ``cands`` for ``key``, benchmarked once per process and cached.

    Never benchmarks while a CUDA graph is being captured (it would synchronize): then the cached
    choice or the default is used. Warm up once outside capture to get the tuned config.
    """
    hit = _TUNED.get(key)
    if hit is not None:
        return hit
    if len(cands) == 1 or not _AUTOTUNE["enabled"] or device.type != "cuda" or _INTERPRET:
        return cands[0]
    if torch.cuda.is_current_stream_capturing():
        return cands[0]
    best, best_t = cands[0], float("inf")
    for cfg in cands:
        try:
            t = triton.testing.do_bench(lambda c=cfg: launch(c), warmup=5, rep=20, return_mode="median")
        except Exception:  # a config that does not compile or fit is skipped
            continue
        if t < best_t:
            best, best_t = cfg, t
    _TUNED[key] = best
    return best


def _resolve_tma(use_tma: bool | None, has_reduction: bool, *operands: torch.Tensor) -> tuple[bool, tuple[int, int]]:
    """(whether the operands go through TMA descriptors, the compute capability to pick configs
    for). use_tma given (tests, tuning) is kept as is, with Hopper's configs; otherwise TMA needs
    sm_90 (or the interpreter), a non-empty reduction and 16-byte aligned operands."""
    if use_tma is not None:
        return use_tma, (9, 0)
    device = operands[0].device
    cap = (9, 0) if (_INTERPRET or device.type != "cuda") else _capability(device.index)
    return (cap[0] >= 9 or _INTERPRET) and has_reduction and _tma_ok(*operands), cap


def _empty(shape, device, dtype) -> torch.Tensor:
    """Every output is allocated here, uninitialised: the kernels write every element. (Tests
    replace this with a NaN-filled allocation to prove it.)"""
    return torch.empty(shape, device=device, dtype=dtype)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands: full fp32 products unless the user allowed TF32 for matmuls, like torch.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@functools.cache
def _block_groups(n: int) -> int:
    # The per-group vectors are tiny next to a tile; one size for up to 255 groups means one
    # compiled kernel for every model instead of one per expert count.
    return max(256, triton.next_power_of_2(n))


def _bucket(m: int) -> int:
    return 1 << max(int(m) - 1, 0).bit_length()


def _grid_size(device: torch.device, bound: int, per_sm: int = 1) -> int:
    """Programs of a persistent kernel: per_sm per multiprocessor (2 lets one program's epilogue
    overlap another's main loop), at most `bound` (the tiles of the largest schedule)."""
    sms = (
        4
        if (_INTERPRET or device.type != "cuda")
        else multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    )
    return max(1, min(sms * per_sm, bound))


def _check_offs(offs: torch.Tensor, groups: int, device: torch.device) -> torch.Tensor:
    if offs.dim() != 1 or offs.shape[0] != groups + 1:
        raise ValueError(f"offs must have shape ({groups + 1},), got {tuple(offs.shape)}")
    if offs.device != device:
        raise ValueError(f"offs is on {offs.device}, inputs on {device}")
    if offs.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"offs must be int64 or int32, got {offs.dtype}")
    return offs


def _device_ctx(device: torch.device):
    """Launches go to the tensors' device: switch to it unless it is already current (entering
    torch.cuda.device costs two device exchanges per launch)."""
    if (
        device.type == "cuda"
        and not _INTERPRET
        and device.index is not None
        and device.index != torch.cuda.current_device()
    ):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _mm_launch(a, w, out_cols: int, bias, has_scale: bool, trans_b: bool, cfg: GemmConfig, use_tma: bool) -> LaunchPlan:
    """The launch of grouped_mm_kernel for a (M, red) row-major input, a fresh (M, out_cols) output,
    and weights w (N, b_rows, b_cols); tensors: (a, w, out, bias or out, scale or out, offs)."""
    M, red = a.shape
    N, b_rows, b_cols = w.shape
    bound = (triton.cdiv(M, cfg.block_rows) + N + 1) * triton.cdiv(out_cols, cfg.block_cols)
    nprog = _grid_size(a.device, bound)
    # TMA stores need a 16-byte aligned row stride of the (contiguous, fresh) output.
    epi_tma = bool(cfg.epi_tma and use_tma and (out_cols * a.element_size()) % 16 == 0)
    ints = (
        M,
        out_cols,
        red,
        N,
        b_rows,
        b_cols,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out_cols,
        bias.stride(0) if bias is not None else 0,
    )
    return LaunchPlan(
        _grouped_mm,
        (nprog,),
        ints,
        dict(
            TRANS_B=trans_b,
            HAS_BIAS=bias is not None,
            HAS_SCALE=has_scale,
            USE_TMA=use_tma,
            UPCAST=_INTERPRET,
            DOT_PRECISION=_dot_precision(a.dtype),
            BLOCK_M=cfg.block_rows,
            BLOCK_C=cfg.block_cols,
            BLOCK_RED=cfg.block_red,
            GROUP_M=cfg.group_rows,
            BLOCK_GROUPS=_block_groups(N + 2),
            NUM_PROGRAMS=nprog,
            FLATTEN=cfg.flatten,
            EPI_TMA=epi_tma,
            num_stages=cfg.stages,
            num_warps=cfg.warps,
        ),
    )


def _run_mm(a, w, offs, out, bias, scale, trans_b: bool, cfg: GemmConfig, use_tma: bool) -> None:
    plan = _mm_launch(a, w, out.shape[1], bias, scale is not None, trans_b, cfg, use_tma)
    plan(a, w, out, bias if bias is not None else out, scale if scale is not None else out, offs)


def _check_weight(a: torch.Tensor, w: torch.Tensor) -> None:
    if w.dim() != 3 or w.stride(2) != 1:
        raise ValueError(
            f"the weight must be a 3-D (groups, out, in) tensor whose last dim has stride 1, "
            f"got shape {tuple(w.shape)} strides {w.stride()}"
        )
    if a.dim() != 2:
        raise ValueError(f"expected a 2-D input (rows, features), got shape {tuple(a.shape)}")
    if w.dtype != a.dtype or w.device != a.device:
        raise ValueError(f"the weight is {w.dtype} on {w.device}, the input is {a.dtype} on {a.device}")


class _Plan(NamedTuple):
    """What a grouped product does for one problem key: its output columns, whether the input is
    copied to unit column stride first, and the launch (None: no kernel; `zero` then says whether
    the output is zeros (no groups) or empty)."""

    cols: int
    contiguous: bool
    launch: LaunchPlan | None
    zero: bool = False


_PLANS = PlanCache()


def _plan_key(*parts) -> tuple:
    """Plans are made per everything they were validated and specialized on: the tensors'
    `tensor_key`s, the options, and whether config search is on (a plan made while it was off, or
    during CUDA-graph capture, holds the untuned default)."""
    return (*parts, _AUTOTUNE["enabled"])


def _planned(key: tuple, make):
    """The plan under `key`, made by `make()` the first time. A plan made during CUDA-graph capture
    is not remembered (its config may be the untuned default)."""
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    plan = make()
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return plan
    return _PLANS.put(key, plan)


def _mm(op: str, a, w, offs, bias, scale, cfg: GemmConfig | None, use_tma: bool | None) -> torch.Tensor:
    """Shared launcher of forward (op="fwd": out (M, O)) and dgrad (op="dgrad": out (M, I))."""
    key = _plan_key(
        op,
        tensor_key(a),
        tensor_key(w),
        tensor_key(offs),
        tensor_key(bias),
        tensor_key(scale),
        cfg,
        use_tma,
        _dot_precision(a.dtype),
    )
    plan = _planned(key, lambda: _plan_mm(op, a, w, offs, bias, scale, cfg, use_tma))
    if plan.contiguous:
        a = a.contiguous()
    out = _empty((a.shape[0], plan.cols), a.device, a.dtype)
    if plan.launch is None:
        return out.zero_() if plan.zero else out
    with _device_ctx(a.device):
        plan.launch(a, w, out, bias if bias is not None else out, scale if scale is not None else out, offs)
    return out


def _plan_mm(op: str, a, w, offs, bias, scale, cfg: GemmConfig | None, use_tma: bool | None) -> _Plan:
    _check_device(a)
    _check_weight(a, w)
    contiguous = a.stride(1) != 1
    if contiguous:
        a = a.contiguous()
    N, O, I = w.shape
    trans_b = op == "fwd"
    red, cols = (I, O) if trans_b else (O, I)
    if a.shape[1] != red:
        raise ValueError(f"the input has {a.shape[1]} columns; a weight of shape {tuple(w.shape)} needs {red}")
    offs = _check_offs(offs, N, a.device)
    M = a.shape[0]
    if M == 0 or cols == 0 or N == 0:
        return _Plan(cols, contiguous, None, zero=N == 0)
    use_tma, cap = _resolve_tma(use_tma, red > 0, a, w)
    with _device_ctx(a.device):
        if cfg is None:
            cands = _candidates(op, a.dtype, use_tma, cap, cols)
            key = (op, a.dtype, cols, red, N, _bucket(M), use_tma, bias is not None, scale is not None)
            out = _empty((M, cols), a.device, a.dtype)
            cfg = _pick(key, cands, lambda c: _run_mm(a, w, offs, out, bias, scale, trans_b, c, use_tma), a.device)
    return _Plan(cols, contiguous, _mm_launch(a, w, cols, bias, scale is not None, trans_b, cfg, use_tma))


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

    x_MI: (M, I) fp32/bf16/fp16, unit column stride preferred (copied otherwise).
    w_NOI: (N, O, I), same dtype, any strides with stride(2) == 1.
    offs: (N+1,) int64 device tensor, offs[0] = 0, non-decreasing, offs[N] <= M.
    bias_NO: optional (N, O) (unit column stride); bias_scale_M: optional (M,) per-row factor of the
    bias (router probabilities), any float dtype. Rows r >= offs[N] are written as 0.
    cfg / use_tma: a fixed kernel configuration and operand path (tests and tuning); None = chosen
    here. Returns a fresh (M, O) tensor of x's dtype; accumulation and epilogue math in fp32.
    M and every feature size must stay below 2**31 (TMA coordinates are int32).
    """
    if bias_NO is None and bias_scale_M is not None:
        raise ValueError("bias_scale given without bias: it scales the bias")
    if bias_NO is not None:
        N, O, _ = w_NOI.shape
        if tuple(bias_NO.shape) != (N, O):
            raise ValueError(f"bias must have shape ({N}, {O}), got {tuple(bias_NO.shape)}")
        if bias_NO.device != x_MI.device:
            raise ValueError(f"bias is on {bias_NO.device}, x on {x_MI.device}")
        if bias_NO.stride(-1) != 1:
            bias_NO = bias_NO.contiguous()
    if bias_scale_M is not None:
        if bias_scale_M.dim() != 1 or bias_scale_M.shape[0] != x_MI.shape[0]:
            raise ValueError(f"bias_scale must have shape ({x_MI.shape[0]},), got {tuple(bias_scale_M.shape)}")
        if bias_scale_M.device != x_MI.device:
            raise ValueError(f"bias_scale is on {bias_scale_M.device}, x on {x_MI.device}")
        bias_scale_M = bias_scale_M.contiguous()
    return _mm("fwd", x_MI, w_NOI, offs, bias_NO, bias_scale_M, cfg, use_tma)


def grouped_gemm_dgrad(
    dy_MO: torch.Tensor,
    w_NOI: torch.Tensor,
    offs: torch.Tensor,
    *,
    cfg: GemmConfig | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """Grouped dgrad: dx (M, I) with dx[r] = dy[r] @ w[g]; rows r >= offs[N] are 0.

    dy_MO: (M, O); w_NOI: (N, O, I) with stride(2) == 1; offs, cfg, use_tma as in grouped_gemm_forward.
    """
    return _mm("dgrad", dy_MO, w_NOI, offs, None, None, cfg, use_tma)


def _wgrad_launch(dy, x, num_groups: int, cfg: GemmConfig, use_tma: bool) -> LaunchPlan:
    """The launch of wgrad_kernel for row-major dy (M, O), x (M, I) and a fresh dw (N, O, I);
    tensors: (dy, x, dw, offs)."""
    M, O = dy.shape
    I = x.shape[1]
    bound = num_groups * triton.cdiv(O, cfg.block_rows) * triton.cdiv(I, cfg.block_cols)
    nprog = _grid_size(dy.device, bound)
    epi_tma = bool(cfg.epi_tma and use_tma and (I * dy.element_size()) % 16 == 0)
    return LaunchPlan(
        _wgrad,
        (nprog,),
        (M, O, I, num_groups, dy.stride(0), x.stride(0), O * I, I),
        dict(
            USE_TMA=use_tma,
            UPCAST=_INTERPRET,
            DOT_PRECISION=_dot_precision(dy.dtype),
            BLOCK_O=cfg.block_rows,
            BLOCK_I=cfg.block_cols,
            BLOCK_M=cfg.block_red,
            GROUP_O=cfg.group_rows,
            BLOCK_GROUPS=_block_groups(num_groups + 1),
            NUM_PROGRAMS=nprog,
            FLATTEN=cfg.flatten,
            EPI_TMA=epi_tma,
            num_stages=cfg.stages,
            num_warps=cfg.warps,
        ),
    )


def grouped_gemm_wgrad(
    dy_MO: torch.Tensor,
    x_MI: torch.Tensor,
    offs: torch.Tensor,
    *,
    cfg: GemmConfig | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """Grouped wgrad in one launch: dw (N, O, I) with dw[g] = dy[rows of g]^T @ x[rows of g].

    dy_MO: (M, O), x_MI: (M, I), same dtype; offs: (N+1,) int64 device tensor (N = its length - 1).
    Groups with no rows get zeros. Rows r >= offs[N] take part in nothing. cfg, use_tma as in
    grouped_gemm_forward.
    """
    key = _plan_key(
        "wgrad", tensor_key(dy_MO), tensor_key(x_MI), tensor_key(offs), cfg, use_tma, _dot_precision(dy_MO.dtype)
    )
    plan = _planned(key, lambda: _plan_wgrad(dy_MO, x_MI, offs, cfg, use_tma))
    dy = dy_MO.contiguous() if plan.contiguous else dy_MO
    x = x_MI.contiguous() if plan.contiguous else x_MI
    N = offs.shape[0] - 1
    dw = _empty((N, dy.shape[1], x.shape[1]), dy.device, dy.dtype)
    if plan.launch is not None:
        with _device_ctx(dy.device):
            plan.launch(dy, x, dw, offs)
    return dw


def _plan_wgrad(dy_MO, x_MI, offs, cfg: GemmConfig | None, use_tma: bool | None) -> _Plan:
    _check_device(dy_MO)
    if dy_MO.dim() != 2 or x_MI.dim() != 2 or dy_MO.shape[0] != x_MI.shape[0]:
        raise ValueError(f"dy {tuple(dy_MO.shape)} and x {tuple(x_MI.shape)} must be (M, O) and (M, I)")
    if dy_MO.dtype != x_MI.dtype or dy_MO.device != x_MI.device:
        raise ValueError(f"dy is {dy_MO.dtype} on {dy_MO.device}, x is {x_MI.dtype} on {x_MI.device}")
    # Operands at unit column stride: .contiguous() on both where either is not (a no-op for one
    # that already is; the fused path's operands are row-major).
    contiguous = dy_MO.stride(1) != 1 or x_MI.stride(1) != 1
    dy = dy_MO.contiguous() if contiguous else dy_MO
    x = x_MI.contiguous() if contiguous else x_MI
    if offs.dim() != 1 or offs.shape[0] < 1:
        raise ValueError(f"offs must be a 1-D tensor of N+1 group offsets, got shape {tuple(offs.shape)}")
    N = offs.shape[0] - 1
    offs = _check_offs(offs, N, dy.device)
    M, O = dy.shape
    I = x.shape[1]
    if N == 0 or O == 0 or I == 0:
        return _Plan(I, contiguous, None)
    use_tma, cap = _resolve_tma(use_tma, M > 0, dy, x)
    with _device_ctx(dy.device):
        if cfg is None:
            cands = _candidates("wgrad", dy.dtype, use_tma, cap, I)
            key = ("wgrad", dy.dtype, O, I, N, _bucket(M), use_tma)
            dw = _empty((N, O, I), dy.device, dy.dtype)
            cfg = _pick(key, cands, lambda c: _wgrad_launch(dy, x, N, c, use_tma)(dy, x, dw, offs), dy.device)
    return _Plan(I, contiguous, _wgrad_launch(dy, x, N, cfg, use_tma))


def group_row_sum(src_MC: torch.Tensor, offs: torch.Tensor, row_scale_M: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group row sums (the bias gradient of a grouped linear): (N, C) in src's dtype with
    out[g] = sum over rows r of group g of src[r] (* row_scale[r]), summed in fp32.

    Deterministic (fixed-order partial sums over 8 row slices per group, then a fixed-shape sum; no
    atomics) and reads no padding row. src_MC: (M, C); offs: (N+1,) device int64; row_scale_M:
    optional (M,) float (router probabilities for fc2's bias).
    """
    return _row_sums(src_MC, offs, row_scale_M, None)[0]


def group_row_sum_and_dot(
    src_MC: torch.Tensor, offs: torch.Tensor, vec_NC: torch.Tensor, row_scale_M: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_row_sum` and, from the same pass over src, dot (M,) fp32 with dot[r] = <src[r], vec[g]>
    for the group g of row r (0 for padding rows): fc2's bias gradient and the bias term of d probs."""
    if vec_NC.dim() != 2 or vec_NC.shape != (offs.shape[0] - 1, src_MC.shape[1]):
        raise ValueError(f"vec must have shape ({offs.shape[0] - 1}, {src_MC.shape[1]}), got {tuple(vec_NC.shape)}")
    return _row_sums(src_MC, offs, row_scale_M, vec_NC)


def _row_sums(src_MC, offs, row_scale_M, vec_NC):
    _check_device(src_MC)
    if src_MC.dim() != 2:
        raise ValueError(f"expected a 2-D (rows, columns) tensor, got shape {tuple(src_MC.shape)}")
    src = src_MC if src_MC.stride(1) == 1 else src_MC.contiguous()
    N = offs.shape[0] - 1
    offs = _check_offs(offs, N, src.device)
    M, C = src.shape
    splits, block_c = (2, 32) if _INTERPRET else (8, 128)
    dots = None
    if vec_NC is not None:
        vec_NC = vec_NC if vec_NC.stride(-1) == 1 else vec_NC.contiguous()
        # Padding rows are never visited: their dot stays 0.
        dots = torch.zeros((triton.cdiv(C, block_c), M), device=src.device, dtype=torch.float32)
    if N == 0 or C == 0:
        sums = torch.zeros((N, C), device=src.device, dtype=src.dtype)
        return sums, (torch.zeros(M, device=src.device) if vec_NC is not None else None)
    part = torch.empty((splits, N, C), device=src.device, dtype=torch.float32)
    with _device_ctx(src.device):
        _group_row_sum[(triton.cdiv(C, block_c), N, splits)](
            src,
            row_scale_M if row_scale_M is not None else src,
            part,
            vec_NC if vec_NC is not None else src,
            dots if dots is not None else part,
            offs,
            M,
            C,
            N,
            src.stride(0),
            vec_NC.stride(0) if vec_NC is not None else 0,
            HAS_SCALE=row_scale_M is not None,
            ROW_DOT=vec_NC is not None,
            SPLITS=splits,
            BLOCK_M=32,
            BLOCK_C=block_c,
            num_warps=4,
        )
    # Fixed-shape torch sums have a fixed reduction order: deterministic.
    return part.sum(0).to(src.dtype), (dots.sum(0) if dots is not None else None)
