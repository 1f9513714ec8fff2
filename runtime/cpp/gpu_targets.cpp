// See gpu_targets.h. No ExecuTorch or CUDA here: the check runs (and is tested) without either.

#include "gpu_targets.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <set>

namespace zoo {
namespace {

constexpr uint8_t kFatbinMagic[4] = {0x50, 0xed, 0x55, 0xba};  // 0xBA55ED50, little-endian
constexpr uint64_t kArchSpecific = 0x100000;
constexpr uint64_t kFamilySpecific = 0x200000;
constexpr uint16_t kEmX86_64 = 62;
constexpr uint16_t kEmAarch64 = 183;
constexpr uint16_t kEtDyn = 3;

template <typename T>
T read_le(const uint8_t* p) {  // the formats are little-endian, as are the hosts zoo runs on
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// The images of the fatbin at `at` and the offset just past it; false when the bytes are not one.
bool parse_fatbin(const uint8_t* data, size_t size, size_t at, std::vector<KernelImage>* images, size_t* end) {
  if (size < at + 16 || std::memcmp(data + at, kFatbinMagic, 4) != 0) return false;
  const uint16_t version = read_le<uint16_t>(data + at + 4);
  const uint16_t header = read_le<uint16_t>(data + at + 6);
  const uint64_t body = read_le<uint64_t>(data + at + 8);
  if (version != 1 || header != 16 || body == 0 || body > size - at - header) return false;
  const size_t stop = at + header + body;
  size_t p = at + header;
  images->clear();
  while (p < stop) {
    if (stop - p < 64) return false;
    const uint16_t kind = read_le<uint16_t>(data + p);
    const uint32_t entry_header = read_le<uint32_t>(data + p + 4);
    const uint64_t payload = read_le<uint64_t>(data + p + 8);
    if ((kind != 1 && kind != 2) || entry_header < 64 || entry_header > stop - p ||
        payload > stop - p - entry_header) {
      return false;
    }
    const uint64_t flags = read_le<uint64_t>(data + p + 40);
    KernelImage image;
    image.ptx = kind == 1;
    image.arch = static_cast<int>(read_le<uint32_t>(data + p + 28));
    image.variant = (flags & kArchSpecific) ? 'a' : (flags & kFamilySpecific) ? 'f' : 0;
    images->push_back(image);
    p += entry_header + payload;
  }
  *end = stop;
  return p == stop && !images->empty();
}

std::string join(const std::vector<KernelImage>& images) {
  std::string out;
  std::set<std::string> seen;
  for (const auto& i : images) {
    if (seen.insert(i.name()).second) out += (out.empty() ? "" : "/") + i.name();
  }
  return out;
}

}  // namespace

std::string KernelImage::name() const {
  return std::string(ptx ? "compute_" : "sm_") + std::to_string(arch) + (variant ? std::string(1, variant) : "");
}

bool is_tegra_arch(int arch) {
  return arch == 53 || arch == 62 || arch == 72 || arch == 87 || arch == 101 || arch == 110;
}

bool KernelImage::runs_on(int device_arch, bool tegra) const {
  const int major = device_arch / 10, minor = device_arch % 10;
  const int own_major = arch / 10, own_minor = arch % 10;
  if (variant == 'a') return device_arch == arch;
  if (variant == 'f') return major == own_major && minor >= own_minor && tegra == is_tegra_arch(arch);
  if (ptx) return device_arch >= arch;
  if (tegra || is_tegra_arch(arch)) return device_arch == arch && tegra;
  return major == own_major && minor >= own_minor;
}

BinaryTargets scan_binary(const uint8_t* data, size_t size) {
  BinaryTargets out;
  std::set<std::string> machines;
  size_t at = 0;
  while (at + 4 <= size) {
    if (std::memcmp(data + at, kFatbinMagic, 4) == 0) {
      std::vector<KernelImage> images;
      size_t end = 0;
      if (parse_fatbin(data, size, at, &images, &end)) {
        out.fatbins.push_back(images);
        at = end;  // a fatbin's payloads (SASS ELF files among them) are not host code
        continue;
      }
    } else if (size - at >= 20 && data[at] == 0x7f && std::memcmp(data + at + 1, "ELF", 3) == 0 &&
               data[at + 4] == 2 && data[at + 5] == 1 && read_le<uint16_t>(data + at + 16) == kEtDyn) {
      const uint16_t machine = read_le<uint16_t>(data + at + 18);
      if (machine == kEmX86_64) machines.insert("x86_64");
      if (machine == kEmAarch64) machines.insert("aarch64");
    }
    ++at;
  }
  out.host_machines.assign(machines.begin(), machines.end());
  return out;
}

BinaryTargets scan_file(const std::string& path, std::string* error) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *error = "cannot read " + path;
    return {};
  }
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return scan_binary(bytes.data(), bytes.size());
}

std::string this_machine() {
#if defined(__x86_64__)
  return "x86_64";
#elif defined(__aarch64__)
  return "aarch64";
#else
  return "other";
#endif
}

// The first GPU of zoo/gpu_targets.py's table with this architecture (x86-64 hosts), for the hint's --target.
std::string target_name(int arch) {
  switch (arch) {
    case 75: return "t4";
    case 80: return "a100";
    case 86: return "a10";
    case 89: return "l4";
    case 90: return "h100";
    case 100: return "b200";
    case 120: return "rtx5090";
    default: return "NAME";
  }
}

std::string check_targets(const BinaryTargets& targets, int device_arch, const std::string& gpu_name,
                          const std::string& machine) {
  const std::string hint =
      is_tegra_arch(device_arch)
          ? "lower the run on this Jetson itself (`python -m zoo.lower RUN_DIR`; README, 'GPU targets and Jetson')"
          : "lower the run for this GPU: here, `python -m zoo.lower RUN_DIR`, or on a machine with a GPU of the "
            "same generation or newer, `python -m zoo.lower RUN_DIR --target " + target_name(device_arch) +
            "` (README, 'GPU targets and Jetson')";
  for (const auto& m : targets.host_machines) {
    if (m != machine) {
      return "the artifact's .so is " + m + " host code; this machine is " + machine + ": " + hint;
    }
  }
  const bool tegra = is_tegra_arch(device_arch);
  for (const auto& fatbin : targets.fatbins) {
    bool runs = false;
    for (const auto& image : fatbin) runs = runs || image.runs_on(device_arch, tegra);
    if (!runs) {
      std::vector<KernelImage> all;
      for (const auto& f : targets.fatbins) all.insert(all.end(), f.begin(), f.end());
      return "the artifact's kernels are " + join(all) + "; this GPU is sm_" + std::to_string(device_arch) + " (" +
             gpu_name + "), which cannot run " + join(fatbin) + ": " + hint;
    }
  }
  return "";
}

}  // namespace zoo
