"""Checks of moekit.distributed in spawned process groups (gloo on CPU, NCCL on GPUs).

Run: python tests/distributed/distributed_worker.py GROUP WORLD PORT BACKEND WORKDIR [EXPERTS_BACKEND]. Every
rank runs the group's checks and prints "OK <check>" for each; any failure exits non-zero. The checkpoint chain
starts with `python tests/distributed/distributed_worker.py one_process_save WORKDIR` and ends with
`... one_process_check WORKDIR` (one process, no process group). Groups:
- train: data parallel (DDP, FSDP2 fp32 and bf16 compute; GroupedLinear, GroupedMLP, MoELayer; both
  layouts) and expert parallel (dropless, capacity; alone and with FSDP2 on an (ep, dp) mesh)
  against one process on the full batch.
- ckpt4: loads WORKDIR/w1 (written by one process), trains FSDP2 + EP on 4 ranks, saves WORKDIR/w4,
  checks that resumed training repeats the uninterrupted losses bit for bit.
- ckpt2: loads WORKDIR/w4 on 2 ranks in other layouts / EP degrees, saves WORKDIR/w2 (EP=2), and
  transformers models through apply_moekit (per-expert weights; the model's own layout) + FSDP2 to
  WORKDIR/hf2 and WORKDIR/hf2_gpt_oss.
- ckpt_missing: checkpoint.load of paths without a checkpoint is refused on every rank, before any
  collective.
Expected full tensors travel between groups as WORKDIR/<name>.expected.pt files.

Legend: T tokens, H hidden size, F ffn size, N experts, K top-k.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# tests/, where helpers.py is (pytest puts it on sys.path; a worker run by path needs it too).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import rel_err, tolerance_floor  # noqa: E402

H, F, N, K, T = 16, 12, 8, 2, 12
# The experts' GEMM backend (the optional 6th argument): "auto" (torch's grouped_mm on CPU); the
# NCCL run passes "loop", so that fp32 checks need no Triton compilation within its time budget.
EXPERTS_BACKEND = "auto"
FP32_REL = 1e-6
# Adam divides by sqrt(v) + eps: with the default 1e-8 an entry whose gradient is ~0 moves by +-lr on
# fp32 rounding noise alone; a larger eps keeps "same parameters" a well-conditioned comparison.
ADAM_EPS = 1e-5


# ---- models and data -------------------------------------------------------------------------


class Routed(nn.Module):
    """A GroupedLinear or GroupedMLP on rows already sorted by expert, with fixed splits."""

    def __init__(self, inner: nn.Module, m_splits: list[int]):
        super().__init__()
        self.inner, self.m_splits = inner, m_splits

    def forward(self, x):
        return self.inner(x, self.m_splits)


SPLITS = [3, 0, 5, 1, 0, 2, 4, 1]  # per rank; empty experts in the middle and at the start


def make_model(kind: str, grouped: bool, device, dtype=torch.float32, seed=0, aux_loss_coef=0.0) -> nn.Module:
    import moekit

    torch.manual_seed(seed)
    if kind == "linear":
        inner = moekit.GroupedLinear(
            N,
            H,
            F,
            bias=True,
            single_grouped_weight=grouped,
            single_grouped_bias=grouped,
            backend=EXPERTS_BACKEND,
            device=device,
            dtype=dtype,
        )
        return Routed(inner, SPLITS)
    if kind == "mlp":
        return Routed(
            moekit.GroupedMLP(
                N, H, F, bias=True, single_grouped_weight=grouped, backend=EXPERTS_BACKEND, device=device, dtype=dtype
            ),
            SPLITS,
        )
    return moekit.MoELayer(
        H,
        F,
        N,
        K,
        bias=True,
        single_grouped_weight=grouped,
        backend=EXPERTS_BACKEND,
        device=device,
        dtype=dtype,
        aux_loss_coef=aux_loss_coef,
    )


def batch(kind: str, rank: int, device, dtype=torch.float32, step=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows = sum(SPLITS) if kind != "moe" else T
    return torch.randn(rows, H, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def full_batch(kind: str, world: int, device, dtype=torch.float32, step=0):
    """(x, m_splits) of one process holding every rank's rows (sorted by expert for the routed kinds)."""
    parts = [batch(kind, r, device, dtype, step) for r in range(world)]
    if kind == "moe":
        return torch.cat(parts), None
    offs = [0]
    for s in SPLITS:
        offs.append(offs[-1] + s)
    rows = [p[offs[e] : offs[e + 1]] for e in range(N) for p in parts]
    return torch.cat(rows), [world * s for s in SPLITS]


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return (y.float() - 0.1).square().mean()


