// Runs membound::mamba on inputs written by bench/peers/mamba_peer.py, for its comparison with
// the same Mamba-1 block in PyTorch on the CPU. Not part of ctest.
//
//   mamba_peer_runner IN OUT --prec fp32|bf16 --pass fwd|fwdbwd [--chunk 64|128|256]
//                     [--reps N] [--threads N]
//
// IN (little-endian): 8 uint64 B, T, C, Di, Ns, K, R, dtype (0 fp32, 1 bf16), then x [B, T, C],
// in_proj [C, 2·Di], conv_w [Di, K], conv_b [Di], x_proj [Di, R + 2·Ns], dt_proj [R, Di],
// dt_bias [Di], a_log [Di, Ns], d [Di], out_proj [Di, C], dy [B, T, C], in the storage type (W is
// [in, out], row-major: the layout of membound::mamba::weights).
// OUT: y, then for fwdbwd dx and the nine gradients in the order above, in the storage type, from
// one fresh call (gradients zeroed: ours accumulate +=).
// stdout: one JSON line {"ms", "peak_alloc_bytes", "peak_rss_bytes", "threads", ...}:
//   ms                best of --reps wall times of one call after one warm-up; a call allocates
//                     saved + workspace from a system_allocator, runs forward (and backward into
//                     preallocated dx and gradients) and frees them. The block's policy is
//                     `recompute` with scan_chunk<--chunk> (default 256).
//   peak_alloc_bytes  the allocator's peak_requested over one call: saved + workspace, the
//                     block's own memory beyond its inputs, outputs, weights and gradients.
//   peak_rss_bytes    VmHWM - VmRSS around one call measured as the Python script measures
//                     PyTorch: malloc_trim(0), "5" to /proc/self/clear_refs (resets VmHWM), read
//                     VmRSS, allocate the outputs (y; dx and gradients for fwdbwd, zeroed) and
//                     run the call, read VmHWM. Outputs are allocated inside the window because
//                     PyTorch allocates its y, x.grad and parameter .grad inside it too.
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

constexpr std::size_t n_weights = 9;  // in_proj, conv_w, conv_b, x_proj, dt_proj, dt_bias, a_log, d, out_proj
const char* const weight_names[n_weights] = {"in_proj", "conv_w",  "conv_b", "x_proj",  "dt_proj",
                                             "dt_bias", "a_log",   "d",      "out_proj"};

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
               "%s\nusage: %s IN OUT --prec fp32|bf16 --pass fwd|fwdbwd [--chunk 64|128|256] "
               "[--reps N] [--threads N]\n",
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

std::array<std::size_t, n_weights> weight_sizes(const mb::mamba_shape& s) {
  const std::size_t C = s.d_model, Di = s.d_inner, Ns = s.d_state, K = s.d_conv, R = s.dt_rank;
  return {C * 2 * Di, Di * K, Di, Di * (R + 2 * Ns), R * Di, Di, Di * Ns, Di, Di * C};
}

