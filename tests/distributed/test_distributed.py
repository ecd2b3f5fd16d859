"""moekit.distributed on CPU with gloo, in spawned process groups (tests/distributed/distributed_worker.py).

Spawning is what costs (each rank imports torch and moekit), so each group runs many checks:
- train, world sizes 2 and 4: DDP and FSDP2 (fp32; bf16 compute with fp32 masters and reductions)
  of GroupedLinear, GroupedMLP and MoELayer in both layouts, FSDP2 shards along and through experts,
  against one process on the full batch; expert parallelism (dropless, capacity) against MoELayer;
  FSDP2 + EP on (ep, dp) meshes against one process.
- checkpoints: one process -> 4 ranks (FSDP2 + EP=2, discrete) -> resume bit-identical, EP 2 -> 4,
  -> 2 ranks (FSDP2 discrete; FSDP2 + EP=2 grouped) -> one process; a transformers model saved
  under FSDP2 loads into the plain transformers model; refusals leave the model untouched.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import moekit
from moekit.distributed import checkpoint

# DCP in one process without a process group says it assumes a single process: what these tests mean.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

WORKER = Path(__file__).with_name("distributed_worker.py")
MODES = ("dropless", "capacity")
sys.path.insert(0, str(WORKER.parent))
import distributed_worker as dw  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How torch.multiprocessing reports a rank killed by a signal (the parent exits 1 with this message).
KILLED_BY_SIGNAL = "terminated with signal"


def run_group(group: str, world: int, workdir: Path, backend: str = "gloo") -> str:
    """Run one group of checks in `world` spawned ranks; its stdout. A group whose rank was killed by a
    signal runs once more, with a warning that names the signal: the ranks run torch's CPU ops and
    gloo only (no native code of moekit's), and a full CI run saw one rank of the FSDP2 + EP checks
    die by SIGSEGV once under load, not again in isolation. A failed check (a rank that raises) is
    never run again."""
    # The ranks run real kernels, not Triton's interpreter (the CPU backends are torch's).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(WORKER), group, str(world), str(_free_port()), backend, str(workdir)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )

    proc = run()
    if proc.returncode != 0 and KILLED_BY_SIGNAL in proc.stderr:
        killed = next(line for line in proc.stderr.splitlines() if KILLED_BY_SIGNAL in line)
        warnings.warn(f"{group} world {world}: a rank died ({killed.strip()}); running the group again", stacklevel=2)
        proc = run()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert f"DONE {group} {world}" in proc.stdout
    return proc.stdout


def test_run_group_runs_a_group_again_only_when_a_rank_died_by_a_signal(monkeypatch, tmp_path):
    """A rank killed by a signal: the group runs once more, with a warning naming it; a rank whose check
    raised: no second run, the failure stands."""
    died = subprocess.CompletedProcess([], 1, "", f"ProcessExitedException: process 3 {KILLED_BY_SIGNAL} SIGSEGV\n")
    passed = subprocess.CompletedProcess([], 0, "OK one\nDONE g 2\n", "")
    raised = subprocess.CompletedProcess([], 1, "", "AssertionError: ep=2 fsdp gradient\n")
    calls: list[int] = []

    def fake(outcomes):
        def run(*args, **kwargs):
            calls.append(1)
            return outcomes[len(calls) - 1]

        return run

    monkeypatch.setattr(subprocess, "run", fake([died, passed]))
    with pytest.warns(UserWarning, match=r"^g world 2: a rank died \(.*SIGSEGV\); running the group again$"):
        assert ok_lines(run_group("g", 2, tmp_path)) == {"OK one"}
    assert len(calls) == 2
    calls.clear()
    monkeypatch.setattr(subprocess, "run", fake([raised, passed]))
    with pytest.raises(AssertionError, match="ep=2 fsdp gradient"):
        run_group("g", 2, tmp_path)
    assert len(calls) == 1


def ok_lines(stdout: str) -> set[str]:
    return {line.strip() for line in stdout.replace("OK ", "\nOK ").splitlines() if line.startswith("OK ")}


@pytest.mark.parametrize("world", [2, 4], ids=["world2", "world4"])
def test_data_and_expert_parallel(tmp_path, world):
    done = ok_lines(run_group("train", world, tmp_path))
    expected = {
        f"OK dp {w} {k} grouped={g} shard_dim=None"
        for w in ("ddp", "fsdp2")
        for k in ("linear", "mlp", "moe")
        for g in (True, False)
    }
    expected |= {f"OK dp fsdp2 {k} grouped=True shard_dim=1" for k in ("linear", "mlp", "moe")}
    expected |= {f"OK dp fsdp2-bf16 {k} grouped={g}" for k in ("mlp", "moe") for g in (True, False)}
    expected |= {f"OK dp fsdp2-quantized {r} grouped={g}" for r in ("fp8_block", "fp8_rowwise") for g in (True, False)}
    expected |= {
        f"OK ep={ep} dropless grouped={g} chunks={c}"
        for ep in {2, world}
        for g, c in ((True, 1), (False, 1), (True, 3))
    }
    expected |= {f"OK ep={ep} dropless uneven tokens per rank" for ep in {2, world}}
    expected |= {
        f"OK ep={ep} x dp={world // ep} fsdp2 training {m} grouped={g} aux_loss_coef={a}"
        for ep in {2, world}
        for m, g, a in (
            ("dropless", True, 0.0),
            ("dropless", False, 0.0),
            ("dropless", True, 0.5),
            ("capacity", False, 0.5),
        )
    }
    for ep in {2, world}:
        for pattern in dw.uneven_patterns(world):
            counts = dw.uneven_counts(pattern, world)
            expected |= {
                f"OK ep={ep} capacity tokens={counts} factor={f} capacity_tokens={c}"
                for f, c in ((float(dw.N), None), (0.5, None), (1.0, 3))
            }
        for pattern in (*dw.uneven_patterns(world), (0, 0, 0, 0)):
            expected |= {f"OK ep={ep} {m} aux loss tokens={dw.uneven_counts(pattern, world)}" for m in MODES}
    sequences = [dw.SEQUENCES[r % 4] for r in range(world)]
    expected |= {f"OK ep=2 x dp={world // 2} fsdp2 {m} uneven sequences {sequences}" for m in MODES}
    # The capacity lines carry their dropped count after the name: compare the names.
    done |= {line.rsplit(" dropped=", 1)[0] for line in done if " capacity tokens=" in line}
    assert expected <= done, sorted(expected - done)
    capacity = [line for line in done if "capacity factor=" in line]
    assert any("dropped=0" not in line for line in capacity), "capacity mode never dropped a copy"
    assert all("dropped=0" in line for line in capacity if f"factor={float(dw.N)}" in line)


def _capacity_maps_reference(ids: torch.Tensor, num_experts: int, ep_size: int, slots: int):
    """Python loops over the copies in (token, k) order: (token_of_slot, copy_of_slot, slot_of_copy,
    dropped) as capacity_maps lays them out."""
    local = num_experts // ep_size
    width = local * slots + 1
    token_of_slot = [0] * (ep_size * width)
    copy_of_slot = [0] * (ep_size * width)
    slot_of_copy, seen = [], [0] * num_experts
    for copy, e in enumerate(ids.reshape(-1).tolist()):
        p, seen[e] = seen[e], seen[e] + 1
        block = (e // local) * width
        if p < slots:
            slot = block + (e % local) * slots + p
            token_of_slot[slot], copy_of_slot[slot] = copy // ids.shape[1], copy
        else:
            slot = block + local * slots
        slot_of_copy.append(slot)
    dropped = sum(max(0, c - slots) for c in seen)
    return torch.tensor(token_of_slot), torch.tensor(copy_of_slot), torch.tensor(slot_of_copy).view(ids.shape), dropped


CAPACITY_CASES = {
    # name: (expert ids (T, K) or (T, K, seed) for random ids, N, EP, C)
    "drops_and_empty_first_expert": ([[1, 3], [1, 2], [3, 1], [2, 3], [3, 2]], 4, 2, 1),
    "one_token": ([[2, 0]], 4, 2, 1),
    "all_on_last_expert_top1": ([[5], [5], [5], [5]], 6, 3, 2),
    "random_prime_experts_no_ep": ((9, 3, 0), 7, 1, 2),
    "random_ep4": ((13, 2, 1), 8, 4, 3),
}


@pytest.mark.parametrize("case", list(CAPACITY_CASES))
def test_capacity_maps_match_the_rule(case):
    from moekit.distributed.dispatch import capacity_maps, received_local_ids

    ids, num_experts, ep_size, slots = CAPACITY_CASES[case]
    if isinstance(ids, tuple):
        tokens, top_k, seed = ids
        g = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    ids = torch.as_tensor(ids)
    maps = capacity_maps(ids, num_experts, ep_size, slots)
    token_of_slot, copy_of_slot, slot_of_copy, dropped = _capacity_maps_reference(ids, num_experts, ep_size, slots)
    assert torch.equal(maps.token_of_slot.view(-1), token_of_slot)
    assert torch.equal(maps.copy_of_slot.view(-1), copy_of_slot)
    assert torch.equal(maps.slot_of_copy, slot_of_copy)
    assert int(maps.dropped) == dropped
    assert torch.equal(maps.counts, torch.bincount(ids.reshape(-1), minlength=num_experts))
    # The receiving side of every rank (here: all sources sent these counts): slot p of (source s,
    # local expert e) is expert e's when p < count, else padding (id L), sentinels too.
    local = num_experts // ep_size
    for dest in range(ep_size):
        recv = maps.counts[dest * local : (dest + 1) * local].repeat(ep_size, 1)
        got = received_local_ids(recv, slots).view(ep_size, local * slots + 1)
        for e in range(local):
            for p in range(slots):
                assert int(got[0, e * slots + p]) == (e if p < int(recv[0, e]) else local)
        assert (got[:, -1] == local).all()


@pytest.fixture
def fake_group():
    """torch's fake process group of 2 ranks (this process is rank 0; collectives do nothing) and
    its 1-D mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tokens", [dw.T, 0], ids=["tokens", "no-tokens"])
def test_capacity_mode_reads_nothing_on_host(monkeypatch, fake_group, tokens):
    """Capacity mode with capacity_tokens, forward and backward on meta tensors (no data: any host
    read raises) over a fake process group of 2 ranks, with tokens and without; without
    capacity_tokens it reads the agreed largest token count, and dropless its split sizes (so the
    check can fail). The local grouped MLP (tested for host syncs on its own, and meta-incapable)
    is a stand-in here."""
    import moekit.nn.grouped_mlp as grouped_mlp_module
    from moekit.distributed import ExpertParallelMoE

    calls = []

    def stand_in_mlp(x, fc1_weight, fc2_weight, m_splits, *, probs, **_):
        assert isinstance(m_splits, torch.Tensor) and m_splits.device.type == "meta", m_splits
        calls.append(x.shape)
        return x * probs[:, None] + (fc1_weight.sum() + fc2_weight.sum()) * 0

    monkeypatch.setattr(grouped_mlp_module, "grouped_mlp", stand_in_mlp)  # what GroupedMLP.forward calls
    layer = moekit.MoELayer(dw.H, dw.F, dw.N, dw.K, bias=True, device="meta", aux_loss_coef=0.1)
    model = ExpertParallelMoE(layer, fake_group, mode="capacity", capacity_factor=1.0, capacity_tokens=dw.T)
    x = torch.empty(tokens, dw.H, device="meta", requires_grad=True)
    y = model(x)
    y.sum().backward()
    slots = model.capacity(dw.T)
    assert calls == [(2 * (dw.N // 2 * slots + 1), dw.H)]
    assert y.shape == x.shape and x.grad.shape == x.shape and model.dropped_copies.device.type == "meta"
    assert model.router.weight.grad is not None and model.experts.fc1.weight.grad is not None
    with pytest.raises(RuntimeError, match="meta"):
        ExpertParallelMoE(layer, fake_group, mode="capacity")(x)
    with pytest.raises(NotImplementedError, match="meta"):
        ExpertParallelMoE(layer, fake_group)(x)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"capacity_factor": float("inf")}, ValueError, r"^capacity_factor must be a finite number, got inf$"),
        ({"capacity_factor": float("nan")}, ValueError, r"^capacity_factor must be a finite number, got nan$"),
        ({"capacity_factor": 0.0}, ValueError, r"^capacity_factor must be > 0, got 0.0$"),
        ({"capacity_factor": -1}, ValueError, r"^capacity_factor must be > 0, got -1.0$"),
        ({"capacity_factor": "1.25"}, TypeError, r"^capacity_factor must be a finite number, got '1.25' \(str\)$"),
        ({"capacity_factor": True}, TypeError, r"^capacity_factor must be a finite number, got True \(bool\)$"),
        ({"mode": "drop"}, ValueError, r"^unknown mode 'drop'; expected one of \('dropless', 'capacity'\)$"),
        ({"num_chunks": 0}, ValueError, r"^num_chunks must be an int >= 1, got 0$"),
        ({"num_chunks": 2.0}, TypeError, r"^num_chunks must be an int, got 2.0 \(float\)$"),
        ({"num_chunks": 2, "mode": "capacity"}, ValueError, r"^num_chunks > 1 .* for mode='dropless' only$"),
        ({"capacity_tokens": 0, "mode": "capacity"}, ValueError, r"^capacity_tokens must be an int >= 1, got 0$"),
        ({"capacity_tokens": "8", "mode": "capacity"}, TypeError, r"^capacity_tokens must be an int, got '8'"),
        ({"capacity_tokens": 8}, ValueError, r"^capacity_tokens sets capacity mode's slots; .* mode='capacity' only$"),
    ],
)
def test_expert_parallel_refuses_bad_arguments_at_construction(fake_group, kwargs, exc, match):
    """Refused in one line when the module is built (on every rank alike, before any collective):
    issue: capacity_factor=inf was accepted and the forward raised OverflowError."""
    from moekit.distributed import ExpertParallelMoE

    layer = moekit.MoELayer(dw.H, dw.F, dw.N, dw.K)
    with pytest.raises(exc, match=match):
        ExpertParallelMoE(layer, fake_group, **{"mode": "dropless", **kwargs})
    with pytest.raises(TypeError, match=r"^layer must be a moekit.MoELayer, got GroupedMLP$"):
        ExpertParallelMoE(layer.experts, fake_group)


