// The interface between the CUDA fused Adam kernels (fused_adam_kernel.cu, plain CUDA, no torch
// headers: nvcc compile-checks it on machines without a GPU) and their torch binding (fused_adam.cpp).
#pragma once

#include <cstdint>

namespace tnlg {

enum class DType : int { kFloat = 0, kBFloat16 = 1, kHalf = 2 };

// Elements per thread block: 256 threads x 256 elements each.
constexpr int64_t kAdamChunk = 65536;

// One step's constants, each rounded once to float from double on the host.
struct AdamHyper {
  float decay;  // 1 - lr * weight_decay (AdamW)
  float weight_decay;  // Adam: added to the gradient
  float one_minus_beta1, beta2, one_minus_beta2, eps;
  float step_size;  // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float grad_scale;  // unscaling and clipping, applied as the gradient is read
};

// Device pointers: per tensor, its buffers and size; per thread block, the tensor and chunk it updates.
struct AdamTable {
  float** params;
  const void** grads;
  float** exp_avgs;
  float** exp_avg_sqs;
  float** max_sqs;  // null when not amsgrad
  void** outs;  // null when no 16-bit copy
  const int64_t* sizes;
  const int32_t* block_tensor;
  const int64_t* block_chunk;
};

// Launches on `stream` (a cudaStream_t); returns null, or the CUDA error's description.
const char* launch_fused_adam(const AdamTable& table, const AdamHyper& hyper, int blocks, DType grad_type,
                              DType out_type, bool adamw, bool amsgrad, void* stream);

}  // namespace tnlg
