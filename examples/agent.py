"""A ReAct-style agent with two tools: a calculator and an encyclopedia lookup.

Each step the model writes a thought, then a tool call constrained to the tools' names
and argument schemas; the call runs and its observation is appended. A ``select`` then
decides whether to answer or to continue — control flow that depends on a generated
value, so from there on the program runs interpreted (see ``trace()`` output).

    python examples/agent.py
"""

from __future__ import annotations

import ast
import json
import operator
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import default_engine  # noqa: E402

from frontend_dsl import gen, program, select, system, tool, user  # noqa: E402

FACTS = {
    "eiffel tower": "The Eiffel Tower is 330 metres tall and was finished in 1889.",
    "france": "France's capital is Paris; its population is about 68 million.",
    "python": "Python is a programming language first released in 1991.",
}

_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg}


@tool
def calculator(expression: str) -> float:
    """Evaluate an arithmetic expression with + - * / ** and parentheses."""
    return float(_evaluate(ast.parse(expression, mode="eval").body))


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_evaluate(node.operand)))
    raise ValueError(f"unsupported expression: {ast.dump(node)}")


@tool
def lookup(topic: str) -> str:
    """Look a topic up in a small encyclopedia."""
    key = topic.strip().lower()
    if key not in FACTS:
        raise KeyError(f"no entry for {topic!r}; known topics: {sorted(FACTS)}")
    return FACTS[key]


TOOLS = [calculator, lookup]


@program
def react(s: Any, question: str, max_steps: int = 3, max_tokens: int = 48) -> None:
    s += system("Answer the question. Use the tools when useful. Tools:\n"
                + "\n".join(json.dumps(t.spec()) for t in TOOLS)
                + '\nCall a tool as {"name": ..., "arguments": {...}}.')
    s += user(question)
    with s.assistant():
        for step in range(max_steps):
            s += f"Thought {step + 1}:" + gen(f"thought_{step}", max_tokens=max_tokens, stop="\n",
                                              temperature=0)
            s += f"\nAction {step + 1}: " + gen(f"action_{step}", tools=TOOLS, max_tokens=max_tokens,
                                                temperature=0)
            s += "\nNext:" + select(f"next_{step}", [" answer", " continue"])
            s += "\n"
            if s[f"next_{step}"] == " answer":  # depends on a generated value: interpreted
                break
        s += "Final answer:" + gen("answer", max_tokens=max_tokens, stop="\n", temperature=0)


def main(engine: Any = None, question: str = "How tall is the Eiffel Tower in centimetres?",
         max_steps: int = 3, max_tokens: int = 48) -> Any:
    """Run the agent, print its transcript and tool calls; return the final state."""
    backend = default_engine(engine)
    graph = react.trace(backend, question=question, max_steps=max_steps, max_tokens=max_tokens)
    print(f"traced {len(graph.nodes)} nodes; graph complete={graph.complete} "
          f"({graph.stop.reason if graph.stop else ''})")
    state = react.run(backend, question=question, max_steps=max_steps, max_tokens=max_tokens)
    print(state.text())
    for name, value in state.variables().items():
        if name.startswith("action_"):
            print(f"{name}: tool={value.name} args={value.arguments} result={value.result!r} "
                  f"error={value.error!r}")
    print(f"answer: {state['answer'].strip()!r}")
    return state


if __name__ == "__main__":
    main()
