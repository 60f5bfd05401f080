// The device trainer over nccl_communicator (ctest: mpiexec -n 1; any N with N GPUs on one node,
// rank r on device r; started without mpiexec, one rank without MPI). Without a GPU, or with
// fewer GPUs than ranks (NCCL refuses two ranks on one device), it reports itself skipped (77).
// At one rank (ctest's, and the only one any machine here can give) the trainer exchanges
// nothing: what runs is the plumbing (the trainer's static_asserts, constructing it over NCCL,
// setting and clearing the stream, the checkpoint round trip, the bits of one process), and the
// multi-rank checks below compare a path with itself. The multi-rank device paths are
// test_cuda_data_parallel's (2 ranks as threads on one GPU); NCCL's transport is
// test_nccl_communicator's. The checks below are the ones N > 1 ranks would make:
//   - One process (local_communicator, 4 micro-batches of 1) is the reference. N ranks run
//     4/N micro-batches each and sum in rank order: with one rank the curve is the reference's
//     bit for bit; with more, within 1e-5 relative per step (fp32: another order of additions,
//     as test_mpi_trainer states and measures on the CPU).
//   - ZeRO-1 (AdamW's state sharded; gradients reduce-scattered, weights all-gathered on the
//     device) gives ZeRO-0's losses and weights bit for bit: the same sums, and the norm's parts
//     are summed per shard in rank order under both stages.
//   - Every rank holds rank 0's weights; each rank's measured peak (device budget statistics)
//     equals its plan's prediction: the exchange's workspace fits inside the step's peak.
//   - bf16 storage (16-bit gradients on the wire, summed in fp32 on the device, rounded once):
//     ZeRO-1's bits are ZeRO-0's, measured peak == predicted.
//   - Checkpoints: 4 steps, save (under ZeRO-1 over N > 1 ranks: a shard per rank and a
//     manifest, written from host copies), a fresh trainer loads and runs 4 more: the
//     uninterrupted run's losses and weights, bit for bit.
//   - Refusals (N > 1): ZeRO-2 and overlap on a device, typed errors naming the option.
//   - NCCL's own device memory (outside every budget: the trainer sees it as others' bytes) is
//     measured around the communicator's construction and printed.
//   - The fp32 checks again through a communicator with a timeout (non-blocking NCCL, the
//     watchdog): the same bits, and no collective timed out.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "membound/nccl.cuh"

#include "../cuda/data_parallel_support.cuh"
#include "../support/rank_checks.hpp"

namespace mb = membound;

