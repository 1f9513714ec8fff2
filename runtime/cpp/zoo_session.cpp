// zoo_session: the C API of zoo_session.h over MethodRunner, for a caller that loads the runtime into its own
// process.

#include "zoo_session.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <executorch/runtime/platform/runtime.h>
#ifdef ZOO_RUNNER_CUDA
#include <cuda_runtime.h>
#endif

#include "build_facts.h"
#include "device_values.h"
#include "method_runner.h"

struct zoo_session {
  std::unique_ptr<zoo::MethodRunner> runner;
};

namespace {

int fail(const std::string& why, char* error, size_t error_size) {
  if (error != nullptr && error_size > 0) {
    const size_t n = std::min(why.size(), error_size - 1);
    std::memcpy(error, why.data(), n);
    error[n] = '\0';
  }
  return 1;
}

std::vector<int64_t> sizes_of(const zoo_tensor& t) { return std::vector<int64_t>(t.sizes, t.sizes + t.ndim); }

// The caller's tensor as a runner value: a device pointer as it is (not owned: the caller frees it), host bytes
// copied (the runner's host values own their bytes; inputs that matter for speed come on the GPU).
std::string to_value(const zoo_tensor& t, zoo::Value* out) {
  if (t.ndim > ZOO_SESSION_MAX_DIMS) return "rank " + std::to_string(t.ndim) + " is over the limit";
  const size_t elem = zoo::element_size(t.dtype);
  if (elem == 0) return "dtype code " + std::to_string(t.dtype) + " is not one zoo passes";
  zoo::Value v;
  v.dtype = t.dtype;
  v.sizes = sizes_of(t);
  v.strides = zoo::contiguous_strides(v.sizes);
  const size_t nbytes = v.nbytes();
  if (nbytes > 0 && t.data == nullptr) return "no data";
  if (zoo::is_device_pointer(t.data)) {
    v.device = std::make_shared<zoo::DeviceBuffer>();
    v.device->ptr = t.data;
    v.device->nbytes = nbytes;
  } else {
    v.host.dtype = t.dtype;
    v.host.sizes = v.sizes;
    const auto* bytes = static_cast<const uint8_t*>(t.data);
    v.host.data.assign(bytes, bytes + nbytes);
  }
  *out = std::move(v);
  return "";
}

// Copies an output (contiguous, on the host or the GPU) into the caller's memory (host or GPU).
std::string copy_out(const zoo::Value& v, void* dst) {
  const size_t nbytes = v.nbytes();
  if (nbytes == 0) return "";
  if (v.on_device() && !v.contiguous()) return "the output is not contiguous on the GPU";
  const void* src = v.on_device() ? v.device->ptr : v.host.data.data();
#ifdef ZOO_RUNNER_CUDA
  if (v.on_device() || zoo::is_device_pointer(dst)) {
    const cudaError_t err = cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault);  // unified addressing: any direction
    return err == cudaSuccess ? "" : std::string("cudaMemcpy of an output: ") + cudaGetErrorString(err);
  }
#endif
  std::memcpy(dst, src, nbytes);
  return "";
}

}  // namespace

