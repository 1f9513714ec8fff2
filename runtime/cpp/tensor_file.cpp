#include "tensor_file.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

namespace zoo {
namespace {

// The file stores little-endian values; every host ExecuTorch's CUDA backend runs on (x86-64, aarch64) is one.
static_assert(sizeof(int64_t) == 8 && sizeof(uint32_t) == 4, "unexpected integer sizes");

bool host_is_little_endian() {
  const uint16_t probe = 1;
  uint8_t first = 0;
  std::memcpy(&first, &probe, 1);
  return first == 1;
}

}  // namespace

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) {
    n *= s;
  }
  return n;
}

size_t element_size(uint32_t dtype) {
  switch (dtype) {
    case 0:   // uint8
    case 1:   // int8
    case 11:  // bool
      return 1;
    case 2:   // int16
    case 5:   // float16
    case 15:  // bfloat16
    case 27:  // uint16
      return 2;
    case 3:   // int32
    case 6:   // float32
    case 28:  // uint32
      return 4;
    case 4:   // int64
    case 7:   // float64
    case 9:   // complex64
    case 29:  // uint64
      return 8;
    case 10:  // complex128
      return 16;
    default:
      return 0;
  }
}

std::string dtype_name(uint32_t dtype) {
  switch (dtype) {
    case 0: return "uint8";
    case 1: return "int8";
    case 2: return "int16";
    case 3: return "int32";
    case 4: return "int64";
    case 5: return "float16";
    case 6: return "float32";
    case 7: return "float64";
    case 9: return "complex64";
    case 10: return "complex128";
    case 11: return "bool";
    case 15: return "bfloat16";
    case 27: return "uint16";
    case 28: return "uint32";
    case 29: return "uint64";
    default: return "dtype<" + std::to_string(dtype) + ">";
  }
}

std::string read_tensor_file(const std::string& path, HostTensor* out) {
  if (!host_is_little_endian()) {
    return "zoo tensor files are little-endian and this host is not";
  }
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) {
    return path + ": cannot open";
  }
  const std::streamoff file_size = in.tellg();
  in.seekg(0);
  char header[24];
  if (file_size < 24 || !in.read(header, 24)) {
    return path + ": not a zoo tensor file (shorter than its 24-byte header)";
  }
  if (std::memcmp(header, kTensorFileMagic, 8) != 0) {
    return path + ": not a zoo tensor file (wrong magic)";
  }
  uint32_t version, dtype, rank, reserved;
  std::memcpy(&version, header + 8, 4);
  std::memcpy(&dtype, header + 12, 4);
  std::memcpy(&rank, header + 16, 4);
  std::memcpy(&reserved, header + 20, 4);
  if (version != kTensorFileVersion) {
    return path + ": zoo tensor file version " + std::to_string(version) + ", this runner reads version " +
           std::to_string(kTensorFileVersion);
  }
  const size_t elem = element_size(dtype);
  if (elem == 0) {
    return path + ": dtype code " + std::to_string(dtype) + " is not one the zoo tensor format carries";
  }
  if (rank > kTensorFileMaxRank || reserved != 0) {
    return path + ": corrupt header (rank " + std::to_string(rank) + ", reserved " + std::to_string(reserved) + ")";
  }
  std::vector<int64_t> sizes(rank);
  if (rank > 0 && !in.read(reinterpret_cast<char*>(sizes.data()), 8 * static_cast<std::streamsize>(rank))) {
    return path + ": truncated (the header promises " + std::to_string(rank) + " sizes)";
  }
  // numel * elem, refusing negative sizes and overflow instead of allocating garbage.
  uint64_t nbytes = elem;
  for (int64_t s : sizes) {
    if (s < 0) {
      return path + ": corrupt header (negative size " + std::to_string(s) + ")";
    }
    if (s != 0 && nbytes > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(s)) {
      return path + ": corrupt header (sizes overflow)";
    }
    nbytes *= static_cast<uint64_t>(s);
  }
  const uint64_t header_bytes = 24 + 8 * static_cast<uint64_t>(rank);
  const uint64_t have = static_cast<uint64_t>(file_size) - header_bytes;  // the sizes were read: no underflow
  if (have != nbytes) {
    return path + ": " + (have < nbytes ? "truncated" : "trailing bytes") + " (" + std::to_string(nbytes) +
           " data bytes expected for " + dtype_name(dtype) + ", " + std::to_string(have) + " present)";
  }
  out->dtype = dtype;
  out->sizes = std::move(sizes);
  out->data.resize(nbytes);
  if (nbytes > 0 && !in.read(reinterpret_cast<char*>(out->data.data()), static_cast<std::streamsize>(nbytes))) {
    return path + ": read error";
  }
  return "";
}

std::string write_tensor_file(const std::string& path, const HostTensor& tensor) {
  if (!host_is_little_endian()) {
    return "zoo tensor files are little-endian and this host is not";
  }
  if (element_size(tensor.dtype) == 0) {
    return path + ": cannot write " + dtype_name(tensor.dtype) + " (not a dtype the zoo tensor format carries)";
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      return tmp + ": cannot create";
    }
    char header[24] = {};
    const uint32_t version = kTensorFileVersion;
    const uint32_t rank = static_cast<uint32_t>(tensor.sizes.size());
    std::memcpy(header, kTensorFileMagic, 8);
    std::memcpy(header + 8, &version, 4);
    std::memcpy(header + 12, &tensor.dtype, 4);
    std::memcpy(header + 16, &rank, 4);
    out.write(header, 24);
    if (rank > 0) {
      out.write(reinterpret_cast<const char*>(tensor.sizes.data()), 8 * static_cast<std::streamsize>(rank));
    }
    if (!tensor.data.empty()) {
      out.write(reinterpret_cast<const char*>(tensor.data.data()), static_cast<std::streamsize>(tensor.data.size()));
    }
    out.flush();
    if (!out) {
      return tmp + ": write error (disk full?)";
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return path + ": cannot rename " + tmp + " into place";
  }
  return "";
}

}  // namespace zoo
