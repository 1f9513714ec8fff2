// What a runtime build is (ExecuTorch version, CUDA, registered backends, zoo's patches, weight sharing), as
// zoo_runner --info and zoo_session_build() report it.
#pragma once

#include "json_text.h"

namespace zoo {

void add_build_facts(JsonObject& obj, bool weight_sharing);

}  // namespace zoo
