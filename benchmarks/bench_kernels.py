"""Triton paged attention vs the torch reference vs SDPA on contiguous KV (a GPU benchmark).

Decode: batch 64, context 4096, 32 query heads, 8 KV heads, head dim 128, fp16, page sizes
16 and 1 (pages handed out in a scrambled order, as after a while of serving). Extend:
batch 8, prefix 2048, extend 512, same heads. For every case, in this one process:

* correctness first: the Triton output is compared with the torch reference (the spec); a
  mismatch stops the run before anything is timed;
* timing: CUDA events around each call, median of ``--iters`` calls after ``--warmup``;
* baselines measured in the same run: the torch reference on the same paged pool, and
  ``F.scaled_dot_product_attention`` on contiguous ``[B, H, L, D]`` K/V (``enable_gqa``, or
  K/V repeated before timing) -- the "no paging" target;
* decode reports achieved memory bandwidth: bytes of K+V read (+ q, out, page table) per
  second, in GB/s and as a fraction of ``--peak-gbps`` (4800 for an H200); besides the
  kernel's own split-K choice, decode is swept over the ``--splits`` factors;
* extend reports TFLOP/s (QK^T and PV, causal part only) and a fraction of ``--peak-tflops``.

    .venv/bin/python benchmarks/bench_kernels.py [--page-sizes 16 1] [--iters 50]
        [--warmup 10] [--splits 1 2 4 8 16] [--peak-gbps 4800] [--out result.json]
    .venv/bin/python benchmarks/bench_kernels.py --compile-only   # no GPU needed

Needs a CUDA device. ``--compile-only`` needs none: it compiles every kernel for ``--arch``
(default sm_90) with Triton's bundled ptxas and prints registers / spills per kernel.
``--device cpu`` (with ``TRITON_INTERPRET=1`` and tiny shapes) only smoke-tests this
script on a CPU machine; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import reproduce_line, save_result  # noqa: E402

from kernels import reference  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (atol, rtol) vs the reference. Outputs are small (|o| ~ 0.05: softmax over thousands of
# random keys averages V), so atol must sit well below that to mean anything.
TOLERANCE = {torch.float16: (1e-3, 1e-2), torch.bfloat16: (8e-3, 5e-2), torch.float32: (1e-4, 1e-4)}


@dataclass(frozen=True)
class PagedPool:
    """One layer's paged K/V pool holding ``batch`` requests of ``seq_len`` tokens each."""

    k_buffer: torch.Tensor  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor  # [num_slots, Hkv, D]
    page_table: torch.Tensor  # [B, pages_per_req] int32, scrambled page order
    page_size: int

    def contiguous_kv(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same K/V laid out contiguously, [B, Hkv, L, D], for the SDPA baseline."""
        pos = torch.arange(seq_len, device=self.page_table.device)
        pages = self.page_table.long()[:, pos // self.page_size]  # [B, L]
        slots = pages * self.page_size + pos % self.page_size
        return (
            self.k_buffer[slots].transpose(1, 2).contiguous(),
            self.v_buffer[slots].transpose(1, 2).contiguous(),
        )


@dataclass
class Timing:
    """One timed implementation of one case."""

    name: str
    median_ms: float
    gbps: float | None = None  # decode: achieved memory bandwidth
    peak_fraction: float | None = None  # of --peak-gbps (decode) or --peak-tflops (extend)
    tflops: float | None = None  # extend: achieved fp throughput


def build_pool(
    batch: int, seq_len: int, num_kv_heads: int, head_dim: int, page_size: int,
    dtype: torch.dtype, device: torch.device, seed: int = 0,
) -> PagedPool:  # fmt: skip
    """Random K/V for ``batch`` requests; pages 1.. are handed out in a random order."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pages_per_req = math.ceil(seq_len / page_size)
    num_pages = batch * pages_per_req + 1  # page 0 stays unused, as a pool's dummy page
    order = torch.randperm(batch * pages_per_req, generator=gen) + 1
    page_table = order.view(batch, pages_per_req).to(torch.int32).to(device)
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, dtype=dtype, device=device)
    v_buffer = torch.randn(shape, dtype=dtype, device=device)
    return PagedPool(k_buffer, v_buffer, page_table, page_size)


