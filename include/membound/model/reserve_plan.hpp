// The plan of the reserve: what a training run takes from the allocator stack it runs on, not
// only what it requests. A budget over a caching allocator or an arena caps reserved bytes
// (512-byte rounding, shared segments, 2 MiB granules, holes), so a plan whose requested peak fits
// can still run out of memory there. Before step 1 the planner replays the run's requests (the
// persistent state, then steps and an evaluation, in the exact order the trainer and
// model::forward_backward make them: model::step_requests) through a shadow of the caller's stack
// (memory/shadow.hpp) and reads the reserved peak off the shadow's statistics. The shadow runs the
// allocators' own code, so the prediction is exact for a stack that the run uses alone (others'
// bytes counted as the budget's external bytes).
//
//   auto reserve = membound::reserve_model(m, alloc);   // alloc: the stack the trainer will use
//   membound::fit_options fo{.threads = 2};
//   fo.reserve = reserve;                               // fit compares reserved bytes with the budget
//   auto plan = membound::fit(m, {8, 256}, budget, fo); // plan.reserved_peak: what the stack will hold
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/memory/planned_layout.hpp"
#include "membound/memory/shadow.hpp"
#include "membound/model/recompute_schedule.hpp"
#include "membound/model/model_config.hpp"
#include "membound/model/planner.hpp"
#include "membound/optimizer/adamw.hpp"

MEMBOUND_NAMESPACE_BEGIN

// An allocator that hands out no memory and writes down what it was asked, in order. Model
// functions that only make requests (model::step_requests, loss_requests) run on it.
class request_recorder {
 public:
  static constexpr memory_space space = memory_space::host;
  static constexpr std::size_t max_alignment = std::size_t{1} << 21;

  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment, memory_tag tag = memory_tag::other) {
    detail::check_alignment(alignment, max_alignment, "request_recorder");
    detail::check_tag(tag);
    if (bytes == 0) return nullptr;
    if (alignment != default_alignment) {
      throw invalid_argument("alignment", "default_alignment (" + std::to_string(default_alignment) + ")",
                             std::to_string(alignment), "The step's requests all use default_alignment");
    }
    const auto id = static_cast<std::uint32_t>(next_id_++);
    requests_.push_back({id, false, bytes, tag});
    live_.push_back(id);
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(id + 1) * 64);  // never dereferenced
  }
  void deallocate(void* p, std::size_t bytes, std::size_t = default_alignment, memory_tag tag = memory_tag::other) {
    if (p == nullptr) return;
    const auto id = static_cast<std::uint32_t>(reinterpret_cast<std::uintptr_t>(p) / 64 - 1);
    const auto it = std::find(live_.begin(), live_.end(), id);
    if (it == live_.end()) {
      throw invalid_argument("p", "a live block of this recorder", "an unknown pointer", "A bug in the caller");
    }
    live_.erase(it);
    requests_.push_back({id, true, bytes, tag});
  }
  std::size_t growth_for(std::size_t bytes, std::size_t) const noexcept { return bytes; }
  memory_stats stats() const noexcept { return {}; }

  // Checks that the requests recorded since requests().size() was `from` give back every block
  // they take and no other (a cycle that can stand for its copies: run_requests::micro); returns
  // the blocks they take.
  std::size_t check_cycle(std::size_t from) const {
    if (from > requests_.size()) {
      throw invalid_argument("from", "at most requests().size() = " + std::to_string(requests_.size()),
                             std::to_string(from), "Pass a size requests() had earlier");
    }
    std::size_t first = next_id_, taken = 0, least_given = next_id_;
    for (std::size_t k = from; k < requests_.size(); ++k) {
      const recorded_request& q = requests_[k];
      if (q.free) {
        least_given = std::min<std::size_t>(least_given, q.id);
      } else {
        first = std::min<std::size_t>(first, q.id);
        ++taken;
      }
    }
    // Ids are handed out in order: the span took first..next_id_-1, and gave back only those.
    const std::size_t given = requests_.size() - from - taken;
    if (given != taken || next_id_ - first != taken || least_given < first) {
      throw invalid_argument("from", "the start of a span that gives back every block it takes",
                             std::to_string(taken) + " taken, " + std::to_string(given) + " given back",
                             "Repeat only a whole micro-batch's requests");
    }
    return taken;
  }

  const std::vector<recorded_request>& requests() const noexcept { return requests_; }
  std::size_t live_blocks() const noexcept { return live_.size(); }

 private:
  std::size_t next_id_ = 0;
  std::vector<recorded_request> requests_;
  std::vector<std::uint32_t> live_;
};

