// Runs membound::attention on inputs written by bench/peers/attention_peer.py, for its
// comparison with PyTorch's scaled_dot_product_attention on the CPU. Not part of ctest.
//
//   attention_peer_runner IN OUT --prec fp32|bf16 --pass fwd|fwdbwd [--reps N] [--threads N]
//                         [--mode all|time|memory]
//
// IN (little-endian): 8 uint64 B, T, C, H, Hkv, D, causal, dtype (0 fp32, 1 bf16), then x
// [B, T, C], wq [C, H·D], wk [C, Hkv·D], wv [C, Hkv·D], wo [H·D, C], dy [B, T, C] in the storage
// type (W is [in, out], row-major; RoPE base 10000).
// OUT: y, then for fwdbwd dx, dwq, dwk, dwv, dwo, in the storage type, from one fresh call
// (gradients zeroed: ours accumulate +=); written by modes all and memory.
// stdout: one JSON line {"ms", "peak_alloc_bytes", "peak_rss_bytes", "threads", ...}:
//   ms                (modes all, time) best of --reps wall times of one call after one warm-up;
//   cpu_ms            (modes all, time) the least process CPU time (all threads) of those calls:
//                     on a shared machine, the work done, whatever the other processes took;
//                     a call allocates saved + workspace from a system_allocator, runs forward
//                     (and backward into preallocated dx and gradients) and frees them.
//   peak_alloc_bytes  (modes all, memory) the allocator's peak_requested over one call: saved +
//                     workspace, the layer's own memory beyond inputs, outputs, weights, grads.
//   peak_rss_bytes    (modes all, memory) VmHWM - VmRSS around one call after the warm-up (and
//                     the timing), measured as attention_peer.py measures PyTorch:
//                     malloc_trim(0), "5" to /proc/self/clear_refs (resets VmHWM), read VmRSS,
//                     allocate the outputs (y; dx and gradients for fwdbwd, zeroed) and run the
//                     call, read VmHWM. Outputs are allocated inside the window because PyTorch
//                     allocates its y, x.grad and weight .grad inside it too.
// Modes: `time` runs under glibc's default malloc settings. `memory` and `all` first fix glibc's
// mmap threshold at 128 KiB (mallopt(M_MMAP_THRESHOLD), as MALLOC_MMAP_THRESHOLD_=131072 does):
// by default glibc raises the threshold whenever a large buffer is freed, after which buffers of
// up to 32 MiB come from the heap and stay resident once freed, so that the RSS peak of a call
// counts whatever earlier calls left in the heap (our forward workspace beside backward's, seen
// as +8 MiB at T=512 D=64 bf16). attention_peer.py times with `time` and measures with `memory`.
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "membound/membound.hpp"

namespace mb = membound;
using clock_type = std::chrono::steady_clock;

namespace {

struct tracked {  // a buffer from the allocator, so that its statistics see it
  mb::system_allocator* alloc = nullptr;
  void* p = nullptr;
  std::size_t bytes = 0;
  tracked(mb::system_allocator& a, std::size_t n) : alloc(&a), bytes(n) {
    p = n ? a.allocate(n, mb::default_alignment, mb::memory_tag::workspace) : nullptr;
  }
  tracked(const tracked&) = delete;
  tracked& operator=(const tracked&) = delete;
  ~tracked() {
    if (p) alloc->deallocate(p, bytes, mb::default_alignment, mb::memory_tag::workspace);
  }
};

// VmRSS / VmHWM of this process, in bytes.
std::size_t proc_status_bytes(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::size_t n = std::strlen(key);
  while (std::getline(f, line)) {
    if (line.compare(0, n, key) == 0 && line.size() > n && line[n] == ':') {
      return static_cast<std::size_t>(std::stoull(line.substr(n + 1))) * 1024;  // "  123 kB"
    }
  }
  throw std::runtime_error(std::string("no ") + key + " in /proc/self/status");
}

void reset_hwm() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  if (!f) throw std::runtime_error("cannot write /proc/self/clear_refs");
}

