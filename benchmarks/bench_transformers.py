"""A transformers MoE model before and after `apply_moekit`: forward+backward tokens/s.

The model is Qwen3-MoE at Qwen3-30B-A3B's layer width (hidden 2048, 128 experts of ffn 768, top-8,
32 heads / 4 KV heads of 128) with fewer layers and a smaller vocabulary, so that the experts
dominate and the run fits in a couple of minutes; randomly initialised, bf16, on one GPU.
Variants timed on the same weights and tokens:
- `transformers_grouped_mm`: the model as transformers builds it (its default experts path,
  torch's grouped_mm);
- `transformers_eager`: the model's own per-expert loop (experts_implementation="eager");
- `moekit_apply`: after `apply_moekit(model)` (moekit backend "auto");
- `moekit_experts_implementation`: experts_implementation="moekit", the model's modules unchanged.
Each also reports how far its logits are from the grouped_mm variant's (bf16).

Usage: python benchmarks/bench_transformers.py --out DIR [--tiny]   (--tiny: a CPU smoke run)
Writes DIR/bench_transformers.json with the GPU name, versions and the git commit.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def _git_commit() -> str:
    try:
        if os.environ.get("MOEKIT_BENCH_COMMIT"):
            return os.environ["MOEKIT_BENCH_COMMIT"]
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        # The GPU machine gets a copy of the tree without .git; the caller names the commit.
        return os.environ.get("MOEKIT_BENCH_COMMIT", "unknown")


def _config(tiny: bool):
    import transformers

    if tiny:
        return transformers.Qwen3MoeConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256,
        )
    return transformers.Qwen3MoeConfig(
        vocab_size=32768, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=4096,
    )


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_fwd_bwd(model, ids, warmup: int, iters: int, device) -> float:
    """Median seconds of one forward + backward (loss = next-token cross entropy)."""
    times = []
    for step in range(warmup + iters):
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory for bench_transformers.json")
    parser.add_argument("--tiny", action="store_true", help="tiny model, float32, CPU allowed: a smoke test")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--skip-eager", action="store_true", help="do not time the (slow) per-expert loop")
    args = parser.parse_args()

    import transformers

    import moekit
    from moekit.integrations.transformers import EXPERTS_IMPLEMENTATION, apply_moekit

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and device.type != "cuda":
        raise SystemExit("the realistic-width run needs a GPU; use --tiny for a CPU smoke run")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    batch, seq, iters, warmup = (2, 32, 2, 1) if args.tiny else (args.batch, args.seq, args.iters, 2)

    cfg = _config(args.tiny)
    torch.manual_seed(0)
    # Built on the device: initialising billions of parameters on the host takes minutes.
    with device:
        base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    base.train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    tokens = batch * seq

    variants = {}
    with torch.no_grad():
        reference_logits = base(input_ids=ids).logits.float()

    def run(name, model):
        seconds = _time_fwd_bwd(model, ids, warmup, iters, device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        diff = ((logits - reference_logits).norm() / reference_logits.norm()).item()
        variants[name] = {"fwd_bwd_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
                          "logits_rel_diff_vs_grouped_mm": diff}
        print(f"{name:32s} {seconds * 1e3:9.2f} ms  {tokens / seconds:12.0f} tokens/s  logits rel diff {diff:.2e}",
              flush=True)

    base.set_experts_implementation("grouped_mm")
    run("transformers_grouped_mm", base)
    if not args.skip_eager:
        base.set_experts_implementation("eager")
        run("transformers_eager", base)
    base.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    run("moekit_experts_implementation", base)
    base.set_experts_implementation("grouped_mm")
    moekit_model = apply_moekit(copy.deepcopy(base))
    run("moekit_apply", moekit_model)

    result = {
        "benchmark": "bench_transformers",
        "model": "Qwen3MoeForCausalLM (random init)",
        "config": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "num_key_value_heads", "head_dim", "moe_intermediate_size",
                                                "num_experts", "num_experts_per_tok")},
        "tiny": args.tiny,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "seq": seq,
        "tokens_per_step": tokens,
        "iters": iters,
        "warmup": warmup,
        "timing": "median wall time of forward+backward (cross-entropy loss), synchronised",
        "variants": variants,
        "speedup_moekit_apply_vs_grouped_mm": variants["moekit_apply"]["tokens_per_s"]
        / variants["transformers_grouped_mm"]["tokens_per_s"],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": transformers.__version__,
        "moekit": moekit.__version__,
        "git_commit": _git_commit(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_transformers.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
