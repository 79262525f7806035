// A decode step's decoder layers in one call: what LlamaDecoderLayer.forward does per layer
// (norm, qkv GEMM, RoPE, KV store, paged attention, o GEMM, norm, gate/up GEMM, SiLU * up, down
// GEMM), with the same ops, so the results are the same bits. From Python each layer is some forty
// module calls and op dispatches: 4-5 ms of a ~20 ms batch-1 step on 2 cores, gone here, and the GIL
// is free for the server's event loop for the whole stack (kiln/engine/cpu_decoder.py says when
// this runs: plain bf16/fp32 weights, a float cache, every sequence's query rows on the op).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

// The weights of one layer in the order decoder_layers takes them.
enum { kInNorm, kQkv, kO, kPostNorm, kGateUp, kDown, kPerLayer };
// And the GEMM weights in oneDNN's packed layout, when given.
enum { kPackedQkv, kPackedO, kPackedGateUp, kPackedDown, kPackedPerLayer };

// cpu_kernels.linear: Kiln's bf16 op up to max_rows rows, oneDNN's GEMM on the packed weight above
// (when packed weights are given), else torch's.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* packed, int64_t max_rows) {
  if (x.size(0) <= max_rows) return kiln_ops::linear_bf16(x, weight, std::nullopt);
  if (packed != nullptr) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, *packed, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), std::string("")};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::linear(x, weight);
}

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, at::TensorList weights, at::TensorList packed, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& positions, const at::Tensor& cos_sin, const at::Tensor& slot_mapping,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_tables,
    int64_t num_heads, int64_t num_kv_heads, double eps, double scale, int64_t max_rows) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0, "decoder_layers: at least one layer (a K and V cache) expected");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer && v_caches.size() == k_caches.size(),
              "decoder_layers: ", kPerLayer, " weights and a K and V cache per layer expected, got ", weights.size(),
              " weights for ", layers, " layers");
  TORCH_CHECK(packed.empty() || static_cast<int64_t>(packed.size()) == layers * kPackedPerLayer,
              "decoder_layers: no packed weights or ", kPackedPerLayer, " per layer expected");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layers: contiguous x [N, hidden] expected");
  const int64_t n = x.size(0), head_dim = k_caches[0].size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor h = x;
  std::optional<at::Tensor> residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    const at::Tensor* p = packed.empty() ? nullptr : packed.data() + l * kPackedPerLayer;
    auto [normed, summed] = kiln_ops::rms_norm(h, w[kInNorm], eps, residual);
    residual = summed;  // without a residual (layer 0) this is h itself, as in LlamaDecoderLayer
    const at::Tensor qkv = linear(normed, w[kQkv], p ? p + kPackedQkv : nullptr, max_rows);
    const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({n, num_heads + num_kv_heads, head_dim});
    kiln_ops::rope_(qk, positions, cos_sin);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, head_dim});
    kiln_ops::store_kvcache(qk.narrow(1, num_heads, num_kv_heads), v, k_caches[l], v_caches[l], slot_mapping);
    const at::Tensor o = kiln_ops::paged_attention(qk.narrow(1, 0, num_heads), k_caches[l], v_caches[l],
                                                   cu_seqlens_q, seq_lens, block_tables, scale, 0, 0);
    h = linear(o.view({n, q_size}), w[kO], p ? p + kPackedO : nullptr, max_rows);
    std::tie(normed, summed) = kiln_ops::rms_norm(h, w[kPostNorm], eps, residual);
    residual = summed;
    const at::Tensor gate_up = linear(normed, w[kGateUp], p ? p + kPackedGateUp : nullptr, max_rows);
    const int64_t inter = gate_up.size(1) / 2;
    at::Tensor gate = gate_up.narrow(1, 0, inter);
    at::silu_(gate).mul_(gate_up.narrow(1, inter, inter));
    h = linear(gate, w[kDown], p ? p + kPackedDown : nullptr, max_rows);
  }
  return {h, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("decoder_layers(Tensor x, Tensor[] weights, Tensor[] packed, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor positions, Tensor cos_sin, Tensor slot_mapping, Tensor cu_seqlens_q, Tensor seq_lens, "
        "Tensor block_tables, int num_heads, int num_kv_heads, float eps, float scale, int max_rows) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
// oneDNN's packed weights are tensors of their own backend: a call that passes them dispatches there.
TORCH_LIBRARY_IMPL(kiln, MkldnnCPU, m) { m.impl("decoder_layers", &decoder_layers); }
