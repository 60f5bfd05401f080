// membound over NCCL and MPI: the host library, mpi_communicator (for mpi_environment and the
// CPU ranks) and nccl_communicator (the GPUs'). Compile with nvcc; link NCCL, CUDA::cudart and
// MPI::MPI_CXX. Neither membound/membound.hpp nor membound/backend/cuda.cuh includes it.
#pragma once

#include "membound/mpi.hpp"
#include "membound/dist/nccl_communicator.cuh"
