"""Across TP workers, a transfer is finished only once every worker reported it (vLLM's
KVOutputAggregator): the scheduler must not free or promote a request while a rank still reads.
A load that failed on several ranks in one step keeps the lowest rank's reason: one request,
one message for its client (the ranks' reasons differ by little more than the rank)."""

from __future__ import annotations

from pdserve.outputs import KVConnectorOutput, ModelRunnerOutput


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        # request id -> the ranks that reported it: a rank that reports an id twice (a retried
        # notification) still counts once.
        self._sending: dict[str, set[int]] = {}
        self._recving: dict[str, set[int]] = {}

    def _count(
        self, reported: dict[str, set[int]], rank: int, ids: set[str] | None, done: set[str]
    ) -> None:
        for req_id in ids or ():
            ranks = reported.setdefault(req_id, set())
            ranks.add(rank)
            if len(ranks) == self.world_size:
                del reported[req_id]
                done.add(req_id)

    def aggregate(self, outputs: list[ModelRunnerOutput], output_rank: int) -> ModelRunnerOutput:
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        stats: dict[str, float] = {}
        errors: dict[str, str] = {}
        for rank, output in enumerate(outputs):
            kv = output.kv_connector_output
            if kv is None:
                continue
            self._count(self._sending, rank, kv.finished_sending, sending)
            self._count(self._recving, rank, kv.finished_recving, recving)
            invalid |= kv.invalid_block_ids
            for name, value in (kv.stats or {}).items():
                stats[name] = stats.get(name, 0.0) + value
            for req_id, reason in (kv.load_errors or {}).items():
                errors.setdefault(req_id, reason)
        # A copy: a worker in this process may have returned the shared empty output.
        return outputs[output_rank].with_kv_connector_output(
            KVConnectorOutput(
                sending or None, recving or None, invalid, stats or None, errors or None
            )
        )
