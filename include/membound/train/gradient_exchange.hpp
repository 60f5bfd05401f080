// The trainer's gradient exchange over ranks, one part of the trainer (train/trainer.hpp composes
// it): which gradients and optimizer state a rank keeps (ZeRO-0, 1, 2), how a micro-batch's
// gradients reach the ranks (after the backward in buckets, or during it block by block: ZeRO-2's
// buckets, ZeRO-0/1 overlapped), the sum of the loss, and the global norm of the summed gradient.
//
// Every sum is over ranks in rank order, so each stage gives ZeRO-0's bits (ZeRO-2 with more than
// one micro-batch sums the micro-batches' rank-order sums). Every byte it takes beyond the
// gradients comes from the trainer's allocator as workspace or gradient buckets, in the sizes the
// planner counts (gradient_shards, gradient_exchange_bytes).
//
// It owns no gradient: the trainer allocates them (grad_bytes()) and passes them in. With one
// rank nothing is exchanged and the gradients are the whole model's.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/core/argument_checks.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/dist/communicator.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/stream.hpp"
#include "membound/model/glue.hpp"
#include "membound/model/planner.hpp"

MEMBOUND_NAMESPACE_BEGIN

// ZeRO-2's plan_options::gradients for a rank of `comm` (storage S): its rank, the world size and
// the communicator's reduce-scatter workspace (affine in the block size; anything else is refused).
// Off (ranks 0) for a world of one. (ZeRO-3's: gradient_exchange_of(comm, 3, overlap).)
//   po.optimizer_elements = shard_of(n, comm.size(), comm.rank()).size();
//   po.gradients = gradient_shards_of<float>(comm);
template <typename S, typename Communicator>
gradient_shards gradient_shards_of(const Communicator& comm, bool overlap = false) {
  if constexpr (!summable<S>) {
    return {};  // the trainer refuses storage its communicator cannot sum over more than one rank
  } else {
    if (comm.size() <= 1) return {};
    const std::size_t w0 = comm.template reduce_scatter_blocks_workspace_bytes<S>(0);
    const std::size_t w1 = comm.template reduce_scatter_blocks_workspace_bytes<S>(1);
    const std::size_t w1000 = comm.template reduce_scatter_blocks_workspace_bytes<S>(1000);
    if (w1 < w0 || w1000 != w0 + 1000 * (w1 - w0)) {
      throw invalid_argument("communicator", "a reduce_scatter_blocks_workspace_bytes affine in the block size",
                             std::string(comm.name()) + " gives " + std::to_string(w0) + ", " + std::to_string(w1) + ", " +
                                 std::to_string(w1000) + " bytes for 0, 1, 1000 elements",
                             "ZeRO-2's planner counts a + b·k bytes per exchange: use zero = 1 with this communicator");
    }
    return {comm.size(), comm.rank(), w1 - w0, w0, overlap};
  }
}

// plan_options::gradients for a trainer of ZeRO stage `zero` (trainer_options::zero, overlap) over
// `comm` (storage S): ZeRO-2's gradient_shards_of (ZeRO-3: the same, its weights sharded too); ZeRO-0/1 overlapped, the exchange the last
// micro-batch's backward carries (gradient_shards::whole_overlapped: the communicator's all-reduce
// workspace, affine in the largest shard of the range, or its reduce_scatter_blocks workspace);
// otherwise off (ZeRO-0/1 exchange inside the step's peak, after the backward).
//   po.gradients = gradient_exchange_of<float>(comm, options.zero, options.overlap);
template <typename S, typename Communicator>
gradient_shards gradient_exchange_of(const Communicator& comm, std::size_t zero, bool overlap) {
  if (zero >= 2) {
    gradient_shards g = gradient_shards_of<S>(comm, overlap);
    if (g.ranks > 1) g.zero = zero;
    return g;
  }
  if constexpr (!summable<S>) {
    return {};
  } else {
    const std::size_t N = comm.size();
    if (!overlap || N <= 1) return {};
    const auto ws = [&](std::size_t most) {
      return zero == 0 ? comm.template all_reduce_workspace_bytes<S>(most * N)
                       : comm.template reduce_scatter_blocks_workspace_bytes<S>(most);
    };
    const std::size_t w0 = ws(0), w1 = ws(1), w1000 = ws(1000);
    if (w1 < w0 || w1000 != w0 + 1000 * (w1 - w0)) {
      throw invalid_argument("communicator",
                             zero == 0 ? "an all_reduce_workspace_bytes affine in the largest shard"
                                       : "a reduce_scatter_blocks_workspace_bytes affine in the block size",
                             std::string(comm.name()) + " gives " + std::to_string(w0) + ", " + std::to_string(w1) +
                                 ", " + std::to_string(w1000) + " bytes for shards of 0, 1, 1000 elements",
                             "The overlapped exchange's planner counts a + b·k bytes per block: set overlap = false");
    }
    gradient_shards g{N, comm.rank(), w1 - w0, w0, true};
    g.zero = zero;
    return g;
  }
}

