// kvfleet CPU kernel for the attention of a long prefill chunk over its context, added to the
// torch.ops.kvfleet_cpu library (layer_ops.cpp).
//
//   prefill_attention_(out, q, k, v, scale)
//       q [T, H, D] bf16 (rows may be strided: the fused qkv buffer), k, v [S, Hkv, D] bf16 contiguous, out
//       [T, H, D] bf16 contiguous; query t sees keys 0 .. S - T + t (the chunk's cached prefix and itself,
//       causally). Grouped-query heads of one KV head are one block of query rows that share every K/V read.
//
// Flash attention on AVX-512 BF16 dot products (vdpbf16ps: 32 bf16 products per instruction, float32
// sums): keys in tiles of 64, scores and the online softmax in float32, the probabilities rounded to bf16
// for the product with V (as every bf16 flash kernel does). K is packed per KV head so that one register
// holds 16 keys x one pair of dimensions, V so that one register holds 16 dimensions x one pair of keys; a
// broadcast query (or probability) pair then multiplies 16 keys (or dimensions) per instruction. Work is
// (KV head, tile of 16 query tokens) items handed out dynamically: causal tiles near the end cost more.
// prefill_attention_available() says whether this build has the instructions (-march=native on a CPU with
// AVX512_BF16); without them the engine keeps PyTorch's flash attention.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu_common.h"

namespace {

using namespace kvfleet_cpu;

bool prefill_attention_available() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)

constexpr int64_t TK = 64;  // keys per tile: four registers of 16 scores per query row
constexpr int64_t TQ = 16;  // query tokens per work item
constexpr int64_t RB = 6;   // query rows per register block (two tokens of a 3-head group)

// K of one KV head as [tile][D/2][TK keys] pairs of dimensions (uint32 = two bf16); keys past S are zero.
void pack_k(const uint16_t* k, int64_t S, int64_t row_stride, int64_t D, uint32_t* dst) {
  const int64_t pairs = D / 2, tiles = (S + TK - 1) / TK;
  for (int64_t t = 0; t < tiles; ++t) {
    uint32_t* tile = dst + t * pairs * TK;
    for (int64_t j = 0; j < TK; ++j) {
      const int64_t key = t * TK + j;
      const uint32_t* row = key < S ? reinterpret_cast<const uint32_t*>(k + key * row_stride) : nullptr;
      for (int64_t p = 0; p < pairs; ++p) tile[p * TK + j] = row ? row[p] : 0u;
    }
  }
}

// V of one KV head as [key pair][D] pairs of keys (uint32 = V[2i][d], V[2i+1][d]); keys past S are zero.
void pack_v(const uint16_t* v, int64_t S, int64_t row_stride, int64_t D, uint32_t* dst) {
  const int64_t kpairs = (S + TK - 1) / TK * (TK / 2);
  for (int64_t i = 0; i < kpairs; ++i) {
    const int64_t k0 = 2 * i, k1 = 2 * i + 1;
    const uint16_t* a = k0 < S ? v + k0 * row_stride : nullptr;
    const uint16_t* b = k1 < S ? v + k1 * row_stride : nullptr;
    uint32_t* out = dst + i * D;
    for (int64_t d = 0; d < D; ++d)
      out[d] = uint32_t(a ? a[d] : 0) | (uint32_t(b ? b[d] : 0) << 16);
  }
}

