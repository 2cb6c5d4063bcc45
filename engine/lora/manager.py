"""Which adapters the engine holds: in memory (up to --max-cpu-loras, least recently used dropped first) and
in the model's slots (up to --max-loras, the adapters one step can run).

`ensure_loaded(request)` reads an adapter the first time a request names it (LoRAError if it cannot be
served); `set_batch(scheduled)` gives every adapter of the step a slot (a free one, else the least recently
used one no row of this step needs) and tells the wrapped projections which rows run under which slot. The
scheduler admits no request whose adapter would make a step need more than --max-loras slots.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence as Seq

from engine.kernels import cpu_ops
from engine.lora.adapter import LoRAWeights, load_adapter
from engine.lora.layers import FUSED, attach_lora, lora_layers
from engine.lora.request import LoRARequest
from engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_cpu_loras: int, max_rank: int,
                 kernel: bool = False):
        self.model = model
        self.config = model.config
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        weight = model.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        cpu_kernel = not kernel and self.device.type == "cpu" and cpu_ops.load()
        self.batch = attach_lora(model, max_loras, max_rank, kernel, cpu_kernel)
        self.layers = lora_layers(model)
        self.cpu: OrderedDict[int, tuple[LoRARequest, LoRAWeights]] = OrderedDict()
        self.slots: list[int | None] = [None] * max_loras  # adapter id per slot
        self._slot_use: list[int] = [0] * max_loras  # step number of each slot's last use (LRU)
        self._steps = 0
        self.loads = 0  # adapters read from disk

    # ---- memory ------------------------------------------------------------------------------

    def ensure_loaded(self, request: LoRARequest) -> LoRAWeights:
        """The adapter's weights, read from its directory the first time (LoRAError names what is wrong)."""
        hit = self.cpu.get(request.id)
        if hit is not None:
            self.cpu.move_to_end(request.id)
            return hit[1]
        weights = load_adapter(request.path, self.config, self.max_rank, self.dtype)
        self.loads += 1
        self.cpu[request.id] = (request, weights)
        while len(self.cpu) > self.max_cpu_loras:
            old, (req, _) = self.cpu.popitem(last=False)
            logger.info("LoRA adapter %s left memory (--max-cpu-loras %d)", req.name, self.max_cpu_loras)
        logger.info("LoRA adapter %s loaded from %s (rank %d, %s; %.1f MiB)", request.name, request.path,
                    weights.rank, ", ".join(weights.modules), weights.nbytes / 2**20)
        return weights

    def remove(self, adapter_id: int) -> None:
        """Forget an unloaded adapter: out of memory and out of its slot (requests under it have finished)."""
        self.cpu.pop(adapter_id, None)
        for slot, held in enumerate(self.slots):
            if held == adapter_id:
                self.slots[slot] = None
                for _, _, layer in self.layers:
                    layer.clear_slot(slot)

    # ---- one step ----------------------------------------------------------------------------

    def set_batch(self, scheduled: Seq) -> None:
        """Slots for this step's adapters, and each row's slot, for the wrapped projections."""
        self._steps += 1
        row_slots: list[int] = []
        needed = {it.seq.lora.id for it in scheduled if it.seq.lora is not None}
        slot_of: dict[int, int] = {}
        for it in scheduled:
            lora = it.seq.lora
            if lora is None:
                row_slots.extend([-1] * it.num_new_tokens)
                continue
            slot = slot_of.get(lora.id)
            if slot is None:
                slot = slot_of[lora.id] = self._slot_for(lora, needed)
            row_slots.extend([slot] * it.num_new_tokens)
        self.batch.set(row_slots, self.device)

    def _slot_for(self, lora: LoRARequest, needed: set[int]) -> int:
        if lora.id in self.slots:
            slot = self.slots.index(lora.id)
        else:
            free = [s for s, held in enumerate(self.slots) if held is None or held not in needed]
            if not free:  # the scheduler keeps a step to max_loras adapters; this is a bug if it happens
                raise RuntimeError(f"a step needs more than --max-loras {self.max_loras} adapters")
            slot = min(free, key=lambda s: (self.slots[s] is not None, self._slot_use[s]))
            self._activate(slot, lora)
        self._slot_use[slot] = self._steps
        return slot

    def _activate(self, slot: int, lora: LoRARequest) -> None:
        weights = self.ensure_loaded(lora).tensors
        for i, fused, layer in self.layers:
            parts = []
            for module in FUSED[fused]:
                pair = weights.get((i, module))
                parts.append(None if pair is None else (pair[0].to(self.device), pair[1].to(self.device)))
            layer.set_slot(slot, parts)
        self.slots[slot] = lora.id

    @property
    def resident(self) -> list[str]:
        """Names of the adapters held in memory, most recently used last."""
        return [req.name for req, _ in self.cpu.values()]


def lora_manager(model: LlamaForCausalLM, args, backend_name: str) -> LoRAManager | None:
    """The engine's LoRAManager when LoRA is enabled (--enable-lora or --lora-modules), else None."""
    if not args.lora_enabled:
        return None
    return LoRAManager(model, args.max_loras, args.max_cpu_loras or args.max_loras, args.max_lora_rank,
                       kernel=backend_name == "triton")  # the Triton kernel (in its interpreter on CPU: tests)
