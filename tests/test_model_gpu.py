"""The same forward pass on CuPy (float16) as on numpy (float32). Skipped where CuPy cannot run."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import tiny_model
from pyplugin.runtime import Generation, ResidentLayers
from pyplugin.runtime.options import Options
from pyplugin.store import backend_named
from pyplugin.xp import array_module, cupy_usable

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cupy_usable(), reason="CuPy with a usable GPU is not available")]

PROMPT = [3, 17, 42, 99, 7, 150, 8, 61, 5]


def _logits(model, kernels, num_batch=512):
    gen = Generation(model, Options(num_ctx=64, num_batch=num_batch), layers=ResidentLayers(model, 64, kernels))
    first = gen.prefill(PROMPT)
    return [first] + [gen.decode_one(t) for t in (11, 12, 13)]


@pytest.mark.parametrize("arch,spec", [("llama", {}), ("qwen2", {}), ("phi3", {}),
                                       ("llama", {"weight_type": "Q4_K", "tied_output": True})])
def test_cupy_float16_matches_numpy_float32(arch, spec):
    model = tiny_model(arch, **spec)
    cuda = backend_named("cuda")
    for host, device in zip(_logits(model, cuda.host_kernels), _logits(model, cuda.kernels, num_batch=4)):
        assert isinstance(device, np.ndarray) and device.dtype == np.float32
        np.testing.assert_allclose(device, host, rtol=0, atol=0.02 * np.abs(host).max())


def test_cupy_weights_and_cache_live_on_the_device():
    cupy = array_module("cupy")
    model = tiny_model("llama")
    gen = Generation(model, Options(num_ctx=32), layers=ResidentLayers(model, 32, backend_named("cuda").kernels))
    lw = gen.layers.layer(0)[0]
    assert isinstance(lw.wq, cupy.ndarray) and lw.wq.dtype == np.float16
    assert isinstance(gen.layers.kv.k[0], cupy.ndarray) and gen.layers.kv.k[0].dtype == np.float16
    assert isinstance(gen.outer.token_embd, np.ndarray)   # rows are gathered on the host

