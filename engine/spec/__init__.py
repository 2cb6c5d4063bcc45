"""Speculative decoding (`--speculative-config`): draft tokens proposed per sequence and verified by the target
model in one step. `config.py` the setting, `ngram.py` the prompt-lookup proposer, `decoder.py` proposing (with
back-off) and verifying (accept the drafts the target model's own sampling agrees with)."""
