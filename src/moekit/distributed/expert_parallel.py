"""Expert parallelism: each rank of an expert-parallel group holds N/EP experts, and the routed
token copies travel to the rank of their expert and back with `all_to_all_single`.

Legend: T tokens (this rank's), K top-k, N experts in all, H hidden size; EP ranks in the group,
L = N/EP experts per rank ("local"), C slots per (source rank, expert) in capacity mode.

Dispatch and combine, for one rank (index maps in `moekit.distributed.dispatch`, all on the device):
1. route (`MoELayer.route`, the single-process layer's own router) and sort the T*K copies by
   global expert (moe_experts' device routing). Experts r*L..(r+1)*L-1 live on rank r, so the
   sorted copies are already grouped by destination rank.
2. exchange the per-expert counts with `all_to_all_single` on the device: rank r learns, for each
   source rank s, how many copies s routed to each of r's L experts.
3. gather the send buffer straight from the tokens (one (M, H) copy: the all-to-all's input) and
   the router weights beside it; `all_to_all_single` (differentiable: its backward is the reverse
   all-to-all); the received rows, grouped (source rank, local expert), go through the local
   experts as `moekit.moe_experts` runs its rows (sorted by local expert on the device, the fused
   grouped MLP with the router weights as probs, back in received order; the grouped MLP keeps its
   sorted input for the weight gradients, an (R, H) tensor, where moe_experts gathers it again from
   the K times smaller tokens); the outputs travel back the same way and each token's K (already weighted) outputs
   are summed in fixed order. Every row movement is a deterministic gather-sum, forward and
   backward: no floating-point atomics.

Modes:
- "dropless": the all-to-all splits are the exchanged counts, so their sums must reach the host:
  one device-to-host copy per forward (the split sizes of the dispatch, which the combine and both
  backward passes reuse; with num_chunks > 1, all chunks' sizes in the same one copy). Outputs and
  gradients equal the single-process `MoELayer`'s.
- "capacity": every (source rank, expert) pair gets C = ceil(capacity_factor * T * K / N) slots (and
  each destination one sentinel slot that dropped copies point to), so every buffer has a fixed
  size, nothing is read by the host and the step can be captured in a CUDA graph. Every rank must
  pass the same number of tokens T >= 1 (the buffers' sizes must agree). Copies past C are dropped,
  the last ones in token order (the first C copies of each expert, in token order, are kept):
  deterministic. Empty slots travel but are padding rows of the local grouped MLP (not computed).
  `dropped_copies` holds the number of copies this rank's tokens lost in the last forward, as a
  device tensor. Dropless mode takes any T per rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moekit.distributed.dispatch import (
    capacity_maps,
    dropless_maps,
    move_rows,
    received_local_ids,
    use_triton_rows,
)
from moekit.nn.grouped_mlp import GroupedMLP
from moekit.nn.moe_layer import MoELayer, _AuxLossInjector

MODES = ("dropless", "capacity")


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows, differentiable: the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        rows = x.shape[0] if output_splits is None else sum(output_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, d_out):
        rows = d_out.shape[0] if ctx.input_splits is None else sum(ctx.input_splits)
        d_x = d_out.new_empty((rows, *d_out.shape[1:]))
        dist.all_to_all_single(d_x, d_out.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return d_x, None, None, None


def all_to_all_rows(
    x: torch.Tensor, output_splits: list[int] | None, input_splits: list[int] | None, group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable `torch.distributed.all_to_all_single` along dim 0 (splits None: equal)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


class _Pending:
    """One all-to-all of `_AllToAllStart` / `_AllToAllWait`: the work in flight and the tensors
    that must outlive it, forward and backward."""

    def __init__(self) -> None:
        self.work = None
        self.keep_alive = None
        self.d_input = None


class _AllToAllStart(torch.autograd.Function):
    """Start `all_to_all_single` without waiting; its output is valid after `_AllToAllWait`.

    The backward mirrors it: `_AllToAllWait`'s backward starts the reverse all-to-all of the
    gradient, this backward waits for it. Autograd runs the nodes of later chunks first, so another
    chunk's expert backward can run while a transfer is in flight.
    """

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, pending):
        ctx.pending = pending
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        x = x.contiguous()
        pending.work = dist.all_to_all_single(out, x, output_splits, input_splits, group=group, async_op=True)
        pending.keep_alive = x  # the input must outlive the transfer
        return out

    @staticmethod
    def backward(ctx, d_out):
        pending = ctx.pending
        pending.work.wait()
        d_input = pending.d_input
        pending.work = pending.keep_alive = pending.d_input = None
        return d_input, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, output_splits, input_splits, group, pending):
        pending.work.wait()
        pending.work = pending.keep_alive = None
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.pending = output_splits, input_splits, group, pending
        return out.view_as(out)

    @staticmethod
    def backward(ctx, d_out):
        pending = ctx.pending
        d_out = d_out.contiguous()
        pending.d_input = d_out.new_empty((sum(ctx.input_splits), *d_out.shape[1:]))
        pending.work = dist.all_to_all_single(
            pending.d_input, d_out, ctx.input_splits, ctx.output_splits, group=ctx.group, async_op=True
        )
        pending.keep_alive = d_out
        # `_AllToAllStart.backward` (the only consumer) ignores this and waits for the transfer.
        return d_out, None, None, None, None


def _start(x, output_splits, input_splits, group):
    pending = _Pending()
    return _AllToAllStart.apply(x, output_splits, input_splits, group, pending), (
        output_splits,
        input_splits,
        group,
        pending,
    )


def _wait(out, started):
    return _AllToAllWait.apply(out, *started)


class _HostRead:
    """A device tensor's values for the host: the copy is queued now (into pinned memory, without
    blocking), `values()` waits for it; the host may launch more work in between."""

    def __init__(self, t: torch.Tensor) -> None:
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = t, None

    def values(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def _as_input_shape(y_TH: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # A 2-D input gets the (T, H) result itself, not a view (FSDP2 warns about views).
    return y_TH if x.dim() == 2 else y_TH.reshape(x.shape)


class ExpertParallelMoE(nn.Module):
    """A `MoELayer` with its experts spread over the expert-parallel ranks of `mesh`.

    `ExpertParallelMoE(layer, mesh, mode="dropless" | "capacity", capacity_factor=1.0,
    num_chunks=1)`; forward(x (..., H)) -> (..., H), like `layer`. `num_chunks > 1` (dropless)
    splits the tokens into chunks whose all-to-alls are started asynchronously, so that one chunk's
    transfers can overlap another's experts, forward and backward; whether that pays is measured in
    benchmarks/bench_expert_parallel.py.
    `mesh` is a 1-D DeviceMesh (expert parallelism only) or a
    2-D one with dims ("ep", "dp") (experts replicated over "dp", e.g. sharded there by FSDP2:
    `moekit.distributed.apply_fsdp`). The layer's router is shared (the same module); the experts
    become a `GroupedMLP` of N/EP experts, experts r*N/EP..(r+1)*N/EP-1 of `layer` on EP rank r
    (copied from `layer.experts` unless those live on the meta device), in the layer's weight
    layout. Parameter names equal `layer`'s, so `moekit.distributed.checkpoint` stores the same
    global tensors whatever the EP degree.

    Every rank routes its own tokens; the expert gradients sum the contributions of every EP rank's
    tokens (a data-parallel wrapper over the "dp" dim then averages them: `apply_fsdp` sets the
    divide factor to EP x DP so that they match a loss averaged over all ranks).

    With the layer's `aux_loss_coef > 0` (training), MoELayer's load-balancing loss is computed over
    the tokens of every rank of `mesh` (one all-reduce per mesh dim of counts, score sums and token
    counts, on the device), its gradient added through the output as MoELayer adds it; `aux_loss`
    keeps the global value, detached.
    """

    def __init__(
        self,
        layer: MoELayer,
        mesh: DeviceMesh,
        *,
        mode: str = "dropless",
        capacity_factor: float = 1.0,
        num_chunks: int = 1,
    ) -> None:
        super().__init__()
        if not isinstance(layer, MoELayer):
            raise TypeError(f"layer must be a moekit.MoELayer, got {type(layer).__name__}")
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim == 2 and tuple(mesh.mesh_dim_names or ()) != ("ep", "dp"):
            raise ValueError(f"a 2-D mesh must have dims ('ep', 'dp'), got {mesh.mesh_dim_names}")
        if mesh.ndim not in (1, 2):
            raise ValueError(f"mesh must be 1-D (ep) or 2-D (ep, dp), got {mesh.ndim} dims")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        if not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            raise ValueError(f"capacity_factor must be a positive number, got {capacity_factor!r}")
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
        if num_chunks > 1 and mode != "dropless":
            raise ValueError("num_chunks > 1 (all-to-all overlapped with the experts) exists for mode='dropless' only")
        self.mesh = mesh
        self.ep_mesh = mesh["ep"] if mesh.ndim == 2 else mesh
        self.ep_group = self.ep_mesh.get_group()
        self.ep_size = self.ep_mesh.size()
        self.ep_rank = self.ep_mesh.get_local_rank()
        if layer.num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={layer.num_experts} is not divisible by the expert-parallel size {self.ep_size}"
            )
        self.mode = mode
        self.capacity_factor = float(capacity_factor)
        self.num_chunks = num_chunks
        self.hidden_size = layer.hidden_size
        self.num_experts = layer.num_experts
        self.num_local_experts = layer.num_experts // self.ep_size
        self.top_k = layer.top_k
        self.score_func = layer.score_func
        self.norm_topk_prob = layer.norm_topk_prob
        self.aux_loss_coef = layer.aux_loss_coef
        self.aux_loss: torch.Tensor | None = None
        self._routing_stats: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.router = layer.router
        full = layer.experts
        weight = full.fc1.weights()
        ref = weight if isinstance(weight, torch.Tensor) else weight[0]
        self.experts = GroupedMLP(
            self.num_local_experts,
            full.hidden_size,
            full.ffn_hidden_size,
            bias=full.fc1.use_bias,
            activation=full.activation,
            glu_interleave_size=full.glu_interleave_size,
            single_grouped_weight=full.fc1.single_grouped_weight,
            backend=full.backend,
            device=ref.device,
            dtype=ref.dtype,
        )
        if ref.device.type != "meta":
            self._copy_local_experts(full)
        self.dropped_copies: torch.Tensor | None = None

    @torch.no_grad()
    def _copy_local_experts(self, full: GroupedMLP) -> None:
        first = self.ep_rank * self.num_local_experts
        for name in ("fc1", "fc2"):
            src, dst = getattr(full, name), getattr(self.experts, name)
            for src_params, dst_params in ((src.weights(), dst.weights()), (src.biases(), dst.biases())):
                if src_params is None:
                    continue
                src_full = src_params if isinstance(src_params, torch.Tensor) else torch.stack(src_params)
                local = src_full[first : first + self.num_local_experts]
                if isinstance(dst_params, torch.Tensor):
                    dst_params.copy_(local)
                else:
                    for p, value in zip(dst_params, local.unbind(0), strict=True):
                        p.copy_(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"input's last dimension is {x.shape[-1] if x.dim() else None}; expected "
                f"hidden_size={self.hidden_size} (input shape {tuple(x.shape)})"
            )
        x_TH = x.reshape(-1, self.hidden_size)
        # (copies per expert (N,), router scores summed over this rank's tokens (N,)) for the aux loss.
        self._routing_stats = []
        y_TH = self._dropless(x_TH) if self.mode == "dropless" else self._capacity(x_TH)
        if self.aux_loss_coef > 0 and self.training:
            y_TH = _AuxLossInjector.apply(y_TH, self._aux_loss(x_TH.shape[0]))
        self._routing_stats = []
        return _as_input_shape(y_TH, x)

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`MoELayer.route`: (top-k weights (T, K) fp32, expert ids (T, K), scores (T, N) fp32)."""
        weights, ids, scores = MoELayer.route(self, x_TH)
        if self.aux_loss_coef > 0 and self.training:
            self._routing_stats.append((ids, scores.sum(0)))
        return weights, ids, scores

    def _aux_loss(self, num_tokens: int) -> torch.Tensor:
        """MoELayer's load-balancing loss `coef * N * sum_e f_e * P_e` over the tokens of every rank
        of the mesh: f_e (share of routed copies) and P_e (mean score) come from one all-reduce of
        (copies per expert, score sums, tokens) over the mesh (per dim); the returned part, this
        rank's, differentiates its own scores' sum, scaled so that the mean over the mesh's ranks
        (what data-parallel gradient averaging takes) is the loss of one process on all the tokens,
        whatever each rank's token count. `self.aux_loss` keeps that global loss, detached."""
        ids = torch.cat([i.reshape(-1) for i, _ in self._routing_stats])
        score_sum = torch.stack([s for _, s in self._routing_stats]).sum(0)
        copies = torch.zeros(self.num_experts, dtype=torch.float64, device=ids.device)
        copies.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.float64))  # integer-valued: exact
        totals = torch.cat([copies, score_sum.detach().double(), copies.new_full((1,), num_tokens)])
        for dim in range(self.mesh.ndim):
            dist.all_reduce(totals, group=self.mesh.get_group(dim))
        num_experts = self.num_experts
        routed_share = (totals[:num_experts] / (totals[-1] * self.top_k)).to(score_sum.dtype)
        scale = self.aux_loss_coef * num_experts
        self.aux_loss = scale * (routed_share * (totals[num_experts:-1] / totals[-1]).to(score_sum.dtype)).sum()
        return scale * (routed_share * score_sum).sum() * (self.mesh.size() / totals[-1]).to(score_sum.dtype)

    def _dropless(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Dropless dispatch and combine of x_TH's tokens in `num_chunks` token chunks: every
        all-to-all starts as soon as its input exists and is waited for only where its output is
        needed, so chunk c+1's dispatch and chunk c's combine can run while chunk c's (c+1's)
        experts compute. One host read for all chunks' split sizes."""
        ep_size, local_L = self.ep_size, self.num_local_experts
        use_triton = use_triton_rows(self.experts.backend, x_TH)
        routed = []
        # Exactly num_chunks pieces (some may be empty) on every rank, whatever its token count: the
        # ranks' all-to-alls must pair up.
        for x_chunk in torch.tensor_split(x_TH, self.num_chunks):
            weights_TK, ids_TK, _ = self.route(x_chunk)
            routed.append((x_chunk, weights_TK, dropless_maps(ids_TK, self.num_experts)))
        num_chunks = len(routed)
        # Counts to each destination rank, chunk-major: (EP, chunks, L); received (EP sources, chunks, L).
        send_counts = torch.stack([maps.counts for *_, maps in routed]).view(num_chunks, ep_size, local_L)
        send_counts = send_counts.transpose(0, 1)
        recv_counts = torch.empty_like(send_counts, memory_format=torch.contiguous_format)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.ep_group)
        # The one host read of a dropless all-to-all: every chunk's split sizes, in one copy, queued
        # before the send buffers' gathers and waited for after them, so the GPU gathers meanwhile.
        splits_read = _HostRead(torch.cat([send_counts.sum(2).reshape(-1), recv_counts.sum(2).reshape(-1)]))
        chunks = []
        for x_chunk, weights_TK, maps in routed:
            # The send buffers: copies sorted by expert, so grouped by destination rank.
            x_send = move_rows(x_chunk, maps.token_of_row, maps.row_of_copy, use_triton)
            probs_send = move_rows(
                weights_TK.reshape(-1, 1), maps.copy_of_row, maps.row_of_copy.reshape(-1, 1), use_triton
            )
            chunks.append((x_send, probs_send, maps))
        splits = splits_read.values()
        send = [[splits[r * num_chunks + c] for r in range(ep_size)] for c in range(num_chunks)]
        recv = [[splits[(ep_size + r) * num_chunks + c] for r in range(ep_size)] for c in range(num_chunks)]
        dispatched = []
        for c, (x_send, probs_send, _) in enumerate(chunks):
            dispatched.append(
                (_start(x_send, recv[c], send[c], self.ep_group), _start(probs_send, recv[c], send[c], self.ep_group))
            )
        expert_of_block = torch.arange(local_L, device=x_TH.device).repeat(ep_size)
        combined = []
        for c, ((x_recv, x_started), (probs_recv, probs_started)) in enumerate(dispatched):
            x_recv = _wait(x_recv, x_started)
            probs_recv = _wait(probs_recv, probs_started)
            # Received rows come grouped (source rank, local expert).
            local_ids = torch.repeat_interleave(
                expert_of_block, recv_counts[:, c].reshape(-1), output_size=x_recv.shape[0]
            )
            y_recv = self._local_experts(x_recv, probs_recv, local_ids, use_triton)
            combined.append(_start(y_recv, send[c], recv[c], self.ep_group))
        # Each token's K outputs (already weighted by the experts' probs) summed back.
        out = [
            move_rows(_wait(*started), chunk[2].row_of_copy, chunk[2].token_of_row, use_triton)
            for started, chunk in zip(combined, chunks, strict=True)
        ]
        return out[0] if num_chunks == 1 else torch.cat(out)

    def capacity(self, num_tokens: int) -> int:
        """Slots per (source rank, expert) for `num_tokens` tokens on each rank."""
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def _capacity(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Fixed-size dispatch and combine: every buffer's shape depends on T, K, N, EP and C only,
        so nothing is read by the host and the step can be captured in a CUDA graph."""
        num_tokens = x_TH.shape[0]
        if num_tokens == 0:
            raise ValueError("mode='capacity' needs at least one token per rank (every rank passes the same count)")
        slots = self.capacity(num_tokens)
        use_triton = use_triton_rows(self.experts.backend, x_TH)
        weights_TK, ids_TK, _ = self.route(x_TH)
        maps = capacity_maps(ids_TK, self.num_experts, self.ep_size, slots)
        self.dropped_copies = maps.dropped
        # recv_counts[s * L + e]: copies that EP rank s routed to this rank's local expert e.
        recv_counts = torch.empty_like(maps.counts)
        dist.all_to_all_single(recv_counts, maps.counts, group=self.ep_group)
        x_send = move_rows(x_TH, maps.token_of_slot, maps.slot_of_copy, use_triton)
        probs_send = move_rows(
            weights_TK.reshape(-1, 1), maps.copy_of_slot, maps.slot_of_copy.reshape(-1, 1), use_triton
        )
        x_recv = all_to_all_rows(x_send, None, None, self.ep_group)
        probs_recv = all_to_all_rows(probs_send, None, None, self.ep_group)
        local_ids = received_local_ids(recv_counts.view(self.ep_size, self.num_local_experts), slots)
        y_recv = self._local_experts(x_recv, probs_recv, local_ids, use_triton)
        y_back = all_to_all_rows(y_recv, None, None, self.ep_group)
        # Dropped copies read their destination's sentinel slot, which came back as zeros.
        return move_rows(y_back, maps.slot_of_copy, maps.token_of_slot, use_triton)

    def _local_experts(
        self, x_recv: torch.Tensor, probs_recv: torch.Tensor, local_ids: torch.Tensor, use_triton: bool
    ) -> torch.Tensor:
        """Received rows through the local experts, as `moekit.moe_experts` runs its rows: x_recv
        (R, H) in any order, probs_recv (R, 1) their router weights, local_ids (R,) their local
        expert, L for an empty slot. Sorted by local expert on the device (empty slots last: the
        grouped MLP's padding rows past sum(m_splits), not computed, zero output and gradient), the
        fused grouped MLP with the weights as probs, back in received order. The experts run as a
        module call, so FSDP2's hooks on them gather their parameters."""
        by_expert = dropless_maps(local_ids[:, None], self.num_local_experts)  # ids == L sort last, uncounted
        slot_of_sorted, sorted_of_slot = by_expert.token_of_row, by_expert.row_of_copy
        x_sorted = move_rows(x_recv, slot_of_sorted, sorted_of_slot, use_triton)
        probs_sorted = move_rows(probs_recv, slot_of_sorted, sorted_of_slot, use_triton)
        y_sorted = self.experts(x_sorted, by_expert.counts, probs=probs_sorted.view(-1))
        return move_rows(y_sorted, sorted_of_slot, slot_of_sorted, use_triton)

    def extra_repr(self) -> str:
        capacity = f", capacity_factor={self.capacity_factor}" if self.mode == "capacity" else ""
        return (
            f"num_experts={self.num_experts}, ep_size={self.ep_size}, ep_rank={self.ep_rank}, "
            f"mode={self.mode!r}{capacity}"
        )
