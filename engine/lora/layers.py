"""Projections that add each row's LoRA product to the base output: the BGMV/SGMV idea in torch.

`attach_lora(model, num_slots)` wraps the four projections of every decoder layer (fused qkv, o, fused
gate/up, down), whatever implementation the load swapped in (plain, oneDNN, packed 4-bit, Triton glue),
in a `LoRALinear`. All wrappers share one `LoRABatch`: before each forward pass the engine sets which
rows of the flattened batch run under which slot. A step with no adapter rows takes the base path
unchanged (one attribute test per projection). Otherwise, in torch:
- steps of up to DENSE_MAX_ROWS rows (decodes) with several adapters: every slot's A side by side
  (`a [in, parts * slots * rank]`, part-major, zero-padded to the largest rank) and, per part, every slot's
  B stacked (`b[part] [slots * rank, part size]`); x @ a gives every row its product with every slot's A, a
  per-row mask keeps its own slot's columns (none for base rows), and one matmul per part adds its own B:
  a few large-matmul ops per projection whatever the number of adapters (on this machine's CPU cheaper than
  gathering per-row weights, BGMV-style, or looping over slots);
- larger steps (prefill chunks): per slot in the step, its rows are gathered and get
  y[rows, part] += (x[rows] @ A^T) @ (scale * B)^T for each part the adapter targets (the SGMV idea: one
  A product for the whole fused projection, one B product per part, at the adapter's own rank).
With `kernel=True` (the triton backend) every row's product comes from one gathered Triton launch per part
(engine/kernels/lora.py) over stacked slot weights, rows without an adapter skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from engine.model.llama import LlamaForCausalLM, ModelConfig

DENSE_MAX_ROWS = 32  # steps up to this many rows multiply every slot's weights, masked; larger ones loop over slots

# wrapper attribute -> the PEFT modules it fuses, in output order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def part_sizes(config: ModelConfig, fused: str) -> list[int]:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv_proj": [q, kv, kv], "o_proj": [config.hidden_size],
            "gate_up_proj": [config.intermediate_size] * 2, "down_proj": [config.hidden_size]}[fused]


@dataclass
class SlotWeights:
    """One adapter's weights for one wrapped projection: A of every targeted part stacked ([in, sum r]),
    and per part (output offset, size, columns of x @ A that feed it, (scale * B)^T [r, size])."""

    a: torch.Tensor
    parts: list[tuple[int, int, int, int, torch.Tensor]]


class LoRABatch:
    """Which rows of this step's flattened batch run under which slot (shared by every LoRALinear)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, row indices; None: every row)
        self.row_slots: torch.Tensor | None = None  # [T] slot per row, -1 for base rows
        self.dense = False  # this step multiplies every slot's weights, masked per row, instead of looping
        self.kernel = False
        self.num_slots = 0
        self._masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # (rank, parts, dtype) -> the mask

    def set(self, row_slots: list[int], device: torch.device) -> None:
        """row_slots: the slot of every row (-1: the base model)."""
        slots = sorted(set(row_slots) - {-1})
        if not slots:
            self.clear()
            return
        self._masks = {}
        self.row_slots = t = torch.tensor(row_slots, dtype=torch.int32 if self.kernel else torch.long, device=device)
        self.dense = not self.kernel and len(row_slots) <= DENSE_MAX_ROWS and len(slots) > 1
        if self.kernel or (len(slots) == 1 and -1 not in row_slots):  # kernel: no host sync (attach_lora made stacks)
            self.groups = [(s, None) for s in slots]
        else:  # the per-slot rows (the wrappers' path when the kernel or the dense weights are not there)
            self.groups = [(s, torch.nonzero(t == s).flatten()) for s in slots]

    def mask(self, rank: int, parts: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, parts * slots * rank]: 1 where a column belongs to the row's slot (dense path; once per step)."""
        m = self._masks.get((rank, parts, dtype))
        rows = self.row_slots
        if m is None and rows is not None:
            cols = torch.arange(parts * self.num_slots * rank, device=rows.device)
            slot_of = (cols % (self.num_slots * rank)) // rank
            m = self._masks[(rank, parts, dtype)] = (rows[:, None] == slot_of[None, :]).to(dtype)
        if m is None:
            raise RuntimeError("no rows set for this step")
        return m

    def clear(self) -> None:
        self.groups = []
        self.row_slots = None
        self.dense = False


