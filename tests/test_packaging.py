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
