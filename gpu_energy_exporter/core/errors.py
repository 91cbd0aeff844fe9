"""The project's own exceptions.

Vendor errors (NVML, sysfs, OTLP decoding) are translated into these at the boundary where they happen,
so that every message a user sees says what happened and what to do about it.
"""

from __future__ import annotations


class ExporterError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(ExporterError):
    """A flag, environment variable or configuration file holds a value we cannot use."""


class NVMLUnavailable(ExporterError):
    """NVML cannot be used at all (no driver, no library, no GPU, init failed).

    ``reason`` is a short machine-friendly token used as a metric label; the message is for humans.
    """

    def __init__(self, message: str, reason: str = "unknown") -> None:
        super().__init__(message)
        self.reason = reason


class GPUError(ExporterError):
    """An operation on one GPU failed."""


class GPULost(GPUError):
    """The GPU fell off the bus or stopped answering (NVML_ERROR_GPU_IS_LOST and friends)."""


class NotSupported(GPUError):
    """This GPU, driver or virtualisation mode does not provide this reading. Not an error: no data."""


class NoPermission(ExporterError):
    """The process lacks the permission for a reading (NVML or sysfs); the message says how to grant it."""
