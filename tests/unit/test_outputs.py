"""ModelRunnerOutput's copy with a connector report keeps everything else of the step: a
prefill worker's connector report in the step that returns prompt logprobs must not drop them."""

from __future__ import annotations

from pdserve.outputs import KVConnectorOutput, LogprobsLists, ModelRunnerOutput


def test_with_kv_connector_output_keeps_every_other_field() -> None:
    row = LogprobsLists([[3, 3]], [[-0.1, -0.1]], [1])
    output = ModelRunnerOutput(["a"], [[3]], row, None, {"a": row})
    kv = KVConnectorOutput(finished_sending={"b"})
    copy = output.with_kv_connector_output(kv)
    assert copy.kv_connector_output is kv and output.kv_connector_output is None
    for name in ModelRunnerOutput.__slots__:
        if name not in ("kv_connector_output", "_index"):
            assert getattr(copy, name) is getattr(output, name), name
    assert copy.req_id_to_index == {"a": 0}
