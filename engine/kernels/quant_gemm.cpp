// Group-quantized weights from GGUF checkpoints times bf16 activations, registered as torch.ops.kvfleet_cpu.*:
//   Q4 (Q4_1, and Q4_0 groups spanning all 16 levels): w = s * q + m, q in 0..15, float16 s and m per 32 inputs
//   Q8 (Q8_0): w = d * q, q in -128..127, float16 d per 32 inputs
//
//   q4_linear(x, qweight, scales, bias?, fast=True, float_out=False) -> out
//   q8_linear(x, qweight, scales, bias?, fast=True, float_out=False) -> out
//       out[M, N] = x[M, K] @ dequant(qweight)^T (+ bias), bf16 (float_out: the float32 sums, unrounded);
//       fast=False: the portable loops
//   q4_dequant(qweight, scales) -> w, q8_dequant(...)   the bf16 weight [N, K] the kernel multiplies with
//   quant_path() -> str    what the *_linear ops run on here: "amx" (tiles), "avx512_bf16" (vdpbf16ps, CPUs
//                          without AMX) or "portable"
//
// Decode steps are bound by reading weights from memory; packed, Q4 is 0.625 bytes per weight and Q8
// 1.03 instead of bf16's 2. Each 16-column x 32-input chunk is dequantized in registers to exactly the bf16
// value of the checkpoint's weight (s * q and d * q are exact in float32, so s * q + m rounds once, as the
// float32 value did; then round-to-nearest-even to bf16) and multiplied on AMX tiles (TDPBF16PS) or with
// AVX-512 BF16 dot products (VDPBF16PS): bf16 products, float32 sums, so the result is the bf16 model's
// matmul, read from a third (half) of the bytes.
//
// Packed layouts (engine/model/quantized.py builds them); a chunk's row r holds inputs 2r and 2r+1 of its
// group for 16 columns, in AMX B-tile order (element e: column e/2, input 2r + e%2):
//   Q4: qweight uint8 [N/16, K/32, 16, 16]: byte i = q[col i/2][2r + i%2] | q[8 + i/2][2r + i%2] << 4
//       scales float16 [N/16, K/32, 2, 16]: s then m of the chunk's 16 columns
//   Q8: qweight int8 [N/16, K/32, 16, 32]: element e as above; scales float16 [N/16, K/32, 16]: d
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "amx.h"
#include "cpu_common.h"
#include "quant_formats.h"  // defines KVFLEET_DPBF16 where AVX-512 BF16 is compiled

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;
using namespace kvfleet_quant;

void check(bool ok, const char* msg) { TORCH_CHECK(ok, "kvfleet_cpu.quant: ", msg); }

// Chunks prefetched (into L2) ahead of the dequantization: the packed weights stream from memory once per step,
// and without it a core waited on them (loadtest.cpu_kernels_bench projections, cold weights, alternating builds:
// 1.3-1.5x at 1-8 rows, 1.2-1.3x at 16-32, 1.04x at 64).
constexpr int64_t kAhead = 8;

#ifdef KVFLEET_AMX
using kvfleet_amx::amx_permitted;
using kvfleet_amx::configure_tiles;

// Where the activations of 16-row block mb are: x itself (row stride k) or, for a last partial block, a
// zero-padded copy of its rows packed per group ([kcs][16 x 32], row stride 32).
struct ActTiles {
  const uint16_t* x;
  int64_t k, full_blocks;
  const uint16_t* tail;
  const uint16_t* at(int64_t mb, int64_t kc) const {
    return mb < full_blocks ? x + mb * 16 * k + kc * kGroup : tail + kc * 512;
  }
  int64_t stride(int64_t mb) const { return mb < full_blocks ? k * 2 : 64; }
};

