"""transformers MoE models on moekit's experts on the GPU (pytest -m gpu), at each supported family's real
expert width: both ways in (`experts_implementation="moekit"` and `apply_moekit`), bfloat16, with and
without activation checkpointing, give the per-token losses and the expert parameters' gradients of transformers'
own `grouped_mm` experts within the tolerance rule (tests/conftest.py).

Each model is randomly initialised at its family's expert width (hidden size, expert ffn size, experts,
top-k, biases, activation, weight layout as transformers lays them out: gpt-oss's (N, in, out) weights
with alternating gate/up columns), with 2 decoder layers, a small vocabulary and fewer attention heads.
DeepSeek-V3 keeps 64 of its 256 routed experts (memory: the float32 reference of 256 experts of
7168 x 2048 would not fit beside the bfloat16 model). The rule's reference is the model's own eager
experts on a float32 copy of the bfloat16 weights (float32 is far below bfloat16's error), "torch's own
computation" the bfloat16 model with transformers' grouped_mm experts. Every run takes the reference's
choice of experts per token (`_pin_routing`).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import moekit.integrations.transformers as hf  # noqa: E402
from helpers import assert_within_tolerance  # noqa: E402
from moekit import set_autotune  # noqa: E402
from moekit.integrations.transformers import EXPERTS_IMPLEMENTATION, SUPPORTED_EXPERTS, apply_moekit  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 512
BATCH, SEQ = 2, 256
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=1024, tie_word_embeddings=False)


def _config(name: str):
    if name == "mixtral":  # Mixtral 8x7B
        return transformers.MixtralConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            **COMMON,
        )
    if name == "qwen2_moe":  # Qwen1.5-MoE-A2.7B
        return transformers.Qwen2MoeConfig(
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_experts=60,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            num_attention_heads=16,
            num_key_value_heads=16,
            **COMMON,
        )
    if name == "qwen3_moe":  # Qwen3-30B-A3B
        return transformers.Qwen3MoeConfig(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            **COMMON,
        )
    if name == "olmoe":  # OLMoE-1B-7B
        return transformers.OlmoeConfig(
            hidden_size=2048,
            intermediate_size=1024,
            num_experts=64,
            num_experts_per_tok=8,
            num_attention_heads=16,
            num_key_value_heads=16,
            **COMMON,
        )
    if name == "deepseek_v3":  # DeepSeek-V3's widths, 64 of its 256 routed experts; layer 0 dense
        return transformers.DeepseekV3Config(
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            n_routed_experts=64,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **COMMON,
        )
    if name == "gpt_oss":  # gpt-oss-20b
        return transformers.GptOssConfig(
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
            **COMMON,
        )
    raise KeyError(name)


MODELS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


def _experts(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in SUPPORTED_EXPERTS]


def _expert_tensors(model) -> dict[str, torch.nn.Parameter]:
    """Every expert parameter of the model's own layout (weights, and biases where the family has them)."""
    out = {}
    for i, experts in enumerate(_experts(model)):
        for pname, p in experts.named_parameters(recurse=False):
            out[f"{i}.{pname}"] = p
    return out


def _model(name: str):
    """The bfloat16 model on the GPU, experts initialised so that they matter in the loss: fc1 weights
    of std 1/sqrt(H), fc2 of 1/sqrt(F) (unit-scale activations), biases N(0, 0.1)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(_config(name), dtype=torch.bfloat16)
    model.config.use_cache = False
    with torch.no_grad():
        for experts in _experts(model):
            for p in experts.parameters(recurse=False):
                if p.dim() == 2:
                    p.normal_(0.0, 0.1)
                else:
                    transposed = SUPPORTED_EXPERTS[type(experts).__name__][1].transposed
                    fan_in = p.shape[1] if transposed else p.shape[2]
                    p.normal_(0.0, fan_in**-0.5)
    model.train()
    return model


def _pin_routing(model, chosen: list[torch.Tensor]) -> None:
    """Every experts module of the model runs with the experts `chosen` (one (T, K) index tensor per
    module, in order): an empty list is filled with the choices of the model's next forward, a full one
    replaces the model's own choices (its routing weights stay its own). bfloat16 noise in the hidden
    states flips near-tied top-k choices of a few tokens, which moves whole rows between experts (an
    error of the order of those rows' share of the gradient, far above bfloat16's); with the routes
    pinned, every run computes the same function and only the arithmetic differs."""
    record = not chosen
    for i, experts in enumerate(_experts(model)):

        def hook(module, args, kwargs, i=i):
            if "top_k_index" in kwargs:
                index = kwargs["top_k_index"]
            else:
                index = args[1]
            if record:
                chosen.append(index.detach().clone())
                return None
            assert index.shape == chosen[i].shape
            if "top_k_index" in kwargs:
                return args, {**kwargs, "top_k_index": chosen[i]}
            return (args[0], chosen[i], *args[2:]), kwargs

        experts.register_forward_pre_hook(hook, with_kwargs=True)


def _step(model, ids) -> dict[str, torch.Tensor]:
    """One training step's per-token losses and expert gradients. The loss is transformers' causal-LM
    loss (next-token cross entropy in float32, the mean over tokens); its terms are compared, not the mean:
    one number's bfloat16 error is a single draw that can land near zero on torch's side by chance (it
    did: 3.5e-7 relative, against moekit's 1.6e-5, both bfloat16 noise), which the rule would then turn
    into a bound no bfloat16 computation meets."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    per_token.mean().backward()
    out = {"per-token loss": per_token.detach()}
    for key, p in _expert_tensors(model).items():
        assert p.grad is not None, f"{key}: no gradient"
        out[key] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture
def moekit_calls(monkeypatch):
    """Counts the calls of moekit's experts op, so a test can tell that moekit ran (in both forwards of
    a checkpointed layer); with the configuration search off (its first candidate: the same results,
    no timing of candidates in a test)."""
    calls = []
    inner = hf.moe_experts

    def counting(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(hf, "moe_experts", counting)
    set_autotune(False)
    yield calls
    set_autotune(True)


@pytest.mark.parametrize("name", MODELS)
def test_real_width_both_ways_match_grouped_mm(name, moekit_calls, gpu_to_itself):
    model = _model(name)
    layers = len(_experts(model))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    chosen: list[torch.Tensor] = []
    reference_model = copy.deepcopy(model).float()
    reference_model.set_experts_implementation("eager")
    _pin_routing(reference_model, chosen)
    ref = _step(reference_model, ids)
    del reference_model
    assert len(chosen) == layers
    _pin_routing(model, chosen)

    model.set_experts_implementation("grouped_mm")
    lowp = _step(model, ids)
    assert not moekit_calls

    def check(way: str, checkpointing: bool) -> None:
        if checkpointing:
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_disable()
        before = len(moekit_calls)
        ours = _step(model, ids)
        assert len(moekit_calls) - before == layers * (2 if checkpointing else 1), (way, checkpointing)
        for key, want in ref.items():
            what = f"{name} {way} checkpointing={checkpointing}: {key}"
            assert torch.isfinite(ours[key]).all(), what
            assert_within_tolerance(ours[key], want, lowp[key], what)

    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    check("experts_implementation", False)
    check("experts_implementation", True)
    model.gradient_checkpointing_disable()
    apply_moekit(model)
    check("apply_moekit", False)
    check("apply_moekit", True)
