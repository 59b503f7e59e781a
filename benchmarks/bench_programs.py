"""LLM programs end to end: Arbor (``@program`` through the DSL) vs HF transformers, naive
and batched.

One set of weights (the default model, fp32); each side runs in its own worker process
(as ``bench_offline.py`` separates them), one after the other, never at the same time.
Each workload runs as an Arbor ``@program`` (``run`` / ``run_batch`` on an in-process
``Engine``) and as two HF baselines:

- **naive** (the old baseline): one ``AutoModelForCausalLM.generate`` call per LLM call of
  the program, sequentially, each with its own full chat-template prompt, and one full
  forward pass per ``select`` choice;
- **batched** (the fair one): what a careful HF user batches by hand: the QA prompts in
  one left-padded ``generate``; self-consistency as one ``generate`` with
  ``num_return_sequences``; the tree level by level (one ``generate`` for the ideas, one
  padded ``generate`` for every draft, one padded forward pass scoring every leaf's
  choices). What HF cannot do is share the prompt prefix's KV between the sequences.

  (a) qa:   5-shot QA, 32 questions behind one shared few-shot prefix (5 user/assistant
            pairs), greedy, max 16 tokens each; Arbor: ``run_batch``.
  (b) sc:   self-consistency: one question, fork 8, each branch samples 24 tokens at
            temperature 0.7 with seed i; majority vote. HF: 8 sampled generate calls.
  (c) tree: examples/tree_search.py (fork 3 ideas x fork 3 drafts, every leaf judged by
            ``select(["yes", "no"])``). HF: 12 generate calls + 18 scoring forward passes.

Prints wall time per system, the ratios HF/Arbor (target >= 3x) and Arbor's prefix-cache
hit rate over the workload (cached / prompt tokens, deltas of ``engine.metrics()``). On a
shared machine read the ratios with the load average printed beside them.

    .venv/bin/python benchmarks/bench_programs.py [--quick] [--skip-hf] [--hf naive batched]
        [--workloads qa sc tree] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
from common import load_average, reproduce_line, save_result, timed  # noqa: E402
from self_consistency import final_number, majority  # noqa: E402
from tree_search import best_leaf, tree_search  # noqa: E402

from frontend_dsl import Backend, assistant, gen, program, user  # noqa: E402
from frontend_dsl.default_backend import as_backend  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.model.default_model import default_model_dir  # noqa: E402

TARGET = 3.0  # HF seconds / Arbor seconds, per workload

ANSWER_STYLE = " Answer with one word or a short phrase."
FEW_SHOT = [  # (question, answer); ANSWER_STYLE is appended to every question
    ("Paris has been the seat of the French government for centuries; it lies on the Seine "
     "and is home to the Louvre and the Eiffel Tower. What is the capital of France?", "Paris"),
    ("Iron oxide gives its surface a rusty colour that is visible from Earth with a small "
     "telescope. Which planet is known as the Red Planet?", "Mars"),
    ("Spiders are arachnids, not insects: insects have six legs and three body parts, while "
     "arachnids have two body parts and no antennae. How many legs does a spider have?", "Eight"),
    ("An English playwright of the late sixteenth century wrote a tragedy about two young "
     "lovers from feuding families in Verona. Who wrote Romeo and Juliet?", "William Shakespeare"),
    ("Chemical symbols often come from Latin names, such as Na for sodium, Fe for iron and "
     "Ag for silver. What is the chemical symbol for gold?", "Au"),
]
QUESTIONS = [
    "What is the capital of Japan?", "What is the largest ocean on Earth?",
    "How many days are in a leap year?", "What gas do plants absorb from the air?",
    "Who painted the Mona Lisa?", "What is the boiling point of water in Celsius?",
    "What is the capital of Italy?", "How many continents are there?",
    "What is the largest mammal?", "Which metal is liquid at room temperature?",
    "What is the square root of 81?", "What language is spoken in Brazil?",
    "Who discovered penicillin?", "What is the smallest prime number?",
    "What is the capital of Canada?", "How many sides does a hexagon have?",
    "What is the hardest natural substance?", "Which planet is closest to the Sun?",
    "What is the currency of the United Kingdom?", "How many hours are in a day?",
    "What is the freezing point of water in Fahrenheit?", "Who was the first person on the Moon?",
    "What is the capital of Germany?", "What is the longest river in Africa?",
    "How many strings does a standard guitar have?", "What is the main ingredient of guacamole?",
    "What is the capital of Spain?", "Which organ pumps blood through the body?",
    "What is 7 times 8?", "What color do you get by mixing blue and yellow?",
    "What is the tallest mountain on Earth?", "How many minutes are in an hour?",
]
SC_QUESTION = "What is 12 + 30? Think briefly, then end with 'Answer: <number>'."
TREE_TASK = "Write a one-line slogan for a small bakery."
TREE_REFINE = "Make it shorter and punchier."  # NOTE: the same texts as examples/tree_search.py
TREE_JUDGE = "Is this a good slogan? Answer yes or no."


@dataclass(frozen=True)
class Sizes:
    num_questions: int  # (a)
    qa_tokens: int
    num_samples: int  # (b)
    sc_tokens: int
    sc_temperature: float
    tree_width: int  # (c)
    tree_tokens: int


FULL = Sizes(32, 16, 8, 24, 0.7, 3, 16)
QUICK = Sizes(8, 8, 8, 8, 0.7, 3, 8)


# ---- the programs (Arbor side) ----------------------------------------------------------------
@program
def few_shot_qa(s: Any, question: str, max_tokens: int) -> None:
    for q, a in FEW_SHOT:
        s += user(q + ANSWER_STYLE)
        s += assistant(a)
    s += user(question + ANSWER_STYLE)
    s += assistant(gen("answer", max_tokens=max_tokens, temperature=0.0))


@program
def self_consistency(s: Any, question: str, n: int, max_tokens: int, temperature: float) -> None:
    s += user(question)
    forks = s.fork(n)
    for i, branch in enumerate(forks):
        branch += assistant(gen("reasoning", max_tokens=max_tokens, temperature=temperature, seed=i))
    forks.join()


@program
def warm_up(s: Any) -> None:
    s += "Hello there."  # no chat role: nothing this caches is shared with the workloads
    s += gen("x", max_tokens=2, temperature=0.0)


def output_tokens(meta: dict[str, Any] | None) -> int:
    """Generated tokens under a gen meta, summed through (nested) join metas."""
    if not meta:
        return 0
    if "branches" in meta:
        return sum(output_tokens(m) for m in meta["branches"])
    return int(meta.get("num_output_tokens", 0))


# ---- the naive HF side --------------------------------------------------------------------------
class NaiveHF:
    """One ``generate`` (or scoring forward) per LLM call, batch 1, full prompt each time."""

    def __init__(self, model_dir: str, eos_ids: list[int]) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
        self.eos_ids = eos_ids
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos_ids[0]
        self.num_calls = 0
        self.num_output_tokens = 0

    def prompt_ids(self, messages: list[dict[str, str]]) -> torch.Tensor:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return torch.tensor([self.tok.encode(text, add_special_tokens=False)])  # [1, S]

    def generate(self, messages: list[dict[str, str]], max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None, stop: str | None = None) -> str:
        """The reply's text (cut at ``stop``); greedy when ``temperature == 0``."""
        ids = self.prompt_ids(messages)
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:  # Arbor's defaults: no top-k, no top-p
            torch.manual_seed(0 if seed is None else seed)
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        extra: dict[str, Any] = {"stop_strings": [stop], "tokenizer": self.tok} if stop else {}
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
                                      **sampling, **extra)
        new = out[0, ids.shape[1]:].tolist()
        self.num_calls += 1
        self.num_output_tokens += sum(t not in self.eos_ids for t in new)  # as Arbor counts
        text = str(self.tok.decode(new, skip_special_tokens=True))
        return text.split(stop)[0] if stop else text

    def score(self, messages: list[dict[str, str]], choice: str) -> float:
        """Length-normalised logprob of ``choice`` as the assistant's reply (one forward)."""
        prompt = self.prompt_ids(messages)
        choice_ids = torch.tensor([self.tok.encode(choice, add_special_tokens=False)])
        ids = torch.cat([prompt, choice_ids], dim=1)  # [1, S + C]
        with torch.inference_mode():
            logits = self.model(ids).logits[0, prompt.shape[1] - 1 : -1]  # [C, V]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        self.num_calls += 1
        return float(logprobs.gather(1, choice_ids[0, :, None]).mean())

    def warm_up(self) -> None:
        self.generate([{"role": "user", "content": "Hi"}], max_tokens=2)
        self.num_calls = self.num_output_tokens = 0


