"""GroupedLinear under torch.distributed wrappers (DDP, FSDP2) on CPU with gloo, two ranks.

DDP keeps parameter storage; FSDP2 replaces every parameter with a sharded DTensor, so the discrete
layout's per-expert weights stop being slices of one buffer: results must stay exact (with the
announced stacking warning), and the gradients must match an unwrapped module's.
"""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent(
    """
    import os, sys, warnings
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp

    def run(rank, world, port, wrapper):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        import moekit
        torch.manual_seed(0)
        ref = moekit.GroupedLinear(4, 16, 8, bias=True, dtype=torch.float64)
        model = moekit.GroupedLinear(4, 16, 8, bias=True, dtype=torch.float64)
        model.load_state_dict(ref.state_dict())
        if wrapper == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        torch.manual_seed(1)
        x_all = torch.randn(world * 20, 16, dtype=torch.float64)
        x = x_all[rank * 20:(rank + 1) * 20]
        m_splits = [5, 0, 10, 5]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = model(x, m_splits)
            y.square().sum().backward()
        # The reference sees every rank's rows; DDP/FSDP average gradients over ranks.
        for r in range(world):
            ref(x_all[r * 20:(r + 1) * 20], m_splits).square().sum().backward()
        torch.testing.assert_close(y, ref(x, m_splits), rtol=0, atol=1e-12)
        inner = model.module if wrapper == "ddp" else model
        for name, p in inner.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, getattr(ref, name).grad / world, rtol=1e-12, atol=1e-12)
        stacked = any("not adjacent slices" in str(w.message) for w in caught)
        assert stacked == (wrapper == "fsdp2"), [str(w.message) for w in caught]
        dist.destroy_process_group()

    if __name__ == "__main__":
        port, wrapper = int(sys.argv[1]), sys.argv[2]
        mp.spawn(run, args=(2, port, wrapper), nprocs=2)
        print("OK", wrapper)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_grouped_linear_under_wrapper(tmp_path, wrapper):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script), str(_free_port()), wrapper], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"OK {wrapper}" in proc.stdout
