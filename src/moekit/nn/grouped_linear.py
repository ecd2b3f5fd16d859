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
import re

import torch
from torch import nn

from moekit._splits import MSplits
from moekit.grouped_tensor import GroupedTensor
from moekit.ops.grouped_linear import BACKENDS, grouped_linear, packed_view
from moekit.ops.swiglu import check_interleave, deinterleave_glu, interleave_glu

EXTRA_STATE_FORMAT = "moekit.GroupedLinear/1"


class GroupedLinear(nn.Module):
    """N linear layers `in_features -> out_features`, one per group of rows.

    forward(inp (..., I), m_splits (N,)) -> (..., O); rows past sum(m_splits) give zeros.
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
    ) -> None:
        super().__init__()
        for name, v in (("num_gemms", num_gemms), ("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.single_grouped_weight = single_grouped_weight
        self.single_grouped_bias = single_grouped_bias
        self.backend = backend
        # Set by GroupedMLP on its fc1: the output rows are GLU gate/up pairs in this order.
        self.is_glu = False
        self.glu_interleave_size: int | None = None

        factory = {"device": device, "dtype": dtype if dtype is not None else torch.get_default_dtype()}
        weight_store = GroupedTensor.empty(num_gemms, (out_features, in_features), **factory)
        if single_grouped_weight:
            self.weight = nn.Parameter(weight_store.stacked())
        else:
            for i, member in enumerate(weight_store.tensors()):
                self.register_parameter(f"weight{i}", nn.Parameter(member))
        if bias:
            bias_store = GroupedTensor.empty(num_gemms, (out_features,), **factory)
            if single_grouped_bias:
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

    def _apply(self, fn, *args, **kwargs):
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

    def __deepcopy__(self, memo):
        # copy.deepcopy clones every Parameter on its own (Parameter.__deepcopy__), which splits the
        # discrete experts' shared buffer (EMA copies, reference models); copy as usual, then repack.
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        new._repack()
        return new

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, inp: torch.Tensor, m_splits: MSplits) -> torch.Tensor:
        if inp.dim() < 1 or inp.shape[-1] != self.in_features:
            raise ValueError(
                f"input's last dimension is {inp.shape[-1] if inp.dim() else None}; "
                f"expected in_features={self.in_features} (input shape {tuple(inp.shape)})"
            )
        x = inp.reshape(-1, self.in_features)
        y = grouped_linear(x, self.weights(), m_splits, self.biases(), backend=self.backend)
        # A 2-D input gets the op's own output back, not a view of it (FSDP2 warns about views).
        return y if inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, single_grouped_weight={self.single_grouped_weight}, "
            f"single_grouped_bias={self.single_grouped_bias}, backend={self.backend!r}"
            + (f", glu_interleave_size={self.glu_interleave_size}" if self.is_glu else "")
        )

    # ---- checkpoints -------------------------------------------------------------------------

    def get_extra_state(self) -> dict:
        return {
            "format": EXTRA_STATE_FORMAT,
            "glu": self.is_glu,
            "glu_interleave_size": self.glu_interleave_size,
        }

    def set_extra_state(self, state) -> None:
        # _load_from_state_dict has already converted the weights to this module's interleave
        # size and replaced the entry with this module's own state; nothing to adopt here.
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        extra_key = prefix + "_extra_state"
        ckpt_extra = state_dict.get(extra_key)
        weight = _collect_grouped(state_dict, prefix, "weight", self.num_gemms,
                                  (self.out_features, self.in_features))
        # Without a bias of its own the module leaves bias keys in place: a strict load reports them.
        bias = (_collect_grouped(state_dict, prefix, "bias", self.num_gemms, (self.out_features,))
                if self.use_bias else None)
        if weight is not None or bias is not None:
            weight, bias = self._convert_glu(weight, bias, ckpt_extra, prefix)
        if weight is not None:
            _place_grouped(state_dict, prefix, "weight", weight, self.single_grouped_weight)
        if bias is not None:
            _place_grouped(state_dict, prefix, "bias", bias, self.single_grouped_bias)
        state_dict[extra_key] = self.get_extra_state()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _convert_glu(self, weight, bias, ckpt_extra, prefix):
        """Map the checkpoint's GLU row order to this module's; refuse when it cannot be known."""
        if not self.is_glu:
            return weight, bias
        ckpt_known = isinstance(ckpt_extra, dict) and ckpt_extra.get("format") == EXTRA_STATE_FORMAT
        if not ckpt_known:
            if self.glu_interleave_size is None:
                # Checkpoints from other tools (TransformerEngine, Hugging Face) use [gates; ups].
                return weight, bias
            raise ValueError(
                f"{prefix or 'module '}: this module expects fc1 rows interleaved with glu_interleave_size="
                f"{self.glu_interleave_size}, but the checkpoint does not record its interleave size "
                f"({prefix}_extra_state missing or not moekit's). Load it into a module with "
                "glu_interleave_size=None if it is [gates; ups], or convert it first "
                "(moekit.interleave_glu / `moekit convert`)."
            )
        ckpt_k = ckpt_extra.get("glu_interleave_size")
        if ckpt_k == self.glu_interleave_size:
            return weight, bias
        ffn = self.out_features // 2
        check_interleave(ffn, ckpt_k)

        def convert(t):
            if t is None:
                return None
            if ckpt_k is not None:
                t = deinterleave_glu(t, ckpt_k, dim=1)
            if self.glu_interleave_size is not None:
                t = interleave_glu(t, self.glu_interleave_size, dim=1)
            return t

        return convert(weight), convert(bias)


def _as_list(t):
    if t is None:
        return []
    return [t] if isinstance(t, torch.Tensor) else list(t)


def _collect_grouped(state_dict, prefix, name, num: int, member_shape: tuple[int, ...]):
    """Read `name` (grouped, or packed (N*O, ...)) or `name{i}` (discrete) from state_dict and
    return one (N, *member_shape) tensor, or None if neither is present. Removes the keys read."""
    pattern = re.compile(re.escape(prefix + name) + r"(\d+)$")
    indexed = {}
    for key in state_dict:
        m = pattern.match(key)
        if m:
            indexed[int(m.group(1))] = key
    grouped_key = prefix + name
    has_grouped = grouped_key in state_dict and state_dict[grouped_key] is not None
    if has_grouped and indexed:
        raise ValueError(
            f"checkpoint has both {grouped_key!r} and per-expert keys {sorted(indexed.values())}; "
            "the layout is ambiguous"
        )
    if has_grouped:
        t = state_dict.pop(grouped_key)
        full = (num, *member_shape)
        packed = (num * member_shape[0], *member_shape[1:])
        if tuple(t.shape) == full:
            return t
        if tuple(t.shape) == packed:
            return t.reshape(full)
        raise ValueError(f"{grouped_key!r} has shape {tuple(t.shape)}; expected {full} or packed {packed}")
    if not indexed:
        return None
    missing = [f"{prefix}{name}{i}" for i in range(num) if i not in indexed]
    extra = [indexed[i] for i in sorted(indexed) if i >= num]
    if missing or extra:
        raise ValueError(
            f"checkpoint's per-expert {name} keys do not cover experts 0..{num - 1} exactly: "
            f"missing {missing}, extra {extra}"
        )
    bad = [f"{indexed[i]} {tuple(state_dict[indexed[i]].shape)}" for i in range(num)
           if tuple(state_dict[indexed[i]].shape) != member_shape]
    if bad:
        raise ValueError(f"per-expert {name} tensors must have shape {member_shape}; got {bad}")
    return torch.stack([state_dict.pop(indexed[i]) for i in range(num)])


def _place_grouped(state_dict, prefix, name, full: torch.Tensor, single: bool) -> None:
    if single:
        state_dict[prefix + name] = full
    else:
        for i, member in enumerate(full.unbind(0)):
            state_dict[f"{prefix}{name}{i}"] = member
