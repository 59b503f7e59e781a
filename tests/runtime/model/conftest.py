"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

import kernels
from kernels.cpu import NativeBuildError


@pytest.fixture(scope="module")
def cpu_kernels_enabled(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The C kernels on, as every CPU engine turns them on (the reference quantizes no
    activations and dequantizes each weight on every call)."""
    try:
        kernels.enable_cpu_kernels(tmp_path_factory.mktemp("kernels"))
    except NativeBuildError as exc:
        if "no C compiler" not in str(exc):
            raise  # a kernel that does not build is a failure, not a missing environment
        pytest.skip(f"environment: {exc}")
