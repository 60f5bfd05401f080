// Optimizer offload (plan_options::offload), two figures from one run:
//
// 1. The largest model fit() admits in a fixed device budget, with the optimizer's state on the
//    device and offloaded to a host space, and (rank 0's plan, the planner alone) sharded over 2
//    and 4 MPI ranks under ZeRO-1, 2 and 3: the example trainer's hybrid (--blocks blocks of
//    ttt, attn, mamba, attn in turn), bf16 storage with AdamW (fp32 m, v and masters: 12 bytes
//    a parameter) or 8-bit AdamW, --batch x --seq tokens per step, its width grown in steps of 64
//    (heads of 64) until no plan fits. The planner alone: no step runs.
// 2. The step time of an offloaded run against the in-place run of the same plan on the CPU (the
//    same bits; both spaces are host memory here, so the figure is the copies' and the bucketed
//    update's cost), with the measured device and host peaks against their predictions.
// 3. Activation offload (offload_options::activations): at device budgets from the least-memory
//    generated schedule's peak (Revolve with one slot) up, the budget DP's recompute with block
//    inputs kept on the device only and with them offloadable, the host bytes it takes, and both
//    runs' step times and measured peaks.
//
// No peer: DeepSpeed's ZeRO-Offload (the design this follows) needs a GPU and is not installed
// here; the ratios are against membound's own in-place step.
//
// Run: ./build/release/bench/bench_offload [--budget MiB] [--blocks N] [--batch N] [--seq N] [--threads N] [--steps N]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "bench_flags.hpp"
#include "membound/membound.hpp"

namespace mb = membound;

namespace {

double mib(std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

template <typename P>
mb::hybrid_model<P> make_model(std::size_t width, std::size_t blocks, std::size_t heads = 0) {
  mb::model_config c;
  c.vocab = 256;
  c.width = width;
  c.heads = heads != 0 ? heads : width / 64;
  using net = mb::hybrid_model<P>;
  const char* names[] = {"ttt_linear", "attention", "mamba", "attention"};
  std::vector<std::size_t> pattern;
  for (std::size_t i = 0; i < blocks; ++i) pattern.push_back(net::mixer_index(names[i % 4]));
  return net(c, pattern);
}

// Data parallel over `ranks` MPI ranks at ZeRO stage `zero` (ranks 1: one process): rank 0's plan,
// each rank taking batch / ranks sequences of the step; the world's sizes are mpi_communicator's
// (mpi_world), so no MPI is needed to plan it.
struct world_choice {
  std::size_t ranks = 1, zero = 0;
};

// fit()'s plan for width w, or nothing when none fits the budget.
template <typename Opt>
std::optional<mb::training_plan> fit_at(std::size_t w, std::size_t blocks, mb::batch_shape b, std::size_t budget,
                                        std::size_t threads, bool offload, bool activations, world_choice world = {}) {
  const auto m = make_model<mb::bf16_precision>(w, blocks);
  mb::fit_options fo;
  fo.threads = threads;
  fo.optimizer_policy = mb::optimizer_of<Opt>();
  fo.offload = {offload, 0, 0, activations};
  fo.offload_mode = mb::fit_options::offload_choice::always;
  if (world.ranks > 1) {
    const mb::mpi_world rank0{world.ranks, 0};
    if (world.zero >= 1) fo.optimizer_elements = mb::shard_of(m.parameter_elements(), world.ranks, 0).size();
    fo.gradients = mb::gradient_exchange_of<mb::bf16>(rank0, world.zero, false);
    b.batch /= world.ranks;
  }
  try {
    return mb::fit(m, b, budget, fo);
  } catch (const mb::budget_too_small&) {
    return std::nullopt;
  }
}

struct largest {
  std::size_t width = 0, params = 0;
  mb::training_plan plan;
};

// The widest multiple of 64 that fits (every plan's bytes grow with the width: bisection).
template <typename Opt>
largest widest(std::size_t blocks, mb::batch_shape b, std::size_t budget, std::size_t threads, bool offload,
               bool activations = false, world_choice world = {}) {
  std::size_t lo = 0, hi = 256;  // in units of 64; lo fits (0: nothing), hi + 1 does not
  largest best;
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo + 1) / 2;
    if (auto p = fit_at<Opt>(mid * 64, blocks, b, budget, threads, offload, activations, world)) {
      lo = mid;
      best.plan = std::move(*p);
    } else {
      hi = mid - 1;
    }
  }
  best.width = lo * 64;
  if (lo != 0) best.params = make_model<mb::bf16_precision>(best.width, blocks).parameter_count();
  return best;
}

