"""CUDA graphs of the decode forward pass, one per batch-size bucket (--cuda-graphs, off by default).

A decode step of n sequences replays the graph of the smallest bucket >= n: the persistent decode inputs
(engine/decode_inputs.py) are filled for rows 0..n-1 and padded with length-0 rows up to the bucket, and
the whole forward pass (positions and slots derived on the device, every layer, the output head) is one
replay. This needs a backend whose decode-only steps read nothing on the host: the triton backend.
Graphs are captured at start-up, largest bucket first, sharing one memory pool.

Off by default: it stays off until a GPU run (loadtest/gpu_check.sh) shows identical greedy tokens with
and without graphs. Nothing here has run on a GPU yet.
"""

from __future__ import annotations

import logging

import torch

from engine.decode_inputs import DecodeInputs

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def buckets_for(max_num_seqs: int) -> list[int]:
    """The capture sizes: the fixed ladder below max_num_seqs, and max_num_seqs itself."""
    return [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, kv_caches, backend, inputs: DecodeInputs):
        self.model, self.kv_caches, self.backend, self.inputs = model, kv_caches, backend, inputs
        self.buckets = buckets_for(inputs.max_num_seqs)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        """Capture every bucket (largest first); the decode inputs must hold only padding (length 0) rows."""
        pool = torch.cuda.graph_pool_handle()
        inp = self.inputs
        inp.seq_lens.zero_()
        for b in sorted(self.buckets, reverse=True):
            meta = inp.metadata(b, longest=0)
            for _ in range(2):  # compile and settle allocations outside the capture
                self._forward(b, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(b, meta)
            self._graphs[b] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs of the decode step for batch sizes %s", self.buckets)

    def _forward(self, b: int, meta) -> torch.Tensor:
        self.inputs.derive(b)
        return self.model(self.inputs.input_ids[:b], self.inputs.positions[:b], self.kv_caches, meta, self.backend)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n and b in self._graphs), None)

    def replay(self, n: int, bucket: int) -> torch.Tensor:
        """Logits [n, vocab] of the step whose inputs were filled (padded to `bucket`)."""
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[:n]
