"""The lower KV tier's store: LRU bounded by bytes, in host memory or files. Exact."""

from __future__ import annotations

import os

import pytest

from engine.kv.tier import KVTier


@pytest.mark.parametrize("on_disk", [False, True])
def test_least_recently_used_blocks_leave_to_make_room(tmp_path, on_disk):
    path = str(tmp_path / "tier") if on_disk else None
    tier = KVTier(300, path)
    assert tier.medium == ("DISK" if on_disk else "CPU")
    assert tier.put(1, (1,), None, b"a" * 100) == []
    assert tier.put(2, (2,), "sql", b"b" * 100) == []
    assert tier.put(3, (3,), None, b"c" * 100) == []
    assert tier.get(1)[1] == b"a" * 100  # 1 is now the most recent
    assert tier.put(4, (4,), None, b"d" * 150) == [2, 3]
    assert tier.hashes() == [1, 4] and tier.used_bytes == 250
    entry, payload = tier.get(4)
    assert (entry.tokens, entry.lora, entry.nbytes, payload) == ((4,), None, 150, b"d" * 150)
    assert tier.put(1, (1,), None, b"a" * 100) == [] and tier.used_bytes == 250  # held already
    assert tier.put(9, (9,), None, b"x" * 301) == [] and 9 not in tier  # larger than the whole tier
    assert tier.adapter_hashes("sql") == []
    assert tier.drop(4) and not tier.drop(4) and tier.used_bytes == 100
    if on_disk:
        assert sorted(os.listdir(path)) == [f"{1:032x}.kv"]
    assert tier.clear() == [1] and len(tier) == 0 and tier.used_bytes == 0
    if on_disk:
        assert os.listdir(path) == []


def test_a_disk_tier_starts_empty(tmp_path):
    path = tmp_path / "tier"
    path.mkdir()
    (path / "stale.kv").write_bytes(b"old run")
    KVTier(100, str(path))
    assert os.listdir(path) == []