// The n-blocks [nb0, nb1) of one thread, two at a time (a 2 x 2 block of tiles: each tile load feeds
// one multiply). While a pair is multiplied, the next pair's chunks are dequantized in between its tile
// instructions, so the vector units dequantize while the tile unit multiplies. c: [2][mp x 16] float32.
// Tiles: 0-3 the 2 x 2 float32 sums, 4 and 6 two 16-row activation tiles, 5 and 7 two weight chunks.
template <typename F, typename Store>
void nblocks_amx(const ActTiles& a, int64_t mblocks, int64_t kcs, const typename F::Q* qd, const c10::Half* sd,
                 int64_t nb0, int64_t nb1, uint16_t* wbuf, float* c, Store&& store) {
  const int64_t pair_chunks = 2 * kcs, mp = mblocks * 16;
  auto dequant = [&](int64_t nb, int64_t i, uint16_t* w) {  // chunk i of the pair starting at n-block nb
    const int64_t chunk = nb * kcs + i;  // the pair's chunks are consecutive: (nb, 0..kcs), (nb + 1, 0..kcs)
    const char* ahead = reinterpret_cast<const char*>(qd + (chunk + kAhead) * F::kChunkBytes);
    for (int64_t b = 0; b < F::kChunkBytes; b += 64) kvfleet_cpu::prefetch_line<2>(ahead + b);
    if constexpr (F::kScales > 0) kvfleet_cpu::prefetch_line<2>(sd + (chunk + kAhead) * F::kScales);
    F::dequant(qd + chunk * F::kChunkBytes, sd + chunk * F::kScales, w + i * 512);
  };
  const int64_t first = std::min<int64_t>(2, nb1 - nb0) * kcs;
  for (int64_t i = 0; i < first; ++i) dequant(nb0, i, wbuf);
  for (int64_t nb = nb0, parity = 0; nb < nb1; nb += 2, parity ^= 1) {
    const uint16_t* w0 = wbuf + parity * pair_chunks * 512;
    const uint16_t* w1 = nb + 1 < nb1 ? w0 + kcs * 512 : nullptr;
    uint16_t* next = wbuf + (parity ^ 1) * pair_chunks * 512;
    const int64_t next_chunks = nb + 2 < nb1 ? std::min<int64_t>(2, nb1 - nb - 2) * kcs : 0;
    const int64_t iters = (mblocks + 1) / 2 * kcs;
    int64_t done = 0, it = 0;
    for (int64_t mb = 0; mb < mblocks; mb += 2) {
      const bool two_m = mb + 1 < mblocks, two_n = w1 != nullptr;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const int64_t s0 = a.stride(mb), s1 = two_m ? a.stride(mb + 1) : 0;
      for (int64_t kc = 0; kc < kcs; ++kc, ++it) {
        _tile_loadd(5, w0 + kc * 512, 64);
        _tile_loadd(4, a.at(mb, kc), s0);
        if (two_n) _tile_loadd(7, w1 + kc * 512, 64);
        if (two_m) _tile_loadd(6, a.at(mb + 1, kc), s1);
        _tile_dpbf16ps(0, 4, 5);
        if (two_n) _tile_dpbf16ps(1, 4, 7);
        if (two_m) _tile_dpbf16ps(2, 6, 5);
        if (two_m && two_n) _tile_dpbf16ps(3, 6, 7);
        for (const int64_t target = (it + 1) * next_chunks / iters; done < target; ++done) dequant(nb + 2, done, next);
      }
      float* c0 = c + mb * 16 * kCols;
      float* c1 = c + mp * kCols + mb * 16 * kCols;
      _tile_stored(0, c0, 64);
      if (two_n) _tile_stored(1, c1, 64);
      if (two_m) _tile_stored(2, c0 + 256, 64);
      if (two_m && two_n) _tile_stored(3, c1 + 256, 64);
    }
    for (; done < next_chunks; ++done) dequant(nb + 2, done, next);
    store(nb, c);
    if (w1) store(nb + 1, c + mp * kCols);
  }
}

#endif

#ifdef KVFLEET_DPBF16
// out[r, 0:16] = c[r] + bias for rows [0, m): rounded to bf16 (nearest even), or kept in float32.
void store_block_avx512(const float* c, int64_t m, const uint16_t* bias, void* out, int64_t n, bool float_out) {
  const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias))), 16))
                        : _mm512_setzero_ps();
  for (int64_t r = 0; r < m; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * kCols), b);
    if (float_out)
      _mm512_storeu_ps(static_cast<float*>(out) + r * n, v);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + r * n), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// The AVX-512 BF16 path (CPUs without AMX): out rows [0, m) for NB n-blocks at a time. Each weight row (AMX B
