"""A registrar handed to plugins: ``registry.add(name, factory, **metadata)``.

Plugins never return lists from hooks; they receive a :class:`Registry` and add
entries to it. Names are unique: adding a name twice raises, naming both the
plugin that registered it first and the one that tried again, so two plugins
can never silently shadow each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered factory and the metadata its plugin gave with it."""

    name: str
    factory: Callable[[], T]
    metadata: dict[str, Any] = field(default_factory=dict)


class Registry(Generic[T]):
    """Named factories of one kind (devices, collective backends, ...).

    ``kind`` is only used in messages ("device", "collective backend").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def add(self, name: str, factory: Callable[[], T], **metadata: Any) -> None:
        """Register ``factory`` under ``name``; raise if the name is taken."""
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(
                f"{self.kind} name {name!r} is not valid: use letters, digits, '-' and '_'"
            )
        if name in self._entries:
            raise ValueError(
                f"{self.kind} {name!r} is registered twice; names must be unique "
                f"(already registered: {sorted(self._entries)})"
            )
        self._entries[name] = Entry(name, factory, dict(metadata))

    def get(self, name: str) -> Entry[T]:
        """The entry called ``name``; an unknown name lists the known ones."""
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; known {self.kind}s: {', '.join(sorted(self._entries)) or '(none)'}"
            ) from None

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