[[noreturn]] void usage(const char* prog, const std::string& why) {
  std::fprintf(stderr,
               "%s\nusage: %s IN OUT --prec fp32|bf16 --pass fwd|fwdbwd [--reps N] [--threads N]"
               " [--mode all|time|memory]\n",
               why.c_str(), prog);
  std::exit(2);
}

template <typename S>
void read_into(std::ifstream& f, std::vector<S>& v, std::size_t n, const char* name) {
  v.resize(n);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(S)));
  if (!f) throw std::runtime_error(std::string("IN ends before ") + name);
}

template <typename S>
void write_out(std::ofstream& f, const std::vector<S>& v) {
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(S)));
}

enum class run_mode { all, time, memory };

template <typename Attn>
int run(const mb::attention_shape& s, std::ifstream& in, const std::string& out_path, bool bwd,
        int reps, std::size_t threads, run_mode mode) {
  using S = typename Attn::storage_type;
  const std::size_t N = s.batch * s.seq, C = s.d_model, HD = s.heads * s.head_dim,
                    KD = s.kv_heads * s.head_dim;
  std::vector<S> x, wq, wk, wv, wo, dy;
  read_into(in, x, N * C, "x");
  read_into(in, wq, C * HD, "wq");
  read_into(in, wk, C * KD, "wk");
  read_into(in, wv, C * KD, "wv");
  read_into(in, wo, HD * C, "wo");
  read_into(in, dy, N * C, "dy");
  Attn::check(s);
  mb::thread_pool pool(threads);
  const typename Attn::weights w{wq.data(), wk.data(), wv.data(), wo.data()};

  // One call: saved + workspace from `alloc`, outputs from the caller.
  const auto call = [&](mb::system_allocator& alloc, S* y, S* dx, S* gq, S* gk, S* gv, S* go) {
    tracked saved(alloc, Attn::saved_bytes(s));
    {
      tracked ws(alloc, Attn::forward_workspace_bytes(s, pool.size()));
      Attn::forward(s, w, x.data(), y, saved.p, saved.bytes, ws.p, ws.bytes, pool);
    }
    if (bwd) {
      tracked ws(alloc, Attn::backward_workspace_bytes(s, pool.size()));
      Attn::backward(s, w, x.data(), saved.p, saved.bytes, dy.data(), dx, {gq, gk, gv, go}, ws.p,
                     ws.bytes, pool);
    }
  };

  // Warm-up, then the timing: outputs allocated once (gradients accumulate across calls; their
  // values do not matter here).
  double best = 1e300, best_cpu = 1e300;
  const auto cpu_now = [] {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) * 1e-6;
  };
  {
    std::vector<S> y(N * C), dx(bwd ? N * C : 0), gq(bwd ? C * HD : 0), gk(bwd ? C * KD : 0),
        gv(bwd ? C * KD : 0), go(bwd ? HD * C : 0);
    const int calls = mode == run_mode::memory ? 0 : reps;
    for (int r = 0; r <= calls; ++r) {  // r = 0 is the warm-up
      mb::system_allocator alloc;
      const auto t0 = clock_type::now();
      const double c0 = cpu_now();
      call(alloc, y.data(), dx.data(), gq.data(), gk.data(), gv.data(), go.data());
      const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
      const double cpu = cpu_now() - c0;
      if (r > 0) best = std::min(best, ms);
      if (r > 0) best_cpu = std::min(best_cpu, cpu);
    }
  }

  nlohmann::json j;
  j["threads"] = pool.size();
  if (mode != run_mode::memory) j["cpu_ms"] = best_cpu;
  if (mode == run_mode::time) {
    j["ms"] = best;
    std::cout << j.dump() << std::endl;
    return 0;
  }

  // One fresh call: its peaks, and the outputs written to OUT.
  malloc_trim(0);
  reset_hwm();
  const std::size_t rss_before = proc_status_bytes("VmRSS");
  mb::system_allocator alloc;
  std::vector<S> y(N * C), dx(bwd ? N * C : 0), gq(bwd ? C * HD : 0), gk(bwd ? C * KD : 0),
      gv(bwd ? C * KD : 0), go(bwd ? HD * C : 0);  // value-initialized: zero
  call(alloc, y.data(), dx.data(), gq.data(), gk.data(), gv.data(), go.data());
  const std::size_t hwm = proc_status_bytes("VmHWM");

  std::ofstream out(out_path, std::ios::binary);
  write_out(out, y);
  if (bwd) {
    write_out(out, dx);
    write_out(out, gq);
    write_out(out, gk);
    write_out(out, gv);
    write_out(out, go);
  }
  if (!out) throw std::runtime_error("cannot write " + out_path);

  const std::size_t out_bytes = (y.size() + dx.size() + gq.size() + gk.size() + gv.size() +
                                 go.size()) * sizeof(S);
  if (mode == run_mode::all) j["ms"] = best;
  j["peak_alloc_bytes"] = alloc.stats().peak_requested;
  j["peak_rss_bytes"] = hwm > rss_before ? hwm - rss_before : 0;
  j["output_bytes"] = out_bytes;
  j["saved_bytes"] = Attn::saved_bytes(s);
  std::cout << j.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> pos;
  std::string prec, pass, mode_name = "all";
  int reps = 3;
  std::size_t threads = mb::thread_pool::default_threads();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(argv[0], a + " needs a value");
      return argv[++i];
    };
    if (a == "--prec") prec = value();
    else if (a == "--pass") pass = value();
    else if (a == "--mode") mode_name = value();
    else if (a == "--reps") reps = std::max(1, std::atoi(value().c_str()));
    else if (a == "--threads") threads = static_cast<std::size_t>(std::max(1, std::atoi(value().c_str())));
    else if (a.rfind("--", 0) == 0) usage(argv[0], "unknown option " + a);
    else pos.push_back(a);
  }
  if (pos.size() != 2) usage(argv[0], "needs IN and OUT");
  if (prec != "fp32" && prec != "bf16") usage(argv[0], "--prec is fp32 or bf16");
  if (pass != "fwd" && pass != "fwdbwd") usage(argv[0], "--pass is fwd or fwdbwd");
  if (mode_name != "all" && mode_name != "time" && mode_name != "memory") {
    usage(argv[0], "--mode is all, time or memory");
  }
  const run_mode mode = mode_name == "time" ? run_mode::time
                        : mode_name == "memory" ? run_mode::memory
                                                : run_mode::all;
  // Before the first large allocation, so that no freed buffer is ever kept in the heap.
  if (mode != run_mode::time) mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  try {
    std::ifstream in(pos[0], std::ios::binary);
    if (!in) throw std::runtime_error("cannot open " + pos[0]);
    std::uint64_t h[8];
    in.read(reinterpret_cast<char*>(h), sizeof h);
    if (!in) throw std::runtime_error("IN is shorter than its header");
    mb::attention_shape s;
    s.batch = h[0];
    s.seq = h[1];
    s.d_model = h[2];
    s.heads = h[3];
    s.kv_heads = h[4];
    s.head_dim = h[5];
    s.causal = h[6] != 0;
    s.rope_base = 10000.0;
    const std::uint64_t dtype = prec == "fp32" ? 0 : 1;
    if (h[7] != dtype) throw std::runtime_error("IN's dtype code does not match --prec " + prec);
    const bool bwd = pass == "fwdbwd";
    if (prec == "fp32") {
      return run<mb::attention<mb::fp32_precision>>(s, in, pos[1], bwd, reps, threads, mode);
    }
    return run<mb::attention<mb::bf16_precision>>(s, in, pos[1], bwd, reps, threads, mode);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_peer_runner: %s\n", e.what());
    return 1;
  }
}
