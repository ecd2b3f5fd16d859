"""Triton kernel launches at less host cost, and the scratch memory of device-side TMA descriptors.

Small MoE batches are host-bound: the GPU waits for launches. `kernel[grid](...)` (Triton's
`JITFunction.run`) binds and specializes every argument and rebuilds its cache key on each call;
on the H200's host that costs 36.7 us per launch of the grouped GEMM kernel, of which the compiled
kernel's own launcher takes 13.9 us (notes/grouped_mlp.md, v5).

`Launcher(kernel)[grid](*args, **constexprs)` is called like the kernel. The first launch for a key
goes through Triton, which compiles (or finds) the binary; later launches with the same key call
that binary's launcher with the same arguments Triton would pass. The key is what Triton
specializes a compilation on: the device, every runtime argument's kind (a tensor's dtype and
whether its address is 16-byte aligned; an integer's width, whether it is 1 and whether 16 divides
it; the type of other values) and the constexprs and options by name. So the binary launched is
the one Triton would pick. Launches take Triton's own path under the interpreter, while a launch hook
is installed (profilers such as proton: the hooks see every launch), and on Triton versions other
than the one this was written against (3.6: the binary's launcher signature is internal to Triton).

A `LaunchPlan` goes one step further for the launchers called on every step of a layer: everything
of a launch but its tensors (grid, integer arguments, constexprs) is fixed when the plan is made,
once per problem (the caller keys its plans on `tensor_key` of every tensor it will pass, which
covers what Triton specializes on), and the binary is remembered by the plan itself.

Scratch. Kernels that build TMA descriptors on the device need a global scratch (a few hundred
bytes per program) on every launch, which Triton asks of the allocator set with
`triton.set_allocator`. Here that is one buffer per (device, stream), allocated once and reused:
launches on one stream run one after another, so they never use it at the same time (as cuBLAS
keeps its workspace). During CUDA-graph capture every launch gets its own allocation from the
graph's pool, since a graph may be replayed on any stream.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton import knobs
from triton.runtime import _allocation, driver

try:  # Triton >= 3.0: the interpreter's kernel class
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - very old triton
    _InterpretedFunction = ()

_INT32_MIN, _INT32_LIMIT, _UINT64_FROM = -(1 << 31), 1 << 31, 1 << 63
_DIRECT_LAUNCH_VERSIONS = ("3.6.",)


def _arg_key(arg) -> object:
    """What Triton specializes a runtime argument on (see the module docstring)."""
    if type(arg) is int:
        return (arg == 1, arg % 16 == 0, _INT32_MIN <= arg < _INT32_LIMIT, arg >= _UINT64_FROM)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    return type(arg)  # bools, floats, None: Triton keys them on their type only


class Launcher:
    """A `@triton.jit` kernel launched through its compiled binary once Triton has built it."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        interpreted = bool(_InterpretedFunction) and isinstance(kernel, _InterpretedFunction)
        self._direct = not interpreted and triton.__version__.startswith(_DIRECT_LAUNCH_VERSIONS)
        self._binaries: dict[tuple, tuple] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return functools.partial(self.launch, grid)

    def launch(self, grid: tuple[int, ...], *args, **kwargs) -> None:
        """`kernel[grid](*args, **kwargs)`."""
        _ensure_allocator()
        if not self._direct or _hooks_installed():
            self.kernel[grid](*args, **kwargs)
            return
        key = (driver.active.get_current_device(), *map(_arg_key, args), *kwargs.items())
        entry = self._binaries.get(key)
        if entry is None:
            self._binaries[key] = self._first_launch(grid, args, kwargs)
        else:
            _run_binary(*entry, grid, args)

    def _first_launch(self, grid, args, kwargs) -> tuple:
        """Launch through Triton (compiling if needed); return (its binary, the parameters after
        `args` as Triton bound them: the binary's launcher takes every parameter in order,
        constexprs included, and skips those)."""
        binary = self.kernel[grid](*args, **kwargs)
        bound = self.kernel.device_caches[driver.active.get_current_device()][4](*args, **kwargs)[0]
        return binary, tuple(bound.values())[len(args) :]


def _run_binary(binary, tail: tuple, grid: tuple[int, ...], args: tuple) -> None:
    """Launch a compiled kernel on the current stream, as Triton does once it has the binary (no
    launch hooks: they take Triton's path)."""
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    binary.run(
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        grid[2] if len(grid) > 2 else 1,
        stream,
        binary.function,
        binary.packed_metadata,
        None,
        None,
        None,
        *args,
        *tail,
    )


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a launch plan depends on of a tensor argument: shape, strides, dtype, device and
    whether its address is 16-byte aligned (Triton specializes on that)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


class LaunchPlan:
    """One launch of `launcher`'s kernel with all but its tensor arguments fixed.

    `plan(*tensors)` launches kernel[grid](*tensors, *ints, **constexprs): the kernel's parameters
    are its tensors first, then its integers, then its constexprs. The first call goes through
    Triton (compiling if needed); later calls launch the binary it returned. The caller makes one
    plan per `tensor_key` of the tensors it passes (outputs it allocates fresh are 16-byte aligned)."""

    __slots__ = ("launcher", "grid", "ints", "constexprs", "_entry")

    def __init__(self, launcher: Launcher, grid: tuple[int, ...], ints: tuple[int, ...], constexprs: dict) -> None:
        self.launcher, self.grid, self.ints, self.constexprs = launcher, grid, ints, constexprs
        self._entry = None

    def __call__(self, *tensors: torch.Tensor) -> None:
        launcher = self.launcher
        _ensure_allocator()
        args = (*tensors, *self.ints)
        if not launcher._direct or _hooks_installed():
            launcher.kernel[self.grid](*args, **self.constexprs)
        elif self._entry is None:
            self._entry = launcher._first_launch(self.grid, args, self.constexprs)
        else:
            _run_binary(*self._entry, self.grid, args)


class PlanCache(dict):
    """Launch plans by problem key; emptied when it grows past `limit` (shapes that keep changing)."""

    def __init__(self, limit: int = 4096) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key, plan):
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan
        return plan


def _hooks_installed() -> bool:
    hooks = knobs.runtime
    return bool(hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls)


# --------------------------------------------------------------------------------------------------
# Scratch of device-side TMA descriptors
# --------------------------------------------------------------------------------------------------

_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}


def _scratch(size: int, alignment: int, stream: int) -> torch.Tensor:
    """Triton's allocator: the (device, stream)'s buffer, grown when a launch needs more."""
    del alignment  # the caching allocator's blocks are 512-byte aligned, more than any kernel asks
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device="cuda")
    key = (torch.cuda.current_device(), stream)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < size:
        # The old buffer goes back to the caching allocator, which reuses it on this stream only
        # after the launches queued before this point: stream order keeps it safe.
        buffer = _SCRATCH[key] = torch.empty(size, dtype=torch.int8, device="cuda")
    return buffer


def _ensure_allocator() -> None:
    """The scratch allocator is a ContextVar, unset in fresh threads (autograd's backward threads
    among them): set it before each launch unless the user installed their own."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)
