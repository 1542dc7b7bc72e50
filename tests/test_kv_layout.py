"""The KV block-size adaptor over SGLang's own token allocator: per-request layouts in one pool."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from worker_ext.kv_layout import SubSlotAllocator, view

H, D, SIZE = 4, 3, 64


def pool():
    return torch.zeros(SIZE + 1, H, D), TokenToKVPoolAllocator(
        SIZE, torch.float32, "cpu", None, need_sort=False
    )


def test_view_is_the_same_bytes_as_heads_of_physical_slots():
    buf = torch.arange((SIZE + 1) * H * D, dtype=torch.float32).view(SIZE + 1, H, D)
    v = view(buf, 2)
    assert v.shape == ((SIZE + 1) * 2, H // 2, D) and v.data_ptr() == buf.data_ptr()
    assert torch.equal(v[7 * 2 + 1], buf[7, 2:4])  # virtual slot p*d+j = heads j*H/d.. of physical slot p


def test_tp_requests_get_width_times_the_tokens():
    _, base = pool()
    sub = SubSlotAllocator(base, 4)
    assert sub.available_size() == 4 * SIZE
    got = sub.alloc(4 * SIZE)
    assert got is not None and len(set(got.tolist())) == 4 * SIZE
    assert sub.alloc(1) is None and base.available_size() == 0
    sub.free(got)
    assert base.available_size() == SIZE and sub.physical_in_use() == 0


def test_dp_and_tp_requests_coexist_and_free_back_to_one_allocator():
    _, base = pool()
    dp = base.alloc(10)  # a paused DP request keeps its physical slots
    sub = SubSlotAllocator(base, 2)
    a, b = sub.alloc(3), sub.alloc(3)  # two TP requests may share a physical slot, never a virtual one
    assert set(a.tolist()).isdisjoint(b.tolist())
    phys = {v // 2 for v in a.tolist() + b.tolist()}
    assert phys.isdisjoint(dp.tolist()) and len(phys) == 3
    sub.free(a)
    assert base.available_size() == SIZE - 10 - 2  # the shared slot stays until b frees it
    sub.free(b)
    assert base.available_size() == SIZE - 10


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=8), st.integers(1, 20))
def test_slot_written_is_slot_read_for_any_width_sequence(widths, tokens):
    """Each episode writes every token of a request through its width's view and reads it back through the same
    view; earlier episodes' tokens (other widths, still resident) must be untouched."""
    buf, base = pool()
    resident = []  # (width, slots, values) of earlier requests, kept allocated
    for i, w in enumerate(widths):
        alloc = SubSlotAllocator(base, w) if w > 1 else base
        slots = alloc.alloc(tokens)
        if slots is None:
            break
        vals = torch.full((tokens, H // w, D), float(i + 1)) + torch.arange(tokens).view(-1, 1, 1)
        view(buf, w)[slots] = vals  # write (set_kv_buffer)
        resident.append((w, slots, vals))
        for rw, rs, rv in resident:  # read (attention gathers k_cache[req_to_token[...]])
            assert torch.equal(view(buf, rw)[rs], rv)


def test_keep_back_lowers_the_reported_room_but_not_what_can_be_carved():
    _, base = pool()
    alloc = SubSlotAllocator(base, 2)
    assert alloc.available_size() == 2 * SIZE
    alloc.keep_back(5)
    assert alloc.available_size() == 2 * SIZE - 5
    # carved to the last slot: the reserve shows as a deficit, so that SGLang's eviction (asked for
    # need - available) frees what it covers too
    assert alloc.alloc(2 * SIZE) is not None and alloc.available_size() == -5
    alloc.keep_back(-3)
    assert alloc.available_size() == 0
