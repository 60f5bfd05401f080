// Runs membound::ttt_linear or membound::ttt_mlp on inputs written by bench/peers/ttt_peer.py, for
// its comparison with the same TTT-Linear / TTT-MLP layer in PyTorch on the CPU. Not part of ctest.
//
//   ttt_peer_runner IN OUT --prec fp32|bf16 --pass fwd|fwdbwd [--kind linear|mlp]
//                   [--group 1|4|all] [--reps N] [--threads N]
//
// IN (little-endian): 8 uint64 B, T, C, H, b (mini-batch: 16), use_gate (0 or 1), kind (0
// TTT-Linear, 1 TTT-MLP), dtype (0 fp32, 1 bf16), then x [B, T, C], wq, wk, wv [C, C],
// ttt_norm_w, ttt_norm_b [H, D], w1 [H, D, F], b1 [H, F], lr_w [H, C], lr_b [H], tok_offset [b],
// post_w, post_b [C], wg [C, C] (only when use_gate), wo [C, C], then for TTT-MLP w2 [H, F, D],
// b2 [H, D], then dy [B, T, C], in the storage type (F = D for TTT-Linear, 4·D for TTT-MLP): the
// layout and order of membound::basic_ttt::weights (W is [in, out], row-major; base_lr 1, RoPE
// base 10000). --kind (default linear) must match the header's kind.
// OUT: y, then for fwdbwd dx and the gradients in the order above (wg only when use_gate, w2 and
// b2 only for TTT-MLP), in the storage type, from one fresh call (gradients zeroed: ours
// accumulate +=).
// --group: the checkpoint policy, ttt_state_groups<1>, <4> (default) or ttt_state_groups_all.
// stdout: one JSON line {"ms", "peak_alloc_bytes", "peak_rss_bytes", "threads", ...}:
//   ms                best of --reps wall times of one call after one warm-up; a call allocates
//                     saved + workspace from a system_allocator, runs forward (and backward into
//                     preallocated dx and gradients) and frees them.
//   peak_alloc_bytes  the allocator's peak_requested over one call: saved + workspace, the
//                     layer's own memory beyond its inputs, outputs, weights and gradients.
//   peak_rss_bytes    VmHWM - VmRSS around one call, after the timing, measured as ttt_peer.py
//                     measures PyTorch: mallopt(M_MMAP_THRESHOLD, 128 KiB) (fixes glibc's
//                     threshold, whose dynamic growth would otherwise keep freed buffers of up to
//                     32 MiB in the heap, resident, so that the peak depends on earlier calls),
//                     malloc_trim(0), "5" to /proc/self/clear_refs (resets VmHWM), read VmRSS,
//                     allocate the outputs (y; dx and gradients for fwdbwd, zeroed) and run the
//                     call, read VmHWM. Outputs are allocated inside the window because PyTorch
//                     allocates its y, x.grad and parameter .grad inside it too.
#include <malloc.h>

#include <algorithm>
#include <array>
#include <chrono>
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

constexpr std::size_t mini_batch = 16;
constexpr std::size_t n_weights = 16;  // the order of basic_ttt::weights
const char* const weight_names[n_weights] = {
    "wq", "wk", "wv", "ttt_norm_w", "ttt_norm_b", "w1", "b1", "lr_w", "lr_b", "tok_offset",
    "post_w", "post_b", "wg", "wo", "w2", "b2"};

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
               "%s\nusage: %s IN OUT --prec fp32|bf16 --pass fwd|fwdbwd [--kind linear|mlp] "
               "[--group 1|4|all] [--reps N] [--threads N]\n",
               why.c_str(), prog);
  std::exit(2);
}

template <typename S>
void read_into(std::ifstream& f, std::vector<S>& v, std::size_t n, const char* name) {
  v.resize(n);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(S)));
  if (!f) throw std::runtime_error(std::string("IN ends before the end of ") + name);
}

template <typename S>
void write_out(std::ofstream& f, const std::vector<S>& v) {
  f.write(reinterpret_cast<const char*>(v.data()),
          static_cast<std::streamsize>(v.size() * sizeof(S)));
}

std::array<std::size_t, n_weights> weight_sizes(const mb::ttt_shape& s, bool mlp) {
  const std::size_t C = s.width, H = s.heads, D = s.head_dim(), F = mlp ? 4 * D : D;
  return {C * C, C * C, C * C, H * D, H * D, H * D * F, H * F, H * C, H, mini_batch, C, C,
          s.use_gate ? C * C : 0, C * C, mlp ? H * F * D : 0, mlp ? H * D : 0};
}

