// MethodRunner: one loaded zoo program in ExecuTorch's runtime (method_runner.h says what it does and why).

#include "method_runner.h"

#include <algorithm>
#include <set>
#include <sstream>

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/platform/log.h>
#ifdef ZOO_RUNNER_CUDA
#include <cuda_runtime.h>
#endif

#include "gpu_targets.h"

namespace zoo {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::extension::Module;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::MethodMeta;
using executorch::runtime::Tag;

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out.empty() ? "none" : out;
}

const char* tag_name(Tag tag) {
  switch (tag) {
    case Tag::None: return "None";
    case Tag::Tensor: return "Tensor";
    case Tag::String: return "String";
    case Tag::Double: return "Double";
    case Tag::Int: return "Int";
    case Tag::Bool: return "Bool";
    default: return "a list or other value";
  }
}

// A non-tensor output as a 0-d host value (int64, float64, bool).
std::string scalar_to_value(const EValue& v, Value* out) {
  HostTensor h;
  if (v.isInt()) {
    const int64_t x = v.toInt();
    h.dtype = 4;
    h.data.assign(reinterpret_cast<const uint8_t*>(&x), reinterpret_cast<const uint8_t*>(&x) + 8);
  } else if (v.isDouble()) {
    const double x = v.toDouble();
    h.dtype = 7;
    h.data.assign(reinterpret_cast<const uint8_t*>(&x), reinterpret_cast<const uint8_t*>(&x) + 8);
  } else if (v.isBool()) {
    h.dtype = 11;
    h.data.assign(1, v.toBool() ? 1 : 0);
  } else {
    return std::string("an output is ") + tag_name(v.tag) + ", which zoo cannot hand back";
  }
  *out = host_value(std::move(h));
  return "";
}

}  // namespace

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, sep)) {
    if (!item.empty()) {
      out.push_back(item);
    }
  }
  return out;
}

std::string shape_text(const std::vector<int64_t>& sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

// Checks the inputs against the method's own signature before the runtime sees them, so that a wrong count or
// dtype is named here.
std::string check_inputs(const std::string& method, const MethodMeta& meta, const std::vector<Value>& inputs) {
  if (meta.num_inputs() != inputs.size()) {
    return "method " + method + " takes " + std::to_string(meta.num_inputs()) + " inputs, " +
           std::to_string(inputs.size()) + " were given";
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto tag = meta.input_tag(i);
    if (!tag.ok()) {
      return "method " + method + ": cannot read the tag of input " + std::to_string(i);
    }
    if (*tag != Tag::Tensor) {
      return "method " + method + ": input " + std::to_string(i) + " is " + tag_name(*tag) +
             "; zoo passes tensors only";
    }
    auto info = meta.input_tensor_meta(i);
    if (!info.ok()) {
      return "method " + method + ": cannot read the tensor meta of input " + std::to_string(i);
    }
    const uint32_t want = static_cast<uint32_t>(info->scalar_type());
    if (inputs[i].dtype != want) {
      return "method " + method + ": input " + std::to_string(i) + " is " + dtype_name(inputs[i].dtype) +
             ", the method takes " + dtype_name(want);
    }
    if (info->sizes().size() != inputs[i].sizes.size()) {
      std::vector<int64_t> want_sizes(info->sizes().begin(), info->sizes().end());
      return "method " + method + ": input " + std::to_string(i) + " has shape " + shape_text(inputs[i].sizes) +
             ", the method takes rank " + std::to_string(want_sizes.size()) + " (" + shape_text(want_sizes) + ")";
    }
  }
  return "";
}

std::string check_gpu_targets(const std::string& model, std::string* kernels) {
#ifdef ZOO_RUNNER_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    return "";
  }
  std::string read_error;
  const BinaryTargets targets = scan_file(model, &read_error);
  if (!read_error.empty()) {
    return "";  // the load names an unreadable file itself
  }
  std::set<std::string> names;
  for (const auto& fatbin : targets.fatbins) {
    for (const auto& image : fatbin) names.insert(image.name());
  }
  for (const auto& n : names) {
    *kernels += (kernels->empty() ? "" : "/") + n;
  }
  return check_targets(targets, prop.major * 10 + prop.minor, prop.name, this_machine());
#else
  (void)model;
  (void)kernels;
  return "";
#endif
}

executorch::runtime::Result<MethodMeta> MethodRunner::meta(const std::string& method) const {
  if (!module_ || !module_->is_method_loaded(method)) return Error::InvalidArgument;
  return module_->method_meta(method);
}