def forward_full(model: nn.Module, kind: str, x, m_splits):
    inner = model.inner if kind != "moe" else model
    return inner(x) if kind == "moe" else inner(x, m_splits)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_rel(ours, ref, tol, what):
    err = rel_err(ours, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


# ---- data parallel ---------------------------------------------------------------------------


def check_data_parallel(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moekit.distributed import apply_fsdp

    mesh = init_device_mesh(device.type, (world,))
    for kind in ("linear", "mlp", "moe"):
        for grouped in (True, False):
            for wrapper in ("ddp", "fsdp2"):
                # N=8 experts on 4 ranks: whole experts per rank; force a cut through them too.
                for shard_dim in (None, 1) if wrapper == "fsdp2" and grouped else (None,):
                    ref = make_model(kind, grouped, device)
                    model = copy.deepcopy(ref)
                    if wrapper == "ddp":
                        model = nn.parallel.DistributedDataParallel(model)
                    else:
                        apply_fsdp(model, mesh, mp_policy=MixedPrecisionPolicy(), expert_shard_dim=shard_dim)
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
                    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
                    inner = model.module if wrapper == "ddp" else model
                    for step in range(2):
                        loss_of(model(batch(kind, rank, device, step=step))).backward()
                        x, m_splits = full_batch(kind, world, device, step=step)
                        # Mean over ranks of per-rank means = mean over the full batch (equal rows per rank).
                        loss_of(forward_full(ref, kind, x, m_splits)).backward()
                        if step == 0:
                            for (name, p), (_, p_ref) in zip(
                                inner.named_parameters(), ref.named_parameters(), strict=True
                            ):
                                assert_rel(full(p.grad), p_ref.grad, FP32_REL, f"{wrapper} {kind} {name} gradient")
                        opt.step()
                        opt.zero_grad()
                        opt_ref.step()
                        opt_ref.zero_grad()
                    for (name, p), (_, p_ref) in zip(inner.named_parameters(), ref.named_parameters(), strict=True):
                        assert_rel(
                            full(p.detach()),
                            p_ref.detach(),
                            FP32_REL,
                            f"{wrapper} {kind} grouped={grouped} shard_dim={shard_dim} {name}",
                        )
                    print(f"OK dp {wrapper} {kind} grouped={grouped} shard_dim={shard_dim}", flush=True)
    check_bf16_compute(rank, world, device, mesh)
    check_fsdp_quantized(rank, world, device, mesh)


def check_fsdp_quantized(rank, world, device, mesh):
    """FSDP2 with quantized experts: after every optimizer step the next forward computes with the
    quantization of the updated weights (FSDP2 all-gathers them anew; a quantization kept from the
    step before would be stale), so its output equals, bit for bit, that of a one-process twin
    loaded with the full updated weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import moekit
    from moekit.distributed import apply_fsdp

    for recipe in ("fp8_block", "fp8_rowwise"):
        for grouped in (True, False):
            torch.manual_seed(0)
            model = moekit.MoELayer(
                H, F, N, K, bias=True, single_grouped_weight=grouped, quantization=recipe, device=device
            )
            twin = copy.deepcopy(model)
            apply_fsdp(model, mesh, mp_policy=MixedPrecisionPolicy())  # fp32: the twin's arithmetic
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            for step in range(3):
                x = batch("moe", rank, device, step=step)
                y = model(x)
                with torch.no_grad():
                    twin.load_state_dict({k: full(v) for k, v in model.state_dict().items()})
                    want = twin(x)
                assert torch.equal(y.detach(), want), (
                    f"fsdp2 {recipe} grouped={grouped} step {step}: output is not the updated weights' "
                    f"(rel. error {rel_err(y.detach(), want):.2e})"
                )
                loss_of(y).backward()
                opt.step()
                opt.zero_grad()
            print(f"OK dp fsdp2-quantized {recipe} grouped={grouped}", flush=True)


def check_bf16_compute(rank, world, device, mesh):
    """FSDP2 with bf16 compute, fp32 parameters and reductions: gradients within the repo's tolerance
    rule against float64, with one process computing the full batch in bf16 as torch's own error."""
    from moekit.distributed import apply_fsdp

    for kind in ("mlp", "moe"):
        for grouped in (True, False):
            model = make_model(kind, grouped, device)
            ref64 = copy.deepcopy(model).double()
            ref16 = copy.deepcopy(model).bfloat16()
            apply_fsdp(model, mesh)
            x = batch(kind, rank, device)
            loss_of(model(x)).backward()
            x_full, m_splits = full_batch(kind, world, device)
            loss_of(forward_full(ref64, kind, x_full.double(), m_splits)).backward()
            loss_of(forward_full(ref16, kind, x_full.bfloat16(), m_splits)).backward()
            for (name, p), (_, p64), (_, p16) in zip(
                model.named_parameters(), ref64.named_parameters(), ref16.named_parameters(), strict=True
            ):
                grad = full(p.grad)
                assert grad.dtype == torch.float32, f"{name}: gradient {grad.dtype}, expected the fp32 master's"
                bound = 2 * rel_err(p16.grad, p64.grad) + tolerance_floor(torch.bfloat16, x_full.shape[0])
                err = rel_err(grad, p64.grad)
                assert err <= bound, f"bf16 {kind} grouped={grouped} {name}: {err:.3e} > {bound:.3e}"
            print(f"OK dp fsdp2-bf16 {kind} grouped={grouped}", flush=True)


# ---- expert parallel -------------------------------------------------------------------------


def ep_mesh(device, world, ep):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (ep, world // ep), mesh_dim_names=("ep", "dp"))


def moe_reference(layer, x, keep=None):
    """The single-process MoELayer's output on x; with `keep` (T, K) bool, its routed experts
    (`moekit.moe_experts`) where the dropped copies contribute nothing."""
    import moekit

    if keep is None:
        return layer(x)
    weights, ids, _ = layer.route(x)
    e = layer.experts
    return moekit.moe_experts(
        x,
        ids,
        weights * keep,
        e.fc1.weights(),
        e.fc2.weights(),
        fc1_bias=e.fc1.biases(),
        fc2_bias=e.fc2.biases(),
        activation=e.activation,
        glu_interleave_size=e.glu_interleave_size,
        backend=e.backend,
    )


def kept_copies(ids: torch.Tensor, num_experts: int, slots: int) -> torch.Tensor:
    """(T, K) bool: copy kept in capacity mode = among the first `slots` copies of its expert in
    (token, k) order on its source rank."""
    flat = ids.reshape(-1).tolist()
    seen = [0] * num_experts
    keep = []
    for e in flat:
        keep.append(seen[e] < slots)
        seen[e] += 1
    return torch.tensor(keep, dtype=torch.bool, device=ids.device).view(ids.shape)


def check_expert_parallel(rank, world, device):
    from moekit.distributed import ExpertParallelMoE

    dtype = torch.float64 if device.type == "cpu" else torch.float32
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for ep in sorted({2, world}):
        mesh = ep_mesh(device, world, ep)
        for grouped, num_chunks in ((True, 1), (False, 1), (True, 3)):
            layer = make_model("moe", grouped, device, dtype)
            model = ExpertParallelMoE(layer, mesh, num_chunks=num_chunks)
            x = batch("moe", rank, device, dtype).requires_grad_()
            y = model(x)
            d_y = _dy(y, rank)
            y.backward(d_y)
            d_router = take_router_grad(model)
            x_ref = x.detach().requires_grad_()
            y_ref = moe_reference(layer, x_ref)
            y_ref.backward(d_y)
            assert_rel(y, y_ref, tol, f"ep={ep} dropless output")
            assert_rel(x.grad, x_ref.grad, tol, f"ep={ep} dropless d x")
            assert_rel(d_router, layer.router.weight.grad, tol, f"ep={ep} dropless d router")
            check_local_expert_grads(model, layer, mesh, world, device, dtype, tol, f"ep={ep} dropless")
            print(f"OK ep={ep} dropless grouped={grouped} chunks={num_chunks}", flush=True)
        check_uneven_tokens(rank, world, device, dtype, tol, mesh)
        check_capacity(rank, world, device, dtype, tol, mesh)
        check_capacity_uneven_tokens(rank, world, device, dtype, tol, mesh)
        check_aux_loss_uneven_tokens(rank, world, device, dtype, tol, mesh)


def ep_group_ranks(mesh, world):
    """The global ranks of this rank's EP group (the same "dp" coordinate)."""
    dp_rank, ep = mesh["dp"].get_local_rank(), mesh["ep"].size()
    return [r for r in range(world) if r % (world // ep) == dp_rank]


def check_local_expert_grads(model, layer, mesh, world, device, dtype, tol, what, slots=None, counts=None):
    """This rank's expert gradients against MoELayer's for the same experts on the tokens of every
    rank of its EP group (with `slots`, capacity mode's dropped copies weighted zero; with
    `counts`, rank r's first counts[r] tokens)."""
    layer.zero_grad()
    for r in ep_group_ranks(mesh, world):
        x_r = batch("moe", r, device, dtype)[: None if counts is None else counts[r]]
        keep_r = None if slots is None else kept_copies(layer.route(x_r)[1], N, slots)
        moe_reference(layer, x_r, keep_r).backward(_dy(x_r, r))
    first = model.ep_rank * model.num_local_experts
    local = slice(first, first + model.num_local_experts)
    for name in ("fc1", "fc2"):
        for kind_ in ("weights", "biases"):
            ours = _stack(getattr(getattr(model.experts, name), kind_)(), grad=True)
            ref = _stack(getattr(getattr(layer.experts, name), kind_)(), grad=True)[local]
            assert_rel(ours, ref, tol, f"{what} d {name} {kind_}")


def take_router_grad(model):
    """The router's gradient, taken away: the wrapper shares the layer's router, so the reference's
    backward would otherwise add into the same tensor (and compare it with itself)."""
    d_router = model.router.weight.grad
    model.router.weight.grad = None
    assert d_router is not None and d_router.abs().sum() > 0
    return d_router


def _dy(x_r, r):
    # The same upstream gradient every rank uses for its own tokens (seeded by rank).
    return torch.randn(x_r.shape, generator=torch.Generator().manual_seed(77 + r), dtype=torch.float64).to(x_r)


def _stack(params, grad=False):
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    items = [p.grad if grad else p for p in items]
    return items[0] if isinstance(params, torch.Tensor) else torch.stack(items)


def check_uneven_tokens(rank, world, device, dtype, tol, mesh):
    """Dropless with another token count on every rank (rank 0: none, rank 1: one), chunked
    (num_chunks larger than some ranks' token counts): outputs and input gradients equal MoELayer's."""
    from moekit.distributed import ExpertParallelMoE

    layer = make_model("moe", True, device, dtype)
    for num_chunks in (1, 3):
        model = ExpertParallelMoE(layer, mesh, num_chunks=num_chunks)
        x = batch("moe", rank, device, dtype)[: rank * 5].clone().requires_grad_()
        y = model(x)
        y.backward(_dy(y, rank))
        x_ref = x.detach().clone().requires_grad_()
        y_ref = moe_reference(layer, x_ref)
        y_ref.backward(_dy(y, rank))
        assert_rel(y, y_ref, tol, f"uneven tokens chunks={num_chunks} output")
        if x.shape[0]:
            assert_rel(x.grad, x_ref.grad, tol, f"uneven tokens chunks={num_chunks} d x")
    print(f"OK ep={mesh['ep'].size()} dropless uneven tokens per rank", flush=True)


def check_capacity(rank, world, device, dtype, tol, mesh):
    """Capacity mode: fixed buffers; the first C copies of each expert (token order) are kept, the
    rest dropped and counted; outputs and the gradients of x, the router and this rank's experts
    (from every EP rank's tokens) equal MoELayer's with the dropped copies' weights zeroed; with room
    for every copy nothing is dropped."""
    from moekit.distributed import ExpertParallelMoE

    ep = mesh["ep"].size()
    for grouped, factor in ((True, 0.5), (False, 1.0), (True, float(N))):
        layer = make_model("moe", grouped, device, dtype)
        x = batch("moe", rank, device, dtype)
        model = ExpertParallelMoE(layer, mesh, mode="capacity", capacity_factor=factor)
        slots = model.capacity(x.shape[0])
        xg = x.clone().requires_grad_()
        y = model(xg)
        y.backward(_dy(y, rank))
        d_router = take_router_grad(model)
        _, ids, _ = layer.route(x)
        keep = kept_copies(ids, N, slots)
        x_ref = x.clone().requires_grad_()
        y_ref = moe_reference(layer, x_ref, keep)
        y_ref.backward(_dy(y, rank))
        assert_rel(y, y_ref, tol, f"capacity {factor} output")
        assert_rel(xg.grad, x_ref.grad, tol, f"capacity {factor} d x")
        assert_rel(d_router, layer.router.weight.grad, tol, f"capacity {factor} d router")
        assert int(model.dropped_copies) == int((~keep).sum()), (int(model.dropped_copies), int((~keep).sum()))
        if factor == N:
            assert int(model.dropped_copies) == 0
        check_local_expert_grads(model, layer, mesh, world, device, dtype, tol, f"capacity {factor}", slots)
        print(f"OK ep={ep} capacity factor={factor} grouped={grouped} dropped={int(model.dropped_copies)}", flush=True)


# Tokens per global rank r: pattern[r % 4]. In every EP group (2 ranks of world 2; (0, 2) and
# (1, 3), or all 4, of world 4) the counts differ, and some rank has none.
UNEVEN_TOKENS = ((6, 0, 5, 7), (5, 7, 0, 6))


def uneven_counts(pattern, world):
    return [pattern[r % len(pattern)] for r in range(world)]


def uneven_patterns(world):
    """The token patterns a world runs: both on 2 ranks, the first on 4 (CI time: it already holds
    an EP group with a rank without tokens and one with unequal counts)."""
    return UNEVEN_TOKENS if world == 2 else UNEVEN_TOKENS[:1]


def check_capacity_uneven_tokens(rank, world, device, dtype, tol, mesh):
    """Capacity mode with another token count on every rank, 0 included (issue: 0 tokens raised on
    one rank and hung the other; 5 and 7 tokens aborted gloo): C comes from the group's largest
    count, the first C copies of each expert (token order) are kept; outputs, dropped counts and the
    gradients of x, the router and this rank's experts equal MoELayer's with the dropped copies'
    weights zeroed. With capacity_tokens set, C comes from it alone."""
    from moekit.distributed import ExpertParallelMoE

    ep = mesh["ep"].size()
    for pattern in uneven_patterns(world):
        counts = uneven_counts(pattern, world)
        most = max(counts[r] for r in ep_group_ranks(mesh, world))
        for factor, capacity_tokens in ((float(N), None), (0.5, None), (1.0, 3)):
            layer = make_model("moe", True, device, dtype)
            x = batch("moe", rank, device, dtype)[: counts[rank]]
            model = ExpertParallelMoE(
                layer, mesh, mode="capacity", capacity_factor=factor, capacity_tokens=capacity_tokens
            )
            slots = model.capacity(most if capacity_tokens is None else capacity_tokens)
            xg = x.clone().requires_grad_()
            y = model(xg)
            assert y.shape == x.shape, (tuple(y.shape), tuple(x.shape))
            y.backward(_dy(y, rank))
            d_router = model.router.weight.grad
            model.router.weight.grad = None
            keep = kept_copies(layer.route(x)[1], N, slots)
            x_ref = x.clone().requires_grad_()
            moe_reference(layer, x_ref, keep).backward(_dy(y, rank))
            what = f"capacity tokens={counts} factor={factor} capacity_tokens={capacity_tokens}"
            if counts[rank]:
                assert_rel(y, moe_reference(layer, x, keep), tol, f"{what} output")
                assert_rel(xg.grad, x_ref.grad, tol, f"{what} d x")
                assert_rel(d_router, layer.router.weight.grad, tol, f"{what} d router")
            else:
                assert d_router is not None and not d_router.any(), (
                    f"{what}: a rank without tokens got a router gradient"
                )
            assert int(model.dropped_copies) == int((~keep).sum()), (what, int(model.dropped_copies))
            if factor == N:
                assert int(model.dropped_copies) == 0, what
            check_local_expert_grads(model, layer, mesh, world, device, dtype, tol, what, slots, counts)
            print(f"OK ep={ep} {what} dropped={int(model.dropped_copies)}", flush=True)


def check_aux_loss_uneven_tokens(rank, world, device, dtype, tol, mesh):
    """The load-balancing loss with another token count on every rank, 0 included, both modes (room
    for every copy): aux_loss equals one process's on every rank's tokens, and the router gradient
    averaged over the ranks (what data parallelism takes) equals one process's, whose loss is the
    ranks' mean loss with the aux loss injected by the layer. No token on any rank: aux_loss 0 and
    a zero router gradient (issue: NaN)."""
    from moekit.distributed import ExpertParallelMoE

    ep = mesh["ep"].size()
    for pattern in (*uneven_patterns(world), (0, 0, 0, 0)):
        counts = uneven_counts(pattern, world)
        for mode in ("dropless", "capacity"):
            layer = make_model("moe", True, device, dtype, aux_loss_coef=0.5)
            model = ExpertParallelMoE(layer, mesh, mode=mode, capacity_factor=float(N))
            x = batch("moe", rank, device, dtype)[: counts[rank]]
            y = model(x)
            y.backward(_dy(y, rank))
            d_router = model.router.weight.grad
            model.router.weight.grad = None
            dist.all_reduce(d_router)
            d_router /= world
            what = f"{mode} aux loss tokens={counts}"
            parts = [batch("moe", r, device, dtype)[: counts[r]] for r in range(world)]
            y_ref = layer(torch.cat(parts))
            d_y = torch.cat([_dy(p, r) for r, p in enumerate(parts)]) / world
            y_ref.backward(d_y)
            assert_rel(model.aux_loss, layer.aux_loss, tol, f"{what} value")
            assert_rel(d_router, layer.router.weight.grad, tol, f"{what} d router")
            if not sum(counts):
                assert float(model.aux_loss) == 0 and not d_router.any(), what
            print(f"OK ep={ep} {what}", flush=True)


def check_ep_fsdp_training(rank, world, device):
    """FSDP2 + EP on an (ep, dp) mesh, fp32: the first gradients and the parameters after AdamW
    steps equal one process's on the full batch (every rank's tokens); also in capacity mode with
    room for every copy (its experts run under FSDP2's hooks as dropless's do)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moekit.distributed import ExpertParallelMoE, apply_fsdp

    world_mesh = init_device_mesh(device.type, (world,))
    for ep in sorted({2, world}):
        mesh = ep_mesh(device, world, ep)
        # The load-balancing loss (aux) over every rank's tokens: one process's on the full batch.
        for grouped, aux, mode in (
            (True, 0.0, "dropless"),
            (False, 0.0, "dropless"),
            (True, 0.5, "dropless"),
            (False, 0.5, "capacity"),
        ):
            ref = make_model("moe", grouped, device, aux_loss_coef=aux)
            model = ExpertParallelMoE(copy.deepcopy(ref), mesh, mode=mode, capacity_factor=float(N))
            apply_fsdp(model, world_mesh, mp_policy=MixedPrecisionPolicy())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
            local = slice(
                mesh["ep"].get_local_rank() * model.num_local_experts,
                (mesh["ep"].get_local_rank() + 1) * model.num_local_experts,
            )

            for step in range(2):
                loss_of(model(batch("moe", rank, device, step=step))).backward()
                loss_of(ref(full_batch("moe", world, device, step=step)[0])).backward()
                if step == 0:
                    compare_ep_model(model, ref, local, grouped, grads=True, what=f"ep={ep} fsdp gradient")
                if aux:
                    assert_rel(model.aux_loss, ref.aux_loss, FP32_REL, f"ep={ep} aux loss step {step}")
                opt.step()
                opt.zero_grad()
                opt_ref.step()
                opt_ref.zero_grad()
            compare_ep_model(model, ref, local, grouped, grads=False, what=f"ep={ep} fsdp after 2 steps")
            assert mode == "dropless" or int(model.dropped_copies) == 0
            print(
                f"OK ep={ep} x dp={world // ep} fsdp2 training {mode} grouped={grouped} aux_loss_coef={aux}", flush=True
            )


VIEW_WARNING = "returned a view tensor"
SEQ_LEN = 3
SEQUENCES = (2, 0, 1, 3)  # per global rank r: SEQUENCES[r % 4] sequences of SEQ_LEN tokens


def sequences(rank, device, step=0):
    """(batch, SEQ_LEN, H) fp32 sequences of one rank in one step."""
    g = torch.Generator().manual_seed(5000 + 1000 * step + rank)
    return torch.randn(SEQUENCES[rank % 4], SEQ_LEN, H, generator=g, dtype=torch.float64).to(device, torch.float32)


def check_ep_fsdp_uneven_tokens(rank, world, device):
    """FSDP2 + EP on (ep, dp) meshes with another number of sequences on every rank (none on one),
    3-D input (batch, seq, H) as a transformer block passes it, the aux loss on, both modes (capacity
    with room for every copy): the first gradients and the parameters after two AdamW steps equal
    one process's on every rank's tokens (each rank's loss is its tokens' share of the global mean),
    and FSDP2 warns about no returned view (issue: "FSDPExpertParallelMoE returned a view tensor" on
    every rank of examples/train_distributed.py). The warning check is shown to fire first, on an
    FSDP2 module that does return a view."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from moekit.distributed import ExpertParallelMoE, apply_fsdp

    class ReturnsView(nn.Linear):
        def forward(self, x):
            return super().forward(x).view(x.shape)

    world_mesh = init_device_mesh(device.type, (world,))

    def view_warnings(call):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = call()
        return out, [str(w.message) for w in caught if VIEW_WARNING in str(w.message)]

    probe = fully_shard(ReturnsView(H, H, device=device), mesh=world_mesh)
    _, caught = view_warnings(lambda: probe(torch.randn(2, SEQ_LEN, H, device=device)))
    assert caught, "FSDP2's view warning did not fire on a module returning a view: the check below cannot fail"
    tokens = sum(SEQUENCES[r % 4] * SEQ_LEN for r in range(world))
    for ep in (2,):  # 2 ranks: (2, 1); 4 ranks: (2, 2), EP groups of unequal counts over 2 dp replicas
        mesh = ep_mesh(device, world, ep)
        for mode, grouped in (("dropless", True), ("capacity", False)):
            ref = make_model("moe", grouped, device, aux_loss_coef=0.5)
            model = ExpertParallelMoE(copy.deepcopy(ref), mesh, mode=mode, capacity_factor=float(N))
            apply_fsdp(model, world_mesh, mp_policy=MixedPrecisionPolicy())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
            first = mesh["ep"].get_local_rank() * model.num_local_experts
            local = slice(first, first + model.num_local_experts)
            what = (
                f"ep={ep} x dp={world // ep} fsdp2 {mode} uneven sequences {[SEQUENCES[r % 4] for r in range(world)]}"
            )
            for step in range(2):
                x = sequences(rank, device, step)
                y, caught = view_warnings(lambda x=x, model=model: model(x))
                assert not caught, f"{what}: {caught[0]}"
                assert y.shape == x.shape and y._base is None, (tuple(y.shape), tuple(x.shape))
                # This rank's part of the mean over every rank's tokens, times the ranks FSDP2 averages over.
                (world * (y - 0.1).square().sum() / (tokens * H)).backward()
                x_full = torch.cat([sequences(r, device, step).reshape(-1, H) for r in range(world)])
                loss_of(ref(x_full)).backward()
                if step == 0:
                    compare_ep_model(model, ref, local, grouped, grads=True, what=f"{what} gradient")
                assert_rel(model.aux_loss, ref.aux_loss, FP32_REL, f"{what} aux loss step {step}")
                opt.step()
                opt.zero_grad()
                opt_ref.step()
                opt_ref.zero_grad()
            compare_ep_model(model, ref, local, grouped, grads=False, what=f"{what} after 2 steps")
            print(f"OK {what}", flush=True)


def compare_ep_model(model, ref, local: slice, grouped: bool, *, grads: bool, what: str) -> None:
    """An FSDP2 + EP model's router and local experts (gradients: scale-sensitive, so the EP x DP
    divide factor is checked; or parameters) against the one-process reference's."""

    def value(p):
        return full(p.grad) if grads else full(p.detach())

    ref_router = ref.router.weight.grad if grads else ref.router.weight.detach()
    assert_rel(value(model.router.weight), ref_router, FP32_REL, f"{what} router")
    for name in ("fc1", "fc2"):
        for kind_ in ("weights", "biases"):
            ours = _stack([value(p) for p in _as_list(getattr(getattr(model.experts, name), kind_)())])
            ref_t = _stack(getattr(getattr(ref.experts, name), kind_)(), grad=grads).detach()[local]
            assert_rel(ours if not grouped else ours[0], ref_t, FP32_REL, f"{what} {name} {kind_}")


def _as_list(params):
    return [params] if isinstance(params, torch.Tensor) else list(params)


def check_capacity_graph(rank, world, device, workdir):
    """NCCL only: capacity mode (with capacity_tokens) in bf16 on moekit's GPU kernels. An eager step makes no host sync
    (torch.cuda's sync debug mode set to error), and forward+backward captured in one CUDA graph,
    replayed with new tokens (so new routing and new drops), gives what an eager step gives, bit for
    bit (every kernel on the path is deterministic), outputs, dropped count and every gradient."""
    import moekit
    from moekit.distributed import ExpertParallelMoE

    if device.type != "cuda":
        raise RuntimeError("the capacity_graph group needs CUDA (run it with the nccl backend)")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    layer = moekit.MoELayer(256, 128, 4 * world, 2, bias=True, device=device, dtype=torch.bfloat16)
    tokens = 384
    # capacity_tokens: C fixed without the agreeing all-reduce, whose result the host would read.
    model = ExpertParallelMoE(layer, mesh, mode="capacity", capacity_factor=1.0, capacity_tokens=tokens)

    def data(seed):
        g = torch.Generator(device=device).manual_seed(1000 * seed + rank)
        return (
            torch.randn(tokens, 256, device=device, dtype=torch.bfloat16, generator=g),
            torch.randn(tokens, 256, device=device, dtype=torch.bfloat16, generator=g),
        )

    x0, dy0 = data(0)
    x = x0.clone().requires_grad_()
    dy = dy0.clone()
    leaves = [x, *model.parameters()]

    def step():
        y = model(x)
        y.backward(dy)
        return y

    step()  # compile and autotune before the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print("OK capacity no host sync (cuda sync debug mode error)", flush=True)

    from helpers import capture_cuda_graph

    graph, y_static = capture_cuda_graph(step, leaves)
    static = {
        "out": y_static,
        "dropped": model.dropped_copies,
        **{name: t.grad for name, t in zip(["x", *dict(model.named_parameters())], leaves, strict=True)},
    }
    dropped_seen = set()
    for seed in (1, 2, 3):
        x_new, dy_new = data(seed)
        with torch.no_grad():
            x.copy_(x_new)
            dy.copy_(dy_new)
        graph.replay()
        torch.cuda.synchronize()
        replayed = {k: v.clone() for k, v in static.items()}
        for t in leaves:
            t.grad = None
        eager = {
            "out": step().detach(),
            "dropped": model.dropped_copies,
            **{name: t.grad for name, t in zip(["x", *dict(model.named_parameters())], leaves, strict=True)},
        }
        for key, value in eager.items():
            assert torch.equal(replayed[key], value), f"replay {seed}: {key} differs from eager"
        dropped_seen.add(int(eager["dropped"]))
    assert dropped_seen != {0}, "no replay dropped a copy: the test did not exercise dropping"
    print(f"OK capacity CUDA graph replays equal eager (dropped {sorted(dropped_seen)})", flush=True)


# ---- checkpoints -----------------------------------------------------------------------------


def full_state(model, optimizer=None) -> dict:
    """Every stored tensor (moekit.distributed.checkpoint's keys) as a full CPU tensor."""
    from moekit.distributed import checkpoint

    out = {}
    state = checkpoint.state_dict(model, optimizer)
    flat = {}
    _flatten("", state, flat)
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            out[key] = full(value).detach().cpu().clone()
    return out


def _flatten(prefix, value, out):
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def assert_same_state(ours: dict, expected: dict, what: str):
    assert ours.keys() == expected.keys(), f"{what}: keys differ: {sorted(ours.keys() ^ expected.keys())}"
    for key in expected:
        assert torch.equal(ours[key], expected[key]), f"{what}: {key} differs after load"


def train_steps(model, opt, rank, device, steps, first_step=0):
    losses = []
    for step in range(first_step, first_step + steps):
        loss = loss_of(model(batch("moe", rank, device, step=step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return torch.stack(losses)


def build(kind, rank, world, device, *, grouped=True, ep=1, fsdp=True, lr=1e-2):
    """A MoELayer model in one configuration, with its AdamW. kind: "moe"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moekit.distributed import ExpertParallelMoE, apply_fsdp

    model = make_model(kind, grouped, device, seed=123)
    if ep > 1:
        model = ExpertParallelMoE(model, ep_mesh(device, world, ep))
    if fsdp:
        apply_fsdp(model, init_device_mesh(device.type, (world,)), mp_policy=MixedPrecisionPolicy())
    return model, torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAM_EPS)


def check_ckpt4(rank, world, device, workdir):
    from moekit.distributed import checkpoint

    # 1 -> 4: the one-process checkpoint into FSDP2 + EP=2 on 4 ranks, discrete layout.
    model, opt = build("moe", rank, world, device, grouped=False, ep=2)
    checkpoint.load(os.path.join(workdir, "w1"), model, opt)
    assert_same_state(full_state(model, opt), torch.load(os.path.join(workdir, "w1.expected.pt")), "1 -> 4")
    print("OK ckpt 1 -> 4 (ep=2, fsdp2, discrete)", flush=True)
    train_steps(model, opt, rank, device, 2, first_step=10)
    path = os.path.join(workdir, "w4")
    checkpoint.save(path, model, opt)
    expected = full_state(model, opt)
    if rank == 0:
        torch.save(expected, path + ".expected.pt")
    uninterrupted = train_steps(model, opt, rank, device, 3, first_step=12)
    # Resume in the same configuration: bit-identical fp32 losses.
    model2, opt2 = build("moe", rank, world, device, grouped=False, ep=2)
    checkpoint.load(path, model2, opt2)
    resumed = train_steps(model2, opt2, rank, device, 3, first_step=12)
    assert torch.equal(resumed, uninterrupted), (resumed.tolist(), uninterrupted.tolist())
    print("OK ckpt resume bit-identical losses (4 ranks)", flush=True)
    # EP degree 2 -> 4 and layout discrete -> grouped, same world.
    model3, opt3 = build("moe", rank, world, device, grouped=True, ep=4)
    checkpoint.load(path, model3, opt3)
    assert_same_state(full_state(model3, opt3), expected, "ep 2 -> 4")
    print("OK ckpt ep 2 -> 4, discrete -> grouped", flush=True)


def check_ckpt2(rank, world, device, workdir):
    from moekit.distributed import checkpoint

    path4 = os.path.join(workdir, "w4")
    expected = torch.load(path4 + ".expected.pt")
    for grouped, ep in ((False, 1), (True, 2)):
        model, opt = build("moe", rank, world, device, grouped=grouped, ep=ep)
        checkpoint.load(path4, model, opt)
        assert_same_state(full_state(model, opt), expected, f"4 -> 2 grouped={grouped} ep={ep}")
        print(f"OK ckpt 4 -> 2 (ep={ep}, grouped={grouped})", flush=True)
    check_uneven_shards(rank, world, device, workdir)
    train_steps(model, opt, rank, device, 2, first_step=20)
    path = os.path.join(workdir, "w2")
    checkpoint.save(path, model, opt)
    expected2 = full_state(model, opt)
    if rank == 0:
        torch.save(expected2, path + ".expected.pt")
    check_hf_save(rank, world, device, workdir)


def check_uneven_shards(rank, world, device, workdir):
    """3 experts on 2 ranks: FSDP2 shards (3, O, I) unevenly along the experts; saved so, loaded
    into shards cut through every expert (and the discrete layout), state equal bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import moekit
    from moekit.distributed import apply_fsdp, checkpoint

    mesh = init_device_mesh(device.type, (world,))

    def build3(grouped, shard_dim):
        torch.manual_seed(7)
        model = moekit.MoELayer(
            H, F, 3, 2, bias=True, single_grouped_weight=grouped, backend=EXPERTS_BACKEND, device=device
        )
        apply_fsdp(model, mesh, mp_policy=MixedPrecisionPolicy(), expert_shard_dim=shard_dim)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)

    model, opt = build3(True, 0)
    placements = {p.placements[0].dim for p in model.experts.parameters()}
    assert placements == {0}, placements
    train_steps(model, opt, rank, device, 2)
    path = os.path.join(workdir, "uneven")
    checkpoint.save(path, model, opt)
    expected = full_state(model, opt)
    for grouped, shard_dim in ((True, 1), (False, None)):
        other, other_opt = build3(grouped, shard_dim)
        checkpoint.load(path, other, other_opt)
        assert_same_state(full_state(other, other_opt), expected, f"uneven -> grouped={grouped} dim={shard_dim}")
    print("OK ckpt uneven expert shards -> through-expert shards and discrete", flush=True)


def tiny_hf_model(device, seed=5, kind="mixtral"):
    """A one-layer transformers MoE model: Mixtral ([N, 2F, H] experts) or gpt-oss (transposed
    [N, H, 2F] experts with biases, alternating gate/up rows)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=12,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**common)).to(device)
    config = transformers.GptOssConfig(head_dim=8, sliding_window=8, layer_types=["full_attention"], **common)
    model = transformers.GptOssForCausalLM(config).to(device)
    with torch.no_grad():  # transformers initialises gpt-oss's expert biases to zero
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_()
    return model


# The transformers models check_hf_save trains under FSDP2 and saves: (directory, kind, apply_moekit's
# single_grouped_weight, apply_fsdp's expert_shard_dim). Mixtral converted to per-expert weights; gpt-oss
# kept in its own (transposed) layout, its expert tensors cut through the experts (out features: dim 2
# of a transposed weight).
HF_SAVES = (("hf2", "mixtral", False, None), ("hf2_gpt_oss", "gpt_oss", True, 1))


def check_hf_save(rank, world, device, workdir):
    """Transformers models on moekit experts (apply_moekit, both layouts) trained under FSDP2 and
    saved with the model's own expert tensor names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moekit.distributed import apply_fsdp, checkpoint
    from moekit.integrations.transformers import MoekitExperts, apply_moekit

    for name, kind, grouped, shard_dim in HF_SAVES:
        model = apply_moekit(tiny_hf_model(device, kind=kind), single_grouped_weight=grouped, backend=EXPERTS_BACKEND)
        mesh = init_device_mesh(device.type, (world,))
        apply_fsdp(model, mesh, mp_policy=MixedPrecisionPolicy(), expert_shard_dim=shard_dim)
        experts = next(m for m in model.modules() if isinstance(m, MoekitExperts))
        if grouped:  # the model's own parameters, cut along their out features
            dims = {n: p.placements[0].dim for n, p in experts.named_parameters()}
            assert dims == {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 2, "down_proj_bias": 1}, dims
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank)).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss), loss
        loss.backward()
        opt.step()
        path = os.path.join(workdir, name)
        checkpoint.save(path, model, opt)
        expected = full_state(model)
        if rank == 0:
            torch.save(expected, path + ".expected.pt")
    print("OK ckpt transformers apply_moekit + fsdp2 saved", flush=True)


def check_missing_checkpoint(rank, world, device, workdir):
    """checkpoint.load of a path without a checkpoint: every rank refuses in one line, before any
    collective (the barrier after it completes: no rank waits in one)."""
    import moekit
    from moekit.distributed import checkpoint

    model = moekit.MoELayer(H, F, N, K, device=device)
    empty = os.path.join(workdir, "empty")
    os.makedirs(empty, exist_ok=True)
    for path, what in (("/nonexistent/moekit-ckpt", "does not exist"), (empty, "holds no .metadata file")):
        try:
            checkpoint.load(path, model)
        except FileNotFoundError as exc:
            message = str(exc)
            assert message == (
                f"checkpoint path {path!r} {what}; expected a directory written by moekit.distributed.checkpoint.save"
            ), message
        else:
            raise AssertionError(f"checkpoint.load({path!r}) loaded")
    dist.barrier()
    print("OK ckpt missing path refused on every rank", flush=True)


def one_process_model(grouped: bool, device="cpu"):
    model = make_model("moe", grouped, torch.device(device), seed=123)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)


def one_process_save(workdir):
    """The chain's start: one process trains a grouped-layout MoELayer and saves WORKDIR/w1."""
    from moekit.distributed import checkpoint

    model, opt = one_process_model(grouped=True)
    train_steps(model, opt, 0, torch.device("cpu"), 2)
    checkpoint.save(os.path.join(workdir, "w1"), model, opt)
    torch.save(full_state(model, opt), os.path.join(workdir, "w1.expected.pt"))


def one_process_check(workdir):
    """The chain's end: WORKDIR/w2 into one process (discrete layout), and the transformers model
    saved under FSDP2 (WORKDIR/hf2*) into the plain transformers model, without moekit."""
    from moekit.distributed import checkpoint

    model, opt = one_process_model(grouped=False)
    checkpoint.load(os.path.join(workdir, "w2"), model, opt)
    assert_same_state(full_state(model, opt), torch.load(os.path.join(workdir, "w2.expected.pt")), "2 -> 1")
    print("OK ckpt 2 -> 1 (discrete)", flush=True)
    one_process_check_hf(workdir)


def one_process_check_hf(workdir):
    """The transformers models saved under FSDP2 (check_hf_save) into the plain transformers models,
    without moekit, bit for bit."""
    import torch.distributed.checkpoint as dcp

    for name, kind, _, _ in HF_SAVES:
        hf = tiny_hf_model("cpu", seed=99, kind=kind)
        state = {"model": hf.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(workdir, name))
        expected = torch.load(os.path.join(workdir, name + ".expected.pt"))
        assert any(k.endswith("experts.gate_up_proj") for k in expected), sorted(expected)
        for key, value in hf.state_dict().items():
            assert torch.equal(value, expected[f"model.{key}"]), key
    print("OK ckpt transformers fsdp2 -> plain transformers model", flush=True)


GROUPS = {
    "train": lambda rank, world, device, workdir: (
        check_data_parallel(rank, world, device),
        check_expert_parallel(rank, world, device),
        check_ep_fsdp_training(rank, world, device),
        check_ep_fsdp_uneven_tokens(rank, world, device),
    ),
    "ep": lambda rank, world, device, workdir: (
        check_expert_parallel(rank, world, device),
        check_ep_fsdp_training(rank, world, device),
        check_ep_fsdp_uneven_tokens(rank, world, device),
    ),
    "capacity_graph": check_capacity_graph,
    "ckpt4": check_ckpt4,
    "ckpt2": check_ckpt2,
    "ckpt_missing": check_missing_checkpoint,
}


def run(rank, group, world, port, backend, workdir, experts_backend="auto"):
    global EXPERTS_BACKEND
    EXPERTS_BACKEND = experts_backend
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if backend == "nccl" else None)
    try:
        GROUPS[group](rank, world, device, workdir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] in ("one_process_save", "one_process_check"):
        globals()[sys.argv[1]](sys.argv[2])
        sys.exit(0)
    group, world, port, backend, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    experts_backend = sys.argv[6] if len(sys.argv) > 6 else "auto"
    mp.spawn(run, args=(group, world, port, backend, workdir, experts_backend), nprocs=world)
    print(f"DONE {group} {world}", flush=True)
