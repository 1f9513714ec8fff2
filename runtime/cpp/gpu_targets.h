// Which GPUs and hosts can run a zoo artifact, read from its bytes before ExecuTorch loads it: the C++ side of
// zoo/gpu_targets.py, with the same rules (tests/test_gpu_targets_cpp.py runs both over the same files).
//
// Each method's AOTInductor .so sits in model.pte as it is; inside it, every Triton kernel is an NVIDIA fatbin
// (magic 0xBA55ED50): a 16-byte header (u32 magic, u16 version 1, u16 header size 16, u64 size of the entries),
// then entries, each a header and its payload: u16 kind (1 PTX, 2 SASS), u16 version, u32 header size, u64
// payload size, u32 architecture at 28 (90 for sm_90), u64 flags at 40 (0x100000 arch-specific "a", 0x200000
// family-specific "f"). The host code is an ELF shared library whose e_machine says x86-64 or aarch64.
//
// What runs where (NVIDIA's compatibility rules): SASS sm_XY on X.Z with Z >= Y, never across major versions nor
// between Tegra (Jetson) and desktop GPUs; sm_XYa / compute_XYa on X.Y only; sm_XYf / compute_XYf on X.Z with
// Z >= Y; PTX compute_XY through the driver's JIT on any GPU of X.Y or newer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zoo {

struct KernelImage {
  bool ptx = false;
  int arch = 0;      // 90 for sm_90
  char variant = 0;  // 'a', 'f' or 0
  std::string name() const;  // sm_90a, compute_80
  bool runs_on(int device_arch, bool tegra) const;
};

struct BinaryTargets {
  std::vector<std::vector<KernelImage>> fatbins;  // one per embedded fatbin (AOTInductor: one per kernel)
  std::vector<std::string> host_machines;         // of the x86-64 / aarch64 shared libraries found, each once
};

bool is_tegra_arch(int arch);

// Every fatbin container and x86-64 / aarch64 shared-library header in `data` (a .pte, a .so).
BinaryTargets scan_binary(const uint8_t* data, size_t size);
// The same for a file; `error` is set when it cannot be read.
BinaryTargets scan_file(const std::string& path, std::string* error);

// The machine this program was built for: "x86_64", "aarch64" or "other".
std::string this_machine();

// "" when every kernel runs on a GPU of `device_arch` (87 for 8.7) and the host code is `machine`'s; else why,
// and what to do.
std::string check_targets(const BinaryTargets& targets, int device_arch, const std::string& gpu_name,
                          const std::string& machine);

}  // namespace zoo
