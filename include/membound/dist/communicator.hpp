// Communicators: how data-parallel ranks exchange gradients and parameters. A communicator is a
// policy object the trainer is given (like its allocator): `local_communicator` is one process,
// `mpi_communicator` (membound/mpi.hpp, optional: needs MPI) is N processes over MPI.
//
//   membound::local_communicator comm;                        // world size 1
//   std::size_t ws = comm.reduce_scatter_workspace_bytes<float>(n);
//   comm.reduce_scatter_sum(grad, n, my_shard, workspace, ws); // my_shard: shard_of(n) elements
//   comm.all_gather(my_params, params, n);
//   // ZeRO-1's gradient exchange: rank r gets the sum of every rank's in[blocks[r]], in place.
//   comm.reduce_scatter_blocks_sum(grad, blocks, grad + blocks[comm.rank()].begin, ws2, ws2_bytes);
//
// Sums are membound's own, never MPI's: every rank receives its shard from each rank and adds
// them in rank order 0, 1, ..., N − 1, so the result does not depend on the MPI library's
// algorithm, and equals, bit for bit, one process that accumulates the N contributions into one
// buffer in that order (what gradient accumulation over micro-batches does). The network carries
// the same 2·(N − 1)/N bytes per element as a ring all-reduce (all-to-all, then all-gather); the
// price is a receive buffer of N shards, which the caller provides (CUB-style: ask its size,
// then pass it), so the planner can count it.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "membound/core/argument_checks.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/shard.hpp"

MEMBOUND_NAMESPACE_BEGIN

// A collective failed (a rank died, the transport broke). Every rank that sees it must stop: the
// others are blocked in, or will block in, the same collective.
class communication_error : public backend_error {
 public:
  communication_error(std::string call, int code, std::string detail)
      : backend_error(std::move(call), code, std::move(detail),
                      "A rank or the transport failed; every rank stops here. Resume from the "
                      "last checkpoint once all ranks are healthy") {}
};

// What a communicator has sent: the bytes this rank handed to other ranks, counted as the direct
// algorithm sends them (each shard once to each rank that needs it), so they compare with the
// textbook formulas (an all-reduce of n bytes: 2·(N − 1)/N·n) whatever the library does inside.
struct communication_stats {
  std::uint64_t bytes_sent = 0;
  std::uint64_t collectives = 0;
};

// The element types whose sums a communicator computes in their own type.
template <typename T>
concept reducible = std::same_as<T, float> || std::same_as<T, double>;
// Those, and 16-bit storage (bf16, fp16) as the CPU communicators sum it: 16 bits on the wire,
// every rank's value widened to fp32, added in rank order and rounded once (ordered_sum).
template <typename T>
concept summable = reducible<T> || std::same_as<T, bf16> || std::same_as<T, fp16>;

// What the trainer needs of a communicator. Blocking collectives; all ranks call them in the
// same order with the same n. Buffers are the caller's; none may overlap another argument.
template <typename C>
concept communicator = requires(C& c, const C& cc, float* f, const float* cf, std::size_t n,
                                void* ws) {
  { cc.rank() } -> std::convertible_to<std::size_t>;
  { cc.size() } -> std::convertible_to<std::size_t>;
  { cc.name() } -> std::convertible_to<const char*>;
  { cc.template reduce_scatter_workspace_bytes<float>(n) } -> std::convertible_to<std::size_t>;
  { cc.template all_reduce_workspace_bytes<float>(n) } -> std::convertible_to<std::size_t>;
  { cc.template reduce_scatter_blocks_workspace_bytes<float>(n) } -> std::convertible_to<std::size_t>;
  c.reduce_scatter_sum(cf, n, f, ws, n);
  c.reduce_scatter_blocks_sum(cf, static_cast<const shard_range*>(nullptr), f, ws, n);
  c.all_gather(cf, f, n);
  c.all_reduce_sum(f, n, ws, n);
  c.broadcast(f, n, n);
  c.barrier();
};

