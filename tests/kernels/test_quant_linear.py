"""Block-quantized weights: the format's conversions (fp32 -> int8 / int4, GGUF blocks ->
ours, bit for bit against the ``gguf`` package's own dequantizer) and the C kernel on each
instruction-set path against the torch reference."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kernels import dispatch
from kernels.cpu import CpuKernels
from kernels.cpu.quant_linear import CpuQuantLinear
from kernels.reference import q6_k
from kernels.reference import quant as Q

PATH_DEFINES = {"native": (), "avx2": ("ARBOR_QUANT_NO_AVX512",), "portable": ("ARBOR_QUANT_SCALAR",)}


@pytest.fixture(scope="module", params=sorted(PATH_DEFINES))
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CpuQuantLinear:
    """The kernel built for each instruction-set path this CPU can run (the native build;
    AVX2 forced below AVX-512; portable C)."""
    native = CpuQuantLinear(tmp_path_factory.mktemp("qk"))
    built = CpuQuantLinear(tmp_path_factory.getbasetemp() / "qk-paths", PATH_DEFINES[request.param])
    if request.param == "avx2" and native.path == "portable C":
        pytest.skip("this CPU has no AVX2: only the portable path runs here")
    return built


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


FORMATS = {
    "int8-row": lambda w: Q.quantize_int8(w),
    "int8-g32": lambda w: Q.quantize_int8(w, blocks_per_group=1),
    "int4-g32": lambda w: Q.quantize_int4(w),
    "int4-g128": lambda w: Q.quantize_int4(w, blocks_per_group=4),
    "int5-g32": lambda w: Q.quantize_int5(w),  # Q5_0 / Q5_1 / Q5_K's layout
    "int5-g64": lambda w: Q.quantize_int5(w, blocks_per_group=2),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows,n,k", [(1, 960, 576), (7, 576, 1536), (33, 100, 800), (3, 17, 40)])
def test_kernel_matches_the_reference(kernel: CpuQuantLinear, fmt: str, rows: int, n: int, k: int) -> None:
    """Equal to the reference on the int8-rounded activations up to fp32 summation order,
    and within the activation rounding (~0.5% of the output) of the fp32 spec; K = 800 and
    40 exercise the padding to whole 64-element superblocks."""
    weight = FORMATS[fmt](_randn(n, k, seed=1, scale=0.05))
    x, bias = _randn(rows, k, seed=2), _randn(n, seed=3)
    out = kernel(x, weight, bias)
    exact = Q.quantized_linear(Q.quantize_activations(x), weight, bias)
    torch.testing.assert_close(out, exact, atol=2e-5, rtol=1e-5)
    spec = Q.quantized_linear(x, weight, bias)
    assert ((out - spec).norm() / spec.norm()).item() < 0.01


@pytest.mark.parametrize("bits,blocks_per_group", [(8, None), (8, 1), (5, 1), (5, 2), (4, 1), (4, 2)])
def test_kernel_takes_every_code_and_full_scale_activations(
    kernel: CpuQuantLinear, bits: int, blocks_per_group: int | None
) -> None:
    """Codes over their whole range (8 bits: 0 is q = -128, whose |q| the AVX2 path takes
    as an unsigned 128) with any scale and offset, against activations whose blocks
    quantize to +-127: the integer pair sums sit at their bound and must not saturate."""
    n, k, rows = 6, 128, 5
    gen = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 256, (n, k * bits // 8), generator=gen, dtype=torch.uint8)
    codes[0] = 0  # every q = -128 (8 bits) / every nibble 0
    codes[1] = 255
    groups = k // 32 if blocks_per_group == 1 else (1 if blocks_per_group is None else k // 64)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).half()
    offsets = (torch.rand(n, groups, generator=gen) * 0.2 - 0.1).half()
    weight = Q.QuantizedWeight(codes, scales, offsets, bits, blocks_per_group, k)
    x = torch.where(torch.rand(rows, k, generator=gen) < 0.5, -1.0, 1.0)  # every |xq| = 127
    x[1] = 1.0
    x[2] = -1.0
    exact = Q.quantized_linear(Q.quantize_activations(x), weight)
    torch.testing.assert_close(kernel(x, weight), exact, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k", [(70, 800), (17, 40), (3, 576)])
def test_dequantize_is_the_references_bit_for_bit(kernel: CpuQuantLinear, fmt: str, n: int, k: int) -> None:
    weight = FORMATS[fmt](_randn(n, k, seed=12, scale=0.05))
    assert torch.equal(kernel.dequantize(weight), Q.dequantize(weight))
    assert torch.equal(kernel.dequantize(weight, torch.bfloat16), Q.dequantize(weight).bfloat16())


def test_kernel_takes_any_leading_shape_and_no_rows(kernel: CpuQuantLinear) -> None:
    weight = Q.quantize_int4(_randn(64, 128, seed=4))
    x = _randn(2, 3, 128, seed=5)
    out = kernel(x, weight)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out.view(6, 64), kernel(x.view(6, 128), weight))
    assert kernel(torch.zeros(0, 128), weight).shape == (0, 64)


def test_kernel_refuses_a_wrong_width_or_bias(kernel: CpuQuantLinear) -> None:
    weight = Q.quantize_int8(_randn(64, 128, seed=6))
    with pytest.raises(ValueError, match="128 input features"):
        kernel(torch.zeros(1, 96), weight)
    with pytest.raises(ValueError, match="bias"):
        kernel(torch.zeros(1, 128), weight, torch.zeros(63))


def test_dispatch_uses_the_kernel_and_falls_back_to_the_reference(
    cpu_kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    weight = Q.quantize_int4(_randn(96, 256, seed=7))
    x = _randn(5, 256, seed=8)
    native = dispatch.quantized_linear(x, weight)
    torch.testing.assert_close(native, Q.quantized_linear(Q.quantize_activations(x), weight),
                               atol=2e-5, rtol=1e-5)
    many = _randn(600, 256, seed=9)  # a prefill chunk: bf16 with AVX512_BF16, else the AVX-512 kernel
    kernel = cpu_kernels.quant_linear
    if kernel.has_bf16:
        want = Q.bf16_linear(many, Q.dequantize(weight).bfloat16())
    else:
        want = Q.quantized_linear(Q.quantize_activations(many) if kernel.path == "avx512-vnni" else many, weight)
    torch.testing.assert_close(dispatch.quantized_linear(many, weight), want, atol=2e-5, rtol=1e-5)
    dispatch.set_kernel_backend("torch")
    try:
        torch.testing.assert_close(dispatch.quantized_linear(x, weight), Q.quantized_linear(x, weight))
    finally:
        dispatch.set_kernel_backend("auto")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_with_bf16_large_batches_run_a_bf16_matmul(cpu_kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch,
                                                   fmt: str) -> None:
    """Past ``quant_kernel_max_rows`` (AVX512_BF16 machines: from 32 rows, 64 for a weight
    with one scale per row) the weight, dequantized to bf16, meets x in a oneDNN bf16
    matmul: exactly ``reference.quant.bf16_linear``, and within its bf16 rounding (~0.3%)
    of the fp32 spec; up to it, the int8 kernel. On a CPU without AVX512_BF16 the path is
    forced (its C dequantize then rounds in plain C, and oneDNN emulates bf16)."""
    weight = FORMATS[fmt](_randn(96, 800, seed=14, scale=0.05))
    bias = _randn(96, seed=15)
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    monkeypatch.setattr(cpu_kernels.quant_linear, "has_bf16", True)
    limit = dispatch.quant_kernel_max_rows(weight)
    assert limit == (63 if fmt == "int8-row" else 31)
    for rows, on_bf16 in ((limit, False), (limit + 1, True), (300, True)):
        x = _randn(rows, 800, seed=16)
        out = dispatch.quantized_linear(x, weight, bias)
        spec = Q.quantized_linear(x, weight, bias)
        if on_bf16:
            assert torch.equal(out, Q.bf16_linear(x, Q.dequantize(weight).bfloat16(), bias))
            assert ((out - spec).norm() / spec.norm()).item() < 0.005
        else:
            torch.testing.assert_close(out, Q.quantized_linear(Q.quantize_activations(x), weight, bias),
                                       atol=2e-5, rtol=1e-5)


def test_without_avx512_large_batches_dequantize(cpu_kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """The AVX2 / portable kernel takes batches up to its row limit, and beyond it the
    weight is dequantized for an fp32 matmul (which is faster there, measured)."""
    lower = CpuQuantLinear(tmp_path, PATH_DEFINES["avx2"])
    monkeypatch.setattr(dispatch, "_cpu", dataclasses.replace(cpu_kernels, quant_linear=lower))
    weight = Q.quantize_int8(_randn(40, 96, seed=12))
    limit = dispatch.QUANT_KERNEL_MAX_ROWS_WITHOUT_AVX512
    for rows, expect_kernel in ((limit, True), (limit + 1, False)):
        x = _randn(rows, 96, seed=13)
        want = Q.quantized_linear(Q.quantize_activations(x) if expect_kernel else x, weight)
        torch.testing.assert_close(dispatch.quantized_linear(x, weight), want, atol=2e-5, rtol=1e-5)


# ---- the tiled layout (AVX-512 VNNI) --------------------------------------------------------
@pytest.fixture(scope="module")
def tiling(tmp_path_factory: pytest.TempPathFactory) -> CpuQuantLinear:
    """The native build, which reads tiled weights where the CPU has AVX-512 VNNI."""
    native = CpuQuantLinear(tmp_path_factory.mktemp("qk-tiles"))
    if not native.tiles:
        pytest.skip(f"environment: this CPU's build ({native.path}) has no AVX-512 VNNI path, which tiles")
    return native


def test_exactly_the_avx512_vnni_build_reads_tiles(kernel: CpuQuantLinear) -> None:
    """What the tiled tests' skip rests on: tiles go with the instruction-set path, and no
    other cause turns them off."""
    assert kernel.tiles == (kernel.path == "avx512-vnni")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows,n,k", [(1, 960, 576), (2, 576, 1536), (7, 112, 800), (33, 48, 40), (3, 16, 64)])
def test_tiled_kernel_matches_the_reference(tiling: CpuQuantLinear, fmt: str, rows: int, n: int, k: int) -> None:
    """The tiled weight gives what its row layout gives: the reference on the int8-rounded
    activations, up to fp32 summation order (1, 2, 3 tiles at a time, 1 or 2 activation
    rows, K padded to whole superblocks)."""
    weight = FORMATS[fmt](_randn(n, k, seed=21, scale=0.05))
    x, bias = _randn(rows, k, seed=22), _randn(n, seed=23)
    out = tiling(x, Q.tile(weight), bias)
    torch.testing.assert_close(out, Q.quantized_linear(Q.quantize_activations(x), weight, bias),
                               atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out, tiling(x, weight, bias), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("bits,blocks_per_group", [(8, None), (8, 1), (5, 1), (5, 2), (4, 1), (4, 2)])
def test_tiled_kernel_takes_every_code_and_full_scale_activations(
        tiling: CpuQuantLinear, bits: int, blocks_per_group: int | None) -> None:
    n, kp = 32, 256
    codes = torch.arange(n * kp).remainder(1 << bits).view(n, kp)  # every code, in every position
    groups = 1 if blocks_per_group is None else kp // 32 // blocks_per_group
    d = _randn(n, groups, seed=24).abs().half() * 0.01 + 0.001
    m = -(d.float() * (1 << (bits - 1))).half()
    weight = Q.QuantizedWeight(Q._pack_codes(codes, bits), d, m, bits, blocks_per_group, kp)
    x = torch.where(_randn(3, kp, seed=25) > 0, 1.0, -1.0)  # every activation code is +-127
    exact = Q.quantized_linear(Q.quantize_activations(x), weight)
    torch.testing.assert_close(tiling(x, Q.tile(weight)), exact, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_tiled_dequantize_is_the_references_bit_for_bit(tiling: CpuQuantLinear, fmt: str) -> None:
    weight = FORMATS[fmt](_randn(48, 800, seed=26, scale=0.05))
    tiled = Q.tile(weight)
    assert torch.equal(tiling.dequantize(tiled), Q.dequantize(weight))
    assert torch.equal(tiling.dequantize(tiled, torch.bfloat16), Q.dequantize(weight).bfloat16())


def test_builds_without_tiles_refuse_tiled_weights(tmp_path: Path, cpu_kernels: CpuKernels,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2 or portable build is asked for the row layout: handed a tiled weight it
    refuses it by name, and the dispatcher sends it to the reference instead."""
    lower = CpuQuantLinear(tmp_path, PATH_DEFINES["portable"])
    tiled = Q.tile(Q.quantize_int8(_randn(32, 64, seed=27)))
    x = _randn(3, 64, seed=28)
    assert not lower.tiles and not lower.supports(x, tiled)
    with pytest.raises(ValueError, match="row layout only"):
        lower(x, tiled)
    monkeypatch.setattr(dispatch, "_cpu", dataclasses.replace(cpu_kernels, quant_linear=lower))
    torch.testing.assert_close(dispatch.quantized_linear(x, tiled), Q.quantized_linear(x, tiled))
    assert dispatch.prepare_quantized(Q.quantize_int8(_randn(32, 64, seed=27))).tiled is False


