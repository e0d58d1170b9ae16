"""Chained hashes of full KV cache blocks: the keys of the prefix cache."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import msgspec

from pdserve.request import Request

_encode = msgspec.msgpack.Encoder().encode
# BLAKE2s-256: a cryptographic hash, as long as sha256's, in about 60% of its instructions
# (a decode step hashes one block in every block_size for each request).
_hash = hashlib.blake2s

# Parent of the first block. A constant rather than vLLM's per-process random value, so that
# every process (and every instance) computes the same hash for the same tokens.
NONE_HASH: bytes = _hash(b"pdserve.prefix_cache.none_hash").digest()


def hash_block_tokens(
    parent_block_hash: bytes | None,
    block_token_ids: Sequence[int],
    extra_keys: tuple[str, ...] | None = None,
) -> bytes:
    """Hash of (parent hash, tokens, extra keys), vLLM's tuple: equal hashes mean equal whole
    prefixes, not just blocks, under the same extra keys."""
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    return _hash(_encode((parent, block_token_ids, extra_keys))).digest()


def extend_block_hashes(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> None:
    """Append the hashes of the full blocks of `token_ids` past those in `block_hashes`."""
    first_end = (len(block_hashes) + 1) * block_size
    num_tokens = len(token_ids)
    if first_end > num_tokens:
        return
    if block_hashes:
        parent = block_hashes[-1]
    else:
        # The salt enters the first block only (vLLM's generate_block_hash_extra_keys): every
        # later block chains from it, so only requests with the same salt share a cached block.
        extra_keys = None if cache_salt is None else (cache_salt,)
        parent = hash_block_tokens(None, token_ids[:block_size], extra_keys)
        block_hashes.append(parent)
        first_end += block_size
    for end in range(first_end, num_tokens + 1, block_size):
        # hash_block_tokens without extra keys, inlined.
        parent = _hash(_encode((parent, token_ids[end - block_size : end], None))).digest()
        block_hashes.append(parent)


def request_block_hasher(block_size: int) -> Callable[[Request], None]:
    """A function that extends `request.block_hashes` with the blocks filled since its last call."""

    def hash_new_full_blocks(request: Request) -> None:
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, block_size, request.cache_salt
        )

    return hash_new_full_blocks
