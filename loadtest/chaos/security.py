"""Security: requests without a key or with a wrong one never reach an engine; an engine refuses everything but
/health and /ready without the internal token; tenant cache isolation holds (no cross-tenant prefix hit);
keys, the internal token and prompts appear in no log and no metric (every process at its default log level;
checked over everything the campaign sent, so this scenario runs last)."""

from __future__ import annotations

import asyncio
import uuid

import httpx

from loadtest.chaos.clients import chat_body, request
from loadtest.chaos.common import Options, client
from loadtest.chaos.fleet import INTERNAL_TOKEN, KEYS, Fleet, metric
from loadtest.chaos.verdict import Verdict

NAME = "security"
ENGINE_COUNTERS = ("vllm:request_success_total", "kvfleet:rejected_requests_total", "kvfleet:aborted_requests_total",
                   "vllm:prompt_tokens_total")


def _engine_work(fleet: Fleet) -> list[float]:
    out = []
    for i in range(len(fleet.engines)):
        m = fleet.engine_metrics(i)
        out.append(sum(metric(m, name) for name in ENGINE_COUNTERS))
    return out


async def _cached(c, url: str, text: str, key: str) -> int:
    res = await request(c, url, chat_body(text, 4, False), key, timeout=120)
    if not res.ok:
        raise RuntimeError(f"isolation probe failed: {res.status} {res.error}")
    return int(((res.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def run(fleet: Fleet, opts: Options) -> Verdict:
    v = Verdict(NAME)
    canary = f"chaos-canary-{uuid.uuid4().hex[:12]}"
    async with client(16) as c:
        # 1. no key, a wrong key, the internal token as a key: 401 at the router, nothing reaches an engine
        await asyncio.to_thread(fleet.wait_idle, 30)
        before = await asyncio.to_thread(_engine_work, fleet)
        tries = []
        for r in fleet.routers:
            for key in (None, "sk-wrong-key", INTERNAL_TOKEN, KEYS["alpha"] + "x"):
                for stream in (False, True):
                    tries.append(await request(c, r.url, chat_body(f"{canary} unauthorised", 4, stream), key))
        await asyncio.sleep(1.0)
        after = await asyncio.to_thread(_engine_work, fleet)
        statuses = sorted({t.status for t in tries})
        v.figures["unauthorised requests: count / statuses"] = (len(tries), statuses)
        v.check("no or wrong key: 401, never reaches an engine", statuses == [401] and before == after,
                f"statuses {statuses}; engines' request counters before {before}, after {after}")
        # 2. engines: internal token required everywhere but /health and /ready
        refused, open_ok = [], []
        for e in fleet.engines:
            for hdrs in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {KEYS['alpha']}"}):
                for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                     ("GET", "/metrics"), ("GET", "/v1/kv/events"), ("GET", "/v1/models"),
                                     ("GET", "/v1/kvfleet/tokenizer")):
                    body = chat_body(canary, 4, False) if method == "POST" else None
                    resp = await c.request(method, e.url + path, json=body, headers=hdrs)
                    refused.append(resp.status_code)
            for path in ("/health", "/ready"):
                open_ok.append((await c.get(e.url + path)).status_code)
        v.figures["engine endpoints without the internal token: statuses"] = sorted(set(refused))
        v.check("engines refuse all but /health and /ready without the internal token",
                set(refused) == {401} and set(open_ok) == {200}, f"{sorted(set(refused))}; probes {open_ok}")
        # 3. tenant cache isolation, through the routers (the kv policy sends a repeated prefix to its engine)
        url = fleet.routers[0].url

        def fresh(tag: str) -> str:  # nobody sent it before: only the chat template's prefix can be cached
            return " ".join(uuid.uuid4().hex for _ in range(40)) + f" {tag} {canary}"

        p1, p2 = fresh("isolation one"), fresh("isolation two")
        for key in (KEYS["iso"], KEYS["alpha"]):  # each tenant's cache holds the chat template's first blocks
            await _cached(c, url, fresh("warm-up"), key)
        control_iso = await _cached(c, url, fresh("control"), KEYS["iso"])
        control_alpha = await _cached(c, url, fresh("control"), KEYS["alpha"])
        template = max(control_iso, control_alpha)  # what a prompt nobody sent before can hit
        iso_first, iso_again = await _cached(c, url, p1, KEYS["iso"]), await _cached(c, url, p1, KEYS["iso"])
        alpha_after_iso, alpha_again = await _cached(c, url, p1, KEYS["alpha"]), await _cached(c, url, p1, KEYS["alpha"])
        await _cached(c, url, p2, KEYS["alpha"])
        beta_after_alpha = await _cached(c, url, p2, KEYS["beta"])
        iso_after_alpha = await _cached(c, url, p2, KEYS["iso"])
        v.figures["cached tokens of a fresh prompt (the chat template's blocks): iso, alpha"] = (control_iso,
                                                                                                control_alpha)
        v.figures["cached tokens: iso, iso again, alpha after iso, alpha again, beta after alpha, iso after alpha"] = (
            iso_first, iso_again, alpha_after_iso, alpha_again, beta_after_alpha, iso_after_alpha)
        v.check("tenant cache isolation: no cross-tenant prefix hit", iso_again > template
                and alpha_again > template and alpha_after_iso <= template and iso_after_alpha <= template,
                f"the isolated tenant hits its own cache ({iso_again} tokens) but nothing of another's "
                f"({iso_after_alpha}); others hit nothing of its cache ({alpha_after_iso}); shared tenants share "
                f"({beta_after_alpha}); a fresh prompt's hit (the chat template's blocks) is {template}")
    # 4. secrets and prompts in logs and metrics
    texts = {p.name: p.log_text() for p in fleet.all_procs()}
    for p in fleet.routers:
        texts[f"{p.name} /metrics"] = httpx.get(p.url + "/metrics", timeout=5).text
    for e in fleet.engines:
        texts[f"{e.name} /metrics"] = httpx.get(e.url + "/metrics", headers=fleet.auth, timeout=5).text
    secrets = {**{f"key {k}": s for k, s in KEYS.items()}, "internal token": INTERNAL_TOKEN}
    leaks = [f"{what} in {where}" for where, text in texts.items() for what, s in secrets.items() if s in text]
    prompt_leaks = [where for where, text in texts.items() if canary in text or "chaos-canary-" in text]
    v.figures["logs and metrics scanned (bytes)"] = sum(len(t) for t in texts.values())
    v.check("keys and the internal token in no log or metric", not leaks, "; ".join(leaks) or "none found")
    v.check("prompts not logged by default", not prompt_leaks, ", ".join(prompt_leaks) or "no prompt text found")
    return v