def test_dispatch_tiles_what_the_kernel_reads_and_takes_every_batch(
        cpu_kernels: CpuKernels, tiling: CpuQuantLinear, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the build reads tiles, ``prepare_quantized`` tiles whole-tile weights (not
    others), and a tiled weight stays in the kernel at every batch size: it beats the bf16
    and fp32 paths there (measured; ``dispatch``'s table)."""
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    weight = Q.quantize_int4(_randn(96, 256, seed=29))
    tiled = dispatch.prepare_quantized(weight)
    assert tiled.tiled and dispatch.prepare_quantized(tiled) is tiled
    assert not dispatch.prepare_quantized(Q.quantize_int4(_randn(40, 256, seed=30))).tiled
    assert dispatch.quant_kernel_max_rows(tiled) is None
    many = _randn(600, 256, seed=31)
    torch.testing.assert_close(dispatch.quantized_linear(many, tiled),
                               Q.quantized_linear(Q.quantize_activations(many), weight), atol=2e-5, rtol=1e-5)
    dispatch.set_kernel_backend("torch")
    try:
        assert not dispatch.prepare_quantized(weight).tiled
    finally:
        dispatch.set_kernel_backend("auto")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_tile_round_trips_and_tiled_rows_are_the_rows(fmt: str) -> None:
    weight = FORMATS[fmt](_randn(48, 200, seed=32))
    tiled = Q.tile(weight)
    assert tiled.tiled and not torch.equal(tiled.codes, weight.codes)
    back = Q.untile(tiled)
    for a, b in ((back.codes, weight.codes), (back.scales, weight.scales), (back.offsets, weight.offsets)):
        assert torch.equal(a, b)
    assert torch.equal(Q.dequantize(tiled), Q.dequantize(weight))
    idx = torch.tensor([47, 0, 17, 16, 5])
    assert torch.equal(Q.dequantize(tiled.rows(idx)), Q.dequantize(weight)[idx])
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        Q.tile(Q.quantize_int8(_randn(40, 64, seed=33)))
    with pytest.raises(ValueError, match="then tile"):
        Q.cat_rows([tiled, tiled])


# ---- the format ----------------------------------------------------------------------------
def test_int8_and_int4_round_trip_within_half_a_step() -> None:
    w = _randn(50, 200, seed=9)  # 200 features: padded to 256 = 8 blocks
    for qw, groups in ((Q.quantize_int8(w), 1), (Q.quantize_int4(w), 8), (Q.quantize_int4(w, 4), 2)):
        assert qw.scales.shape == (50, groups) and qw.padded_features == 256
        err = (Q.dequantize(qw) - w).abs()
        per_row_step = qw.scales.float().amax(dim=1, keepdim=True)
        # within half a grid step (plus the fp16 rounding of d and m)
        assert (err <= per_row_step * 0.5 * 1.01 + 1e-3).all(), qw.bits
    exact = torch.tensor([[-127.0, 0.0, 1.0, 127.0] * 8])  # on the int8 grid with d = 1
    torch.testing.assert_close(Q.dequantize(Q.quantize_int8(exact)), exact)


def test_format_checks_its_tensors() -> None:
    qw = Q.quantize_int4(_randn(8, 64, seed=10))
    with pytest.raises(ValueError, match="codes must be uint8"):
        Q.QuantizedWeight(qw.codes[:, :-1], qw.scales, qw.offsets, 4, 1, 64)
    with pytest.raises(ValueError, match="power of two"):
        Q.QuantizedWeight(qw.codes, qw.scales, qw.offsets, 4, 3, 64)
    with pytest.raises(ValueError, match="bits"):
        Q.QuantizedWeight(qw.codes, qw.scales, qw.offsets, 2, 1, 64)
    with pytest.raises(ValueError, match="one format"):
        Q.cat_rows([qw, Q.quantize_int8(_randn(8, 64, seed=11))])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("k", [64, 96])  # 96: an odd number of blocks, padded
def test_ggml_blocks_load_bit_for_bit(kind: str, k: int) -> None:
    """gguf's own quantizer writes the blocks; ours must dequantize to exactly what gguf's
    dequantizer gives (both compute d * q + m in fp32). Q5's codes are held in 5 bits, in
    rows and in tiles, and widened to 8 give the same values."""
    qtype = gguf.GGMLQuantizationType[kind]
    w = _randn(24, k, seed=12).numpy()
    raw = gguf.quants.quantize(w, qtype)  # uint8 [24, k / 32 * block bytes]
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    ours = Q.from_ggml_blocks(torch.from_numpy(raw), kind, k)
    assert ours.bits == {"Q4": 4, "Q5": 5, "Q8": 8}[kind[:2]]
    torch.testing.assert_close(Q.dequantize(ours), want, atol=0, rtol=0)
    if ours.bits == 5:
        tile = ours.rows(torch.arange(16))  # whole tiles
        for held, rows in ((Q.tile(tile), 16), (Q.widen(ours), 24), (Q.widen(Q.tile(tile)), 16)):
            torch.testing.assert_close(Q.dequantize(held), want[:rows], atol=0, rtol=0)


def _k_quant_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random Q4_K / Q5_K superblocks (every scale, min, fifth-bit and nibble byte random;
    d, dmin ordinary)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, Q.K_BYTES[kind]), dtype=np.uint8)
    raw[:, :, 0:2] = rng.uniform(1e-4, 2e-2, (n, k // 256)).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    raw[:, :, 2:4] = rng.uniform(1e-4, 2e-2, (n, k // 256)).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind,bits", [("Q4_K", 4), ("Q5_K", 5)])
@pytest.mark.parametrize("k", [256, 768])
def test_k_quant_blocks_load_as_groups_of_32(kernel: CpuQuantLinear, kind: str, bits: int, k: int) -> None:
    """Q4_K and Q5_K (superblocks of 256 with 6-bit sub-block scales and mins) as our
    groups of 32 (Q5_K's in 5 bits): within the fp16 rounding of the block
    scales of gguf's own dequantizer, and the kernel matches the reference on them."""
    raw = _k_quant_blocks(kind, 20, k, seed=17)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32))
    ours = Q.from_ggml_blocks(torch.from_numpy(raw), kind, k)
    assert (ours.bits, ours.blocks_per_group, ours.scales.shape) == (bits, 1, (20, k // 32))
    # d * sc_j and dmin * m_j rounded to fp16 (at most 2^-11 of each): per block of 32, the
    # error is bounded by 2^-11 (max_code |scale| + |offset|), and is not zero (they were rounded)
    top = 15 if kind == "Q4_K" else 31
    bound = ((top * ours.scales.float().abs() + ours.offsets.float().abs()) * 2.0**-11).repeat_interleave(32, dim=1)
    err = (Q.dequantize(ours) - want).abs()
    assert (err <= bound * 1.001 + 1e-7).all() and err.max() > 0
    assert (err <= want.abs() * 1e-2 + 2e-3).all()
    x = _randn(5, k, seed=18)
    exact = Q.quantized_linear(Q.quantize_activations(x), ours)
    # NOTE: relative to the output's scale: these random blocks have offsets up to 1.26 a
    # weight, and the AVX2 path's 8-bit codes as code - 128 (offset + 128 d) cancel that much
    # more (seen: 4e-4 off on outputs of ~10^2)
    torch.testing.assert_close(kernel(x, ours), exact, atol=5e-6 * exact.abs().max().item(), rtol=1e-5)
    with pytest.raises(ValueError, match="superblocks of 256"):
        Q.from_ggml_blocks(torch.from_numpy(raw[:, :72]), kind, 128)


def test_widen_holds_4_bit_codes_in_8() -> None:
    weight = Q.quantize_int4(_randn(32, 96, seed=34))
    wide = Q.widen(weight)
    assert (wide.bits, wide.blocks_per_group) == (8, 1) and int(wide.codes.max()) <= 15
    assert torch.equal(Q.dequantize(wide), Q.dequantize(weight))
    assert torch.equal(Q.dequantize(Q.widen(Q.tile(weight))), Q.dequantize(weight))
    assert Q.widen(wide) is wide


def test_widen_holds_4_bit_codes_in_5_and_5_bit_ones_in_8() -> None:
    """4-bit codes are 5-bit ones with a zero fifth bit (how Q4 parts stack beside Q5); 5-bit
    ones widen to 8 (beside Q8_0); nothing narrows, and Q6_K does not widen."""
    four, five = Q.quantize_int4(_randn(32, 96, seed=35)), Q.quantize_int5(_randn(32, 96, seed=36))
    as5 = Q.widen(four, 5)
    assert as5.bits == 5 and torch.equal(Q.dequantize(as5), Q.dequantize(four))
    assert Q.widen(five, 8).bits == 8 and torch.equal(Q.dequantize(Q.widen(five, 8)), Q.dequantize(five))
    with pytest.raises(ValueError, match="cannot widen"):
        Q.widen(Q.widen(five, 8), 5)
    with pytest.raises(ValueError, match="cannot be widened"):
        Q.widen(Q.quantize_q6_k(_randn(16, 256, seed=37)))


def test_ggml_blocks_refuse_unknown_types_and_partial_blocks() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF block type"):
        Q.from_ggml_blocks(torch.zeros(1, 18, dtype=torch.uint8), "Q3_K", 32)
    with pytest.raises(ValueError, match="whole blocks"):
        Q.from_ggml_blocks(torch.zeros(1, 18, dtype=torch.uint8), "Q4_0", 40)


def test_rows_select_and_concatenate() -> None:
    a, b = Q.quantize_int4(_randn(6, 64, seed=13)), Q.quantize_int4(_randn(4, 64, seed=14))
    both = Q.cat_rows([a, b])
    torch.testing.assert_close(Q.dequantize(both), torch.cat([Q.dequantize(a), Q.dequantize(b)]))
    idx = torch.tensor([3, 0, 9])
    torch.testing.assert_close(Q.dequantize(both.rows(idx)), Q.dequantize(both)[idx])


def test_cache_dir_is_the_callers(tmp_path: Path) -> None:
    CpuQuantLinear(tmp_path)
    assert list(tmp_path.glob("quant_linear-*.so"))


def test_quantizing_by_row_chunks_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _randn(40, 96, seed=15)
    whole8, whole4 = Q.quantize_int8(w), Q.quantize_int4(w)
    monkeypatch.setattr(Q, "QUANTIZE_CHUNK_ROWS", 16)
    for whole, parts in ((whole8, Q.quantize_int8(w)), (whole4, Q.quantize_int4(w))):
        assert torch.equal(whole.codes, parts.codes) and torch.equal(whole.scales, parts.scales)
        assert torch.equal(whole.offsets, parts.offsets)


# ---- Q6_K, held as the file holds it (kernels/reference/q6_k.py) ---------------------------
def _q6_k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Random Q6_K superblocks: every code and sub-block scale byte random, d ordinary."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    raw[:, :, 208:] = rng.uniform(1e-4, 2e-2, (n, k // 256)).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("k", [256, 768])
def test_q6_k_blocks_load_as_stored_bit_for_bit(k: int) -> None:
    """Q6_K keeps its own bytes (6.5 bits a weight plus d and -32 d per 256; 8.5 in tiles) and
    dequantizes to exactly what gguf's dequantizer gives, in rows and in tiles."""
    raw = _q6_k_blocks(32, k, seed=40)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).astype(np.float32))
    ours = Q.from_ggml_blocks(torch.from_numpy(raw), "Q6_K", k)
    assert (ours.bits, ours.blocks_per_group, tuple(ours.codes.shape)) == (6, 8, (32, k // 256 * 208))
    assert ours.nbytes == 32 * k // 256 * 212
    assert torch.equal(Q.dequantize(ours), want)
    tiled = Q.tile(ours)
    assert tiled.nbytes == 32 * k // 256 * 276  # in tiles, a byte a code
    assert torch.equal(Q.dequantize(tiled), want) and torch.equal(Q.untile(tiled).codes, ours.codes)
    index = torch.tensor([31, 0, 17, 16, 5])
    assert torch.equal(Q.dequantize(tiled.rows(index)), want[index])
    assert torch.equal(Q.dequantize(ours.rows(index)), want[index])
    assert torch.equal(q6_k.to_blocks(ours.codes, ours.scales), torch.from_numpy(raw))
    with pytest.raises(ValueError, match="superblocks of 256"):
        Q.from_ggml_blocks(torch.from_numpy(raw[:, :105]), "Q6_K", 128)
    with pytest.raises(ValueError, match="cannot be widened"):
        Q.widen(ours)


def test_q6_k_quantizer_round_trips_through_the_file_format() -> None:
    """``quantize_q6_k`` writes blocks gguf reads back as our dequantization, within a
    6-bit step of the weights (4x closer than 4-bit groups of 32)."""
    w = _randn(48, 512, seed=41, scale=0.05)
    ours = Q.quantize_q6_k(w)
    raw = q6_k.to_blocks(ours.codes, ours.scales).numpy()
    back = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K))
    assert torch.equal(Q.dequantize(ours), back)
    err = ((back - w).norm() / w.norm()).item()
    assert err < 0.03 and err < ((Q.dequantize(Q.quantize_int4(w)) - w).norm() / w.norm()).item() / 3


