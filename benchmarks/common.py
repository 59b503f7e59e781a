"""Helpers shared by the benchmarks: timing, medians, reproduce lines, JSON results."""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# NOTE: tests that run a benchmark point this elsewhere (tests/conftest.py), so the saved
# results (rendered into docs/benchmarks.md by benchmarks/report.py) are real runs only.
RESULTS = Path(os.environ.get("ARBOR_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def reproduce_line() -> str:
    return "reproduce: " + " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def time_call(fn: Any, repeats: int) -> float:
    """Median seconds of one ``fn()`` call, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()
    except OSError:
        return "n/a"


def cpu_description() -> dict[str, Any]:
    """The CPU a figure holds for: model name, family/model, the vector extensions the
    kernels choose between, and the cores this process may use."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    return {"model": info.get("model name", platform.processor() or "unknown"),
            "family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
            "flags": [f for f in wanted if f in flags], "cores": len(os.sched_getaffinity(0))}


def versions() -> dict[str, str]:
    import subprocess

    out = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        root = Path(__file__).resolve().parents[1]
        out["arbor"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                      capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def save_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``results/<name>.json``: the payload plus the machine, versions, date and the
    command that reproduces it (what ``benchmarks/report.py`` puts in docs/benchmarks.md).
    A payload may carry ``title``, ``summary`` (lines), ``rows`` (a list of dicts: a table)
    and ``plots`` (image paths relative to the results folder)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"command": reproduce_line().removeprefix("reproduce: "),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
               "cpu": cpu_description(), "versions": versions(), "loadavg": load_average(), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_arbor_server(args: list[str], start_timeout_s: float = 900.0) -> tuple[subprocess.Popen[bytes], str]:
    """``arbor serve ARGS`` on a free local port, from this checkout; returns the process
    and its URL once ``/health`` answers (the last of its stderr if it exits first)."""
    import httpx

    repo = Path(__file__).resolve().parent.parent
    port = free_port()
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout_s  # NOTE: a shared, loaded machine starts it slowly
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
            raise RuntimeError(f"the server exited with {proc.returncode}: {tail}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not start")