namespace detail {
// The handle of a started reduce-scatter (ZeRO-2's overlap); a stand-in for communicators that
// cannot start one (the trainer refuses overlap with them).
template <typename C>
struct pending_exchange_of {
  struct type {
    bool test() noexcept { return true; }
    void wait() noexcept {}
  };
};
template <overlapping_communicator C>
struct pending_exchange_of<C> {
  using type = decltype(std::declval<C&>().start_reduce_scatter_blocks_sum(
      std::declval<const float*>(), std::declval<const shard_range*>(), std::declval<float*>(), std::declval<void*>(),
      std::size_t{}));
};

// The handle of a started all-reduce (ZeRO-0's overlap); a stand-in as above.
template <typename C>
struct pending_all_reduce_of {
  struct type {
    bool test() noexcept { return true; }
    void wait() noexcept {}
  };
};
template <overlapping_all_reduce_communicator C>
struct pending_all_reduce_of<C> {
  using type = decltype(std::declval<C&>().start_all_reduce_sum(std::declval<float*>(), std::size_t{},
                                                                std::declval<void*>(), std::size_t{}));
};

// The handle of a started all_gather_blocks (ZeRO-3's prefetch); a stand-in as above.
template <typename C>
struct pending_gather_of {
  struct type {
    bool test() noexcept { return true; }
    void wait() noexcept {}
  };
};
template <prefetching_communicator C>
struct pending_gather_of<C> {
  using type = decltype(std::declval<C&>().start_all_gather_blocks(std::declval<float*>(),
                                                                    std::declval<const shard_range*>()));
};

// The communicator of the host values every rank agrees on (flags, votes, plans, the loss, the
// norm's parts): a split communicator's control(), else the communicator itself. A device
// communicator's collectives return before their data moved, so one whose watchdog aborted a
// collective (nccl_communicator with a timeout) says so here, before a host value built on its
// data is exchanged (and before the optimizer step that would use it).
template <typename Communicator>
auto& control_of(Communicator& comm) {
  if constexpr (requires { comm.check(); }) comm.check();
  if constexpr (split_communicator<Communicator>) return comm.control();
  else return comm;
}
}  // namespace detail

template <typename Model, typename Allocator, typename Communicator>
class gradient_exchange {
 public:
  using S = typename Model::storage_type;
  using executor = typename Model::executor;
  // A started gather of ZeRO-3's prefetch (a stand-in where the communicator cannot start one).
  using pending_gather = typename detail::pending_gather_of<Communicator>::type;

  // zero: the ZeRO stage, 0 to 3; overlap: the exchanges in the backward (trainer_options's;
  // the trainer checks them against the world and the communicator first).
  gradient_exchange(const Model& m, Allocator& alloc, executor& ex, Communicator& comm, std::size_t zero, bool overlap)
      : m_(m), alloc_(alloc, stream_of(ex)), ex_(ex), comm_(comm), n_(m.parameter_elements()), zero_(zero), overlap_(overlap) {
    if (zero > 3) {
      throw invalid_argument("zero", "0, 1, 2 or 3 (the ZeRO stage)", std::to_string(zero),
                             "Use 1 to shard the optimizer state over the ranks, 2 to shard the gradients too, "
                             "3 the weights too, 0 to keep all whole");
    }
    shard_ = sharded() ? shard_of(n_, world(), comm_.rank()) : shard_range{0, n_};
    if (world() > 1) {
      blocks_.resize(world());
      norm_parts_.resize(world());
    }
  }
  gradient_exchange(const gradient_exchange&) = delete;
  gradient_exchange& operator=(const gradient_exchange&) = delete;

  // The loss's exchange workspace (a few dozen bytes), made once, before step 1.
  void reserve_loss_workspace() {
    if constexpr (summable<S>) loss_ws_.resize(detail::control_of(comm_).template all_reduce_workspace_bytes<double>(1));
  }

  std::size_t world() const noexcept { return comm_.size(); }
  // ZeRO-1 and 2: this rank keeps the optimizer state of its shard only.
  bool sharded() const noexcept { return zero_ >= 1 && world() > 1; }
  // ZeRO-2 (and 3): and the gradients of its shard only.
  bool zero2() const noexcept { return zero_ >= 2 && world() > 1; }
  // ZeRO-3: and the weights of its shard only.
  bool zero3() const noexcept { return zero_ == 3 && world() > 1; }
  // The weights this rank keeps: all of them, or under ZeRO-3 its shard's.
  std::size_t weight_elements() const noexcept { return zero3() ? shard_.size() : n_; }
  std::size_t weight_bytes() const noexcept { return weight_elements() * sizeof(S); }
  // The weights of this rank's optimizer shard, in the weights w it keeps.
  S* shard_weights(S* w) const noexcept { return zero3() ? w : w + shard_.begin; }
  // ZeRO-0/1 overlapped: the last micro-batch's blocks start their exchanges in the backward.
  bool whole_overlapped() const noexcept { return overlap_ && zero_ < 2 && world() > 1; }
  // The parameters whose optimizer state this rank holds (all of them unless sharded).
  shard_range shard() const noexcept { return shard_; }
  // The gradients this rank keeps: all of them, or under ZeRO-2 its shard's.
  std::size_t grad_elements() const noexcept { return zero2() ? shard_.size() : n_; }
  std::size_t grad_bytes() const noexcept { return grad_elements() * sizeof(S); }
  // The summed gradient of this rank's optimizer shard, in the gradients g.
  S* shard_gradients(S* g) const noexcept { return zero2() ? g : g + shard_.begin; }
  // What plan_options::gradients says for this rank.
  gradient_shards sharding() const {
    return world() > 1 ? gradient_exchange_of<S>(comm_, zero_, overlap_) : gradient_shards{};
  }
  // What plan_options / fit_options say about this rank's optimizer state.
  std::size_t optimizer_elements() const noexcept { return sharded() ? shard_.size() : 0; }