template <typename Layer>
int run(const mb::ttt_shape& s, std::ifstream& in, const std::string& out_path, bool bwd, int reps,
        std::size_t threads) {
  using S = typename Layer::storage_type;
  const std::size_t N = s.batch * s.seq, C = s.width;
  const auto sizes = weight_sizes(s, Layer::is_mlp);
  std::vector<S> x, dy;
  std::array<std::vector<S>, n_weights> w;
  read_into(in, x, N * C, "x");
  for (std::size_t k = 0; k < n_weights; ++k) read_into(in, w[k], sizes[k], weight_names[k]);
  read_into(in, dy, N * C, "dy");
  if (in.peek() != std::ifstream::traits_type::eof()) {
    throw std::runtime_error("IN is longer than its header says");
  }
  Layer::check(s);
  mb::thread_pool pool(threads);
  const auto ptr = [](const std::vector<S>& v) -> const S* { return v.empty() ? nullptr : v.data(); };
  const typename Layer::weights wv{ptr(w[0]),  ptr(w[1]),  ptr(w[2]),  ptr(w[3]),
                                   ptr(w[4]),  ptr(w[5]),  ptr(w[6]),  ptr(w[7]),
                                   ptr(w[8]),  ptr(w[9]),  ptr(w[10]), ptr(w[11]),
                                   ptr(w[12]), ptr(w[13]), ptr(w[14]), ptr(w[15])};

  struct outputs {
    std::vector<S> y, dx;
    std::array<std::vector<S>, n_weights> g;
    outputs(std::size_t n, bool bwd, const std::array<std::size_t, n_weights>& sizes)
        : y(n), dx(bwd ? n : 0) {  // value-initialized: zero
      for (std::size_t k = 0; k < n_weights; ++k) g[k].resize(bwd ? sizes[k] : 0);
    }
    typename Layer::gradients grads() {
      const auto p = [](std::vector<S>& v) -> S* { return v.empty() ? nullptr : v.data(); };
      return {p(g[0]), p(g[1]), p(g[2]),  p(g[3]),  p(g[4]),  p(g[5]),  p(g[6]),  p(g[7]),
              p(g[8]), p(g[9]), p(g[10]), p(g[11]), p(g[12]), p(g[13]), p(g[14]), p(g[15])};
    }
  };

  // One call: saved + workspace from `alloc`, outputs from the caller.
  const auto call = [&](mb::system_allocator& alloc, outputs& o) {
    tracked saved(alloc, Layer::saved_bytes(s));
    {
      tracked ws(alloc, Layer::forward_workspace_bytes(s, pool.size()));
      Layer::forward(s, wv, x.data(), o.y.data(), saved.p, saved.bytes, ws.p, ws.bytes, pool);
    }
    if (bwd) {
      tracked ws(alloc, Layer::backward_workspace_bytes(s, pool.size()));
      Layer::backward(s, wv, x.data(), saved.p, saved.bytes, dy.data(), o.dx.data(), o.grads(),
                      ws.p, ws.bytes, pool);
    }
  };

  // Timing: outputs allocated once (gradients accumulate across reps; values do not matter here).
  double best = 1e300;
  {
    outputs o(N * C, bwd, sizes);
    for (int r = 0; r <= reps; ++r) {  // r = 0 is the warm-up
      mb::system_allocator alloc;
      const auto t0 = clock_type::now();
      call(alloc, o);
      const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
      if (r > 0) best = std::min(best, ms);
    }
  }

  // One fresh call: its peaks, and the outputs written to OUT.
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  malloc_trim(0);
  reset_hwm();
  const std::size_t rss_before = proc_status_bytes("VmRSS");
  mb::system_allocator alloc;
  outputs o(N * C, bwd, sizes);
  call(alloc, o);
  const std::size_t hwm = proc_status_bytes("VmHWM");

  std::ofstream out(out_path, std::ios::binary);
  write_out(out, o.y);
  std::size_t out_elems = o.y.size();
  if (bwd) {
    write_out(out, o.dx);
    out_elems += o.dx.size();
    for (const auto& g : o.g) {
      write_out(out, g);
      out_elems += g.size();
    }
  }
  if (!out) throw std::runtime_error("cannot write " + out_path);

  nlohmann::json j;
  j["ms"] = best;
  j["peak_alloc_bytes"] = alloc.stats().peak_requested;
  j["peak_rss_bytes"] = hwm > rss_before ? hwm - rss_before : 0;
  j["output_bytes"] = out_elems * sizeof(S);
  j["saved_bytes"] = Layer::saved_bytes(s);
  j["saved_state_bytes"] = Layer::saved_state_bytes(s);
  j["group"] = Layer::group;
  j["threads"] = pool.size();
  std::cout << j.dump() << std::endl;
  return 0;
}

