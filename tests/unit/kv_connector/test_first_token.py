"""When a decode request continues from the prefill instance's token, and when it samples its
own (kv_connector/first_token.py)."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.kv_connector.first_token import shipped_first_token
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.sampling_params import SamplingParams

EOS = 2
PARAMS = {"do_remote_prefill": True, "first_token_id": 7}


def _shipped(kv: dict[str, Any] | None, max_model_len: int = 100, **params: Any) -> int | None:
    sp = SamplingParams(**{"max_tokens": 8, **params})
    typed = None if kv is None else KVTransferParams.from_json(kv)
    return shipped_first_token(
        typed,
        n=sp.n,
        max_tokens=sp.max_tokens,
        logprobs=sp.logprobs,
        stop_token_ids=[EOS, *(sp.stop_token_ids or [])],
        room_after_it=10 + 1 < max_model_len,
    )


def test_a_decode_request_continues_from_the_shipped_token() -> None:
    assert _shipped(PARAMS) == 7
    assert _shipped(PARAMS, temperature=0.8, seed=3) == 7  # seeded noise is per position


@pytest.mark.parametrize(
    ("kv", "params", "why"),
    [
        (None, {}, "no kv_transfer_params"),
        ({"first_token_id": 7}, {}, "not a remote prefill"),
        ({**PARAMS, "first_token_id": None}, {}, "an older prefill instance ships none"),
        ({**PARAMS, "first_token_id": EOS}, {"ignore_eos": True}, "EOS: min_tokens may forbid it"),
        (PARAMS, {"stop_token_ids": [7]}, "it stops the request"),
        (PARAMS, {"max_tokens": 1}, "nothing is left to decode"),
        (PARAMS, {"n": 2}, "each of n sequences samples its own first token"),
        (PARAMS, {"logprobs": 1}, "its logprobs are not shipped"),
    ],
)
def test_the_decode_side_samples_its_own(
    kv: dict[str, Any] | None, params: dict[str, Any], why: str
) -> None:
    assert _shipped(kv, **params) is None, why


def test_no_shipped_token_where_it_fills_the_context() -> None:
    assert _shipped(PARAMS, max_model_len=11) is None
    assert _shipped(PARAMS, max_model_len=12) == 7
