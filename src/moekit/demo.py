"""`moekit demo`: train a small MoE language model built from moekit layers, then round-trip its
checkpoint between expert layouts.

The task is generated in-process. Each sequence is written in one of several "dialects": it starts
with the dialect's marker token, then a random token, then every next token follows the dialect's
own rule `t' = (a * t + b) mod V`: the model must carry the dialect along the sequence (attention)
and apply one of several rules, which an MoE layer can split over experts that each see a subset of
(dialect, token) pairs; the demo prints how the first layer's router spreads each dialect. After the
random start everything is predictable, so the best possible loss is `log(V) / (L - 1)` per
predicted token.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moekit._progress import Progress
from moekit.checkpoint import load_safetensors, save_safetensors
from moekit.nn.moe_layer import MoELayer
from moekit.ops.grouped_linear import BACKENDS
from moekit.ops.quantize import QUANTIZATIONS
from moekit.validation import check_choice, check_int, check_positive_int

# Optional (`pip install 'moekit[plot]'`); imported with the module, before the demo's work starts. A
# matplotlib that is installed but fails to import (a broken build raises SystemError from its C
# extension) costs the plot, said in one line, never the training run.
_NO_MATPLOTLIB: str | None
try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    _NO_MATPLOTLIB = None
except ImportError:
    _NO_MATPLOTLIB = "matplotlib is not installed, so no loss plot was drawn (pip install 'moekit[plot]')"
except Exception as exc:
    _NO_MATPLOTLIB = f"matplotlib failed to import ({type(exc).__name__}: {exc}), so no loss plot was drawn"


@dataclass
class DemoConfig:
    vocab: int = 96
    dialects: int = 6
    seq_len: int = 32
    hidden: int = 64
    ffn: int = 128
    heads: int = 4
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    batch: int = 48
    steps: int = 400
    lr: float = 3e-3
    aux_loss_coef: float = 1e-2
    seed: int = 0


class DialectTask:
    """Synthetic sequences; tokens [0, dialects) are dialect markers, the rest are words."""

    def __init__(self, cfg: DemoConfig, generator: torch.Generator) -> None:
        self.cfg = cfg
        self.words = cfg.vocab - cfg.dialects
        # Odd multipliers coprime with the word count keep every rule a permutation of the words.
        mults = [a for a in range(3, 10 * cfg.dialects, 2) if math.gcd(a, self.words) == 1][: cfg.dialects]
        self.mult = torch.tensor(mults)
        self.add = torch.randint(1, self.words, (cfg.dialects,), generator=generator)

    def batch(self, n: int, generator: torch.Generator) -> torch.Tensor:
        cfg = self.cfg
        dialect = torch.randint(0, cfg.dialects, (n,), generator=generator)
        word = torch.randint(0, self.words, (n,), generator=generator)
        seq = [dialect, word + cfg.dialects]
        for _ in range(cfg.seq_len - 2):
            word = (self.mult[dialect] * word + self.add[dialect]) % self.words
            seq.append(word + cfg.dialects)
        return torch.stack(seq, dim=1)

    def loss_floor(self) -> float:
        return math.log(self.words) / (self.cfg.seq_len - 1)


class Block(nn.Module):
    def __init__(
        self, cfg: DemoConfig, single_grouped_weight: bool, backend: str, quantization: str | None = None
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden)
        self.attn = nn.MultiheadAttention(cfg.hidden, cfg.heads, batch_first=True)
        self.norm2 = nn.LayerNorm(cfg.hidden)
        self.moe = MoELayer(
            cfg.hidden,
            cfg.ffn,
            cfg.experts,
            cfg.top_k,
            aux_loss_coef=cfg.aux_loss_coef,
            single_grouped_weight=single_grouped_weight,
            backend=backend,
            quantization=quantization,
        )

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(
        self,
        cfg: DemoConfig,
        single_grouped_weight: bool = True,
        backend: str = "auto",
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg, single_grouped_weight, backend, quantization) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        mask = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.embed(tokens) + self.pos[:seq]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def routing_table(model: TinyMoELM, task: DialectTask, tokens: torch.Tensor) -> torch.Tensor:
    """(dialects, experts): share of each dialect's routed copies in the first MoE layer."""
    cfg = task.cfg
    block = model.blocks[0]
    assert isinstance(block, Block)  # (an nn.ModuleList item is typed Module)
    x = model.embed(tokens) + model.pos[: tokens.shape[1]]
    mask = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).triu(1)
    h = block.norm1(x)
    x = x + block.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
    _, ids, _ = block.moe.route(block.norm2(x).reshape(-1, cfg.hidden))
    dialect = tokens[:, :1].expand(-1, tokens.shape[1]).reshape(-1)
    table = torch.zeros(cfg.dialects, cfg.experts)
    for k in range(ids.shape[1]):
        table.index_put_((dialect.cpu(), ids[:, k].cpu()), torch.ones(dialect.numel()), accumulate=True)
    return table / table.sum(1, keepdim=True)