// A communicator whose collectives move the trainer's data (gradients and weights, in the
// backend's memory: device memory for nccl_communicator) and which hands the small host values
// ranks agree on (flags, plan votes, the loss, the gradient norm's parts) to control(), a host
// communicator over the same ranks, called in the same order on every rank. A plain
// communicator does both itself.
template <typename C>
concept split_communicator = communicator<C> && requires(C& c) {
  typename C::control_type;
  requires communicator<typename C::control_type>;
  { c.control() } -> std::same_as<typename C::control_type&>;
};
// A split communicator whose data collectives move device memory (nccl_communicator), which a
// trainer on a device needs; it says so with `static constexpr bool moves_device_memory = true`.
template <typename C>
concept device_communicator = split_communicator<C> && requires { requires C::moves_device_memory; };

// A communicator that can also start reduce_scatter_blocks_sum and complete it later (ZeRO-2's
// overlapped gradient exchange): the handle's test() lets the exchange move on, wait() completes
// it and writes the sum. Buffers stay untouched until wait() returns.
template <typename P>
concept exchange_handle = requires(P& p) {
  { p.test() } -> std::convertible_to<bool>;
  p.wait();
};
template <typename C>
concept overlapping_communicator =
    communicator<C> && requires(C& c, const float* cf, float* f, void* ws, std::size_t n) {
      { c.start_reduce_scatter_blocks_sum(cf, static_cast<const shard_range*>(nullptr), f, ws, n) } -> exchange_handle;
    };

// A communicator that can also start all_reduce_sum and complete it later (ZeRO-0's overlapped
// gradient exchange): the same handle contract; data and ws stay untouched (data is written) until
// wait() returns.
template <typename C>
concept overlapping_all_reduce_communicator =
    communicator<C> && requires(C& c, float* f, void* ws, std::size_t n) {
      { c.start_all_reduce_sum(f, n, ws, n) } -> exchange_handle;
    };

// A communicator that can also gather blocks of uneven size in place (ZeRO-3's gather of one
// block's weights from the ranks' parameter shards): all_gather_blocks(data, blocks), where rank r
// holds its blocks[r] of data before and every rank holds every block after.
template <typename C>
concept gathering_communicator = communicator<C> && requires(C& c, float* f) {
  c.all_gather_blocks(f, static_cast<const shard_range*>(nullptr));
};

// One that can also start that gather and complete it later (ZeRO-3's prefetch of the next
// block): the same handle contract as the reduce-scatter's; data stays untouched until wait().
template <typename C>
concept prefetching_communicator = gathering_communicator<C> && requires(C& c, float* f) {
  { c.start_all_gather_blocks(f, static_cast<const shard_range*>(nullptr)) } -> exchange_handle;
};

namespace detail {
// out = Σ_r parts[r·stride .. + count] in rank order: the one summation every communicator uses.
// 16-bit parts are summed in fp32 and rounded once, so the sum of N ranks' gradients rounds as
// one value does (the same per-element order, rank 0 first).
template <summable T>
void ordered_sum(const T* parts, std::size_t ranks, std::size_t stride, std::size_t count, T* out) {
  if constexpr (reducible<T>) {
    std::memcpy(out, parts, count * sizeof(T));
    for (std::size_t r = 1; r < ranks; ++r) {
      const T* p = parts + r * stride;
      for (std::size_t i = 0; i < count; ++i) out[i] += p[i];
    }
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      float acc = to_accum<float>(parts[i]);
      for (std::size_t r = 1; r < ranks; ++r) acc += to_accum<float>(parts[r * stride + i]);
      out[i] = from_accum<T>(acc);
    }
  }
}
inline void check_root(std::size_t root, std::size_t ranks) {
  if (root >= ranks) {
    throw invalid_argument("root", "a rank below the world size " + std::to_string(ranks),
                           std::to_string(root), "Broadcast from a rank that exists, e.g. 0");
  }
}
inline void check_workspace(const void* ws, std::size_t bytes, std::size_t need) {
  need_space(ws, bytes, need, "workspace");
}
}  // namespace detail

