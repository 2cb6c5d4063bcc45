// kvfleet CPU kernels for paged attention, added to the torch.ops.kvfleet_cpu library (layer_ops.cpp).
//
//   write_kv(key, value, k_cache, v_cache, slots)    store each token's K/V heads at its cache slot
//   paged_decode_(out, q, k_cache, v_cache, tables, seq_lens, scale)
//       one query token per sequence over its paged context, grouped-query heads share K/V reads; for
//       bf16 with head_dim 64 the scores run on AMX tiles where the CPU has them (the next 16 keys
//       prefetched while a tile is read); elsewhere bf16 caches with an even block size use AVX-512 BF16
//       dot products for the scores and for the weighted sum of V (weights rounded to bf16, as flash
//       attention does; the softmax sum is taken over the rounded weights), two blocks prefetched ahead;
//       and a thread's next sequence's K/V is asked for a few lines at a time while it computes one (RunFeed,
//       paged_scores.h: cold caches, 64 x 140 keys, 2-core EPYC, 325 against 536 us per layer).
//       Sequences run in parallel; when there are fewer sequences than threads, a long context is split
//       into runs of blocks on several threads (flash-decoding): each part keeps its own float32 maximum,
//       sum and weighted sum of V, and the parts are merged by rescaling to the common maximum.
//       split_blocks > 0 fixes the runs instead (that many blocks each, from the first): batch-invariant.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <memory>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "cpu_common.h"
#include "paged_scores.h"

namespace {

using namespace kvfleet_cpu;

// ---- KV write ------------------------------------------------------------------------------------

void check_heads(const Tensor& t, const char* name, int64_t heads, int64_t d) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == heads && t.size(2) == d && t.stride(2) == 1 && t.stride(1) == d,
              "kvfleet_cpu: ", name, " must be [tokens, ", heads, ", ", d, "] with contiguous heads");
}

void write_kv(const Tensor& key, const Tensor& value, Tensor& k_cache, Tensor& v_cache, const Tensor& slots) {
  check_float(key, "key");
  check(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
        "caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  check(k_cache.scalar_type() == key.scalar_type() && v_cache.scalar_type() == key.scalar_type() &&
            value.scalar_type() == key.scalar_type(),
        "key, value and caches must have one dtype");
  const int64_t hkv = k_cache.size(2), d = k_cache.size(3);
  check_heads(key, "key", hkv, d);
  check_heads(value, "value", hkv, d);
  check(value.size(0) == key.size(0), "key and value must have the same number of tokens");
  const int64_t n_slots = k_cache.size(0) * k_cache.size(1);
  check(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == key.size(0),
        "slot_mapping must be int64 [tokens]");
  const Tensor sc = slots.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t tokens = key.size(0), es = key.element_size();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] < n_slots, "kvfleet_cpu: slot ", sp[t], " is outside the cache (", n_slots, " slots)");
  const size_t bytes = hkv * d * es;
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    if (sp[t] < 0) continue;  // padding: not written
    std::memcpy(kd + sp[t] * bytes, kp + t * key.stride(0) * es, bytes);
    std::memcpy(vd + sp[t] * bytes, vp + t * value.stride(0) * es, bytes);
  }
}

// ---- paged decode attention ----------------------------------------------------------------------

// softmax numerators in place over each of `rows` rows of `len` scores; their maxima in mx[rows], their
// sums in sum[rows]
inline void softmax_rows(float* sc, int64_t rows, int64_t len, float* mx, float* sum) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sj = sc + r * len;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < len; ++t) m = sj[t] > m ? sj[t] : m;
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      sj[t] = fast_exp(sj[t] - m);
      total += sj[t];
    }
    mx[r] = m;
    sum[r] = total;
  }
}


// The attention of every query head over one run of a sequence's keys (all of them, or one part of a split
// context): per head the maximum score, the sum of exp(score - maximum) and the unnormalised weighted sum
// of V rows (acc [q_heads * head_dim]), all float32.
struct Partial {
  float* acc;
  float* max;
  float* sum;
};

