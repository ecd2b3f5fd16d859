"""The one recipe by which every kernel family of moekit is planned and launched, and the launcher
under it.

The recipe (`plan_launch`), for one problem of one kernel family:

    key (what the launch depends on: every tensor's `tensor_key`, the options)
      -> the cached `Plan` under that key, else make it once: check the operands, decide the operand
         path (TMA descriptors or pointers), take the candidates of `moekit.ops.runtime.configs`,
         pick one (`pick_config`: timed once per process where there are several) and fix the
         launch (`LaunchPlan`: grid, integers, constexprs)
      -> the caller allocates its outputs and calls `plan.launch(*tensors)`.

Small MoE batches are host-bound (the GPU waits for launches), which is why everything but the tensors
is fixed once per problem, and why a launch goes straight to the compiled binary: `kernel[grid](...)`
(Triton's `JITFunction.run`) binds and specializes every argument and rebuilds its cache key on each
call. `Launcher(kernel)` launches through Triton the first time for a key (Triton compiles or finds the
binary) and calls that binary's own launcher afterwards, with the arguments Triton would pass. Its key
is what Triton specializes a compilation on: the device, every runtime argument's kind (a tensor's
dtype and whether its address is 16-byte aligned; an integer's width, whether it is 1 and whether 16
divides it; the type of other values) and the constexprs and options by name. Launches take Triton's
own path under the interpreter, while a launch hook is installed (profilers see every launch), and on
Triton versions other than the one this was written against (3.6: the binary's launcher signature is
internal to Triton).

Scratch. Kernels that build TMA descriptors on the device need a global scratch (a few hundred bytes
per program) on every launch, which Triton asks of the allocator set with `triton.set_allocator`. Here
that is one buffer per (device, stream), allocated once and reused: launches on one stream run one
after another, so they never use it at the same time (as cuBLAS keeps its workspace). During CUDA-graph
capture every launch gets its own allocation from the graph's pool, since a graph may be replayed on any
stream.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import _allocation, driver
from triton.runtime.interpreter import InterpretedFunction

from moekit.ops.kernels.schedule import tile_coords
from moekit.ops.runtime.configs import Arch, GemmConfig
from moekit.ops.runtime.device import capability, multiprocessor_count

_INT32_MIN, _INT32_LIMIT, _UINT64_FROM = -(1 << 31), 1 << 31, 1 << 63
_DIRECT_LAUNCH_VERSIONS = ("3.6.",)


def arg_key(arg: object) -> object:
    """What Triton specializes a runtime argument on (see the module docstring)."""
    if type(arg) is int:
        return (arg == 1, arg % 16 == 0, _INT32_MIN <= arg < _INT32_LIMIT, arg >= _UINT64_FROM)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    return type(arg)  # bools, floats, None: Triton keys them on their type only


class Launcher:
    """A `@triton.jit` kernel launched through its compiled binary once Triton has built it."""

    def __init__(self, kernel: Any) -> None:  # a JITFunction or InterpretedFunction (triton is untyped)
        self.kernel = kernel
        self.direct = not isinstance(kernel, InterpretedFunction) and triton.__version__.startswith(
            _DIRECT_LAUNCH_VERSIONS
        )
        self._binaries: dict[tuple, tuple[Any, tuple]] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return functools.partial(self.launch, grid)

    def launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """`kernel[grid](*args, **kwargs)`."""
        _ensure_allocator()
        if not self.direct or _hooks_installed():
            self.kernel[grid](*args, **kwargs)
            return
        key = (driver.active.get_current_device(), *map(arg_key, args), *kwargs.items())
        entry = self._binaries.get(key)
        if entry is None:
            self._binaries[key] = self.first_launch(grid, args, kwargs)
        else:
            _run_binary(*entry, grid, args)

    def first_launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> tuple[Any, tuple]:
        """Launch through Triton (compiling if needed); return (its binary, the parameters after
        `args` as Triton bound them: the binary's launcher takes every parameter in order,
        constexprs included, and skips those)."""
        binary = self.kernel[grid](*args, **kwargs)
        bound = self.kernel.device_caches[driver.active.get_current_device()][4](*args, **kwargs)[0]
        return binary, tuple(bound.values())[len(args) :]


def _run_binary(binary: Any, tail: tuple, grid: tuple[int, ...], args: tuple) -> None:
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
        self._entry: tuple[Any, tuple] | None = None

    def __call__(self, *tensors: torch.Tensor) -> None:
        launcher = self.launcher
        _ensure_allocator()
        args = (*tensors, *self.ints)
        if not launcher.direct or _hooks_installed():
            launcher.kernel[self.grid](*args, **self.constexprs)
        elif self._entry is None:
            self._entry = launcher.first_launch(self.grid, args, self.constexprs)
        else:
            _run_binary(*self._entry, self.grid, args)


P = TypeVar("P")


class PlanCache(dict):
    """Launch plans by problem key; emptied when it grows past `limit` (shapes that keep changing)."""

    def __init__(self, limit: int = 4096) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: tuple, plan: P) -> P:
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


# --------------------------------------------------------------------------------------------------
# Where kernels run
# --------------------------------------------------------------------------------------------------

# Whether moekit's kernels run on Triton's CPU interpreter: fixed when triton defined them (the
# TRITON_INTERPRET environment variable, read at import), so asked of a kernel, not of the environment.
INTERPRET = isinstance(tile_coords, InterpretedFunction)


def arch_of(device: torch.device) -> Arch:
    """The configuration table (`moekit.ops.runtime.configs`) a launch on `device` takes."""
    if INTERPRET or device.type != "cuda":
        return "interpreter"
    return "sm90" if capability(device_index(device))[0] >= 9 else "sm80"


def within_widest(widest_by_arch: dict[Arch, int], device: torch.device, width: int) -> bool:
    """Whether `width` (an expert's F) is within a `configs` table of the widest F at which a gathered
    kernel pays, for the table of `device`'s architecture (an architecture absent from it: never)."""
    return width <= widest_by_arch.get(arch_of(device), 0)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_ctx(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Launches go to the tensors' device: switch to it unless it is already current (entering
    torch.cuda.device costs two device exchanges per launch)."""
    if (
        device.type == "cuda"
        and not INTERPRET
        and device.index is not None
        and device.index != torch.cuda.current_device()
    ):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def grid_size(device: torch.device, bound: int, per_sm: int = 1) -> int:
    """Programs of a persistent kernel: per_sm per multiprocessor (2 lets one program's epilogue overlap
    another's main loop), at most `bound` (the tiles of the largest schedule)."""
    sms = 4 if (INTERPRET or device.type != "cuda") else multiprocessor_count(device_index(device))
    return max(1, min(sms * per_sm, bound))


def row_tiled_grid(
    device: torch.device, M: int, N: int, cols: int, block_rows: int, block_cols: int, per_sm: int = 1
) -> int:
    """`grid_size` of a persistent row-tiled kernel (`moekit.ops.kernels.schedule.tile_schedule`'s tile
    space) over M rows in N groups and `cols` output columns, tiles of block_rows x block_cols: its tiles
    are at most each group's row tiles, plus a partial tile per group and the padding pseudo-group, times
    the column tiles."""
    bound = (triton.cdiv(M, block_rows) + N + 1) * triton.cdiv(cols, block_cols)
    return grid_size(device, bound, per_sm)


@functools.cache
def block_groups(n: int) -> int:
    """BLOCK_GROUPS of a kernel's group vector for n groups: the per-group vectors are tiny next to a tile,
    and one size for up to 255 groups means one compiled kernel for every model instead of one per
    expert count."""
    return max(256, triton.next_power_of_2(n))


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# The kernels' names of the floating dtypes a kernel rounds its outputs to (a constexpr argument).
TL_DTYPES: dict[torch.dtype, Any] = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: fp32 operands get full fp32 products unless the user allowed TF32 for
    matmuls, as torch does."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can take these operands: 16-byte aligned bases, 16-byte multiples for
    every non-unit stride, and at least one element."""
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16 or t.numel() == 0 or any((s * es) % 16 for s in t.stride()[:-1]):
            return False
    return True


def use_tma(forced: bool | None, has_reduction: bool, *operands: torch.Tensor) -> tuple[bool, Arch]:
    """(whether the operands go through TMA descriptors, the configuration table). `forced` (tests,
    tuning) is kept as is, with Hopper's table; otherwise TMA needs sm_90 (or the interpreter), a
    non-empty reduction and operands `tma_ok` takes."""
    if forced is not None:
        return forced, "sm90"
    arch = arch_of(operands[0].device)
    return arch != "sm80" and has_reduction and tma_ok(*operands), arch


def empty(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Every kernel output is allocated here, uninitialised: the kernels write every element (tests
    fill fresh allocations with NaN to prove it)."""
    return torch.empty(shape, device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------------------------------


class Plan(NamedTuple):
    """One problem's launch: `launch` (None: nothing to compute; `zero` then says whether the output
    is zeros rather than empty), `cols` (the output columns, or the rows of a partials output),
    `contiguous` (whether row operands are copied to unit column stride first) and `swapped` (whether
    the launch takes a two-operand problem's operands the other way round, as a wgrad whose gathered
    operand is dy: `gemm.grouped_gemm_wgrad`)."""

    launch: LaunchPlan | None
    cols: int = 0
    contiguous: bool = False
    zero: bool = False
    swapped: bool = False


_PLANS = PlanCache()
_TUNED: dict[tuple, GemmConfig] = {}
_AUTOTUNE = {"enabled": True}


def set_autotune(enabled: bool) -> None:
    """Turn the per-problem-class configuration search on (default) or off (the first candidate).

    The search times a few configurations on the first call of each problem class, which synchronizes
    with the host once; turn it off for runs that must not sync even on their first step."""
    _AUTOTUNE["enabled"] = bool(enabled)


def plan_launch(family: str, key: tuple, make: Callable[[], P]) -> P:
    """The plan of kernel family `family` for the problem `key`, made by `make()` the first time.
    Plans are kept per everything they were validated and specialized on (the key, and whether the
    configuration search is on); a plan made during CUDA-graph capture is not kept (its configuration
    may be the untuned default)."""
    full_key = (family, *key, _AUTOTUNE["enabled"])
    plan = _PLANS.get(full_key)
    if plan is not None:
        return plan
    plan = make()
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return plan
    return _PLANS.put(full_key, plan)


def pick_config(
    problem: tuple, candidates: tuple[GemmConfig, ...], trial: Callable[[GemmConfig], None], device: torch.device
) -> GemmConfig:
    """The fastest of `candidates` for a problem class, timed once per process and remembered; the first
    where there is one, on the CPU, with the search off, or during CUDA-graph capture (timing would
    synchronize: warm up once outside capture to get the tuned choice). `trial(cfg)` launches once."""
    hit = _TUNED.get(problem)
    if hit is not None:
        return hit
    if len(candidates) == 1 or not _AUTOTUNE["enabled"] or device.type != "cuda" or INTERPRET:
        return candidates[0]
    if torch.cuda.is_current_stream_capturing():
        return candidates[0]
    best, best_t = candidates[0], float("inf")
    for cfg in candidates:
        try:
            t = triton.testing.do_bench(lambda c=cfg: trial(c), warmup=5, rep=20, return_mode="median")
        except Exception:  # a configuration that does not compile or fit is skipped
            continue
        if t < best_t:
            best, best_t = cfg, t
    _TUNED[problem] = best
    return best


def forget_plans() -> None:
    """Drop every kept plan: after a configuration table changed (tests and tuning compare kernels
    or entries in one process), the next call of each problem plans again from the tables."""
    _PLANS.clear()


def planned_count() -> int:
    """Plans kept (tests check that a problem is planned once)."""
    return len(_PLANS)


# --------------------------------------------------------------------------------------------------
# Whether moekit's kernels can run
# --------------------------------------------------------------------------------------------------

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unavailable_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why moekit's Triton kernels cannot run for tensors of `dtype` on `device`; None if they can.

    CUDA: compute capability 8.0 or newer (Hopper, sm_90, gets the TMA path and the Gluon kernels;
    Ampere/Ada run the pointer-load path of the same kernels). CPU: only when TRITON_INTERPRET=1 was
    set before triton was imported (slow; for tests)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and not INTERPRET and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if torch.compiler.is_compiling():  # dynamo traces through caches anyway (and warns)
        return _unavailable_reason.__wrapped__(device, dtype)
    return _unavailable_reason(device, dtype)


@functools.lru_cache(maxsize=64)
def _unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    # Cached: every launch asks, the answer is fixed for the process (device capability, interpreter
    # mode) and the CUDA queries behind it cost microseconds of host time each.
    if dtype not in SUPPORTED_DTYPES:
        return f"moekit's Triton kernels take float32, bfloat16 and float16, not {dtype}"
    if device.type == "cpu":
        if INTERPRET:
            return None
        return (
            "moekit's Triton kernels need a CUDA device; on CPU they run only under the Triton interpreter "
            "(set TRITON_INTERPRET=1 before triton is imported)"
        )
    if device.type != "cuda":
        return f"moekit's Triton kernels run on CUDA devices (or CPU under TRITON_INTERPRET=1), not {device.type}"
    if INTERPRET:
        return None
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = capability(device_index(device))
    if major < 8:
        return f"moekit's Triton kernels need compute capability 8.0 or newer, the device has {major}.{minor}"
    return None


def check_triton_device(t: torch.Tensor) -> None:
    """Raise ValueError where `unavailable_reason` gives one for t."""
    reason = unavailable_reason(t.device, t.dtype)
    if reason is not None:
        raise ValueError(reason)
