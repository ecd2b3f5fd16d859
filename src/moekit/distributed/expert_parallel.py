"""Expert parallelism: each rank of an expert-parallel group holds N/EP experts, and the routed
token copies travel to the rank of their expert and back with `all_to_all_single`.

Legend: T tokens (this rank's), K top-k, N experts in all, H hidden size; EP ranks in the group,
L = N/EP experts per rank ("local"), C slots per (source rank, expert) in capacity mode.

`ExpertParallelMoE` is `MoELayer`'s parts recomposed: the same `TopKRouter` module, this rank's
experts (`GroupedMLP.select_experts`), and the dispatch below; the layer's input check and output
(`moekit.nn.moe_layer.layer_input` / `layer_output`) are MoELayer's own.

Dispatch and combine, for one rank (index maps in `moekit.distributed.dispatch`, all on the device):
1. route this rank's tokens with the router and sort the T*K copies by global expert (moe_experts'
   device routing). Experts r*L..(r+1)*L-1 live on rank r, so the sorted copies are already
   grouped by destination rank.
2. exchange the per-expert counts with `all_to_all_single` on the device: rank r learns, for each
   source rank s, how many copies s routed to each of r's L experts.
3. gather the send buffer straight from the tokens (one (M, H) copy: the all-to-all's input) and
   the router weights beside it; `all_to_all_single` (differentiable: its backward is the reverse
   all-to-all); the received rows, grouped (source rank, local expert), go through the local
   experts as `moekit.moe_experts` runs its rows (sorted by local expert on the device, the fused
   grouped MLP with the router weights as probs, back in received order; the grouped MLP keeps its
   sorted input for the weight gradients, an (R, H) tensor, where moe_experts gathers it again from
   the K times smaller tokens); the outputs travel back the same way and each token's K (already
   weighted) outputs are summed in fixed order. Every row movement is a deterministic gather-sum,
   forward and backward: no floating-point atomics.

Every rank of the group takes part in every forward and backward with any token count, 0 included
(a rank without tokens still sends and receives: the others' copies reach its experts). Arguments
are refused at construction, on every rank alike, before any collective.

Modes:
- "dropless": the all-to-all splits are the exchanged counts, so their sums must reach the host:
  one device-to-host copy per forward (the split sizes of the dispatch, which the combine and both
  backward passes reuse; with num_chunks > 1, all chunks' sizes in the same one copy). Outputs and
  gradients equal the single-process `MoELayer`'s.
- "capacity": every (source rank, expert) pair gets C slots (and each destination one sentinel slot
  that dropped copies point to), so every buffer has a size fixed by C and the maps are computed
  without a host read. C = ceil(capacity_factor * T_C * K / N) must be the same on every rank of the
  group, so T_C is one number for all: `capacity_tokens` if given, else the largest token count of
  the group in this forward, agreed by one all-reduce (max) of one integer over the EP group, which
  the host reads (it sizes the buffers: on CUDA one device-to-host copy of one integer, a sync).
  With `capacity_tokens` nothing is read by the host and the step can be captured in a CUDA graph;
  a rank with more tokens than that just drops more copies. While a CUDA graph is being captured
  without `capacity_tokens`, nothing can be read either: T_C is then this rank's own token count,
  so every rank must capture with the same one (as before ranks could differ). Copies past C are
  dropped, the last ones in token order (the first C copies of each expert, in token order, are
  kept): deterministic. Empty slots travel but are padding rows of the local grouped MLP (not
  computed). `dropped_copies` holds the number of copies this rank's tokens lost in the last
  forward, as a device tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moekit.distributed.dispatch import (
    capacity_maps,
    dropless_maps,
    move_rows,
    received_local_ids,
    sentinel_slots,
    use_triton_rows,
)
from moekit.nn.moe_layer import MoELayer, layer_input, layer_output
from moekit.nn.router import LoadBalancingStats, TopKRouting
from moekit.validation import check_choice, check_float, check_positive_int

MODES = ("dropless", "capacity")


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows, differentiable: the backward sends the gradients back."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_splits: list[int] | None,
        input_splits: list[int] | None,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        rows = x.shape[0] if output_splits is None else sum(output_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
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
        self.work: dist.Work | None = None
        self.keep_alive: torch.Tensor | None = None
        self.d_input: torch.Tensor | None = None


class _AllToAllStart(torch.autograd.Function):
    """Start `all_to_all_single` without waiting; its output is valid after `_AllToAllWait`.

    The backward mirrors it: `_AllToAllWait`'s backward starts the reverse all-to-all of the
    gradient, this backward waits for it. Autograd runs the nodes of later chunks first, so another
    chunk's expert backward can run while a transfer is in flight.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
        pending: _Pending,
    ) -> torch.Tensor:
        ctx.pending = pending
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        x = x.contiguous()
        pending.work = dist.all_to_all_single(out, x, output_splits, input_splits, group=group, async_op=True)
        pending.keep_alive = x  # the input must outlive the transfer
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        pending = ctx.pending
        pending.work.wait()
        d_input = pending.d_input
        pending.work = pending.keep_alive = pending.d_input = None
        return d_input, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        out: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
        pending: _Pending,
    ) -> torch.Tensor:
        assert pending.work is not None  # started by _AllToAllStart
        pending.work.wait()
        pending.work = pending.keep_alive = None
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.pending = output_splits, input_splits, group, pending
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        pending = ctx.pending
        d_out = d_out.contiguous()
        pending.d_input = d_out.new_empty((sum(ctx.input_splits), *d_out.shape[1:]))
        pending.work = dist.all_to_all_single(
            pending.d_input, d_out, ctx.input_splits, ctx.output_splits, group=ctx.group, async_op=True
        )
        pending.keep_alive = d_out
        # `_AllToAllStart.backward` (the only consumer) ignores this and waits for the transfer.
        return d_out, None, None, None, None