#ifdef __AVX512BF16__
// softmax_rows, and each row's numerators rounded to bf16 into pb (row stride lp, an even length >= len; a
// last odd slot 0), the sums taken over the rounded values (the weights the V sums use).
inline void softmax_rows_bf16(float* sc, int64_t rows, int64_t len, float* mx, float* sum, uint16_t* pb, int64_t lp) {
  softmax_rows(sc, rows, len, mx, sum);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* d = pb + r * lp;
    from_f32(sc + r * len, reinterpret_cast<c10::BFloat16*>(d), len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      const uint32_t back = uint32_t(d[t]) << 16;
      float f;
      std::memcpy(&f, &back, sizeof(f));
      total += f;
    }
    if (len < lp) d[len] = 0;
    sum[r] = total;
  }
}

// decode_part_avx512 for bf16 caches with an even block size, on AVX-512 BF16 dot products: scores as
// scores_dpbf16 (AMX tiles where `amx`), then the weighted sum of V two keys at a time: their V rows
// interleaved (one register: 16 dims x the two keys) times the pair of bf16 weights broadcast (VDPBF16PS),
// float32 sums. Lane k of sum 2v holds dim 32v + 8(k/4) + k%4, of sum 2v + 1 dim 32v + 8(k/4) + 4 + k%4.
template <int D, int G>
void decode_part_dpbf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table,
                        int64_t len, int64_t bs, int64_t hkv, float scale, Partial part, std::vector<float>& work,
                        bool amx, RunFeed& next) {
  constexpr int V = D / 32;
  const int64_t hq = hkv * G, row_elems = hkv * D, lp = (len + 1) & ~int64_t(1);
  work.resize(hq * len + (hq * lp + 1) / 2);
  float* sc = work.data();
  uint16_t* pb = reinterpret_cast<uint16_t*>(sc + hq * len);
  bool scored = false;
#ifdef KVFLEET_AMX
  if constexpr (D == 64) {
    if (amx) {
      scores_amx<G>(q, kc, table, len, bs, hkv, scale, sc);
      scored = true;
    }
  }
#endif
  for (int64_t h = 0; h < hkv && !scored; ++h) scores_dpbf16<D, G>(q, kc, table, len, bs, hkv, h, scale, sc + h * G * len, next);
  softmax_rows_bf16(sc, hq, len, part.max, part.sum, pb, lp);
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(vc);
  const int64_t nblk = (len + bs - 1) / bs;
  const __m512i lo_dims = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_dims = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < hkv; ++h) {
    __m512 acc[G][2 * V];
    for (int j = 0; j < G; ++j)
      for (int v = 0; v < 2 * V; ++v) acc[j][v] = _mm512_setzero_ps();
    const uint16_t* ph = pb + h * G * lp;
    for (int64_t bi = 0; bi < nblk; ++bi) {
      const uint16_t* block = vb + int64_t(table[bi]) * bs * row_elems + h * D;
      const int64_t in_block = std::min(bs, len - bi * bs);
      prefetch_ahead(vb + h * D, table, bi, nblk, bs, row_elems, D);
      for (int64_t o = 0; o < in_block; o += 2) {  // an odd last key pairs with zeros (its weight slot is 0)
        next.feed(kFeedPerPair);
        const int64_t t = bi * bs + o;
        const uint16_t* r0 = block + o * row_elems;
        const bool pair = o + 1 < in_block;
        __m512bh lo[V], hi[V];
        for (int v = 0; v < V; ++v) {
          const __m512i a = _mm512_loadu_si512(r0 + v * 32);
          const __m512i b = pair ? _mm512_loadu_si512(r0 + row_elems + v * 32) : _mm512_setzero_si512();
          lo[v] = (__m512bh)_mm512_unpacklo_epi16(a, b);
          hi[v] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
        for (int j = 0; j < G; ++j) {
          int32_t w2;
          std::memcpy(&w2, ph + j * lp + t, sizeof(w2));
          const __m512bh w = (__m512bh)_mm512_set1_epi32(w2);
          for (int v = 0; v < V; ++v) {
            acc[j][2 * v] = _mm512_dpbf16_ps(acc[j][2 * v], lo[v], w);
            acc[j][2 * v + 1] = _mm512_dpbf16_ps(acc[j][2 * v + 1], hi[v], w);
          }
        }
      }
    }
    for (int j = 0; j < G; ++j)
      for (int v = 0; v < V; ++v) {
        float* dst = part.acc + (h * G + j) * D + v * 32;
        _mm512_storeu_ps(dst, _mm512_permutex2var_ps(acc[j][2 * v], lo_dims, acc[j][2 * v + 1]));
        _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(acc[j][2 * v], hi_dims, acc[j][2 * v + 1]));
      }
  }
  next.drain();  // what the run's loops did not ask for yet
}
#endif  // __AVX512BF16__

#ifdef __AVX512F__
// The partial of a run of `len` keys (blocks from `table`) with head_dim D (a multiple of 16) and G query
// heads per kv head: bf16 with an even block size goes to decode_part_dpbf16 (and AMX, which needs blocks of
// 16, with it); otherwise scores per kv head on AVX-512, softmax, then the weighted sum of V with the G
// accumulators in registers while the V rows stream by.
template <int D, int G, typename T>
void decode_part_avx512(const T* q, const T* kc, const T* vc, const int32_t* table, int64_t len, int64_t bs,
                        int64_t hkv, float scale, Partial part, std::vector<float>& work, bool amx, RunFeed& next) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bs % 2 == 0) return decode_part_dpbf16<D, G>(q, kc, vc, table, len, bs, hkv, scale, part, work, amx, next);
  }
#endif
  next.drain();
  constexpr int V = D / 16;
  const int64_t hq = hkv * G, row_elems = hkv * D;
  work.resize(hq * len);
  float* sc = work.data();
  for (int64_t h = 0; h < hkv; ++h) scores_avx512<D, G>(q, kc, table, len, bs, hkv, h, scale, sc + h * G * len);
  softmax_rows(sc, hq, len, part.max, part.sum);
  for (int64_t h = 0; h < hkv; ++h) {
    __m512 acc[G][V];
    for (int j = 0; j < G; ++j)
      for (int v = 0; v < V; ++v) acc[j][v] = _mm512_setzero_ps();
    const float* p = sc + h * G * len;
    for_each_token(vc, table, len, bs, row_elems, h * D, [&](const T* row, int64_t t) {
      __m512 x[V];
      for (int v = 0; v < V; ++v) x[v] = load16(row + v * 16);
      for (int j = 0; j < G; ++j) {
        const __m512 w = _mm512_set1_ps(p[j * len + t]);
        for (int v = 0; v < V; ++v) acc[j][v] = _mm512_fmadd_ps(w, x[v], acc[j][v]);
      }
    });
    for (int j = 0; j < G; ++j)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(part.acc + (h * G + j) * D + v * 16, acc[j][v]);
  }
}
#endif

// The partial of a run of keys, every head, vectorized above where the shape has a specialization, else
// portable: K and V rows of all kv heads sit together in a block ([block_size, kv_heads, d]), so each block
// is read front to back once for K and once for V.
template <typename T>
void decode_part(const T* q, const T* kc, const T* vc, const int32_t* table, int64_t len, int64_t bs, int64_t hkv,
                 int64_t g, int64_t d, float scale, Partial part, std::vector<float>& work, bool amx, RunFeed& next) {
#ifdef __AVX512F__
  if (d == 64 && g == 3) return decode_part_avx512<64, 3>(q, kc, vc, table, len, bs, hkv, scale, part, work, amx, next);
  if (d == 64 && g == 4) return decode_part_avx512<64, 4>(q, kc, vc, table, len, bs, hkv, scale, part, work, amx, next);
  if (d == 64 && g == 1) return decode_part_avx512<64, 1>(q, kc, vc, table, len, bs, hkv, scale, part, work, amx, next);
  if (d == 128 && g == 1) return decode_part_avx512<128, 1>(q, kc, vc, table, len, bs, hkv, scale, part, work, amx, next);
  if (d == 128 && g == 2) return decode_part_avx512<128, 2>(q, kc, vc, table, len, bs, hkv, scale, part, work, amx, next);
  if (d == 128 && g == 4) return decode_part_avx512<128, 4>(q, kc, vc, table, len, bs, hkv, scale, part, work, amx, next);
#endif
  next.drain();
  const int64_t hq = hkv * g, row_elems = hkv * d;
  // work: q (hq*d) | scores (hq*len) | one K/V row (hkv*d)
  work.resize(hq * d + hq * len + row_elems);
  float* qf = work.data();
  float* sc = qf + hq * d;
  float* row = sc + hq * len;
  float* acc = part.acc;
  to_f32(q, qf, hq * d);
  for (int64_t i = 0; i < hq * d; ++i) qf[i] *= scale;
  for_each_token(kc, table, len, bs, row_elems, 0, [&](const T* r, int64_t t) {  // scores
    to_f32(r, row, row_elems);
    for (int64_t hj = 0; hj < hq; ++hj) {
      const float* qj = qf + hj * d;
      const float* kr = row + (hj / g) * d;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += qj[i] * kr[i];
      sc[hj * len + t] = s;
    }
  });
  softmax_rows(sc, hq, len, part.max, part.sum);
  std::fill(acc, acc + hq * d, 0.f);
  for_each_token(vc, table, len, bs, row_elems, 0, [&](const T* r, int64_t t) {  // weighted sum of V
    to_f32(r, row, row_elems);
    for (int64_t hj = 0; hj < hq; ++hj) {
      const float p = sc[hj * len + t];
      const float* vr = row + (hj / g) * d;
      float* aj = acc + hj * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) aj[i] += p * vr[i];
    }
  });
}

