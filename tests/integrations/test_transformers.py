"""Hugging Face transformers MoE models on moekit experts: same losses, logits and gradients as the
model's own eager experts, the model's own parameter names kept, and the tools that find parameters
by name (PEFT LoRA on the experts, TP plans, from_pretrained's loading and missing-key reports,
save_pretrained) working unchanged.

Each model is built small and randomly initialised from a config written here (no downloads), in
float32 on CPU. Results are held to the tolerance rule (tests/conftest.py): the reference is the
model with its eager experts in float64 (the same float32 weights), "torch's own computation" the
eager model in float32; bitwise where the math is the same (eager after switching back, state dicts,
checkpoint round trips).
"""

from __future__ import annotations

import collections
import copy
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.integrations.transformers as hf  # noqa: E402
from helpers import assert_within_tolerance, rel_err  # noqa: E402
from moekit.integrations.experts import IntegratedExperts  # noqa: E402
from moekit.integrations.transformers import (  # noqa: E402
    EXPERTS_IMPLEMENTATION,
    HIDDEN_ACT_ACTIVATIONS,
    SUPPORTED_EXPERTS,
    ExpertsLayout,
    MoekitExperts,
    UnsupportedModelError,
    apply_moekit,
)
from moekit.ops.runtime.backends import backend_named  # noqa: E402

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
LORA_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _config(name: str, **overrides):
    if name == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, **COMMON)
    elif name == "qwen2_moe":
        # Layer 1 dense (mlp_only_layers): the integration must leave it alone.
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            **COMMON,
        )
    elif name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            head_dim=8,
            **COMMON,
        )
    elif name == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=16, num_experts=8, num_experts_per_tok=2, **COMMON)
    elif name == "deepseek_v3":
        # Layer 0 dense (first_k_dense_replace=1), layer 1 MoE with grouped top-k, routed scaling,
        # expert score bias and a shared expert.
        cfg = transformers.DeepseekV3Config(
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **{**COMMON, "num_key_value_heads": 4},
        )
    elif name == "gpt_oss":
        cfg = transformers.GptOssConfig(
            intermediate_size=24,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **COMMON,
        )
    else:
        raise KeyError(name)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


MODELS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


def _randomize(model) -> None:
    with torch.no_grad():
        # Larger than the init's 0.02 so the experts matter in the logits (and gpt-oss's clamp at 7
        # is reached); biases and the expert-score bias nonzero so their paths are exercised.
        for pname, p in model.named_parameters():
            std = 0.5 if "experts" in pname else 0.2
            p.normal_(0.0, std) if "norm" not in pname else p.uniform_(0.5, 1.5)
        for bname, b in model.named_buffers():
            if "e_score_correction_bias" in bname:
                b.normal_(0.0, 0.2)


def _model(name: str, experts_implementation: str = "eager", seed: int = 0, **config):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        _config(name, **config), experts_implementation=experts_implementation, dtype=torch.float32
    )
    _randomize(model)
    return model


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 10), generator=g)


def _grads_in_model_layout(model) -> dict[str, torch.Tensor | None]:
    """Gradients of the trainable parameters, keyed by the plain model's parameter names (experts
    converted to per-expert weights report theirs in the model's names and layout)."""
    grads, converted = {}, []
    for mname, module in model.named_modules():
        if isinstance(module, MoekitExperts) and module.converted_mlp() is not None:
            converted.append(mname + ".")
            for tname, g in module.model_layout_tensors(grads=True).items():
                grads[f"{mname}.{tname}"] = g
    for pname, p in model.named_parameters():
        if p.requires_grad and not any(pname.startswith(prefix) for prefix in converted):
            grads[pname] = p.grad
    return grads


