"""What the engine and the router must agree on, written once: both import it, it imports neither.

hashing.py (chained block hashes), cacheable.py (which prompt blocks a prefix hit may cover),
kv_events.py and kv_wire.py (the KV event types and their NDJSON codec), messages.py (chat message
normalisation before the chat template), errors.py (the OpenAI error body), token_ids.py (token ids in
responses, vLLM's `return_token_ids`: what a router needs to continue a stream on another replica).
"""
