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
// Not built: a timeout (NCCL's non-blocking communicators and ncclCommAbort would give one).
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "membound/backend/cuda/model_kernels.cuh"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/shard.hpp"
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
inline void nccl_mpi_check(int code, const char* call) {
  if (code != MPI_SUCCESS) throw communication_error(call, code, "the MPI bootstrap of NCCL failed");
}

template <typename T>
constexpr ncclDataType_t nccl_type() noexcept {
  if constexpr (std::is_same_v<T, float>) return ncclFloat32;
  else return ncclFloat64;
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
  explicit nccl_control(MPI_Comm parent) : mpi_(std::make_unique<mpi_communicator>(parent)) {}

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
  // first). A collective over parent: every rank must construct it.
  explicit nccl_communicator(MPI_Comm parent = MPI_COMM_WORLD) {
    int r = 0, n = 0;
    detail::nccl_mpi_check(MPI_Comm_rank(parent, &r), "MPI_Comm_rank");
    detail::nccl_mpi_check(MPI_Comm_size(parent, &n), "MPI_Comm_size");
    rank_ = static_cast<std::size_t>(r);
    size_ = static_cast<std::size_t>(n);
    ncclUniqueId id{};
    if (r == 0) detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    detail::nccl_mpi_check(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, parent), "MPI_Bcast(ncclUniqueId)");
    detail::nccl_mpi_check(MPI_Comm_dup(parent, &mpi_), "MPI_Comm_dup");  // barrier()'s, never a user's messages
    init(id);
    try {
      control_ = nccl_control(parent);
    } catch (...) {
      release();
      throw;
    }
  }
  // One rank on the current device, without MPI (never initialized, never called): NCCL's own
  // one-rank communicator, the same collectives and the same kernel, so that a machine with one
  // GPU and no MPI runtime runs the NCCL path (tests/nccl without mpiexec).
  explicit nccl_communicator(single_process_t) {
    ncclUniqueId id{};
    detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    init(id);
  }
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  ~nccl_communicator() {
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
  ncclComm_t native() const noexcept { return comm_; }
  communication_stats stats() const noexcept { return stats_; }

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
    reduce_blocks(in, out, ws, ws_bytes, max_shard(n, size_));
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
    reduce_blocks(in, out, ws, ws_bytes, most);
  }
  // out (n elements) = every rank's shard_of(n) of `shard` (shard_of(n, size(), rank()) elements,
  // which may be out + its shard's begin).
  template <typename T>
  void all_gather(const T* shard, T* out, std::size_t n) {
    static_assert(std::is_trivially_copyable_v<T>, "membound: all_gather copies bytes: T must be trivially copyable");
    begin();
    const shard_range mine = shard_of(n, size_, rank_);
    if (mine.size() != 0 && shard != out + mine.begin) {
      detail::nccl_cuda_check(cudaMemcpyAsync(out + mine.begin, shard, mine.size() * sizeof(T), cudaMemcpyDeviceToDevice,
                                              stream_),
                              "cudaMemcpyAsync");
    }
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (std::size_t r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const shard_range s = shard_of(n, size_, r);
      if (mine.size() != 0) send_bytes(out + mine.begin, mine.size() * sizeof(T), r);
      if (s.size() != 0) recv_bytes(out + s.begin, s.size() * sizeof(T), r);
    }
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    end();
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
    begin();
    detail::nccl_check(ncclBroadcast(data, data, n * sizeof(T), ncclChar, static_cast<int>(root), comm_, stream_),
                       "ncclBroadcast");
    if (rank_ == root) stats_.bytes_sent += (size_ - 1) * n * sizeof(T);
    end();
  }
  // Every rank's work so far done, on the device and on the host: the caller's stream and the
  // communicator's drained, then an MPI barrier.
  void barrier() {
    synchronize();
    if (mpi_ != MPI_COMM_NULL) detail::nccl_mpi_check(MPI_Barrier(mpi_), "MPI_Barrier");  // one process: nobody to wait for
  }
  void synchronize() {
    detail::nccl_cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    if (user_ != nullptr) detail::nccl_cuda_check(cudaStreamSynchronize(user_), "cudaStreamSynchronize");
  }

 private:
  // stream_ waits for the caller's work so far.
  void begin() {
    ++stats_.collectives;
    if (user_ == nullptr) return;
    detail::nccl_cuda_check(cudaEventRecord(ready_, user_), "cudaEventRecord");
    detail::nccl_cuda_check(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
  }
  // The caller's later work waits for this collective.
  void end() {
    if (user_ == nullptr) return;
    detail::nccl_cuda_check(cudaEventRecord(done_, stream_), "cudaEventRecord");
    detail::nccl_cuda_check(cudaStreamWaitEvent(user_, done_, 0), "cudaStreamWaitEvent");
  }
  void send_bytes(const void* p, std::size_t bytes, std::size_t peer) {
    detail::nccl_check(ncclSend(p, bytes, ncclChar, static_cast<int>(peer), comm_, stream_), "ncclSend");
    stats_.bytes_sent += bytes;
  }
  void recv_bytes(void* p, std::size_t bytes, std::size_t peer) {
    detail::nccl_check(ncclRecv(p, bytes, ncclChar, static_cast<int>(peer), comm_, stream_), "ncclRecv");
  }

  // blocks_ set: the all-to-all of every rank's blocks into ws (slot r: rank r's part of this
  // rank's block, `most` elements apart), then their rank-order sum into out.
  template <summable T>
  void reduce_blocks(const T* in, T* out, void* ws, std::size_t ws_bytes, std::size_t most) {
    detail::check_workspace(ws, ws_bytes, size_ * most * sizeof(T));
    const shard_range mine = blocks_[rank_];
    T* parts = static_cast<T*>(ws);
    begin();
    if (mine.size() != 0) {
      detail::nccl_cuda_check(cudaMemcpyAsync(parts + rank_ * most, in + mine.begin, mine.size() * sizeof(T),
                                              cudaMemcpyDeviceToDevice, stream_),
                              "cudaMemcpyAsync");
    }
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (std::size_t r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      if (blocks_[r].size() != 0) send_bytes(in + blocks_[r].begin, blocks_[r].size() * sizeof(T), r);
      if (mine.size() != 0) recv_bytes(parts + r * most, mine.size() * sizeof(T), r);
    }
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    if (mine.size() != 0) {
      const unsigned threads = 256;
      const auto grid = static_cast<unsigned>(std::min<std::size_t>((mine.size() + threads - 1) / threads, 4096));
      detail::nccl_ordered_sum<T><<<grid, threads, 0, stream_>>>(parts, size_, most, mine.size(), out);
      detail::nccl_cuda_check(cudaGetLastError(), "nccl_ordered_sum<<<>>>");
    }
    end();
  }

  // After rank_, size_ and (over MPI) mpi_ are set: the stream, events and NCCL's communicator.
  void init(const ncclUniqueId& id) {
    try {
      blocks_.resize(size_);
      detail::nccl_cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      detail::nccl_cuda_check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      detail::nccl_cuda_check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      detail::nccl_check(ncclCommInitRank(&comm_, static_cast<int>(size_), id, static_cast<int>(rank_)),
                         "ncclCommInitRank");
    } catch (...) {
      release();
      throw;
    }
  }
  void release() noexcept {
    if (comm_ != nullptr) (void)ncclCommDestroy(comm_);
    if (done_ != nullptr) (void)cudaEventDestroy(done_);
    if (ready_ != nullptr) (void)cudaEventDestroy(ready_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    comm_ = nullptr;
    done_ = ready_ = nullptr;
    stream_ = nullptr;
    int finalized = 0;
    if (mpi_ != MPI_COMM_NULL && MPI_Finalized(&finalized) == MPI_SUCCESS && finalized == 0) (void)MPI_Comm_free(&mpi_);
    mpi_ = MPI_COMM_NULL;
  }

  std::size_t rank_ = 0, size_ = 1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr, user_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  MPI_Comm mpi_ = MPI_COMM_NULL;
  communication_stats stats_{};
  std::vector<shard_range> blocks_;  // each rank's block of the reduce-scatter in flight
  nccl_control control_;
};
static_assert(device_communicator<nccl_communicator>);

MEMBOUND_NAMESPACE_END