// order is vdpbf16ps' operand order: a 64-byte row holds one input pair for 16 columns) feeds the dot products of
// R activation rows, their input pair broadcast from x, float32 sums in NB x R registers. The weight rows come
// from `Src`: BufferedRows (chunks dequantized once into a buffer, for any number of rows, R <= 12 at a time) or
// FusedRows (steps of up to kFusedMaxRows rows: each chunk row dequantized in registers, no pass through a
// buffer). Both give the same products in the same order, so the same bits. c: [NB][R x 16], n-block b at
// c + b * c_stride.
constexpr int kRowsPerPass = 12;
constexpr int kFusedMaxRows = 8;

template <int R, int NB, typename Src>
void dot_rows(const uint16_t* x, int64_t k, int64_t kcs, Src src, float* c, int64_t c_stride) {
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int i = 0; i < R; ++i) acc[b][i] = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < kcs; ++kc) {
    src.chunk(kc);
    const uint16_t* xk = x + kc * kGroup;
    for (int p = 0; p < 16; ++p) {
      __m512bh wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = src.row(b, p);
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, xk + i * k + 2 * p, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int b = 0; b < NB; ++b) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], xb, wv[b]);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(c + b * c_stride + i * kCols, acc[b][i]);
}

template <int NB, int R, typename Src>
void dot_rows_any(int r, const uint16_t* x, int64_t k, int64_t kcs, const Src& src, float* c, int64_t cs) {
  if constexpr (R > 0) {
    if (r == R) return dot_rows<R, NB>(x, k, kcs, src, c, cs);
    return dot_rows_any<NB, R - 1>(r, x, k, kcs, src, c, cs);
  }
}

// Weight rows of NB n-blocks whose kcs chunks each lie dequantized, one after the other, at w.
struct BufferedRows {
  const uint16_t* w;
  int64_t kcs;
  const uint16_t* wk = nullptr;
  void chunk(int64_t kc) { wk = w + kc * 512; }
  __m512bh row(int b, int p) const { return (__m512bh)_mm512_load_si512(wk + b * kcs * 512 + p * 32); }
};

// Weight rows of the NB n-blocks from nb on, dequantized in registers chunk by chunk (prefetching kAhead ahead).
template <typename F, int NB>
struct FusedRows {
  const typename F::Q* qd;
  const c10::Half* sd;
  int64_t nb, kcs;
  typename F::Rows rows[NB];
  void chunk(int64_t kc) {
    for (int b = 0; b < NB; ++b) {
      const int64_t at = (nb + b) * kcs + kc;
      const char* ahead = reinterpret_cast<const char*>(qd + (at + kAhead) * F::kChunkBytes);
      for (int64_t l = 0; l < F::kChunkBytes; l += 64) kvfleet_cpu::prefetch_line<2>(ahead + l);
      if constexpr (F::kScales > 0) kvfleet_cpu::prefetch_line<2>(sd + (at + kAhead) * F::kScales);
      rows[b] = typename F::Rows(qd + at * F::kChunkBytes, sd + at * F::kScales);
    }
  }
  __m512bh row(int b, int p) const { return rows[b].row(p); }
};

// The n-blocks [nb0, nb1) of one thread for m <= kFusedMaxRows rows, four at a time up to 4 rows (two above:
// the sums must stay in registers); c: [4][m x 16] float32.
template <typename F, typename Store>
void nblocks_fused(const uint16_t* x, int64_t m, int64_t k, int64_t kcs, const typename F::Q* qd,
                   const c10::Half* sd, int64_t nb0, int64_t nb1, float* c, Store&& store) {
  const int r = int(m);
  for (int64_t nb = nb0; nb < nb1;) {
    const int64_t left = nb1 - nb, nbs = left >= 4 && r <= 4 ? 4 : left >= 2 ? 2 : 1;
    if (nbs == 4)
      dot_rows_any<4, 4>(r, x, k, kcs, FusedRows<F, 4>{qd, sd, nb, kcs, {}}, c, m * kCols);
    else if (nbs == 2)
      dot_rows_any<2, kFusedMaxRows>(r, x, k, kcs, FusedRows<F, 2>{qd, sd, nb, kcs, {}}, c, m * kCols);
    else
      dot_rows_any<1, kFusedMaxRows>(r, x, k, kcs, FusedRows<F, 1>{qd, sd, nb, kcs, {}}, c, m * kCols);
    for (int64_t b = 0; b < nbs; ++b) store(nb + b, c + b * m * kCols);
    nb += nbs;
  }
}

