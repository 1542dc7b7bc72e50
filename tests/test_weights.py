"""Weight shards as views of the one DP copy: exact Megatron shards, bit-exact restore, no memory growth."""

import itertools

import pytest
import torch

from worker_ext.weights import Dims, LayerWeights, WeightsManager, storage_bytes

DIMS = Dims(num_heads=8, num_kv_heads=4, head_dim=4, intermediate=16)
HIDDEN = 32


def make_layers(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv_rows = (DIMS.num_heads + 2 * DIMS.num_kv_heads) * DIMS.head_dim

    def p(*shape):
        return torch.nn.Parameter(torch.randn(*shape, generator=g), requires_grad=False)

    return [
        LayerWeights(
            p(qkv_rows, HIDDEN),
            p(HIDDEN, DIMS.num_heads * DIMS.head_dim),
            p(2 * DIMS.intermediate, HIDDEN),
            p(HIDDEN, DIMS.intermediate),
        )
        for _ in range(n)
    ]


def snapshot(layers):
    return [
        (lw.qkv.data.clone(), lw.o.data.clone(), lw.gate_up.data.clone(), lw.down.data.clone())
        for lw in layers
    ]


def megatron_shard(full, width, rank):
    """Rank r's shard cut the textbook way from the unfused weights."""
    qkv, o, gu, down = full
    q, kv = DIMS.num_heads * DIMS.head_dim, DIMS.num_kv_heads * DIMS.head_dim
    wq, wk, wv = qkv[:q], qkv[q : q + kv], qkv[q + kv :]
    g, u = gu[: DIMS.intermediate], gu[DIMS.intermediate :]

    def rows(w, r):
        n = w.shape[0] // width
        return w[r * n : (r + 1) * n]

    def cols(w, r):
        n = w.shape[1] // width
        return w[:, r * n : (r + 1) * n]

    return (
        torch.cat([rows(wq, rank), rows(wk, rank), rows(wv, rank)]),
        cols(o, rank),
        torch.cat([rows(g, rank), rows(u, rank)]),
        cols(down, rank),
    )


@pytest.mark.parametrize("width", [2, 4])
def test_each_rank_sees_exactly_its_megatron_shard(width):
    for rank in range(width):
        layers = make_layers()
        before = snapshot(layers)
        WeightsManager(layers, DIMS).activate(width, rank)
        for lw, full in zip(layers, before):
            want = megatron_shard(full, width, rank)
            got = (lw.qkv.data, lw.o.data, lw.gate_up.data, lw.down.data)
            for a, b in zip(got, want):
                assert torch.equal(a, b)


def test_row_parallel_partial_sums_add_up_to_the_dp_result():
    layers = make_layers(1)
    x_attn = torch.randn(5, DIMS.num_heads * DIMS.head_dim)
    full_o = layers[0].o.data.clone()
    for width in (2, 4):
        m = WeightsManager(layers, DIMS)
        total = 0
        cols = x_attn.shape[1] // width
        for rank in range(width):
            m.activate(width, rank)
            total = total + torch.nn.functional.linear(
                x_attn[:, rank * cols : (rank + 1) * cols], layers[0].o.data
            )
        m.release()
        torch.testing.assert_close(total, torch.nn.functional.linear(x_attn, full_o), rtol=1e-5, atol=1e-5)


def test_any_width_sequence_restores_dp_bit_exactly_and_shards_stay_right():
    layers = make_layers()
    dp = snapshot(layers)
    m = WeightsManager(layers, DIMS)
    for width in (1, 2, 4, 2, 1, 4, 1, 4, 2, 2):  # includes direct width changes (2 -> 4, 4 -> 2)
        rank = width - 1
        m.activate(width, rank)
        for lw, full in zip(layers, dp):
            for a, b in zip(
                (lw.qkv.data, lw.o.data, lw.gate_up.data, lw.down.data), megatron_shard(full, width, rank)
            ):
                assert torch.equal(a, b)
    m.release()
    for lw, full in zip(layers, dp):
        for a, b in zip((lw.qkv.data, lw.o.data, lw.gate_up.data, lw.down.data), full):
            assert torch.equal(a, b) and a.is_contiguous()


def test_no_parameter_memory_growth_over_100_cycles():
    layers = make_layers()
    params = lambda: [t for lw in layers for t in (lw.qkv.data, lw.o.data, lw.gate_up.data, lw.down.data)]  # noqa: E731
    before, ptrs = storage_bytes(params()), {t.untyped_storage().data_ptr() for t in params()}
    m = WeightsManager(layers, DIMS)
    for width, rank in itertools.islice(itertools.cycle([(2, 0), (4, 3), (2, 1)]), 100):
        m.activate(width, rank)
        assert storage_bytes(params()) == before
        m.release()
    assert {t.untyped_storage().data_ptr() for t in params()} == ptrs


def test_bad_width_or_rank_is_refused():
    m = WeightsManager(make_layers(), DIMS)
    with pytest.raises(ValueError):
        m.activate(3, 0)
    with pytest.raises(ValueError):
        m.activate(2, 2)
