"""The router's tokenizer fetch (router/requests/tokenizers.py) against a real HTTP server on loopback serving the
bundled model's tokenizer archive: an unexpected error while loading it (here one injected RuntimeError, as the
tokenizers library raises when two threads share a tokenizer), or a load stuck in its thread, is logged and
retried, never the end of the fetch (the model would stay without a tokenizer for the router's life)."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest
from aiohttp import web

import engine.tokenizer as engine_tokenizer
from engine.model.registry import resolve_model
from router.requests import tokenizers
from router.requests.tokenizers import tokenizer_from_engines

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def archive() -> bytes:
    return engine_tokenizer.tokenizer_archive(engine_tokenizer.load_tokenizer(resolve_model("smollm2", False)))


def test_an_unexpected_error_or_a_stuck_load_is_logged_and_the_fetch_retried(archive, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    real, calls = engine_tokenizer.load_tokenizer_archive, []

    def flaky(data: bytes):
        calls.append(len(data))
        if len(calls) == 1:
            raise RuntimeError("Already borrowed")
        if len(calls) == 2:
            time.sleep(4.0)  # stuck, as far as a 3 s bound is concerned
        return real(data)

    monkeypatch.setattr(engine_tokenizer, "load_tokenizer_archive", flaky)
    monkeypatch.setattr(tokenizers, "LOAD_TIMEOUT_S", 3.0)

    async def main():
        app = web.Application()
        app.router.add_get("/v1/kvfleet/tokenizer", lambda _: web.Response(body=archive))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                return await asyncio.wait_for(tokenizer_from_engines(
                    session, lambda: [f"http://127.0.0.1:{port}"], {}, "smollm2"), 60)
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.INFO, logger="kvfleet.router"):
        tok = asyncio.run(main())
    assert calls == [len(archive)] * 3  # failed once, stuck once, then loaded
    assert tok.encode_text("Hello harbour") == real(archive).encode("Hello harbour", add_special_tokens=False)
    assert "fetching the tokenizer of smollm2 from http://127.0.0.1" in caplog.text and "Already borrowed" in caplog.text
    assert "loading the tokenizer of smollm2 from http://127.0.0.1" in caplog.text and "took over 3 s" in caplog.text
    assert "tokenizer of smollm2 from" in caplog.text
