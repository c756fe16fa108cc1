// Multi-tensor fused Adam / AdamW for CUDA: every tensor of a list updated by one kernel launch.
//
// Each thread block takes one CHUNK of one tensor, found through a block table (tensor index, chunk
// index) built on the host, so tensors of any sizes share a launch, and a ZeRO flat group (one
// tensor) is one launch. Per element: read the fp32 parameter and moments and the gradient in its own
// dtype (fp32 / bf16 / fp16, scaled as it is read), write the parameter, the moments and, if asked, a
// bf16 / fp16 copy of the parameter. The arithmetic is torch's single-tensor Adam (see
// fused_adam.py); constants arrive from Python rounded once from double. Built with -fmad=false
// (no multiply-add contraction), so each operation rounds as written; torch's own kernels do
// contract, so the two differ by float rounding (the tests bound it at 1e-6 relative).
// Plain CUDA without torch headers: `nvcc -c` checks it on any machine with nvcc (tests/test_fused_adam.py).

#include "fused_adam.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;

using tnlg::AdamHyper;
using tnlg::AdamTable;
using tnlg::kAdamChunk;

template <typename T>
__device__ __forceinline__ float to_float(T value);
template <>
__device__ __forceinline__ float to_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) { return __bfloat162float(value); }
template <>
__device__ __forceinline__ float to_float<__half>(__half value) { return __half2float(value); }

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) { return __float2bfloat16_rn(value); }
template <>
__device__ __forceinline__ __half from_float<__half>(float value) { return __float2half_rn(value); }

template <typename Grad, typename Out, bool kAdamW, bool kAmsgrad>
__global__ void adam_kernel(AdamTable table, AdamHyper h) {
  const int tensor = table.block_tensor[blockIdx.x];
  const int64_t start = table.block_chunk[blockIdx.x] * kAdamChunk;
  const int64_t end = min(start + kAdamChunk, table.sizes[tensor]);
  float* param = table.params[tensor];
  const Grad* grad = static_cast<const Grad*>(table.grads[tensor]);
  float* exp_avg = table.exp_avgs[tensor];
  float* exp_avg_sq = table.exp_avg_sqs[tensor];
  float* max_sq = kAmsgrad ? table.max_sqs[tensor] : nullptr;
  Out* out = table.outs != nullptr ? static_cast<Out*>(table.outs[tensor]) : nullptr;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    float p = param[i];
    float g = to_float<Grad>(grad[i]) * h.grad_scale;
    if (kAdamW) {
      p = p * h.decay;
    } else {
      g = g + h.weight_decay * p;
    }
    const float m = exp_avg[i] + h.one_minus_beta1 * (g - exp_avg[i]);
    float v = exp_avg_sq[i] * h.beta2 + h.one_minus_beta2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (kAmsgrad) {
      v = fmaxf(max_sq[i], v);
      max_sq[i] = v;
    }
    const float denom = sqrtf(v) / h.bias_correction2_sqrt + h.eps;
    p = p - h.step_size * (m / denom);
    param[i] = p;
    if (out != nullptr) {
      out[i] = from_float<Out>(p);
    }
  }
}

template <typename Grad, typename Out>
void launch(const AdamTable& table, const AdamHyper& h, int blocks, bool adamw, bool amsgrad, cudaStream_t stream) {
  if (adamw && amsgrad) {
    adam_kernel<Grad, Out, true, true><<<blocks, kThreads, 0, stream>>>(table, h);
  } else if (adamw) {
    adam_kernel<Grad, Out, true, false><<<blocks, kThreads, 0, stream>>>(table, h);
  } else if (amsgrad) {
    adam_kernel<Grad, Out, false, true><<<blocks, kThreads, 0, stream>>>(table, h);
  } else {
    adam_kernel<Grad, Out, false, false><<<blocks, kThreads, 0, stream>>>(table, h);
  }
}

template <typename Grad>
void launch_for_out(tnlg::DType out_type, const AdamTable& table, const AdamHyper& h, int blocks, bool adamw,
                    bool amsgrad, cudaStream_t stream) {
  if (out_type == tnlg::DType::kHalf) {
    launch<Grad, __half>(table, h, blocks, adamw, amsgrad, stream);
  } else {
    launch<Grad, __nv_bfloat16>(table, h, blocks, adamw, amsgrad, stream);  // also "no copy": outs is null
  }
}

}  // namespace

const char* tnlg::launch_fused_adam(const AdamTable& table, const AdamHyper& hyper, int blocks, DType grad_type,
                                    DType out_type, bool adamw, bool amsgrad, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  if (grad_type == DType::kFloat) {
    launch_for_out<float>(out_type, table, hyper, blocks, adamw, amsgrad, stream);
  } else if (grad_type == DType::kBFloat16) {
    launch_for_out<__nv_bfloat16>(out_type, table, hyper, blocks, adamw, amsgrad, stream);
  } else {
    launch_for_out<__half>(out_type, table, hyper, blocks, adamw, amsgrad, stream);
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}
