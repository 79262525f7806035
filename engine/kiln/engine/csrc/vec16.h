// 16-float vectors for Kiln's CPU ops: GCC vector types, which the compiler keeps in registers
// (one AVX-512 register, or two AVX2 ones: the code is the same on both), with loads that widen
// bf16/fp16 and stores that round back as torch does.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace kiln_vec {

constexpr int64_t kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
// bf16 is the top half of an fp32: a shift the compiler vectorises (c10's conversion does not).
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(double x) { return static_cast<float>(x); }

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
template <typename T>
inline f32x16 load16(const T* p) {  // fp16, double
  f32x16 v;
  for (int t = 0; t < kLanes; ++t) v[t] = static_cast<float>(p[t]);
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
// Round to nearest even, NaN to the quiet NaN 0x7FC0: c10::BFloat16's rounding, 16 at a time.
inline void store16(c10::BFloat16* p, f32x16 v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const u32x16 out = v != v ? u32x16{} + 0x7FC0u : rounded;
  const u16x16 h = __builtin_convertvector(out, u16x16);
  std::memcpy(p, &h, sizeof h);
}
template <typename T>
inline void store16(T* p, f32x16 v) {  // fp16, double
  for (int t = 0; t < kLanes; ++t) p[t] = static_cast<T>(v[t]);
}

inline float hsum(f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

}  // namespace kiln_vec
