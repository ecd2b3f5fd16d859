"""What an installed moekit ships besides its modules, and what installing it takes: the README's set-up
commands as CI runs them, the extras' ranges and the versions tested (constraints.txt)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest

import moekit

ROOT = Path(__file__).resolve().parent.parent


def test_py_typed_marker_is_shipped():
    """PEP 561: the marker sits in the package and pyproject.toml puts it into wheels and sdists."""
    assert (files("moekit") / "py.typed").is_file()
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["moekit"]


def test_public_surface_is_importable():
    for name in moekit.__all__:
        assert getattr(moekit, name) is not None, name
    assert callable(moekit.reference.unpermute_reference)


def test_works_without_triton():
    """Triton is an optional extra (`moekit[triton]`; the README's demo command installs none): the
    package imports and its CPU paths run with `import triton` failing, and the triton backend is
    refused with a reason instead."""
    script = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch, moekit
layer = moekit.MoELayer(16, 8, 4, 2)
x = torch.randn(5, 16, requires_grad=True)
layer(x).sum().backward()
assert x.grad is not None and torch.isfinite(x.grad).all()
try:
    moekit.grouped_linear(torch.randn(4, 16), torch.randn(2, 8, 16), [2, 2], backend="triton")
except ValueError as exc:
    assert "triton" in str(exc).lower(), exc
else:
    raise AssertionError("the triton backend ran without triton")
print("ok")
"""
    src = str(ROOT / "src")
    env = {**os.environ, "PYTHONPATH": src}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def _setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("\n## Set up") : text.index("\n## Use\n")]
    return re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)


def test_ci_runs_the_readme_test_command_with_the_constraints():
    """.ci/run runs the README's test command as written, and both set-up commands install the
    versions CI tests (constraints.txt)."""
    demo, tests = _setup_commands()
    assert "pytest" in tests and "moekit demo" in demo
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()
    for command in (demo, tests):
        assert " -c constraints.txt " in command, command


def _constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and name == name.strip(), f"not a pin: {line!r}"
            assert _canonical(name) not in pins, f"pinned twice: {name}"
            pins[_canonical(name)] = version
    return pins


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_constraints_pin_every_extra_within_its_range():
    """Every requirement of every extra is pinned in constraints.txt to a version its range allows;
    torch is chosen per machine (a CPU or a CUDA build) and pinned by the command instead."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    requirements = pytest.importorskip("packaging.requirements")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _constraints()
    assert "torch" not in pins
    assert [requirements.Requirement(r).name for r in project["dependencies"]] == ["torch"]
    checked = 0
    for extra, reqs in project["optional-dependencies"].items():
        for text in reqs:
            req = requirements.Requirement(text)
            if req.name == "moekit":
                assert req.extras <= set(project["optional-dependencies"]), (extra, text)
                continue
            assert req.specifier, f"extra {extra}: {text} has no range"
            assert _canonical(req.name) in pins, f"extra {extra}: {req.name} is not in constraints.txt"
            assert req.specifier.contains(pins[_canonical(req.name)]), (extra, text, pins[_canonical(req.name)])
            checked += 1
    assert checked > 10


def test_works_without_numpy():
    """numpy is no runtime dependency (only the `triton` and `io` extras bring it): nothing in the
    package imports it, and the layer runs forward and backward with `import numpy` failing."""
    for path in (ROOT / "src" / "moekit").rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.split(".")[0] == "numpy"], path
    script = """
import sys
sys.modules["numpy"] = None  # any `import numpy` now raises ImportError
import torch, moekit
layer = moekit.MoELayer(16, 8, 4, 2)
x = torch.randn(5, 16, requires_grad=True)
layer(x).sum().backward()
assert x.grad is not None and torch.isfinite(x.grad).all()
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_pre_commit_runs_the_ruff_ci_runs():
    """The pre-commit hooks and CI format with the same ruff (its style moves between releases)."""
    rev = re.search(r"ruff-pre-commit\n\s+rev: v([\d.]+)", (ROOT / ".pre-commit-config.yaml").read_text())
    assert rev and _constraints()["ruff"] == rev.group(1)
