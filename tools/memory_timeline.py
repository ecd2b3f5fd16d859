"""Which tensors are alive at the peak of one `moe_experts` forward + backward, on any machine: every
tensor an op makes is followed (a `TorchDispatchMode`), its storage counted from the op that made it
until the last tensor on it dies, and at the largest total the live storages are listed with their
shapes and the moekit function that made them. The inputs and the weights made before are not counted
(the "peak above the start" of the GPU benchmarks, whose caching allocator this does not model).

    PYTHONPATH=src python tools/memory_timeline.py [--layer mixtral] [--scale 16] [--quantization fp8_block]

Why: the layer's peak is set by which of its steps holds the most at once; this tells which step and
which tensors, at the real layers' proportions (T, H, F divided by --scale, the experts and top-k kept),
on the CPU (the Triton kernels under the interpreter, TRITON_INTERPRET=1, float32) where no GPU is at
hand. Byte counts scale with the shape; the order of the steps and what is alive together do not,
with two exceptions that do not scale down: the FP8 wgrad's layout pads every group by up to 127
columns (at a large --scale that padding can outweigh the rows), and the layer's memory contract keeps
h for fewer rows of a small Mixtral than of the real one.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import weakref
from dataclasses import dataclass

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import moekit  # noqa: E402

# (T, N, K, H, F) of the layers the benchmarks time.
LAYERS = {
    "deepseek-v3-ep8": (16384, 32, 8, 7168, 2048),
    "mixtral-8x7b": (16384, 8, 2, 4096, 14336),
    "qwen3-30b-a3b": (32768, 128, 8, 2048, 768),
    "gpt-oss-20b": (16384, 32, 4, 2880, 2880),
}


@dataclass
class _Storage:
    nbytes: int
    what: str
    made_by: str
    tensors: int = 0  # tensors made by ops on this storage and still alive
    probe: weakref.ref[torch.Tensor] | None = None  # one of them, to see the storage released in place


def _caller() -> str | None:
    """The innermost moekit frame of the current stack (file:line function), "outside moekit", or None
    for the Triton interpreter's own copies of a kernel's arguments (a CPU artifact: a GPU launch
    allocates nothing)."""
    stack = traceback.extract_stack()[:-3]
    if any("triton/runtime/interpreter" in frame.filename for frame in stack):
        return None
    for frame in reversed(stack):
        if "/moekit/" in frame.filename:
            return f"{frame.filename.split('/moekit/')[-1]}:{frame.lineno} {frame.name}"
    return "outside moekit"


class LiveBytes(TorchDispatchMode):
    """Follows every tensor an op returns; `peak` and `at_peak` (the live storages then, largest first).
    A storage counts from the op that first returns a tensor on it until the last such tensor dies or
    the storage is freed in place (seen at the next op)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, _Storage] = {}
        self.live = self.peak = 0
        self.at_peak: list[_Storage] = []
        self.phase = "forward"
        self.peak_phase = ""

    def _drop(self, key: int) -> None:
        self.live -= self.storages.pop(key).nbytes

    def _dead(self, key: int, entry: _Storage) -> None:
        entry.tensors -= 1
        if entry.tensors == 0 and self.storages.get(key) is entry:
            self._drop(key)

    def _released(self) -> None:
        """Drop the storages freed in place while tensors on them live on (`untyped_storage().resize_(0)`,
        as a backward does with an incoming gradient it has consumed): no op returns them, so look."""
        for key, entry in list(self.storages.items()):
            t = entry.probe() if entry.probe is not None else None
            if t is not None and t.untyped_storage().nbytes() == 0:
                self._drop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self._released()
        out = func(*args, **(kwargs or {}))
        grew = False
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key == 0:
                continue
            entry = self.storages.get(key)
            if entry is None:
                caller = _caller()
                if caller is None:
                    continue
                what = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                made_by = f"{func.__name__} <- {caller}"
                entry = self.storages[key] = _Storage(storage.nbytes(), what, made_by, probe=weakref.ref(t))
                self.live += entry.nbytes
                grew = True
            entry.tensors += 1
            weakref.finalize(t, self._dead, key, entry)
        if grew and self.live > self.peak:
            self.peak, self.peak_phase = self.live, self.phase
            self.at_peak = sorted(self.storages.values(), key=lambda s: -s.nbytes)
        return out


def run(layer: str, scale: int, quantization: str | None, backend: str) -> LiveBytes:
    tokens, experts, top_k, hidden, ffn = LAYERS[layer]
    tokens, hidden, ffn = max(tokens // scale, 1), max(hidden // scale, 1), max(ffn // scale, 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).requires_grad_(True)
    ids = (torch.arange(tokens * top_k) % experts).reshape(tokens, top_k)
    weights = torch.rand(tokens, top_k, generator=g).requires_grad_(True)
    w1 = (torch.randn(experts, 2 * ffn, hidden, generator=g) / hidden**0.5).requires_grad_(True)
    w2 = (torch.randn(experts, hidden, ffn, generator=g) / ffn**0.5).requires_grad_(True)
    dy = torch.randn(tokens, hidden, generator=g)
    mode = LiveBytes()
    with mode:
        y = moekit.moe_experts(x, ids, weights, w1, w2, backend=backend, quantization=quantization)
        mode.phase = "backward"
        y.backward(dy)
        del y
    return mode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", choices=sorted(LAYERS), default="mixtral-8x7b")
    parser.add_argument("--scale", type=int, default=16, help="T, H and F divided by this (default 16)")
    parser.add_argument("--quantization", default=None, help="None (bf16 path) or a recipe")
    parser.add_argument("--backend", default="triton", help='moekit backend (default "triton")')
    parser.add_argument("--top", type=int, default=12, help="live storages listed at the peak")
    args = parser.parse_args(argv)
    if args.scale < 1:
        parser.error(f"--scale must be at least 1, got {args.scale}")
    mode = run(args.layer, args.scale, args.quantization, args.backend)
    mib = 2**20
    print(f"{args.layer} / {args.scale}, quantization={args.quantization}, backend={args.backend}")
    print(f"peak {mode.peak / mib:.2f} MiB in the {mode.peak_phase}; alive then ({len(mode.at_peak)} storages):")
    for s in mode.at_peak[: args.top]:
        print(f"  {s.nbytes / mib:9.2f} MiB  {s.what:28s} {s.made_by}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
