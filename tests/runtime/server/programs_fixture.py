"""Programs the test server registers (loaded by path, as ``arbor serve --programs``)."""

from frontend_dsl import assistant, gen, program, select, user


@program
def qa(s, question: str, max_tokens: int = 6):
    """Answer a question in a few tokens."""
    s += user(question)
    s += assistant(gen("answer", max_tokens=max_tokens, temperature=0))


@program
def two_steps(s, topic: str):
    """Two greedy generations and a choice."""
    s += "Topic: " + topic + "\nFirst:"
    s += gen("first", max_tokens=4, temperature=0)
    s += "\nSecond:"
    s += gen("second", max_tokens=4, temperature=0)
    s += "\nVerdict: " + select("verdict", ["good", "bad"])


@program
def long_story(s, seed_text: str):
    """One long generation (for cancellation tests)."""
    s += seed_text
    s += gen("story", max_tokens=250, temperature=0, speculation=False)


@program(max_branches=4)
def fan_out(s, n: int):
    """n greedy branches of two tokens each (at most 4)."""
    s += "Say something:"
    branches = s.fork(n)
    for b in branches:
        b += gen("x", max_tokens=2, temperature=0)
    branches.join()
