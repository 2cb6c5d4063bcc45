// Reading a sequence's paged K/V and its attention scores, for attention_ops.cpp: prefetching the next cache
// block, visiting a sequence's tokens through its block table, and the scores of one query token against
// every key (AVX-512 with the group's queries in registers; AMX tiles for bf16 with head_dim 64).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "cpu_common.h"

namespace kvfleet_cpu {

// Asks for the first `span` elements of each of a cache block's bs rows to be in cache soon: blocks of a
// sequence sit anywhere in the cache, so the hardware prefetchers cannot see the next one coming.
template <typename T>
inline void prefetch_block(const T* block, int64_t bs, int64_t row_elems, int64_t span) {
  const char* p = reinterpret_cast<const char*>(block);
  const int64_t bytes = span * int64_t(sizeof(T)), stride = row_elems * int64_t(sizeof(T));
  for (int64_t o = 0; o < bs; ++o)
    for (int64_t line = 0; line < bytes; line += 64) prefetch_line<1>(p + o * stride + line);
}

// While block bi of a sequence is read: asks for the `span` elements at `base` (a head's offset into the cache)
// of each row of the block two ahead (at the first block, of the next two too). Blocks sit anywhere in the
// cache; this made the AVX-512 BF16 decode 1.3-1.6x faster on cold caches.
template <typename T>
inline void prefetch_ahead(const T* base, const int32_t* table, int64_t bi, int64_t nblk, int64_t bs,
                           int64_t row_elems, int64_t span) {
  for (int64_t ahead = bi == 0 ? 1 : 2; ahead <= 2 && bi + ahead < nblk; ++ahead)
    prefetch_block(base + int64_t(table[bi + ahead]) * bs * row_elems, bs, row_elems, span);
}

// The K and V blocks of a thread's next run (every head, in table order, up to kBlocks blocks), asked for into
// L2 a few lines at a time while the current run computes (`feed` from its loops, `drain` at its end), so that a
// run starts on keys already there instead of one cache miss after another: the hardware prefetchers see neither
// the jump to another sequence nor its scattered blocks. Asked for all at once, the lines stall the core until
// they arrive, and the run's arithmetic waits behind them.
struct RunFeed {
  static constexpr int kBlocks = 24;
  const char* k[kBlocks];
  const char* v[kBlocks];
  int64_t bytes[kBlocks];
  int n = 0, at = 0;
  int64_t line = 0;

  RunFeed() = default;
  template <typename T>
  RunFeed(const T* kc, const T* vc, const int32_t* table, int64_t len, int64_t bs, int64_t row_elems) {
    const int64_t nblk = std::min<int64_t>((len + bs - 1) / bs, kBlocks);
    for (n = 0; n < nblk; ++n) {
      const int64_t off = int64_t(table[n]) * bs * row_elems;
      k[n] = reinterpret_cast<const char*>(kc + off);
      v[n] = reinterpret_cast<const char*>(vc + off);
      bytes[n] = std::min(bs, len - n * bs) * row_elems * int64_t(sizeof(T));
    }
  }
  // The next `lines` lines of K and as many of V.
  void feed(int64_t lines) {
    for (; lines > 0 && at < n; --lines) {
      prefetch_line<2>(k[at] + line);
      prefetch_line<2>(v[at] + line);
      if ((line += 64) >= bytes[at]) line = 0, ++at;
    }
  }
  void drain() { feed(INT64_MAX); }
};
constexpr int64_t kFeedPerKeys = 16;  // lines fed per 16 keys' scores of one kv head
constexpr int64_t kFeedPerPair = 2;   // per pair of V rows of one kv head

// Calls f(row, t) for the sequence's tokens t = 0 .. len-1 in order, row pointing at token t's entry in a
// paged cache ([blocks, block_size, row_elems]) plus `offset` elements; blocks come from `table`. Nothing is
// prefetched: the engine hands a sequence consecutive blocks, which the hardware prefetchers follow, and
// asking for the next block's rows measured 3-5% slower at 2,600 keys (the prefetch loop that was here never
// reached the binary: GCC deleted it, see prefetch_line).
template <typename T, typename F>
inline void for_each_token(const T* cache, const int32_t* table, int64_t len, int64_t bs, int64_t row_elems,
                           int64_t offset, F&& f) {
  const int64_t nblk = (len + bs - 1) / bs;
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const T* block = cache + int64_t(table[bi]) * bs * row_elems;
    const int64_t n = std::min(bs, len - bi * bs);
    for (int64_t o = 0; o < n; ++o) f(block + o * row_elems + offset, bi * bs + o);
  }
}

