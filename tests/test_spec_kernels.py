"""vLLM 0.32's CPU fallback of the rejection sampler's `expand_kernel` writes nothing
into a float or int32 output, so sampling steps that verify drafts read uninitialised
temperatures; rpk's torch version (`rpk.sync.worker.spec.expand_reference`), installed
through vLLM's kernel-override registry, writes what the Triton kernel does."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rpk.sync.worker.spec import expand_reference

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _reference(x: torch.Tensor, cu: list[int], replace_from: float, replace_to: float) -> torch.Tensor:
    """The Triton kernel's semantics, written out request by request."""
    out, start = [], 0
    for value, end in zip(x.tolist(), cu):
        out += [replace_to if value == replace_from else value] * (end - start)
        start = end
    return torch.tensor(out, dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_reference_writes_each_requests_value_over_its_tokens(dtype: torch.dtype) -> None:
    x = torch.tensor([3, 1, 7, 1], dtype=dtype)
    cu = [2, 2, 5, 6]
    out = torch.full((8,), -9, dtype=dtype)
    expand_reference(out, x, torch.tensor(cu, dtype=torch.int32), 1, 4)
    assert torch.equal(out[:6], _reference(x, cu, 1, 4))
    assert torch.equal(out[6:], torch.full((2,), -9, dtype=dtype))  # past the last token: untouched


@needs_vllm
def test_the_override_corrects_vllms_cpu_fallback() -> None:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        pytest.skip("vLLM's CPU fallbacks are registered only on CPU without Triton")
    from vllm.v1.sample import rejection_sampler as rs

    from rpk.sync.worker.spec import install_cpu_kernels

    temperatures = torch.tensor([0.7, 1.0, -1.0], dtype=torch.float32)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    want = _reference(temperatures, [2, 5, 6], -1.0, 1.0)
    current_platform.register_triton_kernel_overrides()  # what each vLLM worker does at start
    assert install_cpu_kernels() in ("registry", "rebound")
    for _ in range(3):
        assert torch.equal(rs.expand_batch_to_tokens(temperatures, cu, 6, replace_from=-1, replace_to=1), want)
    top_k = torch.tensor([5, 7], dtype=torch.int32)
    got = rs.expand_batch_to_tokens(top_k, torch.tensor([1, 3], dtype=torch.int32), 3)
    assert got.tolist() == [5, 7, 7]


@needs_vllm
def test_the_override_goes_in_when_vllms_registry_scan_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's registry rebinds by scanning every loaded module, and trips over some
    (llvmlite's, once numba is loaded): the override then rebinds the kernel's holders
    itself, and checks that it took."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON, dispatcher

    if not current_platform.is_cpu() or HAS_TRITON:
        pytest.skip("vLLM's CPU fallbacks are registered only on CPU without Triton")
    from vllm.v1.sample import rejection_sampler as rs

    from rpk.sync.worker.spec import install_cpu_kernels

    current_platform.register_triton_kernel_overrides()

    def broken(overrides: object) -> None:
        raise AttributeError("'_lib_fn_wrapper' object has no attribute 'get'")

    monkeypatch.setattr(dispatcher, "register_kernels", broken)
    assert install_cpu_kernels() == "rebound"
    got = rs.expand_batch_to_tokens(torch.tensor([0.7, 1.0]), torch.tensor([2, 3], dtype=torch.int32), 3)
    assert got.tolist() == pytest.approx([0.7, 0.7, 1.0])
