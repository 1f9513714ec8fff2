#include "device_values.h"

#include <algorithm>
#include <cstring>
#include <limits>

#ifdef ZOO_RUNNER_CUDA
#include <cuda_runtime.h>
#endif

namespace zoo {
namespace {

#ifdef ZOO_RUNNER_CUDA
std::string cuda_error(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorString(err);
}
#endif

// Elements from the first to the last one a strided tensor reaches (its storage span); 0 for an empty tensor.
int64_t span_elements(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  int64_t last = 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) {
      return 0;
    }
    last += (sizes[d] - 1) * strides[d];
  }
  return last + 1;
}

}  // namespace

// --- CUDA ------------------------------------------------------------------------------------------------------------

bool cuda_device_present() {
#ifdef ZOO_RUNNER_CUDA
  static const bool present = [] {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  }();
  return present;
#else
  return false;
#endif
}

std::string cuda_sync() {
#ifdef ZOO_RUNNER_CUDA
  if (cuda_device_present()) {
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      return cuda_error("cudaDeviceSynchronize", err);
    }
  }
#endif
  return "";
}

bool is_device_pointer(const void* ptr) {
#ifdef ZOO_RUNNER_CUDA
  if (ptr == nullptr || !cuda_device_present()) {
    return false;
  }
  cudaPointerAttributes attributes{};
  const cudaError_t err = cudaPointerGetAttributes(&attributes, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // a host pointer the driver does not know is not an error to keep
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice;
#else
  (void)ptr;
  return false;
#endif
}

std::string keep_freed_memory_in_pool() {
#ifdef ZOO_RUNNER_CUDA
  if (!cuda_device_present()) {
    return "";
  }
  cudaMemPool_t pool = nullptr;
  cudaError_t err = cudaDeviceGetDefaultMemPool(&pool, 0);
  if (err != cudaSuccess) {
    return cuda_error("cudaDeviceGetDefaultMemPool", err);
  }
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  err = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
  if (err != cudaSuccess) {
    return cuda_error("cudaMemPoolSetAttribute(ReleaseThreshold)", err);
  }
#endif
  return "";
}

DeviceBuffer::~DeviceBuffer() {
#ifdef ZOO_RUNNER_CUDA
  if (owned && ptr != nullptr) {
    cudaFree(ptr);  // synchronises with the device: no kernel can still be reading it
  }
#endif
}

// --- values ----------------------------------------------------------------------------------------------------------

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * std::max<int64_t>(sizes[d + 1], 1);
  }
  return strides;
}

bool Value::contiguous() const {
  const auto want = contiguous_strides(sizes);
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] != 1 && strides[d] != want[d]) {
      return false;
    }
  }
  return true;
}

size_t Value::nbytes() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return static_cast<size_t>(n) * element_size(dtype);
}

Value host_value(HostTensor tensor) {
  Value v;
  v.dtype = tensor.dtype;
  v.sizes = tensor.sizes;
  v.strides = contiguous_strides(tensor.sizes);
  v.host = std::move(tensor);
  return v;
}

std::string gather_contiguous(const uint8_t* storage, uint32_t dtype, const std::vector<int64_t>& sizes,
                              const std::vector<int64_t>& strides, HostTensor* out) {
  const size_t elem = element_size(dtype);
  if (elem == 0) {
    return "dtype " + dtype_name(dtype) + " is not one the zoo tensor format carries";
  }
  out->dtype = dtype;
  out->sizes = sizes;
  const int64_t n = out->numel();
  out->data.resize(static_cast<size_t>(n) * elem);
  if (n == 0) {
    return "";
  }
  Value shape;
  shape.sizes = sizes;
  shape.strides = strides;
  if (shape.contiguous()) {
    std::memcpy(out->data.data(), storage, out->data.size());
    return "";
  }
  std::vector<int64_t> index(sizes.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (size_t d = 0; d < sizes.size(); ++d) {
      offset += index[d] * strides[d];
    }
    std::memcpy(out->data.data() + i * elem, storage + offset * elem, elem);
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      if (++index[d] < sizes[d]) break;
      index[d] = 0;
    }
  }
  return "";
}

std::string to_host(const Value& value, HostTensor* out) {
  if (!value.on_device()) {
    *out = value.host;
    return "";
  }
#ifdef ZOO_RUNNER_CUDA
  const size_t elem = element_size(value.dtype);
  std::vector<uint8_t> storage(static_cast<size_t>(span_elements(value.sizes, value.strides)) * elem);
  if (!storage.empty()) {
    const cudaError_t err = cudaMemcpy(storage.data(), value.device->ptr, storage.size(), cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) {
      return cuda_error("cudaMemcpy to the host", err);
    }
  }
  return gather_contiguous(storage.data(), value.dtype, value.sizes, value.strides, out);
#else
  return "a device value in a build without CUDA";
#endif
}

