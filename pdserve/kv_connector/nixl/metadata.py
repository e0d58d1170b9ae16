"""Messages of the NixlConnector: scheduler -> workers, handshake, and peer notifications."""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

import msgspec

import pdserve
from pdserve.kv_connector.transport.base import MemoryKind

if TYPE_CHECKING:
    import torch

    from pdserve.config import EngineConfig
    from pdserve.kv_connector.transport.base import Transport

logger = logging.getLogger(__name__)

# Bumped whenever a message below or the KV layout changes meaning.
NIXL_CONNECTOR_VERSION = 4
KV_LAYOUT = "block-major:[blocks,layers,{parts},block_size,kv_heads,head_dim]"


class RecvReqMeta(msgspec.Struct, array_like=True):
    """A request whose KV a decode worker reads from a prefill instance."""

    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    # Host staging: the blocks of the staging buffer the READ lands in (local_block_ids[i]'s
    # bytes in staging_block_ids[i]), copied into the cache once all arrived.
    staging_block_ids: list[int] = msgspec.field(default_factory=list)
    # The prefill instance's incarnation (a restart changes it: re-handshake) and the request's
    # lease on its blocks: (slot, tag) of the prefill side's lease board, read after the data
    # to prove the blocks were still held for it. Empty / (-1, 0): not checked.
    remote_epoch: str = ""
    remote_lease: tuple[int, int] = (-1, 0)


class RemoteAddress(msgspec.Struct, array_like=True):
    """Where a prefill engine's side channel answers, and its TP size."""

    host: str
    port: int
    tp_size: int


class LeaseStamp(msgspec.Struct, array_like=True):
    """Prefill side: write `tag` into the lease board's `slot` (0 clears it)."""

    slot: int
    tag: int


class SaveReqMeta(msgspec.Struct, array_like=True):
    """Host staging, prefill side: copy the cache's `block_ids` into the staging buffer's
    `staging_block_ids` after this step's forward pass (which completes the prompt)."""

    block_ids: list[int]
    staging_block_ids: list[int]


class PushReqMeta(msgspec.Struct, array_like=True):
    """Push mode, prefill side: a request this step computes prompt tokens of. Once the step's
    forward pass ran, its first `num_final_tokens` tokens' KV is final in `block_ids`."""

    transfer_id: str  # what the decode side's registrations name it by
    block_ids: list[int]
    num_prompt_tokens: int
    num_final_tokens: int


class NixlConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True):
    reqs_to_recv: dict[str, RecvReqMeta] = msgspec.field(default_factory=dict)
    # Prefill side: finished requests whose blocks wait for a reader, with their lease expiry
    # (wall clock: the workers are other processes).
    reqs_to_send: dict[str, float] = msgspec.field(default_factory=dict)
    # Decode side: remote engine id -> its request ids still awaited (heartbeats extend leases).
    heartbeats: dict[str, list[str]] = msgspec.field(default_factory=dict)
    reqs_to_save: dict[str, SaveReqMeta] = msgspec.field(default_factory=dict)
    # Decode side: how to reach the engines of `heartbeats`, for a worker that does not know one
    # yet (a request queued before its first read from that engine).
    remote_engines: dict[str, RemoteAddress] = msgspec.field(default_factory=dict)
    # Prefill side: lease board entries to write before this step's forward pass, by request.
    lease_stamps: dict[str, LeaseStamp] = msgspec.field(default_factory=dict)
    # Push mode, prefill side: the requests whose blocks fill this step, and the transfer ids
    # of requests aborted here (their pushes fail).
    reqs_to_push: dict[str, PushReqMeta] = msgspec.field(default_factory=dict)
    push_aborts: list[str] = msgspec.field(default_factory=list)
    # Push mode, decode side: requests aborted while a push into their blocks is awaited (the
    # prefill side stops writing).
    push_cancels: list[str] = msgspec.field(default_factory=list)
    # Decode side: requests that need none of the prefill side's KV after all (a local hit;
    # in push mode also a short rest computed here): an empty read (push: registration) tells
    # it to free, and nothing is reported back.
    declines: dict[str, RecvReqMeta] = msgspec.field(default_factory=dict)


class AgentMetadata(msgspec.Struct, array_like=True):
    """One worker rank's answer to a handshake: how to reach its KV cache and how it is laid out.

    The blocks are those of the region peers read: the KV cache, or its host staging buffer.
    """

    engine_id: str
    tp_rank: int
    tp_size: int
    transport: str
    agent_metadata: bytes
    num_blocks: int
    block_len: int  # bytes of one block, every layer
    block_size: int
    num_kv_heads: int  # of this rank
    head_dim: int
    num_layers: int
    dtype: str
    memory: MemoryKind  # of the region peers read
    # The lease board (int64 per slot, host memory): a finished request's slot holds its tag
    # while its blocks are held for a reader; -1: none.
    board_region: int = -1
    board_slots: int = 0
    # The instance's incarnation; the side channel fills it in when it serves the metadata.
    epoch: str = ""


class HandshakePayload(msgspec.Struct, array_like=True):
    compatibility_hash: str
    agent_metadata: bytes  # an encoded AgentMetadata, decoded only once the hash matched
    # What the hash covers, by name: a peer whose hash differs says which ones differ.
    compatibility_factors: dict[str, str | int] = msgspec.field(default_factory=dict)


class HandshakeRequest(msgspec.Struct, array_like=True):
    tp_rank: int


