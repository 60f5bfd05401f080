// The CUDA layers' entry points for membound._layers_cuda: declared here in plain C++ (the module's
// nanobind half, layers_cuda.cpp, is compiled by the host compiler), defined in
// layer_calls_cuda.cu under nvcc. Each runs on the spec's device and stream (spec::stream, the
// framework's current stream; 0 is the legacy default stream, PyTorch's default) and returns
// without waiting for the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <vector>

#include "layer_calls.hpp"

namespace membound_python::cuda_calls {

void check(const spec& s, const std::int32_t* offsets);
std::tuple<std::size_t, std::size_t, std::size_t> sizes(const spec& s);
std::tuple<std::size_t, std::size_t> decode_sizes(const spec& s, std::size_t max_len);
void forward(const spec& s, const std::int32_t* offsets, const void* x, const std::vector<const void*>& w, void* y,
             bytes saved, bytes ws);
void backward(const spec& s, const std::int32_t* offsets, const void* x, const std::vector<const void*>& w,
              bytes saved, const void* dy, void* dx, const std::vector<void*>& g, bytes ws);
void decode_reset(const spec& s, const std::vector<const void*>& w, bytes state, std::size_t max_len);
void decode_step(const spec& s, const std::vector<const void*>& w, bytes state, std::size_t position,
                 std::size_t max_len, const void* x_t, void* y_t, bytes ws);

}  // namespace membound_python::cuda_calls
