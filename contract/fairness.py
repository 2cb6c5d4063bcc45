"""Whom an engine's waiting queue is fair across: the router names the request's tenant in llm-d's header (the
same one gateways send the endpoint picker), and the engine's scheduler keeps a virtual token counter per name
(engine/fair_share.py). A request without it shares the name "" with every other such request."""

from __future__ import annotations

FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
MAX_FAIRNESS_ID_CHARS = 256
