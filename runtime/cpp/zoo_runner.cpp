// zoo_runner: load a zoo artifact (model.pte + aoti_cuda_blob.ptd) with ExecuTorch's C++ runtime and its CUDA
// backend, run methods on tensors read from files, write the outputs, time the calls.
//
// Two modes, one loaded program each:
//   single  --method NAME --inputs a.zt,b.zt : warm-up calls, then timed calls; median and p90 latency.
//   plan    --plan FILE (or - for stdin)      : a sequence of calls, each line "METHOD IN IN ...", where IN is a
//           tensor file or @S:K, output K of call S (S counted from 0; negative S counts back from this call).
//           State that the host carries between calls (LingBot-VA's KV pool in the "io" layout) flows this way
//           without leaving the process. Once the program is loaded the runner prints a {"ready": true, ...}
//           line, then each call answers with one JSON line on stdout as soon as it is done, so a caller can
//           drive the runner line by line over a pipe (zoo/et_runtime.py does). A line "quit" ends the plan.
// Both end with one JSON summary line on stdout. ExecuTorch's own log (compiled in) goes to stderr.
// Before loading, the kernels and host code in model.pte are checked against this GPU and host (gpu_targets.h): an
// artifact lowered for another GPU is refused with stage "gpu_target" and what to do.
// Exit status: 0 ok, 2 bad command line or input file, 3 the program or a method failed to load (or cannot run on
// this GPU), 4 a call failed.
//
// Inputs are given in the method's signature order (the order of the exported program's inputs): the runtime
// hands them to the compiled .so in its own order itself. Tensor file format: tensor_file.h, docs/runtime.md.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

#ifdef ZOO_RUNNER_CUDA
#include <cuda_runtime.h>
#endif

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

constexpr int kExitUsage = 2;
constexpr int kExitLoad = 3;
constexpr int kExitCall = 4;

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

// --- command line ---------------------------------------------------------------------------------------------------

const char* kUsage =
    "usage: zoo_runner --model model.pte [--data aoti_cuda_blob.ptd] [--load m1,m2] [--no-weight-sharing]\n"
    "                  (--method NAME --inputs a.zt,b.zt [--warmup 3] [--iters 10] | --plan FILE|-)\n"
    "                  [--outputs DIR]\n"
    "       zoo_runner --info\n"
    "  --method/--inputs  run one method: warm-up calls, then timed calls; outputs of the first call go to DIR\n"
    "  --plan             a sequence of calls, one per line: METHOD IN IN ... (IN: a .zt file or @STEP:OUTPUT)\n"
    "  --load             methods to load (default: every method of the program)\n"
    "  --outputs          where outputs are written (single: <method>.out<k>.zt; plan: step<i>.out<k>.zt)\n"
    "  --no-weight-sharing  do not ask the CUDA backend to share weights across methods (ExecuTorch 1.3+)\n"
    "  --info             print what this build is (ExecuTorch version, CUDA, backends) as JSON and exit\n";

struct Options {
  std::string model, method, plan, outputs;
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
               arg == "--outputs" || arg == "--load" || arg == "--warmup" || arg == "--iters") {
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
  return "";
}

// --- the build -------------------------------------------------------------------------------------------------------

std::string weight_sharing_state(const Options& o) {
#if defined(ZOO_RUNNER_CUDA) && defined(ZOO_HAVE_WEIGHT_SHARING)
  return o.weight_sharing ? "on" : "off (--no-weight-sharing)";
#elif defined(ZOO_RUNNER_CUDA)
  (void)o;
  return std::string("not available (the CUDA backend of ExecuTorch ") + ET_VERSION +
         " has no weight_sharing_across_methods option; it comes with 1.3)";
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

void add_build_facts(JsonObject& obj, const Options& o) {
  obj.str("executorch_version", ET_VERSION);
#ifdef ZOO_RUNNER_CUDA
  obj.boolean("cuda", true);
#else
  obj.boolean("cuda", false);
#endif
  obj.str("weight_sharing_across_methods", weight_sharing_state(o));
  obj.raw("backends", json_list(registered_backends(), json_string));
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

// Waits for the GPU so that a timed call includes its kernels; a no-op without CUDA.
std::string device_sync() {
#ifdef ZOO_RUNNER_CUDA
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    return std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(err);
  }
#endif
  return "";
}

std::string gpu_name() {
#ifdef ZOO_RUNNER_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    return prop.name;
  }
#endif
  return "";
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

// A contiguous host copy of an ETensor in its logical (sizes) order, whatever its dim order.
std::string to_host(const Tensor& t, HostTensor* out) {
  out->dtype = static_cast<uint32_t>(t.scalar_type());
  const size_t elem = zoo::element_size(out->dtype);
  if (elem == 0) {
    return "output dtype " + zoo::dtype_name(out->dtype) + " is not one the zoo tensor format carries";
  }
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  out->sizes.assign(sizes.begin(), sizes.end());
  const int64_t n = out->numel();
  out->data.resize(static_cast<size_t>(n) * elem);
  if (n == 0) {
    return "";
  }
  const auto* src = static_cast<const uint8_t*>(t.const_data_ptr());
  bool contiguous = true;
  int64_t expect = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    if (sizes[d] != 1 && strides[d] != expect) {
      contiguous = false;
    }
    expect *= sizes[d];
  }
  if (contiguous) {
    std::memcpy(out->data.data(), src, out->data.size());
    return "";
  }
  std::vector<int64_t> index(sizes.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (size_t d = 0; d < sizes.size(); ++d) {
      offset += index[d] * strides[d];
    }
    std::memcpy(out->data.data() + i * elem, src + offset * elem, elem);
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      if (++index[d] < sizes[d]) break;
      index[d] = 0;
    }
  }
  return "";
}

