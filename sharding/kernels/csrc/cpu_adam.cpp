// Adam / AdamW over fp32 CPU tensors in one pass: moments, parameter and (optionally) its 16-bit copy.
//
// One read of param, grad and the moments and one write of each per element: the 16-bit copy that
// ZeRO-Offload sends back to the device is written in the same pass, so no separate cast pass
// reads the parameters again. The loop is split across OpenMP threads and vectorised by the
// compiler (-O3 -march=native; -fno-math-errno lets sqrt vectorise). The arithmetic follows
// torch.optim.Adam / AdamW (bias corrections, decoupled or L2 weight decay, amsgrad).

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// Round to nearest even, NaN to the canonical quiet NaN: the same as c10::BFloat16(float), written
// branch-free so that the loop vectorises.
inline uint16_t float_to_bf16(float value) {
  const uint32_t bits = float_to_bits(value);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return std::isnan(value) ? uint16_t(0x7FC0) : uint16_t(rounded);
}

template <typename T>
inline float load(const T* data, int64_t i);
template <>
inline float load<float>(const float* data, int64_t i) { return data[i]; }
template <>
inline float load<at::BFloat16>(const at::BFloat16* data, int64_t i) {
  return bits_to_float(uint32_t(data[i].x) << 16);
}
template <>
inline float load<at::Half>(const at::Half* data, int64_t i) { return float(data[i]); }

template <typename T>
inline void store(T* data, int64_t i, float value);
template <>
inline void store<at::BFloat16>(at::BFloat16* data, int64_t i, float value) {
  data[i].x = float_to_bf16(value);
}
template <>
inline void store<at::Half>(at::Half* data, int64_t i, float value) { data[i] = at::Half(value); }

// Every constant is computed in double and rounded once, as torch does with its Python scalars
// (1 - beta2 rounded from double is 0.001f; 1.0f - 0.999f is 0.00100005f, a 5e-5 relative error).
struct Hyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  float grad_scale;         // the gradient is multiplied by it as it is read (unscaling, clipping)
  float decay_factor;       // AdamW: 1 - lr * weight_decay, applied to the parameter first
  float step_size;          // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  bool adamw, amsgrad;
};

// The variants are template parameters, not run-time branches: a loop body without conditional
// stores is one the compiler vectorises (with them, GCC kept it scalar: 3x slower).
template <typename G, typename O, bool ADAMW, bool AMSGRAD, bool OUT>
void adam_loop(float* __restrict param, const G* __restrict grad, float* __restrict exp_avg,
               float* __restrict exp_avg_sq, float* __restrict max_exp_avg_sq, O* __restrict out, int64_t n,
               const Hyper h, int threads) {
  const float one_minus_beta1 = h.one_minus_beta1, one_minus_beta2 = h.one_minus_beta2;
  const float beta2 = h.beta2, grad_scale = h.grad_scale, decay_factor = h.decay_factor;
  const float weight_decay = h.weight_decay, step_size = h.step_size, eps = h.eps;
  const float bias_correction2_sqrt = h.bias_correction2_sqrt;
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    float g = load<G>(grad, i) * grad_scale;
    float p = param[i];
    if constexpr (ADAMW) {
      p *= decay_factor;
    } else {
      g += weight_decay * p;
    }
    const float m = exp_avg[i] + one_minus_beta1 * (g - exp_avg[i]);  // torch's lerp for weights < 0.5
    const float v = beta2 * exp_avg_sq[i] + one_minus_beta2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    float second = v;
    if constexpr (AMSGRAD) {
      second = std::fmax(max_exp_avg_sq[i], v);
      max_exp_avg_sq[i] = second;
    }
    p -= step_size * (m / (std::sqrt(second) / bias_correction2_sqrt + eps));  // addcdiv's order
    param[i] = p;
    if constexpr (OUT) store<O>(out, i, p);
  }
}

template <typename G, typename O, bool OUT>
void dispatch_mode(float* param, const G* grad, float* m, float* v, float* vmax, O* out, int64_t n, const Hyper& h,
                   int threads) {
  if (h.adamw && h.amsgrad) {
    adam_loop<G, O, true, true, OUT>(param, grad, m, v, vmax, out, n, h, threads);
  } else if (h.adamw) {
    adam_loop<G, O, true, false, OUT>(param, grad, m, v, vmax, out, n, h, threads);
  } else if (h.amsgrad) {
    adam_loop<G, O, false, true, OUT>(param, grad, m, v, vmax, out, n, h, threads);
  } else {
    adam_loop<G, O, false, false, OUT>(param, grad, m, v, vmax, out, n, h, threads);
  }
}