@pytest.mark.parametrize("rows,n,k", [(1, 96, 512), (3, 40, 256), (33, 64, 768)])
def test_q6_k_kernel_matches_the_reference(kernel: CpuQuantLinear, rows: int, n: int, k: int) -> None:
    """On every path, in the row layout: the reference on the int8-rounded activations up to
    fp32 summation order; the C dequantize is the reference's bit for bit."""
    weight = Q.from_ggml_blocks(torch.from_numpy(_q6_k_blocks(n, k, seed=42)), "Q6_K", k)
    x, bias = _randn(rows, k, seed=43), _randn(n, seed=44)
    exact = Q.quantized_linear(Q.quantize_activations(x), weight, bias)
    torch.testing.assert_close(kernel(x, weight, bias), exact, atol=2e-6 * exact.abs().max().item(), rtol=1e-5)
    assert torch.equal(kernel.dequantize(weight), Q.dequantize(weight))
    assert torch.equal(kernel.dequantize(weight, torch.bfloat16), Q.dequantize(weight).bfloat16())


@pytest.mark.parametrize("rows,n,k", [(1, 96, 512), (2, 48, 256), (7, 112, 768), (33, 64, 512)])
def test_q6_k_tiled_kernel_matches_the_reference(tiling: CpuQuantLinear, rows: int, n: int, k: int) -> None:
    """Tiled (AVX-512 VNNI): 1, 2, 3, 4 tiles at a time, 1 or 2 activation rows, one and
    several superblocks; every code (0 and 63) and full-scale activations included."""
    raw = _q6_k_blocks(n, k, seed=45)
    raw.reshape(n, -1, 210)[0, 0, :192] = 0xFF  # codes 63
    raw.reshape(n, -1, 210)[1, 0, :192] = 0  # codes 0
    weight = Q.from_ggml_blocks(torch.from_numpy(raw), "Q6_K", k)
    x, bias = _randn(rows, k, seed=46), _randn(n, seed=47)
    x[0] = torch.where(x[0] > 0, 1.0, -1.0)  # every activation code +-127
    exact = Q.quantized_linear(Q.quantize_activations(x), weight, bias)
    out = tiling(x, Q.tile(weight), bias)
    torch.testing.assert_close(out, exact, atol=2e-6 * exact.abs().max().item(), rtol=1e-5)
    torch.testing.assert_close(out, tiling(x, weight, bias), atol=2e-6 * exact.abs().max().item(), rtol=1e-5)
    assert torch.equal(tiling.dequantize(Q.tile(weight)), Q.dequantize(weight))
    assert torch.equal(tiling.dequantize(Q.tile(weight), torch.bfloat16), Q.dequantize(weight).bfloat16())


