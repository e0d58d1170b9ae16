"""Why a load failed reaches the request's client (pd_lessons 25): a prefill instance of another
model is refused at the handshake, and the reason the decode worker found travels in
KVConnectorOutput.load_errors, through the scheduler's failed-load path, into the request's
EngineCoreOutput.error and its RequestOutput, across both process boundaries. Real connector
halves (halves.py), no mocks."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
import pytest

from pdserve.engine.messages import EngineCoreOutputs
from pdserve.engine.output_processor import OutputProcessor
from pdserve.executor import wire
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.outputs import (
    EngineCoreOutput,
    KVConnectorOutput,
    ModelRunnerOutput,
    RequestOutputKind,
)
from pdserve.request import FinishReason
from tests.unit.scheduler.conftest import make_request
from tests.utils.tiny_models import make_tokenizer

from .halves import Instance, poll
from .utils import assert_scheduler_empty

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def instances(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Instance]]:
    made: list[Instance] = []

    def make(model: str, role: str) -> Instance:
        made.append(Instance(model, role, monkeypatch))
        return made[-1]

    yield make
    for instance in made:
        instance.shutdown()


def test_model_mismatch_reason_reaches_the_request_output(
    tiny_model: Callable[[str], str], instances: Callable[..., Instance]
) -> None:
    """The two instances differ only in architecture: the reason says so, names no address,
    and the decode side's pool ends full."""
    p = instances(tiny_model("qwen2"), "kv_producer")
    d = instances(tiny_model("llama"), "kv_consumer")
    prompt = list(range(100, 140))
    request = make_request("r", prompt=prompt, max_tokens=1)
    request.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    p.scheduler.add_request(request)
    (prefilled,) = p.step()[1]
    decode = make_request("r", prompt=prompt, max_tokens=4)
    assert prefilled.kv_transfer_params is not None
    decode.kv_transfer_params = msgspec.structs.replace(prefilled.kv_transfer_params)
    d.scheduler.add_request(decode)
    outputs: list[EngineCoreOutput] = []

    def failed() -> bool:
        outputs.extend(d.step()[1])
        return decode.is_finished()

    poll(failed)
    (output,) = outputs
    assert output.finish_reason == FinishReason.ERROR
    assert output.error is not None
    assert output.error.startswith("the KV handshake with prefill engine prefill failed: ")
    assert "compatibility hash mismatch" in output.error
    assert output.error.endswith("architecture: prefill Qwen2ForCausalLM, decode LlamaForCausalLM")
    assert "127.0.0.1" not in output.error  # the side channel's address stays in the log
    assert d.connector.get_stats()["handshake_failures"] == 1

    processor = OutputProcessor(make_tokenizer(512))
    processor.add_request("r", None, prompt, decode.sampling_params, RequestOutputKind.FINAL_ONLY)
    (update,), _ = processor.process_outputs([output])
    assert update.output is not None
    (completion,) = update.output.outputs
    assert (completion.finish_reason, completion.error) == ("error", output.error)
    d.step()  # the finished id reaches the workers
    assert_scheduler_empty(d.scheduler)


def test_the_reason_crosses_both_process_boundaries() -> None:
    """Worker -> engine core in the runner output's wire form, engine core -> front end in
    EngineCoreOutputs: the reason arrives as it left."""
    why = "the KV handshake with prefill engine p failed: decode TP 2 does not divide prefill TP 3"
    output = ModelRunnerOutput(
        ["d-1"], [[]], kv_connector_output=KVConnectorOutput(None, {"d-1"}, {4}, None, {"d-1": why})
    )
    encoded = msgspec.msgpack.encode(wire.model_runner_output_to_wire(output, ()))
    got = wire.model_runner_output_from_wire(
        msgspec.msgpack.decode(encoded, type=wire.ModelRunnerOutputWire), ()
    )
    assert got == output and got.kv_connector_output.load_errors == {"d-1": why}  # type: ignore[union-attr]
    outputs = EngineCoreOutputs(
        0.0, [EngineCoreOutput("d-1", [], finish_reason=int(FinishReason.ERROR), error=why)]
    )
    got_outputs = msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs)
    assert got_outputs.outputs[0].error == why
