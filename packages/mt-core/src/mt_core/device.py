"""The device abstraction: what mt needs to know about an accelerator.

A :class:`Device` wraps one torch device type (``"cpu"``, ``"cuda"``,
``"musa"``, or a third-party type) and answers, without the caller knowing the
vendor module: availability and count, the current device, synchronisation,
memory statistics, RNG state, streams and events where the device has them,
and :class:`Capabilities` (bf16, FP8 GEMM, peak dense FLOP/s, the preferred
collective backend).

:class:`AcceleratorDevice` implements all of this on top of a CUDA-like torch
module (``torch.cuda``, ``torch_musa``'s ``torch.musa``, ...), which is how
vendor ports expose their devices; the module is imported lazily so that a
plugin registers without its vendor library installed.

Peak FLOP/s come from :data:`PEAK_FLOPS`, a table of dense (no sparsity)
datasheet numbers matched against the device name. An unknown device gives
``None``: MFU is then not reported, never guessed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch


@dataclass(frozen=True)
class Capabilities:
    """What a device can do; numbers are per device (one GPU), dense, in FLOP/s."""

    bf16: bool
    fp8_gemm: bool
    peak_bf16_flops: float | None
    peak_fp8_flops: float | None


# Dense datasheet peaks (FLOP/s), matched in order against the lower-cased device
# name, so more specific patterns come first. (pattern, bf16, fp8 or None).
PEAK_FLOPS: tuple[tuple[str, float, float | None], ...] = (
    ("gb200", 2.5e15, 5.0e15),
    ("b200", 2.25e15, 4.5e15),
    ("h100 pcie", 756.0e12, 1513.0e12),
    ("h100 nvl", 835.0e12, 1671.0e12),
    ("h100", 989.4e12, 1978.9e12),
    ("h200", 989.4e12, 1978.9e12),
    ("h800", 989.4e12, 1978.9e12),
    ("h20", 148.0e12, 296.0e12),
    ("gh200", 989.4e12, 1978.9e12),
    ("a100", 312.0e12, None),
    ("a800", 312.0e12, None),
    ("l40s", 362.05e12, 733.0e12),
    ("l4", 121.0e12, 242.0e12),
    ("rtx 4090", 165.2e12, 330.3e12),
)


def lookup_peak_flops(device_name: str) -> tuple[float | None, float | None]:
    """(bf16, fp8) dense peak FLOP/s for a device name, or (None, None) if unknown."""
    lowered = device_name.lower()
    for pattern, bf16, fp8 in PEAK_FLOPS:
        if pattern in lowered:
            return bf16, fp8
    return None, None


class Device:
    """Base class of all devices. Subclasses override what differs.

    ``name`` is the plugin-registered name (``"cuda"``), ``type`` the torch
    device type (``torch.device(type)``); they differ for a third-party device
    that runs on another torch backend.
    """

    name: str
    type: str
    preferred_backend: str

    def __init__(self, name: str, type: str, preferred_backend: str) -> None:
        self.name = name
        self.type = type
        self.preferred_backend = preferred_backend

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, type={self.type!r})"

    # ---------------------------------------------------------------- presence
    def is_available(self) -> bool:
        raise NotImplementedError

    def unavailable_reason(self) -> str:
        """Why the device is not available, phrased for an error message."""
        return "no such device is visible on this machine"

    def device_count(self) -> int:
        raise NotImplementedError

    def device_name(self, index: int | None = None) -> str:
        """The hardware name ("NVIDIA H200"); used for the peak-FLOP/s table."""
        raise NotImplementedError

    # ---------------------------------------------------------- current device
    def set_device(self, index: int) -> None:
        raise NotImplementedError

    def current_device(self) -> int:
        raise NotImplementedError

    def torch_device(self, index: int | None = None) -> torch.device:
        """``torch.device`` for ``index`` (default: the current device)."""
        return torch.device(self.type, self.current_device() if index is None else index)

    def synchronize(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ memory
    def memory_stats(self) -> dict[str, int]:
        """Bytes: ``allocated``, ``reserved``, ``peak_allocated`` (and ``total`` if known)."""
        raise NotImplementedError

    def reset_peak_memory_stats(self) -> None:
        raise NotImplementedError

    # --------------------------------------------------------------------- RNG
    def get_rng_state(self) -> torch.Tensor:
        raise NotImplementedError

    def set_rng_state(self, state: torch.Tensor) -> None:
        raise NotImplementedError

    def manual_seed(self, seed: int) -> None:
        raise NotImplementedError

    # -------------------------------------------------------- streams / events
    @property
    def has_streams(self) -> bool:
        return False

    def stream(self) -> Any:
        """A new stream; raises on devices without streams (``has_streams``)."""
        raise NotImplementedError(f"device {self.name!r} has no streams")

    def current_stream(self) -> Any:
        raise NotImplementedError(f"device {self.name!r} has no streams")

    def event(self, enable_timing: bool = False) -> Any:
        raise NotImplementedError(f"device {self.name!r} has no events")

    # ------------------------------------------------------------ capabilities
    def capabilities(self) -> Capabilities:
        raise NotImplementedError


class AcceleratorDevice(Device):
    """A device driven through a CUDA-like torch module, imported on first use.

    ``module`` names the module (``"torch.cuda"``), ``requires`` what must be
    imported first to make it exist (``"torch_musa"``) and ``install_hint``
    what to tell the user when that import fails.
    """

    def __init__(
        self,
        name: str,
        type: str,
        preferred_backend: str,
        module: str,
        requires: str | None = None,
        install_hint: str = "",
        fp8_gemm: Callable[[AcceleratorDevice], bool] | None = None,
    ) -> None:
        super().__init__(name, type, preferred_backend)
        self._module_name = module
        self._requires = requires
        self._install_hint = install_hint
        self._fp8_gemm = fp8_gemm
        self._module: ModuleType | None = None

    def _vendor_library_present(self) -> bool:
        if self._requires is None:
            return True
        try:
            importlib.import_module(self._requires)
        except ImportError:
            return False
        return True

    @property
    def module(self) -> ModuleType:
        """The torch device module; a missing vendor library raises with an install hint."""
        if self._module is None:
            if self._requires is not None:
                try:
                    importlib.import_module(self._requires)
                except ImportError as error:
                    raise RuntimeError(
                        f"device {self.name!r} needs the Python package {self._requires!r}, "
                        f"which is not installed: {self._install_hint}"
                    ) from error
            self._module = importlib.import_module(self._module_name)
        return self._module

    def is_available(self) -> bool:
        if not self._vendor_library_present():
            return False
        try:
            return bool(self.module.is_available())
        except (ImportError, RuntimeError, AttributeError):
            return False

    def unavailable_reason(self) -> str:
        if not self._vendor_library_present():
            return (
                f"it needs the Python package {self._requires!r}, which is not installed: "
                f"{self._install_hint}"
            )
        return f"{self._module_name}.is_available() is False (no driver or no visible device)"

    def device_count(self) -> int:
        return int(self.module.device_count()) if self.is_available() else 0

    def device_name(self, index: int | None = None) -> str:
        return str(self.module.get_device_name(self.current_device() if index is None else index))

    def set_device(self, index: int) -> None:
        self.module.set_device(index)

    def current_device(self) -> int:
        return int(self.module.current_device())

    def synchronize(self) -> None:
        self.module.synchronize()

    def memory_stats(self) -> dict[str, int]:
        index = self.current_device()
        stats = {
            "allocated": int(self.module.memory_allocated(index)),
            "reserved": int(self.module.memory_reserved(index)),
            "peak_allocated": int(self.module.max_memory_allocated(index)),
        }
        get_properties = getattr(self.module, "get_device_properties", None)
        if get_properties is not None:
            stats["total"] = int(get_properties(index).total_memory)
        return stats

    def reset_peak_memory_stats(self) -> None:
        self.module.reset_peak_memory_stats()

    def get_rng_state(self) -> torch.Tensor:
        return self.module.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.module.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        self.module.manual_seed(seed)

    @property
    def has_streams(self) -> bool:
        return True

    def stream(self) -> Any:
        return self.module.Stream()

    def current_stream(self) -> Any:
        return self.module.current_stream()

    def event(self, enable_timing: bool = False) -> Any:
        return self.module.Event(enable_timing=enable_timing)

    def capabilities(self) -> Capabilities:
        name = self.device_name()
        bf16_peak, fp8_peak = lookup_peak_flops(name)
        bf16_check = getattr(self.module, "is_bf16_supported", None)
        fp8 = bool(self._fp8_gemm(self)) if self._fp8_gemm is not None else False
        return Capabilities(
            bf16=bool(bf16_check()) if bf16_check is not None else True,
            fp8_gemm=fp8,
            peak_bf16_flops=bf16_peak,
            peak_fp8_flops=fp8_peak if fp8 else None,
        )
