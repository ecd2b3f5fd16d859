"""fp8_block's columnwise form, and mxfp8's (M, X) form, by the Gluon kernel on Hopper
(`moekit.ops.kernels.quantize_hopper`, `quantize_slots_tma_kernel`): the same bytes as the Triton slots
kernel, which the other quantize tests check against the torch path and float64.

On the CPU: the kernel compiles for sm_90 (in a subprocess without the interpreter) with 16-byte stores
of every form and shared memory for its configured programs an SM; which problems the runtime gives
it. On the GPU (-m gpu): every output byte equal to the Triton kernel's (the configuration table's
entry removed, plans forgotten) for both layouts, with and without the rowwise form, bf16 and fp16, at
layer sizes with skewed splits, empty groups, one-row groups, padding rows holding NaN, specials (inf,
NaN, zero and tiny rows) and widths not multiples of 128; outputs NaN-poisoned; the noop flag; no host
sync; which kernel ran (profiler names).

Legend: M rows, N groups, X columns."""

from __future__ import annotations

import pytest
import torch

import moekit
from helpers import assert_no_host_sync, compile_in_subprocess
from moekit.grouped_tensor import recipe_named
from moekit.ops.kernels.quantize import slot_records_kernel
from moekit.ops.quantize import group_quantize_for_wgrad
from moekit.ops.runtime import configs
from moekit.ops.runtime.launch import forget_plans
from moekit.ops.runtime.quantize_torch import SEGMENT_COLUMNS

quantize_runtime = pytest.importorskip("moekit.ops.runtime.quantize")

# mxfp8's (M, X) form's entry where the table has none (the GPU tests and the compile test run it):
# 16-row chunks, 2 warps, 3 strips in flight a program, 8 programs an SM.
MX_TRIAL = configs.QUANTIZE_SLOTS_TMA["sm90"].get((32, "rows"), (16, 2, 3, 8, False, 0))

_COMPILE_FOR_SM90 = """
import json, os, pathlib, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moekit.ops.kernels.quantize_hopper import quantize_slots_tma_kernel as K
from moekit.ops.runtime.configs import QUANTIZE_SLOTS_TMA

out = {}
# fp8_block's forms' entries with TMA boxes and gathered (cp.async copies), whether its gathered form is
# configured or not; mxfp8's (M, X) form (TMA boxes only), its entry or the trial one where it has none.
table = {**{(32, "rows"): MX_TRIAL}, **QUANTIZE_SLOTS_TMA["sm90"]}
plain = [(key, e) for key, e in table.items() if not key[1].endswith("-gathered")]
PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
cases = [(k, g, e) for k, e in plain for g in ((0, 1) if k[0] == 128 else (0,))]
for (block, form), gather, (chunk, warps, stages, per_sm, slots_fastest, maxnreg) in cases:
    mx = block == 32
    for rowwise in (False, True) if form == "rows" else (form == "segments",):
        const = dict(ROWWISE=rowwise, SEGMENTS=form.startswith("segments"), CHUNK=chunk, STAGES=stages,
                     SLOTS_FASTEST=slots_fastest, HAS_NOOP=True, HW_E4M3=True, GATHER=bool(gather), MX=mx)
        scales = "*u8" if mx else "*fp32"
        ptr = {"x_ptr": "*bf16", "index_ptr": "*i32", "rec_ptr": "*i32", "noop_ptr": "*fp32",
               "row_data_ptr": "*u8", "row_scale_ptr": scales, "col_data_ptr": "*u8", "col_scale_ptr": scales}
        sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in K.arg_names}
        # What Triton specializes at launch for a 16-byte aligned x of 16 | X columns.
        div16 = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(K.arg_names)
                 if n.endswith("_ptr") or n in ("rows", "cols", "stride_x", "pitch")}
        src = GluonASTSource(fn=K, signature=sig, attrs=div16,
                             constexprs={(K.arg_names.index(k),): v for k, v in const.items()})
        options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = compiled.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp) / "k.ptx"
            path.write_text(ptx)
            report = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(path), "-o", os.devnull],
                                    capture_output=True, text=True, check=True).stderr
        regs = int(re.search(r"Used (\\d+) registers", report).group(1))
        stores = sorted(set(re.findall(r"st\\.global[\\w.]*", ptx)))
        # cp.async's copy size and source size operands (the source size zero-fills masked copies).
        copy = r"cp\\.async\\.c[ag]\\.shared\\.global \\[[^]]*\\], \\[[^]]*\\], (0x[0-9a-f]+), %r"
        copies = sorted(set(re.findall(copy, ptx)))
        tma = len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx))
        out[f"{block}-{form}-{rowwise}-{bool(gather)}"] = dict(shared=compiled.metadata.shared, per_sm=per_sm,
                                                          stores=stores, copies=copies, tma=tma, regs=regs,
                                                          warps=warps)
print(json.dumps(out))
"""


