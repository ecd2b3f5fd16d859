"""Hugging Face transformers MoE models on moekit experts.

Legend: T tokens, K experts per token (top-k), M = T*K routed rows, N experts, H hidden size,
F expert ffn size.

Two ways in, both keeping the model's own router (its softmax or sigmoid, top-k normalisation,
routed scaling, expert-score bias, group-limited choice) and its shared experts untouched:

1. `apply_moekit(model)` replaces each experts module of a supported model by `MoekitExperts`, which
   holds a `moekit.GroupedMLP`. Where the model's expert tensors already have moekit's layout
   (`[N, out, in]`, gate rows before up rows) the GroupedMLP's parameters ARE the model's
   parameters (same `nn.Parameter` objects: no copy, and an optimizer built before keeps working);
   otherwise (gpt-oss stores `[N, in, out]`) they are converted once. `state_dict()` keeps the
   model's own key names and layouts, so `save_pretrained` / `load_state_dict` / `from_pretrained`
   checkpoints are unchanged; `named_parameters()` shows the moekit names.
2. `experts_implementation="moekit"` (in `from_pretrained`, in the config, or
   `model.set_experts_implementation("moekit")`): importing this module registers moekit's forward
   in transformers' `ExpertsInterface`, next to its own `"grouped_mm"`. The model keeps its modules
   and parameters; each experts forward runs through `moekit.moe_experts`.

Layer-by-layer mapping (transformers 5.x). In each decoder layer L with routed experts, only
`model.layers.L.mlp.experts` is replaced; the router and everything else stay.

- Mixtral (`mixtral`), experts class MixtralExperts:
    `gate_up_proj [N, 2F, H]` -> `fc1.weight` (the same Parameter; rows `[gates; ups]`),
    `down_proj [N, H, F]` -> `fc2.weight` (the same Parameter); activation swiglu (silu).
    Routing kept in `mlp.gate` (MixtralTopKRouter): softmax, top-k, renormalised.
- Qwen2-MoE (`qwen2_moe`), Qwen2MoeExperts: tensors as Mixtral. Routing in `mlp.gate`: softmax,
    top-k, `norm_topk_prob`. `mlp.shared_expert` and `mlp.shared_expert_gate` untouched; dense
    layers (`mlp_only_layers`, `decoder_sparse_step`) untouched.
- Qwen3-MoE (`qwen3_moe`), Qwen3MoeExperts: tensors as Mixtral; routing in `mlp.gate` (softmax,
    top-k, `norm_topk_prob`).
- OLMoE (`olmoe`), OlmoeExperts: tensors as Mixtral; routing in `mlp.gate` (softmax, top-k,
    `norm_topk_prob`).
- DeepSeek-V3 (`deepseek_v3`), DeepseekV3Experts (layers L >= `first_k_dense_replace`; the first
    ones are dense and untouched): tensors as Mixtral. Routing in `mlp.gate` (DeepseekV3TopkRouter):
    sigmoid scores, `e_score_correction_bias` for the choice, group-limited top-k (`n_group`,
    `topk_group`), `norm_topk_prob`, `routed_scaling_factor`. `mlp.shared_experts` untouched.
- gpt-oss (`gpt_oss`), GptOssExperts:
    `gate_up_proj [N, H, 2F]` -> `fc1.weight [N, 2F, H]` (transposed once; its rows alternate
    gate, up, gate, ...: `glu_interleave_size=1`), `gate_up_proj_bias [N, 2F]` -> `fc1.bias` (the same
    Parameter), `down_proj [N, F, H]` -> `fc2.weight [N, H, F]` (transposed once),
    `down_proj_bias [N, H]` -> `fc2.bias` (the same Parameter); activation `clamped_swiglu`
    (limit 7, alpha 1.702). Routing in `mlp.router` (GptOssTopKRouter): linear with bias, top-k of
    the logits, softmax over those k.

In both, `forward(hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K))` is
`moekit.moe_experts`: the T*K routed copies sorted by expert, the grouped MLP with the routing
weights as `probs` (they scale the activation and the fc2 bias, as the model's
`(x W1 -> act -> W2 + b2) * w` does), and the K copies of each token summed back.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

try:
    from transformers.integrations.moe import ExpertsInterface, _default_apply_gate
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "moekit.integrations.transformers needs Hugging Face transformers 5.x: pip install 'moekit[hf]'"
    ) from exc

from moekit.nn.grouped_mlp import GroupedMLP
from moekit.nn.moe_layer import run_experts
from moekit.ops.activations import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT
from moekit.ops.moe_experts import moe_experts

EXPERTS_IMPLEMENTATION = "moekit"


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
    """How a transformers experts module stores its tensors, in moekit's terms."""

    transposed: bool  # weights stored [N, in, out] (True) or Linear-style [N, out, in] (False)
    glu_interleave_size: int | None  # fc1 row order: None = [gates; ups], 1 = alternating
    activation: str  # moekit activation name
    has_bias: bool


