"""Projections that add each row's LoRA product to the base output: the BGMV/SGMV idea on CPU and GPU.

`attach_lora(model, num_slots)` wraps the four projections of every decoder layer (fused qkv, o, fused
gate/up, down), whatever implementation the load swapped in (plain, oneDNN, packed 4-bit, Triton glue),
in a `LoRALinear`. All wrappers share one `LoRABatch`: before each forward pass the engine sets which
rows of the flattened batch run under which slot. A step with no adapter rows takes the base path
unchanged (one attribute test per projection). Every slot's weights are held once, stacked and
zero-padded to the largest rank; otherwise:
every slot's A stacked (`dense_at [parts, slots, rank, in]`, zero-padded to the largest rank) and, per part,
every slot's scaled B^T (`dense_b[part] [slots * rank, part size]`).
- Where the fused CPU kernels are built (engine/kernels/lora_ops.cpp): the rows of slots with at most
  FUSED_MAX_SLOT_ROWS rows in the step (decodes, short prefills; in mixed steps too) in one call per
  projection, each row with its own slot's weights (rows grouped by slot, only the adapter's rank read);
  a slot's longer run of rows (a prefill chunk) in matmuls, as below.
- Without them, steps of up to DENSE_MAX_ROWS rows with several adapters: x @ dense_at viewed [in, parts *
  slots * rank] gives every row its product with every slot's A, a per-row mask keeps its own slot's
  columns (none for base rows), and one matmul per part adds its own B;
- otherwise, per slot, its rows are gathered and get
  y[rows, part] += (x[rows] @ A^T) @ (scale * B)^T for each part the adapter targets, at the adapter's own
  rank (the SGMV idea: a slot's rows in a few large matmuls).
With `kernel=True` (the triton backend) every row's product comes from one gathered Triton launch per part
(engine/kernels/lora.py) over stacked slot weights, rows without an adapter skipped.
"""

from __future__ import annotations

from collections import Counter
from typing import cast

import torch
from torch import nn

from engine.kernels import cpu_ops
from engine.kernels.lora_shapes import LORA_PROJECTIONS, fan_in, part_sizes  # noqa: F401 - re-exported
from engine.model.llama import LlamaForCausalLM

DENSE_MAX_ROWS = 32  # torch: steps up to this many rows multiply every slot's weights, masked; larger ones loop
FUSED_MAX_SLOT_ROWS = 512  # fused CPU kernel: a slot with up to this many rows in the step; a longer run, matmuls
# (the kernel measured 1.6-5x faster than them for 16-200 rows of one slot, bf16, rank 16, on a 2-core Zen 4)

# wrapper attribute -> the PEFT modules it fuses, in output order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRABatch:
    """Which rows of this step's flattened batch run under which slot (shared by every LoRALinear)."""

    def __init__(self) -> None:
        self.active = False  # some row of the step runs under an adapter
        self.groups: list[tuple[int, torch.Tensor | slice]] = []  # matmul path: (slot, its rows: indices or a range)
        self.row_slots: torch.Tensor | None = None  # [T] slot per row, -1 for base rows
        self.fused_rows: torch.Tensor | None = None  # fused CPU kernel: [T] slot per row it serves, -1 for the rest
        self.dense = False  # this step multiplies every slot's weights, masked per row, instead of looping
        self.kernel = False
        self.cpu_kernel = False  # the fused CPU kernels are loaded
        self._masks: dict[tuple[int, int, int, torch.dtype], torch.Tensor] = {}  # (slots, rank, parts, dtype) -> mask

    def set(self, row_slots: list[int], device: torch.device) -> None:
        """row_slots: the slot of every row (-1: the base model)."""
        slots = sorted(set(row_slots) - {-1})
        if not slots:
            self.clear()
            return
        self.active = True
        self._masks = {}
        self.row_slots = t = torch.tensor(row_slots, dtype=torch.int32 if self.kernel else torch.long, device=device)
        self.fused_rows, self.dense = None, False
        if self.kernel:  # no host sync (attach_lora made stacks)
            self.groups = [(s, slice(None)) for s in slots]
            return
        loop = slots
        if self.cpu_kernel:  # slots with few rows (decodes) in the kernel, a slot's long prefill chunk in matmuls
            counts = Counter(row_slots)
            loop = [s for s in slots if counts[s] > FUSED_MAX_SLOT_ROWS]
            if len(loop) < len(slots):
                self.fused_rows = t if not loop else torch.tensor(
                    [-1 if s in loop else s for s in row_slots], dtype=torch.long, device=device)
        else:
            self.dense = len(row_slots) <= DENSE_MAX_ROWS and len(slots) > 1
            loop = [] if self.dense else slots
        self.groups = [(s, _rows_of(row_slots, s, t)) for s in loop]

    def mask(self, slots: int, rank: int, parts: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, parts * slots * rank]: 1 where a column belongs to the row's slot (dense path; once per step)."""
        m = self._masks.get((slots, rank, parts, dtype))
        rows = self.row_slots
        if m is None and rows is not None:
            cols = torch.arange(parts * slots * rank, device=rows.device)
            slot_of = (cols % (slots * rank)) // rank
            m = self._masks[(slots, rank, parts, dtype)] = (rows[:, None] == slot_of[None, :]).to(dtype)
        if m is None:
            raise RuntimeError("no rows set for this step")
        return m

    def clear(self) -> None:
        self.active = self.dense = False
        self.groups = []
        self.row_slots = self.fused_rows = None