// Returns "" or why loading failed (ExecuTorch's log on stderr says more).
std::string MethodRunner::load(double* load_ms, std::vector<std::string>* loaded) {
  module_ = std::make_unique<Module>(options_.model, options_.data, Module::LoadMode::Mmap);
  const auto start = std::chrono::steady_clock::now();
  const Error err = module_->load();
  if (err != Error::Ok) {
    return "cannot load program " + options_.model + ": " + executorch::runtime::to_string(err);
  }
  auto names = module_->method_names();
  if (!names.ok()) {
    return "cannot list the methods of " + options_.model + ": " + executorch::runtime::to_string(names.error());
  }
  std::vector<std::string> all(names->begin(), names->end());
  std::sort(all.begin(), all.end());
  std::string why = set_backend_options(all);
  if (!why.empty()) {
    return why;
  }
  std::vector<std::string> to_load = options_.load.empty() ? all : options_.load;
  for (const auto& m : to_load) {
    if (!names->count(m)) {
      return "the program has no method " + m + " (it has " + join(all) + ")";
    }
    const Error e = module_->load_method(m);
    if (e != Error::Ok) {
      return "cannot load method " + m + ": " + executorch::runtime::to_string(e) +
             " (ExecuTorch's log above says why; a missing .ptd, a dtype the runtime lacks, or an undefined "
             "aoti_torch_* symbol are the usual causes)";
    }
    why = read_planned_memory(m);
    if (!why.empty()) {
      return why;
    }
    loaded->push_back(m);
  }
  const std::string sync = cuda_sync();
  *load_ms = ms_since(start);
  return sync;
}

uint64_t MethodRunner::calls_of(const std::string& method) const {
  auto it = calls_.find(method);
  return it == calls_.end() ? 0 : it->second;
}

// The number of outputs of a loaded method (0 and an error for one that is not loaded).
size_t MethodRunner::num_outputs(const std::string& method, std::string* error) const {
  if (!module_->is_method_loaded(method)) {
    *error = "method " + method + " is not loaded (loaded: " + join(loaded_names()) + ")";
    return 0;
  }
  auto meta = module_->method_meta(method);
  if (!meta.ok()) {
    *error = "cannot read the signature of " + method;
    return 0;
  }
  return meta->num_outputs();
}

CallResult MethodRunner::call(const std::string& method, const std::vector<Value>& inputs,
                              const std::vector<OutSpec>& specs) {
  CallResult r;
  const size_t n_out = num_outputs(method, &r.error);
  if (!r.error.empty()) return r;
  if (!specs.empty() && specs.size() != n_out) {
    r.error = "method " + method + " returns " + std::to_string(n_out) + " outputs, " +
              std::to_string(specs.size()) + " output modes were given";
    return r;
  }
  auto meta = module_->method_meta(method);
  r.error = check_inputs(method, *meta, inputs);
  if (!r.error.empty()) return r;
  std::vector<executorch::extension::TensorPtr> keep;
  std::vector<HostTensor> staged(inputs.size());
  std::vector<EValue> values;
  auto t0 = std::chrono::steady_clock::now();
  r.error = bind_inputs(method, inputs, &staged, &keep, &values, &r.host_copies);
  if (!r.error.empty()) return r;
  r.io_ms = ms_since(t0);
  const uint64_t call_number = ++calls_[method];
  t0 = std::chrono::steady_clock::now();
  auto result = module_->execute(method, values);
  const std::string sync = cuda_sync();
  r.ms = ms_since(t0);
  if (!result.ok()) {
    r.error = "method " + method + " failed: " + executorch::runtime::to_string(result.error());
    return r;
  }
  if (!sync.empty()) {
    r.error = "method " + method + ": " + sync;
    return r;
  }
  t0 = std::chrono::steady_clock::now();
  for (size_t k = 0; k < result->size() && r.error.empty(); ++k) {
    const OutMode mode = specs.empty() ? OutMode::Host : specs[k].mode;
    r.error = take_output((*result)[k], mode, method, call_number, &r);
  }
  r.io_ms += ms_since(t0);
  return r;
}

