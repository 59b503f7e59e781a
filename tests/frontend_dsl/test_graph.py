"""Tracing: programs become request graphs; reads of generated values end the graph."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from frontend_dsl import assistant, gen, program, select, tool, user
from frontend_dsl.fake_backend import FakeBackend, FakeRequest


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return key.upper()


@program
def vote(s: Any, question: str, n: int) -> None:
    s += user(question)
    forks = s.fork(n)
    forks += assistant(gen("answer", max_tokens=8))
    forks.join()
    s += "Best: " + select("best", ["A", "B"])
    s += gen("call", tools=[lookup])


def test_trace_builds_nodes_and_edges_without_running(fake: FakeBackend) -> None:
    graph = vote.trace(fake, question="Q?", n=2)
    assert fake.requests == []
    assert graph.complete and graph.stop is None
    kinds = [n.kind for n in graph.nodes]
    assert kinds.count("gen") == 2 and kinds.count("fork") == 1 and kinds.count("join") == 1
    assert kinds[-2:] == ["select", "tool_call"]
    fork = next(n for n in graph.nodes if n.kind == "fork")
    join = next(n for n in graph.nodes if n.kind == "join")
    gens = [n for n in graph.nodes if n.kind == "gen"]
    # branches depend (through their chain) on the fork, not on each other
    assert {g.stream_id for g in gens} == set(fork.attrs["branches"])
    assert all(g.deps[0] != other.id for g in gens for other in gens)
    # the join depends on its parent's chain and on the last node of every branch
    branch_tails = {max(n.id for n in graph.nodes if n.stream_id == b) for b in fork.attrs["branches"]}
    assert set(join.deps) == {fork.id} | branch_tails


def test_graph_json_and_dot(fake: FakeBackend) -> None:
    graph = vote.trace(fake, question="Q?", n=2)
    data = json.loads(graph.to_json_str())
    assert data["program"] == "vote" and data["complete"] is True
    assert len(data["nodes"]) == len(graph.nodes)
    assert [tuple(e) for e in data["edges"]] == graph.edges()
    gen_node = next(n for n in data["nodes"] if n["kind"] == "gen")
    assert gen_node["name"] == "answer" and gen_node["max_tokens"] == 8
    call = next(n for n in data["nodes"] if n["kind"] == "tool_call")
    assert call["tools"] == ["lookup"] and call["constraint"]["kind"] == "json_schema"
    dot = graph.to_dot()
    assert dot.startswith('digraph "vote" {') and dot.rstrip().endswith("}")
    assert dot.count(" -> ") == len(graph.edges())
    assert "fork x2" in dot and "join (gather)" in dot


def test_argument_dependent_control_flow_is_traced(fake: FakeBackend) -> None:
    assert sum(n.kind == "gen" for n in vote.trace(fake, question="Q", n=3).nodes) == 3
    assert sum(n.kind == "gen" for n in vote.trace(fake, question="Q", n=5).nodes) == 5


@program
def branchy(s: Any) -> None:
    s += "Is it raining? " + gen("answer", max_tokens=2)
    if "yes" in s["answer"]:
        s += " Take an umbrella." + gen("tip", max_tokens=2)
    else:
        s += " Enjoy the sun." + gen("tip", max_tokens=2)


def test_data_dependent_control_flow_ends_the_graph(fake: FakeBackend) -> None:
    graph = branchy.trace(fake)
    assert not graph.complete
    assert graph.stop is not None and graph.stop.variable == "answer"
    assert [n.kind for n in graph.nodes] == ["text", "gen"]  # nothing after the read
    assert graph.stop.after_node == 1
    assert "interpreted" in graph.to_dot()
    assert graph.to_json()["stop"]["variable"] == "answer"


def test_the_rest_runs_interpreted_and_takes_the_right_branch(make_fake: Callable[..., FakeBackend]) -> None:
    def weather(answer: str) -> Callable[[FakeRequest], str]:
        return lambda r: answer if r.prompt.endswith("? ") else " ok"

    rainy = branchy.run(make_fake(weather(" yes")))
    sunny = branchy.run(make_fake(weather(" no")))
    assert rainy.text() == "Is it raining?  yes Take an umbrella. ok"
    assert sunny.text() == "Is it raining?  no Enjoy the sun. ok"
    assert [n.kind for n in rainy.graph.nodes] == ["text", "gen", "text", "gen"]


def test_reading_text_also_ends_the_trace(fake: FakeBackend) -> None:
    @program
    def p(s: Any) -> None:
        s += "a" + gen("x", max_tokens=1)
        if len(s.text()) > 3:
            s += "long"

    graph = p.trace(fake)
    assert not graph.complete and graph.stop is not None and graph.stop.variable is None


def test_independent_branches_are_submitted_together(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(token_delay_s=0.01)
    state = vote.run(backend, question="Q?", n=4)
    assert backend.max_in_flight == 4
    assert len(state["answer"]) == 4
