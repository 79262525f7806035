"""CUDA graphs for decode steps: capture the model's forward once per batch size, replay it.

A decode step launches hundreds of small kernels; at small batch the GPU waits on the CPU
launching them. A graph replays the whole forward in one launch. Graphs freeze pointers
and shapes, so every input lives in a static buffer that `run` overwrites in place, and a
batch of n runs in the smallest captured size >= n, padded with rows that write nothing
(slot -1) and attend to one key. Only the Triton backend is graph-safe (the torch one
syncs to the host). Kernel arguments are frozen too: the graphs are captured with
max_seqlen_k = the longest context they will ever see, which only picks the split-KV count.

Usage (model runner, CUDA only):
    graphs = DecodeGraphs(model.forward, [1, 2, 4, 8, 16, 32, 64], max_blocks_per_seq, max_model_len, device)
    graphs.capture()                        # after the KV cache is assigned to the layers
    if graphs.can_run(context): hidden = graphs.run(input_ids, positions, context)
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from kiln.engine.context import Context, reset_context, set_context

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    def __init__(self, forward: Forward, batch_sizes: Sequence[int], max_blocks_per_seq: int,
                 max_seqlen_k: int, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
        self.forward, self.max_seqlen_k = forward, max_seqlen_k
        self.batch_sizes = sorted(set(batch_sizes))
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token each
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _context(self, bs: int) -> Context:
        return Context(cu_seqlens_q=self.cu_seqlens_q[:bs + 1], seq_lens=self.seq_lens[:bs], max_seqlen_q=1,
                       max_seqlen_k=self.max_seqlen_k, slot_mapping=self.slot_mapping[:bs],
                       block_tables=self.block_tables[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the largest size first so smaller graphs reuse its memory pool."""
        pool = None
        try:
            for bs in reversed(self.batch_sizes):
                set_context(self._context(bs))
                self.forward(self.input_ids[:bs], self.positions[:bs])  # compile kernels outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(self.input_ids[:bs], self.positions[:bs])
                pool = graph.pool()
                self.graphs[bs] = (graph, out)
        finally:
            reset_context()

    def can_run(self, context: Context) -> bool:
        """Decode-only steps that fit a captured size and the captured context length."""
        return (context.max_seqlen_q == 1 and context.seq_lens.shape[0] <= self.batch_sizes[-1]
                and context.max_seqlen_k <= self.max_seqlen_k
                and context.block_tables.shape[1] <= self.block_tables.shape[1] and bool(self.graphs))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """Replay the graph for this decode step; returns the hidden states [n, hidden]."""
        n = input_ids.shape[0]
        bs = next(size for size in self.batch_sizes if size >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(context.slot_mapping)
        self.seq_lens[:n].copy_(context.seq_lens)
        self.block_tables[:n, :context.block_tables.shape[1]].copy_(context.block_tables)
        # Padding rows: position 0, write nothing, attend to one key of block 0.
        self.positions[n:bs].zero_()
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[n:bs].zero_()
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
