"""A request asking logprobs continues from the shipped token only with its logprob row
(kv_connector/first_token.py): the prefill side writes the row, the decode side reads it back."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.kv_connector.first_token import (
    first_token_logprobs,
    shipped_first_token,
    shipped_logprobs,
)
from pdserve.outputs import LogprobsLists
from pdserve.sampling_params import SamplingParams

ROW = LogprobsLists([[7, 7, 3, 9]], [[-0.5, -0.5, -1.25, -2.0]], [1])
PARAMS = {"do_remote_prefill": True, "first_token_id": 7, "first_token_logprobs": None}


def _params(row: Any) -> dict[str, Any]:
    return {**PARAMS, "first_token_logprobs": row}


def _shipped(kv: dict[str, Any], logprobs: int) -> int | None:
    sp = SamplingParams(max_tokens=8, logprobs=logprobs)
    return shipped_first_token(kv, sp, [2], 10, 100)


def test_the_row_goes_there_and_back_cut_to_the_request_width() -> None:
    kv = _params(first_token_logprobs(ROW))
    assert _shipped(kv, 3) == 7
    assert shipped_logprobs(kv, 3) == ROW
    # A batch's rows are as wide as its widest request: this one asked for one.
    assert _shipped(kv, 1) == 7
    assert shipped_logprobs(kv, 1) == LogprobsLists([[7, 7]], [[-0.5, -0.5]], [1])


@pytest.mark.parametrize(
    ("row", "why"),
    [
        (None, "an older prefill instance ships no row"),
        ({"token_ids": [7, 7], "logprobs": [-0.5, -0.5], "rank": 1}, "narrower than asked"),
        ({"token_ids": [8, 8, 3, 9], "logprobs": [0.0] * 4, "rank": 1}, "another token's row"),
        ({"token_ids": [7, 7, 3, 9], "logprobs": [-0.5] * 3, "rank": 1}, "ragged"),
        ({"token_ids": [7, 7, 3, 9], "logprobs": ["x"] * 4, "rank": 1}, "not numbers"),
        ({"token_ids": [7, 7, 3, 9], "logprobs": [-0.5] * 4, "rank": None}, "no rank"),
        ([[7, 7, 3, 9]], "not a row"),
    ],
)
def test_without_a_fitting_row_the_decode_side_samples_its_own(row: Any, why: str) -> None:
    assert _shipped(_params(row), 3) is None, why
