"""One resident weight layout for every width: each rank's shard is a view of it (nothing copied or permuted at
bind or release), and with the activation order undone the GEMMs compute exactly what stock tp=1 / ``--tp d``
compute."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from worker_ext.sglang_patches.model import LayerWeights
from worker_ext.weights import Dims, WeightsManager, storage_bytes

DIMS = Dims(num_heads=8, num_kv_heads=4, head_dim=4, intermediate=16)  # pieces 4: widths 1, 2, 4
HIDDEN = 32
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


def make_layers(n=2, seed=0, dims=DIMS, hidden=HIDDEN, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    qkv_rows = (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim

    def p(*shape):
        return torch.nn.Parameter(torch.randn(*shape, generator=g).to(device), requires_grad=False)

    return [
        LayerWeights(
            p(qkv_rows, hidden),
            p(hidden, dims.num_heads * dims.head_dim),
            p(2 * dims.intermediate, hidden),
            p(hidden, dims.intermediate),
        )
        for _ in range(n)
    ]


def snapshot(layers):
    return [
        (lw.qkv.data.clone(), lw.o.data.clone(), lw.gate_up.data.clone(), lw.down.data.clone())
        for lw in layers
    ]


def megatron_shard(full, width, rank, dims=DIMS):
    """Rank r's shard cut the textbook way from the unfused checkpoint weights."""
    qkv, o, gu, down = full
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    wq, wk, wv = qkv[:q], qkv[q : q + kv], qkv[q + kv :]
    g, u = gu[: dims.intermediate], gu[dims.intermediate :]

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


def effective(m, lw):
    """The shard as the forward sees it: the resident rows put back in order by the activation order (the order
    applied to W^T's columns is exactly what it does to the GEMM output x W^T)."""
    order = m.activation_order(m.width)
    return (
        order.qkv_out(lw.qkv.data.T).T,
        lw.o.data,
        order.gate_up_out(lw.gate_up.data.T).T,
        lw.down.data,
    )


def projections(m, lw, x, x_attn, x_mlp):
    """The four GEMMs of a layer as the patched forward runs them (one GEMM each, then the activation order)."""
    order = m.activation_order(m.width)
    return (
        order.qkv_out(F.linear(x, lw.qkv.data)),
        F.linear(x_attn, lw.o.data),
        order.gate_up_out(F.linear(x, lw.gate_up.data)),
        F.linear(x_mlp, lw.down.data),
    )


@pytest.mark.parametrize("width", [1, 2, 4])
def test_each_rank_sees_exactly_its_megatron_shard(width):
    for rank in range(width):
        layers = make_layers()
        before = snapshot(layers)
        m = WeightsManager(layers, DIMS)
        m.activate(width, rank)
        for lw, full in zip(layers, before):
            for a, b in zip(effective(m, lw), megatron_shard(full, width, rank)):
                assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 3, 8, 64])
def test_dp_mode_gemms_are_bit_identical_to_stock(tokens, device):
    layers = make_layers(device=device)
    stock = snapshot(layers)
    m = WeightsManager(layers, DIMS)
    assert not torch.equal(layers[0].qkv.data, stock[0][0])  # the resident layout is not the checkpoint order
    x, x_attn, x_mlp = (
        torch.randn(tokens, n).to(device) for n in (HIDDEN, DIMS.num_heads * DIMS.head_dim, DIMS.intermediate)
    )
    for lw, (qkv, o, gu, down) in zip(layers, stock):
        want = (F.linear(x, qkv), F.linear(x_attn, o), F.linear(x, gu), F.linear(x_mlp, down))
        for a, b in zip(projections(m, lw, x, x_attn, x_mlp), want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [2, 4])
