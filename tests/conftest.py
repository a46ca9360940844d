"""Shared fixtures. `store_backend`: the name of each store backend, one test per backend present."""

from __future__ import annotations

import os

import pytest


def store_backend_params() -> list:
    """cuda, host and stub as pytest params; one that is absent here, or left out by
    PEBBLING_TEST_BACKENDS (a comma list, e.g. "host" for the sanitizer run), is skipped with the reason."""
    from pyplugin.backend import BACKENDS, probe

    listed = os.environ.get("PEBBLING_TEST_BACKENDS", "")
    wanted = {name.strip().lower() for name in listed.split(",") if name.strip()} or set(BACKENDS)
    unknown = wanted - set(BACKENDS)
    if unknown:
        raise ValueError(f"PEBBLING_TEST_BACKENDS={listed!r} names {sorted(unknown)}; valid: "
                         f"{', '.join(BACKENDS)}")
    params = []
    for name in BACKENDS:
        marks = [pytest.mark.gpu] if name == "cuda" else []
        if name not in wanted:
            marks.append(pytest.mark.skip(reason=f"left out by PEBBLING_TEST_BACKENDS={listed}"))
        else:
            found = probe(name)
            if not found.usable:
                marks.append(pytest.mark.skip(reason=f"{name} backend unavailable: {found.reason}"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture(params=store_backend_params())
def store_backend(request) -> str:
    return request.param
