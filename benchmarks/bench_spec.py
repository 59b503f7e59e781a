"""Speculative decoding on an extraction workload: speculation on vs off, same engine.

A pydantic schema of 8 fields whose values are copied from a ~250-token document, on the
default model, greedy, one document at a time (so forward passes per output token are a
per-request figure: 1.0 plus prefill without speculation). Speculation on draws
grammar-forced tokens (keys, quotes, punctuation) and prompt-lookup n-grams (values copied
from the document); off decodes one token per forward pass. Prints forward passes per
output token, acceptance rate, wall time and the ratios, and checks that every run
produces identical tokens.

Fair by construction: the prefix cache is off (asserted: no prompt token is served from
it), so every run prefills its prompts as a fresh request would; every prompt is run
once on each side, untimed, before timing; each repeat alternates which side runs first.

    .venv/bin/python benchmarks/bench_spec.py [--docs 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result, timed  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402

Short = Annotated[str, Field(max_length=48)]


class Employee(BaseModel):
    full_name: Short
    job_title: Short
    employer: Short
    city: Short
    country: Short
    start_year: int
    email: Short
    manager_name: Short


PEOPLE = [
    ("Maria Elena Garcia", "Senior Structural Engineer", "Northwind Infrastructure Group",
     "Barcelona", "Spain", 2016, "maria.garcia@northwind-infra.example", "Jordi Puig"),
    ("Kenji Watanabe", "Lead Data Scientist", "Sakura Analytics Corporation", "Osaka", "Japan",
     2019, "k.watanabe@sakura-analytics.example", "Yuki Tanaka"),
    ("Amara Okafor", "Principal Product Designer", "Lagos Creative Technologies", "Lagos",
     "Nigeria", 2014, "amara.okafor@lagoscreative.example", "Chinedu Eze"),
    ("Lukas Bergmann", "Head of Customer Operations", "Alpenblick Logistics AG", "Munich",
     "Germany", 2021, "lukas.bergmann@alpenblick.example", "Sabine Koch"),
]


def document(p: tuple) -> str:  # type: ignore[type-arg]
    name, title, employer, city, country, year, email, manager = p
    filler = (
        "The company has grown steadily over the past decade, opening new offices and "
        "expanding its partnerships across the region. Colleagues describe the team as "
        "collaborative and focused on long-term quality rather than quick wins. "
    )
    return (
        f"Staff profile. {name} joined {employer} in {year} and works as {title}. "
        f"{filler}Based in the {city} office ({country}), {name.split()[0]} reports to "
        f"{manager}, who leads the department. {filler}{filler}Outside of work, "
        f"{name.split()[0]} volunteers at a local school and enjoys hiking. For questions "
        f"about projects, write to {email}. {filler}"
    )


def run(engine: Engine, prompts: list[str], speculation: bool) -> tuple[float, list, dict]:  # type: ignore[type-arg]
    """Extract each document alone (batch 1), so forward passes per token are per request."""
    params = SamplingParams(max_new_tokens=160, temperature=0.0, constraint=Employee,
                            speculation=speculation)
    before = engine.metrics()
    seconds, outs = timed(lambda: [engine.generate(p, params)[0] for p in prompts])
    after = engine.metrics()
    assert after["cached_prompt_tokens"] == 0, "a prompt was served from the prefix cache"
    delta = {k: after[k] - before[k] for k in ("forward_passes", "spec_draft_tokens",
                                               "spec_accepted_tokens", "spec_forced_tokens")}
    return seconds, outs, delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=4, help="documents, extracted one at a time")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(reproduce_line())
    engine = Engine(model="default", page_size=16, disable_prefix_cache=True)
    docs = [document(PEOPLE[i % len(PEOPLE)]) for i in range(args.docs)]
    prompts = [engine.apply_chat_template([{"role": "user", "content":
               f"Extract the employee record from this profile as JSON.\n\n{d}"}]) for d in docs]
    print(f"document length: {len(engine.tokenizer(docs[0])['input_ids'])} tokens")
    engine.compile_constraint(Employee)
    for spec in (False, True):  # warm-up: every prompt, each side
        run(engine, prompts, spec)
    rows = {True: [], False: []}  # type: ignore[var-annotated]
    outputs = []
    for repeat in range(args.repeats):
        for spec in (False, True) if repeat % 2 == 0 else (True, False):  # alternate who goes first
            seconds, outs, delta = run(engine, prompts, spec)
            tokens = sum(len(o.token_ids) for o in outs)
            rows[spec].append({"seconds": seconds, "tokens": tokens, **delta})
            outputs.append([o.token_ids for o in outs])
    assert all(o == outputs[0] for o in outputs), "speculation changed the output"
    valid = sum(1 for o in outs if o.finish_reason == "stop" and Employee.model_validate_json(o.text))
    for o in outs[:2]:
        print("sample output:", o.text)
    summary = {}
    for spec in (False, True):
        r = rows[spec]
        summary[spec] = {
            "wall_s": median([x["seconds"] for x in r]),
            "passes_per_token": median([x["forward_passes"] / x["tokens"] for x in r]),
            "acceptance": median([x["spec_accepted_tokens"] / x["spec_draft_tokens"]
                                  if x["spec_draft_tokens"] else 0.0 for x in r]),
            "forced_share": median([x["spec_forced_tokens"] / x["tokens"] for x in r]),
        }
    off, on = summary[False], summary[True]
    print(f"{'':>16} {'wall s':>8} {'passes/token':>13} {'acceptance':>11}")
    for label, s in (("speculation off", off), ("speculation on", on)):
        print(f"{label:>16} {s['wall_s']:>8.2f} {s['passes_per_token']:>13.3f} {s['acceptance']:>11.2f}")
    print(f"forward passes: {off['passes_per_token'] / on['passes_per_token']:.2f}x fewer; "
          f"wall time: {off['wall_s'] / on['wall_s']:.2f}x faster; outputs identical; "
          f"{valid}/{len(outs)} validate")
    print(f"load average: {load_average()}")
    print("saved", save_result("bench_spec", {"args": vars(args), "off": off, "on": on,
                                              "runs": {str(k): v for k, v in rows.items()}}))


if __name__ == "__main__":
    main()
