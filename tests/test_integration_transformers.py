"""Hugging Face transformers MoE models on moekit experts: equal logits and gradients.

Each model is built small and randomly initialised from a config written here (no downloads), in
float32 on CPU. The reference is the model's own eager experts loop (experts_implementation="eager").
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.integrations.transformers import (  # noqa: E402
    EXPERTS_IMPLEMENTATION,
    SUPPORTED_EXPERTS,
    ExpertsLayout,
    MoekitExperts,
    UnsupportedModelError,
    apply_moekit,
)

REL_TOL = 1e-5
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


def _config(name: str):
    if name == "mixtral":
        return transformers.MixtralConfig(intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, **COMMON)
    if name == "qwen2_moe":
        # Layer 1 dense (mlp_only_layers): the integration must leave it alone.
        return transformers.Qwen2MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            **COMMON,
        )
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            head_dim=8,
            **COMMON,
        )
    if name == "olmoe":
        return transformers.OlmoeConfig(intermediate_size=16, num_experts=8, num_experts_per_tok=2, **COMMON)
    if name == "deepseek_v3":
        # Layer 0 dense (first_k_dense_replace=1), layer 1 MoE with grouped top-k, routed scaling,
        # expert score bias and a shared expert.
        return transformers.DeepseekV3Config(
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
    if name == "gpt_oss":
        return transformers.GptOssConfig(
            intermediate_size=24,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **COMMON,
        )
    raise KeyError(name)


MODELS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


def _model(name: str, experts_implementation: str = "eager", seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        _config(name), experts_implementation=experts_implementation, torch_dtype=torch.float32
    )
    with torch.no_grad():
        # Larger than the init's 0.02 so the experts matter in the logits (and gpt-oss's clamp at 7
        # is reached); biases and the expert-score bias nonzero so their paths are exercised.
        for pname, p in model.named_parameters():
            std = 0.5 if "experts" in pname else 0.2
            p.normal_(0.0, std) if "norm" not in pname else p.uniform_(0.5, 1.5)
        for bname, b in model.named_buffers():
            if "e_score_correction_bias" in bname:
                b.normal_(0.0, 0.2)
    return model


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 10), generator=g)


def _forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _grads_in_model_layout(model) -> dict[str, torch.Tensor | None]:
    """Gradients keyed by the unconverted model's parameter names."""
    grads = {}
    moekit_prefixes = []
    for mname, module in model.named_modules():
        if isinstance(module, MoekitExperts):
            moekit_prefixes.append(mname + ".")
            for tname, g in module.model_layout_tensors(grads=True).items():
                grads[f"{mname}.{tname}"] = g
    for pname, p in model.named_parameters():
        if not any(pname.startswith(prefix) for prefix in moekit_prefixes):
            grads[pname] = p.grad
    return grads


def _assert_same_training_step(reference, candidate, ids):
    ref_logits = _forward_backward(reference, ids)
    logits = _forward_backward(candidate, ids)
    assert _rel_err(logits, ref_logits) <= REL_TOL
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    grads = _grads_in_model_layout(candidate)
    assert grads.keys() == ref_grads.keys()
    for pname, ref_grad in ref_grads.items():
        assert ref_grad is not None, pname
        assert grads[pname] is not None, pname
        assert grads[pname].shape == ref_grad.shape, pname
        assert _rel_err(grads[pname], ref_grad) <= REL_TOL, pname
    return logits, ref_logits


@pytest.mark.parametrize("name", MODELS)
def test_apply_moekit_matches_model(name):
    reference = _model(name)
    candidate = copy.deepcopy(reference)
    experts_before = {n: m for n, m in candidate.named_modules() if type(m).__name__ in SUPPORTED_EXPERTS}
    assert experts_before
    apply_moekit(candidate)

    for mname, old in experts_before.items():
        new = candidate.get_submodule(mname)
        assert isinstance(new, MoekitExperts)
        layout = SUPPORTED_EXPERTS[type(old).__name__][1]
        mlp = new.grouped_mlp
        assert mlp.hidden_size == reference.config.hidden_size
        assert 2 * mlp.ffn_hidden_size == mlp.fc1.out_features == 2 * mlp.fc2.in_features
        assert mlp.fc1.in_features == mlp.fc2.out_features == reference.config.hidden_size
        if not layout.transposed:
            # Same layout: the model's own Parameters, not copies.
            assert mlp.fc1.weight is old.gate_up_proj
            assert mlp.fc2.weight is old.down_proj
        else:
            assert torch.equal(mlp.fc1.weight, old.gate_up_proj.transpose(1, 2))
            assert torch.equal(mlp.fc2.weight, old.down_proj.transpose(1, 2))
            assert mlp.fc1.bias is old.gate_up_proj_bias
            assert mlp.fc2.bias is old.down_proj_bias
            assert mlp.glu_interleave_size == 1 and mlp.activation == "clamped_swiglu"
    # Routers, shared experts and dense MLPs were left as they were.
    touched = {n for n, m in candidate.named_modules() if isinstance(m, MoekitExperts)}
    assert touched == set(experts_before)

    _assert_same_training_step(reference, candidate, _batch())


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
    reference = _model("gpt_oss")
    candidate = copy.deepcopy(reference)
    wrong = ExpertsLayout(transposed=True, glu_interleave_size=None, activation="clamped_swiglu", has_bias=True)
    monkeypatch.setitem(SUPPORTED_EXPERTS, "GptOssExperts", ("gpt_oss", wrong))
    apply_moekit(candidate)
    ids = _batch()
    assert _rel_err(_forward_backward(candidate, ids), _forward_backward(reference, ids)) > 1e-3


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_apply_moekit_discrete_weights(name):
    reference = _model(name)
    candidate = apply_moekit(copy.deepcopy(reference), single_grouped_weight=False, backend="loop")
    experts = next(m for m in candidate.modules() if isinstance(m, MoekitExperts))
    assert not experts.grouped_mlp.fc1.single_grouped_weight
    assert hasattr(experts.grouped_mlp.fc1, "weight0")
    _assert_same_training_step(reference, candidate, _batch())


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_apply_moekit_keeps_state_dict(name):
    reference = _model(name)
    candidate = apply_moekit(copy.deepcopy(reference))
    ref_state, state = reference.state_dict(), candidate.state_dict()
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert state[key].shape == value.shape, key
        assert torch.equal(state[key], value), key
    # And the model's own checkpoint loads into the converted model (other values, to see them land).
    other = _model(name, seed=7)
    missing, unexpected = candidate.load_state_dict(other.state_dict(), strict=True)
    assert not missing and not unexpected
    ids = _batch()
    _assert_same_training_step(other, candidate, ids)


