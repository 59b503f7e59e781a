"""Tensor parallelism over gloo: two ranks (two processes) give the greedy tokens of one,
across the multi-node launch, and a dead rank fails requests instead of hanging them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runtime import Engine, SamplingParams

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "The quick brown fox", "Q: What is the boiling point of water?\nA:", "import numpy as np\n",
           "Roses are red, violets are"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def greedy_tokens(model: str, **config: Any) -> list[list[int]]:
    with Engine(model=model, num_pages=1024, max_model_len=256, seed=0, **config) as engine:
        return [out.token_ids for out in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("fixture", ["tiny_llama3_dir", "tiny_qwen2_dir"])
def test_tp2_greedy_equals_tp1_on_tiny_models(fixture: str, request: pytest.FixtureRequest) -> None:
    """KV heads replicated (llama3: one KV head), q/k/v bias and a tied head (qwen2); the
    tiny llama (KV heads split) is checked by the dead-rank test before it kills a rank."""
    model = str(request.getfixturevalue(fixture))
    assert greedy_tokens(model, tensor_parallel_size=2, num_threads=1) == greedy_tokens(model, num_threads=1)


def test_tp2_greedy_equals_tp1_on_the_default_model() -> None:
    """9 heads over 3 KV heads: the ranks hold 2 + 1 KV heads (6 + 3 q heads)."""
    assert greedy_tokens("default", tensor_parallel_size=2, num_threads=1) == greedy_tokens(
        "default", weights="fp32", num_threads=1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_two_nodes_on_localhost(tiny_llama_dir: Path) -> None:
    """Node 1 is `arbor serve --node-rank 1` (rank 1 only); node 0 is the engine (rank 0)."""
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", str(tiny_llama_dir),
                              "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                              "--num-pages", "1024", "--max-model-len", "256", "--num-threads", "1"],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        two = greedy_tokens(str(tiny_llama_dir), tensor_parallel_size=2, nnodes=2, node_rank=0,
                            dist_init_addr=addr, num_threads=1)
        assert node1.wait(timeout=60) == 0  # the engine's close stops the remote rank too
    finally:
        if node1.poll() is None:
            node1.kill()
    assert two == greedy_tokens(str(tiny_llama_dir), num_threads=1)


def test_tp2_greedy_equals_tp1_then_a_dead_rank_fails_requests_clearly(tiny_llama_dir: Path) -> None:
    one = greedy_tokens(str(tiny_llama_dir), num_threads=1)
    with Engine(model=str(tiny_llama_dir), tensor_parallel_size=2, num_threads=1, num_pages=1024,
                max_model_len=256, seed=0, dist_timeout_s=10) as engine:
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == one
        [rank1] = engine._tp.procs  # type: ignore[union-attr]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(5)
        started = time.monotonic()
        outs = engine.generate(PROMPTS[:2], GREEDY)
        assert time.monotonic() - started < 15
        assert all(o.error is not None and "tensor-parallel rank failed" in o.error for o in outs)
        again = engine.generate(PROMPTS[:1], GREEDY)[0]  # later requests fail at once too
        assert again.error is not None and "tensor-parallel" in again.error
