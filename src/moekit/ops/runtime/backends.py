"""The backends of moekit's grouped products, behind one Protocol, and the capabilities the fused paths ask
for.

Legend: M rows, N groups (experts), I/O a linear's in/out features, H hidden size, F ffn size, D features
of a moved row, J rows summed into one.

Every backend computes the four products of a grouped linear (`GemmBackend`): forward, dgrad, wgrad and
the per-group bias sums. A backend that also runs the fused MLP's kernels has the `FusedMLP`
capability (fc1 + activation in one kernel, fc2's dgrad + the activation's backward in one kernel, and
the bias sums with the d probs term in one pass); the fused paths of `grouped_mlp` and `moe_experts`
ask a backend for it (`fused_mlp_of`), never for a name. Rows move with `gather_sum_rows`: moekit's row
kernel wherever the Triton kernels run (`use_triton_rows`), plain torch elsewhere, with the same values.
The ops that take a backend but run no grouped product (the gated activation on its own, the router's
top-k) choose between moekit's kernel and torch ops with `kernel_chosen`.
Every backend can quantize grouped tensors (the `GroupQuantizer` capability, `select_quantizer`): the
loop and torch backends in plain torch (`moekit.ops.runtime.quantize_torch`), the triton backend with
moekit's kernels (`moekit.ops.runtime.quantize`), byte for byte the same.

    "loop"    per-group matmuls: the reference schedule, any device and dtype (reads device offsets on
              the host: a sync, which is why "auto" never picks it on CUDA when another can run)
    "torch"   torch's grouped GEMM (`torch.nn.functional.grouped_mm` / `torch._grouped_mm`), where it
              supports the device and dtype; offsets stay on the device
    "triton"  moekit's own kernels (`moekit.ops.runtime`): CUDA, or the CPU under TRITON_INTERPRET=1;
              has FusedMLP
    "auto"    the first that runs of `auto_order(x)`

This module needs no triton: the Triton backend imports moekit's runtime when first asked to run.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple, Protocol, cast, runtime_checkable

import torch

from moekit.ops.runtime import quantize_torch
from moekit.ops.runtime.configs import TOPK_MAX_EXPERTS
from moekit.ops.runtime.device import cuda_capability
from moekit.ops.splits import GroupOffsets, compute_dtype
from moekit.validation import check_bool

BACKENDS = ("auto", "loop", "torch", "triton")


@runtime_checkable
class GemmBackend(Protocol):
    """The four products of a grouped linear over rows sorted by group (`offs`: `GroupOffsets`)."""

    name: str

    def unavailable_reason(self, x: torch.Tensor, w_NOI: torch.Tensor) -> str | None:
        """Why this backend cannot run for input x and weights like w_NOI; None if it can."""

    def forward(
        self,
        x_MI: torch.Tensor,
        w_NOI: torch.Tensor,
        offs: GroupOffsets,
        bias_NO: torch.Tensor | None,
        bias_scale_M: torch.Tensor | None,
    ) -> torch.Tensor:
        """y (M, O) = x @ w[g]^T (+ bias[g] (* bias_scale)), padding rows zero."""

    def dgrad(self, dy_MO: torch.Tensor, w_NOI: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
        """dx (M, I) = dy @ w[g], padding rows zero."""

    def wgrad(self, dy_MO: torch.Tensor, x_MI: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
        """dw (N, O, I) = dy[rows of g]^T x[rows of g]; groups without rows get zeros."""

    def dbias(self, dy_MO: torch.Tensor, offs: GroupOffsets, bias_scale_M: torch.Tensor | None) -> torch.Tensor:
        """db (N, O) = per-group sums of dy's rows (* bias_scale); dy's padding rows must be zero."""


@runtime_checkable
class FusedMLP(Protocol):
    """The fused MLP's kernels (moekit.ops.runtime.glu for their contracts)."""

    def glu_forward(
        self,
        x_MH: torch.Tensor,
        w1_N2FH: torch.Tensor,
        offs: torch.Tensor,
        bias_N2F: torch.Tensor | None,
        probs_M: torch.Tensor | None,
        glu_interleave_size: int | None,
        activation: str,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h (M, 2F), act (M, F)): fc1 + bias + activation (* probs) in one kernel."""

    def gathered_fc1_pays(self, x_TH: torch.Tensor, w1_N2FH: torch.Tensor, glu_interleave_size: int | None) -> bool:
        """Whether the layer's fc1 reads x's token rows in its loads (`glu_forward_gathered`'s kernel)
        rather than gathering them first: the same bits either way, a choice of speed."""

    def glu_forward_gathered(
        self,
        x_TH: torch.Tensor,
        token_of_row: torch.Tensor,
        w1_N2FH: torch.Tensor,
        offs: torch.Tensor,
        bias_N2F: torch.Tensor | None,
        probs_M: torch.Tensor | None,
        glu_interleave_size: int | None,
        activation: str,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`glu_forward` of the rows x_TH[token_of_row] (M, H), bit for bit; the rows are read where the
        kernel can gather them, else gathered first."""

    def gathered_wgrad_pays(self, x_TH: torch.Tensor, ffn: int) -> bool:
        """Whether the layer's fc1 weight gradient reads x's token rows through the row map in its loads
        (`wgrad_gathered`) rather than gathering them first: the same bits either way, a choice of speed."""

    def wgrad_gathered(
        self,
        dy: torch.Tensor,
        x: torch.Tensor,
        offs: torch.Tensor,
        dy_rows: torch.Tensor | None,
        x_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """dw (N, O, I) of the routed rows dy[dy_rows] (M, O) and x[x_rows] (M, I) (an operand without a
        row map: its own M rows), bit for bit the wgrad of the gathered rows, read in the kernel's loads."""

    def glu_backward_partials(
        self,
        dy_MH: torch.Tensor,
        w2_NHF: torch.Tensor,
        h_M2F: torch.Tensor,
        offs: torch.Tensor,
        probs_M: torch.Tensor | None,
        glu_interleave_size: int | None,
        activation: str,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(dh (M, 2F), act_p (M, F), d probs partials or None): fc2's dgrad + the activation's backward."""

    def gathered_backward_pays(
        self, d_out_TH: torch.Tensor, w2_NHF: torch.Tensor, glu_interleave_size: int | None
    ) -> bool:
        """Whether the layer's fc2 backward reads d out's token rows in its loads
        (`glu_backward_gathered_partials`, `wgrad_gathered`) rather than gathering them first: the same
        bits either way, a choice of speed."""

    def glu_backward_gathered_partials(
        self,
        d_out_TH: torch.Tensor,
        token_of_row: torch.Tensor,
        w2_NHF: torch.Tensor,
        h_M2F: torch.Tensor,
        offs: torch.Tensor,
        probs_M: torch.Tensor | None,
        glu_interleave_size: int | None,
        activation: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`glu_backward_partials` of the rows d_out_TH[token_of_row] (M, H), bit for bit; the rows are read
        where the kernel can gather them, else gathered first."""

    def dbias_and_dot(
        self,
        dy_MH: torch.Tensor,
        offs: torch.Tensor,
        b2_NH: torch.Tensor,
        probs_M: torch.Tensor | None,
        token_of_row: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(d fc2 bias (N, H): the rows of each group summed, each times its probs where there are probs;
        <dy[r], b2[g]> (M,) fp32, the bias term of d probs) from one pass over dy. With token_of_row, dy is
        d out's (T, H) token rows and row r is dy[token_of_row[r]], read where it lies (bit for bit the
        gathered rows' sums)."""


@runtime_checkable
class GroupQuantizer(Protocol):
    """Grouped FP8 quantization into existing storage, and back (`moekit.ops.runtime.quantize_torch` for
    the contracts of `group_quantize_into` and `group_dequantize`)."""

    def quantize_unavailable_reason(self, x: torch.Tensor) -> str | None:
        """Why this backend cannot quantize x; None if it can."""

    def group_quantize_into(
        self,
        recipe: str,
        x: torch.Tensor,
        offs: torch.Tensor,
        slot_offs: torch.Tensor,
        noop: torch.Tensor | None,
        row_data: torch.Tensor | None,
        row_scale: torch.Tensor | None,
        col_data: torch.Tensor | None,
        col_scale: torch.Tensor | None,
        col_segments: bool = False,
        index: torch.Tensor | None = None,
        data_t: torch.Tensor | None = None,
        scale_t: torch.Tensor | None = None,
    ) -> None:
        """Quantize x (rows in groups `offs`, or an (N, O, I) weight) into the given storage; with
        col_segments the columnwise data in the FP8 wgrad's transposed layout (X, pitch); with index
        ((M,) rows of x, the columnwise form asked) the rows x[index], never written out; with data_t
        and scale_t a weight's transposed copy too (`quantize_torch.group_quantize_into`)."""

    def group_dequantize(
        self,
        recipe: str,
        data: torch.Tensor,
        scale: torch.Tensor,
        offs: torch.Tensor,
        slot_offs: torch.Tensor | None,
        columnwise: bool,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """One form of a quantized tensor back in `dtype` (`quantize_torch.group_dequantize`: the
        contract; every backend the same bytes). `quantize_unavailable_reason` of a tensor of `dtype` on
        data's device says whether this backend can."""

    def transpose_weight_into(
        self, recipe: str, data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor, scale_t: torch.Tensor
    ) -> None:
        """An (N, O, I) quantized weight's data and scales transposed into (N, I, O) storage
        (`quantize_torch.transpose_weight_into`: the contract; every backend the same bytes)."""


@runtime_checkable
class QuantizedGemm(Protocol):
    """FP8 compute of a quantized grouped linear's forward, dgrad and (where the recipe allows) wgrad
    (`moekit.ops.runtime.quantized_gemm` for the operands' formats and the contracts): products of the
    FP8 data with their scales, accumulated in fp32, instead of the reference path's
    dequantize-then-GEMM."""

    def quantized_gemm_unavailable_reason(self, recipe: str, x: torch.Tensor) -> str | None:
        """Why this backend cannot compute `recipe`'s products for input x (its dtype is the output's);
        None if it can."""

    def quantized_forward(
        self,
        recipe: str,
        x_data: torch.Tensor,
        x_scale: torch.Tensor,
        w_data: torch.Tensor,
        w_scale: torch.Tensor,
        offs: GroupOffsets,
        bias_NO: torch.Tensor | None,
        bias_scale_M: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """y (M, O) = x_q @ w_q[g]^T (+ bias[g] (* bias_scale)) in out_dtype, padding rows zero."""

    def quantized_dgrad(
        self,
        recipe: str,
        dy_data: torch.Tensor,
        dy_scale: torch.Tensor,
        w_data: torch.Tensor,
        w_scale: torch.Tensor,
        offs: GroupOffsets,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """dx (M, I) = dy_q @ w_q[g] in out_dtype, padding rows zero; w_data / w_scale are the weight
        transposed, (N, I, O) (`moekit.ops.quantize.TransposedWeight`)."""

    def quantized_wgrad_unavailable_reason(self, recipe: str, x: torch.Tensor) -> str | None:
        """Why this backend cannot compute `recipe`'s weight gradient in FP8 for input x (its dtype is
        the output's); None if it can."""

    def quantized_wgrad(
        self,
        recipe: str,
        dy_data: torch.Tensor,
        dy_scale: torch.Tensor,
        x_data: torch.Tensor,
        x_scale: torch.Tensor,
        offs: GroupOffsets,
        out_dtype: torch.dtype,
        segmented: bool = False,
    ) -> torch.Tensor:
        """dw (N, O, I) in out_dtype, dw[g] = Qc(dy)[rows of g]^T Qc(x)[rows of g] from the columnwise
        quantizations of dy (M, O) and x (M, I) (data and per-group scales); groups without rows zero.
        segmented: the data already in the wgrad's transposed layout, (O, pitch) and (I, pitch) of
        offs.rows rows (`moekit.ops.runtime.quantize_torch.segment_transposed`)."""


@runtime_checkable
class QuantizedGatedFc1(Protocol):
    """fc1 of the quantized MLP in one kernel: its FP8 GEMM with the gated activation and the rowwise
    quantizations of the activation and of h in the epilogue, h never written
    (`moekit.ops.runtime.quantized_gemm.quantized_glu_forward_into` for the contract: the bytes of the FP8
    forward followed by the gated quantize pass)."""

    def quantized_gated_fc1_unavailable_reason(
        self, recipe: str, x: torch.Tensor, ffn: int, glu_block: int, gate_limit: float, up_limit: float
    ) -> str | None:
        """Why this backend cannot run fc1 this way for input x (M, H) (its dtype is h's), F = ffn in GLU
        blocks of glu_block, the activation's clamps; None if it can."""

    def quantized_gated_fc1_into(
        self,
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
        """The rowwise forms of a = ACT(gate(h), up(h)) (* probs) and of h = Q(x) Q(w1)^T (+ b1) into the
        given storage."""


# --------------------------------------------------------------------------------------------------
# Group bookkeeping of the torch paths
# --------------------------------------------------------------------------------------------------


def zero_padding_rows(t: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
    """Zero rows past the last offset in place (grouped_mm leaves them unwritten; the contract says
    zeros), at the cost of the padding rows, not of the whole tensor: a slice where the host knows the
    last offset; on CUDA a kernel that reads it on the device (no host sync)."""
    if offs.host is not None:
        if offs.host[-1] < offs.rows:
            t[offs.host[-1] :] = 0
        return t
    runtime = triton_runtime()
    if t.device.type == "cuda" and t.stride(-1) == 1 and runtime is not None:
        return runtime.rows.zero_rows_from(t, offs.offs[-1:])
    # Offsets the host was not given off CUDA (only tests build those on the CPU), or no Triton: a
    # masked pass over the whole tensor, still without reading the offsets on the host.
    rows = torch.arange(offs.rows, device=t.device)
    return t.masked_fill_((rows >= offs.offs[-1])[:, None], 0)


def without_padding(t: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
    """t itself where the host knows there are no padding rows, else a copy with them zeroed."""
    if offs.host is not None and offs.host[-1] == offs.rows:
        return t
    return zero_padding_rows(t.clone(), offs)


def bias_rows(bias_NO: torch.Tensor, offs: GroupOffsets, dtype: torch.dtype) -> torch.Tensor:
    """(M, O): the bias of every row's group in `dtype`; zeros for padding rows."""
    zero_row = bias_NO.new_zeros(1, bias_NO.shape[1])
    return torch.cat([bias_NO, zero_row]).to(dtype)[offs.row_group()]


def _group_sum(dy_MO: torch.Tensor, offs: GroupOffsets, scale_M: torch.Tensor | None) -> torch.Tensor:
    """Per-group row sums as a (N, M) x (M, O) product: deterministic (no atomics), no sync."""
    acc_t = compute_dtype(dy_MO, scale_M)
    src = dy_MO.to(acc_t) if scale_M is None else dy_MO.to(acc_t) * scale_M[:, None].to(acc_t)
    groups = torch.arange(offs.num_groups, device=offs.offs.device)
    onehot_NM = (offs.row_group()[None, :] == groups[:, None]).to(acc_t)
    return (onehot_NM @ src).to(dy_MO.dtype)


def _add_group_bias(
    y_MO: torch.Tensor, bias_NO: torch.Tensor, offs: GroupOffsets, bias_scale_M: torch.Tensor | None
) -> torch.Tensor:
    """y += bias[group(row)] (* scale[row]), math in fp32, one rounding."""
    acc_t = compute_dtype(y_MO, bias_scale_M)
    bias_MO = bias_rows(bias_NO, offs, acc_t)
    if bias_scale_M is not None:
        bias_MO = bias_MO * bias_scale_M[:, None].to(acc_t)
    return (y_MO.to(acc_t) + bias_MO).to(y_MO.dtype)


# --------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------


class LoopBackend:
    """Per-group matmuls: the reference schedule; any device and dtype. Reads device offsets on the host
    (a sync)."""

    name = "loop"

    def unavailable_reason(self, x: torch.Tensor, w_NOI: torch.Tensor) -> str | None:
        return None

    def forward(
        self,
        x_MI: torch.Tensor,
        w_NOI: torch.Tensor,
        offs: GroupOffsets,
        bias_NO: torch.Tensor | None,
        bias_scale_M: torch.Tensor | None,
    ) -> torch.Tensor:
        bounds = offs.host_offsets()
        y_MO = x_MI.new_zeros(x_MI.shape[0], w_NOI.shape[1])
        for g in range(w_NOI.shape[0]):
            lo, hi = bounds[g], bounds[g + 1]
            if hi == lo:
                continue
            acc = x_MI[lo:hi] @ w_NOI[g].t()
            if bias_NO is not None:
                acc_t = compute_dtype(x_MI, bias_scale_M)
                b = bias_NO[g].to(acc_t)
                acc = acc.to(acc_t) + (b * bias_scale_M[lo:hi, None].to(acc_t) if bias_scale_M is not None else b)
            y_MO[lo:hi] = acc.to(y_MO.dtype)
        return y_MO

    def dgrad(self, dy_MO: torch.Tensor, w_NOI: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
        bounds = offs.host_offsets()
        dx_MI = dy_MO.new_zeros(dy_MO.shape[0], w_NOI.shape[2])
        for g in range(w_NOI.shape[0]):
            lo, hi = bounds[g], bounds[g + 1]
            if hi > lo:
                dx_MI[lo:hi] = dy_MO[lo:hi] @ w_NOI[g]
        return dx_MI

    def wgrad(self, dy_MO: torch.Tensor, x_MI: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
        bounds = offs.host_offsets()
        dw_NOI = dy_MO.new_zeros(offs.num_groups, dy_MO.shape[1], x_MI.shape[1])
        for g in range(offs.num_groups):
            lo, hi = bounds[g], bounds[g + 1]
            if hi > lo:
                dw_NOI[g] = dy_MO[lo:hi].t() @ x_MI[lo:hi]
        return dw_NOI

    def dbias(self, dy_MO: torch.Tensor, offs: GroupOffsets, bias_scale_M: torch.Tensor | None) -> torch.Tensor:
        bounds = offs.host_offsets()
        acc_t = compute_dtype(dy_MO, bias_scale_M)
        src = dy_MO.to(acc_t) if bias_scale_M is None else dy_MO.to(acc_t) * bias_scale_M[:, None].to(acc_t)
        db = torch.zeros(offs.num_groups, dy_MO.shape[1], dtype=acc_t, device=dy_MO.device)
        for g in range(offs.num_groups):
            lo, hi = bounds[g], bounds[g + 1]
            if hi > lo:
                db[g] = src[lo:hi].sum(0)
        return db.to(dy_MO.dtype)

    # The GroupQuantizer capability: plain torch, any device and floating dtype, no host read.
    def quantize_unavailable_reason(self, x: torch.Tensor) -> str | None:
        return None

    group_quantize_into = staticmethod(quantize_torch.group_quantize_into)
    group_dequantize = staticmethod(quantize_torch.group_dequantize)
    transpose_weight_into = staticmethod(quantize_torch.transpose_weight_into)


def torch_grouped_mm() -> Callable[..., torch.Tensor] | None:
    """torch's grouped GEMM, or None where this torch has none."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def _grouped_mm() -> Callable[..., torch.Tensor]:
    """torch's grouped GEMM, where the torch backend runs (its `unavailable_reason` found one)."""
    fn = torch_grouped_mm()
    if fn is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no grouped_mm")
    return fn


class TorchBackend:
    """torch's grouped GEMM; device offsets stay on the device."""

    name = "torch"

    def unavailable_reason(self, x: torch.Tensor, w_NOI: torch.Tensor) -> str | None:
        if torch_grouped_mm() is None:
            return f"this torch ({torch.__version__}) has no grouped_mm"
        if x.device.type == "cuda":
            if x.dtype != torch.bfloat16:
                return f"torch's CUDA grouped_mm runs on bfloat16 only, got {x.dtype}"
            if cuda_capability(x.device) < (8, 0):
                return "torch's CUDA grouped_mm needs compute capability >= 8.0"
        elif x.device.type == "cpu":
            if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                return f"torch's CPU grouped_mm supports float32/bfloat16/float16, got {x.dtype}"
        else:
            return f"torch's grouped_mm does not run on {x.device.type}"
        # grouped_mm requires 16-byte aligned row strides for every operand it touches, and no empty
        # reduction.
        align = 16 // x.element_size()
        bad = [n for n, d in (("in_features", x.shape[1]), ("out_features", w_NOI.shape[1])) if d % align or d == 0]
        if bad:
            return (
                f"torch's grouped_mm needs {', '.join(bad)} to be a non-zero multiple of {align} for {x.dtype} "
                f"(got in={x.shape[1]}, out={w_NOI.shape[1]}); use backend='loop' or 'triton'"
            )
        return None

    def forward(
        self,
        x_MI: torch.Tensor,
        w_NOI: torch.Tensor,
        offs: GroupOffsets,
        bias_NO: torch.Tensor | None,
        bias_scale_M: torch.Tensor | None,
    ) -> torch.Tensor:
        ends = offs.offs[1:].to(torch.int32)
        y_MO = _grouped_mm()(x_MI, w_NOI.transpose(-2, -1), offs=ends)
        if bias_NO is not None:
            y_MO = _add_group_bias(y_MO, bias_NO, offs, bias_scale_M)
        return zero_padding_rows(y_MO, offs)

    def dgrad(self, dy_MO: torch.Tensor, w_NOI: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
        ends = offs.offs[1:].to(torch.int32)
        return zero_padding_rows(_grouped_mm()(dy_MO, w_NOI, offs=ends), offs)

    def wgrad(self, dy_MO: torch.Tensor, x_MI: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
        ends = offs.offs[1:].to(torch.int32)
        return _grouped_mm()(dy_MO.t(), x_MI, offs=ends)

    def dbias(self, dy_MO: torch.Tensor, offs: GroupOffsets, bias_scale_M: torch.Tensor | None) -> torch.Tensor:
        return _group_sum(dy_MO, offs, bias_scale_M)

    # The GroupQuantizer capability: plain torch (grouped_mm has nothing to do with it), as the loop backend.
    def quantize_unavailable_reason(self, x: torch.Tensor) -> str | None:
        return None

    group_quantize_into = staticmethod(quantize_torch.group_quantize_into)
    group_dequantize = staticmethod(quantize_torch.group_dequantize)
    transpose_weight_into = staticmethod(quantize_torch.transpose_weight_into)


class TritonRuntime(NamedTuple):
    """moekit's Triton runtime modules."""

    gated: ModuleType
    gemm: ModuleType
    glu: ModuleType
    launch: ModuleType
    rows: ModuleType
    routing: ModuleType
    quantize: ModuleType
    quantized_gemm: ModuleType
    topk: ModuleType


_RUNTIME: list[TritonRuntime | None] = []


def triton_runtime() -> TritonRuntime | None:
    """moekit's Triton runtime, or None where triton cannot be imported. Imported on first use: moekit
    runs without triton through the other backends."""
    if not _RUNTIME:
        try:
            from moekit.ops.runtime import gated, gemm, glu, launch, quantize, quantized_gemm, routing, rows, topk
        except ImportError:
            _RUNTIME.append(None)
        else:
            _RUNTIME.append(TritonRuntime(gated, gemm, glu, launch, rows, routing, quantize, quantized_gemm, topk))
    return _RUNTIME[0]


def _runtime() -> TritonRuntime:
    """moekit's Triton runtime, where the caller found moekit's kernels able to run (so triton imports)."""
    runtime = triton_runtime()
    if runtime is None:
        raise RuntimeError("triton cannot be imported (pip install triton)")
    return runtime


class TritonBackend:
    """moekit's own Triton kernels: every GEMM product, and the FusedMLP, GroupQuantizer and QuantizedGemm
    capabilities."""

    name = "triton"

    def unavailable_reason(self, x: torch.Tensor, w_NOI: torch.Tensor) -> str | None:
        return triton_unavailable_reason(x.device, x.dtype)

    def forward(
        self,
        x_MI: torch.Tensor,
        w_NOI: torch.Tensor,
        offs: GroupOffsets,
        bias_NO: torch.Tensor | None,
        bias_scale_M: torch.Tensor | None,
    ) -> torch.Tensor:
        return _runtime().gemm.grouped_gemm_forward(x_MI, w_NOI, offs.offs, bias_NO, bias_scale_M)

    def dgrad(self, dy_MO: torch.Tensor, w_NOI: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
        return _runtime().gemm.grouped_gemm_dgrad(dy_MO, w_NOI, offs.offs)

    def wgrad(self, dy_MO: torch.Tensor, x_MI: torch.Tensor, offs: GroupOffsets) -> torch.Tensor:
        return _runtime().gemm.grouped_gemm_wgrad(dy_MO, x_MI, offs.offs)

    def dbias(self, dy_MO: torch.Tensor, offs: GroupOffsets, bias_scale_M: torch.Tensor | None) -> torch.Tensor:
        return _runtime().gemm.group_row_sum(dy_MO, offs.offs, bias_scale_M)

    # The FusedMLP capability: the runtime's functions themselves, so that a call goes straight to the
    # launcher (no frame of this module on a kernel's path).
    @property
    def glu_forward(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        return _runtime().glu.glu_forward

    @property
    def glu_forward_gathered(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        return _runtime().glu.glu_forward_gathered

    @property
    def gathered_fc1_pays(self) -> Callable[..., bool]:
        return _runtime().glu.gathered_fc1_pays

    @property
    def gathered_wgrad_pays(self) -> Callable[..., bool]:
        return _runtime().gemm.gathered_wgrad_pays

    def wgrad_gathered(
        self,
        dy: torch.Tensor,
        x: torch.Tensor,
        offs: torch.Tensor,
        dy_rows: torch.Tensor | None,
        x_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        return _runtime().gemm.grouped_gemm_wgrad(dy, x, offs, dy_rows=dy_rows, x_rows=x_rows)

    @property
    def glu_backward_partials(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        return _runtime().glu.glu_backward_partials

    @property
    def gathered_backward_pays(self) -> Callable[..., bool]:
        return _runtime().glu.gathered_backward_pays

    @property
    def glu_backward_gathered_partials(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        return _runtime().glu.glu_backward_gathered_partials

    @property
    def dbias_and_dot(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        return _runtime().gemm.group_row_sum_and_dot

    # The GroupQuantizer capability: moekit's quantization kernels.
    def quantize_unavailable_reason(self, x: torch.Tensor) -> str | None:
        return triton_unavailable_reason(x.device, x.dtype)

    @property
    def group_quantize_into(self) -> Callable[..., None]:
        runtime = triton_runtime()
        if runtime is None:
            raise ValueError("triton cannot be imported (pip install triton)")
        return runtime.quantize.group_quantize_into

    @property
    def group_dequantize(self) -> Callable[..., torch.Tensor]:
        runtime = triton_runtime()
        if runtime is None:
            raise ValueError("triton cannot be imported (pip install triton)")
        return runtime.quantize.group_dequantize

    @property
    def transpose_weight_into(self) -> Callable[..., None]:
        runtime = triton_runtime()
        if runtime is None:
            raise ValueError("triton cannot be imported (pip install triton)")
        return runtime.quantize.transpose_weight_into

    # The QuantizedGemm capability: moekit's FP8 kernels (fp8_block, fp8_rowwise; FP8 tensor cores or
    # the interpreter).
    def quantized_gemm_unavailable_reason(self, recipe: str, x: torch.Tensor) -> str | None:
        runtime = triton_runtime()
        if runtime is None:
            return "triton cannot be imported (pip install triton)"
        return runtime.quantized_gemm.fp8_gemm_unavailable_reason(recipe, x.device, x.dtype)

    def quantized_forward(
        self,
        recipe: str,
        x_data: torch.Tensor,
        x_scale: torch.Tensor,
        w_data: torch.Tensor,
        w_scale: torch.Tensor,
        offs: GroupOffsets,
        bias_NO: torch.Tensor | None,
        bias_scale_M: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return _runtime().quantized_gemm.quantized_gemm_forward(
            recipe, x_data, x_scale, w_data, w_scale, offs.offs, bias_NO, bias_scale_M, out_dtype=out_dtype
        )

    def quantized_dgrad(
        self,
        recipe: str,
        dy_data: torch.Tensor,
        dy_scale: torch.Tensor,
        w_data: torch.Tensor,
        w_scale: torch.Tensor,
        offs: GroupOffsets,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return _runtime().quantized_gemm.quantized_gemm_dgrad(
            recipe, dy_data, dy_scale, w_data, w_scale, offs.offs, out_dtype=out_dtype
        )

    def quantized_wgrad_unavailable_reason(self, recipe: str, x: torch.Tensor) -> str | None:
        runtime = triton_runtime()
        if runtime is None:
            return "triton cannot be imported (pip install triton)"
        return runtime.quantized_gemm.fp8_wgrad_unavailable_reason(recipe, x.device, x.dtype)

    def quantized_wgrad(
        self,
        recipe: str,
        dy_data: torch.Tensor,
        dy_scale: torch.Tensor,
        x_data: torch.Tensor,
        x_scale: torch.Tensor,
        offs: GroupOffsets,
        out_dtype: torch.dtype,
        segmented: bool = False,
    ) -> torch.Tensor:
        return _runtime().quantized_gemm.quantized_gemm_wgrad(
            recipe,
            dy_data,
            dy_scale,
            x_data,
            x_scale,
            offs.offs,
            out_dtype=out_dtype,
            segmented_rows=offs.rows if segmented else None,
        )

    # The QuantizedGatedFc1 capability: fc1's Gluon fp8_block kernel with the gated epilogue (Hopper).
    def quantized_gated_fc1_unavailable_reason(
        self, recipe: str, x: torch.Tensor, ffn: int, glu_block: int, gate_limit: float, up_limit: float
    ) -> str | None:
        runtime = triton_runtime()
        if runtime is None:
            return "triton cannot be imported (pip install triton)"
        return runtime.quantized_gemm.fp8_glu_unavailable_reason(
            recipe, x.device, x.dtype, x.shape[-1], ffn, glu_block, gate_limit, up_limit
        )

    @property
    def quantized_gated_fc1_into(self) -> Callable[..., None]:
        runtime = triton_runtime()
        if runtime is None:
            raise ValueError("triton cannot be imported (pip install triton)")
        return runtime.quantized_gemm.quantized_glu_forward_into


# Integer dtypes the row kernel gathers as they are (J = 1, no weight): FP8 data and scales move as
# integer views of their bytes.
_GATHER_BYTES = (torch.uint8, torch.int16, torch.int32, torch.int64)


def gather_sum_rows(
    src_SD: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None, use_triton: bool
) -> torch.Tensor:
    """(rows of index, D): out[r] = sum over j of (weight[r, j] *) src[index[r, j]], j in ascending order,
    sums in fp32 (float64 for float64 src), one rounding, in src's dtype. With use_triton, moekit's row
    kernel for the kernels' dtypes (and the integer dtypes of _GATHER_BYTES for a plain gather);
    otherwise (and for other dtypes, e.g. float64 router weights) torch's
    gather and a fixed-order sum over j: the same values (a gather is exact, the sums run in one order)."""
    src_SD, index = src_SD.contiguous(), index.contiguous()
    gather = index.shape[1] == 1 and weight is None
    if use_triton and (
        src_SD.dtype in (torch.float32, torch.bfloat16, torch.float16) or (gather and src_SD.dtype in _GATHER_BYTES)
    ):
        return _runtime().rows.gather_sum_rows(src_SD, index, weight)
    num_out, per_out = index.shape
    gathered = src_SD.index_select(0, index.reshape(-1))
    if gather:
        return gathered
    acc_t = torch.promote_types(src_SD.dtype, torch.float32)
    gathered = gathered.view(num_out, per_out, src_SD.shape[1]).to(acc_t)
    if weight is not None:
        gathered = gathered * weight.to(acc_t)[:, :, None]
    return gathered.sum(1).to(src_SD.dtype)


def kernel_chosen(backend: str, t: torch.Tensor, what: str, limit: str | None = None) -> bool:
    """Whether an op that takes a `backend` but runs no grouped product (the gated activation on its own,
    the router's top-k) runs moekit's kernel on `t`: "triton" wherever the kernel runs (ValueError saying
    why elsewhere), "auto" on CUDA where it runs, "torch" and "loop" never (plain torch, the same math in
    another order). `what` names the op in the error; `limit` says why this kernel cannot take these
    operands although moekit's kernels run here (None: it can)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend in ("torch", "loop"):
        return False
    why = triton_unavailable_reason(t.device, t.dtype) or limit
    if backend == "triton" and why is not None:
        raise ValueError(f"backend='triton' cannot run {what} here: {why}")
    return why is None and (backend == "triton" or t.device.type == "cuda")


def gated_uses_triton(backend: str, h: torch.Tensor) -> bool:
    """Whether the gated activation on its own (`moekit.ops.glu.glu`) runs moekit's kernel for `backend`
    (`kernel_chosen`)."""
    return kernel_chosen(backend, h, "the activation")


def topk_uses_triton(backend: str, logits_TN: torch.Tensor) -> bool:
    """Whether the router's top-k (`moekit.ops.topk.topk_softmax`) runs moekit's kernel for `backend`
    (`kernel_chosen`); the kernel holds a row in registers, so it takes at most
    `configs.TOPK_MAX_EXPERTS` experts."""
    num_experts = logits_TN.shape[-1]
    limit = None
    if num_experts > TOPK_MAX_EXPERTS:
        limit = (
            f"logits has {num_experts} experts (columns), more than the {TOPK_MAX_EXPERTS} moekit's top-k "
            "kernel takes; use backend='torch'"
        )
    return kernel_chosen(backend, logits_TN, "the router's top-k", limit)


def topk_softmax(logits_TN: torch.Tensor, top_k: int, ids_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """moekit's top-k + softmax kernel (`moekit.ops.runtime.topk.topk_softmax`)."""
    return _runtime().topk.topk_softmax(logits_TN, top_k, ids_dtype)


def topk_softmax_backward(
    weights_TK: torch.Tensor, ids_TK: torch.Tensor, d_weights_TK: torch.Tensor, num_experts: int, dtype: torch.dtype
) -> torch.Tensor:
    """moekit's top-k + softmax backward kernel (`moekit.ops.runtime.topk.topk_softmax_backward`)."""
    return _runtime().topk.topk_softmax_backward(weights_TK, ids_TK, d_weights_TK, num_experts, dtype)


def gated_forward(h_M2F: torch.Tensor, probs_M: torch.Tensor | None, glu_block: int, activation: str) -> torch.Tensor:
    """moekit's gated-activation kernel (`moekit.ops.runtime.gated.gated_forward`)."""
    return _runtime().gated.gated_forward(h_M2F, probs_M, glu_block, activation)


def gated_backward(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_block: int,
    activation: str,
    need_d_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """moekit's gated-activation backward kernel (`moekit.ops.runtime.gated.gated_backward`)."""
    return _runtime().gated.gated_backward(h_M2F, probs_M, d_out_MF, glu_block, activation, need_d_probs)


def held_gated_forward(
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    recipe: str,
    dtype: torch.dtype,
    gate_limit: float,
    up_limit: float,
) -> torch.Tensor:
    """moekit's gated-activation kernel reading h held in FP8 (`moekit.ops.runtime.gated.held_gated_forward`:
    h_data, h_scale the rowwise quantization of a `recipe` in `dtype`; gate_limit, up_limit the clamps
    of its held form, 0 for none)."""
    held = _runtime().gated.HeldH.of(recipe, dtype, gate_limit, up_limit)
    return _runtime().gated.held_gated_forward(h_data, h_scale, probs_M, glu_block, activation, held)


def held_gated_backward(
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_block: int,
    activation: str,
    recipe: str,
    gate_limit: float,
    up_limit: float,
    need_d_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """moekit's gated-activation backward kernel reading h held in FP8
    (`moekit.ops.runtime.gated.held_gated_backward`; dh in d_out's dtype)."""
    held = _runtime().gated.HeldH.of(recipe, d_out_MF.dtype, gate_limit, up_limit)
    return _runtime().gated.held_gated_backward(
        h_data, h_scale, probs_M, d_out_MF, glu_block, activation, need_d_probs, held
    )


def gated_quantize_unavailable_reason(recipe: str, ffn: int, glu_block: int) -> str | None:
    """Why moekit's gated-activation kernel cannot quantize its output and h itself for `recipe` at this
    GLU layout (`moekit.ops.runtime.gated.gated_quantize_unavailable_reason`); None if it can. Asked
    only where the gated kernel runs (so triton imports)."""
    return _runtime().gated.gated_quantize_unavailable_reason(recipe, ffn, glu_block)


def gated_quantize_into(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    offs: torch.Tensor,
    glu_block: int,
    activation: str,
    recipe: str,
    gate_limit: float,
    up_limit: float,
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
) -> None:
    """moekit's gated-activation kernel writing the rowwise quantizations of its output and of h's held
    form (`moekit.ops.runtime.gated.gated_quantize_into`)."""
    _runtime().gated.gated_quantize_into(
        h_M2F, probs_M, offs, glu_block, activation, recipe, gate_limit, up_limit, a_data, a_scale, h_data, h_scale
    )


def held_columns_unavailable_reason(recipe: str, device: torch.device) -> str | None:
    """Why the quantized MLP does not quantize the held h's activation columnwise by moekit's gated kernel
    for `recipe` on `device` (`moekit.ops.runtime.gated.held_columns_unavailable_reason`); None where it
    does. Asked only where the gated kernel runs (so triton imports)."""
    return _runtime().gated.held_columns_unavailable_reason(recipe, device)


def held_columns_into(
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    offs: torch.Tensor,
    slot_offs: torch.Tensor,
    glu_block: int,
    activation: str,
    recipe: str,
    dtype: torch.dtype,
    gate_limit: float,
    up_limit: float,
    col_data: torch.Tensor,
    col_scale: torch.Tensor,
) -> None:
    """moekit's gated kernel writing the columnwise quantization of the held h's activation (in `dtype`)
    into the FP8 wgrad's segments (`moekit.ops.runtime.gated.held_columns_into`)."""
    held = _runtime().gated.HeldH.of(recipe, dtype, gate_limit, up_limit)
    _runtime().gated.held_columns_into(
        h_data, h_scale, probs_M, offs, slot_offs, glu_block, activation, held, recipe, col_data, col_scale
    )


def set_autotune(enabled: bool) -> None:
    """Turn the Triton kernels' configuration search on (default) or off. With it on, the first call of
    each problem class times the few candidate configurations of `moekit.ops.runtime.configs` (one host
    sync, once); off, every launch takes the first candidate: for runs that must not sync even on their
    first step. Without triton there is nothing to tune."""
    check_bool("enabled", enabled)
    runtime = triton_runtime()
    if runtime is not None:
        runtime.launch.set_autotune(enabled)


def triton_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why moekit's Triton kernels cannot run for `dtype` on `device`; None if they can."""
    runtime = triton_runtime()
    if runtime is None:
        return "triton cannot be imported (pip install triton)"
    return runtime.launch.unavailable_reason(device, dtype)


_BACKEND_OBJECTS: dict[str, GemmBackend] = {b.name: b for b in (LoopBackend(), TorchBackend(), TritonBackend())}


def backend_named(name: str) -> GemmBackend:
    """The backend of a resolved name (the custom ops of `moekit.ops.library` carry backends by name)."""
    return _BACKEND_OBJECTS[name]


def auto_order(x: torch.Tensor) -> tuple[str, ...]:
    """Backends "auto" tries, in order. On Hopper moekit's kernels are at least as fast as grouped_mm in
    every product (the benchmarks' results); on older GPUs they run an untuned pointer path, so
    grouped_mm comes first there. Where only one of torch/triton runs (fp16/fp32, odd dims on CUDA), it
    beats the loop, which also syncs."""
    if x.device.type == "cuda":
        if cuda_capability(x.device)[0] >= 9:
            return ("triton", "torch", "loop")
        return ("torch", "triton", "loop")
    return ("torch", "loop")


def select_backend(backend: str, x: torch.Tensor, w_NOI: torch.Tensor) -> GemmBackend:
    """Resolve a backend name for this input; ValueError saying why and what would work where an explicit
    one cannot run. Nothing falls back silently: "auto" is the only name that chooses."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        impl = _BACKEND_OBJECTS[backend]
        reason = impl.unavailable_reason(x, w_NOI)
        if reason is not None:
            usable = [n for n, b in _BACKEND_OBJECTS.items() if b.unavailable_reason(x, w_NOI) is None]
            raise ValueError(f"backend={backend!r} cannot run here: {reason}. Usable here: {usable}")
        return impl
    for name in auto_order(x):  # the first that runs (asking the others would cost host time)
        if _BACKEND_OBJECTS[name].unavailable_reason(x, w_NOI) is None:
            return _BACKEND_OBJECTS[name]
    return _BACKEND_OBJECTS["loop"]


# (backend class, capability Protocol) -> whether the class has it.
_CAPABILITIES: dict[tuple[type, type], bool] = {}


def _has(backend: GemmBackend, capability: type) -> bool:
    """isinstance(backend, capability), settled once per backend class: an isinstance check against a
    runtime-checkable Protocol looks up every member on every call (a layer's step asks dozens of
    times), while a backend's capabilities are its class's methods."""
    key = (type(backend), capability)
    has = _CAPABILITIES.get(key)
    if has is None:
        has = _CAPABILITIES[key] = isinstance(backend, capability)
    return has


def quantizer_of(backend: GemmBackend) -> GroupQuantizer | None:
    """The backend's GroupQuantizer capability, or None where it has none."""
    return cast(GroupQuantizer, backend) if _has(backend, GroupQuantizer) else None


def select_quantizer(backend: str, x: torch.Tensor) -> GemmBackend:
    """The backend that quantizes x for `backend` ("auto": the first of `auto_order(x)` that can: moekit's
    kernels on Hopper, plain torch elsewhere, as the GEMMs choose); ValueError saying why and what would
    work where an explicit one cannot."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")

    def reason(impl: GemmBackend) -> str | None:
        quantizer = quantizer_of(impl)
        return "it cannot quantize" if quantizer is None else quantizer.quantize_unavailable_reason(x)

    if backend != "auto":
        impl = _BACKEND_OBJECTS[backend]
        why = reason(impl)
        if why is not None:
            usable = [n for n, b in _BACKEND_OBJECTS.items() if reason(b) is None]
            raise ValueError(f"backend={backend!r} cannot quantize here: {why}. Usable here: {usable}")
        return impl
    for name in auto_order(x):
        if reason(_BACKEND_OBJECTS[name]) is None:
            return _BACKEND_OBJECTS[name]
    return _BACKEND_OBJECTS["loop"]


def quantized_gemm_of(backend: GemmBackend) -> QuantizedGemm | None:
    """The backend's QuantizedGemm capability (FP8 compute of the quantized paths), or None where it has
    none (the loop and torch backends: their quantized products take the reference path)."""
    return cast(QuantizedGemm, backend) if _has(backend, QuantizedGemm) else None


def quantized_gated_fc1_of(backend: GemmBackend) -> QuantizedGatedFc1 | None:
    """The backend's QuantizedGatedFc1 capability, or None where it has none."""
    return cast(QuantizedGatedFc1, backend) if _has(backend, QuantizedGatedFc1) else None


def fused_mlp_of(backend: GemmBackend) -> FusedMLP | None:
    """The backend's FusedMLP capability, or None where it has none."""
    return cast(FusedMLP, backend) if _has(backend, FusedMLP) else None


def use_triton_rows(backend: GemmBackend, x: torch.Tensor) -> bool:
    """Whether a layer on `backend` moves its rows with moekit's row kernel: wherever moekit's Triton
    kernels run, on CUDA whatever GEMM backend was chosen, and on the CPU (interpreter) when the Triton
    backend itself was chosen."""
    runs = triton_unavailable_reason(x.device, x.dtype) is None
    return runs and (isinstance(backend, TritonBackend) or x.device.type == "cuda")