template <typename G>
void dispatch_out(float* param, const G* grad, float* m, float* v, float* vmax, const torch::Tensor& out,
                  int64_t n, const Hyper& h, int threads) {
  if (!out.defined() || out.numel() == 0) {
    dispatch_mode<G, at::BFloat16, false>(param, grad, m, v, vmax, nullptr, n, h, threads);
  } else if (out.scalar_type() == at::kBFloat16) {
    dispatch_mode<G, at::BFloat16, true>(param, grad, m, v, vmax, out.data_ptr<at::BFloat16>(), n, h, threads);
  } else {
    dispatch_mode<G, at::Half, true>(param, grad, m, v, vmax, out.data_ptr<at::Half>(), n, h, threads);
  }
}

void check(const torch::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, the parameter ", n);
}

}  // namespace

// One Adam step of one parameter, in place. `max_exp_avg_sq` is used when amsgrad; `out16`, when
// it has elements, receives the updated parameter in bf16 or fp16; the gradient is read times
// `grad_scale`.
void adam_step(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
               torch::Tensor max_exp_avg_sq, torch::Tensor out16, double lr, double beta1, double beta2,
               double eps, double weight_decay, int64_t step, bool adamw, bool amsgrad, double grad_scale,
               int64_t threads) {
  const int64_t n = param.numel();
  TORCH_CHECK(param.scalar_type() == at::kFloat, "the parameter must be fp32");
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat,
              "the moments must be fp32");
  check(param, "param", n);
  check(grad, "grad", n);
  check(exp_avg, "exp_avg", n);
  check(exp_avg_sq, "exp_avg_sq", n);
  if (amsgrad) check(max_exp_avg_sq, "max_exp_avg_sq", n);
  const bool has_out = out16.defined() && out16.numel() > 0;
  if (has_out) {
    check(out16, "out16", n);
    TORCH_CHECK(out16.scalar_type() == at::kBFloat16 || out16.scalar_type() == at::kHalf,
                "out16 must be bf16 or fp16, got ", out16.scalar_type());
  }
  TORCH_CHECK(step >= 1, "step must be >= 1");
  Hyper h;
  h.beta1 = float(beta1);
  h.beta2 = float(beta2);
  h.one_minus_beta1 = float(1.0 - beta1);
  h.one_minus_beta2 = float(1.0 - beta2);
  h.eps = float(eps);
  h.weight_decay = float(weight_decay);
  h.grad_scale = float(grad_scale);
  h.decay_factor = float(1.0 - lr * weight_decay);
  h.step_size = float(lr / (1.0 - std::pow(beta1, double(step))));
  h.bias_correction2_sqrt = float(std::sqrt(1.0 - std::pow(beta2, double(step))));
  h.adamw = adamw;
  h.amsgrad = amsgrad;
  float* vmax = amsgrad ? max_exp_avg_sq.data_ptr<float>() : nullptr;
  const int threads_used = int(threads < 1 ? 1 : threads);
  switch (grad.scalar_type()) {
    case at::kFloat:
      dispatch_out<float>(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                          exp_avg_sq.data_ptr<float>(), vmax, out16, n, h, threads_used);
      break;
    case at::kBFloat16:
      dispatch_out<at::BFloat16>(param.data_ptr<float>(), grad.data_ptr<at::BFloat16>(),
                                 exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), vmax, out16, n, h,
                                 threads_used);
      break;
    case at::kHalf:
      dispatch_out<at::Half>(param.data_ptr<float>(), grad.data_ptr<at::Half>(), exp_avg.data_ptr<float>(),
                             exp_avg_sq.data_ptr<float>(), vmax, out16, n, h, threads_used);
      break;
    default:
      TORCH_CHECK(false, "the gradient must be fp32, bf16 or fp16, got ", grad.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "One fused Adam/AdamW step of an fp32 CPU parameter (optionally writing a 16-bit copy)");
}
