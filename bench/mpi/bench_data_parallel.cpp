// Data-parallel training over MPI: the example trainer's default model (4 blocks ttt, attn,
// mamba, attn; width 128; 8 sequences of 128 tokens per step, fp32), ZeRO-0, 1, 2 and 3,
// under `mpiexec -n N`. Rank 0 prints one markdown row per stage: the median step time over the timed
// steps, the bytes this rank sent per step against the formulas (an all-reduce of the Ψ gradient
// bytes: 2·(N − 1)/N·Ψ; ZeRO-1 reduce-scatters the gradient, (N − 1)/N·Ψ, and all-gathers the
// weights, (N − 1)/N·Ψ: the same 2·(N − 1)/N·Ψ), and the
// optimizer bytes and measured peak per rank. A second table gives each stage's model-state
// bytes per rank (weights + gradients + optimizer, as the trainer holds them between steps)
// against the formula for our fp32 and bf16 storage and DeepSpeed's published mixed-precision
// formulas; bf16 storage is measured under each stage too (its layout is DeepSpeed's 2 + 2 + 12).
// ZeRO-3 also gathers each weight unit (a block, the embedding, the head) around its use: its peak holds the gathered ones
// (training_plan::weight_gather), and its bytes sent the gathers.
// Each stage runs twice, blocking and overlapped (each block's exchange in flight through the next
// block's backward: ZeRO-2's reduce-scatter of every micro-batch's bucket, ZeRO-0's all-reduce and
// ZeRO-1's reduce-scatter of the last micro-batch's accumulated block), alternating over three
// rounds so that both see the same machine; the lines after the table give their median step
// times' ratios and the machine's load average (/proc/loadavg) before and after.
//
//   mpiexec -n 2 --oversubscribe ./build/release/bench/bench_data_parallel [steps]
// A benchmark, not a test: its times depend on the machine (2 ranks on 2 cores here).
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../bench_flags.hpp"
#include "membound/mpi.hpp"

namespace mb = membound;

namespace {

template <typename P>
using net_of = mb::model<mb::embedding<P>, mb::block_pattern<mb::ttt_linear<P>, mb::attention<P>, mb::mamba<P>>,
                         mb::lm_head<P>>;
using net = net_of<mb::fp32_precision>;
using net16 = net_of<mb::bf16_precision>;  // DeepSpeed's mixed precision: bf16 weights and gradients, fp32 AdamW
using alloc_t = mb::budget_allocator<mb::system_allocator>;

struct random_tokens {
  std::size_t seq;
  void operator()(const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) const {
    std::uint64_t s = r.random | 1;
    for (std::size_t t = 0; t < seq; ++t) {
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      x[t] = static_cast<std::int32_t>((s >> 33) % 256);
      y[t] = static_cast<std::int32_t>((s >> 41) % 256);
    }
  }
};

struct row {
  double ms = 0;
  std::vector<double> all_ms;  // every timed step
  double sent = 0;  // bytes per step
  std::size_t optimizer = 0, peak = 0, predicted = 0, in_flight = 0, gathered = 0;
  mb::rank_memory memory{};
};

template <typename Net>
row measure(const Net& m, mb::mpi_communicator& comm, std::size_t zero, std::size_t steps, std::size_t threads,
            bool overlap = false) {
  using S = typename Net::storage_type;
  const std::size_t N = comm.size();
  const mb::batch_shape eff{8, 128};
  mb::plan_options po;
  po.threads = threads;
  po.optimizer_elements = zero >= 1 && N > 1 ? mb::shard_of(m.parameter_elements(), N, comm.rank()).size() : 0;
  po.gradients = mb::gradient_exchange_of<S>(comm, zero, overlap && N > 1);
  const mb::training_plan plan = mb::make_plan(m, mb::batch_shape{eff.batch / N, eff.seq}, mb::schedules::none{}, po);
  alloc_t a(std::size_t{1} << 32);
  mb::thread_pool pool(threads);
  mb::trainer_options to;
  to.zero = zero;
  to.overlap = overlap && N > 1;
  to.replan_under_pressure = false;
  mb::trainer t(m, eff, plan, a, pool, to, mb::null_monitor{}, comm);
  random_tokens src{eff.seq};
  (void)t.step(src);  // warm-up
  const mb::communication_stats before = comm.stats();
  std::vector<double> ms;
  for (std::size_t i = 0; i < steps; ++i) ms.push_back(t.step(src).ms);
  row r;
  r.all_ms = ms;
  std::sort(ms.begin(), ms.end());
  r.ms = ms[ms.size() / 2];
  r.sent = static_cast<double>(comm.stats().bytes_sent - before.bytes_sent) / static_cast<double>(steps);
  r.optimizer = t.optimizer_bytes();
  r.peak = a.stats().peak_requested;
  r.predicted = t.largest_predicted_peak();
  r.memory = t.memory();
  r.in_flight = plan.gradient_in_flight;
  r.gathered = plan.weight_gather;
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The 1-minute load average, or "?".
std::string load_average() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return "?";
  char buf[64] = {};
  const bool ok = std::fgets(buf, sizeof buf, f) != nullptr;
  std::fclose(f);
  if (!ok) return "?";
  std::string s(buf);
  return s.substr(0, s.find(' '));
}

}  // namespace