// The requests of a training run under a plan, as the trainer makes them: the prefix (weights,
// gradients, optimizer state, a device's step buffers: its constructor), then the cycle every
// optimizer step repeats: `repeats` times one micro-batch's requests (`micro`, which gives back
// every block it takes), then `rest` (an overlapped exchange's last micro-batch, which differs,
// and one evaluation of a micro-batch: trainer::evaluate). A step of 65,536 micro-batches is
// recorded and stored in the size of one (and replayed in the time of a few: replay_run).
struct run_requests {
  std::vector<recorded_request> prefix, micro, rest;
  std::size_t repeats = 0;
  std::size_t evaluation = 0;  // rest's last requests that are one evaluation micro-batch

  // The cycle in full, each copy of `micro` under fresh ids.
  std::vector<recorded_request> cycle() const {
    std::size_t taken = 0;
    std::uint32_t first = std::numeric_limits<std::uint32_t>::max();
    for (const recorded_request& q : micro) {
      if (!q.free) ++taken, first = std::min(first, q.id);
    }
    std::vector<recorded_request> out;
    out.reserve(micro.size() * repeats + rest.size());
    for (std::size_t t = 0; t < repeats; ++t) {
      for (recorded_request q : micro) {
        q.id = static_cast<std::uint32_t>(q.id + t * taken);
        out.push_back(q);
      }
    }
    // rest's ids follow micro's one recorded copy: they move past the copies.
    const std::size_t shift = repeats > 1 ? (repeats - 1) * taken : 0;
    for (recorded_request q : rest) {
      if (q.id >= first) q.id = static_cast<std::uint32_t>(q.id + shift);
      out.push_back(q);
    }
    return out;
  }
};

// What a replay measured on a shadow stack.
struct reserve_replay {
  std::size_t peak_reserved = 0;   // the stack's reserved peak: what a budget over it counts
  std::size_t peak_requested = 0;
  bool fits = true;                // false: the shadow (its budget, arena capacity) refused a request
  std::string refusal;             // the out_of_memory message when it did not fit
};

// Replays a run on `shadow` (a fresh stack or one that already holds state): the prefix, `steps`
// cycles (two reach the steady state of every stack here: the second finds the first one's free
// blocks), and the prefix given back in reverse. Once a micro-batch leaves the stack in the state
// it found it in (allocator_state_key, when every layer has one), the step's remaining copies
// would repeat it answer for answer, peaks included, and are skipped: the replay's cost does not
// grow with the number of micro-batches.
template <typename Allocator>
reserve_replay replay_run(Allocator& shadow, const run_requests& run, std::size_t steps = 2) {
  std::vector<void*> ptr;
  const auto apply = [&](const recorded_request& q) {
    if (q.id >= ptr.size()) ptr.resize(std::size_t{q.id} + 1, nullptr);
    if (q.free) {
      shadow.deallocate(ptr[q.id], q.bytes, default_alignment, q.tag);
      ptr[q.id] = nullptr;
    } else {
      ptr[q.id] = shadow.allocate(q.bytes, default_alignment, q.tag);
    }
  };
  // The bytes and tag each id was taken with, to give back what a refusal leaves live.
  std::vector<const recorded_request*> taken_by;
  for (const auto* part : {&run.prefix, &run.micro, &run.rest}) {
    for (const recorded_request& q : *part) {
      if (q.id >= taken_by.size()) taken_by.resize(std::size_t{q.id} + 1, nullptr);
      if (!q.free) taken_by[q.id] = &q;
    }
  }
  reserve_replay r;
  try {
    for (const recorded_request& q : run.prefix) apply(q);
    std::vector<std::uint64_t> last, now;
    for (std::size_t s = 0; s < steps; ++s) {
      last.clear();
      for (std::size_t k = 0; k < run.repeats; ++k) {
        for (const recorded_request& q : run.micro) apply(q);
        if constexpr (has_state_key<Allocator>()) {
          if (k + 1 == run.repeats) break;
          now.clear();
          allocator_state_key(shadow, now);
          if (k > 0 && now == last) break;  // micro-batch k started and ended in this state
          std::swap(last, now);
        }
      }
      for (const recorded_request& q : run.rest) apply(q);
    }
    for (std::size_t k = run.prefix.size(); k-- > 0;) {
      const recorded_request& q = run.prefix[k];
      apply({q.id, true, q.bytes, q.tag});
    }
  } catch (const out_of_memory& e) {
    r.fits = false;
    r.refusal = e.what();
    // Give back what is still live, newest first, as the run's own unwinding would.
    for (std::size_t id = ptr.size(); id-- > 0;) {
      if (ptr[id] != nullptr) shadow.deallocate(ptr[id], taken_by[id]->bytes, default_alignment, taken_by[id]->tag);
    }
  }
  const memory_stats st = shadow.stats();
  r.peak_reserved = st.peak_reserved;
  r.peak_requested = st.peak_requested;
  return r;
}

