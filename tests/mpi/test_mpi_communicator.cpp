// mpi_communicator under mpiexec -n N (ctest runs N = 1, 2, 4 with --oversubscribe): every rank
// checks, bit for bit, what it received against the same collective computed locally from every
// rank's data (each rank can generate all of them from the seed), and the ranks agree on the
// verdict. The reference sum is the sequential one, g = g_0; g += g_1; ..., which is what one
// process accumulating N micro-batches computes: equality here is the property data-parallel
// training relies on to match one process bit for bit.
//
// Also: all_reduce_sum started (start_all_reduce_sum, two in flight); reduce_scatter_blocks_sum
// against the sequential sum; started, over bf16 (the fp32
// rank-order sum of the widened values, rounded once); a communicator with a timeout
// (collective_timeout on the ranks left waiting for a late one).
//
// Plain main (no doctest): N processes printing one report each would interleave; rank 0 prints.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "membound/mpi.hpp"

namespace mb = membound;

namespace {

int failures = 0;
void check(bool ok, const std::string& what, std::size_t rank) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "rank %zu: FAIL: %s\n", rank, what.c_str());
  }
}

// Values of mixed signs and magnitudes 1e-3 … 1e3, so the order of a sum shows in its bits.
template <typename T>
std::vector<T> data_of(std::size_t rank, std::size_t n, std::uint64_t salt) {
  std::vector<T> v(n);
  std::uint64_t s = (rank + 1) * 0x9E3779B97F4A7C15ull ^ salt;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(s >> 11) / 9007199254740992.0;  // [0, 1)
    const double mag = std::pow(10.0, -3.0 + 6.0 * u);
    x = static_cast<T>(((s >> 7) & 1) != 0 ? mag : -mag);
  }
  return v;
}

template <typename T>
std::vector<T> sequential_sum(std::size_t ranks, std::size_t n, std::uint64_t salt) {
  std::vector<T> g = data_of<T>(0, n, salt);
  for (std::size_t r = 1; r < ranks; ++r) {
    const std::vector<T> d = data_of<T>(r, n, salt);
    for (std::size_t i = 0; i < n; ++i) g[i] += d[i];
  }
  return g;
}

template <typename T>
bool same_bits(const T* a, const T* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;
}

