"""Smoke tests of examples/ on the default model, with few tokens each.

Each example's ``main`` is called with the session's engine instead of loading its own;
``python examples/X.py`` runs the same code with the default settings.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pydantic
import pytest

from frontend_dsl import ProgramState, ToolCall

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"arbor_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart(default_engine: Any) -> None:
    answers = load("quickstart").main(default_engine, max_tokens=8)
    assert len(answers) == 3 and "Paris" in answers[0]


def test_self_consistency(default_engine: Any) -> None:
    module = load("self_consistency")
    assert module.majority(["42", None, "42", "7"]) == ("42", {"42": 2, "7": 1})
    assert module.final_number("so 12+30 = 42. Answer: 42") == "42"
    module.main(default_engine, n=8, max_tokens=6)  # 8 branches actually sampled
    state = module.sample_answers.run(default_engine, question="What is 1 + 1?", n=8, max_tokens=4)
    assert len(state["reasoning"]) == 8 and len(set(state["reasoning"])) > 1  # different seeds


def test_tree_search(default_engine: Any) -> None:
    module = load("tree_search")
    best = module.main(default_engine, width=3, max_tokens=4)
    state = module.tree_search.run(default_engine, task="Write a slogan for a bakery.", width=3, max_tokens=4)
    drafts = state["draft"]
    assert [len(d) for d in drafts] == [3, 3, 3]
    score, draft, _ = module.best_leaf(state)
    scores = [m["scores"]["yes"] for inner in state.get_meta("verdict")["branches"] for m in inner["branches"]]
    assert len(scores) == 9 and score == max(scores)
    assert isinstance(best, str) and draft in [d for row in drafts for d in row]


def test_extraction(default_engine: Any, tmp_path: Path) -> None:
    module = load("extraction")
    out = tmp_path / "out.jsonl"
    lines = module.main(default_engine, output_path=out, max_tokens=48)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    docs = module.read_jsonl(module.DATA)
    assert written == lines and [w["id"] for w in written] == [d["id"] for d in docs]
    # constrained decoding: every document gives a record that validates, none an error
    assert all(set(line) == {"id", "record"} for line in written), written
    for line in written:
        module.Person.model_validate(line["record"])


def test_agent(default_engine: Any) -> None:
    module = load("agent")
    assert module.calculator(expression="330 * 100") == 33000.0
    with pytest.raises(KeyError):
        module.lookup(topic="mars")
    graph = module.react.trace(default_engine, question="q", max_steps=2)
    assert not graph.complete and graph.stop.variable == "next_0"
    state = module.main(default_engine, max_steps=2, max_tokens=12)
    assert isinstance(state, ProgramState) and isinstance(state["action_0"], ToolCall)
    assert "Observation: " in state.text() and "Final answer:" in state.text()


def test_programs(default_engine: Any) -> None:
    module = load("programs")
    assert set(module.PROGRAMS) == {"qa", "sentiment", "extract_contact", "summarize"}
    results = module.main(default_engine, max_tokens=6)
    assert results["sentiment"]["label"] == "positive"
    assert isinstance(module.Contact, type) and issubclass(module.Contact, pydantic.BaseModel)