namespace detail {
// ZeRO-2's requests in a block's backward (gradient_exchange's zero2_router): the block's gradient
// bucket at begin_block; at end_block its reduce-scatter's workspace, then both given back.
// Overlapped (gs.overlap): at end_block the exchange in flight is given back (workspace, then
// bucket), then this block's workspace is taken and both stay in flight until the next
// end_block, or finish() after the micro-batch's backward.
template <typename Model>
struct zero2_request_router {
  using S = typename Model::storage_type;
  const Model& m;
  request_recorder& rec;
  gradient_shards gs;
  std::size_t accumulation;
  void* bucket = nullptr;
  std::size_t bytes = 0;
  void *flight_bucket = nullptr, *flight_ws = nullptr;
  std::size_t flight_bytes = 0, flight_ws_bytes = 0;
  S* at(std::size_t) const noexcept { return nullptr; }
  void begin_block(std::size_t i) {
    bytes = bytes_of<S>(m.block_parameters(i).size());
    bucket = rec.allocate(bytes, default_alignment, memory_tag::gradients);
  }
  void end_block(std::size_t i) {
    const std::size_t wsb = gradient_exchange_bytes(m, gs, m.block_parameters(i), accumulation);
    if (gs.overlap) {
      finish();
      flight_ws = rec.allocate(wsb, default_alignment, memory_tag::workspace);
      flight_ws_bytes = wsb;
      flight_bucket = std::exchange(bucket, nullptr);
      flight_bytes = bytes;
      return;
    }
    rec.deallocate(rec.allocate(wsb, default_alignment, memory_tag::workspace), wsb, default_alignment,
                   memory_tag::workspace);
    rec.deallocate(bucket, bytes, default_alignment, memory_tag::gradients);
  }
  void finish() {
    if (flight_bucket == nullptr) return;
    rec.deallocate(std::exchange(flight_ws, nullptr), flight_ws_bytes, default_alignment, memory_tag::workspace);
    rec.deallocate(std::exchange(flight_bucket, nullptr), flight_bytes, default_alignment, memory_tag::gradients);
  }
};
// ZeRO-0/1 overlapped (gs.whole_overlapped()), the last micro-batch: no bucket; at end_block the
// exchange in flight is given back (its workspace) and this block's workspace taken, in flight
// until the next end_block or finish().
template <typename Model>
struct exchange_request_router {
  using S = typename Model::storage_type;
  const Model& m;
  request_recorder& rec;
  gradient_shards gs;
  std::size_t accumulation;
  void* flight_ws = nullptr;
  std::size_t flight_ws_bytes = 0;
  S* at(std::size_t) const noexcept { return nullptr; }
  void begin_block(std::size_t) const noexcept {}
  void end_block(std::size_t i) {
    finish();
    flight_ws_bytes = gradient_exchange_bytes(m, gs, m.block_parameters(i), accumulation);
    flight_ws = rec.allocate(flight_ws_bytes, default_alignment, memory_tag::workspace);
  }
  void finish() {
    if (flight_ws == nullptr) return;
    rec.deallocate(std::exchange(flight_ws, nullptr), flight_ws_bytes, default_alignment, memory_tag::workspace);
  }
};
}  // namespace detail