namespace {

int& failures = membound_test::rank_checks::failures;
std::size_t& me = membound_test::rank_checks::me;
using membound_test::rank_checks::check;
void cu(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw mb::backend_error(what, static_cast<int>(e), cudaGetErrorString(e));
}

using namespace dpt;

template <typename P>
void suite(mb::nccl_communicator& comm, const char* name) {
  const std::size_t N = comm.size();
  const hybrid<P> m(config());
  const run ref = one_process(m);
  const run z0 = rank_run(m, comm, 0);
  const run z1 = rank_run(m, comm, 1);
  const std::string at = std::string(name) + ", " + std::to_string(N) + " rank(s)";
  check(z0.losses.size() == steps && std::isfinite(z0.losses.back()) && z0.losses.back() < z0.losses.front(),
        at + ": finite losses that fall");
  if (N == 1) {
    check(same_bits(z0.losses, ref.losses) && z0.weights == ref.weights,
          at + ": ZeRO-0 over NCCL gives one process's losses and weights, bit for bit");
  } else if (std::is_same_v<typename P::storage_type, float>) {
    check(worst_gap(z0.losses, ref.losses) <= 1e-5, at + ": one process's loss curve within 1e-5 relative (worst " +
                                                         std::to_string(worst_gap(z0.losses, ref.losses)) + ")");
  }
  check(same_bits(z1.losses, z0.losses) && z1.weights == z0.weights, at + ": ZeRO-1 gives ZeRO-0's losses and weights, bit for bit");
  check(z0.all_returned && z1.all_returned, at + ": every device byte given back");
  check(z0.peak == z0.predicted && z1.peak == z1.predicted,
        at + ": measured peak == predicted (ZeRO-0 " + std::to_string(z0.peak) + " / " + std::to_string(z0.predicted) +
            ", ZeRO-1 " + std::to_string(z1.peak) + " / " + std::to_string(z1.predicted) + ")");
  std::vector<unsigned char> root = z1.weights;
  comm.control().broadcast(root.data(), root.size(), 0);
  check(root == z1.weights, at + ": every rank holds rank 0's weights");
  if (me == 0) {
    std::printf("%s: ZeRO-0 peak %zu B, ZeRO-1 peak %zu B (measured == predicted), worst loss gap to one process %.3g\n",
                at.c_str(), z0.peak, z1.peak, worst_gap(z0.losses, ref.losses));
  }
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("test_nccl_trainer: no CUDA device here: skipped\n");
    return 77;
  }
  const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
                        std::getenv("PMI_RANK") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
                        std::getenv("MV2_COMM_WORLD_SIZE") != nullptr;
  std::optional<mb::mpi_environment> env;
  int r = 0, n = 1;
  if (launched) {
    env.emplace(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
  }
  me = static_cast<std::size_t>(r);
  if (n > devices) {
    if (me == 0) std::printf("test_nccl_trainer: %d ranks, %d GPU(s): NCCL needs one GPU per rank: skipped\n", n, devices);
    return 77;
  }
  try {
    cu(cudaSetDevice(r), "cudaSetDevice");
    cu(cudaFree(nullptr), "cudaFree");  // the context first, so the figure below is NCCL's alone
    std::size_t free_before = 0, free_after = 0, total = 0;
    cu(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");
    std::optional<mb::nccl_communicator> made;
    if (launched) made.emplace();
    else made.emplace(mb::single_process);
    mb::nccl_communicator& comm = *made;
    cu(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo");
    if (me == 0) {
      std::printf("test_nccl_trainer: %zu rank(s)%s; NCCL's own device memory: %.1f MiB (outside the budget)\n",
                  comm.size(), launched ? "" : " (no MPI)",
                  static_cast<double>(free_before > free_after ? free_before - free_after : 0) / 1048576.0);
    }
    const std::size_t N = comm.size();
    suite<mb::fp32_precision>(comm, "fp32");
    suite<mb::bf16_precision>(comm, "bf16");

    // Checkpoints: the uninterrupted run's bits after a save and a load into a fresh trainer.
    {
      const hybrid<mb::fp32_precision> m(config());
      const std::string dir = "test_nccl_trainer_ckpt";
      if (me == 0) std::filesystem::create_directories(dir);
      comm.control().barrier();
      const std::string path = dir + "/run-" + std::to_string(N) + ".ckpt";
      for (const std::size_t zero : {std::size_t{0}, std::size_t{1}}) {
        const run whole = rank_run(m, comm, zero);
        const run resumed = rank_run(m, comm, zero, steps / 2, path);
        check(same_bits(resumed.losses, whole.losses) && resumed.weights == whole.weights,
              "ZeRO-" + std::to_string(zero) + ": saved at step " + std::to_string(steps / 2) +
                  " and resumed: the uninterrupted run's bits");
      }
      comm.control().barrier();
      if (me == 0) std::filesystem::remove_all(dir);
    }

    if (N > 1) {
      const hybrid<mb::fp32_precision> m(config());
      mb::cuda_executor ex;
      device_budget alloc(budget_bytes);
      using trainer_t = mb::trainer<hybrid<mb::fp32_precision>, device_budget, mb::null_monitor, mb::nccl_communicator>;
      for (const auto& [zero, overlap, arg] : {std::tuple{std::size_t{2}, false, "options.zero"},
                                               std::tuple{std::size_t{0}, true, "options.overlap"},
                                               std::tuple{std::size_t{1}, true, "options.overlap"}}) {
        bool refused = false;
        try {
          trainer_t t(m, effective, plan_for(m, effective.batch / N, 0), alloc, ex, options(zero, overlap),
                      mb::null_monitor{}, comm);
        } catch (const mb::invalid_argument& e) {
          refused = std::string(e.argument()) == arg;
        }
        check(refused, std::string("ZeRO-") + std::to_string(zero) + (overlap ? " overlapped" : "") +
                           " on a device: invalid_argument naming " + arg);
      }
    }
    // Every trainer and executor is gone: the communicator forgot their streams (trainer::release),
    // so its barrier synchronizes only its own.
    check(comm.caller_stream() == nullptr, "no trainer's stream is left set on the communicator");
    comm.barrier();

    // With a timeout: non-blocking NCCL and the watchdog following every collective, the same
    // checks (the trainer also asks the communicator's check() before each host exchange).
    {
      std::optional<mb::nccl_communicator> timed;
      if (launched) timed.emplace(MPI_COMM_WORLD, std::chrono::seconds(120));
      else timed.emplace(mb::single_process, std::chrono::seconds(120));
      suite<mb::fp32_precision>(*timed, "fp32, timeout 120 s");
      check(timed->usable(), "no collective timed out (120 s)");
      timed->barrier();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %zu: %s\n", me, e.what());
    ++failures;
  }
  int total = failures;
  if (launched) MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (me == 0) std::printf("test_nccl_trainer: %s\n", total == 0 ? "all checks passed" : "FAILED");
  return total == 0 ? 0 : 1;
}
