// LoRA products of a decode step in one call per projection, registered as torch.ops.kvfleet_cpu.lora_add_:
//
//   lora_add_(y, x, at, bs, ranks, row_slots)
//       y[t, part p] += (x[t] @ at[p, s, :r].T) @ bs[p][s * R : s * R + r]   for each row t with s = row_slots[t] >= 0
//
// at [parts, slots, R, in] holds every slot's A (zero-padded to R rows per part), bs[p] [slots * R, size of
// part p] its scaled B^T, ranks [slots, parts] the rank r of each slot's part (0: not targeted): only those
// rows and columns are read. Rows are grouped by slot and taken up to TILE at a time, so a slot's weights are
// read once per TILE rows. x @ A^T as dot products over the whole input row (long vector loops); the B side
// adds row r of B^T, scaled by the row's r-th product, to the output row. Float32 sums, one rounding per
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

template <typename T>
inline float dot(const float* x, const T* a, int64_t n) {
  float acc = 0.f;
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += x[i] * a[i];
  } else {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(a);
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = uint32_t(bits[i]) << 16;
      float v;
      std::memcpy(&v, &u, sizeof(v));
      acc += x[i] * v;
    }
  }
  return acc;
}

template <typename T>
void lora_rows(const Work& w, T* yp, int64_t ys, const T* xp, int64_t xs, const T* atp, const int64_t* ranks,
               const std::vector<const T*>& bps, const std::vector<int64_t>& sizes, int64_t in, int64_t slots,
               int64_t R) {
  const int64_t parts = int64_t(sizes.size()), n = w.n;
  std::vector<float> xrow(n * in), xa(R * TILE), brow, out, yrow;
  for (int64_t k = 0; k < n; ++k) to_f32(xp + w.rows[k] * xs, xrow.data() + k * in, in);
  int64_t off = 0;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t size = sizes[p], r_used = ranks[w.slot * parts + p];
    if (r_used > 0) {
      const T* a = atp + (p * slots + w.slot) * R * in;
      for (int64_t r = 0; r < r_used; ++r)
        for (int64_t k = 0; k < n; ++k) xa[r * TILE + k] = dot(xrow.data() + k * in, a + r * in, in);
      const T* b = bps[p] + w.slot * R * size;
      brow.resize(size);
      out.assign(n * size, 0.f);
      for (int64_t r = 0; r < r_used; ++r) {
        to_f32(b + r * size, brow.data(), size);  // once for the tile's rows
        for (int64_t k = 0; k < n; ++k) {
          const float c = xa[r * TILE + k];
          float* o = out.data() + k * size;
#pragma omp simd
          for (int64_t j = 0; j < size; ++j) o[j] += c * brow[j];
        }
      }
      yrow.resize(size);
      for (int64_t k = 0; k < n; ++k) {
        T* y = yp + w.rows[k] * ys + off;
        to_f32(y, yrow.data(), size);
        const float* o = out.data() + k * size;
#pragma omp simd
        for (int64_t j = 0; j < size; ++j) yrow[j] += o[j];
        from_f32(yrow.data(), y, size);
      }
    }
    off += size;
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
