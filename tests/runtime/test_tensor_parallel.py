"""Tensor parallelism over gloo: two ranks (two processes) give the greedy tokens of one,
across the multi-node launch, and a dead rank fails requests instead of hanging them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from runtime import Engine, SamplingParams
from runtime.errors import EngineFailedError

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
        deadline = time.monotonic() + 5
        while engine.failure is None and time.monotonic() < deadline:  # the watcher sees it idle
            time.sleep(0.05)
        assert engine.failure is not None and "rank1" in engine.failure and "signal 9" in engine.failure
        with pytest.raises(EngineFailedError, match="rank1 .* was killed by signal 9"):
            engine.generate(PROMPTS[:1], GREEDY)  # later requests are refused at once


def test_a_rank_killed_mid_generation_fails_requests_within_seconds_and_health_says_so(
        tiny_llama_dir: Path) -> None:
    """Requests in flight when a rank dies end with a 503 that names the rank, within a
    few seconds (not the collective timeout); /health then answers 503 "unhealthy"."""
    import httpx

    from runtime.server import create_app

    sys.path.insert(0, str(Path(__file__).parent / "server"))
    from server_helpers import LiveServer

    with Engine(model=str(tiny_llama_dir), tensor_parallel_size=2, num_threads=1, num_pages=2048,
                max_model_len=1024, seed=0, dist_timeout_s=60) as engine, \
            LiveServer(create_app(engine, model_name="m")) as live:
        assert httpx.get(live.url + "/health").json()["status"] == "ok"
        answers: list[httpx.Response] = []
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
        threads = [threading.Thread(target=lambda: answers.append(httpx.post(live.url + "/generate", json=body,
                                                                             timeout=120))) for _ in range(2)]
        for t in threads:
            t.start()
        while engine.metrics()["num_running"] < 2:  # both are decoding
            time.sleep(0.02)
        [rank1] = engine._tp.procs  # type: ignore[union-attr]
        killed = time.monotonic()
        os.kill(rank1.pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        elapsed = time.monotonic() - killed
        print(f"requests in flight failed {elapsed:.2f} s after the kill")
        assert elapsed < 5, elapsed
        for r in answers:
            assert r.status_code == 503, r.text
            message = r.json()["error"]["message"]
            assert "tensor-parallel rank1" in message and "killed by signal 9" in message, message
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "rank1" in health.json()["reason"]
        refused = httpx.post(live.url + "/generate", json=body)
        assert refused.status_code == 503 and "cannot serve" in refused.json()["error"]["message"]


STDIN_PROGRAM = """
import time, sys
from runtime import Engine
print("constructing", time.monotonic(), flush=True)
Engine(model=sys.argv[1], tensor_parallel_size=2, num_threads=1, num_pages=256, max_model_len=128,
       dist_timeout_s=120)
"""


def test_tp_from_stdin_fails_fast_naming_the_rank_and_the_fix(tiny_llama_dir: Path) -> None:
    """`python - <<EOF`: the spawned rank cannot re-import a main read from stdin and dies
    at once; the start fails within seconds (not dist_timeout_s) with the rank, its exit
    code, its stderr and the fix."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-", str(tiny_llama_dir)], input=STDIN_PROGRAM, text=True,
                          capture_output=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    total = time.monotonic() - started
    assert proc.returncode != 0
    constructing = float(proc.stdout.split()[1])
    print(f"stdin TP start failed {time.monotonic() - constructing:.2f} s after Engine(...), {total:.2f} s in all")
    assert time.monotonic() - constructing < 10 and total < 30, (total, proc.stderr[-2000:])
    message = proc.stderr
    assert "TensorParallelError: a tensor-parallel rank died before joining" in message, message[-3000:]
    assert "tensor-parallel rank1" in message and "exited with code 1" in message
    assert "run the program from a file" in message and 'if __name__ == "__main__":' in message
    assert "<stdin>" in message  # the child's own traceback, from its stderr
