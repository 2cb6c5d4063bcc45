// A float32 matmul whose every output comes from its own row of x alone, in one fixed order, registered as
// torch.ops.kvfleet_cpu.f32_linear: the batch-invariant projections of float32 models under --deterministic
// (bf16 ones multiply through bf16_linear / q4_linear / q8_linear, quant_gemm.cpp).
//
//   f32_linear(x, weight, bias?) -> out     out[M, N] = x[M, K] @ W^T (+ bias), float32
//       weight: W packed per 16 columns, [N/16, K, 16] (engine/model/invariant_linear.py packs it)
//
// Each output is a chain of multiply-adds over k = 0 .. K-1 in order, whatever M is: rows are taken R at a time
// (R only sets how many accumulators live in registers), and threads split the columns, never the inputs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

using at::Tensor;

constexpr int64_t kCols = 16;
constexpr int kRows = 8;

// rows [0, R) of x times one 16-column block of packed weights w ([K][16]): out rows, columns [0, 16)
template <int R>
void rows_f32(const float* x, int64_t k, const float* w, const float* bias, float* out, int64_t n) {
  float acc[R][kCols] = {};
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* wk = w + kk * kCols;
    for (int i = 0; i < R; ++i) {
      const float xv = x[i * k + kk];
#pragma omp simd
      for (int j = 0; j < kCols; ++j) acc[i][j] += xv * wk[j];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kCols; ++j) out[i * n + j] = acc[i][j] + (bias ? bias[j] : 0.f);
}

template <int R = kRows>
void rows_any(int r, const float* x, int64_t k, const float* w, const float* bias, float* out, int64_t n) {
  if constexpr (R > 0) {
    if (r == R) return rows_f32<R>(x, k, w, bias, out, n);
    return rows_any<R - 1>(r, x, k, w, bias, out, n);
  }
}

Tensor f32_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "kvfleet_cpu.f32_linear: x must be float32 [M, K]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 3 && weight.size(2) == kCols && weight.is_contiguous(),
              "kvfleet_cpu.f32_linear: weight must be contiguous float32 [N/16, K, 16]");
  const int64_t nbs = weight.size(0), k = weight.size(1), n = nbs * kCols, m = x.size(0);
  TORCH_CHECK(x.size(1) == k, "kvfleet_cpu.f32_linear: x has ", x.size(1), " inputs, the weight ", k);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous()),
              "kvfleet_cpu.f32_linear: bias must be contiguous float32 [N]");
  Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const Tensor xc = x.contiguous();
  const float* xd = xc.data_ptr<float>();
  const float* wd = weight.data_ptr<float>();
  const float* bd = bias ? bias->data_ptr<float>() : nullptr;
  float* od = out.data_ptr<float>();
  at::parallel_for(0, nbs, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; ++nb)
      for (int64_t r0 = 0; r0 < m; r0 += kRows)
        rows_any(int(std::min<int64_t>(kRows, m - r0)), xd + r0 * k, k, wd + nb * k * kCols, bd ? bd + nb * kCols : nullptr,
                 od + r0 * n + nb * kCols, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", &f32_linear);
}