def _rows_of(row_slots: list[int], slot: int, t: torch.Tensor) -> torch.Tensor | slice:
    """The rows of a slot: a range where they are consecutive (a prefill chunk: no gather), else their indices."""
    first = row_slots.index(slot)
    n = row_slots.count(slot)
    if row_slots[first:first + n].count(slot) == n:
        return slice(first, first + n)
    return torch.nonzero(t == slot).flatten()


class LoRALinear(nn.Module):
    """base(x) plus, for the rows of each slot in the step, that slot's LoRA product."""

    def __init__(self, base: nn.Module, batch: LoRABatch, sizes: list[int], fan_in: int, num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.batch = batch
        self.sizes = sizes
        self.num_slots = num_slots
        self.slot_ranks: list[list[int]] = [[0] * len(sizes) for _ in range(num_slots)]  # per slot, per part (0: none)
        self.stacks: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # kernel path: per part (A, B) stacks
        self.dense_at: torch.Tensor | None = None  # dense and fused paths: [parts, slots, rank, in]
        self.dense_b: list[torch.Tensor] = []  # per part: [slots * rank, part size]
        self.dense_rank = 0
        self.ranks: torch.Tensor | None = None  # fused path: slot_ranks as an int64 tensor [slots, parts]
        if batch.kernel:
            self._make_stacks(max_rank, fan_in, dtype, device)
        else:
            self._make_dense_stacks(max_rank, fan_in, dtype, device)

    @property
    def weight(self) -> torch.Tensor:  # what code that inspects projections reads (dtype, shape)
        return cast(torch.Tensor, self.base.weight)

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.batch.active:
            return y
        if self.batch.kernel and self.stacks is not None and self.batch.row_slots is not None:
            from engine.kernels.lora import lora_gathered_  # imported late: Triton's interpreter mode

            off = 0
            for (a, b), size in zip(self.stacks, self.sizes, strict=True):
                lora_gathered_(y[:, off:off + size], x, a, b, self.batch.row_slots)
                off += size
            return y
        if self.batch.fused_rows is not None and self.dense_at is not None:
            cpu_ops.ops().lora_add_(y, x.contiguous(), self.dense_at, self.dense_b, self.ranks, self.batch.fused_rows)
        if self.batch.dense and self.dense_at is not None:
            xa = x @ self.dense_at.view(-1, self.dense_at.shape[-1]).t()
            xa *= self.batch.mask(self.num_slots, self.dense_rank, len(self.sizes), xa.dtype)
            width, off = self.num_slots * self.dense_rank, 0
            for i, (b, size) in enumerate(zip(self.dense_b, self.sizes, strict=True)):
                y[:, off:off + size].addmm_(xa[:, i * width:(i + 1) * width], b)
                off += size
            return y
        at, rank = self.dense_at, self.dense_rank
        if at is None:
            raise RuntimeError("LoRA weights were not stacked (attach_lora)")
        for slot, rows in self.batch.groups:
            ranks = self.slot_ranks[slot]
            if not any(ranks):
                continue  # this adapter does not target this projection
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            off = 0
            for part, (size, r) in enumerate(zip(self.sizes, ranks, strict=True)):
                if r:
                    d = (xs @ at[part, slot, :r].t()) @ self.dense_b[part][slot * rank:slot * rank + r]
                    if isinstance(rows, slice):
                        y[rows, off:off + size] += d
                    else:
                        y[:, off:off + size].index_add_(0, rows, d)
                off += size
        return y

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put an adapter's (A [r, in], scaled B [out, r]) per part (None: not targeted) into slot."""
        self.clear_slot(slot)
        ranks = self.slot_ranks[slot]
        for i, pair in enumerate(parts):
            if pair is None:
                continue
            a, b = pair
            r = ranks[i] = a.shape[0]
            if self.dense_at is not None and self.ranks is not None:
                self.dense_at[i, slot, :r].copy_(a)
                self.dense_b[i][slot * self.dense_rank:slot * self.dense_rank + r].copy_(b.t())
                self.ranks[slot, i] = r
            if self.stacks is not None:
                a_stack, b_stack = self.stacks[i]
                a_stack[slot, :r].copy_(a)
                b_stack[slot, :, :r].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.slot_ranks[slot] = [0] * len(self.sizes)
        if self.dense_at is not None:
            self._clear_dense(slot)
        if self.stacks is not None:
            for a_stack, b_stack in self.stacks:
                a_stack[slot].zero_()
                b_stack[slot].zero_()

    def _make_dense_stacks(self, max_rank: int, fan_in: int, dtype: torch.dtype, device: torch.device) -> None:
        """The dense path's weights: every slot's A and B, zero-padded to max_rank per part."""
        n = self.num_slots
        self.dense_rank = max_rank
        self.dense_at = torch.zeros(len(self.sizes), n, max_rank, fan_in, dtype=dtype, device=device)
        self.dense_b = [torch.zeros(n * max_rank, size, dtype=dtype, device=device) for size in self.sizes]
        self.ranks = torch.zeros(n, len(self.sizes), dtype=torch.long)

    def _clear_dense(self, slot: int) -> None:
        rank, at = self.dense_rank, self.dense_at
        if at is None or self.ranks is None:
            return
        at[:, slot].zero_()
        self.ranks[slot].zero_()
        for b in self.dense_b:
            b[slot * rank:(slot + 1) * rank].zero_()

    def _make_stacks(self, max_rank: int, fan_in: int, dtype: torch.dtype, device: torch.device) -> None:
        """The kernel path's zero-padded slot stacks: per part A [slots, max_rank, in], B [slots, size, max_rank]."""
        n = self.num_slots
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


def attach_lora(model: LlamaForCausalLM, num_slots: int, max_rank: int, kernel: bool = False,
                cpu_kernel: bool = False) -> LoRABatch:
    """Wrap the projections (after the load swapped in its fast layers) for num_slots adapters at once; the
    LoRABatch to set before each forward pass. kernel: the Triton path; cpu_kernel: decode steps run the fused
    CPU kernel (loaded already). On a model wrapped already (engines sharing one loaded model), the wrappers
    are rebuilt empty for this engine's slots."""
    batch = LoRABatch()
    batch.kernel = kernel
    batch.cpu_kernel = cpu_kernel and not kernel
    cfg = model.config
    weight = model.embed_tokens.weight
    for layer in model.layers:
        for name in LORA_PROJECTIONS:
            owner = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
            proj = getattr(owner, name)
            base = proj.base if isinstance(proj, LoRALinear) else proj
            wrapper = LoRALinear(base, batch, part_sizes(cfg, name), fan_in(cfg, name), num_slots, max_rank,
                                 weight.dtype, weight.device)
            setattr(owner, name, wrapper)
    return batch
