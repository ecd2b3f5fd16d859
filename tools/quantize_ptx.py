"""Compile moekit's group_quantize kernels (and the gated kernels: the columnwise quantization of the held
activation, `held_columns_kernel`; the activation and its backward on the held h; the forward's gated
quantize pass) for sm_90 on any machine (no GPU) at the sm90 configurations of
`moekit.ops.runtime.configs` (the Gluon columnwise kernel's `QUANTIZE_SLOTS_TMA` too) and print, per
kernel and form: registers and spills (ptxas -v), shared
memory, shuffles, barriers, and the global access widths (16-byte `ld/st.global.v4.b32`, `cp.async`),
i.e. what bounds its programs an SM and its bytes in flight (notes/quantize.md); and from its sm_90a SASS
(cuobjdump) the instructions of each loop body (a backward branch's span: both sides of any branch
inside it), what an element costs to issue. FAST_PATH=1 compiles every `store_e4m3` as its branch for
tiles without a non-finite block (what nearly every tile runs), so that the loop bodies count that path.

    PYTHONPATH=src python tools/quantize_ptx.py [OUTDIR] [NAME_FILTER]

Integers are compiled as the launcher specializes them at the benchmark's shapes (divisible by 16),
pointers 16-byte aligned; x is bf16 (X_DTYPE=*fp32 or *fp16 for the others). OUTDIR keeps each
kernel's PTX (default: a temporary directory).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from moekit.ops.kernels import quantize as kernels  # noqa: E402
from moekit.ops.kernels import quantize_hopper  # noqa: E402
from moekit.ops.kernels.gated import (  # noqa: E402
    gated_backward_kernel,
    gated_forward_kernel,
    gated_quantize_kernel,
    held_columns_kernel,
)
from moekit.ops.kernels.quantize_hopper import quantize_slots_tma_kernel  # noqa: E402
from moekit.ops.runtime import configs  # noqa: E402
from moekit.ops.runtime.glu import jit_pair  # noqa: E402


@triton.jit
def _store_e4m3_fast_path(ptrs, x, s, keep, mask, any_nan, HW_E4M3: tl.constexpr, TRANSPOSE: tl.constexpr):
    """`store_e4m3`'s branch for tiles without a non-finite block (FAST_PATH: counting its instructions)."""
    q = (x * s).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    if TRANSPOSE:
        q = tl.trans(q)
    tl.store(ptrs, q, mask=mask)


if os.environ.get("FAST_PATH"):
    kernels.store_e4m3 = quantize_hopper.store_e4m3 = _store_e4m3_fast_path

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
CUOBJDUMP = PTXAS.with_name("cuobjdump")
POINTERS = {
    "offs_ptr": "*i64",
    "slot_offs_ptr": "*i64",
    "noop_ptr": "*fp32",
    "index_ptr": "*i32",
    "rec_ptr": "*i32",
    "x_ptr": os.environ.get("X_DTYPE", "*bf16"),
}
COUNTS = {
    "ld.v4": r"ld\.global(\.\w+)*\.v4\.b32",
    "cp.async16": r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], 0x10",
    "st.v4": r"st\.global(\.\w+)*\.v4\.b32",
    "st.b8": r"st\.global(\.\w+)*\.b8",
    "shfl": r"shfl\.sync",
    "bar": r"bar\.sync",
    "atom": r"(?<![a-z.])(red|atom)\.global",
}


def compile_case(out: Path, name: str, kernel, constexprs: dict, warps: int, pointers: dict, maxnreg: int = 0) -> None:
    pointers = {**POINTERS, **pointers}
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        else:
            signature[arg] = pointers.get(arg, "*u8") if arg.endswith("_ptr") else "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = (GluonASTSource if kernel is quantize_slots_tma_kernel else ASTSource)(
        fn=kernel,
        signature=signature,
        constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    path = out / f"{name}.ptx"
    path.write_text(ptx)
    cubin = path.with_suffix(".cubin")
    report = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", cubin], capture_output=True, text=True)
    regs = re.findall(r"Used (\d+) registers", report.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", report.stderr)
    counts = " ".join(f"{k} {len(re.findall(v, ptx))}" for k, v in COUNTS.items())
    print(f"{name:<34} warps {warps:>2} regs {regs} spill {spills} smem {compiled.metadata.shared:>6}  {counts}")
    sass = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True).stdout
    print(f"{'':<34} SASS {len(sass_instructions(sass))} instructions, loop bodies {loop_bodies(sass)}")


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction in cuobjdump's SASS listing."""
    return [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,6})\*/\s+([^;]*);", sass)]


