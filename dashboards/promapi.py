"""A small client of Prometheus's HTTP API (query, query_range, rules, targets) for the renderer and the tests."""

from __future__ import annotations

import httpx


class PromQLError(RuntimeError):
    """Prometheus answered with an error (bad expression, failed evaluation)."""


class PrometheusAPI:
    def __init__(self, url: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.client = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> PrometheusAPI:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _get(self, path: str, params: dict | None = None):
        r = self.client.get(self.url + path, params=params)
        try:
            body = r.json()
        except ValueError:
            raise PromQLError(f"{path}: HTTP {r.status_code}: {r.text[:200]}") from None
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType', 'error')}: {body.get('error', r.text[:200])}")
        return body["data"]

    def query(self, expr: str, time: float | None = None) -> list[dict]:
        """Instant vector (or scalar as one sample) at `time` (now by default): [{"metric": {...}, "value": [t, v]}]."""
        data = self._get("/api/v1/query", {"query": expr, **({"time": time} if time is not None else {})})
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """Range result: [{"metric": {...}, "values": [[t, "v"], ...]}]."""
        return self._get("/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step})["result"]

    def rules(self) -> list[dict]:
        return self._get("/api/v1/rules")["groups"]

    def targets(self) -> list[dict]:
        return self._get("/api/v1/targets")["activeTargets"]

    def ready(self) -> bool:
        try:
            return self.client.get(self.url + "/-/ready").status_code == 200
        except httpx.HTTPError:
            return False
