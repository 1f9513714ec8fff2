// zoo_runner: load a zoo artifact (model.pte + aoti_cuda_blob.ptd) with ExecuTorch's C++ runtime and its CUDA
// backend, run methods on tensors read from files or held on the GPU, write the outputs, time the calls.
//
// Two modes, one loaded program each:
//   single  --method NAME --inputs a.zt,b.zt : warm-up calls, then timed calls; median and p90 latency.
//           --device-inputs/--keep-outputs put chosen inputs on the GPU once and leave chosen outputs there.
//   plan    --plan FILE (or - for stdin)      : a sequence of commands, one per line (docs/runtime.md):
//             METHOD IN IN ... [-> OUT OUT ...]   IN: a tensor file, @S:K (output K of call S, from the last
//                                                 calls' host outputs) or $NAME (a value the runner holds);
//                                                 OUT per output: host (copied back, written), keep:NAME (held
//                                                 under NAME, on the GPU where it came out), drop
//             zeros NAME DTYPE [D0,D1,...] | upload NAME FILE | fetch NAME FILE | drop NAME ... | names | quit
//           State one call hands to the next (LingBot-VA's KV pool, the VAE caches, Fast-WAM's video K/V) stays on
//           the GPU as $NAME, never crossing to the host. Once the program is loaded the runner prints a
//           {"ready": true, ...} line, then answers each command with one JSON line as soon as it is done, so a
//           caller can drive it over a pipe (zoo/et_runtime.py does).
// Both end with one JSON summary line on stdout. ExecuTorch's own log (compiled in) goes to stderr.
// Before loading, the kernels and host code in model.pte are checked against this GPU and host (gpu_targets.h): an
// artifact lowered for another GPU is refused with stage "gpu_target" and what to do.
// Exit status: 0 ok, 2 bad command line or input file, 3 the program or a method failed to load (or cannot run on
// this GPU), 4 a call failed.
//
// On the GPU (ExecuTorch 1.2's CUDA backend, backends/cuda/runtime/cuda_backend.cpp): every method of the program
// is put in the backend's skip_copy_output_to_cpu_for_method list, so outputs stay on the GPU and zoo_runner copies
// back only what a caller reads; an input given as a device pointer is used as it is; all methods share one CUDA
// stream. An artifact lowered with its graph inputs memory-planned cannot take a device pointer (Method::set_input
// memcpy's into planned memory): such an input is copied to the host first and counted ("host_copies").
// Inputs are given in the method's signature order: the runtime hands them to the compiled .so in its own order.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/platform/log.h>
#include <executorch/runtime/platform/runtime.h>
#if __has_include(<executorch/runtime/core/version.h>)
#include <executorch/runtime/core/version.h>
#endif
#ifndef ET_VERSION
#define ET_VERSION "unknown"
#endif
#ifndef ZOO_RUNTIME_PATCHES
#define ZOO_RUNTIME_PATCHES ""
#endif

#ifdef ZOO_RUNNER_CUDA
#include <cuda_runtime.h>
#endif

#include "device_values.h"
#include "gpu_targets.h"
#include "tensor_file.h"

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::extension::Module;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::MethodMeta;
using executorch::runtime::Tag;
using zoo::HostTensor;
using zoo::Value;

constexpr int kExitUsage = 2;
constexpr int kExitLoad = 3;
constexpr int kExitCall = 4;
// The line protocol this runner speaks (zoo/et_runtime.py checks it): 2 adds $NAME inputs, "->" output modes,
// zeros/upload/fetch/drop/names, and the single mode's --device-inputs/--keep-outputs.
constexpr int kProtocol = 2;
// How many past calls' host outputs a plan can still refer to with @S:K (older ones are released).
constexpr size_t kHistory = 16;

// --- a minimal JSON writer (the summary is flat: strings, numbers, bools, lists) ----------------------------------

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string json_number(double v) {
  if (!std::isfinite(v)) {
    return "null";
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

class JsonObject {
 public:
  JsonObject& raw(const std::string& key, const std::string& value) {
    fields_.push_back(json_string(key) + ": " + value);
    return *this;
  }
  JsonObject& str(const std::string& key, const std::string& value) { return raw(key, json_string(value)); }
  JsonObject& num(const std::string& key, double value) { return raw(key, json_number(value)); }
  JsonObject& boolean(const std::string& key, bool value) { return raw(key, value ? "true" : "false"); }
  std::string text() const {
    std::string out = "{";
    for (size_t i = 0; i < fields_.size(); ++i) {
      out += (i ? ", " : "") + fields_[i];
    }
    return out + "}";
  }

 private:
  std::vector<std::string> fields_;
};

template <typename T, typename F>
std::string json_list(const std::vector<T>& items, F to_json) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) {
    out += (i ? ", " : "") + to_json(items[i]);
  }
  return out + "]";
}

std::string sizes_json(const std::vector<int64_t>& sizes) {
  return json_list(sizes, [](int64_t v) { return std::to_string(v); });
}

