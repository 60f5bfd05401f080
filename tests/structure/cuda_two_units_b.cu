// The second unit of cuda_two_units_a.cu's link check.
#include "membound/backend/cuda.cuh"

int membound_cuda_unit_b() { return 2; }
