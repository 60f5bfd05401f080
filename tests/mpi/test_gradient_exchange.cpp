// The trainer's gradient exchange on its own (train/gradient_exchange.hpp), over mpi_communicator
// at 1, 2 and 4 ranks, without a trainer:
//   - The blocking exchange (ZeRO-0 all-reduce, ZeRO-1 reduce-scatter into the shards) sums every
//     rank's gradients: each value is a multiple of 1/4 below 2^10, so every order of fp32
//     additions gives the exact sum and the result is compared for equality, element by element,
//     with headrooms that force one bucket and many. The loss is summed too.
//   - Its bytes: the allocator's peak above the gradients never exceeds the headroom it was given,
//     and nothing is left allocated afterwards. A headroom below the least workspace is refused
//     with a typed error naming the plan, with the gradients untouched.
//   - The global norm is the same bits under ZeRO-0 and ZeRO-1, and equals a double-precision
//     norm of the exact sum to 1e-15 relative (each shard's Σ g² is a double sum of exact fp32
//     squares; the partials are added in rank order).
//   - A stage above 3 and null gradients are refused naming the argument.
//   - ZeRO-2, one micro-batch: the real model's backward routed through zero2_micro_batch leaves
//     this rank's shard equal, bit for bit, to that shard of ZeRO-0's exchanged full gradient;
//     the overlapped router too, and ZeRO-0/1 overlapped equal the blocking exchange bit for bit.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "membound/memory/budget.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/model/planner.hpp"
#include "membound/mpi.hpp"
#include "membound/train/gradient_exchange.hpp"

#include "../support/small_models.hpp"
#include "../support/rank_checks.hpp"

namespace mb = membound;

