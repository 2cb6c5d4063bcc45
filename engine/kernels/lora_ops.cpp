// LoRA products of a decode step in one call per projection, registered as torch.ops.kvfleet_cpu.lora_add_:
//
//   lora_add_(y, x, at, bs, ranks, row_slots)
//       y[t, part p] += (x[t] @ at[p, s, :r].T) @ bs[p][s * R : s * R + r]   for each row t with s = row_slots[t] >= 0
//
// at [parts, slots, R, in] holds every slot's A (zero-padded to R rows per part), bs[p] [slots * R, size of
// part p] its scaled B^T, ranks [slots, parts] the rank r of each slot's part (0: not targeted): only those
// rows and columns are read. Rows are grouped by slot and taken up to TILE at a time, so a slot's weights are
// read once per TILE rows. x @ A^T as dot products over the input row, 4 rows of A by the tile's rows at once
// (independent vector sums); the B side L output columns at a time, summed over the rank in registers. Float32 sums, one rounding per
// output element (bf16 y: its value plus the product, rounded once). The torch fallback (engine/lora/layers.py)
// multiplies every row with every slot's A (the same tensor, viewed [in, parts * slots * R]) and masks; this
// reads each row's own slot only.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace kvfleet_cpu;

constexpr int64_t TILE = 4;  // rows of one slot multiplied together


struct Work {
  int64_t slot;
  int64_t rows[TILE];
  int64_t n;
};

constexpr int64_t L = 16;  // floats per vector chunk (one AVX-512 register, two AVX2 ones)

template <typename T>
inline float to_float(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const uint32_t u = uint32_t(reinterpret_cast<const uint16_t&>(v)) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
}

template <typename T>
inline void load_chunk(const T* src, float* dst) {  // L elements to float32
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) dst[l] = to_float(src[l]);
}

// x . a over the inputs from `from` on (past the last whole chunk), one at a time
template <typename T>
inline float dot_tail(const float* x, const T* a, int64_t from, int64_t in) {
  float sum = 0.f;
  for (int64_t t = from; t < in; ++t) sum += x[t] * to_float(a[t]);
  return sum;
}

// the B side's columns from j on (past the last whole chunk), one at a time
template <int64_t N, typename T>
void b_tail(const float* xa, const T* b, int64_t r_used, int64_t size, int64_t j, T* const* y) {
  for (; j < size; ++j)
    for (int64_t k = 0; k < N; ++k) {
      float sum = to_float(y[k][j]);
      for (int64_t r = 0; r < r_used; ++r) sum += xa[r * TILE + k] * to_float(b[r * size + j]);
      from_f32(&sum, y[k] + j, 1);
    }
}

#ifdef __AVX512F__
// xa[r * TILE + k] = x[k] . a[r] for r in [r0, r0 + RB), k < N: N * RB independent vector sums in registers,
// every 16 inputs of a row of A loaded once for the N rows
template <int64_t N, int64_t RB, typename T>
void dots(const float* xrow, const T* a, int64_t in, int64_t r0, float* xa) {
  __m512 acc[N][RB];
  for (int64_t k = 0; k < N; ++k)
    for (int64_t rr = 0; rr < RB; ++rr) acc[k][rr] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + L <= in; i += L) {
    __m512 av[RB];
    for (int64_t rr = 0; rr < RB; ++rr) av[rr] = load16(a + (r0 + rr) * in + i);
    for (int64_t k = 0; k < N; ++k) {
      const __m512 xv = _mm512_loadu_ps(xrow + k * in + i);
      for (int64_t rr = 0; rr < RB; ++rr) acc[k][rr] = _mm512_fmadd_ps(xv, av[rr], acc[k][rr]);
    }
  }
  for (int64_t k = 0; k < N; ++k)
    for (int64_t rr = 0; rr < RB; ++rr) {
      float sum = _mm512_reduce_add_ps(acc[k][rr]);
      sum += dot_tail(xrow + k * in, a + (r0 + rr) * in, i, in);
      xa[(r0 + rr) * TILE + k] = sum;
    }
}