// out = the parts merged: each rescaled from its own maximum to the common one, divided by the rescaled sum
// of the sums; a single part (an unsplit sequence) is acc / sum.
template <typename T>
void merge_parts(const Partial* parts, int64_t n, int64_t hq, int64_t d, T* out, float* res) {
  for (int64_t hj = 0; hj < hq && n == 1; ++hj) {
    const float inv = 1.f / parts[0].sum[hj];
    const float* a = parts[0].acc + hj * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) res[hj * d + i] = a[i] * inv;
  }
  for (int64_t hj = 0; hj < hq && n > 1; ++hj) {
    float m = parts[0].max[hj];
    for (int64_t p = 1; p < n; ++p) m = std::max(m, parts[p].max[hj]);
    float total = 0.f;
    float* r = res + hj * d;
    std::fill(r, r + d, 0.f);
    for (int64_t p = 0; p < n; ++p) {
      const float w = std::exp(parts[p].max[hj] - m);
      total += parts[p].sum[hj] * w;
      const float* a = parts[p].acc + hj * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) r[i] += a[i] * w;
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) r[i] *= inv;
  }
  from_f32(res, out, hq * d);
}

// A run of blocks [first, last) of sequence `seq`, one unit of parallel work; `parts` runs make up the sequence.
// A run of a split sequence keeps its partial in slot `slot` until the merge; a whole one (slot -1) is
// finished by its thread.
struct Run {
  int64_t seq, first, last, parts, slot;
};

constexpr int64_t kMinPartTokens = 256;  // a split part reads at least this many keys (per-part cost stays small)

// split_blocks 0: every sequence whole while there are at least as many sequences as threads; otherwise each
// long one split into up to ceil(threads / seqs) runs of whole blocks, so that one sequence's context is read by
// every core. split_blocks > 0 (--deterministic): runs of that many blocks at fixed places (blocks 0, s, 2s, ...),
// whatever the batch and the threads, so a query's result depends on its own context alone.
std::vector<Run> plan_runs(const int32_t* lens, int64_t b, int64_t bs, int64_t split_blocks) {
  const int64_t threads = at::get_num_threads();
  const int64_t want = b < threads ? (threads + b - 1) / b : 1;
  std::vector<Run> runs;
  runs.reserve(b * want);
  int64_t slots = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t nblk = (lens[i] + bs - 1) / bs;
    if (split_blocks > 0) {
      const int64_t parts = (nblk + split_blocks - 1) / split_blocks;
      for (int64_t p = 0; p < parts; ++p)
        runs.push_back({i, p * split_blocks, std::min(nblk, (p + 1) * split_blocks), parts, parts == 1 ? -1 : slots++});
      continue;
    }
    const int64_t parts = std::max<int64_t>(1, std::min(want, int64_t(lens[i]) / kMinPartTokens));
    for (int64_t p = 0; p < parts; ++p)
      runs.push_back({i, nblk * p / parts, nblk * (p + 1) / parts, parts, parts == 1 ? -1 : slots++});
  }
  return runs;
}

