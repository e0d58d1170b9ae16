"""KVOutputAggregator: across TP workers, a transfer is finished only once every rank reported
it, so the scheduler never frees or promotes a request while one rank still reads or sends
(docs/abort.md); everything else the ranks report is merged."""

from __future__ import annotations

from pdserve.kv_connector.aggregator import KVOutputAggregator
from pdserve.outputs import KVConnectorOutput, ModelRunnerOutput


def rank_output(
    sending: set[str] | None = None,
    recving: set[str] | None = None,
    invalid: set[int] | None = None,
    stats: dict[str, float] | None = None,
    req_ids: list[str] | None = None,
) -> ModelRunnerOutput:
    """One rank's step: its transfer news, and one sampled token per request id."""
    req_ids = req_ids or []
    kv = KVConnectorOutput(sending, recving, invalid or set(), stats)
    return ModelRunnerOutput(req_ids, [[7] for _ in req_ids], kv_connector_output=kv)


def news(output: ModelRunnerOutput) -> tuple[set[str] | None, set[str] | None]:
    kv = output.kv_connector_output
    assert kv is not None
    return kv.finished_sending, kv.finished_recving


def test_a_transfer_ends_once_every_rank_reported_it() -> None:
    agg = KVOutputAggregator(world_size=2)
    step1 = agg.aggregate([rank_output({"p"}, {"d"}), rank_output()], output_rank=0)
    assert news(step1) == (None, None)  # rank 1 may still be reading into d's blocks
    step2 = agg.aggregate([rank_output(), rank_output({"p"}, {"d"})], output_rank=0)
    assert news(step2) == ({"p"}, {"d"})
    # Counted once: a later report starts a new count.
    step3 = agg.aggregate([rank_output(recving={"d"}), rank_output()], output_rank=0)
    assert news(step3) == (None, None)


def test_a_rank_reporting_an_id_twice_counts_once() -> None:
    agg = KVOutputAggregator(world_size=2)
    for _ in range(2):  # rank 0 twice, rank 1 not yet: rank 1 may still be reading
        step = agg.aggregate([rank_output(recving={"d"}), rank_output()], output_rank=0)
        assert news(step) == (None, None)
    step = agg.aggregate([rank_output(), rank_output(recving={"d"})], output_rank=0)
    assert news(step) == (None, {"d"})


def test_every_rank_in_the_same_step() -> None:
    agg = KVOutputAggregator(world_size=4)
    out = agg.aggregate([rank_output({"p"}, {"a", "b"}) for _ in range(4)], output_rank=3)
    assert news(out) == ({"p"}, {"a", "b"})


def test_sending_and_receiving_are_counted_apart() -> None:
    """One rank's send completion and the other's receive completion of the same id finish
    neither: each kind needs every rank."""
    agg = KVOutputAggregator(world_size=2)
    out = agg.aggregate([rank_output(sending={"x"}), rank_output(recving={"x"})], output_rank=0)
    assert news(out) == (None, None)
    out = agg.aggregate([rank_output(recving={"x"}), rank_output(sending={"x"})], output_rank=0)
    assert news(out) == ({"x"}, {"x"})


def test_invalid_blocks_are_joined_and_counters_summed() -> None:
    agg = KVOutputAggregator(world_size=2)
    out = agg.aggregate(
        [
            rank_output(invalid={3, 4}, stats={"transfers": 1.0, "transfer_bytes": 512.0}),
            rank_output(invalid={4, 9}, stats={"transfers": 1.0, "failed_transfers": 1.0}),
        ],
        output_rank=0,
    )
    kv = out.kv_connector_output
    assert kv is not None
    assert kv.invalid_block_ids == {3, 4, 9}
    assert kv.stats == {"transfers": 2.0, "transfer_bytes": 512.0, "failed_transfers": 1.0}


def test_a_load_that_failed_on_several_ranks_has_one_reason() -> None:
    """One reason per request, the lowest rank's: the client gets one message."""
    agg = KVOutputAggregator(world_size=2)
    first, second = rank_output(invalid={3}), rank_output(invalid={3, 4})
    first.kv_connector_output.load_errors = {"a": "rank 0 refused"}  # type: ignore[union-attr]
    second.kv_connector_output.load_errors = {  # type: ignore[union-attr]
        "a": "rank 1 refused",
        "b": "rank 1 read failed",
    }
    kv = agg.aggregate([first, second], output_rank=0).kv_connector_output
    assert kv is not None and not kv.is_empty()
    assert kv.load_errors == {"a": "rank 0 refused", "b": "rank 1 read failed"}
    kv = agg.aggregate([rank_output(), rank_output()], output_rank=0).kv_connector_output
    assert kv is not None and kv.load_errors is None


def test_the_output_ranks_tokens_with_the_merged_news() -> None:
    """The sampled tokens are the output rank's (the last pipeline stage); a rank without a
    connector output reports nothing."""
    agg = KVOutputAggregator(world_size=2)
    first = rank_output(recving={"d"})
    first.kv_connector_output = None
    last = rank_output(recving={"d"}, req_ids=["r1", "r2"])
    out = agg.aggregate([first, last], output_rank=1)
    assert out.req_ids == ["r1", "r2"] and out.sampled_token_ids == [[7], [7]]
    assert news(out) == (None, None)
    kv = out.kv_connector_output
    assert kv is not None and kv.is_empty()
    out = agg.aggregate([rank_output(recving={"d"}), rank_output()], output_rank=1)
    assert news(out) == (None, {"d"})


def test_one_rank_passes_through() -> None:
    agg = KVOutputAggregator(world_size=1)
    out = agg.aggregate([rank_output({"p"}, {"d"}, {5}, {"transfers": 1.0})], output_rank=0)
    assert news(out) == ({"p"}, {"d"})
    kv = out.kv_connector_output
    assert kv is not None and kv.invalid_block_ids == {5} and kv.stats == {"transfers": 1.0}


def test_the_shared_empty_output_is_never_mutated() -> None:
    """A worker in this process returns EMPTY_MODEL_RUNNER_OUTPUT for a step with nothing
    scheduled and nothing to report; the merged news goes on a copy."""
    from pdserve.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    merged = KVOutputAggregator(world_size=1).aggregate([EMPTY_MODEL_RUNNER_OUTPUT], 0)
    assert merged is not EMPTY_MODEL_RUNNER_OUTPUT and merged.kv_connector_output is not None
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None
