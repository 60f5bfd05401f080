// membound._layers_cuda: the CUDA layers over the caller's CUDA arrays (DLPack), for membound.ops
// when its tensors are on a GPU. The module is layers_module.hpp's, the calls layer_calls_cuda.cu's
// (nvcc); this file is host C++ and includes no CUDA header.
#include "layer_calls_cuda.hpp"
#include "layers_module.hpp"

namespace {

// The entry points as the static functions bind_layers takes.
struct device_calls {
  static constexpr auto check = &membound_python::cuda_calls::check;
  static constexpr auto sizes = &membound_python::cuda_calls::sizes;
  static constexpr auto decode_sizes = &membound_python::cuda_calls::decode_sizes;
  static constexpr auto forward = &membound_python::cuda_calls::forward;
  static constexpr auto backward = &membound_python::cuda_calls::backward;
  static constexpr auto decode_reset = &membound_python::cuda_calls::decode_reset;
  static constexpr auto decode_step = &membound_python::cuda_calls::decode_step;
};

}  // namespace

NB_MODULE(_layers_cuda, m) {
  m.doc() = "membound's CUDA layers over caller-owned CUDA arrays (use membound.ops)";
  membound_python::translate_errors();
  membound_python::bind_layers<device_calls, nanobind::device::cuda>(m, "CUDA");
}
