// The device trainer over more than one rank, on one GPU: NCCL refuses two ranks on one device,
// so here N ranks are N host threads, each with its own executor (stream), device budget and
// trainer, joined by a split communicator of the test's own (`board_rank`): a data collective
// copies each rank's device bytes to a shared host board, waits for every rank, sums in rank
// order on the host (detail::ordered_sum: the CPU communicators' bits, 16-bit storage in fp32
// rounded once) and copies the rank's result back onto its stream; control() does the same on
// host memory. What it exercises is the trainer's side of a device communicator: the exchange
// on device gradients in buckets, ZeRO-1's sharded norm on the device (each shard's sum of
// squares, gathered through control()), the weights' all-gather into device memory, ZeRO-1's
// checkpoint shards written from host copies and loaded back. nccl_communicator's own transport
// is test_nccl_trainer's (tests/nccl/).
//   - 2 ranks of 2 micro-batches against one process of 4 (local_communicator): the loss curve
//     within 1e-5 relative per step (fp32: (m0 + m1) + (m2 + m3) against ((m0 + m1) + m2) + m3,
//     as test_mpi_trainer states for the CPU, where the largest seen was 5.7e-7).
//   - ZeRO-1 gives ZeRO-0's losses and weights bit for bit, fp32 and bf16: the same sums, and
//     both stages add the same shards' sums of squares in rank order.
//   - Both ranks hold the same weights; each rank's measured peak == its plan's prediction.
//   - ZeRO-1 over 2 ranks: save at step 4 (a shard per rank and a manifest), load into fresh
//     trainers, 4 more steps: the uninterrupted run's bits.
//   - ZeRO-2 and overlap over ranks on a device: invalid_argument naming the option.
// Without a device it exits 77 (skipped).
#include <cuda_runtime_api.h>

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test_support.cuh"
#include "data_parallel_support.cuh"

namespace mb = membound;

namespace {

using namespace dpt;
constexpr std::size_t ranks = 2;

// ---- The board: N threads' collectives through host memory ---------------------------------------
struct board {
  explicit board(std::size_t n) : sync(static_cast<std::ptrdiff_t>(n)), slot(n) {}
  std::barrier<> sync;
  std::vector<std::vector<std::byte>> slot;  // each rank's contribution to the collective in progress
};

// OnDevice: the buffers are device memory, copied on the rank's stream (after its work so far).
template <bool OnDevice>
class board_comm {
 public:
  board_comm(board& b, std::size_t rank) : b_(b), rank_(rank) {}
  std::size_t rank() const noexcept { return rank_; }
  std::size_t size() const noexcept { return b_.slot.size(); }
  const char* name() const noexcept { return OnDevice ? "board (device)" : "board (host)"; }
  void set_stream(cudaStream_t s) { stream_ = s; }
  cudaStream_t caller_stream() const noexcept { return stream_; }
  void clear_stream() noexcept { stream_ = nullptr; }

  // The same workspace nccl_communicator asks for, so the plans count what NCCL's would.
  template <mb::summable T>
  std::size_t reduce_scatter_workspace_bytes(std::size_t n) const noexcept {
    return size() * mb::max_shard(n, size()) * sizeof(T);
  }
  template <mb::summable T>
  std::size_t reduce_scatter_blocks_workspace_bytes(std::size_t most) const noexcept {
    return size() * most * sizeof(T);
  }
  template <mb::summable T>
  std::size_t all_reduce_workspace_bytes(std::size_t n) const noexcept {
    return reduce_scatter_workspace_bytes<T>(n) + mb::max_shard(n, size()) * sizeof(T);
  }

  template <mb::summable T>
  void reduce_scatter_sum(const T* in, std::size_t n, T* out, void*, std::size_t) {
    std::vector<mb::shard_range> blocks(size());
    for (std::size_t r = 0; r < size(); ++r) blocks[r] = mb::shard_of(n, size(), r);
    reduce_blocks(in, blocks.data(), out);
  }
  template <mb::summable T>
  void reduce_scatter_blocks_sum(const T* in, const mb::shard_range* blocks, T* out, void*, std::size_t) {
    reduce_blocks(in, blocks, out);
  }
  template <typename T>
  void all_gather(const T* shard, T* out, std::size_t n) {
    const mb::shard_range mine = mb::shard_of(n, size(), rank_);
    post(shard, mine.size() * sizeof(T));
    std::vector<std::byte> whole(n * sizeof(T));
    for (std::size_t r = 0; r < size(); ++r) {
      const mb::shard_range s = mb::shard_of(n, size(), r);
      if (s.size() != 0) std::memcpy(whole.data() + s.begin * sizeof(T), slot(r, s.size() * sizeof(T)), s.size() * sizeof(T));
    }
    b_.sync.arrive_and_wait();  // every rank has read the board
    put(out, whole.data(), whole.size());
  }
  template <mb::summable T>
  void all_reduce_sum(T* data, std::size_t n, void*, std::size_t) {
    post(data, n * sizeof(T));
    std::vector<T> parts(size() * n), sum(n);
    for (std::size_t r = 0; r < size(); ++r) std::memcpy(parts.data() + r * n, slot(r, n * sizeof(T)), n * sizeof(T));
    b_.sync.arrive_and_wait();
    if (n != 0) mb::detail::ordered_sum(parts.data(), size(), n, n, sum.data());
    put(data, sum.data(), n * sizeof(T));
  }
  template <typename T>
  void broadcast(T* data, std::size_t n, std::size_t root) {
    post(data, rank_ == root ? n * sizeof(T) : 0);
    std::vector<std::byte> v(n * sizeof(T));
    if (rank_ != root && n != 0) std::memcpy(v.data(), slot(root, v.size()), v.size());
    b_.sync.arrive_and_wait();
    if (rank_ != root) put(data, v.data(), v.size());
  }
  void barrier() { b_.sync.arrive_and_wait(); }

