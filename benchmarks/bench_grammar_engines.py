"""Grammar engines head to head: llguidance vs xgrammar vs outlines-core.

With the default model's vocabulary (SmolLM2-135M, 49152 tokens), for each backend:

* compile: a sample of JSONSchemaBench schemas (``--per-split`` per split, evenly spread
  over each split's size range), each compiled in a forked worker process killed after
  ``--timeout`` s (outlines-core can run for minutes). Reports the share compiled, the
  median / p90 compile time and the time to the first mask (compile + one mask; llguidance
  compiles lazily, so the first mask is where its work shows).
* mask: time per decode step to fill the token bitmask while walking the canonical
  tokenization of valid instances, at batch 1 (one matcher) and batch 32 (32 matchers,
  one ``fill_bitmasks`` call), on schemas every backend compiled.
* other kinds (regex, choice, type, Lark grammar): compile ms and mask µs per step on
  a few samples each, in process (they compile in milliseconds).

Baseline, measured in the same run: the lm_head projection of a decode step alone
([B, 576] x [576, 49152] fp32 matmul) and applying the bitmask to the logits; a mask
should cost far less than a decode step.

    .venv/bin/python benchmarks/bench_grammar_engines.py [--per-split 6] [--timeout 10]
        [--backends llguidance xgrammar outlines] [--mask-schemas 12] [--batch-steps 60]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result  # noqa: E402

from grammars import (  # noqa: E402
    ChoiceConstraint,
    ConstraintError,
    JsonSchemaConstraint,
    RegexConstraint,
    TypeConstraint,
    load_grammar,
)
from runtime.constrained import (  # noqa: E402
    GrammarBackend,
    GrammarMatcher,
    allocate_token_bitmask,
    apply_token_bitmask,
    create_backend,
)

DATA_DIR = Path("/work/shared/jsonschemabench")
from runtime.model.default_model import default_model_dir  # noqa: E402

MODEL_DIR = default_model_dir()


@dataclass
class SchemaCase:
    """One benchmark schema and its valid instances (as canonical JSON text)."""

    name: str
    schema: dict[str, Any]
    valid_texts: list[str] = field(default_factory=list)


@dataclass
class CompileResult:
    """Outcome of compiling one schema on one backend."""

    name: str
    status: str  # "ok", "error" (invalid or unsupported) or "timeout"
    compile_ms: float | None = None
    first_mask_ms: float | None = None  # compile + new matcher + one mask
    error: str = ""  # why it failed, or (status "ok") what a relaxed grammar does not enforce


def instance_text(instance: Any) -> str:
    """The text a model would emit for ``instance``: json.dumps defaults, UTF-8 kept."""
    return json.dumps(instance, ensure_ascii=False)


def sample_cases(data_dir: Path, per_split: int) -> list[SchemaCase]:
    """``per_split`` schemas of each split, at evenly spaced size ranks."""
    manifest = json.loads((data_dir / "manifest.json").read_text())
    by_split: dict[str, list[dict[str, Any]]] = {}
    for entry in manifest["files"]:
        by_split.setdefault(entry["split"], []).append(entry)
    cases = []
    for split in sorted(by_split):
        entries = sorted(by_split[split], key=lambda e: e["size_rank"])
        step = (len(entries) - 1) / max(per_split - 1, 1)
        for i in range(per_split):
            cases.append(_load_case(data_dir, entries[round(i * step)]))
    return cases


def _load_case(data_dir: Path, entry: dict[str, Any]) -> SchemaCase:
    schema = json.loads((data_dir / entry["file"]).read_text())
    tests_path = data_dir / entry["tests_file"] if entry.get("tests_file") else None
    valid: list[str] = []
    if tests_path is not None and tests_path.is_file():
        tests = json.loads(tests_path.read_text())["tests"]
        valid = [instance_text(t["data"]) for t in tests if t["valid"]]
    return SchemaCase(entry["file"], schema, valid)


# --- compile, in a killable worker --------------------------------------------------

_WORKER_BACKEND: GrammarBackend | None = None  # set before fork; inherited by workers


def _worker_loop(conn: Connection) -> None:
    assert _WORKER_BACKEND is not None
    bitmask = allocate_token_bitmask(1, _WORKER_BACKEND.vocab_size)
    while True:
        schema_json = conn.recv()
        start = time.perf_counter()
        try:
            compiled = _WORKER_BACKEND.compile(JsonSchemaConstraint(schema_json))
            compile_s = time.perf_counter() - start
            compiled.new_matcher().fill_bitmask(bitmask, 0)
            conn.send(("ok", compile_s, time.perf_counter() - start, compiled.approximation or ""))
        except Exception as exc:
            conn.send(("error", None, None, str(exc).splitlines()[0][:200]))


class CompileWorker:
    """A forked process that compiles schemas; replaced when a compile times out."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        self.conn, child = mp.get_context("fork").Pipe()
        self.proc = mp.get_context("fork").Process(target=_worker_loop, args=(child,))
        self.proc.start()

    def compile(self, name: str, schema_json: str, timeout_s: float) -> CompileResult:
        self.conn.send(schema_json)
        if not self.conn.poll(timeout_s):
            self.proc.kill()
            self.proc.join()
            self._start()
            return CompileResult(name, "timeout", error=f"> {timeout_s:g} s")
        status, compile_s, first_s, error = self.conn.recv()
        if status != "ok":
            return CompileResult(name, status, error=error)
        return CompileResult(name, "ok", compile_s * 1e3, first_s * 1e3, error=error)

    def close(self) -> None:
        self.proc.kill()
        self.proc.join()


