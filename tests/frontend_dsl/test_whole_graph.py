"""The whole request graph: reads that flow into later prompts are edges, not stops, and
the executor submits every ready node together (the 3 x 3 tree in two batches)."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from frontend_dsl import assistant, gen, program, select, user
from frontend_dsl.fake_backend import FakeBackend

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@program
def refine(s: Any, topic: str) -> None:
    s += f"Write about {topic}:" + gen("draft", max_tokens=3)
    s += "\nImprove this: " + s["draft"] + "\nBetter:" + gen("better", max_tokens=3)


def test_a_read_into_a_prompt_is_an_edge_and_tracing_goes_on(fake: FakeBackend) -> None:
    graph = refine.trace(fake, topic="cats")
    assert graph.complete and graph.stop is None
    kinds = [n.kind for n in graph.nodes]
    assert kinds == ["text", "gen", "text", "var", "text", "gen"]
    gen_node, var_node = graph.nodes[1], graph.nodes[3]
    assert (gen_node.id, var_node.id) in graph.edges() and var_node.attrs["name"] == "draft"
    assert "text of draft" in graph.to_dot()


def test_the_run_gives_the_same_text_as_an_eager_read(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: " purr" if r.prompt.endswith("cats:") else " better")
    state = refine.run(backend, topic="cats")
    assert state.text() == "Write about cats: purr\nImprove this:  purr\nBetter: better"
    assert backend.decode(state.token_ids()) == state.text()


def test_values_gathered_from_branches_flow_into_the_parent(fake: FakeBackend) -> None:
    @program
    def vote(s: Any) -> None:
        s += "Q:"
        forks = s.fork(2)
        forks += gen("a", max_tokens=1)
        forks.join()
        s += " Answers: " + s.ref("a") + gen("final", max_tokens=1)  # a list: + needs the ref

    graph = vote.trace(fake)
    assert graph.complete
    join = next(n for n in graph.nodes if n.kind == "join")
    var = next(n for n in graph.nodes if n.kind == "var")
    assert join.id in var.deps
    assert vote.run(fake).text() == "Q: Answers: [' ok', ' ok'] ok"


def test_control_flow_on_a_value_still_ends_the_trace(fake: FakeBackend) -> None:
    @program
    def branchy(s: Any) -> None:
        s += "Rain?" + gen("a", max_tokens=1)
        s += "Echo: " + s["a"]  # flows into the prompt: goes on
        if s["a"].strip() == "yes":  # needs the value: stops here
            s += "Umbrella."

    graph = branchy.trace(fake)
    assert not graph.complete and graph.stop is not None and graph.stop.variable == "a"
    assert [n.kind for n in graph.nodes] == ["text", "gen", "text", "var"]


def test_ref_under_run_never_blocks_the_body(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(token_delay_s=0.05)
    returned: list[float] = []

    @program
    def chain(s: Any) -> None:
        start = time.perf_counter()
        forks = s.fork(3)
        for branch in forks:
            branch += "Idea:" + gen("idea", max_tokens=3)
            branch += " Again: " + branch.ref("idea") + gen("again", max_tokens=3)
        forks.join()
        returned.append(time.perf_counter() - start)

    state = chain.run(backend)
    assert returned[0] < 0.1  # nothing waited for a generation
    assert backend.max_in_flight == 3
    assert state["again"] == [" ok ok ok"] * 3


def _load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(EXAMPLES))
    spec.loader.exec_module(module)
    return module


def test_the_tree_example_traces_whole(fake: FakeBackend) -> None:
    graph = _load_example("tree_search").tree_search.trace(fake, task="t")
    assert graph.complete
    gens = [n for n in graph.nodes if n.kind == "gen"]
    assert [n.attrs["name"] for n in gens].count("idea") == 3
    assert [n.attrs["name"] for n in gens].count("draft") == 9
    assert sum(n.kind == "select" for n in graph.nodes) == 9


@program
def tree(s: Any, width: int = 3) -> None:
    s += user("Name a colour.")
    ideas = s.fork(width)
    # NOTE: no speculation: whether a branch's drafts pay depends on measured step costs, and
    # a branch that accepts drafts finishes its idea steps early (same tokens, other steps)
    for i, idea in enumerate(ideas):
        idea += assistant(f"Idea {i}:" + gen("idea", max_tokens=8, ignore_eos=True, temperature=0,
                                             speculation=False))
        drafts = idea.fork(width)
        for j, draft in enumerate(drafts):
            draft += user(f"Draft {j}:") + assistant(gen("draft", max_tokens=16, ignore_eos=True, temperature=0,
                                                          speculation=False))
            draft += user("Good?") + assistant(select("ok", ["yes", "no"]))
        drafts.join()
    ideas.join()


def test_the_3x3_tree_runs_as_one_batch_of_3_then_one_of_9(tiny_engine: Any) -> None:
    tokenizer = tiny_engine.tokenizer
    steps: list[list[str]] = []
    lock = threading.Lock()

    def level(ids: list[int]) -> str:
        text = tokenizer.decode(ids)
        return "draft" if "Draft" in text.rsplit("Idea", 1)[-1] else "idea"

    def hook(batch: Any) -> None:
        generating = [r for r in batch.decode] + [i.request for i in batch.prefill
                                                  if i.request.params.max_new_tokens > 0]
        with lock:
            steps.append([level(r.prompt_ids) for r in generating])

    remove = tiny_engine.add_step_hook(hook)
    try:
        state = tree.run(tiny_engine)
    finally:
        remove()
    assert len(state["draft"]) == 3 and all(len(d) == 3 for d in state["draft"])
    ideas = [s.count("idea") for s in steps]
    drafts = [s.count("draft") for s in steps]
    assert max(ideas) == 3  # the 3 first-level branches decode together
    assert max(drafts) == 9  # then all 9 second-level ones
    first_draft = next(i for i, n in enumerate(drafts) if n)
    assert all(n == 0 for n in ideas[first_draft:])  # no idea is still running then


def test_the_run_trace_shows_the_new_node_kinds(fake: FakeBackend) -> None:
    @program
    def p(s: Any) -> None:
        s["k"] = 1
        with s.var_scope("line"):
            s += "A:" + gen("a", max_tokens=1)
        s += " again" + s.ref("a")

    trace = p.run(fake).run_trace().to_json()
    kinds = [n["kind"] for n in trace["nodes"]]
    assert {"set", "capture", "var"} <= set(kinds)
    assert all(n["end_s"] >= n["start_s"] for n in trace["nodes"])
