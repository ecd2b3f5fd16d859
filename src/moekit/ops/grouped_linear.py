"""Grouped linear: `y_i = x_i W_i^T + b_i` over rows sorted by group.

Legend: M rows, N groups, I in_features, O out_features.

One autograd Function serves every backend; a backend supplies the three products (forward, dgrad,
wgrad) and the bias reduction. Weights arrive as one `(N, O, I)` tensor or as N `(O, I)` tensors;
N separate tensors that are adjacent slices of one buffer (what `GroupedLinear` keeps) are viewed
as `(N, O, I)` without a copy.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from moekit._device import cuda_capability
from moekit._splits import GroupOffsets, MSplits, compute_dtype, resolve_splits
from moekit.ops import library

BACKENDS = ("auto", "loop", "torch", "triton")

Weight = torch.Tensor | Sequence[torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------


class _LoopBackend:
    """Per-group matmuls: the reference schedule; any device and dtype. Reads device offsets on
    the host (a sync), which is why it is never what `auto` picks on CUDA when another can run."""

    name = "loop"

    def unavailable_reason(self, x: torch.Tensor, w_NOI: torch.Tensor) -> str | None:
        return None

    def forward(self, x_MI, w_NOI, go: GroupOffsets, bias_NO, bias_scale_M):
        offs = go.host_offsets()
        y_MO = x_MI.new_zeros(x_MI.shape[0], w_NOI.shape[1])
        for g in range(w_NOI.shape[0]):
            lo, hi = offs[g], offs[g + 1]
            if hi == lo:
                continue
            acc = x_MI[lo:hi] @ w_NOI[g].t()
            if bias_NO is not None:
                acc_t = compute_dtype(x_MI, bias_scale_M)
                b = bias_NO[g].to(acc_t)
                acc = acc.to(acc_t) + (b * bias_scale_M[lo:hi, None].to(acc_t) if bias_scale_M is not None else b)
            y_MO[lo:hi] = acc.to(y_MO.dtype)
        return y_MO

    def dgrad(self, dy_MO, w_NOI, go: GroupOffsets):
        offs = go.host_offsets()
        dx_MI = dy_MO.new_zeros(dy_MO.shape[0], w_NOI.shape[2])
        for g in range(w_NOI.shape[0]):
            lo, hi = offs[g], offs[g + 1]
            if hi > lo:
                dx_MI[lo:hi] = dy_MO[lo:hi] @ w_NOI[g]
        return dx_MI

    def wgrad(self, dy_MO, x_MI, go: GroupOffsets, num_groups: int):
        offs = go.host_offsets()
        dw_NOI = dy_MO.new_zeros(num_groups, dy_MO.shape[1], x_MI.shape[1])
        for g in range(num_groups):
            lo, hi = offs[g], offs[g + 1]
            if hi > lo:
                dw_NOI[g] = dy_MO[lo:hi].t() @ x_MI[lo:hi]
        return dw_NOI

    def dbias(self, dy_MO, go: GroupOffsets, num_groups: int, bias_scale_M):
        offs = go.host_offsets()
        acc_t = compute_dtype(dy_MO, bias_scale_M)
        src = dy_MO.to(acc_t) if bias_scale_M is None else dy_MO.to(acc_t) * bias_scale_M[:, None].to(acc_t)
        db = torch.zeros(num_groups, dy_MO.shape[1], dtype=acc_t, device=dy_MO.device)
        for g in range(num_groups):
            lo, hi = offs[g], offs[g + 1]
            if hi > lo:
                db[g] = src[lo:hi].sum(0)
        return db.to(dy_MO.dtype)


class _TorchBackend:
    """torch's grouped GEMM (`torch.nn.functional.grouped_mm`); device offsets stay on the device."""

    name = "torch"

    def unavailable_reason(self, x: torch.Tensor, w_NOI: torch.Tensor) -> str | None:
        grouped_mm = _torch_grouped_mm()
        if grouped_mm is None:
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
        # grouped_mm requires 16-byte aligned row strides for every operand it touches.
        align = 16 // x.element_size()
        bad = [n for n, d in (("in_features", x.shape[1]), ("out_features", w_NOI.shape[1])) if d % align]
        if bad:
            return (
                f"torch's grouped_mm needs {', '.join(bad)} to be a multiple of {align} for {x.dtype} "
                f"(got in={x.shape[1]}, out={w_NOI.shape[1]}); use backend='loop' or 'triton'"
            )
        return None

    def forward(self, x_MI, w_NOI, go: GroupOffsets, bias_NO, bias_scale_M):
        ends = go.offs[1:].to(torch.int32)
        y_MO = _torch_grouped_mm()(x_MI, w_NOI.transpose(-2, -1), offs=ends)
        if bias_NO is not None:
            y_MO = _add_group_bias(y_MO, bias_NO, go, bias_scale_M)
        return _zero_padding_rows(y_MO, go)

    def dgrad(self, dy_MO, w_NOI, go: GroupOffsets):
        ends = go.offs[1:].to(torch.int32)
        return _zero_padding_rows(_torch_grouped_mm()(dy_MO, w_NOI, offs=ends), go)

    def wgrad(self, dy_MO, x_MI, go: GroupOffsets, num_groups: int):
        ends = go.offs[1:].to(torch.int32)
        return _torch_grouped_mm()(dy_MO.t(), x_MI, offs=ends)

    def dbias(self, dy_MO, go: GroupOffsets, num_groups: int, bias_scale_M):
        return _group_sum(dy_MO, go, num_groups, bias_scale_M)


