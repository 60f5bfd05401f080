// The MPI communicator: data-parallel ranks as MPI processes (Debian's OpenMPI; any MPI-3
// library). Include membound/mpi.hpp and link MPI::MPI_CXX; the rest of membound never includes
// <mpi.h>.
//
//   membound::mpi_environment env(argc, argv);       // MPI_Init_thread, MPI_Finalize at scope end
//   membound::mpi_communicator comm;                 // a duplicate of MPI_COMM_WORLD
//   std::vector<std::byte> ws(comm.all_reduce_workspace_bytes<float>(n));
//   comm.all_reduce_sum(grad, n, ws.data(), ws.size());
//
// MPI moves bytes only (all-to-all, all-gather, broadcast); the sums are membound's, in rank
// order (see dist/communicator.hpp), so a result depends on the world size and the data, never
// on which algorithm the MPI library picks. Errors return (MPI_ERRORS_RETURN on our own
// communicator) and become communication_error; a rank that dies makes mpirun end the others.
//
// A timeout (mpi_communicator(parent, timeout)) bounds every collective: each is started
// non-blocking and polled until its deadline; one that has not completed by then throws
// collective_timeout on every rank waiting in it (a rank that never joins cannot throw). MPI
// cannot cancel a collective, so the communicator is then unusable: end the run (MPI_Abort, as
// mpirun does when a rank dies) and resume from the last checkpoint.
#pragma once

// The C API only: the deprecated C++ bindings are not needed and do not compile warning-free.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/dist/communicator.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {
inline void mpi_check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  throw communication_error(call, code, len > 0 ? std::string(text, static_cast<std::size_t>(len)) : "no message");
}
// MPI counts are int: a shard of more bytes must be split by the caller (buckets).
inline int mpi_count(std::size_t bytes, const char* argument) {
  if (bytes > static_cast<std::size_t>(INT_MAX)) {
    throw invalid_argument(argument, "at most " + std::to_string(INT_MAX) + " bytes per rank and collective",
                           std::to_string(bytes) + " bytes",
                           "Split the buffer into buckets (MPI counts are int)");
  }
  return static_cast<int>(bytes);
}
}  // namespace detail

// A collective did not complete within the communicator's timeout: some rank did not join it
// (stuck, much slower than the deadline, or dead). The communicator cannot be used again.
class collective_timeout : public communication_error {
 public:
  collective_timeout(std::string call, std::chrono::milliseconds timeout)
      : communication_error(std::move(call), 0,
                            "not complete after " + std::to_string(timeout.count()) +
                                " ms: a rank did not join it (stuck, much slower, or dead); this communicator "
                                "cannot be used again"),
        timeout_(timeout) {}
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

 private:
  std::chrono::milliseconds timeout_;
};

