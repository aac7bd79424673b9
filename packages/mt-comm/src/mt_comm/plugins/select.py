"""The default ``mt_select_backend``: the device's own preferred backend.

It runs last (``trylast``), so any plugin may choose differently first.
"""

from __future__ import annotations

from mt_core import Device, hookimpl


@hookimpl(trylast=True)
def mt_select_backend(device: Device) -> str | None:
    return device.preferred_backend