def measure_compiles(
    backend: GrammarBackend, cases: list[SchemaCase], timeout_s: float
) -> list[CompileResult]:
    """Compile every case on ``backend`` in a worker, each bounded by ``timeout_s``."""
    global _WORKER_BACKEND
    _WORKER_BACKEND = backend
    worker = CompileWorker()
    results = []
    for case in cases:
        try:  # the front end (metaschema check) runs here: invalid schemas never compile
            constraint = JsonSchemaConstraint.from_schema(case.schema)
        except ConstraintError as exc:
            results.append(CompileResult(case.name, "error", error=str(exc)[:200]))
            continue
        results.append(worker.compile(case.name, constraint.schema_json, timeout_s))
    worker.close()
    return results


# --- mask time per step --------------------------------------------------------------


def canonical_walks(tokenizer: Any, cases: list[SchemaCase]) -> list[list[int]]:
    """Token ids of each case's first valid instance (the tokenizer's own encoding)."""
    return [tokenizer.encode(c.valid_texts[0], add_special_tokens=False) for c in cases]


def mask_times_batch1(
    backend: GrammarBackend, cases: list[SchemaCase], walks: list[list[int]]
) -> list[float]:
    """µs per fill of one matcher's mask, over every step of every walk."""
    bitmask = allocate_token_bitmask(1, backend.vocab_size)
    times = []
    for case, walk in zip(cases, walks, strict=True):
        matcher = backend.compile(JsonSchemaConstraint.from_schema(case.schema)).new_matcher()
        for token_id in walk:
            start = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            times.append((time.perf_counter() - start) * 1e6)
            if not matcher.accept_token(token_id):
                break
    return times