def _step(model, ids) -> dict[str, torch.Tensor | None]:
    """One training step's loss, logits and gradients."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), **_grads_in_model_layout(model)}


def _assert_step_matches_eager(candidate, eager, ids) -> dict[str, torch.Tensor | None]:
    """The tolerance rule on the loss, the logits and every gradient: candidate (float32) against
    the eager model run in float64, torch's own error being the eager model's in float32."""
    eager64 = copy.deepcopy(eager).double()
    ours, lowp, ref = _step(candidate, ids), _step(eager, ids), _step(eager64, ids)
    assert ours.keys() == ref.keys()
    for key, want in ref.items():
        assert want is not None, f"{key}: no reference gradient"
        assert ours[key] is not None, f"{key}: no gradient"
        assert ours[key].shape == want.shape, key
        assert_within_tolerance(ours[key], want, lowp[key], key)
    return ours


@pytest.fixture
def moekit_calls(monkeypatch):
    """Counts the calls of moekit's experts op (both ways in), so a test can tell that moekit ran."""
    calls = []
    inner_op, inner_run = hf.moe_experts, hf.run_experts

    def counting_op(*args, **kwargs):
        calls.append("moe_experts")
        return inner_op(*args, **kwargs)

    def counting_run(*args, **kwargs):
        calls.append("run_experts")
        return inner_run(*args, **kwargs)

    monkeypatch.setattr(hf, "moe_experts", counting_op)
    monkeypatch.setattr(hf, "run_experts", counting_run)
    return calls


def _num_moe_layers(model) -> int:
    return sum(isinstance(m, IntegratedExperts) or type(m).__name__ in SUPPORTED_EXPERTS for m in model.modules())


# --------------------------------------------------------------------------------------------------
# Both ways in: same training step as the eager experts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_apply_moekit_keeps_the_model_and_matches_eager(name, moekit_calls):
    eager = _model(name)
    candidate = copy.deepcopy(eager)
    params_before = dict(candidate.named_parameters())
    experts_before = {n: m for n, m in candidate.named_modules() if type(m).__name__ in SUPPORTED_EXPERTS}
    classes_before = {n: type(m) for n, m in experts_before.items()}
    assert experts_before
    assert apply_moekit(candidate) is candidate

    # The same modules and the same Parameter objects under the same names: nothing renamed or copied.
    assert {n: p for n, p in candidate.named_parameters()} == params_before
    assert all(p is params_before[n] for n, p in candidate.named_parameters())
    for mname, old in experts_before.items():
        new = candidate.get_submodule(mname)
        assert new is old and isinstance(new, MoekitExperts) and isinstance(new, classes_before[mname])
        assert type(new).__name__ == classes_before[mname].__name__
        assert new.converted_mlp() is None and new.moekit_backend == "auto"
        assert new.config._experts_implementation == EXPERTS_IMPLEMENTATION
    # Routers, shared experts and dense MLPs were left as they were.
    assert {n for n, m in candidate.named_modules() if isinstance(m, MoekitExperts)} == set(experts_before)

    _assert_step_matches_eager(candidate, eager, _batch())
    assert moekit_calls.count("moe_experts") == _num_moe_layers(candidate)


@pytest.mark.parametrize("name", MODELS)
def test_experts_implementation_moekit_matches_eager(name, moekit_calls):
    eager = _model(name, "eager")
    candidate = _model(name, EXPERTS_IMPLEMENTATION)
    candidate.load_state_dict(eager.state_dict())
    assert candidate.config._experts_implementation == EXPERTS_IMPLEMENTATION
    _assert_step_matches_eager(candidate, eager, _batch())
    assert moekit_calls.count("moe_experts") == _num_moe_layers(candidate)


TRITON_OK = backend_named("triton").unavailable_reason(torch.empty(1, 8), torch.empty(1, 8, 8)) is None
GEMM_BACKENDS = [
    "loop",
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")),
]


def _moekit_candidate(eager, name: str, way: str, backend: str, **config):
    """A copy of `eager` on moekit's experts, one way or the other, on `backend`."""
    if way == "apply_moekit":
        return apply_moekit(copy.deepcopy(eager), backend=backend)
    candidate = _model(name, EXPERTS_IMPLEMENTATION, moekit_backend=backend, **config)
    candidate.load_state_dict(eager.state_dict())
    return candidate


