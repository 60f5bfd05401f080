// The leading dimensions of a row-major GEMM, shared by both backends' GEMMs
// (backend/cpu/gemm.hpp, backend/cuda/gemm.cuh): elements between rows of x, w and y, for column
// slices such as Mamba's dt_low = x_dbl[:, 0:R].
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct ld3 {
  std::size_t x, w, y;
};

MEMBOUND_NAMESPACE_END
