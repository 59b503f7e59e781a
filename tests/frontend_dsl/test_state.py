"""State utilities: s[x] = v, "x" in s, copy, var_scope, broadcasts, role begin/end,
s.system(...) as an expression; streaming a variable while the program runs; token healing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from frontend_dsl import (
    ProgramDefinitionError,
    ProgramError,
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    program,
    user,
    user_begin,
    user_end,
)
from frontend_dsl.fake_backend import FakeBackend, FakeRequest


def test_set_and_contains(fake: FakeBackend) -> None:
    seen: dict[str, bool] = {}

    @program
    def p(s: Any) -> None:
        s["topic"] = {"k": 1}
        seen["before"] = "x" in s
        s += "Q" + gen("x", max_tokens=1)
        seen["after"] = "x" in s
        seen["topic"] = "topic" in s

    state = p.run(fake)
    assert seen == {"before": False, "after": True, "topic": True}
    assert state["topic"] == {"k": 1} and state.text() == "Q ok"
    with pytest.raises(ProgramDefinitionError):
        state["" ] = 1


def test_copy_is_an_independent_state_sharing_the_prefix(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: " A" if r.prompt.endswith("1:") else " B")

    @program
    def p(s: Any) -> None:
        s += "Shared prefix. "
        other = s.copy()
        other += "1:" + gen("x", max_tokens=1)
        s += "2:" + gen("x", max_tokens=1)
        s["other"] = other["x"]

    state = p.run(backend)
    assert state.text() == "Shared prefix. 2: B" and state["other"] == " A"


def test_var_scope_captures_what_is_appended_inside(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def p(s: Any) -> None:
        s += "Intro. "
        with s.var_scope("line"):
            s += "Name:" + gen("name", max_tokens=1) + "."
        s += " Done"

    state = p.run(make_fake(lambda r: " Ada"))
    assert state["line"] == "Name: Ada." and state["name"] == " Ada"
    assert state.text() == "Intro. Name: Ada. Done"


def test_fork_broadcast_with_a_list_and_a_lambda(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: " " + r.prompt.split()[1] + r.prompt.split()[-1])

    @program
    def p(s: Any) -> None:
        forks = s.fork(3)
        forks += ["say a", "say b", "say c"]
        forks += lambda i: f" then {i}" + gen("x", max_tokens=4)
        forks.join("gather_variable")

    assert p.run(backend)["x"] == [" a0", " b1", " c2"]

    @program
    def bad(s: Any) -> None:
        s.fork(2).__iadd__(["only one"])

    with pytest.raises(ProgramError, match="one item per branch"):
        bad.run(backend)


def test_concate_and_append_is_concat(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def p(s: Any) -> None:
        s += "Q:"
        forks = s.fork(2)
        forks += lambda i: f" b{i}"
        forks.join("concate_and_append")

    assert p.run(make_fake()).text() == "Q: b0 b1"


def test_role_begin_end_equal_role_expressions(fake: FakeBackend) -> None:
    @program
    def with_markers(s: Any) -> None:
        s += user_begin() + "Hi" + user_end()
        s += assistant_begin()
        s += gen("a", max_tokens=1)
        s += assistant_end()

    @program
    def with_roles(s: Any) -> None:
        s += user("Hi")
        s += assistant(gen("a", max_tokens=1))

    one, two = with_markers.run(fake), with_roles.run(fake)
    assert one.text() == two.text() and one.messages() == two.messages()

    @program
    def mismatched(s: Any) -> None:
        s += user_begin()
        s += assistant_end()

    with pytest.raises(ProgramError, match="closes no open 'assistant'"):
        mismatched.run(fake)


def test_role_methods_as_expressions_and_context_managers(fake: FakeBackend) -> None:
    @program
    def calls(s: Any) -> None:
        s.system("Be brief.")
        s.user("Hi")
        with s.assistant():
            s += gen("a", max_tokens=1)

    @program
    def exprs(s: Any) -> None:
        from frontend_dsl import system

        s += system("Be brief.") + user("Hi") + assistant(gen("a", max_tokens=1))

    assert calls.run(fake).messages() == exprs.run(fake).messages()
    assert [m["role"] for m in calls.run(fake).messages()] == ["system", "user", "assistant"]


def test_text_iter_streams_a_variable_while_the_program_runs(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: " one two three four", token_delay_s=0.05)

    @program
    def p(s: Any) -> None:
        s += "Intro:" + gen("intro", max_tokens=2)
        s += " Answer:" + gen("answer", max_tokens=4)

    start = time.perf_counter()
    state = p.run(backend=backend, stream=True)
    assert time.perf_counter() - start < 0.1  # returned while the program runs
    pieces, times = [], []
    for piece in state.text_iter("answer"):
        pieces.append(piece)
        times.append(time.perf_counter() - start)
    assert "".join(pieces) == state.wait()["answer"] == " one two three four"
    assert len(pieces) == 4 and times[-1] - times[0] > 0.1  # piece by piece, not at the end
    assert "".join(state.text_iter()) == state.text()  # the whole state's text, replayed


def test_reads_of_a_streamed_state_wait_for_what_the_body_adds_later(
        make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def p(s: Any) -> None:
        time.sleep(0.2)  # the caller reads before the body has appended anything
        s += "A:" + gen("answer", max_tokens=2)

    state = p.run(backend=make_fake(), stream=True)
    assert state["answer"] == " ok ok"
    assert p.run(backend=make_fake(), stream=True).text() == "A: ok ok"


def test_text_async_iter_and_errors(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def p(s: Any) -> None:
        s += "A:" + gen("answer", max_tokens=3)

    async def collect(state: Any) -> list[str]:
        return [piece async for piece in state.text_async_iter("answer")]

    state = p.run(backend=make_fake(token_delay_s=0.01), stream=True)
    assert "".join(asyncio.run(collect(state))) == " ok ok ok"

    @program
    def failing(s: Any) -> None:
        s += "A:" + gen("answer", max_tokens=3, regex="[0-9]")

    state = failing.run(backend=make_fake(), stream=True)
    with pytest.raises(ProgramError):
        list(state.text_iter())
    with pytest.raises(ProgramError):
        state.wait()


def test_text_iter_without_streaming_gives_the_whole_value(fake: FakeBackend) -> None:
    @program
    def p(s: Any) -> None:
        s += "A:" + gen("answer", max_tokens=2)

    assert list(p.run(fake).text_iter("answer")) == [" ok ok"]


def test_token_healing_regenerates_the_last_token(make_fake: Callable[..., FakeBackend]) -> None:
    prompt = "See https:"

    def responder(r: FakeRequest) -> str:
        return "://example.org"  # the healed ":" and what follows, as one continuation

    backend = make_fake(responder)

    @program
    def p(s: Any) -> None:
        s += prompt + gen("url", max_tokens=8, token_healing=True, stop=" ")

    state = p.run(backend)
    ids = backend.encode(prompt)
    request = backend.requests[0]
    assert list(request.input_ids) == ids[:-1]  # the last token was backed up
    constraint = request.params.constraint
    assert constraint is not None and constraint.value.startswith(":")
    assert request.params.max_tokens == 9  # one more for the healed token
    assert state["url"] == "//example.org"
    assert state.text() == prompt + "//example.org"
    assert backend.decode(state.token_ids()) == state.text()


def test_no_healing_after_generated_text(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: " x")

    @program
    def p(s: Any) -> None:
        s += "A:" + gen("a", max_tokens=1) + gen("b", max_tokens=1, token_healing=True)

    p.run(backend)
    assert backend.requests[1].params.constraint is None  # the state ended with generated ids