namespace detail {
// One micro-batch's requests that are alike across a step: no exchange (ZeRO-0/1), or ZeRO-2's
// (the trainer's zero2_micro_batch: the embedding's and head's bucket for the micro-batch, the
// blocks' buckets in their backward, then the two held ranges' reduce-scatters).
template <typename Model>
void micro_batch_requests(const Model& m, batch_shape micro, std::span<const chain_op> ops, std::size_t head_chunk,
                          std::size_t threads, std::size_t accumulation, const gradient_shards& gs,
                          request_recorder& rec) {
  using S = typename Model::storage_type;
  if (!gs.on()) {
    m.step_requests(micro, ops, head_chunk, threads, rec);
    return;
  }
  const shard_range e = m.embedding_parameters(), h = m.head_parameters();
  // ZeRO-3: the gathered weights first (the trainer's weight_gather), held through the micro-batch.
  const std::size_t gather = gs.weights_sharded() ? weight_gather_bytes(m, gs.overlap) : 0;
  void* gathered = gather != 0 ? rec.allocate(gather, default_alignment, memory_tag::weights) : nullptr;
  const std::size_t held = bytes_of<S>(e.size() + h.size());
  void* kept = rec.allocate(held, default_alignment, memory_tag::gradients);
  zero2_request_router<Model> router{m, rec, gs, accumulation};
  m.step_requests_routed(micro, ops, head_chunk, threads, rec, router);
  router.finish();
  for (const shard_range q : {e, h}) {
    const std::size_t wsb = gradient_exchange_bytes(m, gs, q, accumulation);
    rec.deallocate(rec.allocate(wsb, default_alignment, memory_tag::workspace), wsb, default_alignment,
                   memory_tag::workspace);
  }
  rec.deallocate(kept, held, default_alignment, memory_tag::gradients);
  if (gathered != nullptr) rec.deallocate(gathered, gather, default_alignment, memory_tag::weights);
}
}  // namespace detail

// gradients: the gradient bytes the trainer keeps (weight_bytes(), or its ZeRO-2 shard);
// gs: ZeRO-2's sharding (off by default), whose buckets and exchanges are requests too, or
// ZeRO-0/1 overlapped, whose last micro-batch's exchanges are; under ZeRO-3 the weights are this
// rank's shard, and each micro-batch and evaluation gathers into weight_gather_bytes.
template <typename Model>
run_requests record_run(const Model& m, batch_shape micro, std::span<const chain_op> ops, std::size_t head_chunk,
                        std::size_t threads, std::size_t accumulation, std::size_t optimizer_bytes,
                        std::size_t gradients = 0, const gradient_shards& gs = {}) {
  run_requests r;
  request_recorder rec;
  const std::size_t wb = m.weight_bytes();
  (void)rec.allocate(gs.weights_sharded() ? bytes_of<typename Model::storage_type>(
                                                shard_of(m.parameter_elements(), gs.ranks, gs.rank).size())
                                          : wb,
                     default_alignment, memory_tag::weights);
  (void)rec.allocate(gradients != 0 ? gradients : wb, default_alignment, memory_tag::gradients);
  (void)rec.allocate(optimizer_bytes, default_alignment, memory_tag::optimizer);
  // A device trainer's step buffers (token ids, the norm's partials), made after the state.
  (void)rec.allocate(Model::step_buffer_bytes(sat_mul(micro.tokens(), accumulation), m.parameter_elements()),
                     default_alignment, memory_tag::other);
  const std::size_t k0 = rec.requests().size();
  r.prefix = rec.requests();
  // Every micro-batch but an overlapped exchange's last makes the same requests: one is recorded
  // and stands for all (run_requests::repeats).
  r.repeats = gs.whole_overlapped() ? accumulation - 1 : accumulation;
  if (r.repeats > 0) detail::micro_batch_requests(m, micro, ops, head_chunk, threads, accumulation, gs, rec);
  (void)rec.check_cycle(k0);
  const std::size_t k1 = rec.requests().size();
  r.micro.assign(rec.requests().begin() + static_cast<std::ptrdiff_t>(k0),
                 rec.requests().begin() + static_cast<std::ptrdiff_t>(k1));
  if (gs.whole_overlapped()) {
    // The trainer's overlapped_micro_batch: each block's exchange in flight through the next
    // block's backward, then the embedding's and the head's exchanges, one after the other.
    detail::exchange_request_router<Model> router{m, rec, gs, accumulation};
    m.step_requests_routed(micro, ops, head_chunk, threads, rec, router);
    router.finish();
    for (const shard_range q : {m.embedding_parameters(), m.head_parameters()}) {
      const std::size_t wsb = gradient_exchange_bytes(m, gs, q, accumulation);
      rec.deallocate(rec.allocate(wsb, default_alignment, memory_tag::workspace), wsb, default_alignment,
                     memory_tag::workspace);
    }
  }
  const std::size_t e0 = rec.requests().size();
  const std::size_t gather = gs.weights_sharded() ? weight_gather_bytes(m, gs.overlap) : 0;
  void* gathered = gather != 0 ? rec.allocate(gather, default_alignment, memory_tag::weights) : nullptr;
  m.loss_requests(micro, head_chunk, threads, rec);
  if (gathered != nullptr) rec.deallocate(gathered, gather, default_alignment, memory_tag::weights);
  r.evaluation = rec.requests().size() - e0;
  r.rest.assign(rec.requests().begin() + static_cast<std::ptrdiff_t>(k1), rec.requests().end());
  return r;
}
template <typename Model>
run_requests record_run(const Model& m, const training_plan& p) {
  return record_run(m, p.micro, p.ops, p.head_chunk, p.threads, p.accumulation, p.optimizer, p.gradients,
                    p.gradient_sharding);
}

