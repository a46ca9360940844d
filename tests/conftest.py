"""Shared fixtures. `store_backend`: the name of each store backend, one test per backend present
(the params come from helpers.store_backend_params, which test files parametrize with too)."""

from __future__ import annotations

import pytest
from helpers import store_backend_params


@pytest.fixture(params=store_backend_params())
def store_backend(request) -> str:
    return request.param
