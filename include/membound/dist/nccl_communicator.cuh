// Data-parallel collectives between GPUs over NCCL, one GPU per rank, bootstrapped through MPI
// (rank 0 makes NCCL's unique id, MPI_Bcast gives it to the others). For the CUDA backend what
// mpi_communicator (membound/mpi.hpp) is for the CPU one: the same communicator concept
// (dist/communicator.hpp), on device buffers. Compile with nvcc (it launches one kernel, the
// rank-order sum), link NCCL, cudart and MPI.
//
//   membound::mpi_environment env(argc, argv);
//   cudaSetDevice(local_rank);                               // one GPU per rank
//   membound::nccl_communicator comm;                        // MPI_COMM_WORLD's ranks
//   membound::nccl_communicator one(membound::single_process);  // or: one rank, no MPI at all
//   comm.set_stream(my_stream);                              // the stream whose work it follows
//   std::size_t ws = comm.all_reduce_workspace_bytes<float>(n);   // device bytes, the caller's
//   comm.all_reduce_sum(d_grad, n, d_ws, ws);                // ordered on my_stream
//
// Sums are membound's own, as mpi_communicator's: each rank receives every rank's block of a
// reduce-scatter (grouped ncclSend/ncclRecv, an all-to-all) into the workspace and adds them in
// rank order 0, 1, ..., N − 1 in one kernel (no multiply, so no fused multiply-add can change a
// bit), so the result equals mpi_communicator's and one process accumulating the N parts in that
// order, bit for bit, whatever NCCL's ring or tree would do. The network carries 2·(N − 1)/N bytes
// per element of an all-reduce, as a ring's.
//
// Streams: the communicator owns a non-blocking stream. Each collective first makes that stream
// wait for an event recorded on the caller's stream (set_stream; the legacy default stream is
// refused), runs there, and makes the caller's stream wait for an event recorded after it: the
// work is ordered after everything the caller enqueued before the call and before everything it
// enqueues after, and the host is not blocked (barrier() and synchronize() are what wait). So
// unlike mpi_communicator's, a call returns before its data has moved: a host that reads the
// result reads it after synchronizing the caller's stream.
//
// Storage: fp32 and fp64 summed in their type; bf16 and fp16 as the CPU communicators sum them
// (16 bits on the wire, widened to fp32, added in rank order, rounded once).
//
// The trainer (train/trainer.hpp) takes it as a split_communicator: gradients and weights are
// device memory it moves, and the host values ranks agree on (flags, plan votes, the loss, the
// norm's parts) go through control(), an mpi_communicator over the same ranks (a
// local_communicator's copies for a one-process communicator). The trainer sets the stream.
//
// Faults (nccl_communicator(parent, timeout), timeout > 0): NCCL's communicator is made
// non-blocking (ncclConfig_t::blocking = 0) and a watchdog thread follows every collective from
// its enqueue. One that the device has not finished `timeout` after it was enqueued (a rank died
// or hangs and never joins), or an asynchronous NCCL error, marks the communicator failed: its
// next call, or check(), throws collective_timeout (communication_error for an NCCL error) and it
// cannot be used again. Once the late collective has reached the device (its stream passed the
// caller's earlier work) the watchdog aborts NCCL's communicator (ncclCommAbort: kernels waiting
// for the missing rank return), so no host waiting on a stream hangs on a missing rank; an abort
// never frees NCCL's resources under a kernel still queued behind the caller's work. The
// bootstrap's id broadcast, barrier() and control() go through an mpi_communicator with the same
// timeout (its MPI_Comm_dup, when it is made, has none: MPI gives none). The deadline runs from the
// enqueue, as PyTorch's NCCL watchdog's does, so give more than the host may run ahead of the
// device plus the slowest collective. timeout = 0 (the default): blocking NCCL, no watchdog, a rank
// that never joins hangs the others.
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/backend/cuda/storage.cuh"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/shard.hpp"
#include "membound/dist/collective_watchdog.hpp"
#include "membound/dist/communicator.hpp"
#include "membound/dist/mpi_communicator.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {
inline void nccl_check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) throw communication_error(call, static_cast<int>(r), ncclGetErrorString(r));
}
inline void nccl_cuda_check(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw backend_error(call, static_cast<int>(e), std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e));
}
// out[i] = parts[i] + parts[stride + i] + ... + parts[(ranks − 1)·stride + i], added in that order
// (16-bit parts in fp32, rounded once: detail::ordered_sum's bits).
template <typename T>
__global__ void nccl_ordered_sum(const T* parts, std::size_t ranks, std::size_t stride, std::size_t count, T* out) {
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += step) {
    if constexpr (reducible<T>) {
      T s = parts[i];
      for (std::size_t r = 1; r < ranks; ++r) s += parts[r * stride + i];
      out[i] = s;
    } else {
      float s = gpu::detail::ld(parts, i);
      for (std::size_t r = 1; r < ranks; ++r) s += gpu::detail::ld(parts, r * stride + i);
      gpu::detail::st(out, i, s);
    }
  }
}
// What collective_watchdog asks of NCCL and CUDA (dist/collective_watchdog.hpp).
struct nccl_watch_device {
  using event = cudaEvent_t;
  ncclComm_t* comm = nullptr;  // the communicator's handle; abort() sets it to nullptr
  int device = 0;
  device_event_state query(cudaEvent_t e) {
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaSuccess) return device_event_state::done;
    if (q == cudaErrorNotReady) return device_event_state::pending;
    (void)cudaGetLastError();
    return device_event_state::failed;
  }
  int async_error() {
    ncclResult_t r = ncclSuccess;
    if (*comm == nullptr || ncclCommGetAsyncError(*comm, &r) != ncclSuccess) return 0;
    return r == ncclSuccess || r == ncclInProgress ? 0 : static_cast<int>(r);
  }
  void abort() noexcept {
    if (*comm != nullptr) (void)ncclCommAbort(*comm);
    *comm = nullptr;
  }
  void on_thread_start() noexcept { (void)cudaSetDevice(device); }
};
}  // namespace detail