namespace {

std::size_t& me = membound_test::rank_checks::me;
int& failures = membound_test::rank_checks::failures;

using membound_test::rank_checks::check;

using model_t = membound_test::hybrid<mb::fp32_precision>;
using alloc_t = mb::budget_allocator<mb::system_allocator>;
using exchange_t = mb::gradient_exchange<model_t, alloc_t, mb::mpi_communicator>;

// Rank r's gradient i: a multiple of 1/4 below 2^8, so that sums over four ranks are exact.
float value(std::size_t r, std::size_t i) { return static_cast<float>((i * 7 + r * 13) % 1024) * 0.25f - 100.0f; }

double exact_sum(std::size_t N, std::size_t i) {
  double s = 0;
  for (std::size_t r = 0; r < N; ++r) s += value(r, i);
  return s;
}

void blocking(const model_t& m, mb::mpi_communicator& comm, double& norm0, double& norm1) {
  const std::size_t N = comm.size(), n = m.parameter_elements();
  mb::thread_pool pool(1);
  for (std::size_t zero : {0, 1}) {
    alloc_t a(1ull << 30);
    exchange_t x(m, a, pool, comm, zero, false);
    x.reserve_loss_workspace();
    check(x.grad_elements() == n, "ZeRO-" + std::to_string(zero) + ": the whole gradient is kept");
    const mb::shard_range s = x.shard();
    check(zero == 0 || N == 1 ? s.begin == 0 && s.end == n : s.begin == mb::shard_of(n, N, me).begin,
          "ZeRO-" + std::to_string(zero) + ": the optimizer shard is shard_of's");
    // Headrooms: the whole gradient in one bucket, and a few hundred bytes (many rounds).
    for (std::size_t headroom : {std::size_t{1} << 24, std::size_t{600}}) {
      std::vector<float> g(n);
      for (std::size_t i = 0; i < n; ++i) g[i] = value(me, i);
      const std::size_t before = a.stats().requested;
      if (N > 1) a.reset_peaks();
      const double loss = N > 1 ? x.exchange(g.data(), static_cast<double>(me + 1), headroom) : 1.0;
      const std::string at = "ZeRO-" + std::to_string(zero) + ", headroom " + std::to_string(headroom);
      check(loss == static_cast<double>(N * (N + 1) / 2), at + ": the loss is summed over ranks");
      bool exact = true;
      for (std::size_t i = s.begin; i < s.end; ++i) exact = exact && static_cast<double>(g[i]) == exact_sum(N, i);
      check(exact, at + ": every element of the shard is the exact sum over ranks");
      check(a.stats().requested == before, at + ": nothing left allocated");
      if (N > 1) check(a.stats().peak_requested - before <= headroom, at + ": the workspace fits the headroom");
      double ref = 0;
      for (std::size_t i = 0; i < n; ++i) ref += exact_sum(N, i) * exact_sum(N, i);
      ref = std::sqrt(ref);
      // ZeRO-0 holds every element; ZeRO-1 the exact sum on its shard only, which is all its norm reads.
      const double norm = x.gradient_norm(g.data(), nullptr, 0);
      check(std::abs(norm - ref) <= 1e-15 * ref, at + ": the global norm equals a double norm to 1e-15");
      (zero == 0 ? norm0 : norm1) = norm;
    }
    if (N > 1) {
      std::vector<float> g(n, 1.0f);
      bool refused = false;
      try {
        (void)x.exchange(g.data(), 0.0, 1);
      } catch (const mb::invalid_argument& e) {
        refused = std::string(e.what()).find("plan") != std::string::npos;
      }
      bool untouched = true;
      for (float v : g) untouched = untouched && v == 1.0f;
      check(refused && untouched, "ZeRO-" + std::to_string(zero) +
                                      ": a headroom below the least workspace is refused naming the plan, gradients untouched");
    }
  }
  check(std::memcmp(&norm0, &norm1, sizeof(double)) == 0, "ZeRO-0 and ZeRO-1 clip by the same norm bits");

  // Bad input: a stage that does not exist, and gradients that are not there, refused by name.
  const auto names = [](auto&& call, const char* argument) {
    try {
      call();
    } catch (const mb::invalid_argument& e) {
      return std::string(e.argument()) == argument;
    }
    return false;
  };
  alloc_t a(1ull << 20);
  check(names([&] { exchange_t x(m, a, pool, comm, 4, false); }, "zero"), "a stage above 3 is refused naming zero");
  exchange_t x(m, a, pool, comm, 0, false);
  check(names([&] { (void)x.gradient_norm(nullptr, nullptr, 0); }, "g"), "null gradients are refused naming g");
}

// The real backward of one micro-batch, through the part's routers, against ZeRO-0's exchange.
void routed(const model_t& m, mb::mpi_communicator& comm) {
  const std::size_t N = comm.size(), n = m.parameter_elements();
  if (N == 1) return;
  mb::thread_pool pool(1);
  const mb::batch_shape micro{1, 16};
  const auto data = membound_test::make_token_data(micro, m.config().vocab, 11 + static_cast<std::uint32_t>(me));
  std::vector<float> w(n);
  m.init_weights(w.data(), 5);
  const auto plan = [&](const exchange_t& x) {
    mb::plan_options po;
    po.threads = 1;
    po.head_chunk = 64;
    po.optimizer_elements = x.optimizer_elements();
    po.gradients = x.sharding();
    return mb::make_plan(m, micro, mb::schedules::none{}, po);
  };
  const auto run = [&](const mb::training_plan& p, alloc_t& a) {
    return [&, p](auto& router) {
      return m.forward_backward_routed(w.data(), router, data.tokens.data(), data.targets.data(), micro, p.ops,
                                       p.head_chunk, 1.0, a, pool, [](mb::check_point) {});
    };
  };
  // ZeRO-0, blocking: the reference.
  std::vector<float> g0(n, 0.0f);
  {
    alloc_t a(1ull << 30);
    exchange_t x(m, a, pool, comm, 0, false);
    x.reserve_loss_workspace();
    const mb::training_plan p = plan(x);
    (void)m.forward_backward(w.data(), g0.data(), data.tokens.data(), data.targets.data(), micro, p.ops, p.head_chunk,
                             1.0, a, pool, [](mb::check_point) {});
    (void)x.exchange(g0.data(), 0.0, 1 << 24);
  }
  const mb::shard_range s = mb::shard_of(n, N, me);
  for (bool overlap : {false, true}) {
    alloc_t a(1ull << 30);
    exchange_t x(m, a, pool, comm, 2, overlap);
    std::vector<float> g(x.grad_elements(), -1.0f);
    const mb::training_plan p = plan(x);
    (void)x.zero2_micro_batch(g.data(), true, 1, run(p, a));
    check(g.size() == s.size() && std::memcmp(g.data(), g0.data() + s.begin, s.size() * sizeof(float)) == 0,
          std::string("ZeRO-2") + (overlap ? " overlapped" : "") + ": the shard is ZeRO-0's, bit for bit");
    check(a.stats().requested == 0, std::string("ZeRO-2") + (overlap ? " overlapped" : "") + ": nothing left allocated");
  }
  for (std::size_t zero : {0, 1}) {
    alloc_t a(1ull << 30);
    exchange_t x(m, a, pool, comm, zero, true);
    std::vector<float> g(n, 0.0f);
    const mb::training_plan p = plan(x);
    (void)x.overlapped_micro_batch(g.data(), 1, run(p, a));
    const mb::shard_range mine = x.shard();
    check(std::memcmp(g.data() + mine.begin, g0.data() + mine.begin, mine.size() * sizeof(float)) == 0,
          "ZeRO-" + std::to_string(zero) + " overlapped: the blocking exchange's sums, bit for bit");
    check(a.stats().requested == 0, "ZeRO-" + std::to_string(zero) + " overlapped: nothing left allocated");
  }
}

}  // namespace

int main(int argc, char** argv) {
  membound_test::rank_checks::say_passed = true;
  mb::mpi_environment env(argc, argv);
  mb::mpi_communicator comm;
  me = comm.rank();
  const model_t m(membound_test::small_config());
  double norm0 = 0, norm1 = 0;
  blocking(m, comm, norm0, norm1);
  routed(m, comm);
  std::printf("rank %zu: %d failure(s)\n", me, failures);
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