template <typename T>
void collectives(mb::mpi_communicator& comm, std::size_t n, const char* type) {
  const std::size_t N = comm.size(), me = comm.rank();
  const std::string at = std::string(type) + " n=" + std::to_string(n) + ": ";
  const std::uint64_t salt = n * 31 + sizeof(T);
  const std::vector<T> want = sequential_sum<T>(N, n, salt);
  const mb::shard_range mine = mb::shard_of(n, N, me);

  // Reduce-scatter: this rank's shard of the ordered sum.
  {
    const std::vector<T> in = data_of<T>(me, n, salt);
    std::vector<std::byte> ws(comm.template reduce_scatter_workspace_bytes<T>(n));
    std::vector<T> out(mine.size() + 1, T(-7));  // one guard element past the shard
    comm.reduce_scatter_sum(in.data(), n, out.data(), ws.data(), ws.size());
    check(same_bits(out.data(), want.data() + mine.begin, mine.size()), at + "reduce_scatter_sum == ordered sum", me);
    check(out[mine.size()] == T(-7), at + "reduce_scatter_sum writes only the shard", me);
    check(in == data_of<T>(me, n, salt), at + "reduce_scatter_sum leaves its input", me);
  }
  // All-reduce, in place.
  {
    std::vector<T> data = data_of<T>(me, n, salt);
    std::vector<std::byte> ws(comm.template all_reduce_workspace_bytes<T>(n));
    comm.all_reduce_sum(data.data(), n, ws.data(), ws.size());
    check(same_bits(data.data(), want.data(), n), at + "all_reduce_sum == ordered sum on every rank", me);
  }
  // All-reduces started (ZeRO-0's overlap): two in flight, moved into handles made before (a
  // move-assigned handle keeps its state), polled with test(), waited in reverse order; the
  // blocking all-reduce's bits and bytes sent.
  {
    std::vector<T> a = data_of<T>(me, n, salt), b = data_of<T>(me, n, salt + 1);
    const std::vector<T> want_b = sequential_sum<T>(N, n, salt + 1);
    std::vector<std::byte> wa(comm.template all_reduce_workspace_bytes<T>(n)), wb(wa.size());
    const std::uint64_t before = comm.stats().bytes_sent;
    mb::mpi_communicator::pending_all_reduce pa, pb;
    pa = comm.start_all_reduce_sum(a.data(), n, wa.data(), wa.size());
    pb = comm.start_all_reduce_sum(b.data(), n, wb.data(), wb.size());
    (void)pa.test();
    pb.wait();
    while (!pa.test()) {
    }
    pa.wait();
    const std::uint64_t sent = comm.stats().bytes_sent - before;
    check(same_bits(a.data(), want.data(), n) && same_bits(b.data(), want_b.data(), n),
          at + "started all-reduces == ordered sums on every rank", me);
    const std::uint64_t s = mine.size() * sizeof(T);
    check(sent == 2 * ((n * sizeof(T) - s) + s * (N - 1)),
          at + "started all-reduces: the blocking one's bytes sent (" + std::to_string(sent) + ")", me);
    // A blocking collective while one is in flight and polled (some ranks' test() may have started
    // its all-gather, others not: the blocking call starts it first on those, so the order matches).
    std::vector<T> c = data_of<T>(me, n, salt), d = data_of<T>(me, n, salt + 1);
    std::vector<std::byte> wd(wa.size());
    auto pc = comm.start_all_reduce_sum(c.data(), n, wa.data(), wa.size());
    for (std::size_t k = 0; k < 3 * (me + 1); ++k) (void)pc.test();
    comm.all_reduce_sum(d.data(), n, wd.data(), wd.size());
    pc.wait();
    check(same_bits(c.data(), want.data(), n) && same_bits(d.data(), want_b.data(), n),
          at + "a blocking all-reduce while a started one is in flight", me);
  }
  // All-gather, from a separate shard and in place.
  {
    const std::vector<T> full = data_of<T>(0, n, salt ^ 0xABCDu);  // the same on every rank
    std::vector<T> shard(full.begin() + static_cast<std::ptrdiff_t>(mine.begin),
                         full.begin() + static_cast<std::ptrdiff_t>(mine.end));
    std::vector<T> out(n, T(0));
    comm.all_gather(shard.data(), out.data(), n);
    check(same_bits(out.data(), full.data(), n), at + "all_gather assembles every shard", me);
    std::vector<T> in_place(n, T(0));
    std::copy(shard.begin(), shard.end(), in_place.begin() + static_cast<std::ptrdiff_t>(mine.begin));
    comm.all_gather(in_place.data() + mine.begin, in_place.data(), n);
    check(same_bits(in_place.data(), full.data(), n), at + "all_gather in place", me);
    // Blocks of uneven sizes (the last rank's empty, rank 0's the largest), at offsets that are
    // not the shards', in place: ZeRO-3's gather of one block's weights.
    std::vector<mb::shard_range> blocks(N);
    std::size_t at_k = std::min<std::size_t>(n, 1);  // element 0 belongs to no rank and stays untouched
    for (std::size_t r = 0; r < N; ++r) {
      const std::size_t len = r + 1 == N && N > 1 ? 0 : std::min(n - at_k, (n / (r + 2)) + 1);
      blocks[r] = {at_k, at_k + len};
      at_k += len;
    }
    std::vector<T> gathered(n, T(0));
    std::copy(full.begin() + static_cast<std::ptrdiff_t>(blocks[me].begin),
              full.begin() + static_cast<std::ptrdiff_t>(blocks[me].end),
              gathered.begin() + static_cast<std::ptrdiff_t>(blocks[me].begin));
    comm.all_gather_blocks(gathered.data(), blocks.data());
    const T zero(0);
    bool same = n == 0 || std::memcmp(&gathered[0], &zero, sizeof(T)) == 0;
    for (std::size_t i = std::min<std::size_t>(n, 1); i < at_k; ++i) same = same && std::memcmp(&gathered[i], &full[i], sizeof(T)) == 0;
    for (std::size_t i = at_k; i < n; ++i) same = same && std::memcmp(&gathered[i], &zero, sizeof(T)) == 0;
    check(same, at + "all_gather_blocks assembles uneven blocks in place, nothing else", me);
    // Started, with a blocking collective between start and wait (ZeRO-3's prefetch runs through
    // the block's compute and its gradient exchange); a second start while it is in flight is refused.
    std::vector<T> started(n, T(0));
    std::copy(full.begin() + static_cast<std::ptrdiff_t>(blocks[me].begin),
              full.begin() + static_cast<std::ptrdiff_t>(blocks[me].end),
              started.begin() + static_cast<std::ptrdiff_t>(blocks[me].begin));
    auto pg = comm.start_all_gather_blocks(started.data(), blocks.data());
    bool refused = false;
    try {
      std::vector<T> other(n, T(0));
      (void)comm.start_all_gather_blocks(other.data(), blocks.data());
    } catch (const mb::invalid_argument& e) {
      refused = std::string(e.argument()) == "start_all_gather_blocks";
    }
    check(refused, at + "a second started gather while one is in flight: invalid_argument", me);
    std::vector<T> sum_in = data_of<T>(me, n, salt + 5);
    std::vector<std::byte> ws_sum(comm.template all_reduce_workspace_bytes<T>(n));
    comm.all_reduce_sum(sum_in.data(), n, ws_sum.data(), ws_sum.size());
    (void)pg.test();
    pg.wait();
    check(same_bits(started.data(), gathered.data(), n), at + "a started all_gather_blocks: the blocking one's bytes", me);
    auto again = comm.start_all_gather_blocks(started.data(), blocks.data());  // allowed once waited
    again.wait();
  }
  // Two reduce-scatters in flight, waited in reverse order.
  {
    const std::vector<T> a = data_of<T>(me, n, salt), b = data_of<T>(me, n, salt + 1);
    const std::vector<T> want_b = sequential_sum<T>(N, n, salt + 1);
    std::vector<std::byte> wa(comm.template reduce_scatter_workspace_bytes<T>(n)),
        wb(comm.template reduce_scatter_workspace_bytes<T>(n));
    std::vector<T> oa(mine.size()), ob(mine.size());
    auto pa = comm.start_reduce_scatter_sum(a.data(), n, oa.data(), wa.data(), wa.size());
    auto pb = comm.start_reduce_scatter_sum(b.data(), n, ob.data(), wb.data(), wb.size());
    pb.wait();
    pa.wait();
    check(!pa.pending() && !pb.pending(), at + "requests done after wait", me);
    check(same_bits(oa.data(), want.data() + mine.begin, mine.size()) &&
              same_bits(ob.data(), want_b.data() + mine.begin, mine.size()),
          at + "overlapped reduce-scatters", me);
  }
}

}  // namespace

