"""A structured-outputs constraint as xgrammar takes it: checked where requests come in,
compiled in the engine.

The check parses the constraint without a tokenizer (cheap), so that a bad schema, regex or
grammar is a 400 naming the problem rather than a failed request later. `choice` becomes an
EBNF grammar whose strings are JSON-escaped literals, as vLLM builds it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from pdserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar's C++ errors start with "[time] /path/file.cc:line: " and sometimes an internal
# check; the rest is the message a user can act on.
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def check(params: StructuredOutputsParams, field: str | None = None) -> None:
    """Raise ValueError naming the field (`field`, else structured_outputs.<kind>) when the
    constraint does not parse."""
    # Imported on first use: every API server and proxy imports this module, few need it.
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            schema = json.loads(params.json)  # type: ignore[arg-type]
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is an object")
            xgr.Grammar.from_json_schema(params.json)  # type: ignore[arg-type]
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)  # type: ignore[arg-type]
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)  # type: ignore[arg-type]
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(params.choice))  # type: ignore[arg-type]
    except (RuntimeError, ValueError) as e:
        name = field or f"structured_outputs.{kind}"
        raise ValueError(f"{name} is invalid: {error_message(e)}") from None


def error_message(error: Exception) -> str:
    return _ERROR_PREFIX.sub("", str(error).strip().splitlines()[0]).strip()


def compile_grammar(
    compiler: xgr.GrammarCompiler, params: StructuredOutputsParams
) -> xgr.CompiledGrammar:
    """The compiler caches what it compiled: a schema sent again costs a lookup."""
    any_whitespace = not params.disable_any_whitespace
    kind = params.kind
    if kind == "json":
        return compiler.compile_json_schema(params.json, any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(params.choice))
    return compiler.compile_grammar(params.grammar)
