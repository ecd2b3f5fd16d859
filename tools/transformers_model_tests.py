"""Run transformers' own model tests of the MoE families moekit supports three ways and compare outcomes.

Needs a transformers source tree whose `tests/` matches the installed transformers (moekit ships none
of it): `tests/test_modeling_common.py` and the other mixins, `tests/causal_lm_tester.py`,
`tests/generation/`, `tests/exporters/`, `tests/utils/`, `tests/pipelines/`, `tests/models/<family>/`,
the root `conftest.py` and `pyproject.toml`, `utils/test_module/`, `utils/fetch_hub_objects_for_ci.py`,
and `src/transformers` being the installed package (the pipeline tests import it by path). Each way runs
each family's `tests/models/<family>/test_modeling_<family>.py` in its own pytest process (one torch
thread, HF_HUB_OFFLINE=1), with this file as a pytest plugin (`-p transformers_model_tests`) that sets
the way up before any model is built:

    eager   every model whose experts implementation nobody asked for gets transformers' "eager"
            experts (transformers' own default would be "grouped_mm"): the reference outcomes
    apply   as eager, and every model with experts moekit supports goes through
            `moekit.integrations.transformers.apply_moekit` at the end of its construction
            (`PreTrainedModel.post_init`, so inside `from_pretrained` too)
    moekit  every model whose experts implementation nobody asked for gets `experts_implementation="moekit"`
    default transformers unchanged ("grouped_mm"), for reference

An implementation a test asks for by name is kept in every way (`apply` converts such a model too, as a
`post_init` plugin would; `set_experts_implementation` afterwards takes effect). The plugin counts the
calls of moekit's experts op, so a run also says that moekit ran. In the apply and moekit ways it also
holds moekit to transformers' tolerance against eager (the comment above `EXPERTS_RTOL`), after
transformers' test_eager_matches_batched_and_grouped_inference, which compares eager with its own
batched_mm and grouped_mm only; the result is recorded beside the test and never changes its outcome
(`--no-check` leaves it out).

    python tools/transformers_model_tests.py run --tree /path/to/transformers --out /tmp/hf_runs \\
        --families qwen3_moe mixtral gpt_oss --ways eager apply moekit --timeout 900
    python tools/transformers_model_tests.py compare --out /tmp/hf_runs [--checks]

`run` writes `<out>/<family>_<way>.xml` (junit), `.log` and `.json` (moekit's call counts and the
check records); `compare` prints each family's passed/failed/error/skipped counts per way (distinct
test ids), every test whose outcome differs from the eager run's with the first lines of its failure,
and every failed check (`--checks`: every check). Optional modules the tests import at module level
but this environment lacks (`datasets`, used only by pipeline tests that download Hub data) are
replaced by stubs that raise when used. `-k` passes a selection expression to pytest.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

WAYS = ("eager", "apply", "moekit", "default")
FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe", "qwen2_moe", "deepseek_v3")
WAY_ENV = "MOEKIT_HF_WAY"
STATS_ENV = "MOEKIT_HF_STATS"
TOLERANCE_ENV = "MOEKIT_HF_TOLERANCE_CHECK"
TOLERANCE_TEST = "_test_eager_matches_batched_and_grouped_inference"
# Modules the test files import at module level that an environment may lack; each stub raises when used.
OPTIONAL_MODULES = {"datasets": ("Audio", "Dataset", "load_dataset")}

# --------------------------------------------------------------------------------------------------
# pytest plugin (loaded in each test process with -p transformers_model_tests)
# --------------------------------------------------------------------------------------------------

_calls = collections.Counter()


def _install_way(way: str) -> None:
    import torch
    from transformers.modeling_utils import PreTrainedModel

    import moekit.integrations.transformers as hf

    default = {"eager": "eager", "apply": "eager", "moekit": hf.EXPERTS_IMPLEMENTATION, "default": None}[way]
    if default is not None:
        correct = PreTrainedModel.get_correct_experts_implementation

        def get_correct_experts_implementation(self, requested):
            return correct(self, default if requested is None else requested)

        PreTrainedModel.get_correct_experts_implementation = get_correct_experts_implementation

    if way == "apply":
        post_init = PreTrainedModel.post_init

        def post_init_applying_moekit(self):
            post_init(self)
            found, applied, _ = hf._find_experts(self)
            if found or applied:
                hf.apply_moekit(self)
                _calls["apply_moekit"] += 1

        PreTrainedModel.post_init = post_init_applying_moekit

    for name in ("moe_experts", "run_experts"):
        inner = getattr(hf, name)

        def counting(*args, _inner=inner, _name=name, **kwargs):
            if not torch.compiler.is_compiling():  # a traced counter would be a guard: recompiles
                _calls[_name] += 1
            return _inner(*args, **kwargs)

        setattr(hf, name, counting)


# moekit against eager, after transformers' own test_eager_matches_batched_and_grouped_inference (which compares
# eager with its batched_mm and grouped_mm at rtol = atol = 1e-4 in fp32, fp16 and bf16, not with moekit), with the
# same recipe: seed 42, the norms' eps 1, the model cast to the dtype. Recorded beside the test, never changing its
# outcome. Two comparisons:
# - the model outputs, at the test's rtol = atol = 1e-4; where that fails, the errors of eager and moekit against
#   the same model run in float64 are recorded too;
# - each experts module's output, on the inputs eager's got, scale-relative: |moekit - eager| <= r * (|eager| + s),
#   s = max |eager|, or the dtype's smallest normal number where all are below it. The model outputs hide the
#   experts at the testers' initialisation (std 0.02, norms' eps 1: experts outputs near 1e-7, so experts 2x off
#   stay within 1e-4 of the logits); r = 1e-4 (the test's tolerance) in float32, 8 units in the last place in
#   float16 / bfloat16, where eager itself rounds every product to 16 bits (float16 holds these outputs as
#   subnormals, in steps of 6e-8: there r * s is 8 such steps).
EXPERTS_RTOL = {"fp32": 1e-4, "fp16": 8 * 2.0**-10, "bf16": 8 * 2.0**-7}
_checks: list[dict] = []


def _moekit_against_eager(module, test, dtype_name: str) -> list[dict]:
    """One record per model class of the tester (see the comment above)."""
    import copy

    import torch
    from transformers import set_seed
    from transformers.testing_utils import set_config_for_less_flaky_test, set_model_for_less_flaky_test, torch_device

    import moekit.integrations.transformers as hf

    def max_diff(a, b):
        return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    records = []
    for model_class in test.all_model_classes:
        record = {"test": test.id().rsplit(".", 2)[-2:], "class": model_class.__name__, "dtype": dtype_name}
        set_seed(42)
        config, inputs_dict = test.model_tester.prepare_config_and_inputs_for_common()
        set_config_for_less_flaky_test(config)
        model = model_class(config).eval().to(torch_device).to(dtype)
        set_model_for_less_flaky_test(model)
        inputs_dict = {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in inputs_dict.items()}
        prepared = test._prepare_for_class(inputs_dict, model_class)
        found, applied, _ = hf._find_experts(model)
        seen = []  # (experts module, args, kwargs, eager output)
        hooks = [
            m.register_forward_hook(lambda m, a, k, o, seen=seen: seen.append((m, a, k, o)), with_kwargs=True)
            for m in found + applied
        ]
        outputs, ran = {}, {}
        for impl in ("eager", hf.EXPERTS_IMPLEMENTATION):
            model.set_experts_implementation(impl)
            before = _calls["moe_experts"] + _calls["run_experts"]
            with torch.no_grad():
                outputs[impl] = module._get_output_tensors(model(**prepared))
            ran[impl] = _calls["moe_experts"] + _calls["run_experts"] > before
            for hook in hooks if impl == "eager" else ():
                hook.remove()
        eager, ours = outputs["eager"], outputs[hf.EXPERTS_IMPLEMENTATION]
        record["moekit_ran"] = ran[hf.EXPERTS_IMPLEMENTATION] and not ran["eager"]
        record["model_max_diff"] = max_diff(eager, ours)
        record["model_ok"] = all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(eager, ours, strict=True))
        if not record["model_ok"]:
            ref = copy.deepcopy(model).double()
            ref.set_experts_implementation("eager")
            with torch.no_grad():
                exact = module._get_output_tensors(
                    ref(**{k: v.double() if torch.is_floating_point(v) else v for k, v in prepared.items()})
                )
            record["eager_err_fp64"], record["moekit_err_fp64"] = max_diff(eager, exact), max_diff(ours, exact)
        rtol, worst = EXPERTS_RTOL[dtype_name], 0.0
        for experts, args, kwargs, want in seen:
            with torch.no_grad():
                got = experts(*args, **kwargs).double()
            want = want.double()
            scale = max(want.abs().max().item(), torch.finfo(dtype).tiny)
            worst = max(worst, ((got - want).abs() / (want.abs() + scale)).max().item() / rtol)
        record["experts_calls"], record["experts_worst"] = len(seen), worst
        record["experts_ok"] = bool(seen) and worst <= 1.0
        records.append(record)
    return records


def _add_tolerance_check(module) -> None:
    own = module.__dict__[TOLERANCE_TEST]
    if getattr(own, "moekit_checked", False):
        return

    def with_moekit(test, name, dtype):
        own(test, name, dtype)  # transformers' test, its outcome as it is
        try:
            _checks.extend(_moekit_against_eager(module, test, dtype))
        except Exception as exc:  # recorded, not raised: the test's outcome stays transformers'
            _checks.append({"test": test.id().rsplit(".", 2)[-2:], "dtype": dtype, "error": repr(exc)[:500]})

    with_moekit.moekit_checked = True
    setattr(module, TOLERANCE_TEST, with_moekit)


def pytest_configure(config):
    way = os.environ.get(WAY_ENV)
    if way is None:
        return
    if way not in WAYS:
        raise ValueError(f"{WAY_ENV}={way!r}; expected one of {WAYS}")
    _install_way(way)


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get(WAY_ENV) in ("apply", "moekit") and os.environ.get(TOLERANCE_ENV, "1") == "1":
        for module in list(sys.modules.values()):
            own = getattr(module, "__dict__", {}).get(TOLERANCE_TEST)  # no lazy module's __getattr__
            if callable(own) and own.__module__ == module.__name__:
                _add_tolerance_check(module)


def pytest_report_header(config):
    import transformers

    return f"moekit way: {os.environ.get(WAY_ENV)}; transformers {transformers.__version__}"


def pytest_unconfigure(config):
    path = os.environ.get(STATS_ENV)
    if path and not hasattr(config, "workerinput"):  # the controller; xdist workers add theirs below
        Path(path).write_text(json.dumps({"calls": dict(_calls), "checks": _checks}))


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(STATS_ENV)
    if path and hasattr(session.config, "workerinput"):
        worker = Path(f"{path}.{session.config.workerinput['workerid']}")
        worker.write_text(json.dumps({"calls": dict(_calls), "checks": _checks}))


# --------------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------------


def _stub_dir(out: Path) -> Path | None:
    missing = {m: names for m, names in OPTIONAL_MODULES.items() if importlib.util.find_spec(m) is None}
    if not missing:
        return None
    stubs = out / "_stubs"
    for module, names in missing.items():
        (stubs / module).mkdir(parents=True, exist_ok=True)
        body = [f'"""Stub: {module} is not installed here; anything used from it raises."""', ""]
        body += ["def __getattr__(name):", f"    raise ImportError(f'{module} is not installed (stub): {{name}}')", ""]
        body += [
            f"def {n}(*args, **kwargs):\n    raise ImportError('{module} is not installed (stub)')\n" for n in names
        ]
        (stubs / module / "__init__.py").write_text("\n".join(body))
        print(f"stub for missing module {module!r} in {stubs}")
    return stubs


def run(args) -> int:
    tree, out = args.tree.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stubs = _stub_dir(out)
    here = Path(__file__).resolve().parent
    src = here.parent / "src"
    paths = [str(here), str(src), str(tree), *([str(stubs)] if stubs else []), *args.pythonpath]
    status = 0
    for family in args.families:
        test_file = tree / "tests" / "models" / family / f"test_modeling_{family}.py"
        if not test_file.exists():
            raise FileNotFoundError(test_file)
        for way in args.ways:
            stem = out / f"{family}_{way}"
            for stale in out.glob(f"{family}_{way}.json*"):
                stale.unlink()
            env = {
                **os.environ,
                WAY_ENV: way,
                STATS_ENV: f"{stem}.json",
                "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
                "OMP_NUM_THREADS": str(args.threads),
                "HF_HUB_OFFLINE": "1",
                TOLERANCE_ENV: "0" if args.no_check else "1",
            }
            cmd = [sys.executable, "-m", "pytest", "-p", "transformers_model_tests", str(test_file)]
            cmd += ["-p", "no:cacheprovider", "-q", "-o", "log_cli=false", f"--junitxml={stem}.xml"]
            cmd += ["-n", str(args.workers)] if args.workers else []
            cmd += ["-k", args.k] if args.k else []
            start = time.monotonic()
            with open(f"{stem}.log", "w") as log:
                try:
                    rc = subprocess.run(
                        cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
                    )
                    code = rc.returncode
                except subprocess.TimeoutExpired:
                    code = "timeout"
            last = Path(f"{stem}.log").read_text().strip().splitlines()[-1:] or [""]
            print(f"{family} {way}: exit {code} in {time.monotonic() - start:.0f}s: {last[0]}", flush=True)
            status = status or (code == "timeout")
    return int(status)


# --------------------------------------------------------------------------------------------------
# compare
# --------------------------------------------------------------------------------------------------

_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def outcomes(xml_path: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, its failure, error or skip message) from a junit file; a test reported more
    than once (subtests, a teardown error) keeps its worst outcome."""
    result: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml_path).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "").strip()
        if name not in result or _RANK[outcome] > _RANK[result[name][0]]:
            result[name] = (outcome, message)
    return result