def test_compiles_for_sm90_with_16_byte_stores():
    """Every configured form of fp8_block (the (M, X) layout with and without the rowwise form), and
    each one's gathered form (GATHER: rows copied by cp.async), and mxfp8's (M, X) form (its entry, or
    `MX_TRIAL` where it has none): the data leave by 16-byte stores (fp8_block's scales by 4-byte
    ones, mxfp8's E8M0 bytes by byte stores), and the configured programs an SM fit its shared memory
    and its registers (ptxas -v, under the entry's MAXNREG); the TMA form loads by TMA only, the
    gathered form by 16-byte cp.async copies with a source size (zero-filled where masked) only."""
    got = compile_in_subprocess("MX_TRIAL = " + repr(MX_TRIAL) + "\n" + _COMPILE_FOR_SM90)
    block = [key for key in configs.QUANTIZE_SLOTS_TMA["sm90"] if key[0] == 128 and not key[1].endswith("-gathered")]
    assert len(got) == 2 * (len(block) + 1) + 2
    for case, info in got.items():
        scales = {"st.global.b8"} if case.startswith("32-") else {"st.global.b32"}
        assert set(info["stores"]) <= scales | {"st.global.v4.b32"}, (case, info["stores"])
        assert "st.global.v4.b32" in info["stores"], case
        assert info["shared"] * info["per_sm"] <= 227 * 1024, (case, info["shared"])
        # The persistent launch's programs an SM fit the register file (65536 registers, allocated 8 a
        # thread at a time): a program that does not fit would wait for a whole one to finish.
        assert -(-info["regs"] // 8) * 8 * 32 * info["warps"] * info["per_sm"] <= 65536, (case, info["regs"])
        if case.endswith("-True"):
            assert info["copies"] == ["0x10"] and info["tma"] == 0, (case, info)
        else:
            assert info["copies"] == [] and info["tma"] > 0, (case, info)


def records_by_rule(m_splits: list[int], M: int, segments: bool) -> list[list[int]]:
    """`slot_records_kernel`'s table by its docstring: slot s of group g (the padding rows' slots and
    the unused ones after them: g = N) -> (r0, n, live, seg0)."""
    N = len(m_splits)
    offs = [0]
    for m in m_splits:
        offs.append(offs[-1] + m)
    firsts = [0]
    for m in m_splits:
        firsts.append(firsts[-1] + -(-m // 128))
    seg = [0]
    for m in m_splits:
        seg.append(seg[-1] + -(-m // SEGMENT_COLUMNS) * SEGMENT_COLUMNS)
    table = []
    for s in range(-(-M // 128) + N):
        g = sum(first <= s for first in firsts[1:])
        j0 = (s - firsts[g]) * 128
        end = offs[g + 1] if g < N else M
        table.append([offs[g] + j0, end - offs[g] - j0, int(g < N), seg[g] + j0 if segments else 0])
    return table


@pytest.mark.parametrize("segments", [False, True], ids=["rows", "segments"])
@pytest.mark.parametrize(
    "m_splits, M",
    [
        pytest.param([0, 700, 512, 0, 900, 333, 1100, 0], 4096, id="skewed-empty-padding"),
        pytest.param([1, 129, 0, 3000, 127, 1], 3300, id="one-row-odd-slots"),
        pytest.param([0, 0, 0], 300, id="all-padding"),
        pytest.param([257] * 20, 5140, id="20-groups"),
    ],
)
def test_slot_records_follow_the_rule(m_splits, M, segments):
    """The table the Gluon kernel reads its slots' rows from (run under the interpreter on CPU): every
    slot's first row, rows left in its group, whether the group is real, and its segment start, from
    the device offsets and slot offsets (int64, as `group_quantize` makes them); entries past the table
    poisoned and untouched."""
    num_slots = -(-M // 128) + len(m_splits)
    splits = torch.tensor(m_splits, dtype=torch.int64)
    offs = torch.cat([splits.new_zeros(1), splits.cumsum(0)])
    slot_offs = torch.cat([splits.new_zeros(1), ((splits + 127) // 128).cumsum(0)])
    block_s, warps = configs.SLOT_RECORDS["interpreter"]
    table = torch.full((num_slots + 3, 4), -7, dtype=torch.int32)
    grid = (-(-num_slots // block_s),)
    slot_records_kernel[grid](
        offs,
        slot_offs,
        table,
        M,
        len(m_splits),
        num_slots,
        SLOT_ROWS=128,
        SEGMENTS=segments,
        BLOCK_S=block_s,
        BLOCK_GROUPS=64,
        num_warps=warps,
    )
    assert table[:num_slots].tolist() == records_by_rule(m_splits, M, segments)
    assert (table[num_slots:] == -7).all()


FORMS = {"rows": (True, False), "segments": (True, True), "segments-columnwise": (False, True)}


@pytest.mark.parametrize("form", list(FORMS))
def test_which_problems_the_kernel_takes(form):
    """The runtime gives the Gluon kernel exactly fp8_block's columnwise form, and mxfp8's (M, X) form
    of rows read in place, of 2-D bf16/fp16 rows that TMA can read, on an architecture whose table has
    the recipe's block and the form (sm90); every other problem keeps the Triton slots kernel. Checked
    on CPU tensors: the choice reads shapes, strides, dtypes and addresses."""
    rowwise, segments = FORMS[form]
    block = recipe_named("fp8_block")

    def entry(x, recipe=block, arch="sm90"):
        return quantize_runtime.hopper_slots_entry(recipe, x, arch, rowwise, segments)

    x = torch.zeros(300, 256, dtype=torch.bfloat16)
    assert entry(x) == configs.QUANTIZE_SLOTS_TMA["sm90"][(128, form)]
    assert entry(x.half()) == configs.QUANTIZE_SLOTS_TMA["sm90"][(128, form)]
    assert entry(torch.zeros(3, 72, dtype=torch.bfloat16)) is not None  # 144-byte rows, a partial strip
    # mxfp8: the (M, X) form only, and only where the table has its entry.
    mx = recipe_named("mxfp8")
    assert entry(x, mx) == configs.QUANTIZE_SLOTS_TMA["sm90"].get((32, form))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(configs.QUANTIZE_SLOTS_TMA, "sm90", {**configs.QUANTIZE_SLOTS_TMA["sm90"], (32, form): MX_TRIAL})
        assert entry(x, mx) == (MX_TRIAL if form == "rows" else None)
        assert quantize_runtime.hopper_slots_entry(mx, x, "sm90", rowwise, segments, gather=True) is None
    refused = {
        "fp8_rowwise": entry(x, recipe_named("fp8_rowwise")),
        "sm80": entry(x, arch="sm80"),
        "interpreter": entry(x, arch="interpreter"),
        "fp32": entry(x.float()),
        "weight": entry(torch.zeros(4, 128, 256, dtype=torch.bfloat16)),
        "70 columns (140-byte rows)": entry(torch.zeros(300, 70, dtype=torch.bfloat16)),
        "base 2 bytes past 16": entry(torch.zeros(300 * 256 + 1, dtype=torch.bfloat16)[1:].view(300, 256)),
        "column stride 2": entry(torch.zeros(300, 512, dtype=torch.bfloat16)[:, ::2]),
        "no rows": entry(torch.zeros(0, 256, dtype=torch.bfloat16)),
    }
    assert {k: v for k, v in refused.items() if v is not None} == {}
    # Rows gathered by an index: the form's "-gathered" entry (cp.async copies), absent until configured.
    gathered = quantize_runtime.hopper_slots_entry(block, x, "sm90", rowwise, segments, gather=True)
    assert gathered == configs.QUANTIZE_SLOTS_TMA["sm90"].get((128, form + "-gathered"))
    # Gathered rows of 2888 columns (16-byte rows, a column count not a multiple of 16): never the GATHER
    # form, configured or not (its masked cp.async would not compile), while the TMA form takes them.
    odd = torch.zeros(300, 2888, dtype=torch.bfloat16)
    configured = {(128, form + "-gathered"): configs.QUANTIZE_SLOTS_TMA["sm90"][(128, form)]}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(configs.QUANTIZE_SLOTS_TMA, "sm90", {**configs.QUANTIZE_SLOTS_TMA["sm90"], **configured})
        assert quantize_runtime.hopper_slots_entry(block, x, "sm90", rowwise, segments, gather=True) is not None
        assert quantize_runtime.hopper_slots_entry(block, odd, "sm90", rowwise, segments, gather=True) is None
        assert entry(odd) is not None


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU"
)

# (m_splits, M, X): skewed with empty groups first / middle / last and padding rows; one-row and
# 129-row groups (a slot of one row, a slot past a block); DeepSeek-V3's width; a width that is not a
# multiple of 128 (a partial last strip; 16-byte rows); many groups.
SHAPES = [
    pytest.param([0, 700, 512, 0, 900, 333, 1100, 0], 4096, 1024, id="skewed-empty-padding"),
    pytest.param([1, 129, 0, 3000, 127, 1], 3300, 7168, id="one-row-odd-slots-H7168"),
    pytest.param([5000, 3, 2800], 8192, 2888, id="partial-strip-X2888"),
    pytest.param([257] * 64, 16448, 768, id="64-groups"),
    pytest.param([0, 0, 0], 300, 256, id="nothing-routed-all-padding"),
    pytest.param([1], 1, 128, id="one-row"),
]


def rows_with_specials(M: int, X: int, used: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows and columns of different magnitudes, a zero row, a tiny row, a huge row, an inf and a NaN
    (where there are 26 rows), a -inf in the last real row but one (where there are 131: in the last
    group's last slot, whose segment tail must stay zeros under a NaN column scale); padding rows NaN
    (read as zeros)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, X, device="cuda", generator=gen) * torch.logspace(-2, 1, X, device="cuda")
    if M >= 26:
        x[3] *= 1000.0
        x[4] = 0.0
        x[5] *= 1e-30
        x[20, 5] = float("inf")
        x[25, 7] = float("nan")
    if used > 130:
        x[used - 2, 9] = float("-inf")
    x[used:] = float("nan")
    return x.to(dtype)


def storage_bytes(obj, m_splits: list[int]) -> list[torch.Tensor]:
    """Every output tensor of a GroupedTensor, or of SegmentedColumns the columns in use (the segments,
    each rounded up to SEGMENT_COLUMNS; the columns past them are unspecified), as bytes on the CPU."""
    if isinstance(obj, moekit.GroupedTensor):
        tensors = [t for t in obj.storage()[2:6] if t is not None]
    else:
        in_use = sum(-(-n // SEGMENT_COLUMNS) * SEGMENT_COLUMNS for n in m_splits)
        tensors = [obj.data[:, :in_use], obj.scale_inv]
    return [t.view(torch.uint8).cpu() if t.element_size() == 1 else t.view(torch.int32).cpu() for t in tensors]


def kernels_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "quantize_slots" in e.name}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m_splits, M, X", SHAPES)
def test_bytes_equal_the_triton_slots_kernel(m_splits, M, X, dtype, monkeypatch):
    x = rows_with_specials(M, X, sum(m_splits), dtype, seed=M + X)
    offs = torch.tensor(m_splits, device="cuda")
    cases = {
        "rows": lambda: [moekit.group_quantize(x, offs, "fp8_block", columnwise=True, backend="triton")],
        "rows-columnwise-alone": lambda: [
            moekit.group_quantize(x, offs, "fp8_block", rowwise=False, columnwise=True, backend="triton")
        ],
        "segments": lambda: [
            t for t in group_quantize_for_wgrad(x, offs, "fp8_block", rowwise=True, backend="triton") if t is not None
        ],
        "segments-columnwise-alone": lambda: [
            t for t in group_quantize_for_wgrad(x, offs, "fp8_block", backend="triton") if t is not None
        ],
    }
    forget_plans()
    torch.cuda.empty_cache()
    got = {}
    for name, run in cases.items():
        # Fresh allocations are uninitialised; poison the caching allocator's blocks first.
        torch.full((64 << 20,), -1, dtype=torch.int32, device="cuda")
        assert kernels_run(run) == {"quantize_slots_tma_kernel"}, name
        got[name] = [b for out in run() for b in storage_bytes(out, m_splits)]
    monkeypatch.setitem(configs.QUANTIZE_SLOTS_TMA, "sm90", {})
    forget_plans()
    try:
        for name, run in cases.items():
            assert kernels_run(run) == {"quantize_slots_kernel"}, name
            want = [b for out in run() for b in storage_bytes(out, m_splits)]
            assert len(want) == len(got[name]), name
            for i, (a, b) in enumerate(zip(got[name], want, strict=True)):
                assert a.shape == b.shape and torch.equal(a, b), f"{name} output {i}: {(a != b).sum()} differ"
    finally:
        forget_plans()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m_splits, M, X", SHAPES)
def test_mxfp8_bytes_equal_the_triton_slots_kernel(m_splits, M, X, dtype, monkeypatch):
    """mxfp8's rowwise + columnwise and columnwise-alone (M, X) forms (32-row slots, 1 x 32 row blocks,
    E8M0 scales) by the Gluon kernel under its entry (`MX_TRIAL` where the table has none): every byte
    the Triton slots kernel's, at the same shapes and specials as fp8_block's; outputs NaN-poisoned."""
    x = rows_with_specials(M, X, sum(m_splits), dtype, seed=M + X + 2)
    offs = torch.tensor(m_splits, device="cuda")
    cases = {
        "rows": lambda: moekit.group_quantize(x, offs, "mxfp8", columnwise=True, backend="triton"),
        "rows-columnwise-alone": lambda: moekit.group_quantize(
            x, offs, "mxfp8", rowwise=False, columnwise=True, backend="triton"
        ),
    }
    table = {**configs.QUANTIZE_SLOTS_TMA["sm90"], (32, "rows"): MX_TRIAL}
    monkeypatch.setitem(configs.QUANTIZE_SLOTS_TMA, "sm90", table)
    forget_plans()
    got = {}
    for name, run in cases.items():
        torch.full((64 << 20,), -1, dtype=torch.int32, device="cuda")
        assert kernels_run(run) == {"quantize_slots_tma_kernel"}, name
        got[name] = storage_bytes(run(), m_splits)
    monkeypatch.setitem(configs.QUANTIZE_SLOTS_TMA, "sm90", {})
    forget_plans()
    try:
        for name, run in cases.items():
            assert kernels_run(run) == {"quantize_slots_kernel"}, name
            want = storage_bytes(run(), m_splits)
            assert len(want) == len(got[name]), name
            for i, (a, b) in enumerate(zip(got[name], want, strict=True)):
                assert a.shape == b.shape and torch.equal(a, b), f"{name} output {i}: {(a != b).sum()} differ"
    finally:
        forget_plans()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m_splits, M, X", SHAPES)
def test_gathered_bytes_equal_the_triton_slots_kernel(m_splits, M, X, monkeypatch):
    """The gathered form (GATHER: rows x[index] copied by cp.async), enabled here by "-gathered" entries
    equal to the TMA form's: the bytes of the Triton slots kernel on the same index and of the TMA form
    on the gathered tensor, for the segments with both forms and the columnwise form alone. Columns not
    a multiple of 16 (X 2888) are not the GATHER form's (`hopper_slots_entry`): the Triton kernel runs."""
    tokens = max(M // 3, 1) + 2
    x = rows_with_specials(tokens, X, tokens, torch.bfloat16, seed=M + X + 1)
    gen = torch.Generator(device="cuda").manual_seed(M)
    index = torch.randint(0, tokens, (M,), device="cuda", generator=gen, dtype=torch.int32)
    offs = torch.tensor(m_splits, device="cuda")
    table = dict(configs.QUANTIZE_SLOTS_TMA["sm90"])
    table.update({(128, f"{form}-gathered"): table[(128, form)] for form in ("segments", "segments-columnwise")})
    monkeypatch.setitem(configs.QUANTIZE_SLOTS_TMA, "sm90", table)

    def run(rows, idx, rowwise):
        outs = group_quantize_for_wgrad(rows, offs, "fp8_block", rowwise=rowwise, index=idx, backend="triton")
        return [b for out in outs if out is not None for b in storage_bytes(out, m_splits)]

    for rowwise in (True, False):
        forget_plans()
        torch.full((64 << 20,), -1, dtype=torch.int32, device="cuda")
        gathered_kernel = "quantize_slots_tma_kernel" if X % 16 == 0 else "quantize_slots_kernel"
        assert kernels_run(lambda r=rowwise: run(x, index, r)) == {gathered_kernel}
        got = run(x, index, rowwise)
        want = run(x.index_select(0, index), None, rowwise)  # the TMA form on the gathered rows
        monkeypatch.setitem(configs.QUANTIZE_SLOTS_TMA, "sm90", {})
        forget_plans()
        try:
            assert kernels_run(lambda r=rowwise: run(x, index, r)) == {"quantize_slots_kernel"}
            triton_bytes = run(x, index, rowwise)
        finally:
            monkeypatch.setitem(configs.QUANTIZE_SLOTS_TMA, "sm90", table)
            forget_plans()
        for i, (a, b, c) in enumerate(zip(got, want, triton_bytes, strict=True)):
            assert torch.equal(a, b), f"rowwise={rowwise} output {i}: {(a != b).sum()} differ from the TMA form"
            assert torch.equal(a, c), f"rowwise={rowwise} output {i}: {(a != c).sum()} differ from the Triton kernel"


def same(a, b, m_splits: list[int]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(storage_bytes(a, m_splits), storage_bytes(b, m_splits), strict=True))


@pytest.mark.gpu
@needs_hopper
def test_out_and_noop_flag_and_no_host_sync():
    """out= into NaN-poisoned storage writes the allocating call's bytes; the noop flag at 1.0 leaves
    out byte-identical; neither syncs with the host."""
    m_splits = [0, 700, 512, 0, 900, 333, 1100, 0]
    x = rows_with_specials(4096, 2048, sum(m_splits), torch.bfloat16, seed=7)
    offs = torch.tensor(m_splits, device="cuda")
    forget_plans()
    want = moekit.group_quantize(x, offs, "fp8_block", columnwise=True, backend="triton")
    out = moekit.group_quantize(x, offs, "fp8_block", columnwise=True, backend="triton")
    for t in out.storage()[2:6]:
        t.view(torch.uint8).fill_(0xFF)
    noop = torch.zeros((), device="cuda")
    assert_no_host_sync(
        lambda: moekit.group_quantize(x, offs, "fp8_block", columnwise=True, out=out, noop_flag=noop, backend="triton")
    )
    assert [
        torch.equal(a, b) for a, b in zip(storage_bytes(out, m_splits), storage_bytes(want, m_splits), strict=True)
    ] == [True] * 4
    noop.fill_(1.0)
    moekit.group_quantize(x * 2, offs, "fp8_block", columnwise=True, out=out, noop_flag=noop, backend="triton")
    assert [
        torch.equal(a, b) for a, b in zip(storage_bytes(out, m_splits), storage_bytes(want, m_splits), strict=True)
    ] == [True] * 4