  // The most bytes one exchange of a step takes (rank_memory::exchange): with the exchanges in the
  // backward, the largest range's (accumulation: the plan's micro-batches); otherwise the
  // blocking exchange's bucket under `headroom` (0 when none fits: the first step says so).
  std::size_t largest_exchange_bytes(std::size_t accumulation, std::size_t headroom) const {
    std::size_t most = 0;
    if (zero2() || whole_overlapped()) {
      most = std::max(range_exchange_bytes(m_.embedding_parameters(), accumulation),
                      range_exchange_bytes(m_.head_parameters(), accumulation));
      for (std::size_t i = 0; i < m_.depth(); ++i) {
        most = std::max(most, range_exchange_bytes(m_.block_parameters(i), accumulation));
      }
    } else if (world() > 1) {
      try {
        most = exchange_workspace_bytes(exchange_bucket(headroom));
      } catch (const invalid_argument&) {
        most = 0;
      }
    }
    return most;
  }

  // After the step's micro-batches: the sum over ranks, in rank order, of the gradients g (in
  // place; nothing left to do where the backward exchanged them) and of the loss. The blocking
  // exchange goes in buckets whose workspace fits `headroom`, the bytes between the step's
  // predicted peak and the trainer's own: every activation is gone by now, so the exchange never
  // raises the peak the plan predicted.
  double exchange(S* g, double loss, std::size_t headroom, double* counted = nullptr) {
    detail::need_pointer(g, "g");
    if constexpr (summable<S>) {
      if (zero2() || whole_overlapped()) {
        // Reduce-scattered (all-reduced) during the backward already.
      } else if (sharded()) {
        exchange_shards(g, headroom);
      } else {
        exchange_all(g, headroom);
      }
      // The loss, then the counted targets when given (summed over ranks into *counted): one
      // double each, through a buffer made once before step 1 (a few dozen bytes).
      detail::control_of(comm_).all_reduce_sum(&loss, 1, loss_ws_.data(), loss_ws_.size());
      if (counted != nullptr) detail::control_of(comm_).all_reduce_sum(counted, 1, loss_ws_.data(), loss_ws_.size());
      return loss;
    } else {
      return loss;  // the trainer refuses more than one rank
    }
  }

  // ---- ZeRO-2 ------------------------------------------------------------------------------------
  // What this rank keeps of a micro-batch's gradients, and when: its shard (g, between steps
  // too); in each block's backward, that block's gradients (a bucket allocated after the block's
  // δ and freed once reduce-scattered into the ranks' shards at the end of its backward); for the
  // whole micro-batch, the embedding's and head's (one bucket, reduce-scattered after the
  // micro-batch). The first micro-batch of a step writes the sums into the shard, the others add
  // theirs: so with one micro-batch per rank the shard holds ZeRO-0's sum, bit for bit, and with
  // more it is a sum of the micro-batches' rank-order sums (another order than ZeRO-0's).
  // Overlapped: a block's reduce-scatter is started at the end of its backward and completed at
  // the end of the next block's (the last block's after the micro-batch's backward), its bucket
  // and workspace kept until then; the next block's begin_block polls it, since MPI moves a
  // non-blocking collective on only inside MPI calls. One exchange is in flight at a time and
  // each is summed as the blocking path sums it, so the results are its bits.
  //
  // run(router) runs the micro-batch's forward and backward with the router (the model's
  // forward_backward_routed) and returns its loss.
  template <typename Run>
  double zero2_micro_batch(S* g, bool first, std::size_t accumulation, Run&& run) {
    detail::need_pointer(g, "g");
    zero2_router router(*this, g, first, accumulation);
    router.held = static_cast<S*>(alloc_.allocate(held_bytes(), default_alignment, memory_tag::gradients));
    std::memset(static_cast<void*>(router.held), 0, held_bytes());
    const double loss = run(router);
    router.finish();
    const shard_range e = m_.embedding_parameters();
    reduce_scatter_range(g, router.held, e, first, accumulation);
    reduce_scatter_range(g, router.held + e.size(), m_.head_parameters(), first, accumulation);
    return loss;
  }