def stats(stem: Path) -> tuple[dict[str, int], list[dict]]:
    """moekit's call counts and the moekit-vs-eager check records of one run (summed over xdist workers)."""
    calls, checks = collections.Counter(), []
    for path in sorted(stem.parent.glob(f"{stem.name}.json*")):
        data = json.loads(path.read_text())
        calls.update(data["calls"])
        checks += data["checks"]
    return dict(calls), checks


def _check_line(record: dict) -> str:
    where = f"{'::'.join(record['test'])} {record.get('class', '')} {record['dtype']}"
    if "error" in record:
        return f"{where}: the check raised {record['error']}"
    parts = [f"model outputs max |moekit - eager| {record['model_max_diff']:.2e}"]
    if not record["model_ok"]:
        errors = f"eager {record['eager_err_fp64']:.2e}, moekit {record['moekit_err_fp64']:.2e}"
        parts.append(f"> 1e-4; max error vs float64: {errors}")
    parts.append(f"experts ({record['experts_calls']} calls) at {record['experts_worst']:.2f} of their tolerance")
    if not record["moekit_ran"]:
        parts.append("moekit did not run")
    return f"{where}: " + "; ".join(parts)


def compare(args) -> int:
    out = args.out.resolve()
    runs: dict[str, dict[str, dict[str, tuple[str, str]]]] = collections.defaultdict(dict)
    for xml in sorted(out.glob("*.xml")):
        family, _, way = xml.stem.rpartition("_")
        if way in WAYS:
            runs[family][way] = outcomes(xml)
    differences = failed_checks = 0
    for family in [f for f in FAMILIES if f in runs] + sorted(set(runs) - set(FAMILIES)):
        print(f"\n## {family}\n")
        print("| way | passed | failed | error | skipped | moekit calls | moekit vs eager checks (failed) |")
        print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
        bad = []
        for way in [w for w in WAYS if w in runs[family]]:
            counts = collections.Counter(o for o, _ in runs[family][way].values())
            calls, checks = stats(out / f"{family}_{way}")
            failed = [c for c in checks if "error" in c or not (c["model_ok"] and c["experts_ok"] and c["moekit_ran"])]
            bad += [(way, c) for c in failed]
            row = " | ".join(str(counts[k]) for k in ("passed", "failed", "error", "skipped"))
            called = ", ".join(f"{k} {v}" for k, v in sorted(calls.items())) or "-"
            print(f"| {way} | {row} | {called} | {f'{len(checks)} ({len(failed)})' if checks else '-'} |")
        failed_checks += len(bad)
        for way, record in bad:
            print(f"- {way}: moekit vs eager: {_check_line(record)}")
        base = runs[family].get("eager")
        if base is None:
            continue
        for way in [w for w in WAYS if w in runs[family] and w != "eager"]:
            cand = runs[family][way]
            diff = sorted(
                n for n in set(base) | set(cand) if base.get(n, ("absent",))[0] != cand.get(n, ("absent",))[0]
            )
            differences += len(diff) if way != "default" else 0
            for name in diff:
                was, now = base.get(name, ("absent", "")), cand.get(name, ("absent", ""))
                why = (now[1] or was[1]).splitlines()[: args.lines]
                print(f"- {way}: {name}: eager {was[0]} -> {now[0]}" + "".join(f"\n    {line}" for line in why))
        if args.checks:
            for way in [w for w in WAYS if w in runs[family]]:
                for record in stats(out / f"{family}_{way}")[1]:
                    print(f"  - {way}: {_check_line(record)}")
    print(f"\n{differences} outcome(s) of apply / moekit differ from eager; {failed_checks} check(s) of moekit failed")
    return int(differences > 0 or failed_checks > 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the families' model tests each way")
    p.add_argument("--tree", type=Path, required=True, help="transformers source tree (with tests/)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--families", nargs="+", default=list(FAMILIES[:3]))
    p.add_argument("--ways", nargs="+", choices=WAYS, default=["eager", "apply", "moekit"])
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per family and way")
    p.add_argument("--workers", type=int, default=0, help="pytest-xdist workers (0: none)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the test process")
    p.add_argument("-k", help="pytest -k expression (e.g. to deselect slow tests unrelated to the experts)")
    p.add_argument("--no-check", action="store_true", help="leave out the moekit-vs-eager check")
    p.add_argument("--pythonpath", nargs="*", default=[], help="more entries for PYTHONPATH (e.g. test deps)")
    c = sub.add_parser("compare", help="compare the outcomes of each way with eager's")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--lines", type=int, default=3, help="lines of each differing test's message")
    c.add_argument("--checks", action="store_true", help="print every moekit-vs-eager check record")
    args = parser.parse_args(argv)
    return run(args) if args.command == "run" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
