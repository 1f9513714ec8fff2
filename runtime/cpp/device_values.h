// Tensors the runner (zoo_runner, zoo_session) holds between calls: in host memory, or on the GPU, where state one
// call hands to the next (LingBot-VA's KV pool, the VAE's causal caches, Fast-WAM's video K/V) stays without crossing
// to the host.
//
// Who owns device memory (ExecuTorch 1.2, backends/cuda/runtime/cuda_backend.cpp):
// - an input whose data is already a device pointer is used as it is (execute(), cudaPointerGetAttributes);
// - with the backend option skip_copy_output_to_cpu_for_method naming a method, its outputs stay on the GPU:
//   the backend allocates them in each call and frees the previous call's outputs of THAT method at the start of
//   the next call's cleanup (cached_outputs_, cudaFreeAsync on the method's stream, after the kernels that read
//   them). So an output of call N of method M lives until call N+1 of M: a value still needed after that must
//   be copied first (NamedValues::rescue);
// - memory the runner allocates itself (uploads, zeros, rescued copies) is freed when no value refers to it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "tensor_file.h"

namespace zoo {

// --- the few CUDA calls the runner makes itself (each returns "" or the CUDA error; without CUDA, no-ops) ---------

// A CUDA build with a visible GPU. A CUDA build on a machine without one still runs portable programs on the host.
bool cuda_device_present();
std::string cuda_sync();
bool is_device_pointer(const void* ptr);
// Freed device memory stays in the pool for the next call's outputs (the backend allocates them with
// cudaMallocAsync; by default the pool hands freed memory back to the driver at every synchronisation).
std::string keep_freed_memory_in_pool();

// --- device memory and values ---------------------------------------------------------------------------------------

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t nbytes = 0;
  bool owned = false;    // the runner allocated it: freed with the last value that refers to it
  std::string method;    // else the output of this method's call number `call`, which the backend frees when
  uint64_t call = 0;     //   the method runs again
  ~DeviceBuffer();
};

struct Value {
  uint32_t dtype = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // in elements; the data's own layout (for a host value: contiguous)
  HostTensor host;               // the data when on the host
  std::shared_ptr<DeviceBuffer> device;

  bool on_device() const { return device != nullptr; }
  bool contiguous() const;
  size_t nbytes() const;  // the logical bytes: numel x element size
};

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes);
Value host_value(HostTensor tensor);
// A contiguous host copy (logical order) of strided data in host memory: `storage` is the first element's byte.
std::string gather_contiguous(const uint8_t* storage, uint32_t dtype, const std::vector<int64_t>& sizes,
                              const std::vector<int64_t>& strides, HostTensor* out);
// Device data back to the host (contiguous, logical order); a host value is copied as it is.
std::string to_host(const Value& value, HostTensor* out);
// A copy in memory the runner owns: on the GPU when one is present (an upload for a host value), else on the host.
std::string owned_copy(const Value& value, Value* out);
// A zero-filled tensor the runner owns, on the GPU when one is present.
std::string zeros(uint32_t dtype, const std::vector<int64_t>& sizes, Value* out);
// Fills a device value's memory with zeros in place.
std::string zero_fill(const Value& value);

// --- the values the caller names (`keep:NAME`, `zeros NAME`, `upload NAME`) -----------------------------------------

class NamedValues {
 public:
  const Value* find(const std::string& name) const;
  void bind(const std::string& name, Value value);  // an earlier value of that name is released
  bool drop(const std::string& name);
  std::vector<std::string> names() const;
  // Before call number `next_call` of `method`: a named value that this call's cleanup frees (an output of the
  // method's previous call) and that the call does not replace (`rebound`) is copied into memory the runner owns.
  // Returns "" or an error; `rescued` gets the names copied.
  std::string rescue(const std::string& method, uint64_t next_call, const std::set<std::string>& rebound,
                     std::vector<std::string>* rescued);

 private:
  std::map<std::string, Value> values_;
};

}  // namespace zoo