 private:
  // Copies this rank's bytes onto the board and waits for every rank's.
  void post(const void* src, std::size_t bytes) {
    std::vector<std::byte>& mine = b_.slot[rank_];
    mine.resize(bytes);
    if (bytes != 0) {
      if constexpr (OnDevice) {
        mb::cuda_check(cudaMemcpyAsync(mine.data(), src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
        mb::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      } else {
        std::memcpy(mine.data(), src, bytes);
      }
    }
    b_.sync.arrive_and_wait();
  }
  // Rank r's contribution, at least `bytes` of it: never a read past a slot. (A rank that failed
  // and left the board may have left a stale slot of the right size: the survivors then go on with
  // its bytes, and the failure is reported through the thread's error.)
  const std::byte* slot(std::size_t r, std::size_t bytes) const {
    if (b_.slot[r].size() < bytes) {
      throw std::runtime_error("board: rank " + std::to_string(r) + " posted " + std::to_string(b_.slot[r].size()) +
                               " bytes, " + std::to_string(bytes) + " expected (it failed?)");
    }
    return b_.slot[r].data();
  }
  void put(void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0) return;
    if constexpr (OnDevice) {
      mb::cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
      mb::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    } else {
      std::memcpy(dst, src, bytes);
    }
  }
  // Every rank posts the whole span its blocks cover; each sums its own block in rank order.
  template <typename T>
  void reduce_blocks(const T* in, const mb::shard_range* blocks, T* out) {
    std::size_t end = 0;
    for (std::size_t r = 0; r < size(); ++r) end = std::max(end, blocks[r].end);
    post(in, end * sizeof(T));
    const mb::shard_range mine = blocks[rank_];
    std::vector<T> parts(size() * mine.size()), sum(mine.size());
    for (std::size_t r = 0; r < size(); ++r) {
      std::memcpy(parts.data() + r * mine.size(), slot(r, mine.end * sizeof(T)) + mine.begin * sizeof(T),
                  mine.size() * sizeof(T));
    }
    b_.sync.arrive_and_wait();
    if (mine.size() != 0) mb::detail::ordered_sum(parts.data(), size(), mine.size(), mine.size(), sum.data());
    put(out, sum.data(), mine.size() * sizeof(T));
  }

  board& b_;
  std::size_t rank_;
  cudaStream_t stream_ = nullptr;
};

// One rank: device data, host control, as nccl_communicator splits them.
class board_rank : public board_comm<true> {
 public:
  board_rank(board& data, board& control, std::size_t rank) : board_comm<true>(data, rank), control_(control, rank) {}
  using control_type = board_comm<false>;
  control_type& control() noexcept { return control_; }
  static constexpr bool moves_device_memory = true;

