"""The proxy's second hop: the request, with the prefill leg's `kv_transfer_params`, to a decode
instance, whose answer goes back to the client. A leg that fails before its first byte goes
once more to another decode instance: the client has seen nothing of it yet."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx

from pdserve.protocol.errors import OpenAIError
from pdserve.proxy.instances import Instance, forwarded_error, upstream_error
from pdserve.proxy.routing import Router
from pdserve.proxy.sse import error_event


class DecodeLeg:
    """An open decode answer; counts in its instance's load until closed."""

    def __init__(self, instance: Instance, answer: httpx.Response) -> None:
        self.instance = instance
        self.answer = answer
        self._open = True

    async def close(self) -> None:
        """Closing an answer not read to its end aborts the request on the instance."""
        if self._open:
            self._open = False
            self.instance.in_flight -= 1
            await self.answer.aclose()

    async def passing(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The rest of the stream to the client; a failure mid-way becomes an error event.
        Cancelled when the client goes away: the close aborts the decode request."""
        try:
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as e:
            yield error_event(upstream_error(self.instance, e))
        finally:
            await self.close()


async def open_decode(
    router: Router,
    instance: Instance,
    hashes: list[int],
    endpoint: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> DecodeLeg:
    """The decode leg's answer, streamed, from `instance` or, when it fails first, from another
    decode instance; an error it answers, or a second failure, is raised as the client's."""
    for attempt in range(2):
        request = instance.client.build_request(
            "POST", f"/v1/{endpoint}", json=body, headers=headers
        )
        instance.in_flight += 1
        try:
            answer = await instance.client.send(request, stream=True)
        except BaseException as e:  # a leg cancelled (its push hop failed) is no load either
            instance.in_flight -= 1
            if not isinstance(e, httpx.HTTPError):
                raise
            error = upstream_error(instance, e)
        else:
            if answer.status_code == 200:
                return DecodeLeg(instance, answer)
            await answer.aread()
            await answer.aclose()
            instance.in_flight -= 1
            error = forwarded_error(instance, answer)
            if answer.status_code < 500:  # the client's mistake: another instance would agree
                raise error
        if attempt == 0:
            try:
                instance = router.pick(hashes, exclude=instance).instance
            except OpenAIError:
                break
    raise error


async def close_unread(opening: asyncio.Task[DecodeLeg]) -> None:
    """Close a leg the client left before reading it, once it is open (a failed one is done)."""
    try:
        leg = await opening
    except OpenAIError:
        return
    await leg.close()