def _record_incoming_grads(model) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, gradient as autograd hands it to the parameter, before it is accumulated) of every
    expert weight of the model's own layout."""
    seen: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    for module in model.modules():
        if type(module).__name__ in SUPPORTED_EXPERTS:
            for p in (module.gate_up_proj, module.down_proj):
                p.register_hook(lambda g, p=p: seen.append((p, g)))
    return seen


@pytest.mark.parametrize("backend", GEMM_BACKENDS)
@pytest.mark.parametrize("way", ["apply_moekit", "experts_implementation"])
def test_transposed_experts_get_their_gradients_in_their_own_layout(way, backend, moekit_calls):
    """gpt-oss stores its expert weights (N, in, out); moekit reads them through transposed views and
    computes their weight gradients in the stored layout, so autograd hands each parameter a gradient
    with its own strides (kept as it is) rather than one it must copy into the parameter's layout: no
    per-step copy of the expert weights. The step still matches eager."""
    eager = _model("gpt_oss")
    candidate = _moekit_candidate(eager, "gpt_oss", way, backend)
    seen = _record_incoming_grads(candidate)
    _assert_step_matches_eager(candidate, eager, _batch())
    assert len(seen) == 2 * _num_moe_layers(candidate) and moekit_calls
    for p, g in seen:
        assert g.shape == p.shape and g.stride() == p.stride(), (tuple(p.shape), p.stride(), g.stride())


@pytest.mark.parametrize("backend", GEMM_BACKENDS)
@pytest.mark.parametrize("way", ["apply_moekit", "experts_implementation"])
@pytest.mark.parametrize("name", MODELS)
def test_gradient_checkpointing_matches_eager(name, way, backend, moekit_calls):
    """Activation checkpointing (transformers' gradient_checkpointing_enable: each decoder layer's forward
    run again in the backward) through moekit's experts: the same step as eager's with it on, and moekit
    ran in both forwards of every MoE layer."""
    if backend == "triton" and name not in ("gpt_oss", "qwen3_moe"):
        pytest.skip("the interpreter is slow: the triton backend on the transposed and the plain layout")
    eager = _model(name)
    eager.gradient_checkpointing_enable()
    candidate = _moekit_candidate(eager, name, way, backend)
    candidate.gradient_checkpointing_enable()
    eager.train(), candidate.train()
    _assert_step_matches_eager(candidate, eager, _batch())
    assert moekit_calls.count("moe_experts") == 2 * _num_moe_layers(candidate)


# gpt-oss-20b's expert width (hidden 2880, ffn 2880: rows of 5760 and 11520 bytes), few experts and layers.
GPT_OSS_WIDTH = dict(
    hidden_size=2880,
    intermediate_size=2880,
    num_local_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=1,
    layer_types=["full_attention"],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
)


@pytest.mark.parametrize("way", ["apply_moekit", "experts_implementation"])
def test_gpt_oss_at_real_width_matches_eager(way, moekit_calls):
    """gpt-oss at its real expert width (the shapes the GPU failed on: a (32, 2880, 2880) transposed
    down_proj view), on the torch backend: the step matches eager and the expert weights' gradients
    arrive in their own layout."""
    eager = _model("gpt_oss", **GPT_OSS_WIDTH)
    candidate = _moekit_candidate(eager, "gpt_oss", way, "torch", **GPT_OSS_WIDTH)
    seen = _record_incoming_grads(candidate)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    _assert_step_matches_eager(candidate, eager, ids)
    assert moekit_calls and len(seen) == 2
    for p, g in seen:
        assert g.stride() == p.stride()


