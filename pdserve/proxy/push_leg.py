"""The proxy's push mode (`--kv-mode push`, docs/push.md): both hops leave at once.

The prefill hop carries a transfer id; the decode hop names the prefill instance's KV side
channel (from its /server_info) and that id, so the decode instance registers its blocks there
while the prompt computes, and the prefill instance writes them as they fill. The client's answer
is the decode instance's; the prefill hop's one token is dropped. Where a request cannot take
this path (one token asked, prompt logprobs, a batch, or a prefill instance whose side channel
is unknown) the proxy takes the sequential path, which push instances serve as well.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.kv_transfer_params import KVTransferParams
from pdserve.protocol.errors import OpenAIError
from pdserve.proxy.instances import Instance, forwarded_error, upstream_error
from pdserve.proxy.prefill_leg import PrefillLeg, is_one_token, one_token_hop
from pdserve.proxy.routing import Router

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SideChannel:
    """Where a prefill instance's KV handshakes answer, and who answers."""

    engine_id: str
    host: str
    port: int
    tp_size: int


async def side_channel(instance: Instance) -> SideChannel:
    """From the instance's /server_info, once per incarnation (a restart names a new engine:
    the health check that sees it come back forgets the old one)."""
    if instance.side_channel is None:
        resp = await instance.client.get("/server_info", params={"config_format": "json"})
        resp.raise_for_status()
        info = resp.json()
        config, channel = info["vllm_config"], info["kv_side_channel"]
        instance.side_channel = SideChannel(
            config["kv_transfer_config"]["engine_id"],
            channel["host"],
            channel["port"],
            config["parallel_config"]["tensor_parallel_size"],
        )
    return instance.side_channel


def can_push(body: dict[str, Any]) -> bool:
    """Whether a request's answer is the decode instance's alone: not a one-token one (the
    prefill instance's answer is all of it) and not one asking for prompt logprobs (the
    prefill instance computes those)."""
    one_token = body.get("n", 1) == 1 and is_one_token(body)
    return not one_token and not body.get("prompt_logprobs")


async def push_legs(
    router: Router,
    hashes: list[int],
    body: dict[str, Any],
    endpoint: str,
    headers: dict[str, str],
    keep: Callable[[asyncio.Task[Any]], None],
) -> PrefillLeg:
    """Send the prefill hop (a task for `keep`, which the decode leg watches) and return the
    decode hop's params; a prefill instance that cannot be asked makes the path local, as in
    pull mode."""
    try:
        instance = router.pick(hashes).instance
    except OpenAIError as e:
        return PrefillLeg(reason="prefill-unavailable", detail=e.message)
    try:
        channel = await side_channel(instance)
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
        detail = f"{instance.url}: no KV side channel in its /server_info ({e!r})"
        return PrefillLeg(instance, reason="prefill-failed", detail=detail)
    transfer_id = f"{headers['X-Request-Id']}-{uuid.uuid4().hex[:8]}"
    hop = one_token_hop(body, KVTransferParams(do_remote_decode=True, transfer_id=transfer_id))
    task = asyncio.create_task(_prefill_hop(instance, hop, endpoint, headers))
    keep(task)
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=channel.engine_id,
        remote_request_id=transfer_id,
        remote_host=channel.host,
        remote_port=channel.port,
        tp_size=channel.tp_size,
    )
    return PrefillLeg(instance, params, push_hop=task)


async def _prefill_hop(
    instance: Instance, hop: dict[str, Any], endpoint: str, headers: dict[str, str]
) -> OpenAIError | None:
    """The prefill hop's failure, if it failed: the decode hop then waits for a push that will
    never come, and the decode leg ends it (`Split`)."""
    instance.in_flight += 1
    try:
        resp = await instance.client.post(f"/v1/{endpoint}", json=hop, headers=headers)
    except httpx.HTTPError as e:
        instance.side_channel = None
        error = upstream_error(instance, e)
        logger.warning("Push-mode prefill hop failed: %s", error.message)
        return error
    finally:
        instance.in_flight -= 1
    if resp.status_code == 200:
        return None
    logger.warning(
        "Push-mode prefill hop to %s answered %d: %s",
        instance.url,
        resp.status_code,
        resp.text[:200],
    )
    return forwarded_error(instance, resp)
