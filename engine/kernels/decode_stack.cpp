// kvfleet CPU kernels: every decoder layer of a step in one call from Python (issue 45).
//
// A decode step of a 30-layer model makes ~300 kernel calls (norms, projections, rotary, KV write, attention,
// SiLU x up); made one by one from Python, each pays the interpreter, nn.Module and the dispatcher's Python
// binding, ~5 ms of a 15 ms single-stream step on a 2-core Xeon. `DecodeStack` holds each layer's weights once
// (built at load, engine/model/cpu_decode_stack.py) and runs the layers in a C++ loop that calls exactly the
// ops the Python layers call (through the dispatcher's C++ handles), with the same arguments in the same order:
// the results are the same bits.
//
//   DecodeStack(norms, projections, kinds, heads, kv_heads, head_dim, eps, scale)
//     norms        2 per layer: the input and post-attention RMSNorm weights, float32
//     projections  3 per projection, 4 projections per layer (qkv, o, gate_up, down):
//                  kind 0, q4_linear: qweight, scales, bias; kind 1, oneDNN's _linear_pointwise: packed weight, an
//                  unused empty tensor, bias. A bias with no elements is no bias.
//   run(h, positions, cos_sin, k_caches, v_caches, slots, tables, lens, split_blocks) -> [h, residual]
//     h            the embedded tokens [n, hidden], every row one paged_decode_ attends (consumed: becomes the residual)
//     the rest     what the layers' rotary_, write_kv and paged_decode_ calls take
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

c10::OperatorHandle op_handle(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

// The ops the Python layers call, found once (they are registered when this library loads).
struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      op_handle("kvfleet_cpu::rms_norm").typed<Tensor(const Tensor&, const Tensor&, double)>();
  c10::TypedOperatorHandle<void(Tensor&, Tensor&, const Tensor&, double)> add_rms_norm_ =
      op_handle("kvfleet_cpu::add_rms_norm_").typed<void(Tensor&, Tensor&, const Tensor&, double)>();
  c10::TypedOperatorHandle<void(Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)> rotary_ =
      op_handle("kvfleet_cpu::rotary_").typed<void(Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)>();
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul =
      op_handle("kvfleet_cpu::silu_and_mul").typed<Tensor(const Tensor&)>();
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)> write_kv =
      op_handle("kvfleet_cpu::write_kv").typed<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)>();
  c10::TypedOperatorHandle<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                double, int64_t)>
      paged_decode_ = op_handle("kvfleet_cpu::paged_decode_")
                          .typed<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const Tensor&, double, int64_t)>();
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, bool, bool)>
      q4_linear = op_handle("kvfleet_cpu::q4_linear")
                      .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, bool, bool)>();
  c10::OperatorHandle onednn_linear = op_handle("mkldnn::_linear_pointwise");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

enum Kind : int64_t { kQ4 = 0, kOneDnn = 1 };

struct Projection {
  int64_t kind;
  Tensor w0, w1;
  OptTensor bias;

  Tensor operator()(const Ops& o, const Tensor& x) const {
    if (kind == kQ4) return o.q4_linear.call(x, w0, w1, bias, true, false);
    torch::jit::Stack stack{x, w0, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                            std::string("")};
    o.onednn_linear.callBoxed(&stack);
    return stack[0].toTensor();
  }
};

struct DecodeStack : torch::CustomClassHolder {
  std::vector<Tensor> norms;
  std::vector<Projection> projections;
  int64_t heads, kv_heads, head_dim;
  double eps, scale;

  DecodeStack(std::vector<Tensor> norms_, std::vector<Tensor> tensors, std::vector<int64_t> kinds, int64_t heads_,
              int64_t kv_heads_, int64_t head_dim_, double eps_, double scale_)
      : norms(std::move(norms_)), heads(heads_), kv_heads(kv_heads_), head_dim(head_dim_), eps(eps_), scale(scale_) {
    const size_t layers = norms.size() / 2;
    TORCH_CHECK(norms.size() == 2 * layers && kinds.size() == 4 * layers && tensors.size() == 3 * kinds.size(),
                "kvfleet_cpu.DecodeStack: 2 norms, 4 projection kinds and 12 projection tensors per layer");
    for (size_t i = 0; i < kinds.size(); ++i) {
      TORCH_CHECK(kinds[i] == kQ4 || kinds[i] == kOneDnn, "kvfleet_cpu.DecodeStack: projection kind ", kinds[i]);
      const Tensor& b = tensors[3 * i + 2];
      projections.push_back({kinds[i], tensors[3 * i], tensors[3 * i + 1], b.numel() ? OptTensor(b) : std::nullopt});
    }
    ops();  // every op found now, or a clear error at load
  }

  std::vector<Tensor> run(Tensor h, Tensor positions, Tensor cos_sin, std::vector<Tensor> k_caches,
                          std::vector<Tensor> v_caches, Tensor slots, Tensor tables, Tensor lens,
                          int64_t split_blocks) const {
    const int64_t layers = int64_t(norms.size() / 2);
    TORCH_CHECK(int64_t(k_caches.size()) == layers && int64_t(v_caches.size()) == layers,
                "kvfleet_cpu.DecodeStack: one K and one V cache per layer");
    const Ops& o = ops();
    const int64_t n = h.size(0), rotated = heads + kv_heads;
    Tensor residual = h;
    Tensor x = o.rms_norm.call(h, norms[0], eps);
    for (int64_t l = 0; l < layers; ++l) {
      const Projection* p = &projections[4 * l];
      if (l > 0) o.add_rms_norm_.call(x, residual, norms[2 * l], eps);
      Tensor qkv = p[0](o, x);
      o.rotary_.call(qkv, positions, cos_sin, rotated, head_dim);
      Tensor heads3 = qkv.view({n, rotated + kv_heads, head_dim});
      Tensor q = heads3.narrow(1, 0, heads), k = heads3.narrow(1, heads, kv_heads);
      Tensor v = heads3.narrow(1, rotated, kv_heads);
      o.write_kv.call(k, v, k_caches[l], v_caches[l], slots);
      Tensor attn = at::empty({n, heads, head_dim}, q.options());
      o.paged_decode_.call(attn, q, k_caches[l], v_caches[l], tables, lens, scale, split_blocks);
      x = p[1](o, attn.view({n, heads * head_dim}));
      o.add_rms_norm_.call(x, residual, norms[2 * l + 1], eps);
      x = p[3](o, o.silu_and_mul.call(p[2](o, x)));
    }
    return {x, residual};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<Tensor>, std::vector<Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t,
                       double, double>())
      .def("run", &DecodeStack::run);
}
