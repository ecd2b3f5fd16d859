"""GroupedLinear: N linears applied to rows sorted by group, in either parameter layout.

Legend: N groups, O out_features, I in_features.

Layouts (independent for weight and bias):
- single grouped: one `weight (N, O, I)` / `bias (N, O)` nn.Parameter;
- discrete: `weight0..weight{N-1}` `(O, I)` / `bias0..` `(O,)`, TransformerEngine's names. They are
  views of one packed buffer, so a forward passes them to the kernels without copying.

`load_state_dict` accepts either layout (and a packed `(N*O, I)` weight) whatever the module's own.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from moekit.checkpoint.layout import collect_grouped, convert_glu_on_load, place_grouped
from moekit.checkpoint.metadata import EXTRA_STATE_SUFFIX, glu_order_of_extra_state, linear_extra_state
from moekit.grouped_tensor import GroupedTensor
from moekit.nn.shapes import check_last_dim, rows_as
from moekit.ops.grouped_linear import BACKENDS, grouped_linear, packed_view
from moekit.ops.quantize import QuantizedWeightCache, check_quantization
from moekit.ops.splits import MSplits
from moekit.validation import check_bool, check_choice, check_compute_dtype, check_positive_int


class GroupedLinear(nn.Module):
    """N linear layers `in_features -> out_features`, one per group of rows.

    forward(inp (..., I), m_splits (N,)) -> (..., O); rows past sum(m_splits) give zeros.

    quantization: None, "fp8_block", "fp8_rowwise" or "mxfp8": the products on quantized operands
    (`moekit.grouped_linear`'s: forward and dgrad on FP8 kernels where the backend has them, else the
    reference path: quantize, dequantize, compute in the module's dtype). The parameters stay in the
    module's dtype (master weights; the state dict is the same with or without quantization); the
    quantized weight is kept in `weight_cache` and made again, in place, only when the weight changed
    (the optimizer's step): once per step. quantized_wgrad (with quantization): as `moekit.grouped_linear`'s
    (False: the weight gradient from the unquantized operands in the module's dtype).
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        quantization: str | None = None,
        quantized_wgrad: bool = True,
    ) -> None:
        super().__init__()
        self.num_gemms = check_positive_int("num_gemms", num_gemms)
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        self.use_bias = check_bool("bias", bias)
        self.single_grouped_weight = check_bool("single_grouped_weight", single_grouped_weight)
        self.single_grouped_bias = check_bool("single_grouped_bias", single_grouped_bias)
        self.backend = check_choice("backend", backend, BACKENDS)
        self.quantization = check_quantization(quantization)
        self.quantized_wgrad = check_bool("quantized_wgrad", quantized_wgrad)
        self.weight_cache = QuantizedWeightCache()
        dtype = check_compute_dtype("dtype", dtype if dtype is not None else torch.get_default_dtype())
        # Set by GroupedMLP on its fc1: the output rows are GLU gate/up pairs in this order.
        self.is_glu = False
        self.glu_interleave_size: int | None = None

        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        weight_store = GroupedTensor.empty(self.num_gemms, (self.out_features, self.in_features), **factory)
        if self.single_grouped_weight:
            self.weight = nn.Parameter(weight_store.stacked())
        else:
            for i, member in enumerate(weight_store.tensors()):
                self.register_parameter(f"weight{i}", nn.Parameter(member))
        if self.use_bias:
            bias_store = GroupedTensor.empty(self.num_gemms, (self.out_features,), **factory)
            if self.single_grouped_bias:
                self.bias = nn.Parameter(bias_store.stacked())
            else:
                for i, member in enumerate(bias_store.tensors()):
                    self.register_parameter(f"bias{i}", nn.Parameter(member))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    # ---- parameters --------------------------------------------------------------------------

    def weights(self) -> torch.Tensor | list[torch.Tensor]:
        """The weight as the ops take it: the (N, O, I) parameter or the N (O, I) parameters."""
        if self.single_grouped_weight:
            return self.weight
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def biases(self) -> torch.Tensor | list[torch.Tensor] | None:
        if not self.use_bias:
            return None
        if self.single_grouped_bias:
            return self.bias
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # nn.Linear's weight range per expert; zero bias as TransformerEngine initialises it.
        bound = 1.0 / math.sqrt(self.in_features)
        for w in _as_list(self.weights()):
            w.uniform_(-bound, bound)
        for b in _as_list(self.biases()):
            b.zero_()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> GroupedLinear:
        module = super()._apply(fn, *args, **kwargs)
        # .to()/.cuda()/.half() convert each parameter on its own; repack the discrete ones so the
        # forward keeps viewing them as one (N, O, I) tensor instead of stacking per call.
        self._repack()
        return module

    @torch.no_grad()
    def _repack(self) -> None:
        for params in (self.weights(), self.biases()):
            if isinstance(params, list) and packed_view(params) is None:
                store = GroupedTensor.from_tensors([p.data for p in params])
                for p, member in zip(params, store.tensors(), strict=True):
                    p.data = member

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupedLinear:
        # copy.deepcopy clones every Parameter on its own (Parameter.__deepcopy__), which splits the
        # discrete experts' shared buffer (EMA copies, reference models); copy as usual, then repack.
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        new._repack()
        return new

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, inp: torch.Tensor, m_splits: MSplits) -> torch.Tensor:
        check_last_dim(inp, "in_features", self.in_features)
        x = inp.reshape(-1, self.in_features)
        y = grouped_linear(
            x,
            self.weights(),
            m_splits,
            self.biases(),
            backend=self.backend,
            quantization=self.quantization,
            quantized_wgrad=self.quantized_wgrad,
            weight_cache=self.weight_cache,
        )
        return rows_as(y, (*inp.shape[:-1], self.out_features))

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, single_grouped_weight={self.single_grouped_weight}, "
            f"single_grouped_bias={self.single_grouped_bias}, backend={self.backend!r}"
            + (f", glu_interleave_size={self.glu_interleave_size}" if self.is_glu else "")
            + (f", quantization={self.quantization!r}" if self.quantization is not None else "")
            + (", quantized_wgrad=False" if not self.quantized_wgrad else "")
        )

    # ---- checkpoints -------------------------------------------------------------------------

    def get_extra_state(self) -> dict:
        return linear_extra_state(self.is_glu, self.glu_interleave_size)

    def set_extra_state(self, state: Any) -> None:
        # _load_from_state_dict has already converted the weights to this module's interleave
        # size and replaced the entry with this module's own state; nothing to adopt here.
        return None

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Either layout (and a packed weight) is accepted; fc1 rows move to this module's GLU order.
        extra_key = prefix + EXTRA_STATE_SUFFIX
        weight = collect_grouped(state_dict, prefix, "weight", self.num_gemms, (self.out_features, self.in_features))
        # Without a bias of its own the module leaves bias keys in place: a strict load reports them.
        bias = (
            collect_grouped(state_dict, prefix, "bias", self.num_gemms, (self.out_features,)) if self.use_bias else None
        )
        if self.is_glu and (weight is not None or bias is not None):
            recorded, ckpt_k = glu_order_of_extra_state(state_dict.get(extra_key))
            weight, bias = convert_glu_on_load(
                [weight, bias],
                recorded,
                ckpt_k,
                self.glu_interleave_size,
                self.out_features // 2,
                prefix.rstrip(".") or "module",
            )
        if weight is not None:
            place_grouped(state_dict, prefix, "weight", weight, self.single_grouped_weight)
        if bias is not None:
            place_grouped(state_dict, prefix, "bias", bias, self.single_grouped_bias)
        state_dict[extra_key] = self.get_extra_state()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def _as_list(t: torch.Tensor | Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    if t is None:
        return []
    return [t] if isinstance(t, torch.Tensor) else list(t)
