// How a row-major GEMM on strided tensors (out = a @ b, batched or not) becomes one column-major BLAS call
// (cublasGemmEx / cublasGemmStridedBatchedEx), and how addmm's `self` broadcasts over `out`.
//
// Plain C++ with no CUDA or ExecuTorch dependency, so that the mapping (the part where a transposed view or a
// padded leading dimension goes wrong) is checked on any machine against a literal BLAS emulation
// (tests/test_gemm_plan_cpp.py). cublas_gemm.cu calls cuBLAS with what plan() returns.

#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace zoo {
namespace gemm {

enum class Op { N, T };  // the BLAS operand as stored, or transposed

// One matrix of a tensor: rows x cols, element (i, j) at i * row_stride + j * col_stride.
struct Matrix {
  int64_t rows, cols, row_stride, col_stride;
};

struct Operand {
  Op op = Op::N;
  int64_t ld = 1;
  bool ok = false;
};

// The BLAS call: C (m x n, column-major, ldc) = op(first) (m x k) * op(second) (k x n). When `swapped`, the
// output is row-major and BLAS computes out^T = b^T a^T, so `first` reads b's memory and `second` a's.
struct Plan {
  bool ok = false;
  std::string why;
  bool swapped = false;
  int64_t m = 0, n = 0, k = 0, ldc = 1;
  Operand first, second;
};

// Column-major with leading dimension ld: (i, j) at i + j * ld. A size-1 dimension's stride is never read.
inline Operand column_major(const Matrix& x) {
  Operand o;
  const int64_t ld = x.cols == 1 ? std::max<int64_t>(1, x.rows) : x.col_stride;
  o.ok = (x.rows == 1 || x.row_stride == 1) && ld >= std::max<int64_t>(1, x.rows);
  o.ld = ld;
  return o;
}

inline Matrix transposed(const Matrix& x) {
  return {x.cols, x.rows, x.col_stride, x.row_stride};
}

// Row-major with leading dimension ld: (i, j) at i * ld + j, which is x^T column-major.
inline Operand row_major(const Matrix& x) {
  return column_major(transposed(x));
}

// x as a BLAS operand of shape rows x cols (transposed = false) or cols x rows (transposed = true).
inline Operand operand(const Matrix& x, bool transposed) {
  const Operand col = column_major(x), row = row_major(x);
  Operand o;
  if (!transposed) {
    o = col.ok ? col : row;
    o.op = col.ok ? Op::N : Op::T;  // a row-major x read column-major is x^T: transpose it back
  } else {
    o = row.ok ? row : col;
    o.op = row.ok ? Op::N : Op::T;
  }
  return o;
}

inline std::string describe(const char* name, const Matrix& x) {
  return std::string(name) + " is " + std::to_string(x.rows) + "x" + std::to_string(x.cols) + " with strides (" +
         std::to_string(x.row_stride) + ", " + std::to_string(x.col_stride) + ")";
}

// out (m x n) = a (m x k) @ b (k x n).
inline Plan plan(const Matrix& out, const Matrix& a, const Matrix& b) {
  Plan p;
  if (a.cols != b.rows || out.rows != a.rows || out.cols != b.cols) {
    p.why = "shapes do not chain: " + describe("out", out) + ", " + describe("a", a) + ", " + describe("b", b);
    return p;
  }
  if (a.cols < 1) {
    p.why = "an empty inner dimension (K = 0) is not handled by zoo's cuBLAS shims";
    return p;
  }
  const Operand out_row = row_major(out), out_col = column_major(out);
  if (out_row.ok) {  // BLAS computes out^T (n x m) = b^T (n x k) a^T (k x m)
    p.swapped = true;
    p.m = out.cols, p.n = out.rows, p.k = a.cols, p.ldc = out_row.ld;
    p.first = operand(b, true);
    p.second = operand(a, true);
  } else if (out_col.ok) {
    p.m = out.rows, p.n = out.cols, p.k = a.cols, p.ldc = out_col.ld;
    p.first = operand(a, false);
    p.second = operand(b, false);
  } else {
    p.why = describe("out", out) + ": neither row- nor column-major";
    return p;
  }
  const Matrix& first = p.swapped ? b : a;
  const Matrix& second = p.swapped ? a : b;
  if (!p.first.ok) {
    p.why = describe(p.swapped ? "b" : "a", first) + ": neither row- nor column-major";
  } else if (!p.second.ok) {
    p.why = describe(p.swapped ? "a" : "b", second) + ": neither row- nor column-major";
  } else {
    p.ok = true;
  }
  return p;
}

// The strides that read `self` (sizes, strides: up to `out_sizes.size()` dimensions, aligned at the end as
// broadcasting aligns them) at every index of `out`: 0 along a broadcast dimension. Empty when self does not
// broadcast to out.
inline std::vector<int64_t> broadcast_strides(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                                              const std::vector<int64_t>& out_sizes) {
  if (sizes.size() > out_sizes.size() || sizes.size() != strides.size()) {
    return {};
  }
  std::vector<int64_t> result(out_sizes.size(), 0);
  const size_t offset = out_sizes.size() - sizes.size();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == out_sizes[offset + d]) {
      result[offset + d] = sizes[d] == 1 ? 0 : strides[d];
    } else if (sizes[d] != 1) {
      return {};
    }
  }
  return result;
}

}  // namespace gemm
}  // namespace zoo
