"""moekit's kernel launchers as `torch.library` custom ops (namespace `moekit`), for torch.compile.

Legend: M rows, N groups (experts), I/O a linear's in/out features, H hidden size, F ffn size,
R/J/D the row movement's output rows, rows summed per output row and features.

Every function that launches a kernel (a Triton kernel, `grouped_mm`, or the loop backend's per-group
matmuls) is one custom op here, with a fake implementation that gives its outputs' shapes and
dtypes. The autograd Functions of the ops (`_GroupedLinearFn`, the fused MLP's two nodes and the
fused layer's, `_MoveRowsFn`) call the launchers through the functions below, so torch.compile (dynamo, AOTAutograd)
traces those Functions and sees each launch as one opaque node: host-side work inside a launcher
(the loop backend reading device offsets, kernel config choice, Triton launches) stays out of the
graph, and the compiled program computes exactly what eager does.

Eager calls the same implementations directly: the dispatcher's path for a Python custom op costs
about 12 us of host time per call (measured on a CPU host), and `moe_experts` forward+backward
(torch backend, a small shape, CPU) took 1310 us per step through the ops against 865 us calling
the implementations (825 us before this module existed); small batches on the GPU are host-bound
and would pay that in full. Under torch.compile the ops are called (`torch.compiler.is_compiling()`),
and the compiled graph calls them as its nodes.

Group offsets travel as `offs` (N+1,) int64 on the rows' device plus `host_offs`, the same values
as a list when the host knows them (else None): `moekit._splits.GroupOffsets` flattened, since a
custom op takes tensors and plain values only. Custom ops must not return views of their inputs,
so every launcher here returns fresh tensors.
"""

from __future__ import annotations

import torch

from moekit._splits import GroupOffsets

_BACKEND_NAMES = ("loop", "torch", "triton")


def _offsets(offs: torch.Tensor, host_offs: list[int] | None, rows: int) -> GroupOffsets:
    return GroupOffsets(offs=offs, host=tuple(host_offs) if host_offs is not None else None, rows=rows)


_backends: dict = {}


def _backend(name: str):
    if not _backends:  # filled on first use: grouped_linear imports this module
        from moekit.ops.grouped_linear import _BACKENDS

        _backends.update(_BACKENDS)
    return _backends[name]


# --------------------------------------------------------------------------------------------------
# Grouped linear products (any backend)
# --------------------------------------------------------------------------------------------------


def _linear_forward_impl(
    backend: str,
    x_MI: torch.Tensor,
    w_NOI: torch.Tensor,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    bias_NO: torch.Tensor | None,
    bias_scale_M: torch.Tensor | None,
) -> torch.Tensor:
    return _backend(backend).forward(x_MI, w_NOI, _offsets(offs, host_offs, x_MI.shape[0]), bias_NO, bias_scale_M)


def _linear_dgrad_impl(
    backend: str, dy_MO: torch.Tensor, w_NOI: torch.Tensor, offs: torch.Tensor, host_offs: list[int] | None
) -> torch.Tensor:
    return _backend(backend).dgrad(dy_MO, w_NOI, _offsets(offs, host_offs, dy_MO.shape[0]))


def _linear_wgrad_impl(
    backend: str, dy_MO: torch.Tensor, x_MI: torch.Tensor, offs: torch.Tensor, host_offs: list[int] | None
) -> torch.Tensor:
    go = _offsets(offs, host_offs, dy_MO.shape[0])
    return _backend(backend).wgrad(dy_MO, x_MI, go, go.num_groups)


def _linear_dbias_impl(
    backend: str,
    dy_MO: torch.Tensor,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    bias_scale_M: torch.Tensor | None,
) -> torch.Tensor:
    go = _offsets(offs, host_offs, dy_MO.shape[0])
    return _backend(backend).dbias(dy_MO, go, go.num_groups, bias_scale_M)


def _padding_zeroed_impl(t_MC: torch.Tensor, offs: torch.Tensor, host_offs: list[int] | None) -> torch.Tensor:
    from moekit.ops.grouped_linear import _zero_padding_rows

    return _zero_padding_rows(t_MC.clone(), _offsets(offs, host_offs, t_MC.shape[0]))