// The n-blocks [nb0, nb1) of one thread; wbuf: 2 * kcs chunks, c: [2][m x 16] float32.
template <typename F, typename Store>
void nblocks_dpbf16(const uint16_t* x, int64_t m, int64_t k, int64_t kcs, const typename F::Q* qd,
                    const c10::Half* sd, int64_t nb0, int64_t nb1, uint16_t* wbuf, float* c, Store&& store) {
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const int nbs = int(std::min<int64_t>(2, nb1 - nb));
    for (int64_t i = 0; i < nbs * kcs; ++i) {  // the pair's chunks are consecutive: (nb, 0..kcs), (nb + 1, 0..kcs)
      const char* ahead = reinterpret_cast<const char*>(qd + (nb * kcs + i + kAhead) * F::kChunkBytes);
      for (int64_t b = 0; b < F::kChunkBytes; b += 64) kvfleet_cpu::prefetch_line<2>(ahead + b);
      if constexpr (F::kScales > 0) kvfleet_cpu::prefetch_line<2>(sd + (nb * kcs + i + kAhead) * F::kScales);
      F::dequant(qd + (nb * kcs + i) * F::kChunkBytes, sd + (nb * kcs + i) * F::kScales, wbuf + i * 512);
    }
    for (int64_t r0 = 0; r0 < m; r0 += kRowsPerPass) {
      const int r = int(std::min<int64_t>(kRowsPerPass, m - r0));
      if (nbs == 2)
        dot_rows_any<2, kRowsPerPass>(r, x + r0 * k, k, kcs, BufferedRows{wbuf, kcs}, c + r0 * kCols, m * kCols);
      else
        dot_rows_any<1, kRowsPerPass>(r, x + r0 * k, k, kcs, BufferedRows{wbuf, kcs}, c + r0 * kCols, m * kCols);
    }
    for (int b = 0; b < nbs; ++b) store(nb + b, c + b * m * kCols);
  }
}
#endif  // KVFLEET_DPBF16

bool use_amx() {
#ifdef KVFLEET_AMX
  return amx_permitted();
#else
  return false;
#endif
}

template <typename F>
void check_packed(const Tensor& qweight, const Tensor& scales) {
  constexpr bool q4 = std::is_same_v<F, Q4>;
  check(qweight.device().is_cpu() && qweight.scalar_type() == (q4 ? at::kByte : at::kChar) && qweight.dim() == 4 &&
            qweight.size(2) == 16 && qweight.size(3) == F::kRowBytes && qweight.is_contiguous(),
        q4 ? "qweight must be contiguous uint8 [N/16, K/32, 16, 16]" : "qweight must be contiguous int8 [N/16, K/32, 16, 32]");
  check(scales.scalar_type() == at::kHalf && scales.dim() == (q4 ? 4 : 3) && scales.size(0) == qweight.size(0) &&
            scales.size(1) == qweight.size(1) && scales.size(-1) == 16 && (!q4 || scales.size(2) == 2) &&
            scales.is_contiguous(),
        q4 ? "scales must be contiguous float16 [N/16, K/32, 2, 16] matching qweight"
           : "scales must be contiguous float16 [N/16, K/32, 16] matching qweight");
}

// 64-byte aligned scratch of n elements of T.
template <typename T>
struct Scratch {
  std::unique_ptr<T[]> store;  // not zeroed: every element is written before it is read
  T* data;
  explicit Scratch(int64_t n) : store(new T[n + 64 / sizeof(T)]) {
    data = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(store.get()) + 63) & ~uintptr_t(63));
  }
};

