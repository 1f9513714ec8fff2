// zoo_session: a zoo artifact loaded by ExecuTorch's runtime inside the caller's process, behind a C API
// (zoo/runtimes/inprocess.py drives it with ctypes). Inputs are the caller's own memory, host or GPU: a device
// pointer goes to the CUDA backend as it is, with no copy and no file. Each output is copied into memory the
// caller gives (host or GPU) before the call returns, so nothing the caller holds points into the backend's
// per-call allocations.
//
// It is the same runtime zoo_runner runs (method_runner.h), without the process boundary. Why it must not share a
// process with torch's AOTI runner (the aoti_torch_* symbols both define): docs/runtime.md.
//
// Every function returns 0 on success; otherwise non-zero, with the reason written to `error` (NUL-terminated,
// cut to `error_size`).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZOO_SESSION_API __attribute__((visibility("default")))
#define ZOO_SESSION_MAX_DIMS 16
#define ZOO_SESSION_ABI 1

typedef struct zoo_session zoo_session;

// A tensor the caller owns: C-contiguous data at `data` (host or device), ExecuTorch's ScalarType code (the tensor
// file format's dtype codes: docs/runtime.md) and its sizes.
typedef struct {
  void* data;
  uint32_t dtype;
  uint32_t ndim;
  int64_t sizes[ZOO_SESSION_MAX_DIMS];
} zoo_tensor;

// The ABI this library speaks (ZOO_SESSION_ABI); the caller checks it before anything else.
ZOO_SESSION_API int zoo_session_abi(void);
// What this build is, as one JSON object (ExecuTorch version, CUDA, backends, patches, weight sharing).
ZOO_SESSION_API const char* zoo_session_build(void);

// Loads `model` (with the weights file `data`, or NULL) and the methods in `methods_csv` (NULL or "": every
// method). `*out` is the session, or NULL on failure. Returns 2 when the artifact's kernels or host code cannot run
// on this GPU or host (checked before ExecuTorch loads it, as zoo_runner checks it).
ZOO_SESSION_API int zoo_session_open(const char* model, const char* data, const char* methods_csv, int weight_sharing,
                                     zoo_session** out, double* load_ms, char* error, size_t error_size);
ZOO_SESSION_API void zoo_session_close(zoo_session* session);

// The number of inputs and outputs of a loaded method, and the dtype and sizes of output `k` (its static shape).
ZOO_SESSION_API int zoo_session_signature(zoo_session* session, const char* method, uint32_t* n_inputs,
                                          uint32_t* n_outputs, char* error, size_t error_size);
ZOO_SESSION_API int zoo_session_output_meta(zoo_session* session, const char* method, uint32_t k, zoo_tensor* meta,
                                            char* error, size_t error_size);

// Runs `method` on `inputs` (signature order) and copies output k into `outputs[k].data`, whose dtype and sizes
// must be the output's. `ms` gets the method's time (execute and the device synchronisation after it), `io_ms`
// the copies around it.
ZOO_SESSION_API int zoo_session_call(zoo_session* session, const char* method, const zoo_tensor* inputs,
                                     uint32_t n_inputs, zoo_tensor* outputs, uint32_t n_outputs, double* ms,
                                     double* io_ms, char* error, size_t error_size);

#ifdef __cplusplus
}
#endif