def test_rank_gemms_are_bit_identical_to_stock_tp_shards(width, device):
    layers = make_layers(1, device=device)
    stock = snapshot(layers)[0]
    m = WeightsManager(layers, DIMS)
    x = torch.randn(8, HIDDEN).to(device)
    for rank in range(width):
        m.activate(width, rank)
        qkv, _, gu, _ = megatron_shard(stock, width, rank)
        x_attn, x_mlp = (
            torch.randn(8, DIMS.q_rows // width).to(device),
            torch.randn(8, 16 // width).to(device),
        )
        ours = projections(m, layers[0], x, x_attn, x_mlp)
        assert torch.equal(ours[0], F.linear(x, qkv)) and torch.equal(ours[2], F.linear(x, gu))


def mlp(m, lw, x):
    """A Llama MLP through the patched projections (SiLU(gate) * up, then down)."""
    order = m.activation_order(m.width)
    gu = order.gate_up_out(F.linear(x, lw.gate_up.data))
    n = gu.shape[-1] // 2
    return F.linear(F.silu(gu[..., :n]) * gu[..., n:], lw.down.data)


def test_row_parallel_partial_sums_add_up_to_the_dp_result():
    layers = make_layers(1)
    stock = snapshot(layers)[0]
    x = torch.randn(5, HIDDEN)
    gu = F.linear(x, stock[2])
    want = F.linear(F.silu(gu[:, : DIMS.intermediate]) * gu[:, DIMS.intermediate :], stock[3])
    m = WeightsManager(layers, DIMS)
    assert torch.equal(mlp(m, layers[0], x), want)  # DP mode: exact
    for width in (2, 4):
        total = 0
        for rank in range(width):
            m.activate(width, rank)
            total = total + mlp(m, layers[0], x)
        m.release()
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_switches_copy_or_permute_nothing_and_any_width_sequence_stays_right():
    layers = make_layers()
    stock = snapshot(layers)
    m = WeightsManager(layers, DIMS)
    resident = snapshot(layers)
    versions = [t._version for full in m.full for t in full]  # bumped by any in-place write
    for width in (1, 2, 4, 2, 1, 4, 1, 4, 2, 2):  # includes direct width changes (2 -> 4, 4 -> 2)
        rank = width - 1
        m.activate(width, rank)
        for lw, full in zip(layers, stock):
            for a, b in zip(effective(m, lw), megatron_shard(full, width, rank)):
                assert torch.equal(a, b)
    m.release()
    assert [t._version for full in m.full for t in full] == versions
    for lw, res, full in zip(layers, resident, stock):
        for a, b in zip((lw.qkv.data, lw.o.data, lw.gate_up.data, lw.down.data), res):
            assert torch.equal(a, b) and a.is_contiguous()
        for a, b in zip(effective(m, lw), full):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_shards_are_views_of_the_resident_weights(device):
    layers = make_layers(device=device)
    m = WeightsManager(layers, DIMS)
    for width, rank in ((2, 1), (4, 2)):
        m.activate(width, rank)
        for lw, full in zip(layers, m.full):
            for view, whole in zip((lw.qkv.data, lw.o.data, lw.gate_up.data, lw.down.data), full):
                assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        assert all(lw.qkv.data.is_contiguous() and lw.gate_up.data.is_contiguous() for lw in layers)


@pytest.mark.parametrize("device", DEVICES)
def test_no_parameter_memory_growth_over_100_cycles(device):
    layers = make_layers(device=device)
    params = lambda: [t for lw in layers for t in (lw.qkv.data, lw.o.data, lw.gate_up.data, lw.down.data)]  # noqa: E731
    before, ptrs = storage_bytes(params()), {t.untyped_storage().data_ptr() for t in params()}
    m = WeightsManager(layers, DIMS)
    assert storage_bytes(params()) == before  # the load-time reorder is in place
    held = torch.cuda.memory_allocated() if device == "cuda" else 0
    for width, rank in itertools.islice(itertools.cycle([(2, 0), (4, 3), (2, 1)]), 100):
        m.activate(width, rank)
        assert storage_bytes(params()) == before
        m.release()
    assert {t.untyped_storage().data_ptr() for t in params()} == ptrs
    if device == "cuda":  # nothing allocated on the device by a switch, not even transiently kept
        assert torch.cuda.memory_allocated() == held


def test_a_width_3_model_shards_at_every_divisor_of_its_pieces():
    dims = Dims(num_heads=12, num_kv_heads=6, head_dim=2, intermediate=24)
    assert dims.pieces == 6
    layers = make_layers(1, dims=dims, hidden=8)
    stock = snapshot(layers)[0]
    m = WeightsManager(layers, dims)
    for width in (1, 2, 3, 6):
        for rank in range(width):
            m.activate(width, rank)
            for a, b in zip(effective(m, layers[0]), megatron_shard(stock, width, rank, dims)):
                assert torch.equal(a, b)


def test_bad_width_or_rank_is_refused():
    m = WeightsManager(make_layers(), DIMS)
    with pytest.raises(ValueError):
        m.activate(3, 0)
    with pytest.raises(ValueError):
        m.activate(2, 2)
