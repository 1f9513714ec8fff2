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
// How a program is loaded and called, on the host or the GPU: method_runner.h.

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
#ifdef ZOO_RUNNER_CUDA
#include <cuda_runtime.h>
#endif

#include "build_facts.h"
#include "device_values.h"
#include "gpu_targets.h"
#include "json_text.h"
#include "method_runner.h"
#include "tensor_file.h"

namespace {

using zoo::CallResult;
using zoo::JsonObject;
using zoo::emit;
using zoo::json_bools;
using zoo::json_list;
using zoo::json_number;
using zoo::json_string;
using zoo::json_strings;
using zoo::HostTensor;
using zoo::MethodRunner;
using zoo::ms_since;
using zoo::split;
using zoo::OutMode;
using zoo::OutSpec;
using zoo::PlannedMemory;
using zoo::Value;

constexpr int kExitUsage = 2;
constexpr int kExitLoad = 3;
constexpr int kExitCall = 4;
// The line protocol this runner speaks (zoo/et_runtime.py checks it): 2 adds $NAME inputs, "->" output modes,
// zeros/upload/fetch/drop/names, and the single mode's --device-inputs/--keep-outputs.
constexpr int kProtocol = 2;
// How many past calls' host outputs a plan can still refer to with @S:K (older ones are released).
constexpr size_t kHistory = 16;


std::string sizes_json(const std::vector<int64_t>& sizes) { return zoo::shape_text(sizes); }

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

int run_single(const Options& o, MethodRunner& runner, JsonObject& summary, Totals& totals) {
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
  Session(MethodRunner& r, const Options& o) : runner(r), options(o) {}
  MethodRunner& runner;
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

int run_plan(const Options& o, MethodRunner& runner, JsonObject& summary, Totals& totals) {
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
  zoo::add_build_facts(summary, o.weight_sharing);
  summary.num("protocol", kProtocol);
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
  const std::string target_error = zoo::check_gpu_targets(o.model, &kernels);
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
  MethodRunner runner(zoo::LoadOptions{o.model, o.data, o.load, o.weight_sharing});
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