// y[k, j] += sum over r < r_used of xa[r * TILE + k] * b[r, j], 16 columns at a time summed in registers
template <int64_t N, typename T>
void b_side(const float* xa, const T* b, int64_t r_used, int64_t size, T* const* y) {
  int64_t j = 0;
  for (; j + L <= size; j += L) {
    __m512 acc[N];
    for (int64_t k = 0; k < N; ++k) acc[k] = _mm512_setzero_ps();
    for (int64_t r = 0; r < r_used; ++r) {
      const __m512 bv = load16(b + r * size + j);
      for (int64_t k = 0; k < N; ++k) acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(xa[r * TILE + k]), bv, acc[k]);
    }
    for (int64_t k = 0; k < N; ++k) {
      alignas(64) float yv[L];
      _mm512_store_ps(yv, _mm512_add_ps(load16(y[k] + j), acc[k]));
      from_f32(yv, y[k] + j, L);
    }
  }
  b_tail<N>(xa, b, r_used, size, j, y);
}
#else
// the same in portable loops the compiler vectorizes (AVX2 and others): x[k] . a[r] with RB * N sums of L lanes
template <int64_t N, int64_t RB, typename T>
void dots(const float* xrow, const T* a, int64_t in, int64_t r0, float* xa) {
  float acc[N][RB][L] = {};
  float av[RB][L];
  int64_t i = 0;
  for (; i + L <= in; i += L) {
    for (int64_t rr = 0; rr < RB; ++rr) load_chunk(a + (r0 + rr) * in + i, av[rr]);
    for (int64_t k = 0; k < N; ++k)
      for (int64_t rr = 0; rr < RB; ++rr)
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) acc[k][rr][l] += xrow[k * in + i + l] * av[rr][l];
  }
  for (int64_t k = 0; k < N; ++k)
    for (int64_t rr = 0; rr < RB; ++rr) {
      float sum = 0.f;
      for (int64_t l = 0; l < L; ++l) sum += acc[k][rr][l];
      sum += dot_tail(xrow + k * in, a + (r0 + rr) * in, i, in);
      xa[(r0 + rr) * TILE + k] = sum;
    }
}

template <int64_t N, typename T>
void b_side(const float* xa, const T* b, int64_t r_used, int64_t size, T* const* y) {
  float bv[L], acc[N][L], yv[L];
  int64_t j = 0;
  for (; j + L <= size; j += L) {
    for (int64_t k = 0; k < N; ++k)
      for (int64_t l = 0; l < L; ++l) acc[k][l] = 0.f;
    for (int64_t r = 0; r < r_used; ++r) {
      load_chunk(b + r * size + j, bv);
      for (int64_t k = 0; k < N; ++k) {
        const float c = xa[r * TILE + k];
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) acc[k][l] += c * bv[l];
      }
    }
    for (int64_t k = 0; k < N; ++k) {
      to_f32(y[k] + j, yv, L);
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) yv[l] += acc[k][l];
      from_f32(yv, y[k] + j, L);
    }
  }
  b_tail<N>(xa, b, r_used, size, j, y);
}

#endif

template <int64_t N, typename T>
void lora_tile(const Work& w, T* yp, int64_t ys, const T* xp, int64_t xs, const T* atp, const int64_t* ranks,
               const std::vector<const T*>& bps, const std::vector<int64_t>& sizes, int64_t in, int64_t slots,
               int64_t R) {
  const int64_t parts = int64_t(sizes.size());
  std::vector<float> xrow(N * in);
  float xa[TILE * 64 * 4];  // up to R = 256 (lora_add_ checks)
  for (int64_t k = 0; k < N; ++k) to_f32(xp + w.rows[k] * xs, xrow.data() + k * in, in);
  int64_t off = 0;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t size = sizes[p], r_used = ranks[w.slot * parts + p];
    if (r_used > 0) {
      const T* a = atp + (p * slots + w.slot) * R * in;
      int64_t r = 0;
      for (; r + 4 <= r_used; r += 4) dots<N, 4>(xrow.data(), a, in, r, xa);
      for (; r < r_used; ++r) dots<N, 1>(xrow.data(), a, in, r, xa);
      T* y[N];
      for (int64_t k = 0; k < N; ++k) y[k] = yp + w.rows[k] * ys + off;
      b_side<N>(xa, bps[p] + w.slot * R * size, r_used, size, y);
    }
    off += size;
  }
}

