"""run / run_batch / stream / arun, and how failures surface."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from frontend_dsl import (
    ProgramCancelledError,
    ProgramDefinitionError,
    ProgramError,
    gen,
    program,
    set_default_backend,
)
from frontend_dsl.fake_backend import FakeBackend, FakeRequest


def echo_last_word(r: FakeRequest) -> str:
    return " " + r.prompt.split()[-1].upper()


@program
def shout(s: Any, word: str) -> None:
    s += "Say " + word + gen("loud", max_tokens=4)


def test_run_batch_keeps_order_and_batches(make_fake: Callable[..., FakeBackend], capsys: Any) -> None:
    backend = make_fake(echo_last_word, token_delay_s=0.01)
    words = ["apple", "pear", "fig", "plum", "kiwi"]
    states = shout.run_batch([{"word": w} for w in words], max_concurrency=5, progress=True, backend=backend)
    assert [s["loud"] for s in states] == [f" {w.upper()}" for w in words]
    assert backend.max_in_flight == 5
    assert "shout: 100%" in capsys.readouterr().err  # the tqdm bar


def test_run_batch_respects_max_concurrency(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(echo_last_word, token_delay_s=0.01)
    shout.run_batch([{"word": "x"}] * 6, max_concurrency=2, backend=backend)
    assert backend.max_in_flight == 2


def test_run_batch_errors(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def digit(s: Any, word: str) -> None:
        s += word + gen("d", regex="[0-9]")

    backend = make_fake(lambda r: "7" if r.prompt == "ok" else "x")
    with pytest.raises(ProgramError, match="does not match"):
        digit.run_batch([{"word": "ok"}, {"word": "bad"}], backend=backend)
    results = digit.run_batch([{"word": "ok"}, {"word": "bad"}], backend=backend, return_exceptions=True)
    assert results[0]["d"] == "7"
    assert isinstance(results[1], ProgramError) and results[1].state.text() == "badx"


def test_stream_yields_text_as_it_is_produced(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: " one two three")
    chunks = list(shout.stream(backend, word="hi"))
    assert chunks == ["Say hi", " one", " two", " three"]


def test_arun_from_an_event_loop(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(echo_last_word, token_delay_s=0.01)

    async def main() -> list[str]:
        states = await asyncio.gather(*(shout.arun(backend, word=w) for w in ["a", "b", "c"]))
        return [s["loud"] for s in states]

    assert asyncio.run(main()) == [" A", " B", " C"]
    assert backend.max_in_flight == 3


def test_default_backend(make_fake: Callable[..., FakeBackend]) -> None:
    set_default_backend(make_fake(echo_last_word))
    assert shout.run(word="yes")["loud"] == " YES"


def test_body_exception_carries_the_partial_state(make_fake: Callable[..., FakeBackend]) -> None:
    class Oops(Exception):
        pass

    @program
    def p(s: Any) -> None:
        s += "Q:" + gen("a", max_tokens=2)
        if s["a"]:
            raise Oops("bad answer")

    with pytest.raises(ProgramError, match="raised Oops: bad answer") as info:
        p.run(make_fake())
    assert isinstance(info.value.__cause__, Oops)
    assert info.value.state.text() == "Q: ok ok"
    assert info.value.state.variables() == {"a": " ok ok"}


def test_body_exception_cancels_pending_generation(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(token_delay_s=0.05)

    @program
    def p(s: Any) -> None:
        s += "x" + gen("slow", max_tokens=100)
        raise ValueError("stop now")

    start = time.perf_counter()
    with pytest.raises(ProgramError) as info:
        p.run(backend)
    assert time.perf_counter() - start < 2.0  # 100 tokens * 50 ms were not waited for
    with pytest.raises(ProgramError) as read:
        info.value.state["slow"]
    assert isinstance(read.value.__cause__, ProgramCancelledError)


def test_program_needs_a_state_parameter() -> None:
    with pytest.raises(ProgramDefinitionError):
        program(lambda: None)


def test_a_program_can_call_another(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def inner(s: Any, word: str) -> None:
        s += "<" + word + ">"

    @program
    def outer(s: Any) -> None:
        inner(s, "a")
        inner(s, "b")

    assert outer.run(make_fake()).text() == "<a><b>"