void paged_decode_(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                   const Tensor& block_tables, const Tensor& seq_lens, double scale, int64_t split_blocks) {
  check_float(q, "q");
  check(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() &&
            out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
        "q must be [seqs, q_heads, head_dim] with contiguous heads, out a contiguous tensor like it");
  check(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
            k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
        "caches must be contiguous [blocks, block_size, kv_heads, head_dim] of q's dtype");
  check(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous() &&
            block_tables.size(0) == q.size(0),
        "block_tables must be contiguous int32 [seqs, max_blocks]");
  check(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0),
        "seq_lens must be int32 [seqs]");
  check(split_blocks >= 0, "split_blocks must be 0 (split by threads) or a number of blocks");
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  check(k_cache.size(3) == d && hkv > 0 && hq % hkv == 0, "q heads must be a multiple of the cache's kv heads");
  const int64_t mb = block_tables.size(1), g = hq / hkv, qs = q.stride(0);
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const Tensor lens = seq_lens.contiguous();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(lp[i] >= 1 && (lp[i] + bs - 1) / bs <= mb, "kvfleet_cpu: seq_len ", lp[i], " of sequence ", i,
                " does not fit its block table (", mb, " blocks of ", bs, ")");
    for (int64_t j = 0; j < (lp[i] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[i * mb + j] >= 0 && tp[i * mb + j] < nb, "kvfleet_cpu: block id ", tp[i * mb + j],
                  " outside the cache");
  }
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
#ifdef KVFLEET_AMX
    const bool amx = std::is_same_v<scalar_t, c10::BFloat16> && d == 64 && bs % 16 == 0 && kvfleet_amx::amx_permitted();
#else
    const bool amx = false;
#endif
    const std::vector<Run> runs = plan_runs(lp, b, bs, split_blocks);
    const int64_t n = int64_t(runs.size()), stride = hq * d + 2 * hq;
    const int64_t slots = n - std::count_if(runs.begin(), runs.end(), [](const Run& r) { return r.slot < 0; });
    std::unique_ptr<float[]> partials(new float[slots * stride]);  // none while every sequence stays whole
    auto partial = [&](float* base) { return Partial{base, base + hq * d, base + hq * d + hq}; };
    at::parallel_for(0, n, 1, [&](int64_t s, int64_t e) {
      std::vector<float> work, res(hq * d), own(stride);
#ifdef KVFLEET_AMX
      if (amx) kvfleet_amx::configure_tiles();
#endif
      auto run_len = [&](const Run& run) { return std::min<int64_t>(lp[run.seq], run.last * bs) - run.first * bs; };
      for (int64_t r = s; r < e; ++r) {
        const Run& run = runs[r];
        const int64_t len = run_len(run);
        RunFeed next;  // the next run's keys and values on their way while this one computes
        if (r + 1 < e)
          next = RunFeed(kp, vp, tp + runs[r + 1].seq * mb + runs[r + 1].first, run_len(runs[r + 1]), bs, hkv * d);
        const Partial part = partial(run.slot < 0 ? own.data() : partials.get() + run.slot * stride);
        decode_part(qp + run.seq * qs, kp, vp, tp + run.seq * mb + run.first, len, bs, hkv, g, d, float(scale), part,
                    work, amx, next);
        if (run.slot < 0) merge_parts(&part, 1, hq, d, op + run.seq * hq * d, res.data());
      }
#ifdef KVFLEET_AMX
      if (amx) _tile_release();
#endif
    });
    std::vector<float> res(hq * d);
    std::vector<Partial> parts;
    for (int64_t r = 0; r < n; r += runs[r].parts) {  // the split sequences, their runs side by side
      if (runs[r].parts == 1) continue;
      parts.clear();
      for (int64_t p = 0; p < runs[r].parts; ++p) parts.push_back(partial(partials.get() + runs[r + p].slot * stride));
      merge_parts(parts.data(), runs[r].parts, hq, d, op + runs[r].seq * hq * d, res.data());
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()", &write_kv);
  m.def("paged_decode_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int split_blocks=0) -> ()",
        &paged_decode_);
}
