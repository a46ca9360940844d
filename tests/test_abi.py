"""One source for the ABI: the Python facts (pyplugin.store.abi, the status codes of pyplugin.errors,
the list of types with kernels, the dataclasses that mirror the header's structs) against native/pebble.h
as the bindings read it and against each native library built here."""

from __future__ import annotations

import re

import pytest

from helpers import store_backend_params
from pyplugin import errors
from pyplugin.ggml_types import SUPPORTED_TYPES, block
from pyplugin.store import LayerShape, StoreStats, abi, native
from pyplugin.store.kernels import DECODE_WEIGHTS
from pyplugin.store.native_kernels import NativeKernels
from pyplugin.store.stub_kernels import StubKernels

STATUS_CLASSES = {
    "PEBBLE_ERR_INVALID_ARGUMENT": errors.InvalidArgumentError, "PEBBLE_ERR_UNKNOWN_ENTRY": errors.UnknownEntryError,
    "PEBBLE_ERR_SIZE_MISMATCH": errors.SizeMismatchError, "PEBBLE_ERR_LAYER_RANGE": errors.LayerRangeError,
    "PEBBLE_ERR_TOO_LARGE": errors.TooLargeError, "PEBBLE_ERR_HOST_OOM": errors.HostOutOfMemoryError,
    "PEBBLE_ERR_DEVICE_OOM": errors.DeviceOutOfMemoryError, "PEBBLE_ERR_CUDA": errors.CudaError,
    "PEBBLE_ERR_CLOSED": errors.ClosedError, "PEBBLE_ERR_STRATEGY": errors.StrategyError,
}
NATIVE = [p for p in store_backend_params() if p.values[0] != "stub"]


def header_constants() -> set[str]:
    """Every integer constant pebble.h defines: enum members and #defines."""
    text = native.HEADER.read_text()
    return (set(re.findall(r"^\s*(PEBBLE_[A-Z0-9_]+)\s*=", text, re.M))
            | set(re.findall(r"^#define\s+(PEBBLE_[A-Z0-9_]+)\s+\(?-?\d+\)?", text, re.M)))


def test_every_constant_of_the_header_has_its_python_twin():
    python = set(abi.HEADER_NAMES) | set(STATUS_CLASSES) | {"PEBBLE_OK"}
    assert header_constants() == python


@pytest.fixture(params=NATIVE)
def lib(request):
    return native.load_library(request.param)[0]


def test_python_constants_equal_the_librarys(lib):
    for name, value in abi.HEADER_NAMES.items():
        assert getattr(lib, name) == value, name
    assert lib.PEBBLE_OK == 0
    for name, cls in STATUS_CLASSES.items():
        assert getattr(lib, name) == cls.status, name
        assert errors.ERROR_BY_STATUS[cls.status] is cls
    assert set(errors.ERROR_BY_STATUS) == {getattr(lib, name) for name in STATUS_CLASSES}


def test_the_types_with_kernels_are_the_librarys(lib):
    ffi = native.ffi
    elements, nbytes = ffi.new("int64_t *"), ffi.new("int64_t *")
    with_kernels = set()
    for ggml_type in range(abi.TYPE_COUNT):
        if lib.pebble_type_block(ggml_type, elements, nbytes) == 0:
            with_kernels.add(ggml_type)
            assert (elements[0], nbytes[0]) == block(ggml_type), ggml_type
    assert with_kernels == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("kind", NATIVE)
def test_the_vector_limit_is_the_librarys(kind):
    assert NativeKernels(kind).MAX_VEC == abi.MATVEC_MAX_VEC == StubKernels.MAX_VEC


@pytest.mark.parametrize("struct,python", [
    ("struct pebble_stats", tuple(StoreStats.__dataclass_fields__)),
    ("struct pebble_layer_shape", tuple(LayerShape.__dataclass_fields__)),
    ("struct pebble_layer_weights", DECODE_WEIGHTS),
])
def test_the_dataclasses_mirror_the_headers_structs(struct, python):
    assert tuple(name for name, _ in native.ffi.typeof(struct).fields) == python
