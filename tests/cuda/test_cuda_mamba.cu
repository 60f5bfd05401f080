// mamba<P, ..., cuda_backend> against mamba<P, ...> (the CPU backend) on the same inputs in the
// same process: the output, the saved chunk-entry states, dx and the nine weight gradients (the
// ten gradients of the issue), over chunks that do not divide T, chunk 1, chunk > T, T = 1,
// d_state 1 and 16, d_inner not a multiple of the scan block (70: neither of the forward's 8 nor
// of the backward's 64 channels), both recompute policies; bit-identical repeats; no device
// memory beyond the caller's; decoding steps equal to the forward's rows; packed sequences; typed errors. Without a
// device it exits 77 (skipped).
//
// The metric is the CPU tests' (tests/unit/test_mamba.cpp): max |got − want| / max |want| per
// tensor.
//   fp32: both sides compute in fp32 (TF32 off); they differ by the order of sums (GEMM blocking,
//         the scan's lane sums, the reductions over rows), FMA contraction and the device's
//         expf/log1pf against the host's: a few ulps per operation, over sums of at most
//         B·T = 74 rows: 1e-5 relative. (On the host, the CPU block's fp32 results are within
//         7e-7 of its fp64 ones on every case below, so each side's own error is far inside.)
//   bf16, fp16: against the CPU's fp32 block on the same rounded inputs, with the CPU's own
//         bound (16u: 6.25e-2 bf16, 7.8e-3 fp16): the device rounds u, y ⊙ SiLU(z), dΔ·σ,
//         dx_dbl and dxz to storage once more each than the CPU (the GEMMs take one type). A host
//         emulation of backend/cuda/mamba.cuh's launch sequence (kernels run per block with a barrier per
//         __syncthreads, GEMMs as fp32 sums rounded to their output type) gives at most 1.2e-2
//         (bf16) and 1.4e-3 (fp16) on this problem: a margin of 5 over the bound.
//   step: the same kernels' formulas and order as the forward row; the GEMMs over B rows instead
//         of B·T may block differently: 1e-5 (fp32).
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cuda_test_support.cuh"

namespace mb = membound;

namespace {

using mbt::as_double;

mb::mamba_shape shape_of(std::size_t B, std::size_t T, std::size_t C, std::size_t Di,
                         std::size_t Ns, std::size_t K, std::size_t R) {
  mb::mamba_shape s;
  s.batch = B;
  s.seq = T;
  s.d_model = C;
  s.d_inner = Di;
  s.d_state = Ns;
  s.d_conv = K;
  s.dt_rank = R;
  return s;
}

struct lcg {
  std::uint32_t s;
  float next() {  // uniform in [−1, 1)
    s = s * 1664525u + 1013904223u;
    return 2.0f * static_cast<float>(s >> 8) / static_cast<float>(1u << 24) - 1.0f;
  }
};

// Parameters in fp32 (later rounded to the storage type): Δ = softplus(dt) lands in about
// [0.05, 1], A = −exp(a_log) in [−Ns, −1], so every gradient is well away from zero.
struct problem {
  mb::mamba_shape shape;
  std::vector<float> in_proj, conv_w, conv_b, x_proj, dt_proj, dt_bias, a_log, d, out_proj, x, dout;
};

problem make_problem(const mb::mamba_shape& s, std::uint32_t seed) {
  lcg r{seed * 2654435761u + 11};
  const std::size_t N = s.batch * s.seq, C = s.d_model, Di = s.d_inner, Ns = s.d_state;
  const std::size_t R = s.dt_rank, K = s.d_conv;
  const auto fill = [&](std::size_t n, float scale, float offset) {
    std::vector<float> v(n);
    for (auto& e : v) e = offset + scale * r.next();
    return v;
  };
  problem p;
  p.shape = s;
  p.in_proj = fill(C * 2 * Di, 1.0f / std::sqrt(static_cast<float>(C)), 0);
  p.conv_w = fill(Di * K, 0.5f, 0);
  p.conv_b = fill(Di, 0.2f, 0);
  p.x_proj = fill(Di * (R + 2 * Ns), 1.5f / std::sqrt(static_cast<float>(Di)), 0);
  p.dt_proj = fill(R * Di, 0.5f / std::sqrt(static_cast<float>(R)), 0);
  p.dt_bias = fill(Di, 1.0f, -1.0f);
  p.a_log.resize(Di * Ns);
  for (std::size_t i = 0; i < Di; ++i)
    for (std::size_t j = 0; j < Ns; ++j)
      p.a_log[i * Ns + j] = std::log(static_cast<float>(j + 1)) + 0.3f * r.next();
  p.d = fill(Di, 0.5f, 1.0f);
  p.out_proj = fill(Di * C, 1.0f / std::sqrt(static_cast<float>(Di)), 0);
  p.x = fill(N * C, 1.0f, 0);
  p.dout = fill(N * C, 1.0f, 0);
  return p;
}

template <typename S>
std::vector<S> to_storage(const std::vector<float>& v) {
  std::vector<S> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = mb::from_accum<S>(v[i]);
  return out;
}
// The CPU tests' metric: max |a − b| / max |b|.
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double d = 0, s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double e = std::abs(a[i] - b[i]);
    d = std::isnan(e) ? INFINITY : std::max(d, e);
    s = std::max(s, std::abs(b[i]));
  }
  return s == 0 ? d : d / s;
}

