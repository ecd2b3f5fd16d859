"""Every kernel configuration moekit launches, per architecture, in one module (as quack's gemm_config).

An architecture is one of `ARCHES`: "sm90" (Hopper: TMA descriptors, wgmma, the warp-specialised Gluon
kernels), "sm80" (Ampere/Ada and operands TMA cannot take: pointer loads) and "interpreter" (Triton's
CPU interpreter, tests: tiny tiles so that small problems cover many tiles). The tables say which
configurations a problem class may run; the launcher (`moekit.ops.runtime.launch.plan_launch`) picks
among them (the first is the default; several candidates are timed once per process unless autotuning
is off) and plans the launch once per problem.

Why each entry is what it is, and the measurements that decided it, are in notes/grouped_gemm.md and
notes/grouped_mlp.md. Plain Python and torch: importing this module needs no triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

Arch = Literal["sm90", "sm80", "interpreter"]
ARCHES: tuple[Arch, ...] = ("sm90", "sm80", "interpreter")


@dataclass(frozen=True)
class GemmConfig:
    """One configuration of a tiled Triton GEMM kernel: the output tile (block_rows x block_cols), the
    reduction step, the swizzle band (group_rows row tiles share their B blocks in L2), pipelining
    stages, warps, whether the persistent tile loop and the reduction loop form one software pipeline
    (flatten), whether tiles leave through TMA stores (epi_tma) and how many programs of the
    persistent kernel share a multiprocessor (programs_per_sm).

    For the forward/dgrad kernel the tile is (rows of M, output columns) and the reduction runs over
    the input features; for the wgrad kernel the tile is (O, I) and the reduction runs over the
    group's rows; for the fused MLP kernels block_cols counts activation columns (the forward's tile
    is twice as wide in h).
    """

    block_rows: int
    block_cols: int
    block_red: int
    group_rows: int
    stages: int
    warps: int
    flatten: bool
    epi_tma: bool = False
    programs_per_sm: int = 1


# --------------------------------------------------------------------------------------------------
# Grouped GEMM (kernels.grouped_gemm): forward / dgrad ("fwd", "dgrad") and weight gradient ("wgrad")
# --------------------------------------------------------------------------------------------------


@functools.cache
def gemm_candidates(op: str, dtype: torch.dtype, use_tma: bool, arch: Arch, cols: int) -> tuple[GemmConfig, ...]:
    """Candidates of the plain grouped GEMM for one problem class; the first is the default."""
    if arch == "interpreter":
        return (GemmConfig(32, 32, 16, 4, 1, 4, False),)
    if dtype == torch.float32:
        return (GemmConfig(64, 64, 32, 8, 3, 4, False),)
    if arch == "sm90" and use_tma:
        if op == "wgrad":
            # One config: its 4-stage and whole-tile-store variants measured within noise of it, and a
            # single candidate means no tuning sync.
            return (GemmConfig(128, 256, 64, 8, 3, 8, True, True),)
        # Variants of the 128 x 256 x 64 / 8-warp tile (flatten, epi_tma); 128 x 128 only for narrow outputs.
        big = (
            GemmConfig(128, 256, 64, 8, 3, 8, True, False),
            GemmConfig(128, 256, 64, 8, 3, 8, True, True),
            GemmConfig(128, 256, 64, 8, 3, 8, False, False),
        )
        return big if cols > 128 else (GemmConfig(128, 128, 64, 8, 4, 8, True, False), big[0])
    # Pointer path (operands TMA cannot take, or Ampere/Ada): shapes that fit 100 KB of shared memory.
    return (GemmConfig(128, 128, 32, 8, 3, 8, False), GemmConfig(128, 64, 32, 8, 4, 4, False))


# --------------------------------------------------------------------------------------------------
# FP8 grouped GEMM (kernels.grouped_gemm_fp8): forward / dgrad ("fwd", "dgrad"); FP8 wgrad (kernels.grouped_wgrad_fp8)
# --------------------------------------------------------------------------------------------------

# The reduction step of the FP8 kernel: fp8_block's scale block (its scales change every 128 reduction
# columns, and a step must not straddle two), and 128 bytes of FP8 per row of a TMA box, a whole
# 128-byte shared-memory swizzle row, for fp8_rowwise too.
FP8_BLOCK_RED = 128


@functools.cache
def fp8_gemm_candidates(op: str, recipe: str, use_tma: bool, arch: Arch, cols: int) -> tuple[GemmConfig, ...]:
    """Candidates of the FP8 grouped GEMM for one problem class; the first is the default.

    fp8_block: tiles of at most 128 columns (one weight scale block a step: a tile's columns must not
    straddle two) and at most 64 fp32 registers a thread per tile, since its main loop keeps three fp32
    tiles live (the accumulator, the previous step's product and the current one:
    `kernels.grouped_gemm_fp8`); 128 x 128 with 8 warps (two warpgroups of 64 rows), or 64 x 128 with
    4 warps and two programs a multiprocessor (one program's promotion overlaps the other's MMAs). Its
    loop moves two reduction steps a stage: 2 or 3 stages of 64 KiB (128 x 128, beside the epilogue's
    32 KiB staging tile, within Hopper's 227 KiB a program) or 2 of 48 KiB (64 x 128: two programs of
    about 104 KiB each within the 228 KiB of a multiprocessor). fp8_rowwise may
    take 128 x 256 (one fp32 tile, as the bf16 kernel's), the dgrad too: it runs on the weight
    transposed, the forward's K-major orientation (`op` names the problem class only); 4 stages of 32
    KiB (128 x 128 tiles) or 3 of 48 KiB (128 x 256), beside the epilogue's staging tile, fit in
    Hopper's 227 KiB."""
    red = FP8_BLOCK_RED
    if arch == "interpreter":
        return (GemmConfig(32, 32, red, 4, 1, 4, False, True),)
    if arch == "sm90" and use_tma:
        if recipe == "fp8_block":
            return (
                GemmConfig(128, 128, red, 8, 2, 8, False, True),
                GemmConfig(64, 128, red, 8, 2, 4, False, True, programs_per_sm=2),
                GemmConfig(128, 128, red, 8, 3, 8, False, True),
            )
        narrow = (
            GemmConfig(128, 128, red, 8, 4, 8, False, True),
            GemmConfig(128, 128, red, 8, 4, 8, True, True),
        )
        if cols <= 128:
            return narrow
        return (GemmConfig(128, 256, red, 8, 3, 8, False, True), *narrow)
    # Pointer path (Ada's FP8 tensor cores, operands TMA cannot take): within ~100 KB of shared memory.
    return (GemmConfig(128, 64, red, 8, 3, 4, False), GemmConfig(64, 64, red, 8, 3, 4, False))


@functools.cache
def fp8_wgrad_candidates(recipe: str, use_tma: bool, arch: Arch) -> tuple[GemmConfig, ...]:
    """Candidates of the FP8 wgrad (kernels.grouped_wgrad_fp8; tile (O, I), reduction over the group's
    rows); the first is the default.

    fp8_rowwise (always the flattened loop), sm90 with TMA: the bf16 wgrad's 128 x 256 tile (one fp32
    accumulator, 128 registers a thread at 8 warps) with 128 rows a step (128 bytes of FP8 a box row,
    one 128-byte swizzle row; FP8 wgmma takes 32 a instruction): 3 stages of 48 KiB beside the
    epilogue's 32 KiB half-tile staging fit Hopper's 227 KiB; 128 x 128 with 4 stages of 32 KiB as the
    alternative. fp8_block (a tile loop around a reduction loop of two 128-row steps an iteration, the
    steps' products promoted with their block's scales, the forward's main loop): 128 x 128 at 8 warps
    (three fp32 tiles live: the accumulator and two steps' products, 192 registers a thread), 2 or 3
    stages of 64 KiB. Pointer loads (Ada's FP8 tensor cores): within ~100 KB of shared memory; steps of
    64 rows (fp8_block: half a scale block). Interpreter: small tiles, 32 rows a step (a
    quarter of an fp8_block scale block and of a 128-column segment, so that a ragged group's last step
    reads its segment's zero tail), so that CPU tests cross several tiles, steps and scale blocks."""
    if arch == "interpreter":
        return (GemmConfig(32, 32, 32, 4, 1, 4, True, True),)
    if arch == "sm90" and use_tma:
        if recipe == "fp8_block":
            return (
                GemmConfig(128, 128, FP8_BLOCK_RED, 8, 2, 8, False, True),
                GemmConfig(128, 128, FP8_BLOCK_RED, 8, 3, 8, False, True),
            )
        return (
            GemmConfig(128, 256, FP8_BLOCK_RED, 8, 3, 8, True, True),
            GemmConfig(128, 128, FP8_BLOCK_RED, 8, 4, 8, True, True),
        )
    if recipe == "fp8_block":
        return (GemmConfig(128, 64, 64, 8, 2, 4, False, False), GemmConfig(64, 64, 64, 8, 2, 4, False, False))
    return (GemmConfig(128, 128, 64, 8, 3, 8, True, False), GemmConfig(128, 64, 64, 8, 3, 4, True, False))


# Per-group row sums (kernels.grouped_gemm.group_row_sum_kernel): (row slices per group, columns per program).
ROW_SUM_TILES: dict[Arch, tuple[int, int]] = {"sm90": (8, 128), "sm80": (8, 128), "interpreter": (2, 32)}


# --------------------------------------------------------------------------------------------------
# Fused MLP (kernels.glu, Triton): glu_forward_kernel ("fwd") and glu_backward_kernel ("bwd")
# --------------------------------------------------------------------------------------------------


@functools.cache
def glu_widths(ffn: int, glu_block: int, arch: Arch) -> tuple[int, ...]:
    """Activation-column widths (BLOCK_C) the fused kernels may take for this ffn size and GLU block
    (`glu_interleave_size`, F for `[gate | up]`), widest first. A tile's weight box needs
    block | BLOCK_C or BLOCK_C | block (or block = F); no width above the next power of two of F."""
    widths = (16, 8) if arch == "interpreter" else (128, 64, 32, 16)
    cap = max(1 << (ffn - 1).bit_length(), widths[-1])
    fits = [w for w in widths if w <= cap and (glu_block == ffn or glu_block % w == 0 or w % glu_block == 0)]
    return tuple(fits) or (min(cap, widths[0]),)


@functools.cache
def glu_candidates(
    kernel: str, dtype: torch.dtype, ffn: int, glu_block: int, use_tma: bool, arch: Arch
) -> tuple[GemmConfig, ...]:
    """The configuration of the fused kernel `kernel` ("fwd" or "bwd"): one each (no tuning sync).

    Both use 128 rows x 128 activation columns: the forward holds two fp32 accumulators (gate and up,
    the register budget of one 128 x 256 tile of the plain GEMM), the backward one. The forward is
    fastest with the tile loop and the reduction loop left unfused and 3 stages (4 do not fit in
    shared memory beside its epilogue), the backward with 4 stages, unfused too. epi_tma: the forward's
    h and act leave through TMA where the layout allows it (the backward's epilogue moves h, dh and
    act_p by pointer)."""
    widths = glu_widths(ffn, glu_block, arch)
    if arch == "interpreter":
        return (GemmConfig(16, widths[0], 16, 8, 1, 4, False, True),)
    if dtype == torch.float32:
        # 4-byte operands and outputs: at most 64 activation columns, 32 reduction columns a stage and
        # pointer stores (no staging tile). 128 x 128 tiles with 64 (then 32) reduction columns and TMA
        # stores asked sm_90 for 352 (then 240) KiB of shared memory, past its 227 KiB.
        narrow = next((w for w in widths if w <= 64), widths[-1])
        return (GemmConfig(128, narrow, 32, 8, 3, 8, True, False),)
    if not use_tma:
        return (GemmConfig(128, widths[0], 64, 8, 3, 8, True, True),)
    if kernel == "fwd":
        return (GemmConfig(128, widths[0], 64, 8, 3, 8, False, True),)
    return (GemmConfig(128, widths[0], 64, 8, 4, 8, False),)


# --------------------------------------------------------------------------------------------------
# Fused MLP on Hopper (kernels.glu_hopper, Gluon): one configuration each, sm90 only
# --------------------------------------------------------------------------------------------------

# Forward: a 128 x (128 + 128) tile, 3 slots of 64 reduction columns (4 do not fit in shared memory
# beside the two h staging tiles), the epilogue partition 16 columns at a time with 88 registers a
# thread (32 columns spill), the load partition one warp (of its warp group) with 24 registers, the
# mma partition the rest of the 128 per thread of 16 warps.
WS_FORWARD = dict(
    BLOCK_M=128,
    BLOCK_C=128,
    BLOCK_RED=64,
    GROUP_M=8,
    STAGES=3,
    EPI_COLS=16,
    EPI_REGS=88,
    GATHER=False,
    LOAD_WARPS=1,
    LOAD_REGS=24,
    num_warps=8,
    maxnreg=128,
)
# The forward with x's rows gathered by cp.async (`WS_FORWARD` with these): the load partition takes its
# whole warp group, 128 threads forming a slot's 128 row addresses (4 rows a thread at 32-column steps,
# their 64-bit bases held for the tile), with 40 registers; the same 16 warps. Steps of 32 reduction
# columns in 5 slots (the same shared memory as 3 of 64): the main loop holds two slots (the one it reads
# and the one in flight), so 3 slots of 64 left one step of copies ahead, and the copies' latency, not
# their bytes, is what the main loop waited for (ncu: the mma warps at the ready barrier, the copy warps
# at the empty one). The TMA form keeps 64-column steps: with 32 it was slower (more barrier rounds a tile
# for the same bytes; benchmarks/README.md, the gathered loads sweep).
WS_FORWARD_GATHER = dict(WS_FORWARD, GATHER=True, LOAD_WARPS=4, LOAD_REGS=40, BLOCK_RED=32, STAGES=5)
# The widest F at which the layer's fc1 (moe_experts' fused node 1) reads x's token rows in its loads
# (the GATHER variant) instead of gathering them into an (M, H) tensor first; an architecture absent
# here, or F above it, gathers first. The gather costs one (M, H) write and read whatever F is, while
# the GATHER variant's cp.async main loop is slower than TMA's by a share of fc1's own time (which
# grows with F): the variant pays only at narrow experts (benchmarks/README.md, the gathered fc1 A/Bs;
# with the variant's 32-column steps, 768 instead of 512 left the Qwen3-30B-A3B step (F 768) as it
# was: kept at 512).
GATHERED_FC1_MAX_FFN: dict[Arch, int] = {"sm90": 512}
# The widest F at which the layer's fc1 weight gradient (moe_experts' node 1 backward) reads x's token
# rows through the row map in its loads (`gemm.grouped_gemm_wgrad`'s x_rows; on sm90 the Gluon kernel,
# `WGRAD_GATHERED_WS`) instead of gathering them into an (M, H) tensor first. The gathered wgrad is
# slower than the TMA wgrad by a share of its own time, which grows with F, while the gather costs one
# (M, H) write and read whatever F is: the step gains at narrow experts and loses at wide ones. With
# two copy warp groups (`WGRAD_GATHERED_WS`' LOAD_WARPS 8) F 512 pays too (benchmarks/README.md, the
# gathered wgrad A/Bs).
GATHERED_WGRAD_MAX_FFN: dict[Arch, int] = {"sm90": 512}
# The gathered wgrad on Hopper (kernels.grouped_gemm_hopper, Gluon): the Triton wgrad's sm90 tile (128 x
# 256 of dw, 64-row steps, the same bits), x's rows copied by the load partition's warp group (cp.async,
# 8 rows a thread, this step's row addresses and the next step's map entries: 56 registers, none
# spilled; 40 spilled 64 bytes) while dy's boxes come by TMA; 4 slots of 48 KiB (dy 16, x 32) fit beside
# nothing else (the epilogue stores from registers); the 8 warps of the main loop get 224 registers of
# the 168 a thread of 12 warps (ptxas: no spills).
# SPLIT_O: the tile 256 x 128 instead (two dy boxes of 128 columns, one x slot of 128): half the
# copied bytes a step for the same MMAs, as x's rows are read once for 256 rows of dw, not 128; a little
# faster than the 128 x 256 form at F 256-512, yet still well behind the TMA wgrad over the gathered copy
# (benchmarks/README.md, the gathered wgrad split along O): the copy's bytes are not what bounds it.
# LOAD_WARPS 8: the copy partition as two warp groups (16 warps of 128 registers at launch; the main
# loop's 8 warps then get 200, no spills), 4 rows a thread: the copy warps were busy nearly all the time
# and seldom waited for a free slot (ncu), so the producer was what bounded the step; faster than 4 copy
# warps at the fine shapes (benchmarks/README.md, the gathered loads sweep). Smaller steps with more
# slots (32 rows, 8 slots) were slower.
WGRAD_GATHERED_WS = dict(
    BLOCK_O=256,
    BLOCK_I=128,
    SPLIT_O=True,
    BLOCK_M=64,
    GROUP_O=8,
    STAGES=4,
    LOAD_WARPS=8,
    LOAD_REGS=56,
    num_warps=8,
    maxnreg=128,
)
# A wgrad whose dy rows come through a row map (the layer's fc2 weight gradient reading d out's token
# rows in its loads): with SWAPPED on sm90, the Gluon kernel above on the swapped operands (x^T dy, d
# out's rows copied as its x rows, dw's transpose stored: TRANS_OUT), whose bits are the Triton wgrad's
# of the swapped operands; else the Triton kernel with dy's row map. Off until timed (runner's
# TABLE_CHANGES, wgrad_dy_rows).
WGRAD_GATHERED_DY_ROWS = dict(SWAPPED=False)
# The forward / dgrad on Hopper (kernels.grouped_gemm_hopper.grouped_mm_ws_kernel, Gluon): the Triton
# kernel's sm_90 tile (128 x 256, 64-deep steps, the same bits) with the loads in a warp of their own and
# each of two math warp groups (64 rows, two 64 x 128 fp32 accumulators: 128 registers a thread) storing
# its own rows. 4 slots of 48 KiB beside the two warp groups' 16 KiB staging tiles (224 KiB of Hopper's
# 227); 12 warps of 168 registers a thread at launch, then 224 for each math warp group and 56 for the
# load warp (whose tile schedule spills 64 bytes at 40; ptxas, sm_90a: no spills at 224 / 56 up to 254
# groups, 128 bytes in the load warp past that, where the group vectors are 512 long: MM_WS_512_GROUPS'
# registers hold them, LOAD_WARPS 4 all but 4 bytes). Both
# math warp groups start together: group 1 started 1 or 2 steps behind, so that one group's epilogue
# would fall beside the other's MMAs, ran slower (benchmarks/README.md, the Gluon forward/dgrad).
# STAGED_ROWS: the tiles a group's rows end inside (about one in 17 at 256 experts under the layer's
# routing) store through the staging tile as 16-byte row pieces instead of the accumulator layout's
# element pairs: the layer's step faster at fine-grained experts (benchmarks/README.md, the staged
# rows A/B).
MM_WS = dict(
    PINGPONG=False,
    STAGED_ROWS=True,
    BLOCK_M=128,
    BLOCK_C0=128,
    BLOCK_C1=128,
    BLOCK_RED=64,
    GROUP_M=8,
    STAGES=4,
    MATH_REGS=224,
    LOAD_REGS=56,
    LOAD_WARPS=1,
    num_warps=4,
    maxnreg=168,
)
# MM_WS's registers where the group vectors are 512 or more long (255 experts or more), which spill in the load
# warp at 56 registers (ptxas, sm_90a): 208 for the math warp groups and 88 for the load warp hold them
# without spills, and the layer's step is faster at 256 experts (benchmarks/README.md, the regs208 A/Bs;
# at 256 groups and fewer the same registers were slower, so MM_WS keeps 224 / 56 there).
MM_WS_512_GROUPS = dict(MATH_REGS=208, LOAD_REGS=88)
# The forward / dgrad's ping-pong schedule on Hopper (the same kernel with PINGPONG, compiled as
# grouped_mm_pingpong_kernel): each math warp group a whole 128 x (128 + 64) tile in turn (fp32
# accumulators of 192 registers a thread), its epilogue beside the other group's main loop; the same
# bits as MM_WS. 4 slots of 40 KiB beside one 128 x 128 staging tile a warp group (224 KiB): while one
# group drains its tile, the other's loads need about a microsecond's bytes in flight beyond the slots
# its MMAs hold, which a third slot alone does not give (notes/grouped_gemm.md); 12 warps of 168
# registers at launch, then 232 for the math warp groups and 48 for the load warp.
MM_PINGPONG = dict(
    PINGPONG=True,
    STAGED_ROWS=False,
    BLOCK_M=128,
    BLOCK_C0=128,
    BLOCK_C1=64,
    BLOCK_RED=64,
    GROUP_M=8,
    STAGES=4,
    MATH_REGS=232,
    LOAD_REGS=48,
    LOAD_WARPS=1,
    num_warps=4,
    maxnreg=168,
)
# Which schedule the Hopper forward / dgrad run: MM_PINGPONG at reductions of at most PINGPONG_MAX_RED
# columns, MM_WS above. 0: MM_PINGPONG nowhere (not measured faster yet; the sweep's "pingpong" variants
# select it).
MM_SCHEDULE = dict(PINGPONG_MAX_RED=0)
# Pipeline stages a wgrad launch adds where an operand's rows come through a row map: the software
# pipeliner gives the map's load a stage of its own ahead of the rows' cp.async, so at the table's 3
# stages the rows would be prefetched one step ahead (the TMA loads: two). Stages do not change the
# tile or the reduction order: a gathered launch gives the bits of the plain one.
GATHERED_WGRAD_EXTRA_STAGES = 2
# The widest F at which the layer's fc2 backward (moe_experts' node 2) reads d out's token rows in its
# loads (the Hopper backward's GATHER variant and fc2's weight gradient through the row map, each slower
# than its TMA form) instead of gathering them into an (M, H) tensor first: the gather's (M, H) write
# and read against the kernels' extra time, which grows with F; and the (M, H) tensor would live beside
# h, dh and fc2's weight gradient at the layer's peak (benchmarks/README.md, the gathered backward A/Bs).
GATHERED_DOUT_MAX_FFN: dict[Arch, int] = {"sm90": 768}
# Backward: a 128 x (128 + 128) tile, 3 slots of 64 reduction columns beside the fp32 staging tile,
# the epilogue 16 columns at a time (32 spill), the load warp 24 registers and the 8 warps of the main
# loop and the epilogue 240 of the 168 per thread of 12 warps.
WS_BACKWARD = dict(
    BLOCK_M=128,
    BLOCK_C=128,
    BLOCK_RED=64,
    GROUP_M=8,
    STAGES=3,
    EPI_COLS=16,
    GATHER=False,
    LOAD_WARPS=1,
    LOAD_REGS=24,
    num_warps=8,
    maxnreg=168,
)
# The backward with d out's rows gathered by cp.async (`WS_BACKWARD` with these), as the forward's: the
# load partition's whole warp group with 40 registers (8 row addresses a thread), which leaves the 8
# warps of the main loop and the epilogue 232 registers instead of 240.
WS_BACKWARD_GATHER = dict(WS_BACKWARD, GATHER=True, LOAD_WARPS=4, LOAD_REGS=40)


# fp8_block's forward / dgrad on Hopper (kernels.grouped_gemm_fp8_hopper, Gluon): one configuration, sm90
# with TMA. A 128 x 256 tile: two weight scale blocks of columns, so a step's operands are 16 KiB of rows
# and 32 KiB of weight (a 128 x 128 tile reads a third more bytes per FLOP from L2: at FP8 rates the
# operand traffic, not the tensor cores, bounds it). One 128-deep reduction step (one scale block) a ring
# slot of 48 KiB, STAGES by the output's element size (FP8_BLOCK_WS_STAGES): 4 beside the two warp groups'
# 64 x 128 staging tiles in 16-bit outputs, 3 in fp32, within Hopper's 227 KiB. Partitions: two math warp
# groups of 64 rows (the default partition and a worker, MATH_REGS each: two fp32 accumulators and one
# product, 192 registers a thread, plus addresses and scales) and the load warp (LOAD_REGS); 12 warps of
# 168 registers a thread at launch.
FP8_BLOCK_WS = dict(
    BLOCK_M=128,
    BLOCK_C=256,
    BLOCK_RED=128,
    GROUP_M=8,
    MATH_REGS=232,
    LOAD_REGS=40,
    num_warps=4,
    maxnreg=168,
)
FP8_BLOCK_WS_STAGES: dict[int, int] = {2: 4, 4: 3}

# fp8_block's wgrad on Hopper (the same kernel module's grouped_wgrad_fp8_block_ws_kernel): the forward's
# layout with dw's (O, I) tile as its (rows, columns), 128 x 256, a step 128 rows of the group (one scale
# block). A ring slot is the forward's 48 KiB of operands plus the step's scale rows (1.5 KiB: s_dy's 128
# and s_x's 256, through TMA), so beside the two staging tiles 3 slots fit in 16-bit outputs and 2 in fp32
# (FP8_BLOCK_WGRAD_WS_STAGES; a fourth would pass Hopper's 227 KiB). Each 128-column half's promotion
# needs that half's x scales in the accumulator's layout (32 registers a thread) beside the two
# accumulators and the product: MATH_REGS 240 (the main loop without spills), the load warp 24
# (2 x 240 + 24 of 504 a thread-slot, as 2 x 232 + 40).
FP8_BLOCK_WGRAD_WS = dict(
    BLOCK_O=128,
    BLOCK_I=256,
    BLOCK_RED=128,
    GROUP_O=8,
    MATH_REGS=240,
    LOAD_REGS=24,
    num_warps=4,
    maxnreg=168,
)
FP8_BLOCK_WGRAD_WS_STAGES: dict[int, int] = {2: 3, 4: 2}


# --------------------------------------------------------------------------------------------------
# Row movement (kernels.rows) and routing (kernels.routing)
# --------------------------------------------------------------------------------------------------


# The row kernel (kernels.rows.gather_sum_rows_kernel), by what it does:
# - a gather (J = 1, no weight: bytes copied): COPY_TILE_BYTES a program, in row pieces of at most
#   COPY_ROW_BYTES (bf16: 64 rows of 128 columns), so that a program has many independent row loads in
#   flight;
# - a sum (the combine of each token's K rows, weighted or not): SUM_TILE_ELEMENTS elements a program,
#   at most SUM_MAX_BLOCK_D columns; UNROLL_J the unroll factor of its loop over the J source rows (1:
#   not unrolled);
# num_warps for both. Narrow rows (the (M, 1) router weights) get many rows a program. Chosen by
# `benchmarks/sweep_rows.py` at the layer shapes (benchmarks/README.md has the run).
ROWS: dict[str, int] = dict(
    COPY_TILE_BYTES=8192, COPY_ROW_BYTES=256, SUM_TILE_ELEMENTS=2048, SUM_MAX_BLOCK_D=1024, num_warps=4, UNROLL_J=1
)


def rows_tile(num_features: int, element_size: int, copy: bool) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_D) of the row kernel for rows of `num_features` elements of `element_size`
    bytes, a gather (`copy`) or a sum, from `ROWS`."""
    if copy:
        most_d, tile = ROWS["COPY_ROW_BYTES"] // element_size, ROWS["COPY_TILE_BYTES"] // element_size
    else:
        most_d, tile = ROWS["SUM_MAX_BLOCK_D"], ROWS["SUM_TILE_ELEMENTS"]
    block_d = min(1 << max(num_features - 1, 0).bit_length(), max(most_d, 1))
    return max(1, tile // block_d), block_d


# The padding-row zeroing kernel (kernels.rows.zero_rows_from_kernel): (BLOCK_ROWS, BLOCK_COLS).
ZERO_ROWS_TILE = (64, 128)


# Grouped FP8 quantization (kernels.quantize). The tiles kernel (rowwise alone, a weight's blocks), by
# (the format's block side TILE_K, form): (BLOCK_R, BLOCK_C, warps, STEPS, STAGES, MAXNREG). Forms:
# "rows" (rowwise alone: any BLOCK_R, the rows need no group), "tile" (fp8_block's 128 x 128 weight
# blocks, with or without the weight's transposed copy). A program holds one 2-D tile read once (8-32 KB
# of bf16). What keeps HBM busy is the bytes in flight an SM: the registers allow many programs an SM,
# so a program is one tile with no loop (STEPS = 1). MAXNREG as the slots kernel's (below): the tile
# form at 64 keeps two programs of 16 warps an SM with the transposed copy (82 registers uncapped,
# none spilled at 64: ptxas -v, `tools/quantize_ptx.py`). Under
# the interpreter: small tiles and a loop, so that CPU tests cover several tiles of a block row, the
# loop, and blocks cut by the edges.
# The slots kernel (the columnwise form, with or without the rowwise), by (TILE_K, layout of the
# columnwise data: "rows" (M, X), "segments" the FP8 wgrad's transposed operand, "segments-gathered" the
# same with the rows gathered from token rows by an index as they are loaded, the layer's routed
# operands, whose dependent index loads may want other settings): (BLOCK_C, CHUNK,
# warps, STAGES, BAND, MAXNREG). A program is one slot's (32 or 128 rows of one group) strip of BLOCK_C columns,
# walked twice in CHUNK-row chunks (the first walk pipelined over STAGES); the chunk, not the slot,
# sets the registers, hence the programs an SM. A CHUNK of the whole slot is one walk: the strip is
# held in registers from its load to its columnwise bytes, read once. CHUNK divides the slot and is a
# multiple of 16 (the wgrad layout's stores). BAND orders the programs (the kernels' `program_order`): bands of BAND
# slots, columns fastest at 1; 0 is a 2-D launch, slots fastest (the order before bands, which the
# wgrad layout keeps: its transposed stores are x's columns). MAXNREG caps the registers a thread
# (Triton's `maxnreg`; 0: ptxas's choice): the programs an SM step at 128, 96 and 80 registers for 4
# warps, and the latency-bound routed operands want programs more than registers (ptxas spills the
# rest to L1). The sm90 entries are the fastest of
# sweeps on the H200 (notes/quantize.md); "segments-gathered" (a copy of "segments") and mxfp8's
# (32, "rows") (one walk) the fastest of `benchmarks/sweep_quantize.py` on an H100 (sm_90 too); the
# sm80 ones are guesses, not timed. Under the
# interpreter: two chunks a slot, narrow strips and both launch forms, so that CPU tests cover
# several chunks of a slot, several strips of a row and bands cut by the last slot; fp8_block's
# gathered entry is one walk, so that they cover that form too.
# Every interpreter entry of these quantize tables is the largest that still gives the CPU tests'
# shapes several tiles, chunks or spans: the interpreter's cost is per operation of every program, so
# smaller tiles only multiply the CPU time (the tests' groups of 33-130 rows, 67-257 columns).
# fp8_rowwise's whole-row kernel (rowwise alone) walks (BLOCK_ROWS rows, BLOCK_COLS columns) chunks when
# a row does not fit a program (QUANTIZE_CHUNKS); tiny chunks under the interpreter so that CPU tests
# cover several chunks of a row.
QUANTIZE_TILES: dict[Arch, dict[tuple[int, str], tuple[int, int, int, int, int, int]]] = {
    "sm90": {
        (32, "rows"): (32, 128, 4, 1, 1, 0),
        (128, "rows"): (32, 128, 4, 1, 1, 0),
        (128, "tile"): (128, 128, 16, 1, 1, 64),
    },
    "sm80": {
        (32, "rows"): (32, 128, 4, 1, 1, 0),
        (128, "rows"): (32, 128, 4, 1, 1, 0),
        (128, "tile"): (128, 128, 16, 1, 1, 0),
    },
    "interpreter": {
        (32, "rows"): (16, 64, 4, 1, 1, 0),
        (128, "rows"): (16, 128, 4, 2, 1, 0),
        (128, "tile"): (128, 128, 4, 1, 1, 0),
    },
}
QUANTIZE_SLOTS: dict[Arch, dict[tuple[int, str], tuple[int, int, int, int, int, int]]] = {
    "sm90": {
        (32, "rows"): (128, 32, 4, 1, 1, 0),
        (128, "rows"): (128, 16, 4, 1, 1, 0),
        (32, "segments"): (128, 16, 4, 1, 0, 0),
        (32, "segments-gathered"): (128, 16, 4, 1, 0, 0),
        (128, "segments"): (128, 32, 4, 2, 0, 0),
        (128, "segments-gathered"): (128, 32, 4, 2, 0, 128),
    },
    "sm80": {
        (32, "rows"): (128, 16, 4, 1, 1, 0),
        (128, "rows"): (128, 16, 4, 1, 1, 0),
        (32, "segments"): (128, 16, 4, 1, 0, 0),
        (32, "segments-gathered"): (128, 16, 4, 1, 0, 0),
        (128, "segments"): (128, 16, 4, 2, 0, 0),
        (128, "segments-gathered"): (128, 16, 4, 2, 0, 0),
    },
    "interpreter": {
        (32, "rows"): (64, 16, 4, 1, 1, 0),
        (128, "rows"): (128, 64, 4, 1, 1, 0),
        (32, "segments"): (64, 16, 4, 1, 2, 0),
        (32, "segments-gathered"): (64, 16, 4, 1, 2, 0),
        (128, "segments"): (128, 64, 4, 1, 0, 0),
        (128, "segments-gathered"): (128, 128, 4, 1, 0, 0),
    },
}
# The columnwise form on Hopper by the Gluon kernel (`kernels/quantize_hopper.py`), per (the recipe's
# block: 128 fp8_block, 32 mxfp8; form): "rows" ((M, X) columnwise data, with or without the rowwise
# form), "segments" (the FP8 wgrad's layout with the rowwise form; fp8_block only), "segments-columnwise"
# (that layout alone) -> (CHUNK rows a walk step, warps, strips (a slot's rows x 128 columns) in flight a
# program, programs an SM, slots fastest, MAXNREG: the registers a
# thread, 0 for ptxas's choice, else capped so that the programs an SM fit the register file: the launch
# is persistent, and a program that does not fit waits for a whole one to finish). Many small programs beat a
# few large ones (each walks its strip alone; the others' loads and stores hide its latency); the H200
# sweeps that chose each entry are in notes/quantize.md; the segments' entries were chosen at splits
# that are not multiples of 128 rows (what routing gives) while segments started at multiples of 16
# columns, off 128-byte lines (now at multiples of 128: `SEGMENT_COLUMNS`; not swept since).
# With the rowwise form, strips go fastest: the programs running at one time then cover a few slots'
# whole width, so each row's scales (one float a strip, side by side in memory) are written close
# together in time rather than one float per 32-byte sector spread over the whole launch. Only
# architectures listed here run it;
# elsewhere (and for x that TMA cannot take) `quantize_slots_kernel` writes the same bytes. A form's
# "-gathered" entry runs its GATHER form (rows x[index], copied by cp.async: TMA boxes cannot gather)
# for the backward's routed operands (`group_quantize_for_wgrad(index=)`); without one the Triton slots
# kernel gathers them. None: the GATHER form was slower than the Triton kernel, alone and in the layer's
# step (notes/quantize.md, benchmarks/README.md).
# mxfp8's (32, "rows"): 8 programs an SM of 2 warps, one 32 x 128 strip in flight each, the fastest of the
# entries `benchmarks/sweep_quantize.py` timed on an H100 (notes/quantize.md); deeper rings did not help.
QUANTIZE_SLOTS_TMA: dict[Arch, dict[tuple[int, str], tuple[int, int, int, int, bool, int]]] = {
    "sm90": {
        (128, "rows"): (16, 2, 1, 6, False, 0),
        (128, "segments"): (32, 4, 1, 4, False, 128),
        (128, "segments-columnwise"): (32, 4, 2, 3, True, 0),
        (32, "rows"): (16, 2, 1, 8, False, 0),
    },
}
# The table of the slots' rows the Gluon kernel reads (`slot_records_kernel`): (slots a program,
# warps). A program compares its slots with every group's first slot, a (slots, BLOCK_GROUPS) tile.
# Small under the interpreter so that CPU tests cover several programs.
SLOT_RECORDS: dict[Arch, tuple[int, int]] = {
    "sm90": (64, 4),
    "interpreter": (8, 4),
}
QUANTIZE_CHUNKS: dict[Arch, tuple[int, int, int]] = {
    "sm90": (16, 512, 4),
    "sm80": (16, 512, 4),
    "interpreter": (16, 64, 4),
}
# The whole-row kernel's one-pass form (rows read once, held in registers): (most columns, elements a
# program, warps). 16384 bf16 columns are 64 fp32 registers a thread at 8 warps; a program takes
# max(1, elements / next_power_of_2(X)) rows. Small under the interpreter so that CPU tests cover both
# forms (70 columns in one pass, 130 in two).
QUANTIZE_ONE_PASS_ROWS: dict[Arch, tuple[int, int, int]] = {
    "sm90": (16384, 8192, 8),
    "sm80": (16384, 8192, 8),
    "interpreter": (128, 256, 4),
}
# fp8_rowwise with the columnwise form: two passes over (SPAN rows of one group, BLOCK_COLS) tiles: the
# maxima (QUANTIZE_AMAX_SPANS, (SPAN, BLOCK_COLS, warps): tall tiles, so that the atomic maxima are few
# next to the elements, one per row and per column of a tile; maxima only, so a thread holds 64
# elements at few registers and several programs share an SM) and the data of both forms
# (QUANTIZE_SPANS, (SPAN, BLOCK_COLS, warps, STEPS, STAGES): both forms' registers allow few programs
# an SM, so a program walks STEPS column blocks in a pipelined loop). Small under the interpreter so
# that CPU tests cover several spans of a group, several column blocks and the loop. The sm90 entries
# of these two tables are the fastest of a sweep on the H200 (notes/quantize.md); the sm80 ones are
# the first guesses, not timed.
QUANTIZE_AMAX_SPANS: dict[Arch, tuple[int, int, int]] = {
    "sm90": (256, 64, 4),
    "sm80": (64, 128, 4),
    "interpreter": (16, 32, 4),
}
QUANTIZE_SPANS: dict[Arch, tuple[int, int, int, int, int]] = {
    "sm90": (64, 128, 4, 8, 2),
    "sm80": (32, 128, 8, 8, 2),
    "interpreter": (16, 32, 4, 2, 1),
}
# The dequantize kernel's tiles (BLOCK_M rows, BLOCK_X columns, warps): an elementwise pass, 32 x 256
# moves 8 KB of FP8 in and 16 KB of bf16 out a program; small tiles under the interpreter so that CPU
# tests cover several tiles of a block and blocks across tiles.
DEQUANTIZE_TILES: dict[Arch, tuple[int, int, int]] = {
    "sm90": (32, 256, 4),
    "sm80": (32, 256, 4),
    "interpreter": (16, 16, 4),
}

# The transposed FP8 weight's tiles (BLOCK_O, BLOCK_I, warps): fp8_block's tiles are its 128 x 128
# blocks (the warps from here); 128 x 128 bytes a program, each side read or written 16 bytes a thread
# at a time, the transpose through shared memory. Small under the interpreter so that CPU tests cross
# several tiles.
TRANSPOSE_TILES: dict[Arch, tuple[int, int, int]] = {
    "sm90": (128, 128, 4),
    "sm80": (128, 128, 4),
    "interpreter": (16, 32, 4),
}


@dataclass(frozen=True)
class RoutingTiles:
    """The routing kernels' tile sizes: rows per sub-block (sub), chunks of up to max_chunk rows, about
    target_chunks chunks, buckets per tile, the scan's buckets per program and chunks per step, and the
    scatter kernel's warps."""

    sub: int
    max_chunk: int
    target_chunks: int
    max_bucket_tile: int
    scan_buckets: int
    scan_block: int
    scatter_warps: int