namespace {

std::string device_alloc(size_t nbytes, std::shared_ptr<DeviceBuffer>* out) {
#ifdef ZOO_RUNNER_CUDA
  auto buffer = std::make_shared<DeviceBuffer>();
  buffer->owned = true;
  buffer->nbytes = nbytes;
  if (nbytes > 0) {
    const cudaError_t err = cudaMalloc(&buffer->ptr, nbytes);
    if (err != cudaSuccess) {
      return cuda_error(("cudaMalloc of " + std::to_string(nbytes) + " bytes").c_str(), err);
    }
  }
  *out = std::move(buffer);
  return "";
#else
  (void)nbytes;
  (void)out;
  return "no GPU in a build without CUDA";
#endif
}

}  // namespace

std::string owned_copy(const Value& value, Value* out) {
  Value copy;
  copy.dtype = value.dtype;
  copy.sizes = value.sizes;
  copy.strides = contiguous_strides(value.sizes);
  if (!cuda_device_present()) {
    std::string err = to_host(value, &copy.host);
    *out = std::move(copy);
    return err;
  }
#ifdef ZOO_RUNNER_CUDA
  HostTensor staged;
  const void* src = value.host.data.data();
  cudaMemcpyKind kind = cudaMemcpyHostToDevice;
  if (value.on_device() && value.contiguous()) {
    src = value.device->ptr;
    kind = cudaMemcpyDeviceToDevice;
  } else if (value.on_device()) {  // strided on the GPU: through the host, in logical order (rare: state is dense)
    std::string err = to_host(value, &staged);
    if (!err.empty()) return err;
    src = staged.data.data();
  }
  std::string err = device_alloc(value.nbytes(), &copy.device);
  if (!err.empty()) return err;
  if (value.nbytes() > 0) {
    const cudaError_t cerr = cudaMemcpy(copy.device->ptr, src, value.nbytes(), kind);
    if (cerr != cudaSuccess) return cuda_error("cudaMemcpy into zoo_runner's copy", cerr);
  }
  *out = std::move(copy);
  return cuda_sync();  // a device-to-device copy does not wait for itself; the next call may run on another stream
#else
  return "";
#endif
}

std::string zeros(uint32_t dtype, const std::vector<int64_t>& sizes, Value* out) {
  Value v;
  v.dtype = dtype;
  v.sizes = sizes;
  v.strides = contiguous_strides(sizes);
  if (!cuda_device_present()) {
    v.host.dtype = dtype;
    v.host.sizes = sizes;
    v.host.data.assign(v.nbytes(), 0);
    *out = std::move(v);
    return "";
  }
  std::string err = device_alloc(v.nbytes(), &v.device);
  if (!err.empty()) return err;
  err = zero_fill(v);
  *out = std::move(v);
  return err;
}

std::string zero_fill(const Value& value) {
#ifdef ZOO_RUNNER_CUDA
  if (value.on_device() && value.device->nbytes > 0) {
    const cudaError_t err = cudaMemset(value.device->ptr, 0, value.device->nbytes);
    if (err != cudaSuccess) return cuda_error("cudaMemset", err);
    return cuda_sync();
  }
#endif
  (void)value;
  return "";
}

// --- named values ----------------------------------------------------------------------------------------------------

const Value* NamedValues::find(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? nullptr : &it->second;
}

void NamedValues::bind(const std::string& name, Value value) { values_[name] = std::move(value); }

bool NamedValues::drop(const std::string& name) { return values_.erase(name) > 0; }

std::vector<std::string> NamedValues::names() const {
  std::vector<std::string> out;
  for (const auto& entry : values_) out.push_back(entry.first);
  return out;
}

std::string NamedValues::rescue(const std::string& method, uint64_t next_call, const std::set<std::string>& rebound,
                                std::vector<std::string>* rescued) {
  for (auto& entry : values_) {
    const Value& v = entry.second;
    if (!v.on_device() || v.device->owned || v.device->method != method || v.device->call + 1 != next_call ||
        rebound.count(entry.first)) {
      continue;
    }
    Value copy;
    std::string err = owned_copy(v, &copy);
    if (!err.empty()) {
      return "keeping " + entry.first + " alive past the next call of " + method + ": " + err;
    }
    entry.second = std::move(copy);
    rescued->push_back(entry.first);
  }
  return "";
}

}  // namespace zoo