  // ---- ZeRO-3 ------------------------------------------------------------------------------------
  // The weights of a micro-batch or an evaluation under ZeRO-3 (a weight source of the model's
  // forward_backward_routed, loss and next_token_logits): one buffer of weight_gather_bytes from
  // the trainer's allocator, made at construction (before the micro-batch's own bytes, as the
  // planner counts it) and given back at destruction. It holds weight units (Model::
  // unit_parameters: a block, the embedding, the head) in one slot, or two with overlap; the
  // two slots start at the buffer's two ends. use(u, next) makes unit u's weights present
  // (completing its prefetch, or gathering it into the slot not used last, unless a slot holds
  // it: a block's forward and its backward, or its recompute, read the same bits, since the
  // weights change only in the optimizer step); with two slots it then starts the gather of
  // `next` into the other one, non-blocking (prefetching_communicator), unless a slot holds it:
  // it runs while unit u computes. So the embedding's table is present for the lookup and the
  // head's for the loss, not in between. A gather is every rank's part of the unit (its shard's
  // overlap with it) copied into place, then one all_gather_blocks; a unit that some rank meets
  // in two pieces (a tied head's table and norm, on a rank holding every block) is gathered part
  // by part, blocking.
  class gathered_weights {
   public:
    // shard: the weights this rank keeps (weight_elements()).
    gathered_weights(gradient_exchange& t, const S* shard) : t_(t), shard_w_(shard) {
      slots_n_ = t.overlap_ ? 2 : 1;  // the trainer refuses overlap without a prefetching communicator
      bytes_ = weight_gather_bytes(t.m_, slots_n_ == 2);
      buf_ = static_cast<S*>(t.alloc_.allocate(bytes_, default_alignment, memory_tag::weights));
    }
    gathered_weights(const gathered_weights&) = delete;
    gathered_weights& operator=(const gathered_weights&) = delete;
    ~gathered_weights() {
      flight_ = pending_gather{};  // waits for a prefetch still in flight before its slot goes
      t_.alloc_.deallocate(buf_, bytes_, default_alignment, memory_tag::weights);
    }
    const S* at(std::size_t offset) const noexcept {
      const slot& k = slots_[current_];
      const shard_range p = k.parts[0];
      if (offset >= p.begin && offset < p.end) return k.base + (offset - p.begin);
      return k.base + p.size() + (offset - k.parts[1].begin);
    }
    void use(std::size_t u, std::size_t next) {
      if (flight_slot_ < 2) {
        // The prefetch of u (the op order names the next unit) completes here. The model's order
        // guarantees it is u: another unit's would be overwritten below, outside the planner's pairs.
        flight_.wait();
        slots_[flight_slot_].unit = flight_unit_;
        flight_slot_ = 2;
      }
      std::size_t k = holding(u);
      if (k == 2) {
        k = slots_n_ == 1 ? 0 : 1 - current_;  // the slot not used last
        place(k, u);
        gather(slots_[k]);
        slots_[k].unit = u;
      }
      current_ = k;
      if constexpr (prefetching_communicator<Communicator>) {
        if (slots_n_ == 2 && next != Model::no_unit && holding(next) == 2) {
          const std::size_t o = 1 - k;
          place(o, next);
          copy_mine(slots_[o]);
          if (unit_blocks(slots_[o])) {
            flight_ = t_.comm_.start_all_gather_blocks(slots_[o].base, t_.blocks_.data());
            (void)flight_.test();  // MPI moves a started collective on only inside its calls: a first push
            flight_slot_ = o;
            flight_unit_ = next;
          }  // else: gathered part by part when it is used
        }
      }
    }

