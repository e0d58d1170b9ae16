"""Incremental detokenization and stop strings, one instance per generated sequence.

The text is kept as a list of pieces, so that a step costs what its own tokens cost however
long the sequence is: the whole text is joined only when asked for (`output_text`), and the
stop-string search and a stream's new text read the end of the list only.
"""

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
        self.max_stop_len = max(map(len, self.stop), default=0)
        # A stream holds back this many characters: a stop string they may begin would cut them.
        self.stop_buffer_len = (
            0 if self.include_stop_str_in_output else max(0, self.max_stop_len - 1)
        )
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._pieces: list[str] = []
        self.num_chars = 0

    @property
    def output_text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def text_from(self, start: int) -> str:
        """The text from character `start` on, read from the end: O(its length)."""
        need = self.num_chars - start
        if need <= 0:
            return ""
        taken, found, i = [], 0, len(self._pieces)
        while found < need:
            i -= 1
            taken.append(self._pieces[i])
            found += len(self._pieces[i])
        text = "".join(reversed(taken))
        return text[len(text) - need :]

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
            self._pieces.append(delta)
            self.num_chars += len(delta)
            if self.stop:
                stop = self._check_stop(len(delta))
                if stop is not None:
                    return stop
        return None

    def _check_stop(self, new_chars: int) -> str | None:
        # Only the region the new characters could complete needs a search.
        window_start = max(0, self.num_chars - new_chars - self.max_stop_len + 1)
        window = self.text_from(window_start)
        for stop in self.stop:
            start = max(0, len(window) - new_chars - len(stop) + 1)
            pos = window.find(stop, start)
            if pos != -1:
                end = pos + len(stop) if self.include_stop_str_in_output else pos
                self._truncate(window_start + end)
                return stop
        return None

    def _truncate(self, num_chars: int) -> None:
        cut = self.num_chars - num_chars
        while cut and cut >= len(self._pieces[-1]):
            cut -= len(self._pieces.pop())
        if cut:
            self._pieces[-1] = self._pieces[-1][:-cut]
        self.num_chars = num_chars
