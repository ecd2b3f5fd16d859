"""Train a small MoE language model with FSDP2 + expert parallelism under torchrun.

Every rank holds N/EP experts of each MoE layer (`moekit.distributed.ExpertParallelMoE`), FSDP2
shards the rest over all ranks and the experts over the "dp" dim of an (ep, dp) mesh
(`moekit.distributed.apply_fsdp`, bf16 compute with fp32 parameters and reductions on GPUs), and
the model and optimizer are saved with `moekit.distributed.checkpoint` (layout- and
sharding-independent: the checkpoint loads at any other world size or EP degree). The task is
synthetic: each sequence counts up by a step of its own modulo the vocabulary, so the next token
is predictable from the previous two; the loss falls from about ln(vocab).

    torchrun --nproc-per-node 2 examples/train_distributed.py --ep 2                 # CPU, gloo
    torchrun --nproc-per-node 4 examples/train_distributed.py --ep 2 --steps 100      # ep 2 x dp 2
    torchrun --nproc-per-node 2 examples/train_distributed.py --ep 2 --device cuda    # GPUs, NCCL
    torchrun --nproc-per-node 2 examples/train_distributed.py --ep 2 --save ckpt     # then, elsewhere:
    torchrun --nproc-per-node 1 examples/train_distributed.py --ep 1 --resume ckpt   # 1 rank, all experts

Rank 0 shows a progress bar with every rank's tokens/s (each rank's own tokens over its own step
time, gathered every `--log-every` steps); at the end every rank prints its own line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    """Pre-norm residual block: causal self-attention, then the MoE layer."""

    def __init__(self, hidden: int, heads: int, moe: nn.Module):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.moe = moe

    def forward(self, x):
        h = self.norm1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: list[nn.Module], heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, moe) for moe in layers)
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int, rank: int, args, device):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 8, (args.batch, 1), generator=g)
    seq = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def progress(done: int, total: int, loss: float, rates: list[float]) -> str:
    width = 24
    filled = width * done // total
    per_rank = " ".join(f"{r:,.0f}" for r in rates)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} loss {loss:.3f} tokens/s per rank: {per_rank}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree (divides the world size)")
    parser.add_argument("--mode", choices=["dropless", "capacity"], default="dropless", help="token dispatch")
    parser.add_argument(
        "--aux-loss-coef",
        type=float,
        default=0.01,
        help="load-balancing loss coefficient (over every rank's tokens; 0: none)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo; cuda: NCCL")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--log-every", type=int, default=5, help="steps between progress updates")
    parser.add_argument("--save", default=None, help="DCP checkpoint directory to write at the end")
    parser.add_argument(
        "--resume",
        default=None,
        help="DCP checkpoint directory to start from (written by --save at any world size or --ep)",
    )
    args = parser.parse_args()
    if args.resume:
        # Refused here, in one line on every rank, before the process group and the model exist.
        from moekit.distributed.checkpoint import check_checkpoint_exists

        try:
            check_checkpoint_exists(args.resume)
        except FileNotFoundError as e:
            parser.error(f"--resume: {e}")

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if world % args.ep:
        raise SystemExit(f"--ep {args.ep} does not divide the world size {world}")

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import moekit
    from moekit.distributed import BF16_COMPUTE, ExpertParallelMoE, apply_fsdp, checkpoint

    world_mesh = init_device_mesh(device.type, (world,))
    ep_mesh = init_device_mesh(device.type, (args.ep, world // args.ep), mesh_dim_names=("ep", "dp"))
    torch.manual_seed(0)  # the same initial model on every rank
    layers = [
        ExpertParallelMoE(
            moekit.MoELayer(
                args.hidden, 2 * args.hidden, args.experts, 2, device=device, aux_loss_coef=args.aux_loss_coef
            ),
            ep_mesh,
            mode=args.mode,
        )
        for _ in range(args.layers)
    ]
    model = TinyMoELM(args.vocab, args.hidden, layers, heads=4).to(device)
    # bf16 compute on GPUs; CPU stays in fp32 (bf16 matmuls there are slow, not what this shows).
    policy = BF16_COMPUTE if device.type == "cuda" else MixedPrecisionPolicy()
    apply_fsdp(model, world_mesh, blocks=model.blocks, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.resume:
        checkpoint.load(args.resume, model, opt)
        if rank == 0:
            print(f"resumed from {args.resume}")

    tokens_per_step = args.batch * args.seq
    rates, t_last, steps_since, loss_value = [0.0] * world, time.perf_counter(), 0, float("nan")
    t_start = t_last
    for step in range(args.steps):
        ids, targets = batch(step, rank, args, device)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        steps_since += 1
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            loss_value = loss.item()  # syncs, once per log interval
            now = time.perf_counter()
            mine = torch.tensor([tokens_per_step * steps_since / (now - t_last)], device=device)
            gathered = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            rates = [float(r) for r in gathered]
            t_last, steps_since = time.perf_counter(), 0
            if rank == 0:
                print(progress(step + 1, args.steps, loss_value, rates), end="", flush=True)
    elapsed = time.perf_counter() - t_start
    if rank == 0:
        print()
    dist.barrier()
    # One write per line: the ranks share the terminal.
    sys.stdout.write(
        f"rank {rank}: {tokens_per_step * args.steps / elapsed:,.0f} tokens/s over {args.steps} steps, "
        f"final loss {loss_value:.3f}\n"
    )
    sys.stdout.flush()
    if args.save:
        checkpoint.save(args.save, model, opt)
        if rank == 0:
            print(f"saved {args.save} (moekit.distributed.checkpoint; loads at any world size or EP degree)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