// [STEPS]: steps per measured run (default 5), the only argument.
static int bench_main(int argc, char** argv) {
  if (argc > 1 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf("usage: mpirun -np N bench_data_parallel [STEPS]\n  STEPS: steps per measured run, 1 to 100000 (default 5)\n");
    return 0;
  }
  if (argc > 2) throw membound::invalid_argument(argv[2], "at most one argument, STEPS", "another", "See --help");
  mb::mpi_communicator comm;
  const std::size_t steps = argc > 1 ? static_cast<std::size_t>(cli_checks::whole("STEPS", argv[1], 1, 100000, "5")) : 5;
  const std::size_t N = comm.size();
  mb::model_config cfg;
  cfg.vocab = 256;
  cfg.width = 128;
  cfg.heads = 4;
  const net m(cfg, {0, 1, 2, 1});
  const net16 m16(cfg, {0, 1, 2, 1});
  const double psi = static_cast<double>(m.weight_bytes());  // gradient bytes: Ψ
  const std::string load_before = load_average();
  // Blocking and overlapped, each stage, alternating, the same steps each round.
  constexpr std::size_t stages = 4;
  std::array<row, stages> blk, ovl;
  std::array<std::vector<double>, stages> blocking_ms, overlapped_ms;
  for (int round = 0; round < 3; ++round) {
    for (std::size_t z = 0; z < stages; ++z) {
      blk[z] = measure(m, comm, z, steps, 1);
      ovl[z] = measure(m, comm, z, steps, 1, true);
      blocking_ms[z].insert(blocking_ms[z].end(), blk[z].all_ms.begin(), blk[z].all_ms.end());
      overlapped_ms[z].insert(overlapped_ms[z].end(), ovl[z].all_ms.begin(), ovl[z].all_ms.end());
    }
  }
  for (std::size_t z = 0; z < stages; ++z) {
    blk[z].ms = median(blocking_ms[z]);
    ovl[z].ms = median(overlapped_ms[z]);
  }
  const row &z0 = blk[0], &z1 = blk[1], &z2 = blk[2], &z3 = blk[3], &z0o = ovl[0], &z1o = ovl[1], &z2o = ovl[2],
            &z3o = ovl[3];
  // bf16 storage: the model states DeepSpeed's mixed-precision formulas count.
  const row h0 = measure(m16, comm, 0, steps, 1), h1 = measure(m16, comm, 1, steps, 1), h2 = measure(m16, comm, 2, steps, 1),
            h3 = measure(m16, comm, 3, steps, 1);
  if (comm.rank() == 0) {
    const double ring = 2.0 * static_cast<double>(N - 1) / static_cast<double>(N) * psi;
    std::printf("| ranks | stage | step ms (median of %zu) | sent per step per rank | formula | optimizer bytes per rank | peak per rank |\n",
                steps);
    std::printf("|---|---|---|---|---|---|---|\n");
    std::printf("| %zu | ZeRO-0 | %.1f | %.0f | 2(N-1)/N·Ψ = %.0f | %zu | %zu |\n", N, z0.ms, z0.sent, ring, z0.optimizer,
                z0.peak);
    std::printf("| %zu | ZeRO-0 overlapped | %.1f | %.0f | 2(N-1)/N·Ψ = %.0f | %zu | %zu (%zu in flight) |\n", N, z0o.ms,
                z0o.sent, ring, z0o.optimizer, z0o.peak, z0o.in_flight);
    std::printf("| %zu | ZeRO-1 | %.1f | %.0f | 2(N-1)/N·Ψ = %.0f | %zu | %zu |\n", N, z1.ms, z1.sent, ring,
                z1.optimizer, z1.peak);
    std::printf("| %zu | ZeRO-1 overlapped | %.1f | %.0f | 2(N-1)/N·Ψ = %.0f | %zu | %zu (%zu in flight) |\n", N, z1o.ms,
                z1o.sent, ring, z1o.optimizer, z1o.peak, z1o.in_flight);
    std::printf("| %zu | ZeRO-2 | %.1f | %.0f | 2(N-1)/N·Ψ = %.0f | %zu | %zu |\n", N, z2.ms, z2.sent, ring,
                z2.optimizer, z2.peak);
    std::printf("| %zu | ZeRO-2 overlapped | %.1f | %.0f | 2(N-1)/N·Ψ = %.0f | %zu | %zu (%zu in flight) |\n", N, z2o.ms,
                z2o.sent, ring, z2o.optimizer, z2o.peak, z2o.in_flight);
    std::printf("| %zu | ZeRO-3 | %.1f | %.0f | (N-1)/N·Ψ per micro-batch + the gathers | %zu | %zu (%zu gathered) |\n", N,
                z3.ms, z3.sent, z3.optimizer, z3.peak, z3.gathered);
    std::printf("| %zu | ZeRO-3 overlapped | %.1f | %.0f | the same | %zu | %zu (%zu gathered, %zu in flight) |\n", N,
                z3o.ms, z3o.sent, z3o.optimizer, z3o.peak, z3o.gathered, z3o.in_flight);
    bool exact = true;
    for (std::size_t z = 0; z < stages; ++z) exact = exact && blk[z].peak == blk[z].predicted && ovl[z].peak == ovl[z].predicted;
    std::printf("(Ψ = %.0f gradient bytes, 1 thread per rank; the bytes sent include the loss's all-reduce of one double, "
                "and under ZeRO-1/2/3 the gather of N sums of squares for the norm; measured peak == predicted: %s)\n",
                psi, exact ? "yes, all eight" : "NO");
    for (std::size_t z = 0; z < stages; ++z) {
      std::printf("ZeRO-%zu step time, overlapped / blocking: %.3f (medians of %zu steps each, 3 alternating rounds)\n", z,
                  ovl[z].ms / blk[z].ms, blocking_ms[z].size());
    }
    std::printf("(load average, 1 minute: %s before, %s after; the machine's cores are shared)\n\n", load_before.c_str(),
                load_average().c_str());
    // Model states per rank. P parameter elements (padding included), s = rank 0's shard.
    const double P = static_cast<double>(m.parameter_elements());
    const double s = static_cast<double>(mb::shard_of(m.parameter_elements(), N, 0).size());
    const double n = static_cast<double>(N);
    // bf16's tensors are padded to the same byte alignment, so to other element counts.
    const double Q = static_cast<double>(m16.parameter_elements());
    const double q = static_cast<double>(mb::shard_of(m16.parameter_elements(), N, 0).size());
    std::printf("| ranks | stage | fp32 storage, rank 0 (measured) | ours, fp32 storage | bf16 storage, rank 0 "
                "(measured) | ours, bf16 storage | DeepSpeed, mixed precision (K = 12) |\n|---|---|---|---|---|---|---|\n");
    const auto states = [](const row& r) {
      return static_cast<double>(r.memory.weights + r.memory.gradients + r.memory.optimizer);
    };
    std::printf("| %zu | ZeRO-0 | %.0f | 16P = %.0f | %.0f | 2Q + 2Q + 12Q = %.0f | 16P = %.0f |\n", N, states(z0), 16 * P,
                states(h0), 16 * Q, 16 * P);
    std::printf("| %zu | ZeRO-1 | %.0f | 8P + 8s = %.0f | %.0f | 4Q + 12q = %.0f | 4P + 12P/N = %.0f |\n", N, states(z1),
                8 * P + 8 * s, states(h1), 4 * Q + 12 * q, 4 * P + 12 * P / n);
    std::printf("| %zu | ZeRO-2 | %.0f | 4P + 12s = %.0f | %.0f | 2Q + 14q = %.0f | 2P + 14P/N = %.0f |\n", N, states(z2),
                4 * P + 12 * s, states(h2), 2 * Q + 14 * q, 2 * P + 14 * P / n);
    std::printf("| %zu | ZeRO-3 | %.0f | 16s = %.0f | %.0f | 16q = %.0f | 16P/N = %.0f |\n", N, states(z3), 16 * s,
                states(h3), 16 * q, 16 * P / n);
    const bool exact16 = h0.peak == h0.predicted && h1.peak == h1.predicted && h2.peak == h2.predicted &&
                         h3.peak == h3.predicted;
    std::printf("(bf16 step ms, median of %zu: ZeRO-0 %.1f, ZeRO-1 %.1f, ZeRO-2 %.1f, ZeRO-3 %.1f; sent per step per rank "
                "%.0f / %.0f / %.0f / %.0f (fp32: %.0f / %.0f / %.0f / %.0f; 16-bit gradients and weights on the wire); peak "
                "per rank %zu / %zu / %zu / %zu, measured == predicted: %s)\n",
                steps, h0.ms, h1.ms, h2.ms, h3.ms, h0.sent, h1.sent, h2.sent, h3.sent, z0.sent, z1.sent, z2.sent, z3.sent,
                h0.peak, h1.peak, h2.peak, h3.peak, exact16 ? "yes" : "NO");
    std::printf("(ZeRO-3's model states exclude the weights it gathers in a step: %zu bytes in fp32, %zu in bf16: one "
                "slot of the largest weight unit: a block, the embedding or the head)\n",
                z3.gathered, h3.gathered);
    std::printf("(P = %.0f parameter elements, s = %.0f the shard of rank 0 (P/N rounded up); bf16: Q = %.0f, q = %.0f "
                "(each tensor padded to 64 bytes, so %.0f padding elements more); fp32 weights and gradients are 4 bytes "
                "each and AdamW's m, v 8, with no masters: 4 + 4 + 8 = 16; bf16 storage is DeepSpeed's mixed precision, "
                "2 + 2 + 12 (fp32 masters, m, v), sharded as it shards them)\n",
                P, s, Q, q, Q - P);
  }
  return 0;
}

int main(int argc, char** argv) {
  mb::mpi_environment env(argc, argv);
  return bench_flags::run([&] {
    try {
      return bench_main(argc, argv);
    } catch (const std::exception& e) {
      // An error on one rank (a flag's is every rank's) would leave the others in a collective
      // forever: its line, then end them all.
      int size = 1;
      MPI_Comm_size(MPI_COMM_WORLD, &size);
      if (size > 1) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: %s\n", e.what());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      throw;
    }
  });
}
