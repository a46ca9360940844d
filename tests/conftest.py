"""Shared fixtures. `store_backend`: the name of each store backend, one test per backend present
(the params come from helpers.store_backend_params, which test files parametrize with too)."""

from __future__ import annotations

import os
import tempfile

import pytest
from helpers import store_backend_params

# The demo model is written into pebbling's cache: a directory of this session's, never the user's
# (set here, before any test, so that the servers and commands the tests start find it too).
_CACHE = tempfile.TemporaryDirectory(prefix="pebbling-cache-tests-")
os.environ["PEBBLING_CACHE"] = _CACHE.name


@pytest.fixture(params=store_backend_params())
def store_backend(request) -> str:
    return request.param