void emit(const JsonObject& obj) {
  std::cout << obj.text() << std::endl;  // endl flushes: a caller on the other end of a pipe waits for it
}


std::string json_strings(const std::vector<std::string>& items) { return json_list(items, json_string); }

std::string json_bools(const std::vector<bool>& items) {
  return json_list(items, [](bool b) { return std::string(b ? "true" : "false"); });
}

// --- command line ---------------------------------------------------------------------------------------------------

const char* kUsage =
    "usage: zoo_runner --model model.pte [--data aoti_cuda_blob.ptd] [--load m1,m2] [--no-weight-sharing]\n"
    "                  (--method NAME --inputs a.zt,b.zt [--warmup 3] [--iters 10]\n"
    "                   [--device-inputs all|I,J] [--keep-outputs all|K,L] | --plan FILE|-)\n"
    "                  [--outputs DIR]\n"
    "       zoo_runner --info\n"
    "  --method/--inputs  run one method: warm-up calls, then timed calls; outputs of the first call go to DIR\n"
    "  --device-inputs    inputs (signature positions, or all) put on the GPU once, before the calls\n"
    "  --keep-outputs     outputs left on the GPU in the timed calls (the others are copied back in each call)\n"
    "  --plan             a sequence of commands, one per line (METHOD IN ... [-> OUT ...], zeros, upload, fetch,\n"
    "                     drop, names, quit; docs/runtime.md)\n"
    "  --load             methods to load (default: every method of the program)\n"
    "  --outputs          where outputs are written (single: <method>.out<k>.zt; plan: step<i>.out<k>.zt)\n"
    "  --no-weight-sharing  each method loads its own copy of its weights (the backend's default)\n"
    "  --info             print what this build is (ExecuTorch version, CUDA, backends) as JSON and exit\n";

struct Options {
  std::string model, method, plan, outputs, device_inputs, keep_outputs;
  std::vector<std::string> data, inputs, load;
  int warmup = 3, iters = 10;
  bool info = false, weight_sharing = true;
};

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

bool parse_int(const std::string& s, int* out) {
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v < 0 || v > 1000000) {
    return false;
  }
  *out = static_cast<int>(v);
  return true;
}

// "all", "none" or "" (none), or comma-separated positions below `count`. Returns "" or what is wrong.
std::string parse_positions(const std::string& text, size_t count, const char* what, std::set<size_t>* out) {
  if (text.empty() || text == "none") return "";
  if (text == "all") {
    for (size_t i = 0; i < count; ++i) out->insert(i);
    return "";
  }
  for (const auto& item : split(text, ',')) {
    int v = 0;
    if (!parse_int(item, &v) || static_cast<size_t>(v) >= count) {
      return std::string(what) + " takes all, none or positions below " + std::to_string(count) + ", not " + item;
    }
    out->insert(static_cast<size_t>(v));
  }
  return "";
}

// Returns "" or a message saying what is wrong with the command line.
std::string parse_args(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos && arg.rfind("--", 0) == 0) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    auto take = [&](std::string* dst) -> bool {
      if (eq != std::string::npos) {
        *dst = value;
        return true;
      }
      if (i + 1 >= argc) {
        return false;
      }
      *dst = argv[++i];
      return true;
    };
    std::string v;
    if (arg == "--info") {
      o->info = true;
    } else if (arg == "--no-weight-sharing") {
      o->weight_sharing = false;
    } else if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (arg == "--model" || arg == "--data" || arg == "--method" || arg == "--inputs" || arg == "--plan" ||
               arg == "--outputs" || arg == "--load" || arg == "--warmup" || arg == "--iters" ||
               arg == "--device-inputs" || arg == "--keep-outputs") {
      if (!take(&v)) {
        return arg + " needs a value";
      }
      if (arg == "--model") o->model = v;
      else if (arg == "--data") o->data.push_back(v);
      else if (arg == "--method") o->method = v;
      else if (arg == "--inputs") o->inputs = split(v, ',');
      else if (arg == "--plan") o->plan = v;
      else if (arg == "--outputs") o->outputs = v;
      else if (arg == "--load") o->load = split(v, ',');
      else if (arg == "--device-inputs") o->device_inputs = v;
      else if (arg == "--keep-outputs") o->keep_outputs = v;
      else if (arg == "--warmup" && !parse_int(v, &o->warmup)) return "--warmup takes a count >= 0";
      else if (arg == "--iters" && (!parse_int(v, &o->iters) || o->iters < 1)) return "--iters takes a count >= 1";
    } else {
      return "unknown argument " + arg;
    }
  }
  if (o->info) {
    return "";
  }
  if (o->model.empty()) {
    return "--model is required";
  }
  if (o->method.empty() == o->plan.empty()) {
    return "give either --method (with --inputs) or --plan";
  }
  if (!o->plan.empty() && !o->inputs.empty()) {
    return "--inputs belongs to --method; a plan names its inputs on each line";
  }
  if (!o->plan.empty() && (!o->device_inputs.empty() || !o->keep_outputs.empty())) {
    return "--device-inputs and --keep-outputs belong to --method; a plan says $NAME and keep:NAME on each line";
  }
  return "";
}

// --- the build -------------------------------------------------------------------------------------------------------

std::string weight_sharing_state(const Options& o) {
#if defined(ZOO_RUNNER_CUDA) && defined(ZOO_HAVE_WEIGHT_SHARING)
  return o.weight_sharing ? "on" : "off (--no-weight-sharing)";
#elif defined(ZOO_RUNNER_CUDA)
  (void)o;
  return std::string("not available (the CUDA backend of ExecuTorch ") + ET_VERSION +
         " has no weight_sharing_across_methods option; it comes with 1.3, and zoo's patch for 1.2 was not applied)";
#else
  (void)o;
  return "not applicable (built without the CUDA backend)";
#endif
}

std::vector<std::string> registered_backends() {
  std::vector<std::string> names;
  for (size_t i = 0; i < executorch::runtime::get_num_registered_backends(); ++i) {
    auto name = executorch::runtime::get_backend_name(i);
    if (name.ok()) {
      names.push_back(*name);
    }
  }
  return names;
}

// "1.2" of "1.2.0": what an artifact's runtime requirement names.
std::string release_of(const std::string& version) {
  const size_t first = version.find('.');
  const size_t second = first == std::string::npos ? std::string::npos : version.find('.', first + 1);
  return version.substr(0, second);
}

void add_build_facts(JsonObject& obj, const Options& o) {
  obj.str("executorch_version", ET_VERSION).str("release", release_of(ET_VERSION)).num("protocol", kProtocol);
#ifdef ZOO_RUNNER_CUDA
  obj.boolean("cuda", true);
#else
  obj.boolean("cuda", false);
#endif
  obj.str("weight_sharing_across_methods", weight_sharing_state(o));
  obj.raw("patches", json_strings(split(ZOO_RUNTIME_PATCHES, ',')));
  obj.raw("backends", json_strings(registered_backends()));
}

// --- GPU facts ------------------------------------------------------------------------------------------------------

struct GpuMemory {
  bool known = false;
  double used_mib = 0, total_mib = 0;
  std::string error;
};

GpuMemory gpu_memory() {
  GpuMemory m;
#ifdef ZOO_RUNNER_CUDA
  if (!zoo::cuda_device_present()) {
    m.error = "no CUDA device";
    return m;
  }
  size_t free_b = 0, total_b = 0;
  const cudaError_t err = cudaMemGetInfo(&free_b, &total_b);
  if (err != cudaSuccess) {
    m.error = cudaGetErrorString(err);
    return m;
  }
  m.known = true;
  m.used_mib = static_cast<double>(total_b - free_b) / (1024.0 * 1024.0);
  m.total_mib = static_cast<double>(total_b) / (1024.0 * 1024.0);
#else
  m.error = "built without CUDA";
#endif
  return m;
}

std::string gpu_name() {
#ifdef ZOO_RUNNER_CUDA
  cudaDeviceProp prop{};
  if (zoo::cuda_device_present() && cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    return prop.name;
  }
#endif
  return "";
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// Whether this GPU and host can run the artifact's kernels and host code, read from model.pte's bytes before
// ExecuTorch loads it (gpu_targets.h): "" when they can, or when there is no GPU to ask (loading then says so);
// else why, and what to do. Sets `kernels` to the kernel images found.
std::string check_gpu_targets(const std::string& model, std::string* kernels) {
#ifdef ZOO_RUNNER_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    return "";
  }
  std::string read_error;
  const zoo::BinaryTargets targets = zoo::scan_file(model, &read_error);
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
  return zoo::check_targets(targets, prop.major * 10 + prop.minor, prop.name, zoo::this_machine());
#else
  (void)model;
  (void)kernels;
  return "";
#endif
}

// --- tensors in and out ----------------------------------------------------------------------------------------------

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
    return std::string("an output is ") + tag_name(v.tag) + ", which zoo_runner cannot write";
  }
  *out = zoo::host_value(std::move(h));
  return "";
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
             "; zoo_runner passes tensors only";
    }
    auto info = meta.input_tensor_meta(i);
    if (!info.ok()) {
      return "method " + method + ": cannot read the tensor meta of input " + std::to_string(i);
    }
    const uint32_t want = static_cast<uint32_t>(info->scalar_type());
    if (inputs[i].dtype != want) {
      return "method " + method + ": input " + std::to_string(i) + " is " + zoo::dtype_name(inputs[i].dtype) +
             ", the method takes " + zoo::dtype_name(want);
    }
    if (info->sizes().size() != inputs[i].sizes.size()) {
      std::vector<int64_t> want_sizes(info->sizes().begin(), info->sizes().end());
      return "method " + method + ": input " + std::to_string(i) + " has shape " + sizes_json(inputs[i].sizes) +
             ", the method takes rank " + std::to_string(want_sizes.size()) + " (" + sizes_json(want_sizes) + ")";
    }
  }
  return "";
}

