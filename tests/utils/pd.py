"""Prefill and decode instances as real `pdserve serve` processes, and the proxy's two hops."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from pdserve.utils import get_open_port
from tests.utils.server import MetricsReader, RemoteServer
from tests.utils.tiny_models import hf_greedy


def kv_transfer_config(
    role: str,
    transport: str = "nixl",
    kv_buffer_device: str | None = None,
    engine_id: str | None = None,
    connector: str = "NixlConnector",
    **extra: Any,
) -> str:
    config = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_connector_extra_config": {"transport": transport, **extra},
    }
    if kv_buffer_device is not None:
        config["kv_buffer_device"] = kv_buffer_device
    if engine_id is not None:
        config["engine_id"] = engine_id
    return json.dumps(config)


def start_instance(
    model: str,
    role: str,
    transport: str = "nixl",
    tp: int = 1,
    runner: str | None = None,
    extra_args: list[str] | None = None,
    host: str = "127.0.0.1",
    prefix: list[str] | None = None,
    kv_buffer_device: str | None = None,
    env: dict[str, str] | None = None,
    engine_id: str | None = None,
    side_channel_port: int | None = None,
    port: int | None = None,
    connector: str = "NixlConnector",
    **extra: Any,
) -> RemoteServer:
    """One instance with its own side-channel port (a free one unless given); `runner` "0"/"1"
    forces runner V1/V2; `host` is its HTTP and side-channel address, `prefix` wraps its
    command (a netns); `env` adds to its environment (a fault plan); `extra` goes to
    kv_connector_extra_config."""
    env = {
        **(env or {}),
        "PDSERVE_SIDE_CHANNEL_PORT": str(side_channel_port or get_open_port()),
        "PDSERVE_SIDE_CHANNEL_HOST": host,
    }
    if runner is not None:
        env["PDSERVE_USE_V2_MODEL_RUNNER"] = runner
    args = [
        "serve",
        "--model",
        model,
        "--dtype",
        "float32",
        "--kv-transfer-config",
        kv_transfer_config(role, transport, kv_buffer_device, engine_id, connector, **extra),
        "--tensor-parallel-size",
        str(tp),
        *(extra_args or []),
    ]
    if tp > 1:
        args += ["--distributed-executor-backend", "mp"]
    server = RemoteServer(args, env=env, host=host, prefix=prefix, port=port)
    server.side_channel_port = int(env["PDSERVE_SIDE_CHANNEL_PORT"])
    return server


def prefill(
    prefill_server: RemoteServer, body: dict[str, Any], endpoint: str = "completions"
) -> dict[str, Any]:
    """The proxy's first hop: one token, and the prefill instance holds the KV for a reader."""
    hop = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    hop.pop("max_completion_tokens", None)
    resp = httpx.post(f"{prefill_server.url}/v1/{endpoint}", json=hop, timeout=120)
    resp.raise_for_status()
    params = resp.json()["kv_transfer_params"]
    assert params and params["do_remote_prefill"], params
    return params


def split_request(
    prefill_server: RemoteServer,
    decode_server: RemoteServer,
    body: dict[str, Any],
    endpoint: str = "completions",
) -> httpx.Response:
    params = prefill(prefill_server, body, endpoint)
    return httpx.post(
        f"{decode_server.url}/v1/{endpoint}",
        json={**body, "kv_transfer_params": params},
        timeout=120,
    )


def instances(proxy: RemoteServer) -> dict[str, list[MetricsReader]]:
    """Metric readers for the instances behind a proxy (their URLs from its /health)."""
    health = httpx.get(f"{proxy.url}/health", timeout=10).json()
    return {
        role: [MetricsReader(item["url"]) for item in health[role]]
        for role in ("prefill", "decode")
    }


def wait_all_pools_full(proxy: RemoteServer, timeout: float = 60) -> None:
    for readers in instances(proxy).values():
        for reader in readers:
            reader.wait_pool_full(timeout)


def greedy_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A completion request for exactly max_tokens greedy tokens (EOS ignored)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def split_proxy(
    prefill: RemoteServer | list[RemoteServer],
    decode: RemoteServer | list[RemoteServer],
    *flags: str,
) -> RemoteServer:
    """`pdserve proxy` over the prefill and decode instances, every prompt through the prefill
    leg (--pd-min-uncached-tokens 0: these test the split)."""
    address = lambda s: s.url.removeprefix("http://")  # noqa: E731
    prefills = prefill if isinstance(prefill, list) else [prefill]
    decodes = decode if isinstance(decode, list) else [decode]
    args = ["proxy", "--prefill", *map(address, prefills), "--decode", *map(address, decodes)]
    return RemoteServer([*args, "--pd-min-uncached-tokens", "0", *flags])


async def complete_all(
    server: RemoteServer,
    model: str,
    prompts: list[str],
    max_tokens: int,
    return_exceptions: bool = False,
) -> list[Any]:
    """Every prompt at once through `server`'s OpenAI API: max_tokens greedy tokens each."""
    client = server.async_client(timeout=300)
    return await asyncio.gather(
        *[
            client.completions.create(
                model=model,
                prompt=p,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for p in prompts
        ],
        return_exceptions=return_exceptions,
    )


def hf_reference(model: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """HF transformers' greedy tokens for each text prompt."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    return hf_greedy(Path(model), [tokenizer.encode(p) for p in prompts], max_tokens)


def post_and_hang_up_later(server: RemoteServer, body: dict[str, Any]) -> socket.socket:
    """A completion request on a raw connection: closing the socket is the client going away."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock
