"""Helpers of the server tests (a module of its own: test files import from it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

API_KEY = "test-key"
REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(model_dir: Path, *flags: str) -> tuple[subprocess.Popen[bytes], str]:
    """``arbor serve`` on 127.0.0.1 in a child process; returns it and its URL once healthy.
    ``flags`` come last, so they override the defaults here."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--num-threads", "1", "--num-pages", "2048", "--max-model-len", "1024",
           "--log-level", "warning", "--served-model-name", "m", *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stdout.read().decode() if proc.stdout else ''}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not start")


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # NOTE: a long keep-alive: uvicorn's default (5 s) can close an idle pooled
        # connection just as the client reuses it (an httpx.ReadError in the load test).
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=1, timeout_keep_alive=120)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


VERSION_LABELS = ("model", "config_version")  # on every sample (runtime/server/versions.py)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text as ``{(sample name, sorted labels): value}``, without the version
    labels that every sample carries (``test_versions.py`` checks those)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in VERSION_LABELS))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def engine_metric(engine: Any, name: str) -> float:
    """One engine metric, retried if the read races an engine step."""
    for _ in range(10):
        try:
            return float(engine.metrics()[name])
        except RuntimeError:
            time.sleep(0.001)
    raise AssertionError(f"could not read engine metric {name}")