// --- the loaded program ----------------------------------------------------------------------------------------------

// What becomes of one output of a call.
enum class OutMode { Host, Keep, Drop };
struct OutSpec {
  OutMode mode = OutMode::Host;
  std::string name;  // for Keep
};

struct CallResult {
  std::string error;
  double ms = 0;     // the method: execute() and the device synchronisation after it
  double io_ms = 0;  // zoo_runner's own copies for this call (planned inputs to the host, host outputs back)
  std::vector<Value> outputs;  // Host: a host value; Keep: the value as it came out; Drop and None: shape only
  std::vector<bool> none, on_device;
  int host_copies = 0;  // device inputs that crossed to the host because the method plans its input memory
};

struct PlannedMemory {
  std::vector<bool> inputs, outputs;  // which graph inputs / outputs live in the method's planned (host) memory
};

class Runner {
 public:
  explicit Runner(const Options& o) : options_(o) {}

  // Returns "" or why loading failed (ExecuTorch's log on stderr says more).
  std::string load(double* load_ms, std::vector<std::string>* loaded) {
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
    const std::string sync = zoo::cuda_sync();
    *load_ms = ms_since(start);
    return sync;
  }

  const std::map<std::string, PlannedMemory>& planned() const { return planned_; }
  uint64_t calls_of(const std::string& method) const {
    auto it = calls_.find(method);
    return it == calls_.end() ? 0 : it->second;
  }
  bool skip_copy() const { return !skip_copy_.empty(); }