@pytest.mark.parametrize("width", ["tiny", "gpt-oss width"])
@pytest.mark.parametrize("way", ["apply_moekit", "experts_implementation"])
def test_gpt_oss_bf16_logits_as_close_to_float32_as_grouped_mm(way, width, moekit_calls):
    """In bf16, moekit's gpt-oss logits are as close to the float32 model's as transformers' own bf16
    `grouped_mm` experts are (the two bf16 runs differ from each other by about as much as each differs
    from float32 at this random initialization: what a comparison of moekit against grouped_mm alone
    in bf16 cannot tell apart from an error)."""
    config = GPT_OSS_WIDTH if width == "gpt-oss width" else {}
    reference = _model("gpt_oss", "grouped_mm", **config).eval()
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits32 = reference(ids).logits.double()
        theirs = copy.deepcopy(reference).to(torch.bfloat16)
        ours = _moekit_candidate(reference, "gpt_oss", way, "torch", **config).to(torch.bfloat16).eval()
        err_theirs = rel_err(theirs(ids).logits, logits32)
        err_ours = rel_err(ours(ids).logits, logits32)
    assert moekit_calls
    assert 0 < err_ours <= 1.25 * err_theirs, (err_ours, err_theirs)


# transformers' own model testers build MoE models with hidden_act="gelu"; the other three of the table too.
@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh", "relu"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("way", ["apply_moekit", "experts_implementation"])
def test_gelu_and_relu_experts_match_eager(name, hidden_act, way, moekit_calls):
    eager = _model(name, hidden_act=hidden_act)
    if way == "apply_moekit":
        candidate = apply_moekit(copy.deepcopy(eager))
    else:
        candidate = _model(name, EXPERTS_IMPLEMENTATION, hidden_act=hidden_act)
        candidate.load_state_dict(eager.state_dict())
    _assert_step_matches_eager(candidate, eager, _batch())
    assert moekit_calls


def test_activation_table_is_the_documented_one():
    assert HIDDEN_ACT_ACTIVATIONS == {
        "silu": "swiglu",
        "gelu": "geglu",
        "gelu_pytorch_tanh": "geglu_tanh",
        "relu": "reglu",
    }


@pytest.mark.parametrize("way", ["apply_moekit", "experts_implementation"])
def test_other_activation_is_refused_in_one_line(way):
    model = _model("qwen3_moe", hidden_act="gelu_new")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    match = r"^Qwen3MoeExperts uses activation 'gelu_new' \(config.hidden_act\); moekit runs GLU experts with"
    with pytest.raises(UnsupportedModelError, match=match) as info:
        if way == "apply_moekit":
            apply_moekit(model)
        else:
            model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
            model(input_ids=_batch())
    assert "\n" not in str(info.value)
    if way == "apply_moekit":  # refused before anything changed
        assert not any(isinstance(m, MoekitExperts) for m in model.modules())
        assert model.config._experts_implementation != EXPERTS_IMPLEMENTATION
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_act_fn_other_than_hidden_act_is_refused():
    model = _model("mixtral")
    model.model.layers[1].mlp.experts.act_fn = torch.nn.Tanh()
    with pytest.raises(UnsupportedModelError, match=r"MixtralExperts.act_fn is Tanh, not SiLUActivation"):
        apply_moekit(model)
    assert not any(isinstance(m, MoekitExperts) for m in model.modules())


def test_apply_moekit_gpt_oss_clamp_is_reached():
    # The clamp of gpt-oss's activation must be exercised for its test to mean something.
    model = _model("gpt_oss")
    seen = []
    experts = model.model.layers[0].mlp.experts
    handle = experts.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    model(input_ids=_batch())
    handle.remove()
    gate_up = seen[0] @ experts.gate_up_proj[0]
    assert (gate_up.abs() > 7.0).any()


