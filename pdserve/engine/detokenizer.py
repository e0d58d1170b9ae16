"""Incremental detokenization and stop strings, one instance per generated sequence."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from pdserve.sampling_params import SamplingParams

# Prompt tokens decoded along with the output so that word boundaries come out right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop or []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string that matched, if any (text is then truncated)."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            # A trailing U+FFFD is an incomplete UTF-8 sequence: wait for the next token.
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                continue
            delta = new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.output_text += delta
            stop = self._check_stop(len(delta))
            if stop is not None:
                return stop
        return None

    def _check_stop(self, new_chars: int) -> str | None:
        for stop in self.stop:
            # Only the region the new characters could complete needs a search.
            start = max(0, len(self.output_text) - new_chars - len(stop) + 1)
            pos = self.output_text.find(stop, start)
            if pos != -1:
                end = pos + len(stop) if self.include_stop_str_in_output else pos
                self.output_text = self.output_text[:end]
                return stop
        return None