  // The number of outputs of a loaded method (0 and an error for one that is not loaded).
  size_t num_outputs(const std::string& method, std::string* error) const {
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

  CallResult call(const std::string& method, const std::vector<Value>& inputs, const std::vector<OutSpec>& specs) {
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
    const std::string sync = zoo::cuda_sync();
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

  std::vector<std::string> loaded_names() const {
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

 private:
  static std::string join(const std::vector<std::string>& v) {
    std::string out;
    for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
    return out.empty() ? "none" : out;
  }

  // Before any method loads: outputs of every method stay on the GPU (zoo_runner copies back what is read), all
  // methods share one stream (a value one method leaves on the GPU is read by another), and weights are shared
  // across methods where the backend can (1.3+, or 1.2 with zoo's patch).
  std::string set_backend_options(const std::vector<std::string>& methods) {
#ifdef ZOO_RUNNER_CUDA
    if (!zoo::cuda_device_present()) {
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
    const std::string pool = zoo::keep_freed_memory_in_pool();
    if (!pool.empty()) {
      ET_LOG(Error, "freed GPU memory goes back to the driver after each call: %s", pool.c_str());
    }
#else
    (void)methods;
#endif
    return "";
  }

  std::string read_planned_memory(const std::string& method) {
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
  std::string bind_inputs(const std::string& method, const std::vector<Value>& inputs, std::vector<HostTensor>* staged,
                          std::vector<executorch::extension::TensorPtr>* keep, std::vector<EValue>* values,
                          int* host_copies) {
    const auto& planned = planned_[method].inputs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Value& v = inputs[i];
      void* data = v.host.data.empty() ? nullptr : const_cast<uint8_t*>(v.host.data.data());
      if (v.on_device() && i < planned.size() && planned[i]) {
        const std::string err = zoo::to_host(v, &(*staged)[i]);
        if (!err.empty()) return "method " + method + ": input " + std::to_string(i) + ": " + err;
        data = (*staged)[i].data.empty() ? nullptr : (*staged)[i].data.data();
        ++*host_copies;
      } else if (v.on_device()) {
        if (!v.contiguous()) {
          return "method " + method + ": input " + std::to_string(i) + " is a non-contiguous GPU value (strides " +
                 sizes_json(v.strides) + "); fetch it and pass it as a file";
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
  std::string take_output(const EValue& ev, OutMode mode, const std::string& method, uint64_t call_number,
                          CallResult* r) {
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
      device = zoo::is_device_pointer(ptr);
      if (device) {
        // The backend's allocation for this call's output: it frees it when the method runs again.
        v.device = std::make_shared<zoo::DeviceBuffer>();
        v.device->ptr = const_cast<void*>(ptr);
        v.device->nbytes = t.nbytes();
        v.device->method = method;
        v.device->call = call_number;
      } else if (mode != OutMode::Drop) {
        // Host data lives in the method's planned memory, which its next call overwrites: copy it now.
        std::string err = ptr == nullptr && t.numel() > 0 ? "output has no data" :
            zoo::gather_contiguous(static_cast<const uint8_t*>(ptr), v.dtype, v.sizes, v.strides, &v.host);
        if (!err.empty()) return "method " + method + ": " + err;
        v.strides = zoo::contiguous_strides(v.sizes);
      }
    }
    if (mode == OutMode::Host && v.on_device()) {
      HostTensor h;
      std::string err = zoo::to_host(v, &h);
      if (!err.empty()) return "method " + method + ": " + err;
      v = zoo::host_value(std::move(h));
    } else if (mode == OutMode::Drop) {
      v.device.reset();
      v.host = HostTensor{};
    }
    r->outputs.push_back(std::move(v));
    r->none.push_back(false);
    r->on_device.push_back(device);
    return "";
  }

  const Options& options_;
  std::unique_ptr<Module> module_;
  std::map<std::string, PlannedMemory> planned_;
  std::map<std::string, uint64_t> calls_;
  std::string skip_copy_;
};

std::string output_path(const std::string& dir, const std::string& stem, size_t k) {
  return dir + "/" + stem + ".out" + std::to_string(k) + ".zt";
}

// Writes a call's host outputs as <dir>/<stem>.out<k>.zt; `paths` gets "" for an output not on the host.
std::string write_outputs(const std::string& dir, const std::string& stem, const CallResult& r,
                          const std::vector<OutSpec>& specs, std::vector<std::string>* paths) {
  for (size_t k = 0; k < r.outputs.size(); ++k) {
    const bool host = specs.empty() || specs[k].mode == OutMode::Host;
    if (r.none[k] || !host || dir.empty()) {
      paths->push_back("");
      continue;
    }
    const std::string path = output_path(dir, stem, k);
    const std::string err = zoo::write_tensor_file(path, r.outputs[k].host);
    if (!err.empty()) {
      return err;
    }
    paths->push_back(path);
  }
  return "";
}

void add_outputs_json(JsonObject& obj, const CallResult& r, const std::vector<std::string>& paths) {
  obj.raw("outputs", json_list(paths, [](const std::string& p) { return p.empty() ? std::string("null") : json_string(p); }));
  std::vector<std::string> shapes, dtypes;
  for (const auto& t : r.outputs) {
    shapes.push_back(sizes_json(t.sizes));
    dtypes.push_back(zoo::dtype_name(t.dtype));
  }
  obj.raw("shapes", json_list(shapes, [](const std::string& s) { return s; }));
  obj.raw("dtypes", json_strings(dtypes));
  obj.raw("device", json_bools(r.on_device));
}

double percentile(std::vector<double> v, double q) {
  // Nearest rank: the smallest value with at least q of the samples at or below it.
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[rank == 0 ? 0 : rank - 1];
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// What the session saw, for the summary line.
struct Totals {
  int rescued = 0, host_copies = 0;
  double gpu_peak_mib = 0;
  void after_call(const CallResult& r) {
    host_copies += r.host_copies;
    const auto m = gpu_memory();
    if (m.known) gpu_peak_mib = std::max(gpu_peak_mib, m.used_mib);
  }
  void add_to(JsonObject& summary) const {
    summary.num("rescued", rescued).num("host_copies", host_copies);
    if (gpu_peak_mib > 0) summary.num("gpu_used_mib_peak", gpu_peak_mib);
  }
};

// --- single mode ----------------------------------------------------------------------------------------------------

int run_single(const Options& o, Runner& runner, JsonObject& summary, Totals& totals) {
  std::vector<Value> inputs(o.inputs.size());
  for (size_t i = 0; i < o.inputs.size(); ++i) {
    HostTensor t;
    const std::string err = zoo::read_tensor_file(o.inputs[i], &t);
    if (!err.empty()) {
      summary.boolean("ok", false).str("stage", "inputs").str("error", err);
      return kExitUsage;
    }
    inputs[i] = zoo::host_value(std::move(t));
  }
  std::string err;
  const size_t n_out = runner.num_outputs(o.method, &err);
  std::set<size_t> on_gpu, kept;
  if (err.empty()) err = parse_positions(o.device_inputs, inputs.size(), "--device-inputs", &on_gpu);
  if (err.empty()) err = parse_positions(o.keep_outputs, n_out, "--keep-outputs", &kept);
  for (size_t i : on_gpu) {
    if (err.empty() && zoo::cuda_device_present()) err = zoo::owned_copy(inputs[i], &inputs[i]);
  }
  if (!err.empty()) {
    summary.boolean("ok", false).str("stage", "inputs").str("error", err);
    return kExitUsage;
  }
  std::vector<OutSpec> specs(n_out);
  for (size_t k : kept) specs[k].mode = OutMode::Keep;
  summary.str("mode", "single").str("method", o.method).num("warmup", o.warmup).num("iters", o.iters);
  summary.raw("device_inputs", json_list(std::vector<size_t>(on_gpu.begin(), on_gpu.end()),
                                         [](size_t i) { return std::to_string(i); }));
  summary.raw("kept_outputs", json_list(std::vector<size_t>(kept.begin(), kept.end()),
                                        [](size_t i) { return std::to_string(i); }));
  std::vector<double> times, exec_times, io_times;
  CallResult first;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    CallResult r = runner.call(o.method, inputs, specs);
    if (!r.error.empty()) {
      summary.boolean("ok", false).str("stage", "call").str("error", r.error);
      return kExitCall;
    }
    totals.after_call(r);
    if (i >= o.warmup) {
      times.push_back(r.ms + r.io_ms);
      exec_times.push_back(r.ms);
      io_times.push_back(r.io_ms);
    }
    if (i == 0) {
      // The outputs written are the first call's (a stateful method moves on every call); one kept on the GPU is
      // copied back now, untimed: the next call frees it.
      for (auto& v : r.outputs) {
        HostTensor h;
        if (v.on_device() && (err = zoo::to_host(v, &h)).empty()) v = zoo::host_value(std::move(h));
      }
      first = std::move(r);
    }
  }
  std::vector<std::string> paths;
  err = write_outputs(o.outputs, o.method, first, {}, &paths);
  if (!err.empty()) {
    summary.boolean("ok", false).str("stage", "outputs").str("error", err);
    return kExitUsage;
  }
  add_outputs_json(summary, first, paths);
  summary.num("median_ms", median(times)).num("p90_ms", percentile(times, 0.9))
      .num("min_ms", *std::min_element(times.begin(), times.end()))
      .num("max_ms", *std::max_element(times.begin(), times.end()))
      .num("median_execute_ms", median(exec_times)).num("median_io_ms", median(io_times));
  summary.boolean("ok", true);
  return 0;
}

// --- plan mode -------------------------------------------------------------------------------------------------------

struct Session {
  Session(Runner& r, const Options& o) : runner(r), options(o) {}
  Runner& runner;
  const Options& options;
  zoo::NamedValues named;
  std::deque<std::pair<size_t, CallResult>> history;  // the last kHistory calls, for @S:K
  std::vector<double> times;
  size_t steps = 0;
  Totals totals;
};

// "@S:K": a host output of one of the last calls.
std::string resolve_reference(const std::string& token, const Session& s, const std::string& method, Value* out) {
  const size_t colon = token.find(':');
  char* end = nullptr;
  const std::string s_text = token.substr(1, colon == std::string::npos ? std::string::npos : colon - 1);
  const long step = std::strtol(s_text.c_str(), &end, 10);
  if (colon == std::string::npos || s_text.empty() || *end != '\0') {
    return "bad reference " + token + " (write @STEP:OUTPUT, e.g. @0:1 or @-1:2)";
  }
  const std::string k_text = token.substr(colon + 1);
  const long k = std::strtol(k_text.c_str(), &end, 10);
  if (k_text.empty() || *end != '\0' || k < 0) {
    return "bad reference " + token + " (OUTPUT is an index >= 0)";
  }
  const long src = step < 0 ? static_cast<long>(s.steps) + step : step;
  if (src < 0 || src >= static_cast<long>(s.steps)) {
    return "reference " + token + " in call " + std::to_string(s.steps) + " (" + method + ") names no earlier call";
  }
  for (const auto& entry : s.history) {
    if (entry.first != static_cast<size_t>(src)) continue;
    const CallResult& prev = entry.second;
    const size_t kk = static_cast<size_t>(k);
    if (kk >= prev.outputs.size() || prev.none[kk]) {
      return "reference " + token + ": call " + std::to_string(src) + " has no tensor output " + std::to_string(k);
    }
    if (prev.outputs[kk].on_device() || (prev.outputs[kk].host.data.empty() && prev.outputs[kk].nbytes() > 0)) {
      return "reference " + token + ": call " + std::to_string(src) + " kept output " + std::to_string(k) +
             " on the GPU or dropped it (a kept output is used as $NAME)";
    }
    *out = prev.outputs[kk];
    return "";
  }
  return "reference " + token + ": call " + std::to_string(src) + "'s outputs are no longer held (the runner keeps "
         "the last " + std::to_string(kHistory) + " calls'; hold an output with keep:NAME)";
}

std::string parse_out_spec(const std::string& token, OutSpec* spec) {
  if (token == "host") {
    spec->mode = OutMode::Host;
  } else if (token == "drop") {
    spec->mode = OutMode::Drop;
  } else if (token.rfind("keep:", 0) == 0 && token.size() > 5) {
    spec->mode = OutMode::Keep;
    spec->name = token.substr(5);
  } else {
    return "bad output mode " + token + " (host, drop or keep:NAME)";
  }
  return "";
}

// "METHOD IN ... [-> OUT ...]": one call. Replies with its JSON line; returns "" or the error.
std::string run_call(Session& s, std::istringstream& in, const std::string& method, JsonObject& reply) {
  std::vector<std::string> in_tokens;
  std::vector<OutSpec> specs;
  std::set<std::string> rebound;
  std::string token;
  bool outs = false;
  while (in >> token) {
    if (token == "->") {
      outs = true;
    } else if (outs) {
      OutSpec spec;
      std::string err = parse_out_spec(token, &spec);
      if (!err.empty()) return err;
      if (spec.mode == OutMode::Keep) rebound.insert(spec.name);
      specs.push_back(spec);
    } else {
      in_tokens.push_back(token);
    }
  }
  // Named values this call's cleanup would free and that it does not replace are copied first.
  std::vector<std::string> rescued;
  std::string err = s.named.rescue(method, s.runner.calls_of(method) + 1, rebound, &rescued);
  if (!err.empty()) return err;
  s.totals.rescued += static_cast<int>(rescued.size());
  std::vector<Value> inputs;
  for (const auto& t : in_tokens) {
    Value v;
    if (t[0] == '@') {
      err = resolve_reference(t, s, method, &v);
    } else if (t[0] == '$') {
      const Value* found = s.named.find(t.substr(1));
      if (found == nullptr) err = "no value named " + t.substr(1) + " (names: " + json_strings(s.named.names()) + ")";
      else v = *found;
    } else {
      HostTensor h;
      err = zoo::read_tensor_file(t, &h);
      v = zoo::host_value(std::move(h));
    }
    if (!err.empty()) return err;
    inputs.push_back(std::move(v));
  }
  reply.str("method", method);
  CallResult r = s.runner.call(method, inputs, specs);
  if (!r.error.empty()) return r.error;
  s.totals.after_call(r);
  std::vector<std::string> paths, kept;
  err = write_outputs(s.options.outputs, "step" + std::to_string(s.steps), r, specs, &paths);
  if (!err.empty()) return err;
  for (size_t k = 0; k < specs.size(); ++k) {
    if (specs[k].mode == OutMode::Keep && !r.none[k]) {
      s.named.bind(specs[k].name, r.outputs[k]);
      r.outputs[k].device.reset();  // the history keeps its shape only: a held value is used as $NAME, not @S:K
      r.outputs[k].host = HostTensor{};
      kept.push_back(specs[k].name);
    }
  }
  reply.boolean("ok", true).num("ms", r.ms).num("io_ms", r.io_ms);
  add_outputs_json(reply, r, paths);
  reply.raw("kept", json_strings(kept)).raw("rescued", json_strings(rescued)).num("host_copies", r.host_copies);
  s.times.push_back(r.ms);
  s.history.emplace_back(s.steps, std::move(r));
  if (s.history.size() > kHistory) s.history.pop_front();
  ++s.steps;
  return "";
}

uint32_t dtype_code(const std::string& name) {
  for (uint32_t code = 0; code < 64; ++code) {
    if (zoo::element_size(code) > 0 && zoo::dtype_name(code) == name) return code;
  }
  return UINT32_MAX;
}

void describe_value(JsonObject& obj, const Value& v) {
  obj.raw("shape", sizes_json(v.sizes)).str("dtype", zoo::dtype_name(v.dtype)).boolean("device", v.on_device());
}

// zeros / upload / fetch / drop / names. Returns "" or the error; fills the reply.
std::string run_command(Session& s, const std::string& command, std::istringstream& in, JsonObject& reply) {
  std::string name, arg, extra;
  reply.str("command", command);
  if (command == "names") {
    std::vector<std::string> items;
    for (const auto& n : s.named.names()) {
      JsonObject item;
      describe_value(item.str("name", n), *s.named.find(n));
      items.push_back(item.text());
    }
    reply.boolean("ok", true).raw("values", json_list(items, [](const std::string& t) { return t; }));
    return "";
  }
  if (command == "drop") {
    std::vector<std::string> dropped;
    while (in >> name) {
      if (!s.named.drop(name)) return "drop: no value named " + name;
      dropped.push_back(name);
    }
    reply.boolean("ok", true).raw("dropped", json_strings(dropped));
    return "";
  }
  if (!(in >> name >> arg)) return command + " takes a name and " + (command == "zeros" ? "a dtype and a shape" : "a file");
  Value v;
  std::string err;
  if (command == "zeros") {
    std::string shape;
    in >> shape;
    const uint32_t code = dtype_code(arg);
    if (code == UINT32_MAX) return "zeros: unknown dtype " + arg;
    if (shape.size() < 2 || shape.front() != '[' || shape.back() != ']') return "zeros: write the shape as [D0,D1,...]";
    std::vector<int64_t> sizes;
    for (const auto& d : split(shape.substr(1, shape.size() - 2), ',')) sizes.push_back(std::strtoll(d.c_str(), nullptr, 10));
    const Value* old = s.named.find(name);
    if (old != nullptr && old->on_device() && old->dtype == code && old->sizes == sizes && old->contiguous() &&
        old->device.use_count() == 1) {
      err = zoo::zero_fill(*old);  // the value's own memory, zeroed in place: no second allocation
      v = *old;
    } else {
      s.named.drop(name);  // released before the new allocation
      err = zoo::zeros(code, sizes, &v);
    }
  } else if (command == "upload") {
    HostTensor h;
    err = zoo::read_tensor_file(arg, &h);
    if (err.empty()) err = zoo::owned_copy(zoo::host_value(std::move(h)), &v);
  } else if (command == "fetch") {
    const Value* found = s.named.find(name);
    if (found == nullptr) return "fetch: no value named " + name;
    HostTensor h;
    err = zoo::to_host(*found, &h);
    if (err.empty()) err = zoo::write_tensor_file(arg, h);
    if (!err.empty()) return "fetch " + name + ": " + err;
    describe_value(reply.boolean("ok", true).str("name", name).str("path", arg), *found);
    return "";
  } else {
    return "unknown command " + command;
  }
  if (!err.empty()) return command + " " + name + ": " + err;
  describe_value(reply.boolean("ok", true).str("name", name), v);
  s.named.bind(name, std::move(v));
  return "";
}

bool is_command(const std::string& word) {
  return word == "zeros" || word == "upload" || word == "fetch" || word == "drop" || word == "names";
}

int run_plan(const Options& o, Runner& runner, JsonObject& summary, Totals& totals) {
  std::ifstream file;
  std::istream* in = &std::cin;
  if (o.plan != "-") {
    file.open(o.plan);
    if (!file) {
      summary.boolean("ok", false).str("stage", "plan").str("error", "cannot open plan " + o.plan);
      return kExitUsage;
    }
    in = &file;
  }
  summary.str("mode", "plan");
  Session s(runner, o);
  std::string line;
  int rc = 0;
  while (std::getline(*in, line)) {
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') {
      continue;
    }
    std::istringstream words(line.substr(first));
    std::string head;
    words >> head;
    if (head == "quit") {
      break;
    }
    JsonObject reply;
    std::string err;
    if (is_command(head)) {
      err = run_command(s, head, words, reply);
    } else {
      reply.num("step", static_cast<double>(s.steps));
      err = run_call(s, words, head, reply);
    }
    if (!err.empty()) {
      emit(reply.boolean("ok", false).str("error", err));
      summary.boolean("ok", false).str("stage", is_command(head) ? head : "call")
          .num("failed_step", static_cast<double>(s.steps)).str("error", err);
      rc = kExitCall;
      break;
    }
    emit(reply);
  }
  summary.num("steps", static_cast<double>(s.steps));
  summary.raw("step_ms", json_list(s.times, json_number));
  summary.num("named_values", static_cast<double>(s.named.names().size()));
  totals = s.totals;
  if (rc == 0) summary.boolean("ok", true);
  return rc;
}

std::string planned_json(const std::map<std::string, PlannedMemory>& planned) {
  std::vector<std::string> items;
  for (const auto& entry : planned) {
    JsonObject m;
    m.raw("inputs", json_bools(entry.second.inputs)).raw("outputs", json_bools(entry.second.outputs));
    items.push_back(json_string(entry.first) + ": " + m.text());
  }
  std::string out = "{";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out + "}";
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const std::string usage_error = parse_args(argc, argv, &o);
  JsonObject summary;
  if (!usage_error.empty()) {
    std::cerr << "zoo_runner: " << usage_error << "\n" << kUsage;
    emit(summary.boolean("ok", false).str("stage", "arguments").str("error", usage_error));
    return kExitUsage;
  }
  executorch::runtime::runtime_init();
  add_build_facts(summary, o);
  if (o.info) {
    emit(summary.boolean("ok", true));
    return 0;
  }
  summary.str("model", o.model).raw("data", json_strings(o.data));
  const std::string gpu = gpu_name();
  if (!gpu.empty()) {
    summary.str("gpu", gpu);
  }
  std::string kernels;
  const std::string target_error = check_gpu_targets(o.model, &kernels);
  if (!kernels.empty()) {
    summary.str("kernels", kernels);
  }
  if (!target_error.empty()) {
    emit(summary.boolean("ok", false).str("stage", "gpu_target").str("error", target_error));
    return kExitLoad;
  }
  const GpuMemory before = gpu_memory();  // the first CUDA call creates the context: "before" includes it
  double load_ms = 0;
  std::vector<std::string> loaded;
  Runner runner(o);
  const std::string load_error = runner.load(&load_ms, &loaded);
  summary.raw("loaded", json_strings(loaded));
  if (!load_error.empty()) {
    emit(summary.boolean("ok", false).str("stage", "load").str("error", load_error));
    return kExitLoad;
  }
  summary.num("load_ms", load_ms);
  summary.boolean("device_outputs", runner.skip_copy()).raw("memory_planned", planned_json(runner.planned()));
  const GpuMemory after = gpu_memory();
  if (before.known && after.known) {
    summary.num("gpu_used_mib_before_load", before.used_mib)
        .num("gpu_used_mib_after_load", after.used_mib)
        .num("gpu_loaded_mib", after.used_mib - before.used_mib)
        .num("gpu_total_mib", after.total_mib);
  } else {
    summary.str("gpu_memory", after.error.empty() ? before.error : after.error);
  }
  if (!o.plan.empty()) {
    // A caller driving the runner over a pipe waits for this line before sending the first command.
    JsonObject ready = summary;
    emit(ready.boolean("ready", true));
  }
  Totals totals;
  const int rc = o.plan.empty() ? run_single(o, runner, summary, totals) : run_plan(o, runner, summary, totals);
  totals.add_to(summary);
  emit(summary);
  return rc;
}