def time_ms(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Callable[[], Any]:
    """A call of SDPA with q [B, Hq, Lq, D] over K/V [B, Hkv, L, D]: ``enable_gqa`` where
    this torch has it, else K/V repeated once here, outside the timed call."""
    try:
        tiny_q, tiny_kv = q.new_zeros(1, 2, 1, 8), q.new_zeros(1, 1, 1, 8)
        F.scaled_dot_product_attention(tiny_q, tiny_kv, tiny_kv, enable_gqa=True)
    except TypeError:  # torch < 2.5
        group = q.shape[1] // k.shape[1]
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, **kwargs)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)


def check_close(name: str, out: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error of ``out`` vs the reference; exits the run if beyond tolerance."""
    err = (out.float() - expected.float()).abs().max().item()
    atol, rtol = TOLERANCE[out.dtype]
    bad = ~torch.isclose(out.float(), expected.float(), atol=atol, rtol=rtol)
    if bad.any() or not math.isfinite(err):
        sys.exit(
            f"bench_kernels: {name} does not match the torch reference (max abs err {err:.3g}, "
            f"{int(bad.sum())} elements beyond atol {atol} / rtol {rtol}); not timing it"
        )
    scale = expected.float().abs().max().item()
    print(f"check: {name} matches the reference (max abs err {err:.2e}, max |ref| {scale:.2e})")
    return err


def bench_decode(args: argparse.Namespace, page_size: int, device: torch.device) -> dict[str, Any]:
    """Decode at one page size: Triton (auto splits, then the ``--splits`` sweep), the torch
    reference, contiguous SDPA."""
    from kernels.triton.decode_attention import choose_num_splits, decode_attention

    dtype, batch, seq_len = DTYPES[args.dtype], args.batch, args.context
    pool = build_pool(batch, seq_len, args.kv_heads, args.head_dim, page_size, dtype, device)
    q = torch.randn(batch, args.q_heads, args.head_dim, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    scale = args.head_dim**-0.5
    paged = (q, pool.k_buffer, pool.v_buffer, pool.page_table, seq_lens, page_size, scale)

    expected = reference.decode_attention(*paged)
    err = check_close(f"triton decode (page {page_size})", decode_attention(*paged), expected)
    elt = q.element_size()
    num_bytes = (
        2 * batch * seq_len * args.kv_heads * args.head_dim * elt  # K and V
        + 2 * q.numel() * elt  # q in, out
        + pool.page_table.numel() * 4
    )

    def timing(name: str, fn: Callable[[], Any]) -> Timing:
        ms = time_ms(fn, args.iters, args.warmup, device)
        gbps = num_bytes / (ms * 1e-3) / 1e9
        return Timing(name, ms, gbps=gbps, peak_fraction=gbps / args.peak_gbps)

    auto_splits = choose_num_splits(
        batch, args.kv_heads, pool.page_table.shape[1] * page_size, device
    )
    rows = [timing(f"triton (auto: {auto_splits} splits)", lambda: decode_attention(*paged))]
    for splits in [s for s in args.splits if s > 0]:
        call = functools.partial(decode_attention, *paged, num_kv_splits=splits)
        rows.append(timing(f"triton ({splits} splits)", call))
    rows.append(timing("torch reference (paged)", lambda: reference.decode_attention(*paged)))
    k, v = pool.contiguous_kv(seq_len)
    rows.append(timing("torch SDPA (contiguous KV)", sdpa_gqa(q[:, :, None], k, v, scale=scale)))
    return {"op": "decode", "page_size": page_size, "bytes": num_bytes, "max_abs_err": err,
            "timings": [asdict(r) for r in rows]}  # fmt: skip


def bench_extend(args: argparse.Namespace, page_size: int, device: torch.device) -> dict[str, Any]:
    """Extend (prefill with a cached prefix) at one page size: Triton, torch reference, SDPA."""
    from kernels.triton.extend_attention import extend_attention

    dtype, batch, prefix, ext = DTYPES[args.dtype], args.extend_batch, args.prefix, args.extend
    seq_len = prefix + ext
    pool = build_pool(
        batch, seq_len, args.kv_heads, args.head_dim, page_size, dtype, device, seed=1
    )
    q = torch.randn(batch * ext, args.q_heads, args.head_dim, dtype=dtype, device=device)
    lens = torch.full((batch,), ext, dtype=torch.int32, device=device)
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=device)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * ext
    scale = args.head_dim**-0.5
    paged = (
        q,
        pool.k_buffer,
        pool.v_buffer,
        pool.page_table,
        prefix_lens,
        lens,
        qo_indptr,
        page_size,
        scale,
    )

    expected = reference.extend_attention(*paged)
    err = check_close(f"triton extend (page {page_size})", extend_attention(*paged), expected)
    # Causal work only: each new token i sees prefix + i + 1 keys; 2 matmuls x 2 flops per MAC.
    flops = 4 * batch * args.q_heads * args.head_dim * (ext * prefix + ext * (ext + 1) / 2)

    def timing(name: str, fn: Callable[[], Any]) -> Timing:
        ms = time_ms(fn, args.iters, args.warmup, device)
        tflops = flops / (ms * 1e-3) / 1e12
        return Timing(name, ms, tflops=tflops, peak_fraction=tflops / args.peak_tflops)

    rows = [timing("triton", lambda: extend_attention(*paged)),
            timing("torch reference (paged)", lambda: reference.extend_attention(*paged))]  # fmt: skip
    k, v = pool.contiguous_kv(seq_len)
    q_bhld = q.view(batch, ext, args.q_heads, args.head_dim).transpose(1, 2)  # [B, Hq, ext, D]
    allowed = (
        torch.arange(seq_len, device=device)[None, :]
        <= prefix + torch.arange(ext, device=device)[:, None]
    )
    rows.append(
        timing("torch SDPA (contiguous KV)", sdpa_gqa(q_bhld, k, v, attn_mask=allowed, scale=scale))
    )
    return {"op": "extend", "page_size": page_size, "flops": flops, "max_abs_err": err,
            "timings": [asdict(r) for r in rows]}  # fmt: skip


def compile_only(args: argparse.Namespace) -> None:
    """Compile every kernel for ``--arch`` at the benchmark's shapes, no GPU needed, and
    print ptxas's register / spill report: catches compile errors and register blow-ups
    before a GPU run. Uses Triton internals (ASTSource, GPUTarget), so it may need updating
    with Triton; the JIT would add the same 16-divisibility hints for these shapes."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from kernels.triton import decode_attention as dec
    from kernels.triton import extend_attention as ext
    from kernels.triton import rms_norm as rms
    from kernels.triton import store_kv as skv

    dt, group = args.dtype, args.q_heads // args.kv_heads  # "fp16" etc. are Triton's names too
    dots = {"DOT_FP32": dt == "fp32", "DOT_PRECISION": "ieee" if dt == "fp32" else None}
    arch = int(args.arch.removeprefix("sm_"))
    decode = dec.launch_config(args.head_dim, group)
    # (kernel, dtypes of its pointer args, constexprs and launch options)
    kernels: list[tuple[Any, dict[str, str], dict[str, Any]]] = [
        (dec._decode_partial_kernel, {"q": dt, "k": dt, "v": dt, "mid_o": "fp32", "mid_lse": "fp32"},
         {**decode, **dots, "PAGE_SIZE": 16, "NUM_SPLITS": 4}),
        (dec._decode_reduce_kernel, {"mid_o": "fp32", "mid_lse": "fp32", "out": dt},
         {"NUM_SPLITS": 4, "BLOCK_N": decode["BLOCK_N"], "BLOCK_D": decode["BLOCK_D"], "num_warps": 4}),
        (ext._extend_kernel, {"q": dt, "k": dt, "v": dt, "out": dt},
         {**ext.launch_config(args.head_dim, group), **dots, "PAGE_SIZE": 16}),
        (skv._store_kv_kernel, {"k_buf": dt, "v_buf": dt, "k": dt, "v": dt, "slot_idx": "i64"},
         {"BLOCK_H": triton.next_power_of_2(args.kv_heads), "BLOCK_D": triton.next_power_of_2(args.head_dim)}),
        (rms._rms_norm_kernel, {"x": dt, "weight": dt, "out": dt}, {"BLOCK": 4096, "num_warps": 16}),
    ]  # fmt: skip
    for kernel, pointer_dtypes, config in kernels:
        options = {k: config.pop(k) for k in ("num_warps", "num_stages") if k in config}
        signature: dict[str, str] = {}
        attrs: dict[tuple[int], list[list[Any]]] = {}
        for i, name in enumerate(kernel.arg_names):
            if name in config:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = "*" + pointer_dtypes.get(name.removesuffix("_ptr"), "i32")
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[name] = "fp32" if name in ("scale_log2", "eps") else "i32"
                if name.startswith("stride_") or name == "head_dim":
                    attrs[(i,)] = [["tt.divisibility", 16]]
        start = time.perf_counter()
        src = ASTSource(fn=kernel, signature=signature, constexprs=config, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(compiled.asm["ptx"])
            ptx.flush()
            cmd = [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", ptx.name, "-o", os.devnull]
            report = subprocess.run(cmd, capture_output=True, text=True).stderr
        usage = [
            re.sub(r"^ptxas\S* info\s*:\s*", "", line.strip())
            for line in report.splitlines()
            if "registers" in line or "spill" in line
        ]
        print(f"{kernel.__name__}: compiled in {time.perf_counter() - start:.1f}s, "
              f"shared {compiled.metadata.shared} B; {' | '.join(usage)}")  # fmt: skip


def print_case(case: dict[str, Any]) -> None:
    head = f"{case['op']}, page size {case['page_size']} (max abs err vs reference {case['max_abs_err']:.2e})"
    print(
        f"\n{head}\n  {'implementation':<30} {'median ms':>10} {'GB/s':>8} {'TFLOP/s':>8} {'of peak':>8}"
    )
    for t in case["timings"]:
        gbps = f"{t['gbps']:.0f}" if t["gbps"] is not None else "-"
        tflops = f"{t['tflops']:.1f}" if t["tflops"] is not None else "-"
        print(
            f"  {t['name']:<30} {t['median_ms']:>10.3f} {gbps:>8} {tflops:>8} {t['peak_fraction']:>8.1%}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=64, help="decode batch size")
    p.add_argument("--context", type=int, default=4096, help="decode context length (tokens)")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16, 1])
    p.add_argument("--extend-batch", type=int, default=8)
    p.add_argument("--prefix", type=int, default=2048, help="extend: cached prefix tokens")
    p.add_argument("--extend", type=int, default=512, help="extend: new tokens per request")
    p.add_argument("--ops", nargs="+", choices=["decode", "extend"], default=["decode", "extend"])
    p.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8, 16],
                   help="decode split-K factors to sweep besides the automatic choice")  # fmt: skip
    p.add_argument("--iters", type=int, default=50, help="timed calls per implementation")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="GPU peak memory bandwidth")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="GPU peak dense fp16 TFLOP/s")
    p.add_argument(
        "--out", type=Path, help="write the JSON result here (default benchmarks/results/)"
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="no GPU needed: compile every kernel for --arch, print registers / spills",
    )
    p.add_argument("--arch", default="sm_90", help="--compile-only target (sm_90 = H100 / H200)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: smoke-test this script under TRITON_INTERPRET=1 (tiny shapes only)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compile_only:
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("bench_kernels: --compile-only compiles real kernels; unset TRITON_INTERPRET")
        print(reproduce_line())
        compile_only(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_kernels: needs a CUDA device (torch.cuda.is_available() is False); "
                 "nothing to measure here. Run it on a GPU machine.")  # fmt: skip
    if args.device == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench_kernels: TRITON_INTERPRET=1 would time the CPU interpreter; unset it")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("bench_kernels: --device cpu needs TRITON_INTERPRET=1")
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(reproduce_line())
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(
        f"device: {gpu}; torch {torch.__version__}; peak {args.peak_gbps:.0f} GB/s, {args.peak_tflops:.0f} TFLOP/s"
    )

    cases = []
    for page_size in args.page_sizes:
        if "decode" in args.ops:
            cases.append(bench_decode(args, page_size, device))
            print_case(cases[-1])
        if "extend" in args.ops:
            cases.append(bench_extend(args, page_size, device))
            print_case(cases[-1])
        if device.type == "cuda":
            torch.cuda.empty_cache()

    payload = {"device": gpu, "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
               "reproduce": reproduce_line(), "cases": cases}  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2))
        path = args.out
    else:
        path = save_result("bench_kernels", payload)
    print(f"\nresult: {path}\n{reproduce_line()}")


if __name__ == "__main__":
    main()
