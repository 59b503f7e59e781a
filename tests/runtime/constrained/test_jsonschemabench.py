"""The default JSON backend on JSONSchemaBench: the 300-schema sample in
``../shared/jsonschemabench`` where the checkout has it (slow), and always the 39 schemas
vendored under ``data/jsonschemabench_sample`` (drawn from it: exact, relaxed and one
schema that does not compile; see its README).

Figures a user would notice: the share of real-world schemas that compile (exactly, or
as a flagged relaxation), the share of known-valid instances the grammar accepts (fed
as the tokenizer's canonical tokenization, then EOS; an instance refused as written is
retried with its keys in the schema's property order, the order engines generate in),
and the share of known-invalid instances it rejects. Each compile is bounded by the compiler's time limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for

from grammars import ConstraintError
from runtime.constrained import (
    CompiledGrammar,
    GrammarCompiler,
    allocate_token_bitmask,
    default_backend_name,
)
from runtime.constrained.bitmask import allowed_token_ids
from runtime.constrained.token_bytes import ordinary_token_bytes
from tests.runtime.constrained.conftest import EOS, encode

# NOTE: beside the repository (``/work/shared`` next to ``/work/main`` or a worktree).
FULL_DIR = Path(__file__).resolve().parents[3].parent / "shared" / "jsonschemabench"
SAMPLE_DIR = Path(__file__).resolve().parent / "data" / "jsonschemabench_sample"
COMPILE_TIMEOUT_S = 10.0


@dataclass
class BenchFigures:
    """Counts over the sample; ``failures`` says what went wrong, for the report."""

    num_schemas: int = 0
    num_exact: int = 0  # compiled to a grammar for exactly the schema
    num_approximate: int = 0  # compiled to a relaxation (unsupported keywords ignored)
    num_valid: int = 0
    num_valid_accepted: int = 0
    num_valid_reordered: int = 0  # of those, accepted only with keys in schema order
    num_valid_respelled: int = 0  # of those, written with another tokenization under the mask
    num_valid_mask_only: int = 0  # refused by the mask, taken by the matcher, not respellable
    num_invalid: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    num_invalid_rejected: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    failures: list[str] = field(default_factory=list)


def _cases(data_dir: Path) -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    cases = []
    for entry in manifest["files"]:
        tests_file = entry.get("tests_file")
        tests = json.loads((data_dir / tests_file).read_text())["tests"] if tests_file else []
        cases.append((entry["file"], json.loads((data_dir / entry["file"]).read_text()), tests))
    return cases


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    """Follow local ``$ref`` pointers (``#/a/b``) to the schema they name."""
    for _ in range(16):  # NOTE: bounded: a ref chain may loop
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#"):
            return schema
        target: Any = root
        for part in ref.lstrip("#").strip("/").split("/") if ref != "#" else []:
            target = target.get(part.replace("~1", "/").replace("~0", "~"), {})
        schema = target
    return schema


def _properties(
    schema: dict[str, Any], value: Any, root: dict[str, Any], branch_first: bool
) -> dict[str, Any]:
    """Property schemas in emission order: the schema's own, then ``allOf`` parts', then
    those of the first ``anyOf``/``oneOf`` branch that ``value`` is valid under (or the
    branches' first, with ``branch_first``: engines differ in how they merge)."""
    own = dict(schema.get("properties") or {})
    props: dict[str, Any] = {} if branch_first else own
    branches = [_resolve(b, root) for b in schema.get("allOf", [])]
    for key in ("anyOf", "oneOf"):
        options = [_resolve(b, root) for b in schema.get(key, [])]
        branches += [b for b in options if _valid(value, b, root)][:1]
    for branch in branches:
        if isinstance(branch, dict):
            for name, sub in _properties(branch, value, root, branch_first).items():
                props.setdefault(name, sub)
    return {**props, **{k: v for k, v in own.items() if k not in props}}


def _valid(value: Any, schema: Any, root: dict[str, Any]) -> bool:
    validator = validator_for(root, default=Draft202012Validator)(root)
    return bool(validator.evolve(schema=schema).is_valid(value))


def in_schema_order(
    value: Any, schema: Any, root: dict[str, Any], branch_first: bool = False, depth: int = 0
) -> Any:
    """``value`` with object keys in the schema's order: ``properties``, then other
    ``required`` keys, then the rest as written.

    Grammar engines emit properties in schema order, so that is how a model writes an
    instance; the benchmark's instances were written by another model in any order.
    """
    schema = _resolve(schema, root)
    if depth > 32 or not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        props = _properties(schema, value, root, branch_first)
        order = [*props, *(k for k in schema.get("required", []) if k not in props)]
        keys = [k for k in order if k in value] + [k for k in value if k not in order]
        return {
            k: in_schema_order(value[k], props.get(k, {}), root, branch_first, depth + 1)
            for k in keys
        }
    if isinstance(value, list):
        items = schema.get("items")
        if not isinstance(items, dict):
            options = [_resolve(b, root) for b in schema.get("anyOf", []) + schema.get("oneOf", [])]
            items = next((b.get("items") for b in options if _valid(value, b, root)), None)
        if isinstance(items, dict):
            return [in_schema_order(v, items, root, branch_first, depth + 1) for v in value]
    return value


def grammar_accepts(
    compiled: CompiledGrammar, vocab_size: int, token_ids: list[int], check_mask: bool = True
) -> bool:
    """Every token (then EOS) is accepted and, with ``check_mask``, in the mask first."""
    matcher = compiled.new_matcher()
    bitmask = allocate_token_bitmask(1, vocab_size)
    for token in [*token_ids, EOS]:
        if check_mask:
            matcher.fill_bitmask(bitmask, 0)
            word, bit = divmod(token, 32)
            if not (int(bitmask[0, word]) >> bit) & 1:
                return False
        if not matcher.accept_token(token):
            return False
    return True


def mask_can_spell(compiled: CompiledGrammar, vocab_size: int, data: bytes, spelling: dict[int, bytes]) -> bool:
    """Can decoding under the mask write exactly ``data``, then EOS?

    Where the canonical tokenization hits a token the mask refuses, a model still writes
    the same text with other tokens (``"}`` as ``"`` then ``}``). Greedy: each step takes
    the longest allowed token that spells the next bytes.
    """
    matcher = compiled.new_matcher()
    bitmask = allocate_token_bitmask(1, vocab_size)
    pos = 0
    while pos < len(data):
        matcher.fill_bitmask(bitmask, 0)
        fits = [t for t in allowed_token_ids(bitmask[0], vocab_size)
                if spelling.get(t) and data.startswith(spelling[t], pos)]
        if not fits:
            return False
        token = max(fits, key=lambda t: len(spelling[t]))
        if not matcher.accept_token(token):
            return False
        pos += len(spelling[token])
    matcher.fill_bitmask(bitmask, 0)
    return EOS in allowed_token_ids(bitmask[0], vocab_size) and matcher.accept_token(EOS)


def _spelling(tokenizer: Any) -> dict[int, bytes]:
    return {i: b for b, ids in ordinary_token_bytes(tokenizer).items() for i in ids}


def _check_instances(
    figures: BenchFigures, name: str, compiled: CompiledGrammar, tokenizer: Any,
    schema: dict[str, Any], tests: list[dict[str, Any]], spelling: dict[int, bytes],
) -> None:
    exact = compiled.approximation is None
    for test in tests:
        text = json.dumps(test["data"], ensure_ascii=False)
        accepted = grammar_accepts(compiled, len(tokenizer), encode(tokenizer, text))
        for branch_first in (False, True) if test["valid"] and not accepted else ():
            ordered = in_schema_order(test["data"], schema, schema, branch_first)
            text = json.dumps(ordered, ensure_ascii=False)
            accepted = grammar_accepts(compiled, len(tokenizer), encode(tokenizer, text))
            figures.num_valid_reordered += accepted
            if accepted:
                break
        if test["valid"]:
            figures.num_valid += 1
            figures.num_valid_accepted += accepted
            matcher_takes = not accepted and grammar_accepts(
                compiled, len(tokenizer), encode(tokenizer, text), check_mask=False
            )
            if matcher_takes and mask_can_spell(compiled, len(tokenizer), text.encode(), spelling):
                figures.num_valid_accepted += 1
                figures.num_valid_respelled += 1
            elif matcher_takes:
                figures.num_valid_mask_only += 1  # the matcher takes it; only the mask refuses
            elif not accepted:
                figures.failures.append(f"valid instance refused: {name}: {test['description']}")
        else:
            figures.num_invalid[exact] += 1
            figures.num_invalid_rejected[exact] += not accepted


def run_bench(compiler: GrammarCompiler, tokenizer: Any, data_dir: Path) -> BenchFigures:
    figures = BenchFigures()
    cases = _cases(data_dir)
    spelling = _spelling(tokenizer)
    futures = [compiler.compile_async(schema) for _, schema, _ in cases]  # all queued at once
    for (name, schema, tests), future in zip(cases, futures, strict=True):
        figures.num_schemas += 1
        try:
            compiled = future.result()
        except ConstraintError as exc:
            figures.failures.append(f"not compiled: {name}: {str(exc).splitlines()[0][:150]}")
            continue
        if compiled.approximation is None:
            figures.num_exact += 1
        else:
            figures.num_approximate += 1
        _check_instances(figures, name, compiled, tokenizer, schema, tests, spelling)
    return figures


def _share(num: int, den: int) -> str:
    return f"{num}/{den} = {num / max(den, 1):.1%}"


DATA_SETS = [
    pytest.param(SAMPLE_DIR, 39, id="vendored-sample"),
    *([pytest.param(FULL_DIR, 300, id="shared-300", marks=pytest.mark.slow)] if FULL_DIR.is_dir() else []),
]


@pytest.mark.parametrize(("data_dir", "num_schemas"), DATA_SETS)
def test_default_backend_on_jsonschemabench(
    tokenizer: Any, capsys: Any, data_dir: Path, num_schemas: int
) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), timeout_s=COMPILE_TIMEOUT_S)
    figures = run_bench(compiler, tokenizer, data_dir)
    compiler.close()
    num_compiled = figures.num_exact + figures.num_approximate
    with capsys.disabled():
        print(
            f"\n[{default_backend_name('json_schema')}] compiled "
            f"{_share(num_compiled, figures.num_schemas)} "
            f"(exact {figures.num_exact}, relaxed {figures.num_approximate}); valid accepted "
            f"{_share(figures.num_valid_accepted, figures.num_valid)} "
            f"({figures.num_valid_reordered} after putting keys in schema order, "
            f"{figures.num_valid_respelled} written with another tokenization where the mask "
            f"refuses a canonical token; refused by the mask only, matcher accepts: "
            f"{figures.num_valid_mask_only}); invalid rejected: "
            f"exact grammars {_share(figures.num_invalid_rejected[True], figures.num_invalid[True])}"
            f", relaxed {_share(figures.num_invalid_rejected[False], figures.num_invalid[False])}"
        )
        for failure in figures.failures:
            print("  ", failure)
    assert figures.num_schemas == num_schemas
    assert num_compiled / figures.num_schemas >= 0.85
    # Both kinds of compile are exercised (the vendored sample: 27 exact, 11 relaxed, 1 not
    # compiled), and key reordering.
    assert figures.num_exact and figures.num_approximate and figures.num_invalid[True]
    assert figures.num_valid_reordered
    # Every valid instance can be written under the mask: where the mask refuses a canonical
    # token the matcher accepts (llguidance_backend.JSON_LAYOUT's NOTE), another tokenization
    # of the same text gets through.
    assert figures.num_valid_accepted == figures.num_valid, figures.failures
    assert figures.num_valid_mask_only == 0
    # An exact grammar admits no instance the schema forbids.
    assert figures.num_invalid_rejected[True] == figures.num_invalid[True]