class _TritonBackend:
    """moekit's own Triton grouped GEMM (`moekit.ops.grouped_gemm`)."""

    name = "triton"

    def unavailable_reason(self, x: torch.Tensor, w_NOI: torch.Tensor) -> str | None:
        try:
            from moekit.ops import grouped_gemm
        except ImportError as exc:
            return f"the Triton kernels could not be imported ({exc})"
        return grouped_gemm.triton_unavailable_reason(x.device, x.dtype)

    def forward(self, x_MI, w_NOI, go: GroupOffsets, bias_NO, bias_scale_M):
        from moekit.ops.grouped_gemm import grouped_gemm_forward

        return grouped_gemm_forward(x_MI, w_NOI, go.offs, bias_NO, bias_scale_M)

    def dgrad(self, dy_MO, w_NOI, go: GroupOffsets):
        from moekit.ops.grouped_gemm import grouped_gemm_dgrad

        return grouped_gemm_dgrad(dy_MO, w_NOI, go.offs)

    def wgrad(self, dy_MO, x_MI, go: GroupOffsets, num_groups: int):
        from moekit.ops.grouped_gemm import grouped_gemm_wgrad

        return grouped_gemm_wgrad(dy_MO, x_MI, go.offs)

    def dbias(self, dy_MO, go: GroupOffsets, num_groups: int, bias_scale_M):
        from moekit.ops.grouped_gemm import group_row_sum

        return group_row_sum(dy_MO, go.offs, bias_scale_M)


_BACKENDS = {b.name: b for b in (_LoopBackend(), _TorchBackend(), _TritonBackend())}


def _torch_grouped_mm():
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def _zero_padding_rows(t: torch.Tensor, go: GroupOffsets) -> torch.Tensor:
    """Zero rows past the last offset in place (grouped_mm leaves them unwritten; the contract says
    zeros), at the cost of the padding rows, not of the whole tensor: a slice where the host knows
    the last offset; on CUDA a kernel that reads it on the device (no host sync)."""
    if go.host is not None:
        if go.host[-1] < go.rows:
            t[go.host[-1] :] = 0
        return t
    if t.device.type == "cuda" and t.stride(-1) == 1 and _zero_rows_from(t, go.offs[-1:]):
        return t
    # Offsets the host was not given off CUDA (only tests build those on the CPU), or no Triton:
    # a masked pass over the whole tensor, still without reading the offsets on the host.
    rows = torch.arange(go.rows, device=t.device)
    return t.masked_fill_((rows >= go.offs[-1])[:, None], 0)


_ZERO_BLOCK_ROWS, _ZERO_BLOCK_COLS = 64, 128