int main(int argc, char** argv) {
  mb::mpi_environment env(argc, argv);
  mb::mpi_communicator comm;
  const std::size_t N = comm.size(), me = comm.rank();

  // Shards: balanced, covering, in order.
  for (std::size_t n : {0u, 1u, 3u, 7u, 1000u}) {
    std::size_t at = 0;
    for (std::size_t r = 0; r < N; ++r) {
      const mb::shard_range s = mb::shard_of(n, N, r);
      check(s.begin == at && s.size() <= mb::max_shard(n, N) && s.size() + 1 >= mb::max_shard(n, N),
            "shard_of(" + std::to_string(n) + ") balanced and contiguous", me);
      at = s.end;
    }
    check(at == n, "shards cover n", me);
  }
  // n = 0, fewer elements than ranks, uneven shards, and a size past one page per rank.
  for (std::size_t n : {0u, 1u, 3u, 7u, 1000u, 65537u}) {
    collectives<float>(comm, n, "float");
    collectives<double>(comm, n, "double");
  }

  // Bytes sent by an all-reduce: the ring formula 2·(N − 1)/N·n, exactly when N divides n.
  {
    const std::size_t n = 1000;
    std::vector<float> g = data_of<float>(me, n, 5);
    std::vector<std::byte> ws(comm.all_reduce_workspace_bytes<float>(n));
    const mb::communication_stats before = comm.stats();
    comm.all_reduce_sum(g.data(), n, ws.data(), ws.size());
    const std::uint64_t sent = comm.stats().bytes_sent - before.bytes_sent;
    check(sent == 2 * (N - 1) * (n / N) * sizeof(float),
          "all_reduce_sum of 1000 floats sends 2(N-1)/N of them (" + std::to_string(sent) + " bytes)", me);
    check(comm.stats().collectives == before.collectives + 2, "an all-reduce is two collectives", me);
  }
  // Broadcast from the last rank.
  {
    std::vector<std::int32_t> v(5, static_cast<std::int32_t>(me));
    comm.broadcast(v.data(), v.size(), N - 1);
    check(v == std::vector<std::int32_t>(5, static_cast<std::int32_t>(N - 1)), "broadcast from the last rank", me);
  }
  // Typed errors, before any communication (so every rank throws, and none blocks).
  {
    std::vector<float> g(10);
    std::vector<std::byte> small(comm.reduce_scatter_workspace_bytes<float>(10) - 1);
    bool threw = false;
    try {
      comm.all_reduce_sum(g.data(), g.size(), small.data(), small.size());
    } catch (const mb::workspace_too_small& e) {
      threw = std::string(e.argument()) == "workspace";
    }
    check(threw, "a workspace one byte short: workspace_too_small naming the workspace", me);
    threw = false;
    try {
      comm.broadcast(g.data(), g.size(), N);
    } catch (const mb::invalid_argument& e) {
      threw = std::string(e.argument()) == "root";
    }
    check(threw, "a root past the world: invalid_argument naming root", me);
  }
  comm.barrier();

  // reduce_scatter_blocks_sum (ZeRO-1's exchange): rank r receives the rank-order sum of every
  // rank's in[blocks[r]], blocks of unequal sizes (one empty), in place at in + blocks[r].begin.
  {
    const std::size_t n = 1000;
    std::vector<mb::shard_range> blocks(N);
    std::size_t at = 0;
    for (std::size_t r = 0; r < N; ++r) {
      const std::size_t len = r == 1 ? 0 : 37 + 11 * r;
      blocks[r] = {at, at + len};
      at += len + 5;  // gaps between blocks are left alone
    }
    std::vector<float> g = data_of<float>(me, n, 42);
    const std::vector<float> before = g;
    std::vector<float> want(blocks[me].size());
    for (std::size_t r = 0; r < N; ++r) {
      const std::vector<float> d = data_of<float>(r, n, 42);
      for (std::size_t i = 0; i < want.size(); ++i) want[i] = r == 0 ? d[blocks[me].begin + i] : want[i] + d[blocks[me].begin + i];
    }
    std::vector<std::byte> ws(comm.reduce_scatter_blocks_workspace_bytes<float>(37 + 11 * (N - 1)));
    comm.reduce_scatter_blocks_sum(g.data(), blocks.data(), g.data() + blocks[me].begin, ws.data(), ws.size());
    check(same_bits(g.data() + blocks[me].begin, want.data(), want.size()),  // rank 1's block is empty
          "reduce_scatter_blocks_sum: this rank's block is the rank-order sum, bit for bit", me);
    bool rest = true;
    for (std::size_t i = 0; i < n; ++i) {
      if ((i < blocks[me].begin || i >= blocks[me].end) && std::memcmp(&g[i], &before[i], sizeof(float)) != 0) rest = false;
    }
    check(rest, "reduce_scatter_blocks_sum: nothing outside this rank's block changes", me);
  }

  // Started (ZeRO-2's overlap) and 16-bit: bf16 moves as 16 bits and each element is the fp32
  // rank-order sum of the widened values, rounded once; test() until done, then wait() sums.
  {
    const std::size_t n = 1000;
    std::vector<mb::shard_range> blocks(N);
    for (std::size_t r = 0; r < N; ++r) blocks[r] = {r * 50, r * 50 + 40};
    const auto bf16_of = [&](std::size_t r) {
      const std::vector<float> f = data_of<float>(r, n, 43);
      std::vector<mb::bf16> h(n);
      for (std::size_t i = 0; i < n; ++i) h[i] = mb::from_accum<mb::bf16>(f[i]);
      return h;
    };
    const std::vector<mb::bf16> g = bf16_of(me);
    std::vector<mb::bf16> want(40), out(40);
    for (std::size_t i = 0; i < 40; ++i) {
      float acc = 0;
      for (std::size_t r = 0; r < N; ++r) {
        const float v = mb::to_accum<float>(bf16_of(r)[blocks[me].begin + i]);
        acc = r == 0 ? v : acc + v;
      }
      want[i] = mb::from_accum<mb::bf16>(acc);
    }
    std::vector<std::byte> ws(comm.reduce_scatter_blocks_workspace_bytes<mb::bf16>(40));
    check(ws.size() == N * 40 * 2 + 4 * N * sizeof(int), "bf16: a workspace of N blocks of 16-bit values", me);
    auto p = comm.start_reduce_scatter_blocks_sum(g.data(), blocks.data(), out.data(), ws.data(), ws.size());
    while (!p.test()) {
    }
    p.wait();
    check(std::memcmp(out.data(), want.data(), 40 * sizeof(mb::bf16)) == 0,
          "bf16 started reduce_scatter_blocks_sum: the fp32 rank-order sum rounded once, bit for bit", me);
  }

  // Timeouts: a communicator with a 200 ms timeout sums as the untimed one; then rank 0 joins a
  // barrier a second late and every other rank throws collective_timeout after ~200 ms, and its
  // communicator refuses the next collective.
  {
    using namespace std::chrono_literals;
    mb::mpi_communicator timed(MPI_COMM_WORLD, 200ms);
    std::vector<double> a = data_of<double>(me, 100, 9), b = a;
    std::vector<std::byte> ws(comm.all_reduce_workspace_bytes<double>(100));
    comm.all_reduce_sum(a.data(), a.size(), ws.data(), ws.size());
    timed.all_reduce_sum(b.data(), b.size(), ws.data(), ws.size());
    check(a == b, "a timed communicator: the same all-reduce, bit for bit", me);
    if (N > 1) {
      if (me == 0) std::this_thread::sleep_for(1s);
      const auto t0 = std::chrono::steady_clock::now();
      bool timed_out = false;
      try {
        timed.barrier();
      } catch (const mb::collective_timeout& e) {
        timed_out = e.timeout() == 200ms;
      }
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (me == 0) {
        check(!timed_out && timed.usable(), "the late rank completes its barrier", me);
      } else {
        check(timed_out && waited >= 0.2 && waited < 0.9 && !timed.usable(),
              "a rank waiting for a late one: collective_timeout after 200 ms (waited " + std::to_string(waited) + " s)", me);
        bool refused = false;
        try {
          timed.barrier();
        } catch (const mb::communication_error&) {
          refused = true;
        }
        check(refused, "after a timeout the communicator refuses the next collective", me);
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);  // the late barrier has completed everywhere before `timed` goes
  }

  // Every rank's verdict, so that one failing rank fails them all.
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, comm.native());
  if (me == 0) {
    if (total == 0) {
      std::printf("test_mpi_communicator: %zu rank(s), all checks passed\n", N);
    } else {
      std::printf("test_mpi_communicator: %zu rank(s), %d check(s) failed\n", N, total);
    }
  }
  return total == 0 ? 0 : 1;
}
