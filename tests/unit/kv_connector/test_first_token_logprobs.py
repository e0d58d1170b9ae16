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
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.outputs import LogprobsLists

ROW = LogprobsLists([[7, 7, 3, 9]], [[-0.5, -0.5, -1.25, -2.0]], [1])


def _params(row: Any) -> KVTransferParams:
    return KVTransferParams.from_json(
        {"do_remote_prefill": True, "first_token_id": 7, "first_token_logprobs": row}
    )


def _shipped(kv: KVTransferParams, logprobs: int) -> int | None:
    return shipped_first_token(kv, n=1, max_tokens=8, logprobs=logprobs, stop_token_ids=[2])


def test_the_row_goes_there_and_back_cut_to_the_request_width() -> None:
    kv = _params(first_token_logprobs(ROW))
    assert _shipped(kv, 3) == 7
    assert shipped_logprobs(kv, 3) == ROW
    # A batch's rows are as wide as its widest request: this one asked for one.
    assert _shipped(kv, 1) == 7
    assert shipped_logprobs(kv, 1) == LogprobsLists([[7, 7]], [[-0.5, -0.5]], [1])
    # Through JSON, as the proxy carries it.
    assert _params(kv.to_json()["first_token_logprobs"]) == kv


@pytest.mark.parametrize(
    ("row", "why"),
    [
        (None, "an older prefill instance ships no row"),
        ({"token_ids": [7, 7], "logprobs": [-0.5, -0.5], "rank": 1}, "narrower than asked"),
        ({"token_ids": [8, 8, 3, 9], "logprobs": [0.0] * 4, "rank": 1}, "another token's row"),
        ({"token_ids": [7, 7, 3, 9], "logprobs": [-0.5] * 3, "rank": 1}, "ragged"),
    ],
)
def test_without_a_fitting_row_the_decode_side_samples_its_own(row: Any, why: str) -> None:
    assert _shipped(_params(row), 3) is None, why


@pytest.mark.parametrize(
    ("row", "where"),
    [
        ({"token_ids": [7, 7, 3, 9], "logprobs": ["x"] * 4, "rank": 1}, r"\.logprobs\[0\]"),
        ({"token_ids": [7, 7, 3, 9], "logprobs": [-0.5] * 4}, ""),
        ({"token_ids": [7, True], "logprobs": [-0.5] * 2, "rank": 1}, r"\.token_ids\[1\]"),
        ([[7, 7, 3, 9]], ""),
    ],
)
def test_a_malformed_row_is_refused_naming_its_field(row: Any, where: str) -> None:
    """The HTTP layer converts kv_transfer_params with KVTransferParams.from_json: a 400."""
    with pytest.raises(ValueError, match=rf"^kv_transfer_params\.first_token_logprobs{where}"):
        _params(row)