template <bool Mlp, typename Prec>
int dispatch_group(const std::string& group, const mb::ttt_shape& s, std::ifstream& in,
                   const std::string& out, bool bwd, int reps, std::size_t threads) {
  using mb::ttt_state_groups;
  using mb::ttt_mini_batch;
  if (group == "1") {
    return run<mb::basic_ttt<Mlp, Prec, ttt_mini_batch<mini_batch>, ttt_state_groups<1>>>(
        s, in, out, bwd, reps, threads);
  }
  if (group == "4") {
    return run<mb::basic_ttt<Mlp, Prec, ttt_mini_batch<mini_batch>, ttt_state_groups<4>>>(
        s, in, out, bwd, reps, threads);
  }
  return run<mb::basic_ttt<Mlp, Prec, ttt_mini_batch<mini_batch>, mb::ttt_state_groups_all>>(
      s, in, out, bwd, reps, threads);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> pos;
  std::string prec, pass, group = "4", kind = "linear";
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
    else if (a == "--group") group = value();
    else if (a == "--kind") kind = value();
    else if (a == "--reps") reps = std::max(1, std::atoi(value().c_str()));
    else if (a == "--threads") threads = static_cast<std::size_t>(std::max(1, std::atoi(value().c_str())));
    else if (a.rfind("--", 0) == 0) usage(argv[0], "unknown option " + a);
    else pos.push_back(a);
  }
  if (pos.size() != 2) usage(argv[0], "needs IN and OUT");
  if (prec != "fp32" && prec != "bf16") usage(argv[0], "--prec is fp32 or bf16");
  if (pass != "fwd" && pass != "fwdbwd") usage(argv[0], "--pass is fwd or fwdbwd");
  if (group != "1" && group != "4" && group != "all") usage(argv[0], "--group is 1, 4 or all");
  if (kind != "linear" && kind != "mlp") usage(argv[0], "--kind is linear or mlp");
  try {
    std::ifstream in(pos[0], std::ios::binary);
    if (!in) throw std::runtime_error("cannot open " + pos[0]);
    std::uint64_t h[8];
    in.read(reinterpret_cast<char*>(h), sizeof h);
    if (!in) throw std::runtime_error("IN is shorter than its header");
    mb::ttt_shape s;
    s.batch = h[0];
    s.seq = h[1];
    s.width = h[2];
    s.heads = h[3];
    if (h[4] != mini_batch) throw std::runtime_error("IN's mini-batch is not 16");
    if (h[5] > 1 || h[6] > 1) throw std::runtime_error("IN's header has bad flags");
    const bool mlp = kind == "mlp";
    if (h[6] != (mlp ? 1u : 0u)) {
      throw std::runtime_error("IN's kind (word 6 of the header) does not match --kind " + kind);
    }
    s.use_gate = h[5] == 1;
    const std::uint64_t dtype = prec == "fp32" ? 0 : 1;
    if (h[7] != dtype) throw std::runtime_error("IN's dtype code does not match --prec " + prec);
    const bool bwd = pass == "fwdbwd";
    if (mlp) {
      if (prec == "fp32") {
        return dispatch_group<true, mb::fp32_precision>(group, s, in, pos[1], bwd, reps, threads);
      }
      return dispatch_group<true, mb::bf16_precision>(group, s, in, pos[1], bwd, reps, threads);
    }
    if (prec == "fp32") {
      return dispatch_group<false, mb::fp32_precision>(group, s, in, pos[1], bwd, reps, threads);
    }
    return dispatch_group<false, mb::bf16_precision>(group, s, in, pos[1], bwd, reps, threads);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ttt_peer_runner: %s\n", e.what());
    return 1;
  }
}
