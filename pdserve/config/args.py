"""Engine flags built from the configuration dataclasses: one source for names, defaults and
help (docs/serving.md, "Command line").

A field declared with `flag(...)` becomes `--field-name` (vLLM's spelling, or `name=` where
vLLM's flag differs from its field), typed by its annotation: a bool is a switch with its
`--no-` form, `int | None` takes an int, `json=True` a JSON object. Fields declared without
`flag` (logits processors, the device) are Python-only. The vLLM flags pdserve does not
implement come from unsupported.py, hidden, so that their error names the feature.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.config.unsupported import UNSUPPORTED_FEATURES


def flag(
    default: Any,
    help: str,
    *,
    name: str | None = None,
    short: str | None = None,
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
    json: bool = False,
) -> Any:
    """A configuration field that is also an engine flag. `choices` may be a callable, for
    choices that live in a registry imported on use."""
    metadata = {"help": help, "name": name, "short": short, "choices": choices, "json": json}
    return dataclasses.field(default=default, metadata={"flag": metadata})


def _config_classes() -> list[type]:
    from pdserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from pdserve.config.model import ModelConfig

    return [ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, EngineConfig]


def _flag_fields() -> list[tuple[dataclasses.Field, type, dict[str, Any]]]:
    """(field, its value type, its flag metadata) of every field that is a flag."""
    found = []
    for cls in _config_classes():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                found.append((f, _value_type(hints[f.name]), f.metadata["flag"]))
    return found


def _value_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f, kind, meta in _flag_fields():
        names = [meta["name"] or "--" + f.name.replace("_", "-")]
        if meta["short"]:
            names.append(meta["short"])
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default}
        help_text = meta["help"]
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _json_object if meta["json"] else kind
            choices = meta["choices"]
            if choices is not None:
                kwargs["choices"] = choices() if callable(choices) else choices
        if f.default is not None and kind is not bool:
            help_text += f" (default: {f.default})"
        parser.add_argument(*names, help=help_text, **kwargs)
    # vLLM's flags for what pdserve does not implement: parsed, so that the configuration says
    # which feature is missing rather than argparse calling the flag unknown.
    for u in UNSUPPORTED_FEATURES.values():
        names = [u.flag, u.short_flag] if u.short_flag else [u.flag]
        if u.kind is bool:
            kind_args: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        else:
            kind_args = {"type": _json_object if u.kind is dict else u.kind}
        parser.add_argument(
            *names, dest=u.arg, default=u.off[0], help=argparse.SUPPRESS, **kind_args
        )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments (EngineConfig.from_engine_args) the flags gave."""
    names = [f.name for f, _, _ in _flag_fields()]
    return {n: getattr(args, n) for n in [*names, *UNSUPPORTED_FEATURES]}


def _json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed
