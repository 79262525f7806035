// bf16 GEMM for the few rows of a decode step: y[M, N] = x[M, K] W[N, K]^T (+ b), with AVX512-BF16
// dot products (vdpbf16ps: bf16 pairs multiplied, summed in fp32). At batch 1 a decode step reads
// every weight once and does two FLOPs per weight, so its speed is the memory's: torch's bf16 GEMM
// (oneDNN) reaches ~10 GB/s of a core's ~27 there, this loop ~20 (bench/linear_cpu.py). Larger
// batches are matrix products, which torch's GEMM does well; the Python side (cpu_kernels.py) sends
// only M <= a measured bound here.
//
// Blocking: 4 weight rows at a time, each row's 32-element chunks read once and multiplied by up
// to 4 rows of x held in registers (16 accumulators); the 4 weight rows (<= 4 x K x 2 bytes) stay
// in L1 while the next tile of x rows runs over them. Threads split the weight rows.
// Built without AVX512-BF16 (-march=native on a CPU without it) the op reports itself unsupported.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <cstdint>
#include <optional>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

bool supported() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512BF16__
inline __m512bh load(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// out[m] = x[m] . w for MR rows of x. The weight row is read once, front to back: one sequential
// stream over the whole matrix, which the hardware prefetchers follow (reading 4 rows side by side
// ran at half the speed). Two accumulators per x row hide the dot product's latency.
template <int MR>
void dot_row(const uint16_t* const* x, const uint16_t* w, int64_t K, float* out) {
  __m512 acc0[MR], acc1[MR];
  for (int m = 0; m < MR; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  const __mmask32 all = ~__mmask32(0);
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh w0 = load(w + k, all), w1 = load(w + k + 32, all);
    _mm_prefetch(reinterpret_cast<const char*>(w + k + 1024), _MM_HINT_T0);  // 2 KiB ahead: 2x at M=4
    for (int m = 0; m < MR; ++m) {
      acc0[m] = _mm512_dpbf16_ps(acc0[m], load(x[m] + k, all), w0);
      acc1[m] = _mm512_dpbf16_ps(acc1[m], load(x[m] + k + 32, all), w1);
    }
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? all : (__mmask32(1) << (K - k)) - 1;
    const __m512bh w0 = load(w + k, mask);
    for (int m = 0; m < MR; ++m) acc0[m] = _mm512_dpbf16_ps(acc0[m], load(x[m] + k, mask), w0);
  }
  for (int m = 0; m < MR; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
}

void run(const uint16_t* x, const uint16_t* w, const c10::BFloat16* bias, c10::BFloat16* y,
         int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    float out[4];
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* wn = w + n * K;
      const float b = bias ? static_cast<float>(bias[n]) : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {  // the row stays in L1 for the later tiles of x
        const int64_t mr = std::min<int64_t>(4, M - m0);
        const uint16_t* xr[4];
        for (int m = 0; m < mr; ++m) xr[m] = x + (m0 + m) * K;
        switch (mr) {
          case 1: dot_row<1>(xr, wn, K, out); break;
          case 2: dot_row<2>(xr, wn, K, out); break;
          case 3: dot_row<3>(xr, wn, K, out); break;
          default: dot_row<4>(xr, wn, K, out); break;
        }
        for (int64_t m = 0; m < mr; ++m) y[(m0 + m) * N + n] = c10::BFloat16(out[m] + b);  // RNE, as torch
      }
    }
  });
}
#endif

}  // namespace

namespace kiln_ops {

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "kiln::linear_bf16 was built for a CPU without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear_bf16: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "linear_bf16: bfloat16 x and weight expected");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_bf16: CPU tensors expected");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kBFloat16 && bias->numel() == weight.size(0)),
              "linear_bf16: a bfloat16 bias of N elements expected");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
#ifdef __AVX512BF16__
  run(reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()),
      reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>()),
      bias ? bc.data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(),
      x.size(0), weight.size(0), x.size(1));
#endif
  return y;
}

}  // namespace kiln_ops

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_bf16_supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_bf16", &kiln_ops::linear_bf16); }
