"""The cacheable-block rule: whole blocks, never the last prompt token."""

from contract.cacheable import cacheable_blocks, cacheable_tokens


def test_cacheable_blocks_never_cover_the_last_token():
    assert [cacheable_blocks(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


def test_cacheable_tokens_are_whole_blocks_and_never_the_last_token():
    assert [cacheable_tokens(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 4, 4, 8]
    assert [cacheable_tokens(n) for n in (0, 1, 2, 17)] == [0, 0, 1, 16]
