"""LoRA adapters on the base model: loading PEFT adapters (adapter.py), the projections that add their
products row by row (layers.py), which adapters are in memory and in a step's slots (manager.py)."""
