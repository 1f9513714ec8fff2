// The runtime build's facts (build_facts.h).

#include "build_facts.h"

#include <executorch/runtime/backend/interface.h>
#if __has_include(<executorch/runtime/core/version.h>)
#include <executorch/runtime/core/version.h>
#endif
#ifndef ET_VERSION
#define ET_VERSION "unknown"
#endif
#ifndef ZOO_RUNTIME_PATCHES
#define ZOO_RUNTIME_PATCHES ""
#endif
#ifndef ZOO_RUNTIME_FEATURES
#define ZOO_RUNTIME_FEATURES ""
#endif

#include "method_runner.h"

namespace zoo {
namespace {

std::string weight_sharing_state(bool weight_sharing) {
#if defined(ZOO_RUNNER_CUDA) && defined(ZOO_HAVE_WEIGHT_SHARING)
  return weight_sharing ? "on" : "off (--no-weight-sharing)";
#elif defined(ZOO_RUNNER_CUDA)
  (void)weight_sharing;
  return std::string("not available (the CUDA backend of ExecuTorch ") + ET_VERSION +
         " has no weight_sharing_across_methods option; it comes with 1.3, and zoo's patch for 1.2 was not applied)";
#else
  (void)weight_sharing;
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

}  // namespace

void add_build_facts(JsonObject& obj, bool weight_sharing) {
  obj.str("executorch_version", ET_VERSION).str("release", release_of(ET_VERSION));
#ifdef ZOO_RUNNER_CUDA
  obj.boolean("cuda", true);
#else
  obj.boolean("cuda", false);
#endif
  obj.str("weight_sharing_across_methods", weight_sharing_state(weight_sharing));
  obj.raw("patches", json_strings(split(ZOO_RUNTIME_PATCHES, ',')));
  // What zoo's build adds beyond ExecuTorch's own runtime (CMakeLists.txt): an artifact's runtime.json names
  // the features it needs.
  obj.raw("features", json_strings(split(ZOO_RUNTIME_FEATURES, ',')));
  obj.raw("backends", json_strings(registered_backends()));
}

}  // namespace zoo