def loop_bodies(sass: str) -> list[int]:
    """The instructions between each backward branch and its target, in program order: a loop's body
    per iteration (with both sides of a branch inside it: compile a branch out to count one side)."""
    instructions = sass_instructions(sass)
    bodies = []
    for address, text in instructions:
        target = re.search(r"BRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            bodies.append(sum(1 for a, _ in instructions if start <= a <= address))
    return bodies


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="quantize_ptx_"))
    only = sys.argv[2] if len(sys.argv) > 2 else ""
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    common = dict(HAS_NOOP=False, BLOCK_GROUPS=256, HW_E4M3=True)
    for (tile_k, form), (block_r, block_c, warps, steps, stages, maxnreg) in configs.QUANTIZE_TILES["sm90"].items():
        mx = tile_k == 32
        for transposed in (False, True) if form == "tile" else (False,):
            constexprs = dict(MX=mx, TILE=form == "tile", TILE_K=tile_k, BLOCK_R=block_r, BLOCK_C=block_c)
            constexprs.update(STEPS=steps, STAGES=stages, TRANSPOSED=transposed)
            scales = "*u8" if mx else "*fp32"
            name = f"tiles_{'mxfp8' if mx else 'fp8_block'}_{form}{'_transposed' if transposed else ''}"
            pointers = {"row_scale_ptr": scales, "t_scale_ptr": scales}
            cases.append((name, kernels.quantize_tiles_kernel, {**constexprs, **common}, warps, pointers, maxnreg))
    slots_table = configs.QUANTIZE_SLOTS[os.environ.get("ARCH", "sm90")]
    for (tile_k, layout), (block_c, chunk, warps, stages, band, maxnreg) in slots_table.items():
        mx = tile_k == 32
        slot_rows = 32 if mx else 128
        segments, gather = layout.startswith("segments"), layout.endswith("-gathered")
        for rowwise in (True, False):
            constexprs = dict(MX=mx, ROWWISE=rowwise, SEGMENTS=segments, GATHER=gather, TILE_K=tile_k)
            constexprs.update(SLOT_ROWS=slot_rows)
            constexprs.update(BLOCK_C=block_c, CHUNK=chunk, STAGES=stages, BAND=band)
            scales = "*u8" if mx else "*fp32"
            form = ("row+col" if rowwise else "col") + ("" if layout == "rows" else f"_{layout}")
            name = f"slots_{'mxfp8' if mx else 'fp8_block'}_{form}"
            pointers = {"row_scale_ptr": scales, "col_scale_ptr": scales}
            constexprs.update(HAS_NOOP=False, HW_E4M3=True)
            cases.append((name, kernels.quantize_slots_kernel, constexprs, warps, pointers, maxnreg))
    fp32 = {"scale_ptr": "*fp32", "row_scale_ptr": "*fp32", "col_scale_ptr": "*fp32"}
    for (block, form), entry in configs.QUANTIZE_SLOTS_TMA["sm90"].items():
        chunk, warps, stages, _, slots_fastest, maxnreg = entry
        gather, mx = form.endswith("-gathered"), block == 32
        form = form.removesuffix("-gathered")
        scales = {"row_scale_ptr": "*u8", "col_scale_ptr": "*u8"} if mx else fp32
        for rowwise in (True, False) if form == "rows" else (form == "segments",):
            constexprs = dict(ROWWISE=rowwise, SEGMENTS=form.startswith("segments"), CHUNK=chunk, STAGES=stages)
            constexprs.update(SLOTS_FASTEST=slots_fastest, HAS_NOOP=False, HW_E4M3=True, GATHER=gather, MX=mx)
            recipe = "mxfp8" if mx else "fp8_block"
            name = f"slots_tma_{recipe}_{'row+col' if rowwise else 'col'}_{form}{'_gathered' if gather else ''}"
            cases.append((name, quantize_slots_tma_kernel, constexprs, warps, {**scales, "rec_ptr": "*i32"}, maxnreg))
    block_s, warps = configs.SLOT_RECORDS["sm90"]
    for segments in (False, True):
        consts = dict(SLOT_ROWS=128, SEGMENTS=segments, BLOCK_S=block_s, BLOCK_GROUPS=256)
        name = f"slot_records_seg{int(segments)}"
        cases.append((name, kernels.slot_records_kernel, consts, warps, {"rec_ptr": "*i32"}))
    amax = {"row_amax_ptr": "*i32", "col_amax_ptr": "*i32"}
    most_cols, elements, warps = configs.QUANTIZE_ONE_PASS_ROWS["sm90"]
    for cols in (7168, 4096, 2880, 2048):
        block_cols = triton.next_power_of_2(cols)
        rows_consts = dict(BLOCK_ROWS=max(1, elements // block_cols), BLOCK_COLS=block_cols, ONE_PASS=True)
        rows_consts.update(HAS_NOOP=False, HW_E4M3=True)
        cases.append((f"rows_x{cols}", kernels.quantize_rows_kernel, rows_consts, warps, fp32))
    span, block_cols, warps = configs.QUANTIZE_AMAX_SPANS["sm90"]
    for rowwise in (True, False):
        consts = dict(ROWWISE=rowwise, GATHER=False, HAS_NOOP=False, SPAN=span, BLOCK_COLS=block_cols)
        consts.update(BLOCK_GROUPS=256)
        cases.append((f"amax_spans_row{int(rowwise)}", kernels.amax_spans_kernel, consts, warps, amax))
    span, block_cols, warps, steps, stages = configs.QUANTIZE_SPANS["sm90"]
    for rowwise in (True, False):
        consts = dict(ROWWISE=rowwise, SPAN=span, BLOCK_COLS=block_cols, STEPS=steps, STAGES=stages, SEGMENTS=False)
        consts.update(GATHER=False)
        consts.update(common)
        cases.append((f"quantize_spans_row{int(rowwise)}", kernels.quantize_spans_kernel, consts, warps, fp32 | amax))
    # fc2's wgrad operand from the held h (fp8_block, SwiGLU with probs, bf16 h): a row's scales once a
    # tile, of one block a run (every real width at the sm90 tile) and of two.
    block_c, warps = configs.HELD_COLUMNS["sm90"]
    for row_scales in (1, 2):
        consts = dict(GLU_BLOCK=768, HAS_PROBS=True, ACT=jit_pair("swiglu")["ACT"], OUT_DTYPE=tl.bfloat16)
        consts.update(SCALED=True, SCALE_COLS=128, SCALE_E8M0=False, HELD_GATE_LIMIT=0.0, HELD_UP_LIMIT=0.0)
        consts.update(ROUND_BF16=False, FP8_CVT=True, ROW_SCALES=row_scales, MX=False, SLOT_ROWS=128)
        consts.update(BLOCK_C=block_c, HW_E4M3=True)
        held = {"h_ptr": "*u8", "scale_ptr": "*fp32", "probs_ptr": "*bf16", "rec_ptr": "*i32", "col_scale_ptr": "*fp32"}
        cases.append((f"held_columns_row_scales{row_scales}", held_columns_kernel, consts, warps, held))
    # The gated kernels of the quantized MLP's backward reading the held h (fp8_block, SwiGLU with probs,
    # bf16 out): the activation (fc2's wgrad operand) and dh with d probs.
    block_rows, block_c, warps = configs.GATED_TILES["sm90"][True]
    held = {"h_ptr": "*u8", "scale_ptr": "*fp32", "probs_ptr": "*bf16", "out_ptr": "*bf16", "dh_ptr": "*bf16"}
    held |= {"d_out_ptr": "*bf16", "d_probs_ptr": "*fp32"}
    pair = jit_pair("swiglu")
    for row_scales in (1, 2):  # F 768: one block a run; 2: F 2880 at this tile, the ups' runs crossing one
        consts = dict(GLU_BLOCK=768 if row_scales == 1 else 2880, HAS_PROBS=True, SCALED=True, SCALE_COLS=128)
        consts.update(SCALE_E8M0=False, HELD_GATE_LIMIT=0.0, HELD_UP_LIMIT=0.0, ROUND_BF16=False, FP8_CVT=True)
        consts.update(ROW_SCALES=row_scales, BLOCK_ROWS=block_rows, BLOCK_C=block_c)
        name = f"gated_forward_held_row_scales{row_scales}"
        cases.append((name, gated_forward_kernel, {**consts, "ACT": pair["ACT"]}, warps, held))
        consts.update(NEED_DPROBS=True, **pair)
        cases.append((name.replace("forward", "backward"), gated_backward_kernel, consts, warps, held))
    # The quantized MLP's forward between its GEMMs (bf16 h, fp8_block, SwiGLU with probs, F 768 in the
    # [gate | up] order: runs of gates and ups).
    block_rows, block_c, warps, band = configs.GATED_QUANTIZE_TILES["sm90"][True]
    consts = dict(GLU_BLOCK=768, HAS_PROBS=True, ACT=pair["ACT"], MX=False, TILE_K=128, HELD_GATE_LIMIT=0.0)
    consts.update(HELD_UP_LIMIT=0.0, RUNS=True, HW_E4M3=True, BLOCK_ROWS=block_rows, BLOCK_C=block_c, BAND=band)
    quantize = {"h_ptr": "*bf16", "probs_ptr": "*bf16", "a_scale_ptr": "*fp32", "h_scale_ptr": "*fp32"}
    cases.append(("gated_quantize_runs", gated_quantize_kernel, consts, warps, quantize))
    for name, kernel, constexprs, warps, pointers, *maxnreg in cases:
        if only in name:
            compile_case(out, name, kernel, constexprs, warps, pointers, *maxnreg)
    print(f"PTX in {out}")


if __name__ == "__main__":
    main()