// One register block of `nr` (<= RB) query rows over one key tile: scores, online softmax, O += P V.
// (RB = 6, TK = 64: 24 score registers; 6 x 4 output registers for D = 64. Measured on a 2-core AMD EPYC
// without AMX, 2,048 causal queries: RB 4 / TK 32 ran at 250 GFLOP/s, RB 6 / TK 32 at 430, RB 6 / TK 64 at 500.)
// rows[r]: the row's query (bf16, D); limit[r]: the last key it sees; m: running max of the scaled scores; l:
// the running sum, 16 lanes a row (added up once, at the end); o: [nr][D]. A tile that does not raise a row's
// max leaves its sum and output unscaled (no exp, no multiply): after the first tiles, most do not. Masks only on
// tiles that reach past a row's last key. Together 1.06-1.09x over rescaling every row at every tile.
template <int64_t D>
inline void block_tile(const uint16_t* const* rows, const int64_t* limit, int64_t nr, int64_t key0,
                       const uint32_t* kt, const uint32_t* vt, float scale, float* m, float* l, float* o) {
  constexpr int64_t P = D / 2, NS = TK / 16;  // NS: registers of 16 scores per row
  __m512 s[RB][NS];
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t j = 0; j < NS; ++j) s[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh kk[NS];
    for (int64_t j = 0; j < NS; ++j) kk[j] = (__m512bh)_mm512_loadu_si512(kt + p * TK + 16 * j);
    for (int64_t r = 0; r < RB; ++r) {
      if (r >= nr) break;
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(rows[r])[p]);
      for (int64_t j = 0; j < NS; ++j) s[r][j] = _mm512_dpbf16_ps(s[r][j], kk[j], qp);
    }
  }
  alignas(64) uint32_t pbuf[RB][TK / 2];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const bool full = limit[0] - key0 + 1 >= TK;  // rows are in token order: the first sees the fewest keys
  float alpha[RB];  // 1: the tile did not raise the row's max, nothing to rescale
  for (int64_t r = 0; r < nr; ++r) {
    if (!full) {
      const int64_t visible = limit[r] - key0 + 1;  // keys of this tile the row sees (> 0: tiles past it are skipped)
      for (int64_t j = 0; j < NS; ++j) {
        const int64_t n = std::max<int64_t>(0, std::min<int64_t>(visible - 16 * j, 16));
        const __mmask16 mk = _mm512_cmp_epi32_mask(lane, _mm512_set1_epi32(int32_t(n)), _MM_CMPINT_LT);
        s[r][j] = _mm512_mask_mov_ps(ninf, mk, s[r][j]);
      }
    }
    __m512 mx = s[r][0];
    for (int64_t j = 1; j < NS; ++j) mx = _mm512_max_ps(mx, s[r][j]);
    const float m_tile = _mm512_reduce_max_ps(mx) * scale;  // scale > 0: the max of the scaled scores
    const float m_new = std::max(m[r], m_tile);
    const __m512 mn = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < NS; ++j) {
      s[r][j] = exp512(_mm512_fmsub_ps(s[r][j], vscale, mn));
      sum = _mm512_add_ps(sum, s[r][j]);
    }
    alpha[r] = m_new == m[r] ? 1.f : m[r] == -INFINITY ? 0.f : fast_exp(m[r] - m_new);
    _mm512_storeu_ps(l + 16 * r, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * r), _mm512_set1_ps(alpha[r]), sum));
    m[r] = m_new;
    for (int64_t j = 0; j < NS; j += 2)  // keys in order: a pair of keys per 32-bit lane
      _mm512_store_si512(pbuf[r] + 8 * j, (__m512i)_mm512_cvtne2ps_pbh(s[r][j + 1], s[r][j]));
  }
  constexpr int64_t C = D / 16;  // registers per output row
  __m512 acc[RB][C];
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
    if (alpha[r] != 1.f)
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(alpha[r]));
  }
  for (int64_t i = 0; i < TK / 2; ++i) {
    __m512bh vv[C];
    for (int64_t c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vt + i * D + 16 * c);
    for (int64_t r = 0; r < RB; ++r) {
      if (r >= nr) break;
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(int32_t(pbuf[r][i]));
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], pp);
    }
  }
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

