"""A pool's `adapters:` in the pools file (LoRA adapters its replicas load on demand): parsed with their paths,
checked, and served by the pool in the model catalog whether its models are declared or learned."""

from __future__ import annotations

import pytest

from router.config_file import ConfigFileError
from router.pools.file import parse_pools
from router.pools.models import catalog

TEXT = """
pools:
  a:
    version: v1
    weight: 1
    model: smollm2
    adapters:
      sql: /adapters/sql
      chat: /adapters/chat
    replicas: [http://127.0.0.1:9001]
  b:
    version: v1
    weight: 1
    adapters: {sql: /other/sql}
    replicas: [http://127.0.0.1:9002]
"""


def test_adapters_are_parsed_and_served_by_their_pool():
    pools = parse_pools(TEXT)
    a, b = (p.spec for p in pools.pools)
    assert a.adapters == (("sql", "/adapters/sql"), ("chat", "/adapters/chat")) and b.adapters == (("sql", "/other/sql"),)
    cat = catalog([a, b], {})  # b declares no models and has not learned any yet
    assert cat.pools_of == {"smollm2": ("a",), "sql": ("a", "b"), "chat": ("a",)} and cat.unlearned == ("b",)
    cat = catalog([a, b], {"b": frozenset({"smollm2", "tuned"})})
    assert cat.pools_of["smollm2"] == ("a", "b") and cat.pools_of["tuned"] == ("b",) and not cat.unlearned


@pytest.mark.parametrize("adapters, words", [("[sql]", "a mapping of adapter name to its path"),
                                             ("{sql: ''}", "non-empty string")])
def test_bad_adapters_name_the_field(adapters, words):
    text = TEXT.replace("adapters: {sql: /other/sql}", f"adapters: {adapters}")
    with pytest.raises(ConfigFileError) as e:
        parse_pools(text)
    assert "pools.b.adapters" in str(e.value) and words in str(e.value)