class BatchedHF(NaiveHF):
    """The same model batched by hand where HF can: padded prompts, ``num_return_sequences``."""

    def generate_batch(self, prompts: list[list[dict[str, str]]], max_tokens: int, temperature: float = 0.0,
                       seed: int | None = None, stop: str | None = None, n: int = 1) -> list[str]:
        """The replies, ``n`` per prompt (prompt-major), from one left-padded ``generate``."""
        rows = [self.prompt_ids(m)[0].tolist() for m in prompts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows])  # [B, S]
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            torch.manual_seed(0 if seed is None else seed)
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        extra: dict[str, Any] = {"stop_strings": [stop], "tokenizer": self.tok} if stop else {}
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, num_return_sequences=n,
                                      eos_token_id=self.eos_ids, pad_token_id=self.pad_id, **sampling, **extra)
        self.num_calls += 1
        texts = []
        for new in out[:, width:].tolist():
            new = new[: next((k for k, t in enumerate(new) if t in self.eos_ids or t == self.pad_id), len(new))]
            self.num_output_tokens += len(new)
            text = str(self.tok.decode(new, skip_special_tokens=True))
            texts.append(text.split(stop)[0] if stop else text)
        return texts

    def score_batch(self, items: list[tuple[list[dict[str, str]], str]]) -> list[float]:
        """Length-normalised logprob of each (messages, choice), one right-padded forward."""
        prompts = [self.prompt_ids(m)[0].tolist() for m, _ in items]
        choices = [self.tok.encode(c, add_special_tokens=False) for _, c in items]
        rows = [p + c for p, c in zip(prompts, choices, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.pad_id] * (width - len(r)) for r in rows])  # [B, S]
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        with torch.inference_mode():
            logprobs = torch.log_softmax(self.model(ids, attention_mask=mask).logits.float(), dim=-1)
        self.num_calls += 1
        scores = []
        for b, (p, c) in enumerate(zip(prompts, choices, strict=True)):
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(c))  # the rows predicting the choice
            scores.append(float(logprobs[b, pos, torch.tensor(c)].mean()))
        return scores


