"""benchmarks/bench_overload.py reads guidellm's report and the server's counters: the
parsing, on small documents of the shapes guidellm 0.8 and ``/metrics`` write."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_overload.py"


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("arbor_bench_overload", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def dist(p50: float, p99: float) -> dict[str, Any]:
    return {"successful": {"mean": p50, "percentiles": {"p50": p50, "p99": p99}}}


def report() -> dict[str, Any]:
    error = ("HTTPStatusError(\"Client error '429 Too Many Requests' for url "
             "'http://127.0.0.1:1/v1/chat/completions'\")")
    bench = {
        "config": {"strategy": {"type_": "constant", "rate": 0.6}},
        "metrics": {
            "request_totals": {"successful": 11, "errored": 2, "incomplete": 3, "total": 16},
            "requests_per_second": {"successful": {"mean": 0.25}},
            "output_tokens_per_second": {"successful": {"mean": 8.5}},
            "time_to_first_token_ms": dist(700.0, 4300.0),
            "inter_token_latency_ms": dist(300.0, 600.0),
        },
        "requests": {"errored": [{"info": {"error": error}}, {"info": {"error": "ReadTimeout()"}}]},
    }
    return {"benchmarks": [bench]}


def test_rows_of_a_guidellm_report() -> None:
    [row] = load_bench().rows_of(report(), "past")
    assert row == {"phase": "past", "strategy": "constant", "rate_asked": 0.6, "requests_per_s": 0.25,
                   "output_tok_per_s": 8.5, "ttft_p50_ms": 700.0, "ttft_p99_ms": 4300.0,
                   "itl_p50_ms": 300.0, "itl_p99_ms": 600.0, "completed": 11, "errored": 2,
                   "incomplete": 3, "errored_by_status": {"429": 1, "no status": 1}}


def test_the_saved_report_drops_per_request_records(tmp_path: Path) -> None:
    path = tmp_path / "g" / "r.json"
    load_bench().save_report(report(), path)
    saved = json.loads(path.read_text())
    assert "requests" not in saved["benchmarks"][0] and saved["benchmarks"][0]["metrics"]["request_totals"]["errored"] == 2


def test_server_answers_by_status_and_error_kind(monkeypatch: Any) -> None:
    bench = load_bench()
    text = "\n".join([
        "# HELP arbor_requests_total Requests answered",
        'arbor_requests_total{config_version="a",endpoint="chat_stream",model="m",status="200"} 27.0',
        'arbor_requests_total{config_version="a",endpoint="chat",model="m",status="200"} 3.0',
        'arbor_errors_total{kind="rate_limit_error"} 906.0',
        'arbor_errors_created{kind="rate_limit_error"} 1.7e9',
    ])

    class Answer:
        def __init__(self, body: str) -> None:
            self.text = body

    monkeypatch.setattr(bench.httpx, "get", lambda url, timeout: Answer(text))
    assert dict(bench.statuses("http://x")) == {"200": 30, "rate_limit_error": 906}
    assert bench.probe_counts([[200, None], [200, None], [429, "1"]]) == {"(200, None)": 2, "(429, 1)": 1}
