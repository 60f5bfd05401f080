// nccl_communicator against the rank-order sums on the host (ctest: mpiexec -n 1; any N works,
// one GPU per rank, device = rank % device count; started without mpiexec, one rank without MPI).
// Without a GPU it reports itself skipped (77).
// Each collective, float, double, bf16 and fp16, n = 0, 1, 3, 7, 1000, 65537 (16-bit: moved as 16
// bits, summed in fp32 in rank order, rounded once; at one rank the sum kernel's load and store
// must give the input back bit for bit): rank r's input is a function of
// (r, i), so every rank computes every rank's input and the expected result (detail::ordered_sum,
// mpi_communicator's sum), and the device result must equal it bit for bit. The collectives run
// ordered on a stream of the test's own (set_stream), read back after synchronizing it.
//
// `--watchdog` (ctest test_nccl_communicator_watchdog, one process without MPI): the same checks
// through a communicator with a timeout (non-blocking NCCL and the watchdog thread: the same
// bits), then a collective that cannot finish in time: the caller's stream holds a kernel that
// sleeps 1.5 s, standing in for a peer that never joins (one rank has no peer to lose), under a
// 200 ms timeout. Required: 500 ms after the enqueue the communicator is already marked failed
// (usable() false, while the collective still waits behind the kernel: it is aborted only once
// it reaches the device), synchronize() throws collective_timeout, every later call
// communication_error, and the destructor returns. At one rank the
// collective launches no NCCL kernel (the all-to-all has no peer), so this checks the watchdog and
// the abort's bookkeeping, not that NCCL's kernels return when aborted (that needs two GPUs).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "membound/nccl.cuh"
#include "../support/rank_checks.hpp"

namespace mb = membound;

