// Two nvcc units that include the whole CUDA backend, linked into one program (with
// cuda_two_units_b.cu): a kernel defined in a header as a plain __global__ function would be an
// external symbol in both, and this link would fail with a duplicate definition. Runs without a GPU.
#include <cstdio>

#include "membound/backend/cuda.cuh"

int membound_cuda_unit_b();

int main() {
  std::printf("two units with membound/backend/cuda.cuh linked: %d\n", membound_cuda_unit_b());
  return 0;
}