_linear_forward_op = torch.library.custom_op("moekit::grouped_linear_forward", _linear_forward_impl, mutates_args=())
_linear_dgrad_op = torch.library.custom_op("moekit::grouped_linear_dgrad", _linear_dgrad_impl, mutates_args=())
_linear_wgrad_op = torch.library.custom_op("moekit::grouped_linear_wgrad", _linear_wgrad_impl, mutates_args=())
_linear_dbias_op = torch.library.custom_op("moekit::grouped_linear_dbias", _linear_dbias_impl, mutates_args=())
_padding_zeroed_op = torch.library.custom_op("moekit::padding_zeroed", _padding_zeroed_impl, mutates_args=())


@_linear_forward_op.register_fake
def _(backend, x_MI, w_NOI, offs, host_offs, bias_NO, bias_scale_M):
    return x_MI.new_empty(x_MI.shape[0], w_NOI.shape[1])


@_linear_dgrad_op.register_fake
def _(backend, dy_MO, w_NOI, offs, host_offs):
    return dy_MO.new_empty(dy_MO.shape[0], w_NOI.shape[2])


@_linear_wgrad_op.register_fake
def _(backend, dy_MO, x_MI, offs, host_offs):
    return dy_MO.new_empty(offs.shape[0] - 1, dy_MO.shape[1], x_MI.shape[1])


@_linear_dbias_op.register_fake
def _(backend, dy_MO, offs, host_offs, bias_scale_M):
    return dy_MO.new_empty(offs.shape[0] - 1, dy_MO.shape[1])


