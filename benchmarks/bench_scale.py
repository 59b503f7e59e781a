"""Load time, peak RSS and decode speed of random-weight GGUF models of real shapes.

    python benchmarks/bench_scale.py --shape 1b --type Q4_K_M --runs 2 --decode

Writes a Llama of the chosen shape straight with the ``gguf`` writer in random blocks of the
chosen type (random codes, fp16 scales of a sane size, F32 norms; the default model's
tokenizer, whose 49,152-token vocabulary the 1B shape shares) — no f16 intermediate. "Q4_K_M"
mixes types as llama-quantize does for it: Q6_K for the output head and for attn_v and
ffn_down in a third of the layers (more at both ends), Q4_K elsewhere. Then it starts an
Engine on it in a fresh process per run and reports the load wall time and the process's
peak RSS, and with ``--decode`` greedy decode tok/s at 1 and 8 streams (64 tokens each,
distinct prompts) and the time of one 512-token prefill. The text such a model writes is
noise; only speed and memory are real.
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


def q8_0_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks ``[rows, cols / 32 * 34]``: fp16 d ~ 0.001, random int8."""
    nb = cols // 32
    blocks = np.empty((rows, nb, 34), dtype=np.uint8)
    d = (0.0005 + 0.001 * rng.random((rows, nb), dtype=np.float32)).astype(np.float16)
    blocks[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)
    blocks[:, :, 2:] = rng.integers(0, 256, size=(rows, nb, 32), dtype=np.uint8)
    return blocks.reshape(rows, nb * 34)


def q4_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K superblocks ``[rows, cols / 256 * 144]``: d, dmin ~ 0.0002, random 6-bit
    scales and mins, random nibbles."""
    ns = cols // 256
    blocks = rng.integers(0, 256, size=(rows, ns, 144), dtype=np.uint8)
    for at in (0, 2):
        d = (0.0001 + 0.0002 * rng.random((rows, ns), dtype=np.float32)).astype(np.float16)
        blocks[:, :, at:at + 2] = d.view(np.uint8).reshape(rows, ns, 2)
    return blocks.reshape(rows, ns * 144)


def q6_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K superblocks ``[rows, cols / 256 * 210]``: random codes, int8 sub-block
    scales in -64..63, d ~ 0.0001."""
    ns = cols // 256
    blocks = rng.integers(0, 256, size=(rows, ns, 210), dtype=np.uint8)
    blocks[:, :, 192:208] = rng.integers(-64, 64, size=(rows, ns, 16), dtype=np.int8).view(np.uint8)
    d = (0.00005 + 0.0001 * rng.random((rows, ns), dtype=np.float32)).astype(np.float16)
    blocks[:, :, 208:] = d.view(np.uint8).reshape(rows, ns, 2)
    return blocks.reshape(rows, ns * 210)


BLOCK_WRITERS = {"Q4_0": q4_0_blocks, "Q8_0": q8_0_blocks, "Q4_K": q4_k_blocks, "Q6_K": q6_k_blocks}
TYPES = ("Q4_0", "Q4_K_M", "Q8_0")


def tensor_type(name: str, file_type: str, layers: int) -> str:
    """The block type of a linear in a file of ``file_type`` (llama-quantize's Q4_K_M rule:
    Q6_K for the head, and for attn_v / ffn_down where it "uses more bits")."""
    if file_type != "Q4_K_M":
        return file_type
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(name.split(".")[1])
        more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return "Q6_K" if more_bits else "Q4_K"
    return "Q4_K"


def write_model(path: Path, shape: str, file_type: str = "Q4_0") -> Path:
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
        kind = tensor_type(name, file_type, layers)
        w.add_tensor(name, BLOCK_WRITERS[kind](rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
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
out = {"import_s": t1 - t0, "load_s": t2 - t1}
engine.generate(["Hello"], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
if sys.argv[2] == "decode":
    for streams in (1, 8):
        prompts = [[1, *range(100 + 50 * i, 116 + 50 * i)] for i in range(streams)]
        params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        done = engine.generate(input_ids=prompts, sampling_params=params)
        out[f"decode_{streams}_tok_s"] = sum(len(d.token_ids) for d in done) / (time.perf_counter() - t)
    t = time.perf_counter()
    engine.generate(input_ids=[[1, *range(2000, 2511)]], sampling_params=SamplingParams(max_new_tokens=1))
    out["prefill_512_s"] = time.perf_counter() - t
out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
engine.close()
"""


def measure(path: Path, decode: bool = False) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), "decode" if decode else "load"],
                         capture_output=True, text=True, cwd=REPO, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--type", choices=TYPES, default="Q4_0", help="the file's block types")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--decode", action="store_true", help="also time decode and a prefill")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/arbor-bench-scale"))
    args = parser.parse_args()
    print("command:", " ".join(sys.argv))
    path = args.dir / f"random-{args.shape}-{args.type}.gguf"
    if not path.exists():
        args.dir.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write_model(path.with_suffix(".part"), args.shape, args.type).rename(path)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.1f} s")
    for run in range(args.runs):
        r = measure(path, args.decode)
        speed = (f", decode {r['decode_1_tok_s']:.1f} / {r['decode_8_tok_s']:.1f} tok/s at 1 / 8 streams, "
                 f"prefill 512 in {r['prefill_512_s']:.2f} s") if args.decode else ""
        print(f"run {run}: load {r['load_s']:.1f} s (+{r['import_s']:.1f} s imports), "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB, file {path.stat().st_size / 2**20:.0f} MiB{speed}")


if __name__ == "__main__":
    main()
