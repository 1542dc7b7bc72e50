"""Prefix block-hash chains (flying.prefix): cumulative, deterministic across processes, compact in Redis."""

from __future__ import annotations

import subprocess
import sys

from flying.prefix import BLOCK, MAX_BLOCKS, TEXT_BLOCK, block_hashes, decode_chain, encode_chain, key_hash


def test_a_chain_has_one_hash_per_complete_block_up_to_the_cap():
    assert block_hashes(list(range(BLOCK - 1))) == []
    assert len(block_hashes(list(range(3 * BLOCK + 5)))) == 3
    assert len(block_hashes(list(range(200 * BLOCK)))) == MAX_BLOCKS
    assert len(block_hashes(list(range(200 * BLOCK)), cap=100)) == 100
    assert all(0 <= h < 2**64 for h in block_hashes(list(range(10 * BLOCK))))


def test_hashes_are_cumulative_prompts_agree_exactly_on_their_shared_blocks():
    a = list(range(4 * BLOCK))
    b = a[: 2 * BLOCK] + [7] + a[2 * BLOCK + 1 :]  # one token differs in block 2
    ca, cb = block_hashes(a), block_hashes(b)
    assert ca[:2] == cb[:2] and ca[2] != cb[2] and ca[3] != cb[3], "a difference ends the shared prefix"
    c = [9] + a[1:]  # differs in block 0: nothing shared, though blocks 1-3 hold the same ids
    assert not set(block_hashes(c)) & set(ca)
    longer = block_hashes(a + list(range(5 * BLOCK)))
    assert longer[:4] == ca, "a prompt's chain is a prefix of its extension's"


def test_text_prompts_hash_in_byte_blocks_in_their_own_domain():
    text = "system prompt " * 100
    chain = block_hashes(text)
    assert len(chain) == len(text.encode()) // TEXT_BLOCK
    assert block_hashes(text + "user question")[: len(chain)] == chain
    assert block_hashes("x" * (TEXT_BLOCK - 1)) == []


def test_a_cache_key_heads_the_chain_and_partitions_it():
    ids, text = list(range(3 * BLOCK)), "system prompt " * 100
    for prompt in (ids, text):
        plain, keyed = block_hashes(prompt), block_hashes(prompt, key="user-7")
        assert keyed[0] == key_hash("user-7") and len(keyed) == len(plain) + 1
        assert not set(keyed) & set(plain), "a key's blocks are its own"
        other = block_hashes(prompt, key="user-8")
        assert not set(other) & set(keyed), "different keys share nothing, the same prompt included"
        assert block_hashes(prompt, key="user-7") == keyed
    assert block_hashes([1, 2], key="k") == [key_hash("k")], "a prompt shorter than a block: the key alone"
    assert block_hashes(ids + ids, key="k")[:4] == block_hashes(ids, key="k"), "still cumulative"
    assert key_hash("user-7") == PINNED_KEY


def test_chains_are_the_same_in_another_process_and_pinned():
    """The gateway and the router compute and read chains in different processes (str hashing is salted per
    process; these must not be). Pinned values catch a Python whose tuple hash changed."""
    code = "from flying.prefix import block_hashes as b; print(b(list(range(256)))[-1], b('é' * 600)[-1])"
    env_runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": ":".join(sys.path)},
        ).stdout  # fmt: skip
        for seed in ("1", "2")
    ]
    here = f"{block_hashes(list(range(256)))[-1]} {block_hashes('é' * 600)[-1]}\n"
    assert env_runs == [here, here]
    assert block_hashes(list(range(256)))[-1] == PINNED_IDS
    assert block_hashes("é" * 600)[-1] == PINNED_TEXT


def test_encoding_is_compact_and_round_trips():
    chain = block_hashes(list(range(MAX_BLOCKS * BLOCK)))
    text = encode_chain(chain)
    assert text.isascii() and len(text) <= 12 * len(chain)
    assert decode_chain(text) == tuple(chain)
    assert encode_chain([]) == "" and decode_chain("") == ()


PINNED_IDS = 15446048130887238808  # block_hashes(list(range(256)))[-1] on CPython 3.11 (the tuple hash is unchanged since 3.8)
PINNED_TEXT = 1295746137255538768  # block_hashes("é" * 600)[-1]
PINNED_KEY = 9225012871344179377  # key_hash("user-7") (BLAKE2b: the same everywhere)
