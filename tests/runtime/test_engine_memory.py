"""What an engine keeps resident over time: the prefix cache's bound on the CPU and the
pool's lowest-page-first reuse, which keep the lazily touched KV pool from growing into
resident memory under a steady load (docs/memory.md)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import Engine, SamplingParams
from runtime.config import CPU_PREFIX_CACHE_BYTES
from runtime.errors import InvalidRequestError


def distinct_prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 49152) for _ in range(length)] for _ in range(n)]


def test_cpu_default_bounds_the_cache_by_bytes(tiny_llama_dir: Path) -> None:
    with Engine(model=str(tiny_llama_dir), num_pages=512, num_threads=1) as engine:
        per_token = engine.kv.k[0][0].numel() * engine.kv.k[0].element_size() * 2 * len(engine.kv.k)
        assert engine.cache.max_evictable_pages == CPU_PREFIX_CACHE_BYTES // per_token  # type: ignore[attr-defined]


def test_a_steady_load_touches_only_the_bound_plus_the_working_set(tiny_llama_dir: Path) -> None:
    with Engine(model=str(tiny_llama_dir), num_pages=2048, num_threads=1,
                prefix_cache_max_pages=64) as engine:
        handed_out: set[int] = set()
        allocate = engine.pool.allocate

        def recording(num_pages: int) -> list[int]:
            pages = allocate(num_pages)
            handed_out.update(pages)
            return pages

        engine.pool.allocate = recording  # type: ignore[method-assign]
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        for prompt in distinct_prompts(40, 24):  # 40 x 32 tokens: 1,280 pages if all were kept
            engine.generate(input_ids=[prompt], sampling_params=params)
        m = engine.metrics()
        assert m["kv_pages_cached"] <= 64 and m["kv_pages_used"] == 0
        # One request's 32 pages (plus its decode reserve) at a time, beside at most 64
        # cached: every page handed out lies at or below that high-water mark.
        assert max(handed_out) <= 64 + 32 + 16
        engine.check_integrity()


def test_prefix_cache_max_pages_is_validated() -> None:
    with pytest.raises(InvalidRequestError, match="prefix_cache_max_pages must be an integer >= 0"):
        Engine(model="default", prefix_cache_max_pages=-1)


def test_loading_a_model_imports_neither_dynamo_nor_triton(tiny_llama_dir: Path) -> None:
    """The meta-device model build stays off torch's reference ops, which import
    torch._dynamo and Triton: resident memory and start-up time a CPU engine never uses."""
    code = ("import sys; from runtime import Engine; "
            f"e = Engine(model={str(tiny_llama_dir)!r}, num_pages=64, num_threads=1); "
            "e.generate(['hello'], None); e.close(); "
            "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root)}, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
