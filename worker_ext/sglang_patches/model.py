"""The SGLang model internals a bind touches (pinned: ``SUPPORTED_SGLANG``): attention head counts per width, the
row-parallel layers' reduction group, and the two fused projections whose outputs come back to stock column order
(worker_ext.weights: the resident layout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from worker_ext.sglang_patches import require
from worker_ext.weights import ActivationOrder, Dims

if TYPE_CHECKING:
    from worker_ext.sequence_parallel import SPStep


def dims(layers: list[Any]) -> Dims:
    a0 = layers[0].self_attn
    return Dims(a0.num_heads, a0.num_kv_heads, a0.head_dim, layers[0].mlp.down_proj.weight.shape[1])


@dataclass
class LayerWeights:
    """One decoder layer's four sharded parameters (worker_ext.weights.LayerParams): the views a width computes
    with are set on SGLang's parameters here, and only here."""

    qkv: torch.nn.Parameter
    o: torch.nn.Parameter
    gate_up: torch.nn.Parameter
    down: torch.nn.Parameter

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv.data, self.o.data, self.gate_up.data, self.down.data

    def point(self, qkv: torch.Tensor, o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.qkv.data, self.o.data, self.gate_up.data, self.down.data = qkv, o, gate_up, down


def layer_weights(layer: Any) -> LayerWeights:
    """The fused column-parallel (qkv, gate_up) and row-parallel (o, down) weights of one decoder layer."""
    a, m = layer.self_attn, layer.mlp
    return LayerWeights(a.qkv_proj.weight, a.o_proj.weight, m.gate_up_proj.weight, m.down_proj.weight)


def apply_resident_layout(layer: Any, order: ActivationOrder) -> None:
    """Wrap the layer's fused QKV and gate_up projections so that their outputs are restored to stock column order
    (``order``, replaced per width by :func:`set_width`) before SGLang splits them into q, k, v and gate, up."""
    a, m = layer.self_attn, layer.mlp
    for proj, name in ((a.qkv_proj, "qkv_out"), (m.gate_up_proj, "gate_up_out")):
        require(
            getattr(proj, "bias", None) is None, "fused projection with a bias: not in the resident layout"
        )
        assert not hasattr(proj, "flying_order"), "resident layout applied twice"
        proj.forward = _ordered(proj, proj.forward, name)
    dual_gemm = getattr(getattr(m, "dual_gemm", None), "mode", None)
    require(dual_gemm is None, "a fused gate_up+down kernel would read the resident layout")
    set_order(layer, order)


def _ordered(proj: Any, forward: Any, name: str) -> Any:
    def ordered(x: Any) -> tuple[Any, Any]:
        out, bias = forward(x)
        return getattr(proj.flying_order, name)(out), bias

    return ordered


def set_order(layer: Any, order: ActivationOrder) -> None:
    layer.self_attn.qkv_proj.flying_order = order
    layer.mlp.gate_up_proj.flying_order = order


def row_parallel_layers(layer: Any) -> tuple[Any, Any]:
    return layer.self_attn.o_proj, layer.mlp.down_proj


def row_parallel_state(layer: Any) -> list[tuple[Any, bool]]:
    """The DP (width 1) reduction group and flag of the layer's row-parallel projections, to restore later."""
    return [(m.tp_group, m.reduce_results) for m in row_parallel_layers(layer)]


def set_width(
    layer: Any,
    num_heads: int,
    num_kv_heads: int,
    width: int,
    group: Any,
    dp_state: list,
    order: ActivationOrder,
) -> None:
    """Head counts and activation order for ``width`` and the row-parallel reduction: over ``group`` while bound
    (at width 1 SGLang builds the layer's stage boundaries without an all-reduce, so the row-parallel layers do
    their own), the DP state ``dp_state`` otherwise."""
    set_order(layer, order)
    a = layer.self_attn
    a.num_heads, a.num_kv_heads = num_heads // width, num_kv_heads // width
    a.q_size, a.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    a.attn.tp_q_head_num, a.attn.tp_k_head_num, a.attn.tp_v_head_num = (
        a.num_heads,
        a.num_kv_heads,
        a.num_kv_heads,
    )
    set_row_parallel(layer, group, dp_state)


def set_row_parallel(layer: Any, group: Any, dp_state: list) -> None:
    """The row-parallel projections reduce over ``group``, or (None) as in DP."""
    for m, (tp_group, reduce) in zip(row_parallel_layers(layer), dp_state):
        m.tp_group, m.reduce_results = (group, True) if group is not None else (tp_group, reduce)


# --- sequence-parallel steps (worker_ext.sequence_parallel) ----------------------------------------------------


def apply_sp_attention(layer: Any, step: SPStep, q_size: int, kv_size: int) -> None:
    """The layer's attention for an SP step: the full QKV projection of this member's tokens, rotary on their
    positions, the all-to-all to every token of this member's heads, SGLang's own attention over the TP KV view
    (head counts stay at the group's width), the all-to-all back and the full o_proj (no reduction). Undone by
    :func:`remove_sp_attention`."""
    a = layer.self_attn
    require(all(hasattr(a, n) for n in ("qkv_proj", "rotary_emb", "attn", "o_proj")), "LlamaAttention layout")

    def forward(positions: Any, hidden_states: Any, forward_batch: Any) -> Any:
        qkv, _ = a.qkv_proj(hidden_states)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = a.rotary_emb(positions, q, k)
        q, k, v = step.heads_of_all_tokens(q, k, v)
        out = a.attn(q, k, v, forward_batch)
        output, _ = a.o_proj(step.tokens_of_all_heads(out))
        return output

    a.forward = forward


def remove_sp_attention(layer: Any) -> None:
    layer.self_attn.__dict__.pop("forward", None)


def apply_sp_stack(stack: Any, step: SPStep) -> None:
    """The decoder stack (``LlamaModel``) for an SP step: its layers and final norm run this member's slice of the
    tokens; the hidden states are all-gathered after the norm, so the logits see every token. Undone by
    :func:`remove_sp_stack`."""
    original = type(stack).forward

    def forward(
        input_ids: Any,
        positions: Any,
        forward_batch: Any,
        input_embeds: Any = None,
        pp_proxy_tensors: Any = None,
    ) -> Any:
        lo, hi = step.begin(int(positions.shape[0]))
        embeds = None if input_embeds is None else input_embeds[lo:hi]
        ids = None if input_ids is None else input_ids[lo:hi]
        hidden = original(
            stack, ids, positions[lo:hi], forward_batch, embeds, pp_proxy_tensors=pp_proxy_tensors
        )
        require(
            not isinstance(hidden, tuple), "SP steps need a decoder stack without auxiliary hidden states"
        )
        return step.gather(hidden)

    stack.forward = forward


def remove_sp_stack(stack: Any) -> None:
    stack.__dict__.pop("forward", None)
