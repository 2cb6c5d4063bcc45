// One query token's attention over a run of its paged bf16 K/V in a single pass, for attention_ops.cpp on CPUs
// with AVX512-BF16 (and no AMX tiles): the keys and values of each chunk of 16 tokens are read once, while
// they are in L1, instead of a pass over every key and then one over every value per kv head.
//
// Per chunk: the scores of every query head against the chunk's keys (vdpbf16ps: bf16 products, float32
// sums, 16 keys' sums folded into one vector without a horizontal reduction per key), an online softmax
// (each head's running maximum and sum; its float32 accumulator rescaled when the maximum rises), then the
// chunk's V rows weighted into the accumulators, a few query heads at a time in registers: two tokens per
// vdpbf16ps, their weights rounded to bf16 as FlashAttention does for P @ V on GPUs (float32 sums).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVFLEET_ONEPASS_DECODE 1
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace kvfleet_cpu {

// e^x for 16 lanes, fast_exp's arithmetic (2^n * e^r, Taylor to r^7); 0 below e^-70 (and for -inf).
inline __m512 exp16(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-70.f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-70.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

// The sums of 16 vectors' lanes as one vector: out[4L + i] = sum(a[4i + L]), i.e. in token order when a[k]
// holds the partial sums of token 4 * (k % 4) + k / 4 (the order in which chunk_scores fills it).
inline __m512 fold16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k)  // 128-bit lanes: [a(2k) 0+2, a(2k) 1+3, a(2k+1) 0+2, a(2k+1) 1+3]
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit lane L: the four partial sums of a(4k + L)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // within each 128-bit lane: two sums each of a(8k + L), a(8k + 4 + L)
    d[k] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * k], c[2 * k + 1]), _mm512_unpackhi_ps(c[2 * k], c[2 * k + 1]));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x44), _mm512_shuffle_ps(d[0], d[1], 0xEE));
}

inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// scores[t] = scale * q . k_t for the chunk's n <= 16 keys (rows[t] + offset: one kv head's D elements),
// -inf in lanes t >= n (those rows are never read).
template <int D>
inline __m512 chunk_scores(const uint16_t* q, const uint16_t* const* rows, int64_t offset, int n, float scale) {
  constexpr int P = D / 32;  // 32 bf16 (16 pairs) per vdpbf16ps
  __m512bh qv[P];
  for (int v = 0; v < P; ++v) qv[v] = load_bh(q + v * 32);
  __m512 a[16];
  for (int k = 0; k < 16; ++k) {
    const int t = 4 * (k % 4) + k / 4;
    a[k] = _mm512_setzero_ps();
    if (t < n)
      for (int v = 0; v < P; ++v) a[k] = _mm512_dpbf16_ps(a[k], load_bh(rows[t] + offset + v * 32), qv[v]);
  }
  const __m512 s = _mm512_mul_ps(fold16(a), _mm512_set1_ps(scale));
  return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), __mmask16((1u << n) - 1), s);
}

// acc[j] += sum_t p[j][t] * v_t for J query heads j of one kv head (rows[t] + offset: its D values), two
// tokens per vdpbf16ps: their V rows interleaved (unpack lo/hi), the weights a bf16 pair per query (pw[j][t/2],
// zero past n). The accumulators hold the dims in the unpacks' order (see natural_order).
template <int D, int J>
inline void chunk_values(const uint16_t* const* rows, int64_t offset, int n, const uint32_t* pw, float* acc) {
  constexpr int V = D / 16, R = D / 32;
  __m512 a[J][V];
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < V; ++v) a[j][v] = _mm512_loadu_ps(acc + j * D + v * 16);
  for (int t = 0; t < n; t += 2) {
    const uint16_t* r0 = rows[t] + offset;
    const uint16_t* r1 = (t + 1 < n ? rows[t + 1] : rows[t]) + offset;  // a lone last token: weight 0 beside it
    __m512bh x[V];
    for (int v = 0; v < R; ++v) {
      const __m512i a0 = _mm512_loadu_si512(r0 + v * 32), b0 = _mm512_loadu_si512(r1 + v * 32);
      x[2 * v] = (__m512bh)_mm512_unpacklo_epi16(a0, b0);
      x[2 * v + 1] = (__m512bh)_mm512_unpackhi_epi16(a0, b0);
    }
    for (int j = 0; j < J; ++j) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pw[j * 8 + t / 2]));
      for (int v = 0; v < V; ++v) a[j][v] = _mm512_dpbf16_ps(a[j][v], x[v], w);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + j * D + v * 16, a[j][v]);
}

// The D accumulators of one query head from chunk_values' order back to dims 0..D-1: in each 32-dim block v,
// lane 4k + i of vector 2v holds dim 32v + 8k + i and of vector 2v + 1 dim 32v + 8k + 4 + i.
template <int D>
inline void natural_order(float* acc) {
  float tmp[D];
  std::copy(acc, acc + D, tmp);
  for (int v = 0; v < D / 32; ++v)
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 4; ++i) {
        acc[32 * v + 8 * k + i] = tmp[32 * v + 4 * k + i];
        acc[32 * v + 8 * k + 4 + i] = tmp[32 * v + 16 + 4 * k + i];
      }
}

