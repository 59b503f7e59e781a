"""Kernel tests: the Triton kernels run on CPU tensors through Triton's interpreter.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a kernel, i.e. when a
``kernels.triton.*`` module is imported. So each test module that uses the
``triton_kernels`` fixture gets, for its duration:

1. ``TRITON_INTERPRET=1`` in the environment and freshly imported ``kernels.triton.*``
   modules (interpreted kernels; the dispatcher imports from the same ``sys.modules``);
2. on teardown, the variable restored and those modules dropped again, so the rest of the
   suite (and a GPU run of it) imports compiled kernels, untouched by these tests.

If this environment's Triton cannot interpret a probe kernel on the CPU
(``interpreter_probe.py``: a Triton build or platform without the interpreter), every test
using the fixture skips, saying so; a kernel module of ours that fails to import is an error,
not a skip.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kernels import dispatch
from kernels.cpu import CpuDecodeAttention, CpuKernels, NativeBuildError

TRITON_KERNEL_MODULES = ("store_kv", "decode_attention", "extend_attention", "rms_norm", "grouped_experts")


def _drop_triton_modules() -> None:
    for name in [
        m for m in sys.modules if m.startswith("kernels.triton.") or m == "interpreter_probe"
    ]:
        del sys.modules[name]


def _interpreter_unavailable() -> str | None:
    """Why Triton's interpreter cannot run here, or None if a probe kernel works."""
    try:
        probe = importlib.import_module("interpreter_probe")
        return None if probe.interpreter_works() else "the probe kernel computed wrong values"
    except Exception as exc:  # any failure here means "no interpreter", not a kernel bug
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="module")
def triton_kernels() -> Iterator[SimpleNamespace]:
    """The Triton ops (``.store_kv``, ``.decode_attention``, ...) in interpreter mode."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _drop_triton_modules()
    try:
        reason = _interpreter_unavailable()
        if reason is not None:
            pytest.skip(f"environment: this Triton cannot interpret kernels on the CPU ({reason})")
        mods = [importlib.import_module(f"kernels.triton.{n}") for n in TRITON_KERNEL_MODULES]
        yield SimpleNamespace(
            **{n: getattr(m, n) for n, m in zip(TRITON_KERNEL_MODULES, mods, strict=True)}
        )
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
        _drop_triton_modules()


@pytest.fixture(scope="session")
def cpu_kernels(tmp_path_factory: pytest.TempPathFactory) -> CpuKernels:
    """The native CPU kernels, built into a fresh cache directory (this also tests the
    build). Skips where no C compiler exists."""
    try:
        return CpuKernels.build(tmp_path_factory.mktemp("kernel-cache"))
    except NativeBuildError as exc:
        if "no C compiler" in str(exc):
            pytest.skip(f"environment: {exc}")
        raise


@pytest.fixture(scope="session")
def cpu_decode(cpu_kernels: CpuKernels) -> CpuDecodeAttention:
    return cpu_kernels.decode_attention


@pytest.fixture()
def no_native_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher as in a process that never built the native CPU kernels (an engine
    built earlier in the session enables them process-wide)."""
    monkeypatch.setattr(dispatch, "_cpu", None)
