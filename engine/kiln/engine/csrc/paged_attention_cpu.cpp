// Fused paged attention for the CPU: one call per layer reads K/V straight from the block pool
// through the block tables, for decodes and chunked prefills over the cache in one varlen batch.
// The torch path (kiln/engine/attention.py) gathers every sequence's K/V padded to the longest
// context and calls SDPA; this op gathers nothing and pads nothing.
//
// Layout (the same as the Triton kernel, kiln/engine/kernels/paged_attention.py):
//   q [N, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; cu_seqlens_q int32 [B+1];
//   seq_lens int32 [B]; block_tables int32 [B, max_blocks]. Query token i of sequence b sits at
//   position seq_lens[b] - q_len_b + i and attends to keys 0..that position.
//
// Work is cut into items of (sequence, tile of query tokens, context split), all KV heads each:
//  - an item reads each cache block whole, one contiguous stream for every head (a pass per head
//    read a third of every key's row and ran ~1.7x slower);
//  - the query heads of a GQA group share each K/V row, widened from bf16 in registers: their
//    scores, and then their output rows, are summed in registers over a block's keys
//    (attend_keys), 16 floats to a vector (vec16.h);
//  - softmax is online (running max and sum in fp32), so no score matrix is ever materialised;
//  - when there are fewer (sequence, tile) pairs than threads (decode at small batch, long
//    contexts), the context is split so every thread gets work; each split leaves its
//    unnormalised output, max and sum in a scratch buffer, and a second pass merges them.
// Sequences with more than max_q_len query tokens (when > 0) are left out, their rows unwritten:
// a long prefill chunk is a matrix product, which SDPA's GEMMs do ~2x faster than these per-row
// loops (bench/cpu_attention.py), so the Python wrapper gives those to SDPA.
// Items run on OpenMP threads (torch's libgomp; as many as torch.get_num_threads()), pulled
// dynamically because their lengths differ.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace {

using namespace kiln_vec;

constexpr int64_t kMaxTileRows = 64;  // token x group-head rows per KV head and item

// e^x for x <= 0 (scores minus the running max), 16 at a time (std::exp is a scalar libm call, one
// per query head and key at decode): 2^n * e^r, |r| <= ln2/2, with Cephes' polynomial, within 2
// ulp of expf. Below x = -87 it gives ~1e-38, not 0: nothing beside e^0 = 1.
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 lowest = f32x16{} - 87.f, round = f32x16{} + 12582912.f;  // 1.5 * 2^23 rounds to an integer
  x = x < lowest ? lowest : x;
  const f32x16 n = (x * 1.44269504088896341f + round) - round;
  const f32x16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The lane sums of 16 vectors as one vector, lane j = sum of p[j]: a tree of shuffles and adds
