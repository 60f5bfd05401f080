// Data-parallel training over mpi_communicator (ctest runs it at 1, 2 and 4 ranks): the small
// hybrid model of the trainer tests, an effective batch of 4 sequences of 16 tokens, 30 steps.
//   - Against one process: the same model, seed and effective batch on a local trainer with 4
//     micro-batches of 1 (every rank runs it too). With one rank the curves are bit-identical.
//     With N ranks each rank accumulates its 4/N micro-batches and the ranks' sums are added in
//     rank order, where one process adds all 4 into one buffer in turn: another order of fp32
//     additions, so the curves agree to a tolerance. Stated: 1e-5 relative per step. Each
//     step's rounding differences are ~1e-7 relative (fp32, a handful of additions per element);
//     AdamW's normalised steps carry them into the weights and the later losses. The largest
//     seen (printed) was 5.7e-7 at 2 ranks and 3.4e-7 at 4: the bound leaves a 17x margin.
//   - Reproducible: a second data-parallel run with the same seed gives the same bits.
//   - Every rank holds the same weights and optimizer state after the run (compared with rank
//     0's bytes by broadcast).
//   - Memory: each rank's measured peak (budget allocator statistics) equals the plan's
//     prediction: the gradient exchange fits inside the step's own peak.
//   - ZeRO-1 (AdamW's state sharded over the ranks): the same losses, weights and per-element
//     optimizer values as ZeRO-0, bit for bit (the same full gradient, the same elementwise
//     update, only who computes it differs); each rank's optimizer bytes are AdamW's state for
//     its shard, they add up to the unsharded state, and the measured peak still equals the
//     prediction, lower than ZeRO-0's by exactly the state no longer held. The gradients are
//     reduce-scattered (each rank receives only its shard's sum, in rank order) and the weights
//     all-gathered: the bytes each rank sends per step are checked against the exact formula,
//     2·(N − 1)/N·4n plus 16·(N − 1) or so for the norm's and the loss's doubles.
//   - Sharded checkpoints (ZeRO-1, N > 1): 15 steps, save (one shard file per rank and a
//     manifest), a fresh trainer loads them and runs 15 more: the losses and weights of the
//     uninterrupted run, bit for bit. Each shard file holds the rank's slice of the weights and
//     its optimizer state only.
//   - ZeRO-2 (the gradients sharded too): the measured peak equals the prediction; each rank's
//     gradient bytes are its shard's; with one micro-batch per rank (N = 4, and N = 2 with
//     micro-batches of 2) ZeRO-0's losses and weights and ZeRO-1's optimizer state bit for bit,
//     with more (N = 2, two micro-batches of 1) ZeRO-0's curve within 1e-5 relative (each
//     micro-batch's gradients are reduce-scattered and the shard sums them: another order);
//     bytes sent per step against the exact formula; a ZeRO-1 plan given to ZeRO-2 is refused.
//   - ZeRO-2 overlapped (each block's reduce-scatter in flight through the next block's
//     backward): the blocking path's losses, weights, optimizer state and bytes sent, bit for
//     bit, with schedules none and full (retape ops while a bucket is in flight), and at N = 2
//     with micro-batches of 2; measured peak == predicted in each; a blocking plan given to an
//     overlapping trainer (ZeRO-0, 1, 2), and an overlapped plan to a blocking one, are refused
//     with typed errors naming the plan.
//   - ZeRO-0/1 overlapped (N > 1; the last micro-batch's block i starts its all-reduce, or
//     reduce-scatter into the shards, as its backward ends): blocking's losses, weights and
//     optimizer state bit for bit, schedules none and full, one and two micro-batches per rank and
//     micro-batches of 2; ZeRO-1's bytes sent exactly blocking's, ZeRO-0's over all ranks; measured
//     peak and reserve == predicted; bf16 too.
//   - bf16 storage (16-bit gradients on the wire, summed in fp32 in rank order, rounded once;
//     fp32 masters, m, v sharded): measured peak == predicted under ZeRO-0/1/2 and overlapped;
//     ZeRO-1's and ZeRO-2's (one micro-batch per rank) bits are ZeRO-0's, overlapped's blocking's;
//     one process's loss curve within twice bf16's own gap to fp32; model states per rank 16P,
//     4P + 12s, 2P + 14s (DeepSpeed's mixed-precision layout).
//   - Re-sharding (N > 1): the N ranks' shards resumed by one process (MPI_COMM_SELF, zero 0
//     and 1) give exactly the saved weights and m, v, and the continuation of a whole checkpoint
//     of the same state (ZeRO-0 over N ranks) bit for bit; a one-process checkpoint resumed by N
//     ranks under ZeRO-1 (each rank slices its shard of m and v) gives ZeRO-0's continuation of
//     it bit for bit, under ZeRO-2 within 1e-5 (bit for bit with one micro-batch per rank). At
//     N = 4, through two 2-rank halves: 2 -> 4 and 4 -> 2 manifests under ZeRO-1, bit for bit
//     against ZeRO-0 resuming a whole checkpoint of the same state.
//     adamw8bit's block-wise state is not re-sliced: checkpoint_world_mismatch, nothing loaded.
//     A whole checkpoint loaded by N ranks whose last rank cannot fit its plan: no rank restores
//     the plan (ranks under different plans would make different collectives).
//     Shards written under another peak lr are refused (checkpoint_run_changed) on every rank with
//     nothing loaded, through the shards and re-sharded into one process, and load when accepted.
//   - A sharded save killed at each point of its protocol (shards being written, some committed,
//     the manifest being written, committed with none or some of the old shards removed): the next
//     load resumes the committed step and leaves exactly the manifest and the shards it names.
//   - Fit before step 1 (N > 1): the last rank's budget is half its plan's peak; every rank's
//     constructor throws rank_cannot_start naming that rank, its peak and its budget.
//   - The per-rank plan lines (rank_memory): every rank's, gathered, match each rank's own.
//   - Replanning under pressure over ranks (ZeRO-0, 1, 2, 3, each also overlapped): the last rank
//     alone sees others take memory (its budget's external bytes) before step 1 or step 3; its
//     pressure monitor's emergency is voted at the next agreement point and every rank retries
//     the step under the same stricter plan (same choices on every rank, rank 0's broadcast);
//     after it each rank's measured peak equals the new plan's prediction, every rank holds rank
//     0's weights, and the losses and weights equal, bit for bit, a run without pressure that
//     switches to that plan at the same step (from step 1: planned with it from the start).
//     With no monitor: external bytes that leave no room for the plan's peak on the last rank
//     (every stage), and bytes allocated there so that the plan's peak runs out of memory
//     (ZeRO-0/1 blocking: no exchange inside the micro-batch), retry step 1 on every rank the same way.
//   - ZeRO-3 (N > 1; the weights sharded, each block gathered before an op reads it, the next one
//     prefetched when overlapped): ZeRO-2's losses and optimizer state and this rank's shard of its
//     weights bit for bit, blocking and overlapped, one and two micro-batches per rank; measured
//     peak == predicted == ZeRO-2's less the weights others hold plus the gathered buffer; bytes
//     sent exactly; evaluation ZeRO-2's loss and decoding its logits; a ZeRO-2 plan refused; offload under
//     it as above.
//     With no plan fitting what the last rank has left, every rank throws rank_budget_too_small
//     naming it, with nothing lost (weights, optimizer state, step count, bytes held).
//   - Refusals: an effective batch the ranks cannot share, a typed error naming the argument.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include "membound/monitor/pressure_monitor.hpp"
#include "membound/mpi.hpp"

#include "../support/small_models.hpp"
#include "../support/text_source.hpp"
#include "../support/rank_checks.hpp"

namespace mb = membound;

namespace {

int& failures = membound_test::rank_checks::failures;
std::size_t& me = membound_test::rank_checks::me;
using membound_test::rank_checks::check;

constexpr mb::batch_shape effective{4, 16};
constexpr std::size_t steps = 30;

using text_source = membound_test::text_source<effective.seq>;

using model_t = membound_test::hybrid<mb::fp32_precision>;
using alloc_t = mb::budget_allocator<mb::system_allocator>;
using planned_t = mb::budget_allocator<mb::caching_allocator<mb::system_allocator>>;

mb::trainer_options options(std::size_t zero = 0, bool overlap = false) {
  mb::trainer_options o;
  o.zero = zero;
  o.overlap = overlap;
  o.seed = 3;
  o.lr = mb::cosine_lr{1e-2, 1e-3, 2, 20};
  o.head_chunks = {64, 16};
  o.replan_under_pressure = false;
  return o;
}

template <typename Model>
mb::training_plan plan_for(const Model& m, std::size_t micro_batches, std::size_t optimizer_elements = 0,
                           mb::gradient_shards gradients = {}, std::size_t micro = 1,
                           mb::schedule_choice schedule = mb::schedule_choice::of(mb::schedules::none{}),
                           mb::offload_options offload = {}) {
  mb::plan_options po;
  po.offload = offload;
  po.optimizer_elements = optimizer_elements;
  po.gradients = gradients;
  po.threads = 1;
  po.head_chunk = 64;
  po.accumulation = micro_batches;
  return mb::make_plan(m, mb::batch_shape{micro, effective.seq}, schedule, po);
}

struct run {
  std::vector<double> losses;
  std::vector<unsigned char> weights, optimizer;
  std::size_t peak = 0, predicted = 0;
  std::size_t host_peak = 0, predicted_host = 0;  // optimizer offload's host space
  std::size_t reserved = 0, predicted_reserve = 0;  // on the allocator stack (reserve_plan's replay)
  std::uint64_t bytes_sent = 0;  // by this rank over the steps (data parallel runs)
  std::uint64_t control_sent = 0;  // of those, through a split communicator's control()
  mb::rank_memory memory{};
};

template <typename Trainer, typename Alloc>
run finish(Trainer& t, Alloc& a) {
  text_source src(membound_test::small_config().vocab);
  run r;
  for (std::size_t k = 0; k < steps; ++k) r.losses.push_back(t.step(src).loss);
  const auto* w = static_cast<const unsigned char*>(static_cast<const void*>(t.weights()));
  // Under ZeRO-3 this rank's shard of them.
  r.weights.assign(w, w + t.weight_shard().size() * sizeof(typename Trainer::S));
  const auto* o = static_cast<const unsigned char*>(t.optimizer_state());
  r.optimizer.assign(o, o + t.optimizer_bytes());
  r.peak = a.stats().peak_requested;
  r.predicted = t.largest_predicted_peak();
  r.reserved = a.stats().peak_reserved;
  r.predicted_reserve = t.largest_predicted_reserve();
  r.memory = t.memory();
  return r;
}

// micro: sequences per micro-batch (each rank runs effective.batch / N / micro micro-batches).
// overlap: ZeRO-2's reduce-scatters overlapped with the next block's backward. offload: the
// optimizer's state (this rank's shard) in a host space, buckets of 1000 parameters. activations:
// the schedule budget(the stage's Revolve-with-one-slot peak), block inputs offloadable.
template <typename Model, typename Comm>
run data_parallel(const Model& m, Comm& comm, std::size_t zero = 0, std::size_t micro = 1,
                  bool overlap = false, mb::schedule_choice schedule = mb::schedule_choice::of(mb::schedules::none{}),
                  bool offload = false, bool activations = false) {
  alloc_t a(std::size_t{1} << 30), host(std::size_t{1} << 30);
  mb::trainer_options o = options(zero, overlap && comm.size() > 1);
  o.host = mb::host_allocator_ref(host);
  mb::thread_pool pool(1);
  const std::size_t shard = zero >= 1 && comm.size() > 1 ? mb::shard_of(m.parameter_elements(), comm.size(), comm.rank()).size() : 0;
  const bool ov = overlap && comm.size() > 1;
  const mb::gradient_shards gs = mb::gradient_exchange_of<typename Model::storage_type>(comm, zero, ov);
  const std::size_t A = effective.batch / comm.size() / micro;
  if (activations) {
    schedule = {mb::schedule_choice::kind::budget,
                plan_for(m, A, shard, gs, micro, mb::schedule_choice::of(mb::schedules::binomial<1>{})).peak_bytes};
  }
  mb::trainer t(m, effective, plan_for(m, A, shard, gs, micro, schedule, {offload, 1000, 0, activations}), a, pool, o,
                mb::null_monitor{}, comm);
  const std::uint64_t before = comm.stats().bytes_sent;
  std::uint64_t control_before = 0;
  if constexpr (mb::split_communicator<Comm>) control_before = comm.control().stats().bytes_sent;
  run r = finish(t, a);
  r.bytes_sent = comm.stats().bytes_sent - before;
  if constexpr (mb::split_communicator<Comm>) r.control_sent = comm.control().stats().bytes_sent - control_before;
  r.host_peak = host.stats().peak_requested;
  r.predicted_host = t.plan().host_peak();
  return r;
}

// The split nccl_communicator relies on (communicator.hpp's split_communicator), on the host: the
// data communicator takes only the storage type, so a flag, vote, loss or norm part the trainer
// sent there instead of through control() fails to compile here; on a device it would hand NCCL
// a host pointer. A trainer over it must give the plain communicator's bits.
template <typename S>
struct split_comm {
  mb::mpi_communicator data, ctl;
  using control_type = mb::mpi_communicator;
  control_type& control() noexcept { return ctl; }
  std::size_t rank() const noexcept { return data.rank(); }
  std::size_t size() const noexcept { return data.size(); }
  const char* name() const noexcept { return "split"; }
  mb::communication_stats stats() const noexcept { return data.stats(); }

