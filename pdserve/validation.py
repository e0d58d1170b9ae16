"""Validation helpers shared by the configuration objects: errors name the field."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def check_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}.")


def config_from_dict(cls: type[T], name: str, value: T | dict[str, Any]) -> T:
    """A config dataclass from a JSON object, naming the keys it does not know."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}.")
    unknown = set(value) - set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    if unknown:
        raise ValueError(
            f"{name} has unknown keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}."  # type: ignore[attr-defined]
        )
    return cls(**value)
