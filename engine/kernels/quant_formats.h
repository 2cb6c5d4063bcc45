// The packed weight formats of the tile GEMM (quant_gemm.cpp): how one chunk of 16 columns x 32 inputs is stored
// and dequantized into an AMX B tile of bf16 (16 rows of input pairs x 16 columns x 2 inputs), portably and,
// with AVX-512 BF16, in registers. Q4 and Q8 hold the checkpoint's 4/8-bit groups; B16 holds bf16 weights
// already in tile order (its "dequantization" is a copy), so that bf16 checkpoints without exact groups
// multiply through the same kernel (the batch-invariant projections of --deterministic).
#pragma once

#include <c10/util/Half.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVFLEET_DPBF16 1  // AVX-512 BF16 dot products (vdpbf16ps): the path for CPUs without AMX
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace kvfleet_quant {

constexpr int64_t kCols = 16;   // columns per n-block (one AMX tile's width in float32)
constexpr int64_t kGroup = 32;  // inputs per scale group (one AMX tile row of bf16)

inline uint16_t round_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The formats: a chunk's bytes and scales, and the chunk dequantized as an AMX B tile (16 rows of
// input pairs x 16 columns x 2 inputs, bf16), portably and (where AMX is compiled) with AVX-512.
struct Q4 {
  using Q = uint8_t;
  static constexpr int64_t kChunkBytes = kCols * kGroup / 2, kScales = 32, kRowBytes = 16;
  static constexpr const char* kName = "q4";
  static void dequant_portable(const uint8_t* q, const c10::Half* sm, uint16_t* dst) {
    for (int64_t r = 0; r < 16; ++r)
      for (int64_t i = 0; i < 16; ++i) {
        const uint8_t byte = q[r * 16 + i];
        const int64_t col_a = i / 2, col_b = 8 + i / 2;
        dst[r * 32 + i] = round_bf16(float(byte & 0xF) * float(sm[col_a]) + float(sm[16 + col_a]));
        dst[r * 32 + 16 + i] = round_bf16(float(byte >> 4) * float(sm[col_b]) + float(sm[16 + col_b]));
      }
  }
#ifdef KVFLEET_DPBF16
  // One chunk's rows as bf16 registers (a row: one input pair for the 16 columns, vdpbf16ps' operand order).
  struct Rows {
    const uint8_t* q;
    __m512 sa, sb, ma, mb, levels;
    Rows() = default;
    Rows(const uint8_t* q_, const c10::Half* sm) : q(q_) {
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + 16)));
      const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
      const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
      sa = _mm512_permutexvar_ps(lo_cols, s), sb = _mm512_permutexvar_ps(hi_cols, s);
      ma = _mm512_permutexvar_ps(lo_cols, m), mb = _mm512_permutexvar_ps(hi_cols, m);
      // float(0..15), looked up by each lane's low 4 bits (a permute instead of mask + convert)
      levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    }
    __m512bh row(int r) const {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * 16)));
      // s * q is exact in float32 (11-bit s times 4-bit q), so the fma rounds once, like s * q + m does
      const __m512 wa = _mm512_fmadd_ps(_mm512_permutexvar_ps(b, levels), sa, ma);
      const __m512 wb = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), levels), sb, mb);
      return _mm512_cvtne2ps_pbh(wb, wa);
    }
  };
  static void dequant(const uint8_t* q, const c10::Half* sm, uint16_t* dst) {
    const Rows rows(q, sm);
    for (int r = 0; r < 16; ++r) _mm512_store_si512(reinterpret_cast<__m512i*>(dst + r * 32), (__m512i)rows.row(r));
  }
#endif
};

struct Q8 {
  using Q = int8_t;
  static constexpr int64_t kChunkBytes = kCols * kGroup, kScales = 16, kRowBytes = 32;
  static constexpr const char* kName = "q8";
  static void dequant_portable(const int8_t* q, const c10::Half* d, uint16_t* dst) {
    for (int64_t e = 0; e < 512; ++e) dst[e] = round_bf16(float(q[e]) * float(d[(e % 32) / 2]));
  }
#ifdef KVFLEET_DPBF16
  struct Rows {  // as Q4::Rows
    const int8_t* q;
    __m512 sa, sb;
    Rows() = default;
    Rows(const int8_t* q_, const c10::Half* d) : q(q_) {
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
      const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
      sa = _mm512_permutexvar_ps(lo_cols, s);
      sb = _mm512_permutexvar_ps(_mm512_add_epi32(lo_cols, _mm512_set1_epi32(8)), s);
    }
    __m512bh row(int r) const {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * 32));
      // d * q is exact in float32 (11-bit d times 8-bit q): one rounding, to bf16
      const __m512 wa = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b))), sa);
      const __m512 wb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1))), sb);
      return _mm512_cvtne2ps_pbh(wb, wa);
    }
  };
  static void dequant(const int8_t* q, const c10::Half* d, uint16_t* dst) {
    const Rows rows(q, d);
    for (int r = 0; r < 16; ++r) _mm512_store_si512(reinterpret_cast<__m512i*>(dst + r * 32), (__m512i)rows.row(r));
  }
#endif
};

struct B16 {
  using Q = uint8_t;  // bytes: a chunk is 512 bf16 values in tile order, no scales
  static constexpr int64_t kChunkBytes = kCols * kGroup * 2, kScales = 0, kRowBytes = 64;
  static constexpr const char* kName = "bf16";
  static void dequant_portable(const uint8_t* q, const c10::Half*, uint16_t* dst) { std::memcpy(dst, q, kChunkBytes); }
#ifdef KVFLEET_DPBF16
  struct Rows {
    const uint8_t* q;
    Rows() = default;
    Rows(const uint8_t* q_, const c10::Half*) : q(q_) {}
    __m512bh row(int r) const { return (__m512bh)_mm512_loadu_si512(q + r * 64); }
  };
  static void dequant(const uint8_t* q, const c10::Half*, uint16_t* dst) { std::memcpy(dst, q, kChunkBytes); }
#endif
};

}  // namespace kvfleet_quant