// The most blocks (of the same width) that fit: the parameters grow by one block's at a time, a
// finer step than the width's (bisection; every plan's bytes grow with the depth).
template <typename Opt>
largest deepest(std::size_t width, mb::batch_shape b, std::size_t budget, std::size_t threads, bool offload,
                world_choice world = {}) {
  std::size_t lo = 0, hi = 128;  // lo fits (0: nothing), hi + 1 does not
  largest best;
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo + 1) / 2;
    if (auto p = fit_at<Opt>(width, mid, b, budget, threads, offload, false, world)) {
      lo = mid;
      best.plan = std::move(*p);
    } else {
      hi = mid - 1;
    }
  }
  best.width = lo;  // here: the blocks
  if (lo != 0) best.params = make_model<mb::bf16_precision>(width, lo).parameter_count();
  return best;
}

// A windowed source over a fixed pseudo-random text.
struct source {
  std::size_t seq;
  void operator()(const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) const {
    std::uint64_t s = r.random | 1;
    for (std::size_t t = 0; t <= seq; ++t) {
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      const auto v = static_cast<std::int32_t>((s >> 40) % 64);
      if (t < seq) x[t] = v;
      if (t > 0) y[t - 1] = v;
    }
  }
};

struct timed {
  double ms = 0;  // mean step time over the timed steps
  std::size_t device_peak = 0, host_peak = 0;
  double last_loss = 0;
};