def _start(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> tuple[torch.Tensor, tuple[list[int], list[int], dist.ProcessGroup, _Pending]]:
    pending = _Pending()
    return _AllToAllStart.apply(x, output_splits, input_splits, group, pending), (
        output_splits,
        input_splits,
        group,
        pending,
    )


def _wait(out: torch.Tensor, started: tuple[list[int], list[int], dist.ProcessGroup, _Pending]) -> torch.Tensor:
    return _AllToAllWait.apply(out, *started)


class _HostRead:
    """A device tensor's values for the host: the copy is queued now (into pinned memory, without
    blocking), `values()` waits for it; the host may launch more work in between."""

    def __init__(self, t: torch.Tensor) -> None:
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.ready: torch.cuda.Event | None = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = t, None

    def values(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class ExpertParallelMoE(nn.Module):
    """A `MoELayer` with its experts spread over the expert-parallel ranks of `mesh`.

    `ExpertParallelMoE(layer, mesh, mode="dropless" | "capacity", capacity_factor=1.0,
    num_chunks=1, capacity_tokens=None)`; forward(x (..., H)) -> (..., H), like `layer`, with any
    number of tokens on each rank (0 included). `num_chunks > 1` (dropless) splits the tokens into
    chunks whose all-to-alls are started asynchronously, so that one chunk's transfers can overlap
    another's experts, forward and backward; whether that pays is measured in
    benchmarks/bench_expert_parallel.py. `capacity_factor` and `capacity_tokens` set capacity
    mode's C (module docstring).
    `mesh` is a 1-D DeviceMesh (expert parallelism only) or a
    2-D one with dims ("ep", "dp") (experts replicated over "dp", e.g. sharded there by FSDP2:
    `moekit.distributed.apply_fsdp`). `router` is the layer's router (the same module); `experts`
    are experts r*N/EP..(r+1)*N/EP-1 of `layer` on EP rank r (`GroupedMLP.select_experts`: copied
    unless on the meta device), in the layer's weight layout. Parameter names equal `layer`'s, so
    `moekit.distributed.checkpoint` stores the same global tensors whatever the EP degree.

    Every rank routes its own tokens; the expert gradients sum the contributions of every EP rank's
    tokens (a data-parallel wrapper over the "dp" dim then averages them: `apply_fsdp` sets the
    divide factor to EP x DP so that they match a loss averaged over all ranks).

    With the router's `aux_loss_coef > 0` (training), MoELayer's load-balancing loss is computed
    over the tokens of every rank of `mesh` (the router's statistics all-reduced, one all-reduce per
    mesh dim, on the device), its gradient added through the output as MoELayer adds it; `aux_loss`
    keeps the global value, detached (0 when no rank has a token).
    """

    def __init__(
        self,
        layer: MoELayer,
        mesh: DeviceMesh,
        *,
        mode: str = "dropless",
        capacity_factor: float = 1.0,
        num_chunks: int = 1,
        capacity_tokens: int | None = None,
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
        self.mode = check_choice("mode", mode, MODES)
        self.capacity_factor = check_float("capacity_factor", capacity_factor, positive=True)
        self.num_chunks = check_positive_int("num_chunks", num_chunks)
        if capacity_tokens is not None:
            capacity_tokens = check_positive_int("capacity_tokens", capacity_tokens)
        self.capacity_tokens = capacity_tokens
        if self.num_chunks > 1 and mode != "dropless":
            raise ValueError("num_chunks > 1 (all-to-all overlapped with the experts) exists for mode='dropless' only")
        if capacity_tokens is not None and mode != "capacity":
            raise ValueError("capacity_tokens sets capacity mode's slots; it exists for mode='capacity' only")
        self.mesh = mesh
        self.ep_mesh = mesh["ep"] if mesh.ndim == 2 else mesh
        self.ep_group = self.ep_mesh.get_group()
        self.ep_size: int = self.ep_mesh.size()
        self.ep_rank = self.ep_mesh.get_local_rank()
        if layer.num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={layer.num_experts} is not divisible by the expert-parallel size {self.ep_size}"
            )
        self.num_local_experts = layer.num_experts // self.ep_size
        self.router = layer.router
        self.experts = layer.experts.select_experts(self.ep_rank * self.num_local_experts, self.num_local_experts)
        self.aux_loss: torch.Tensor | None = None
        self.dropped_copies: torch.Tensor | None = None

    @property
    def hidden_size(self) -> int:
        """The router's."""
        return self.router.hidden_size

    @property
    def num_experts(self) -> int:
        """Experts in all (over every EP rank): the router's."""
        return self.router.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TH = layer_input("ExpertParallelMoE", self.router, x)
        routing = self.router(x_TH)
        aux = self._aux_loss(routing) if self.router.aux_loss_coef > 0 and self.training else None
        y_TH = self._dropless(x_TH, routing) if self.mode == "dropless" else self._capacity(x_TH, routing)
        return layer_output(y_TH, x.shape, aux)

    def _aux_loss(self, routing: TopKRouting) -> torch.Tensor:
        """MoELayer's load-balancing loss over the tokens of every rank of the mesh: the router's
        statistics (copies per expert, score sums, tokens) all-reduced over the mesh (per dim) give
        f_e and the token count; the returned part, this rank's, differentiates its own scores'
        sum, scaled so that the mean over the mesh's ranks (what data-parallel gradient averaging
        takes) is the loss of one process on all the tokens, whatever each rank's token count.
        `self.aux_loss` keeps that global loss, detached."""
        router, num_experts = self.router, self.router.num_experts
        local = router.load_balancing_stats(routing)
        totals = torch.cat([local.copies, local.score_sum.detach().double(), local.tokens.view(1)])
        for dim in range(self.mesh.ndim):
            dist.all_reduce(totals, group=self.mesh.get_group(dim))
        total = LoadBalancingStats(totals[:num_experts], totals[num_experts:-1].to(local.score_sum.dtype), totals[-1])
        self.aux_loss = router.load_balancing_loss(total).detach()
        return router.load_balancing_loss(local, total) * self.mesh.size()

    def _dropless(self, x_TH: torch.Tensor, routing: TopKRouting) -> torch.Tensor:
        """Dropless dispatch and combine of x_TH's tokens in `num_chunks` token chunks: every
        all-to-all starts as soon as its input exists and is waited for only where its output is
        needed, so chunk c+1's dispatch and chunk c's combine can run while chunk c's (c+1's)
        experts compute. One host read for all chunks' split sizes."""
        ep_size, local_L = self.ep_size, self.num_local_experts
        use_triton = use_triton_rows(self.experts.backend, x_TH)
        routed = []
        # Exactly num_chunks pieces (some may be empty) on every rank, whatever its token count: the
        # ranks' all-to-alls must pair up.
        pieces = (torch.tensor_split(t, self.num_chunks) for t in (x_TH, routing.weights, routing.ids))
        for x_chunk, weights_TK, ids_TK in zip(*pieces, strict=True):
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
        """Slots C per (source rank, expert) when T_C (module docstring) is `num_tokens`."""
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.router.top_k / self.num_experts))

    def _capacity_token_count(self, num_tokens: int, device: torch.device) -> int:
        """T_C of a forward in which this rank has `num_tokens` tokens: `capacity_tokens` if set;
        during CUDA graph capture `num_tokens`; else the group's largest token count, from one
        all-reduce (max) of one integer over the EP group, read by the host."""
        if self.capacity_tokens is not None:
            return self.capacity_tokens
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return num_tokens
        most = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.ep_group)
        return int(most.item())

    def _capacity(self, x_TH: torch.Tensor, routing: TopKRouting) -> torch.Tensor:
        """Fixed-size dispatch and combine: every buffer's shape depends on EP, L and C (the
        same on every rank) and each map's on this rank's T too, so nothing but C is read by the
        host (and C not with `capacity_tokens`)."""
        num_tokens, hidden = x_TH.shape
        slots = self.capacity(self._capacity_token_count(num_tokens, x_TH.device))
        use_triton = use_triton_rows(self.experts.backend, x_TH)
        maps = capacity_maps(routing.ids, self.num_experts, self.ep_size, slots)
        self.dropped_copies = maps.dropped
        # recv_counts[s * L + e]: copies that EP rank s routed to this rank's local expert e.
        recv_counts = torch.empty_like(maps.counts)
        dist.all_to_all_single(recv_counts, maps.counts, group=self.ep_group)
        x_src, probs_src = x_TH, routing.weights.reshape(-1, 1)
        x_bwd, probs_bwd = maps.slot_of_copy, maps.slot_of_copy.reshape(-1, 1)
        if num_tokens == 0:
            # No tokens: every slot is empty and reads row 0; one zero row is there to be read (its
            # gradient, from a sentinel slot, is zero and is dropped with it).
            x_src = torch.cat([x_TH, x_TH.new_zeros(1, hidden)])
            probs_src = torch.cat([probs_src, probs_src.new_zeros(1, 1)])
            x_bwd = probs_bwd = sentinel_slots(self.num_experts, self.ep_size, slots, 1, x_TH.device)
        x_send = move_rows(x_src, maps.token_of_slot, x_bwd, use_triton)
        probs_send = move_rows(probs_src, maps.copy_of_slot, probs_bwd, use_triton)
        x_recv = all_to_all_rows(x_send, None, None, self.ep_group)
        probs_recv = all_to_all_rows(probs_send, None, None, self.ep_group)
        local_ids = received_local_ids(recv_counts.view(self.ep_size, self.num_local_experts), slots)
        y_recv = self._local_experts(x_recv, probs_recv, local_ids, use_triton)
        y_back = all_to_all_rows(y_recv, None, None, self.ep_group)
        if num_tokens == 0:
            # Nothing to combine; the (0, H) result still leads the backward to the reverse transfers.
            return y_back[:0].clone()
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
        capacity = ""
        if self.mode == "capacity":
            capacity = f", capacity_factor={self.capacity_factor}, capacity_tokens={self.capacity_tokens}"
        return (
            f"num_experts={self.num_experts}, ep_size={self.ep_size}, ep_rank={self.ep_rank}, "
            f"mode={self.mode!r}{capacity}"
        )