// mpi_communicator's workspace sizes for rank `me` of a world of `ranks`, without MPI
// (mpi_communicator's own sizes are these): enough to plan a rank of a world this process is not
// in, e.g. fit a ZeRO-3 run over 4 ranks before launching it:
//   fo.gradients = gradient_exchange_of<bf16>(mpi_world{4, 0}, 3, false);
struct mpi_world {
  std::size_t ranks = 1, me = 0;
  std::size_t rank() const noexcept { return me; }
  std::size_t size() const noexcept { return ranks; }
  const char* name() const noexcept { return "mpi"; }
  // The N received shards of a reduce-scatter, then the counts of a non-blocking one (4·N ints).
  template <summable T>
  std::size_t reduce_scatter_workspace_bytes(std::size_t n) const noexcept {
    return ranks * max_shard(n, ranks) * sizeof(T) + 4 * ranks * sizeof(int);
  }
  // The N received blocks (of at most max_block elements each) of reduce_scatter_blocks_sum,
  // then its 4·N int counts.
  template <summable T>
  std::size_t reduce_scatter_blocks_workspace_bytes(std::size_t max_block) const noexcept {
    return ranks * max_block * sizeof(T) + 4 * ranks * sizeof(int);
  }
  // A reduce-scatter's workspace, then this rank's summed shard.
  template <summable T>
  std::size_t all_reduce_workspace_bytes(std::size_t n) const noexcept {
    return reduce_scatter_workspace_bytes<T>(n) + max_shard(n, ranks) * sizeof(T);
  }
};

// One process: every collective is a copy (or nothing), and needs no workspace.
class local_communicator {
 public:
  std::size_t rank() const noexcept { return 0; }
  std::size_t size() const noexcept { return 1; }
  const char* name() const noexcept { return "local"; }

  template <summable T>
  std::size_t reduce_scatter_workspace_bytes(std::size_t) const noexcept {
    return 0;
  }
  template <summable T>
  std::size_t all_reduce_workspace_bytes(std::size_t) const noexcept {
    return 0;
  }
  template <summable T>
  std::size_t reduce_scatter_blocks_workspace_bytes(std::size_t) const noexcept {
    return 0;
  }
  template <summable T>
  void reduce_scatter_sum(const T* in, std::size_t n, T* out, void*, std::size_t) {
    if (n != 0 && in != out) std::memcpy(out, in, n * sizeof(T));
  }
  template <summable T>
  void reduce_scatter_blocks_sum(const T* in, const shard_range* blocks, T* out, void*, std::size_t) {
    const shard_range b = blocks[0];
    if (b.size() != 0 && in + b.begin != out) std::memcpy(out, in + b.begin, b.size() * sizeof(T));
  }
  template <typename T>
  void all_gather(const T* shard, T* out, std::size_t n) {
    static_assert(std::is_trivially_copyable_v<T>, "membound: all_gather copies bytes: T must be trivially copyable");
    if (n != 0 && shard != out) std::memcpy(out, shard, n * sizeof(T));
  }
  // One block, already in place.
  template <typename T>
  void all_gather_blocks(T*, const shard_range*) {
    static_assert(std::is_trivially_copyable_v<T>, "membound: all_gather_blocks copies bytes: T must be trivially copyable");
  }
  template <summable T>
  void all_reduce_sum(T*, std::size_t, void*, std::size_t) {}
  template <typename T>
  void broadcast(T*, std::size_t, std::size_t root) {
    detail::check_root(root, 1);
  }
  void barrier() {}
  communication_stats stats() const noexcept { return {}; }  // one rank sends nothing
};
static_assert(communicator<local_communicator>);
static_assert(gathering_communicator<local_communicator>);

MEMBOUND_NAMESPACE_END
