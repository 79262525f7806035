"""Triton kernels of the engine, each beside a pure-torch reference with the same signature.

paged_attention  unified paged attention (prefill, chunked prefill, decode; GQA; split-KV)
kv_store         scatter new K/V into the paged cache by slot
norm_rope        fused residual-add + RMSNorm; rotary embedding (neox / HF Llama)
quant_gemm       W8A16 (per-channel int8) and W4A16 (group-wise int4) dequant-GEMM
backend          get_backend(name, device): the engine's one switch, "torch" | "cpu" | "triton" ("auto" by device)
cuda_graphs      capture/replay of decode steps per batch size (CUDA only)
"""
from kiln.engine.kernels.backend import Backend, get_backend

__all__ = ["Backend", "get_backend"]
