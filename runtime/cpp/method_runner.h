// One loaded zoo program in ExecuTorch's runtime: load it with the CUDA backend's options set, call a method on
// host or device tensors, take each output as the caller asks. zoo_runner (a process of its own, driven over a
// pipe) and zoo_session (a shared library, loaded into the caller's process) are both built on it.
//
// On the GPU (ExecuTorch 1.2's CUDA backend, backends/cuda/runtime/cuda_backend.cpp): every method of the program
// is put in the backend's skip_copy_output_to_cpu_for_method list, so outputs stay on the GPU and the caller copies
// back only what it reads; an input given as a device pointer is used as it is; all methods share one CUDA stream.
// An artifact lowered with its graph inputs memory-planned cannot take a device pointer (Method::set_input
// memcpy's into planned memory): such an input is copied to the host first and counted ("host_copies").
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include "device_values.h"

namespace zoo {

double ms_since(std::chrono::steady_clock::time_point start);

// The non-empty items of a `sep`-separated list ("a,b,,c" -> a, b, c): the command line's lists, the build's
// patch names, the methods to load.
std::vector<std::string> split(const std::string& s, char sep);

// "[2, 3]": a shape in messages and JSON.
std::string shape_text(const std::vector<int64_t>& sizes);

// Checks the inputs against the method's own signature before the runtime sees them, so that a wrong count or
// dtype is named here.
std::string check_inputs(const std::string& method, const executorch::runtime::MethodMeta& meta,
                         const std::vector<Value>& inputs);

// Whether this GPU and host can run the artifact's kernels and host code, read from model.pte's bytes before
// ExecuTorch loads it (gpu_targets.h): "" when they can, or when there is no GPU to ask (loading then says so);
// else why, and what to do. Sets `kernels` to the kernel images found.
std::string check_gpu_targets(const std::string& model, std::string* kernels);

struct LoadOptions {
  std::string model;
  std::vector<std::string> data;  // .ptd files
  std::vector<std::string> load;  // methods to load (empty: all)
  bool weight_sharing = true;     // weights shared across methods where the backend can
};

// What becomes of one output of a call.
enum class OutMode { Host, Keep, Drop };

struct OutSpec {
  OutMode mode = OutMode::Host;
  std::string name;  // for Keep
};

struct CallResult {
  std::string error;
  double ms = 0;     // the method: execute() and the device synchronisation after it
  double io_ms = 0;  // the runner's own copies for this call (planned inputs to the host, host outputs back)
  std::vector<Value> outputs;  // Host: a host value; Keep: the value as it came out; Drop and None: shape only
  std::vector<bool> none, on_device;
  int host_copies = 0;  // device inputs that crossed to the host because the method plans its input memory
};

struct PlannedMemory {
  std::vector<bool> inputs, outputs;  // which graph inputs / outputs live in the method's planned (host) memory
};

class MethodRunner {
 public:
  explicit MethodRunner(LoadOptions options) : options_(std::move(options)) {}

  // Returns "" or why loading failed (ExecuTorch's log on stderr says more).
  std::string load(double* load_ms, std::vector<std::string>* loaded);

  const std::map<std::string, PlannedMemory>& planned() const { return planned_; }
  uint64_t calls_of(const std::string& method) const;
  bool skip_copy() const { return !skip_copy_.empty(); }

  // The number of outputs of a loaded method (0 and an error for one that is not loaded).
  size_t num_outputs(const std::string& method, std::string* error) const;
  // The signature of a loaded method (an error for one that is not loaded).
  executorch::runtime::Result<executorch::runtime::MethodMeta> meta(const std::string& method) const;

  CallResult call(const std::string& method, const std::vector<Value>& inputs, const std::vector<OutSpec>& specs);

  std::vector<std::string> loaded_names() const;

 private:
  std::string set_backend_options(const std::vector<std::string>& methods);
  std::string read_planned_memory(const std::string& method);
  std::string bind_inputs(const std::string& method, const std::vector<Value>& inputs, std::vector<HostTensor>* staged,
                          std::vector<executorch::extension::TensorPtr>* keep,
                          std::vector<executorch::runtime::EValue>* values, int* host_copies);
  std::string take_output(const executorch::runtime::EValue& ev, OutMode mode, const std::string& method,
                          uint64_t call_number, CallResult* r);

  LoadOptions options_;
  std::unique_ptr<executorch::extension::Module> module_;
  std::map<std::string, PlannedMemory> planned_;
  std::map<std::string, uint64_t> calls_;
  std::string skip_copy_;
};

}  // namespace zoo