class Notif(msgspec.Struct, tag="notif", array_like=True):
    """Decode -> prefill over the transport: `done` after a READ (or instead of one), `heartbeat`
    while a request waits for its turn to read (push mode: for its push)."""

    kind: str  # "done" | "heartbeat"
    request_ids: list[str]
    # Readers the prefill side must hear from before it frees (decode TP > prefill TP).
    num_readers: int = 1


class PushRegistration(msgspec.Struct, tag="register", array_like=True):
    """Push mode, a decode rank -> a prefill rank: WRITE the prompt's KV of `transfer_id` into
    these blocks of this rank's region `region` (`block_len` bytes each), which take the
    prompt's last len(block_ids) blocks; then answer `Pushed`. No blocks: nothing to write (a
    full local hit, an abort before admission). `cancel`: stop writing (an abort here)."""

    transfer_id: str
    request_id: str  # the decode side's, which Pushed names
    agent_metadata: bytes  # this rank's transport metadata: the writer learns it
    region: int
    block_ids: list[int]
    block_len: int
    num_registrants: int  # the decode ranks that register with this prefill rank
    cancel: bool = False


class Pushed(msgspec.Struct, tag="pushed", array_like=True):
    """Push mode, prefill rank -> decode rank: every WRITE of the request's registration ended
    (and landed, when `ok`); `reason` says why not, for the request's client."""

    request_id: str
    ok: bool
    reason: str = ""


class PushAlive(msgspec.Struct, tag="alive", array_like=True):
    """Push mode, prefill rank -> decode rank: these requests' registrations are held here and
    their pushes will come (the decode side's watchdog waits on)."""

    request_ids: list[str]


PeerMessage = Notif | PushRegistration | Pushed | PushAlive


def send(transport: Transport, agent: str, msg: msgspec.Struct) -> bool:
    """A message to a peer agent; False (logged) if it could not go: a peer that vanished is
    left to the watchdogs and leases."""
    try:
        transport.send_notif(agent, msgspec.msgpack.encode(msg))
        return True
    except Exception as e:
        logger.warning("Message to %s failed: %s", agent, e)
        return False


def model_factors(config: EngineConfig) -> dict[str, str]:
    """What the engine's configuration adds to the compatibility factors: the architecture, the
    activations' dtype, a state model's state rows, a drafter's KV layers and the weights'
    quantization."""
    mc, spec = config.model_config, config.speculative_config
    return {
        "architecture": mc.architecture,
        "dtype": str(mc.torch_dtype).removeprefix("torch."),
        "state_layout": mc.state_layout,
        "drafter": "none" if spec is None else spec.drafter_layout,
        "quantization": mc.quantization or "none",
        # Calculated scales are the same wherever the setting is (runners/kv_scales.py).
        "kv_scales": "calculated" if config.cache_config.calculate_kv_scales else "1.0",
    }


def compatibility_factors(
    kv_cache: torch.Tensor, tp_size: int, transport: str, model: dict[str, str]
) -> dict[str, str | int]:
    """Both sides of a transfer must agree on all of these, or the bytes mean nothing.

    The layout is the registered cache's own (its geometry is the model's attention layers'),
    with the KV heads counted over the TP group (EngineConfig checks that TP divides them), so
    that instances of different TP sizes agree. A state model's block ends in rows of state
    (models/state_cache.py), counted in num_layers; `state_layout` says what they hold. So
    are a draft model's layers (runners/draft_model.py), which `drafter` names. `quantization`:
    weights in GGUF blocks compute other KV (and tokens) than dequantized ones. The cache's
    dtype (fp8 or the activations') and the activations' are two factors: each changes the
    bytes."""
    _, num_layers, parts, block_size, num_kv_heads, head_dim = kv_cache.shape
    return {
        "pdserve_version": pdserve.__version__,
        "connector_version": NIXL_CONNECTOR_VERSION,
        # 2 parts: a key and a value per KV head; 1: a latent (MLA), the same on every rank.
        "kv_layout": KV_LAYOUT.format(parts=parts),
        "architecture": model["architecture"],
        "dtype": model["dtype"],
        "kv_cache_dtype": str(kv_cache.dtype).removeprefix("torch."),
        "total_kv_heads": num_kv_heads * (tp_size if parts == 2 else 1),
        "head_dim": head_dim,
        "num_layers": num_layers,
        "block_size": block_size,
        "transport": transport,
        # A rank's state rows hold its share of the channels: equal TP sizes only (vLLM's rule
        # for hybrid models).
        "state_layout": (
            f"{model['state_layout']} over TP {tp_size}" if model["state_layout"] else "none"
        ),
        # The decode side's drafter reads the draft KV the prefill side's computed.
        "drafter": model["drafter"],
        "quantization": model["quantization"],
        "kv_scales": model["kv_scales"],
    }


def compatibility_hash(factors: dict[str, str | int]) -> str:
    return hashlib.sha256(repr(tuple(factors.values())).encode()).hexdigest()[:32]


def factor_differences(prefill: dict[str, str | int], decode: dict[str, str | int]) -> str:
    """The factors that differ, as "name: prefill X, decode Y; ..." ("" when the prefill side
    sent none: an older peer)."""
    return "; ".join(
        f"{name}: prefill {prefill[name]}, decode {value}"
        for name, value in decode.items()
        if name in prefill and prefill[name] != value
    )
