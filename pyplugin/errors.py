"""Exceptions raised by pebbling. Every store backend raises these, never a raw status code."""

from __future__ import annotations


class PebblingError(Exception):
    """Base of every error pebbling raises on purpose."""


class PebbleError(PebblingError):
    """A store call failed. ``status`` is the native status code, ``message`` its explanation."""

    status = -1

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class InvalidArgumentError(PebbleError, ValueError):
    status = -1


class UnknownEntryError(PebbleError, KeyError):
    status = -2

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class SizeMismatchError(PebbleError, ValueError):
    status = -3


class LayerRangeError(PebbleError, IndexError):
    status = -4


class TooLargeError(PebbleError, MemoryError):
    status = -5


class HostOutOfMemoryError(PebbleError, MemoryError):
    status = -6


class DeviceOutOfMemoryError(PebbleError, MemoryError):
    status = -7


class CudaError(PebbleError, RuntimeError):
    status = -8


class ClosedError(PebbleError, RuntimeError):
    status = -9


class StrategyError(PebbleError, ValueError):
    status = -10


ERROR_BY_STATUS: dict[int, type[PebbleError]] = {
    cls.status: cls
    for cls in (
        InvalidArgumentError, UnknownEntryError, SizeMismatchError, LayerRangeError, TooLargeError,
        HostOutOfMemoryError, DeviceOutOfMemoryError, CudaError, ClosedError, StrategyError,
    )
}


def error_for(status: int, message: str) -> PebbleError:
    """The exception for a native status code; unknown codes still raise PebbleError."""
    cls = ERROR_BY_STATUS.get(status, PebbleError)
    return cls(message or f"pebble call failed with status {status}", status)


class ModelError(PebblingError):
    """A model file is missing, malformed or unsupported; the message names the file and the problem."""


class OptionsError(PebblingError, ValueError):
    """A request option is invalid; the message names the option and what would be accepted."""
