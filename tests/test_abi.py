"""One source for the ABI: the Python facts (pyplugin.store.abi, the status codes of pyplugin.errors,
the list of types with kernels, the dataclasses that mirror the header's structs) against native/pebble.h
as the bindings read it and against each native library built here, whose exported symbols are the
header's functions."""

from __future__ import annotations

import re
import struct
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------------
# the libraries' exported symbols

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build"
LIBRARIES = ("libpebble_host.so", "libpebble_host_asan.so", "libpebble_cuda.so")
# The C++ standard library's template instantiations (namespaces std and __gnu_cxx, their typeinfo,
# vtables and function-local statics), which libstdc++ declares with default visibility.
STANDARD_LIBRARY = re.compile(r"_Z(?:Z?NK?|T[ISV]N?)?(?:St|9__gnu_cxx)")


def exported_functions() -> set[str]:
    """The functions pebble.h declares with its export macro."""
    return set(re.findall(r"^PEBBLE_API\s[^(;]*?\b(pebble_\w+)\s*\(", (ROOT / "native" / "pebble.h").read_text(), re.M))


def dynamic_symbols(path) -> set[str]:
    """The names a shared library defines in its dynamic symbol table (nm -D --defined-only), read from
    the ELF64 file itself."""
    data = path.read_bytes()
    assert data[:5] == b"\x7fELF\x02", f"{path} is not a 64-bit ELF file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        strings = sections[link][4]
        for at in range(offset + entsize, offset + size, entsize):  # entry 0 is the null symbol
            name, info, _, shndx = struct.unpack_from("<IBBH", data, at)
            if shndx != 0 and info >> 4 in (1, 2, 10):  # defined; global, weak or unique
                names.add(data[strings + name:data.index(b"\0", strings + name)].decode())
    return names


@pytest.mark.parametrize("name", LIBRARIES)
def test_a_library_exports_the_headers_functions_and_nothing_of_its_own_besides(name):
    """Each library built here (make host, host-asan, cuda) exports exactly the functions pebble.h declares
    with PEBBLE_API, besides the C++ standard library's template instantiations that every shared object
    using them exports: no internal name leaks, whichever source it lives in (-fvisibility=hidden). `make
    test` builds the host libraries, so they are always checked there; the cuda library only where `make
    cuda` has built it: without it that case is skipped, saying so."""
    path = BUILD / name
    if not path.exists():
        pytest.skip(f"{path.relative_to(ROOT)} is not built here (make {name[10:-3].replace('_', '-')})")
    symbols = dynamic_symbols(path)
    ours = {s for s in symbols if not STANDARD_LIBRARY.match(s)}
    assert ours == exported_functions(), (f"exported but not in pebble.h: {sorted(ours - exported_functions())}; "
                                          f"in pebble.h but not exported: {sorted(exported_functions() - ours)}")
