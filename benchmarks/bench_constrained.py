"""Constrained decoding speed (issue 5): mask cost, decode throughput, extraction vs outlines.

Three parts, all in this one process, each with its baseline in the same run:

1. Mask time. Exactly what the engine does per step for constrained rows:
   ``runtime.constrained.masking.mask_logits`` on a ``[B, vocab]`` float32 logits tensor with B
   llguidance matchers of a realistic JSON schema (EXTRACT_SCHEMA). Between timed steps
   each matcher advances by a token sampled from its allowed set (seeded random logits
   plus a bonus for quote/punctuation/digit tokens so strings stay short, masked, then
   softmax-sampled), so the states walk through keys, strings, numbers, nested objects
   and arrays; a matcher whose JSON is complete is replaced by a fresh one. Only the
   ``mask_logits`` call is timed (fresh logits are made outside the timed region).
   Reported per batch-step and per sequence-step (batch-step / B), median and p99, µs.
2. Decode throughput at batch 32, constrained (LONG_SCHEMA, long enough that outputs hit
   max_new_tokens) vs unconstrained (ignore_eos) on the same 32 chat prompts, greedy,
   both on ``Engine(speculation=False)`` so the difference is the mask cost. The prompts
   are prefilled once beforehand (prefix cache warm for both runs) and the grammar is
   compiled beforehand, so the wall time is mostly decode. tokens/s = generated tokens /
   wall time of ``engine.generate``. Constrained with speculation on (a second engine,
   ``Engine(speculation=True)``) is reported separately, labelled as such.
3. Extraction workload: 16 short documents, a 4-field pydantic schema (Contact), greedy,
   max_new_tokens 64. Arbor: one ``engine.generate`` of all 16 (speculation on, the
   default). outlines 1.x: ``outlines.from_transformers`` on the same weights (fp32)
   and tokenizer; a ``Generator(model, Contact)`` built once (its index build is timed
   separately), then ``generator.batch`` of all 16 (outlines' transformers model supports
   batches: one left-padded ``model.generate`` with its logits processor) and, unless
   --quick, ``generator(prompt)`` per request (sequential). Both sides get the same chat
   messages (outlines is given a ``Chat``, so it renders the same template; checked) and
   every output is validated with ``Contact.model_validate_json``.

    .venv/bin/python benchmarks/bench_constrained.py [--quick] [--skip-outlines] [--parts 1 2 3]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result, timed  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402
from runtime.constrained.masking import mask_logits  # noqa: E402

NUM_PAGES = 1024  # 16k KV tokens: plenty for 32 x (prompt + 64), independent of free memory

# Part 1: a realistic extraction-style schema (nested object, enum, array of objects).
EXTRACT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "number"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                               "paid": {"type": "boolean"}},
                "required": ["sku", "qty", "paid"],
            },
        },
    },
    "required": ["id", "name", "email", "status", "score", "address", "orders"],
}

# Part 2: outputs long enough to reach max_new_tokens (so both runs decode the same count).
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 20},
        "author": {"type": "string", "minLength": 5},
        "year": {"type": "integer"},
        "pages": {"type": "integer"},
        "summary": {"type": "string", "minLength": 80},
        "keywords": {"type": "array", "items": {"type": "string", "minLength": 3}, "minItems": 6},
        "ratings": {"type": "array", "items": {"type": "integer"}, "minItems": 8},
    },
    "required": ["title", "author", "year", "pages", "summary", "keywords", "ratings"],
}

TOPICS = ["the sea", "a lighthouse keeper", "Mars colonists", "a chess prodigy", "medieval Venice",
          "a haunted library", "climate migration", "a jazz drummer", "artificial minds", "the Silk Road",
          "a mountain rescue", "quantum computing", "a family bakery", "Arctic explorers", "a lost dog",
          "the printing press", "a detective in Oslo", "volcano scientists", "a startup founder",
          "Roman engineers", "a marathon runner", "deep-sea divers", "a village election", "bees",
          "a time traveller", "the first vaccines", "a river delta", "street musicians", "a robot cook",
          "desert caravans", "a chess engine", "island birds"]


class Contact(BaseModel):
    name: str
    company: str
    age: int
    city: str


DOCUMENTS = [
    "Maria Lopez, 34, is a structural engineer at Acme Corp and lives in Madrid.",
    "Our new hire Tom Becker (age 29) joins Globex from Berlin next week.",
    "Dr. Aiko Tanaka, 51, leads research at Hitachi Labs in Osaka.",
    "Ravi Kumar is 42 and runs sales for Infosys in Bangalore.",
    "Contact: Emma Wilson, Initech, London. Age: 37.",
    "Lucas Martin (23) is an intern at Renault in Paris.",
    "Fatima Zahra, a 45-year-old architect at Foster Partners, is based in Dubai.",
    "Jonas Berg, 31, works for Spotify in Stockholm as a data scientist.",
    "Chen Wei, age 39, manages logistics at Alibaba in Hangzhou.",
    "Olivia Brown is a 28-year-old nurse at Mayo Clinic in Rochester.",
    "Carlos Silva, 55, founded Natura in Sao Paulo.",
    "Hannah Schmidt (33) is a product manager at SAP in Walldorf.",
    "Pieter de Vries, 47, is CFO of Philips in Amsterdam.",
    "Sofia Rossi, 26, designs shoes for Gucci in Florence.",
    "Ahmed Hassan is 60 and chairs Orascom in Cairo.",
    "Grace Kim, 30, is a pilot for Korean Air based in Seoul.",
]


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def chat(user: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": user}]


# ---- part 1 -------------------------------------------------------------------------------------
STRUCTURAL = set("{}[],:0123456789")


def structural_bias(engine: Engine, quote_share: float = 0.6, other_share: float = 0.2) -> torch.Tensor:
    """Logit bonus for tokens holding a quote, and for JSON punctuation or digits.

    With uniform random logits a random walk almost never leaves a string (nearly every
    token is allowed there, few close it); the bonuses give quote tokens about
    ``quote_share`` and other structural tokens about ``other_share`` of the mass when
    everything is allowed, so strings run a handful of tokens, like real outputs.
    """
    pieces = [p or "" for p in engine.tokenizer.convert_ids_to_tokens(list(range(len(engine.tokenizer))))]
    quote = torch.tensor(['"' in p for p in pieces])
    other = torch.tensor([bool(STRUCTURAL.intersection(p)) and '"' not in p for p in pieces])
    bias = torch.zeros(engine.vocab_size)
    rest = engine.vocab_size - int(quote.sum()) - int(other.sum())
    total = 1 - quote_share - other_share
    for group, share in ((quote, quote_share), (other, other_share)):
        bias[: len(pieces)][group] = math.log(share / total * rest / int(group.sum()))
    return bias


def bench_mask(engine: Engine, batch: int, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    compiled = engine.compile_constraint(EXTRACT_SCHEMA)
    vocab = engine.vocab_size
    bias = structural_bias(engine)
    gen = torch.Generator().manual_seed(seed)
    matchers = [compiled.new_matcher() for _ in range(batch)]
    per_step: list[float] = []
    completed = rejected = dead_rows = 0
    for step in range(warmup + steps):
        logits = torch.randn(batch, vocab, generator=gen) + bias
        start = time.perf_counter()
        dead = mask_logits(logits, matchers)
        elapsed = time.perf_counter() - start
        if step >= warmup:
            per_step.append(elapsed)
        dead_rows += len(dead)
        tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).flatten().tolist()
        for i, tok in enumerate(tokens):
            m = matchers[i]
            if i in dead or not m.accept_token(tok):
                rejected += 1
            elif not m.is_terminated():
                continue
            else:
                completed += 1
            matchers[i] = compiled.new_matcher()
    us = [s * 1e6 for s in per_step]
    per_seq = [u / batch for u in us]
    return {
        "batch": batch, "steps": steps,
        "batch_step_us_median": median(us), "batch_step_us_p99": pct(us, 0.99),
        "seq_step_us_median": median(per_seq), "seq_step_us_p99": pct(per_seq, 0.99),
        "completed_objects": completed, "rejected_tokens": rejected, "dead_rows": dead_rows,
    }


def part1(engine: Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    steps = 60 if args.quick else 200
    rows = []
    default_threads = torch.get_num_threads()
    print(f"\n[part 1] mask_logits on [B, {engine.vocab_size}] fp32, EXTRACT_SCHEMA, llguidance; "
          f"{steps} timed steps per batch; torch threads {default_threads} (the engine's) and 1")
    print(f"{'thr':>3} {'B':>3} {'batch-step med':>15} {'p99':>9} {'seq-step med':>13} {'p99':>9} (µs)  completed JSON objects")
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        for batch in (1, 32):
            r = {"torch_threads": threads, **bench_mask(engine, batch, steps, warmup=10, seed=args.seed)}
            rows.append(r)
            print(f"{threads:>3} {batch:>3} {r['batch_step_us_median']:>15.1f} {r['batch_step_us_p99']:>9.1f} "
                  f"{r['seq_step_us_median']:>13.1f} {r['seq_step_us_p99']:>9.1f}       {r['completed_objects']}",
                  flush=True)
    torch.set_num_threads(default_threads)
    return rows


# ---- part 2 -------------------------------------------------------------------------------------
def decode_run(engine: Engine, prompts: list[str], params: SamplingParams) -> dict[str, Any]:
    seconds, outs = timed(engine.generate, prompts, params)
    tokens = sum(len(o.token_ids) for o in outs)
    reasons: dict[str, int] = {}
    for o in outs:
        reasons[str(o.finish_reason)] = reasons.get(str(o.finish_reason), 0) + 1
    valid = 0
    if params.constraint is not None:
        for o in outs:
            try:
                json.loads(o.text)
                valid += 1
            except ValueError:
                pass
    errors = [o.error for o in outs if o.error]
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "finish": reasons,
            "complete_json": valid if params.constraint is not None else None,
            "errors": errors[:3], "sample": outs[0].text[:160]}


def part2(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    batch, new = 32, args.new_tokens
    prompts = [engine.apply_chat_template(chat(f"Describe an imaginary book about {t} as JSON "
                                                       "with title, author, year, pages, summary, "
                                                       "keywords and ratings."))
               for t in TOPICS[:batch]]
    plain = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=new, temperature=0.0, constraint=LONG_SCHEMA)
    engine.compile_constraint(LONG_SCHEMA)
    engine.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0))  # prefill once: cache warm
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0, constraint=LONG_SCHEMA))
    print(f"\n[part 2] batch {batch}, {new} new tokens, greedy, Engine(speculation=False); "
          f"{args.repeats} repeat(s), alternating, best of N")
    runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "constrained": []}
    for _ in range(args.repeats):
        runs["unconstrained"].append(decode_run(engine, prompts, plain))
        runs["constrained"].append(decode_run(engine, prompts, constrained))
    result: dict[str, Any] = {"batch": batch, "new_tokens": new}
    for name, rs in runs.items():
        best = max(rs, key=lambda r: r["tok_s"])
        result[name] = {**best, "tok_s_all": [r["tok_s"] for r in rs]}
        print(f"  {name:<14} {best['tok_s']:>8.1f} tok/s  ({best['tokens']} tokens in {best['seconds']:.2f} s; "
              f"finish {best['finish']})", flush=True)
    result["ratio"] = result["constrained"]["tok_s"] / result["unconstrained"]["tok_s"]
    steps = result["unconstrained"]["tokens"] / batch
    result["unconstrained_ms_per_batch_step"] = 1e3 * result["unconstrained"]["seconds"] / steps
    print(f"  constrained / unconstrained = {result['ratio']:.3f}x  (target >= 0.9x); "
          f"complete JSON {result['constrained']['complete_json']}/{batch} (length-capped by design); "
          f"unconstrained batch-step ~{result['unconstrained_ms_per_batch_step']:.1f} ms")
    print(f"  sample: {result['constrained']['sample']!r}")
    return result


def part2_spec(spec_engine: Engine, args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    batch, new = 32, args.new_tokens
    prompts = [spec_engine.apply_chat_template(chat(f"Describe an imaginary book about {t} as "
                                                                 "JSON with title, author, year, pages, "
                                                                 "summary, keywords and ratings."))
               for t in TOPICS[:batch]]
    params = SamplingParams(max_new_tokens=new, temperature=0.0, constraint=LONG_SCHEMA)
    spec_engine.compile_constraint(LONG_SCHEMA)
    spec_engine.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0))
    rs = [decode_run(spec_engine, prompts, params) for _ in range(args.repeats)]
    best = max(rs, key=lambda r: r["tok_s"])
    m = spec_engine.spec
    out = {**best, "tok_s_all": [r["tok_s"] for r in rs],
           "vs_unconstrained_no_spec": best["tok_s"] / base["unconstrained"]["tok_s"],
           "forced_tokens": m.forced_tokens, "draft_tokens": m.draft_tokens,
           "accepted_tokens": m.accepted_tokens}
    print(f"  constrained, Engine(speculation=True) [separate engine, NOT the isolated comparison]: "
          f"{best['tok_s']:.1f} tok/s ({best['tokens']} tokens, finish {best['finish']}); "
          f"{out['vs_unconstrained_no_spec']:.2f}x the unconstrained run above; "
          f"forced {m.forced_tokens}, drafted {m.draft_tokens}, accepted {m.accepted_tokens}")
    return out


# ---- part 3 -------------------------------------------------------------------------------------
def validity(texts: list[str]) -> int:
    ok = 0
    for text in texts:
        try:
            Contact.model_validate_json(text)
            ok += 1
        except ValidationError:
            pass
    return ok


def _values(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def part3(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    new = 64
    messages = [chat("Extract the person's name, company, age and city from the text below. "
                             f"Answer with JSON.\n\n{doc}") for doc in DOCUMENTS]
    prompts = [engine.apply_chat_template(m) for m in messages]
    params = SamplingParams(max_new_tokens=new, temperature=0.0, constraint=Contact)
    compile_s, _ = timed(engine.compile_constraint, Contact)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, temperature=0.0))  # warm the code paths
    print(f"\n[part 3] 16 extraction requests, pydantic Contact (4 fields), greedy, max_new_tokens {new}")
    stats = engine.spec
    before = (stats.forced_tokens, stats.draft_tokens, stats.accepted_tokens)
    seconds, outs = timed(engine.generate, prompts, params)
    forced, drafted, accepted = (after - b for after, b in zip(
        (stats.forced_tokens, stats.draft_tokens, stats.accepted_tokens), before, strict=True))
    arbor_texts = [o.text for o in outs]
    arbor = {"spec_forced_tokens": forced, "spec_draft_tokens": drafted,
             "spec_accepted_tokens": accepted, "seconds": seconds, "tokens": sum(len(o.token_ids) for o in outs), "valid": validity(arbor_texts),
             "compile_s": compile_s, "finish": [str(o.finish_reason) for o in outs],
             "errors": [o.error for o in outs if o.error][:3], "samples": arbor_texts[:3]}
    print(f"  arbor   engine.generate(16): {seconds:.2f} s, {arbor['tokens']} tokens, "
          f"valid {arbor['valid']}/16 (grammar compile {compile_s * 1e3:.0f} ms, before timing; "
          f"speculation on: forced {forced}, drafted {drafted}, accepted {accepted})", flush=True)
    result: dict[str, Any] = {"arbor": arbor}
    if args.skip_outlines:
        return result

    import outlines
    from outlines.inputs import Chat
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.model.loader import resolve_model_dir

    reference = resolve_model_dir("default")  # transformers' conversion of the engine's GGUF file
    load_s, model = timed(lambda: outlines.from_transformers(
        AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(str(reference))))
    rendered = [model.type_adapter.format_input(Chat(m)) for m in messages]
    assert rendered == prompts, "outlines renders a different prompt than arbor"
    build_s, generator = timed(outlines.Generator, model, Contact)
    kwargs = {"max_new_tokens": new, "do_sample": False, "pad_token_id": engine.tokenizer.pad_token_id}
    with torch.inference_mode():
        generator(Chat(messages[0]), max_new_tokens=2, do_sample=False)  # warm-up
        batch_s, batch_texts = timed(generator.batch, [Chat(m) for m in messages], **kwargs)
    ol: dict[str, Any] = {
        "version": importlib.metadata.version("outlines"), "load_s": load_s, "generator_build_s": build_s,
        "backend": type(generator.logits_processor).__name__,
        "batch": {"seconds": batch_s, "valid": validity(batch_texts),
                  "approx_tokens": sum(len(engine.tokenizer(t)["input_ids"]) for t in batch_texts),
                  "samples": batch_texts[:3]},
    }
    print(f"  outlines {ol['version']} generator.batch(16) [{ol['backend']}]: {batch_s:.2f} s, "
          f"~{ol['batch']['approx_tokens']} tokens, valid {ol['batch']['valid']}/16 "
          f"(Generator build {build_s:.2f} s, before timing)", flush=True)
    if not args.quick:
        with torch.inference_mode():
            seq_s, seq_texts = timed(lambda: [generator(Chat(m), **kwargs) for m in messages])
        ol["sequential"] = {"seconds": seq_s, "valid": validity(seq_texts), "samples": seq_texts[:3]}
        print(f"  outlines generator(prompt) x16 sequential: {seq_s:.2f} s, "
              f"valid {ol['sequential']['valid']}/16", flush=True)
        result["ratio_vs_sequential"] = seq_s / seconds
    result["outlines"] = ol
    result["ratio_vs_batch"] = batch_s / seconds
    same = sum(a == b for a, b in zip(arbor_texts, batch_texts, strict=True))
    result["identical_outputs_vs_outlines_batch"] = same
    result["same_values_vs_outlines_batch"] = sum(
        _values(a) is not None and _values(a) == _values(b)
        for a, b in zip(arbor_texts, batch_texts, strict=True))
    result["differing_examples"] = [{"arbor": a, "outlines": b} for a, b in
                                    zip(arbor_texts, batch_texts, strict=True) if a != b][:3]
    print(f"  speed-up arbor vs outlines batch: {result['ratio_vs_batch']:.2f}x (target >= 2x)"
          + (f"; vs sequential: {result['ratio_vs_sequential']:.2f}x" if "ratio_vs_sequential" in result else "")
          + f"; identical text {same}/16, same parsed values "
          f"{result['same_values_vs_outlines_batch']}/16 (outlines allows flexible whitespace)")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer mask steps, 1 repeat, no sequential outlines")
    ap.add_argument("--skip-outlines", action="store_true")
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    ap.add_argument("--new-tokens", type=int, default=64, help="part 2 max_new_tokens")
    ap.add_argument("--repeats", type=int, default=None, help="part 2 repeats (default 1 quick, 2 full)")
    ap.add_argument("--skip-spec", action="store_true", help="part 2: skip the speculation-on run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.threads:
        torch.set_num_threads(args.threads)
    print(reproduce_line())
    print(f"load average at start: {load_average()}; torch threads {torch.get_num_threads()}")
    torch.manual_seed(args.seed)
    engine = Engine(model="default", speculation=False, num_pages=NUM_PAGES)
    payload: dict[str, Any] = {"args": vars(args), "loadavg_start": load_average()}
    if 1 in args.parts:
        payload["part1_mask"] = part1(engine, args)
    if 2 in args.parts:
        payload["part2_decode"] = part2(engine, args)
        if not args.skip_spec:
            spec_engine = Engine(model="default", speculation=True, num_pages=NUM_PAGES)
            payload["part2_decode"]["constrained_speculation_on"] = part2_spec(spec_engine, args,
                                                                               payload["part2_decode"])
            spec_engine.close()
    if 3 in args.parts:
        spec3 = Engine(model="default", num_pages=NUM_PAGES)  # the default config (speculation on)
        payload["part3_extraction"] = part3(spec3, args)
        spec3.close()
    engine.close()
    payload["loadavg_end"] = load_average()
    print(f"\nload average at end: {load_average()} (start {payload['loadavg_start']})")
    print("saved", save_result("bench_constrained_quick" if args.quick else "bench_constrained", payload))


if __name__ == "__main__":
    main()
