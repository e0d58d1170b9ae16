"""What the OpenAI request bodies do with fields they lack (vLLM's: ignore them, and one warning
names them) and vLLM's check of cache_salt."""

from __future__ import annotations

import logging

import pytest
from pydantic import TypeAdapter, ValidationError

from pdserve.protocol.chat import ChatCompletionRequest
from pdserve.protocol.completion import CompletionRequest
from pdserve.protocol.errors import validation_error
from pdserve.protocol.tokenize import TokenizeRequest

IGNORED = "The following fields were present in the request but ignored"


def ignored_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(IGNORED)]


def test_one_warning_names_the_ignored_fields(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "pdserve.protocol.common"):
        CompletionRequest.model_validate(
            {"prompt": "hi", "max_tokens": 2, "user": "u1", "tenant_isolation": True}
        )
    [line] = ignored_lines(caplog)
    assert "'user'" in line and "'tenant_isolation'" in line
    assert "prompt" not in line and "max_tokens" not in line


def test_known_fields_and_aliases_are_not_named(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "pdserve.protocol.common"):
        CompletionRequest.model_validate(
            {"prompt": "hi", "cache_salt": "s", "structured_outputs": {"json": {}}}
        )
    assert ignored_lines(caplog) == []


def test_a_nested_object_names_its_own(caplog: pytest.LogCaptureFixture) -> None:
    """As vLLM's: each object of the body checks its own keys (a message's, a tool's)."""
    with caplog.at_level(logging.WARNING, "pdserve.protocol.common"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi", "reasoning": "x"}], "store": False}
        )
    lines = ignored_lines(caplog)
    assert len(lines) == 2
    assert any("'reasoning'" in line for line in lines) and any("'store'" in line for line in lines)


def test_a_union_bodys_error_names_the_field_not_the_member() -> None:
    """The validator that logs wraps each member of a union body (/tokenize's two forms): the
    400 still names the field."""
    both = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ValidationError) as e:
        TypeAdapter(TokenizeRequest).validate_python(both)
    assert validation_error(e.value.errors()).param in ("prompt", "messages")


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_cache_salt_is_a_non_empty_string_if_given(salt: object) -> None:
    for body in ({"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}):
        model = CompletionRequest if "prompt" in body else ChatCompletionRequest
        with pytest.raises(ValidationError, match="must be a non-empty string if provided"):
            model.model_validate({**body, "cache_salt": salt})
        assert model.model_validate({**body, "cache_salt": None}).cache_salt is None