   private:
    struct slot {
      S* base = nullptr;
      std::array<shard_range, 2> parts{};  // the unit's parts, laid out one after the other from base
      std::size_t unit = Model::no_unit;   // no_unit: nothing whole
    };
    std::size_t holding(std::size_t u) const noexcept {
      for (std::size_t k = 0; k < slots_n_; ++k)
        if (slots_[k].unit == u) return k;
      return 2;
    }
    // Slot k takes unit u (holding nothing whole until its gather completes): slot 0 from the
    // buffer's start, slot 1 ending at its end.
    void place(std::size_t k, std::size_t u) {
      slot& s = slots_[k];
      s.unit = Model::no_unit;
      s.parts = t_.m_.unit_parameters(u);
      const std::size_t n = s.parts[0].size() + s.parts[1].size();
      s.base = k == 0 ? buf_ : buf_ + (bytes_ / sizeof(S) - n);
    }
    // Copies this rank's part of the slot's unit into place.
    void copy_mine(const slot& s) {
      std::size_t at = 0;
      for (const shard_range p : s.parts) {
        const shard_range mine = overlap(t_.shard_, p.begin, p.end);
        if (mine.size() != 0) {
          std::memcpy(static_cast<void*>(s.base + at + (mine.begin - p.begin)),
                      static_cast<const void*>(shard_w_ + (mine.begin - t_.shard_.begin)), mine.size() * sizeof(S));
        }
        at += p.size();
      }
    }
    // Fills t_.blocks_ with every rank's part of the slot's unit in its layout; false when a rank's
    // part is two pieces there.
    bool unit_blocks(const slot& s) {
      const shard_range p0 = s.parts[0], p1 = s.parts[1];
      const std::size_t N = t_.world();
      for (std::size_t r = 0; r < N; ++r) {
        const shard_range sh = shard_of(t_.n_, N, r);
        const shard_range o0 = overlap(sh, p0.begin, p0.end), o1 = overlap(sh, p1.begin, p1.end);
        const shard_range a0{o0.begin - p0.begin, o0.end - p0.begin};
        const shard_range a1{p0.size() + (o1.begin - p1.begin), p0.size() + (o1.end - p1.begin)};
        if (o1.size() == 0) {
          t_.blocks_[r] = a0;
        } else if (o0.size() == 0) {
          t_.blocks_[r] = a1;
        } else if (a0.end == a1.begin) {
          t_.blocks_[r] = {a0.begin, a1.end};
        } else {
          return false;
        }
      }
      return true;
    }
    void gather(const slot& s) {
      if constexpr (gathering_communicator<Communicator>) {
        copy_mine(s);
        if (unit_blocks(s)) {
          t_.comm_.all_gather_blocks(s.base, t_.blocks_.data());
          return;
        }
        for (std::size_t i = 0, at = 0; i < 2; at += s.parts[i].size(), ++i) {
          if (s.parts[i].size() == 0) continue;
          (void)t_.range_blocks(s.parts[i]);
          t_.comm_.all_gather_blocks(s.base + at, t_.blocks_.data());
        }
      } else {
        (void)s;  // the trainer refuses ZeRO-3 over a communicator without all_gather_blocks
      }
    }
    gradient_exchange& t_;
    const S* shard_w_;
    std::size_t bytes_ = 0;
    S* buf_ = nullptr;
    slot slots_[2];
    std::size_t slots_n_ = 1;
    std::size_t current_ = 1;  // the slot the current op reads (1: slot 0 is used first)
    pending_gather flight_{};                              // a prefetch in flight
    std::size_t flight_slot_ = 2, flight_unit_ = 0;        // its slot (2: none) and unit
  };

  // ---- ZeRO-0/1 overlapped ------------------------------------------------------------------------
  // The step's last micro-batch (the earlier ones accumulate into g as the blocking path does):
  // once its block i's backward has ended, block i's gradients (block_parameters(i), contiguous)
  // are complete, so their exchange is started there, non-blocking, on g in place: ZeRO-0
  // all-reduces the range, ZeRO-1 reduce-scatters it into the ranks' optimizer shards (each
  // rank's part of the range, as exchange_shards' rounds carry them). It is completed as the next
  // block's backward ends (test() polled as that one begins, since MPI moves a non-blocking
  // collective on only inside MPI calls); the last block's after the backward, then the
  // embedding's and the head's ranges are exchanged, one after the other. One exchange in
  // flight at a time, holding only its workspace (the planner's carry). Every element's sum is
  // the rank-order sum the blocking path computes, so the bits are its bits.
  template <typename Run>
  double overlapped_micro_batch(S* g, std::size_t accumulation, Run&& run) {
    detail::need_pointer(g, "g");
    exchange_router router(*this, g, accumulation);
    const double loss = run(router);
    router.finish();
    for (const shard_range r : {m_.embedding_parameters(), m_.head_parameters()}) {
      router.start(r);
      router.finish();
    }
    return loss;
  }

  // The global norm of the summed gradient g. Over ranks: each shard's sum of squares added in
  // rank order (ZeRO-0 computes every shard's itself, ZeRO-1 its own and gathers the others'), so
  // both stages clip by the same bits. step_buffers and tokens: the device glue's partials.
  double gradient_norm(S* g, void* step_buffers, std::size_t tokens) {
    detail::need_pointer(g, "g");
    using glue = model_glue_of<typename Model::backend>;
    const std::size_t N = world();
    if (N == 1) {
      return glue::template gradient_norm<S>(ex_, g, n_, step_buffers, tokens);
    }
    const auto sum_squares = [&](const S* p, std::size_t count) {
      return glue::template sum_squares<S>(ex_, p, count, step_buffers, tokens, n_);
    };
    const std::size_t me = comm_.rank();
    if (sharded()) {
      norm_parts_[me] = sum_squares(shard_gradients(g), shard_.size());
      detail::control_of(comm_).all_gather(static_cast<const double*>(norm_parts_.data() + me), norm_parts_.data(), N);
    } else {
      for (std::size_t r = 0; r < N; ++r) {
        const shard_range s = shard_of(n_, N, r);
        norm_parts_[r] = sum_squares(g + s.begin, s.size());
      }
      // The reads above waited for the exchange: a device communicator whose watchdog ended it
      // says so here, before the optimizer step would use what arrived (ZeRO-1 asks in control_of).
      if constexpr (requires { comm_.check(); }) comm_.check();
    }
    double sum = 0;
    for (const double v : norm_parts_) sum += v;
    return std::sqrt(sum);
  }