// MPI_Init_thread at construction (unless MPI is already initialized), MPI_Finalize at
// destruction (only if this object initialized it). FUNNELED: membound's thread pool never calls
// MPI; only the thread that made the communicator does.
class mpi_environment {
 public:
  mpi_environment(int& argc, char**& argv) {
    int ready = 0;
    detail::mpi_check(MPI_Initialized(&ready), "MPI_Initialized");
    if (ready == 0) {
      int provided = 0;
      detail::mpi_check(MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
      owner_ = true;
    }
  }
  mpi_environment(const mpi_environment&) = delete;
  mpi_environment& operator=(const mpi_environment&) = delete;
  ~mpi_environment() {
    int done = 0;
    if (owner_ && MPI_Finalized(&done) == MPI_SUCCESS && done == 0) MPI_Finalize();
  }

 private:
  bool owner_ = false;
};

class mpi_communicator {
 public:
  // A duplicate of `parent`, so our collectives never match a user's messages. timeout: 0 waits
  // as long as it takes; otherwise the most any collective may take (collective_timeout).
  explicit mpi_communicator(MPI_Comm parent = MPI_COMM_WORLD,
                            std::chrono::milliseconds timeout = std::chrono::milliseconds{0})
      : timeout_(timeout) {
    if (timeout.count() < 0) {
      throw invalid_argument("timeout", "0 (none) or a positive time", std::to_string(timeout.count()) + " ms",
                             "Give the longest a collective may take, e.g. 60000 ms");
    }
    int ready = 0;
    detail::mpi_check(MPI_Initialized(&ready), "MPI_Initialized");
    if (ready == 0) {
      throw invalid_argument("MPI", "initialized before a communicator is made", "not initialized",
                             "Create a membound::mpi_environment (or call MPI_Init_thread) first");
    }
    detail::mpi_check(MPI_Comm_dup(parent, &comm_), "MPI_Comm_dup");
    detail::mpi_check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    int r = 0, n = 0;
    detail::mpi_check(MPI_Comm_rank(comm_, &r), "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(comm_, &n), "MPI_Comm_size");
    rank_ = static_cast<std::size_t>(r);
    size_ = static_cast<std::size_t>(n);
    // Counts and displacements of the blocking collectives, sized once here rather than per call.
    counts_.resize(4 * size_);
    gather_counts_.resize(2 * size_);
  }
  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;
  ~mpi_communicator() {
    int done = 0;
    if (comm_ == MPI_COMM_NULL || MPI_Finalized(&done) != MPI_SUCCESS || done != 0) return;
    // A timed-out collective may still complete (its late rank joins): one more timeout for it,
    // else the communicator is left as it is rather than freed under a pending operation.
    if (drained()) MPI_Comm_free(&comm_);
  }

  std::size_t rank() const noexcept { return rank_; }
  std::size_t size() const noexcept { return size_; }
  const char* name() const noexcept { return "mpi"; }
  MPI_Comm native() const noexcept { return comm_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  // False after a collective timed out: every later collective throws communication_error.
  bool usable() const noexcept { return broken_.empty(); }

  // ---- Sizes (mpi_world's, communicator.hpp) -----------------------------------------------------
  template <summable T>
  std::size_t reduce_scatter_workspace_bytes(std::size_t n) const noexcept {
    return world().template reduce_scatter_workspace_bytes<T>(n);
  }
  template <summable T>
  std::size_t reduce_scatter_blocks_workspace_bytes(std::size_t max_block) const noexcept {
    return world().template reduce_scatter_blocks_workspace_bytes<T>(max_block);
  }
  template <summable T>
  std::size_t all_reduce_workspace_bytes(std::size_t n) const noexcept {
    return world().template all_reduce_workspace_bytes<T>(n);
  }
  // This world's sizes, without MPI.
  mpi_world world() const noexcept { return {size_, rank_}; }

  // ---- Reduce-scatter ---------------------------------------------------------------------------
  // out (shard_of(n, size(), rank()).size() elements) = Σ over ranks, in rank order, of in's
  // elements in this rank's shard.
  class pending_reduce_scatter;
  template <summable T>
  pending_reduce_scatter start_reduce_scatter_sum(const T* in, std::size_t n, T* out, void* ws,
                                                  std::size_t ws_bytes);
  template <summable T>
  void reduce_scatter_sum(const T* in, std::size_t n, T* out, void* ws, std::size_t ws_bytes);
  // out (blocks[rank()].size() elements) = Σ over ranks, in rank order, of in[blocks[rank()]]:
  // each rank names the block every rank receives (blocks: size() ranges of `in`, the same on
  // every rank). ZeRO-1 uses it with each rank's parameter shard cut into buckets, so a rank's
  // summed gradient lands where its optimizer shard is. out may be in + blocks[rank()].begin (the
  // sum is written after every block has been received).
  template <summable T>
  void reduce_scatter_blocks_sum(const T* in, const shard_range* blocks, T* out, void* ws, std::size_t ws_bytes);
  // The same, started: it runs while the caller computes (MPI moves it on inside MPI calls, so
  // call test() now and then) and wait() completes it, writing out. blocks is read here only;
  // in, out and ws stay the caller's and untouched until wait() returns.
  template <summable T>
  pending_reduce_scatter start_reduce_scatter_blocks_sum(const T* in, const shard_range* blocks, T* out, void* ws,
                                                         std::size_t ws_bytes);

  // ---- All-gather, all-reduce, broadcast ---------------------------------------------------------
  // out (n elements) gets every rank's shard (shard_of(n, size(), r).size() elements) at its place.
  template <typename T>
  void all_gather(const T* shard, T* out, std::size_t n) {
    static_assert(std::is_trivially_copyable_v<T>, "membound: all_gather copies bytes: T must be trivially copyable");
    int* counts = counts_.data();
    int* displs = counts + size_;
    for (std::size_t r = 0; r < size_; ++r) {
      const shard_range s = shard_of(n, size_, r);
      counts[r] = detail::mpi_count(s.size() * sizeof(T), "n");
      displs[r] = detail::mpi_count(s.begin * sizeof(T), "n");
    }
    // In place when the shard already sits in out (ZeRO's parameter gather does that).
    const bool in_place = shard == out + shard_of(n, size_, rank_).begin;
    gather_bytes(in_place ? MPI_IN_PLACE : static_cast<const void*>(shard), out, counts, displs);
  }
  // In place: data + blocks[r].begin holds rank r's blocks[r].size() elements on rank r; after,
  // every rank holds every block (ZeRO-3's gather of one block's weights from the ranks' shards).
  // blocks: size() ranges, the same on every rank, not overlapping (in any order: ZeRO-3's tied
  // head lays the array's end before its start).
  template <typename T>
  void all_gather_blocks(T* data, const shard_range* blocks) {
    static_assert(std::is_trivially_copyable_v<T>, "membound: all_gather_blocks copies bytes: T must be trivially copyable");
    int* counts = counts_.data();
    int* displs = counts + size_;
    for (std::size_t r = 0; r < size_; ++r) {
      counts[r] = detail::mpi_count(blocks[r].size() * sizeof(T), "blocks");
      displs[r] = detail::mpi_count(blocks[r].begin * sizeof(T), "blocks");
    }
    gather_bytes(MPI_IN_PLACE, data, counts, displs);
  }
  // The same, started (ZeRO-3's prefetch of the next block): it runs while the caller computes
  // (test() lets MPI move it on) and wait() completes it; data stays the caller's and untouched
  // until then. One started gather at a time per communicator (its counts live here, sized once
  // at construction): starting another before the first is waited is an invalid_argument.
  class pending_gather;
  template <typename T>
  pending_gather start_all_gather_blocks(T* data, const shard_range* blocks);
  // data (n elements) = Σ over ranks in rank order, on every rank.
  // The same, started (ZeRO-0's overlapped gradient exchange): the reduce-scatter's all-to-all
  // now; once it has completed (test() sees it, or wait()), this rank's shard is summed and the
  // all-gather started non-blocking. data and ws stay the caller's and untouched (data is written
  // by the all-gather) until wait() returns; the sums are all_reduce_sum's, bit for bit. MPI
  // matches collectives by the order each rank starts them, and when test() starts the all-gather
  // depends on timing: so the next collective this communicator starts (any call) first completes
  // the all-to-all and starts the all-gather of a started all-reduce that has not started it yet,
  // and every rank starts the same collectives in the same order.
  class pending_all_reduce;
  template <summable T>
  pending_all_reduce start_all_reduce_sum(T* data, std::size_t n, void* ws, std::size_t ws_bytes);
  template <summable T>
  void all_reduce_sum(T* data, std::size_t n, void* ws, std::size_t ws_bytes) {
    const std::size_t need = all_reduce_workspace_bytes<T>(n);
    detail::check_workspace(ws, ws_bytes, need);
    T* mine = reinterpret_cast<T*>(static_cast<std::byte*>(ws) + reduce_scatter_workspace_bytes<T>(n));
    reduce_scatter_sum(static_cast<const T*>(data), n, mine, ws, reduce_scatter_workspace_bytes<T>(n));
    all_gather(static_cast<const T*>(mine), data, n);
  }
  template <typename T>
  void broadcast(T* data, std::size_t n, std::size_t root) {
    static_assert(std::is_trivially_copyable_v<T>, "membound: broadcast copies bytes: T must be trivially copyable");
    detail::check_root(root, size_);
    start_pending_gather();
    check_usable();
    count_sent(rank_ == root ? static_cast<std::uint64_t>(n * sizeof(T)) * (size_ - 1) : 0);
    const int bytes = detail::mpi_count(n * sizeof(T), "n");
    if (timeout_.count() == 0) {
      detail::mpi_check(MPI_Bcast(data, bytes, MPI_BYTE, static_cast<int>(root), comm_), "MPI_Bcast");
      return;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    detail::mpi_check(MPI_Ibcast(data, bytes, MPI_BYTE, static_cast<int>(root), comm_, &req), "MPI_Ibcast");
    complete(req, "MPI_Ibcast");
  }
  void barrier() {
    start_pending_gather();
    check_usable();
    if (timeout_.count() == 0) {
      detail::mpi_check(MPI_Barrier(comm_), "MPI_Barrier");
      return;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    detail::mpi_check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
    complete(req, "MPI_Ibarrier");
  }
  communication_stats stats() const noexcept { return stats_; }

 private:
  // The all-gather of every rank's counts[r] bytes at out + displs[r] (send: this rank's, or
  // MPI_IN_PLACE when they already sit there).
  void gather_bytes(const void* send, void* out, const int* counts, const int* displs) {
    start_pending_gather();
    check_usable();
    count_sent(static_cast<std::uint64_t>(counts[rank_]) * (size_ - 1));
    if (timeout_.count() == 0) {
      detail::mpi_check(MPI_Allgatherv(send, counts[rank_], MPI_BYTE, out, counts, displs, MPI_BYTE, comm_),
                        "MPI_Allgatherv");
      return;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    detail::mpi_check(MPI_Iallgatherv(send, counts[rank_], MPI_BYTE, out, counts, displs, MPI_BYTE, comm_, &req),
                      "MPI_Iallgatherv");
    complete(req, "MPI_Iallgatherv");
  }
  // The all-to-all of a reduce-scatter whose 4·N counts (send counts and displacements, then
  // receive ones) are at c, in the caller's workspace; its handle sums `count` elements into out.
  template <summable T>
  pending_reduce_scatter start_alltoall(const T* in, const int* c, T* parts, T* out, std::size_t stride,
                                        std::size_t count);
  // Starts the all-gather of the started all-reduce that has not yet (see start_all_reduce_sum).
  void start_pending_gather();
  void count_sent(std::uint64_t bytes) noexcept {
    stats_.bytes_sent += bytes;
    ++stats_.collectives;
  }
  void check_usable() const {
    if (!broken_.empty()) {
      throw communication_error(broken_, 0, "an earlier collective timed out, so this communicator cannot be used again");
    }
  }
  // Completes req: MPI_Wait without a timeout, else MPI_Test until the deadline. A request past
  // it is kept (MPI cannot cancel a collective) and the communicator marked unusable.
  void complete(MPI_Request& req, const char* call) {
    if (timeout_.count() == 0) {
      detail::mpi_check(MPI_Wait(&req, MPI_STATUS_IGNORE), "MPI_Wait");
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      int done = 0;
      detail::mpi_check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done != 0) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        stale_.push_back(std::exchange(req, MPI_REQUEST_NULL));
        broken_ = call;
        throw collective_timeout(call, timeout_);
      }
      std::this_thread::yield();
    }
  }
  // Whether req has completed (MPI moves a started collective on inside such calls).
  static bool test_request(MPI_Request& req) {
    if (req == MPI_REQUEST_NULL) return true;
    int done = 0;
    detail::mpi_check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
    return done != 0;
  }
  // Completes req of a handle dropped unwaited, errors swallowed: with a timeout one past the
  // deadline is kept by `owner` as stale (MPI cannot cancel a collective), else MPI_Wait.
  static void complete_quietly(mpi_communicator* owner, MPI_Request& req, const char* call) noexcept {
    if (req == MPI_REQUEST_NULL) return;
    if (owner != nullptr && owner->timeout_.count() != 0) {
      try {
        owner->complete(req, call);
      } catch (...) {
      }
    } else {
      MPI_Wait(&req, MPI_STATUS_IGNORE);
    }
  }
  // Whether every timed-out request completed within one more timeout.
  bool drained() noexcept {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (MPI_Request& r : stale_) {
      int done = 0;
      while (r != MPI_REQUEST_NULL && MPI_Test(&r, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done == 0) {
        if (std::chrono::steady_clock::now() >= deadline) return false;
        std::this_thread::yield();
      }
    }
    return true;
  }

  communication_stats stats_{};
  std::chrono::milliseconds timeout_{0};
  std::string broken_;               // the call that timed out; empty while usable
  std::vector<MPI_Request> stale_;   // collectives that timed out, still pending
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::size_t rank_ = 0, size_ = 1;
  std::vector<int> counts_;
  std::vector<int> gather_counts_;  // a started all_gather_blocks' counts and displacements
  bool gather_started_ = false;     // ... while it is in flight
  pending_all_reduce* ungathered_ = nullptr;  // a started all-reduce whose all-gather has not started
};

// An all-to-all in flight: wait() completes it and adds the received shards in rank order. The
// buffers given to start_reduce_scatter_sum must stay untouched until then. Destroying it
// unwaited waits (MPI requires completion before the buffers go), without the sum.
class mpi_communicator::pending_reduce_scatter {
 public:
  pending_reduce_scatter() = default;
  pending_reduce_scatter(const pending_reduce_scatter&) = delete;
  pending_reduce_scatter& operator=(const pending_reduce_scatter&) = delete;
  pending_reduce_scatter(pending_reduce_scatter&& o) noexcept { *this = std::move(o); }
  pending_reduce_scatter& operator=(pending_reduce_scatter&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      req_ = std::exchange(o.req_, MPI_REQUEST_NULL);
      sum_ = std::exchange(o.sum_, nullptr);
      owner_ = o.owner_;
      parts_ = o.parts_;
      out_ = o.out_;
      ranks_ = o.ranks_;
      stride_ = o.stride_;
      count_ = o.count_;
    }
    return *this;
  }
  ~pending_reduce_scatter() { finish_quietly(); }

  bool pending() const noexcept { return req_ != MPI_REQUEST_NULL || sum_ != nullptr; }
  // Lets MPI move the exchange on (many MPI libraries progress a non-blocking collective only
  // inside MPI calls); true once every shard has arrived. The sum is still wait()'s.
  bool test() { return test_request(req_); }
  // With a timeout: collective_timeout when the exchange does not complete in time.
  void wait() {
    if (req_ != MPI_REQUEST_NULL) {
      if (owner_ != nullptr) {
        owner_->complete(req_, "MPI_Ialltoallv");
      } else {
        detail::mpi_check(MPI_Wait(&req_, MPI_STATUS_IGNORE), "MPI_Wait");
      }
    }
    if (sum_ != nullptr) std::exchange(sum_, nullptr)(parts_, ranks_, stride_, count_, out_);
  }

 private:
  friend class mpi_communicator;
  using sum_fn = void (*)(const void*, std::size_t, std::size_t, std::size_t, void*);
  template <summable T>
  static void sum(const void* parts, std::size_t ranks, std::size_t stride, std::size_t count, void* out) {
    detail::ordered_sum(static_cast<const T*>(parts), ranks, stride, count, static_cast<T*>(out));
  }
  void finish_quietly() noexcept {
    complete_quietly(owner_, req_, "MPI_Ialltoallv");
    sum_ = nullptr;
  }

  MPI_Request req_ = MPI_REQUEST_NULL;
  sum_fn sum_ = nullptr;
  mpi_communicator* owner_ = nullptr;
  const void* parts_ = nullptr;
  void* out_ = nullptr;
  std::size_t ranks_ = 0, stride_ = 0, count_ = 0;
};

// An all-reduce in flight: its reduce-scatter, then (once that is complete and summed) its
// all-gather. Destroying it unwaited completes what was started, without starting the rest.
class mpi_communicator::pending_all_reduce {
 public:
  pending_all_reduce() = default;
  pending_all_reduce(const pending_all_reduce&) = delete;
  pending_all_reduce& operator=(const pending_all_reduce&) = delete;
  pending_all_reduce(pending_all_reduce&& o) noexcept { *this = std::move(o); }
  pending_all_reduce& operator=(pending_all_reduce&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      scatter_ = std::move(o.scatter_);
      gather_ = std::exchange(o.gather_, MPI_REQUEST_NULL);
      owner_ = std::exchange(o.owner_, nullptr);
      data_ = o.data_;
      mine_ = o.mine_;
      counts_ = o.counts_;
      n_ = o.n_;
      size_ = o.size_;
      elem_ = o.elem_;
      gathering_ = std::exchange(o.gathering_, true);
      if (owner_ != nullptr && owner_->ungathered_ == &o) owner_->ungathered_ = this;
    }
    return *this;
  }
  ~pending_all_reduce() { finish_quietly(); }

  // Lets MPI move the exchange on (the all-gather is started from here once the all-to-all is
  // complete); true once every shard has arrived in data.
  bool test() {
    if (!gathering_) {
      if (!scatter_.test()) return false;
      start_gather();
    }
    return test_request(gather_);
  }
  // With a timeout: collective_timeout when a part does not complete in time.
  void wait() {
    if (!gathering_) start_gather();
    if (gather_ != MPI_REQUEST_NULL) owner_->complete(gather_, "MPI_Iallgatherv");
  }

 private:
  friend class mpi_communicator;
  // Completes the reduce-scatter (this rank's shard summed into mine_), then starts the all-gather
  // of every rank's shard into data_; its counts go where the all-to-all's were (free by now).
  void start_gather() {
    gathering_ = true;
    if (owner_->ungathered_ == this) owner_->ungathered_ = nullptr;
    scatter_.wait();
    int* counts = counts_;
    int* displs = counts + size_;
    for (std::size_t r = 0; r < size_; ++r) {
      const shard_range s = shard_of(n_, size_, r);
      counts[r] = detail::mpi_count(s.size() * elem_, "n");
      displs[r] = detail::mpi_count(s.begin * elem_, "n");
    }
    const std::size_t me = owner_->rank_;
    owner_->check_usable();
    owner_->count_sent(static_cast<std::uint64_t>(counts[me]) * (size_ - 1));
    detail::mpi_check(MPI_Iallgatherv(mine_, counts[me], MPI_BYTE, data_, counts, displs, MPI_BYTE, owner_->comm_, &gather_),
                      "MPI_Iallgatherv");
  }
  // Unwaited: the all-gather is started all the same (the other ranks may have started theirs),
  // and completed, errors swallowed.
  void finish_quietly() noexcept {
    if (!gathering_) {
      try {
        start_gather();
      } catch (...) {
        if (owner_->ungathered_ == this) owner_->ungathered_ = nullptr;
      }
    }
    scatter_ = pending_reduce_scatter{};  // waits for an all-to-all still in flight
    complete_quietly(owner_, gather_, "MPI_Iallgatherv");
    gathering_ = true;
  }

  pending_reduce_scatter scatter_;
  MPI_Request gather_ = MPI_REQUEST_NULL;
  mpi_communicator* owner_ = nullptr;
  void* data_ = nullptr;
  const void* mine_ = nullptr;
  int* counts_ = nullptr;
  std::size_t n_ = 0, size_ = 0, elem_ = 0;
  bool gathering_ = true;  // false while the reduce-scatter is the part in flight
};

template <summable T>
mpi_communicator::pending_all_reduce mpi_communicator::start_all_reduce_sum(T* data, std::size_t n, void* ws,
                                                                            std::size_t ws_bytes) {
  const std::size_t need = all_reduce_workspace_bytes<T>(n);
  detail::check_workspace(ws, ws_bytes, need);
  if (n != 0 && data == nullptr) {
    throw invalid_argument("data", "a buffer of n elements", "nullptr", "Pass the gradient buffer");
  }
  const std::size_t rs = reduce_scatter_workspace_bytes<T>(n);
  T* mine = reinterpret_cast<T*>(static_cast<std::byte*>(ws) + rs);
  pending_all_reduce p;
  p.scatter_ = start_reduce_scatter_sum(static_cast<const T*>(data), n, mine, ws, rs);
  p.owner_ = this;
  p.data_ = data;
  p.mine_ = mine;
  // The all-to-all's counts, reused by the all-gather (see start_reduce_scatter_sum's layout).
  p.counts_ = reinterpret_cast<int*>(static_cast<std::byte*>(ws) + size_ * max_shard(n, size_) * sizeof(T));
  p.n_ = n;
  p.size_ = size_;
  p.elem_ = sizeof(T);
  p.gathering_ = false;
  ungathered_ = &p;  // follows p when it is moved
  return p;
}

// A started all_gather_blocks: wait() completes it; destroying it unwaited waits (MPI requires
// completion before the buffer goes).
class mpi_communicator::pending_gather {
 public:
  pending_gather() = default;
  pending_gather(const pending_gather&) = delete;
  pending_gather& operator=(const pending_gather&) = delete;
  pending_gather(pending_gather&& o) noexcept { *this = std::move(o); }
  pending_gather& operator=(pending_gather&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      req_ = std::exchange(o.req_, MPI_REQUEST_NULL);
      owner_ = std::exchange(o.owner_, nullptr);
    }
    return *this;
  }
  ~pending_gather() { finish_quietly(); }
  bool pending() const noexcept { return req_ != MPI_REQUEST_NULL; }
  // Lets MPI move the gather on; true once it is complete (wait() still releases it).
  bool test() { return test_request(req_); }
  // With a timeout: collective_timeout when the gather does not complete in time.
  void wait() {
    if (owner_ == nullptr) return;
    if (req_ != MPI_REQUEST_NULL) owner_->complete(req_, "MPI_Iallgatherv");
    std::exchange(owner_, nullptr)->gather_started_ = false;
  }

 private:
  friend class mpi_communicator;
  void finish_quietly() noexcept {
    if (owner_ == nullptr) return;
    complete_quietly(owner_, req_, "MPI_Iallgatherv");
    std::exchange(owner_, nullptr)->gather_started_ = false;
  }
  MPI_Request req_ = MPI_REQUEST_NULL;
  mpi_communicator* owner_ = nullptr;
};

template <typename T>
mpi_communicator::pending_gather mpi_communicator::start_all_gather_blocks(T* data, const shard_range* blocks) {
  static_assert(std::is_trivially_copyable_v<T>, "membound: all_gather_blocks copies bytes: T must be trivially copyable");
  if (gather_started_) {
    throw invalid_argument("start_all_gather_blocks", "no started gather in flight on this communicator",
                           "one started and not yet waited", "Wait the started gather first");
  }
  int* counts = gather_counts_.data();
  int* displs = counts + size_;
  for (std::size_t r = 0; r < size_; ++r) {
    counts[r] = detail::mpi_count(blocks[r].size() * sizeof(T), "blocks");
    displs[r] = detail::mpi_count(blocks[r].begin * sizeof(T), "blocks");
  }
  start_pending_gather();
  check_usable();
  count_sent(static_cast<std::uint64_t>(counts[rank_]) * (size_ - 1));
  pending_gather p;
  detail::mpi_check(MPI_Iallgatherv(MPI_IN_PLACE, counts[rank_], MPI_BYTE, data, counts, displs, MPI_BYTE, comm_, &p.req_),
                    "MPI_Iallgatherv");
  p.owner_ = this;
  gather_started_ = true;
  return p;
}

inline void mpi_communicator::start_pending_gather() {
  if (ungathered_ != nullptr) ungathered_->start_gather();  // clears ungathered_
}

template <summable T>
mpi_communicator::pending_reduce_scatter mpi_communicator::start_reduce_scatter_sum(const T* in, std::size_t n, T* out,
                                                                                    void* ws, std::size_t ws_bytes) {
  const std::size_t need = reduce_scatter_workspace_bytes<T>(n);
  detail::check_workspace(ws, ws_bytes, need);
  const std::size_t stride = max_shard(n, size_);
  const shard_range mine = shard_of(n, size_, rank_);
  // A rank whose shard is empty (n < ranks) may pass a null out.
  if ((n != 0 && in == nullptr) || (mine.size() != 0 && out == nullptr)) {
    throw invalid_argument(in == nullptr ? "in" : "out", in == nullptr ? "a buffer of n elements" : "a buffer of this rank's shard",
                           "nullptr", "Pass the gradient buffer and this rank's shard");
  }
  check_usable();
  T* parts = static_cast<T*>(ws);
  // The counts live in the caller's workspace: MPI reads them until the request completes.
  int* c = reinterpret_cast<int*>(static_cast<std::byte*>(ws) + size_ * stride * sizeof(T));
  int *send_counts = c, *send_displs = c + size_, *recv_counts = c + 2 * size_, *recv_displs = c + 3 * size_;
  for (std::size_t r = 0; r < size_; ++r) {
    const shard_range s = shard_of(n, size_, r);
    send_counts[r] = detail::mpi_count(s.size() * sizeof(T), "n");
    send_displs[r] = detail::mpi_count(s.begin * sizeof(T), "n");
    recv_counts[r] = detail::mpi_count(mine.size() * sizeof(T), "n");
    recv_displs[r] = detail::mpi_count(r * stride * sizeof(T), "n");
  }
  std::uint64_t sent = 0;
  for (std::size_t r = 0; r < size_; ++r) sent += r == rank_ ? 0 : static_cast<std::uint64_t>(send_counts[r]);
  count_sent(sent);
  return start_alltoall(in, c, parts, out, stride, mine.size());
}

template <summable T>
mpi_communicator::pending_reduce_scatter mpi_communicator::start_alltoall(const T* in, const int* c, T* parts, T* out,
                                                                          std::size_t stride, std::size_t count) {
  start_pending_gather();
  pending_reduce_scatter p;
  detail::mpi_check(MPI_Ialltoallv(in, c, c + size_, MPI_BYTE, parts, c + 2 * size_, c + 3 * size_, MPI_BYTE, comm_, &p.req_),
                    "MPI_Ialltoallv");
  p.sum_ = count != 0 ? &pending_reduce_scatter::sum<T> : nullptr;
  p.owner_ = this;
  p.parts_ = parts;
  p.out_ = out;
  p.ranks_ = size_;
  p.stride_ = stride;
  p.count_ = count;
  return p;
}

template <summable T>
void mpi_communicator::reduce_scatter_sum(const T* in, std::size_t n, T* out, void* ws, std::size_t ws_bytes) {
  start_reduce_scatter_sum(in, n, out, ws, ws_bytes).wait();
}

template <summable T>
void mpi_communicator::reduce_scatter_blocks_sum(const T* in, const shard_range* blocks, T* out, void* ws,
                                                 std::size_t ws_bytes) {
  start_reduce_scatter_blocks_sum(in, blocks, out, ws, ws_bytes).wait();
}

template <summable T>
mpi_communicator::pending_reduce_scatter mpi_communicator::start_reduce_scatter_blocks_sum(
    const T* in, const shard_range* blocks, T* out, void* ws, std::size_t ws_bytes) {
  std::size_t stride = 0;
  for (std::size_t r = 0; r < size_; ++r) stride = std::max(stride, blocks[r].size());
  detail::check_workspace(ws, ws_bytes, reduce_scatter_blocks_workspace_bytes<T>(stride));
  const std::size_t mine = blocks[rank_].size();
  T* parts = static_cast<T*>(ws);
  int* c = reinterpret_cast<int*>(static_cast<std::byte*>(ws) + size_ * stride * sizeof(T));
  int *send_counts = c, *send_displs = c + size_, *recv_counts = c + 2 * size_, *recv_displs = c + 3 * size_;
  std::uint64_t sent = 0;
  for (std::size_t r = 0; r < size_; ++r) {
    send_counts[r] = detail::mpi_count(blocks[r].size() * sizeof(T), "blocks");
    send_displs[r] = detail::mpi_count(blocks[r].begin * sizeof(T), "blocks");
    recv_counts[r] = detail::mpi_count(mine * sizeof(T), "blocks");
    recv_displs[r] = detail::mpi_count(r * stride * sizeof(T), "blocks");
    sent += r == rank_ ? 0 : static_cast<std::uint64_t>(send_counts[r]);
  }
  check_usable();
  count_sent(sent);
  return start_alltoall(in, c, parts, out, stride, mine);
}

static_assert(communicator<mpi_communicator>);
static_assert(prefetching_communicator<mpi_communicator>);
static_assert(overlapping_communicator<mpi_communicator>);
static_assert(overlapping_all_reduce_communicator<mpi_communicator>);

MEMBOUND_NAMESPACE_END
