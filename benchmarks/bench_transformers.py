"""transformers MoE models with moekit's experts against transformers' own: forward+backward tokens/s
and peak memory.

Models (`--models`, any of; randomly initialised, bf16, one GPU), each at its real expert width with
fewer layers and a smaller vocabulary, so that the experts dominate and a case takes seconds:
- `qwen3-30b-a3b` (default): Qwen3-MoE at Qwen3-30B-A3B's layer width (hidden 2048, 128 experts of
  ffn 768, top-8, 32 heads / 4 KV heads of 128), 4 layers;
- `gpt-oss-20b`: gpt-oss at gpt-oss-20b's layer width (hidden 2880, 32 experts of ffn 2880, top-4,
  expert biases, clamped SwiGLU with interleaved gate/up rows, weights stored transposed (N, in, out);
  64 heads / 8 KV heads of 64, sliding and full attention), 2 layers.
`--checkpointing off|on|both`: each model without and/or with activation checkpointing
(`gradient_checkpointing_enable()`: each decoder layer's forward is run again in the backward).
`--attention`: the attention implementation of every variant (transformers' `attn_implementation`):
`default` is what transformers picks for the model (gpt-oss: `eager`, which materialises the
(batch, heads, seq, seq) scores and then dominates the step at seq 2048; gpt-oss cannot take `sdpa`,
its attention sinks need `flex_attention` or a flash kernel), the others as named. The experts are
what differs between the variants; the attention is the same for all of them.

Per case (model x checkpointing), the variants timed on the same weights and tokens, in interleaved
rounds (the order rotates each round):
- `transformers_grouped_mm`: the model as transformers builds it (its default experts path,
  torch's grouped_mm): the baseline;
- `moekit_apply`: after `apply_moekit(model)` (moekit backend "auto") on a copy;
- `moekit_experts_implementation`: experts_implementation="moekit", the model's modules unchanged;
- `transformers_eager` (with --eager): the model's own per-expert loop.
Per variant: the median time of one forward+backward (next-token cross entropy, synchronized), the
tokens/s it gives, the peak memory allocated during one step (absolute and above what was allocated
before it: activations and gradients), and how far its logits are from the baseline's (bf16).

    python benchmarks/bench_transformers.py --out $OUT                       # the session's case
    python benchmarks/bench_transformers.py --models qwen3-30b-a3b gpt-oss-20b --checkpointing both \
        --rounds 2 --out $OUT                                                # both models, both ways
    python benchmarks/bench_transformers.py --smoke --out /tmp/b             # tiny models, float32, CPU

Writes OUT/transformers.json (machine, versions, commit: runner.machine): `cases`, one entry per model
and checkpointing setting with its config and variants; `variants` and
`speedup_moekit_apply_vs_grouped_mm` repeat the first case's (what the session summary reads).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import runner
import torch

NAME = "transformers"
BASELINE = "transformers_grouped_mm"


MODELS = ("qwen3-30b-a3b", "gpt-oss-20b")
CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
)


def _config(model: str, smoke: bool):
    import transformers

    if model == "gpt-oss-20b":
        if smoke:
            return transformers.GptOssConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_local_experts=8,
                num_experts_per_tok=2,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=256,
            )
        return transformers.GptOssConfig(
            vocab_size=32768,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=2,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=4096,
        )
    if smoke:
        return transformers.Qwen3MoeConfig(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=256,
        )
    return transformers.Qwen3MoeConfig(
        vocab_size=32768,
        hidden_size=2048,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    )


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, ids) -> None:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()


def _time_steps(model, ids, warmup: int, iters: int, device) -> list[float]:
    """Milliseconds of `iters` forward+backward steps after `warmup` untimed ones, each synchronized."""
    times = []
    for step in range(warmup + iters):
        _sync(device)
        start = time.perf_counter()
        _step(model, ids)
        _sync(device)
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def _memory(model, ids, device) -> dict:
    if device.type != "cuda":
        return {"peak_bytes": None, "peak_extra_bytes": None}
    model.zero_grad(set_to_none=True)
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _step(model, ids)
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    return {"peak_bytes": peak, "peak_extra_bytes": peak - before}


def _run_case(model_name: str, checkpointing: bool, args, device, dtype, batch: int, seq: int, iters: int, rounds: int):
    """One model with or without activation checkpointing: every variant's timing, memory and logits."""
    import transformers

    from moekit.integrations.transformers import EXPERTS_IMPLEMENTATION, apply_moekit

    cfg = _config(model_name, args.smoke)
    torch.manual_seed(0)
    # Built on the device: initialising billions of parameters on the host takes minutes.
    attention = {} if args.attention == "default" else {"attn_implementation": args.attention}
    with device:
        base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, **attention)
    base.train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    base.set_experts_implementation("grouped_mm")
    applied = apply_moekit(copy.deepcopy(base))
    if checkpointing:
        for model in (base, applied):
            model.gradient_checkpointing_enable()
            model.config.use_cache = False

    # name -> (model, experts implementation to set on it before each use, or None)
    variants = {
        BASELINE: (base, "grouped_mm"),
        "moekit_apply": (applied, None),
        "moekit_experts_implementation": (base, EXPERTS_IMPLEMENTATION),
    }
    if args.eager:
        variants["transformers_eager"] = (base, "eager")

    def use(name):
        model, impl = variants[name]
        if impl is not None:
            model.set_experts_implementation(impl)
        return model

    results = {name: {"status": "ok", "reason": None, "ms_steps": []} for name in variants}
    with torch.no_grad():
        reference = use(BASELINE)(input_ids=ids).logits.float()
    for name, r in results.items():
        try:
            model = use(name)
            with torch.no_grad():
                logits = model(input_ids=ids).logits.float()
            r["logits_rel_diff_vs_grouped_mm"] = ((logits - reference).norm() / reference.norm()).item()
            _step(model, ids)  # compilation and tuning, outside the timing
            r.update(_memory(model, ids, device))
        except Exception as exc:  # one broken variant must not lose the others
            r["status"], r["reason"] = "error", runner.error_reason(exc)
    del reference
    names = [n for n in variants if results[n]["status"] == "ok"]
    for rnd in range(rounds):
        k = rnd % max(len(names), 1)
        for name in names[k:] + names[:k]:
            try:
                results[name]["ms_steps"] += _time_steps(use(name), ids, 1, iters, device)
            except Exception as exc:
                results[name]["status"], results[name]["reason"] = "error", f"round {rnd}: {runner.error_reason(exc)}"
    tokens = batch * seq
    for r in results.values():
        if r["ms_steps"]:
            r["fwd_bwd_ms"] = statistics.median(r["ms_steps"])
            r["tokens_per_s"] = tokens / r["fwd_bwd_ms"] * 1e3
    base_tps = results[BASELINE].get("tokens_per_s")
    print(
        f"== {model_name}, attention {base.config._attn_implementation}, activation checkpointing "
        f"{'on' if checkpointing else 'off'}, {tokens} tokens",
        flush=True,
    )
    for name, r in results.items():
        r["x_grouped_mm"] = r["tokens_per_s"] / base_tps if r.get("tokens_per_s") and base_tps else None
        peak, peak_base = r.get("peak_extra_bytes"), results[BASELINE].get("peak_extra_bytes")
        r["peak_extra_x_grouped_mm"] = peak / peak_base if peak is not None and peak_base else None
        ms, tps = r.get("fwd_bwd_ms"), r.get("tokens_per_s")
        print(
            f"{name:32s} "
            + (f"{ms:9.2f} ms {tps:12.0f} tokens/s x{r['x_grouped_mm']:.3f}" if ms else " " * 40)
            + (f"  peak+ {peak / 2**30:6.2f} GiB" if peak is not None else "")
            + (
                f"  logits rel diff {r['logits_rel_diff_vs_grouped_mm']:.2e}"
                if "logits_rel_diff_vs_grouped_mm" in r
                else ""
            )
            + (f"  [{r['status']}: {r['reason'][:160]}]" if r["reason"] else ""),
            flush=True,
        )
    base_attention = base.config._attn_implementation
    variants.clear()
    del base, applied
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "model": model_name,
        "architecture": f"{type(cfg).__name__.removesuffix('Config')}ForCausalLM (random init)",
        "activation_checkpointing": checkpointing,
        "attention": base_attention,
        "config": {k: getattr(cfg, k) for k in CONFIG_KEYS if hasattr(cfg, k)},
        "variants": results,
        "speedup_moekit_apply_vs_grouped_mm": results["moekit_apply"].get("x_grouped_mm"),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for transformers.json")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny models, float32, CPU allowed: proves the script runs"
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=[MODELS[0]], help="models to time, in order")
    parser.add_argument(
        "--checkpointing", choices=("off", "on", "both"), default="off", help="activation checkpointing in each model"
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median over all steps is kept)")
    parser.add_argument(
        "--attention",
        choices=("default", "eager", "sdpa", "flex_attention"),
        default="default",
        help="attention implementation of every variant (default: transformers' choice for the model)",
    )
    parser.add_argument("--eager", action="store_true", help="also time transformers' (slow) per-expert loop")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if not args.smoke and device.type != "cuda":
        raise SystemExit("the realistic-width run needs a GPU; use --smoke for a CPU run")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    batch, seq, iters, rounds = (2, 32, 1, 2) if args.smoke else (args.batch, args.seq, args.iters, args.rounds)
    start = time.monotonic()
    settings = {"off": (False,), "on": (True,), "both": (False, True)}[args.checkpointing]
    cases = [
        _run_case(model, ckpt, args, device, dtype, batch, seq, iters, rounds)
        for model in args.models
        for ckpt in settings
    ]
    first = cases[0]
    result = {
        "meta": {
            **runner.machine(device),
            "dtype": str(dtype).removeprefix("torch."),
            "smoke": args.smoke,
            "model": first["architecture"],
            "config": first["config"],
            "batch": batch,
            "seq": seq,
            "tokens_per_step": batch * seq,
            "iters": iters,
            "rounds": rounds,
            "timing": "median wall time of one forward+backward (cross-entropy loss), synchronized, "
            "over all rounds' steps; variants in interleaved rounds",
            "checkpointing": "transformers' gradient_checkpointing_enable() (non-reentrant torch.utils.checkpoint "
            "per decoder layer) where a case has activation_checkpointing",
            "wall_s": round(time.monotonic() - start, 1),
        },
        "cases": cases,
        "variants": first["variants"],
        "speedup_moekit_apply_vs_grouped_mm": first["speedup_moekit_apply_vs_grouped_mm"],
    }
    runner.write_json(args.out / f"{NAME}.json", result)
    return result


if __name__ == "__main__":
    main()