 private:
  using pending_exchange = typename detail::pending_exchange_of<Communicator>::type;
  using pending_all_reduce = typename detail::pending_all_reduce_of<Communicator>::type;

  // ZeRO-2's router (see zero2_micro_batch): where each parameter's gradient goes during the
  // backward, and the block buckets' exchanges.
  struct zero2_router {
    gradient_exchange& t;
    S* g;
    bool first;
    std::size_t accumulation;
    S* held = nullptr;    // the embedding's and head's gradients
    S* bucket = nullptr;  // the current block's
    shard_range range{};
    // The exchange in flight (overlapped): its handle, bucket, workspace and destination.
    pending_exchange flight{};
    S* flight_bucket = nullptr;
    void* flight_ws = nullptr;
    std::size_t flight_bucket_bytes = 0, flight_ws_bytes = 0;
    S* flight_dst = nullptr;
    S* flight_out = nullptr;
    std::size_t flight_count = 0;
    zero2_router(gradient_exchange& tr, S* grads, bool f, std::size_t accum)
        : t(tr), g(grads), first(f), accumulation(accum) {}
    zero2_router(const zero2_router&) = delete;
    zero2_router& operator=(const zero2_router&) = delete;
    ~zero2_router() {
      flight = pending_exchange{};  // waits for an exchange still in flight before its buffers go
      release_flight();
      if (bucket != nullptr) t.alloc_.deallocate(bucket, range.size() * sizeof(S), default_alignment, memory_tag::gradients);
      if (held != nullptr) t.alloc_.deallocate(held, t.held_bytes(), default_alignment, memory_tag::gradients);
    }
    S* at(std::size_t offset) const noexcept {
      if (bucket != nullptr && offset >= range.begin && offset < range.end) return bucket + (offset - range.begin);
      const shard_range e = t.m_.embedding_parameters();
      if (offset < e.end) return held + offset;
      return held + e.size() + (offset - t.m_.head_parameters().begin);
    }
    void begin_block(std::size_t i) {
      const shard_range r = t.m_.block_parameters(i);
      bucket = static_cast<S*>(t.alloc_.allocate(r.size() * sizeof(S), default_alignment, memory_tag::gradients));
      range = r;
      std::memset(static_cast<void*>(bucket), 0, r.size() * sizeof(S));
      if (flight_bucket != nullptr) (void)flight.test();
    }
    void end_block(std::size_t) {
      if constexpr (overlapping_communicator<Communicator> && summable<S>) {
        if (t.overlap_) {
          finish();
          // The workspace first, then the bucket becomes the flight's: a throw leaves each owned once.
          flight_ws_bytes = t.range_exchange_bytes(range, accumulation);
          flight_ws = t.alloc_.allocate(flight_ws_bytes, default_alignment, memory_tag::workspace);
          flight_bucket = std::exchange(bucket, nullptr);
          flight_bucket_bytes = range.size() * sizeof(S);
          const auto x = t.prepare_range(g, range, flight_ws, first);
          flight_dst = x.dst;
          flight_out = x.out;
          flight_count = x.add ? x.count : 0;
          flight = t.comm_.start_reduce_scatter_blocks_sum(static_cast<const S*>(flight_bucket), t.blocks_.data(),
                                                           x.out, flight_ws, x.exchange_bytes);
          return;
        }
      }
      t.reduce_scatter_range(g, bucket, range, first, accumulation);
      t.alloc_.deallocate(bucket, range.size() * sizeof(S), default_alignment, memory_tag::gradients);
      bucket = nullptr;
    }
    // Completes the exchange in flight, adds its partial sum (after the first micro-batch) into
    // the shard and gives its workspace, then its bucket, back.
    void finish() {
      if (flight_bucket == nullptr) return;
      flight.wait();
      add_into(flight_dst, flight_out, flight_count);
      release_flight();
    }
    void release_flight() noexcept {
      if (flight_ws != nullptr) {
        t.alloc_.deallocate(std::exchange(flight_ws, nullptr), flight_ws_bytes, default_alignment, memory_tag::workspace);
      }
      if (flight_bucket != nullptr) {
        t.alloc_.deallocate(std::exchange(flight_bucket, nullptr), flight_bucket_bytes, default_alignment,
                            memory_tag::gradients);
      }
    }
  };