extern "C" {

int zoo_session_abi(void) { return ZOO_SESSION_ABI; }

const char* zoo_session_build(void) {
  static const std::string text = [] {
    executorch::runtime::runtime_init();
    zoo::JsonObject obj;
    zoo::add_build_facts(obj, true);
    return obj.text();
  }();
  return text.c_str();
}

int zoo_session_open(const char* model, const char* data, const char* methods_csv, int weight_sharing,
                     zoo_session** out, double* load_ms, char* error, size_t error_size) {
  *out = nullptr;
  if (model == nullptr) return fail("no model path", error, error_size);
  executorch::runtime::runtime_init();
  zoo::LoadOptions options;
  options.model = model;
  if (data != nullptr && data[0] != '\0') options.data.push_back(data);
  if (methods_csv != nullptr) options.load = zoo::split(methods_csv, ',');
  options.weight_sharing = weight_sharing != 0;
  // An artifact lowered for another GPU or host is refused before ExecuTorch loads it, as zoo_runner refuses it.
  std::string kernels;
  const std::string target_error = zoo::check_gpu_targets(model, &kernels);
  if (!target_error.empty()) return fail(target_error, error, error_size) + 1;  // 2: not for this GPU
  auto session = std::make_unique<zoo_session>();
  session->runner = std::make_unique<zoo::MethodRunner>(options);
  std::vector<std::string> loaded;
  double ms = 0;
  const std::string why = session->runner->load(&ms, &loaded);
  if (!why.empty()) return fail(why, error, error_size);
  if (load_ms != nullptr) *load_ms = ms;
  *out = session.release();
  return 0;
}

void zoo_session_close(zoo_session* session) { delete session; }

int zoo_session_signature(zoo_session* session, const char* method, uint32_t* n_inputs, uint32_t* n_outputs,
                          char* error, size_t error_size) {
  std::string why;
  session->runner->num_outputs(method, &why);  // names the loaded methods when this one is not
  auto meta = session->runner->meta(method);
  if (!why.empty() || !meta.ok()) return fail(why.empty() ? "cannot read the signature of " + std::string(method) : why,
                                              error, error_size);
  *n_inputs = static_cast<uint32_t>(meta->num_inputs());
  *n_outputs = static_cast<uint32_t>(meta->num_outputs());
  return 0;
}

int zoo_session_output_meta(zoo_session* session, const char* method, uint32_t k, zoo_tensor* out, char* error,
                            size_t error_size) {
  uint32_t n_in = 0, n_out = 0;
  if (zoo_session_signature(session, method, &n_in, &n_out, error, error_size) != 0) return 1;
  if (k >= n_out) {
    return fail(std::string("method ") + method + " has " + std::to_string(n_out) + " outputs, not an output " +
                std::to_string(k), error, error_size);
  }
  auto info = session->runner->meta(method)->output_tensor_meta(k);
  if (!info.ok()) return fail(std::string("output ") + std::to_string(k) + " of " + method + " is not a tensor",
                              error, error_size);
  if (info->sizes().size() > ZOO_SESSION_MAX_DIMS) return fail("output rank over the limit", error, error_size);
  out->data = nullptr;
  out->dtype = static_cast<uint32_t>(info->scalar_type());
  out->ndim = static_cast<uint32_t>(info->sizes().size());
  for (uint32_t d = 0; d < out->ndim; ++d) out->sizes[d] = info->sizes()[d];
  return 0;
}

int zoo_session_call(zoo_session* session, const char* method, const zoo_tensor* inputs, uint32_t n_inputs,
                     zoo_tensor* outputs, uint32_t n_outputs, double* ms, double* io_ms, char* error,
                     size_t error_size) {
  std::vector<zoo::Value> values(n_inputs);
  for (uint32_t i = 0; i < n_inputs; ++i) {
    const std::string why = to_value(inputs[i], &values[i]);
    if (!why.empty()) return fail(std::string("method ") + method + ": input " + std::to_string(i) + ": " + why,
                                  error, error_size);
  }
  // Every output stays where the backend put it (on the GPU, until this method's next call) and is copied into
  // the caller's memory here, before anything else can run the method again.
  std::vector<zoo::OutSpec> specs(n_outputs, zoo::OutSpec{zoo::OutMode::Keep, ""});
  zoo::CallResult r = session->runner->call(method, values, specs);
  if (!r.error.empty()) return fail(r.error, error, error_size);
  const auto t0 = std::chrono::steady_clock::now();
  for (uint32_t k = 0; k < n_outputs; ++k) {
    const zoo::Value& v = r.outputs[k];
    const std::string where = std::string("method ") + method + ": output " + std::to_string(k) + " is ";
    if (r.none[k]) return fail(where + "None, which has no tensor to copy", error, error_size);
    if (v.dtype != outputs[k].dtype || v.sizes != sizes_of(outputs[k])) {
      return fail(where + zoo::dtype_name(v.dtype) + " " + zoo::shape_text(v.sizes) + ", the destination is " +
                  zoo::dtype_name(outputs[k].dtype) + " " + zoo::shape_text(sizes_of(outputs[k])), error, error_size);
    }
    const std::string why = copy_out(v, outputs[k].data);
    if (!why.empty()) return fail(where + "not copied: " + why, error, error_size);
  }
  if (ms != nullptr) *ms = r.ms;
  if (io_ms != nullptr) *io_ms = r.io_ms + zoo::ms_since(t0);
  return 0;
}

}  // extern "C"