// The tag of nccl_communicator's one-process constructor.
struct single_process_t {
  explicit single_process_t() = default;
};
inline constexpr single_process_t single_process{};

// nccl_communicator's control(): collectives on host values over the same ranks, through an
// mpi_communicator (its own duplicate of the ranks' MPI communicator), or, for a one-process
// nccl_communicator, a local_communicator's copies (no MPI at all).
class nccl_control {
 public:
  nccl_control() = default;  // one process
  // timeout: mpi_communicator's (0: none).
  explicit nccl_control(MPI_Comm parent, std::chrono::milliseconds timeout = std::chrono::milliseconds{0})
      : mpi_(std::make_unique<mpi_communicator>(parent, timeout)) {}

  std::size_t rank() const noexcept { return mpi_ ? mpi_->rank() : 0; }
  std::size_t size() const noexcept { return mpi_ ? mpi_->size() : 1; }
  const char* name() const noexcept { return mpi_ ? "nccl (control over mpi)" : "nccl (one process)"; }
  communication_stats stats() const noexcept { return mpi_ ? mpi_->stats() : communication_stats{}; }

  template <summable T>
  std::size_t reduce_scatter_workspace_bytes(std::size_t n) const noexcept {
    return mpi_ ? mpi_->template reduce_scatter_workspace_bytes<T>(n) : 0;
  }
  template <summable T>
  std::size_t reduce_scatter_blocks_workspace_bytes(std::size_t max_block) const noexcept {
    return mpi_ ? mpi_->template reduce_scatter_blocks_workspace_bytes<T>(max_block) : 0;
  }
  template <summable T>
  std::size_t all_reduce_workspace_bytes(std::size_t n) const noexcept {
    return mpi_ ? mpi_->template all_reduce_workspace_bytes<T>(n) : 0;
  }
  template <summable T>
  void reduce_scatter_sum(const T* in, std::size_t n, T* out, void* ws, std::size_t ws_bytes) {
    with([&](auto& c) { c.reduce_scatter_sum(in, n, out, ws, ws_bytes); });
  }
  template <summable T>
  void reduce_scatter_blocks_sum(const T* in, const shard_range* blocks, T* out, void* ws, std::size_t ws_bytes) {
    with([&](auto& c) { c.reduce_scatter_blocks_sum(in, blocks, out, ws, ws_bytes); });
  }
  template <typename T>
  void all_gather(const T* shard, T* out, std::size_t n) {
    with([&](auto& c) { c.all_gather(shard, out, n); });
  }
  template <summable T>
  void all_reduce_sum(T* data, std::size_t n, void* ws, std::size_t ws_bytes) {
    with([&](auto& c) { c.all_reduce_sum(data, n, ws, ws_bytes); });
  }
  template <typename T>
  void broadcast(T* data, std::size_t n, std::size_t root) {
    with([&](auto& c) { c.broadcast(data, n, root); });
  }
  void barrier() {
    with([](auto& c) { c.barrier(); });
  }

