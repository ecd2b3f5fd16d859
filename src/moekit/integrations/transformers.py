"""Hugging Face transformers MoE models on moekit experts.

Legend: T tokens, K experts per token (top-k), M = T*K routed rows, N experts, H hidden size,
F expert ffn size.

Two ways in, both keeping the model's own router (its softmax or sigmoid, top-k normalisation,
routed scaling, expert-score bias, group-limited choice), its shared experts, and its expert
parameters under their own names, shapes and state-dict layout:

1. `experts_implementation="moekit"` (in `from_pretrained`, in the config, or
   `model.set_experts_implementation("moekit")`): importing this module registers moekit's forward
   in transformers' `ExpertsInterface`, next to its own `"grouped_mm"`. The model keeps its modules
   and parameters; each experts forward runs through `moekit.moe_experts`, with the GEMM backend
   `config.moekit_backend` where the config has one, else "auto".
2. `apply_moekit(model, backend=..., quantization=...)` checks, before changing anything, that every experts module of
   the model is one moekit runs exactly (else `UnsupportedModelError`), turns each into a
   `MoekitExperts` (the same module object, its class becomes a subclass of its own class that
   keeps the class's name: nothing is copied, no parameter is renamed or replaced, `isinstance` with
   the model's experts class still holds) holding its GEMM backend, and sets the experts'
   `experts_implementation` to "moekit". So everything in the ecosystem that finds parameters by
   name sees the model unchanged: PEFT's `target_parameters` (LoRA on `mlp.experts.gate_up_proj` /
   `down_proj`), transformers' tensor-parallel plans, its missing-key reports on load,
   `save_pretrained` / `from_pretrained` (also with `apply_moekit` run inside the model's
   construction, as in `post_init`), optimizers built before, DCP checkpoints.
   `model.set_experts_implementation(other)` afterwards takes effect (the parameters are the
   model's, so transformers' "eager" or "grouped_mm" run them); `"moekit"` or `apply_moekit` again
   switch back. `apply_moekit` also marks the modules for moekit's tools: `moekit.distributed`
   shards them as their own FSDP2 unit (`IntegratedExperts`).

   `apply_moekit(model, single_grouped_weight=False)` instead converts the experts to moekit's
   per-expert layout (TransformerEngine's `weight{i}`: `grouped_mlp.fc1.weight0..`, one parameter
   per expert, a `moekit.GroupedMLP` child). That changes the parameter names, so it breaks every
   tool that finds parameters by name: PEFT `target_parameters`, transformers' TP plans, loading
   with `from_pretrained` into the converted model (apply it after loading), transformers'
   `_init_weights`, and any `experts_implementation` but "moekit" (refused at the forward in one
   line). `state_dict()` / `load_state_dict()` and `moekit.distributed.checkpoint` still use the
   model's own key names and layouts, so checkpoints are unchanged.

Activations: the experts' GLU `act_fn(gate) * up` with the config's `hidden_act` maps, through the
one table `HIDDEN_ACT_ACTIVATIONS`, to moekit's activation (`silu` -> "swiglu", `gelu` -> "geglu",
`gelu_pytorch_tanh` -> "geglu_tanh", `relu` -> "reglu"); any other `hidden_act`, or an `act_fn`
that is not its `hidden_act`'s, is refused in one line naming it. gpt-oss has its own gate
(clamped SwiGLU, limit 7, alpha 1.702): moekit's "clamped_swiglu".

Layer-by-layer mapping (transformers 5.x). In each decoder layer L with routed experts, only
`model.layers.L.mlp.experts` runs on moekit; the router and everything else stay.

- Mixtral (`mixtral`), experts class MixtralExperts: `gate_up_proj [N, 2F, H]` is moekit's fc1
  weight (rows `[gates; ups]`), `down_proj [N, H, F]` its fc2 weight, both as they are.
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
- gpt-oss (`gpt_oss`), GptOssExperts, stored transposed: `gate_up_proj [N, H, 2F]` reaches moekit
  as the view `gate_up_proj.transpose(-2, -1)` (fc1 `[N, 2F, H]`, unit stride in dim 1; rows
  alternate gate, up, gate, ...: `glu_interleave_size=1`), `gate_up_proj_bias [N, 2F]` as fc1's
  bias, `down_proj [N, F, H]` as the view `[N, H, F]`, `down_proj_bias [N, H]` as fc2's bias;
  activation "clamped_swiglu". No per-call copy: moekit's ops take the views. Routing in
  `mlp.router` (GptOssTopKRouter): linear with bias, top-k of the logits, softmax over those k.

Quantized experts: `apply_moekit(model, quantization="fp8_block" | "fp8_rowwise" | "mxfp8")` (or
`config.moekit_quantization` with `experts_implementation="moekit"`) runs the experts' linears on
quantized operands, as `moekit.moe_experts` computes them (FP8 kernels for the forward and the dgrad
where the backend has them, else the reference path: quantize, dequantize, compute in the model's
dtype). The parameters, their names and the state dict stay as
they are (master weights in the model's dtype); each experts module keeps its quantized weights and
makes them again, in place, once per optimizer step. `quantized_wgrad=False` (or
`config.moekit_quantized_wgrad = False`) takes the experts' weight gradients from the unquantized
operands in the model's dtype, as `moekit.moe_experts` documents.

In both, `forward(hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K))` is
`moekit.moe_experts`: the T*K routed copies sorted by expert, the grouped MLP with the routing
weights as `probs` (they scale the activation and the fc2 bias, as the model's
`(x W1 -> act -> W2 + b2) * w` does), and the K copies of each token summed back.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch
from torch import nn

try:
    from transformers.activations import ACT2CLS
    from transformers.integrations.moe import ExpertsInterface, _default_apply_gate
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "moekit.integrations.transformers needs Hugging Face transformers 5.x: pip install 'moekit[hf]'"
    ) from exc

from moekit.integrations.experts import IntegratedExperts
from moekit.nn.grouped_mlp import GroupedMLP
from moekit.nn.moe_layer import run_experts
from moekit.ops.activations import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT
from moekit.ops.grouped_linear import BACKENDS
from moekit.ops.moe_experts import moe_experts
from moekit.ops.quantize import QuantizedWeightCache, check_quantization
from moekit.validation import check_bool, check_choice

EXPERTS_IMPLEMENTATION = "moekit"

# The one table: a transformers model's `hidden_act` -> moekit's GLU activation of `act_fn(gate) * up`.
HIDDEN_ACT_ACTIVATIONS: dict[str, str] = {
    "silu": "swiglu",
    "gelu": "geglu",
    "gelu_pytorch_tanh": "geglu_tanh",
    "relu": "reglu",
}


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
    """How a transformers experts module stores its tensors, in moekit's terms."""

    transposed: bool  # weights stored [N, in, out] (True) or Linear-style [N, out, in] (False)
    glu_interleave_size: int | None  # fc1 row order: None = [gates; ups], 1 = alternating
    activation: str | None  # moekit activation name; None: the model's hidden_act, mapped by HIDDEN_ACT_ACTIVATIONS
    has_bias: bool