def test_apply_moekit_detects_wrong_glu_order(monkeypatch):
    # Negative control: treating gpt-oss's alternating rows as [gates; ups] must be caught.
    eager = _model("gpt_oss")
    candidate = copy.deepcopy(eager)
    wrong = ExpertsLayout(transposed=True, glu_interleave_size=None, activation="clamped_swiglu", has_bias=True)
    monkeypatch.setitem(SUPPORTED_EXPERTS, "GptOssExperts", ("gpt_oss", wrong))
    apply_moekit(candidate)
    ids = _batch()
    with pytest.raises(AssertionError, match="relative error"):
        _assert_step_matches_eager(candidate, eager, ids)


# --------------------------------------------------------------------------------------------------
# The per-expert layout option: other parameter names, same checkpoints
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_apply_moekit_per_expert_weights(name, moekit_calls):
    eager = _model(name)
    candidate = apply_moekit(copy.deepcopy(eager), single_grouped_weight=False, backend="loop")
    experts = next(m for m in candidate.modules() if isinstance(m, MoekitExperts))
    mlp = experts.converted_mlp()
    assert mlp is not None and not mlp.fc1.single_grouped_weight and hasattr(mlp.fc1, "weight0")
    assert not hasattr(experts, "gate_up_proj")  # renamed: what the option's docstring warns of
    _assert_step_matches_eager(candidate, eager, _batch())
    assert moekit_calls.count("run_experts") == _num_moe_layers(candidate)
    # state_dict keeps the model's keys and layouts.
    assert candidate.state_dict().keys() == eager.state_dict().keys()
    # Another experts_implementation cannot take effect on per-expert weights: refused in one line.
    candidate.set_experts_implementation("eager")
    with pytest.raises(RuntimeError, match=r"converted to per-expert weights .* experts_implementation='eager' cannot"):
        candidate(input_ids=_batch())


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("grouped", [True, False], ids=["model-layout", "per-expert"])
def test_apply_moekit_keeps_state_dict(name, grouped):
    eager = _model(name)
    candidate = apply_moekit(copy.deepcopy(eager), single_grouped_weight=grouped)
    ref_state, state = eager.state_dict(), candidate.state_dict()
    assert list(state) == list(ref_state)
    for key, value in ref_state.items():
        assert state[key].shape == value.shape, key
        assert torch.equal(state[key], value), key
    # And the model's own checkpoint loads into the converted model (other values, to see them land).
    other = _model(name, seed=7)
    missing, unexpected = candidate.load_state_dict(other.state_dict(), strict=True)
    assert not missing and not unexpected
    assert all(torch.equal(candidate.state_dict()[k], v) for k, v in other.state_dict().items())


def test_optimizer_built_before_apply_moekit_updates_the_model():
    eager = _model("olmoe")
    candidate = copy.deepcopy(eager)
    opt = torch.optim.SGD(candidate.parameters(), lr=0.1)  # built before apply_moekit
    apply_moekit(candidate)
    ref_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for model, optimizer in ((eager, ref_opt), (candidate, opt)):
        _step(model, _batch())
        optimizer.step()
    experts = candidate.model.layers[0].mlp.experts
    assert not torch.equal(experts.gate_up_proj, _model("olmoe").model.layers[0].mlp.experts.gate_up_proj)
    _assert_step_matches_eager(candidate, eager, _batch(seed=3))


# --------------------------------------------------------------------------------------------------
# set_experts_implementation after apply_moekit takes effect
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2_moe", "gpt_oss"])
def test_set_experts_implementation_after_apply_moekit_takes_effect(name, moekit_calls):
    eager = _model(name)
    candidate = apply_moekit(copy.deepcopy(eager))
    ids = _batch()
    candidate.set_experts_implementation("eager")
    moekit_calls.clear()
    ours, ref = _step(candidate, ids), _step(eager, ids)
    assert not moekit_calls
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ref), "eager again: bit for bit the eager model"
    # grouped_mm as well (transformers' own kernel on the model's own parameters) ...
    candidate.set_experts_implementation("grouped_mm")
    _step(candidate, ids)
    assert not moekit_calls
    # ... and back to moekit, by name or by apply_moekit again.
    candidate.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    _step(candidate, ids)
    assert moekit_calls.count("moe_experts") == _num_moe_layers(candidate)
    candidate.set_experts_implementation("eager")
    apply_moekit(candidate)
    moekit_calls.clear()
    _assert_step_matches_eager(candidate, eager, ids)
    assert moekit_calls.count("moe_experts") == _num_moe_layers(candidate)