constexpr int64_t kFar = 4;  // chunks ahead prefetched into L2

// Every cache line of the K and V rows of tokens [first, first + 16) (or up to len) asked into L`Level`.
template <int Level, typename RowOffset>
inline void prefetch_rows(const uint16_t* kc, const uint16_t* vc, int64_t first, int64_t len, RowOffset&& row_offset,
                          int64_t row_elems) {
  const int64_t last = std::min<int64_t>(first + 16, len), bytes = row_elems * 2;
  for (int64_t t = first; t < last; ++t) {
    const char* k = reinterpret_cast<const char*>(kc + row_offset(t));
    const char* v = reinterpret_cast<const char*>(vc + row_offset(t));
    for (int64_t b = 0; b < bytes; b += 64) {
      prefetch_line<Level>(k + b);
      prefetch_line<Level>(v + b);
    }
  }
}

// The partial (acc, max, sum per query head, float32) of a run of `len` keys of a bf16 cache
// ([blocks, bs, hkv, D]) whose blocks come from `table`, g query heads per kv head.
template <int D>
void decode_part_onepass(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int32_t* table,
                         int64_t len, int64_t bs, int64_t hkv, int64_t g, float scale, float* acc, float* mx,
                         float* sum, std::vector<float>& work) {
  constexpr int J = D == 64 ? 4 : 2;  // query heads whose V accumulators fit in registers at once
  const int64_t hq = hkv * g, row_elems = hkv * D;
  work.resize(hq * 8 + hq * 16 + 16);
  uint32_t* pw = reinterpret_cast<uint32_t*>(work.data());  // [hq][8] this chunk's softmax numerators, bf16 pairs
  __m512* sums = reinterpret_cast<__m512*>((reinterpret_cast<uintptr_t>(work.data() + hq * 8) + 63) & ~uintptr_t(63));
  for (int64_t hj = 0; hj < hq; ++hj) sums[hj] = _mm512_setzero_ps();  // per head, lane-wise until the end
  std::fill(acc, acc + hq * D, 0.f);
  std::fill(mx, mx + hq, -INFINITY);
  const uint16_t* krows[16];
  const uint16_t* vrows[16];
  auto row_offset = [&](int64_t t) { return (int64_t(table[t / bs]) * bs + t % bs) * row_elems; };
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = int(std::min<int64_t>(16, len - t0));
    for (int t = 0; t < n; ++t) {
      const int64_t o = row_offset(t0 + t);
      krows[t] = kc + o;
      vrows[t] = vc + o;
    }
    // Blocks sit anywhere, out of the hardware prefetchers' sight: the rows kFar chunks ahead are asked into
    // L2 (2,600 keys on cold, shuffled blocks: ~25% faster; also asking for the next chunk in L1 gained nothing).
    for (int64_t c = t0 == 0 ? 1 : kFar; c <= kFar && t0 + 16 * c < len; ++c)  // a run's first chunks too
      prefetch_rows<2>(kc, vc, t0 + 16 * c, len, row_offset, row_elems);
    for (int64_t hj = 0; hj < hq; ++hj) {  // scores and the online softmax
      const __m512 s = chunk_scores<D>(q + hj * D, krows, (hj / g) * D, n, scale);
      if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(mx[hj]), _CMP_GT_OQ)) {  // a new maximum: rescale what was summed
        const float m = _mm512_reduce_max_ps(s);
        const __m512 f = _mm512_set1_ps(mx[hj] == -INFINITY ? 0.f : fast_exp(mx[hj] - m));
        sums[hj] = _mm512_mul_ps(sums[hj], f);
        for (int i = 0; i < D; i += 16) _mm512_storeu_ps(acc + hj * D + i, _mm512_mul_ps(_mm512_loadu_ps(acc + hj * D + i), f));
        mx[hj] = m;
      }
      const __m512 e = exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx[hj])));
      sums[hj] = _mm512_add_ps(sums[hj], e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + hj * 8), (__m256i)_mm512_cvtneps_pbh(e));
    }
    for (int64_t h = 0; h < hkv; ++h)  // the values, J query heads at a time
      for (int64_t j = 0; j < g; j += J) {
        const int64_t hj = h * g + j;
        switch (std::min<int64_t>(J, g - j)) {
          case 1: chunk_values<D, 1>(vrows, h * D, n, pw + hj * 8, acc + hj * D); break;
          case 2: chunk_values<D, 2>(vrows, h * D, n, pw + hj * 8, acc + hj * D); break;
          case 3: chunk_values<D, 3>(vrows, h * D, n, pw + hj * 8, acc + hj * D); break;
          default: chunk_values<D, 4>(vrows, h * D, n, pw + hj * 8, acc + hj * D); break;
        }
      }
  }
  for (int64_t hj = 0; hj < hq; ++hj) {
    natural_order<D>(acc + hj * D);
    sum[hj] = _mm512_reduce_add_ps(sums[hj]);
  }
}

}  // namespace kvfleet_cpu
#endif  // __AVX512F__ && __AVX512BF16__
