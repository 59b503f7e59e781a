"""The dispatcher: device-based choice, and ``set_kernel_backend`` forcing an implementation."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from paged_batch import make_paged_batch, random_q

import kernels
from kernels import dispatch, reference
from kernels.cpu import NativeBuildError


@pytest.fixture(autouse=True)
def _restore_auto_backend() -> Iterator[None]:
    yield
    kernels.set_kernel_backend("auto")


def _spy(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> list[int]:
    """Wrap ``module.name`` so each call is recorded; returns the call log."""
    mod = importlib.import_module(module)
    real: Callable[..., Any] = getattr(mod, name)
    calls: list[int] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, name, wrapper)
    return calls


def test_auto_uses_torch_on_cpu_and_triton_on_cuda(no_native_cpu_kernels: None) -> None:
    assert kernels.get_kernel_backend(torch.device("cpu")) == "torch"
    assert kernels.get_kernel_backend(torch.device("cuda", 0)) == "triton"
    with pytest.raises(ValueError, match="not built"):
        kernels.set_kernel_backend("cpu")


def test_auto_uses_the_native_kernels_on_cpu_once_built(
    cpu_kernels: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    assert kernels.get_kernel_backend(torch.device("cpu")) == "cpu"
    assert kernels.get_kernel_backend(torch.device("cuda", 0)) == "triton"
    batch = make_paged_batch([5, 20], [1, 1], 2, 32, 16, torch.float32)
    q = random_q(2, 4, 32, torch.float32)
    args = (q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens, 16, 0.2)
    torch_calls = _spy(monkeypatch, "kernels.reference", "decode_attention")
    native_out = kernels.decode_attention(*args)
    assert len(torch_calls) == 0
    kernels.set_kernel_backend("torch")
    torch.testing.assert_close(native_out, kernels.decode_attention(*args), atol=1e-5, rtol=1e-5)
    assert len(torch_calls) == 1


def test_forced_backend_wins_over_the_device() -> None:
    kernels.set_kernel_backend("torch")
    assert kernels.get_kernel_backend(torch.device("cuda", 0)) == "torch"
    kernels.set_kernel_backend("triton")
    assert kernels.get_kernel_backend(torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.set_kernel_backend("cuda")  # type: ignore[arg-type]


def test_forcing_triton_runs_the_triton_kernels_on_cpu_tensors(
    triton_kernels: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, no_native_cpu_kernels: None
) -> None:
    batch = make_paged_batch([5, 20], [1, 1], 2, 32, 16, torch.float32)
    q = random_q(2, 4, 32, torch.float32)
    args = (q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens, 16, 0.2)
    triton_calls = _spy(monkeypatch, "kernels.triton.decode_attention", "decode_attention")
    torch_calls = _spy(monkeypatch, "kernels.reference", "decode_attention")

    auto_out = kernels.decode_attention(*args)
    assert (len(torch_calls), len(triton_calls)) == (1, 0)
    kernels.set_kernel_backend("triton")
    forced_out = kernels.decode_attention(*args)
    assert (len(torch_calls), len(triton_calls)) == (1, 1)
    torch.testing.assert_close(forced_out, auto_out, atol=1e-5, rtol=1e-5)


def test_forced_triton_routes_every_op(
    triton_kernels: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels.set_kernel_backend("triton")
    calls = {
        op: _spy(monkeypatch, f"kernels.triton.{op}", op)
        for op in ("store_kv", "extend_attention", "rms_norm")
    }
    batch = make_paged_batch([3], [4], 1, 16, 1, torch.float32)
    q = random_q(4, 2, 16, torch.float32)
    kernels.store_kv(batch.k_buffer, batch.v_buffer, q[:, :1], q[:, 1:], torch.tensor([1, 2, 3, 4]))
    kernels.extend_attention(
        q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.prefix_lens,
        batch.extend_lens, batch.qo_indptr, 1, 0.25,
    )  # fmt: skip
    out = kernels.rms_norm(q, torch.ones(16), 1e-6)
    assert {op: len(c) for op, c in calls.items()} == {
        "store_kv": 1,
        "extend_attention": 1,
        "rms_norm": 1,
    }
    torch.testing.assert_close(out, reference.rms_norm(q, torch.ones(16), 1e-6))


def test_a_failed_cpu_kernel_build_keeps_the_reference_and_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatch, "_cpu", None)
    monkeypatch.setattr(dispatch, "_cpu_build_error", None)
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    runs = _spy(monkeypatch, "subprocess", "run")
    for _ in range(2):
        with pytest.raises(NativeBuildError, match="false failed"):
            kernels.enable_cpu_kernels(tmp_path)
    assert len(runs) == 1
    assert kernels.get_kernel_backend(torch.device("cpu")) == "torch"
