"""`kv_transfer_params`, typed: what a request tells the connector and what a prefill instance
answers, under vLLM's NixlConnector names.

The HTTP layer converts a request's JSON object with `from_json` (a wrong type is a 400 naming
the key) and answers with `to_json`; inside the engine, on the wire to the EngineCore process
included, the params are this struct. Keys no field names are dropped, as other connectors'
keys mean nothing here.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class RemoteLease(msgspec.Struct, frozen=True):
    """The prefill side's lease on the request's blocks: its board slot and tag, which the
    reader checks after its READ, and its duration (docs/lease.md)."""

    slot: int
    tag: int
    seconds: float | None = None


class FirstTokenLogprobs(msgspec.Struct, frozen=True):
    """The shipped token's logprobs row: column 0 is the token, then the hop's top ones."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Immutable once made: a writer (the connector, the prefill front end) makes a changed
    copy with `msgspec.structs.replace`, so that the params a request was given never change
    under another holder of them."""

    # Asked of a prefill instance: hold the blocks for a reader and answer where they are.
    do_remote_decode: bool = False
    # Asked of a decode instance: read the prompt's KV from the instance named below.
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[NonNegative] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int | None = None  # the prefill instance's tensor-parallel size; None: 1
    remote_num_tokens: int | None = None  # tokens whose KV the blocks hold
    remote_cached_tokens: NonNegative | None = None  # of those, the prefill side's cache hits
    remote_epoch: str | None = None  # the prefill instance's incarnation (docs/handshake.md)
    remote_lease: RemoteLease | None = None
    # First-token shipping (first_token.py): the token the prefill instance sampled.
    first_token_id: NonNegative | None = None
    first_token_logprobs: FirstTokenLogprobs | None = None
    # Push mode, asked of a prefill instance: the id the decode side's registrations name this
    # request by (the decode request's remote_request_id). None: the request's own id.
    transfer_id: str | None = None

    @classmethod
    def from_json(cls, value: Any) -> KVTransferParams:
        """Raises ValueError naming the key, as `kv_transfer_params.remote_port: ...`. A key
        whose value is null is unset (vLLM's proxies send the remote fields as nulls)."""
        if isinstance(value, dict):
            value = {key: v for key, v in value.items() if v is not None}
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as e:
            message, _, path = str(e).partition(" - at `$")
            where = "kv_transfer_params" + path.rstrip("`")
            raise ValueError(f"{where}: {message}") from None

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def missing_remote_fields(self, push: bool = False) -> list[str]:
        """The fields a read (push: a registration, which names no blocks) needs that are
        unset."""
        names = _REMOTE_FIELDS[1:] if push else _REMOTE_FIELDS
        return [name for name in names if getattr(self, name) is None]

    def reads_remote(self, push: bool = False) -> bool:
        """A decode request whose prompt's KV can be read (push: registered for): every field
        that needs is set."""
        return self.do_remote_prefill and not self.missing_remote_fields(push)

    @property
    def remote_tp_size(self) -> int:
        return self.tp_size or 1


# X-PD-Path's reason when a decode instance recomputed a prompt whose KV load failed.
KV_LOAD_FAILED = "kv-load-failed"

_REMOTE_FIELDS = (  # remote_block_ids first: a push names no blocks
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