def test_expert_parallel_is_the_layers_parts(fake_group):
    """The router is the layer's own module (not a copy of its settings); the experts are this
    rank's slice of the layer's, in its layout and options, under the layer's parameter names."""
    from moekit.distributed import ExpertParallelMoE

    torch.manual_seed(0)
    layer = moekit.MoELayer(dw.H, dw.F, dw.N, dw.K, bias=True, single_grouped_weight=False, glu_interleave_size=2)
    model = ExpertParallelMoE(layer, fake_group)
    assert model.router is layer.router
    names = dict(model.named_parameters()).keys()
    assert "router.weight" in names and names <= dict(layer.named_parameters()).keys()
    assert model.experts.options() == layer.experts.options()
    local = dw.N // 2  # rank 0 of 2
    for name in ("fc1", "fc2"):
        ours, full = getattr(model.experts, name), getattr(layer.experts, name)
        for i in range(local):
            assert torch.equal(getattr(ours, f"weight{i}"), getattr(full, f"weight{i}"))
            assert torch.equal(getattr(ours, f"bias{i}"), getattr(full, f"bias{i}"))
    layer.router.top_k = 1  # one setting, read where it lives
    assert model.router.top_k == 1 and layer.top_k == 1


@pytest.mark.gpu
def test_capacity_mode_cuda_graph_over_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL)")
    done = ok_lines(run_group("capacity_graph", 2, tmp_path, backend="nccl"))
    assert "OK capacity no host sync (cuda sync debug mode error)" in done, done
    assert any(line.startswith("OK capacity CUDA graph replays equal eager") for line in done), done


