"""``bench_serving.py --compare-url``: two servers, one workload, side by side, each
labelled with the model and config version its answers carry."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "server"))
from server_helpers import LiveServer  # noqa: E402


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("arbor_bench_serving", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Any:
    from runtime import Engine

    eng = Engine(model=str(tiny_llama_dir), num_pages=2048, max_model_len=512, num_threads=1)
    yield eng
    eng.close()


def test_compare_two_servers_side_by_side(engine: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.server import create_app

    bench = load_bench()
    with LiveServer(create_app(engine, model_name="baseline")) as a, \
            LiveServer(create_app(engine, model_name="canary")) as b:
        args = bench.parse_args(["--base-url", a.url + "/v1", "--compare-url", b.url + "/v1",
                                 "--num-requests", "3", "--rate", "50", "--buckets", "short_in/short_out",
                                 "--short-output", "4", "--no-baseline", "--name", "test_compare"])
        first = asyncio.run(bench.main_async(args))
        second = asyncio.run(bench.main_async(args, args.compare_url, "test_compare_b"))
    rows = bench.print_comparison(first, second)
    assert first["server_version"] == {"model": "baseline", "config_version": engine.config.version()}
    assert second["server_version"]["model"] == "canary"
    assert rows["output tok/s"]["A"] > 0 and rows["output tok/s"]["B"] > 0
    assert "B / A" in capsys.readouterr().out