std::vector<std::string> MethodRunner::loaded_names() const {
  std::vector<std::string> out;
  auto names = module_->method_names();
  if (names.ok()) {
    for (const auto& n : *names) {
      if (module_->is_method_loaded(n)) out.push_back(n);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}


// Before any method loads: outputs of every method stay on the GPU (the caller copies back what it reads), all
// methods share one stream (a value one method leaves on the GPU is read by another), and weights are shared
// across methods where the backend can (1.3+, or 1.2 with zoo's patch).
std::string MethodRunner::set_backend_options(const std::vector<std::string>& methods) {
#ifdef ZOO_RUNNER_CUDA
  if (!cuda_device_present()) {
    return "";
  }
  std::string csv;
  for (const auto& m : methods) csv += (csv.empty() ? "" : ",") + m;
  if (csv.size() >= executorch::runtime::kMaxOptionValueLength) {
    return "the method names (" + csv + ") do not fit the CUDA backend's option value (" +
           std::to_string(executorch::runtime::kMaxOptionValueLength - 1) + " characters)";
  }
  executorch::runtime::BackendOptions<3> opts;
  Error e = opts.set_option("skip_copy_output_to_cpu_for_method", csv.c_str());
  if (e == Error::Ok) e = opts.set_option("use_shared_cuda_stream", true);
#ifdef ZOO_HAVE_WEIGHT_SHARING
  if (e == Error::Ok) e = opts.set_option("weight_sharing_across_methods", options_.weight_sharing);
#endif
  if (e == Error::Ok) e = executorch::runtime::set_option("CudaBackend", opts.view());
  if (e != Error::Ok) {
    return std::string("cannot set the CUDA backend's options: ") + executorch::runtime::to_string(e);
  }
  skip_copy_ = csv;
  const std::string pool = keep_freed_memory_in_pool();
  if (!pool.empty()) {
    ET_LOG(Error, "freed GPU memory goes back to the driver after each call: %s", pool.c_str());
  }
#else
  (void)methods;
#endif
  return "";
}

std::string MethodRunner::read_planned_memory(const std::string& method) {
  auto meta = module_->method_meta(method);
  if (!meta.ok()) {
    return "cannot read the signature of " + method;
  }
  PlannedMemory p;
  for (size_t i = 0; i < meta->num_inputs(); ++i) {
    auto info = meta->input_tensor_meta(i);
    p.inputs.push_back(info.ok() && info->is_memory_planned());
  }
  for (size_t k = 0; k < meta->num_outputs(); ++k) {
    auto info = meta->output_tensor_meta(k);
    p.outputs.push_back(info.ok() && info->is_memory_planned());
  }
  planned_[method] = std::move(p);
  return "";
}

// Each input as an EValue over the caller's data: a device pointer as it is (the backend uses it without a copy),
// host bytes for the backend to copy. An input the method plans memory for is copied into that (host) memory by
// Method::set_input, so a device value for it is first brought to the host (`staged`).
std::string MethodRunner::bind_inputs(const std::string& method, const std::vector<Value>& inputs,
                                      std::vector<HostTensor>* staged,
                                      std::vector<executorch::extension::TensorPtr>* keep,
                                      std::vector<EValue>* values, int* host_copies) {
  const auto& planned = planned_[method].inputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Value& v = inputs[i];
    void* data = v.host.data.empty() ? nullptr : const_cast<uint8_t*>(v.host.data.data());
    if (v.on_device() && i < planned.size() && planned[i]) {
      const std::string err = to_host(v, &(*staged)[i]);
      if (!err.empty()) return "method " + method + ": input " + std::to_string(i) + ": " + err;
      data = (*staged)[i].data.empty() ? nullptr : (*staged)[i].data.data();
      ++*host_copies;
    } else if (v.on_device()) {
      if (!v.contiguous()) {
        return "method " + method + ": input " + std::to_string(i) + " is a non-contiguous GPU value (strides " +
               shape_text(v.strides) + "); make it contiguous first";
      }
      data = v.device->ptr;
    }
    std::vector<executorch::aten::SizesType> sizes(v.sizes.begin(), v.sizes.end());
    keep->push_back(executorch::extension::from_blob(data, sizes, static_cast<ScalarType>(v.dtype)));
    values->emplace_back(*keep->back());
  }
  return "";
}

// One output of a call, as its mode asks: copied to the host, held (on the GPU where it came out), or dropped.
std::string MethodRunner::take_output(const EValue& ev, OutMode mode, const std::string& method,
                                      uint64_t call_number, CallResult* r) {
  Value v;
  bool device = false;
  if (ev.isNone()) {
    r->outputs.emplace_back();
    r->none.push_back(true);
    r->on_device.push_back(false);
    return "";
  }
  if (!ev.isTensor()) {
    std::string err = scalar_to_value(ev, &v);
    if (!err.empty()) return err;
  } else {
    const Tensor& t = ev.toTensor();
    v.dtype = static_cast<uint32_t>(t.scalar_type());
    v.sizes.assign(t.sizes().begin(), t.sizes().end());
    v.strides.assign(t.strides().begin(), t.strides().end());
    const void* ptr = t.const_data_ptr();
    device = is_device_pointer(ptr);
    if (device) {
      // The backend's allocation for this call's output: it frees it when the method runs again.
      v.device = std::make_shared<DeviceBuffer>();
      v.device->ptr = const_cast<void*>(ptr);
      v.device->nbytes = t.nbytes();
      v.device->method = method;
      v.device->call = call_number;
    } else if (mode != OutMode::Drop) {
      // Host data lives in the method's planned memory, which its next call overwrites: copy it now.
      std::string err = ptr == nullptr && t.numel() > 0 ? "output has no data" :
          gather_contiguous(static_cast<const uint8_t*>(ptr), v.dtype, v.sizes, v.strides, &v.host);
      if (!err.empty()) return "method " + method + ": " + err;
      v.strides = contiguous_strides(v.sizes);
    }
  }
  if (mode == OutMode::Host && v.on_device()) {
    HostTensor h;
    std::string err = to_host(v, &h);
    if (!err.empty()) return "method " + method + ": " + err;
    v = host_value(std::move(h));
  } else if (mode == OutMode::Drop) {
    v.device.reset();
    v.host = HostTensor{};
  }
  r->outputs.push_back(std::move(v));
  r->none.push_back(false);
  r->on_device.push_back(device);
  return "";
}

}  // namespace zoo