// The portable path: one n-block, plain loops over the dequantized chunks (tests and CPUs without AMX).
void nblock_portable(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, float* c) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < kCols; ++j) {
      float acc = 0.f;
      for (int64_t kk = 0; kk < k; ++kk)
        acc += bf16_to_float(x[r * k + kk]) * bf16_to_float(w[(kk / kGroup) * 512 + (kk % kGroup) / 2 * 32 + j * 2 + kk % 2]);
      c[r * kCols + j] = acc;
    }
}

// out[M, N] = x @ w^T (+ bias) through the chunks of qd (and their scales sd): nbs n-blocks, kcs chunks each.
// Every path computes each output from its own row of x alone, in one fixed order (chunks in turn, input pairs
// in turn, float32 sums; threads split the columns, never the inputs), so a row's result does not depend on the
// other rows of the step or on their number.
template <typename F>
Tensor run_linear(const Tensor& x, const typename F::Q* qd, const c10::Half* sd, int64_t nbs, int64_t kcs,
                  const std::optional<Tensor>& bias, bool fast, bool float_out) {
  check(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be bf16 [M, K]");
  const int64_t n = nbs * kCols, k = kcs * kGroup, m = x.size(0);
  TORCH_CHECK(x.size(1) == k, "kvfleet_cpu.", F::kName, ": x has ", x.size(1), " inputs, the weight ", k);
  if (bias) check(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == n, "bias must be bf16 [N]");
  Tensor out = at::empty({m, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (m == 0) return out;
  const Tensor xc = x.contiguous();
  const uint16_t* xd = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  const uint16_t* bd = bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr<c10::BFloat16>()) : nullptr;
  char* od = static_cast<char*>(out.data_ptr());
  const int64_t osize = out.element_size();
#ifdef KVFLEET_AMX
  if (fast && use_amx()) {
    const int64_t full = m / 16, mblocks = (m + 15) / 16;
    Scratch<uint16_t> tail(kcs * 512);  // the last partial 16-row block, zero-padded, packed per group
    if (full < mblocks) {
      std::memset(tail.data, 0, kcs * 512 * sizeof(uint16_t));
      for (int64_t r = full * 16; r < m; ++r)
        for (int64_t kc = 0; kc < kcs; ++kc) std::memcpy(tail.data + kc * 512 + (r % 16) * 32, xd + r * k + kc * kGroup, 64);
    }
    const ActTiles acts{xd, k, full, tail.data};
    // whole pairs of n-blocks per thread: at most one thread gets a lone last block
    const int64_t pairs = (nbs + 1) / 2;
    at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
      Scratch<uint16_t> w(2 * 2 * kcs * 512);
      Scratch<float> c(2 * mblocks * 16 * kCols);
      configure_tiles();
      nblocks_amx<F>(acts, mblocks, kcs, qd, sd, 2 * p0, std::min(2 * p1, nbs), w.data, c.data,
                  [&](int64_t nb, const float* cb) {
                    store_block_avx512(cb, m, bd ? bd + nb * kCols : nullptr, od + nb * kCols * osize, n, float_out);
                  });
      _tile_release();
    });
    return out;
  }
#endif
#ifdef KVFLEET_DPBF16
  if (fast && m <= kFusedMaxRows) {
    at::parallel_for(0, nbs, 1, [&](int64_t nb0, int64_t nb1) {
      Scratch<float> c(4 * m * kCols);
      nblocks_fused<F>(xd, m, k, kcs, qd, sd, nb0, nb1, c.data, [&](int64_t nb, const float* cb) {
        store_block_avx512(cb, m, bd ? bd + nb * kCols : nullptr, od + nb * kCols * osize, n, float_out);
      });
    });
    return out;
  }
  if (fast) {
    const int64_t pairs = (nbs + 1) / 2;  // whole pairs of n-blocks per thread, as above
    at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
      Scratch<uint16_t> w(2 * kcs * 512);
      Scratch<float> c(2 * m * kCols);
      nblocks_dpbf16<F>(xd, m, k, kcs, qd, sd, 2 * p0, std::min(2 * p1, nbs), w.data, c.data,
                        [&](int64_t nb, const float* cb) {
                          store_block_avx512(cb, m, bd ? bd + nb * kCols : nullptr, od + nb * kCols * osize, n, float_out);
                        });
    });
    return out;
  }
