"""fork: branches share the parent's prefix and run together; join: gather / concat."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from frontend_dsl import ProgramError, gen, program
from frontend_dsl.fake_backend import FakeBackend, FakeRequest


def numbered(r: FakeRequest) -> str:
    """Answer with the branch number the prompt ends with."""
    return " #" + r.prompt.rstrip(":").split("branch ")[-1]


def test_branches_share_the_parent_prefix_and_hit_the_cache(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(numbered, token_delay_s=0.01)

    @program
    def p(s: Any) -> None:
        s += "A long shared question about many things, " * 4
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += f"branch {i}:" + gen("x", max_tokens=3)
        forks.join()

    state = p.run(backend)
    assert state["x"] == [" #0", " #1", " #2"]
    prefix = backend.encode("A long shared question about many things, " * 4)
    assert all(r.input_ids[: len(prefix) - 1] == tuple(prefix[:-1]) for r in backend.requests)
    assert backend.max_in_flight == 3  # all branches were in flight together
    for name, branch_meta in [(f"b{i}", m) for i, m in enumerate(_branch_metas(state))]:
        assert branch_meta["num_cached_tokens"] >= len(prefix) - 1, name
    assert backend.metrics()["cache_hit_rate"] > 0


def _branch_metas(state: Any) -> list[dict[str, Any]]:
    fork = next(n for n in state.graph.nodes if n.kind == "fork")
    session = state._session
    return [session.executor.streams[b].meta["x"] for b in fork.attrs["branches"]]


def test_broadcast_appends_to_every_branch(fake: FakeBackend) -> None:
    @program
    def p(s: Any) -> None:
        s += "Q:"
        forks = s.fork(2)
        forks += " A" + gen("a", max_tokens=1)
        assert [f["a"] for f in forks] == [" ok", " ok"]
        assert [f.text() for f in forks] == ["Q: A ok", "Q: A ok"]

    state = p.run(fake)
    assert state.text() == "Q:"  # branches never write into the parent by themselves


def test_join_gather_makes_lists_and_leaves_parent_text(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(numbered)

    @program
    def p(s: Any) -> None:
        s += "start "
        s += gen("before", max_tokens=1)
        forks = s.fork(2)
        for i, branch in enumerate(forks):
            branch += f"branch {i}:" + gen("x", max_tokens=2)
        forks[1] += gen("only_second", max_tokens=1)
        forks.join()
        s += " end"

    state = p.run(backend)
    assert state["x"] == [" #0", " #1"]
    assert state["only_second"] == [None, " #"]
    assert state["before"] == " #"  # inherited variables stay as they were, not gathered
    assert state.text() == "start  # end"


def test_join_concat_appends_each_branch_in_order(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(numbered)

    @program
    def p(s: Any) -> None:
        s += "Q:"
        forks = s.fork(2)
        for i, branch in enumerate(forks):
            branch += f"branch {i}:" + gen("x", max_tokens=2)
        forks.join(mode="concat")

    state = p.run(backend)
    assert state.text() == "Q:branch 0: #0branch 1: #1"
    assert backend.decode(state.token_ids()) == state.text()


def test_join_waits_without_blocking_the_program(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(token_delay_s=0.02)
    order: list[str] = []

    @program
    def p(s: Any) -> None:
        forks = s.fork(2)
        forks += "x" + gen("a", max_tokens=5)
        forks.join()
        order.append("after join")
        s += gen("b", max_tokens=1)
        order.append("after gen")
        order.append(f"{len(s['a'])} values")

    p.run(backend)
    assert order == ["after join", "after gen", "2 values"]
    # b starts only once both branches are done: its prompt is the parent's (empty) text
    assert backend.requests[-1].prompt == ""


def test_nested_forks(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: f" <{r.prompt}>")

    @program
    def p(s: Any) -> None:
        outer = s.fork(2)
        for i, o in enumerate(outer):
            o += str(i)
            inner = o.fork(2)
            for j, leaf in enumerate(inner):
                leaf += str(j) + gen("leaf", max_tokens=20)
            inner.join()
        outer.join()

    assert p.run(backend)["leaf"] == [[" <00>", " <01>"], [" <10>", " <11>"]]


def test_a_failing_branch_fails_the_join(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: "bad" if r.prompt.endswith("1") else "7")

    @program
    def p(s: Any) -> None:
        forks = s.fork(2)
        for i, branch in enumerate(forks):
            branch += str(i) + gen("n", regex="[0-9]")
        forks.join()

    with pytest.raises(ProgramError, match="does not match") as info:
        p.run(backend)
    assert info.value.state.text() == ""


def test_fork_inside_an_open_role_is_rejected(fake: FakeBackend) -> None:
    @program
    def p(s: Any) -> None:
        with s.user():
            s.fork(2)

    with pytest.raises(ProgramError, match="close the open role"):
        p.run(fake)


def test_join_gathers_meta_too(fake: FakeBackend) -> None:
    @program
    def p(s: Any) -> None:
        forks = s.fork(2)
        for i, branch in enumerate(forks):
            branch += f"{i} is " + gen("c", choices=["odd", "even"])
        forks.join()

    state = p.run(fake)
    metas = state.get_meta("c")["branches"]
    assert [max(m["scores"], key=m["scores"].get) for m in metas] == state["c"]
