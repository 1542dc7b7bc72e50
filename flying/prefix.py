"""Prompt prefixes as chains of cumulative block hashes: what cache-aware dispatch (router.prefix_index,
router.policy) matches against what each engine was sent.

A prompt's chain holds one 64-bit hash per complete block of ``BLOCK`` token ids (at most ``MAX_BLOCKS``); hash
``k`` covers blocks ``0..k``, so two prompts share their first ``k + 1`` blocks exactly when their chains agree at
``k`` (up to collisions). The gateway computes it at admission (``QueuedRequest.prefix``, encoded by
:func:`encode_chain`: base64 of little-endian u64, 11 characters a block), the router and the simulator decode it.

Deterministic across processes: token blocks hash as CPython's tuple hash of ints (xxHash-based since 3.8; an int
hashes to itself modulo 2**61 - 1, never salted, unlike str and bytes), so the gateway and the router must run the
same Python minor version (one image); ``tests/test_prefix.py`` pins known values. A text prompt without ids (a
completion's string) hashes its UTF-8 bytes in ``TEXT_BLOCK``-byte blocks with BLAKE2b, in its own domain.

A client's cache key (OpenAI's ``prompt_cache_key``) heads the chain: its hash (:func:`key_hash`, BLAKE2b in a
domain of its own) comes first and seeds the blocks' hashes, so requests with the same key share at least the
chain's first entry (the router follows it: router.dp_dispatch), and requests with different keys share nothing.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import struct
from collections.abc import Sequence

BLOCK = 64  # token ids per block
TEXT_BLOCK = 256  # bytes per block of a text prompt (about 64 tokens of English)
MAX_BLOCKS = 64  # a chain covers at most this many blocks (4,096 tokens)
_MASK = (1 << 64) - 1
_SEED = 0x666C79696E67  # "flying": the chain of token ids starts here


def block_hashes(
    prompt: Sequence[int] | str, block: int = BLOCK, cap: int = MAX_BLOCKS, key: str | None = None
) -> list[int]:
    """The prompt's chain: one cumulative 64-bit hash per complete block, at most ``cap`` (a prompt shorter than
    one block has none). ``prompt``: token ids, or text (hashed in ``TEXT_BLOCK``-byte blocks). With a cache
    ``key``, the key's hash comes first and seeds the rest (``cap`` blocks after it)."""
    seed = _SEED if key is None else key_hash(key)
    if isinstance(prompt, str):
        chain = _text_hashes(prompt.encode(), cap, None if key is None else seed)
    else:
        n = min(len(prompt) // block, cap) * block
        chain, h = [], seed
        for i in range(0, n, block):
            h = hash((h, *prompt[i : i + block])) & _MASK
            chain.append(h)
    return chain if key is None else [seed, *chain]


def key_hash(key: str) -> int:
    """A cache key's 64-bit hash (the head of its requests' chains)."""
    return int.from_bytes(
        hashlib.blake2b(key.encode(), digest_size=8, person=b"flying-key").digest(), "little"
    )


def _text_hashes(data: bytes, cap: int, seed: int | None = None) -> list[int]:
    n = min(len(data) // TEXT_BLOCK, cap) * TEXT_BLOCK
    h = hashlib.blake2b(digest_size=8, person=b"flying-text")
    if seed is not None:
        h.update(seed.to_bytes(8, "little"))
    out = []
    for i in range(0, n, TEXT_BLOCK):
        h.update(data[i : i + TEXT_BLOCK])
        out.append(int.from_bytes(h.digest(), "little"))
    return out


def encode_chain(chain: Sequence[int]) -> str:
    """A chain as ASCII for the request record (empty chain: "")."""
    return base64.b64encode(struct.pack(f"<{len(chain)}Q", *chain)).decode() if chain else ""


@functools.lru_cache(maxsize=8192)
def decode_chain(text: str) -> tuple[int, ...]:
    """:func:`encode_chain` undone (cached: the router reads a waiting request's chain every round)."""
    if not text:
        return ()
    raw = base64.b64decode(text)
    return struct.unpack(f"<{len(raw) // 8}Q", raw)
