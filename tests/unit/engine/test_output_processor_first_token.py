"""A prefill hop that asked logprobs ships its token's row in kv_transfer_params (the output
processor is the one that sees both), for the decode side to stream with the token."""

from __future__ import annotations

from pdserve.engine.output_processor import OutputProcessor
from pdserve.kv_connector.first_token import shipped_logprobs
from pdserve.kv_transfer_params import FirstTokenLogprobs, KVTransferParams
from pdserve.outputs import EngineCoreOutput, LogprobsLists, RequestOutputKind
from pdserve.request import FinishReason
from pdserve.sampling_params import SamplingParams
from tests.utils.tiny_models import make_tokenizer


def _hop(logprobs: int | None) -> KVTransferParams | None:
    processor = OutputProcessor(make_tokenizer(512))
    params = SamplingParams(max_tokens=1, logprobs=logprobs)
    processor.add_request("r", None, [1, 5, 6], params, RequestOutputKind.FINAL_ONLY)
    row = LogprobsLists([[9, 9, 4]], [[-0.25, -0.25, -1.5]], [1]) if logprobs else None
    kv = KVTransferParams(do_remote_prefill=True, first_token_id=9)
    out = EngineCoreOutput("r", [9], row, int(FinishReason.LENGTH), kv_transfer_params=kv)
    (update,), _ = processor.process_outputs([out])
    return update.output.kv_transfer_params


def test_a_hop_asking_logprobs_ships_the_row() -> None:
    kv = _hop(logprobs=2)
    assert kv is not None
    assert kv.first_token_logprobs == FirstTokenLogprobs([9, 9, 4], [-0.25, -0.25, -1.5], 1)
    assert shipped_logprobs(kv, 2) == LogprobsLists([[9, 9, 4]], [[-0.25, -0.25, -1.5]], [1])


def test_a_hop_without_logprobs_ships_none() -> None:
    kv = _hop(logprobs=None)
    assert kv is not None and kv.first_token_logprobs is None
