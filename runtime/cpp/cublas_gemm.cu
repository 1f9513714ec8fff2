// cuBLAS GEMMs for AOTInductor-compiled methods: the aoti_torch_cuda_{mm,addmm,bmm,baddbmm}_out shims that a .so
// calls where Inductor chose ATen's GEMM over a Triton template (recipe `lowering.gemm: cublas`, or `autotune`).
//
// Why: ExecuTorch 1.2's CUDA runtime has no GEMM shim, so its backend compiles every GEMM as a Triton template,
// which is weak at the small M of an action step (docs/benchmarks.md). zoo's runtime build adds these four to
// ExecuTorch's own shim library (libaoti_cuda_shims.so, beside aoti_torch_cuda__weight_int4pack_mm), so a .so that
// imports them loads there; stock ExecuTorch refuses it at load (undefined symbol), which the artifact's
// runtime.json says beforehand ("features": ["cublas-gemm"]).
//
// Semantics are ATen's: out = beta * self + alpha * (mat1 @ mat2), batched for bmm/baddbmm; self broadcasts to out
// and is not read when beta is 0. bf16 and float32, accumulated in float32 (CUBLAS_COMPUTE_32F), on the stream
// the backend runs the method on. The mapping of strided operands onto one column-major call is gemm_plan.h's.

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <executorch/backends/aoti/common_shims_slim.h>
#include <executorch/backends/aoti/slim/cuda/guard.h>
#include <executorch/runtime/platform/log.h>

#include <string>
#include <vector>

#include "gemm_plan.h"

namespace {

using executorch::runtime::Error;
using Tensor = executorch::backends::aoti::slim::SlimTensor;
using ScalarType = executorch::backends::aoti::slim::c10::ScalarType;
namespace gemm = zoo::gemm;

template <typename T>
__global__ void broadcast_copy(T* out, const T* src, int64_t batches, int64_t rows, int64_t cols, int64_t ob,
                               int64_t orow, int64_t ocol, int64_t sb, int64_t srow, int64_t scol) {
  const int64_t total = batches * rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i % cols, r = (i / cols) % rows, b = i / (cols * rows);
    out[b * ob + r * orow + c * ocol] = src[b * sb + r * srow + c * scol];
  }
}

Error fail(const char* shim, const std::string& why) {
  ET_LOG(Error, "%s: %s", shim, why.c_str());
  return Error::InvalidArgument;
}

cublasHandle_t handle_for(cudaStream_t stream) {
  // One handle per thread (cuBLAS handles are not thread-safe); the stream is set on every call.
  static thread_local cublasHandle_t handle = nullptr;
  if (handle == nullptr && cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    handle = nullptr;
    return nullptr;
  }
  cublasSetStream(handle, stream);
  return handle;
}

// A 2-D tensor, or one matrix of a 3-D batch: its last two dimensions.
gemm::Matrix matrix(const Tensor& t) {
  const int64_t d = static_cast<int64_t>(t.dim());
  return {t.size(d - 2), t.size(d - 1), t.stride(d - 2), t.stride(d - 1)};
}

int64_t batch_stride(const Tensor& t, int64_t batches) {
  return t.dim() == 3 && batches > 1 ? t.stride(0) : 0;
}

// out = self, broadcast: the GEMM then accumulates onto it with BLAS's beta (so beta scales it there).
Error copy_self(const char* shim, const Tensor& self, const Tensor& out, cudaStream_t stream) {
  if (self.data_ptr() == out.data_ptr()) {
    return Error::Ok;  // in place
  }
  const std::vector<int64_t> sizes(self.sizes().begin(), self.sizes().end());
  const std::vector<int64_t> strides(self.strides().begin(), self.strides().end());
  const std::vector<int64_t> out_sizes(out.sizes().begin(), out.sizes().end());
  const std::vector<int64_t> s = gemm::broadcast_strides(sizes, strides, out_sizes);
  if (s.empty()) {
    return fail(shim, "self does not broadcast to the output's shape");
  }
  const bool batched = out.dim() == 3;
  const int64_t b = batched ? out.size(0) : 1, r = out.size(out.dim() - 2), c = out.size(out.dim() - 1);
  const int64_t ob = batched ? out.stride(0) : 0, sb = batched ? s[0] : 0;
  const int64_t total = b * r * c;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((total + threads - 1) / threads, 4096));
  if (total == 0) {
    return Error::Ok;
  }
  if (out.dtype() == ScalarType::BFloat16) {
    broadcast_copy<<<blocks, threads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(out.data_ptr()), static_cast<const __nv_bfloat16*>(self.data_ptr()), b, r, c, ob,
        out.stride(out.dim() - 2), out.stride(out.dim() - 1), sb, s[s.size() - 2], s[s.size() - 1]);
  } else {
    broadcast_copy<<<blocks, threads, 0, stream>>>(
        static_cast<float*>(out.data_ptr()), static_cast<const float*>(self.data_ptr()), b, r, c, ob,
        out.stride(out.dim() - 2), out.stride(out.dim() - 1), sb, s[s.size() - 2], s[s.size() - 1]);
  }
  return cudaGetLastError() == cudaSuccess ? Error::Ok : fail(shim, "the broadcast copy of self did not launch");
}