// (each level halves the vectors and the lanes per input), ~3 operations a vector where a
// separate sum of each vector's lanes takes ~8.
inline f32x16 sum_lanes16(const f32x16* p) {
  f32x16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Query rows summed in registers at once: R rows of C vectors each (R*C accumulators, C for a K or
// V row: within AVX-512's 32 registers).
template <int C>
constexpr int kRows = C >= 12 ? 1 : 12 / C;

// Up to 16 keys (n) for `rows` (<= R) query rows of one KV head and one token: q and acc hold rows
// of C * 16 floats, (m, l) the rows' running max and sum. K/V key j at k + j * stride. Loops over R
// are unrolled, so the arrays live in registers (but the scores' partial sums: 16 per row).
template <int C, typename T>
void attend_keys(const float* q, int rows, const T* k, const T* v, int64_t stride, int64_t n, float* acc,
                 float* m, float* l) {
  constexpr int R = kRows<C>, D = C * kLanes;
  f32x16 qv[R][C], part[R][kLanes];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    if (r < rows)
      for (int c = 0; c < C; ++c) qv[r][c] = load16(q + r * D + c * kLanes);
  for (int64_t j = 0; j < kLanes; ++j) {
    f32x16 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = j < n ? load16(k + j * stride + c * kLanes) : f32x16{};
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      part[r][j] = qv[r][0] * kv[0];
      for (int c = 1; c < C; ++c) part[r][j] += qv[r][c] * kv[c];
    }
  }
  // Online softmax: the keys' numerators under the new max; what was summed under the old one is
  // rescaled by alpha (e^-inf: ~0 at the first keys).
  f32x16 lane = {};
  for (int t = 0; t < kLanes; ++t) lane[t] = static_cast<float>(t);
  const auto visible = lane < static_cast<float>(n);
  const f32x16 neg_inf = f32x16{} - std::numeric_limits<float>::infinity();
  f32x16 p[R];
  float alpha[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (r >= rows) break;
    const f32x16 scores = visible ? sum_lanes16(part[r]) : neg_inf;
    float mx = m[r];
    for (int t = 0; t < kLanes; ++t) mx = std::max(mx, scores[t]);
    alpha[r] = exp_nonpositive(f32x16{} + (m[r] - mx))[0];
    p[r] = exp_nonpositive(scores - mx);  // e^-inf = ~1e-38 past n: V rows there are zeros
    l[r] = l[r] * alpha[r] + hsum(visible ? p[r] : f32x16{});
    m[r] = mx;
  }
  f32x16 out[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    if (r < rows)
      for (int c = 0; c < C; ++c) out[r][c] = load16(acc + r * D + c * kLanes) * alpha[r];
  for (int64_t j = 0; j < n; ++j) {
    f32x16 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(v + j * stride + c * kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      for (int c = 0; c < C; ++c) out[r][c] += p[r][j] * vv[c];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    if (r < rows)
      for (int c = 0; c < C; ++c) store16(acc + r * D + c * kLanes, out[r][c]);
}

// The head sizes run() is instantiated for (paged_attention's switch; cpu_attention.HEAD_DIMS).
constexpr int64_t kHeadDims[] = {16, 32, 64, 96, 128};

struct Item {  // one (sequence, tile of query tokens, context split), all KV heads
  int64_t seq, tok0, ntok, key0, key1;
  int64_t slot;  // scratch slot of a split's partial result; -1 = the only split, write out directly
};

struct Group {  // a (sequence, tile) whose context was split: merged after all items ran
  int64_t seq, tok0, ntok, slot0, nsplits;
};

// An item's rows are its tile's query rows in q's order: row r = token r / Hq, query head r % Hq
// (KV head r % Hq / group), so a token's rows are one contiguous output row. D = C * 16.
template <typename T, int C>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* cu,
         const int32_t* lens, const int32_t* tables, int64_t table_stride, double scale,
         const std::vector<Item>& items, const std::vector<Group>& groups, int64_t widest_tile,
         at::Tensor& out) {
  constexpr int64_t d = C * kLanes;
  const int64_t hq = q.size(1), bs = k_cache.size(1), hkv = k_cache.size(2);
  const int64_t group = hq / hkv, rows_max = widest_tile * hq;
  const T* qp = q.data_ptr<T>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);  // q may be a view into the fused qkv
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t tok_stride = hkv * d, block_stride = bs * hkv * d;  // cache strides in elements
  // Scratch for split items: unnormalised output [slot, row, D] and (max, sum) [slot, row, 2].
  int64_t nslots = 0;
  for (const Group& g : groups) nslots += g.nsplits;
  std::vector<float> part(nslots * rows_max * d), stats(nslots * rows_max * 2);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int nthreads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(items.size())));

#pragma omp parallel num_threads(nthreads)
  {
    // Per-thread buffers, reused by every item the thread runs.
    std::vector<float> qf(rows_max * d), acc(rows_max * d), m(rows_max), l(rows_max);
#pragma omp for schedule(dynamic, 1)
    for (size_t it = 0; it < items.size(); ++it) {
      const Item& w = items[it];
      const int64_t q0 = cu[w.seq], first_pos = lens[w.seq] - (cu[w.seq + 1] - q0);
      const int64_t rows = w.ntok * hq;
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = qp + (q0 + w.tok0 + r / hq) * q_tok + (r % hq) * q_head;
        for (int64_t i = 0; i < d; ++i) qf[r * d + i] = to_float(src[i]) * static_cast<float>(scale);
      }
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      std::fill(m.begin(), m.begin() + rows, neg_inf);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      // key0 is a multiple of block_size, so each step covers (part of) one cache block.
      for (int64_t k0 = w.key0; k0 < w.key1; k0 += bs) {
        const int64_t n = std::min(bs, w.key1 - k0);
        const T* kb = kp + tables[w.seq * table_stride + k0 / bs] * block_stride;
        const T* vb = vp + tables[w.seq * table_stride + k0 / bs] * block_stride;
        if (k0 + bs < w.key1) {  // the next block lies elsewhere in the pool: fetch it while this one runs
          const int64_t next = tables[w.seq * table_stride + k0 / bs + 1] * block_stride;
          for (int64_t b = 0; b < block_stride * static_cast<int64_t>(sizeof(T)); b += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(kp + next) + b);
            __builtin_prefetch(reinterpret_cast<const char*>(vp + next) + b);
          }
        }
        for (int64_t t = 0; t < w.ntok; ++t) {
          // Causal: a token sees keys up to its own position.
          const int64_t visible = std::min(n, first_pos + w.tok0 + t - k0 + 1);
          if (visible <= 0) continue;
          for (int64_t j = 0; j < visible; j += kLanes)
            for (int64_t h = 0; h < hkv; ++h)
              for (int64_t g = 0; g < group; g += kRows<C>) {
                const int64_t r = t * hq + h * group + g, at = j * tok_stride + h * d;
                attend_keys<C>(&qf[r * d], static_cast<int>(std::min<int64_t>(kRows<C>, group - g)), kb + at, vb + at,
                               tok_stride, std::min(kLanes, visible - j), &acc[r * d], &m[r], &l[r]);
              }
        }
      }
      if (w.slot < 0) {  // every row sees key 0, so l[r] > 0
        T* dst = op + (q0 + w.tok0) * hq * d;
        for (int64_t r = 0; r < rows; ++r) {
          const float inv = 1.f / l[r];
          for (int64_t i = 0; i < d; ++i) dst[r * d + i] = static_cast<T>(acc[r * d + i] * inv);
        }
      } else {  // a split wholly past a row's position leaves m = -inf, l = 0: weight 0 in the merge
        std::copy(acc.begin(), acc.begin() + rows * d, part.begin() + w.slot * rows_max * d);
        for (int64_t r = 0; r < rows; ++r) {
          stats[(w.slot * rows_max + r) * 2] = m[r];
          stats[(w.slot * rows_max + r) * 2 + 1] = l[r];
        }
      }
    }
    // Merge the splits of each split (sequence, tile): rescale each to the common max.