#ifdef __AVX512F__
// Scores of one sequence for kv head h with head_dim D (a multiple of 16) and G query heads per kv head:
// dst[j * len + t] = scale * q_j . k_t. The G queries stay in registers while the rows stream by.
template <int D, int G, typename T>
void scores_avx512(const T* q, const T* kc, const int32_t* table, int64_t len, int64_t bs, int64_t hkv, int64_t h,
                   float scale, float* dst) {
  constexpr int V = D / 16;
  __m512 qv[G][V];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < V; ++v) qv[j][v] = _mm512_mul_ps(load16(q + (h * G + j) * D + v * 16), _mm512_set1_ps(scale));
  for_each_token(kc, table, len, bs, hkv * D, h * D, [&](const T* row, int64_t t) {
    __m512 k[V];
    for (int v = 0; v < V; ++v) k[v] = load16(row + v * 16);
    for (int j = 0; j < G; ++j) {
      __m512 a = _mm512_mul_ps(qv[j][0], k[0]);
      for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(qv[j][v], k[v], a);
      dst[j * len + t] = _mm512_reduce_add_ps(a);
    }
  });
}

#ifdef __AVX512BF16__
// Lane i of the result: the sum of the 16 lanes of a[i] (a tree of shuffles and adds, then one permute).
inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter q of c[i]: key 4i + q, over 4 lanes
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // lane 4q + m of e holds key q + 4m
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, e);
}

// The scores of scores_avx512 for bf16 with AVX-512 BF16 dot products (CPUs without AMX): per query and run
// of up to 16 keys of a block, each key's products summed pairwise in bf16 x bf16 -> float32 lanes
// (VDPBF16PS), the 16 keys' lanes summed by one tree into one register of scores. No conversion of K.
template <int D, int G>
void scores_dpbf16(const c10::BFloat16* q, const c10::BFloat16* kc, const int32_t* table, int64_t len, int64_t bs,
                   int64_t hkv, int64_t h, float scale, float* dst, RunFeed& next) {
  constexpr int V = D / 32;
  const uint16_t* qh = reinterpret_cast<const uint16_t*>(q) + h * G * D;
  const uint16_t* k = reinterpret_cast<const uint16_t*>(kc);
  const int64_t row_elems = hkv * D, nblk = (len + bs - 1) / bs;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const uint16_t* block = k + int64_t(table[bi]) * bs * row_elems + h * D;
    const int64_t in_block = std::min(bs, len - bi * bs);
    prefetch_ahead(k + h * D, table, bi, nblk, bs, row_elems, D);
    for (int64_t o0 = 0; o0 < in_block; o0 += 16) {
      next.feed(kFeedPerKeys);
      const int n = int(std::min<int64_t>(16, in_block - o0));
      const int64_t t0 = bi * bs + o0;
      for (int j = 0; j < G; ++j) {
        __m512bh qv[V];
        for (int v = 0; v < V; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(qh + j * D + v * 32);
        __m512 a[16];
        for (int i = 0; i < 16; ++i) {
          a[i] = _mm512_setzero_ps();
          if (i < n) {
            const uint16_t* row = block + (o0 + i) * row_elems;
            for (int v = 0; v < V; ++v) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(row + v * 32), qv[v]);
          }
        }
        _mm512_mask_storeu_ps(dst + j * len + t0, __mmask16((1u << n) - 1), _mm512_mul_ps(sum_lanes16(a), sv));
      }
    }
  }
}
#endif  // __AVX512BF16__