ROUTING_TILES: dict[Arch, RoutingTiles] = {
    # 32-row sub-blocks: the 32 x 32 rank comparison of a step is 8 values a thread, so the scatter
    # kernel needs 56 registers (64-row sub-blocks need 177 with 8 warps, one program per SM). About
    # 2048 chunks at large M: programs for every SM, while the scan over chunks stays one or two tiles
    # a program (one compiled variant for every M).
    "sm90": RoutingTiles(32, 2048, 2048, 1024, 4, 1024, 4),
    "sm80": RoutingTiles(32, 2048, 2048, 1024, 4, 1024, 4),
    # Tiny tiles, so that CPU tests cover several sub-blocks, chunks, bucket tiles and scan blocks quickly.
    "interpreter": RoutingTiles(16, 64, 4, 128, 64, 2, 4),
}


# --------------------------------------------------------------------------------------------------
# The gated activation on its own (kernels.gated): (BLOCK_ROWS, BLOCK_C, warps)
# --------------------------------------------------------------------------------------------------

# By whether h is read held in FP8 (the quantized MLP's backward: its bytes and rowwise scales,
# dequantized in the load) or in its own dtype. In its own dtype, about 4096 activation columns a
# program (gate and up: 16 KB of bf16 read per tile, enough bytes in flight to stream at HBM speed); the
# backward walks a row's F columns in BLOCK_C steps. Held in FP8, sm90: 8 rows x 128 columns (the same
# elements as the 4 x 256 that a sweep at four real widths on the H200 chose, when each element's scale
# was loaded: far faster than the 16-row tile for the backward at every width, the forward near each
# width's best; benchmarks/README.md, the gated sweep), so that fp8_block's `[gate | up]` tiles each
# read a row's two scales once (`runtime.gated._gated_tile` halves the columns, doubling the rows, where
# a width's tiles still cross a scale block). Tiny tiles under the interpreter, so that CPU tests cover
# several row tiles and several column steps of a row.
GATED_TILES: dict[Arch, dict[bool, tuple[int, int, int]]] = {
    "sm90": {False: (16, 256, 4), True: (8, 128, 4)},
    "sm80": {False: (16, 256, 4), True: (16, 256, 4)},
    "interpreter": {False: (4, 8, 4), True: (4, 8, 4)},
}

