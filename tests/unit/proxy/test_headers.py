"""What the proxy makes of a client's headers before either hop (issue 27); the same cases go
through a live deployment in tests/distributed/test_proxy.py. The headers are built as the ASGI
server hands them over: their raw bytes."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from pdserve.protocol.errors import OpenAIError
from pdserve.proxy.headers import MAX_CHARS, forwarded_headers
from tests.utils.headers import HOSTILE


def _forwarded(*raw: tuple[bytes, bytes]) -> dict[str, str]:
    return forwarded_headers(Headers(raw=[(name.lower(), value) for name, value in raw]))


def test_only_the_key_and_the_id_go_on() -> None:
    assert _forwarded(
        (b"Authorization", b"Bearer k"), (b"X-Request-Id", b"r"), (b"Cookie", b"c\x01")
    ) == {"Authorization": "Bearer k", "X-Request-Id": "r"}


@pytest.mark.parametrize(
    "raw,expected",
    [
        ((b"Authorization", b"Bearer "), {}),
        ((b"Authorization", b" bearer\t"), {}),
        ((b"Authorization", b"\tBearer  k "), {"Authorization": "Bearer  k"}),
        ((b"X-Request-Id", b"a b "), {"X-Request-Id": "a b"}),
        ((b"X-Request-Id", b"a\tb"), {"X-Request-Id": "a\tb"}),
        ((b"X-Request-Id", b"bearer"), {"X-Request-Id": "bearer"}),
        ((b"X-Request-Id", b"   "), {}),
        ((b"X-Request-Id", b"i" * MAX_CHARS), {"X-Request-Id": "i" * MAX_CHARS}),
    ],
)
def test_whitespace_is_stripped_and_an_empty_key_is_no_key(
    raw: tuple[bytes, bytes], expected: dict[str, str]
) -> None:
    assert _forwarded(raw) == expected


@pytest.mark.parametrize("what,headers", [(w, h) for w, h, status, _ in HOSTILE if status == 400])
def test_what_cannot_be_sent_on_is_a_400_naming_the_header(
    what: str, headers: list[tuple[str, bytes]]
) -> None:
    with pytest.raises(OpenAIError) as e:
        _forwarded(*((name.encode(), value) for name, value in headers))
    assert e.value.status == 400
    assert e.value.param == headers[0][0] and headers[0][0] in e.value.message, what
