// membound over MPI: the host library plus mpi_communicator. Needs <mpi.h>: link MPI::MPI_CXX
// (find_package(MPI)); membound/membound.hpp alone never includes it.
#pragma once

#include "membound/membound.hpp"
#include "membound/dist/mpi_communicator.hpp"