# How narrow `runtime.gated.narrowed` makes a held-h tile (columns) for one scale block a run before it
# takes two blocks a run (both blocks' scales loaded, each column picking its own) at a wider tile. sm90
# 128: the table's 128-column tile stays whole where F is not a multiple of it (gpt-oss's 2880: two blocks
# a run, faster than one block at 64 columns in `sweep_gated.py --narrowest-one-block`; benchmarks/README.md);
# the widths that are keep one block a run; mxfp8's 32-column blocks get 64-column tiles with two blocks a
# run instead of 32 with one (faster both ways; notes/quantize.md, "The gated kernels read a row's scales
# once a tile"). sm80 not timed.
GATED_NARROWEST_ONE_BLOCK: dict[Arch, int] = {"sm90": 128, "sm80": 16, "interpreter": 16}

# The gated activation with both quantizations (kernels.gated.gated_quantize_kernel): (BLOCK_ROWS, BLOCK_C,
# warps, BAND) for each way its tiles hold h's scale blocks (True: runs of gates and ups; False:
# interleaved pairs), BLOCK_C the widest tile of activation columns tried (the host halves it until a
# tile's h columns form whole scale blocks, never below one block), BAND the programs' order (0: a 2-D
# launch, row tiles fastest; else bands of BAND row tiles, column tiles fastest). sm90: the fastest of
# sweeps over 4-32 rows x 128-512 columns x 4-8 warps (and a pipelined loop of tiles down the rows, no
# faster than 8 rows without one) at the layer benchmark's widths (benchmarks/README.md, the gated
# sweeps), in bands of one row tile (whole stretches of h's rows read together, which pays most at the
# widest rows; 4 and 32 no better: notes/quantize.md, "The gated pass that quantizes"); sm80 not timed.
# Under the interpreter 64 columns (mxfp8's tiles hold two scale blocks, and F = 96 ends in a partial
# tile), one order each, so that the CPU tests cover both.
GATED_QUANTIZE_TILES: dict[Arch, dict[bool, tuple[int, int, int, int]]] = {
    "sm90": {True: (8, 256, 4, 1), False: (8, 256, 4, 1)},
    "sm80": {True: (16, 256, 4, 0), False: (8, 256, 4, 0)},
    "interpreter": {True: (4, 64, 4, 2), False: (4, 64, 4, 0)},
}