def few_shot_messages(question: str) -> list[dict[str, str]]:
    messages = []
    for q, a in FEW_SHOT:
        messages += [{"role": "user", "content": q + ANSWER_STYLE}, {"role": "assistant", "content": a}]
    return messages + [{"role": "user", "content": question + ANSWER_STYLE}]


def hf_qa(hf: NaiveHF, sizes: Sizes) -> dict[str, Any]:
    answers = [hf.generate(few_shot_messages(q), sizes.qa_tokens) for q in QUESTIONS[: sizes.num_questions]]
    return {"answers": answers}


def hf_sc(hf: NaiveHF, sizes: Sizes) -> dict[str, Any]:
    messages = [{"role": "user", "content": SC_QUESTION}]
    texts = [hf.generate(messages, sizes.sc_tokens, sizes.sc_temperature, seed=i)
             for i in range(sizes.num_samples)]
    winner, votes = majority([final_number(t) for t in texts])
    return {"majority": winner, "votes": dict(votes)}


def hf_tree(hf: NaiveHF, sizes: Sizes) -> dict[str, Any]:
    """examples/tree_search.py, one call at a time: idea -> drafts -> yes/no scores."""
    leaves = []
    width, n = sizes.tree_width, sizes.tree_tokens
    for i in range(width):
        root = [{"role": "user", "content": TREE_TASK}]
        idea = hf.generate(root, n, 0.9, seed=i, stop="\n")
        refine = root + [{"role": "assistant", "content": idea}, {"role": "user", "content": TREE_REFINE}]
        for j in range(width):
            draft = hf.generate(refine, n, 0.9, seed=100 + 10 * i + j, stop="\n")
            judge = refine + [{"role": "assistant", "content": draft}, {"role": "user", "content": TREE_JUDGE}]
            scores = {c: hf.score(judge, c) for c in ("yes", "no")}
            leaves.append((scores["yes"], draft, (i, j)))
    score, draft, where = max(leaves, key=lambda leaf: leaf[0])
    return {"best": draft, "best_leaf": list(where), "best_score": score}