 private:
  template <typename F>
  void with(F&& f) {
    if (mpi_) f(*mpi_);
    else f(local_);
  }
  std::unique_ptr<mpi_communicator> mpi_;
  local_communicator local_;
};
static_assert(communicator<nccl_control>);

class nccl_communicator {
 public:
  // The ranks of `parent`, each on the CUDA device current when it calls this (cudaSetDevice
  // first). A collective over parent: every rank must construct it. timeout: 0 waits as long as
  // it takes; otherwise the most a collective may take from its enqueue (see Faults above).
  explicit nccl_communicator(MPI_Comm parent = MPI_COMM_WORLD,
                             std::chrono::milliseconds timeout = std::chrono::milliseconds{0})
      : timeout_(checked_timeout(timeout)), control_(parent, timeout) {
    rank_ = control_.rank();
    size_ = control_.size();
    ncclUniqueId id{};
    if (rank_ == 0) detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    // Through control(), under its timeout: a rank that never gets here cannot hang the rest in
    // it (control's MPI_Comm_dup above is a collective without one).
    control_.broadcast(reinterpret_cast<unsigned char*>(&id), sizeof id, 0);
    init(id);
  }
  // One rank on the current device, without MPI (never initialized, never called): NCCL's own
  // one-rank communicator, the same collectives and the same kernel, so that a machine with one
  // GPU and no MPI runtime runs the NCCL path (tests/nccl without mpiexec).
  explicit nccl_communicator(single_process_t, std::chrono::milliseconds timeout = std::chrono::milliseconds{0})
      : timeout_(checked_timeout(timeout)) {
    ncclUniqueId id{};
    detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    init(id);
  }
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  ~nccl_communicator() {
    // With a watchdog a collective waiting for a missing rank cannot hang this: past its deadline,
    // once on the device, it is aborted (the caller's own work on its stream is the caller's).
    if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
    release();
  }

