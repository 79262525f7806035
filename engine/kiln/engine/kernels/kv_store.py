"""KV store: scatter each new token's K/V into its pool slot (slot -1 = skip).

Slots come from the model runner (block_id * block_size + offset); -1 marks tokens whose
K/V must not be written, e.g. padding in a CUDA-graph batch or prefix-cache hits.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + slot * stride_kc_slot + offs_h[:, None] * stride_kc_h + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc_slot + offs_h[:, None] * stride_vc_h + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    if k.shape != v.shape or k.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"store_kvcache wants k, v [N,Hkv,D] and caches [blocks,block_size,Hkv,D]; got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"store_kvcache shape mismatch: k {tuple(k.shape)}, cache {tuple(k_cache.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)}")


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k, v [N,Hkv,D] into caches [blocks,block_size,Hkv,D] at slot_mapping [N]."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("store_kvcache needs the head dim contiguous")
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1) or \
            v_cache.stride(0) != v_cache.shape[1] * v_cache.stride(1):
        raise ValueError("store_kvcache needs each cache's blocks laid out slot after slot")
    _, num_heads, head_dim = k.shape
    _store_kvcache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Pure-torch reference of store_kvcache."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)
