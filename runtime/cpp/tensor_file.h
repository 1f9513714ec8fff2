// zoo tensor files (".zt"): one tensor per file, the format zoo_runner reads inputs from and writes outputs to.
//
//   offset  size      field
//   0       8         magic "ZOOTENS\0"
//   8       4         version, uint32 = 1
//   12      4         dtype, uint32: ExecuTorch's (= c10's) ScalarType number (6 float32, 15 bfloat16, 4 int64, ...)
//   16      4         rank, uint32 (0 for a 0-d tensor, at most 16)
//   20      4         reserved, uint32 = 0
//   24      8 * rank  sizes, int64 each, >= 0
//   24+8r   ...       the elements, C-contiguous, little-endian, numel * element size bytes; nothing after them
//
// The Python side is zoo/tensor_file.py; docs/runtime.md has the dtype table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zoo {

constexpr char kTensorFileMagic[8] = {'Z', 'O', 'O', 'T', 'E', 'N', 'S', '\0'};
constexpr uint32_t kTensorFileVersion = 1;
constexpr uint32_t kTensorFileMaxRank = 16;

// A tensor in host memory: dtype code, sizes and contiguous bytes.
struct HostTensor {
  uint32_t dtype = 0;
  std::vector<int64_t> sizes;
  std::vector<uint8_t> data;

  int64_t numel() const;
};

// Bytes per element of a dtype code; 0 when the format does not carry that dtype.
size_t element_size(uint32_t dtype);
// "float32", "bfloat16", ... for messages; "dtype<N>" for a code the format does not carry.
std::string dtype_name(uint32_t dtype);

// Each returns "" on success, else a message that names the file and what is wrong with it.
std::string read_tensor_file(const std::string& path, HostTensor* out);
// Written to "<path>.tmp" and renamed, so a reader never sees half a file.
std::string write_tensor_file(const std::string& path, const HostTensor& tensor);

}  // namespace zoo