  std::size_t rank() const noexcept { return rank_; }
  std::size_t size() const noexcept { return size_; }
  const char* name() const noexcept { return "nccl"; }
  // The host values ranks agree on (see nccl_control): the trainer's flags, votes, loss and norm.
  using control_type = nccl_control;
  nccl_control& control() noexcept { return control_; }
  static constexpr bool moves_device_memory = true;  // see device_communicator
  cudaStream_t stream() const noexcept { return stream_; }
  // NCCL's communicator; nullptr once aborted (the watchdog may do so at any time with a timeout).
  ncclComm_t native() const {
    std::lock_guard<std::mutex> lock(dog_->mutex());
    return comm_;
  }
  communication_stats stats() const noexcept { return stats_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  // False once a collective timed out or NCCL reported an error (marked at once; NCCL's
  // communicator is aborted when the late collective reaches the device).
  bool usable() const {
    std::lock_guard<std::mutex> lock(dog_->mutex());
    return !dog_->failed();
  }
  // Throws collective_timeout (or communication_error) when the watchdog aborted a collective,
  // else nothing. Every collective checks first; the trainer also checks before it uses a host
  // value that depends on the data collectives (data collectives return before their data moved).
  void check() const {
    std::lock_guard<std::mutex> lock(dog_->mutex());
    throw_if_failed();
  }

  // The stream whose work the collectives follow and which follows them. Not the legacy default
  // stream (0): membound launches nothing there.
  void set_stream(cudaStream_t s) {
    if (s == nullptr) {
      throw invalid_argument("stream", "a stream the caller created (cudaStreamCreate)", "the legacy default stream 0",
                             "Create a stream for the step's work and pass it");
    }
    user_ = s;
  }
  // The stream set_stream gave (nullptr: none), and forgetting it before it is destroyed (a
  // trainer does so as it goes): collectives then follow no caller stream.
  cudaStream_t caller_stream() const noexcept { return user_; }
  void clear_stream() noexcept { user_ = nullptr; }

  // Device workspace, in bytes, the caller provides (CUB-style: ask, then pass).
  // A reduce-scatter: the N received shards.
  template <summable T>
  std::size_t reduce_scatter_workspace_bytes(std::size_t n) const noexcept {
    return size_ * max_shard(n, size_) * sizeof(T);
  }
  // reduce_scatter_blocks_sum: the N received blocks of at most max_block elements.
  template <summable T>
  std::size_t reduce_scatter_blocks_workspace_bytes(std::size_t max_block) const noexcept {
    return size_ * max_block * sizeof(T);
  }
  // An all-reduce: a reduce-scatter's workspace, then this rank's summed shard.
  template <summable T>
  std::size_t all_reduce_workspace_bytes(std::size_t n) const noexcept {
    return reduce_scatter_workspace_bytes<T>(n) + max_shard(n, size_) * sizeof(T);
  }

  // out (shard_of(n, size(), rank()) elements) = Σ over ranks, in rank order, of in's shard.
  template <summable T>
  void reduce_scatter_sum(const T* in, std::size_t n, T* out, void* ws, std::size_t ws_bytes) {
    for (std::size_t r = 0; r < size_; ++r) blocks_[r] = shard_of(n, size_, r);
    reduce_blocks(in, out, ws, ws_bytes, max_shard(n, size_), "reduce_scatter_sum");
  }
  // blocks[r]: the elements of `in` rank r receives the sum of (any ranges, the same on every
  // rank); out: blocks[rank()].size() elements, which may be in + blocks[rank()].begin.
  template <summable T>
  void reduce_scatter_blocks_sum(const T* in, const shard_range* blocks, T* out, void* ws, std::size_t ws_bytes) {
    std::size_t most = 0;
    for (std::size_t r = 0; r < size_; ++r) {
      blocks_[r] = blocks[r];
      most = std::max(most, blocks[r].size());
    }
    reduce_blocks(in, out, ws, ws_bytes, most, "reduce_scatter_blocks_sum");
  }
  // out (n elements) = every rank's shard_of(n) of `shard` (shard_of(n, size(), rank()) elements,
  // which may be out + its shard's begin).
  template <typename T>
  void all_gather(const T* shard, T* out, std::size_t n) {
    static_assert(std::is_trivially_copyable_v<T>, "membound: all_gather copies bytes: T must be trivially copyable");
    std::unique_lock<std::mutex> lock(dog_->mutex());
    begin();
    const shard_range mine = shard_of(n, size_, rank_);
    if (mine.size() != 0 && shard != out + mine.begin) {
      detail::nccl_cuda_check(cudaMemcpyAsync(out + mine.begin, shard, mine.size() * sizeof(T), cudaMemcpyDeviceToDevice,
                                              stream_),
                              "cudaMemcpyAsync");
    }
    group g(*this);
    for (std::size_t r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const shard_range s = shard_of(n, size_, r);
      if (mine.size() != 0) send_bytes(out + mine.begin, mine.size() * sizeof(T), r);
      if (s.size() != 0) recv_bytes(out + s.begin, s.size() * sizeof(T), r);
    }
    g.end("all_gather (ncclGroupEnd)");
    end("all_gather");
  }
  template <summable T>
  void all_reduce_sum(T* data, std::size_t n, void* ws, std::size_t ws_bytes) {
    const std::size_t need = all_reduce_workspace_bytes<T>(n);
    detail::check_workspace(ws, ws_bytes, need);
    const std::size_t rs = reduce_scatter_workspace_bytes<T>(n);
    T* mine = reinterpret_cast<T*>(static_cast<std::byte*>(ws) + rs);
    reduce_scatter_sum(static_cast<const T*>(data), n, mine, ws, rs);
    all_gather(static_cast<const T*>(mine), data, n);
  }
  template <typename T>
  void broadcast(T* data, std::size_t n, std::size_t root) {
    static_assert(std::is_trivially_copyable_v<T>, "membound: broadcast copies bytes: T must be trivially copyable");
    detail::check_root(root, size_);
    std::unique_lock<std::mutex> lock(dog_->mutex());
    begin();
    call(ncclBroadcast(data, data, n * sizeof(T), ncclChar, static_cast<int>(root), comm_, stream_), "ncclBroadcast");
    if (rank_ == root) stats_.bytes_sent += (size_ - 1) * n * sizeof(T);
    end("broadcast");
  }
  // Every rank's work so far done, on the device and on the host: the caller's stream and the
  // communicator's drained, then a barrier through control() (under its timeout).
  void barrier() {
    synchronize();
    control_.barrier();  // one process: a local_communicator's, nobody to wait for
  }
  // With a timeout, a collective past its deadline ends these waits once it is on the device (the
  // watchdog aborts it); work of the caller's that never ends is not the communicator's to end.
  // Then check() throws.
  void synchronize() {
    detail::nccl_cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    if (user_ != nullptr) detail::nccl_cuda_check(cudaStreamSynchronize(user_), "cudaStreamSynchronize");
    check();
  }

 private:
  static std::chrono::milliseconds checked_timeout(std::chrono::milliseconds t) {
    if (t.count() < 0) {
      throw invalid_argument("timeout", "0 (none) or a positive time", std::to_string(t.count()) + " ms",
                             "Give the longest a collective may take from its enqueue, e.g. 60000 ms");
    }
    return t;
  }

  // Under the watchdog's mutex. Throws when a collective failed (timed out, or an NCCL error).
  void throw_if_failed() const {
    if (!dog_->failed()) return;
    const auto& f = dog_->first_failure();
    if (reported_) {
      throw communication_error(f.call, 0, "an earlier collective failed, so this communicator cannot be used again");
    }
    reported_ = true;
    if (f.timed_out) throw collective_timeout(f.call, timeout_);
    throw communication_error(f.call, f.code,
                              f.code > 0    ? ncclGetErrorString(static_cast<ncclResult_t>(f.code))
                              : f.code == -1 ? "a CUDA event query failed"
                                             : "the watchdog could not go on (out of memory or a failed CUDA call)");
  }
  // Under the mutex: ends every NCCL operation of this rank (a kernel waiting for a peer returns)
  // and frees NCCL's communicator; what the ranks exchanged is lost, the communicator unusable.
  void abort_nccl(const char* what, bool timed_out, ncclResult_t why) noexcept {
    dog_->abort_device({what, timed_out, static_cast<int>(why)});
  }
  // Under the mutex: r is an NCCL call's result. Non-blocking (a timeout), NCCL may still be enqueueing
  // (ncclInProgress): wait for it until the deadline, as NCCL asks before the next call.
  void call(ncclResult_t r, const char* what) {
    if (r == ncclInProgress && timeout_.count() != 0) {
      const auto deadline = std::chrono::steady_clock::now() + timeout_;
      while (r == ncclInProgress) {
        if (std::chrono::steady_clock::now() >= deadline) {
          abort_nccl(what, true, ncclInProgress);
          throw_if_failed();
        }
        std::this_thread::yield();
        if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) break;
      }
    }
    if (r == ncclSuccess) return;
    if (timeout_.count() != 0) {
      abort_nccl(what, false, r);  // an NCCL error leaves its communicator in no known state
      throw_if_failed();
    }
    detail::nccl_check(r, what);
  }

