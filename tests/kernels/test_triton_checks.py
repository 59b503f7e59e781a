"""The Triton wrappers reject malformed calls with a ValueError naming the argument."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from paged_batch import make_paged_batch, random_q

from kernels.triton import checks


@pytest.fixture
def decode_args() -> dict[str, object]:
    batch = make_paged_batch([4, 9], [1, 1], 2, 16, 4, torch.float32)
    return {
        "q": random_q(2, 4, 16, torch.float32),
        "k_buffer": batch.k_buffer,
        "v_buffer": batch.v_buffer,
        "page_table": batch.page_table,
        "seq_lens": batch.seq_lens,
        "page_size": 4,
        "scale": 0.25,
    }


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        (
            "q",
            lambda a: random_q(2, 3, 16, torch.float32),
            r"q heads \(3\) must be a multiple of KV heads \(2\)",
        ),
        ("q", lambda a: random_q(2, 4, 8, torch.float32), r"q must have shape \[\*, \*, 16\]"),
        ("q", lambda a: a["q"].to(torch.int32), "q must have dtype"),
        (
            "q",
            lambda a: random_q(2, 16, 4, torch.float32).transpose(1, 2),
            "q must be contiguous in its last dim",
        ),
        ("v_buffer", lambda a: a["v_buffer"].half(), "v_buffer must have dtype"),
        ("v_buffer", lambda a: a["v_buffer"][:-1], "v_buffer must have shape"),
        ("page_table", lambda a: a["page_table"].float(), "page_table must have dtype"),
        ("page_table", lambda a: a["page_table"][:1], r"page_table must have shape \[2, \*\]"),
        ("seq_lens", lambda a: a["seq_lens"][:1], r"seq_lens must have shape \[2\]"),
        ("seq_lens", lambda a: [5, 10], "seq_lens must be a torch.Tensor"),
        ("page_size", lambda a: 0, "page_size must be an int >= 1"),
    ],
)
def test_decode_rejects_bad_arguments(
    triton_kernels: SimpleNamespace,
    decode_args: dict[str, object],
    name: str,
    bad: object,
    message: str,
) -> None:
    decode_args[name] = bad(decode_args)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        triton_kernels.decode_attention(**decode_args)


def test_extend_rejects_a_short_qo_indptr(triton_kernels: SimpleNamespace) -> None:
    batch = make_paged_batch([0, 3], [2, 2], 1, 16, 4, torch.float32)
    with pytest.raises(ValueError, match=r"qo_indptr must have shape \[3\]"):
        triton_kernels.extend_attention(
            random_q(4, 2, 16, torch.float32), batch.k_buffer, batch.v_buffer, batch.page_table,
            batch.prefix_lens, batch.extend_lens, batch.qo_indptr[:2], 4, 0.25,
        )  # fmt: skip


def test_store_kv_rejects_mismatched_token_counts(triton_kernels: SimpleNamespace) -> None:
    pool = torch.zeros(8, 2, 16)
    with pytest.raises(ValueError, match=r"slot_idx must have shape \[3\]"):
        triton_kernels.store_kv(
            pool, pool.clone(), torch.ones(3, 2, 16), torch.ones(3, 2, 16), torch.arange(2)
        )


def test_cpu_tensors_need_the_interpreter() -> None:
    compiled_kernel = object()  # what a kernel jitted without TRITON_INTERPRET=1 is not
    with pytest.raises(ValueError, match="need CUDA tensors"):
        checks.check_launchable(torch.device("cpu"), compiled_kernel)