template <typename T>
void lora_rows(const Work& w, T* yp, int64_t ys, const T* xp, int64_t xs, const T* atp, const int64_t* ranks,
               const std::vector<const T*>& bps, const std::vector<int64_t>& sizes, int64_t in, int64_t slots,
               int64_t R) {
  switch (w.n) {  // the tile's row count as a constant: its sums stay in registers
    case 1: return lora_tile<1>(w, yp, ys, xp, xs, atp, ranks, bps, sizes, in, slots, R);
    case 2: return lora_tile<2>(w, yp, ys, xp, xs, atp, ranks, bps, sizes, in, slots, R);
    case 3: return lora_tile<3>(w, yp, ys, xp, xs, atp, ranks, bps, sizes, in, slots, R);
    default: return lora_tile<4>(w, yp, ys, xp, xs, atp, ranks, bps, sizes, in, slots, R);
  }
}

void lora_add_(Tensor& y, const Tensor& x, const Tensor& at, at::TensorList bs, const Tensor& ranks,
               const Tensor& row_slots) {
  check_float(y, "y");
  check(x.scalar_type() == y.scalar_type() && at.scalar_type() == y.scalar_type(), "x, at and y must share a dtype");
  check(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
        "x [T, in] and y [T, out] must have contiguous rows");
  const int64_t in = x.size(1), parts = int64_t(bs.size());
  check(at.dim() == 4 && at.is_contiguous() && at.size(0) == parts && at.size(3) == in,
        "at must be contiguous [parts, slots, R, in]");
  const int64_t slots = at.size(1), R = at.size(2);
  check(R <= 256, "ranks above 256 are not supported");
  check(ranks.scalar_type() == at::kLong && ranks.is_contiguous() && ranks.numel() == slots * parts,
        "ranks must be int64 [slots, parts]");
  check(row_slots.scalar_type() == at::kLong && row_slots.dim() == 1 && row_slots.size(0) == x.size(0) &&
            row_slots.is_contiguous(), "row_slots must be int64 [T]");
  const int64_t* rk = ranks.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots * parts; ++i) check(rk[i] >= 0 && rk[i] <= R, "a rank is out of range");
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (const Tensor& b : bs) {
    check(b.scalar_type() == y.scalar_type() && b.dim() == 2 && b.is_contiguous() && b.size(0) == slots * R,
          "each b must be contiguous [slots * R, part size] of y's dtype");
    sizes.push_back(b.size(1));
    total += b.size(1);
  }
  check(total == y.size(1), "the parts' sizes must add up to y's width");
  const int64_t* rs = row_slots.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> by_slot(slots);
  for (int64_t t = 0; t < x.size(0); ++t) {
    check(rs[t] < slots, "a row's slot is out of range");
    if (rs[t] >= 0) by_slot[rs[t]].push_back(t);
  }
  std::vector<Work> work;
  for (int64_t s = 0; s < slots; ++s) {
    for (size_t i = 0; i < by_slot[s].size(); i += TILE) {
      Work w{s, {}, 0};
      for (size_t j = i; j < by_slot[s].size() && w.n < TILE; ++j) w.rows[w.n++] = by_slot[s][j];
      work.push_back(w);
    }
  }
  dispatch(y.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    std::vector<const T*> bps;
    for (const Tensor& b : bs) bps.push_back(b.data_ptr<T>());
    T* yp = y.data_ptr<T>();
    const T* xp = x.data_ptr<T>();
    const T* atp = at.data_ptr<T>();
    at::parallel_for(0, int64_t(work.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        lora_rows(work[i], yp, y.stride(0), xp, x.stride(0), atp, rk, bps, sizes, in, slots, R);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor at, Tensor[] bs, Tensor ranks, Tensor row_slots) -> ()", &lora_add_);
}