# The held activation quantized columnwise into fc2's wgrad segments (kernels.gated.held_columns_kernel):
# (BLOCK_C, warps), a program one slot (the recipe's block of rows) by BLOCK_C activation columns, held in
# registers from the load to the bytes. sm90: 128 x 64 elements, 8 warps (the slots kernel's one-walk
# strip); every other entry of a sweep (32-128 columns, 4-16 warps) was slower, and the kernel itself is off
# on sm90 (HELD_COLUMNS_FUSED below; notes/quantize.md). Under the interpreter 16 columns, so that a tile
# ends inside F.
HELD_COLUMNS: dict[Arch, tuple[int, int]] = {
    "sm90": (64, 8),
    "sm80": (64, 8),
    "interpreter": (16, 4),
}

# fc2's wgrad operand in the quantized MLP's backward from the held h in one pass (kernels.gated.
# held_columns_kernel) instead of the gated kernel writing the activation and the slots quantizer reading
# it. sm90: off: the same bytes, but slower than the two launches in the layer's profile on the H200
# (benchmarks/README.md, the held columns);
# an architecture absent here keeps them apart. On under the interpreter, so that the CPU tests run the
# quantized MLP through it.
HELD_COLUMNS_FUSED: dict[Arch, bool] = {"sm90": False, "interpreter": True}