def run_demo(
    steps: int = 400,
    device: str = "auto",
    backend: str = "auto",
    out: str = "moekit-demo",
    seed: int = 0,
    quantization: str | None = None,
) -> dict:
    """Train, save (single grouped layout), reload (discrete layout), compare; returns the summary.

    quantization: None, or "fp8_block", "fp8_rowwise", "mxfp8": the MoE layers' expert linears on
    quantized operands (`moekit.MoELayer`'s reference path: quantize, dequantize, compute in float32 on
    the CPU); the reloaded model runs with the same quantization.

    Raises ValueError (TypeError for a value of the wrong type), before training or writing anything,
    for steps < 1, a seed torch cannot take, a device this torch cannot use, a backend that cannot run
    on it, an unknown quantization, or an `out` that is an existing file (it must be a folder, new or
    existing)."""
    steps = check_positive_int("--steps", steps)
    seed = check_int("--seed", seed)
    if not -(2**63) <= seed < 2**63 - 1:  # torch's seed range; the evaluation data takes seed + 1
        raise ValueError(f"--seed must be an int from -2**63 to 2**63 - 2, got {seed}")
    backend = check_choice("--backend", backend, BACKENDS)
    if quantization is not None:
        quantization = check_choice("--quantization", quantization, tuple(q for q in QUANTIZATIONS if q))
    dev = _demo_device(device)
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(
            f"--out {out} is an existing file; expected a folder (new or existing) for the checkpoint, plot and summary"
        )
    cfg = DemoConfig(steps=steps, seed=seed)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    task = DialectTask(cfg, gen)
    existing = next(p for p in (out_dir.absolute(), *out_dir.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {existing} is not writable; choose a folder you can write to")
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        # The model's ops are small (a millisecond or less): intra-op threads gain little on them, and
        # on a machine busy with other work their barriers wait for descheduled threads, many times
        # longer than the work itself. One thread keeps the demo's pace whatever else the machine does.
        torch.set_num_threads(1)
    try:
        return _train_save_reload(cfg, task, gen, dev, backend, out_dir, quantization)
    finally:
        torch.set_num_threads(threads)


def _train_save_reload(
    cfg: DemoConfig,
    task: DialectTask,
    gen: torch.Generator,
    dev: torch.device,
    backend: str,
    out_dir: Path,
    quantization: str | None = None,
) -> dict:
    model = TinyMoELM(cfg, single_grouped_weight=True, backend=backend, quantization=quantization).to(dev)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.1)
    eval_tokens = task.batch(256, torch.Generator().manual_seed(cfg.seed + 1)).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"moekit demo: {cfg.layers}-layer MoE LM, {cfg.experts} experts top-{cfg.top_k}, {n_params / 1e3:.0f}k "
        f"parameters, {cfg.dialects} dialects, device={dev}, backend={backend}"
        + (f", quantization={quantization} (reference path)" if quantization else "")
    )
    print(f"best possible loss (only the random start is unpredictable): {task.loss_floor():.3f}")

    losses = []
    progress = Progress(cfg.steps, quiet_when_piped=False)
    tokens_seen, t0 = 0, time.perf_counter()
    for step in range(1, cfg.steps + 1):
        batch = task.batch(cfg.batch, gen).to(dev)
        loss = lm_loss(model, batch)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        losses.append(loss.item())
        tokens_seen += batch[:, :-1].numel()
        rate = tokens_seen / (time.perf_counter() - t0)
        progress.update(step, f"loss {losses[-1]:.3f} {rate:,.0f} tok/s")
    train_s = time.perf_counter() - t0

    model.eval()
    with torch.no_grad():
        eval_loss = lm_loss(model, eval_tokens).item()
    out_dir.mkdir(parents=True, exist_ok=True)  # only now: a refusal in the first step writes nothing
    ckpt = out_dir / "model.safetensors"
    save_safetensors(model, ckpt)

    reloaded = TinyMoELM(cfg, single_grouped_weight=False, backend=backend, quantization=quantization).to(dev)
    load_safetensors(reloaded, ckpt)
    reloaded.eval()
    with torch.no_grad():
        eval_loss_reloaded = lm_loss(reloaded, eval_tokens).item()
    layouts = sorted({k.rsplit(".", 1)[-1] for k in reloaded.state_dict() if ".experts.fc1." in k})

    table = routing_table(model, task, eval_tokens)
    print("\nrouting (first MoE layer): share of each dialect's routed copies per expert")
    print("dialect " + " ".join(f"e{e:<4d}" for e in range(cfg.experts)))
    for d in range(cfg.dialects):
        print(f"{d:7d} " + " ".join(f"{v:5.2f}" for v in table[d].tolist()))

    plot = _plot_losses(losses, task.loss_floor(), out_dir / "loss.png")
    summary = {
        "steps": cfg.steps,
        "device": str(dev),
        "backend": backend,
        "quantization": quantization,
        "train_seconds": round(train_s, 2),
        "tokens_per_second": round(tokens_seen / train_s, 1),
        "first_loss": losses[0],
        "final_train_loss": losses[-1],
        "loss_floor": task.loss_floor(),
        "eval_loss_single_grouped": eval_loss,
        "eval_loss_reloaded_discrete": eval_loss_reloaded,
        "checkpoint": str(ckpt),
        "reloaded_expert_keys": layouts,
        "loss_plot": str(plot) if plot else None,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\nsummary")
    print(f"  trained {cfg.steps} steps in {train_s:.1f}s ({summary['tokens_per_second']:,.0f} tokens/s)")
    print(f"  train loss {losses[0]:.3f} -> {losses[-1]:.3f} (floor {task.loss_floor():.3f})")
    print(f"  eval loss, single grouped weights  : {eval_loss:.6f}")
    print(
        f"  eval loss, reloaded as weight0..{cfg.experts - 1}: {eval_loss_reloaded:.6f}"
        f"  ({'identical' if eval_loss == eval_loss_reloaded else 'DIFFERENT'})"
    )
    print(f"  checkpoint {ckpt}; loss curve {plot if plot else '(not drawn: pip install matplotlib)'}")
    if eval_loss != eval_loss_reloaded:
        raise RuntimeError("the checkpoint round trip changed the evaluation loss")
    return summary


def _demo_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device; expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}, but this torch ({torch.__version__}) has no usable CUDA device; "
            "use --device cpu or auto"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}, but there are {torch.cuda.device_count()} CUDA devices")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: the demo runs on cpu or cuda")
    return dev


def _plot_losses(losses: list[float], floor: float, path: Path) -> Path | None:
    if _NO_MATPLOTLIB is not None:
        print(_NO_MATPLOTLIB)
        return None
    fig = Figure(figsize=(7, 4))  # no pyplot: no global backend or figure state
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(range(1, len(losses) + 1), losses, label="train loss", lw=1.2)
    ax.axhline(floor, color="gray", ls="--", lw=1, label=f"best possible ({floor:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_yscale("log")
    ax.set_title("moekit demo: MoE LM on the dialect task")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
