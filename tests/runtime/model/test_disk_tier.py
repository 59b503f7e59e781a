"""The disk tier moves pages' bytes exactly: out of the pool, through the file (or the
staging buffer while a write is pending), back into other pool pages."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from runtime.cache.kv_tier import NoTier
from runtime.model.disk_tier import DiskTier, TierUnavailableError, make_tier
from runtime.model.kv_cache import KVCache

PS, LAYERS, HEADS, DIM, PAGES = 4, 3, 2, 8, 24
IDS = list(range(100, 116))  # 4 pages


def filled_kv(dtype: torch.dtype) -> KVCache:
    kv = KVCache(LAYERS, PAGES, PS, HEADS, DIM, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        k, v, k_scale, v_scale = kv.layer(layer)
        for x in (k, v):
            if dtype == torch.int8:
                x.copy_(torch.randint(-127, 128, x.shape, generator=gen, dtype=torch.int8))
            else:
                x.copy_(torch.randn(x.shape, generator=gen).to(dtype))
        for s in (k_scale, v_scale):
            if s is not None:
                s.copy_(torch.rand(s.shape, generator=gen))
    return kv


def page_bytes(kv: KVCache, page: int) -> list[bytes]:
    out = []
    for layer in range(LAYERS):
        for x in kv.layer(layer):
            if x is not None:
                out.append(x[page * PS : (page + 1) * PS].view(torch.uint8).numpy().tobytes())
    return out


class HeldWriter(DiskTier):
    """A tier whose writer waits for ``release`` (a write that has not happened yet)."""

    release = threading.Event()

    def _write_loop(self) -> None:
        self.release.wait()
        super()._write_loop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn, torch.bfloat16])
def test_a_reload_is_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    kv = filled_kv(dtype)
    tier = DiskTier(kv, tmp_path, 2**20)
    try:
        expected = [page_bytes(kv, p) for p in (5, 6, 7, 8)]
        tier.store(IDS, None, [5, 6, 7, 8])
        assert tier.flush()
        match = tier.match([*IDS, 1], None, 4)  # the pool still holds the first page
        assert match.num_tokens == 12 and len(match.slots) == 3
        assert tier.load(match, [20, 21, 22]) == 12
        assert [page_bytes(kv, p) for p in (20, 21, 22)] == expected[1:]
        tier.check_integrity()
        assert tier.stats.stored_pages == 4 and tier.stats.loaded_pages == 3
    finally:
        tier.close()


def test_a_pending_write_reloads_from_staging(tmp_path: Path) -> None:
    kv = filled_kv(torch.float32)
    HeldWriter.release.clear()
    tier = HeldWriter(kv, tmp_path, 2**20)
    try:
        expected = page_bytes(kv, 5)
        tier.store(IDS[:4], None, [5])
        assert tier.index.num_pending == 1
        kv.k[0].zero_()  # the pool page is reused at once
        match = tier.match([*IDS[:4], 1], None, 0)
        assert tier.load(match, [9]) == 4
        assert page_bytes(kv, 9) == expected
    finally:
        HeldWriter.release.set()
        tier.close()


def test_staging_is_bounded_and_the_deeper_pages_are_dropped(tmp_path: Path) -> None:
    kv = filled_kv(torch.float32)
    HeldWriter.release.clear()
    probe = DiskTier(kv, tmp_path, 2**20)
    slot = probe.slot_bytes
    probe.close()
    tier = HeldWriter(kv, tmp_path, 2**20, max_pending_bytes=2 * slot)
    try:
        tier.store(IDS, None, [5, 6, 7, 8])
        assert tier.stats.stored_pages == 2 and tier.stats.dropped_pages == 2
        HeldWriter.release.set()
        assert tier.flush()
        assert tier.match([*IDS, 1], None, 0).num_tokens == 8  # the first two pages
    finally:
        HeldWriter.release.set()
        tier.close()


def test_int8_pages_are_smaller_and_close(tmp_path: Path) -> None:
    kv = filled_kv(torch.float32)
    raw, small = DiskTier(kv, tmp_path, 2**20), DiskTier(kv, tmp_path, 2**20, int8=True)
    try:
        rows = 2 * LAYERS * PS * HEADS  # (token, head) rows of K and V in a page
        assert (raw.slot_bytes, small.slot_bytes) == (rows * DIM * 4, rows * (DIM + 4))  # codes + a scale
        before = kv.k[1][5 * PS : 6 * PS].clone()
        small.store(IDS[:4], None, [5])
        assert small.flush()
        assert small.load(small.match([*IDS[:4], 1], None, 0), [9]) == 4
        after = kv.k[1][9 * PS : 10 * PS]
        step = before.abs().amax(dim=-1, keepdim=True) / 127
        assert torch.all((after - before).abs() <= step / 2 + 1e-6)
        assert not torch.equal(after, before)  # int8 is not exact
    finally:
        raw.close()
        small.close()


def test_a_corrupt_page_is_dropped_and_the_rest_recomputed(tmp_path: Path) -> None:
    kv = filled_kv(torch.float32)
    tier = DiskTier(kv, tmp_path, 2**20)
    try:
        tier.store(IDS, None, [5, 6, 7, 8])
        assert tier.flush()
        match = tier.match([*IDS, 1], None, 0)
        tier._slots[match.slots[2], 100] ^= 0xFF  # the third page's bytes on "disk"
        assert tier.load(match, [9, 10, 11, 12]) == 8
        assert tier.stats.corrupt_pages == 1
        assert tier.match([*IDS, 1], None, 0).num_tokens == 8
        tier.check_integrity()
    finally:
        tier.close()


def test_namespaces_do_not_share_tier_pages(tmp_path: Path) -> None:
    kv = filled_kv(torch.float32)
    tier = DiskTier(kv, tmp_path, 2**20)
    try:
        tier.store(IDS, '["tenant-a", null]', [5, 6, 7, 8])
        assert tier.flush()
        assert tier.match([*IDS, 1], '["tenant-b", null]', 0).num_tokens == 0
        assert tier.match([*IDS, 1], None, 0).num_tokens == 0
        assert tier.match([*IDS, 1], '["tenant-a", null]', 0).num_tokens == 16
    finally:
        tier.close()


def test_lru_inside_the_byte_bound(tmp_path: Path) -> None:
    kv = filled_kv(torch.float32)
    slot = DiskTier(kv, tmp_path, 2**20)
    size = slot.slot_bytes
    slot.close()
    tier = DiskTier(kv, tmp_path, 3 * size + size // 2)  # three pages
    try:
        assert tier.index.num_slots == 3
        tier.store(IDS[:8], None, [5, 6])
        assert tier.flush()  # NOTE: a page whose write is pending is never evicted
        tier.store(list(range(500, 508)), None, [7, 8])
        assert tier.flush()
        assert tier.num_pages == 3
        assert tier.match([*IDS[:8], 1], None, 0).num_tokens == 4  # its deepest page went
        tier.check_integrity()
    finally:
        tier.close()


def test_an_unusable_directory_is_a_typed_error_and_a_logged_downgrade(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kv = filled_kv(torch.float32)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(TierUnavailableError, match="cannot make"):
        DiskTier(kv, not_a_dir / "tier", 2**20)
    with pytest.raises(TierUnavailableError, match="cannot allocate"):
        DiskTier(kv, tmp_path, 2**62)  # more than any disk: refused at start, not at a write
    with caplog.at_level(logging.WARNING, logger="arbor.kv_tier"):
        assert isinstance(make_tier(kv, str(not_a_dir / "tier"), 2**20, False), NoTier)
    assert "KV tier disabled" in caplog.text
    assert list(tmp_path.iterdir()) == [not_a_dir]  # the tier's files are unlinked at once
    assert isinstance(make_tier(kv, None, 2**20, False), NoTier)


def test_a_bound_below_one_page_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no page"):
        DiskTier(filled_kv(torch.float32), tmp_path, 100)


def test_a_pool_off_the_cpu_gets_no_disk_tier(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kv = KVCache(1, 4, PS, HEADS, DIM, torch.float32, torch.device("meta"))
    with caplog.at_level(logging.WARNING, logger="arbor.kv_tier"):
        assert isinstance(make_tier(kv, str(tmp_path), 2**20, False), NoTier)
    assert "the CPU path's" in caplog.text
