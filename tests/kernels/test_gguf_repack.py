"""GGUF blocks straight into the tiled layouts in C (``gguf_repack.c``), bit for bit
against the torch path they replace at load (``from_ggml_blocks``, ``widen``,
``quantize_int8(dequantize(...))``, ``cat_rows``, ``tile``), with F16C and with the
portable fp16 conversions."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels.cpu.gguf_repack import CpuGGUFRepack
from kernels.reference import quant as Q

BUILDS = {"native": (), "portable": ("ARBOR_QUANT_SCALAR",)}
# fp16 d bits at the edges: subnormal, smallest normal, ordinary, largest (-32 d, -128 d overflow)
EDGE_D = [0x0001, 0x03FF, 0x0400, 0x2E66, 0x5000, 0x7BFF, 0x8001, 0xFBFF]


@pytest.fixture(scope="module", params=sorted(BUILDS))
def repack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CpuGGUFRepack:
    return CpuGGUFRepack(tmp_path_factory.mktemp(f"repack-{request.param}"), BUILDS[request.param])


def _addresses(raw: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    index = np.arange(raw.shape[0], dtype=np.uint64) if order is None else order.astype(np.uint64)
    return raw.ctypes.data + index * np.uint64(raw.shape[1])


def _super_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random Q4_K (144 bytes) / Q6_K (210 bytes) superblocks: every byte random but the
    fp16 d (and Q4_K's dmin), ordinary ones."""
    rng = np.random.default_rng(seed)
    size, d_at = (144, (0, 2)) if kind == "Q4_K" else (210, (208,))
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for at in d_at:
        raw[:, :, at:at + 2] = rng.uniform(1e-4, 2e-2, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def _blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    if kind in ("Q4_K", "Q6_K"):
        return _super_blocks(kind, n, k, seed)
    values = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])


def _set_first_d(raw: np.ndarray, kind: str) -> None:
    """Row i's first block (or superblock) gets EDGE_D[i] as its d."""
    at = 208 if kind == "Q6_K" else 0
    for row, bits in enumerate(EDGE_D):
        raw[row, at:at + 2] = np.array([bits], dtype=np.uint16).view(np.uint8)


def _assert_same(got: Q.QuantizedWeight, want: Q.QuantizedWeight) -> None:
    assert (got.bits, got.blocks_per_group, got.in_features, got.tiled) == \
           (want.bits, want.blocks_per_group, want.in_features, want.tiled)
    for field in ("codes", "scales", "offsets"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.shape == b.shape, field
        # fp16 compared as bits: an inf or a NaN must be the same one
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.float16 else a,
                           b.view(torch.int16) if b.dtype == torch.float16 else b), field


@pytest.mark.parametrize("k", [256, 768])
def test_q6_k_rows_go_to_6_bit_tiles_as_the_torch_path(repack: CpuGGUFRepack, k: int) -> None:
    """From row addresses (a permutation of the tensor's rows) to the tiled 6-bit weight:
    the file's codes and int8 scales, d as stored, -32 d rounded alike (subnormal and
    overflowing d included)."""
    raw = _blocks("Q6_K", 48, k, seed=1)
    _set_first_d(raw, "Q6_K")
    order = np.random.default_rng(2).permutation(48)
    got = repack.tile_q6_k_blocks(_addresses(raw, order), k)
    _assert_same(got, Q.tile(Q.from_ggml_blocks(torch.from_numpy(raw[order]), "Q6_K", k)))


def _torch_part(raw: np.ndarray, kind: str, k: int, order: np.ndarray | None) -> Q.QuantizedWeight:
    """What the loader's torch path makes of one part of an 8-bit fused weight."""
    rows = torch.from_numpy(raw if order is None else raw[order])
    part = Q.from_ggml_blocks(rows, kind, k)
    if kind == "Q6_K":
        return Q.quantize_int8(Q.dequantize(part), blocks_per_group=1)
    return Q.widen(part)


@pytest.mark.parametrize(("kinds", "k"), [
    (("Q4_K", "Q4_K", "Q6_K"), 512),  # Q4_K_M's q, k beside a Q6_K v
    (("Q8_0", "Q4_0", "Q4_1"), 96),  # 96 columns: padded to two superblocks of 64
    (("Q8_0",), 2048),
    (("Q6_K", "Q8_0", "Q4_K", "Q4_0"), 256),
])
def test_mixed_rows_go_to_8_bit_tiles_as_the_torch_path(repack: CpuGGUFRepack, kinds: tuple[str, ...],
                                                        k: int) -> None:
    """Parts of different types stacked as one tiled 8-bit weight in groups of 32: Q8_0 as
    stored, 4-bit kinds widened, Q6_K requantized to int8 per 32 — each part's rows in a
    permutation, and d at the fp16 edges in the first part."""
    raws = [_blocks(kind, 16 * (i + 1), k, seed=10 + i) for i, kind in enumerate(kinds)]
    _set_first_d(raws[0], kinds[0])
    orders = [np.random.default_rng(20 + i).permutation(len(raw)) for i, raw in enumerate(raws)]
    got = repack.tile8_blocks([(_addresses(raw, order), kind) for raw, order, kind in zip(raws, orders, kinds,
                                                                                          strict=True)], k)
    want = Q.tile(Q.cat_rows([_torch_part(raw, kind, k, order) for raw, order, kind in zip(raws, orders, kinds,
                                                                                           strict=True)]))
    _assert_same(got, want)


def test_the_requantized_q6_k_rows_stay_within_their_int8_step(repack: CpuGGUFRepack) -> None:
    """Against gguf's own dequantization of the file's Q6_K rows: within half a step of each
    block's int8 scale."""
    raw = _blocks("Q6_K", 32, 512, seed=30)
    got = Q.dequantize(repack.tile8_blocks([(_addresses(raw), "Q6_K")], 512))
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).astype(np.float32))
    step = want.view(32, 16, 32).abs().amax(dim=2, keepdim=True) / 127
    assert ((got - want).view(32, 16, 32).abs() <= step * 0.5 + 1e-7).all()


def test_bad_shapes_and_kinds_are_refused(repack: CpuGGUFRepack) -> None:
    rows = np.zeros(16, dtype=np.uint64)
    with pytest.raises(ValueError, match="whole superblocks in whole tiles"):
        repack.tile_q6_k_blocks(rows, 96)
    with pytest.raises(ValueError, match="whole superblocks in whole tiles"):
        repack.tile_q6_k_blocks(rows[:8], 256)
    with pytest.raises(ValueError, match=r"\['Q5_0'\]"):
        repack.tile8_blocks([(rows, "Q5_0")], 256)
    with pytest.raises(ValueError, match="whole blocks in whole tiles"):
        repack.tile8_blocks([(rows, "Q8_0"), (rows, "Q6_K")], 96)  # Q6_K: whole superblocks
    with pytest.raises(ValueError, match="whole blocks in whole tiles"):
        repack.tile8_blocks([(rows[:8], "Q8_0")], 64)