def test_apply_moekit_optimizer_step_updates_model_parameters():
    reference = _model("olmoe")
    candidate = apply_moekit(copy.deepcopy(reference))
    for model in (reference, candidate):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _forward_backward(model, _batch())
        opt.step()
    _assert_same_training_step(reference, candidate, _batch(seed=3))


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
    cfg = transformers.Qwen3MoeConfig(
        intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8, **COMMON
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    for layer in model.model.layers:
        layer.mlp.experts.__class__ = type("OtherMoeExperts", (layer.mlp.experts.__class__,), {})
    with pytest.raises(UnsupportedModelError, match="OtherMoeExperts"):
        apply_moekit(model)


@pytest.mark.parametrize("name", MODELS)
def test_experts_implementation_moekit_matches_eager(name):
    reference = _model(name, "eager")
    candidate = _model(name, EXPERTS_IMPLEMENTATION)
    candidate.load_state_dict(reference.state_dict())
    assert candidate.config._experts_implementation == EXPERTS_IMPLEMENTATION
    _assert_same_training_step(reference, candidate, _batch())


def test_from_pretrained_selects_moekit(tmp_path, monkeypatch):
    from transformers.integrations.moe import ExpertsInterface

    reference = _model("qwen2_moe")
    reference.save_pretrained(tmp_path)
    calls = []
    moekit_forward = ExpertsInterface._global_mapping[EXPERTS_IMPLEMENTATION]

    def counting_forward(*args, **kwargs):
        calls.append(1)
        return moekit_forward(*args, **kwargs)

    monkeypatch.setitem(ExpertsInterface._global_mapping, EXPERTS_IMPLEMENTATION, counting_forward)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation=EXPERTS_IMPLEMENTATION, torch_dtype=torch.float32
    )
    assert loaded.config._experts_implementation == EXPERTS_IMPLEMENTATION
    _assert_same_training_step(reference, loaded, _batch())
    assert len(calls) == 1  # one MoE layer (layer 1 is dense), one forward

    # The config attribute selects it too, and set_experts_implementation switches back and forth.
    config = transformers.AutoConfig.from_pretrained(tmp_path, experts_implementation=EXPERTS_IMPLEMENTATION)
    assert config._experts_implementation == EXPERTS_IMPLEMENTATION
    loaded.set_experts_implementation("eager")
    calls.clear()
    loaded(input_ids=_batch())
    assert not calls


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_save_pretrained_after_apply_moekit_round_trips(tmp_path, name):
    model = apply_moekit(_model(name))
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="eager", torch_dtype=torch.float32
    )
    saved, state = reloaded.state_dict(), model.state_dict()
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in state)
    ids = _batch()
    with torch.no_grad():
        assert _rel_err(reloaded(input_ids=ids).logits, model(input_ids=ids).logits) <= REL_TOL


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_apply_moekit_twice_is_idempotent(name):
    """A second call with the same arguments changes nothing (same modules, same parameters, same
    step); a call asking for other settings says the model was already converted."""
    reference = _model(name)
    candidate = apply_moekit(copy.deepcopy(reference))
    modules = {n: m for n, m in candidate.named_modules() if isinstance(m, MoekitExperts)}
    params = dict(candidate.named_parameters())
    assert apply_moekit(candidate) is candidate
    assert {n: m for n, m in candidate.named_modules() if isinstance(m, MoekitExperts)} == modules
    assert (
        all(p is params[n] for n, p in candidate.named_parameters())
        and params.keys() == dict(candidate.named_parameters()).keys()
    )
    _assert_same_training_step(reference, candidate, _batch())
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
