"""Malformed and hostile request headers sent to a proxy as their bytes, which httpx (and the
openai client) would refuse to send: what curl, lm-evaluation-harness with an empty key, or an
attacker send (issue 27)."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

import httpx

from pdserve.proxy.headers import MAX_CHARS

# (what it is, the headers, the status the proxy answers, the header its 400 names: none where
# the proxy's HTTP server refuses the request itself, as uvicorn does a control character).
HOSTILE = [
    ("empty bearer", [("Authorization", b"Bearer ")], 200, None),
    ("bearer with no key", [("Authorization", b"Bearer")], 200, None),
    ("whitespace around the key", [("Authorization", b" \tBearer x \t")], 200, None),
    ("trailing space", [("X-Request-Id", b"a b ")], 200, None),
    ("leading space", [("X-Request-Id", b"  lead")], 200, None),
    ("inner tab", [("X-Request-Id", b"a\tb")], 200, None),
    ("only whitespace", [("X-Request-Id", b" \t ")], 200, None),
    ("DEL", [("X-Request-Id", b"a\x7fb")], 400, None),
    ("control character", [("Authorization", b"Bearer \x01x")], 400, None),
    ("escape sequence", [("X-Request-Id", b"\x1b[2Jid")], 400, None),
    ("over-long id", [("X-Request-Id", b"i" * (MAX_CHARS + 1))], 400, "X-Request-Id"),
    ("over-long key", [("Authorization", b"Bearer " + b"k" * MAX_CHARS)], 400, "Authorization"),
    ("duplicated id", [("X-Request-Id", b"one"), ("X-Request-Id", b"two")], 400, "X-Request-Id"),
    ("duplicated key", [("Authorization", b"Bearer a"), ("Authorization", b"Bearer b")], 400,
     "Authorization"),
    ("UTF-8 id", [("X-Request-Id", "café-☕".encode())], 400, "X-Request-Id"),
    ("latin-1 key", [("Authorization", b"Bearer cl\xe9")], 400, "Authorization"),
]  # fmt: skip


def post_raw(
    url: str, path: str, headers: list[tuple[str, bytes]], body: dict[str, Any]
) -> tuple[int, dict[str, str], bytes]:
    """POST `body` with `headers` as given, repeats and all: (status, headers, body)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.putrequest("POST", path)
        payload = json.dumps(body).encode()
        for name, value in [
            *headers,
            ("Content-Type", b"application/json"),
            ("Content-Length", str(len(payload)).encode()),
        ]:
            conn.putheader(name, value)
        conn.endheaders(payload)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def check_hostile_headers(url: str, body: dict[str, Any]) -> None:
    """Each HOSTILE case through the proxy at `url`: the answer it should get, and then a plain
    request answered at once, with every instance still healthy."""
    for what, headers, status, param in HOSTILE:
        got, response_headers, answer = post_raw(url, "/v1/completions", headers, body)
        assert got == status, f"{what}: {got} {answer[:300]!r}"
        if param is not None:
            error = json.loads(answer)["error"]
            assert error["param"] == param and param in error["message"], (what, error)
        if what == "trailing space":
            assert response_headers["x-request-id"] == "a b", what
            assert json.loads(answer)["id"] == "cmpl-a b", what
        plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert plain.status_code == 200, f"after {what}: {plain.text}"
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["status"] == "ok", f"after {what}: {health}"