def mask_times_batched(
    backend: GrammarBackend,
    cases: list[SchemaCase],
    walks: list[list[int]],
    batch_size: int,
    num_steps: int,
) -> list[float]:
    """µs per batched fill of ``batch_size`` rows; a row whose walk ends restarts."""
    compiled = [backend.compile(JsonSchemaConstraint.from_schema(c.schema)) for c in cases]
    rows = [i % len(cases) for i in range(batch_size)]
    matchers: list[GrammarMatcher] = [compiled[c].new_matcher() for c in rows]
    positions = [0] * batch_size
    bitmask = allocate_token_bitmask(batch_size, backend.vocab_size)
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        backend.fill_bitmasks([(m, row) for row, m in enumerate(matchers)], bitmask)
        times.append((time.perf_counter() - start) * 1e6)
        for row, case_idx in enumerate(rows):
            walk = walks[case_idx]
            if positions[row] >= len(walk) or not matchers[row].accept_token(walk[positions[row]]):
                matchers[row], positions[row] = compiled[case_idx].new_matcher(), 0
            else:
                positions[row] += 1
    return times


def baseline_times(vocab_size: int, batch_size: int, repeats: int = 50) -> dict[str, float]:
    """Median µs of the lm_head matmul and of apply_token_bitmask at ``batch_size``."""
    hidden = torch.randn(batch_size, 576)
    weight = torch.randn(vocab_size, 576)
    logits = hidden @ weight.T
    bitmask = allocate_token_bitmask(batch_size, vocab_size)
    bitmask[:, ::2] = 0
    matmul, apply = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        logits = hidden @ weight.T
        matmul.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        apply_token_bitmask(logits, bitmask)
        apply.append((time.perf_counter() - start) * 1e6)
    return {"lm_head_us": median(matmul), "apply_bitmask_us": median(apply)}


# --- the other constraint kinds ------------------------------------------------------

KIND_SAMPLES: list[tuple[str, Any, str]] = [
    ("regex", RegexConstraint(r"\(\d{3}\) \d{3}-\d{4}"), "(555) 123-4567"),
    ("regex", RegexConstraint(r"[A-Za-z ]{1,40}\."), "The quick brown fox jumps."),
    ("choice", ChoiceConstraint(("positive", "negative", "neutral", "mixed")), "neutral"),
    ("type", TypeConstraint("float"), "-12.5e3"),
    ("grammar", load_grammar("sql_select"), "SELECT name, age FROM users WHERE age >= 18;"),
    ("grammar", load_grammar("arithmetic"), "(12 + 7) * 3 - 4 / 2"),
]


def measure_kinds(backend: GrammarBackend, tokenizer: Any) -> dict[str, dict[str, float]]:
    """Per kind: median compile ms and median / p99 mask µs per step over sample walks."""
    compile_ms: dict[str, list[float]] = {}
    mask_us: dict[str, list[float]] = {}
    bitmask = allocate_token_bitmask(1, backend.vocab_size)
    for kind, constraint, text in KIND_SAMPLES:
        start = time.perf_counter()
        try:
            matcher = backend.compile(constraint).new_matcher()
        except ConstraintError:
            continue
        compile_ms.setdefault(kind, []).append((time.perf_counter() - start) * 1e3)
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            start = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            mask_us.setdefault(kind, []).append((time.perf_counter() - start) * 1e6)
            if not matcher.accept_token(token_id):
                break
    return {
        kind: {"compile_ms": median(ms), "mask_us_median": median(mask_us[kind]),
               "mask_us_p99": percentile(mask_us[kind], 0.99)}
        for kind, ms in compile_ms.items()
    }


# --- report --------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def compile_summary(results: list[CompileResult]) -> dict[str, Any]:
    ok = [r for r in results if r.status == "ok"]
    compile_ms = [r.compile_ms for r in ok if r.compile_ms is not None]
    first_ms = [r.first_mask_ms for r in ok if r.first_mask_ms is not None]
    return {
        "num_schemas": len(results),
        "compiled_share": len(ok) / max(len(results), 1),
        "num_relaxed": sum(bool(r.error) for r in ok),
        "num_timeouts": sum(r.status == "timeout" for r in results),
        "num_errors": sum(r.status == "error" for r in results),
        "compile_ms_median": median(compile_ms),
        "compile_ms_p90": percentile(compile_ms, 0.9),
        "first_mask_ms_median": median(first_ms),
        "first_mask_ms_p90": percentile(first_ms, 0.9),
        "errors": [f"{r.name}: {r.status} {r.error}" for r in results if r.status != "ok"],
    }