def _zero_rows_from(t: torch.Tensor, end: torch.Tensor) -> bool:
    """Launch `zero_rows_from_kernel`: rows [end, M) of t (M, columns), unit column stride, become
    zeros; `end` is (1,) int64 on t's device and never read on the host. False (nothing done)
    where Triton cannot be imported."""
    try:
        from moekit.ops.grouped_linear_kernels import zero_rows_from_kernel
    except ImportError:
        return False
    rows, cols = t.shape
    if rows:
        grid = (-(-rows // _ZERO_BLOCK_ROWS),)
        zero_rows_from_kernel[grid](
            t, end, rows, cols, t.stride(0), BLOCK_ROWS=_ZERO_BLOCK_ROWS, BLOCK_COLS=_ZERO_BLOCK_COLS
        )
    return True


def _without_padding(t: torch.Tensor, go: GroupOffsets) -> torch.Tensor:
    """t itself where the host knows there are no padding rows, else a copy with them zeroed."""
    if go.host is not None and go.host[-1] == go.rows:
        return t
    return _zero_padding_rows(t.clone(), go)


def _group_onehot(go: GroupOffsets, num_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """(N, M) 0/1 matrix of group membership; padding rows belong to no group."""
    groups = torch.arange(num_groups, device=go.offs.device)
    return (go.row_group()[None, :] == groups[:, None]).to(dtype)


def _group_sum(dy_MO, go: GroupOffsets, num_groups: int, scale_M) -> torch.Tensor:
    """Per-group row sums as a (N, M) x (M, O) product: deterministic (no atomics), no sync."""
    acc_t = compute_dtype(dy_MO, scale_M)
    src = dy_MO.to(acc_t) if scale_M is None else dy_MO.to(acc_t) * scale_M[:, None].to(acc_t)
    return (_group_onehot(go, num_groups, acc_t) @ src).to(dy_MO.dtype)


def _bias_rows(bias_NO, go: GroupOffsets, dtype: torch.dtype) -> torch.Tensor:
    """(M, O): the bias of every row's group in `dtype`; zeros for padding rows."""
    zero_row = bias_NO.new_zeros(1, bias_NO.shape[1])
    return torch.cat([bias_NO, zero_row]).to(dtype)[go.row_group()]


def _add_group_bias(y_MO, bias_NO, go: GroupOffsets, bias_scale_M):
    """y += bias[group(row)] (* scale[row]), math in fp32, one rounding."""
    acc_t = compute_dtype(y_MO, bias_scale_M)
    bias_MO = _bias_rows(bias_NO, go, acc_t)
    if bias_scale_M is not None:
        bias_MO = bias_MO * bias_scale_M[:, None].to(acc_t)
    return (y_MO.to(acc_t) + bias_MO).to(y_MO.dtype)


# --------------------------------------------------------------------------------------------------
# Weight packing
# --------------------------------------------------------------------------------------------------


def packed_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """View N same-shaped contiguous tensors as one (N, ...) tensor when they are adjacent slices of
    one storage (in order); None when they are not."""
    first = tensors[0]
    if not first.is_contiguous():
        return None
    numel = first.numel()
    base = first.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (
            t.shape != first.shape
            or t.dtype != first.dtype
            or t.device != first.device
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != base
            or t.storage_offset() != first.storage_offset() + i * numel
        ):
            return None
    return first.as_strided((len(tensors), *first.shape), (numel, *first.stride()), first.storage_offset())


# Marks a first expert tensor whose set was already warned about. An attribute on the tensor itself
# dies with it; a set of id()s would outlive the tensors and, once an id is reused by a new module's
# parameter, silence that module's warning.
_WARNED_ATTR = "_moekit_warned_unpacked"


def _stack_weights(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # A traced graph cannot look at storage addresses: it stacks (a copy of all experts).
        return torch.stack(list(tensors))
    view = packed_view(tensors)
    if view is not None:
        return view
    # Not silent: a wrapper (FSDP2, a manual `.data =`) split the expert weights apart; results are
    # still right but every call now pays a copy of all experts' weights.
    if not getattr(tensors[0], _WARNED_ATTR, False):
        setattr(tensors[0], _WARNED_ATTR, True)
        warnings.warn(
            f"moekit: the {len(tensors)} per-expert {what} tensors are not adjacent slices of one buffer; "
            "each call stacks them (a copy of all experts). GroupedLinear repacks on .to()/.cuda(); use "
            "single_grouped_weight=True to avoid this entirely.",
            stacklevel=4,
        )
    return torch.stack(list(tensors))


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with dense row-major strides. `.contiguous()` alone is not enough: a tensor with no
    elements counts as contiguous whatever its strides, e.g. the zero strides of the expanded
    gradient of `y.sum()` when there are no rows, and grouped_mm rejects those strides."""
    if t.numel() == 0:
        return t.clone(memory_format=torch.contiguous_format)  # differentiable, and dense strides
    return t.contiguous()


class _GroupedLinearFn(torch.autograd.Function):
    """Inputs after the fixed ones: n_w weight tensors then n_b bias tensors (n_w, n_b in {0, 1, N});
    one (N, O, I) weight / (N, O) bias, or N per-group tensors (also when N = 1)."""

    @staticmethod
    def forward(ctx, backend, offs, host_offs, bias_scale_M, n_w, n_b, x_MI, *params):
        weights, biases = params[:n_w], params[n_w:]
        w_NOI = weights[0] if weights[0].dim() == 3 else _stack_weights(weights, "weight")
        bias_NO = None
        if n_b:
            bias_NO = biases[0] if biases[0].dim() == 2 else _stack_weights(biases, "bias")
        ctx.grouped_b = bool(n_b) and biases[0].dim() == 2
        y_MO = library.grouped_linear_forward(backend, x_MI, w_NOI, offs, host_offs, bias_NO, bias_scale_M)
        ctx.backend, ctx.host_offs, ctx.n_w, ctx.n_b = backend, host_offs, n_w, n_b
        ctx.save_for_backward(x_MI, offs, bias_scale_M, bias_NO, *weights)
        return y_MO

    @staticmethod
    def backward(ctx, dy_MO):
        x_MI, offs, bias_scale_M, bias_NO, *weights = ctx.saved_tensors
        backend, host_offs, n_w, n_b = ctx.backend, ctx.host_offs, ctx.n_w, ctx.n_b
        w_NOI = weights[0] if weights[0].dim() == 3 else _stack_weights(weights, "weight")
        dy_MO = _row_major(dy_MO)
        dx = dw = db = dscale = None
        # The GEMMs never read padding rows of dy; the bias reductions would (0 * inf = nan), so
        # they get a copy with those rows zeroed: padding rows receive zero gradient whatever dy holds.
        dy_bias_MO = library.without_padding(dy_MO, offs, host_offs) if n_b else None
        # forward's inputs: backend, offs, host_offs, bias_scale, n_w, n_b, x, *params
        if ctx.needs_input_grad[6]:
            dx = library.grouped_linear_dgrad(backend, dy_MO, w_NOI, offs, host_offs)
        if any(ctx.needs_input_grad[7 : 7 + n_w]):
            dw = library.grouped_linear_wgrad(backend, dy_MO, x_MI, offs, host_offs)
        if n_b and any(ctx.needs_input_grad[7 + n_w :]):
            db = library.grouped_linear_dbias(backend, dy_bias_MO, offs, host_offs, bias_scale_M)
        if bias_scale_M is not None and ctx.needs_input_grad[3]:
            acc_t = compute_dtype(dy_MO, bias_scale_M)
            go = GroupOffsets(offs=offs, host=tuple(host_offs) if host_offs is not None else None, rows=dy_MO.shape[0])
            bias_MO = _bias_rows(bias_NO, go, acc_t)
            dscale = (dy_bias_MO.to(acc_t) * bias_MO).sum(-1).to(bias_scale_M.dtype)
        dws = (dw,) if weights[0].dim() == 3 else (tuple(dw.unbind(0)) if dw is not None else (None,) * n_w)
        dbs = (
            () if not n_b else ((db,) if ctx.grouped_b else (tuple(db.unbind(0)) if db is not None else (None,) * n_b))
        )
        return (None, None, None, dscale, None, None, dx, *dws, *dbs)


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def _as_list(t: Weight | None) -> list[torch.Tensor]:
    if t is None:
        return []
    if isinstance(t, torch.Tensor):
        return [t]
    return list(t)


def _check_params(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> tuple[int, int]:
    """Validate weight/bias shapes against x; return (num_groups, out_features)."""
    if not weights:
        raise ValueError("weight must be a (N, out, in) tensor or a non-empty list of N (out, in) tensors")
    if len(weights) == 1 and weights[0].dim() == 3:
        num_groups, out_f, in_f = weights[0].shape
    else:
        shapes = {tuple(w.shape) for w in weights}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"per-group weights must all be 2-D (out, in) of one shape; got {sorted(shapes)}")
        num_groups = len(weights)
        out_f, in_f = weights[0].shape
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, in_features), got shape {tuple(x.shape)}")
    if x.shape[1] != in_f:
        raise ValueError(f"x has {x.shape[1]} features in its last dimension; the weights expect in_features={in_f}")
    for w in weights:
        if w.dtype != x.dtype:
            raise TypeError(f"input dtype {x.dtype} differs from weight dtype {w.dtype}; cast one to match")
        if w.device != x.device:
            raise ValueError(f"input is on {x.device} but a weight is on {w.device}")
    if biases:
        if len(biases) == 1 and biases[0].dim() == 2:
            if tuple(biases[0].shape) != (num_groups, out_f):
                raise ValueError(f"bias has shape {tuple(biases[0].shape)}; expected ({num_groups}, {out_f})")
        elif len(biases) != num_groups or any(tuple(b.shape) != (out_f,) for b in biases):
            raise ValueError(
                f"bias must be a ({num_groups}, {out_f}) tensor or {num_groups} tensors of shape ({out_f},); got "
                f"{[tuple(b.shape) for b in biases]}"
            )
        for b in biases:
            if b.dtype != x.dtype:
                raise TypeError(f"input dtype {x.dtype} differs from bias dtype {b.dtype}; cast one to match")
            if b.device != x.device:
                raise ValueError(f"input is on {x.device} but a bias is on {b.device}")
    return num_groups, out_f


def _probe_weight(weights: list[torch.Tensor]) -> torch.Tensor:
    """A (N, O, I)-shaped stand-in (no copy) used only for capability checks."""
    w = weights[0]
    return w if w.dim() == 3 else w.unsqueeze(0).expand(len(weights), *w.shape)


def select_backend(backend: str, x: torch.Tensor, w_NOI: torch.Tensor):
    """Resolve a backend name for this input, raising ValueError if an explicit one cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        impl = _BACKENDS[backend]
        reason = impl.unavailable_reason(x, w_NOI)
        if reason is not None:
            usable = [n for n, b in _BACKENDS.items() if b.unavailable_reason(x, w_NOI) is None]
            raise ValueError(f"backend={backend!r} cannot run here: {reason}. Usable here: {usable}")
        return impl
    for name in _auto_order(x):  # the first that runs (asking the others would cost host time)
        if _BACKENDS[name].unavailable_reason(x, w_NOI) is None:
            return _BACKENDS[name]
    return _BACKENDS["loop"]


def _auto_order(x: torch.Tensor) -> tuple[str, ...]:
    """Backends `auto` tries, in order. On Hopper moekit's kernels were measured at least as fast
    as grouped_mm in every product (H200, bf16, the README's Performance shapes; benchmarks/results);
    on older GPUs they run an untuned pointer path, so grouped_mm comes first there. Where only
    one of torch/triton runs (fp16/fp32, odd dims on CUDA), it beats the loop, which also syncs."""
    if x.device.type == "cuda":
        if cuda_capability(x.device)[0] >= 9:
            return ("triton", "torch", "loop")
        return ("torch", "triton", "loop")
    return ("torch", "loop")


def grouped_linear(
    x: torch.Tensor,
    weight: Weight,
    m_splits: MSplits | GroupOffsets,
    bias: Weight | None = None,
    *,
    backend: str = "auto",
    bias_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped linear over rows sorted by group.

    x: (M, I). weight: (N, O, I) or N tensors (O, I). m_splits: (N,) rows per group (list, CPU tensor
    or device tensor); rows past sum(m_splits) are padding and give zeros. bias: (N, O), N tensors
    (O,), or None. bias_scale: optional (M,) per-row factor on the bias (router probabilities).
    Returns (M, O) in x's dtype.
    """
    weights, biases = _as_list(weight), _as_list(bias)
    num_groups, _ = _check_params(x, weights, biases)
    go = resolve_splits(m_splits, num_groups, x.shape[0], x.device)
    impl = select_backend(backend, x, _probe_weight(weights))
    if bias_scale is not None:
        if not biases:
            raise ValueError("bias_scale scales the bias; it needs a bias")
        if bias_scale.shape not in ((x.shape[0],), (x.shape[0], 1)):
            raise ValueError(f"bias_scale must have shape ({x.shape[0]},), got {tuple(bias_scale.shape)}")
        bias_scale = bias_scale.reshape(-1)
    x = _row_major(x)
    host_offs = list(go.host) if go.host is not None else None
    return _GroupedLinearFn.apply(
        impl.name, go.offs, host_offs, bias_scale, len(weights), len(biases), x, *weights, *biases
    )


def grouped_linear_reference(
    x: torch.Tensor,
    weight: Weight,
    m_splits: MSplits,
    bias: Weight | None = None,
    *,
    backend: str = "auto",
    bias_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 reference of `grouped_linear`, differentiable by autograd; returns float64."""
    del backend
    weights = [w.double() for w in _as_list(weight)]
    w_list = list(weights[0].unbind(0)) if len(weights) == 1 and weights[0].dim() == 3 else weights
    biases = [b.double() for b in _as_list(bias)]
    b_list = list(biases[0].unbind(0)) if len(biases) == 1 and biases[0].dim() == 2 else biases
    go = resolve_splits(
        m_splits,
        len(w_list),
        x.shape[0],
        torch.device("cpu") if not isinstance(m_splits, torch.Tensor) else m_splits.device,
    )
    offs = go.host_offsets()
    x64 = x.double()
    rows = []
    for g, w in enumerate(w_list):
        y = x64[offs[g] : offs[g + 1]] @ w.t()
        if b_list:
            s = 1.0 if bias_scale is None else bias_scale.reshape(-1)[offs[g] : offs[g + 1], None].double()
            y = y + b_list[g] * s
        rows.append(y)
    rows.append(x64.new_zeros(x.shape[0] - offs[-1], w_list[0].shape[0]))
    return torch.cat(rows)
