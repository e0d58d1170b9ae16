"""The prompt's logprobs through the split: the prefill instance computes them (it computes the
prompt), the decode instance does not, and the proxy puts the first's into the second's answer.

Two fields hold them: vLLM's `prompt_logprobs` (a completion choice's, a chat response's) and,
with `echo` and `logprobs`, the prompt's entries at the head of a completion choice's
`logprobs`. The decode instance is asked for neither `prompt_logprobs` (its hop goes without)
nor the prompt entries' values: with echo and logprobs it answers the prompt's tokens, text and
offsets with null values (docs/proxy.md), which the prefill hop's fill in. A stream has them in
each choice's first chunk.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.proxy.sse import edit_first_events


@dataclass
class PromptLogprobs:
    """What the prefill hop's answer holds of each prompt's logprobs (one hop choice per prompt:
    the hop has n = 1), for the decode instance's choices `index // n`."""

    n: int
    endpoint: str
    prompt_logprobs: dict[int, Any] = field(default_factory=dict)
    # prompt index -> the echoed prompt's token_logprobs and top_logprobs
    echoed: dict[int, tuple[list, list]] = field(default_factory=dict)

    @classmethod
    def from_hop(
        cls, body: dict[str, Any], answer: dict[str, Any], endpoint: str
    ) -> PromptLogprobs | None:
        """None when the client asked for none of them."""
        wanted = body.get("prompt_logprobs") is not None and not body.get("stream")
        echoed = endpoint == "completions" and body.get("echo") and body.get("logprobs") is not None
        if not (wanted or echoed):
            return None
        found = cls(int(body.get("n") or 1), endpoint)
        if wanted and endpoint != "completions":
            found.prompt_logprobs[0] = answer.get("prompt_logprobs")
            return found
        for choice in answer.get("choices") or []:
            i = choice["index"]
            if wanted:
                found.prompt_logprobs[i] = choice.get("prompt_logprobs")
            lp, generated = choice.get("logprobs"), choice.get("token_ids")
            if echoed and lp and isinstance(generated, list):
                num_prompt = len(lp["tokens"]) - len(generated)
                found.echoed[i] = (
                    lp["token_logprobs"][:num_prompt],
                    lp["top_logprobs"][:num_prompt],
                )
        return found

    def fill_answer(self, answer: dict[str, Any]) -> None:
        """A whole answer (not streamed)."""
        if self.endpoint != "completions":
            if 0 in self.prompt_logprobs:
                answer["prompt_logprobs"] = self.prompt_logprobs[0]
            return
        for choice in answer.get("choices") or []:
            self._fill_choice(choice)

    def _fill_choice(self, choice: dict[str, Any]) -> None:
        i = choice["index"] // self.n
        if i in self.prompt_logprobs:
            choice["prompt_logprobs"] = self.prompt_logprobs[i]
        lp = choice.get("logprobs")
        if i in self.echoed and lp:
            values, top = self.echoed[i]
            lp["token_logprobs"][: len(values)] = values
            lp["top_logprobs"][: len(top)] = top

    def fill_stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The stream's events, each choice's first chunk filled (the one with the echo); the
        rest go as they come once every choice has had its first."""
        pending = {i * self.n + c for i in self.echoed for c in range(self.n)}
        return edit_first_events(
            chunks, lambda event: self._fill_event(event, pending), lambda: not pending
        )

    def _fill_event(self, event: bytes, pending: set[int]) -> bytes:
        if not pending or not event.startswith(b"data: {"):
            return event
        payload = json.loads(event.removeprefix(b"data: "))
        filled = False
        for choice in payload.get("choices") or []:
            if choice.get("index") in pending:
                pending.discard(choice["index"])
                self._fill_choice(choice)
                filled = True
        return f"data: {json.dumps(payload)}".encode() if filled else event