# Experts classes apply_moekit converts, by class name, with the model each belongs to.
SUPPORTED_EXPERTS: dict[str, tuple[str, ExpertsLayout]] = {
    "MixtralExperts": ("mixtral", ExpertsLayout(False, None, None, False)),
    "Qwen2MoeExperts": ("qwen2_moe", ExpertsLayout(False, None, None, False)),
    "Qwen3MoeExperts": ("qwen3_moe", ExpertsLayout(False, None, None, False)),
    "OlmoeExperts": ("olmoe", ExpertsLayout(False, None, None, False)),
    "DeepseekV3Experts": ("deepseek_v3", ExpertsLayout(False, None, None, False)),
    "GptOssExperts": ("gpt_oss", ExpertsLayout(True, 1, "clamped_swiglu", True)),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(model_type for model_type, _ in SUPPORTED_EXPERTS.values())


class UnsupportedModelError(ValueError):
    """The model has no experts module that moekit knows how to run exactly."""


def model_experts_class(module: nn.Module) -> type:
    """The model's own class of an experts module: the first class of its MRO that neither torch
    (a parametrization, such as PEFT's LoRA on `target_parameters`; FSDP2's `fully_shard`) nor
    moekit (`apply_moekit`) put on top of it."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith(("torch.", "moekit.")):
            return cls
    return type(module)


def _activation_of(experts: nn.Module) -> str:
    """moekit's activation for an experts module whose gate is `act_fn(gate) * up`: its config's
    `hidden_act` through HIDDEN_ACT_ACTIVATIONS, with `act_fn` checked to be that activation."""
    name = model_experts_class(experts).__name__
    hidden_act = getattr(getattr(experts, "config", None), "hidden_act", None)
    if not isinstance(hidden_act, str) or hidden_act not in HIDDEN_ACT_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{name} uses activation {hidden_act!r} (config.hidden_act); moekit runs GLU experts with "
            f"hidden_act one of {sorted(HIDDEN_ACT_ACTIVATIONS)}"
        )
    expected = ACT2CLS[hidden_act]
    expected = expected[0] if isinstance(expected, tuple) else expected
    act_fn = getattr(experts, "act_fn", None)
    if type(act_fn) is not expected:
        raise UnsupportedModelError(
            # transformers' ACT2CLS is inferred dict[str, object]: its values are classes or (class, kwargs).
            f"{name}.act_fn is {type(act_fn).__name__}, not {expected.__name__} of its config's hidden_act "  # type: ignore[union-attr]
            f"{hidden_act!r}; moekit runs only the activations of hidden_act {sorted(HIDDEN_ACT_ACTIVATIONS)}"
        )
    return HIDDEN_ACT_ACTIVATIONS[hidden_act]


def _check_gpt_oss_constants(experts: nn.Module) -> None:
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if alpha != CLAMPED_SWIGLU_ALPHA or limit != CLAMPED_SWIGLU_LIMIT:
        raise UnsupportedModelError(
            f"{model_experts_class(experts).__name__} uses clamped SwiGLU with alpha={alpha}, limit={limit}; moekit's "
            f"clamped_swiglu has alpha={CLAMPED_SWIGLU_ALPHA}, limit={CLAMPED_SWIGLU_LIMIT}"
        )


def _layout_of_supported(experts: nn.Module) -> ExpertsLayout:
    """The layout of a supported experts module, its activation resolved (raises if moekit cannot
    run it exactly)."""
    layout = SUPPORTED_EXPERTS[model_experts_class(experts).__name__][1]
    if layout.activation == "clamped_swiglu":
        _check_gpt_oss_constants(experts)
        return layout
    return dataclasses.replace(layout, activation=_activation_of(experts))


def _layout_of_interface_experts(experts: nn.Module) -> ExpertsLayout:
    """Layout of any experts class decorated with transformers' `@use_experts_implementation`."""
    name = model_experts_class(experts).__name__
    if name in SUPPORTED_EXPERTS:
        return _layout_of_supported(experts)
    if not getattr(experts, "has_gate", True):
        raise UnsupportedModelError(f"{name} has no gate projection; moekit runs gated (GLU) experts only")
    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        raise UnsupportedModelError(
            f"{name} has its own gating function; moekit runs it only for the supported models "
            f"{sorted(SUPPORTED_MODEL_TYPES)}"
        )
    # The default gate splits fc1's output in halves, [gates; ups], whatever is_concatenated says.
    return ExpertsLayout(
        bool(getattr(experts, "is_transposed", False)),
        None,
        _activation_of(experts),
        bool(getattr(experts, "has_bias", False)),
    )


class MoekitExperts(IntegratedExperts):
    """A transformers experts module run by moekit (made by `apply_moekit`; see the module docstring).

    Never built directly: `apply_moekit` turns an existing experts module into one, by giving it a
    class that derives from this one and from the module's own class and keeps that class's name.
    forward(hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K)) -> (T, H).

    By default (`converted_mlp()` is None) the module keeps the model's parameters under their own
    names and its forward is the model's, which dispatches on the config's `experts_implementation`
    ("moekit": `moekit_experts_forward` with `moekit_backend`). Converted to per-expert weights
    (`apply_moekit(..., single_grouped_weight=False)`), it holds them in `grouped_mlp` and runs only
    on moekit; `state_dict()` / `load_state_dict()` still use the model's key names and layouts.
    """

    model_tensor_names = {
        ("fc1", "weight"): "gate_up_proj",
        ("fc2", "weight"): "down_proj",
        ("fc1", "bias"): "gate_up_proj_bias",
        ("fc2", "bias"): "down_proj_bias",
    }
    # moekit's GEMM backend for these experts ("auto", "loop", "torch", "triton").
    moekit_backend: str = "auto"
    # moekit's quantized compute for these experts (None, "fp8_block", "fp8_rowwise", "mxfp8").
    moekit_quantization: str | None = None
    # With a quantization: the weight gradients from the quantized operands (True) or not.
    moekit_quantized_wgrad: bool = True
    # Set by the model's own experts class: its config, and (until converted) its fused fc1 weight.
    config: Any
    gate_up_proj: torch.Tensor
    # Set where converted to per-expert weights: the model's tensor names in its registration order.
    model_tensor_order: tuple[str, ...]

    def moekit_weight_caches(self) -> tuple[QuantizedWeightCache, QuantizedWeightCache]:
        """The (fc1, fc2) quantized weights these experts keep across calls (made on first use)."""
        caches = self.__dict__.get("_moekit_weight_caches")
        if caches is None:
            caches = self.__dict__["_moekit_weight_caches"] = (QuantizedWeightCache(), QuantizedWeightCache())
        return caches

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        mlp = self.converted_mlp()
        if mlp is None:
            # The model's own forward: it dispatches on the config's experts_implementation.
            return super().forward(hidden_states, top_k_index, top_k_weights)
        implementation = self.config._experts_implementation
        if implementation != EXPERTS_IMPLEMENTATION:
            name = model_experts_class(self).__name__
            raise RuntimeError(
                f"{name} was converted to per-expert weights by apply_moekit(single_grouped_weight="
                f"False), which only moekit runs: experts_implementation={implementation!r} cannot take effect; "
                f"set it back to {EXPERTS_IMPLEMENTATION!r}, or apply_moekit with the default "
                "single_grouped_weight=True, which keeps the model's parameters for every implementation"
            )
        return run_experts(mlp, hidden_states, top_k_index, top_k_weights)

    def model_layout_tensors(self, *, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """The expert tensors (or, with grads=True, their gradients) under the model's names and in
        its layout: the parameters themselves, or views of the GroupedMLP's where converted."""
        mlp = self.converted_mlp()
        if mlp is None:
            params = {name: self._parameters.get(name) for name in self.model_tensor_names.values()}
            return {name: (p.grad if grads else p) for name, p in params.items() if p is not None}
        out: dict[str, torch.Tensor | None] = {}
        for (linear_name, kind), model_name in self.model_tensor_names.items():
            linear = getattr(mlp, linear_name)
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
            out[model_name] = t.transpose(1, 2) if self.stores_transposed and kind == "weight" else t
        return out

    def extra_repr(self) -> str:
        converted = ", per-expert weights in grouped_mlp" if self.converted_mlp() is not None else ""
        quant = f", moekit_quantization={self.moekit_quantization!r}" if self.moekit_quantization else ""
        quant += ", moekit_quantized_wgrad=False" if not self.moekit_quantized_wgrad else ""
        return f"moekit_backend={self.moekit_backend!r}{quant}{converted}"


_MOEKIT_CLASSES: dict[type, type] = {}


def moekit_class(experts_class: type[nn.Module]) -> type[MoekitExperts]:
    """The class `apply_moekit` gives a module of `experts_class`: derived from MoekitExperts and
    from `experts_class`, named as `experts_class` (transformers' checks by class name see the same
    name), importable from this module as `Moekit<name>` (so a pickled model loads again)."""
    if experts_class not in _MOEKIT_CLASSES:
        _MOEKIT_CLASSES[experts_class] = type(
            experts_class.__name__,
            (MoekitExperts, experts_class),
            {"__module__": __name__, "__qualname__": f"Moekit{experts_class.__name__}"},
        )
    return _MOEKIT_CLASSES[experts_class]


def __getattr__(name: str) -> type:
    """`Moekit<experts class>` for unpickling (see `moekit_class`)."""
    experts_name = name.removeprefix("Moekit")
    if experts_name != name and experts_name in SUPPORTED_EXPERTS:
        model_type = SUPPORTED_EXPERTS[experts_name][0]
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        return moekit_class(getattr(module, experts_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _install(linear: nn.Module, kind: str, param: torch.Tensor, *, transpose: bool) -> None:
    """Make `param` ([N, ...]) linear's discrete `weight{i}`/`bias{i}`: views of its storage, unless
    it must be transposed (then of one transposed copy)."""
    packed = param.detach().transpose(1, 2).contiguous() if transpose else param.detach()
    for i in range(packed.shape[0]):
        setattr(linear, f"{kind}{i}", nn.Parameter(packed[i], requires_grad=param.requires_grad))


def _convert_to_per_expert(
    experts: MoekitExperts, layout: ExpertsLayout, backend: str, quantization: str | None, quantized_wgrad: bool
) -> None:
    """Move the model's expert parameters into a per-expert `GroupedMLP` child (see apply_moekit)."""
    gate_up = experts.gate_up_proj
    num_experts = gate_up.shape[0]
    # gate_up_proj is [N, H, 2F] when transposed, [N, 2F, H] otherwise.
    hidden, two_ffn = gate_up.shape[1:] if layout.transposed else gate_up.shape[1:][::-1]
    assert layout.activation is not None  # resolved by _layout_of_supported
    mlp = GroupedMLP(
        num_experts,
        hidden,
        two_ffn // 2,
        bias=layout.has_bias,
        activation=layout.activation,
        glu_interleave_size=layout.glu_interleave_size,
        single_grouped_weight=False,
        backend=backend,
        device="meta",
        dtype=gate_up.dtype,
        quantization=quantization,
        quantized_wgrad=quantized_wgrad,
    )
    # The model's tensor names in its own registration order: state_dict() keeps that order.
    experts.model_tensor_order = tuple(n for n in experts._parameters if n in MoekitExperts.model_tensor_names.values())
    for (linear_name, kind), model_name in MoekitExperts.model_tensor_names.items():
        if kind == "bias" and not layout.has_bias:
            continue
        param = experts._parameters.pop(model_name)
        assert param is not None  # the model registers every tensor of its layout
        _install(getattr(mlp, linear_name), kind, param, transpose=layout.transposed and kind == "weight")
    experts.grouped_mlp = mlp
    experts.register_state_dict_post_hook(_save_in_model_layout)
    experts.register_load_state_dict_pre_hook(_load_from_model_layout)


def _save_in_model_layout(
    module: MoekitExperts, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    own = prefix + "grouped_mlp."
    for key in [k for k in state_dict if k.startswith(own)]:
        del state_dict[key]
    tensors = module.model_layout_tensors()
    for name in module.model_tensor_order:
        t = tensors[name]
        assert t is not None  # (None only for a missing gradient)
        # A transposed view would not serialise (safetensors wants contiguous tensors).
        state_dict[prefix + name] = t.detach().contiguous() if not t.is_contiguous() else t.detach()


def _load_from_model_layout(
    module: MoekitExperts,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    mlp = module.converted_mlp()
    for (linear_name, kind), model_name in module.model_tensor_names.items():
        key = prefix + model_name
        if key not in state_dict:
            continue
        t = state_dict.pop(key)
        if module.stores_transposed and kind == "weight":
            t = t.transpose(1, 2)
        # GroupedLinear's own loader takes the grouped tensor whatever its layout; the extra state
        # says the rows are already in this module's GLU order.
        linear = getattr(mlp, linear_name)
        state_dict[f"{prefix}grouped_mlp.{linear_name}.{kind}"] = t
        state_dict[f"{prefix}grouped_mlp.{linear_name}._extra_state"] = linear.get_extra_state()


def _find_experts(model: nn.Module) -> tuple[list[nn.Module], list[MoekitExperts], list[str]]:
    """(supported experts modules not yet on moekit, those already on moekit, qualified names of
    modules that look like experts but are not supported)."""
    found, applied, unsupported = [], [], []
    for qualified, module in model.named_modules():
        cls = model_experts_class(module).__name__
        if isinstance(module, MoekitExperts):
            applied.append(module)
        elif cls in SUPPORTED_EXPERTS:
            found.append(module)
        elif cls.endswith("Experts") and hasattr(module, "gate_up_proj"):
            unsupported.append(f"{qualified} ({cls})")
    return found, applied, unsupported


def apply_moekit(
    model: nn.Module,
    *,
    backend: str = "auto",
    single_grouped_weight: bool = True,
    quantization: str | None = None,
    quantized_wgrad: bool = True,
) -> nn.Module:
    """Run the experts of a transformers MoE model on moekit, in place; returns the model.

    Every supported experts module (see `SUPPORTED_EXPERTS` and the module docstring) becomes a
    `MoekitExperts` and its config's `experts_implementation` "moekit"; routers, shared experts,
    dense layers and attention stay. By default the model keeps its own parameter names, shapes and
    state-dict layout (the same Parameter objects), so name-based tools (PEFT `target_parameters`,
    TP plans, `from_pretrained`'s loading and missing-key reports) work unchanged, and
    `model.set_experts_implementation(other)` afterwards takes effect.
    `backend` is moekit's GEMM backend ("auto", "loop", "torch", "triton").
    `quantization` (None, "fp8_block", "fp8_rowwise", "mxfp8"): the experts' linears on quantized
    operands, as `moekit.moe_experts` computes them (FP8 kernels or the reference path); the
    parameters and state dict are unchanged, the quantized weights are made once per optimizer step.
    `quantized_wgrad` (with a quantization): False takes the weight gradients from the unquantized
    operands in the model's dtype (`moekit.moe_experts`).
    `single_grouped_weight=False` converts the experts to TransformerEngine-style per-expert weights
    (`grouped_mlp.fc1.weight{i}`): that renames the parameters and so breaks PEFT
    `target_parameters`, transformers' TP plans, `from_pretrained` into the converted model,
    transformers' `_init_weights`, and every experts_implementation but "moekit"; `state_dict()`
    keeps the model's keys and layouts.
    Raises `UnsupportedModelError` (listing the supported models), before changing anything, when
    the model has no supported experts or has experts moekit cannot run exactly (an activation
    outside `HIDDEN_ACT_ACTIVATIONS`, say).

    Idempotent: experts already on moekit are kept as they are, so a second call with the same
    arguments changes nothing but the experts_implementation (back to "moekit"); a second call
    asking for another `backend` or layout raises a ValueError rather than leaving the model in a
    mix of settings.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_moekit takes a transformers model (a torch.nn.Module), got {type(model).__name__}")
    check_choice("backend", backend, BACKENDS)
    check_bool("single_grouped_weight", single_grouped_weight)
    quantization = check_quantization(quantization)
    quantized_wgrad = check_bool("quantized_wgrad", quantized_wgrad)
    found, applied, unsupported = _find_experts(model)
    for experts in applied:
        settings = (
            experts.moekit_backend,
            experts.converted_mlp() is None,
            experts.moekit_quantization,
            experts.moekit_quantized_wgrad,
        )
        if settings != (backend, single_grouped_weight, quantization, quantized_wgrad):
            # The quantization is named where one of the two has one, quantized_wgrad where one is off.
            quantized = settings[2] is not None or quantization is not None
            had = f", quantization={settings[2]!r}" if quantized else ""
            asked = f", quantization={quantization!r}" if quantized else ""
            if not (settings[3] and quantized_wgrad):
                had += f", quantized_wgrad={settings[3]}"
                asked += f", quantized_wgrad={quantized_wgrad}"
            raise ValueError(
                f"apply_moekit was already applied to this model with backend={settings[0]!r}, "
                f"single_grouped_weight={settings[1]}{had}; asked now for backend={backend!r}, "
                f"single_grouped_weight={single_grouped_weight}{asked}. Apply it once, to a freshly loaded model."
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
    # Every module is checked before any is changed: a refusal leaves the model as it was.
    wrapped = [
        f"{type(m).__name__} over {model_experts_class(m).__name__}"
        for m in found
        if type(m) is not model_experts_class(m)
    ]
    if wrapped:
        raise ValueError(
            f"apply_moekit: experts modules already wrapped by torch ({', '.join(wrapped)}); apply it before "
            "fully_shard or any parametrization"
        )
    layouts = [_layout_of_supported(experts) for experts in found]
    for module, layout in zip(found, layouts, strict=True):
        module.__class__ = moekit_class(model_experts_class(module))
        assert isinstance(module, MoekitExperts)  # (the same object, of its moekit class now)
        module.moekit_backend = backend
        module.moekit_quantization = quantization
        module.moekit_quantized_wgrad = quantized_wgrad
        module.stores_transposed = layout.transposed
        if not single_grouped_weight:
            _convert_to_per_expert(module, layout, backend, quantization, quantized_wgrad)
        applied.append(module)
    for experts in applied:
        experts.config._experts_implementation = EXPERTS_IMPLEMENTATION
    return model


def moekit_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers `ExpertsInterface` entry: the experts forward of a `@use_experts_implementation`
    module, run by `moekit.moe_experts` on the module's own tensors (views, never copies).

    hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K) -> (T, H). The GEMM backend is
    the module's `moekit_backend` after `apply_moekit`, else `config.moekit_backend` when the config
    has one, else "auto"; the quantization likewise (`moekit_quantization`, default None), and
    `moekit_quantized_wgrad` (default True). The tensors
    are read from the module at each call, so a parametrization of them (PEFT's LoRA on
    `target_parameters`) trains through moekit.
    """
    layout = _layout_of_interface_experts(self)
    assert layout.activation is not None  # resolved by _layout_of_interface_experts

    def as_moekit(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(-2, -1) if layout.transposed else t

    caches = None
    if isinstance(self, MoekitExperts):
        backend, quantization = self.moekit_backend, self.moekit_quantization
        quantized_wgrad = self.moekit_quantized_wgrad
        caches = self.moekit_weight_caches()
    else:
        config = getattr(self, "config", None)
        backend = getattr(config, "moekit_backend", "auto")
        quantization = check_quantization(getattr(config, "moekit_quantization", None))
        quantized_wgrad = check_bool("moekit_quantized_wgrad", getattr(config, "moekit_quantized_wgrad", True))
    # The model's expert tensors: torch types any module attribute it does not declare (nn.Module.__getattr__)
    # as Tensor | Module.
    return moe_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        as_moekit(self.gate_up_proj),  # type: ignore[arg-type]  # a Tensor (see above)
        as_moekit(self.down_proj),  # type: ignore[arg-type]  # a Tensor
        fc1_bias=self.gate_up_proj_bias if layout.has_bias else None,  # type: ignore[arg-type]  # a Tensor
        fc2_bias=self.down_proj_bias if layout.has_bias else None,  # type: ignore[arg-type]  # a Tensor
        activation=layout.activation,
        glu_interleave_size=layout.glu_interleave_size,
        backend=backend,
        quantization=quantization,
        quantized_wgrad=quantized_wgrad,
        weight_caches=caches,
    )


def register_experts_implementation() -> None:
    """Register `experts_implementation="moekit"` in transformers' ExpertsInterface (idempotent;
    done on import of this module)."""
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, moekit_experts_forward)


register_experts_implementation()

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "HIDDEN_ACT_ACTIVATIONS",
    "SUPPORTED_EXPERTS",
    "SUPPORTED_MODEL_TYPES",
    "ExpertsLayout",
    "MoekitExperts",
    "UnsupportedModelError",
    "apply_moekit",
    "moekit_class",
    "model_experts_class",
    "moekit_experts_forward",
    "register_experts_implementation",
]
