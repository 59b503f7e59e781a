"""Programs the /ui browser test's server registers: one that forks, so the page's
timeline has lanes and cached prefixes to show."""

from frontend_dsl import gen, program


@program
def fan_out(s, topic: str, n: int = 3):
    """A shared prefix, then n branches that each continue it."""
    s += "Notes on " + topic + ":\n" + gen("intro", max_tokens=4, temperature=0)
    branches = s.fork(n)
    for i, branch in enumerate(branches):
        branch += f"\nIdea {i + 1}:" + gen("idea", max_tokens=4, temperature=0.8, seed=i)
    branches.join()
