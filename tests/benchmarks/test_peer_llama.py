"""``benchmarks/peer_llama.py``: llama.cpp's tools' command lines, the parsing of their
output (as 0c1e570 prints it), and a child's wall time and peak RSS."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.peer_llama import (
    LlamaTools,
    batched_command,
    bench_command,
    evict_from_page_cache,
    first_token_command,
    parse_batched_bench,
    parse_llama_bench,
    read_env,
    run_process,
)

TOOLS = LlamaTools(Path("/b/llama-bench"), Path("/b/llama-batched-bench"), "0c1e570")


def _bench_test(n_prompt: int, n_gen: int, avg_ts: float) -> dict[str, object]:
    return {"build_commit": "0c1e57098", "model_type": "llama 1B Q4_0", "n_threads": 2, "n_prompt": n_prompt,
            "n_gen": n_gen, "n_depth": 0, "avg_ns": 20535526, "stddev_ns": 0, "avg_ts": avg_ts,
            "stddev_ts": 0.0, "samples_ns": [20535526], "samples_ts": [avg_ts]}


def test_llama_bench_output_gives_tokens_per_second_per_test() -> None:
    tests = [_bench_test(512, 0, 251.5), _bench_test(4096, 0, 180.25), _bench_test(0, 64, 52.0),
             _bench_test(128, 32, 90.0)]
    text = "some log line\n" + json.dumps(tests, indent=2)
    assert parse_llama_bench(text) == {"pp512": 251.5, "pp4096": 180.25, "tg64": 52.0, "pp128+tg32": 90.0}
    with pytest.raises(ValueError, match="no JSON"):
        parse_llama_bench("error: failed to load model\n")


def test_batched_bench_jsonl_gives_decode_only_speed_per_stream_count() -> None:
    line = {"n_kv_max": 6144, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0,
            "n_threads": 2, "pp": 128, "tg": 64, "n_kv": 0, "t": 9.0, "speed": 100.0}
    text = "\n".join(["main: n_kv_max = 6144", json.dumps({**line, "pl": 8, "t_pp": 4.0, "speed_pp": 256.0,
                                                          "t_tg": 2.5, "speed_tg": 204.8}),
                      json.dumps({**line, "pl": 32, "t_pp": 16.0, "speed_pp": 256.0, "t_tg": 8.0,
                                  "speed_tg": 256.0}), ""])
    rows = parse_batched_bench(text)
    assert sorted(rows) == [8, 32]
    assert rows[8] == {"prefill_tok_s": 256.0, "decode_tok_s": 204.8, "prefill_s": 4.0, "decode_s": 2.5,
                       "total_s": 9.0}
    assert rows[32]["decode_tok_s"] == 256.0
    with pytest.raises(ValueError, match="no result lines"):
        parse_batched_bench("| PP | TG | B |\n")


def test_commands_pin_threads_file_and_workload() -> None:
    cmd = bench_command(TOOLS, Path("m.gguf"), 2, [512, 4096], 64)
    assert cmd[:3] == ["/b/llama-bench", "-m", "m.gguf"]
    text = " ".join(cmd)
    assert "-t 2" in text and "-p 512,4096" in text and "-n 64" in text and "-r 1" in text and "-o json" in text
    assert "-p 0" in " ".join(bench_command(TOOLS, Path("m.gguf"), 2, [], 64))  # decode only
    batched = " ".join(batched_command(TOOLS, Path("m.gguf"), 2, 128, 64, [8, 32]))
    assert batched.startswith("/b/llama-batched-bench -m m.gguf")
    # NOTE: the context holds every sequence's prompt and output at once, with a margin
    assert "-c 6656" in batched and "-npp 128" in batched and "-ntg 64" in batched and "-npl 8,32" in batched
    assert "-t 2 -tb 2" in batched and "--output-format jsonl" in batched and "-pps" not in batched
    assert batched_command(TOOLS, Path("m.gguf"), 2, 528, 32, [16], shared_prompt=True)[-1] == "-pps"
    first = " ".join(first_token_command(TOOLS, Path("m.gguf"), 2))
    assert "-ntg 1" in first and "-npl 1" in first and "-c 256" in first


def test_env_file_names_the_tools(tmp_path: Path) -> None:
    env = tmp_path / "llama.cpp.env"
    env.write_text("# built by build_llama_cpp.sh\nLLAMA_BENCH=/x/llama-bench\nLLAMA_BATCHED_BENCH=/x/bb\n"
                   "LLAMA_COMMIT=0c1e570\n")
    assert read_env(env)["LLAMA_COMMIT"] == "0c1e570"
    assert LlamaTools.from_env(env) == LlamaTools(Path("/x/llama-bench"), Path("/x/bb"), "0c1e570")
    env.write_text("LLAMA_SERVER=/x/llama-server\n")
    with pytest.raises(ValueError, match="LLAMA_BENCH, LLAMA_BATCHED_BENCH"):
        LlamaTools.from_env(env)


def test_run_process_reports_the_childs_own_peak_rss_and_output() -> None:
    code = "b = bytearray(200 * 2**20); print('done', len(b))"
    run = run_process([sys.executable, "-c", code])
    assert run.stdout.strip() == f"done {200 * 2**20}"
    assert 200 < run.peak_rss_mib < 1000 and run.wall_s > 0
    small = run_process([sys.executable, "-c", "print(1)"])
    assert small.peak_rss_mib < 150  # NOTE: the child's own peak, not the largest child's so far
    with pytest.raises(RuntimeError, match="exited with 3: boom"):
        run_process([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])
    with pytest.raises(RuntimeError, match="ran past"):
        run_process([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)


def test_evict_from_page_cache_takes_a_file_and_refuses_a_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 65536)
    evict_from_page_cache(path)
    assert path.read_bytes() == b"x" * 65536  # the file itself is untouched
    with pytest.raises(FileNotFoundError):
        evict_from_page_cache(tmp_path / "missing.gguf")
