"""Speculation on vs off, one stream: natural text (must not lose) and text that echoes its
prompt (should gain).

Natural text: four passages of the Python documentation (``pydoc_data.topics``, on every
Python install; ~300 tokens each), each asked to be summarized, 96 output tokens
(``ignore_eos``, so both sides produce the same count). Echo: four functions of the
standard library's own source, each asked to be repeated with a docstring, 96 tokens: the
answer copies its prompt, where prompt-lookup drafts are accepted. The default model,
``weights="gguf"`` (the fused decode path, where a verify pass costs most), greedy, one
request at a time, prefix cache off (each request prefills as a fresh chat would).

Fair by construction: one engine, speculation switched per request; every prompt runs on
each side untimed first; sides are interleaved and alternate who goes first; outputs are
compared token for token (speculation may change speed, never the output). Prints output
tokens per second (wall time, prefill included) per side and the ratio on/off, medians
over the repeats.

    .venv/bin/python benchmarks/bench_speculation.py [--repeats 3] [--num-threads N]
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result, timed  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402

TOPICS = ("assert", "for", "class", "with")  # pydoc_data.topics keys: prose with a few examples
PROMPT_CHARS = 1300  # ~300 tokens of this documentation


def natural_prompts(engine: Engine) -> list[str]:
    import pydoc_data.topics

    return [engine.apply_chat_template([{"role": "user", "content":
            f"Summarize this part of the Python documentation.\n\n{pydoc_data.topics.topics[t][:PROMPT_CHARS]}"}])
            for t in TOPICS]


def echo_prompts(engine: Engine) -> list[str]:
    import json
    import shlex
    import textwrap

    sources = [inspect.getsource(f) for f in (textwrap.indent, shlex.quote, json.loads, textwrap.dedent)]
    return [engine.apply_chat_template([{"role": "user", "content":
            f"Repeat this function exactly, adding a one-line comment at the top.\n\n{s[:PROMPT_CHARS]}"}])
            for s in sources]


def run(engine: Engine, prompts: list[str], speculation: bool, max_tokens: int) -> tuple[float, list[list[int]], dict[str, float]]:
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True, speculation=speculation)
    before = engine.metrics()
    seconds, outs = timed(lambda: [engine.generate(p, params)[0] for p in prompts])
    after = engine.metrics()
    delta = {k: after[k] - before[k] for k in ("forward_passes", "spec_draft_tokens", "spec_accepted_tokens")}
    return seconds, [o.token_ids for o in outs], delta


def measure(engine: Engine, prompts: list[str], repeats: int, max_tokens: int) -> dict[str, Any]:
    for spec in (False, True):  # warm-up, untimed
        run(engine, prompts, spec, max_tokens)
    rates: dict[bool, list[float]] = {False: [], True: []}
    counters: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    outputs: dict[bool, list[list[list[int]]]] = {False: [], True: []}
    for repeat in range(repeats):
        for spec in (False, True) if repeat % 2 == 0 else (True, False):
            seconds, tokens, delta = run(engine, prompts, spec, max_tokens)
            rates[spec].append(sum(len(t) for t in tokens) / seconds)
            counters[spec].append(delta)
            outputs[spec].append(tokens)
    on = counters[True]
    return {
        # NOTE: identical outputs are the project's rule; counted, not asserted, so a
        # numeric difference between the decode and verify paths shows as a figure.
        "off_runs_identical": all(o == outputs[False][0] for o in outputs[False]),
        "on_equals_off_prompts": sum(a == b for a, b in zip(outputs[True][0], outputs[False][0], strict=True)),
        "off_tok_s": median(rates[False]), "on_tok_s": median(rates[True]),
        "ratio": median(rates[True]) / median(rates[False]),
        "off_runs": rates[False], "on_runs": rates[True],
        "draft_tokens": median([c["spec_draft_tokens"] for c in on]),
        "accepted_tokens": median([c["spec_accepted_tokens"] for c in on]),
        "forward_passes_on": median([c["forward_passes"] for c in on]),
        "forward_passes_off": median([c["forward_passes"] for c in counters[False]]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--weights", default="gguf")
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--name", default="bench_speculation", help="result file name")
    args = ap.parse_args()
    print(reproduce_line())
    engine = Engine(model="default", weights=args.weights, disable_prefix_cache=True, num_threads=args.num_threads)
    results = {}
    for name, prompts in (("natural", natural_prompts(engine)), ("echo", echo_prompts(engine))):
        lengths = [len(engine.tokenizer(p)["input_ids"]) for p in prompts]
        r = measure(engine, prompts, args.repeats, args.max_tokens)
        results[name] = {"prompt_tokens": lengths, **r}
        print(f"{name:>8}: prompts {min(lengths)}-{max(lengths)} tokens -> {args.max_tokens}; "
              f"off {r['off_tok_s']:.1f} tok/s, on {r['on_tok_s']:.1f} tok/s: on/off {r['ratio']:.3f}x "
              f"(drafts {r['draft_tokens']:.0f}, accepted {r['accepted_tokens']:.0f}; forward passes "
              f"{r['forward_passes_on']:.0f} vs {r['forward_passes_off']:.0f}); outputs on == off for "
              f"{r['on_equals_off_prompts']}/{len(prompts)} prompts")
    engine.close()
    print(f"load average: {load_average()} (shared machine)")
    print("saved", save_result(args.name, {"args": vars(args), **results}))


if __name__ == "__main__":
    main()
