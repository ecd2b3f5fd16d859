"""What an installed moekit ships besides its modules."""

from __future__ import annotations

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
    import subprocess
    import sys

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
    env = {**__import__("os").environ, "PYTHONPATH": src}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