# --------------------------------------------------------------------------------------------------
# PEFT LoRA on the experts (`target_parameters`), both ways in
# --------------------------------------------------------------------------------------------------


def _with_lora(model, seed=11):
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)  # the same adapter initialisation for every way in
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=[], target_parameters=LORA_TARGETS, init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("way", ["experts_implementation", "apply_moekit", "apply_moekit_after_peft"])
def test_peft_lora_on_experts_trains_as_eager(name, way, moekit_calls):
    """LoRA adapters on the experts' gate_up_proj / down_proj: the adapter's gradients (and the
    loss, logits) through moekit equal those through transformers' eager experts."""
    eager = _with_lora(_model(name))
    if way == "experts_implementation":
        candidate = _with_lora(_model(name, EXPERTS_IMPLEMENTATION))
    elif way == "apply_moekit":
        candidate = _with_lora(apply_moekit(_model(name)))
    else:
        candidate = apply_moekit(_with_lora(_model(name)))
    trainable = {n for n, p in candidate.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in eager.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # Two adapted tensors per MoE layer.
    assert len(trainable) == 2 * 2 * _num_moe_layers(candidate)
    ours = _assert_step_matches_eager(candidate, eager, _batch())
    assert all(ours[n] is not None and ours[n].abs().sum() > 0 for n in trainable)
    assert moekit_calls.count("moe_experts") == _num_moe_layers(candidate)


# --------------------------------------------------------------------------------------------------
# Name-based tools of transformers: TP plans, missing keys on reload, from_pretrained
# --------------------------------------------------------------------------------------------------


def _applying(model_class):
    """`model_class` with apply_moekit run inside its construction (so inside from_pretrained, before
    the weights are loaded), as a plugin or a subclass applying it in `post_init` does."""

    class Applying(model_class):
        def post_init(self):
            super().post_init()
            apply_moekit(self)

    Applying.__name__ = model_class.__name__
    return Applying


def _unused_plan_entries(plan: dict, module) -> set[str]:
    """The entries of a TP/EP plan that name no parameter, buffer or module of `module`."""
    from transformers.distributed.tensor_parallel import _get_parameter_tp_plan

    params = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    modules = {n for n, _ in module.named_modules()}
    return {
        pattern
        for pattern in plan
        if not any(_get_parameter_tp_plan(p, {pattern: ""}, is_weight=True) is not None for p in params)
        and not any(_get_parameter_tp_plan(m, {pattern: ""}, is_weight=False) is not None for m in modules)
    }


@pytest.mark.parametrize("name", MODELS)
def test_tp_and_ep_plan_entries_match_parameters(name):
    """transformers' test_tp_plan_matches_params (with its first layer dense where the model has
    dense layers), and the same of the expert-parallel plan: every entry names a parameter or module."""
    dense_first = {"first_k_dense_replace": 1, "mlp_only_layers": [0]} if name in ("qwen2_moe", "qwen3_moe") else {}
    if name == "deepseek_v3":
        dense_first = {"first_k_dense_replace": 1}
    model = apply_moekit(_model(name, **dense_first))
    ep_plan = model.config.base_model_ep_plan or {}
    assert any("experts.gate_up_proj" in pattern for pattern in [*model.tp_plan, *ep_plan])
    assert not _unused_plan_entries(model.tp_plan, model), "TP-plan entries not valid"
    assert not _unused_plan_entries(ep_plan, model.base_model), "EP-plan entries not valid"


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_reload_reports_every_missing_key(tmp_path, name):
    """transformers' test_model_weights_reload_no_missing_tied_weights, apply_moekit inside the
    construction: a checkpoint without any of the weights reports every parameter missing, no other."""
    from safetensors.torch import save_file

    cls = _applying(type(_model(name)))
    model = cls(_config(name))
    assert any(isinstance(m, MoekitExperts) for m in model.modules())
    model.save_pretrained(tmp_path)
    save_file({"tensor": torch.tensor([1, 2])}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert any(isinstance(m, MoekitExperts) for m in reloaded.modules())
    params = {n for n, _ in reloaded.named_parameters()} | {n for n, _ in reloaded.named_buffers()}
    missing = set(info["missing_keys"])
    ptrs = collections.defaultdict(list)
    for key, tensor in reloaded.state_dict().items():
        ptrs[tensor.untyped_storage().data_ptr()].append(key)
    tied = {k for keys in ptrs.values() if len(keys) > 1 for k in keys}
    assert missing - params - tied == set()
    persistent = {n for n in params if n in reloaded.state_dict()}
    assert persistent - missing - tied == set()
    assert any(k.endswith("experts.gate_up_proj") for k in missing)


@pytest.mark.parametrize("name", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("when", ["inside", "after"])
def test_from_pretrained_with_apply_moekit(tmp_path, name, when, moekit_calls):
    """A plain checkpoint loads into a model converted inside from_pretrained (its construction) or
    after it: no missing or unexpected key, every tensor bit for bit, moekit running the experts."""
    plain = _model(name)
    plain.save_pretrained(tmp_path)
    cls = type(plain)
    if when == "inside":
        loaded, info = _applying(cls).from_pretrained(tmp_path, output_loading_info=True, dtype=torch.float32)
    else:
        loaded, info = cls.from_pretrained(tmp_path, output_loading_info=True, dtype=torch.float32)
        apply_moekit(loaded)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert loaded.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in plain.state_dict().items())
    _assert_step_matches_eager(loaded, plain, _batch())
    assert moekit_calls.count("moe_experts") == _num_moe_layers(loaded)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("grouped", [True, False], ids=["model-layout", "per-expert"])
def test_save_pretrained_round_trips_bitwise(tmp_path, name, grouped):
    model = apply_moekit(_model(name), single_grouped_weight=grouped)
    model.save_pretrained(tmp_path / "moekit")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moekit", dtype=torch.float32)
    assert not any(isinstance(m, MoekitExperts) for m in reloaded.modules())
    saved, state = reloaded.state_dict(), model.state_dict()
    assert list(saved) == list(state)
    assert all(torch.equal(saved[k], state[k]) for k in state)
    # And back: the plain model's files into a converted one.
    reloaded.save_pretrained(tmp_path / "plain")
    again = type(reloaded).from_pretrained(tmp_path / "plain", dtype=torch.float32)
    apply_moekit(again, single_grouped_weight=grouped)
    assert all(torch.equal(again.state_dict()[k], state[k]) for k in state)


def test_from_pretrained_selects_moekit(tmp_path, moekit_calls):
    eager = _model("qwen2_moe")
    eager.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation=EXPERTS_IMPLEMENTATION, dtype=torch.float32
    )
    assert loaded.config._experts_implementation == EXPERTS_IMPLEMENTATION
    _assert_step_matches_eager(loaded, eager, _batch())
    assert moekit_calls.count("moe_experts") == 1  # one MoE layer (layer 1 is dense), one forward

    # The config attribute selects it too, and set_experts_implementation switches back and forth.
    config = transformers.AutoConfig.from_pretrained(tmp_path, experts_implementation=EXPERTS_IMPLEMENTATION)
    assert config._experts_implementation == EXPERTS_IMPLEMENTATION
    loaded.set_experts_implementation("eager")
    moekit_calls.clear()
    loaded(input_ids=_batch())
    assert not moekit_calls


def test_pickled_model_loads_again():
    model = apply_moekit(_model("mixtral"))
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__qualname__ == "MoekitMixtralExperts"
    assert hf.MoekitMixtralExperts is type(experts)  # how pickle finds the class again
    again = pickle.loads(pickle.dumps(model))
    assert type(again.model.layers[0].mlp.experts) is type(experts)
    ids = _batch()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


# --------------------------------------------------------------------------------------------------
# Idempotence and refusals
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_apply_moekit_twice_is_idempotent(name):
    """A second call with the same arguments changes nothing (same modules, same parameters, same
    step); a call asking for other settings says the model was already converted."""
    eager = _model(name)
    candidate = apply_moekit(copy.deepcopy(eager))
    modules = {n: m for n, m in candidate.named_modules() if isinstance(m, MoekitExperts)}
    params = dict(candidate.named_parameters())
    assert apply_moekit(candidate) is candidate
    assert {n: m for n, m in candidate.named_modules() if isinstance(m, MoekitExperts)} == modules
    assert (
        all(p is params[n] for n, p in candidate.named_parameters())
        and params.keys() == dict(candidate.named_parameters()).keys()
    )
    _assert_step_matches_eager(candidate, eager, _batch())
    with pytest.raises(
        ValueError,
        match=r"already applied to this model with backend='auto', single_grouped_weight="
        r"True; asked now for backend='loop'",
    ):
        apply_moekit(candidate, backend="loop")
    with pytest.raises(ValueError, match=r"asked now for backend='auto', single_grouped_weight=False"):
        apply_moekit(candidate, single_grouped_weight=False)


@pytest.mark.parametrize("model", [None, "mixtral", 3], ids=["None", "str", "int"])
def test_apply_moekit_needs_a_module(model):
    msg = rf"takes a transformers model \(a torch.nn.Module\), got {type(model).__name__}"
    with pytest.raises(TypeError, match=msg):
        apply_moekit(model)


def test_apply_moekit_refuses_bad_settings():
    model = _model("olmoe")
    with pytest.raises(ValueError, match=r"^unknown backend 'cuda'; expected one of \('auto', 'loop'"):
        apply_moekit(model, backend="cuda")
    with pytest.raises(TypeError, match=r"^single_grouped_weight must be a bool \(True or False\), got 0 \(int\)"):
        apply_moekit(model, single_grouped_weight=0)
    assert not any(isinstance(m, MoekitExperts) for m in model.modules())


def test_unsupported_model_raises_with_supported_list():
    cfg = transformers.LlamaConfig(intermediate_size=32, **COMMON)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedModelError) as info:
        apply_moekit(model)
    message = str(info.value)
    assert "LlamaForCausalLM" in message
    for model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"):
        assert model_type in message


