"""Sampled outputs on JSONSchemaBench: does every constrained generation validate?

For each of the 300 real-world schemas in ``/work/shared/jsonschemabench`` (the sample the
test suite uses), the engine's default backend compiles the schema; for every schema that
compiles, the default model samples one output (temperature ``--temperature``, one short
fixed chat prompt, all requests in one ``generate`` call). Every output that finished
(``stop``) is parsed and validated with ``jsonschema`` against its schema; outputs cut by
``max_new_tokens`` are counted apart (a length cap is not a grammar failure, and their
text is a valid prefix by construction). Prints the shares (target: 100% of finished
outputs validate), separately for exact grammars and for relaxations (schemas with
keywords llguidance does not implement compile to a documented superset, so a relaxed
grammar may emit an output the full schema refuses), and names every failure.

The acceptance side (valid instances accepted, invalid ones rejected) is the test
``tests/runtime/constrained/test_jsonschemabench.py``.

    .venv/bin/python benchmarks/bench_jsonschemabench.py [--max-new-tokens 256] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result  # noqa: E402

from grammars import ConstraintError  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402

DATA_DIR = Path("/work/shared/jsonschemabench")


def schemas(limit: int | None) -> list[tuple[str, dict[str, Any]]]:
    manifest = json.loads((DATA_DIR / "manifest.json").read_text())
    out = [(e["file"], json.loads((DATA_DIR / e["file"]).read_text())) for e in manifest["files"]]
    return out[:limit] if limit else out


def validates(text: str, schema: dict[str, Any]) -> str | None:
    """None when ``text`` parses and validates; otherwise why not."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    validator = validator_for(schema, default=Draft202012Validator)(schema)
    error = next(iter(validator.iter_errors(value)), None)
    return None if error is None else f"invalid: {error.message[:160]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--limit", type=int, default=None, help="first N schemas only")
    ap.add_argument("--max-running", type=int, default=128)
    args = ap.parse_args()
    if not DATA_DIR.is_dir():
        sys.exit(f"{DATA_DIR} is missing")
    print(reproduce_line())
    engine = Engine(model="default", page_size=16, max_running_requests=args.max_running)
    prompt = engine.apply_chat_template([{"role": "user", "content": "Write one example record as JSON."}])
    compiled: list[tuple[str, dict[str, Any]]] = []
    exact: dict[str, bool] = {}
    not_compiled: list[str] = []
    for name, schema in schemas(args.limit):
        try:
            exact[name] = engine.compile_constraint(schema).approximation is None
            compiled.append((name, schema))
        except ConstraintError as exc:
            not_compiled.append(f"{name}: {str(exc).splitlines()[0][:120]}")
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=i,
                             constraint=schema) for i, (_, schema) in enumerate(compiled)]
    start = time.perf_counter()
    outs = engine.generate([prompt] * len(compiled), params)
    seconds = time.perf_counter() - start
    capped = 0
    finished = {True: 0, False: 0}  # by exact grammar
    valid = {True: 0, False: 0}
    failures = []
    for (name, schema), out in zip(compiled, outs, strict=True):
        if out.finish_reason == "length":
            capped += 1
            continue
        kind = "exact" if exact[name] else "relaxed"
        if out.finish_reason != "stop":
            failures.append(f"[{kind}] {name}: finish {out.finish_reason} ({out.error})")
            continue
        finished[exact[name]] += 1
        problem = validates(out.text, schema)
        if problem is None:
            valid[exact[name]] += 1
        else:
            failures.append(f"[{kind}] {name}: {problem}: {out.text[:120]!r}")
    total = len(compiled) + len(not_compiled)
    print(f"schemas {total}: compiled {len(compiled)}; sampled one output each in {seconds:.1f} s "
          f"(temperature {args.temperature}, max_new_tokens {args.max_new_tokens})")
    done = finished[True] + finished[False]
    print(f"  finished {done}, cut by max_new_tokens {capped}, other {len(compiled) - done - capped}")
    for is_exact, label in ((True, "exact grammars"), (False, "relaxed grammars")):
        n, ok = finished[is_exact], valid[is_exact]
        print(f"  finished outputs that validate, {label}: {ok}/{n} = {ok / max(n, 1):.1%}")
    for failure in failures:
        print("  FAIL", failure)
    print(f"load average: {load_average()}")
    print("saved", save_result("bench_jsonschemabench", {
        "args": vars(args), "schemas": total, "compiled": len(compiled),
        "exact": sum(exact.values()), "finished_exact": finished[True], "valid_exact": valid[True],
        "finished_relaxed": finished[False], "valid_relaxed": valid[False], "capped": capped,
        "failures": failures, "not_compiled": not_compiled,
        "seconds": seconds,
    }))


if __name__ == "__main__":
    main()