  // Under the mutex. stream_ waits for the caller's work so far.
  void begin() {
    throw_if_failed();
    ++stats_.collectives;
    enqueued_ = std::chrono::steady_clock::now();
    if (user_ != nullptr) {
      detail::nccl_cuda_check(cudaEventRecord(ready_, user_), "cudaEventRecord");
      detail::nccl_cuda_check(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    }
    if (timeout_.count() != 0) {
      if (started_ != nullptr) dog_->spare().push_back(std::exchange(started_, nullptr));  // of a call that threw
      started_ = record_watched();
    }
  }
  // Under the mutex: an event from the spare ones (or a new one) recorded on stream_.
  cudaEvent_t record_watched() {
    std::vector<cudaEvent_t>& spare = dog_->spare();
    cudaEvent_t e = nullptr;
    if (spare.empty()) {
      detail::nccl_cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    } else {
      e = spare.back();
      spare.pop_back();
    }
    const cudaError_t rec = cudaEventRecord(e, stream_);
    if (rec != cudaSuccess) spare.push_back(e);
    detail::nccl_cuda_check(rec, "cudaEventRecord");
    return e;
  }
  // Under the mutex. The caller's later work waits for this collective; the watchdog follows it.
  void end(const char* what) {
    if (timeout_.count() != 0) {
      const cudaEvent_t done = record_watched();
      dog_->follow(std::exchange(started_, nullptr), done, what, enqueued_);
    }
    if (user_ == nullptr) return;
    detail::nccl_cuda_check(cudaEventRecord(done_, stream_), "cudaEventRecord");
    detail::nccl_cuda_check(cudaStreamWaitEvent(user_, done_, 0), "cudaStreamWaitEvent");
  }
  // Under the mutex: ncclGroupStart, and ncclGroupEnd on every path (a call that throws inside the group
  // must not leave this thread's NCCL group open).
  class group {
   public:
    explicit group(nccl_communicator& c) : c_(c) { c_.call(ncclGroupStart(), "ncclGroupStart"); }
    group(const group&) = delete;
    group& operator=(const group&) = delete;
    ~group() {
      if (open_) (void)ncclGroupEnd();
    }
    void end(const char* what) {
      open_ = false;
      c_.call(ncclGroupEnd(), what);
    }

   private:
    nccl_communicator& c_;
    bool open_ = true;
  };
  void send_bytes(const void* p, std::size_t bytes, std::size_t peer) {
    call(ncclSend(p, bytes, ncclChar, static_cast<int>(peer), comm_, stream_), "ncclSend");
    stats_.bytes_sent += bytes;
  }
  void recv_bytes(void* p, std::size_t bytes, std::size_t peer) {
    call(ncclRecv(p, bytes, ncclChar, static_cast<int>(peer), comm_, stream_), "ncclRecv");
  }

  // blocks_ set: the all-to-all of every rank's blocks into ws (slot r: rank r's part of this
  // rank's block, `most` elements apart), then their rank-order sum into out.
  template <summable T>
  void reduce_blocks(const T* in, T* out, void* ws, std::size_t ws_bytes, std::size_t most, const char* what) {
    detail::check_workspace(ws, ws_bytes, size_ * most * sizeof(T));
    const shard_range mine = blocks_[rank_];
    T* parts = static_cast<T*>(ws);
    std::unique_lock<std::mutex> lock(dog_->mutex());
    begin();
    if (mine.size() != 0) {
      detail::nccl_cuda_check(cudaMemcpyAsync(parts + rank_ * most, in + mine.begin, mine.size() * sizeof(T),
                                              cudaMemcpyDeviceToDevice, stream_),
                              "cudaMemcpyAsync");
    }
    group g(*this);
    for (std::size_t r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      if (blocks_[r].size() != 0) send_bytes(in + blocks_[r].begin, blocks_[r].size() * sizeof(T), r);
      if (mine.size() != 0) recv_bytes(parts + r * most, mine.size() * sizeof(T), r);
    }
    g.end(what);
    if (mine.size() != 0) {
      const unsigned threads = 256;
      const auto grid = static_cast<unsigned>(std::min<std::size_t>((mine.size() + threads - 1) / threads, 4096));
      detail::nccl_ordered_sum<T><<<grid, threads, 0, stream_>>>(parts, size_, most, mine.size(), out);
      detail::nccl_cuda_check(cudaGetLastError(), "nccl_ordered_sum<<<>>>");
    }
    end(what);
  }

  // After rank_ and size_ are set: the stream, events, NCCL's communicator and (with a timeout)
  // the watchdog.
  void init(const ncclUniqueId& id) {
    try {
      blocks_.resize(size_);
      detail::nccl_cuda_check(cudaGetDevice(&watched_.device), "cudaGetDevice");
      watched_.comm = &comm_;
      dog_ = std::make_unique<collective_watchdog<detail::nccl_watch_device>>(watched_, timeout_);
      detail::nccl_cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      detail::nccl_cuda_check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      detail::nccl_cuda_check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      if (timeout_.count() != 0) config.blocking = 0;  // so that a wait can end and ncclCommAbort can run
      std::lock_guard<std::mutex> lock(dog_->mutex());
      call(ncclCommInitRankConfig(&comm_, static_cast<int>(size_), id, static_cast<int>(rank_), &config),
           "ncclCommInitRank");
    } catch (...) {
      release();
      throw;
    }
  }

  bool finalized() noexcept {
    ncclResult_t r = ncclCommFinalize(comm_);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (r == ncclInProgress) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::yield();
      if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) return false;
    }
    return r == ncclSuccess;
  }

  void release() noexcept {
    bool failed = false;
    if (dog_ != nullptr) {
      try {
        for (cudaEvent_t e : dog_->stop()) (void)cudaEventDestroy(e);  // the thread joined first
      } catch (...) {  // the list of events could not be made: they stay with the context
      }
      failed = dog_->failed();
    }
    if (comm_ != nullptr) {
      // Non-blocking, NCCL's communicator is finalized (its operations flushed) before it is
      // destroyed; a failed one, or one that does not finalize within the timeout, is aborted.
      if (timeout_.count() != 0 && (failed || !finalized())) (void)ncclCommAbort(comm_);
      else (void)ncclCommDestroy(comm_);
    }
    comm_ = nullptr;
    if (started_ != nullptr) (void)cudaEventDestroy(started_);
    started_ = nullptr;
    if (done_ != nullptr) (void)cudaEventDestroy(done_);
    if (ready_ != nullptr) (void)cudaEventDestroy(ready_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    done_ = ready_ = nullptr;
    stream_ = nullptr;
  }

  std::chrono::milliseconds timeout_{0};
  std::size_t rank_ = 0, size_ = 1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr, user_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  communication_stats stats_{};
  std::vector<shard_range> blocks_;  // each rank's block of the reduce-scatter in flight
  nccl_control control_;             // declared after timeout_: made from it, and before the id broadcast

  // The watchdog (made in init(), without a thread when timeout_ is 0) and the state under its
  // mutex, which the calling thread holds while it calls NCCL: NCCL is never called by both.
  detail::nccl_watch_device watched_;
  std::unique_ptr<collective_watchdog<detail::nccl_watch_device>> dog_;
  std::chrono::steady_clock::time_point enqueued_{};
  cudaEvent_t started_ = nullptr;  // the collective being enqueued's (begin() to end())
  mutable bool reported_ = false;  // the failure thrown once as itself; later calls say it is unusable
};
static_assert(device_communicator<nccl_communicator>);

MEMBOUND_NAMESPACE_END