# fc1 of the quantized MLP with the gated activation and both rowwise quantizations in its epilogue
# (kernels.grouped_gemm_fp8_hopper.grouped_glu_fp8_block_ws_kernel) where it applies, instead of the FP8
# GEMM writing h and the gated pass quantizing it. sm90: off. Its bytes are the pair's, but both math warp
# groups run the quantizing epilogue with the tensor cores idle, and on the H200 it took longer than the
# GEMM and the pass apart (benchmarks/README.md, the gated fc1 A/B); an architecture absent here keeps
# them apart.
GATED_FC1_EPILOGUE: dict[Arch, bool] = {"sm90": False}


# --------------------------------------------------------------------------------------------------
# The router's top-k + softmax (kernels.topk)
# --------------------------------------------------------------------------------------------------

# The most experts the kernels take: a row's logits live in registers (as int32 keys), padded to the next
# power of two; wider rows go through torch ops (backend="auto") or are refused ("triton").
TOPK_MAX_EXPERTS = 1024

# By the row's padded width BLOCK_N: (BLOCK_T rows a program, warps) of the forward, then of the backward.
# Small programs, mostly of one warp: a row's reductions stay within a warp (no shared memory), and an
# SM holds many programs, whose rounds interleave. sm90 at 128, 256 and 512: the fastest of the tiles
# swept (1-8 rows, 1-4 warps) on the H200 at T 32768 in bf16 (notes/moe_experts.md); 64 was swept with
# an earlier form of the forward, 1024 and sm80 are guesses, not timed. Narrower rows than 64 take 64's
# entry. Under the interpreter a few rows a program, so that CPU tests cover several programs and a
# partial last one.
TOPK_TILES: dict[Arch, dict[int, tuple[int, int, int, int]]] = {
    "sm90": {64: (16, 1, 16, 1), 128: (2, 1, 8, 2), 256: (4, 1, 4, 1), 512: (1, 1, 4, 1), 1024: (1, 2, 2, 2)},
    "sm80": {64: (16, 1, 16, 1), 128: (2, 1, 8, 2), 256: (4, 1, 4, 1), 512: (1, 1, 4, 1), 1024: (1, 2, 2, 2)},
    "interpreter": {n: (4, 4, 4, 4) for n in (64, 128, 256, 512, 1024)},
}


# Whether the forward packs each column into the low bits of 16-bit logits' keys (one 32-bit max a round
# instead of a max and a min; the same choices): a table entry so that both forms can be timed side by
# side (`benchmarks/bench_routing.py --topk`).
TOPK_PACKED_KEYS = dict(ON=True)


def topk_tiles(arch: Arch, block_n: int) -> tuple[int, int, int, int]:
    """(forward BLOCK_T, forward warps, backward BLOCK_T, backward warps) of the top-k kernels for rows
    padded to block_n columns (a power of two up to TOPK_MAX_EXPERTS)."""
    return TOPK_TILES[arch][max(block_n, 64)]
