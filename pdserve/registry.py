"""One lookup-by-name idiom for everything pluggable: executors, KV connectors, transports,
model architectures.

Entries are "module:attribute" strings, imported on first use, so naming every choice costs
nothing and an optional library (ray, nixl, ucxx) is imported only when its entry is chosen.
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from pdserve.validation import check_choice

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, field: str, entries: dict[str, str] | None = None) -> None:
        # `kind` names the choices in messages ("KV connector"); `field`, the config field that
        # picks one ("kv_transfer_config.kv_connector"), so an error names what to change.
        self.kind = kind
        self.field = field
        self._entries: dict[str, str] = {}
        for name, target in (entries or {}).items():
            self.register(name, target)

    def register(self, name: str, target: str) -> None:
        """`target` is "package.module:attribute"; a name is registered once."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered already.")
        if ":" not in target:
            raise ValueError(f"{self.kind} {name!r}: {target!r} is not 'module:attribute'.")
        self._entries[name] = target

    def supported_names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def check(self, name: str) -> None:
        """Raise the error that names the field and the choices, for config validation."""
        check_choice(self.field, name, self.supported_names())

    def get(self, name: str) -> T:
        """The entry's object, its module imported now; ImportError propagates for the caller
        to turn into an install hint."""
        self.check(name)
        module_name, attribute = self._entries[name].split(":")
        return getattr(importlib.import_module(module_name), attribute)
