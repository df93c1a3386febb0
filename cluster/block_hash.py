"""The keys of full KV blocks, shared by the nodes' prefix caches and the coordinator's routing:
a 128-bit hash chained over (parent block's hash, this block's token ids), stable across
processes, so the coordinator computes the keys a node caches under."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block given its parent's hash: 128-bit and stable across processes."""
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def group_hash(block_hash: int, group: int) -> int:
    """The key a block of KV group `group` is cached under: group 0's is the block's hash
    itself (what the coordinator's prefix index and the tiers know), another group's the hash
    salted with the group, so equal tokens in two groups name two pages."""
    if group == 0:
        return block_hash
    h = hashlib.blake2b(digest_size=16)
    h.update(block_hash.to_bytes(16, "little"))
    h.update(group.to_bytes(4, "little"))
    return int.from_bytes(h.digest(), "little")


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of a prompt's full blocks, as a node's block manager computes them."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
