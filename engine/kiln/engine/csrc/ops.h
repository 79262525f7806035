// The entry points of Kiln's CPU ops that other ops of the library call directly (decoder_cpu.cpp
// runs a decode step's layers in one call): one definition each, in its own file.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace kiln_ops {

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual);
void rope_(at::Tensor qk, const at::Tensor& positions, const at::Tensor& cos_sin);
void store_kvcache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale, int64_t partition_size,
                           int64_t max_q_len);

}  // namespace kiln_ops