template <typename Block>
int run(const mb::mamba_shape& s, std::ifstream& in, const std::string& out_path, bool bwd,
        int reps, std::size_t threads) {
  using S = typename Block::storage_type;
  const std::size_t N = s.batch * s.seq, C = s.d_model;
  const auto sizes = weight_sizes(s);
  std::vector<S> x, dy;
  std::array<std::vector<S>, n_weights> w;
  read_into(in, x, N * C, "x");
  for (std::size_t k = 0; k < n_weights; ++k) read_into(in, w[k], sizes[k], weight_names[k]);
  read_into(in, dy, N * C, "dy");
  if (in.peek() != std::ifstream::traits_type::eof()) {
    throw std::runtime_error("IN is longer than its header says");
  }
  Block::check(s);
  mb::thread_pool pool(threads);
  const typename Block::weights wv{w[0].data(), w[1].data(), w[2].data(), w[3].data(), w[4].data(),
                                   w[5].data(), w[6].data(), w[7].data(), w[8].data()};

  struct outputs {
    std::vector<S> y, dx;
    std::array<std::vector<S>, n_weights> g;
    outputs(std::size_t n, bool bwd, const std::array<std::size_t, n_weights>& sizes)
        : y(n), dx(bwd ? n : 0) {  // value-initialized: zero
      for (std::size_t k = 0; k < n_weights; ++k) g[k].resize(bwd ? sizes[k] : 0);
    }
    typename Block::gradients grads() {
      return {g[0].data(), g[1].data(), g[2].data(), g[3].data(), g[4].data(),
              g[5].data(), g[6].data(), g[7].data(), g[8].data()};
    }
  };

  // One call: saved + workspace from `alloc`, outputs from the caller.
  const auto call = [&](mb::system_allocator& alloc, outputs& o) {
    tracked saved(alloc, Block::saved_bytes(s));
    {
      tracked ws(alloc, Block::forward_workspace_bytes(s, pool.size()));
      Block::forward(s, wv, x.data(), o.y.data(), saved.p, saved.bytes, ws.p, ws.bytes, pool);
    }
    if (bwd) {
      tracked ws(alloc, Block::backward_workspace_bytes(s, pool.size()));
      Block::backward(s, wv, x.data(), saved.p, saved.bytes, dy.data(), o.dx.data(), o.grads(),
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
  j["saved_bytes"] = Block::saved_bytes(s);
  j["chunk"] = Block::chunk;
  j["threads"] = pool.size();
  std::cout << j.dump() << std::endl;
  return 0;
}

template <typename Prec>
int dispatch_chunk(std::size_t chunk, const mb::mamba_shape& s, std::ifstream& in,
                   const std::string& out, bool bwd, int reps, std::size_t threads) {
  switch (chunk) {
    case 64: return run<mb::mamba<Prec, mb::scan_chunk<64>>>(s, in, out, bwd, reps, threads);
    case 128: return run<mb::mamba<Prec, mb::scan_chunk<128>>>(s, in, out, bwd, reps, threads);
    case 256: return run<mb::mamba<Prec, mb::scan_chunk<256>>>(s, in, out, bwd, reps, threads);
    default: throw std::runtime_error("--chunk is 64, 128 or 256");
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> pos;
  std::string prec, pass;
  int reps = 3;
  std::size_t chunk = 256;
  std::size_t threads = mb::thread_pool::default_threads();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(argv[0], a + " needs a value");
      return argv[++i];
    };
    if (a == "--prec") prec = value();
    else if (a == "--pass") pass = value();
    else if (a == "--reps") reps = std::max(1, std::atoi(value().c_str()));
    else if (a == "--chunk") chunk = static_cast<std::size_t>(std::atoi(value().c_str()));
    else if (a == "--threads") threads = static_cast<std::size_t>(std::max(1, std::atoi(value().c_str())));
    else if (a.rfind("--", 0) == 0) usage(argv[0], "unknown option " + a);
    else pos.push_back(a);
  }
  if (pos.size() != 2) usage(argv[0], "needs IN and OUT");
  if (prec != "fp32" && prec != "bf16") usage(argv[0], "--prec is fp32 or bf16");
  if (pass != "fwd" && pass != "fwdbwd") usage(argv[0], "--pass is fwd or fwdbwd");
  if (chunk != 64 && chunk != 128 && chunk != 256) usage(argv[0], "--chunk is 64, 128 or 256");
  try {
    std::ifstream in(pos[0], std::ios::binary);
    if (!in) throw std::runtime_error("cannot open " + pos[0]);
    std::uint64_t h[8];
    in.read(reinterpret_cast<char*>(h), sizeof h);
    if (!in) throw std::runtime_error("IN is shorter than its header");
    mb::mamba_shape s;
    s.batch = h[0];
    s.seq = h[1];
    s.d_model = h[2];
    s.d_inner = h[3];
    s.d_state = h[4];
    s.d_conv = h[5];
    s.dt_rank = h[6];
    const std::uint64_t dtype = prec == "fp32" ? 0 : 1;
    if (h[7] != dtype) throw std::runtime_error("IN's dtype code does not match --prec " + prec);
    const bool bwd = pass == "fwdbwd";
    if (prec == "fp32") {
      return dispatch_chunk<mb::fp32_precision>(chunk, s, in, pos[1], bwd, reps, threads);
    }
    return dispatch_chunk<mb::bf16_precision>(chunk, s, in, pos[1], bwd, reps, threads);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mamba_peer_runner: %s\n", e.what());
    return 1;
  }
}
