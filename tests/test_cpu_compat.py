import importlib.util

import torch

from worker_ext.cpu_compat import STANDIN_DIR, sglang_cpu_env
from worker_ext.cpu_compat.install import MARK, guard_source

SAMPLE = """import functools
import torch
@functools.lru_cache(None)
def get_meta_lib():
    pass
@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    pass
@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    pass
"""


def test_guard_wraps_both_decorators_and_is_idempotent():
    once = guard_source(SAMPLE)
    assert MARK in once and "@torch.library.register_fake(" not in once
    assert guard_source(once) == once
    compile(once, "x", "exec")


def _standin():
    spec = importlib.util.spec_from_file_location(
        "sgl_kernel_standin", STANDIN_DIR / "sgl_kernel" / "__init__.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_assign_req_to_token_pool_matches_the_triton_kernel_semantics():
    k = _standin()
    req_to_token = torch.zeros((4, 10), dtype=torch.int32)
    k.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([1, 3]),
        torch.tensor([3, 6]),
        torch.tensor([7, 8, 20, 21, 22]),
        10,
    )
    assert req_to_token[2, 1:3].tolist() == [7, 8]
    assert req_to_token[0, 3:6].tolist() == [20, 21, 22]
    assert int(req_to_token.sum()) == 7 + 8 + 20 + 21 + 22


def test_copy_all_layer_kv_cache_copies_rows_in_every_buffer():
    k = _standin()
    bufs = [torch.arange(12, dtype=torch.float32).reshape(6, 2).clone() for _ in range(2)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs])
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    k.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([0, 5]), torch.tensor([2, 1]))
    for b in bufs:
        assert b[0].tolist() == [4.0, 5.0] and b[5].tolist() == [2.0, 3.0]


def test_unknown_cpu_kernels_fail_only_when_called():
    k = _standin()
    fn = k.some_fused_kernel_cpu
    try:
        fn()
    except NotImplementedError as exc:
        assert "some_fused_kernel_cpu" in str(exc)
    else:
        raise AssertionError("expected NotImplementedError")


def test_cpu_env_puts_the_standin_first():
    env = sglang_cpu_env({"PYTHONPATH": "/x"}, cpu_bind="1")
    assert env["PYTHONPATH"].split(":")[0] == str(STANDIN_DIR)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SGLANG_CPU_OMP_THREADS_BIND"] == "1"
