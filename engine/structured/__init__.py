"""Structured outputs: what a request constrains its answer to (spec.py), grammars compiled once and cached
off the engine loop (grammars.py), the token bitmask the batched sampler applies (bitmask.py), and tool
calls parsed out of generated text (tool_parser.py)."""
