"""CPU-only stand-in for ``sgl_kernel`` (flying-serving, worker_ext/cpu_compat).

SGLang 0.5.23 imports a few ``*_cpu`` kernels from ``sgl_kernel`` at import time when SGLANG_USE_CPU_ENGINE=1.
No CPU build of sgl_kernel exists on PyPI. This module makes those imports succeed, implements the two kernels the
plain-torch CPU path can reach, and raises NotImplementedError for any other ``*_cpu`` kernel when it is *called*.
It deliberately does not register ``torch.ops.sgl_kernel.convert_weight_packed``, so SGLang's AMX detection stays
False and every layer takes its plain torch path.
"""

from __future__ import annotations

import ctypes

__version__ = "0.0.0+flying.cpu.standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """req_to_token[row_i, start_i:end_i] = out_cache_loc[cumulative slice i] for every request i."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer (raw pointer, row stride in bytes) copy row src_loc[j] to row tgt_loc[j]."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            ctypes.memmove(ptr + tgt * stride, ptr + src * stride, stride)


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU implementation in the flying-serving stand-in; "
            "this code path needs the real sgl_kernel (GPU) or an AMX build"
        )

    kernel.__name__ = name
    return kernel


def __getattr__(name: str):
    if name.endswith("_cpu"):
        return _missing(name)
    raise AttributeError(f"module 'sgl_kernel' (CPU stand-in) has no attribute {name!r}")
