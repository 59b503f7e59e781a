"""Sampled outputs on JSONSchemaBench: does every constrained generation validate, and how
many run into the length cap, with and without the bounds on number literals?

For each of the 300 real-world schemas in ``/work/shared/jsonschemabench`` (the sample the
test suite uses; ``--stride k`` keeps every k-th, across all ten splits), the engine's
default backend compiles the schema; for every schema that compiles, the default model
samples one output (temperature ``--temperature``, one short fixed chat prompt, seed = the
schema's index, all requests in one ``generate`` call). Every output that finished
(``stop``) is parsed and validated with ``jsonschema`` against its schema; outputs cut by
``max_new_tokens`` are counted apart, and those whose text ends in a run of more than 20
digits are counted as runaway numbers. Prints the shares (target: 100% of finished outputs
validate for exact grammars), separately for exact grammars and for relaxations (schemas
with keywords llguidance does not implement compile to a documented superset, so a
relaxed grammar may emit an output the full schema refuses; the engine's own
``constraint_check`` must agree with the benchmark's verdict), and names every failure.

``--bounds both`` (the default) runs the sample twice on one engine with the same seeds:
bounds off (``json_bounds=None``: the baseline, numbers of any length) and on (the default
``grammars.JsonBounds``); ``--bounds on`` / ``off`` runs one of them.

The acceptance side (valid instances accepted, invalid ones rejected) is the test
``tests/runtime/constrained/test_jsonschemabench.py``.

    .venv/bin/python benchmarks/bench_jsonschemabench.py [--temperature 1] [--bounds both|on|off]
        [--stride 3] [--max-new-tokens 256] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result  # noqa: E402

from grammars import DEFAULT_JSON_BOUNDS, ConstraintError, JsonBounds, to_constraint  # noqa: E402
from runtime import Engine, RequestOutput, SamplingParams  # noqa: E402

DATA_DIR = Path("/work/shared/jsonschemabench")
RUNAWAY = re.compile(r"[0-9]{21,}$")  # a length-capped output that ends inside a long number


def schemas(limit: int | None, stride: int) -> list[tuple[str, dict[str, Any]]]:
    manifest = json.loads((DATA_DIR / "manifest.json").read_text())
    out = [(e["file"], json.loads((DATA_DIR / e["file"]).read_text())) for e in manifest["files"]]
    return (out[:limit] if limit else out)[::stride]


def validates(text: str, schema: dict[str, Any]) -> str | None:
    """None when ``text`` parses and validates; otherwise why not."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    validator = validator_for(schema, default=Draft202012Validator)(schema)
    error = next(iter(validator.iter_errors(value)), None)
    return None if error is None else f"invalid: {error.message[:160]}"


def run(engine: Engine, prompt: str, compiled: list[tuple[str, dict[str, Any]]], exact: dict[str, bool],
        bounds: JsonBounds | None, args: argparse.Namespace) -> dict[str, Any]:
    """Sample one output per schema and tally it."""
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=i,
                             constraint=to_constraint(schema, json_bounds=bounds))
              for i, (_, schema) in enumerate(compiled)]
    start = time.perf_counter()
    outs = engine.generate([prompt] * len(compiled), params)
    seconds = time.perf_counter() - start
    r: dict[str, Any] = {"bounds": bounds is not None, "seconds": seconds, "capped": 0, "runaway": 0,
                         "finished": {"exact": 0, "relaxed": 0}, "valid": {"exact": 0, "relaxed": 0},
                         "check_disagrees": [], "failures": [], "capped_tails": []}
    for (name, schema), out in zip(compiled, outs, strict=True):
        tally(r, name, schema, out, "exact" if exact[name] else "relaxed")
    return r


def tally(r: dict[str, Any], name: str, schema: dict[str, Any], out: RequestOutput, kind: str) -> None:
    if out.finish_reason == "length":
        r["capped"] += 1
        r["runaway"] += RUNAWAY.search(out.text) is not None
        r["capped_tails"].append(f"{name}: {out.text[-60:]!r}")
        return
    if out.finish_reason != "stop":
        r["failures"].append(f"[{kind}] {name}: finish {out.finish_reason} ({out.error})")
        return
    r["finished"][kind] += 1
    problem = validates(out.text, schema)
    r["valid"][kind] += problem is None
    check = out.constraint_check
    if check is None or check.valid != (problem is None):
        r["check_disagrees"].append(f"{name}: engine {check}, benchmark {problem}")
    if problem is not None:
        r["failures"].append(f"[{kind}] {name}: {problem}: {out.text[:120]!r}")


def report(r: dict[str, Any], total: int, args: argparse.Namespace) -> None:
    label = "bounds on (default JsonBounds)" if r["bounds"] else "bounds off (baseline)"
    done = r["finished"]["exact"] + r["finished"]["relaxed"]
    print(f"[{label}] sampled {total} outputs in {r['seconds']:.1f} s")
    print(f"  finished {done}; cut by max_new_tokens={args.max_new_tokens}: {r['capped']}/{total} = "
          f"{r['capped'] / max(total, 1):.1%} (of them ending in a runaway number of 21+ digits: "
          f"{r['runaway']}); other {total - done - r['capped']}")
    for kind in ("exact", "relaxed"):
        n, ok = r["finished"][kind], r["valid"][kind]
        print(f"  finished outputs that validate, {kind} grammars: {ok}/{n} = {ok / max(n, 1):.1%}")
    print(f"  engine constraint_check disagrees with jsonschema: {len(r['check_disagrees'])}")
    for line in r["check_disagrees"] + [f"FAIL {f}" for f in r["failures"]]:
        print("   ", line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--bounds", choices=("both", "on", "off"), default="both",
                    help="number-literal bounds: off is the baseline (default: both, same seeds)")
    ap.add_argument("--limit", type=int, default=None, help="first N schemas only")
    ap.add_argument("--stride", type=int, default=1, help="every k-th schema (all splits)")
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
    for name, schema in schemas(args.limit, args.stride):
        try:
            exact[name] = engine.compile_constraint(schema).approximation is None
            compiled.append((name, schema))
        except ConstraintError as exc:
            not_compiled.append(f"{name}: {str(exc).splitlines()[0][:120]}")
    total = len(compiled) + len(not_compiled)
    print(f"schemas {total}: compiled {len(compiled)} ({sum(exact.values())} exact, "
          f"{len(compiled) - sum(exact.values())} relaxed); temperature {args.temperature}, "
          f"max_new_tokens {args.max_new_tokens}, seed = schema index")
    configs = {"both": [None, DEFAULT_JSON_BOUNDS], "on": [DEFAULT_JSON_BOUNDS], "off": [None]}[args.bounds]
    runs = []
    for bounds in configs:
        runs.append(run(engine, prompt, compiled, exact, bounds, args))
        report(runs[-1], len(compiled), args)
    print(f"load average: {load_average()}")
    print("saved", save_result("bench_jsonschemabench", {
        "args": vars(args), "schemas": total, "compiled": len(compiled), "exact": sum(exact.values()),
        "not_compiled": not_compiled, "runs": runs,
    }))


if __name__ == "__main__":
    main()