  template <typename T>
  static constexpr void data_only() {
    static_assert(std::is_same_v<T, S>, "a host value went to the data communicator: route it through ctl()");
  }
  template <mb::summable T>
  std::size_t reduce_scatter_workspace_bytes(std::size_t n) const noexcept {
    data_only<T>();
    return data.template reduce_scatter_workspace_bytes<T>(n);
  }
  template <mb::summable T>
  std::size_t reduce_scatter_blocks_workspace_bytes(std::size_t n) const noexcept {
    data_only<T>();
    return data.template reduce_scatter_blocks_workspace_bytes<T>(n);
  }
  template <mb::summable T>
  std::size_t all_reduce_workspace_bytes(std::size_t n) const noexcept {
    data_only<T>();
    return data.template all_reduce_workspace_bytes<T>(n);
  }
  template <mb::summable T>
  void reduce_scatter_sum(const T* in, std::size_t n, T* out, void* ws, std::size_t b) {
    data_only<T>();
    data.reduce_scatter_sum(in, n, out, ws, b);
  }
  template <mb::summable T>
  void reduce_scatter_blocks_sum(const T* in, const mb::shard_range* blocks, T* out, void* ws, std::size_t b) {
    data_only<T>();
    data.reduce_scatter_blocks_sum(in, blocks, out, ws, b);
  }
  template <typename T>
  void all_gather(const T* shard, T* out, std::size_t n) {
    data_only<T>();
    data.all_gather(shard, out, n);
  }
  template <mb::summable T>
  void all_reduce_sum(T* d, std::size_t n, void* ws, std::size_t b) {
    data_only<T>();
    data.all_reduce_sum(d, n, ws, b);
  }
  template <typename T>
  void broadcast(T* d, std::size_t n, std::size_t root) {
    data_only<T>();
    data.broadcast(d, n, root);
  }
  void barrier() { data.barrier(); }
};
static_assert(mb::split_communicator<split_comm<float>>);

template <typename Model>
run one_process(const Model& m) {
  alloc_t a(std::size_t{1} << 30);
  mb::thread_pool pool(1);
  mb::trainer t(m, effective, plan_for(m, effective.batch), a, pool, options());
  return finish(t, a);
}

// Bytes live when the loss starts under a plan (after_forward): where the monitor sees the most.
std::size_t live_at_loss(const mb::training_plan& p) {
  for (const mb::plan_phase& ph : p.timeline)
    if (ph.name.rfind("loss", 0) == 0) return ph.live_before;
  return p.peak_bytes;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  // memcmp with an empty vector's null data() is undefined, even for 0 bytes (UBSan says so).
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

// Rank 0's bytes on every rank, for comparison.
std::vector<unsigned char> rank0(mb::mpi_communicator& comm, std::vector<unsigned char> v) {
  comm.broadcast(v.data(), v.size(), 0);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  mb::mpi_environment env(argc, argv);
  mb::mpi_communicator comm;
  me = comm.rank();
  const std::size_t N = comm.size();
  const model_t m(membound_test::small_config());

  const run ref = one_process(m);
  const run dp = data_parallel(m, comm);
  const run again = data_parallel(m, comm);
  const run zero1 = data_parallel(m, comm, 1);

  check(dp.losses.size() == steps && std::isfinite(dp.losses.back()), "30 finite losses");
  check(dp.losses.back() < dp.losses.front(), "the loss falls");
  double worst = 0;
  for (std::size_t k = 0; k < steps; ++k) {
    worst = std::max(worst, std::abs(dp.losses[k] - ref.losses[k]) / std::abs(ref.losses[k]));
  }
  if (N == 1) {
    check(same_bits(dp.losses, ref.losses), "one rank: the loss curve of one process, bit for bit");
  } else {
    check(worst <= 1e-5, "the loss curve of one process within 1e-5 relative (worst " + std::to_string(worst) + ")");
  }
  check(same_bits(dp.losses, again.losses) && dp.weights == again.weights, "a second run: the same bits");
  check(dp.weights == rank0(comm, dp.weights), "every rank holds rank 0's weights");
  check(dp.optimizer == rank0(comm, dp.optimizer), "every rank holds rank 0's optimizer state");
  check(dp.peak == dp.predicted, "measured peak " + std::to_string(dp.peak) + " == predicted " + std::to_string(dp.predicted));

  // ZeRO-1 against ZeRO-0.
  using opt = mb::adamw<float>;
  const std::size_t n = m.parameter_elements();
  const mb::shard_range shard = mb::shard_of(n, N, me);
  check(same_bits(zero1.losses, dp.losses) && zero1.weights == dp.weights, "ZeRO-1: the losses and weights of ZeRO-0, bit for bit");
  check(zero1.optimizer.size() == opt::state_bytes(shard.size()), "ZeRO-1: this rank holds AdamW's state for its shard");
  // m and v of the shard are ZeRO-0's m and v at the shard's elements.
  const std::size_t f = sizeof(float);
  const bool same_m = std::memcmp(zero1.optimizer.data(), dp.optimizer.data() + shard.begin * f, shard.size() * f) == 0;
  const bool same_v = std::memcmp(zero1.optimizer.data() + shard.size() * f, dp.optimizer.data() + (n + shard.begin) * f,
                                  shard.size() * f) == 0;
  check(same_m && same_v, "ZeRO-1: the shard's m and v equal ZeRO-0's, bit for bit");
  unsigned long long held = zero1.optimizer.size(), total_held = 0;
  MPI_Allreduce(&held, &total_held, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, comm.native());
  check(total_held == opt::state_bytes(n), "ZeRO-1: the shards add up to the unsharded state");
  check(zero1.peak == zero1.predicted, "ZeRO-1: measured peak " + std::to_string(zero1.peak) + " == predicted " +
                                           std::to_string(zero1.predicted));
  check(dp.peak - zero1.peak == opt::state_bytes(n) - opt::state_bytes(shard.size()),
        "ZeRO-1: the peak falls by exactly the state no longer held");
  // Communication per step under ZeRO-1, exactly: the gradient reduce-scatter sends every other
  // rank its shard (4·(n − s) bytes), the weight all-gather this rank's shard to every other rank
  // (4·s·(N − 1)): 2·(N − 1)/N·4n together when N divides n, as ZeRO-0's all-reduce. Then 8·(N − 1)
  // for the shards' sums of squares, and the all-reduces of the loss and of the step's counted
  // targets (8 each to rank 0, or 8·(N − 1) each from it).
  const std::uint64_t s = shard.size();
  const std::uint64_t per_step = N == 1 ? 0 : 4 * (n - s) + 4 * s * (N - 1) + 8 * (N - 1) + (me == 0 ? 16 * (N - 1) : 16);
  check(zero1.bytes_sent == steps * per_step, "ZeRO-1: bytes sent " + std::to_string(zero1.bytes_sent) + " == " +
                                                   std::to_string(steps) + " x " + std::to_string(per_step));
  if (me == 0) {
    std::printf("optimizer bytes per rank: ZeRO-0 %zu, ZeRO-1 %zu (1/%zu); peak per rank: ZeRO-0 %zu, ZeRO-1 %zu\n",
                dp.optimizer.size(), zero1.optimizer.size(), N, dp.peak, zero1.peak);
    std::printf("bytes sent per step by rank 0: ZeRO-0 %.0f, ZeRO-1 %.0f; 2(N-1)/N x 4n = %.0f\n",
                static_cast<double>(dp.bytes_sent) / steps, static_cast<double>(zero1.bytes_sent) / steps,
                2.0 * static_cast<double>(N - 1) / static_cast<double>(N) * 4.0 * static_cast<double>(n));
  }

  // Over a split communicator (data and control apart, as nccl_communicator): the plain
  // communicator's bits under ZeRO-0 and ZeRO-1; the data communicator carries exactly the
  // gradients' reduce-scatter and the weights' all-gather, control() the norm's, the loss's and the
  // counted targets' doubles.
  {
    split_comm<float> split;
    const run s0 = data_parallel(m, split);
    const run s1 = data_parallel(m, split, 1);
    check(same_bits(s0.losses, dp.losses) && s0.weights == dp.weights && s0.optimizer == dp.optimizer &&
              s0.peak == dp.peak && s0.peak == s0.predicted,
          "split communicator, ZeRO-0: the plain communicator's losses, weights, optimizer state and peak");
    check(same_bits(s1.losses, zero1.losses) && s1.weights == zero1.weights && s1.optimizer == zero1.optimizer &&
              s1.peak == zero1.peak && s1.peak == s1.predicted,
          "split communicator, ZeRO-1: the plain communicator's losses, weights, optimizer state and peak");
    const std::uint64_t data_step = N == 1 ? 0 : 4 * (n - s) + 4 * s * (N - 1);
    const std::uint64_t control_step = N == 1 ? 0 : 8 * (N - 1) + (me == 0 ? 16 * (N - 1) : 16);
    check(s1.bytes_sent == steps * data_step && s1.control_sent == steps * control_step,
          "split communicator, ZeRO-1: data bytes " + std::to_string(s1.bytes_sent) + " == " +
              std::to_string(steps * data_step) + ", control bytes " + std::to_string(s1.control_sent) + " == " +
              std::to_string(steps * control_step));
    check(s0.control_sent == steps * (N == 1 ? 0 : (me == 0 ? 16 * (N - 1) : 16)),
          "split communicator, ZeRO-0: control() carries only the loss and the counted targets (" +
              std::to_string(s0.control_sent) + " bytes)");
  }

  // Optimizer offload under ZeRO-1, 2 and 3: the same bits as the in-place run of the stage,
  // this rank's shard of the state (and two buckets) in the host space, both peaks as predicted.
  for (const std::size_t z : {std::size_t{1}, std::size_t{2}, std::size_t{3}}) {
    const std::string stage = "ZeRO-" + std::to_string(z) + " offloaded: ";
    const run in_place = z == 1 ? zero1 : data_parallel(m, comm, z);
    const run off = data_parallel(m, comm, z, 1, false, mb::schedule_choice::of(mb::schedules::none{}), true);
    check(same_bits(off.losses, in_place.losses) && off.weights == in_place.weights && off.optimizer == in_place.optimizer,
          stage + "the in-place run's losses, weights and optimizer state, bit for bit");
    check(off.peak == off.predicted, stage + "measured device peak " + std::to_string(off.peak) + " == predicted " +
                                         std::to_string(off.predicted));
    check(in_place.peak - off.peak == in_place.optimizer.size(),
          stage + "the device holds exactly the state's " + std::to_string(in_place.optimizer.size()) + " bytes less");
    check(off.host_peak == off.predicted_host && off.host_peak == off.optimizer.size() + 2 * 1000 * sizeof(float),
          stage + "measured host peak " + std::to_string(off.host_peak) + " == predicted " +
              std::to_string(off.predicted_host) + " (the shard's state and two buckets)");
    check(off.memory.optimizer == 0 && off.memory.host == off.predicted_host, stage + "memory() puts the state on the host");
  }

  // Activation offload under ZeRO-0, 1, 2 and 3: at the stage's Revolve-with-one-slot peak the
  // budget DP keeps block inputs in the host space; the same bits as the stage's run under
  // schedule none, both spaces' peaks as predicted.
  for (const std::size_t z : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{3}}) {
    const std::string stage = "ZeRO-" + std::to_string(z) + ", block inputs offloaded: ";
    const run kept = z == 1 ? zero1 : data_parallel(m, comm, z);
    const run off = data_parallel(m, comm, z, 1, false, mb::schedule_choice::of(mb::schedules::none{}), false, true);
    check(same_bits(off.losses, kept.losses) && off.weights == kept.weights && off.optimizer == kept.optimizer,
          stage + "schedule none's losses, weights and optimizer state, bit for bit");
    check(off.peak == off.predicted, stage + "measured device peak " + std::to_string(off.peak) + " == predicted " +
                                         std::to_string(off.predicted));
    check(off.predicted_host != 0 && off.host_peak == off.predicted_host,
          stage + "measured host peak " + std::to_string(off.host_peak) + " == predicted " +
              std::to_string(off.predicted_host) + " (not 0: the DP offloads)");
  }

  // ZeRO-2 against ZeRO-0 and ZeRO-1.
  {
    const run zero2 = data_parallel(m, comm, 2);
    const std::size_t A = effective.batch / N;  // micro-batches per rank and step
    check(zero2.peak == zero2.predicted, "ZeRO-2: measured peak " + std::to_string(zero2.peak) + " == predicted " +
                                             std::to_string(zero2.predicted));
    check(zero2.memory.gradients == (N == 1 ? n : shard.size()) * sizeof(float),
          "ZeRO-2: this rank keeps the gradients of its shard only (" + std::to_string(zero2.memory.gradients) + " bytes)");
    check(zero2.optimizer.size() == zero1.optimizer.size(), "ZeRO-2: the optimizer shard of ZeRO-1");
    if (A == 1) {
      // One micro-batch per rank: each shard element is ZeRO-0's rank-order sum of the same values.
      check(same_bits(zero2.losses, dp.losses) && zero2.weights == dp.weights && zero2.optimizer == zero1.optimizer,
            "ZeRO-2, one micro-batch per rank: ZeRO-0's losses and weights and ZeRO-1's optimizer state, bit for bit");
    }
    double gap = 0;
    for (std::size_t k = 0; k < steps; ++k) gap = std::max(gap, std::abs(zero2.losses[k] - dp.losses[k]) / std::abs(dp.losses[k]));
    check(gap <= 1e-5, "ZeRO-2: ZeRO-0's loss curve within 1e-5 relative (worst " + std::to_string(gap) + ")");
    check(zero2.weights == rank0(comm, zero2.weights), "ZeRO-2: every rank holds rank 0's weights");
    // Bytes sent per step: each micro-batch's reduce-scatter (4·(n − s)), the weights' all-gather
    // (4·s·(N − 1)), the norm's and loss's doubles as under ZeRO-1.
    const std::uint64_t s2 = shard.size();
    const std::uint64_t per_step2 =
        N == 1 ? 0 : A * 4 * (n - s2) + 4 * s2 * (N - 1) + 8 * (N - 1) + (me == 0 ? 16 * (N - 1) : 16);
    check(zero2.bytes_sent == steps * per_step2, "ZeRO-2: bytes sent " + std::to_string(zero2.bytes_sent) + " == " +
                                                     std::to_string(steps) + " x " + std::to_string(per_step2));
    double gap_all = 0;
    MPI_Allreduce(&gap, &gap_all, 1, MPI_DOUBLE, MPI_MAX, comm.native());
    if (me == 0) {
      std::printf("ZeRO-2 (%zu micro-batch(es) per rank): gradient bytes per rank %llu (ZeRO-0/1: %zu), peak per rank "
                  "%zu (ZeRO-1 %zu, ZeRO-0 %zu), worst relative loss gap to ZeRO-0 %.3g, bytes sent per step %.0f\n",
                  A, static_cast<unsigned long long>(zero2.memory.gradients), m.weight_bytes(), zero2.peak, zero1.peak,
                  dp.peak, gap_all, static_cast<double>(zero2.bytes_sent) / steps);
    }
    if (N == 2) {
      // Micro-batches of 2: one per rank, so ZeRO-2 gives ZeRO-0's bits (against ZeRO-0 with the same micro-batch).
      const run z0 = data_parallel(m, comm, 0, 2);
      const run z2 = data_parallel(m, comm, 2, 2);
      check(same_bits(z2.losses, z0.losses) && z2.weights == z0.weights,
            "ZeRO-2 with one micro-batch of 2 per rank: ZeRO-0's losses and weights, bit for bit");
      check(z2.peak == z2.predicted, "ZeRO-2, micro-batch 2: measured peak == predicted");
    }
    // Overlapped: each block's reduce-scatter in flight through the next block's backward (and,
    // under a checkpoint schedule, through the retape ops before it). The same sums in the same
    // order, so blocking's bits; the measured peak is still the prediction, which counts the
    // bucket and workspace in flight.
    {
      const mb::schedule_choice full = mb::schedule_choice::of(mb::schedules::full{});
      const run z2o = data_parallel(m, comm, 2, 1, true);
      const run z2f = data_parallel(m, comm, 2, 1, false, full);
      const run z2fo = data_parallel(m, comm, 2, 1, true, full);
      check(z2o.peak == z2o.predicted, "ZeRO-2 overlapped: measured peak " + std::to_string(z2o.peak) + " == predicted " +
                                           std::to_string(z2o.predicted));
      check(z2fo.peak == z2fo.predicted, "ZeRO-2 overlapped, schedule full: measured peak " + std::to_string(z2fo.peak) +
                                             " == predicted " + std::to_string(z2fo.predicted));
      check(z2f.peak == z2f.predicted, "ZeRO-2, schedule full: measured peak == predicted");
      check(same_bits(z2o.losses, zero2.losses) && z2o.weights == zero2.weights && z2o.optimizer == zero2.optimizer,
            "ZeRO-2 overlapped: the blocking path's losses, weights and optimizer state, bit for bit");
      check(same_bits(z2fo.losses, z2f.losses) && z2fo.weights == z2f.weights && z2fo.optimizer == z2f.optimizer,
            "ZeRO-2 overlapped, schedule full: the blocking path's bits");
      check(z2o.bytes_sent == zero2.bytes_sent, "ZeRO-2 overlapped: the blocking path's bytes sent");
      check(N == 1 || z2o.peak >= zero2.peak, "ZeRO-2 overlapped: a peak no lower than blocking's (a bucket in flight)");
      if (N == 2) {
        const run z2 = data_parallel(m, comm, 2, 2);
        const run z2o2 = data_parallel(m, comm, 2, 2, true);
        check(same_bits(z2o2.losses, z2.losses) && z2o2.weights == z2.weights && z2o2.peak == z2o2.predicted,
              "ZeRO-2 overlapped, micro-batch 2: the blocking path's bits, measured peak == predicted");
      }
      if (me == 0) {
        std::printf("ZeRO-2 overlapped: peak per rank %zu (blocking %zu), schedule full %zu (blocking %zu), "
                    "measured == predicted\n",
                    z2o.peak, zero2.peak, z2fo.peak, z2f.peak);
      }
    }
    if (N > 1) {
      // A blocking ZeRO-1 plan given to an overlapping ZeRO-1 trainer is refused, naming the plan.
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      bool threw = false;
      try {
        mb::trainer t(m, effective, plan_for(m, A, shard.size()), a, pool, options(1, true), mb::null_monitor{}, comm);
      } catch (const mb::invalid_argument& e) {
        threw = std::string(e.argument()) == "plan";
      }
      check(threw, "ZeRO-1 overlapped given a blocking plan: invalid_argument naming the plan");
      threw = false;
      try {
        mb::trainer t(m, effective, plan_for(m, A), a, pool, options(0, true), mb::null_monitor{}, comm);
      } catch (const mb::invalid_argument& e) {
        threw = std::string(e.argument()) == "plan";
      }
      check(threw, "ZeRO-0 overlapped given a blocking plan: invalid_argument naming the plan");
      // An overlapped plan given to a blocking trainer, likewise.
      threw = false;
      try {
        mb::trainer t(m, effective, plan_for(m, A, 0, mb::gradient_exchange_of<float>(comm, 0, true)), a, pool, options(0),
                      mb::null_monitor{}, comm);
      } catch (const mb::invalid_argument& e) {
        threw = std::string(e.argument()) == "plan";
      }
      check(threw, "blocking ZeRO-0 given an overlapped plan: invalid_argument naming the plan");
      // A blocking plan given to an overlapping trainer is refused, naming the plan.
      threw = false;
      try {
        mb::trainer t(m, effective, plan_for(m, A, shard.size(), mb::gradient_shards_of<float>(comm)), a, pool,
                      options(2, true), mb::null_monitor{}, comm);
      } catch (const mb::invalid_argument& e) {
        threw = std::string(e.argument()) == "plan";
      }
      check(threw, "ZeRO-2 overlapped given a blocking plan: invalid_argument naming the plan");
    }
    if (N > 1) {
      // ZeRO-2's plan states the gradient shard; a ZeRO-1 plan given to a ZeRO-2 trainer is refused.
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      bool threw = false;
      try {
        mb::trainer t(m, effective, plan_for(m, A, shard.size()), a, pool, options(2), mb::null_monitor{}, comm);
      } catch (const mb::invalid_argument& e) {
        threw = std::string(e.argument()) == "plan";
      }
      check(threw, "ZeRO-2 given a ZeRO-1 plan: invalid_argument naming the plan");
    }
  }

  // ZeRO-3 (the weights sharded too): ZeRO-2's losses, optimizer state and (this rank's shard of
  // the) weights bit for bit, blocking and overlapped (the next block's gather prefetched into a
  // second slot), with one micro-batch per rank and with more; the measured peak is the
  // prediction, ZeRO-2's less exactly the weights no longer held plus the gathered ones; the bytes
  // sent are the exact sum of the gathers; evaluation gathers too and gives ZeRO-2's loss.
  if (N > 1) {
    for (const std::size_t micro : {std::size_t{1}, std::size_t{2}}) {
      if (effective.batch / N / micro == 0) continue;
      for (const bool ov : {false, true}) {
        const std::string at = std::string("ZeRO-3") + (ov ? " overlapped" : "") + ", micro-batches of " +
                               std::to_string(micro) + ": ";
        const run z2 = data_parallel(m, comm, 2, micro, ov);
        const run z3 = data_parallel(m, comm, 3, micro, ov);
        const std::size_t A = effective.batch / N / micro;
        check(z3.peak == z3.predicted, at + "measured peak " + std::to_string(z3.peak) + " == predicted " +
                                           std::to_string(z3.predicted));
        check(z3.memory.weights == shard.size() * sizeof(float),
              at + "this rank keeps the weights of its shard only (" + std::to_string(z3.memory.weights) + " bytes)");
        check(same_bits(z3.losses, z2.losses) && z3.optimizer == z2.optimizer,
              at + "ZeRO-2's losses and optimizer state, bit for bit");
        check(z3.weights.size() == shard.size() * sizeof(float) &&
                  std::memcmp(z3.weights.data(), z2.weights.data() + shard.begin * sizeof(float), z3.weights.size()) == 0,
              at + "this rank's shard of ZeRO-2's weights, bit for bit");
        const std::size_t gather = mb::weight_gather_bytes(m, ov);
        check(z3.peak + (n - shard.size()) * sizeof(float) == z2.peak + gather,
              at + "peak " + std::to_string(z3.peak) + " = ZeRO-2's " + std::to_string(z2.peak) + " less the " +
                  std::to_string((n - shard.size()) * sizeof(float)) + " weight bytes others hold, plus " +
                  std::to_string(gather) + " gathered");
        // Bytes sent: ZeRO-2's less its weight all-gather, plus every gather's part of this rank
        // (per micro-batch, as schedule none reads the units: the embedding, forward 0..L-1, the
        // head (its norm and the tied table), backward L-1..0. One slot gathers every block twice;
        // with two, the backward finds block L-1 still in its slot).
        const auto part = [&](mb::shard_range r) -> std::uint64_t {
          return 4 * mb::overlap(shard, r.begin, r.end).size() * (N - 1);
        };
        std::uint64_t per_micro = part(m.embedding_parameters()) + part(m.head_parameters()) +
                                  (m.config().tie_embeddings ? part(m.embedding_parameters()) : 0);
        const std::size_t L = m.depth(), kept = ov ? 1 : 0;  // blocks the backward finds in a slot
        for (std::size_t i = 0; i < L; ++i) per_micro += part(m.block_parameters(i)) * (i + kept >= L ? 1 : 2);
        const std::uint64_t s3 = shard.size();
        const std::uint64_t per_step = A * 4 * (n - s3) + A * per_micro + 8 * (N - 1) + (me == 0 ? 16 * (N - 1) : 16);
        check(z3.bytes_sent == steps * per_step, at + "bytes sent " + std::to_string(z3.bytes_sent) + " == " +
                                                     std::to_string(steps) + " x " + std::to_string(per_step));
        if (me == 0 && micro == 1) {
          std::printf("ZeRO-3%s (%zu micro-batch(es) per rank): weight bytes per rank %zu (ZeRO-2: %zu) + %zu gathered "
                      "in a step; peak per rank %zu (ZeRO-2 %zu); bytes sent per step %.0f (ZeRO-2 %.0f)\n",
                      ov ? " overlapped" : "", A, z3.memory.weights, m.weight_bytes(), gather, z3.peak, z2.peak,
                      static_cast<double>(z3.bytes_sent) / steps, static_cast<double>(z2.bytes_sent) / steps);
        }
      }
    }
    // On a planned caching stack (caching_options::planned: the run served from the plan's layout)
    // ZeRO-2's buckets and ZeRO-3's gathered weights follow the layout: the reserved peak is the
    // predicted one, and the bits are those of the unplanned stack. (ZeRO-3's steps and its
    // evaluation both begin with the gathered buffer: the trainer restarts the layout's cycle at
    // each step, caching_allocator::restart_cycle, which sizes alone could not tell.)
    for (const std::size_t z : {std::size_t{2}, std::size_t{3}}) {
      for (const bool ov : {false, true}) {
        const std::string at = "ZeRO-" + std::to_string(z) + (ov ? " overlapped" : "") + " on a planned stack: ";
        mb::caching_options co;
        co.planned = true;
        planned_t a(std::size_t{1} << 30, co);
        mb::thread_pool pool(1);
        const mb::gradient_shards gs = mb::gradient_exchange_of<float>(comm, z, ov);
        mb::trainer t(m, effective, plan_for(m, effective.batch / N, shard.size(), gs), a, pool, options(z, ov),
                      mb::null_monitor{}, comm);
        const run r = finish(t, a);
        const run flat = data_parallel(m, comm, z, 1, ov);
        check(r.peak == r.predicted && r.reserved == r.predicted_reserve,
              at + "measured peak " + std::to_string(r.peak) + " and reserve " + std::to_string(r.reserved) +
                  " == predicted " + std::to_string(r.predicted) + ", " + std::to_string(r.predicted_reserve));
        const mb::memory_layout* layout = mb::planned_layer(a)->layout();
        check(layout != nullptr && r.reserved == layout->prefix_extent + layout->cycle_extent,
              at + "reserved " + std::to_string(r.reserved) + " == the layout's two segments (no request strayed)");
        check(same_bits(r.losses, flat.losses) && r.optimizer == flat.optimizer && r.weights == flat.weights,
              at + "the unplanned stack's losses, optimizer state and weights, bit for bit");
        // An evaluation after the step follows the layout's tail (its gathered weights included).
        text_source src(membound_test::small_config().vocab);
        (void)t.evaluate(src, 3, 7);
        check(a.stats().peak_reserved == r.reserved, at + "an evaluation after the steps reserves nothing more (" +
                                                         std::to_string(a.stats().peak_reserved) + ")");
      }
    }
    // The head's units on other models: an untied head (its own table, one piece), and a tied
    // table larger than the blocks, so that on 2 ranks rank 1's shard meets both the table and
    // the final norm (the head gathered part by part, blocking, and not prefetched).
    for (const bool tied : {false, true}) {
      mb::model_config c = membound_test::small_config();
      c.tie_embeddings = tied;
      if (tied) c.vocab = 4000;
      const model_t mm(c);
      for (const bool ov : {false, true}) {
        const std::string at = std::string("ZeRO-3") + (ov ? " overlapped" : "") + (tied ? ", a tied table of 4000" :
                                                                                              ", an untied head") + ": ";
        const run z2 = data_parallel(mm, comm, 2, 1, ov);
        const run z3 = data_parallel(mm, comm, 3, 1, ov);
        check(z3.peak == z3.predicted, at + "measured peak " + std::to_string(z3.peak) + " == predicted " +
                                           std::to_string(z3.predicted));
        check(same_bits(z3.losses, z2.losses) && z3.optimizer == z2.optimizer,
              at + "ZeRO-2's losses and optimizer state, bit for bit");
      }
    }
    // A ZeRO-2 plan given to a ZeRO-3 trainer is refused, naming the plan (its weights differ).
    {
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      const mb::gradient_shards gs2 = mb::gradient_exchange_of<float>(comm, 2, false);
      bool threw = false;
      try {
        mb::trainer t(m, effective, plan_for(m, effective.batch / N, shard.size(), gs2), a, pool, options(3),
                      mb::null_monitor{}, comm);
      } catch (const mb::invalid_argument& e) {
        threw = std::string(e.argument()) == "plan";
      }
      check(threw, "ZeRO-3 given a ZeRO-2 plan: invalid_argument naming the plan");
    }
    // Evaluation under ZeRO-3 gathers each block and gives ZeRO-2's loss, bit for bit, at the plan's peak or below;
    // so does decoding (steps with and without the head's logits, a restart) give ZeRO-2's logits.
    {
      double losses[2] = {0, 0};
      std::size_t peaks[2] = {0, 0}, predicted[2] = {0, 0};
      std::vector<double> decoded[2];
      for (const std::size_t z : {std::size_t{2}, std::size_t{3}}) {
        alloc_t a(std::size_t{1} << 30);
        mb::thread_pool pool(1);
        const mb::gradient_shards gs = mb::gradient_exchange_of<float>(comm, z, false);
        mb::trainer t(m, effective, plan_for(m, effective.batch / N, shard.size(), gs), a, pool, options(z),
                      mb::null_monitor{}, comm);
        text_source src(membound_test::small_config().vocab);
        (void)t.step(src);
        a.reset_peaks();
        losses[z - 2] = t.evaluate(src, 3, 7);
        peaks[z - 2] = a.stats().peak_requested;
        predicted[z - 2] = t.largest_predicted_peak();
        const std::int32_t ids[5] = {3, 17, 0, 39, 8};
        std::vector<double> logits(m.config().vocab);
        t.decode(1, 5, [&](auto& d) {
          for (int pass = 0; pass < 2; ++pass) {
            for (std::size_t k = 0; k < 5; ++k) {
              d.step(&ids[k], k == 1 || k == 4 ? logits.data() : nullptr);
              decoded[z - 2].insert(decoded[z - 2].end(), logits.begin(), logits.end());
            }
            d.restart();
          }
        });
      }
      check(same_bits(std::vector<double>{losses[1]}, std::vector<double>{losses[0]}),
            "ZeRO-3 evaluate: ZeRO-2's loss, bit for bit");
      check(same_bits(decoded[1], decoded[0]), "ZeRO-3 decode: ZeRO-2's logits, bit for bit");
      check(peaks[1] <= predicted[1], "ZeRO-3 evaluate: its peak " + std::to_string(peaks[1]) + " within the plan's " +
                                          std::to_string(predicted[1]));
    }
  }

  // ZeRO-0/1 overlapped: the last micro-batch's block i starts its exchange (ZeRO-0 an all-reduce of
  // the block's range, ZeRO-1 a reduce-scatter of it into the shards) as its backward ends; it runs
  // through the next block's backward. Every element's sum is the blocking path's rank-order sum,
  // so the bits are blocking's, with schedules none and full, one micro-batch per rank (N = 4),
  // two (N = 2: the first accumulates, the last exchanges) and one of 2 (N = 2); the measured peak
  // and reserve equal the predictions (the workspace in flight planned as the backward's carry).
  if (N > 1) {
    const mb::schedule_choice full = mb::schedule_choice::of(mb::schedules::full{});
    const run z0o = data_parallel(m, comm, 0, 1, true);
    const run z1o = data_parallel(m, comm, 1, 1, true);
    const run z0f = data_parallel(m, comm, 0, 1, false, full);
    const run z0fo = data_parallel(m, comm, 0, 1, true, full);
    const run z1f = data_parallel(m, comm, 1, 1, false, full);
    const run z1fo = data_parallel(m, comm, 1, 1, true, full);
    for (const auto& [r, what] : {std::pair{&z0o, "ZeRO-0 overlapped"}, std::pair{&z1o, "ZeRO-1 overlapped"},
                                  std::pair{&z0fo, "ZeRO-0 overlapped, schedule full"},
                                  std::pair{&z1fo, "ZeRO-1 overlapped, schedule full"}}) {
      check(r->peak == r->predicted, std::string(what) + ": measured peak " + std::to_string(r->peak) + " == predicted " +
                                         std::to_string(r->predicted));
      check(r->reserved == r->predicted_reserve, std::string(what) + ": measured reserve " + std::to_string(r->reserved) +
                                                     " == predicted " + std::to_string(r->predicted_reserve));
      check(r->weights == rank0(comm, r->weights), std::string(what) + ": every rank holds rank 0's weights");
    }
    check(same_bits(z0o.losses, dp.losses) && z0o.weights == dp.weights && z0o.optimizer == dp.optimizer,
          "ZeRO-0 overlapped: the blocking path's losses, weights and optimizer state, bit for bit");
    check(same_bits(z1o.losses, zero1.losses) && z1o.weights == zero1.weights && z1o.optimizer == zero1.optimizer,
          "ZeRO-1 overlapped: the blocking path's losses, weights and optimizer state, bit for bit");
    check(same_bits(z0fo.losses, z0f.losses) && z0fo.weights == z0f.weights && z0fo.optimizer == z0f.optimizer,
          "ZeRO-0 overlapped, schedule full: the blocking path's bits");
    check(same_bits(z1fo.losses, z1f.losses) && z1fo.weights == z1f.weights && z1fo.optimizer == z1f.optimizer,
          "ZeRO-1 overlapped, schedule full: the blocking path's bits");
    // ZeRO-1: each rank still sends every other rank its part of the gradient once: blocking's
    // bytes exactly. ZeRO-0: the all-reduces are cut by blocks, not by the headroom's buckets, so a
    // rank's share differs, but the world's total (2·(N − 1) per element) is blocking's.
    check(z1o.bytes_sent == zero1.bytes_sent, "ZeRO-1 overlapped: the blocking path's bytes sent");
    unsigned long long sent[2] = {dp.bytes_sent, z0o.bytes_sent}, total[2] = {};
    MPI_Allreduce(sent, total, 2, MPI_UNSIGNED_LONG_LONG, MPI_SUM, comm.native());
    check(total[0] == total[1], "ZeRO-0 overlapped: the blocking path's bytes sent over all ranks (" +
                                    std::to_string(total[1]) + " vs " + std::to_string(total[0]) + ")");
    check(z0o.memory.exchange > 0 && z1o.memory.exchange > 0, "ZeRO-0/1 overlapped: an exchange buffer in the plan line");
    if (N == 2) {
      const run z0 = data_parallel(m, comm, 0, 2), z1 = data_parallel(m, comm, 1, 2);
      const run z0o2 = data_parallel(m, comm, 0, 2, true), z1o2 = data_parallel(m, comm, 1, 2, true);
      check(same_bits(z0o2.losses, z0.losses) && z0o2.weights == z0.weights && z0o2.peak == z0o2.predicted,
            "ZeRO-0 overlapped, micro-batch 2: the blocking path's bits, measured peak == predicted");
      check(same_bits(z1o2.losses, z1.losses) && z1o2.weights == z1.weights && z1o2.peak == z1o2.predicted,
            "ZeRO-1 overlapped, micro-batch 2: the blocking path's bits, measured peak == predicted");
    }
    if (me == 0) {
      std::printf("ZeRO-0/1 overlapped: peak per rank %zu / %zu (blocking %zu / %zu), schedule full %zu / %zu (blocking "
                  "%zu / %zu), exchange buffer %llu / %llu bytes, measured == predicted\n",
                  z0o.peak, z1o.peak, dp.peak, zero1.peak, z0fo.peak, z1fo.peak, z0f.peak, z1f.peak,
                  static_cast<unsigned long long>(z0o.memory.exchange), static_cast<unsigned long long>(z1o.memory.exchange));
    }
  }

  // bf16 storage over ranks: gradients move as 16 bits and are summed in fp32 in rank order,
  // rounded once; AdamW's fp32 masters, m and v are sharded under ZeRO-1/2 (DeepSpeed's mixed
  // precision layout, 2 + 2 + 12 bytes per parameter).
  {
    using half_t = membound_test::hybrid<mb::bf16_precision>;
    const half_t mh(membound_test::small_config());
    const std::size_t nh = mh.parameter_elements();
    const std::size_t sh = mb::shard_of(nh, N, me).size();
    const run h1 = one_process(mh);
    const run h0 = data_parallel(mh, comm, 0);
    const run h1z = data_parallel(mh, comm, 1);
    const run h2 = data_parallel(mh, comm, 2);
    const run h2o = data_parallel(mh, comm, 2, 1, true);
    const run h0o = data_parallel(mh, comm, 0, 1, true);
    const run h1o = data_parallel(mh, comm, 1, 1, true);
    check(h0o.peak == h0o.predicted && h1o.peak == h1o.predicted && h0o.reserved == h0o.predicted_reserve &&
              h1o.reserved == h1o.predicted_reserve,
          "bf16: measured peak and reserve == predicted under ZeRO-0 and 1 overlapped (" + std::to_string(h0o.peak) + ", " +
              std::to_string(h1o.peak) + ")");
    check(same_bits(h0o.losses, h0.losses) && h0o.weights == h0.weights && h0o.optimizer == h0.optimizer,
          "bf16: ZeRO-0 overlapped gives blocking ZeRO-0's bits");
    const std::size_t A = effective.batch / N;
    check(h0.peak == h0.predicted && h1z.peak == h1z.predicted && h2.peak == h2.predicted && h2o.peak == h2o.predicted,
          "bf16: measured peak == predicted under ZeRO-0, 1, 2 and 2 overlapped (" + std::to_string(h0.peak) + ", " +
              std::to_string(h1z.peak) + ", " + std::to_string(h2.peak) + ", " + std::to_string(h2o.peak) + ")");
    double gap = 0;
    for (const run* r : {&h0, &h1z, &h2}) {
      for (std::size_t k = 0; k < steps; ++k) gap = std::max(gap, std::abs(r->losses[k] - h1.losses[k]) / std::abs(h1.losses[k]));
    }
    if (N == 1) {
      check(same_bits(h0.losses, h1.losses) && h0.weights == h1.weights, "bf16, one rank: one process's bits");
    }
    // One process adds each micro-batch's gradient into bf16 (a rounding per micro-batch); N
    // ranks add theirs, then the exchange sums the N partial sums in fp32 and rounds once. So the
    // gradients differ by bf16 roundings (2^-9 relative), and 30 steps of AdamW at lr 1e-2 carry
    // that into the losses as they carry bf16's own rounding: the tolerance is twice the gap
    // between bf16 and fp32 storage in one process (about 1.5% here, at the same steps), i.e.
    // going over ranks may cost no more than storing in bf16 does. Step 1's loss, before any
    // update, differs only by the order of the loss's double sum.
    double precision_gap = 0;
    for (std::size_t k = 0; k < steps; ++k) {
      precision_gap = std::max(precision_gap, std::abs(h1.losses[k] - ref.losses[k]) / std::abs(ref.losses[k]));
    }
    check(gap <= 2 * precision_gap, "bf16 over " + std::to_string(N) + " rank(s): one process's loss curve within twice "
                                    "bf16's own gap to fp32 (" + std::to_string(gap) + " <= 2 x " +
                                    std::to_string(precision_gap) + ")");
    for (const run* r : {&h0, &h1z, &h2}) {
      check(std::abs(r->losses[0] - h1.losses[0]) <= 1e-6 * std::abs(h1.losses[0]), "bf16: step 1's loss is one process's");
    }
    check(h1z.losses.back() < h1z.losses.front(), "bf16: the loss falls");
    // The sums are the same per element in every stage: ZeRO-1's and (one micro-batch per rank)
    // ZeRO-2's bits are ZeRO-0's; overlapped ZeRO-2 is blocking ZeRO-2's.
    check(same_bits(h1z.losses, h0.losses) && h1z.weights == h0.weights, "bf16: ZeRO-1 gives ZeRO-0's bits");
    check(same_bits(h1o.losses, h1z.losses) && h1o.weights == h1z.weights && h1o.optimizer == h1z.optimizer,
          "bf16: ZeRO-1 overlapped gives blocking ZeRO-1's bits");
    if (A == 1) check(same_bits(h2.losses, h0.losses) && h2.weights == h0.weights, "bf16: ZeRO-2 gives ZeRO-0's bits");
    check(same_bits(h2o.losses, h2.losses) && h2o.weights == h2.weights && h2o.optimizer == h2.optimizer,
          "bf16: ZeRO-2 overlapped gives blocking ZeRO-2's bits");
    check(h2.weights == rank0(comm, h2.weights), "bf16: every rank holds rank 0's weights");
    // Model states per rank: 2 bytes of weights per parameter, 2 of gradients (ZeRO-2: of its
    // shard), 12 of optimizer state (m, v, fp32 master; ZeRO-1/2: of its shard).
    const std::size_t states0 = h0.memory.weights + h0.memory.gradients + h0.memory.optimizer;
    const std::size_t states1 = h1z.memory.weights + h1z.memory.gradients + h1z.memory.optimizer;
    const std::size_t states2 = h2.memory.weights + h2.memory.gradients + h2.memory.optimizer;
    const std::size_t s1 = N == 1 ? nh : sh;
    check(states0 == 16 * nh && states1 == 4 * nh + 12 * s1 && states2 == 2 * nh + 14 * s1,
          "bf16 model states per rank: 16P, 4P + 12s, 2P + 14s (" + std::to_string(states0) + ", " +
              std::to_string(states1) + ", " + std::to_string(states2) + ")");
    double gap_all = 0;
    MPI_Allreduce(&gap, &gap_all, 1, MPI_DOUBLE, MPI_MAX, comm.native());
    if (me == 0) {
      std::printf("bf16 over %zu rank(s): worst relative loss gap to one process %.3g over ZeRO-0/1/2 (bf16 vs fp32 in one "
                  "process: %.3g); model states per rank %zu / %zu / %zu (P = %zu); peaks %zu / %zu / %zu / %zu "
                  "overlapped, measured == predicted\n",
                  N, gap_all, precision_gap, states0, states1, states2, nh, h0.peak, h1z.peak, h2.peak, h2o.peak);
    }
  }

  // Sharded checkpoints.
  if (N > 1) {
    char dir[512] = {};
    if (me == 0) {
      const auto d = std::filesystem::temp_directory_path() / ("membound_test_zero1_" + std::to_string(::getpid()));
      std::filesystem::create_directories(d);
      std::snprintf(dir, sizeof dir, "%s", d.c_str());
    }
    comm.broadcast(dir, sizeof dir, 0);
    const std::string path = std::string(dir) + "/run.ckpt";
    text_source src(membound_test::small_config().vocab);
    const std::size_t half = steps / 2;
    std::vector<double> losses;
    {
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      mb::trainer t(m, effective, plan_for(m, effective.batch / N, shard.size()), a, pool, options(1), mb::null_monitor{},
                    comm);
      for (std::size_t k = 0; k < half; ++k) losses.push_back(t.step(src).loss);
      t.save(path);
      t.save(path);  // again: the manifest names the same files; nothing is left behind
    }
    {
      const mb::checkpoint_reader r(std::string(dir) + "/run.ckpt.step-" + std::to_string(half) + ".rank-" +
                                    std::to_string(me) + "-of-" + std::to_string(N));
      check(r.size("weights") == shard.size() * sizeof(float) && r.size("optimizer") == opt::state_bytes(shard.size()),
            "a shard file holds this rank's slice of the weights and its optimizer state");
    }
    {
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      mb::trainer t(m, effective, plan_for(m, effective.batch / N, shard.size()), a, pool, options(1), mb::null_monitor{},
                    comm);
      t.load(path);
      check(t.steps_done() == half, "resumed at step " + std::to_string(half));
      for (std::size_t k = half; k < steps; ++k) losses.push_back(t.step(src).loss);
      const auto* w = static_cast<const unsigned char*>(static_cast<const void*>(t.weights()));
      check(same_bits(losses, zero1.losses) && std::vector<unsigned char>(w, w + m.weight_bytes()) == zero1.weights,
            "ZeRO-1 resumed from its shards: the losses and weights of the uninterrupted run, bit for bit");
    }
    {
      // Every field of a manifest is checked against the run, at the same world size too: a copy of
      // it with a valid checksum and one edited field (the parameter count) is refused by name on
      // every rank, nothing loaded.
      const std::string forged = std::string(dir) + "/forged.ckpt";
      if (me == 0) {
        const std::vector<mb::fingerprint_field> f = mb::read_checkpoint_manifest(mb::checkpoint_reader(path), path);
        std::string text;
        for (const mb::fingerprint_field& e : f) {
          text += e.name + "=" + (e.name == "parameters" ? std::to_string(m.parameter_elements() + 1) : e.value) + "\n";
        }
        mb::checkpoint_writer cw;
        cw.add_value<std::uint64_t>("format", mb::checkpoint_format_version);
        cw.add("manifest", text.data(), text.size());
        cw.commit(forged);
      }
      comm.barrier();
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      mb::trainer t(m, effective, plan_for(m, effective.batch / N, shard.size()), a, pool, options(1), mb::null_monitor{},
                    comm);
      bool refused = false;
      try {
        t.load(forged);
      } catch (const mb::checkpoint_mismatch& e) {
        refused = e.field() == "parameters";
      }
      check(refused && t.steps_done() == 0, "a manifest with an edited parameter count: checkpoint_mismatch naming "
                                            "parameters on every rank, nothing loaded");
      comm.barrier();
      if (me == 0) std::filesystem::remove(forged);
    }
    {
      // A save killed at any point of its protocol (each rank writes its shard under a temporary
      // and renames it; rank 0 then commits the manifest the same way; then each rank removes the
      // files no manifest names) leaves one of the folders below. The next load resumes the
      // committed step and leaves exactly the files its manifest names: no orphaned shard, no
      // temporary of a dead writer. A: step `half` (the files at `path` now); B: one step on.
      namespace fs = std::filesystem;
      const fs::path folder(dir);
      std::vector<std::string> sa, sb;
      for (std::size_t r = 0; r < N; ++r) {
        sa.push_back(mb::checkpoint_shard_name(path, half, r, N));
        sb.push_back(mb::checkpoint_shard_name(path, half + 1, r, N));
      }
      const auto run_files = [&] {
        std::vector<std::string> v;
        for (const auto& e : fs::directory_iterator(folder)) {
          const std::string n = e.path().filename().string();
          if (n.rfind("run.ckpt", 0) == 0) v.push_back(n);
        }
        std::sort(v.begin(), v.end());
        return v;
      };
      const auto set_aside = [&](const char* sub, const std::vector<std::string>& names) {
        if (me != 0) return;
        fs::create_directories(folder / sub);
        for (const std::string& n : names) fs::copy_file(folder / n, folder / sub / n, fs::copy_options::overwrite_existing);
      };
      std::vector<std::string> files_a = sa, files_b = sb;
      files_a.push_back("run.ckpt");
      files_b.push_back("run.ckpt");
      set_aside("A", files_a);
      comm.barrier();
      {
        alloc_t a(std::size_t{1} << 30);
        mb::thread_pool pool(1);
        mb::trainer t(m, effective, plan_for(m, effective.batch / N, shard.size()), a, pool, options(1),
                      mb::null_monitor{}, comm);
        t.load(path);
        (void)t.step(src);
        t.save(path);
      }
      comm.barrier();
      set_aside("B", files_b);
      const pid_t gone = 2147483646;  // above any pid_max: no process has it
      check(mb::detail::process_gone(gone), "the dead writer's pid names no process");
      const std::string tmp = ".tmp." + std::to_string(gone);
      struct crash {
        std::string point;
        bool committed;                   // B's manifest committed
        std::vector<std::string> from_a;  // besides A's manifest or B's
        std::vector<std::string> from_b;
        std::vector<std::string> temporaries;
      };
      std::vector<std::string> b_temps, b_rest_temps;
      for (std::size_t r = 0; r < N; ++r) {
        b_temps.push_back(sb[r] + tmp);
        if (r > 0) b_rest_temps.push_back(sb[r] + tmp);
      }
      const std::vector<crash> crashes{
          {"after the manifest's commit, before any removal", true, sa, sb, {}},
          {"after the manifest's commit, removal half done", true, {sa.back()}, sb, {}},
          {"while every rank writes its shard", false, sa, {}, b_temps},
          {"rank 0's shard committed, the others' being written", false, sa, {sb[0]}, b_rest_temps},
          {"every shard committed, the manifest being written", false, sa, sb, {"run.ckpt" + tmp, "run.ckpt" + tmp + ".1"}},
      };
      for (const crash& c : crashes) {
        if (me == 0) {
          for (const std::string& n : run_files()) fs::remove(folder / n);
          fs::copy_file(folder / (c.committed ? "B" : "A") / "run.ckpt", folder / "run.ckpt");
          for (const std::string& n : c.from_a) fs::copy_file(folder / "A" / n, folder / n);
          for (const std::string& n : c.from_b) fs::copy_file(folder / "B" / n, folder / n);
          for (const std::string& n : c.temporaries) std::fclose(std::fopen((folder / n).c_str(), "wb"));
        }
        comm.barrier();
        alloc_t a(std::size_t{1} << 30);
        mb::thread_pool pool(1);
        mb::trainer t(m, effective, plan_for(m, effective.batch / N, shard.size()), a, pool, options(1),
                      mb::null_monitor{}, comm);
        t.load(path);
        comm.barrier();
        std::vector<std::string> want = c.committed ? files_b : files_a;
        std::sort(want.begin(), want.end());
        check(t.steps_done() == (c.committed ? half + 1 : half) && run_files() == want,
              "a save killed " + c.point + ": the load resumes step " + std::to_string(c.committed ? half + 1 : half) +
                  " and leaves exactly its manifest and the " + std::to_string(N) + " shards it names");
        comm.barrier();
      }
      if (me == 0) {
        fs::remove_all(folder / "A");
        fs::remove_all(folder / "B");
      }
      comm.barrier();
    }
    // Run settings over ranks: the shards under another peak lr are refused on every rank with
    // nothing loaded, through load_shards (N ranks) and load_resharded (one process); accepted,
    // they load and the change is listed.
    for (const bool alone : {false, true}) {
      mb::mpi_communicator self_comm(MPI_COMM_SELF);
      mb::trainer_options other = options(alone ? 0 : 1);
      other.lr.peak = 5e-3;
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      const mb::training_plan p = alone ? plan_for(m, effective.batch) : plan_for(m, effective.batch / N, shard.size());
      mb::trainer t(m, effective, p, a, pool, other, mb::null_monitor{}, alone ? self_comm : comm);
      const auto* w = static_cast<const unsigned char*>(static_cast<const void*>(t.weights()));
      const std::vector<unsigned char> before(w, w + m.weight_bytes());
      const std::string how = alone ? "re-sharded into one process" : "ZeRO-1 shards";
      bool refused = false;
      try {
        t.load(path);
      } catch (const mb::checkpoint_run_changed& e) {
        refused = e.field() == "lr.peak" && e.changes().size() == 1;
      }
      check(refused && t.steps_done() == 0 && std::vector<unsigned char>(w, w + m.weight_bytes()) == before &&
                t.changed_at_load().empty(),
            how + " under another lr: checkpoint_run_changed naming lr.peak, nothing loaded");
      t.load(path, {.changes = mb::run_changes::accept});
      check(t.steps_done() == half && t.changed_at_load().size() == 1 && t.changed_at_load()[0].field == "lr.peak",
            how + " under another lr, accepted: loaded, the change listed");
    }
    // Re-sharding. What is asserted: loading another world's checkpoint gives exactly the saved
    // state (weights, AdamW's m and v, counters), so the continuation is bit for bit the run of the
    // new world size resumed from a whole checkpoint of that same state (ZeRO-0 at N ranks gives
    // ZeRO-1's bits, so its whole checkpoint holds the same state).
    mb::mpi_communicator self(MPI_COMM_SELF);
    const std::string whole_n = std::string(dir) + "/whole_n.ckpt", whole_1 = std::string(dir) + "/whole_1.ckpt";
    {
      // The same state at step `half` as a whole checkpoint: ZeRO-0 over the N ranks (rank 0 writes),
      // and the one-process run's (rank 0 computes it alone).
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      mb::trainer t(m, effective, plan_for(m, effective.batch / N), a, pool, options(0), mb::null_monitor{}, comm);
      text_source src0(membound_test::small_config().vocab);
      for (std::size_t k = 0; k < half; ++k) (void)t.step(src0);
      if (me == 0) {
        t.save(whole_n);
        alloc_t b(std::size_t{1} << 30);
        mb::trainer u(m, effective, plan_for(m, effective.batch), b, pool, options(0), mb::null_monitor{}, self);
        for (std::size_t k = 0; k < half; ++k) (void)u.step(src0);
        u.save(whole_1);
      }
      comm.barrier();
    }
    // The saved plan is restored over ranks only where every rank fits it: the last rank's budget
    // fits a full-recompute plan but not the checkpoint's (schedule none), so no rank restores it
    // and every rank keeps the plan it runs (ranks under different plans would make different
    // collectives).
    {
      const mb::training_plan none_plan = plan_for(m, effective.batch / N);
      const mb::training_plan full_plan = plan_for(m, effective.batch / N, 0, {}, 1,
                                                   mb::schedule_choice::of(mb::schedules::full{}));
      check(full_plan.peak_bytes < none_plan.peak_bytes, "the full-recompute plan's peak is below schedule none's");
      const std::size_t tight = full_plan.peak_bytes + (none_plan.peak_bytes - full_plan.peak_bytes) / 2;
      alloc_t a(me + 1 == N ? tight : std::size_t{1} << 30);
      mb::thread_pool pool(1);
      mb::trainer t(m, effective, full_plan, a, pool, options(0), mb::null_monitor{}, comm);
      const bool restored = t.load(whole_n);
      check(!restored && t.steps_done() == half && t.plan().schedule == full_plan.schedule,
            "a plan one rank cannot fit is restored on no rank: every rank keeps its own, and the state is loaded");
    }
    struct cont {
      std::vector<double> losses;
      std::vector<unsigned char> weights0, optimizer0, weights;  // after loading, and at the end
      std::uint64_t step0 = 0;
    };
    // A fresh trainer over c (zero, micro-batches per rank) loads `from` and runs to `steps`.
    const auto resume = [&](auto& c, std::size_t zero, const std::string& from) {
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      const std::size_t R = c.size();
      const std::size_t el = zero >= 1 && R > 1 ? mb::shard_of(n, R, c.rank()).size() : 0;
      const mb::gradient_shards gs = zero == 2 ? mb::gradient_shards_of<float>(c) : mb::gradient_shards{};
      mb::trainer t(m, effective, plan_for(m, effective.batch / R, el, gs), a, pool, options(zero), mb::null_monitor{}, c);
      t.load(from);
      cont r;
      r.step0 = t.steps_done();
      const auto* w = static_cast<const unsigned char*>(static_cast<const void*>(t.weights()));
      r.weights0.assign(w, w + m.weight_bytes());
      const auto* o = static_cast<const unsigned char*>(t.optimizer_state());
      r.optimizer0.assign(o, o + t.optimizer_bytes());
      text_source s2(membound_test::small_config().vocab);
      while (t.steps_done() < steps) r.losses.push_back(t.step(s2).loss);
      r.weights.assign(w, w + m.weight_bytes());
      return r;
    };
    // N -> 1: each rank, alone, resumes the N ranks' shards and the whole checkpoint of the same state.
    {
      const cont resharded = resume(self, 0, path), reference = resume(self, 0, whole_n);
      check(resharded.step0 == half && resharded.weights0 == reference.weights0 &&
                resharded.optimizer0 == reference.optimizer0,
            "re-sharding " + std::to_string(N) + " -> 1: the saved weights and m, v exactly");
      check(same_bits(resharded.losses, reference.losses) && resharded.weights == reference.weights,
            "re-sharding " + std::to_string(N) + " -> 1: the continuation of the same state, bit for bit");
      const cont z1self = resume(self, 1, path);
      check(same_bits(z1self.losses, reference.losses), "re-sharding " + std::to_string(N) + " -> 1 under zero = 1 (one rank)");
    }
    // 1 -> N: the one-process checkpoint resumed by N ranks under ZeRO-1 and ZeRO-2 (each rank
    // slices its shard) against ZeRO-0 over N ranks resuming it whole.
    {
      const cont reference = resume(comm, 0, whole_1), z1 = resume(comm, 1, whole_1), z2 = resume(comm, 2, whole_1);
      check(z1.step0 == half && z1.weights0 == reference.weights0, "re-sharding 1 -> " + std::to_string(N) + ": the saved weights");
      const std::size_t f4 = sizeof(float);
      check(z1.optimizer0.size() == opt::state_bytes(shard.size()) &&
                std::memcmp(z1.optimizer0.data(), reference.optimizer0.data() + shard.begin * f4, shard.size() * f4) == 0 &&
                std::memcmp(z1.optimizer0.data() + shard.size() * f4, reference.optimizer0.data() + (n + shard.begin) * f4,
                            shard.size() * f4) == 0,
            "re-sharding 1 -> " + std::to_string(N) + ": this rank's slice of m and v, exactly");
      check(same_bits(z1.losses, reference.losses) && z1.weights == reference.weights,
            "re-sharding 1 -> " + std::to_string(N) + " (ZeRO-1): ZeRO-0's continuation, bit for bit");
      double g2 = 0;
      for (std::size_t k = 0; k < z2.losses.size(); ++k)
        g2 = std::max(g2, std::abs(z2.losses[k] - reference.losses[k]) / std::abs(reference.losses[k]));
      if (effective.batch / N == 1) {
        check(same_bits(z2.losses, reference.losses) && z2.weights == reference.weights,
              "re-sharding 1 -> " + std::to_string(N) + " (ZeRO-2, one micro-batch per rank): bit for bit");
      }
      check(z2.step0 == half && g2 <= 1e-5, "re-sharding 1 -> " + std::to_string(N) + " (ZeRO-2): within 1e-5 (" + std::to_string(g2) + ")");
    }
    // N = 4: manifests between sharded worlds, through two 2-rank halves of the world.
    //   2 -> 4: the first half writes a 2-rank ZeRO-1 manifest (and ZeRO-0's whole checkpoint of the
    //   same state); the 4 ranks resume the manifest under ZeRO-1 and the whole file under ZeRO-0.
    //   4 -> 2: each half resumes the 4 ranks' manifest under ZeRO-1 and whole_n under ZeRO-0.
    if (N == 4) {
      MPI_Comm half_comm = MPI_COMM_NULL;
      MPI_Comm_split(comm.native(), static_cast<int>(me / 2), static_cast<int>(me), &half_comm);
      {
        mb::mpi_communicator h(half_comm);
        const std::string two = std::string(dir) + "/two.ckpt", two_whole = std::string(dir) + "/two_whole.ckpt";
        if (me < 2) {
          for (const std::size_t zero : {std::size_t{1}, std::size_t{0}}) {
            alloc_t a(std::size_t{1} << 30);
            mb::thread_pool pool(1);
            const std::size_t el = zero == 1 ? mb::shard_of(n, 2, h.rank()).size() : 0;
            mb::trainer t(m, effective, plan_for(m, effective.batch / 2, el), a, pool, options(zero), mb::null_monitor{}, h);
            text_source s0(membound_test::small_config().vocab);
            for (std::size_t k = 0; k < half; ++k) (void)t.step(s0);
            if (zero == 1 || h.rank() == 0) t.save(zero == 1 ? two : two_whole);
          }
        }
        comm.barrier();
        const cont up = resume(comm, 1, two), up_ref = resume(comm, 0, two_whole);
        check(up.step0 == half && up.weights0 == up_ref.weights0 && same_bits(up.losses, up_ref.losses) &&
                  up.weights == up_ref.weights,
              "re-sharding 2 -> 4 (ZeRO-1): ZeRO-0's continuation of the same state, bit for bit");
        const cont down = resume(h, 1, path), down_ref = resume(h, 0, whole_n);
        check(down.step0 == half && down.weights0 == down_ref.weights0 && same_bits(down.losses, down_ref.losses) &&
                  down.weights == down_ref.weights,
              "re-sharding 4 -> 2 (ZeRO-1): ZeRO-0's continuation of the same state, bit for bit");
        comm.barrier();
        if (me == 0) {
          std::filesystem::remove(two);
          std::filesystem::remove(two_whole);
          for (std::size_t r = 0; r < 2; ++r)
            std::filesystem::remove(std::string(dir) + "/two.ckpt.step-" + std::to_string(half) + ".rank-" +
                                    std::to_string(r) + "-of-2");
        }
      }
      MPI_Comm_free(&half_comm);
    }
    // A block-wise optimizer state (adamw8bit) is not re-sliced: a typed refusal.
    {
      using opt8 = mb::adamw8bit<float>;
      mb::plan_options po;
      po.threads = 1;
      po.head_chunk = 64;
      po.optimizer_policy = mb::optimizer_of<opt8>();
      const std::string path8 = std::string(dir) + "/eight.ckpt";
      {
        alloc_t a(std::size_t{1} << 30);
        mb::thread_pool pool(1);
        po.accumulation = effective.batch / N;
        po.optimizer_elements = shard.size();
        mb::trainer<model_t, alloc_t, mb::null_monitor, mb::mpi_communicator, opt8> t(
            m, effective, mb::make_plan(m, mb::batch_shape{1, effective.seq}, mb::schedules::none{}, po), a, pool,
            options(1), mb::null_monitor{}, comm);
        text_source s8(membound_test::small_config().vocab);
        (void)t.step(s8);
        t.save(path8);
      }
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      po.accumulation = effective.batch;
      po.optimizer_elements = 0;
      mb::trainer<model_t, alloc_t, mb::null_monitor, mb::mpi_communicator, opt8> u(
          m, effective, mb::make_plan(m, mb::batch_shape{1, effective.seq}, mb::schedules::none{}, po), a, pool,
          options(1), mb::null_monitor{}, self);
      bool refused = false;
      try {
        u.load(path8);
      } catch (const mb::checkpoint_world_mismatch& e) {
        refused = e.field() == "ranks" && e.saved() == std::to_string(N) && e.current() == "1" && u.steps_done() == 0;
        if (me == 0) std::printf("adamw8bit re-sharding refused: %s\n", e.what());
      }
      check(refused, "adamw8bit shards resumed by another world size: checkpoint_world_mismatch, nothing loaded");
      comm.barrier();
      if (me == 0) {
        std::filesystem::remove(whole_n);
        std::filesystem::remove(whole_1);
        std::filesystem::remove(path8);
        for (std::size_t r = 0; r < N; ++r)
          std::filesystem::remove(std::string(dir) + "/eight.ckpt.step-1.rank-" + std::to_string(r) + "-of-" + std::to_string(N));
      }
    }
    comm.barrier();
    std::size_t files = 0;
    if (me == 0) {
      for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++files;
    }
    comm.broadcast(&files, 1, 0);
    check(files == N + 1, "the manifest and one shard file per rank, nothing else (" + std::to_string(files) + " files)");
    // The N ranks' checkpoint resumed in one process (re-sharded) and saved whole at the same
    // path: the shard files belong to no checkpoint now and are gone.
    if (me == 0) {
      mb::mpi_communicator alone(MPI_COMM_SELF);
      alloc_t a(std::size_t{1} << 30);
      mb::thread_pool pool(1);
      mb::trainer t(m, effective, plan_for(m, effective.batch), a, pool, options(0), mb::null_monitor{}, alone);
      t.load(path);
      (void)t.step(src);
      t.save(path);
      files = 0;
      for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++files;
      std::filesystem::remove_all(dir);
    }
    comm.broadcast(&files, 1, 0);
    check(files == 1, "resumed in one process and saved whole: the whole file, no shard left (" + std::to_string(files) +
                          " files)");
  }

  // The per-rank plan lines, and the ranks agreeing before step 1.
  if (N > 1) {
    alloc_t a(std::size_t{1} << 30);
    mb::thread_pool pool(1);
    mb::trainer t(m, effective, plan_for(m, effective.batch / N, shard.size()), a, pool, options(1), mb::null_monitor{}, comm);
    const std::vector<mb::rank_memory> all = t.memory_of_ranks();
    const mb::rank_memory mine = t.memory();
    check(all.size() == N && std::memcmp(&all[me], &mine, sizeof mine) == 0, "memory_of_ranks: each rank's own line");
    check(mine.optimizer == opt::state_bytes(shard.size()) && mine.peak == zero1.predicted && mine.exchange > 0 &&
              mine.exchange < mine.peak,
          "this rank's line: its optimizer shard, its predicted peak, an exchange buffer inside it");
    if (me == 0) std::printf("%s", mb::rank_memory_table(all).c_str());

    const mb::training_plan p = plan_for(m, effective.batch / N, shard.size());
    const std::size_t small = p.peak_bytes / 2;
    alloc_t b(me == N - 1 ? small : std::size_t{1} << 30);
    bool all_stopped = false;
    try {
      mb::trainer u(m, effective, p, b, pool, options(1), mb::null_monitor{}, comm);
    } catch (const mb::rank_cannot_start& e) {
      all_stopped = e.rank() == N - 1 && e.peak() == p.peak_bytes && e.limit() == small;
      if (me == 0) std::printf("one rank over budget: %s\n", e.what());
    }
    check(all_stopped, "the last rank over its budget: every rank throws rank_cannot_start with its numbers");
    check(b.stats().requested == 0, "nothing left allocated after the refusal");
  }

  // Replanning under pressure over ranks: only the last rank sees others take memory.
  {
    using monitor_t = mb::pressure_monitor<mb::all_check_points>;
    using pressured_t = mb::trainer<model_t, alloc_t, monitor_t, mb::mpi_communicator>;
    const std::size_t last = N - 1;
    struct stage {
      std::size_t zero;
      bool overlap;
    };
    for (const stage sg : {stage{0, false}, stage{1, false}, stage{2, false}, stage{2, true}, stage{0, true},
                           stage{1, true}, stage{3, false}, stage{3, true}}) {
      if (N == 1 && (sg.zero != 0 || sg.overlap)) continue;  // one rank has no stages
      const std::string name = "pressure, ZeRO-" + std::to_string(sg.zero) + (sg.overlap ? " overlapped" : "");
      const std::size_t sh = sg.zero >= 1 && N > 1 ? shard.size() : 0;
      const mb::gradient_shards gs = mb::gradient_exchange_of<float>(comm, sg.zero, sg.overlap);
      const mb::training_plan p0 = plan_for(m, effective.batch / N, sh, gs);
      // As test_trainer's single-process case: a budget twice the plan's peak, thresholds low
      // enough that the emergency is seen at a check point before any allocation can fail.
      const mb::pressure_thresholds th{0.5, 0.6, 0.7};
      const std::size_t limit = 2 * p0.peak_bytes;
      const std::size_t foreign = static_cast<std::size_t>(0.72 * static_cast<double>(limit)) - live_at_loss(p0);
      mb::trainer_options o = options(sg.zero, sg.overlap);
      o.replan_under_pressure = true;
      constexpr std::size_t pressed_steps = 6;
      // Without pressure, switching to p1 before step at + 1 (at 0: planned with it from the start).
      const auto unpressured = [&](const mb::training_plan& p1, std::size_t at, std::vector<double>& losses) {
        alloc_t ra(std::size_t{1} << 30);
        mb::thread_pool pool(1);
        mb::trainer ref(m, effective, p0, ra, pool, options(sg.zero, sg.overlap), mb::null_monitor{}, comm);
        text_source rs(membound_test::small_config().vocab);
        for (std::size_t k = 0; k < pressed_steps; ++k) {
          if (k == at) ref.set_plan(p1);
          losses.push_back(ref.step(rs).loss);
        }
        const auto* w = static_cast<const unsigned char*>(static_cast<const void*>(ref.weights()));
        return std::vector<unsigned char>(w, w + ref.weight_shard().size() * sizeof(float));  // ZeRO-3: the shard
      };
      // Every rank holds rank 0's weights (ZeRO-3: each its own shard, nothing to compare).
      const auto same_as_rank0 = [&](const std::vector<unsigned char>& w) { return sg.zero == 3 || rank0(comm, w) == w; };
      // The replan every rank saw, checked: the last rank's, retried, the same choices everywhere.
      const auto agreed = [&](const std::vector<mb::replan_event>& events, const mb::training_plan& p1, std::size_t at,
                              const std::string& why, const std::string& what) {
        check(events.size() == 1 && events.front().step == at + 1 && events.front().retried &&
                  events.front().stricter_found && events.front().reason.find(why) == 0 &&
                  (N == 1 ||  // one process names no rank
                   events.front().reason.find("on rank " + std::to_string(last) + " of " + std::to_string(N)) !=
                       std::string::npos),
              what + ": one retry of step " + std::to_string(at + 1) + " on every rank for the last rank's " + why +
                  " (" + std::to_string(events.size()) + " replans)");
        if (me == 0 && !events.empty()) std::printf("%s: %s\n", what.c_str(), events.front().describe().c_str());
        std::uint64_t choices[5] = {p1.micro.batch, p1.accumulation, static_cast<std::uint64_t>(p1.schedule.k),
                                    p1.schedule.param, p1.head_chunk};
        std::uint64_t zeros[5];
        std::memcpy(zeros, choices, sizeof choices);
        comm.broadcast(zeros, 5, 0);
        check(std::memcmp(zeros, choices, sizeof choices) == 0, what + ": rank 0's plan choices on every rank");
        check(p1.peak_bytes < p0.peak_bytes, what + ": a stricter plan");
      };
      for (const std::size_t at : {std::size_t{0}, std::size_t{2}}) {
        const std::string what = name + ", others' bytes on rank " + std::to_string(last) + " before step " +
                                 std::to_string(at + 1);
        alloc_t a(limit);
        mb::thread_pool pool(1);
        pressured_t t(m, effective, p0, a, pool, o, monitor_t(th), comm);
        text_source src(membound_test::small_config().vocab);
        std::vector<double> losses;
        std::vector<mb::replan_event> events;
        for (std::size_t k = 0; k < pressed_steps; ++k) {
          if (k == at && me == last) a.set_external(foreign);
          const mb::step_result r = t.step(src);
          losses.push_back(r.loss);
          events.insert(events.end(), r.replans.begin(), r.replans.end());
          if (k == at) a.reset_peaks();  // from here, the new plan's steps only
        }
        const mb::training_plan p1 = t.plan();
        agreed(events, p1, at, "pressure emergency", what);
        check(a.stats().peak_requested == p1.peak_bytes,
              what + ": measured peak " + std::to_string(a.stats().peak_requested) + " == the new plan's " +
                  std::to_string(p1.peak_bytes));
        check(a.stats().requested == t.own_bytes(), what + ": nothing of the abandoned attempt left");
        std::vector<unsigned char> w(t.weight_shard().size() * sizeof(float));
        std::memcpy(w.data(), t.weights(), w.size());
        check(same_as_rank0(w), what + ": every rank holds rank 0's weights");

        std::vector<double> expected;
        check(unpressured(p1, at, expected) == w, what + ": the weights of a run switched to the plan at that step, bit for bit");
        check(same_bits(losses, expected), what + ": its losses, bit for bit");
      }

      // Others take memory on the last rank alone and no monitor sees it first: (1) outside the
      // allocator (the budget's external bytes), so the plan's peak no longer fits: voted at the
      // first agreement point, under every stage; (2) through the allocator, where only the
      // allocation at the plan's peak fails: under ZeRO-0/1 no exchange lies inside the
      // micro-batch, so the out-of-memory is voted at the next agreement point. (ZeRO-2's peak is
      // in a backward, after its first reduce-scatter: an out-of-memory there is not retried over
      // ranks.) Either way every rank retries step 1 under the agreed plan.
      for (const bool outside : {true, false}) {
        // Overlapped: the peak may lie past an exchange; ZeRO-3: every forward op gathers.
        if (!outside && (sg.zero >= 2 || sg.overlap)) continue;
        const std::string what = name + ", " + (outside ? "external" : "allocated") + " bytes on rank " +
                                 std::to_string(last) + " before step 1, no monitor";
        alloc_t c(limit);
        mb::thread_pool pool(1);
        mb::trainer<model_t, alloc_t, mb::null_monitor, mb::mpi_communicator> v(m, effective, p0, c, pool, o,
                                                                               mb::null_monitor{}, comm);
        // The plan's peak is one byte over what is left.
        const std::size_t taken = limit - p0.peak_bytes + 1;
        void* others = nullptr;
        if (me == last && outside) c.set_external(taken);
        if (me == last && !outside) others = c.allocate(taken, mb::default_alignment, mb::memory_tag::other);
        text_source src(membound_test::small_config().vocab);
        std::vector<double> losses;
        std::vector<mb::replan_event> events;
        for (std::size_t k = 0; k < pressed_steps; ++k) {
          const mb::step_result r = v.step(src);
          losses.push_back(r.loss);
          events.insert(events.end(), r.replans.begin(), r.replans.end());
          if (k == 0) c.reset_peaks();
        }
        const mb::training_plan p1 = v.plan();
        agreed(events, p1, 0, outside && N > 1 ? "no room for the plan's peak" : "out of memory", what);
        const std::size_t peak = c.stats().peak_requested - (others != nullptr ? taken : 0);
        check(peak == p1.peak_bytes, what + ": measured peak " + std::to_string(peak) + " == the new plan's " +
                                         std::to_string(p1.peak_bytes));
        std::vector<unsigned char> w(v.weight_shard().size() * sizeof(float));
        std::memcpy(w.data(), v.weights(), w.size());
        check(same_as_rank0(w), what + ": every rank holds rank 0's weights");
        std::vector<double> expected;
        check(unpressured(p1, 0, expected) == w, what + ": the weights of a run planned with it, bit for bit");
        check(same_bits(losses, expected), what + ": its losses, bit for bit");
        if (others != nullptr) c.deallocate(others, taken, mb::default_alignment, mb::memory_tag::other);
      }

      // No plan fits what the last rank has left: every rank throws the same error, nothing lost.
      alloc_t b(limit);
      mb::thread_pool pool(1);
      pressured_t u(m, effective, p0, b, pool, o, monitor_t(th), comm);
      text_source src(membound_test::small_config().vocab);
      (void)u.step(src);
      std::vector<unsigned char> w(u.weight_shard().size() * sizeof(float)), opt(u.optimizer_bytes());
      std::memcpy(w.data(), u.weights(), w.size());
      std::memcpy(opt.data(), u.optimizer_state(), opt.size());
      std::uint64_t left = u.own_bytes() + 4096;  // the last rank's, on every rank
      if (me == last) b.set_external(limit - left);
      comm.broadcast(&left, 1, last);
      bool threw = false;
      try {
        (void)u.step(src);
      } catch (const mb::budget_too_small& e) {
        const auto* r = dynamic_cast<const mb::rank_budget_too_small*>(&e);
        threw = N == 1 || (r != nullptr && r->rank() == last && e.budget() == left && e.minimum() > left);
        if (me == 0) std::printf("%s, no plan fits: %s\n", name.c_str(), e.what());
      }
      check(threw, name + ": no plan fits the last rank: rank_budget_too_small naming it, on every rank");
      check(std::memcmp(w.data(), u.weights(), w.size()) == 0 &&
                std::memcmp(opt.data(), u.optimizer_state(), opt.size()) == 0 && u.steps_done() == 1 &&
                b.stats().requested == u.own_bytes(),
            name + ": after the error, the weights, optimizer state, step and bytes held as before the step");
    }
  }

  // Refusals, the same on every rank (nothing is communicated before them).
  if (N > 1) {
    alloc_t a(std::size_t{1} << 30);
    mb::thread_pool pool(1);
    bool threw = false;
    try {
      mb::trainer t(m, mb::batch_shape{N + 1, effective.seq}, plan_for(m, 1), a, pool, options(), mb::null_monitor{}, comm);
    } catch (const mb::invalid_argument& e) {
      threw = std::string(e.argument()) == "effective.batch";
    }
    check(threw, "an effective batch of N + 1: invalid_argument naming effective.batch");

    // set_plan over ranks: the last rank's plan is refused (made for another pool), so every rank
    // refuses it, the last with its own error and the others naming it; nobody waits in the
    // exchange and every rank keeps its plan and steps on together.
    mb::trainer t(m, effective, plan_for(m, effective.batch / N), a, pool, options(), mb::null_monitor{}, comm);
    text_source src(membound_test::small_config().vocab);
    (void)t.step(src);
    mb::training_plan q = plan_for(m, effective.batch / N, 0, {}, 1, mb::schedule_choice::of(mb::schedules::full{}));
    if (me == N - 1) {
      mb::plan_options po;
      po.threads = 2;  // not this trainer's pool
      po.head_chunk = 64;
      po.accumulation = effective.batch / N;
      q = mb::make_plan(m, mb::batch_shape{1, effective.seq}, mb::schedule_choice::of(mb::schedules::full{}), po);
    }
    std::string said;
    try {
      t.set_plan(q);
    } catch (const mb::invalid_argument& e) {
      said = e.what();
    }
    const bool named = me == N - 1 ? said.find("thread") != std::string::npos
                                   : said.find("rank " + std::to_string(N - 1) + " of " + std::to_string(N)) != std::string::npos;
    check(named && t.plan().schedule.k == mb::schedule_choice::kind::none,
          "set_plan refused by one rank: every rank refuses, each kept its plan (" + said + ")");
    (void)t.step(src);
    check(t.steps_done() == 2, "the ranks step on together after a refused set_plan");
  }

  double worst_all = 0;
  MPI_Allreduce(&worst, &worst_all, 1, MPI_DOUBLE, MPI_MAX, comm.native());
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, comm.native());
  if (me == 0) {
    std::printf("test_mpi_trainer: %zu rank(s), %zu steps, loss %.4f -> %.4f, worst relative gap to one process %.3g; %s\n",
                N, steps, dp.losses.front(), dp.losses.back(), worst_all,
                total == 0 ? "all checks passed" : (std::to_string(total) + " check(s) failed").c_str());
  }
  return total == 0 ? 0 : 1;
}