def print_row(name: str, summary: dict[str, Any]) -> None:
    print(
        f"{name:<11} compiled {summary['compiled_share']:6.1%} "
        f"(relaxed {summary['num_relaxed']}, timeouts {summary['num_timeouts']}, "
        f"errors {summary['num_errors']})  "
        f"compile ms median {summary['compile_ms_median']:8.2f} p90 {summary['compile_ms_p90']:8.2f}  "
        f"first-mask ms median {summary['first_mask_ms_median']:8.2f}  "
        f"mask µs b1 median {summary.get('mask_b1_median', float('nan')):7.1f} "
        f"p99 {summary.get('mask_b1_p99', float('nan')):7.1f}  "
        f"b32 median {summary.get('mask_b32_median', float('nan')):8.1f} "
        f"p99 {summary.get('mask_b32_p99', float('nan')):8.1f}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DATA_DIR)
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--per-split", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--backends", nargs="+", default=["llguidance", "xgrammar", "outlines"])
    parser.add_argument("--mask-schemas", type=int, default=12)
    parser.add_argument("--batch-steps", type=int, default=60)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # NOTE: one torch thread: on the shared 2-core machine, 2 OpenMP threads turned a
    # 300 µs batch-32 bitmask unpack into ~15 ms of waiting for a core.
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    vocab_size = len(tokenizer)
    cases = sample_cases(args.data, args.per_split)
    print(f"{len(cases)} schemas, vocab {vocab_size}, timeout {args.timeout:g} s, "
          f"loadavg {load_average()}")
    backends = {name: create_backend(name, tokenizer, vocab_size) for name in args.backends}
    compiles = {name: measure_compiles(b, cases, args.timeout) for name, b in backends.items()}
    summaries = {name: compile_summary(r) for name, r in compiles.items()}
    everywhere = [
        case for i, case in enumerate(cases)
        if case.valid_texts and all(r[i].status == "ok" for r in compiles.values())
    ][: args.mask_schemas]
    walks = canonical_walks(tokenizer, everywhere)
    for name, backend in backends.items():
        b1 = mask_times_batch1(backend, everywhere, walks)
        b32 = mask_times_batched(backend, everywhere, walks, 32, args.batch_steps)
        summaries[name].update(
            mask_b1_median=median(b1), mask_b1_p99=percentile(b1, 0.99),
            mask_b32_median=median(b32), mask_b32_p99=percentile(b32, 0.99),
        )
    baseline = {f"b{b}": baseline_times(vocab_size, b) for b in (1, 32)}
    print(f"mask timing on {len(everywhere)} schemas compiled by every backend, "
          f"{sum(map(len, walks))} steps at batch 1, {args.batch_steps} steps at batch 32")
    for name, summary in summaries.items():
        print_row(name, summary)
    kinds = {name: measure_kinds(backend, tokenizer) for name, backend in backends.items()}
    for name, per_kind in kinds.items():
        for kind, fig in per_kind.items():
            print(f"{name:<11} {kind:<8} compile ms {fig['compile_ms']:7.2f}  mask µs median "
                  f"{fig['mask_us_median']:6.1f} p99 {fig['mask_us_p99']:7.1f}")
    for key, base in baseline.items():
        print(f"baseline {key}: lm_head matmul {base['lm_head_us']:.0f} µs, "
              f"apply_token_bitmask {base['apply_bitmask_us']:.0f} µs")
    path = save_result("bench_grammar_engines", {
        "args": {k: str(v) for k, v in vars(args).items()}, "summaries": summaries,
        "baseline": baseline, "mask_schemas": [c.name for c in everywhere], "kinds": kinds,
    })
    print(f"results: {path}")
    print(reproduce_line())


if __name__ == "__main__":
    main()