@_padding_zeroed_op.register_fake
def _(t_MC, offs, host_offs):
    return torch.empty_like(t_MC, memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------------------------------
# The fused MLP's kernels (triton backend)
# --------------------------------------------------------------------------------------------------


def _glu_forward_impl(
    x_MH: torch.Tensor,
    w1_N2FH: torch.Tensor,
    offs: torch.Tensor,
    bias_N2F: torch.Tensor | None,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    from moekit.ops.grouped_mlp import glu_forward

    return glu_forward(x_MH, w1_N2FH, offs, bias_N2F, probs_M, glu_interleave_size, activation)


def _glu_backward_impl(
    dy_MH: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    offs: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh, act_p, dprobs): dprobs is (M,) fp32, or (0,) without probs (an op returns tensors)."""
    from moekit.ops.grouped_mlp import glu_backward

    dh, act_p, dprobs = glu_backward(dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation)
    return dh, act_p, (dprobs if dprobs is not None else dy_MH.new_empty(0, dtype=torch.float32))


def _gemm_forward_impl(
    x_MI: torch.Tensor,
    w_NOI: torch.Tensor,
    offs: torch.Tensor,
    bias_NO: torch.Tensor | None,
    bias_scale_M: torch.Tensor | None,
) -> torch.Tensor:
    from moekit.ops.grouped_gemm import grouped_gemm_forward

    return grouped_gemm_forward(x_MI, w_NOI, offs, bias_NO, bias_scale_M)


def _gemm_dgrad_impl(dy_MO: torch.Tensor, w_NOI: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    from moekit.ops.grouped_gemm import grouped_gemm_dgrad

    return grouped_gemm_dgrad(dy_MO, w_NOI, offs)


def _gemm_wgrad_impl(dy_MO: torch.Tensor, x_MI: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    from moekit.ops.grouped_gemm import grouped_gemm_wgrad

    return grouped_gemm_wgrad(dy_MO, x_MI, offs)


def _row_sum_impl(src_MC: torch.Tensor, offs: torch.Tensor, row_scale_M: torch.Tensor | None) -> torch.Tensor:
    from moekit.ops.grouped_gemm import group_row_sum

    return group_row_sum(src_MC, offs, row_scale_M)


def _row_sum_and_dot_impl(
    src_MC: torch.Tensor, offs: torch.Tensor, vec_NC: torch.Tensor, row_scale_M: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from moekit.ops.grouped_gemm import group_row_sum_and_dot

    return group_row_sum_and_dot(src_MC, offs, vec_NC, row_scale_M)


_glu_forward_op = torch.library.custom_op("moekit::glu_forward", _glu_forward_impl, mutates_args=())
_glu_backward_op = torch.library.custom_op("moekit::glu_backward", _glu_backward_impl, mutates_args=())
_gemm_forward_op = torch.library.custom_op("moekit::grouped_gemm_forward", _gemm_forward_impl, mutates_args=())
_gemm_dgrad_op = torch.library.custom_op("moekit::grouped_gemm_dgrad", _gemm_dgrad_impl, mutates_args=())
_gemm_wgrad_op = torch.library.custom_op("moekit::grouped_gemm_wgrad", _gemm_wgrad_impl, mutates_args=())
_row_sum_op = torch.library.custom_op("moekit::group_row_sum", _row_sum_impl, mutates_args=())
_row_sum_and_dot_op = torch.library.custom_op("moekit::group_row_sum_and_dot", _row_sum_and_dot_impl, mutates_args=())


@_glu_forward_op.register_fake
def _(x_MH, w1_N2FH, offs, bias_N2F, probs_M, glu_interleave_size, activation):
    two_f = w1_N2FH.shape[1]
    return x_MH.new_empty(x_MH.shape[0], two_f), x_MH.new_empty(x_MH.shape[0], two_f // 2)


@_glu_backward_op.register_fake
def _(dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation):
    rows, ffn = dy_MH.shape[0], w2_NHF.shape[2]
    dprobs = dy_MH.new_empty(rows if probs_M is not None else 0, dtype=torch.float32)
    return dy_MH.new_empty(rows, 2 * ffn), dy_MH.new_empty(rows, ffn), dprobs


@_gemm_forward_op.register_fake
def _(x_MI, w_NOI, offs, bias_NO, bias_scale_M):
    return x_MI.new_empty(x_MI.shape[0], w_NOI.shape[1])


@_gemm_dgrad_op.register_fake
def _(dy_MO, w_NOI, offs):
    return dy_MO.new_empty(dy_MO.shape[0], w_NOI.shape[2])


@_gemm_wgrad_op.register_fake
def _(dy_MO, x_MI, offs):
    return dy_MO.new_empty(offs.shape[0] - 1, dy_MO.shape[1], x_MI.shape[1])


@_row_sum_op.register_fake
def _(src_MC, offs, row_scale_M):
    return src_MC.new_empty(offs.shape[0] - 1, src_MC.shape[1])


@_row_sum_and_dot_op.register_fake
def _(src_MC, offs, vec_NC, row_scale_M):
    return src_MC.new_empty(offs.shape[0] - 1, src_MC.shape[1]), src_MC.new_empty(src_MC.shape[0], dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Row movement (moe_experts)
# --------------------------------------------------------------------------------------------------


def _sum_rows_impl(src_SD: torch.Tensor, index_RJ: torch.Tensor, use_triton: bool) -> torch.Tensor:
    from moekit.ops.moe_experts import _sum_rows

    return _sum_rows(src_SD, index_RJ, use_triton)


_sum_rows_op = torch.library.custom_op("moekit::sum_rows", _sum_rows_impl, mutates_args=())


@_sum_rows_op.register_fake
def _(src_SD, index_RJ, use_triton):
    return src_SD.new_empty(index_RJ.shape[0], src_SD.shape[1])


# --------------------------------------------------------------------------------------------------
# The entry points the autograd Functions call
# --------------------------------------------------------------------------------------------------


# Each entry point calls the registered op while torch.compile traces, the implementation itself in
# eager (see the module docstring for why).


def grouped_linear_forward(backend, x_MI, w_NOI, offs, host_offs, bias_NO, bias_scale_M):
    """(M, O) = grouped linear of x (M, I) with w (N, O, I) (+ bias (N, O) (* bias_scale (M,)))."""
    fn = _linear_forward_op if torch.compiler.is_compiling() else _linear_forward_impl
    return fn(backend, x_MI, w_NOI, offs, host_offs, bias_NO, bias_scale_M)


def grouped_linear_dgrad(backend, dy_MO, w_NOI, offs, host_offs):
    """(M, I) = dy (M, O) through w (N, O, I), per group."""
    fn = _linear_dgrad_op if torch.compiler.is_compiling() else _linear_dgrad_impl
    return fn(backend, dy_MO, w_NOI, offs, host_offs)


def grouped_linear_wgrad(backend, dy_MO, x_MI, offs, host_offs):
    """(N, O, I) per-group dy^T x."""
    fn = _linear_wgrad_op if torch.compiler.is_compiling() else _linear_wgrad_impl
    return fn(backend, dy_MO, x_MI, offs, host_offs)


def grouped_linear_dbias(backend, dy_MO, offs, host_offs, bias_scale_M):
    """(N, O) per-group sums of dy's rows (* bias_scale); dy's padding rows must be zero."""
    fn = _linear_dbias_op if torch.compiler.is_compiling() else _linear_dbias_impl
    return fn(backend, dy_MO, offs, host_offs, bias_scale_M)


def without_padding(t_MC, offs, host_offs):
    """t with its padding rows (past the last offset) zeroed: t itself in eager where the host
    knows there are none, else a copy."""
    if torch.compiler.is_compiling():
        return _padding_zeroed_op(t_MC, offs, host_offs)
    from moekit.ops.grouped_linear import _without_padding

    return _without_padding(t_MC, _offsets(offs, host_offs, t_MC.shape[0]))


def glu_forward(x_MH, w1_N2FH, offs, bias_N2F, probs_M, glu_interleave_size, activation):
    """`moekit.ops.grouped_mlp.glu_forward` (h (M, 2F), act (M, F)) as a custom op."""
    fn = _glu_forward_op if torch.compiler.is_compiling() else _glu_forward_impl
    return fn(x_MH, w1_N2FH, offs, bias_N2F, probs_M, glu_interleave_size, activation)


def glu_backward(dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation):
    """`moekit.ops.grouped_mlp.glu_backward`: (dh (M, 2F), act_p (M, F), dprobs (M,) fp32 or None)."""
    fn = _glu_backward_op if torch.compiler.is_compiling() else _glu_backward_impl
    dh, act_p, dprobs = fn(dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation)
    return dh, act_p, (dprobs if probs_M is not None else None)


def grouped_gemm_forward(x_MI, w_NOI, offs, bias_NO=None, bias_scale_M=None):
    fn = _gemm_forward_op if torch.compiler.is_compiling() else _gemm_forward_impl
    return fn(x_MI, w_NOI, offs, bias_NO, bias_scale_M)


def grouped_gemm_dgrad(dy_MO, w_NOI, offs):
    fn = _gemm_dgrad_op if torch.compiler.is_compiling() else _gemm_dgrad_impl
    return fn(dy_MO, w_NOI, offs)


def grouped_gemm_wgrad(dy_MO, x_MI, offs):
    fn = _gemm_wgrad_op if torch.compiler.is_compiling() else _gemm_wgrad_impl
    return fn(dy_MO, x_MI, offs)


def group_row_sum(src_MC, offs, row_scale_M=None):
    fn = _row_sum_op if torch.compiler.is_compiling() else _row_sum_impl
    return fn(src_MC, offs, row_scale_M)


def group_row_sum_and_dot(src_MC, offs, vec_NC, row_scale_M):
    fn = _row_sum_and_dot_op if torch.compiler.is_compiling() else _row_sum_and_dot_impl
    return fn(src_MC, offs, vec_NC, row_scale_M)


def sum_rows(src_SD, index_RJ, use_triton):
    """(R, D): row r is the sum of src's rows index[r, 0..J-1] (`moe_experts._sum_rows`)."""
    fn = _sum_rows_op if torch.compiler.is_compiling() else _sum_rows_impl
    return fn(src_SD, index_RJ, use_triton)