// The layout a planned allocator (caching_options::planned) serves a run from: one micro-batch's
// slots serve every identical one (memory_layout::repeats).
// An evaluation micro-batch's slots end the cycle (memory_layout::tail_slots).
inline memory_layout run_layout(const run_requests& r) {
  memory_layout l = make_layout(r.prefix, r.micro, r.repeats, r.rest);
  for (std::size_t k = r.rest.size() - std::min(r.evaluation, r.rest.size()); k < r.rest.size(); ++k) {
    if (!r.rest[k].free) ++l.tail_slots;
  }
  return l;
}
template <typename Model>
memory_layout plan_layout(const Model& m, const training_plan& p) {
  return run_layout(record_run(m, p));
}

// The reserve function of a stack for a model: for a plan, the reserved peak of a run under it
// on a fresh shadow of `alloc`'s stack (its settings and the budget's external bytes read at each
// call, so a retry under pressure sees the others' bytes of that moment). A plan the stack's
// budget refuses gets more than the budget leaves: its uncapped reserve, or its requested peak
// when even that is refused (SIZE_MAX when the stack has no budget to raise). m and alloc must outlive the function. Put it in
// fit_options::reserve; the trainer makes its own from its allocator.
template <typename Model, typename Allocator>
  requires has_shadow<Allocator>
reserve_function reserve_model(const Model& m, const Allocator& alloc) {
  return [&m, &alloc](const training_plan& p) -> std::size_t {
    const run_requests run = record_run(m, p);
    // Uncapped: without the stack's budgets, and with arenas large enough (a stack remade for a
    // larger budget sizes its arena from it), so that the figure is what the plan reserves.
    auto replay = [&](bool capped) {
      auto shadow = make_shadow(alloc, capped ? shadow_scope::same : shadow_scope::unbounded_capacity);
      if (!capped) detail::lift_budgets(*shadow);
      // A planned stack runs each plan from that plan's layout (the trainer sets it on adopting).
      if constexpr (has_planned_layer<shadow_t<Allocator>>) {
        if (auto* layer = planned_layer(*shadow)) layer->set_layout(run_layout(run));
      }
      return replay_run(*shadow, run);
    };
    const reserve_replay r = replay(true);
    if (r.fits) return r.peak_reserved;
    // The stack's budget refused: what the plan would reserve without the cap, so that a caller
    // learns by how much it misses (budget_too_small's minimum), and never less than one byte
    // over what the cap leaves, so that the plan never passes for one that fits.
    const reserve_replay u = replay(false);
    const auto [limit, external] = detail::tightest_budget(alloc);
    const std::size_t room = sat_sub(limit, external);
    const std::size_t over_cap = sat_add(room, 1);
    // The budget had room for the whole reserve, so it never refused: the stack's own capacity did
    // (an arena sized apart from the budget). No budget makes it fit: SIZE_MAX, which fit() turns
    // into "raise the allocator's capacity" rather than "at least room + 1" again and again.
    if (u.fits && u.peak_reserved <= room) return std::numeric_limits<std::size_t>::max();
    // Refused even then (a layer with a limit of its own): the reserve is unknown, but never below
    // the requested peak, which is then the floor a caller is told. With no budget in the stack
    // at all this stays SIZE_MAX: no budget makes it fit.
    if (!u.fits) return std::max(p.peak_bytes, over_cap);
    return std::max(u.peak_reserved, over_cap);
  };
}

MEMBOUND_NAMESPACE_END