def test_checkpoints_across_world_sizes_layouts_and_ep(tmp_path):
    """1 -> 4 -> (4, EP 2 -> 4) -> 2 -> 1 process, layouts switching on the way; model and Adam state
    equal bit for bit after every load; resumed training repeats the uninterrupted losses."""
    pytest.importorskip("transformers")
    dw.one_process_save(tmp_path)
    done = ok_lines(run_group("ckpt4", 4, tmp_path))
    assert {
        "OK ckpt 1 -> 4 (ep=2, fsdp2, discrete)",
        "OK ckpt resume bit-identical losses (4 ranks)",
        "OK ckpt ep 2 -> 4, discrete -> grouped",
    } <= done, done
    done = ok_lines(run_group("ckpt2", 2, tmp_path))
    assert {
        "OK ckpt 4 -> 2 (ep=1, grouped=False)",
        "OK ckpt 4 -> 2 (ep=2, grouped=True)",
        "OK ckpt transformers apply_moekit + fsdp2 saved",
        "OK ckpt uneven expert shards -> through-expert shards and discrete",
    } <= done, done
    dw.one_process_check(tmp_path)


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "discrete"])
def test_transformers_checkpoint_both_ways(tmp_path, kind, grouped):
    """A plain transformers model's DCP checkpoint loads into its apply_moekit twin, and the twin's
    (moekit.distributed.checkpoint) into the plain model: gpt-oss's transposed experts included."""
    pytest.importorskip("transformers")
    import torch.distributed.checkpoint as dcp

    from moekit.integrations.transformers import apply_moekit

    plain = dw.tiny_hf_model("cpu", seed=1, kind=kind)
    dcp.save({"model": plain.state_dict()}, checkpoint_id=tmp_path / "plain")
    model = apply_moekit(dw.tiny_hf_model("cpu", seed=2, kind=kind), single_grouped_weight=grouped)
    checkpoint.load(tmp_path / "plain", model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    checkpoint.save(tmp_path / "moekit", model)
    back = dw.tiny_hf_model("cpu", seed=3, kind=kind)
    state = {"model": back.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "moekit")
    for key, value in plain.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_load_of_missing_checkpoint_is_refused_on_every_rank(tmp_path):
    """A path without a checkpoint: one line on each of 2 gloo ranks, before any collective."""
    done = ok_lines(run_group("ckpt_missing", 2, tmp_path))
    assert "OK ckpt missing path refused on every rank" in done, done


def test_load_of_missing_checkpoint_is_refused(tmp_path):
    model = moekit.MoELayer(dw.H, dw.F, dw.N, dw.K)
    with pytest.raises(FileNotFoundError, match=r"^checkpoint path '.*absent' does not exist; expected a directory"):
        checkpoint.load(tmp_path / "absent", model)
    with pytest.raises(FileNotFoundError, match=r"^checkpoint path '.*' holds no .metadata file; expected"):
        checkpoint.load(tmp_path, model)


def test_train_distributed_refuses_a_missing_resume_path_in_one_line(tmp_path):
    """examples/train_distributed.py: a wrong --resume is a usage error before any rank starts work."""
    script = Path(__file__).resolve().parents[2] / "examples" / "train_distributed.py"
    absent = tmp_path / "absent"
    done = subprocess.run([sys.executable, str(script), "--resume", str(absent)], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    expected = f"--resume: checkpoint path '{absent}' does not exist; expected a directory written by moekit"
    assert expected in done.stderr.strip().splitlines()[-1], done.stderr


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("case", ["missing_experts", "other_hidden_size", "other_interleave"])
def test_checkpoint_that_does_not_fit_is_refused_untouched(tmp_path, case):
    model, opt = dw.one_process_model(grouped=True)
    dw.train_steps(model, opt, 0, torch.device("cpu"), 1)
    checkpoint.save(tmp_path / "ckpt", model, opt)
    if case == "missing_experts":
        other = moekit.MoELayer(dw.H, dw.F, 2 * dw.N, dw.K, bias=True)
        match = r"global shapes differ.*experts.fc1.weight.*\(8, 24, 16\).*\(16, 24, 16\)"
    elif case == "other_hidden_size":
        other = moekit.MoELayer(dw.H + 2, dw.F, dw.N, dw.K, bias=True)
        match = r"global shapes differ.*router.weight"
    else:
        other = moekit.MoELayer(dw.H, dw.F, dw.N, dw.K, bias=True, glu_interleave_size=2)
        match = r"GLU interleave.*experts.fc1: checkpoint None, model 2"
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    if case != "other_hidden_size":
        dw.train_steps(other, other_opt, 0, torch.device("cpu"), 1)
    before = _params(other)
    opt_before = {k: v.clone() for k, v in other_opt.state_dict()["state"].get(0, {}).items()}
    with pytest.raises(ValueError, match=match):
        checkpoint.load(tmp_path / "ckpt", other, other_opt)
    after = _params(other)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    for k, v in other_opt.state_dict()["state"].get(0, {}).items():
        assert torch.equal(v, opt_before[k]), k


@pytest.mark.parametrize("interleave", [1, 2])
def test_checkpoint_keeps_interleaved_rows(tmp_path, interleave):
    """A model with interleaved fc1 rows saves and loads (other layout) with its interleave size."""
    torch.manual_seed(0)
    model = moekit.MoELayer(dw.H, dw.F, dw.N, dw.K, bias=True, glu_interleave_size=interleave)
    checkpoint.save(tmp_path / "ckpt", model)
    other = moekit.MoELayer(
        dw.H, dw.F, dw.N, dw.K, bias=True, glu_interleave_size=interleave, single_grouped_weight=False
    )
    checkpoint.load(tmp_path / "ckpt", other)
    x = torch.randn(10, dw.H)
    torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)
