"""Cost of the penalties per engine step: counts kept incrementally by the output
processor (what the engine does) vs rebuilt from the output ids every step (torch.unique
over (row, id) keys, vectorised), vs a dense [B, V] count tensor (scatter-add, then one vectorised formula).

All three give the same logits (checked); the figure is the median time of one step's
adjustment for B penalized rows with O output tokens each, vocabulary 49152, next to the
time of sampling the same batch (temperature 1, no filter) for scale.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import load_average, reproduce_line, time_call
from runtime.sampling.params import SamplingParams
from runtime.sampling.penalties import TokenHistory, apply_penalties
from runtime.sampling.sampler import sample

VOCAB = 49152


def rebuilt(logits: torch.Tensor, params: SamplingParams, outputs: torch.Tensor, prompts: torch.Tensor) -> None:
    """Rebuilt from the ids every step, vectorised: distinct (row, id) pairs by torch.unique."""
    b = logits.shape[0]
    rows = torch.arange(b)[:, None]
    seen = torch.unique(torch.cat([prompts, outputs], dim=1) + rows * VOCAB)
    r, t = seen // VOCAB, seen % VOCAB
    v = logits[r, t]
    logits[r, t] = torch.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    keys, counts = torch.unique(outputs + rows * VOCAB, return_counts=True)
    r, t = keys // VOCAB, keys % VOCAB
    logits[r, t] -= counts * params.frequency_penalty + params.presence_penalty


def dense(logits: torch.Tensor, params: SamplingParams, outputs: torch.Tensor, prompts: torch.Tensor) -> None:
    """The vectorised alternative: [B, V] counts from the ids, every step."""
    counts = torch.zeros_like(logits).scatter_add_(1, outputs, torch.ones_like(outputs, dtype=logits.dtype))
    seen = counts.scatter(1, prompts, 1.0) > 0
    rep = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
    logits.copy_(torch.where(seen, rep, logits))
    logits -= counts * params.frequency_penalty + (counts > 0) * params.presence_penalty


def measure(b: int, olen: int, prompt_len: int, repeats: int, params: SamplingParams) -> list[float]:
    """Milliseconds per step: incremental, rebuilt, dense, and sampling for scale."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(b, VOCAB, generator=gen)
    prompts = torch.randint(0, VOCAB, (b, prompt_len), generator=gen)
    outputs = torch.randint(0, 2000, (b, olen), generator=gen)  # text reuses tokens
    histories = []
    for p_ids, o_ids in zip(prompts.tolist(), outputs.tolist(), strict=True):
        h = TokenHistory(p_ids)
        for t in o_ids:
            h.add(t)
        histories.append(h)
    ref, alt, den = logits.clone(), logits.clone(), logits.clone()
    apply_penalties(ref, [params] * b, histories)
    rebuilt(alt, params, outputs, prompts)
    dense(den, params, outputs, prompts)
    assert torch.allclose(ref, alt, atol=1e-5) and torch.allclose(ref, den, atol=1e-5)
    t_clone = time_call(lambda: logits.clone(), repeats)
    times = [time_call(lambda: apply_penalties(logits.clone(), [params] * b, histories), repeats),
             time_call(lambda: rebuilt(logits.clone(), params, outputs, prompts), repeats),
             time_call(lambda: dense(logits.clone(), params, outputs, prompts), repeats)]
    t_smp = time_call(lambda: sample(logits, [params] * b, list(range(b)), [olen] * b), repeats)
    return [1e3 * (t - t_clone) for t in times] + [1e3 * t_smp]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--output-len", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2)
    print(reproduce_line(), "| load", load_average())
    print(f"{'B':>4} {'out':>5} | {'incremental':>11} {'rebuilt':>9} {'dense':>9} | {'sample':>8}  (ms/step)")
    for b in args.batch:
        for olen in args.output_len:
            inc, reb, den, smp = measure(b, olen, args.prompt_len, args.repeats, params)
            print(f"{b:>4} {olen:>5} | {inc:>11.2f} {reb:>9.2f} {den:>9.2f} | {smp:>8.2f}")
    print("load", load_average())


if __name__ == "__main__":
    main()