# Experts classes apply_moekit converts, by class name, with the model each belongs to.
SUPPORTED_EXPERTS: dict[str, tuple[str, ExpertsLayout]] = {
    "MixtralExperts": ("mixtral", ExpertsLayout(False, None, "swiglu", False)),
    "Qwen2MoeExperts": ("qwen2_moe", ExpertsLayout(False, None, "swiglu", False)),
    "Qwen3MoeExperts": ("qwen3_moe", ExpertsLayout(False, None, "swiglu", False)),
    "OlmoeExperts": ("olmoe", ExpertsLayout(False, None, "swiglu", False)),
    "DeepseekV3Experts": ("deepseek_v3", ExpertsLayout(False, None, "swiglu", False)),
    "GptOssExperts": ("gpt_oss", ExpertsLayout(True, 1, "clamped_swiglu", True)),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(model_type for model_type, _ in SUPPORTED_EXPERTS.values())


class UnsupportedModelError(ValueError):
    """The model has no experts module that moekit knows how to run exactly."""


def _is_silu(act: nn.Module | None) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def _check_gpt_oss_constants(experts: nn.Module) -> None:
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if alpha != CLAMPED_SWIGLU_ALPHA or limit != CLAMPED_SWIGLU_LIMIT:
        raise UnsupportedModelError(
            f"{type(experts).__name__} uses clamped SwiGLU with alpha={alpha}, limit={limit}; moekit's "
            f"clamped_swiglu has alpha={CLAMPED_SWIGLU_ALPHA}, limit={CLAMPED_SWIGLU_LIMIT}"
        )


def _layout_of_supported(experts: nn.Module) -> ExpertsLayout:
    layout = SUPPORTED_EXPERTS[type(experts).__name__][1]
    if layout.activation == "clamped_swiglu":
        _check_gpt_oss_constants(experts)
    elif not _is_silu(getattr(experts, "act_fn", None)):
        raise UnsupportedModelError(
            f"{type(experts).__name__} uses activation {type(getattr(experts, 'act_fn', None)).__name__}; "
            "moekit's experts are SwiGLU (silu) or gpt-oss's clamped SwiGLU"
        )
    return layout


def _layout_of_interface_experts(experts: nn.Module) -> ExpertsLayout:
    """Layout of any experts class decorated with transformers' `@use_experts_implementation`."""
    name = type(experts).__name__
    if name in SUPPORTED_EXPERTS:
        return _layout_of_supported(experts)
    if not getattr(experts, "has_gate", True):
        raise NotImplementedError(f"{name} has no gate projection; moekit runs gated (GLU) experts only")
    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        raise NotImplementedError(
            f"{name} has its own gating function; moekit runs it only for the supported models "
            f"{sorted(SUPPORTED_MODEL_TYPES)}"
        )
    if not _is_silu(getattr(experts, "act_fn", None)):
        raise NotImplementedError(
            f"{name} uses activation {type(getattr(experts, 'act_fn', None)).__name__}; moekit runs silu GLU experts"
        )
    # The default gate splits fc1's output in halves, [gates; ups], whatever is_concatenated says.
    return ExpertsLayout(
        bool(getattr(experts, "is_transposed", False)), None, "swiglu", bool(getattr(experts, "has_bias", False))
    )


# The replaced module's tensor names -> (GroupedMLP linear, parameter kind).
_MODEL_NAMES = {
    "gate_up_proj": ("fc1", "weight"),
    "down_proj": ("fc2", "weight"),
    "gate_up_proj_bias": ("fc1", "bias"),
    "down_proj_bias": ("fc2", "bias"),
}


class MoekitExperts(nn.Module):
    """Drop-in for a transformers experts module: forward(hidden_states (T, H), top_k_index (T, K),
    top_k_weights (T, K)) -> (T, H), computed by `self.grouped_mlp` (a `moekit.GroupedMLP`).

    `state_dict()` / `load_state_dict()` use the replaced module's key names and layouts
    (`gate_up_proj`, `down_proj`, and gpt-oss's biases), so checkpoints are unchanged.
    """

    def __init__(self, grouped_mlp: GroupedMLP, layout: ExpertsLayout, replaced: str) -> None:
        super().__init__()
        self.grouped_mlp = grouped_mlp
        self.layout = layout
        self.replaced = replaced
        self.num_experts = grouped_mlp.num_experts
        self._register_state_dict_hook(_save_in_model_layout)
        self._register_load_state_dict_pre_hook(_load_from_model_layout, with_module=True)

    @classmethod
    def from_transformers(
        cls, experts: nn.Module, *, backend: str = "auto", single_grouped_weight: bool = True
    ) -> MoekitExperts:
        """Build from a supported transformers experts module, reusing its parameters where the
        layouts agree (see the module docstring)."""
        name = type(experts).__name__
        if name not in SUPPORTED_EXPERTS:
            raise UnsupportedModelError(
                f"{name} is not a supported experts module; supported: {sorted(SUPPORTED_EXPERTS)}"
            )
        layout = _layout_of_supported(experts)
        gate_up = experts.gate_up_proj
        num_experts = gate_up.shape[0]
        # gate_up_proj is [N, H, 2F] when transposed, [N, 2F, H] otherwise.
        hidden, two_ffn = gate_up.shape[1:] if layout.transposed else gate_up.shape[1:][::-1]
        mlp = GroupedMLP(
            num_experts,
            hidden,
            two_ffn // 2,
            bias=layout.has_bias,
            activation=layout.activation,
            glu_interleave_size=layout.glu_interleave_size,
            single_grouped_weight=single_grouped_weight,
            backend=backend,
            device="meta",
            dtype=gate_up.dtype,
        )
        for model_name, (linear_name, kind) in _MODEL_NAMES.items():
            if kind == "bias" and not layout.has_bias:
                continue
            _install(
                getattr(mlp, linear_name),
                kind,
                getattr(experts, model_name),
                transpose=layout.transposed and kind == "weight",
            )
        return cls(mlp, layout, name)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return run_experts(self.grouped_mlp, hidden_states, top_k_index, top_k_weights)

    def model_layout_tensors(self, *, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """The expert tensors (or, with grads=True, their gradients) under the replaced module's
        names and in its layout: views of the GroupedMLP's parameters where the layout allows."""
        out = {}
        for model_name, (linear_name, kind) in _MODEL_NAMES.items():
            linear = getattr(self.grouped_mlp, linear_name)
            params = linear.weights() if kind == "weight" else linear.biases()
            if params is None:
                continue
            members = [params] if isinstance(params, torch.Tensor) else list(params)
            if grads:
                if any(p.grad is None for p in members):
                    out[model_name] = None
                    continue
                members = [p.grad for p in members]
            t = members[0] if isinstance(params, torch.Tensor) else torch.stack(members)
            out[model_name] = t.transpose(1, 2) if self.layout.transposed and kind == "weight" else t
        return out

    def extra_repr(self) -> str:
        return f"replaces={self.replaced}"


def _install(linear: nn.Module, kind: str, param: torch.Tensor, *, transpose: bool) -> None:
    """Make `param` ([N, ...]) linear's `weight`/`bias` (single grouped) or `weight{i}`/`bias{i}`
    (discrete): the same Parameter, or views of its storage, unless it must be transposed."""
    single = linear.single_grouped_weight if kind == "weight" else linear.single_grouped_bias
    if transpose:
        param = nn.Parameter(param.detach().transpose(1, 2).contiguous(), requires_grad=param.requires_grad)
    if single:
        setattr(linear, kind, param if isinstance(param, nn.Parameter) else nn.Parameter(param))
        return
    # Discrete parameters viewing one packed buffer, as GroupedLinear keeps them.
    packed = param.detach()
    for i in range(packed.shape[0]):
        setattr(linear, f"{kind}{i}", nn.Parameter(packed[i], requires_grad=param.requires_grad))


def _save_in_model_layout(module: MoekitExperts, state_dict: dict, prefix: str, local_metadata) -> None:
    own = prefix + "grouped_mlp."
    for key in [k for k in state_dict if k.startswith(own)]:
        del state_dict[key]
    for name, t in module.model_layout_tensors().items():
        # A transposed view would not serialise (safetensors wants contiguous tensors).
        state_dict[prefix + name] = t.detach().contiguous() if not t.is_contiguous() else t.detach()


def _load_from_model_layout(
    module: MoekitExperts,
    state_dict: dict,
    prefix: str,
    local_metadata,
    strict,
    missing_keys,
    unexpected_keys,
    error_msgs,
) -> None:
    for model_name, (linear_name, kind) in _MODEL_NAMES.items():
        key = prefix + model_name
        if key not in state_dict:
            continue
        t = state_dict.pop(key)
        if module.layout.transposed and kind == "weight":
            t = t.transpose(1, 2)
        # GroupedLinear's own loader takes the grouped tensor whatever its layout; the extra state
        # says the rows are already in this module's GLU order.
        linear = getattr(module.grouped_mlp, linear_name)
        state_dict[f"{prefix}grouped_mlp.{linear_name}.{kind}"] = t
        state_dict[f"{prefix}grouped_mlp.{linear_name}._extra_state"] = linear.get_extra_state()


def _find_experts(model: nn.Module) -> tuple[list[tuple[nn.Module, str, nn.Module]], list[str]]:
    """(parent, attribute, experts module) of every supported experts module, and the qualified
    names of modules that look like experts but are not supported."""
    found, unsupported = [], []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            cls = type(child).__name__
            qualified = f"{parent_name}.{attr}" if parent_name else attr
            if cls in SUPPORTED_EXPERTS:
                found.append((parent, attr, child))
            elif cls.endswith("Experts") and cls != "MoekitExperts" and hasattr(child, "gate_up_proj"):
                unsupported.append(f"{qualified} ({cls})")
    return found, unsupported


def apply_moekit(model: nn.Module, *, backend: str = "auto", single_grouped_weight: bool = True) -> nn.Module:
    """Run the experts of a transformers MoE model on moekit, in place; returns the model.

    Every supported experts module (see `SUPPORTED_EXPERTS` and the mapping in the module
    docstring) becomes a `MoekitExperts`; routers, shared experts, dense layers and attention stay.
    `backend` is moekit's GEMM backend ("auto", "torch", "triton", "loop");
    `single_grouped_weight=False` gives TransformerEngine-style `weight{i}` parameters instead.
    Raises `UnsupportedModelError` (listing the supported models) when the model has no supported
    experts or has experts moekit cannot run exactly.

    Idempotent: experts already on moekit are kept as they are, so a second call with the same
    arguments changes nothing; a second call asking for another `backend` or layout raises a
    ValueError rather than leaving the model in a mix of settings.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_moekit takes a transformers model (a torch.nn.Module), got {type(model).__name__}")
    found, unsupported = _find_experts(model)
    applied = [m for m in model.modules() if isinstance(m, MoekitExperts)]
    for experts in applied:
        mlp = experts.grouped_mlp
        if (mlp.backend, mlp.fc1.single_grouped_weight) != (backend, single_grouped_weight):
            raise ValueError(
                f"apply_moekit was already applied to this model with backend={mlp.backend!r}, "
                f"single_grouped_weight={mlp.fc1.single_grouped_weight}; asked now for backend={backend!r}, "
                f"single_grouped_weight={single_grouped_weight}. Apply it once, to a freshly loaded model."
            )
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if unsupported or not (found or applied):
        what = f"unsupported experts modules {unsupported}" if unsupported else "no supported experts module"
        raise UnsupportedModelError(
            f"apply_moekit: {type(model).__name__} (model_type={model_type!r}) has {what}. Supported models: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (experts classes {', '.join(SUPPORTED_EXPERTS)}). Other "
            "transformers models built on @use_experts_implementation may still run with "
            f"experts_implementation={EXPERTS_IMPLEMENTATION!r}."
        )
    for parent, attr, experts in found:
        setattr(
            parent,
            attr,
            MoekitExperts.from_transformers(experts, backend=backend, single_grouped_weight=single_grouped_weight),
        )
    return model


def moekit_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers `ExpertsInterface` entry: the experts forward of a `@use_experts_implementation`
    module, run by `moekit.moe_experts` on the module's own tensors (views, no copies kept).

    hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K) -> (T, H). The GEMM backend is
    `config.moekit_backend` when the config has one, else "auto".
    """
    layout = _layout_of_interface_experts(self)

    def as_moekit(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2) if layout.transposed else t

    fc1_weight, fc2_weight = as_moekit(self.gate_up_proj), as_moekit(self.down_proj)
    fc1_bias = self.gate_up_proj_bias if layout.has_bias else None
    fc2_bias = self.down_proj_bias if layout.has_bias else None
    backend = getattr(getattr(self, "config", None), "moekit_backend", "auto")

    return moe_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        fc1_weight,
        fc2_weight,
        fc1_bias=fc1_bias,
        fc2_bias=fc2_bias,
        activation=layout.activation,
        glu_interleave_size=layout.glu_interleave_size,
        backend=backend,
    )


def register_experts_implementation() -> None:
    """Register `experts_implementation="moekit"` in transformers' ExpertsInterface (idempotent;
    done on import of this module)."""
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, moekit_experts_forward)


register_experts_implementation()

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "SUPPORTED_EXPERTS",
    "SUPPORTED_MODEL_TYPES",
    "ExpertsLayout",
    "MoekitExperts",
    "UnsupportedModelError",
    "apply_moekit",
    "moekit_experts_forward",
    "register_experts_implementation",
]
