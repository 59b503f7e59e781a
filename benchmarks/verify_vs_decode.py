"""How often a verify row and a decode row disagree: the same token at the same position,
computed once by the decode path (one token, the paged decode kernel) and once inside a
verify pass (the extend path over ``[newest] + drafts``), on the default model.

Speculation is exact only if both paths give the same token. They run different kernels
(and a matmul over 1 row vs k rows), so logits differ in the last bits; this reports the
largest difference, how often the greedy argmax differs, and how often the two paths pick
a different token under seeded Gumbel-max sampling (temperature 1). No baseline: it is an
accuracy report, not a speed comparison.

    .venv/bin/python benchmarks/verify_vs_decode.py [--prompts 20] [--tokens 32] [--drafts 4]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import reproduce_line, save_result  # noqa: E402

from runtime import Engine  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402
from runtime.sampling.sampler import sample  # noqa: E402
from runtime.scheduler.batch import ForwardBatch, ForwardSeq  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--drafts", type=int, default=4)
    args = ap.parse_args()
    print(reproduce_line())
    engine = Engine(model="default", page_size=16, num_pages=512, speculation=False)
    runner, page = engine.runner, engine.config.page_size
    rng = random.Random(0)
    words = ["the", "of", "city", "river", "market", "winter", "music", "garden", "letter", "number", "story"]
    sampled = SamplingParams(temperature=1.0)
    max_diff, argmax_flips, sample_flips, rows = 0.0, 0, 0, 0
    with torch.inference_mode():
        for p in range(args.prompts):
            text = " ".join(rng.choice(words) for _ in range(40))
            prompt = engine.tokenizer(text)["input_ids"]
            pages = tuple(range(1, 1 + (len(prompt) + args.tokens + args.drafts) // page + 2))
            out = runner.forward(ForwardBatch((ForwardSeq("p", tuple(prompt), 0, pages, "last"),), ()))
            ids, decode_rows = list(prompt), []
            token = int(out.logits[0].argmax())
            for _ in range(args.tokens):  # greedy decode, one row at a time
                step = runner.forward(ForwardBatch((), (ForwardSeq("p", (token,), len(ids), pages, "last"),)))
                ids.append(token)
                decode_rows.append(step.logits[0])
                token = int(step.logits[0].argmax())
            # Re-run the same positions as verify passes of 1 + drafts tokens each.
            start = len(prompt)
            while start + 1 + args.drafts <= len(ids):
                seq = ForwardSeq("p", tuple(ids[start : start + 1 + args.drafts]), start, pages, "all")
                verify = runner.forward(ForwardBatch((seq,), ())).verify_logits["p"]
                for j in range(1 + args.drafts):
                    a, b = decode_rows[start - len(prompt) + j], verify[j]
                    max_diff = max(max_diff, float((a - b).abs().max()))
                    argmax_flips += int(a.argmax() != b.argmax())
                    seed, pos = 1000 * p + start, j
                    pick = [sample(r[None], [sampled], [seed], [pos]).token_ids[0] for r in (a, b)]
                    sample_flips += int(pick[0] != pick[1])
                    rows += 1
                start += 1 + args.drafts
    engine.close()
    print(f"rows compared: {rows}; max |logit difference|: {max_diff:.3g}")
    print(f"greedy argmax differs: {argmax_flips} / {rows}; seeded sampled token differs: {sample_flips} / {rows}")
    print("saved", save_result("verify_vs_decode", {"args": vars(args), "rows": rows, "max_abs_diff": max_diff,
                                                    "argmax_flips": argmax_flips, "sample_flips": sample_flips}))


if __name__ == "__main__":
    main()
