// Helpers shared by the fused CPU kernels (layer_ops.cpp, attention_ops.cpp): float32 conversion of bf16 or
// float32 rows, argument checks with kvfleet_cpu's error prefix, dtype dispatch and a vectorizable exp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvfleet_cpu {

using at::Tensor;

inline void to_f32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_f32(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = uint32_t(s[i]) << 16;
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {  // from_f32's rounding: to nearest even, NaN stays NaN
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

inline __m512 exp512(__m512 x) {
  // fast_exp's arithmetic (below), 16 lanes at a time: 2^n * e^r, |r| <= ln(2)/2, Taylor to r^7; 0 below e^-70
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
  return _mm512_maskz_scalef_ps(~tiny, p, n);  // p * 2^n, exact (n is whole, the result normal)
}
#endif

inline void from_f32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void from_f32(const float* src, c10::BFloat16* dst, int64_t n) {
  // round to nearest even, NaN stays NaN (what c10::BFloat16's constructor does)
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b = s[i];
    uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    d[i] = ((b & 0x7FFFFFFFu) > 0x7F800000u) ? uint16_t(0x7FC0) : uint16_t(rounded);
  }
}

// Asks for the cache line at p to be brought into L1 (Level 1) or L2 (Level 2) soon. An asm statement, not
// __builtin_prefetch: a C++ compiler may delete a loop whose only effect is __builtin_prefetch (it assumes
// such a loop terminates and does nothing), and GCC 12 does, silently, for loops with run-time bounds.
template <int Level>
inline void prefetch_line(const void* p) {
#if defined(__x86_64__)
  static_assert(Level == 1 || Level == 2, "prefetch into L1 or L2");
  if constexpr (Level == 1) {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  }
#else
  __builtin_prefetch(p, 0, Level == 1 ? 3 : 2);
#endif
}

inline void check(bool ok, const char* msg) { TORCH_CHECK(ok, "kvfleet_cpu: ", msg); }

inline void check_float(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "kvfleet_cpu: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, "kvfleet_cpu: ", name,
              " must be bfloat16 or float32, got ", t.scalar_type());
}

// Runs f(scalar) with a value of the tensor's element type (bf16 or float32).
template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  if (t == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    f(float{});
  }
}

// exp(x) to about 1 ulp from arithmetic alone, so loops calling it vectorize (std::exp does not without
// -ffast-math): 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r by its Taylor series to r^7;
// 0 below e^-70 (negligible next to the softmax maximum's 1, and it keeps denormals out).
inline float fast_exp(float x) {
  const bool tiny = x < -70.f;  // 0 below e^-70: no denormal products downstream (they are slow on x86)
  x = std::min(std::max(x, -70.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? 0.f : p * scale;
}

}  // namespace kvfleet_cpu