class LoRALinear(nn.Module):
    """base(x) plus, for the rows of each slot in the step, that slot's LoRA product."""

    def __init__(self, base: nn.Module, batch: LoRABatch, sizes: list[int], num_slots: int):
        super().__init__()
        self.base = base
        self.batch = batch
        self.sizes = sizes
        self.slots: list[SlotWeights | None] = [None] * num_slots
        self.stacks: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # kernel path: per part (A, B) stacks
        self.dense_a: torch.Tensor | None = None  # dense path: [in, parts * slots * rank], part-major
        self.dense_b: list[torch.Tensor] = []  # per part: [slots * rank, part size]
        self.dense_rank = 0

    @property
    def weight(self) -> torch.Tensor:  # what code that inspects projections reads (dtype, shape)
        return cast(torch.Tensor, self.base.weight)

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.batch.groups:
            return y
        if self.batch.kernel and self.stacks is not None and self.batch.row_slots is not None:
            from engine.kernels.lora import lora_gathered_  # imported late: Triton's interpreter mode

            off = 0
            for (a, b), size in zip(self.stacks, self.sizes, strict=True):
                lora_gathered_(y[:, off:off + size], x, a, b, self.batch.row_slots)
                off += size
            return y
        if self.batch.dense and self.dense_a is not None:
            xa = x @ self.dense_a
            xa *= self.batch.mask(self.dense_rank, len(self.sizes), xa.dtype)
            width, off = len(self.slots) * self.dense_rank, 0
            for i, (b, size) in enumerate(zip(self.dense_b, self.sizes, strict=True)):
                y[:, off:off + size].addmm_(xa[:, i * width:(i + 1) * width], b)
                off += size
            return y
        for slot, rows in self.batch.groups:
            w = self.slots[slot]
            if w is None:
                continue  # this adapter does not target this projection
            xs = x if rows is None else x.index_select(0, rows)
            xa = xs @ w.a
            for off, size, c0, c1, bt in w.parts:
                d = xa[:, c0:c1] @ bt
                if rows is None:
                    y[:, off:off + size] += d
                else:
                    y[:, off:off + size].index_add_(0, rows, d)
        return y

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put an adapter's (A [r, in], scaled B [out, r]) per part (None: not targeted) into slot."""
        a_cols, out, off, col = [], [], 0, 0
        for pair, size in zip(parts, self.sizes, strict=True):
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                a_cols.append(a)
                out.append((off, size, col, col + r, b.t().contiguous()))
                col += r
            off += size
        self.slots[slot] = SlotWeights(torch.cat(a_cols).t().contiguous(), out) if a_cols else None
        if self.dense_a is not None:
            self._clear_dense(slot)
            rank = self.dense_rank
            for i, pair in enumerate(parts):
                if pair is not None:
                    a, b = pair
                    c = (i * len(self.slots) + slot) * rank
                    self.dense_a[:, c:c + a.shape[0]].copy_(a.t())
                    self.dense_b[i][slot * rank:slot * rank + a.shape[0]].copy_(b.t())
        if self.stacks is not None:
            for (a_stack, b_stack), pair in zip(self.stacks, parts, strict=True):
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                if pair is not None:
                    a, b = pair
                    a_stack[slot, :a.shape[0]].copy_(a)
                    b_stack[slot, :, :a.shape[0]].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.slots[slot] = None
        if self.dense_a is not None:
            self._clear_dense(slot)
        if self.stacks is not None:
            for a_stack, b_stack in self.stacks:
                a_stack[slot].zero_()
                b_stack[slot].zero_()

    def make_dense_stacks(self, max_rank: int, fan_in: int, dtype: torch.dtype, device: torch.device) -> None:
        """The dense path's weights: every slot's A and B, zero-padded to max_rank per part."""
        n = len(self.slots)
        self.dense_rank = max_rank
        self.dense_a = torch.zeros(fan_in, len(self.sizes) * n * max_rank, dtype=dtype, device=device)
        self.dense_b = [torch.zeros(n * max_rank, size, dtype=dtype, device=device) for size in self.sizes]

    def _clear_dense(self, slot: int) -> None:
        n, rank, a = len(self.slots), self.dense_rank, self.dense_a
        if a is None:
            return
        for i, b in enumerate(self.dense_b):
            a[:, (i * n + slot) * rank:(i * n + slot + 1) * rank].zero_()
            b[slot * rank:(slot + 1) * rank].zero_()

    def make_stacks(self, max_rank: int, fan_in: int, dtype: torch.dtype, device: torch.device) -> None:
        """The kernel path's zero-padded slot stacks: per part A [slots, max_rank, in], B [slots, size, max_rank]."""
        n = len(self.slots)
        self.stacks = [(torch.zeros(n, max_rank, fan_in, dtype=dtype, device=device),
                        torch.zeros(n, size, max_rank, dtype=dtype, device=device)) for size in self.sizes]


def lora_layers(model: LlamaForCausalLM) -> list[tuple[int, str, LoRALinear]]:
    """(layer index, fused name, wrapper) for every wrapped projection."""
    out = []
    for i, layer in enumerate(model.layers):
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            proj = getattr(owner, name)
            if isinstance(proj, LoRALinear):
                out.append((i, name, proj))
    return out


def attach_lora(model: LlamaForCausalLM, num_slots: int, max_rank: int, kernel: bool = False) -> LoRABatch:
    """Wrap the projections (after the load swapped in its fast layers) for num_slots adapters at once; the
    LoRABatch to set before each forward pass. On a model wrapped already (engines sharing one loaded model),
    the wrappers are rebuilt empty for this engine's slots."""
    batch = LoRABatch()
    batch.kernel = kernel
    batch.num_slots = num_slots
    cfg = model.config
    weight = model.embed_tokens.weight
    for layer in model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            proj = getattr(owner, name)
            base = proj.base if isinstance(proj, LoRALinear) else proj
            wrapper = LoRALinear(base, batch, part_sizes(cfg, name), num_slots)
            fan_in = cfg.intermediate_size if name == "down_proj" else (
                cfg.num_heads * cfg.head_dim if name == "o_proj" else cfg.hidden_size)
            if kernel:
                wrapper.make_stacks(max_rank, fan_in, weight.dtype, weight.device)
            else:
                wrapper.make_dense_stacks(max_rank, fan_in, weight.dtype, weight.device)
            setattr(owner, name, wrapper)
    return batch
