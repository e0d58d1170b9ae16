"""Turns EngineCoreOutputs into RequestOutputs: detokenization, stop strings, logprobs, n > 1.

Each request says what it wants back (`RequestOutputKind`, vLLM's): everything so far after
every step (CUMULATIVE), only what is new (DELTA, for streams: a step then costs what its own
tokens cost), or one output when it finishes (FINAL_ONLY).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from transformers import PreTrainedTokenizerBase

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.kv_connector.first_token import first_token_logprobs
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    LogprobsLists,
    RequestOutput,
    RequestOutputKind,
)
from pdserve.request import FinishReason
from pdserve.sampling_params import SamplingParams


@dataclass
class _SequenceState:
    """One generated sequence (an engine request); `index` is its place among the n."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # with finish_reason "error": why, for the client
    # What a DELTA output already gave the caller: tokens, characters.
    num_sent_tokens: int = 0
    num_sent_chars: int = 0

    def completion(self) -> CompletionOutput:
        """Everything so far (a copy: the caller may keep it while the sequence grows)."""
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.output_text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )

    def delta(self) -> CompletionOutput:
        """What the caller has not had yet. Text that a stop string may still cut is held back
        until the sequence finishes, so the deltas join to the final text."""
        detok = self.detokenizer
        end = detok.num_chars
        if self.finish_reason is None:
            end = max(self.num_sent_chars, end - detok.stop_buffer_len)
        text = detok.text_from(self.num_sent_chars)[: end - self.num_sent_chars]
        first = self.num_sent_tokens
        self.num_sent_tokens, self.num_sent_chars = len(self.token_ids), end
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[first:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[first:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_SequenceState]
    output_kind: RequestOutputKind
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    kv_load_recomputed: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA: they go in one output

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def make_output(self, updated: list[_SequenceState]) -> RequestOutput | None:
        """The output this step owes the caller, given the sequences it updated."""
        kind = self.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        prompt_logprobs = self.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            outputs = [s.delta() for s in updated]
            if self.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                self.prompt_logprobs_sent = True
        else:
            outputs = [s.completion() for s in self.sequences]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=self.kv_transfer_params,
            kv_load_recomputed=self.kv_load_recomputed,
            prompt_logprobs=prompt_logprobs,
        )


@dataclass
class RequestUpdate:
    """One request's step, for the caller and the metrics."""

    request_id: str
    num_new_tokens: int
    finish_reasons: list[str]  # of the sequences that finished in this step
    finished: bool
    output: RequestOutput | None  # None: nothing owed yet (FINAL_ONLY)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of the n sequences is one engine request; seeded ones get distinct seeds."""
    import msgspec

    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return msgspec.structs.replace(params, n=1, seed=seed)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        # engine request id -> (parent request id, sequence index)
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the (engine request id, params) of its n sequences."""
        if request_id in self.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        sequences, children = [], []
        for i in range(params.n):
            seq_params = child_params(params, i)
            sequences.append(
                _SequenceState(
                    index=i,
                    params=seq_params,
                    detokenizer=IncrementalDetokenizer(
                        self.tokenizer, prompt_token_ids, seq_params
                    ),
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
            child_id = child_request_id(request_id, i, params.n)
            self.child_to_parent[child_id] = (request_id, i)
            children.append((child_id, seq_params))
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, sequences, output_kind
        )
        return children

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestUpdate], list[str]]:
        """Returns one update per request the step changed, and the engine ids to abort (stop
        strings hit). A step's work is that of its new tokens, whatever the lengths so far."""
        # request id -> (its state, the sequences updated by index, its update)
        updated: dict[str, tuple[_RequestState, dict[int, _SequenceState], RequestUpdate]] = {}
        to_abort: list[str] = []
        for out in outputs:
            parent = self.child_to_parent.get(out.request_id)
            if parent is None:
                continue  # aborted by us earlier; late tokens are dropped
            state = self.requests[parent[0]]
            seq = state.sequences[parent[1]]
            seq.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None and seq.logprobs is not None:
                self._append_logprobs(seq, out.new_logprobs)
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = self._prompt_logprobs(out.prompt_logprobs)
            stop_str = seq.detokenizer.update(out.new_token_ids)
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            state.kv_load_recomputed |= out.kv_load_recomputed
            if (kv := out.kv_transfer_params) is not None:
                if out.new_logprobs is not None and kv.first_token_id is not None:
                    # A prefill hop's row, for the decode side to stream with the token.
                    kv = msgspec.structs.replace(
                        kv, first_token_logprobs=first_token_logprobs(out.new_logprobs)
                    )
                state.kv_transfer_params = kv
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = str(FinishReason.STOP), stop_str
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                seq.finish_reason = str(FinishReason(out.finish_reason))
                seq.stop_reason, seq.error = out.stop_reason, out.error
            entry = updated.get(state.request_id)
            if entry is None:
                entry = updated[state.request_id] = (
                    state,
                    {},
                    RequestUpdate(state.request_id, 0, [], False, None),
                )
            entry[1][seq.index] = seq
            entry[2].num_new_tokens += len(out.new_token_ids)
            if seq.finish_reason is not None:
                del self.child_to_parent[out.request_id]
                entry[2].finish_reasons.append(seq.finish_reason)
        results = []
        for state, sequences, update in updated.values():
            update.finished = state.finished
            update.output = state.make_output(list(sequences.values()))
            results.append(update)
            if update.finished:
                del self.requests[state.request_id]
        return results, to_abort

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine ids of its unfinished sequences."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        ids = [child_request_id(request_id, s.index, len(state.sequences)) for s in state.sequences]
        return [i for i in ids if self.child_to_parent.pop(i, None) is not None]

    def _append_logprobs(self, seq: _SequenceState, lp: LogprobsLists) -> None:
        assert seq.logprobs is not None and seq.cumulative_logprob is not None
        for ids, values, rank in zip(lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks):
            entry = {
                tid: Logprob(value, rank if j == 0 else j, self.tokenizer.decode([tid]))
                for j, (tid, value) in enumerate(zip(ids, values))
            }
            seq.logprobs.append(entry)
            seq.cumulative_logprob += values[0]

    def _prompt_logprobs(self, lp: LogprobsLists) -> list[dict[int, Logprob] | None]:
        """vLLM's form: None for the first prompt token, then one entry per position, the
        prompt token first (with its rank), then the top ones (rank 1, 2, ...)."""
        decoded: dict[int, str] = {}  # a prompt's rows share most of their tokens

        def decode(tid: int) -> str:
            text = decoded.get(tid)
            if text is None:
                text = decoded[tid] = self.tokenizer.decode([tid])
            return text

        entries: list[dict[int, Logprob] | None] = [None]
        for ids, values, rank in zip(lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks):
            entries.append(
                {
                    tid: Logprob(value, rank if j == 0 else j, decode(tid))
                    for j, (tid, value) in enumerate(zip(ids, values))
                }
            )
        return entries
