"""Load time and peak RSS of random-weight GGUF models of real shapes.

    python benchmarks/bench_scale.py --shape 1b --runs 2

Writes a Llama of the chosen shape in Q4_0 blocks straight with the ``gguf`` writer (random
nibbles, fp16 block scales of a sane size, F32 norms; the default model's tokenizer, whose
49,152-token vocabulary the 1B shape shares) — no f16 intermediate — then starts an Engine
on it in a fresh process per run and reports the load wall time and the process's peak
RSS. The text such a model writes is noise; only speed and memory are real.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {  # hidden, layers, heads, kv heads, FFN, vocab
    "1b": (2048, 16, 32, 8, 8192, 49152),
    "8b": (4096, 32, 32, 8, 14336, 128256),
}


def q4_0_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks ``[rows, cols / 32 * 18]``: fp16 d ~ 0.01, random nibbles."""
    nb = cols // 32
    blocks = np.empty((rows, nb, 18), dtype=np.uint8)
    d = (0.005 + 0.01 * rng.random((rows, nb), dtype=np.float32)).astype(np.float16)
    blocks[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)
    blocks[:, :, 2:] = rng.integers(0, 256, size=(rows, nb, 16), dtype=np.uint8)
    return blocks.reshape(rows, nb * 18)


def write_model(path: Path, shape: str) -> Path:
    import gguf

    from runtime.model.default_model import default_gguf_file
    from runtime.model.gguf_file import GGUFFile

    hidden, layers, heads, kv_heads, ffn, vocab = SHAPES[shape]
    source = GGUFFile(default_gguf_file())
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 8192), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 500000.0), (w.add_vocab_size, vocab)):
        add(value)  # type: ignore[operator]
    meta = source.metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"].tolist()
    tokens += [f"<|reserved_{i}|>" for i in range(vocab - len(tokens))]  # the 8B shape's larger vocabulary
    types += [1] * (vocab - len(types))  # normal tokens: no special-token matching to build
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(meta["tokenizer.chat_template"])
    source.close()
    q4 = gguf.GGMLQuantizationType.Q4_0
    head_dim = hidden // heads
    linears = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    norms = ["output_norm.weight"]
    for i in range(layers):
        p = f"blk.{i}."
        linears.update({p + "attn_q.weight": (heads * head_dim, hidden), p + "attn_k.weight": (kv_heads * head_dim, hidden),
                        p + "attn_v.weight": (kv_heads * head_dim, hidden), p + "attn_output.weight": (hidden, hidden),
                        p + "ffn_gate.weight": (ffn, hidden), p + "ffn_up.weight": (ffn, hidden),
                        p + "ffn_down.weight": (hidden, ffn)})
        norms += [p + "attn_norm.weight", p + "ffn_norm.weight"]
    for name in norms:
        w.add_tensor(name, np.ones(hidden, dtype=np.float32))
    for name, (rows, cols) in linears.items():
        w.add_tensor(name, q4_0_blocks(rows, cols, rng), raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from runtime import Engine, SamplingParams
t1 = time.perf_counter()
engine = Engine(model=sys.argv[1], max_running_requests=8, max_model_len=2048)
t2 = time.perf_counter()
engine.generate(["Hello"], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
engine.close()
"""


def measure(path: Path) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, cwd=REPO,
                         check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/arbor-bench-scale"))
    args = parser.parse_args()
    print("command:", " ".join(sys.argv))
    path = args.dir / f"random-{args.shape}-Q4_0.gguf"
    if not path.exists():
        args.dir.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write_model(path.with_suffix(".part"), args.shape).rename(path)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.1f} s")
    for run in range(args.runs):
        r = measure(path)
        print(f"run {run}: load {r['load_s']:.1f} s (+{r['import_s']:.1f} s imports), "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB, file {path.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