template <int64_t D>
void run(Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v, float scale) {
  const int64_t T = q.size(0), H = q.size(1), S = k.size(0), Hkv = k.size(1), G = H / Hkv, prefix = S - T;
  const int64_t tiles = (S + TK - 1) / TK, kstride = k.stride(0), vstride = v.stride(0);
  std::vector<uint32_t> kp(Hkv * tiles * TK * D / 2), vp(Hkv * tiles * TK / 2 * D);
  const uint16_t* kd = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const uint16_t* vd = reinterpret_cast<const uint16_t*>(v.data_ptr());
  at::parallel_for(0, 2 * Hkv, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t h = i / 2;
      if (i % 2 == 0)
        pack_k(kd + h * D, S, kstride, D, kp.data() + h * tiles * TK * D / 2);
      else
        pack_v(vd + h * D, S, vstride, D, vp.data() + h * tiles * TK / 2 * D);
    }
  });
  const int64_t qtiles = (T + TQ - 1) / TQ, items = Hkv * qtiles;
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t item = 0; item < items; ++item) {
    const int64_t qt = qtiles - 1 - item / Hkv, h = item % Hkv;  // the costliest (last) tiles first
    const int64_t t0 = qt * TQ, t1 = std::min(T, t0 + TQ), nrows = (t1 - t0) * G;
    std::vector<float> o(nrows * D, 0.f), m(nrows, -INFINITY), l(nrows * 16, 0.f);  // l: 16 lanes a row
    std::vector<const uint16_t*> rows(nrows);
    std::vector<int64_t> limit(nrows);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = (t - t0) * G + g;
        rows[r] = qd + t * qs0 + (h * G + g) * qs1;
        limit[r] = prefix + t;
      }
    const uint32_t* kh = kp.data() + h * tiles * TK * D / 2;
    const uint32_t* vh = vp.data() + h * tiles * TK / 2 * D;
    const int64_t last_tile = (prefix + t1 - 1) / TK;  // no row of this item sees past it
    for (int64_t kt = 0; kt <= last_tile; ++kt) {
      const int64_t key0 = kt * TK;
      for (int64_t r0 = 0; r0 < nrows; r0 += RB) {
        const int64_t end = std::min(nrows, r0 + RB);
        int64_t first = r0;  // rows are in token order: a block's first rows may see nothing of this tile
        while (first < end && limit[first] < key0) ++first;
        if (first == end) continue;
        block_tile<D>(rows.data() + first, limit.data() + first, end - first, key0, kh + kt * TK * D / 2,
                      vh + kt * TK / 2 * D, scale, m.data() + first, l.data() + 16 * first, o.data() + first * D);
      }
    }
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = (t - t0) * G + g;
        const float inv = 1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(l.data() + 16 * r));
        float* orow = o.data() + r * D;
        for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
        from_f32(orow, reinterpret_cast<c10::BFloat16*>(od + t * os0 + (h * G + g) * os1), D);
      }
  }
}

#endif

void prefill_attention_(Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  check(prefill_attention_available(), "prefill_attention_ needs AVX512_BF16 (check prefill_attention_available)");
  check(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
            out.scalar_type() == at::kBFloat16,
        "prefill_attention_: q, k, v and out must be bfloat16");
  check(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "prefill_attention_: q, k, v, out are 3-d");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1);
  check(k.sizes() == v.sizes() && k.size(2) == D && Hkv > 0 && H % Hkv == 0, "prefill_attention_: k, v must be [S, Hkv, D] with H a multiple of Hkv");
  check(out.sizes() == q.sizes(), "prefill_attention_: out must have q's shape");
  check(S >= T && T > 0, "prefill_attention_: the context must hold the chunk (S >= T > 0)");
  check(q.stride(2) == 1 && q.stride(1) == D && k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 &&
            v.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D,
        "prefill_attention_: every row's heads must be contiguous");
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (D == 64)
    run<64>(out, q, k, v, float(scale));
  else if (D == 128)
    run<128>(out, q, k, v, float(scale));
  else
    check(false, "prefill_attention_: head_dim must be 64 or 128");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("prefill_attention_available() -> bool");
  m.impl("prefill_attention_available", c10::DispatchKey::CatchAll, TORCH_FN(prefill_attention_available));
  m.def("prefill_attention_(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale) -> ()");
  m.impl("prefill_attention_", c10::DispatchKey::CPU, TORCH_FN(prefill_attention_));
}