template <typename Opt>
timed time_steps(const mb::hybrid_model<mb::bf16_precision>& m, mb::batch_shape b, const mb::training_plan& p,
                 std::size_t threads, std::size_t steps) {
  mb::thread_pool pool(threads);
  mb::budget_allocator<mb::system_allocator> device(std::size_t{1} << 40), host(std::size_t{1} << 40);
  mb::trainer_options o;
  o.host = mb::host_allocator_ref(host);
  o.lr = mb::cosine_lr{1e-3, 1e-4, 1, steps + 2};
  mb::trainer<mb::hybrid_model<mb::bf16_precision>, decltype(device), mb::null_monitor, mb::local_communicator, Opt> t(
      m, b, p, device, pool, o);
  source src{b.seq};
  (void)t.step(src);  // warm-up: first touches of every buffer
  double total = 0;
  timed r;
  for (std::size_t k = 0; k < steps; ++k) {
    const mb::step_result s = t.step(src);
    total += s.ms;
    r.last_loss = s.loss;
  }
  r.ms = total / static_cast<double>(steps);
  r.device_peak = device.stats().peak_requested;
  r.host_peak = host.stats().peak_requested;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  return bench_flags::run([&] {
    std::size_t budget_mib = 512, blocks = 12, batch = 8, seq = 256, threads = 2, steps = 5;
    bench_flags::args a(argc, argv,
                        "usage: bench_offload [--budget MiB] [--blocks N] [--batch N] [--seq N] [--threads N] "
                        "[--steps N]");
    while (a.next()) {
      if (a.is("--budget")) budget_mib = a.whole(1, 1u << 20);
      else if (a.is("--blocks")) blocks = a.whole(1, 128);
      else if (a.is("--batch")) batch = a.whole(1, 4096);
      else if (a.is("--seq")) seq = a.whole(2, 1u << 16);
      else if (a.is("--threads")) threads = a.whole(1, 256);
      else if (a.is("--steps")) steps = a.whole(1, 1000);
      else a.unknown();
    }
    const std::size_t budget = budget_mib << 20;
    const mb::batch_shape b{batch, seq};

    std::printf("1. The largest hybrid (%zu blocks, bf16, heads of 64) fit() admits in a device budget of %zu MiB, "
                "%zu x %zu tokens per step, %zu threads:\n\n",
                blocks, budget_mib, batch, seq, threads);
    std::printf("| optimizer | state | width | parameters | x in place | device peak | host peak | micro-batches x sequences, schedule |\n");
    std::printf("|---|---|---:|---:|---:|---:|---:|---|\n");
    const auto row = [&](const char* opt, const char* where, const largest& l, std::size_t base) {
      if (l.width == 0) {
        std::printf("| %s | %s | none fits | | | | | |\n", opt, where);
        return;
      }
      std::printf("| %s | %s | %zu | %zu | %.2f | %.1f MiB | %.1f MiB | %zu x %zu, %s |\n", opt, where, l.width, l.params,
                  base == 0 ? 0.0 : static_cast<double>(l.params) / static_cast<double>(base), mib(l.plan.budgeted_peak()),
                  mib(l.plan.host_peak()), l.plan.accumulation, l.plan.micro.batch, l.plan.schedule.name().c_str());
    };
    const largest a_dev = widest<mb::adamw<mb::bf16>>(blocks, b, budget, threads, false);
    const largest a_off = widest<mb::adamw<mb::bf16>>(blocks, b, budget, threads, true);
    const largest q_dev = widest<mb::adamw8bit<mb::bf16>>(blocks, b, budget, threads, false);
    const largest q_off = widest<mb::adamw8bit<mb::bf16>>(blocks, b, budget, threads, true);
    const largest a_all = widest<mb::adamw<mb::bf16>>(blocks, b, budget, threads, true, true);
    row("adamw", "device", a_dev, a_dev.params);
    row("adamw", "offloaded", a_off, a_dev.params);
    row("adamw", "offloaded, + block inputs", a_all, a_dev.params);
    row("adamw8bit", "device", q_dev, a_dev.params);
    row("adamw8bit", "offloaded", q_off, a_dev.params);
    // Over ranks (rank 0's plan, batch / N sequences each): ZeRO-1, 2 and 3 at 2 and 4 ranks.
    for (const std::size_t N : {std::size_t{2}, std::size_t{4}}) {
      if (batch % N != 0) continue;
      for (const std::size_t z : {std::size_t{1}, std::size_t{2}, std::size_t{3}}) {
        const largest l = widest<mb::adamw<mb::bf16>>(blocks, b, budget, threads, false, false, {N, z});
        const std::string where = "device, ZeRO-" + std::to_string(z) + " over " + std::to_string(N) + " ranks";
        row("adamw", where.c_str(), l, a_dev.params);
      }
    }

    // The same, deeper instead of wider: at the in-place model's width, the most blocks that fit.
    if (a_dev.width != 0) {
      std::printf("\n1b. The deepest hybrid of width %zu (the in-place one's above) fit() admits in the same budget, one "
                  "block at a time (up to 128):\n\n",
                  a_dev.width);
      std::printf("| optimizer | state | blocks | parameters | x in place | device peak | host peak | micro-batches x "
                  "sequences, schedule |\n|---|---|---:|---:|---:|---:|---:|---|\n");
      const largest d_dev = deepest<mb::adamw<mb::bf16>>(a_dev.width, b, budget, threads, false);
      row("adamw", "device", d_dev, d_dev.params);
      row("adamw", "offloaded", deepest<mb::adamw<mb::bf16>>(a_dev.width, b, budget, threads, true), d_dev.params);
      for (const std::size_t N : {std::size_t{2}, std::size_t{4}}) {
        if (batch % N != 0) continue;
        for (const std::size_t z : {std::size_t{1}, std::size_t{2}, std::size_t{3}}) {
          const largest l = deepest<mb::adamw<mb::bf16>>(a_dev.width, b, budget, threads, false, {N, z});
          const std::string where = "device, ZeRO-" + std::to_string(z) + " over " + std::to_string(N) + " ranks";
          row("adamw", where.c_str(), l, d_dev.params);
        }
      }
    }

    std::printf("\n2. Step time on the CPU, the same plan in place and offloaded (bf16, width 256, %zu blocks, "
                "%zu x %zu tokens, %zu threads, mean of %zu steps after one):\n\n",
                std::min<std::size_t>(blocks, 4), batch, std::min<std::size_t>(seq, 128), threads, steps);
    std::printf("| optimizer | state | ms/step | x in place | device peak (measured = predicted) | host peak "
                "(measured = predicted) |\n|---|---|---:|---:|---|---|\n");
    const auto m = make_model<mb::bf16_precision>(256, std::min<std::size_t>(blocks, 4), 4);
    const mb::batch_shape tb{batch, std::min<std::size_t>(seq, 128)};
    const auto measure = [&]<typename Opt>(const char* name, Opt*) {
      mb::plan_options po;
      po.threads = threads;
      po.optimizer_policy = mb::optimizer_of<Opt>();
      const mb::training_plan in_place = mb::make_plan(m, tb, mb::schedules::none{}, po);
      po.offload = {true, 0, 0};
      po.offload.bucket = 1u << 16;  // several buckets at this size
      const mb::training_plan off = mb::make_plan(m, tb, mb::schedules::none{}, po);
      const timed x = time_steps<Opt>(m, tb, in_place, threads, steps);
      const timed y = time_steps<Opt>(m, tb, off, threads, steps);
      const auto eq = [](std::size_t got, std::size_t want) {
        return mb::format_bytes(got, false) + (got == want ? " = " : " != ") + mb::format_bytes(want, false);
      };
      std::printf("| %s | device | %.1f | 1.00 | %s | |\n", name, x.ms, eq(x.device_peak, in_place.peak_bytes).c_str());
      std::printf("| %s | offloaded (buckets of %zu) | %.1f | %.3f | %s | %s |\n", name, off.offload_bucket, y.ms,
                  y.ms / x.ms, eq(y.device_peak, off.peak_bytes).c_str(), eq(y.host_peak, off.host_peak()).c_str());
      if (x.last_loss != y.last_loss) {
        throw mb::error("bench_offload: the offloaded run's loss differs from the in-place run's: a bug");
      }
    };
    measure("adamw", static_cast<mb::adamw<mb::bf16>*>(nullptr));
    measure("adamw8bit", static_cast<mb::adamw8bit<mb::bf16>*>(nullptr));
    std::printf("\n(the offloaded and in-place runs' losses are equal bit for bit, checked)\n");

    // 3. Activation offload at tight budgets.
    const auto deep = make_model<mb::bf16_precision>(256, blocks, 4);
    mb::plan_options po;
    po.threads = threads;
    const std::size_t least = mb::make_plan(deep, tb, mb::schedules::binomial<1>{}, po).peak_bytes;
    const std::size_t most = mb::make_plan(deep, tb, mb::schedules::none{}, po).peak_bytes;
    std::printf("\n3. Activation offload on the CPU: the budget DP's plan with block inputs on the device only and "
                "offloadable (free copies: offload_options::flops_per_byte 0), bf16, width 256, %zu blocks, %zu x %zu "
                "tokens, adamw in place, %zu threads, mean of %zu steps after one; budgets from Revolve-with-one-slot's "
                "peak (%.2f MiB) toward schedule none's (%.2f MiB):\n\n",
                blocks, batch, tb.seq, threads, steps, mib(least), mib(most));
    std::printf("| device budget | block inputs | recompute (%% of forward) | ms/step | x device-only's | device peak "
                "(measured = predicted) | host peak (measured = predicted) | copied out per step | schedule ops |\n"
                "|---:|---|---:|---:|---:|---|---|---:|---|\n");
    for (const double f : {0.0, 0.1, 0.25}) {
      const std::size_t B = least + static_cast<std::size_t>(f * static_cast<double>(most - least));
      po.offload = {};
      const mb::training_plan dev = mb::make_plan(deep, tb, mb::schedule_choice{mb::schedule_choice::kind::budget, B}, po);
      po.offload.activations = true;
      const mb::training_plan off = mb::make_plan(deep, tb, mb::schedule_choice{mb::schedule_choice::kind::budget, B}, po);
      const timed x = time_steps<mb::adamw<mb::bf16>>(deep, tb, dev, threads, steps);
      const timed y = time_steps<mb::adamw<mb::bf16>>(deep, tb, off, threads, steps);
      if (x.last_loss != y.last_loss) {
        throw mb::error("bench_offload: the activation-offloaded run's loss differs from the device run's: a bug");
      }
      const auto eq = [](std::size_t got, std::size_t want) {
        return mb::format_bytes(got, false) + (got == want ? " = " : " != ") + mb::format_bytes(want, false);
      };
      std::printf("| %.2f MiB | device | %.1f | %.1f | 1.00 | %s | | | %s |\n", mib(B), 100.0 * dev.recompute_overhead(),
                  x.ms, eq(x.device_peak, dev.peak_bytes).c_str(), mb::to_string(dev.ops).c_str());
      std::printf("| %.2f MiB | offloadable | %.1f | %.1f | %.3f | %s | %s | %s | %s |\n", mib(B),
                  100.0 * off.recompute_overhead(), y.ms, y.ms / x.ms, eq(y.device_peak, off.peak_bytes).c_str(),
                  eq(y.host_peak, off.host_peak()).c_str(), mb::format_bytes(off.offloaded_bytes, false).c_str(),
                  mb::to_string(off.ops).c_str());
    }
    std::printf("\n(each budget's two runs' losses are equal bit for bit, checked)\n");
    return 0;
  });
}