def test_unsupported_experts_module_raises():
    # A transformers MoE that apply_moekit does not claim (its experts are not in the table).
    model = _model("qwen3_moe")
    for layer in model.model.layers:
        layer.mlp.experts.__class__ = type("OtherMoeExperts", (layer.mlp.experts.__class__,), {})
    with pytest.raises(UnsupportedModelError, match="OtherMoeExperts"):
        apply_moekit(model)


def test_finetune_example_trains_lora_on_moekit_experts(tmp_path):
    """examples/finetune_transformers_moe.py with --lora: PEFT adapters on the experts of an
    apply_moekit model train (the loss goes down) and save as a PEFT adapter."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("peft")
    example = Path(__file__).resolve().parents[2] / "examples" / "finetune_transformers_moe.py"
    args = ["--steps", "8", "--batch", "4", "--seq", "16", "--lora", "4", "--lr", "1e-2", "--save", str(tmp_path)]
    out = subprocess.run([sys.executable, str(example), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "experts modules now run on moekit" in out.stdout
    summary = next(line for line in out.stdout.splitlines() if " -> " in line)
    first, last = (float(v) for v in summary.removeprefix("loss ").split(" -> "))
    assert last < first, out.stdout
    assert (tmp_path / "adapter_model.safetensors").is_file()
