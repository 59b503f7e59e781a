"""``bench_serving.py``'s natural workload and ``bench_serving_peers.py``: servers started one
at a time, sides alternated, a table and a plot."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bs() -> Any:
    return load("bench_serving")


@pytest.fixture(scope="module")
def peers() -> Any:
    return load("bench_serving_peers")


def test_log_uniform_spans_the_range_evenly_in_log(bs: Any) -> None:
    rng = random.Random(0)
    values = [bs.log_uniform(rng, 64, 1024) for _ in range(4000)]
    assert min(values) >= 64 and max(values) <= 1024
    # NOTE: four octaves (64-128-256-512-1024): about a quarter of the draws in each
    octaves = [sum(1 for v in values if 64 * 2**k <= v < 64 * 2 ** (k + 1)) for k in range(4)]
    assert all(800 < n < 1200 for n in octaves), octaves
    assert math.isclose(sorted(values)[2000], math.sqrt(64 * 1024), rel_tol=0.1)


def test_natural_prompts_are_distinct_text_of_the_drawn_lengths(bs: Any, tiny_llama_dir: Path) -> None:
    from tokenizers import Tokenizer

    text = bs.TextSource(tiny_llama_dir, seed=3)
    load_ = bs.Workload((64, 1024), (64, 256), 24, 400, 16, 96, 1, 0)
    jobs = bs.make_jobs(30, load_, 3, ["natural"], text=text)
    tok = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    lengths = [len(tok.encode(j.prompt, add_special_tokens=False).ids) for j in jobs]
    assert all(60 <= n <= 1030 for n in lengths), lengths  # NOTE: re-tokenized text may merge a few
    assert max(lengths) > 3 * min(lengths)
    assert all(64 <= j.max_tokens <= 256 for j in jobs)
    assert len({j.prompt[:200] for j in jobs}) == 30  # no two prompts share a beginning
    assert sum(j.prompt.count(" the ") for j in jobs) > 100  # English prose, not a word list
    again = bs.make_jobs(30, load_, 3, ["natural"], text=bs.TextSource(tiny_llama_dir, seed=3))
    assert [j.prompt for j in again] == [j.prompt for j in jobs]  # a seed is a workload


def test_client_asks_for_usage_and_no_logprobs_by_default(bs: Any) -> None:
    import asyncio

    import httpx

    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "bc"}]},
                  {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse)

    async def run() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x/v1") as http:
            return await bs.Client(http, "m", True, "").completion(bs.Job("natural", "hi", 3))

    sample = asyncio.run(run())
    assert "logprobs" not in bodies[0] and bodies[0]["ignore_eos"] is True
    assert bodies[0]["stream_options"] == {"include_usage": True}
    assert (sample.output_tokens, sample.prompt_tokens, sample.counted_by) == (3, 5, "usage")
    assert sample.itl_per == "chunk" and len(sample.itl) == 1  # two chunks with text: one gap
    assert bs.tpot(sample) == pytest.approx((sample.e2e - sample.ttft) / 2)


def test_llama_server_command_and_env_file(peers: Any, tmp_path: Path) -> None:
    side = peers.Side("llama-np8", "llama", ("--foo",), 8)
    cmd = side.command(Path("m.gguf"), 1234, Path("/bin/llama-server"), 1536)
    text = " ".join(cmd)
    assert cmd[0] == "/bin/llama-server" and "-np 8" in text and "-c 12288" in text
    assert "-fa on" in text and "-t 2" in text and "-tb 2" in text and cmd[-1] == "--foo"
    arbor = peers.parse_side("slo=--itl-slo 0.1 --ttft-slo 1").command(Path("m.gguf"), 1, None, 1)
    assert arbor[-4:] == ["--itl-slo", "0.1", "--ttft-slo", "1"] and "--weights" in arbor
    env = tmp_path / "llama.cpp.env"
    env.write_text("LLAMA_SERVER=/x/llama-server\nLLAMA_COMMIT=0c1e570\n")
    assert peers.read_env(env) == {"LLAMA_SERVER": "/x/llama-server", "LLAMA_COMMIT": "0c1e570"}


def test_rates_bracket_the_sides_saturation(peers: Any) -> None:
    rates = peers.sweep_rates({"a": 1.0, "b": 4.0}, [0.5, 1.0, 1.5])
    assert rates == [1.0, 2.0, 3.0]  # NOTE: around the geometric mean of 1 and 4


def test_table_reports_median_and_range_over_repeats(peers: Any) -> None:
    def cell(side: str, rep: int, tok_s: float, ttft_p99: float) -> Any:
        stats = {"ttft_ms": {"p50": 1.0, "p99": ttft_p99}, "itl_ms": {"p99": 2.0}}
        return peers.Cell(side, 1.0, rep, {"output_token_throughput": tok_s, "num_requests": 4, "num_ok": 4 - rep,
                                           "buckets": {"all": stats}})

    rows = peers.table([cell("a", 0, 10.0, 100.0), cell("a", 1, 14.0, 300.0), cell("a", 2, 11.0, 200.0)],
                       ["a", "b"], [1.0])
    assert len(rows) == 1  # side b ran nothing: no row
    assert rows[0]["output tok/s"] == "11 (10-14)" and rows[0]["TTFT p99 ms"] == "200 (100-300)"
    assert rows[0]["failed"] == 3 and rows[0]["repeats"] == 3
    assert "TPOT p50 ms" not in rows[0]  # a figure no cell measured stays out


def test_cells_of_split_invocations_merge_into_one_table(peers: Any, tmp_path: Path) -> None:
    def summary(tok_s: float, req_s: float) -> dict[str, Any]:
        stats = {"ttft_ms": {"p50": 1.0, "p99": 2.0}, "itl_ms": {"p99": 3.0}}
        return {"output_token_throughput": tok_s, "request_throughput": req_s, "num_requests": 4, "num_ok": 4,
                "buckets": {"all": stats}}

    arbor = peers.parse_side("slo=--itl-slo 0.1")
    llama = peers.Side("llama-np8", "llama", (), 8)
    cells = tmp_path / "cells"
    # NOTE: as three invocations would: saturation bursts, then one rate each
    peers.save_cell(cells, llama, peers.Cell("llama-np8", None, 0, summary(50.0, 1.0)))
    peers.save_cell(cells, llama, peers.Cell("llama-np4", None, 0, summary(40.0, 0.8)))
    peers.save_cell(cells, arbor, peers.Cell("slo", None, 0, summary(60.0, 1.2)))
    for rate, rep in ((0.5, 0), (0.5, 1), (1.0, 0)):
        peers.save_cell(cells, llama, peers.Cell("llama-np8", rate, rep, summary(10.0 + rep, rate)))
        peers.save_cell(cells, arbor, peers.Cell("slo", rate, rep, summary(20.0 + rep, rate)))
    sides, rated, bursts = peers.load_cells(cells)
    assert [s.name for s in sides] == ["slo", "llama-np8"] and sides[0].flags == ("--itl-slo", "0.1")
    assert len(rated) == 6 and len(bursts) == 3
    payload = peers.main(["--merge", "--cells-dir", str(cells), "--model", "m.gguf", "--tokenizer", "t.json",
                          "--name", "test_peers_merge"])
    assert [(r["rate req/s"], r["side"], r["repeats"]) for r in payload["rows"]] == [
        (0.5, "slo", 2), (0.5, "llama-np8", 2), (1.0, "slo", 1), (1.0, "llama-np8", 1)]
    assert payload["rows"][0]["output tok/s"] == "20.5 (20-21)"
    assert payload["saturation"] == {"llama-np8": 1.0, "llama-np4": 0.8, "slo": 1.2}
    assert [c["side"] for c in payload["np_sweep"]] == ["llama-np4", "llama-np8"]
    with pytest.raises(SystemExit):
        peers.parse_args(["--merge", "--model", "m.gguf", "--tokenizer", "t.json"])  # where are the cells?


@pytest.mark.slow
def test_two_arbor_sides_alternate_and_write_table_and_plot(peers: Any, tiny_llama_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    payload = peers.main(["--model", str(tiny_llama_dir), "--tokenizer", str(tiny_llama_dir),
                          "--arbor", "plain=--max-model-len 512", "--arbor", "nospec=--max-model-len 512 --no-speculation",
                          "--rates", "20", "--repeats", "2", "--num-requests", "3",
                          "--prompt-tokens", "16", "32", "--output-tokens", "4", "8",
                          "--name", "test_peers", "--log-dir", str(tmp_path),
                          "--cells-dir", str(tmp_path / "cells"), "--step-traces", str(tmp_path / "traces")])
    order = [(c["side"], c["repeat"]) for c in payload["cells"]]
    assert order == [("plain", 0), ("nospec", 0), ("nospec", 1), ("plain", 1)]  # who goes first flips
    assert [r["side"] for r in payload["rows"]] == ["plain", "nospec"]
    assert all(r["failed"] == 0 and r["repeats"] == 2 for r in payload["rows"])
    for c in payload["cells"]:
        assert c["summary"]["output_tokens_counted_by"] == ["usage"] and c["summary"]["num_ok"] == 3
    results = Path(payload["plots"][0])
    from common import RESULTS  # type: ignore[import-not-found]

    assert (RESULTS / results).stat().st_size > 10_000
    assert "--no-speculation" in (tmp_path / "nospec.log").read_text()
    assert "| 20.0 | plain |" in capsys.readouterr().out
    assert len(list((tmp_path / "cells").glob("*.json"))) == 4  # a file a cell
    traces = sorted((tmp_path / "traces").glob("*.jsonl"))
    assert len(traces) == 4 and all(t.name.startswith(("plain.", "nospec.")) for t in traces)
    steps = [json.loads(line) for line in traces[0].read_text().splitlines()]
    assert sum(s["prefill_tokens"] for s in steps) >= 3 * 16 and all(s["seconds"] > 0 for s in steps)


def test_one_slot_count_given_is_used_without_a_sweep(peers: Any) -> None:
    args = peers.parse_args(["--model", "m.gguf", "--llama-server", "/bin/llama-server", "--np", "8",
                             "--tokenizer", "t.json"])
    side, cells = peers.choose_np(args, [], "warm up")
    assert (side.name, side.np, cells) == ("llama-np8", 8, [])


def test_step_traces_summarize_the_slow_steps_of_each_side(peers: Any, tmp_path: Path) -> None:
    def line(decode: int, prefill: int, seconds: float, predicted: float | None) -> str:
        return json.dumps({"decode_rows": decode, "prefill_tokens": prefill, "verify_rows": 0,
                           "seconds": seconds, "predicted": predicted})

    (tmp_path / "slo.1.jsonl").write_text("\n".join([line(4, 0, 0.02, None), line(4, 16, 0.1, 0.08),
                                                     line(0, 900, 3.0, 2.0), line(4, 500, 2.0, 2.0)]))
    (tmp_path / "slo-nospec.2.jsonl").write_text(line(1, 0, 0.01, 0.01))  # another side's file
    out = peers.trace_summary(tmp_path, ["slo", "absent"])
    assert list(out) == ["slo"] and out["slo"]["steps"] == 4 and out["slo"]["max ms"] == 3000.0
    # the 900-token step had nobody decoding: not part of the ITL tail
    assert [s["prefill_tokens"] for s in out["slo"]["slowest steps with decodes"]] == [500, 16, 0]
    assert out["slo"]["median prediction error"] == pytest.approx(0.2)  # of 0.2, 0.333 and 0 (None: no prediction)
