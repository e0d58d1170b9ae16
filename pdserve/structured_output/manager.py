"""Structured outputs in the engine: grammars compiled off the step loop, one matcher per
request advanced by each token it accepts, and each step's token bitmask (docs/structured_outputs.md).

A request with a constraint waits in the EngineCore until its grammar is compiled (one
background thread; xgrammar releases the GIL while it compiles, and caches what it compiled),
then joins the scheduler. The scheduler asks for a bitmask row for every such request that
samples in a step; the bitmask travels with the SchedulerOutput and the runner masks the logits
with it. A request that continues from tokens generated elsewhere (the prefill instance's first
token) has its matcher advanced over them first.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from pdserve.config.model import ModelConfig
from pdserve.scheduler.output import GrammarBitmask
from pdserve.structured_output.grammar import compile_grammar, error_message

if TYPE_CHECKING:
    import xgrammar as xgr

    from pdserve.request import Request

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    """A request's grammar: compiling, then a matcher at the request's last known token."""

    __slots__ = ("_compiled", "matcher")

    def __init__(self, compiled: Future[xgr.CompiledGrammar]) -> None:
        self._compiled = compiled
        self.matcher: xgr.GrammarMatcher | None = None

    def compiled(self, request: Request) -> bool:
        """Whether the grammar is ready; the first time it is, the matcher accepts the tokens
        the request already has. Raises ValueError when the grammar failed to compile or
        refuses those tokens."""
        if self.matcher is not None:
            return True
        if not self._compiled.done():
            return False
        import xgrammar as xgr

        try:
            compiled = self._compiled.result()
        except Exception as e:
            raise ValueError(
                f"structured outputs: the grammar did not compile: {error_message(e)}"
            ) from None
        matcher = xgr.GrammarMatcher(compiled)
        for token_id in request.all_token_ids[request.num_prompt_tokens :]:
            if not matcher.accept_token(token_id):
                raise ValueError(
                    f"structured outputs: token {token_id}, generated before this instance "
                    "took the request, does not match its grammar"
                )
        self.matcher = matcher
        return True

    def valid_prefix(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` (a request's drafts) the grammar accepts from
        where the matcher is; the matcher is left where it was."""
        matcher = self.matcher
        assert matcher is not None
        n = 0
        while n < len(token_ids) and matcher.accept_token(token_ids[n]):
            n += 1
        if n:
            matcher.rollback(n)
        return token_ids[:n]

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        matcher = self.matcher
        assert matcher is not None
        for token_id in token_ids:
            # Only a masked-out token can be refused: one sampled past the grammar's end (under
            # ignore_eos) or forced by min_tokens. The matcher then stays where it was.
            if not matcher.accept_token(token_id):
                logger.warning(
                    "Request %s: token %d does not match its grammar.", request_id, token_id
                )


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig, max_num_seqs: int) -> None:
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.stop_token_ids = model_config.eos_token_ids
        self.max_num_seqs = max_num_seqs
        # One thread: compiles run one at a time, beside the step loop, never in it.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self._bitmask: torch.Tensor | None = None

    def grammar_init(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        assert params is not None
        request.structured_output = StructuredOutputRequest(
            self._executor.submit(lambda: compile_grammar(self._get_compiler(), params))
        )

    def _get_compiler(self) -> xgr.GrammarCompiler:
        """Built on the first constraint (in the compile thread): the tokenizer's vocabulary
        takes a fraction of a second to index."""
        if self._compiler is None:
            # Imported here, in the compile thread: an engine without constraints never needs it.
            import xgrammar as xgr

            mc = self.model_config
            info = xgr.TokenizerInfo.from_huggingface(
                mc.load_tokenizer(),
                vocab_size=self.vocab_size,
                stop_token_ids=mc.eos_token_ids or None,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def grammar_bitmask(
        self, requests: list[Request], spec_token_ids: dict[str, list[int]]
    ) -> GrammarBitmask | None:
        """Bitmask rows for the requests with a grammar that sample in the step just
        scheduled (it left each a placeholder: one with a step in flight is not scheduled):
        one row, and one more per draft (`spec_token_ids`), each for the position after the
        drafts before it (the scheduler gave each request only drafts its grammar accepts)."""
        sampling = [
            r for r in requests if r.structured_output is not None and r.num_output_placeholders
        ]
        if not sampling:
            return None
        req_ids = [
            r.request_id
            for r in sampling
            for _ in range(1 + len(spec_token_ids.get(r.request_id, ())))
        ]
        if self._bitmask is None or self._bitmask.shape[0] < len(req_ids):
            import xgrammar as xgr

            rows = max(self.max_num_seqs, len(req_ids))
            self._bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        bitmask = self._bitmask
        row = 0
        for request in sampling:
            matcher = request.structured_output.matcher  # type: ignore[union-attr]
            drafts = spec_token_ids.get(request.request_id, [])
            for j in range(len(drafts) + 1):
                self._fill_row(matcher, bitmask, row, request.request_id)
                row += 1
                if j < len(drafts):
                    assert matcher.accept_token(drafts[j]), "a draft its grammar refuses"
            if drafts:
                matcher.rollback(len(drafts))
        return GrammarBitmask(req_ids, bitmask[:row].numpy().tobytes())

    def _fill_row(
        self, matcher: xgr.GrammarMatcher, bitmask: torch.Tensor, row: int, request_id: str
    ) -> None:
        if matcher.is_terminated():
            # Past its end the grammar allows nothing; the request stops on its own (or runs
            # on under ignore_eos, unconstrained).
            bitmask[row].fill_(-1)
            return
        matcher.fill_next_token_bitmask(bitmask, row)
        if not bitmask[row].any():
            # A dead end: no token continues the grammar (one whose text the vocabulary cannot
            # spell). The request stops rather than loop on nothing.
            logger.warning("Request %s: its grammar allows no token.", request_id)
            bitmask[row].zero_()
            for token_id in self.stop_token_ids:
                bit = 1 << (token_id % 32)  # as an int32: bit 31 is the sign
                bitmask[row, token_id // 32] |= bit - (bit >> 31 << 32)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
