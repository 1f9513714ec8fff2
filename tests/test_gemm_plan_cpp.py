"""runtime/cpp/gemm_plan.h, the mapping behind zoo's cuBLAS GEMM shims (runtime/cpp/cublas_gemm.cu): a row-major
GEMM on strided tensors as one column-major BLAS call.

The header has no CUDA dependency, so it is compiled here with the host's C++ compiler into a driver that executes
the planned call by BLAS's own definition (column-major, op and leading dimension as given, the leading-dimension
rules cuBLAS checks) over the raw buffers. The result is read back through the output's strides and compared with
torch's float64 matmul of the same strided views; elements of the output buffer outside the view must stay
untouched. Layouts BLAS cannot read are refused with the operand named.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")

DRIVER = r"""
#include <cstdio>
#include <iostream>
#include <vector>
#include "gemm_plan.h"

using namespace zoo::gemm;

// BLAS's definition, column-major: C[i + j*ldc] = sum_l op(A)(i, l) * op(B)(l, j).
static double at(const std::vector<double>& x, Op op, int64_t ld, int64_t r, int64_t c) {
  return op == Op::N ? x[r + c * ld] : x[c + r * ld];
}

int main() {
  std::string mode;
  while (std::cin >> mode) {
    if (mode == "bcast") {  // bcast N SIZES... STRIDES... O OUT_SIZES...
      size_t n, o;
      std::cin >> n;
      std::vector<int64_t> sizes(n), strides(n);
      for (auto& v : sizes) std::cin >> v;
      for (auto& v : strides) std::cin >> v;
      std::cin >> o;
      std::vector<int64_t> out(o);
      for (auto& v : out) std::cin >> v;
      const auto s = broadcast_strides(sizes, strides, out);
      if (s.empty()) std::printf("none");
      for (auto v : s) std::printf("%lld ", (long long)v);
      std::printf("\n");
      continue;
    }
    // gemm OUT(rows cols row_stride col_stride) A(...) B(...) LEN_A LEN_B LEN_C A_VALUES... B_VALUES...
    Matrix c, a, b;
    size_t na, nb, nc;
    std::cin >> c.rows >> c.cols >> c.row_stride >> c.col_stride >> a.rows >> a.cols >> a.row_stride >> a.col_stride
             >> b.rows >> b.cols >> b.row_stride >> b.col_stride >> na >> nb >> nc;
    std::vector<double> A(na), B(nb), C(nc, 0.0);
    for (auto& v : A) std::cin >> v;
    for (auto& v : B) std::cin >> v;
    const Plan p = plan(c, a, b);
    if (!p.ok) { std::printf("refused %s\n", p.why.c_str()); continue; }
    const auto& first = p.swapped ? B : A;
    const auto& second = p.swapped ? A : B;
    const auto max1 = [](int64_t v) { return v > 1 ? v : (int64_t)1; };
    // The leading-dimension rules cuBLAS checks (CUBLAS_STATUS_INVALID_VALUE otherwise).
    if (p.first.ld < max1(p.first.op == Op::N ? p.m : p.k) || p.second.ld < max1(p.second.op == Op::N ? p.k : p.n) ||
        p.ldc < max1(p.m)) {
      std::printf("invalid-ld\n");
      continue;
    }
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t j = 0; j < p.n; ++j) {
        double sum = 0;
        for (int64_t l = 0; l < p.k; ++l)
          sum += at(first, p.first.op, p.first.ld, i, l) * at(second, p.second.op, p.second.ld, l, j);
        C[i + j * p.ldc] = sum;
      }
    std::printf("ok");
    for (double v : C) std::printf(" %.17g", v);
    std::printf("\n");
  }
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemm_plan")
    (folder / "driver.cpp").write_text(DRIVER)
    exe = folder / "driver"
    subprocess.run([CXX, "-std=c++17", "-O1", f"-I{ROOT / 'runtime' / 'cpp'}", str(folder / "driver.cpp"), "-o",
                    str(exe)], check=True, capture_output=True, text=True)
    return exe


def strided(rows, cols, layout, generator):
    """A rows x cols view of a fresh buffer: (buffer, strides) for the layout named."""
    pad = 3
    if layout == "row":
        strides = (cols, 1)
    elif layout == "col":
        strides = (1, rows)
    elif layout == "row-padded":
        strides = (cols + pad, 1)
    elif layout == "col-padded":
        strides = (1, rows + pad)
    elif layout == "every-other":  # no BLAS layout: neither stride is 1
        strides = (2 * cols, 2)
    elif layout == "overlapping":  # both strides 1: rows overlap, no leading dimension fits
        strides = (1, 1)
    elif layout == "odd-size-1":  # a size-1 dimension's stride is never read: any value is legal
        strides = (99, 1) if rows == 1 else (1, 99)
    else:
        raise ValueError(layout)
    size = (rows - 1) * strides[0] + (cols - 1) * strides[1] + 1
    return torch.randn(size, dtype=torch.float64, generator=generator), strides


