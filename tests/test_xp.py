"""pyplugin.xp, the one place numpy and CuPy meet: what it sets before CuPy runs."""

from __future__ import annotations

import os

import pytest

from pyplugin.errors import PebblingError
from pyplugin.xp import CUBLAS_WORKSPACE, array_module


@pytest.mark.parametrize("preset", [None, ":4096:8"])
def test_asking_for_cupy_sets_cublas_workspace_unless_the_environment_does(monkeypatch, preset):
    """Before CuPy can make a cuBLAS handle (one a thread): no workspace, so a thread's handle costs no
    device memory that a plan measured on another thread would miss (pyplugin.xp); a value set is kept."""
    if preset is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", preset)
    try:
        array_module("cupy")
    except PebblingError:  # no CuPy or no GPU here: the setting comes first all the same
        pass
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == (preset or CUBLAS_WORKSPACE) and CUBLAS_WORKSPACE == ":0:0"
