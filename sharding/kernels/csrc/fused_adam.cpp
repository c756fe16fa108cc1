// The torch binding of the CUDA fused Adam (fused_adam_kernel.cu): checks the tensor lists, builds the
// block table on the host, copies it to the device and launches one kernel for all the tensors.
//
// The stream is passed in as an integer and must be the current stream
// (torch.cuda.current_stream().cuda_stream): that keeps this file free of ATen's CUDA headers, and the
// device table, allocated on the current stream, can be freed on return (the caching allocator
// reuses its memory only for work queued later on that stream).

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "fused_adam.h"

namespace {

void check_list(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& params, const char* name,
                bool fp32) {
  TORCH_CHECK(tensors.size() == params.size(), name, ": ", tensors.size(), " tensors for ", params.size(),
              " parameters");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].is_cuda() && tensors[i].is_contiguous(), name, "[", i,
                "] must be a contiguous CUDA tensor");
    TORCH_CHECK(tensors[i].device() == params[i].device(), name, "[", i, "] is on another device than its parameter");
    TORCH_CHECK(tensors[i].numel() == params[i].numel(), name, "[", i, "] has ", tensors[i].numel(),
                " elements, its parameter ", params[i].numel());
    TORCH_CHECK(!fp32 || tensors[i].scalar_type() == at::kFloat, name, "[", i, "] must be fp32");
  }
}

tnlg::DType dtype_code(at::ScalarType type, const char* what) {
  switch (type) {
    case at::kFloat:
      return tnlg::DType::kFloat;
    case at::kBFloat16:
      return tnlg::DType::kBFloat16;
    case at::kHalf:
      return tnlg::DType::kHalf;
    default:
      TORCH_CHECK(false, what, " must be fp32, bf16 or fp16, got ", type);
  }
  return tnlg::DType::kFloat;  // not reached: TORCH_CHECK(false) throws
}

}  // namespace

void fused_adam(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
                std::vector<at::Tensor> exp_avg_sqs, std::vector<at::Tensor> max_exp_avg_sqs,
                std::vector<at::Tensor> outs, double lr, double beta1, double beta2, double eps,
                double weight_decay, double step_size, double bias_correction2_sqrt, bool adamw,
                double grad_scale, int64_t stream_handle) {
  if (params.empty()) {
    return;
  }
  check_list(params, params, "params", true);
  check_list(grads, params, "grads", false);
  check_list(exp_avgs, params, "exp_avgs", true);
  check_list(exp_avg_sqs, params, "exp_avg_sqs", true);
  const bool amsgrad = !max_exp_avg_sqs.empty();
  if (amsgrad) check_list(max_exp_avg_sqs, params, "max_exp_avg_sqs", true);
  const bool copy = !outs.empty();
  if (copy) check_list(outs, params, "outs", false);
  const at::ScalarType grad_type = grads[0].scalar_type();
  const at::ScalarType out_type = copy ? outs[0].scalar_type() : at::kBFloat16;
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(grads[i].scalar_type() == grad_type, "all gradients must share one dtype");
    TORCH_CHECK(!copy || outs[i].scalar_type() == out_type, "all 16-bit copies must share one dtype");
  }
  TORCH_CHECK(out_type == at::kBFloat16 || out_type == at::kHalf, "16-bit copies must be bf16 or fp16");

  // The table in one int64 buffer: six pointer arrays, the sizes, each block's chunk, then each
  // block's tensor index packed as int32.
  const int64_t n = static_cast<int64_t>(params.size());
  std::vector<int64_t> block_chunk;
  std::vector<int32_t> block_tensor;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c * tnlg::kAdamChunk < params[t].numel(); ++c) {
      block_tensor.push_back(static_cast<int32_t>(t));
      block_chunk.push_back(c);
    }
  }
  const int64_t blocks = static_cast<int64_t>(block_chunk.size());
  if (blocks == 0) {
    return;
  }
  TORCH_CHECK(blocks < (int64_t(1) << 31), "too many blocks for one launch");
  auto host = torch::zeros({7 * n + blocks + (blocks + 1) / 2}, torch::dtype(torch::kInt64).pinned_memory(true));
  int64_t* slots = host.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    slots[t] = reinterpret_cast<int64_t>(params[t].data_ptr());
    slots[n + t] = reinterpret_cast<int64_t>(grads[t].data_ptr());
    slots[2 * n + t] = reinterpret_cast<int64_t>(exp_avgs[t].data_ptr());
    slots[3 * n + t] = reinterpret_cast<int64_t>(exp_avg_sqs[t].data_ptr());
    slots[4 * n + t] = amsgrad ? reinterpret_cast<int64_t>(max_exp_avg_sqs[t].data_ptr()) : 0;
    slots[5 * n + t] = copy ? reinterpret_cast<int64_t>(outs[t].data_ptr()) : 0;
    slots[6 * n + t] = params[t].numel();
  }
  std::copy(block_chunk.begin(), block_chunk.end(), slots + 7 * n);
  std::copy(block_tensor.begin(), block_tensor.end(), reinterpret_cast<int32_t*>(slots + 7 * n + blocks));
  // Asynchronous from pinned memory; torch keeps the pinned block until the copy has run.
  auto table_on_device = host.to(params[0].device(), /*non_blocking=*/true);
  auto* base = table_on_device.data_ptr<int64_t>();
  const tnlg::AdamTable table{
      reinterpret_cast<float**>(base),
      reinterpret_cast<const void**>(base + n),
      reinterpret_cast<float**>(base + 2 * n),
      reinterpret_cast<float**>(base + 3 * n),
      amsgrad ? reinterpret_cast<float**>(base + 4 * n) : nullptr,
      copy ? reinterpret_cast<void**>(base + 5 * n) : nullptr,
      base + 6 * n,
      reinterpret_cast<const int32_t*>(base + 7 * n + blocks),
      base + 7 * n,
  };
  const tnlg::AdamHyper hyper{static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(weight_decay),
                              static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                              static_cast<float>(1.0 - beta2), static_cast<float>(eps),
                              static_cast<float>(step_size), static_cast<float>(bias_correction2_sqrt),
                              static_cast<float>(grad_scale)};
  const char* error = tnlg::launch_fused_adam(table, hyper, static_cast<int>(blocks), dtype_code(grad_type, "gradients"),
                                              dtype_code(out_type, "16-bit copies"), adamw, amsgrad,
                                              reinterpret_cast<void*>(stream_handle));
  TORCH_CHECK(error == nullptr, "fused_adam launch failed: ", error);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_adam", &fused_adam, "Multi-tensor fused Adam / AdamW (CUDA)");
}