#ifdef KVFLEET_AMX
// The same scores for bf16, head_dim 64, block_size a multiple of 16, every kv head (up to 16 / G at a
// time), on AMX tiles: each 16-key tile of a block is loaded straight from the cache as 16 x 32 halves per
// kv head and multiplied with all the group's queries (the columns of two B tiles, dims 0-31 and 32-63);
// the columns of the key's own head are kept. bf16 products, float32 sums, then scaled. Keys are read
// once, in cache order, the next block prefetched. Tiles: 0-2 sums per head, 3, 4 queries, 5-7 keys.
template <int G>
void scores_amx(const c10::BFloat16* q, const c10::BFloat16* kc, const int32_t* table, int64_t len, int64_t bs,
                int64_t hkv, float scale, float* sc) {
  constexpr int D = 64, HG = std::min(3, 16 / G);  // kv heads per pass: one sum tile each, HG * G <= 16 columns
  const uint16_t* k = reinterpret_cast<const uint16_t*>(kc);
  const int64_t row_elems = hkv * D, stride = row_elems * 2, tiles = (len + 15) / 16;
  auto keys = [&](int64_t tile) {  // the tile's first row; rows past len are read (inside the block), never used
    const int64_t first = tile * 16;
    return k + (int64_t(table[first / bs]) * bs + first % bs) * row_elems;
  };
  alignas(64) uint16_t qt[2][16][32];  // VNNI: [dims half][dim pair][query column][2]
  alignas(64) float c[HG][16][16];
  for (int64_t h0 = 0; h0 < hkv; h0 += HG) {
    const int heads = int(std::min<int64_t>(HG, hkv - h0));
    std::memset(qt, 0, sizeof(qt));
    const uint16_t* qh = reinterpret_cast<const uint16_t*>(q) + h0 * G * D;
    for (int j = 0; j < heads * G; ++j)
      for (int d = 0; d < D; ++d) qt[d / 32][(d % 32) / 2][j * 2 + d % 2] = qh[j * D + d];
    _tile_loadd(3, qt[0], 64);
    _tile_loadd(4, qt[1], 64);
    for (int64_t tile = 0; tile < tiles; ++tile) {
      if (tile + 1 < tiles) prefetch_block(keys(tile + 1), 16, row_elems, row_elems);
      const uint16_t* kt = keys(tile) + h0 * D;
      _tile_zero(0);
      _tile_loadd(5, kt, stride);
      _tile_loadd(6, kt + 32, stride);
      _tile_dpbf16ps(0, 5, 3);
      _tile_dpbf16ps(0, 6, 4);
      if (heads > 1) {
        _tile_zero(1);
        _tile_loadd(7, kt + D, stride);
        _tile_dpbf16ps(1, 7, 3);
        _tile_loadd(5, kt + D + 32, stride);
        _tile_dpbf16ps(1, 5, 4);
      }
      if (heads > 2) {
        _tile_zero(2);
        _tile_loadd(6, kt + 2 * D, stride);
        _tile_dpbf16ps(2, 6, 3);
        _tile_loadd(7, kt + 2 * D + 32, stride);
        _tile_dpbf16ps(2, 7, 4);
      }
      _tile_stored(0, c[0], 64);
      if (heads > 1) _tile_stored(1, c[1], 64);
      if (heads > 2) _tile_stored(2, c[2], 64);
      const int64_t t0 = tile * 16, n = std::min<int64_t>(16, len - t0);
      for (int hh = 0; hh < heads; ++hh)
        for (int g = 0; g < G; ++g) {
          const int col = hh * G + g;
          float* dst = sc + ((h0 + hh) * G + g) * len + t0;
          for (int64_t r = 0; r < n; ++r) dst[r] = c[hh][r][col] * scale;
        }
    }
  }
}
#endif  // KVFLEET_AMX
#endif  // __AVX512F__

}  // namespace kvfleet_cpu