#endif
  at::parallel_for(0, nbs, 1, [&](int64_t nb0, int64_t nb1) {
    Scratch<uint16_t> w(kcs * 512);
    std::vector<float> c(m * kCols);
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      for (int64_t kc = 0; kc < kcs; ++kc)
        F::dequant_portable(qd + (nb * kcs + kc) * F::kChunkBytes, sd + (nb * kcs + kc) * F::kScales, w.data + kc * 512);
      nblock_portable(xd, m, k, w.data, c.data());
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < kCols; ++j) {
          const int64_t col = nb * kCols + j;
          const float v = c[r * kCols + j] + (bd ? bf16_to_float(bd[col]) : 0.f);
          if (float_out)
            reinterpret_cast<float*>(od)[r * n + col] = v;
          else
            reinterpret_cast<uint16_t*>(od)[r * n + col] = round_bf16(v);
        }
    }
  });
  return out;
}

template <typename F>
Tensor quant_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales, const std::optional<Tensor>& bias,
                    bool fast, bool float_out) {
  check_packed<F>(qweight, scales);
  return run_linear<F>(x, static_cast<const typename F::Q*>(qweight.data_ptr()), scales.data_ptr<c10::Half>(),
                       qweight.size(0), qweight.size(1), bias, fast, float_out);
}

// bf16 weights in tile order ([N/16, K/32, 16, 32], engine/model/invariant_linear.py packs them): the same
// kernel as q4_linear and q8_linear, for checkpoints without exact 4/8-bit groups.
Tensor bf16_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, bool fast, bool float_out) {
  check(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 4 && weight.size(2) == 16 &&
            weight.size(3) == 32 && weight.is_contiguous(),
        "weight must be contiguous bf16 [N/16, K/32, 16, 32] in tile order");
  return run_linear<B16>(x, static_cast<const uint8_t*>(weight.data_ptr()), nullptr, weight.size(0), weight.size(1),
                         bias, fast, float_out);
}

template <typename F>
Tensor quant_dequant(const Tensor& qweight, const Tensor& scales) {
  check_packed<F>(qweight, scales);
  const int64_t nbs = qweight.size(0), kcs = qweight.size(1), k = kcs * kGroup;
  Tensor out = at::empty({nbs * kCols, k}, qweight.options().dtype(at::kBFloat16));
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const auto* qd = static_cast<const typename F::Q*>(qweight.data_ptr());
  std::vector<uint16_t> tile(512);
  for (int64_t nb = 0; nb < nbs; ++nb)
    for (int64_t kc = 0; kc < kcs; ++kc) {
      F::dequant_portable(qd + (nb * kcs + kc) * F::kChunkBytes, scales.data_ptr<c10::Half>() + (nb * kcs + kc) * F::kScales,
                          tile.data());
      for (int64_t pr = 0; pr < 16; ++pr)
        for (int64_t j = 0; j < kCols; ++j)
          for (int64_t par = 0; par < 2; ++par)
            od[(nb * kCols + j) * k + kc * kGroup + pr * 2 + par] = tile[pr * 32 + j * 2 + par];
    }
  return out;
}

std::string quant_path() {
  if (use_amx()) return "amx";
#ifdef KVFLEET_DPBF16
  return "avx512_bf16";
#else
  return "portable";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("q4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None, bool fast=True, "
        "bool float_out=False) -> Tensor",
        &quant_linear<Q4>);
  m.def("q8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None, bool fast=True, "
        "bool float_out=False) -> Tensor",
        &quant_linear<Q8>);
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias=None, bool fast=True, bool float_out=False) -> Tensor",
        &bf16_linear);
  m.def("q4_dequant(Tensor qweight, Tensor scales) -> Tensor", &quant_dequant<Q4>);
  m.def("q8_dequant(Tensor qweight, Tensor scales) -> Tensor", &quant_dequant<Q8>);
  m.def("quant_path() -> str", &quant_path);
}
