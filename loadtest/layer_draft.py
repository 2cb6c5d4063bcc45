"""A draft model cut from a checkpoint: its first N decoder layers, its embeddings, final norm and head.

    python -m loadtest.layer_draft --model smollm2 --layers 8 --out /tmp/smollm2-draft8

The bundled SmolLM2-135M has no smaller sibling to draft for it, so the draft_model benchmarks and tests use one
cut from it (the early-exit drafts of LayerSkip and Draft & Verify, untrained here: its acceptance is what the
first layers alone agree on). Writes config.json (num_hidden_layers = N) and model.safetensors; the tensors are
the checkpoint's own, so a GGUF's exact 4-bit groups stay exact and take the same kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import re

from safetensors.torch import load_file, save_file

from engine.model.loader import checkpoint_dir
from engine.model.registry import resolve_model

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def write_layer_draft(model: str, layers: int, out: str) -> str:
    """Write the draft into `out` (created); returns `out`."""
    src = checkpoint_dir(resolve_model(model))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    total = config["num_hidden_layers"]
    if not 1 <= layers < total:
        raise ValueError(f"--layers must be in [1, {total - 1}] for a model of {total} layers, got {layers}")
    state = load_file(os.path.join(src, "model.safetensors"))
    kept = {name: t for name, t in state.items() if (m := _LAYER.match(name)) is None or int(m.group(1)) < layers}
    os.makedirs(out, exist_ok=True)
    save_file(kept, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config, "num_hidden_layers": layers}, f, indent=1)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="the checkpoint to cut (a bundled name or a path)")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers the draft keeps, from the first")
    ap.add_argument("--out", required=True, help="directory to write the draft into")
    args = ap.parse_args(argv)
    try:
        print(write_layer_draft(args.model, args.layers, args.out))
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
