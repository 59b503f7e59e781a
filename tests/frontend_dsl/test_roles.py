"""Roles render exactly as the model's chat template renders the same messages."""

from __future__ import annotations

from typing import Any

import pytest

from frontend_dsl import ProgramDefinitionError, ProgramError, assistant, gen, program, system, user
from frontend_dsl.fake_backend import FakeBackend


@program
def chat(s: Any, question: str) -> None:
    s += system("You are terse.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=4))


def test_conversation_text_equals_chat_template(fake: FakeBackend, tokenizer: Any) -> None:
    state = chat.run(fake, question="What is 2+2?")
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": state["answer"]}], tokenize=False)
    assert state.text() == expected
    assert state.messages()[2] == {"role": "assistant", "content": " ok ok ok ok"}
    assert fake.decode(state.token_ids()) == state.text()


def test_with_blocks_equal_role_calls(fake: FakeBackend) -> None:
    @program
    def blocks(s: Any, question: str) -> None:
        with s.system():
            s += "You are terse."
        with s.user():
            s += question
        with s.assistant():
            s += gen("answer", max_tokens=4)

    assert blocks.run(fake, question="Hi").text() == chat.run(fake, question="Hi").text()


def test_default_system_prompt_comes_from_the_template(fake: FakeBackend, tokenizer: Any) -> None:
    @program
    def no_system(s: Any) -> None:
        s += user("Hi")
        s += assistant("Hello")
        s += user("Bye")

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    state = no_system.run(fake)
    assert state.text() == tokenizer.apply_chat_template(messages, tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in state.text()
    assert state.messages() == messages


def test_generation_prompt_is_the_assistant_prefix(fake: FakeBackend, tokenizer: Any) -> None:
    @program
    def ask(s: Any) -> None:
        s += user("Hi")
        with s.assistant():
            s += gen("a", max_tokens=1)

    state = ask.run(fake)
    prompt = fake.requests[0].prompt
    assert prompt == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                   tokenize=False, add_generation_prompt=True)
    assert state.text().startswith(prompt)


def test_nested_roles_are_rejected(fake: FakeBackend) -> None:
    @program
    def nested(s: Any) -> None:
        with s.user():
            s += assistant("x")

    with pytest.raises(ProgramError) as info:
        nested.run(fake)
    assert isinstance(info.value.__cause__, ProgramDefinitionError)
    assert "inside 'user'" in str(info.value)


def test_unknown_role_is_rejected(fake: FakeBackend) -> None:
    @program
    def bad(s: Any) -> None:
        with s.role("narrator"):
            s += "x"

    with pytest.raises(ProgramError, match="unknown role"):
        bad.run(fake)