// out = beta_self * self + alpha * (mat1 @ mat2); self may be null (mm, bmm).
Error gemm_out(const char* shim, Tensor* out, const Tensor* self, Tensor* mat1, Tensor* mat2, double beta,
               double alpha, int64_t dims) {
  if (out == nullptr || mat1 == nullptr || mat2 == nullptr) {
    return fail(shim, "a null tensor");
  }
  if (static_cast<int64_t>(out->dim()) != dims || static_cast<int64_t>(mat1->dim()) != dims ||
      static_cast<int64_t>(mat2->dim()) != dims) {
    return fail(shim, "expects " + std::to_string(dims) + "-D tensors");
  }
  const ScalarType dtype = out->dtype();
  if (mat1->dtype() != dtype || mat2->dtype() != dtype || (self != nullptr && self->dtype() != dtype) ||
      (dtype != ScalarType::BFloat16 && dtype != ScalarType::Float)) {
    return fail(shim, "takes bfloat16 or float32 tensors, all of one dtype");
  }
  if (!out->is_cuda() || !mat1->is_cuda() || !mat2->is_cuda()) {
    return fail(shim, "takes CUDA tensors");
  }
  const int64_t batches = dims == 3 ? out->size(0) : 1;
  if (dims == 3 && (mat1->size(0) != batches || mat2->size(0) != batches)) {
    return fail(shim, "batch sizes differ");
  }
  if (out->numel() == 0) {
    return Error::Ok;
  }
  const gemm::Plan p = gemm::plan(matrix(*out), matrix(*mat1), matrix(*mat2));
  if (!p.ok) {
    return fail(shim, p.why);
  }
  auto stream = executorch::backends::cuda::getCurrentCUDAStream(0);
  if (!stream.ok()) {
    return fail(shim, "no current CUDA stream");
  }
  float blas_beta = 0.0f;
  if (self != nullptr && beta != 0.0) {
    const Error copied = copy_self(shim, *self, *out, stream.get());
    if (copied != Error::Ok) {
      return copied;
    }
    blas_beta = static_cast<float>(beta);
  }
  cublasHandle_t handle = handle_for(stream.get());
  if (handle == nullptr) {
    return fail(shim, "cublasCreate failed");
  }
  const float blas_alpha = static_cast<float>(alpha);
  const cudaDataType_t type = dtype == ScalarType::BFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  const auto op = [](gemm::Op o) { return o == gemm::Op::N ? CUBLAS_OP_N : CUBLAS_OP_T; };
  const Tensor& first = p.swapped ? *mat2 : *mat1;
  const Tensor& second = p.swapped ? *mat1 : *mat2;
  cublasStatus_t status;
  if (dims == 2) {
    status = cublasGemmEx(handle, op(p.first.op), op(p.second.op), p.m, p.n, p.k, &blas_alpha, first.data_ptr(), type,
                          p.first.ld, second.data_ptr(), type, p.second.ld, &blas_beta, out->data_ptr(), type, p.ldc,
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  } else {
    status = cublasGemmStridedBatchedEx(
        handle, op(p.first.op), op(p.second.op), p.m, p.n, p.k, &blas_alpha, first.data_ptr(), type, p.first.ld,
        batch_stride(first, batches), second.data_ptr(), type, p.second.ld, batch_stride(second, batches),
        &blas_beta, out->data_ptr(), type, p.ldc, batch_stride(*out, batches), batches, CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT);
  }
  if (status != CUBLAS_STATUS_SUCCESS) {
    return fail(shim, std::string("cuBLAS failed: ") + cublasGetStatusString(status));
  }
  return Error::Ok;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) Error aoti_torch_cuda_mm_out(Tensor* out, Tensor* self, Tensor* mat2) {
  return gemm_out("aoti_torch_cuda_mm_out", out, nullptr, self, mat2, 0.0, 1.0, 2);
}

__attribute__((visibility("default"))) Error aoti_torch_cuda_addmm_out(Tensor* out, Tensor* self, Tensor* mat1,
                                                                       Tensor* mat2, double beta, double alpha) {
  return gemm_out("aoti_torch_cuda_addmm_out", out, self, mat1, mat2, beta, alpha, 2);
}

__attribute__((visibility("default"))) Error aoti_torch_cuda_bmm_out(Tensor* out, Tensor* self, Tensor* mat2) {
  return gemm_out("aoti_torch_cuda_bmm_out", out, nullptr, self, mat2, 0.0, 1.0, 3);
}

__attribute__((visibility("default"))) Error aoti_torch_cuda_baddbmm_out(Tensor* out, Tensor* self, Tensor* batch1,
                                                                         Tensor* batch2, double beta, double alpha) {
  return gemm_out("aoti_torch_cuda_baddbmm_out", out, self, batch1, batch2, beta, alpha, 3);
}

}  // extern "C"
