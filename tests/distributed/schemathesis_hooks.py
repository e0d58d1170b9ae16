"""schemathesis hooks (SCHEMATHESIS_HOOKS) for test_openapi_schema.py: the bodies left out are
schema-valid requests pdserve refuses by design, for reasons a JSON schema cannot state
(docs/serving.md, "OpenAPI schema"). Each rule says why; anything else the fuzzer sends must
get the response the schema declares. Where an operation has headers to fuzz (the proxy's
X-Request-Id), an API key goes with them, as clients send it.

Loaded by schemathesis in its own environment (.venv-schemathesis), not by pytest.
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis
from hypothesis import strategies as st

MAX_MODEL_LEN = int(os.environ["MAX_MODEL_LEN"])  # the servers' --max-model-len


def _refused_by_design(body: dict[str, Any]) -> bool:
    fmt = body.get("response_format")
    constraints = [
        isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"),
        body.get("structured_outputs") is not None,
        *(
            body.get(k) is not None
            for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        ),
    ]
    tools, choice = body.get("tools"), body.get("tool_choice")
    forced_tool = choice == "required" or isinstance(choice, dict)
    constraints.append(forced_tool and bool(tools))
    if sum(constraints) > 1:
        return True  # one structured-outputs constraint per request
    # The content of a JSON schema, a regex or a grammar is checked by compiling it.
    if body.get("structured_outputs") is not None or body.get("guided_json") is not None:
        return True
    if body.get("guided_regex") is not None or body.get("guided_grammar") is not None:
        return True
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return True
    if any(
        isinstance(t, dict) and (t.get("function") or {}).get("parameters") for t in tools or []
    ):
        return True
    if forced_tool:
        names = {(t.get("function") or {}).get("name") for t in tools or [] if isinstance(t, dict)}
        if not tools or (
            isinstance(choice, dict) and (choice.get("function") or {}).get("name") not in names
        ):
            return True  # a forced call needs the tool it forces
    if choice == "auto" and tools:
        return True  # "auto" needs --enable-auto-tool-choice, which the test server lacks
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is None:  # completions' default; chat's is the room the prompt leaves
        max_tokens = 16 if "prompt" in body else MAX_MODEL_LEN - _prompt_bound(None, body)
    if isinstance(max_tokens, (int, float)) and (body.get("min_tokens") or 0) > max_tokens:
        return True  # min_tokens <= max_tokens
    prompt = body.get("prompt")
    if (
        isinstance(max_tokens, (int, float))
        and max_tokens + _prompt_bound(prompt, body) >= MAX_MODEL_LEN
    ):
        return True  # prompt + max_tokens within the context, which depends on tokenizing
    if _prompt_bound(prompt, body) >= MAX_MODEL_LEN:
        return True
    if body.get("stream") and (body.get("echo") or (body.get("prompt_logprobs") or 0) > 0):
        return True  # vLLM's refusals: echo and prompt_logprobs only without streaming
    kv = body.get("kv_transfer_params")
    if isinstance(kv, dict) and (kv.get("do_remote_prefill") or kv.get("do_remote_decode")):
        return True  # a hand-off names a real peer
    batch = isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
    if kv is not None and batch:
        return True  # a hand-off carries one prompt's KV
    return False


def _prompt_bound(prompt: Any, body: dict[str, Any]) -> int:
    """An upper bound of the prompt's token count (byte-level BPE: a token per byte at most;
    a chat adds its template's tokens)."""
    if isinstance(prompt, str):
        return len(prompt.encode())
    if isinstance(prompt, list):
        lengths = [
            len(p.encode()) if isinstance(p, str) else len(p) if isinstance(p, list) else 1
            for p in prompt
        ]
        return max(lengths) if all(isinstance(p, (str, list)) for p in prompt) else len(prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(str(m).encode()) + 16 for m in messages)
    return 0


@schemathesis.hook
def filter_body(ctx: Any, body: Any) -> bool:
    if not isinstance(body, dict):
        return True
    try:
        return not _refused_by_design(body)
    except (TypeError, AttributeError, ValueError):
        return True  # a schema-violating body (negative testing): its fields have any type


# The key the proxy's optional bearer would get no value for (schemathesis draws none for
# optional auth), the way clients send it: none, an empty one (lm-evaluation-harness without a
# key), with whitespace a server strips, or any printable one. The servers take any key.
_API_KEYS = st.one_of(
    st.sampled_from(["", "Bearer", "Bearer ", "bearer \t", "Bearer k ", "Bearer \tk"]),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=64).map(
        "Bearer {}".format
    ),
)


@schemathesis.hook
def flatmap_headers(ctx: Any, headers: dict[str, str] | None) -> Any:
    return st.one_of(st.none(), _API_KEYS).map(
        lambda key: headers if key is None else {**(headers or {}), "Authorization": key}
    )
