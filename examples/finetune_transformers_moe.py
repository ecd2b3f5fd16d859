"""Fine-tune a small Hugging Face transformers MoE model with moekit experts.

Builds a small Qwen3-MoE (or OLMoE / Mixtral / gpt-oss, `--model`) from a config (no download; pass
`--from-pretrained PATH` to start from a local checkpoint instead), runs its experts on moekit with
`apply_moekit`, and trains it with AdamW on a synthetic task (each sequence counts up by a step of
its own modulo the vocabulary, so the next token is predictable from the previous two). The
model's router, attention and everything else stay transformers' own, and so do its parameter
names: an optimizer built before `apply_moekit` would work as well (the expert Parameters are the
same objects), and so does PEFT: `--lora RANK` trains LoRA adapters on the experts' `gate_up_proj`
and `down_proj` (PEFT's `target_parameters`) instead of the whole model. At the end the model is
saved with `save_pretrained` in the usual transformers layout (with --lora: the adapter alone).

    python examples/finetune_transformers_moe.py --steps 60          # CPU, about a minute
    python examples/finetune_transformers_moe.py --lora 8 --lr 1e-2  # LoRA on the experts (needs peft)
    python examples/finetune_transformers_moe.py --device cuda --dtype bfloat16 --steps 200
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def build_model(name: str, vocab: int):
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    configs = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, head_dim=32, **common
        ),
        "olmoe": lambda: transformers.OlmoeConfig(intermediate_size=64, num_experts=8, num_experts_per_tok=2, **common),
        "mixtral": lambda: transformers.MixtralConfig(
            intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, **common
        ),
        "gpt_oss": lambda: transformers.GptOssConfig(
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=32,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        ),
    }
    return transformers.AutoModelForCausalLM.from_config(configs[name]())


def synthetic_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """(batch, seq) token ids: start + step * position, modulo vocab; start and step random per row."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    step = torch.randint(1, 8, (batch, 1), generator=generator)
    return (start + step * torch.arange(seq)) % vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="qwen3_moe",
        choices=("qwen3_moe", "olmoe", "mixtral", "gpt_oss"),
        help="which small MoE to build from a config (default %(default)s)",
    )
    parser.add_argument("--from-pretrained", type=Path, help="a local transformers MoE checkpoint to start from")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default %(default)s)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (default %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default %(default)s)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="parameter and compute dtype (default %(default)s)",
    )
    parser.add_argument("--backend", default="auto", help="moekit GEMM backend: auto, torch, triton, loop")
    parser.add_argument(
        "--lora", type=int, default=0, help="LoRA rank on the experts' weights with PEFT (default: full fine-tuning)"
    )
    parser.add_argument("--save", type=Path, help="save the fine-tuned model here (save_pretrained)")
    args = parser.parse_args()

    import transformers

    from moekit.integrations.transformers import MoekitExperts, apply_moekit

    torch.manual_seed(0)
    vocab = 64
    if args.from_pretrained:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.from_pretrained)
        vocab = model.config.vocab_size
    else:
        model = build_model(args.model, vocab)
    model.to(device=args.device, dtype=getattr(torch, args.dtype))
    apply_moekit(model, backend=args.backend)
    replaced = sum(isinstance(m, MoekitExperts) for m in model.modules())
    print(f"{type(model).__name__}: {replaced} experts modules now run on moekit")
    if args.lora > 0:
        import peft

        # The experts' parameters keep their transformers names, so PEFT finds them as usual.
        config = peft.LoraConfig(
            r=args.lora,
            lora_alpha=2 * args.lora,
            target_modules=[],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )
        model = peft.get_peft_model(model, config)
        model.print_trainable_parameters()

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    model.train()
    first = None
    for step in range(1, args.steps + 1):
        ids = synthetic_batch(args.batch, args.seq, vocab, generator).to(args.device)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        first = loss.item() if first is None else first
        if step % 10 == 0 or step == 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    print(f"loss {first:.4f} -> {loss.item():.4f}")
    if args.save:
        # state_dict() keeps transformers' names, so this is a regular transformers checkpoint (or,
        # with --lora, a regular PEFT adapter).
        model.save_pretrained(args.save)
        print(f"saved to {args.save}")


if __name__ == "__main__":
    main()