def hf_qa_batched(hf: BatchedHF, sizes: Sizes) -> dict[str, Any]:
    questions = QUESTIONS[: sizes.num_questions]
    return {"answers": hf.generate_batch([few_shot_messages(q) for q in questions], sizes.qa_tokens)}


def hf_sc_batched(hf: BatchedHF, sizes: Sizes) -> dict[str, Any]:
    texts = hf.generate_batch([[{"role": "user", "content": SC_QUESTION}]], sizes.sc_tokens,
                              sizes.sc_temperature, seed=0, n=sizes.num_samples)
    winner, votes = majority([final_number(t) for t in texts])
    return {"majority": winner, "votes": dict(votes)}


def hf_tree_batched(hf: BatchedHF, sizes: Sizes) -> dict[str, Any]:
    """examples/tree_search.py level by level: ideas, then every draft, then every score."""
    width, n = sizes.tree_width, sizes.tree_tokens
    root = [{"role": "user", "content": TREE_TASK}]
    ideas = hf.generate_batch([root], n, 0.9, seed=0, stop="\n", n=width)
    refines = [root + [{"role": "assistant", "content": idea}, {"role": "user", "content": TREE_REFINE}]
               for idea in ideas]
    drafts = hf.generate_batch(refines, n, 0.9, seed=1, stop="\n", n=width)  # [i * width + j]
    judges = [refines[k // width] + [{"role": "assistant", "content": d}, {"role": "user", "content": TREE_JUDGE}]
              for k, d in enumerate(drafts)]
    yes_no = hf.score_batch([(judge, c) for judge in judges for c in ("yes", "no")])
    leaves = [(yes_no[2 * k], d, (k // width, k % width)) for k, d in enumerate(drafts)]
    score, draft, where = max(leaves, key=lambda leaf: leaf[0])
    return {"best": draft, "best_leaf": list(where), "best_score": score}


# ---- the Arbor side -----------------------------------------------------------------------------
def arbor_qa(backend: Backend, sizes: Sizes) -> dict[str, Any]:
    states = few_shot_qa.run_batch([{"question": q, "max_tokens": sizes.qa_tokens}
                                    for q in QUESTIONS[: sizes.num_questions]], backend=backend)
    return {"answers": [st["answer"] for st in states], "llm_calls": len(states),
            "output_tokens": sum(output_tokens(st.get_meta("answer")) for st in states)}


def arbor_sc(backend: Backend, sizes: Sizes) -> dict[str, Any]:
    state = self_consistency.run(backend, question=SC_QUESTION, n=sizes.num_samples,
                                 max_tokens=sizes.sc_tokens, temperature=sizes.sc_temperature)
    winner, votes = majority([final_number(t) for t in state["reasoning"]])
    return {"majority": winner, "votes": dict(votes), "llm_calls": sizes.num_samples,
            "output_tokens": output_tokens(state.get_meta("reasoning"))}


def arbor_tree(backend: Backend, sizes: Sizes) -> dict[str, Any]:
    width = sizes.tree_width
    state = tree_search.run(backend, task=TREE_TASK, width=width, max_tokens=sizes.tree_tokens)
    score, draft, where = best_leaf(state)
    tokens = output_tokens(state.get_meta("idea")) + output_tokens(state.get_meta("draft"))
    return {"best": draft, "best_leaf": list(where), "best_score": score,
            "llm_calls": width + width * width * 3, "output_tokens": tokens}


HFSide = Callable[[BatchedHF, Sizes], dict[str, Any]]
WORKLOADS: dict[str, tuple[Callable[[Backend, Sizes], dict[str, Any]], HFSide, HFSide]] = {
    "qa": (arbor_qa, hf_qa, hf_qa_batched),
    "sc": (arbor_sc, hf_sc, hf_sc_batched),
    "tree": (arbor_tree, hf_tree, hf_tree_batched),
}
HF_MODES = ("naive", "batched")


def run_arbor(engine: Engine, backend: Backend, fn: Callable[..., dict[str, Any]], sizes: Sizes) -> dict[str, Any]:
    """Wall time of one workload and its cache hit rate (this workload's tokens only)."""
    before = engine.metrics()
    seconds, result = timed(fn, backend, sizes)
    engine.wait_idle()
    after = engine.metrics()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    return {"seconds": seconds, "cache_hit_rate": cached / prompt if prompt else 0.0,
            "prompt_tokens": prompt, "cached_prompt_tokens": cached, **result}


def run_hf(hf: NaiveHF, fn: Callable[..., dict[str, Any]], sizes: Sizes) -> dict[str, Any]:
    hf.num_calls = hf.num_output_tokens = 0
    seconds, result = timed(fn, hf, sizes)
    return {"seconds": seconds, "llm_calls": hf.num_calls, "output_tokens": hf.num_output_tokens, **result}


# ---- worker processes: one per side, each loads its model once ----------------------------------
_worker: dict[str, Any] = {}


def _start_arbor(threads: int | None) -> None:
    engine = Engine(model="default", num_threads=threads)
    backend = as_backend(engine)
    warm_up.run(backend)
    _worker.update(engine=engine, backend=backend)


def _start_hf(eos_ids: list[int], threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    hf = BatchedHF(str(default_model_dir()), eos_ids)
    hf.warm_up()
    _worker["hf"] = hf


def _arbor_info() -> tuple[list[int], int]:
    """(EOS ids, few-shot prefix tokens) from the Arbor worker."""
    engine, backend = _worker["engine"], _worker["backend"]
    prefix = engine.apply_chat_template(few_shot_messages("")[:-1], False)
    return list(engine.eos_token_ids), len(backend.encode(prefix))


def _run(side: str, name: str, sizes: Sizes) -> dict[str, Any]:
    arbor_fn, naive_fn, batched_fn = WORKLOADS[name]
    if side == "arbor":
        return run_arbor(_worker["engine"], _worker["backend"], arbor_fn, sizes)
    return run_hf(_worker["hf"], naive_fn if side == "naive" else batched_fn, sizes)


def _stop_arbor() -> None:
    _worker["engine"].close()


def report(name: str, ours: dict[str, Any], theirs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Print one workload's line (and what each side answered); return the ratios HF/Arbor
    of wall times (and of seconds per output token) per HF mode."""
    ratios: dict[str, float] = {}
    cells = []
    for mode in HF_MODES:
        hf = theirs.get(mode)
        ratio = hf["seconds"] / ours["seconds"] if hf else float("nan")
        # NOTE: sampled workloads (sc, tree) may stop at EOS after different lengths on the
        # two sides; the per-output-token ratio shows how much of the ratio that explains.
        per_token = ((hf["seconds"] / max(1, hf["output_tokens"])) / (ours["seconds"] / max(1, ours["output_tokens"]))
                     if hf else float("nan"))
        ratios[mode], ratios[mode + "_per_output_token"] = ratio, per_token
        calls = f"{hf['llm_calls']}" if hf else "-"
        tokens = f"{hf['output_tokens']}" if hf else "-"
        cells.append(f"{hf['seconds'] if hf else float('nan'):>8.2f} {ratio:>6.2f}x {per_token:>6.2f}x {calls:>4} {tokens:>5}")
    verdict = "" if not theirs else ("  ok" if min(r for m, r in ratios.items() if m in theirs) >= TARGET
                                     else f"  BELOW {TARGET:.0f}x")
    print(f"{name:>5} {ours['seconds']:>8.2f} {ours['cache_hit_rate']:>5.2f} {ours['llm_calls']:>4}"
          f" {ours['output_tokens']:>5} | " + " | ".join(cells) + verdict, flush=True)
    if name == "qa":
        for mode, hf in theirs.items():
            same = sum(a.strip() == b.strip() for a, b in zip(ours["answers"], hf["answers"], strict=True))
            print(f"      greedy answers identical, arbor vs hf {mode}: {same}/{len(ours['answers'])}")
    elif name == "sc":
        print(f"      majority: arbor {ours['majority']} {ours['votes']}"
              + "".join(f" | hf {m} {hf['majority']} {hf['votes']}" for m, hf in theirs.items()))
    elif name == "tree":
        print(f"      best leaf: arbor {ours['best_leaf']} {ours['best'].strip()!r}"
              + "".join(f" | hf {m} {hf['best_leaf']} {hf['best'].strip()!r}" for m, hf in theirs.items()))
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 questions and fewer tokens per call")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf", nargs="+", choices=HF_MODES, default=list(HF_MODES), help="HF baselines to run")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of each side (default: torch's, one per core)")
    args = ap.parse_args()
    print(reproduce_line())
    sizes = QUICK if args.quick else FULL
    modes = [] if args.skip_hf else args.hf
    spawn = multiprocessing.get_context("spawn")
    rows = []
    with contextlib.ExitStack() as stack:
        arbor = stack.enter_context(ProcessPoolExecutor(1, spawn, initializer=_start_arbor, initargs=(args.threads,)))
        eos_ids, prefix_len = arbor.submit(_arbor_info).result()
        hf = None if not modes else stack.enter_context(ProcessPoolExecutor(
            1, spawn, initializer=_start_hf, initargs=(eos_ids, args.threads)))
        if hf is not None:
            hf.submit(int).result()  # loaded and warmed up before anything is timed
        print(f"few-shot prefix: {prefix_len} tokens; sizes: {sizes}; load {load_average()}")
        print(f"{'work':>5} {'arbor s':>8} {'hit':>5} {'call':>4} {'out':>5} | "
              + " | ".join(f"{'hf ' + m + ' s':>15} {'hf/arb':>7} {'/tok':>7} {'call':>4} {'out':>5}"
                           for m in HF_MODES))
        for name in args.workloads:
            ours = arbor.submit(_run, "arbor", name, sizes).result()
            theirs = {m: hf.submit(_run, m, name, sizes).result() for m in modes} if hf is not None else {}
            ratios = report(name, ours, theirs)
            rows.append({"workload": name, "ratios": ratios, "arbor": ours, "hf": theirs,
                         "load_average": load_average()})
        arbor.submit(_stop_arbor).result()
    print(f"load average: {load_average()}")
    tag = "bench_programs_quick" if args.quick else "bench_programs"
    print("saved", save_result(tag, {"args": vars(args), "sizes": asdict(sizes), "target": TARGET, "rows": rows}))


if __name__ == "__main__":
    main()
