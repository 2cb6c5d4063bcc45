"""`kvfleet keys`: hash and new."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys

import pytest

from router.tenants.keys import main
from router.tenants.registry import Tenant, TenantRegistry
from tests.router.conftest import ROOT

ABC = hashlib.sha256(b"abc").hexdigest()


class _Stdin(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_hash_argument(capsys):
    assert main(["hash", "abc"]) == 0
    assert capsys.readouterr().out == ABC + "\n"


def test_hash_stdin_one_per_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Stdin("abc\n\n  sk-2  \r\n"))
    assert main(["hash"]) == 0
    assert capsys.readouterr().out == f"{ABC}\n{hashlib.sha256(b'sk-2').hexdigest()}\n"


def test_hash_without_a_key_fails(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Stdin(""))
    assert main(["hash"]) == 2
    assert capsys.readouterr().err == "kvfleet keys hash: error: no key given\n"


def test_new_key_identifies_its_tenant(capsys):
    assert main(["new"]) == 0
    key_line, hash_line = capsys.readouterr().out.splitlines()
    key, digest = key_line.removeprefix("key: "), hash_line.removeprefix("sha256: ")
    assert len(key) == 43 and digest == hashlib.sha256(key.encode()).hexdigest()
    reg = TenantRegistry([Tenant("acme", frozenset({digest}), 100)])
    assert reg.identify([(b"authorization", f"Bearer {key}".encode())]).name == "acme"
    assert main(["new", "--bytes", "64"]) == 0
    assert len(capsys.readouterr().out.splitlines()[0].removeprefix("key: ")) == 86


def test_new_refuses_short_keys(capsys):
    with pytest.raises(SystemExit) as e:
        main(["new", "--bytes", "8"])
    assert e.value.code == 2 and "--bytes must be >= 16, got 8" in capsys.readouterr().err


def test_kvfleet_keys_command():
    out = subprocess.run([sys.executable, "-m", "kvfleet", "keys", "hash"], input="abc\n", capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert (out.returncode, out.stdout) == (0, ABC + "\n")
    top = subprocess.run([sys.executable, "-m", "kvfleet", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert "keys      API keys for the router's tenants file" in top.stdout