@pytest.mark.parametrize(("kind", "k"), [("Q4_0", 96), ("Q4_1", 576), ("Q4_0", 64), ("Q4_1", 2048)])
def test_c_tiling_of_q4_blocks_is_the_references(kernel: CpuQuantLinear, kind: str, k: int) -> None:
    """The C pass from row addresses (here a permutation of a tensor's rows, as the loader
    un-permutes q / k) equals the torch one on the permuted rows, Q4_0's m = -8 d rounded
    alike (subnormal, largest and overflowing d included); 96 and 576 columns pad to whole
    superblocks."""
    values = _randn(48, k, seed=48).numpy()
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
    d = raw.reshape(48, k // 32, -1)[:, :, :2]
    for row, bits in enumerate([0x0001, 0x03FF, 0x0400, 0x5000, 0x7BFF, 0x77FF, 0x8001, 0xFBFF]):
        d[row, 0] = np.array([bits], dtype=np.uint16).view(np.uint8)
    order = np.random.default_rng(49).permutation(48)
    got = kernel.tile_q4_blocks(raw.ctypes.data + order.astype(np.uint64) * np.uint64(raw.shape[1]), kind, k)
    want = Q.tiled_from_q4_blocks(torch.from_numpy(raw)[torch.from_numpy(order)], kind, k)
    for field in ("codes", "scales", "offsets"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    with pytest.raises(ValueError, match="whole tiles"):
        kernel.tile_q4_blocks(np.zeros(40, dtype=np.uint64), kind, k)


@pytest.mark.parametrize("k", [256, 768])
def test_c_tiling_of_q4_k_blocks_is_the_references(kernel: CpuQuantLinear, k: int) -> None:
    """Q4_K from row addresses in one C pass: the reference's rows tiled, block scales
    d * sc_j and -dmin * m_j rounded to fp16 alike."""
    raw = _k_quant_blocks("Q4_K", 48, k, seed=50)
    order = np.random.default_rng(51).permutation(48)
    got = kernel.tile_q4_blocks(raw.ctypes.data + order.astype(np.uint64) * np.uint64(raw.shape[1]), "Q4_K", k)
    want = Q.tile(Q.from_ggml_blocks(torch.from_numpy(raw)[torch.from_numpy(order)], "Q4_K", k))
    for field in ("codes", "scales", "offsets"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    with pytest.raises(ValueError, match="whole blocks"):
        kernel.tile_q4_blocks(np.zeros(48, dtype=np.uint64), "Q4_K", 96)


@pytest.mark.parametrize(("kind", "k"), [("Q5_0", 96), ("Q5_1", 576), ("Q5_0", 64), ("Q5_1", 2048)])
def test_c_tiling_of_q5_blocks_is_the_references(kernel: CpuQuantLinear, kind: str, k: int) -> None:
    """Q5_0 / Q5_1 from row addresses (a permutation) in one C pass: the reference's rows
    tiled, fifth bits into their masks, Q5_0's m = -16 d rounded alike (subnormal, largest
    and overflowing d included); 96 and 576 columns pad to whole superblocks."""
    values = _randn(48, k, seed=52).numpy()
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
    d = raw.reshape(48, k // 32, -1)[:, :, :2]
    for row, bits in enumerate([0x0001, 0x03FF, 0x0400, 0x5000, 0x7BFF, 0x77FF, 0x8001, 0xFBFF]):
        d[row, 0] = np.array([bits], dtype=np.uint16).view(np.uint8)
    order = np.random.default_rng(53).permutation(48)
    got = kernel.tile_q5_blocks(raw.ctypes.data + order.astype(np.uint64) * np.uint64(raw.shape[1]), kind, k)
    want = Q.tile(Q.from_ggml_blocks(torch.from_numpy(raw)[torch.from_numpy(order)], kind, k))
    for field in ("codes", "scales", "offsets"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    with pytest.raises(ValueError, match="whole tiles"):
        kernel.tile_q5_blocks(np.zeros(40, dtype=np.uint64), kind, k)


def test_q6_k_tiling_by_row_chunks_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = Q.from_ggml_blocks(torch.from_numpy(_q6_k_blocks(64, 256, seed=52)), "Q6_K", 256)
    whole = Q.tile(weight)
    monkeypatch.setattr(q6_k, "TILE_CHUNK_ROWS", 16)
    assert torch.equal(Q.tile(weight).codes, whole.codes)