  // ZeRO-0/1 overlapped's router (see overlapped_micro_batch): the gradients stay in g.
  struct exchange_router {
    gradient_exchange& t;
    S* g;
    std::size_t accumulation;
    pending_exchange scatter{};   // ZeRO-1's reduce-scatter in flight
    pending_all_reduce reduce{};  // ZeRO-0's all-reduce in flight
    void* ws = nullptr;           // its workspace
    std::size_t ws_bytes = 0;
    exchange_router(gradient_exchange& tr, S* grads, std::size_t accum) : t(tr), g(grads), accumulation(accum) {}
    exchange_router(const exchange_router&) = delete;
    exchange_router& operator=(const exchange_router&) = delete;
    ~exchange_router() {
      scatter = pending_exchange{};  // waits for an exchange still in flight before its workspace goes
      reduce = pending_all_reduce{};
      release();
    }
    S* at(std::size_t offset) const noexcept { return g + offset; }
    void begin_block(std::size_t) {
      if (ws == nullptr) return;
      if (t.sharded()) {
        (void)scatter.test();
      } else {
        (void)reduce.test();
      }
    }
    void end_block(std::size_t i) {
      finish();
      start(t.m_.block_parameters(i));
    }
    // Takes the range's workspace and starts its exchange.
    void start(shard_range r) {
      ws_bytes = t.range_exchange_bytes(r, accumulation);
      ws = t.alloc_.allocate(ws_bytes, default_alignment, memory_tag::workspace);
      if constexpr (summable<S>) {
        if (t.sharded()) {
          if constexpr (overlapping_communicator<Communicator>) {
            const shard_range mine = t.range_blocks(r);
            scatter = t.comm_.start_reduce_scatter_blocks_sum(static_cast<const S*>(g + r.begin), t.blocks_.data(),
                                                              g + mine.begin, ws, ws_bytes);
          }
        } else {
          if constexpr (overlapping_all_reduce_communicator<Communicator>) {
            reduce = t.comm_.start_all_reduce_sum(g + r.begin, r.size(), ws, ws_bytes);
          }
        }
      }
    }
    // Completes the exchange in flight and gives its workspace back.
    void finish() {
      if (ws == nullptr) return;
      if (t.sharded()) {
        scatter.wait();
      } else {
        reduce.wait();
      }
      release();
    }
    void release() noexcept {
      if (ws != nullptr) t.alloc_.deallocate(std::exchange(ws, nullptr), ws_bytes, default_alignment, memory_tag::workspace);
    }
  };

  std::size_t held_bytes() const noexcept {
    return (m_.embedding_parameters().size() + m_.head_parameters().size()) * sizeof(S);
  }

  // The workspace of one range's reduce-scatter (and, with more than one micro-batch, the
  // partial sum it adds into the shard), as the planner counts it (gradient_shards).
  std::size_t range_exchange_bytes(shard_range r, std::size_t accumulation) const {
    return gradient_exchange_bytes(m_, sharding(), r, accumulation);
  }
  // Where one range's reduce-scatter writes: the shard (first micro-batch), or a partial sum in
  // the workspace after the exchange's own part, added to the shard once complete.
  struct range_exchange {
    S* dst = nullptr;                // this rank's shard elements of the range
    S* out = nullptr;                // where the exchange writes their sum
    std::size_t count = 0;           // how many
    std::size_t exchange_bytes = 0;  // the reduce-scatter's part of the workspace
    bool add = false;                // out is a partial sum to add into dst
  };
  // Fills blocks_ with every rank's part of r (relative to r.begin) and says where the sum goes.
  range_exchange prepare_range(S* g, shard_range r, void* ws, bool first) {
    const std::size_t N = world();
    std::size_t most = 0;
    for (std::size_t k = 0; k < N; ++k) {
      const shard_range o = overlap(shard_of(n_, N, k), r.begin, r.end);
      blocks_[k] = {o.begin - r.begin, o.end - r.begin};
      most = std::max(most, o.size());
    }
    const shard_range mine = overlap(shard_, r.begin, r.end);
    range_exchange x;
    x.dst = mine.size() == 0 ? g : g + (mine.begin - shard_.begin);
    x.count = mine.size();
    if constexpr (summable<S>) x.exchange_bytes = comm_.template reduce_scatter_blocks_workspace_bytes<S>(most);
    x.add = !first;
    x.out = first ? x.dst : reinterpret_cast<S*>(static_cast<std::byte*>(ws) + x.exchange_bytes);
    return x;
  }
  // dst += part, elementwise; 16-bit storage adds in fp32 and rounds once, as its accumulation does.
  static void add_into(S* dst, const S* part, std::size_t count) noexcept {
    using A = std::conditional_t<std::is_same_v<S, double>, double, float>;
    for (std::size_t i = 0; i < count; ++i) dst[i] = from_accum<S>(to_accum<A>(dst[i]) + to_accum<A>(part[i]));
  }
  // in: the gradients of the parameters [r.begin, r.end) of this rank's micro-batch. Every rank's
  // part of them summed over ranks in rank order into (first) or onto its shard of g.
  void reduce_scatter_range(S* g, const S* in, shard_range r, bool first, std::size_t accumulation) {
    if constexpr (summable<S>) {
      const std::size_t ws_bytes = range_exchange_bytes(r, accumulation);
      void* ws = alloc_.allocate(ws_bytes, default_alignment, memory_tag::workspace);
      try {
        const range_exchange x = prepare_range(g, r, ws, first);
        comm_.reduce_scatter_blocks_sum(in, blocks_.data(), x.out, ws, x.exchange_bytes);
        if (x.add) add_into(x.dst, x.out, x.count);
      } catch (...) {
        alloc_.deallocate(ws, ws_bytes, default_alignment, memory_tag::workspace);
        throw;
      }
      alloc_.deallocate(ws, ws_bytes, default_alignment, memory_tag::workspace);
    }
  }