def run(driver, lines):
    out = subprocess.run([str(driver)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


LAYOUTS = ["row", "col", "row-padded", "col-padded"]
SHAPES = [(5, 3, 4), (1, 6, 7), (6, 1, 2), (4, 5, 1), (32, 96, 48)]  # the last: an action step's small M


def case(m, n, k, la, lb, lc, g):
    a, sa = strided(m, k, la, g)
    b, sb = strided(k, n, lb, g)
    c, sc = strided(m, n, lc, g)
    line = "gemm " + " ".join(str(v) for v in (m, n, *sc, m, k, *sa, k, n, *sb, a.numel(), b.numel(), c.numel()))
    line += " " + " ".join(f"{v:.17g}" for v in a.tolist()) + " " + " ".join(f"{v:.17g}" for v in b.tolist())
    return line, (a, sa), (b, sb), (c, sc)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_every_blas_layout_of_each_operand_computes_a_at_b(driver, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    layouts = [(la, lb, lc) for la in LAYOUTS for lb in LAYOUTS for lc in LAYOUTS]
    if min(m, n, k) == 1:
        layouts += [("odd-size-1", "row", "row"), ("row", "odd-size-1", "col"), ("col", "col", "odd-size-1")]
    cases = [case(m, n, k, *layout, g) for layout in layouts]
    for layout, (line, (a, sa), (b, sb), (c, sc)), got in zip(layouts, cases, run(driver, [x[0] for x in cases])):
        assert got.startswith("ok "), (layout, got)
        buffer = torch.tensor([float(v) for v in got.split()[1:]], dtype=torch.float64)
        want = torch.as_strided(a, (m, k), sa) @ torch.as_strided(b, (k, n), sb)
        view = torch.as_strided(buffer, (m, n), sc)
        torch.testing.assert_close(view, want, rtol=1e-12, atol=1e-12, msg=f"{layout}")
        outside = buffer.clone()
        torch.as_strided(outside, (m, n), sc).zero_()
        assert not outside.any(), f"{layout}: the GEMM wrote outside the output's view"


def test_a_layout_blas_cannot_read_is_refused_with_the_operand_named(driver):
    g = torch.Generator().manual_seed(0)
    lines = [case(4, 3, 5, "every-other", "row", "row", g)[0], case(4, 3, 5, "row", "every-other", "col", g)[0],
             case(4, 3, 5, "row", "row", "every-other", g)[0], case(4, 3, 5, "overlapping", "row", "row", g)[0]]
    a, b, out, overlapping = run(driver, lines)
    assert a == "refused a is 4x5 with strides (10, 2): neither row- nor column-major"
    assert b == "refused b is 5x3 with strides (6, 2): neither row- nor column-major"
    assert out == "refused out is 4x3 with strides (6, 2): neither row- nor column-major"
    assert overlapping == "refused a is 4x5 with strides (1, 1): neither row- nor column-major"


def test_shapes_that_do_not_chain_and_an_empty_inner_dimension_are_refused(driver):
    bad = "gemm 3 4 4 1 3 5 5 1 6 4 4 1 15 24 12 " + " ".join(["0"] * 39)  # a is 3x5, b is 6x4
    empty = "gemm 3 4 4 1 3 0 1 1 0 4 4 1 0 0 12"
    got = run(driver, [bad, empty])
    assert got[0].startswith("refused shapes do not chain: out is 3x4")
    assert got[1] == "refused an empty inner dimension (K = 0) is not handled by zoo's cuBLAS shims"


@pytest.mark.parametrize("sizes,strides,out,want", [
    ((4,), (1,), (3, 4), "0 1"),            # addmm's usual bias: one row for every row of out
    ((1, 4), (4, 1), (3, 4), "0 1"),
    ((3, 1), (1, 1), (3, 4), "1 0"),        # one value per row
    ((3, 4), (4, 1), (3, 4), "4 1"),        # a full matrix keeps its strides
    ((3, 4), (1, 3), (3, 4), "1 3"),
    ((4,), (1,), (2, 3, 4), "0 0 1"),       # baddbmm: the same bias for every batch
    ((2, 1, 4), (4, 4, 1), (2, 3, 4), "4 0 1"),
    ((3,), (1,), (3, 4), "none"),           # does not broadcast
    ((2, 3, 4), (12, 4, 1), (3, 4), "none"),
])
def test_self_broadcasts_to_the_output_as_torch_broadcasts(driver, sizes, strides, out, want):
    line = f"bcast {len(sizes)} {' '.join(map(str, sizes))} {' '.join(map(str, strides))} {len(out)} " \
           f"{' '.join(map(str, out))}"
    (got,) = run(driver, [line])
    assert got.strip() == want
    if want != "none":  # the strides read the same values torch's broadcast reads
        base = torch.arange(100, dtype=torch.float64)
        src = torch.as_strided(base, sizes, strides)
        read = torch.as_strided(base, out, [int(s) for s in want.split()])
        assert torch.equal(read, src.expand(out))
