"""The proxy's first hop: a one-token copy of the request to a prefill instance, and what its
answer means for the rest (the KV to hand over, the whole answer, or why the decode instance
prefills: docs/proxy.md's local path)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.kv_transfer_params import KVTransferParams
from pdserve.protocol.errors import OpenAIError
from pdserve.proxy.instances import Instance, failed, forwarded_error
from pdserve.proxy.prompt_logprobs import PromptLogprobs
from pdserve.proxy.routing import Router


@dataclass
class PrefillLeg:
    """The first hop's outcome: the KV to hand over, or why the decode instance prefills."""

    instance: Instance | None = None
    params: KVTransferParams | None = None
    reason: str | None = None  # set when the path is local
    detail: str = ""
    # The prefill instance's answer when it is the whole of it: the client asked for one
    # token, or the first token stopped the request. No decode leg follows.
    answer: dict[str, Any] | None = None
    # The prompt's logprobs the client asked for, which the decode instance does not compute.
    prompt_logprobs: PromptLogprobs | None = None
    # The prefill instance's one-token answer, when the KV is handed over.
    hop_answer: dict[str, Any] | None = None
    # Push mode's prefill hop, under way beside the decode leg: its failure, if it fails.
    push_hop: asyncio.Task[OpenAIError | None] | None = None

    @property
    def path(self) -> str:
        if self.answer is not None:
            return "prefill-only"
        return "remote" if self.reason is None else "local"

    @property
    def header(self) -> str:
        """X-PD-Path's value."""
        return self.path if self.reason is None else f"local; reason={self.reason}"


def is_one_token(body: dict[str, Any]) -> bool:
    return (body.get("max_completion_tokens") or body.get("max_tokens")) == 1


def one_token_hop(body: dict[str, Any], params: KVTransferParams | None) -> dict[str, Any]:
    """The prefill hop's body: the request for one token, not streamed, with `params`."""
    # One sequence prefills, whatever the client's n: one hand-off, which the decode
    # instance's n sequences share. The hop's sequence is the client's first (same seed).
    hop = {**body, "max_tokens": 1, "stream": False, "n": 1}
    if params is not None:
        hop["kv_transfer_params"] = params.to_json()
    if hop.get("min_tokens"):  # it forbids a stop at the first token here as it would there
        hop["min_tokens"] = 1
    if "max_completion_tokens" in hop:
        hop["max_completion_tokens"] = 1
    hop.pop("stream_options", None)
    if body.get("stream"):  # a stream never returns prompt_logprobs (0 is all it may ask)
        hop.pop("prompt_logprobs", None)
    return hop


async def prefill_leg(
    router: Router,
    hashes: list[int],
    body: dict[str, Any],
    endpoint: str,
    headers: dict[str, str],
) -> PrefillLeg:
    """The first hop of `body`: a copy that computes the prompt and one token on a prefill
    instance (the router's pick for a prompt of these block hashes) and keeps its KV for the
    decode instance."""
    single = body.get("n", 1) == 1
    one_token = single and is_one_token(body)
    # A one-token request needs no decode leg: nothing is handed over.
    hop = one_token_hop(body, None if one_token else KVTransferParams(do_remote_decode=True))
    instance, resp, failure = await _send(router, hashes, hop, endpoint, headers)
    if resp is None:
        return PrefillLeg(instance, reason=failure[0], detail=failure[1])
    if resp.status_code != 200:  # the client's mistake: the decode instance would agree
        raise forwarded_error(instance, resp)
    answer = resp.json()
    stopped = answer.get("choices", [{}])[0].get("finish_reason") == "stop"
    if one_token or (stopped and single):
        answer.pop("kv_transfer_params", None)
        return PrefillLeg(instance, answer=answer)
    if stopped:  # the first sequence is done, the others need the KV, which was not kept
        detail = f"{instance.url}: the first token stopped the request's first sequence"
        return PrefillLeg(instance, reason="first-token-stopped", detail=detail)
    if not answer.get("kv_transfer_params"):
        detail = f"{instance.url} answered without kv_transfer_params (no KV connector?)"
        return PrefillLeg(instance, reason="no-kv-transfer-params", detail=detail)
    try:
        params = KVTransferParams.from_json(answer["kv_transfer_params"])
    except ValueError as e:
        return PrefillLeg(instance, reason="bad-kv-transfer-params", detail=f"{instance.url}: {e}")
    if not params.reads_remote():
        missing = ", ".join(params.missing_remote_fields()) or "do_remote_prefill"
        detail = f"{instance.url} answered kv_transfer_params without {missing}"
        return PrefillLeg(instance, reason="bad-kv-transfer-params", detail=detail)
    prompt_logprobs = PromptLogprobs.from_hop(body, answer, endpoint)
    return PrefillLeg(instance, params, prompt_logprobs=prompt_logprobs, hop_answer=answer)


async def _send(
    router: Router, hashes: list[int], hop: dict[str, Any], endpoint: str, headers: dict[str, str]
) -> tuple[Instance | None, httpx.Response | None, tuple[str, str]]:
    """The hop's answer (not a 5xx), from a second instance when the first failed: nothing
    reached the client yet. Without one: the last instance tried and (reason, detail)."""
    last: Instance | None = None
    failure = ("prefill-unavailable", "")
    for _ in range(2):
        try:
            instance = router.pick(hashes, exclude=last).instance
        except OpenAIError as e:
            return last, None, failure if last is not None else (failure[0], e.message)
        instance.in_flight += 1
        try:
            resp = await instance.client.post(f"/v1/{endpoint}", json=hop, headers=headers)
        except httpx.HTTPError as e:
            last, failure = instance, ("prefill-failed", failed(instance, e))
            continue
        finally:
            instance.in_flight -= 1
        if resp.status_code < 500:
            return instance, resp, failure
        last, failure = instance, ("prefill-failed", forwarded_error(instance, resp).message)
    return last, None, failure
