"""A one-minute soak with faults (``benchmarks/soak.py``) against a real server on the
tiny model: nothing lost, no KV page held once idle, a clean exit, memory flat."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def load_soak() -> Any:
    spec = importlib.util.spec_from_file_location("arbor_soak", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_one_minute_soak_loses_nothing_and_leaks_nothing(tiny_llama_dir: Path) -> None:
    soak = load_soak()
    summary = soak.soak(["--minutes", "0.75", "--model", str(tiny_llama_dir), "--warmup", "10",
                         "--window", "15", "--burst-every", "15", "--name", "soak_test",
                         "--server-args", "--num-threads", "1", "--num-pages", "4096",
                         "--max-model-len", "512"])
    assert summary["lost"] == 0, summary["lost_examples"]
    assert summary["kv_pages_leaked"] == 0 and summary["idle"]
    assert summary["server_exit_status"] == 0
    kinds = summary["by_kind"]
    for kind in ("chat", "chat_stream", "generate_stream", "program_fork", "constrained"):
        assert kinds[kind].get("completed", 0) > 0, (kind, kinds[kind])
    for kind in ("bad_schema", "oversized"):
        assert kinds[kind].get("completed", 0) == 0 and kinds[kind].get("failed_clear", 0) > 0, kind
    assert kinds["disconnect"].get("client_gone", 0) > 0
    assert summary["rss_growth"] < 0.3, summary["rss_growth"]  # a 45 s run after a 10 s warm-up