#pragma omp for schedule(dynamic, 1)
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const Group& g = groups[gi];
      T* dst = op + (cu[g.seq] + g.tok0) * hq * d;
      for (int64_t r = 0; r < g.ntok * hq; ++r) {
        float mx = neg_inf;
        for (int64_t sp = 0; sp < g.nsplits; ++sp) mx = std::max(mx, stats[((g.slot0 + sp) * rows_max + r) * 2]);
        float* ar = &acc[0];
        std::fill(ar, ar + d, 0.f);
        float total = 0.f;
        for (int64_t sp = 0; sp < g.nsplits; ++sp) {
          const int64_t at = (g.slot0 + sp) * rows_max + r;
          if (stats[at * 2 + 1] == 0.f) continue;
          const float wgt = std::exp(stats[at * 2] - mx);
          total += wgt * stats[at * 2 + 1];
          for (int64_t i = 0; i < d; ++i) ar[i] += wgt * part[at * d + i];
        }
        for (int64_t i = 0; i < d; ++i) dst[r * d + i] = static_cast<T>(ar[i] / total);
      }
    }
  }
}

}  // namespace

namespace kiln_ops {

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale, int64_t partition_size,
                           int64_t max_q_len) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "kiln::paged_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q [N, Hq, D] and k_cache, v_cache [num_blocks, block_size, Hkv, D] alike, got q ",
              q.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must share a float dtype, got ", q.scalar_type(), ", ",
              k_cache.scalar_type(), ", ", v_cache.scalar_type());
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q must have contiguous heads and k_cache, v_cache must be contiguous");
  const int64_t hq = q.size(1), d = q.size(2), num_blocks = k_cache.size(0), bs = k_cache.size(1);
  const int64_t hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d, "head_dim of q (", d, ") and the cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "query heads (", hq, ") must be a multiple of KV heads (", hkv, ")");
  TORCH_CHECK(std::count(std::begin(kHeadDims), std::end(kHeadDims), d), "head_dim ", d,
              " is not one the op is built for ", at::IntArrayRef(kHeadDims));
  for (const at::Tensor* t : {&cu_seqlens_q, &seq_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "cu_seqlens_q, seq_lens and block_tables must be contiguous int32 CPU tensors");
  const int64_t num_seqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(cu_seqlens_q.numel() == num_seqs + 1 && block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "expected cu_seqlens_q [B+1] and block_tables [B, max_blocks] for B = ", num_seqs, " sequences");
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] == q.size(0), "cu_seqlens_q must run from 0 to N = ", q.size(0));

  // Validate every index the kernel will follow (a bad one would read outside the pool), and
  // find the longest context, which sizes the splits.
  const int64_t group = hq / hkv, tile_tokens = std::max<int64_t>(1, kMaxTileRows / group);
  int64_t tiles = 0, longest = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b], len = lens[b];
    TORCH_CHECK(q_len >= 0 && len >= q_len, "sequence ", b, " has ", q_len, " query tokens but a context of ", len);
    TORCH_CHECK((len + bs - 1) / bs <= max_blocks, "sequence ", b, " needs ", (len + bs - 1) / bs,
                " blocks but block_tables has ", max_blocks);
    for (int64_t i = 0; i < (len + bs - 1) / bs; ++i)
      TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < num_blocks, "block_tables[", b,
                  ", ", i, "] = ", tables[b * max_blocks + i], " is outside the pool of ", num_blocks, " blocks");
    tiles += (q_len + tile_tokens - 1) / tile_tokens;
    longest = std::max(longest, len);
  }
  // Split contexts only when (sequence, tile) pairs leave threads idle; a split under
  // 256 keys costs more to merge than it saves. partition_size > 0 forces a size (tests).
  int64_t part = partition_size;
  if (part <= 0) {
    const int64_t threads = at::get_num_threads();
    const int64_t splits = tiles >= threads ? 1 : (threads + tiles - 1) / std::max<int64_t>(tiles, 1);
    part = std::max<int64_t>((longest + splits - 1) / splits, 256);
  }
  part = std::max<int64_t>((part + bs - 1) / bs * bs, bs);  // whole blocks

  std::vector<Item> items;
  std::vector<Group> groups;
  int64_t slot = 0, widest_tile = 1;  // buffers are sized by the widest tile run (decode: 1 token, not a full tile)
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b], first_pos = lens[b] - q_len;
    if (max_q_len > 0 && q_len > max_q_len) continue;  // the caller attends to this one (see cpu_attention.py)
    for (int64_t t0 = 0; t0 < q_len; t0 += tile_tokens) {
      const int64_t ntok = std::min(tile_tokens, q_len - t0), key_end = first_pos + t0 + ntok;
      const int64_t nsplits = (key_end + part - 1) / part;
      widest_tile = std::max(widest_tile, ntok);
      if (nsplits > 1) groups.push_back({b, t0, ntok, slot, nsplits});
      for (int64_t sp = 0; sp < nsplits; ++sp)
        items.push_back({b, t0, ntok, sp * part, std::min(key_end, (sp + 1) * part), nsplits > 1 ? slot++ : -1});
    }
  }
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  if (items.empty()) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "kiln_paged_attention", [&] {
    auto call = [&](auto chunks) {
      run<scalar_t, decltype(chunks)::value>(q, k_cache, v_cache, cu, lens, tables, max_blocks, scale, items, groups,
                                             widest_tile, out);
    };
    switch (d / kLanes) {
      case 1: return call(std::integral_constant<int, 1>{});
      case 2: return call(std::integral_constant<int, 2>{});
      case 4: return call(std::integral_constant<int, 4>{});
      case 6: return call(std::integral_constant<int, 6>{});
      default: return call(std::integral_constant<int, 8>{});
    }
  });
  return out;
}

}  // namespace kiln_ops

TORCH_LIBRARY(kiln, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor seq_lens, "
        "Tensor block_tables, float scale, int partition_size=0, int max_q_len=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("paged_attention", &kiln_ops::paged_attention); }