  // Fills blocks_ with every rank's optimizer-shard part of r (relative to r.begin); returns this
  // rank's part (absolute).
  shard_range range_blocks(shard_range r) {
    const std::size_t N = world();
    for (std::size_t k = 0; k < N; ++k) {
      const shard_range o = overlap(shard_of(n_, N, k), r.begin, r.end);
      blocks_[k] = {o.begin - r.begin, o.end - r.begin};
    }
    return overlap(shard_, r.begin, r.end);
  }

  // ZeRO-1: each rank receives only the summed gradient of its optimizer shard, in place, in
  // rounds: round k carries the k-th bucket of every rank's shard. The sum for each element is
  // the all-reduce's (rank order), so the shard equals ZeRO-0's gradient there, bit for bit.
  void exchange_shards(S* g, std::size_t headroom) {
    const std::size_t N = world(), bucket = exchange_bucket(headroom);
    const std::size_t ws_bytes = comm_.template reduce_scatter_blocks_workspace_bytes<S>(bucket);
    void* ws = alloc_.allocate(ws_bytes, default_alignment, memory_tag::workspace);
    try {
      for (std::size_t at = 0; at < max_shard(n_, N); at += bucket) {
        for (std::size_t r = 0; r < N; ++r) {
          const shard_range s = shard_of(n_, N, r);
          blocks_[r] = {s.begin + std::min(at, s.size()), s.begin + std::min(at + bucket, s.size())};
        }
        comm_.reduce_scatter_blocks_sum(static_cast<const S*>(g), blocks_.data(), g + blocks_[comm_.rank()].begin, ws,
                                        ws_bytes);
      }
    } catch (...) {
      alloc_.deallocate(ws, ws_bytes, default_alignment, memory_tag::workspace);
      throw;
    }
    alloc_.deallocate(ws, ws_bytes, default_alignment, memory_tag::workspace);
  }

  void exchange_all(S* g, std::size_t headroom) {
    if constexpr (summable<S>) {
      const std::size_t bucket = exchange_bucket(headroom);
      const std::size_t ws_bytes = comm_.template all_reduce_workspace_bytes<S>(bucket);
      void* ws = alloc_.allocate(ws_bytes, default_alignment, memory_tag::workspace);
      try {
        for (std::size_t at = 0; at < n_; at += bucket) {
          comm_.all_reduce_sum(g + at, std::min(bucket, n_ - at), ws, ws_bytes);
        }
      } catch (...) {
        alloc_.deallocate(ws, ws_bytes, default_alignment, memory_tag::workspace);
        throw;
      }
      alloc_.deallocate(ws, ws_bytes, default_alignment, memory_tag::workspace);
    }
  }

  // The gradient exchange's workspace for `bucket` elements: an all-reduce's (ZeRO-0), or a
  // reduce-scatter of `bucket` elements of every rank's shard (ZeRO-1).
  std::size_t exchange_workspace_bytes(std::size_t bucket) const {
    if constexpr (summable<S>) {
      return sharded() ? comm_.template reduce_scatter_blocks_workspace_bytes<S>(bucket)
                       : comm_.template all_reduce_workspace_bytes<S>(bucket);
    } else {
      return 0;
    }
  }

  // The most gradient elements per exchange whose workspace fits `headroom` bytes (per rank's
  // shard under ZeRO-1).
  std::size_t exchange_bucket(std::size_t headroom) const {
    std::size_t lo = 0, hi = sharded() ? max_shard(n_, world()) : n_;
    while (lo < hi) {  // the largest k in [0, hi] with workspace(k) <= headroom
      const std::size_t mid = lo + (hi - lo + 1) / 2;
      if (exchange_workspace_bytes(mid) <= headroom) lo = mid;
      else hi = mid - 1;
    }
    if (lo == 0) {  // a step whose activations and workspace are smaller than a few dozen bytes
      throw invalid_argument("plan", "a step peak at least " + format_bytes(exchange_workspace_bytes(1)) +
                                         " above the trainer's own bytes (the gradient exchange's least workspace)",
                             format_bytes(headroom) + " above them", "Use a larger micro-batch");
    }
    return lo;
  }

  const Model& m_;
  stream_view<Allocator> alloc_;  // the executor's stream, as the model's blocks (memory/stream.hpp)
  executor& ex_;
  Communicator& comm_;
  std::size_t n_, zero_;
  bool overlap_;
  shard_range shard_{};  // the parameters whose optimizer state this rank holds
  // Over ranks, sized once at construction: each exchange round's blocks, each shard's sum of squares.
  std::vector<shard_range> blocks_;
  std::vector<double> norm_parts_;
  std::vector<std::byte> loss_ws_;  // the loss exchange's workspace (more than one rank)
};

MEMBOUND_NAMESPACE_END