 private:
  control_type control_;
};
static_assert(mb::device_communicator<board_rank> && board_rank::moves_device_memory);

// ---- Runs ------------------------------------------------------------------------------------------
// Every rank's run; save_at != 0: saved to `path` after that many steps, continued by fresh
// trainers that load it.
template <typename Model>
std::vector<run> data_parallel(const Model& m, std::size_t zero, std::size_t save_at = 0, const std::string& path = {}) {
  board data(ranks), control(ranks);
  std::vector<run> out(ranks);
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<std::thread> threads;
  for (std::size_t rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        mb::cuda_check(cudaSetDevice(0), "cudaSetDevice");
        board_rank comm(data, control, rank);
        out[rank] = rank_run(m, comm, zero, save_at, path);
      } catch (...) {
        errors[rank] = std::current_exception();
        // The other ranks must not wait for this one at the board's next collective.
        data.sync.arrive_and_drop();
        control.sync.arrive_and_drop();
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

template <typename P>
void zero1_is_zero0(const char* name) {
  using model_t = hybrid<P>;
  const model_t m(config());
  const std::vector<run> z0 = data_parallel(m, 0);
  const std::vector<run> z1 = data_parallel(m, 1);
  for (std::size_t r = 0; r < ranks; ++r) {
    CHECK(z0[r].losses.size() == steps && std::isfinite(z0[r].losses.back()) && z0[r].losses.back() < z0[r].losses.front());
    CHECK(same_bits(z1[r].losses, z0[r].losses));  // ZeRO-1: ZeRO-0's bits
    CHECK(z1[r].weights == z0[r].weights);
    CHECK(z0[r].weights == z0[0].weights);  // every rank holds the same weights
    CHECK(z1[r].weights == z1[0].weights);
    CHECK(z0[r].peak == z0[r].predicted);  // measured == predicted on each rank
    CHECK(z1[r].peak == z1[r].predicted);
    CHECK(z0[r].all_returned && z1[r].all_returned);
  }
  CHECK(z1[0].peak < z0[0].peak);  // the optimizer state is sharded
  if constexpr (std::is_same_v<typename P::storage_type, float>) {
    const run ref = one_process(m);
    const double gap = worst_gap(z0[0].losses, ref.losses);
    CHECK(gap <= 1e-5);
    std::printf("  %s, %zu ranks on one device: worst loss gap to one process %.3g; peak per rank ZeRO-0 %zu B, "
                "ZeRO-1 %zu B (measured == predicted)\n",
                name, ranks, gap, z0[0].peak, z1[0].peak);
  } else {
    std::printf("  %s, %zu ranks on one device: ZeRO-1 == ZeRO-0; peak per rank ZeRO-0 %zu B, ZeRO-1 %zu B\n", name,
                ranks, z0[0].peak, z1[0].peak);
  }
}

void fp32_ranks() { zero1_is_zero0<mb::fp32_precision>("fp32"); }
void bf16_ranks() { zero1_is_zero0<mb::bf16_precision>("bf16"); }

void sharded_checkpoint() {
  using model_t = hybrid<mb::fp32_precision>;
  const model_t m(config());
  const std::string dir = "test_cuda_data_parallel_ckpt";
  std::filesystem::create_directories(dir);
  for (const std::size_t zero : {std::size_t{0}, std::size_t{1}}) {
    const std::string path = dir + "/run-zero" + std::to_string(zero) + ".ckpt";
    const std::vector<run> whole = data_parallel(m, zero);
    const std::vector<run> resumed = data_parallel(m, zero, steps / 2, path);
    for (std::size_t r = 0; r < ranks; ++r) {
      CHECK(same_bits(resumed[r].losses, whole[r].losses));
      CHECK(resumed[r].weights == whole[r].weights);
    }
    if (zero == 1) {
      // One shard file per rank beside the manifest.
      std::size_t shards = 0;
      for (const auto& e : std::filesystem::directory_iterator(dir))
        if (e.path().filename().string().find(".rank-") != std::string::npos) ++shards;
      CHECK(shards == ranks);
    }
  }
  std::filesystem::remove_all(dir);
}

void refusals() {
  using model_t = hybrid<mb::fp32_precision>;
  const model_t m(config());
  struct refusal {
    std::size_t zero;
    bool overlap;
    const char* argument;
  };
  for (const refusal& f : {refusal{2, false, "options.zero"}, refusal{0, true, "options.overlap"},
                           refusal{1, true, "options.overlap"}}) {
    // The checks come before any collective: every rank refuses on its own.
    std::vector<std::string> named(ranks);
    std::vector<std::thread> threads;
    board data2(ranks), control2(ranks);
    for (std::size_t rank = 0; rank < ranks; ++rank) {
      threads.emplace_back([&, rank] {
        board_rank comm(data2, control2, rank);
        mb::cuda_executor ex;
        device_budget alloc(budget_bytes);
        try {
          mb::trainer<model_t, device_budget, mb::null_monitor, board_rank> t(
              m, effective, plan_for(m, effective.batch / ranks, 0), alloc, ex, options(f.zero, f.overlap),
              mb::null_monitor{}, comm);
        } catch (const mb::invalid_argument& e) {
          named[rank] = e.argument();
        } catch (const std::exception& e) {
          named[rank] = e.what();
        }
        // Had one rank not refused, it would wait in the start's agreement: let it go on (and fail).
        data2.sync.arrive_and_drop();
        control2.sync.arrive_and_drop();
      });
    }
    for (std::thread& th : threads) th.join();
    for (std::size_t r = 0; r < ranks; ++r) CHECK(named[r] == f.argument);
  }
}

}  // namespace

int main() {
  static const mbt::test_case cases[] = {
      {"device data parallel, 2 ranks: fp32 ZeRO-1 == ZeRO-0, one process within 1e-5, peak = predicted", fp32_ranks},
      {"device data parallel, 2 ranks: bf16 ZeRO-1 == ZeRO-0, peak = predicted", bf16_ranks},
      {"device data parallel, 2 ranks: ZeRO-0/1 checkpoints resume the uninterrupted run", sharded_checkpoint},
      {"device data parallel, 2 ranks: ZeRO-2 and overlap refused", refusals},
  };
  return mbt::run_suite("test_cuda_data_parallel", cases);
}