namespace {

int& failures = membound_test::rank_checks::failures;
std::size_t& me = membound_test::rank_checks::me;
using membound_test::rank_checks::check;
void cu(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw mb::backend_error(what, static_cast<int>(e), cudaGetErrorString(e));
}

template <typename T>
T input(std::size_t r, std::size_t i) {
  // Values whose sums round: different magnitudes per rank.
  const double v = (static_cast<double>((i * 2654435761u + r * 40503u) % 1000) - 500.0) * (r + 1) / 3.0;
  if constexpr (mb::reducible<T>) return static_cast<T>(v);
  else return mb::from_accum<T>(static_cast<float>(v));
}

template <typename T>
struct device_buffer {
  T* p = nullptr;
  explicit device_buffer(std::size_t n) { cu(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc"); }
  ~device_buffer() { (void)cudaFree(p); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
};

template <typename T>
void run(mb::nccl_communicator& comm, cudaStream_t s, std::size_t n) {
  const std::size_t N = comm.size();
  std::vector<T> mine(n), all(N * n);
  for (std::size_t r = 0; r < N; ++r)
    for (std::size_t i = 0; i < n; ++i) all[r * n + i] = input<T>(r, i);
  std::memcpy(mine.data(), all.data() + me * n, n * sizeof(T));
  std::vector<T> sum(n);
  if (n != 0) mb::detail::ordered_sum(all.data(), N, n, n, sum.data());
  const std::string at = std::string(mb::dtype_name<T>()) + " n=" + std::to_string(n);

  device_buffer<T> d(n), out(n);
  device_buffer<std::byte> ws(comm.template all_reduce_workspace_bytes<T>(n));
  std::vector<T> back(n);
  const auto upload = [&] { cu(cudaMemcpyAsync(d.p, mine.data(), n * sizeof(T), cudaMemcpyHostToDevice, s), "upload"); };
  const auto download = [&](const T* from, std::size_t k) {
    back.assign(k, T{});
    cu(cudaMemcpyAsync(back.data(), from, k * sizeof(T), cudaMemcpyDeviceToHost, s), "download");
    cu(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  };

  // all_reduce_sum
  upload();
  comm.all_reduce_sum(d.p, n, ws.p, comm.template all_reduce_workspace_bytes<T>(n));
  download(d.p, n);
  check(back == sum || (n == 0), "all_reduce_sum " + at);
  // reduce_scatter_sum
  const mb::shard_range sh = mb::shard_of(n, N, me);
  upload();
  comm.reduce_scatter_sum(d.p, n, out.p, ws.p, comm.template reduce_scatter_workspace_bytes<T>(n));
  download(out.p, sh.size());
  check(std::equal(back.begin(), back.end(), sum.begin() + static_cast<std::ptrdiff_t>(sh.begin)),
        "reduce_scatter_sum " + at);
  // all_gather: every rank's shard of its own input
  upload();
  comm.all_gather(static_cast<const T*>(d.p + sh.begin), out.p, n);
  download(out.p, n);
  bool gathered = true;
  for (std::size_t r = 0; r < N; ++r) {
    const mb::shard_range q = mb::shard_of(n, N, r);
    for (std::size_t i = q.begin; i < q.end; ++i) gathered = gathered && back[i] == all[r * n + i];
  }
  check(gathered, "all_gather " + at);
  // broadcast from the last rank
  upload();
  comm.broadcast(d.p, n, N - 1);
  download(d.p, n);
  check(std::equal(back.begin(), back.end(), all.begin() + static_cast<std::ptrdiff_t>((N - 1) * n)), "broadcast " + at);
}

// Sleeps on the device for ns nanoseconds (the %globaltimer clock).
__global__ void hold(unsigned long long ns) {
  unsigned long long t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(100000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

void all_types(mb::nccl_communicator& comm, cudaStream_t s) {
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{7}, std::size_t{1000},
                              std::size_t{65537}}) {
    run<float>(comm, s, n);
    run<double>(comm, s, n);
    run<mb::bf16>(comm, s, n);  // 16 bits on the wire, summed in fp32 in rank order, rounded once
    run<mb::fp16>(comm, s, n);
  }
}

void watchdog(cudaStream_t s) {
  {
    mb::nccl_communicator comm(mb::single_process, std::chrono::milliseconds(5000));
    comm.set_stream(s);
    all_types(comm, s);
    check(comm.usable(), "no collective timed out within 5 s");
  }
  mb::nccl_communicator comm(mb::single_process, std::chrono::milliseconds(200));
  comm.set_stream(s);
  const std::size_t n = 1000;
  device_buffer<float> d(n);
  device_buffer<std::byte> ws(comm.template all_reduce_workspace_bytes<float>(n));
  cu(cudaMemsetAsync(d.p, 0, n * sizeof(float), s), "cudaMemsetAsync");
  hold<<<1, 1, 0, s>>>(1500ull * 1000 * 1000);
  cu(cudaGetLastError(), "hold<<<>>>");
  const auto t0 = std::chrono::steady_clock::now();
  comm.all_reduce_sum(d.p, n, ws.p, comm.template all_reduce_workspace_bytes<float>(n));  // returns at once
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  check(!comm.usable(), "marked failed at its deadline, while still queued behind the caller's kernel");
  std::string first = "nothing";
  try {
    comm.synchronize();
  } catch (const mb::collective_timeout& e) {
    first = "collective_timeout";
    check(e.timeout() == std::chrono::milliseconds(200), "the timeout it names is the communicator's");
  } catch (const std::exception& e) {
    first = e.what();
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  check(first == "collective_timeout", "a collective past its deadline: collective_timeout from synchronize(), got " +
                                           first + " after " + std::to_string(waited) + " s");
  check(!comm.usable(), "the communicator is unusable after a timeout");
  std::string later = "nothing";
  try {
    comm.all_reduce_sum(d.p, n, ws.p, comm.template all_reduce_workspace_bytes<float>(n));
  } catch (const mb::collective_timeout&) {
    later = "collective_timeout again";
  } catch (const mb::communication_error&) {
    later = "communication_error";
  }
  check(later == "communication_error", "a later collective: communication_error (unusable), got " + later);
  bool checked = false;
  try {
    comm.check();
  } catch (const mb::communication_error&) {
    checked = true;
  }
  check(checked, "check() throws after a timeout");
  std::printf("test_nccl_communicator --watchdog: timed out after %.2f s (timeout 0.2 s behind a 1.5 s kernel)\n",
              waited);
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("test_nccl_communicator: no CUDA device here: skipped\n");
    return 77;
  }
  // Under mpiexec: MPI_COMM_WORLD's ranks. Started alone: one rank without MPI (the one-process
  // constructor), so a GPU machine without an MPI runtime runs the NCCL path too.
  const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
                        std::getenv("PMI_RANK") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
                        std::getenv("MV2_COMM_WORLD_SIZE") != nullptr;
  const bool watch = argc > 1 && std::strcmp(argv[1], "--watchdog") == 0;
  std::optional<mb::mpi_environment> env;
  int r = 0;
  if (watch) {
    std::printf("test_nccl_communicator --watchdog: one process, no MPI\n");
  } else if (launched) {
    env.emplace(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
  } else {
    std::printf("test_nccl_communicator: one process, no MPI (started without mpiexec)\n");
  }
  me = static_cast<std::size_t>(r);
  try {
    cu(cudaSetDevice(r % devices), "cudaSetDevice");
    cudaStream_t s = nullptr;
    cu(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    if (watch) {
      watchdog(s);
      (void)cudaStreamDestroy(s);
      std::printf("test_nccl_communicator --watchdog: %s\n", failures == 0 ? "all checks passed" : "FAILED");
      return failures == 0 ? 0 : 1;
    }
    std::optional<mb::nccl_communicator> made;
    if (launched) made.emplace();
    else made.emplace(mb::single_process);
    mb::nccl_communicator& comm = *made;
    comm.set_stream(s);
    all_types(comm, s);
    comm.barrier();
    bool refused = false;
    try {
      comm.set_stream(nullptr);
    } catch (const mb::invalid_argument&) {
      refused = true;
    }
    check(refused, "the legacy default stream is refused");
    (void)cudaStreamDestroy(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %zu: %s\n", me, e.what());
    ++failures;
  }
  int total = failures;
  if (launched) MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (me == 0) std::printf("test_nccl_communicator: %s\n", total == 0 ? "all checks passed" : "FAILED");
  return total == 0 ? 0 : 1;
}