// Non-tensor outputs become 0-d tensors (int64, float64, bool); None stays empty (no file).
std::string evalue_to_host(const EValue& v, HostTensor* out, bool* is_none) {
  *is_none = false;
  if (v.isTensor()) {
    return to_host(v.toTensor(), out);
  }
  out->sizes.clear();
  if (v.isInt()) {
    const int64_t x = v.toInt();
    out->dtype = 4;
    out->data.assign(reinterpret_cast<const uint8_t*>(&x), reinterpret_cast<const uint8_t*>(&x) + 8);
  } else if (v.isDouble()) {
    const double x = v.toDouble();
    out->dtype = 7;
    out->data.assign(reinterpret_cast<const uint8_t*>(&x), reinterpret_cast<const uint8_t*>(&x) + 8);
  } else if (v.isBool()) {
    out->dtype = 11;
    out->data.assign(1, v.toBool() ? 1 : 0);
  } else if (v.isNone()) {
    *is_none = true;
  } else {
    return std::string("an output is ") + tag_name(v.tag) + ", which zoo_runner cannot write";
  }
  return "";
}

// Checks the inputs against the method's own signature before the runtime sees them, so that a wrong count or
// dtype is named here (executor_runner filled inputs itself; garbage int64 indices were one suspect of a silent
// abort on the H200).
std::string check_inputs(const std::string& method, const MethodMeta& meta, const std::vector<HostTensor>& inputs) {
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
    if (want != inputs[i].dtype) {
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

struct CallResult {
  std::string error;
  double ms = 0;
  std::vector<HostTensor> outputs;
  std::vector<bool> none;
};

class Runner {
 public:
  explicit Runner(const Options& o) : options_(o) {}

  // Returns "" or why loading failed (ExecuTorch's log on stderr says more).
  std::string load(double* load_ms, std::vector<std::string>* loaded) {
    set_backend_options();
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
    std::vector<std::string> to_load = options_.load;
    if (to_load.empty()) {
      to_load.assign(names->begin(), names->end());
      std::sort(to_load.begin(), to_load.end());
    }
    for (const auto& m : to_load) {
      if (!names->count(m)) {
        return "the program has no method " + m + " (it has " + join(*names) + ")";
      }
      const Error e = module_->load_method(m);
      if (e != Error::Ok) {
        return "cannot load method " + m + ": " + executorch::runtime::to_string(e) +
               " (ExecuTorch's log above says why; a missing .ptd, a dtype the runtime lacks, or an undefined "
               "aoti_torch_* symbol are the usual causes)";
      }
      loaded->push_back(m);
    }
    const std::string sync = device_sync();
    *load_ms = ms_since(start);
    return sync;
  }

  CallResult call(const std::string& method, const std::vector<HostTensor>& inputs) {
    CallResult r;
    if (!module_->is_method_loaded(method)) {
      r.error = "method " + method + " is not loaded (loaded: " + join_vec(loaded_names()) + ")";
      return r;
    }
    auto meta = module_->method_meta(method);
    if (!meta.ok()) {
      r.error = "cannot read the signature of " + method + ": " + executorch::runtime::to_string(meta.error());
      return r;
    }
    r.error = check_inputs(method, *meta, inputs);
    if (!r.error.empty()) {
      return r;
    }
    // Each call gets its own copy of the input bytes: a program may write into an input, and the caller's
    // tensors (earlier outputs in a plan) must stay as they were.
    std::vector<HostTensor> owned(inputs);
    std::vector<executorch::extension::TensorPtr> keep;
    std::vector<EValue> values;
    for (auto& t : owned) {
      std::vector<executorch::aten::SizesType> sizes(t.sizes.begin(), t.sizes.end());
      keep.push_back(executorch::extension::from_blob(t.data.empty() ? nullptr : t.data.data(), sizes,
                                                      static_cast<ScalarType>(t.dtype)));
      values.emplace_back(*keep.back());
    }
    const auto start = std::chrono::steady_clock::now();
    auto result = module_->execute(method, values);
    const std::string sync = device_sync();
    r.ms = ms_since(start);
    if (!result.ok()) {
      r.error = "method " + method + " failed: " + executorch::runtime::to_string(result.error());
      return r;
    }
    if (!sync.empty()) {
      r.error = "method " + method + ": " + sync;
      return r;
    }
    for (const auto& v : *result) {
      HostTensor h;
      bool is_none = false;
      r.error = evalue_to_host(v, &h, &is_none);
      if (!r.error.empty()) {
        return r;
      }
      r.outputs.push_back(std::move(h));
      r.none.push_back(is_none);
    }
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
  static double ms_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  }
  static std::string join(const std::unordered_set<std::string>& names) {
    std::vector<std::string> v(names.begin(), names.end());
    std::sort(v.begin(), v.end());
    return join_vec(v);
  }
  static std::string join_vec(const std::vector<std::string>& v) {
    std::string out;
    for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
    return out.empty() ? "none" : out;
  }

  void set_backend_options() {
#if defined(ZOO_RUNNER_CUDA) && defined(ZOO_HAVE_WEIGHT_SHARING)
    // Must be set before any method is loaded: the backend reads it in init() to choose between one shared copy
    // of each weight (by fully qualified name) and a copy per method.
    if (options_.weight_sharing) {
      executorch::runtime::BackendOptions<1> opts;
      Error e = opts.set_option("weight_sharing_across_methods", true);
      if (e == Error::Ok) {
        e = executorch::runtime::set_option("CudaBackend", opts.view());
      }
      if (e != Error::Ok) {
        ET_LOG(Error, "could not turn on weight_sharing_across_methods: %s", executorch::runtime::to_string(e));
      }
    }
#endif
  }

  const Options& options_;
  std::unique_ptr<Module> module_;
};

std::string output_path(const std::string& dir, const std::string& stem, size_t k) {
  return dir + "/" + stem + ".out" + std::to_string(k) + ".zt";
}

// Writes a call's outputs as <dir>/<stem>.out<k>.zt; returns the paths (empty for None) or an error.
std::string write_outputs(const std::string& dir, const std::string& stem, const CallResult& r,
                          std::vector<std::string>* paths) {
  for (size_t k = 0; k < r.outputs.size(); ++k) {
    if (r.none[k]) {
      paths->push_back("");
      continue;
    }
    const std::string path = output_path(dir, stem, k);
    const std::string err = zoo::write_tensor_file(path, r.outputs[k]);
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
  obj.raw("dtypes", json_list(dtypes, json_string));
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

// --- the two modes ---------------------------------------------------------------------------------------------------

int run_single(const Options& o, Runner& runner, JsonObject& summary) {
  std::vector<HostTensor> inputs(o.inputs.size());
  for (size_t i = 0; i < o.inputs.size(); ++i) {
    const std::string err = zoo::read_tensor_file(o.inputs[i], &inputs[i]);
    if (!err.empty()) {
      summary.boolean("ok", false).str("stage", "inputs").str("error", err);
      return kExitUsage;
    }
  }
  summary.str("mode", "single").str("method", o.method).num("warmup", o.warmup).num("iters", o.iters);
  std::vector<double> times;
  CallResult first;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    CallResult r = runner.call(o.method, inputs);
    if (!r.error.empty()) {
      summary.boolean("ok", false).str("stage", "call").str("error", r.error);
      return kExitCall;
    }
    const double ms = r.ms;
    if (i == 0) {
      first = std::move(r);  // the outputs written are the first call's: a stateful method moves on every call
    }
    if (i >= o.warmup) {
      times.push_back(ms);
    }
  }
  std::vector<std::string> paths;
  if (!o.outputs.empty()) {
    const std::string err = write_outputs(o.outputs, o.method, first, &paths);
    if (!err.empty()) {
      summary.boolean("ok", false).str("stage", "outputs").str("error", err);
      return kExitUsage;
    }
  }
  add_outputs_json(summary, first, paths);
  summary.num("median_ms", median(times)).num("p90_ms", percentile(times, 0.9))
      .num("min_ms", *std::min_element(times.begin(), times.end()))
      .num("max_ms", *std::max_element(times.begin(), times.end()));
  summary.boolean("ok", true);
  return 0;
}

// One plan line: "METHOD IN IN ...". Returns "" or an error; fills method and inputs.
std::string parse_plan_line(const std::string& line, size_t step, const std::vector<CallResult>& done,
                            std::string* method, std::vector<HostTensor>* inputs) {
  std::istringstream in(line);
  std::string token;
  in >> *method;
  while (in >> token) {
    if (token[0] != '@') {
      HostTensor t;
      const std::string err = zoo::read_tensor_file(token, &t);
      if (!err.empty()) return err;
      inputs->push_back(std::move(t));
      continue;
    }
    const size_t colon = token.find(':');
    char* end = nullptr;
    const std::string s_text = token.substr(1, colon == std::string::npos ? std::string::npos : colon - 1);
    const long s = std::strtol(s_text.c_str(), &end, 10);
    if (colon == std::string::npos || s_text.empty() || *end != '\0') {
      return "bad reference " + token + " (write @STEP:OUTPUT, e.g. @0:1 or @-1:2)";
    }
    const std::string k_text = token.substr(colon + 1);
    const long k = std::strtol(k_text.c_str(), &end, 10);
    if (k_text.empty() || *end != '\0' || k < 0) {
      return "bad reference " + token + " (OUTPUT is an index >= 0)";
    }
    const long src = s < 0 ? static_cast<long>(step) + s : s;
    if (src < 0 || src >= static_cast<long>(step)) {
      return "reference " + token + " in call " + std::to_string(step) + " names no earlier call";
    }
    const CallResult& prev = done[static_cast<size_t>(src)];
    if (static_cast<size_t>(k) >= prev.outputs.size() || prev.none[static_cast<size_t>(k)]) {
      return "reference " + token + ": call " + std::to_string(src) + " has no tensor output " + std::to_string(k);
    }
    inputs->push_back(prev.outputs[static_cast<size_t>(k)]);
  }
  return "";
}

int run_plan(const Options& o, Runner& runner, JsonObject& summary) {
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
  std::vector<CallResult> done;
  std::vector<double> times;
  std::string line;
  while (std::getline(*in, line)) {
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') {
      continue;
    }
    if (line.compare(first, 4, "quit") == 0) {
      break;
    }
    const size_t step = done.size();
    std::string method;
    std::vector<HostTensor> inputs;
    JsonObject reply;
    reply.num("step", static_cast<double>(step));
    std::string err = parse_plan_line(line.substr(first), step, done, &method, &inputs);
    CallResult r;
    if (err.empty()) {
      reply.str("method", method);
      r = runner.call(method, inputs);
      err = r.error;
    }
    std::vector<std::string> paths;
    if (err.empty() && !o.outputs.empty()) {
      err = write_outputs(o.outputs, "step" + std::to_string(step), r, &paths);
    }
    if (!err.empty()) {
      emit(reply.boolean("ok", false).str("error", err));
      summary.boolean("ok", false).str("stage", "call").num("failed_step", static_cast<double>(step)).str("error", err);
      return kExitCall;
    }
    reply.boolean("ok", true).num("ms", r.ms);
    add_outputs_json(reply, r, paths);
    emit(reply);
    times.push_back(r.ms);
    done.push_back(std::move(r));
  }
  summary.num("steps", static_cast<double>(done.size()));
  summary.raw("step_ms", json_list(times, json_number));
  summary.boolean("ok", true);
  return 0;
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
  summary.str("model", o.model).raw("data", json_list(o.data, json_string));
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
  summary.raw("loaded", json_list(loaded, json_string));
  if (!load_error.empty()) {
    emit(summary.boolean("ok", false).str("stage", "load").str("error", load_error));
    return kExitLoad;
  }
  summary.num("load_ms", load_ms);
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
    // A caller driving the runner over a pipe waits for this line before sending the first call.
    JsonObject ready = summary;
    emit(ready.boolean("ready", true));
  }
  const int rc = o.plan.empty() ? run_single(o, runner, summary) : run_plan(o, runner, summary);
  emit(summary);
  return rc;
}