constexpr int n_fields = 12;
const char* const field_names[n_fields] = {"out",       "dx",        "d_in_proj", "d_conv_w",
                                           "d_conv_b",  "d_x_proj",  "d_dt_proj", "d_dt_bias",
                                           "d_a_log",   "d_d",       "d_out_proj", "saved states"};

// Everything a run produces, as doubles, plus the raw bytes for bit comparisons.
struct outputs {
  std::vector<double> f[n_fields];
  std::vector<std::uint8_t> bytes;
};

void compare(const char* what, const outputs& got, const outputs& want, double tol) {
  for (int i = 0; i < n_fields; ++i) {
    const double e = rel_err(got.f[i], want.f[i]);
    if (!(e <= tol)) {
      std::fprintf(stderr, "%s: %s relative error %.3g > %.3g\n", what, field_names[i], e, tol);
      ++mbt::failures;
    }
  }
}

template <typename T>
void append_bytes(std::vector<std::uint8_t>& out, const std::vector<T>& v) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(v.data());
  out.insert(out.end(), p, p + v.size() * sizeof(T));
}

// Host-to-device copies go through the legacy stream and the executor's stream does not wait for
// it: settle everything before a launch reads uploaded data or the host reads results.
void settle() { mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

// The CPU block on host buffers.
template <typename Block>
outputs run_cpu(const problem& p) {
  using S = typename Block::storage_type;
  using A = typename Block::accum_type;
  const mb::mamba_shape& s = p.shape;
  mb::thread_pool pool(1);
  const auto in_proj = to_storage<S>(p.in_proj), conv_w = to_storage<S>(p.conv_w),
             conv_b = to_storage<S>(p.conv_b), x_proj = to_storage<S>(p.x_proj),
             dt_proj = to_storage<S>(p.dt_proj), dt_bias = to_storage<S>(p.dt_bias),
             a_log = to_storage<S>(p.a_log), d = to_storage<S>(p.d), out_proj = to_storage<S>(p.out_proj),
             x = to_storage<S>(p.x), dout = to_storage<S>(p.dout);
  std::vector<S> g[9] = {std::vector<S>(in_proj.size()), std::vector<S>(conv_w.size()),
                         std::vector<S>(conv_b.size()),  std::vector<S>(x_proj.size()),
                         std::vector<S>(dt_proj.size()), std::vector<S>(dt_bias.size()),
                         std::vector<S>(a_log.size()),   std::vector<S>(d.size()),
                         std::vector<S>(out_proj.size())};
  std::vector<S> out(x.size()), dx(x.size());
  const std::size_t saved_bytes = Block::saved_bytes(s);
  mbt::host_buffer saved_buf(saved_bytes);
  void* const saved = saved_buf.data();
  const std::size_t wsn = std::max(Block::forward_workspace_bytes(s, 1), Block::backward_workspace_bytes(s, 1));
  mbt::host_buffer ws_buf(wsn);
  void* const ws = ws_buf.data();
  const typename Block::weights w{in_proj.data(), conv_w.data(), conv_b.data(), x_proj.data(),
                                  dt_proj.data(), dt_bias.data(), a_log.data(),  d.data(),
                                  out_proj.data()};
  Block::forward(s, w, x.data(), out.data(), saved, saved_bytes, ws, wsn, pool);
  Block::backward(s, w, x.data(), saved, saved_bytes, dout.data(), dx.data(),
                  {g[0].data(), g[1].data(), g[2].data(), g[3].data(), g[4].data(), g[5].data(),
                   g[6].data(), g[7].data(), g[8].data()},
                  ws, wsn, pool);
  outputs o;
  o.f[0] = as_double(out);
  o.f[1] = as_double(dx);
  for (int i = 0; i < 9; ++i) o.f[2 + i] = as_double(g[i]);
  const A* st = Block::saved_states(s, saved);
  o.f[11].assign(st, st + Block::saved_state_bytes(s) / sizeof(A));
  return o;
}

// The results in the device buffers, as doubles and as raw bytes.
template <typename Block, typename S>
outputs collect(const problem& p, const mbt::device_buffer<S>& out, const mbt::device_buffer<S>& dx,
                mbt::device_buffer<S>* const (&grads)[9], const mbt::device_buffer<std::uint8_t>& saved) {
  const mb::mamba_shape& s = p.shape;
  outputs o;
  const std::vector<S> host[11] = {out.download(),       dx.download(),       grads[0]->download(),
                                   grads[1]->download(), grads[2]->download(), grads[3]->download(),
                                   grads[4]->download(), grads[5]->download(), grads[6]->download(),
                                   grads[7]->download(), grads[8]->download()};
  for (int i = 0; i < 11; ++i) {
    o.f[i] = as_double(host[i]);
    append_bytes(o.bytes, host[i]);
  }
  const std::vector<std::uint8_t> saved_host = saved.download();
  append_bytes(o.bytes, saved_host);
  const float* st = Block::saved_states(s, saved_host.data());
  o.f[11].assign(st, st + Block::saved_state_bytes(s) / sizeof(float));
  return o;
}

struct gpu_runs {
  outputs first, second;
  outputs accumulated;  // a third run onto the second's gradients, not zeroed in between
  bool same_free_memory = false;  // cudaMemGetInfo unchanged over the second forward + backward
};

// The device block, twice on the same buffers; gradients start at zero each time, as on the CPU.
// Then once more without zeroing them: gradients are accumulated (+=) into the caller's buffers,
// which runs that start from zero cannot tell from overwriting.
template <typename Block>
gpu_runs run_gpu(const problem& p, mb::cuda_executor& ex) {
  using S = typename Block::storage_type;
  const mb::mamba_shape& s = p.shape;
  mbt::device_buffer<S> in_proj(to_storage<S>(p.in_proj)), conv_w(to_storage<S>(p.conv_w)),
      conv_b(to_storage<S>(p.conv_b)), x_proj(to_storage<S>(p.x_proj)),
      dt_proj(to_storage<S>(p.dt_proj)), dt_bias(to_storage<S>(p.dt_bias)),
      a_log(to_storage<S>(p.a_log)), d(to_storage<S>(p.d)), out_proj(to_storage<S>(p.out_proj)),
      x(to_storage<S>(p.x)), dout(to_storage<S>(p.dout));
  const std::size_t sizes[9] = {p.in_proj.size(), p.conv_w.size(), p.conv_b.size(),
                                p.x_proj.size(),  p.dt_proj.size(), p.dt_bias.size(),
                                p.a_log.size(),   p.d.size(),       p.out_proj.size()};
  const auto zeros = [&](int i) { return std::vector<S>(sizes[i], mb::from_accum<S>(0.0f)); };
  mbt::device_buffer<S> g0{zeros(0)}, g1{zeros(1)}, g2{zeros(2)}, g3{zeros(3)}, g4{zeros(4)},
      g5{zeros(5)}, g6{zeros(6)}, g7{zeros(7)}, g8{zeros(8)};
  mbt::device_buffer<S> out(p.x.size()), dx(p.x.size());
  mbt::device_buffer<std::uint8_t> saved(Block::saved_bytes(s));
  const std::size_t fws = Block::forward_workspace_bytes(s, 1);
  const std::size_t bws = Block::backward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> ws(std::max(fws, bws));
  const typename Block::weights w{in_proj.get(), conv_w.get(), conv_b.get(), x_proj.get(),
                                  dt_proj.get(), dt_bias.get(), a_log.get(),  d.get(),
                                  out_proj.get()};
  mbt::device_buffer<S>* const grads[9] = {&g0, &g1, &g2, &g3, &g4, &g5, &g6, &g7, &g8};
  gpu_runs r;
  for (int pass = 0; pass < 3; ++pass) {
    if (pass < 2) {
      for (int i = 0; i < 9; ++i) grads[i]->upload(zeros(i));
    }
    settle();
    // Lazy module loading may allocate on the first launch: measure the second.
    std::size_t free_before = 0, free_after = 0, total = 0;
    mb::cuda_check(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");
    Block::forward(s, w, x.get(), out.get(), saved.get(), saved.size(), ws.get(), fws, ex);
    Block::backward(s, w, x.get(), saved.get(), saved.size(), dout.get(), dx.get(),
                    {g0.get(), g1.get(), g2.get(), g3.get(), g4.get(), g5.get(), g6.get(),
                     g7.get(), g8.get()},
                    ws.get(), bws, ex);
    ex.synchronize();
    mb::cuda_check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo");
    (pass == 0 ? r.first : pass == 1 ? r.second : r.accumulated) =
        collect<Block>(p, out, dx, grads, saved);
    if (pass == 1) r.same_free_memory = free_after == free_before;
  }
  return r;
}

// GPU against CPU (the CPU block CpuBlock, maybe in another precision), twice on the GPU: the
// same bits, and no device memory taken beyond the caller's buffers on the second run.
template <typename GpuBlock, typename CpuBlock>
void check_case(const char* name, const mb::mamba_shape& s, double tol) {
  using S = typename GpuBlock::storage_type;
  problem p = make_problem(s, 7);
  // Both sides read the same (rounded) values.
  for (auto* v : {&p.in_proj, &p.conv_w, &p.conv_b, &p.x_proj, &p.dt_proj, &p.dt_bias, &p.a_log,
                  &p.d, &p.out_proj, &p.x, &p.dout}) {
    for (float& e : *v) e = mb::to_accum<float>(mb::from_accum<S>(e));
  }
  mb::cuda_executor ex;
  const gpu_runs runs = run_gpu<GpuBlock>(p, ex);
  if (runs.first.bytes != runs.second.bytes) {
    std::fprintf(stderr, "%s: repeated runs differ\n", name);
    ++mbt::failures;
  }
  if (!runs.same_free_memory) {
    std::fprintf(stderr, "%s: device memory taken during forward + backward\n", name);
    ++mbt::failures;
  }
  // The third run: out, dx and the states overwritten (the same bits again), each gradient g + g.
  // About 2g: a GEMM's beta = 1 epilogue may add the old value in another order than its sums,
  // and bf16/fp16 round the sum once more (one ulp: 2u). Overwriting (g) or adding twice (3g)
  // is off by 1/2 relative, so this case's own tolerance (1e-5 fp32, 16u half) tells them apart.
  {
    const double acc_tol =
        std::is_same_v<S, float> ? 1e-5 : 16.0 * (std::is_same_v<S, mb::bf16> ? 0x1.0p-8 : 0x1.0p-11);
    for (int i = 0; i < n_fields; ++i) {
      const bool grad = i >= 2 && i < 11;
      std::vector<double> want = runs.first.f[i];
      if (grad) {
        for (double& v : want) v *= 2;
      }
      const double e = rel_err(runs.accumulated.f[i], want);
      if (!(e <= (grad ? acc_tol : 0.0))) {
        std::fprintf(stderr, "%s: %s after a run onto the previous gradients: relative error %.3g\n",
                     name, field_names[i], e);
        ++mbt::failures;
      }
    }
  }
  const outputs want = run_cpu<CpuBlock>(p);
  compare(name, runs.first, want, tol);  // the states are fp32 on both sides, whatever the storage
  // saved_state_bytes is the planner's number and the device's: the same function.
  CHECK(GpuBlock::saved_state_bytes(s) == CpuBlock::saved_state_bytes(s));
  using host_twin = mb::mamba<typename GpuBlock::precision, typename GpuBlock::chunking,
                              typename GpuBlock::recompute_policy>;
  CHECK(GpuBlock::saved_bytes(s) == host_twin::saved_bytes(s));
}

template <typename... P>
using gpu_block = mb::mamba<P..., mb::cuda_backend>;

void fp32_chunk_not_dividing_t() {
  const auto s = shape_of(2, 37, 12, 70, 16, 4, 3);
  check_case<gpu_block<mb::scan_chunk<8>>, mb::mamba<mb::scan_chunk<8>>>("chunk 8, T 37", s, 1e-5);
  check_case<gpu_block<mb::scan_chunk<8>, mb::save_all>, mb::mamba<mb::scan_chunk<8>, mb::save_all>>(
      "chunk 8, save_all", s, 1e-5);
}

void fp32_chunk_1_and_d_state_1() {
  check_case<gpu_block<mb::scan_chunk<1>>, mb::mamba<mb::scan_chunk<1>>>(
      "chunk 1, d_state 1", shape_of(2, 9, 8, 70, 1, 4, 2), 1e-5);
  check_case<gpu_block<mb::scan_chunk<1>>, mb::mamba<mb::scan_chunk<1>>>(
      "chunk 1, d_state 5, d_conv 1", shape_of(1, 6, 8, 33, 5, 1, 1), 1e-5);
}

void fp32_chunk_above_t_and_t_1() {
  check_case<gpu_block<mb::scan_chunk<64>>, mb::mamba<mb::scan_chunk<64>>>(
      "chunk 64 > T 20", shape_of(3, 20, 16, 130, 16, 4, 2), 1e-5);
  check_case<gpu_block<mb::scan_chunk<64>>, mb::mamba<mb::scan_chunk<64>>>(
      "T 1", shape_of(2, 1, 16, 70, 16, 4, 2), 1e-5);
  check_case<gpu_block<mb::scan_chunk<8>>, mb::mamba<mb::scan_chunk<8>>>(
      "T 1, chunk 8", shape_of(1, 1, 8, 20, 16, 3, 1), 1e-5);
}

void half_precisions_within_the_cpu_bound() {
  const auto s = shape_of(2, 37, 12, 70, 16, 4, 3);
  check_case<gpu_block<mb::bf16_precision, mb::scan_chunk<8>>, mb::mamba<mb::scan_chunk<8>>>(
      "bf16 against fp32", s, 16.0 * 0x1.0p-8);
  check_case<gpu_block<mb::fp16_precision, mb::scan_chunk<8>>, mb::mamba<mb::scan_chunk<8>>>(
      "fp16 against fp32", s, 16.0 * 0x1.0p-11);
}

// Packed sequences against the CPU block's packed call (which tests/unit holds equal to each
// sequence run alone): starts inside chunks and tiles and at a chunk's first step, sequences
// shorter than the conv (1, 2), an empty one, one over several chunks.
void packed_matches_cpu() {
  static const std::int32_t offsets[] = {0, 1, 3, 3, 16, 24, 44, 47};
  mb::mamba_shape s = shape_of(1, 47, 12, 70, 16, 4, 3);
  s.offsets = offsets;
  s.sequences = 7;
  check_case<gpu_block<mb::scan_chunk<8>>, mb::mamba<mb::scan_chunk<8>>>("packed, chunk 8", s, 1e-5);
  check_case<gpu_block<mb::scan_chunk<8>, mb::save_all>, mb::mamba<mb::scan_chunk<8>, mb::save_all>>(
      "packed, chunk 8, save_all", s, 1e-5);
  check_case<gpu_block<mb::bf16_precision, mb::scan_chunk<16>>, mb::mamba<mb::scan_chunk<16>>>(
      "packed, bf16 against fp32", s, 16.0 * 0x1.0p-8);
}

// The saved states shrink with the chunk exactly as saved_state_bytes says; they are the ones
// the GPU wrote (check_case compares them to the CPU's value for value).
void saved_bytes_follow_the_chunk() {
  const auto s = shape_of(2, 64, 8, 16, 16, 4, 1);
  CHECK(gpu_block<mb::scan_chunk<8>>::saved_state_bytes(s) == 2 * 7 * 16 * 16 * sizeof(float));
  CHECK(gpu_block<mb::scan_chunk<16>>::saved_state_bytes(s) == 2 * 3 * 16 * 16 * sizeof(float));
  CHECK(gpu_block<mb::scan_chunk<64>>::saved_state_bytes(s) == 0);
  CHECK(gpu_block<mb::scan_chunk<8>>::saved_bytes(s) - gpu_block<mb::scan_chunk<16>>::saved_bytes(s) ==
        2 * 4 * 16 * 16 * sizeof(float));
}

// Saved and workspace from a device budget: the layer's peak is saved + the larger workspace (it
// allocates nothing itself: the device's free memory does not move during the calls), and the
// saved bytes of two chunk sizes differ by exactly their saved_state_bytes.
template <typename Block>
std::size_t budget_peak(const problem& p, mb::cuda_executor& ex) {
  using S = typename Block::storage_type;
  const mb::mamba_shape& s = p.shape;
  mbt::device_buffer<S> in_proj(to_storage<S>(p.in_proj)), conv_w(to_storage<S>(p.conv_w)),
      conv_b(to_storage<S>(p.conv_b)), x_proj(to_storage<S>(p.x_proj)),
      dt_proj(to_storage<S>(p.dt_proj)), dt_bias(to_storage<S>(p.dt_bias)),
      a_log(to_storage<S>(p.a_log)), d(to_storage<S>(p.d)), out_proj(to_storage<S>(p.out_proj)),
      x(to_storage<S>(p.x)), dout(to_storage<S>(p.dout));
  mbt::device_buffer<S> g(p.in_proj.size() + p.x_proj.size() + p.out_proj.size() + 8 * p.d.size() +
                          p.conv_w.size() + p.a_log.size() + p.dt_proj.size());
  mb::cuda_check(cudaMemset(g.get(), 0, g.size() * sizeof(S)), "cudaMemset");
  settle();  // the memset ran on the legacy stream
  mbt::device_buffer<S> out(p.x.size()), dx(p.x.size());
  const typename Block::weights w{in_proj.get(), conv_w.get(), conv_b.get(), x_proj.get(),
                                  dt_proj.get(), dt_bias.get(), a_log.get(),  d.get(),
                                  out_proj.get()};
  S* q = g.get();
  const auto take = [&q](std::size_t n) {
    S* r = q;
    q += n;
    return r;
  };
  const typename Block::gradients grads{take(p.in_proj.size()), take(p.conv_w.size()),
                                        take(p.conv_b.size()),  take(p.x_proj.size()),
                                        take(p.dt_proj.size()), take(p.dt_bias.size()),
                                        take(p.a_log.size()),   take(p.d.size()),
                                        take(p.out_proj.size())};
  mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>> budget(std::size_t{8} << 30);
  const std::size_t saved_bytes = Block::saved_bytes(s);
  const std::size_t fws = Block::forward_workspace_bytes(s, 1), bws = Block::backward_workspace_bytes(s, 1);
  const auto call = [&] {
    void* saved = budget.allocate(saved_bytes, 256, mb::memory_tag::activations);
    void* ws = budget.allocate(fws, 256, mb::memory_tag::workspace);
    Block::forward(s, w, x.get(), out.get(), saved, saved_bytes, ws, fws, ex);
    budget.deallocate(ws, fws, 256, mb::memory_tag::workspace);
    ws = budget.allocate(bws, 256, mb::memory_tag::workspace);
    Block::backward(s, w, x.get(), saved, saved_bytes, dout.get(), dx.get(), grads, ws, bws, ex);
    ex.synchronize();
    budget.deallocate(ws, bws, 256, mb::memory_tag::workspace);
    budget.deallocate(saved, saved_bytes, 256, mb::memory_tag::activations);
  };
  settle();
  call();  // warm: the cache holds the segments, modules are loaded
  budget.reset_peaks();
  std::size_t free_before = 0, free_after = 0, total = 0;
  mb::cuda_check(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");
  call();
  mb::cuda_check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo");
  CHECK(free_after == free_before);
  return budget.stats().peak_requested;
}

void peak_is_saved_plus_workspace() {
  const auto s = shape_of(2, 64, 16, 70, 16, 4, 2);
  problem p = make_problem(s, 5);
  mb::cuda_executor ex;
  using b8 = gpu_block<mb::scan_chunk<8>>;
  using b16 = gpu_block<mb::scan_chunk<16>>;
  const std::size_t peak8 = budget_peak<b8>(p, ex), peak16 = budget_peak<b16>(p, ex);
  CHECK(peak8 == b8::saved_bytes(s) + std::max(b8::forward_workspace_bytes(s, 1),
                                               b8::backward_workspace_bytes(s, 1)));
  CHECK(peak16 == b16::saved_bytes(s) + std::max(b16::forward_workspace_bytes(s, 1),
                                                 b16::backward_workspace_bytes(s, 1)));
  CHECK(b8::saved_bytes(s) - b16::saved_bytes(s) ==
        b8::saved_state_bytes(s) - b16::saved_state_bytes(s));
}

// Decoding T tokens one at a time equals the full forward, row by row.
template <typename Block>
void step_case(const mb::mamba_shape& s, double tol) {
  using S = typename Block::storage_type;
  problem p = make_problem(s, 9);
  for (auto* v : {&p.in_proj, &p.conv_w, &p.conv_b, &p.x_proj, &p.dt_proj, &p.dt_bias, &p.a_log,
                  &p.d, &p.out_proj, &p.x}) {
    for (float& e : *v) e = mb::to_accum<float>(mb::from_accum<S>(e));
  }
  mb::cuda_executor ex;
  const std::size_t B = s.batch, T = s.seq, C = s.d_model;
  mbt::device_buffer<S> in_proj(to_storage<S>(p.in_proj)), conv_w(to_storage<S>(p.conv_w)),
      conv_b(to_storage<S>(p.conv_b)), x_proj(to_storage<S>(p.x_proj)),
      dt_proj(to_storage<S>(p.dt_proj)), dt_bias(to_storage<S>(p.dt_bias)),
      a_log(to_storage<S>(p.a_log)), d(to_storage<S>(p.d)), out_proj(to_storage<S>(p.out_proj)),
      x(to_storage<S>(p.x)), out(B * T * C);
  const typename Block::weights w{in_proj.get(), conv_w.get(), conv_b.get(), x_proj.get(),
                                  dt_proj.get(), dt_bias.get(), a_log.get(),  d.get(),
                                  out_proj.get()};
  mbt::device_buffer<std::uint8_t> saved(Block::saved_bytes(s));
  mbt::device_buffer<std::uint8_t> fws(Block::forward_workspace_bytes(s, 1));
  settle();
  Block::forward(s, w, x.get(), out.get(), saved.get(), saved.size(), fws.get(), fws.size(), ex);
  mbt::device_buffer<float> state(Block::state_bytes(s) / sizeof(float));
  mbt::device_buffer<std::uint8_t> sws(Block::step_workspace_bytes(s));
  auto st = Block::make_state(s, state.get(), Block::state_bytes(s), ex);
  mbt::device_buffer<S> xt(B * C), yt(B * C);
  const std::vector<S> xs = to_storage<S>(p.x);
  std::vector<double> stepped(B * T * C);
  std::vector<S> first_row, first_out;
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<S> row(B * C);
    for (std::size_t b = 0; b < B; ++b)
      std::copy_n(xs.begin() + static_cast<std::ptrdiff_t>((b * T + t) * C), C,
                  row.begin() + static_cast<std::ptrdiff_t>(b * C));
    xt.upload(row);
    settle();
    Block::step(s, w, st, xt.get(), yt.get(), sws.get(), sws.size(), ex);
    settle();
    const std::vector<S> y = yt.download();
    if (t == 0) {
      first_row = row;
      first_out = y;
    }
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t c = 0; c < C; ++c)
        stepped[(b * T + t) * C + c] = static_cast<double>(mb::to_accum<float>(y[b * C + c]));
  }
  CHECK(st.position == T);
  settle();
  const double e = rel_err(stepped, as_double(out.download()));
  if (!(e <= tol)) {
    std::fprintf(stderr, "step against forward: relative error %.3g > %.3g\n", e, tol);
    ++mbt::failures;
  }
  // reset zeroes the device state: the first token again gives the forward's first row.
  Block::reset(s, st, ex);
  CHECK(st.position == 0);
  xt.upload(first_row);
  settle();
  Block::step(s, w, st, xt.get(), yt.get(), sws.get(), sws.size(), ex);
  settle();
  const std::vector<S> again = yt.download();
  CHECK(std::memcmp(again.data(), first_out.data(), again.size() * sizeof(S)) == 0);
}

void step_equals_forward() {
  step_case<gpu_block<mb::scan_chunk<8>>>(shape_of(2, 13, 12, 70, 16, 4, 3), 1e-5);
  step_case<gpu_block<mb::scan_chunk<8>>>(shape_of(1, 5, 8, 20, 1, 1, 1), 1e-5);
  step_case<gpu_block<mb::bf16_precision>>(shape_of(2, 9, 16, 32, 16, 4, 1), 2.0 * 0x1.0p-8);
}

void typed_errors() {
  using block = gpu_block<mb::scan_chunk<8>>;
  const auto s = shape_of(1, 4, 8, 16, 4, 4, 1);
  mb::cuda_executor ex;
  mbt::device_buffer<float> x(32), y(32), w(4096);
  mbt::device_buffer<std::uint8_t> saved(block::saved_bytes(s));
  const std::size_t fws = block::forward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> ws(fws);
  const block::weights wt{w.get(), w.get(), w.get(), w.get(), w.get(),
                          w.get(), w.get(), w.get(), w.get()};
  EXPECT_THROW(mb::workspace_too_small,
               block::forward(s, wt, x.get(), y.get(), saved.get(), saved.size(), ws.get(), fws - 1, ex));
  EXPECT_THROW(mb::workspace_too_small,
               block::forward(s, wt, x.get(), y.get(), saved.get(), saved.size() - 1, ws.get(), fws, ex));
  EXPECT_THROW(mb::invalid_argument,
               block::forward(s, wt, nullptr, y.get(), saved.get(), saved.size(), ws.get(), fws, ex));
  block::weights bad = wt;
  bad.a_log = nullptr;
  const std::string msg = EXPECT_THROW(
      mb::invalid_argument,
      block::forward(s, bad, x.get(), y.get(), saved.get(), saved.size(), ws.get(), fws, ex));
  CHECK(msg.find("weights.a_log") != std::string::npos);
  EXPECT_THROW(mb::invalid_argument, block::check(shape_of(1, 4, 8, 16, 0, 4, 1)));
  mbt::device_buffer<float> state(block::state_bytes(s) / sizeof(float));
  EXPECT_THROW(mb::workspace_too_small,
               block::make_state(s, state.get(), block::state_bytes(s) - 1, ex));
  // The workspaces hold cuBLASLt's on every architecture: the plan never depends on the device.
  CHECK(fws >= mb::gpu::gemm_workspace_bytes(ex));
  CHECK(block::backward_workspace_bytes(s, 1) >= mb::gpu::gemm_workspace_bytes(ex));
  CHECK(block::step_workspace_bytes(s) >= mb::gpu::gemm_workspace_bytes(ex));
  // Packed sequences: taken; offsets that do not cover the tokens refused by name.
  const std::int32_t offsets[] = {0, 3, 8}, short_offsets[] = {0, 3, 7};
  mb::mamba_shape packed = shape_of(1, 8, 8, 16, 16, 4, 1);
  packed.offsets = offsets;
  packed.sequences = 2;
  CHECK(gpu_block<mb::scan_chunk<8>>::can_implement(packed).ok);
  packed.offsets = short_offsets;
  CHECK(std::string(gpu_block<mb::scan_chunk<8>>::can_implement(packed).argument) == "shape.offsets");
}

}  // namespace

int main() {
  static const mbt::test_case cases[] = {
      {"mamba cuda_backend fp32: chunk 8 not dividing T, both recompute policies",
       fp32_chunk_not_dividing_t},
      {"mamba cuda_backend fp32: chunk 1, d_state 1, d_conv 1", fp32_chunk_1_and_d_state_1},
      {"mamba cuda_backend fp32: chunk > T, T = 1", fp32_chunk_above_t_and_t_1},
      {"mamba cuda_backend bf16 and fp16 within the CPU's bounds (16u against fp32)",
       half_precisions_within_the_cpu_bound},
      {"mamba cuda_backend packed sequences equal the CPU backend's", packed_matches_cpu},
      {"mamba cuda_backend saved bytes follow the chunk", saved_bytes_follow_the_chunk},
      {"mamba cuda_backend peak through a device budget is saved + the larger workspace",
       peak_is_saved_plus_workspace},
      {"mamba cuda_backend step equals the forward's rows", step_equals_forward},
      {"mamba cuda_backend typed errors", typed_errors},
  };
  return mbt::run_suite("test_cuda_mamba", cases);
}
