"""Tenants: the file's validation (each error with its line), identification by key, cache salts, reload."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import textwrap
from fractions import Fraction

import pytest

from contract.errors import ConfigError
from router.tenants.budget import weighted
from router.tenants.file import TenantsFile, TenantsFileError, load_tenants, parse_tenants
from router.tenants.registry import (
    TENANT_SALT_PREFIX,
    AuthError,
    Tenant,
    TenantRegistry,
    key_sha256,
    presented_key,
    strip_client_credentials,
)

KEY_A, KEY_B, KEY_C = "sk-acme-1", "sk-acme-2", "sk-beta"
H_A, H_B, H_C = (hashlib.sha256(k.encode()).hexdigest() for k in (KEY_A, KEY_B, KEY_C))

GOOD = f"""\
tenants:
  acme:
    api_key_sha256: ["{H_A}", "{H_B}"]
    tokens_per_minute: 20000
    max_concurrent_requests: 8
    max_tokens: 1024
    max_context_tokens: 4096
    priority: 1
    isolate_cache: true
  beta:
    api_key_sha256:
      - {H_C.upper()}
    tokens_per_minute: 500
  free:
    tokens_per_minute: 100
    max_concurrent_requests: null
    priority: -1
anonymous: free
"""


def test_valid_file_loads_every_field():
    reg = parse_tenants(GOOD, "tenants.yaml")
    assert list(reg.tenants) == ["acme", "beta", "free"]
    assert reg.tenants["acme"] == Tenant(name="acme", api_key_sha256=frozenset({H_A, H_B}), tokens_per_minute=20000,
                                         max_concurrent_requests=8, max_tokens=1024, max_context_tokens=4096,
                                         priority=1, isolate_cache=True)
    assert reg.tenants["beta"] == Tenant(name="beta", api_key_sha256=frozenset({H_C}), tokens_per_minute=500)
    assert reg.tenants["free"] == Tenant(name="free", api_key_sha256=frozenset(), tokens_per_minute=100,
                                         priority=-1)
    assert reg.anonymous is reg.tenants["free"] and len(reg) == 3


def test_anonymous_null_and_absent_mean_none():
    one = f'tenants:\n  a:\n    api_key_sha256: ["{H_A}"]\n    tokens_per_minute: 1\n'
    assert parse_tenants(one).anonymous is None
    assert parse_tenants(one + "anonymous: null\n").anonymous is None
    assert len(parse_tenants("tenants: {}\n")) == 0


def _tenant(extra: str, name: str = "acme") -> str:
    """A file whose tenant `acme` has a key, a budget and `extra` (lines 3-5 are api_key_sha256,
    tokens_per_minute, then extra from line 5 on)."""
    return f'tenants:\n  {name}:\n    api_key_sha256: ["{H_A}"]\n    tokens_per_minute: 100\n' + extra


BAD = [
    # (file text, line, field, problem)
    ("tenants:\n  acme:\n    api_key_sha256: [\"" + H_A + "\"]\n    tokens_per_minute: -5\n",
     4, "tenants.acme.tokens_per_minute", "must be a positive integer, got -5"),
    (_tenant("    max_tokens: 0\n"), 5, "tenants.acme.max_tokens", "must be a positive integer or null, got 0"),
    (_tenant("    models: small\n"), 5, "tenants.acme.models", "must be a non-empty list of model names, got \"small\""),
    (_tenant("    models: [small, 3]\n"), 5, "tenants.acme.models[1]", "must be a non-empty string, got 3"),
    (_tenant("model_token_weights:\n  big: 0\n"), 6, "model_token_weights.big", "must be a number > 0, got 0"),
    (_tenant("model_token_weights:\n  big: lots\n"), 6, "model_token_weights.big", 'must be a number > 0, got "lots"'),
    (_tenant("    max_tokens: 1.5\n"), 5, "tenants.acme.max_tokens", "must be a positive integer or null, got 1.5"),
    (_tenant("    max_concurrent_requests: '8'\n"), 5, "tenants.acme.max_concurrent_requests",
     'must be a positive integer or null, got "8"'),
    (_tenant("    max_context_tokens: true\n"), 5, "tenants.acme.max_context_tokens",
     "must be a positive integer or null, got true"),
    (_tenant("    priority: null\n"), 5, "tenants.acme.priority", "must be an integer, got null"),
    (_tenant("    isolate_cache: 1\n"), 5, "tenants.acme.isolate_cache", "must be true or false, got 1"),
    (_tenant("    max_tokens: 4096\n    max_context_tokens: 4096\n"), 5, "tenants.acme.max_tokens",
     "must be less than max_context_tokens (4096): a request's prompt and max_tokens must fit in it, got 4096"),
    (_tenant("    rpm: 5\n"), 5, "tenants.acme.rpm", "unknown field (a tenant has api_key_sha256, "
     "tokens_per_minute, dollars_per_minute, max_concurrent_requests, max_tokens, max_context_tokens, priority, isolate_cache, models, weight, prices, "
     "slo_ttft_ms, slo_tpot_ms)"),
    (_tenant("    slo_ttft_ms: 0\n"), 5, "tenants.acme.slo_ttft_ms", "must be a number >= 1, got 0"),
    (_tenant("    slo_tpot_ms: fast\n"), 5, "tenants.acme.slo_tpot_ms", 'must be a number >= 1, got "fast"'),
    (_tenant("    priority: 1\n    priority: 2\n"), 6, "tenants.acme.priority", "given twice (first on line 5)"),
    (_tenant("  acme:\n    tokens_per_minute: 1\n"), 5, "tenants.acme", "given twice (first on line 2)"),
    (_tenant("default: x\n"), 5, "default", "unknown field (the file holds tenants, anonymous, model_token_weights, model_prices)"),
    (_tenant("anonymous: nobody\n"), 5, "anonymous", 'names no tenant defined under `tenants`: "nobody"'),
    (_tenant("anonymous: [a]\n"), 5, "anonymous", "must be a tenant name or null, got a list"),
    ("tenants:\n  acme:\n    api_key_sha256: [\"abc123\"]\n    tokens_per_minute: 1\n", 3,
     "tenants.acme.api_key_sha256[0]", "must be the 64-character hex sha256 of a key (`kvfleet keys hash`), "
     "got 6 characters"),
    ("tenants:\n  acme:\n    api_key_sha256:\n      - " + H_A + "\n      - " + "g" * 64 + "\n"
     "    tokens_per_minute: 1\n", 5, "tenants.acme.api_key_sha256[1]",
     "must be the 64-character hex sha256 of a key (`kvfleet keys hash`), got 64 characters"),
    ("tenants:\n  acme:\n    api_key_sha256: " + H_A + "\n    tokens_per_minute: 1\n", 3,
     "tenants.acme.api_key_sha256", "must be a list of hex sha256 digests (`kvfleet keys hash`), got a single value"),
    (_tenant("  beta:\n    api_key_sha256: [\"" + H_B + "\", \"" + H_A.upper() + "\"]\n    tokens_per_minute: 1\n"),
     6, "tenants.beta.api_key_sha256[1]", "this key hash is already a key of tenant acme (line 3)"),
    ("tenants:\n  acme:\n    api_key_sha256: [\"" + H_A + "\", \"" + H_A + "\"]\n    tokens_per_minute: 1\n",
     3, "tenants.acme.api_key_sha256[1]", "this key hash is already a key of this tenant (line 3)"),
    ("tenants:\n  acme:\n    api_key_sha256: [\"" + H_A + "\"]\n", 2, "tenants.acme.tokens_per_minute",
     "every tenant needs one budget: tokens_per_minute or dollars_per_minute, not both"),
    ("tenants:\n  acme:\n    tokens_per_minute: 1\n", 2, "tenants.acme.api_key_sha256",
     "missing: a tenant that is not the `anonymous` one needs at least one key hash"),
    ("tenants:\n  'a b':\n    tokens_per_minute: 1\n", 2, "tenants.a b", "a tenant name is 1-64 letters, digits, "
     "'_', '.' or '-', starting with a letter or digit"),
    ("tenants:\n  7: {}\n", 2, "tenants", "keys must be names, got 7"),
    ("tenants:\n  acme: 5\n", 2, "tenants.acme", "must be a mapping of settings, got 5"),
    ("tenants:\n", 1, "tenants", "must be a mapping of tenant name to settings, got null"),
    ("anonymous: null\n", 1, "tenants", "missing: the file needs a `tenants:` mapping of name to settings"),
    ("- tenants\n", 1, "", "must be a mapping with `tenants:` (and `anonymous:` and `model_token_weights:` and "
     "`model_prices:`), got a list"),
    ("", 1, "", "the file is empty; it needs a `tenants:` mapping"),
    ("tenants:\n  acme:\n    tokens_per_minute: [1\n", 4, "", "not valid YAML: did not find expected ',' or ']'"),
    (_tenant("    priority: !!python/object:os.system x\n"), 5, "tenants.acme.priority", "cannot read this value: "
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object:os.system'"),
]


@pytest.mark.parametrize(("text", "line", "field", "problem"), BAD)
def test_each_error_names_file_line_and_field(text, line, field, problem):
    with pytest.raises(TenantsFileError) as e:
        parse_tenants(text, "tenants.yaml")
    err = e.value
    assert (err.path, err.line, err.field, err.problem) == ("tenants.yaml", line, field, problem)
    assert str(err) == f"tenants.yaml:{line}: {field + ': ' if field else ''}{problem}"
    assert isinstance(err, ConfigError)


def test_the_issue_example_message():
    text = GOOD.replace("tokens_per_minute: 20000", "tokens_per_minute: -5")
    with pytest.raises(TenantsFileError) as e:
        parse_tenants(text, "tenants.yaml")
    assert str(e.value) == "tenants.yaml:4: tenants.acme.tokens_per_minute: must be a positive integer, got -5"


def test_a_plain_key_pasted_as_a_hash_is_never_quoted():
    plain = "sk-" + "x" * 61  # 64 characters, not hex
    with pytest.raises(TenantsFileError) as e:
        parse_tenants(f'tenants:\n  a:\n    api_key_sha256: ["{plain}"]\n    tokens_per_minute: 1\n', "t.yaml")
    assert plain not in str(e.value) and "got 64 characters" in str(e.value)


def test_a_digest_of_decimal_digits_is_read_as_text():
    digits = "1" * 64  # plain YAML would read this as an int
    reg = parse_tenants(f"tenants:\n  a:\n    api_key_sha256: [{digits}]\n    tokens_per_minute: 1\n")
    assert reg.tenants["a"].api_key_sha256 == frozenset({digits})


def test_unreadable_file(tmp_path):
    path = str(tmp_path / "missing.yaml")
    with pytest.raises(TenantsFileError) as e:
        load_tenants(path)
    assert str(e.value) == f"{path}: cannot read the tenants file: No such file or directory"
    assert e.value.line is None


# -- identification ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reg() -> TenantRegistry:
    return parse_tenants(GOOD)


@pytest.mark.parametrize(("headers", "tenant"), [
    ([(b"authorization", f"Bearer {KEY_A}".encode())], "acme"),
    ([(b"authorization", f"bearer   {KEY_B} ".encode())], "acme"),
    ([(b"api-key", KEY_C.encode())], "beta"),
    ([("Authorization", f"Bearer {KEY_C}")], "beta"),  # str pairs, any case
    ([("API-Key", KEY_A)], "acme"),
    ([(b"authorization", f"Bearer {KEY_A}".encode()), (b"api-key", KEY_C.encode())], "acme"),  # bearer wins
    ([(b"authorization", b"Basic dXNlcjpwdw=="), (b"api-key", KEY_C.encode())], "beta"),
    ([], "free"),  # no key: the anonymous tenant
    ([(b"authorization", b"Bearer ")], "free"),  # an empty key is no key
    ([(b"content-type", b"application/json")], "free"),
])
def test_identify(reg, headers, tenant):
    assert reg.identify(headers).name == tenant


@pytest.mark.parametrize(("headers", "reason"), [
    ([(b"authorization", b"Bearer sk-wrong")], "unknown_key"),
    ([(b"api-key", b"sk-wrong")], "unknown_key"),
    ([(b"authorization", f"Bearer {H_A}".encode())], "unknown_key"),  # the hash itself is not a key
    ([(b"authorization", b"Basic dXNlcjpwdw==")], "malformed"),
])
def test_identify_refuses(reg, headers, reason):
    with pytest.raises(AuthError) as e:
        reg.identify(headers)
    assert e.value.reason == reason and e.value.status == 401
    assert e.value.headers == ((b"www-authenticate", b"Bearer"),)


def test_missing_key_without_anonymous_is_refused_with_openai_body():
    reg = TenantRegistry([Tenant("acme", frozenset({H_A}), 10)])
    with pytest.raises(AuthError) as e:
        reg.identify([(b"host", b"x")])
    assert e.value.reason == "missing_key"
    assert e.value.body() == {"error": {
        "message": "You didn't provide an API key. Send it as `Authorization: Bearer KEY` or in an `api-key` header.",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


def test_unknown_key_body_never_echoes_the_key(reg):
    with pytest.raises(AuthError) as e:
        reg.identify([(b"authorization", b"Bearer sk-secret-value")])
    body = e.value.body()
    assert body == {"error": {"message": "Incorrect API key provided. Check the key sent in `Authorization: Bearer "
                              "KEY` or in the `api-key` header.", "type": "invalid_request_error", "param": None,
                              "code": "invalid_api_key"}}
    assert "secret" not in str(body) and "secret" not in str(e.value)


def test_presented_key_and_key_sha256():
    assert presented_key([(b"authorization", b"Bearer k1"), (b"authorization", b"Bearer k2")]) == b"k1"
    assert presented_key([(b"api-key", b"  ")]) is None
    assert key_sha256("abc") == key_sha256(b"abc") == hashlib.sha256(b"abc").hexdigest()


def test_registry_refuses_collisions_built_in_code():
    with pytest.raises(ConfigError, match="already a key of tenant 'a'"):
        TenantRegistry([Tenant("a", frozenset({H_A}), 1), Tenant("b", frozenset({H_A}), 1)])
    with pytest.raises(ConfigError, match="defined twice"):
        TenantRegistry([Tenant("a", frozenset(), 1), Tenant("a", frozenset(), 1)])
    with pytest.raises(ConfigError, match="names no tenant"):
        TenantRegistry([Tenant("a", frozenset(), 1)], anonymous="b")


def test_strip_client_credentials_keeps_the_rest_in_order():
    raw = [(b"host", b"r"), (b"authorization", b"Bearer k"), (b"content-type", b"json"), (b"api-key", b"k"),
           (b"x-session-id", b"s")]
    assert strip_client_credentials(raw) == [(b"host", b"r"), (b"content-type", b"json"), (b"x-session-id", b"s")]
    assert strip_client_credentials([("Authorization", "x"), ("Api-Key", "y"), ("Accept", "z")]) == [("Accept", "z")]


# -- cache salts ------------------------------------------------------------------------------------------------


def test_cache_salt_is_stable_per_name_and_only_for_isolated_tenants(reg):
    acme = reg.tenants["acme"]
    expected = TENANT_SALT_PREFIX + hashlib.sha256(b"kvfleet tenant cache salt\0acme").hexdigest()
    assert acme.cache_salt() == expected
    assert Tenant("acme", frozenset(), 5, isolate_cache=True).cache_salt() == expected  # reloads, other routers
    assert Tenant("acme2", frozenset(), 5, isolate_cache=True).cache_salt() != expected
    assert reg.tenants["beta"].cache_salt() is None


def test_request_cache_salt(reg):
    acme, beta = reg.tenants["acme"], reg.tenants["beta"]
    assert acme.request_cache_salt(None) == acme.request_cache_salt("mine") == acme.cache_salt()
    assert beta.request_cache_salt(None) is None
    assert beta.request_cache_salt("mine") == "mine"
    stolen = beta.request_cache_salt(acme.cache_salt())  # a client may not reach an isolated tenant's cache
    assert stolen == "kvfleet-client-" + hashlib.sha256(acme.cache_salt().encode()).hexdigest()


# -- reload -----------------------------------------------------------------------------------------------------


def _write(path, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # as editors and ConfigMap updates do: never a half-written file


def test_reload_good_then_bad_then_good(tmp_path, caplog):
    path = tmp_path / "tenants.yaml"
    _write(path, GOOD)
    seen: list[bool] = []
    tf = TenantsFile(str(path), interval_s=0.02, on_reload=seen.append)
    first = tf.registry
    new_key = key_sha256("sk-new")
    bad = GOOD.replace("tokens_per_minute: 500", "tokens_per_minute: lots")
    good2 = GOOD.replace(H_C.upper(), new_key)

    async def scenario():
        watcher = asyncio.create_task(tf.watch())
        try:
            async def until(cond):
                for _ in range(500):
                    if cond():
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError("the watcher did not act")

            await asyncio.sleep(0.1)
            assert tf.registry is first and tf.reloads == 0  # unchanged file: nothing happens
            _write(path, bad)
            await until(lambda: tf.failed_reloads == 1)
            assert tf.registry is first  # the previous tenants stay in force
            assert tf.registry.identify([(b"api-key", KEY_C.encode())]).name == "beta"
            await asyncio.sleep(0.1)
            assert tf.failed_reloads == 1  # a bad file is reported once, not on every poll
            _write(path, good2)
            await until(lambda: tf.reloads == 1)
            assert tf.registry.identify([(b"api-key", b"sk-new")]).name == "beta"
            with pytest.raises(AuthError):
                tf.registry.identify([(b"api-key", KEY_C.encode())])
            os.remove(path)  # gone: keep what is in force
            await asyncio.sleep(0.1)
            assert tf.registry.identify([(b"api-key", b"sk-new")]).name == "beta"
        finally:
            watcher.cancel()

    with caplog.at_level(logging.INFO, logger="kvfleet.router.tenants"):
        asyncio.run(scenario())
    assert seen == [False, True]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"tenants file not reloaded, the tenants in force stay: {path}:13: "
                      'tenants.beta.tokens_per_minute: must be a positive integer, got "lots"']
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{path}: cannot read the tenants file: No such file or directory; the tenants in force "
                        "stay"]
    assert any(r.getMessage() == f"tenants reloaded from {path}: 3 tenants (acme, beta, free)" for r in caplog.records)


def test_bad_file_at_start_up_raises(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(textwrap.dedent("""\
        tenants:
          acme:
            tokens_per_minute: 5
            colour: blue
        """))
    with pytest.raises(TenantsFileError, match=r"tenants\.yaml:4: tenants\.acme\.colour: unknown field"):
        TenantsFile(str(path))


def test_models_and_token_weights_are_read_exactly():
    reg = parse_tenants(_tenant("    models: [small, big]\nmodel_token_weights:\n  big: 2.5\n  tiny: 0.1\n"))
    assert reg.get("acme").models == frozenset({"small", "big"})
    assert reg.token_weight("big") == Fraction(5, 2) and reg.token_weight("tiny") == Fraction(1, 10)
    assert reg.token_weight("other") == 1 and reg.token_weight(None) == 1
    assert weighted(30, reg.token_weight("tiny")) == 3  # exactly 3: 30 x 0.1 in doubles is 3.0000000000000004
    assert weighted(31, reg.token_weight("tiny")) == 4 and weighted(7, reg.token_weight("big")) == 18
    assert parse_tenants(_tenant("")).get("acme").models is None  # no list: every model


def test_a_tenants_latency_targets_are_read_in_milliseconds():
    reg = parse_tenants("tenants:\n  acme:\n    tokens_per_minute: 10\n    slo_ttft_ms: 500\n    slo_tpot_ms: 80\n"
                        "anonymous: acme\n", "t.yaml")
    assert (reg.tenants["acme"].slo_ttft_s, reg.tenants["acme"].slo_tpot_s) == (0.5, 0.08)
