"""Two-level tree search: 3 ideas, each refined 3 ways; every leaf is scored with ``select``.

The score of a leaf is the model's (length-normalised) log-probability of answering "yes"
to "Is this a good slogan?"; the best leaf wins. All 9 leaves share their ancestors'
prefixes, and the branches of each level are generated together.

    python examples/tree_search.py
    arbor trace examples/tree_search.py     # its trace: JSON, OTLP spans and an SVG timeline
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import default_engine  # noqa: E402

from frontend_dsl import assistant, gen, program, select, user  # noqa: E402


@program
def tree_search(s: Any, task: str = "Write a one-line slogan for a small bakery.", width: int = 3,
                max_tokens: int = 16) -> None:
    s += user(task)
    ideas = s.fork(width)
    for i, idea in enumerate(ideas):
        idea += assistant(gen("idea", max_tokens=max_tokens, temperature=0.9, seed=i, stop="\n"))
        idea += user("Make it shorter and punchier.")
        drafts = idea.fork(width)
        for j, draft in enumerate(drafts):
            draft += assistant(gen("draft", max_tokens=max_tokens, temperature=0.9, seed=100 + 10 * i + j,
                                   stop="\n"))
            draft += user("Is this a good slogan? Answer yes or no.")
            draft += assistant(select("verdict", ["yes", "no"]))
        drafts.join()
    ideas.join()


def best_leaf(state: Any) -> tuple[float, str, tuple[int, int]]:
    """(score, draft, (idea index, draft index)) of the leaf most likely judged good."""
    drafts = state["draft"]  # [idea][draft]
    metas = state.get_meta("verdict")["branches"]  # [idea] -> inner join meta
    leaves = [(inner["branches"][j]["scores"]["yes"], drafts[i][j], (i, j))
              for i, inner in enumerate(metas) for j in range(len(drafts[i]))]
    return max(leaves, key=lambda leaf: leaf[0])


def main(engine: Any = None, task: str = "Write a one-line slogan for a small bakery.",
         width: int = 3, max_tokens: int = 16) -> str:
    """Print the tree and the best leaf; return the best draft."""
    state = tree_search.run(default_engine(engine), task=task, width=width, max_tokens=max_tokens)
    for i, idea in enumerate(state["idea"]):
        print(f"idea {i}: {idea.strip()!r}")
        for j, draft in enumerate(state["draft"][i]):
            score = state.get_meta("verdict")["branches"][i]["branches"][j]["scores"]["yes"]
            print(f"    draft {i}.{j} score={score:7.3f}: {draft.strip()!r}")
    score, draft, where = best_leaf(state)
    print(f"best: draft {where[0]}.{where[1]} ({score:.3f}): {draft.strip()!r}")
    return str(draft)


if __name__ == "__main__":
    main()
