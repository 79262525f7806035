// Fused residual-add + RMSNorm, in-place RoPE and the KV-cache store for the CPU. At decode a
// layer's norm is nine small torch ops, its RoPE about fifteen and its store ten, each a few
// microseconds of dispatch for a few hundred numbers: one call each here. They round as the references do (kiln/engine/kernels/norm_rope.py,
// rms_norm_ref and rope_ref): the residual sum and the normalised row are rounded to x's dtype
// (HF's LlamaRMSNorm), RoPE runs in fp32 and rounds once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>

#include "vec16.h"

namespace {

using namespace kiln_vec;

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }  // c10::BFloat16 rounds to nearest even

// One row: the residual sum rounded to T (as torch's add_), the squares summed in 16 lanes, the
// normalised row rounded to T before the weight multiplies it (HF's LlamaRMSNorm).
template <typename T>
void norm_row(T* row, const T* residual, const T* weight, T* out, int64_t h, float eps) {
  f32x16 squares = {};
  float tail = 0.f;
  int64_t i = 0;
  for (; i + kLanes <= h; i += kLanes) {
    if (residual) store16(row + i, load16(row + i) + load16(residual + i));
    const f32x16 v = load16(row + i);
    squares += v * v;
  }
  for (; i < h; ++i) {
    if (residual) row[i] = round_to<T>(to_float(row[i]) + to_float(residual[i]));
    tail += to_float(row[i]) * to_float(row[i]);
  }
  const float rstd = 1.f / std::sqrt((hsum(squares) + tail) / static_cast<float>(h) + eps);
  for (i = 0; i + kLanes <= h; i += kLanes) {
    T normed[kLanes];
    store16(normed, load16(row + i) * rstd);
    store16(out + i, load16(normed) * load16(weight + i));
  }
  for (; i < h; ++i) out[i] = round_to<T>(to_float(round_to<T>(to_float(row[i]) * rstd)) * to_float(weight[i]));
}

template <typename T>
void norm_rows(T* x, const T* residual, const T* weight, T* out, int64_t n, int64_t h, float eps) {
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(x + r * h, residual ? residual + r * h : nullptr, weight, out + r * h, h, eps);
  });
}

}  // namespace

namespace kiln_ops {

// (norm(x + residual) * weight, x + residual), the sum written into x, as cpu_ops.rms_norm.
std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm: contiguous x [N, hidden] and weight [hidden] expected, got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x differ in dtype");
  TORCH_CHECK(!residual || (residual->sizes() == x.sizes() && residual->is_contiguous() &&
                            residual->scalar_type() == x.scalar_type()),
              "rms_norm: a contiguous residual like x expected");
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                        w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                        static_cast<float>(eps));
  });
  return {out, x};
}

// Rotates, in place, the first cos_sin.size(1) channels of every head of qk [N, heads, D] (rows
// may be strided, as a view into the fused qkv output; heads and channels contiguous), token i at
// positions[i] of the table cos_sin [P, R] (R/2 cosines, then R/2 sines): neox style, halves.
void rope_(at::Tensor qk, const at::Tensor& positions, const at::Tensor& cos_sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "rope_: qk [N, heads, D] with contiguous heads expected, got ", qk.sizes());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == qk.size(0) && positions.scalar_type() == at::kLong,
              "rope_: int64 positions [N] expected");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) % 2 == 0 && cos_sin.size(1) <= qk.size(2) &&
              cos_sin.scalar_type() == qk.scalar_type(), "rope_: a table [P, R <= D] in qk's dtype expected");
  const at::Tensor table = cos_sin.contiguous(), pos = positions.contiguous();
  const int64_t n = qk.size(0), heads = qk.size(1), row_stride = qk.stride(0), rot = table.size(1);
  const int64_t half = rot / 2, max_pos = table.size(0);
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < max_pos, "rope_: position ", p[i], " outside the table of ", max_pos);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rope_", [&] {
    scalar_t* base = qk.data_ptr<scalar_t>();
    const scalar_t* cs = table.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* cos = cs + p[t] * rot;
        const scalar_t* sin = cos + half;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* x = base + t * row_stride + h * qk.size(2);
          for (int64_t j = 0; j < half; ++j) {
            const float x1 = static_cast<float>(x[j]), x2 = static_cast<float>(x[j + half]);
            const float c = static_cast<float>(cos[j]), s = static_cast<float>(sin[j]);
            x[j] = round_to<scalar_t>(x1 * c - x2 * s);
            x[j + half] = round_to<scalar_t>(x2 * c + x1 * s);
          }
        }
      }
    });
  });
}

// Writes k, v [N, Hkv, D] (rows may be strided, as views into the fused qkv output) into the caches
// [blocks, block_size, Hkv, D] at slot_mapping [N]: what attention.write_kvcache does with views and
// two index_copy_ calls. The step has dropped slots < 0 already; a slot outside the pool is an error.
void store_kvcache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "store_kvcache: k, v [N, Hkv, D] and caches [blocks, block_size, Hkv, D] expected, got ", k.sizes(),
              " and ", k_cache.sizes());
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(), "store_kvcache: k, v and the caches differ in dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kvcache: contiguous caches expected");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "store_kvcache: k and v with contiguous head_dim expected");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) && slot_mapping.scalar_type() == at::kLong,
              "store_kvcache: int64 slot_mapping [N] expected");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t n = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "store_kvcache: slot ", sp[i], " outside the pool of ", num_slots);
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  // Rows (and heads within them) may be strided, as views into the fused qkv output or a tensor-
  // parallel rank's slice of it: one copy of head_dim elements per (token, head).
  const int64_t heads = k.size(1), head_bytes = k.size(2) * k.element_size(), e = k.element_size();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + sp[i] * row_bytes + h * head_bytes, kp + (i * k.stride(0) + h * k.stride(1)) * e, head_bytes);
      std::memcpy(vc + sp[i] * row_bytes + h * head_bytes, vp + (i * v.stride(0) + h * v.stride(1)) * e, head_bytes);
    }
}

}  // namespace kiln_ops

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("rms_norm(Tensor(a!) x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor(a!))");
  m.def("rope_(Tensor(a!) qk, Tensor positions, Tensor cos_sin) -> ()");
  m.def("store_kvcache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("rms_norm", &kiln_ops::rms_norm);
  m.impl("rope_", &kiln_ops::rope_);
  m.impl("store_kvcache", &kiln_ops::store_kvcache);
}
