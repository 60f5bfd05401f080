// basic_ttt<Mlp, P, cuda_backend> (TTT-Linear and TTT-MLP) against the CPU backend on the same
// inputs in the same process: the output y and the whole saved buffer (the inner-state
// checkpoints, fp32, and the heads' output before the post norm), then the backward: dx and
// every parameter's gradient (accumulated onto nonzero starting values), for fp32 and bf16
// storage, with and without the gate, a short last mini-batch, b = 1, T < b, G = 1, 2 and all;
// bit-identical repeats and bit-identical y, dx and gradients across G; the decoding step equals
// the forward's row; the peak through a device budget is saved + the larger workspace; packed
// sequences; typed errors. Without a device it exits 77.
//
// Tolerances, normwise (mbt::close_normwise), floor = 1e-2:
//   fp32: TF32 is off in the GEMMs and the inner loop sums in fp32 in another order than Eigen:
//         a few ulps per product over K ≤ 4·D, compounded through two LayerNorms (÷σ) and at
//         most a few mini-batch updates on these short sequences: 1e-5 relative (the issue's bar;
//         the smallest tolerance such a chain is expected to meet). The backward runs the same
//         chain reversed (the LayerNorms' second-order terms divide by σ once more): dx 1e-5
//         too; the parameters' gradients against the layer in float64, 5e-5 (gradients64).
//   bf16: the post norm's output is rounded to bf16 before the output GEMM (the CPU keeps fp32),
//         q, k, v stay fp32 on both sides: one extra 2^-8 rounding into a C-long sum: 4e-2. In
//         the backward the row gradients (dq, dk, dv, the gate's) are rounded to bf16 before the
//         weight-gradient and dx GEMMs (the CPU keeps fp32): the CPU tests' bf16 bound, 16·2^-8.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "cuda_test_support.cuh"

namespace mb = membound;

namespace {

using mbt::random_values;
using mbt::as_double;
using mbt::from_bytes;

// All weights of one layer, host side, in the CPU layer's order and sizes.
template <typename S>
struct host_weights {
  std::vector<S> wq, wk, wv, nw, nb, w1, b1, lr_w, lr_b, tok, post_w, post_b, wg, wo, w2, b2;
  host_weights(const mb::ttt_shape& s, std::size_t F, std::size_t mbsz, bool mlp) {
    const std::size_t C = s.width, H = s.heads, D = s.head_dim();
    wq = random_values<S>(C * C, 1, 0.3f);
    wk = random_values<S>(C * C, 2, 0.3f);
    wv = random_values<S>(C * C, 3, 0.3f);
    nw = random_values<S>(H * D, 4, 0.1f, 1.0f);
    nb = random_values<S>(H * D, 5, 0.1f);
    w1 = random_values<S>(H * D * F, 6, 0.2f);
    b1 = random_values<S>(H * F, 7, 0.1f);
    lr_w = random_values<S>(H * C, 8, 0.2f);
    lr_b = random_values<S>(H, 9, 0.5f);
    tok = random_values<S>(mbsz, 10, 0.05f);
    post_w = random_values<S>(C, 11, 0.1f, 1.0f);
    post_b = random_values<S>(C, 12, 0.1f);
    wg = random_values<S>(C * C, 13, 0.3f);
    wo = random_values<S>(C * C, 14, 0.3f);
    if (mlp) {
      w2 = random_values<S>(H * F * D, 15, 0.2f);
      b2 = random_values<S>(H * D, 16, 0.1f);
    }
  }
};

template <typename S>
struct device_weights {
  mbt::device_buffer<S> wq, wk, wv, nw, nb, w1, b1, lr_w, lr_b, tok, post_w, post_b, wg, wo, w2, b2;
  explicit device_weights(const host_weights<S>& h)
      : wq(h.wq), wk(h.wk), wv(h.wv), nw(h.nw), nb(h.nb), w1(h.w1), b1(h.b1), lr_w(h.lr_w),
        lr_b(h.lr_b), tok(h.tok), post_w(h.post_w), post_b(h.post_b), wg(h.wg), wo(h.wo),
        w2(h.w2.empty() ? std::vector<S>(1) : h.w2), b2(h.b2.empty() ? std::vector<S>(1) : h.b2) {}
};

template <typename Layer, typename W>
typename Layer::weights weights_of(W& w, bool mlp) {
  typename Layer::weights r{w.wq.data(), w.wk.data(), w.wv.data(), w.nw.data(), w.nb.data(),
                            w.w1.data(), w.b1.data(), w.lr_w.data(), w.lr_b.data(), w.tok.data(),
                            w.post_w.data(), w.post_b.data(), w.wg.data(), w.wo.data()};
  if (mlp) {
    r.w2 = w.w2.data();
    r.b2 = w.b2.data();
  }
  return r;
}
template <typename Layer, typename S>
typename Layer::weights weights_of(device_weights<S>& w, bool mlp) {
  typename Layer::weights r{w.wq.get(), w.wk.get(), w.wv.get(), w.nw.get(), w.nb.get(),
                            w.w1.get(), w.b1.get(), w.lr_w.get(), w.lr_b.get(), w.tok.get(),
                            w.post_w.get(), w.post_b.get(), w.wg.get(), w.wo.get()};
  if (mlp) {
    r.w2 = w.w2.get();
    r.b2 = w.b2.get();
  }
  return r;
}

struct gpu_result {
  std::vector<std::uint8_t> y, saved;
};

// Runs one configuration on both backends; returns the device's y bytes (for the across-G check).
template <bool Mlp, typename Precision, std::size_t B, std::size_t G>
std::vector<std::uint8_t> compare(const mb::ttt_shape& s, double tolerance) {
  using cpu_l = mb::basic_ttt<Mlp, Precision, mb::ttt_mini_batch<B>, mb::ttt_state_groups<G>>;
  using gpu_l = mb::basic_ttt<Mlp, Precision, mb::ttt_mini_batch<B>, mb::ttt_state_groups<G>,
                              mb::cuda_backend>;
  using S = typename cpu_l::storage_type;
  const std::size_t N = s.batch * s.seq, C = s.width;
  const host_weights<S> hw(s, cpu_l::hidden(s), B, Mlp);
  const auto x = random_values<S>(N * C, 20, 1.0f);

  mb::thread_pool pool(1);
  std::vector<S> y_c(N * C);
  mbt::host_buffer saved_c(cpu_l::saved_bytes(s));
  const std::size_t wsn_c = cpu_l::forward_workspace_bytes(s, 1);
  std::vector<std::uint8_t> ws_c(wsn_c + 256);
  void* wsp = ws_c.data();
  std::size_t space = ws_c.size();
  wsp = std::align(256, wsn_c, wsp, space);
  auto host_w = hw;
  cpu_l::forward(s, weights_of<cpu_l>(host_w, Mlp), x.data(), y_c.data(), saved_c.data(),
                 saved_c.size(), wsp, wsn_c, pool);

  CHECK(gpu_l::saved_bytes(s) == cpu_l::saved_bytes(s));
  CHECK(gpu_l::saved_state_bytes(s) == cpu_l::saved_state_bytes(s));
  mb::cuda_executor ex;
  device_weights<S> dw(hw);
  mbt::device_buffer<S> dx(x), dy(N * C);
  mbt::device_buffer<std::uint8_t> dsaved(gpu_l::saved_bytes(s));
  const std::size_t fws = gpu_l::forward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> dws(fws);
  const auto wd = weights_of<gpu_l>(dw, Mlp);
  auto run = [&] {
    gpu_l::forward(s, wd, dx.get(), dy.get(), dsaved.get(), dsaved.size(), dws.get(), fws, ex);
    ex.synchronize();
    const auto yv = dy.download();
    std::vector<std::uint8_t> yb(yv.size() * sizeof(S));
    std::memcpy(yb.data(), yv.data(), yb.size());
    return gpu_result{yb, dsaved.download()};
  };
  const gpu_result first = run();
  const gpu_result second = run();
  CHECK(first.y == second.y);
  CHECK(first.saved == second.saved);

  constexpr double floor = 1e-2;
  mbt::close_normwise("y", as_double(from_bytes<S>(first.y.data(), first.y.size())), as_double(y_c),
             tolerance, floor);
  // The saved buffer: fp32 checkpoints first, then the heads' output in storage.
  const std::size_t ck = cpu_l::saved_state_bytes(s);
  const std::size_t ob = N * C * sizeof(S);
  // workspace_layout places the larger slot first (ties: the checkpoints, added first), the other
  // at the next default_alignment boundary: with few mini-batches per checkpoint o comes first.
  const auto up = [](std::size_t n) {
    return (n + mb::default_alignment - 1) / mb::default_alignment * mb::default_alignment;
  };
  const std::size_t ck_at = ck >= ob ? 0 : up(ob), o_at = ck >= ob ? up(ck) : 0;
  CHECK(ck_at + ck <= saved_c.size() && o_at + ob <= saved_c.size());
  mbt::close_normwise("saved checkpoints", as_double(from_bytes<float>(first.saved.data() + ck_at, ck)),
             as_double(from_bytes<float>(saved_c.data() + ck_at, ck)), tolerance, floor);
  mbt::close_normwise("saved heads' output", as_double(from_bytes<S>(first.saved.data() + o_at, ob)),
             as_double(from_bytes<S>(saved_c.data() + o_at, ob)), tolerance, floor);
  return first.y;
}

template <bool Mlp, typename Precision>
void kind_matches_cpu(double tol) {
  // Short last mini-batch (37 = 2·16 + 5), with and without the gate, G = 1, 2, all.
  mb::ttt_shape s{2, 37, 32, 2};
  const auto y1 = compare<Mlp, Precision, 16, 1>(s, tol);
  const auto y2 = compare<Mlp, Precision, 16, 2>(s, tol);
  const auto ya = compare<Mlp, Precision, 16, static_cast<std::size_t>(-1)>(s, tol);
  CHECK(y1 == y2 && y1 == ya);  // G decides only what is copied out
  s.use_gate = true;
  compare<Mlp, Precision, 16, 2>(s, tol);
  // b = 1; T < b.
  compare<Mlp, Precision, 1, 2>({1, 7, 16, 2}, tol);
  compare<Mlp, Precision, 16, 4>({3, 5, 16, 1}, tol);
}

void linear_fp32() { kind_matches_cpu<false, mb::fp32_precision>(1e-5); }
void mlp_fp32() { kind_matches_cpu<true, mb::fp32_precision>(1e-5); }
void linear_bf16() { kind_matches_cpu<false, mb::bf16_precision>(4e-2); }
void mlp_bf16() { kind_matches_cpu<true, mb::bf16_precision>(4e-2); }

// ---- Backward ----------------------------------------------------------------------------------

constexpr const char* grad_names[16] = {"d wq", "d wk", "d wv", "d ttt_norm_w", "d ttt_norm_b",
                                        "d w1", "d b1", "d lr_w", "d lr_b", "d tok_offset",
                                        "d post_w", "d post_b", "d wg", "d wo", "d w2", "d b2"};

// Every gradient's starting values, in host_weights' (and gradients') order, nonzero so that the
// accumulation (+=) is checked too; w2, b2 hold one unused value for TTT-Linear.
template <typename S>
std::vector<std::vector<S>> initial_grads(const host_weights<S>& w) {
  const std::vector<S>* src[16] = {&w.wq,   &w.wk,     &w.wv,   &w.nw,   &w.nb,     &w.w1,
                                   &w.b1,   &w.lr_w,   &w.lr_b, &w.tok,  &w.post_w, &w.post_b,
                                   &w.wg,   &w.wo,     &w.w2,   &w.b2};
  std::vector<std::vector<S>> g;
  for (std::uint32_t i = 0; i < 16; ++i)
    g.push_back(random_values<S>(std::max<std::size_t>(src[i]->size(), 1), 60 + i, 0.05f));
  return g;
}
template <typename Layer, typename P>
typename Layer::gradients gradients_of(P* const (&p)[16], bool mlp) {
  typename Layer::gradients r{p[0], p[1], p[2],  p[3],  p[4],  p[5],  p[6],
                              p[7], p[8], p[9], p[10], p[11], p[12], p[13]};
  if (mlp) {
    r.w2 = p[14];
    r.b2 = p[15];
  }
  return r;
}

template <typename T>
std::vector<std::uint8_t> bytes_of_vector(const std::vector<T>& v) {
  std::vector<std::uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// What a forward + backward produced on the device, as bytes (bit comparisons).
struct backward_bytes {
  std::vector<std::uint8_t> y, dx;
  std::vector<std::vector<std::uint8_t>> g;
  bool operator==(const backward_bytes&) const = default;
};

// The CPU layer's gradients in float64 (from zero) for compare_backward's inputs: the reference of
// the fp32 device's gradients. Some are sums over every token with cancellation, where the fp32
// CPU layer itself is 2.2e-5 from float64 (lr_b; tests/emulation/ttt_cuda_emulate.cpp) and the
// device, summing in another order, may be as far on the other side: 5e-5 against the exact
// values instead of 1e-5 against the fp32 layer's roundings (the emulation measures 4.7e-6).
constexpr double fp32_grad_tol_vs_fp64 = 5e-5;
template <bool Mlp, std::size_t B, std::size_t G>
std::vector<std::vector<double>> gradients64(const mb::ttt_shape& s) {
  using l64 = mb::basic_ttt<Mlp, mb::fp64_precision, mb::ttt_mini_batch<B>, mb::ttt_state_groups<G>>;
  const std::size_t N = s.batch * s.seq, C = s.width;
  host_weights<double> hw(s, l64::hidden(s), B, Mlp);
  const auto x = random_values<double>(N * C, 21, 1.0f);
  const auto dy = random_values<double>(N * C, 22, 1.0f);
  std::vector<std::vector<double>> g;
  for (const auto& v : initial_grads(hw)) g.emplace_back(v.size(), 0.0);
  double* gp[16];
  for (int i = 0; i < 16; ++i) gp[i] = g[static_cast<std::size_t>(i)].data();
  mb::thread_pool pool(1);
  std::vector<double> y(N * C), dx(N * C);
  mbt::host_buffer saved(l64::saved_bytes(s));
  mbt::host_buffer ws(std::max(l64::forward_workspace_bytes(s, 1), l64::backward_workspace_bytes(s, 1)));
  const auto w = weights_of<l64>(hw, Mlp);
  l64::forward(s, w, x.data(), y.data(), saved.data(), saved.size(), ws.data(), ws.size(), pool);
  l64::backward(s, w, x.data(), saved.data(), saved.size(), dy.data(), dx.data(),
                gradients_of<l64>(gp, Mlp), ws.data(), ws.size(), pool);
  return g;
}

// Forward then backward on both backends from the same inputs and the same starting gradients;
// checks the device against the CPU (the fp32 gradients against float64) and two device runs
// against each other; returns the first.
// k: the device executor's kernel choices (the inner loop's shared memory).
template <bool Mlp, typename Precision, std::size_t B, std::size_t G>
backward_bytes compare_backward(const mb::ttt_shape& s, double tol_y, double tol_g, const mb::gpu::kernel_choices& k = {}) {
  using cpu_l = mb::basic_ttt<Mlp, Precision, mb::ttt_mini_batch<B>, mb::ttt_state_groups<G>>;
  using gpu_l = mb::basic_ttt<Mlp, Precision, mb::ttt_mini_batch<B>, mb::ttt_state_groups<G>,
                              mb::cuda_backend>;
  using S = typename cpu_l::storage_type;
  const std::size_t N = s.batch * s.seq, C = s.width;
  const host_weights<S> hw(s, cpu_l::hidden(s), B, Mlp);
  const auto x = random_values<S>(N * C, 21, 1.0f);
  const auto dy = random_values<S>(N * C, 22, 1.0f);
  const auto g0 = initial_grads(hw);

  // The CPU backend.
  mb::thread_pool pool(1);
  std::vector<S> y_c(N * C), dx_c(N * C);
  mbt::host_buffer saved_c(cpu_l::saved_bytes(s));
  mbt::host_buffer ws_c(std::max(cpu_l::forward_workspace_bytes(s, 1),
                                 cpu_l::backward_workspace_bytes(s, 1)));
  auto host_w = hw;
  const auto wc = weights_of<cpu_l>(host_w, Mlp);
  cpu_l::forward(s, wc, x.data(), y_c.data(), saved_c.data(), saved_c.size(), ws_c.data(),
                 ws_c.size(), pool);
  auto g_c = g0;
  S* gp_c[16];
  for (int i = 0; i < 16; ++i) gp_c[i] = g_c[i].data();
  cpu_l::backward(s, wc, x.data(), saved_c.data(), saved_c.size(), dy.data(), dx_c.data(),
                  gradients_of<cpu_l>(gp_c, Mlp), ws_c.data(), ws_c.size(), pool);

  // The device, twice from the same starting gradients.
  mb::cuda_executor ex;
  ex.set_kernels(k);
  device_weights<S> dw(hw);
  const auto wd = weights_of<gpu_l>(dw, Mlp);
  mbt::device_buffer<S> dxin(x), ddy(dy), dyout(N * C), ddx(N * C);
  mbt::device_buffer<std::uint8_t> dsaved(gpu_l::saved_bytes(s));
  const std::size_t fws = gpu_l::forward_workspace_bytes(s, 1);
  const std::size_t bws = gpu_l::backward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> dws(std::max(fws, bws));
  std::vector<std::unique_ptr<mbt::device_buffer<S>>> dg;
  S* gp_d[16];
  for (int i = 0; i < 16; ++i) {
    dg.push_back(std::make_unique<mbt::device_buffer<S>>(g0[i]));
    gp_d[i] = dg.back()->get();
  }
  const auto gd = gradients_of<gpu_l>(gp_d, Mlp);
  auto run = [&] {
    for (int i = 0; i < 16; ++i) dg[static_cast<std::size_t>(i)]->upload(g0[static_cast<std::size_t>(i)]);
    gpu_l::forward(s, wd, dxin.get(), dyout.get(), dsaved.get(), dsaved.size(), dws.get(), fws, ex);
    gpu_l::backward(s, wd, dxin.get(), dsaved.get(), dsaved.size(), ddy.get(), ddx.get(), gd,
                    dws.get(), bws, ex);
    ex.synchronize();
    backward_bytes r{bytes_of_vector(dyout.download()), bytes_of_vector(ddx.download()), {}};
    for (int i = 0; i < 16; ++i) r.g.push_back(bytes_of_vector(dg[static_cast<std::size_t>(i)]->download()));
    return r;
  };
  const backward_bytes first = run();
  const backward_bytes second = run();
  CHECK(first == second);

  constexpr double floor = 1e-2;
  mbt::close_normwise("y", as_double(from_bytes<S>(first.y)), as_double(y_c), tol_y, floor);
  mbt::close_normwise("dx", as_double(from_bytes<S>(first.dx)), as_double(dx_c), tol_g, floor);
  constexpr bool fp32 = std::is_same_v<Precision, mb::fp32_precision>;
  std::vector<std::vector<double>> exact;
  if constexpr (fp32) exact = gradients64<Mlp, B, G>(s);
  for (std::size_t i = 0; i < 16; ++i) {
    if (!Mlp && i >= 14) continue;
    // The change from the starting values: the gradient itself, not the nonzero start.
    std::vector<double> got = as_double(from_bytes<S>(first.g[i])), want = as_double(g_c[i]);
    const std::vector<double> start = as_double(g0[i]);
    for (std::size_t e = 0; e < got.size(); ++e) {
      got[e] -= start[e];
      want[e] -= start[e];
    }
    if constexpr (fp32) {
      mbt::close_normwise(grad_names[i], got, exact[i], fp32_grad_tol_vs_fp64, floor);
    } else {
      mbt::close_normwise(grad_names[i], got, want, tol_g, floor);
    }
  }
  return first;
}


template <bool Mlp, typename Precision>
void kind_backward_matches_cpu(double tol_y, double tol_g) {
  constexpr std::size_t all = static_cast<std::size_t>(-1);
  // Short last mini-batch (37 = 2·16 + 5), G = 1, 2, all: the same bits whatever G is (the
  // backward recomputes the states G skipped with the forward's own device functions).
  mb::ttt_shape s{2, 37, 32, 2};
  const auto r1 = compare_backward<Mlp, Precision, 16, 1>(s, tol_y, tol_g);
  const auto r2 = compare_backward<Mlp, Precision, 16, 2>(s, tol_y, tol_g);
  const auto ra = compare_backward<Mlp, Precision, 16, all>(s, tol_y, tol_g);
  CHECK(r1 == r2);
  CHECK(r1 == ra);
  // The inner loop's placement moves bytes only: with its shared memory capped (nothing on
  // chip; part of it) the device's own placement's bits come back.
  for (const std::size_t cap : {std::size_t{0}, std::size_t{16} << 10, std::size_t{26000}}) {
    const mb::gpu::kernel_choices capped{.ttt_shared_limit = cap};
    const auto c1 = compare_backward<Mlp, Precision, 16, 1>(s, tol_y, tol_g, capped);
    const auto c2 = compare_backward<Mlp, Precision, 16, 2>(s, tol_y, tol_g, capped);
    CHECK(c1 == r1);
    CHECK(c2 == r1);
  }
  s.use_gate = true;
  const auto q1 = compare_backward<Mlp, Precision, 16, 1>(s, tol_y, tol_g);
  const auto qa = compare_backward<Mlp, Precision, 16, all>(s, tol_y, tol_g);
  CHECK(q1 == qa);
  // b = 1 (every mini-batch one token); T < b (one short mini-batch).
  compare_backward<Mlp, Precision, 1, 2>({1, 7, 16, 2}, tol_y, tol_g);
  compare_backward<Mlp, Precision, 16, 4>({3, 5, 16, 1}, tol_y, tol_g);
}

constexpr double bf16_grad_bound = 16.0 / 256.0;  // tests/unit/test_ttt.cpp's 16·2^-8
void linear_backward_fp32() { kind_backward_matches_cpu<false, mb::fp32_precision>(1e-5, 1e-5); }
void mlp_backward_fp32() { kind_backward_matches_cpu<true, mb::fp32_precision>(1e-5, 1e-5); }
void linear_backward_bf16() {
  kind_backward_matches_cpu<false, mb::bf16_precision>(4e-2, bf16_grad_bound);
}
void mlp_backward_bf16() {
  kind_backward_matches_cpu<true, mb::bf16_precision>(4e-2, bf16_grad_bound);
}

// Packed sequences of lengths 5, 0, 16, 17, 1 and 9 (a partial mini-batch, an empty sequence, one
// of exactly b, one of b + 1, a single token) against the CPU's packed call, which
// tests/unit/test_ttt.cpp holds equal to each sequence run alone: y, dx and every gradient; the
// same bits across G (a group cut short at a sequence's end).
template <bool Mlp>
void packed_kind_matches_cpu() {
  static const std::int32_t offsets[] = {0, 5, 5, 21, 38, 39, 48};
  mb::ttt_shape s{1, 48, 32, 2};
  s.offsets = offsets;
  s.sequences = 6;
  const auto g1 = compare_backward<Mlp, mb::fp32_precision, 16, 1>(s, 1e-5, 1e-5);
  const auto g2 = compare_backward<Mlp, mb::fp32_precision, 16, 2>(s, 1e-5, 1e-5);
  CHECK(g1 == g2);
  compare_backward<Mlp, mb::bf16_precision, 16, 1>(s, 4e-2, bf16_grad_bound);
}
void packed_matches_cpu() {
  packed_kind_matches_cpu<false>();
  packed_kind_matches_cpu<true>();
}

// Saved and workspace from a device budget: the layer's peak is saved + the larger workspace (it
// allocates nothing itself: the device's free memory does not move during the calls).
template <bool Mlp, std::size_t G>
void peak_of(const mb::ttt_shape& s, mb::cuda_executor& ex) {
  using L = mb::basic_ttt<Mlp, mb::fp32_precision, mb::ttt_mini_batch<16>,
                          mb::ttt_state_groups<G>, mb::cuda_backend>;
  const std::size_t N = s.batch * s.seq, C = s.width;
  const host_weights<float> hw(s, L::hidden(s), 16, Mlp);
  device_weights<float> dw(hw);
  const auto wd = weights_of<L>(dw, Mlp);
  const auto g0 = initial_grads(hw);
  std::vector<std::unique_ptr<mbt::device_buffer<float>>> dg;
  float* gp[16];
  for (int i = 0; i < 16; ++i) {
    dg.push_back(std::make_unique<mbt::device_buffer<float>>(g0[static_cast<std::size_t>(i)]));
    gp[i] = dg.back()->get();
  }
  const auto gd = gradients_of<L>(gp, Mlp);
  mbt::device_buffer<float> x(random_values<float>(N * C, 23, 1.0f)),
      dy(random_values<float>(N * C, 24, 1.0f)), y(N * C), dx(N * C);
  mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>> budget(std::size_t{8} << 30);
  const std::size_t sb = L::saved_bytes(s), fws = L::forward_workspace_bytes(s, 1),
                    bws = L::backward_workspace_bytes(s, 1);
  const auto call = [&] {
    void* saved = budget.allocate(sb, 256, mb::memory_tag::activations);
    void* ws = budget.allocate(fws, 256, mb::memory_tag::workspace);
    L::forward(s, wd, x.get(), y.get(), saved, sb, ws, fws, ex);
    budget.deallocate(ws, fws, 256, mb::memory_tag::workspace);
    ws = budget.allocate(bws, 256, mb::memory_tag::workspace);
    L::backward(s, wd, x.get(), saved, sb, dy.get(), dx.get(), gd, ws, bws, ex);
    ex.synchronize();
    budget.deallocate(ws, bws, 256, mb::memory_tag::workspace);
    budget.deallocate(saved, sb, 256, mb::memory_tag::activations);
  };
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  call();  // warm: the cache holds the segments, modules are loaded
  budget.reset_peaks();
  std::size_t free_before = 0, free_after = 0, total = 0;
  mb::cuda_check(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");
  call();
  mb::cuda_check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo");
  CHECK(free_after == free_before);
  CHECK(budget.stats().peak_requested == sb + std::max(fws, bws));
}

void peak_is_saved_plus_workspace() {
  mb::cuda_executor ex;
  mb::ttt_shape s{2, 37, 32, 2};
  s.use_gate = true;
  peak_of<false, 2>(s, ex);
  peak_of<true, static_cast<std::size_t>(-1)>(s, ex);
  s.use_gate = false;
  peak_of<false, 1>(s, ex);
}

// The decoding step on the device, token by token from make_state, equals the device forward's
// row t (same kernels' arithmetic up to the order of the running sums: tolerance as fp32 above),
// across two mini-batch boundaries and a partial third.
template <bool Mlp, typename Precision>
void step_equals_forward(double tol, bool gate) {
  using gpu_l = mb::basic_ttt<Mlp, Precision, mb::ttt_mini_batch<4>, mb::ttt_state_groups<2>,
                              mb::cuda_backend>;
  using S = typename gpu_l::storage_type;
  mb::ttt_shape s{2, 11, 16, 2};
  s.use_gate = gate;
  const std::size_t B = s.batch, T = s.seq, C = s.width;
  const host_weights<S> hw(s, gpu_l::hidden(s), 4, Mlp);
  const auto x = random_values<S>(B * T * C, 30, 1.0f);
  mb::cuda_executor ex;
  device_weights<S> dw(hw);
  const auto wd = weights_of<gpu_l>(dw, Mlp);
  mbt::device_buffer<S> dx(x), dy(B * T * C);
  mbt::device_buffer<std::uint8_t> saved(gpu_l::saved_bytes(s));
  const std::size_t fws = gpu_l::forward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> ws(fws);
  gpu_l::forward(s, wd, dx.get(), dy.get(), saved.get(), saved.size(), ws.get(), fws, ex);
  ex.synchronize();
  const auto y_full = dy.download();

  mbt::device_buffer<std::uint8_t> state(gpu_l::state_bytes(s));
  auto st = gpu_l::make_state(s, wd, state.get(), state.size(), ex);
  const std::size_t sws = gpu_l::step_workspace_bytes(s);
  mbt::device_buffer<std::uint8_t> sw(sws);
  mbt::device_buffer<S> xt(B * C), yt(B * C);
  std::vector<double> got, want;
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<S> row(B * C);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t c = 0; c < C; ++c) row[b * C + c] = x[(b * T + t) * C + c];
    xt.upload(row);
    gpu_l::step(s, wd, st, xt.get(), yt.get(), sw.get(), sws, ex);
    ex.synchronize();
    const auto y = yt.download();
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t c = 0; c < C; ++c) {
        got.push_back(static_cast<double>(mb::to_accum<float>(y[b * C + c])));
        want.push_back(static_cast<double>(mb::to_accum<float>(y_full[(b * T + t) * C + c])));
      }
  }
  CHECK(st.position == T);
  // Another summation order than the forward's (one-row GEMMs): y is a cancelling sum whose
  // rounding scales with its terms, so the floor is 5% of max|y|.
  mbt::close_normwise("step vs forward row", got, want, tol, std::max(1e-2, 5e-2 * mbt::max_abs(want)));
}

void step_fp32() {
  step_equals_forward<false, mb::fp32_precision>(1e-5, false);
  step_equals_forward<true, mb::fp32_precision>(1e-5, true);
}

void typed_errors() {
  using gpu_l = mb::ttt_linear<mb::fp32_precision, mb::cuda_backend>;
  const mb::ttt_shape s{1, 4, 8, 2};
  mb::cuda_executor ex;
  const host_weights<float> hw(s, gpu_l::hidden(s), gpu_l::mini_batch, false);
  device_weights<float> dw(hw);
  const auto wd = weights_of<gpu_l>(dw, false);
  mbt::device_buffer<float> x(32), y(32), dx(32), g(1024);
  mbt::device_buffer<std::uint8_t> saved(gpu_l::saved_bytes(s));
  const std::size_t fws = gpu_l::forward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> ws(fws);
  EXPECT_THROW(mb::workspace_too_small,
               gpu_l::forward(s, wd, x.get(), y.get(), saved.get(), saved.size(), ws.get(),
                              fws - 1, ex));
  EXPECT_THROW(mb::workspace_too_small,
               gpu_l::forward(s, wd, x.get(), y.get(), saved.get(), saved.size() - 1, ws.get(),
                              fws, ex));
  EXPECT_THROW(mb::invalid_argument,
               gpu_l::forward(s, wd, nullptr, y.get(), saved.get(), saved.size(), ws.get(), fws, ex));
  float* gp = g.get();
  const gpu_l::gradients gr{gp, gp, gp, gp, gp, gp, gp, gp, gp, gp, gp, gp, gp, gp};
  const std::size_t bws = gpu_l::backward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> bw(bws);
  EXPECT_THROW(mb::workspace_too_small,
               gpu_l::backward(s, wd, x.get(), saved.get(), saved.size(), y.get(), dx.get(), gr,
                               bw.get(), bws - 1, ex));
  EXPECT_THROW(mb::workspace_too_small,
               gpu_l::backward(s, wd, x.get(), saved.get(), saved.size() - 1, y.get(), dx.get(),
                               gr, bw.get(), bws, ex));
  gpu_l::gradients missing = gr;
  missing.wq = nullptr;
  EXPECT_THROW(mb::invalid_argument,
               gpu_l::backward(s, wd, x.get(), saved.get(), saved.size(), y.get(), dx.get(),
                               missing, bw.get(), bws, ex));
  mbt::device_buffer<std::uint8_t> state(gpu_l::state_bytes(s));
  EXPECT_THROW(mb::workspace_too_small, gpu_l::make_state(s, wd, state.get(), state.size() - 1, ex));
  CHECK(fws >= mb::gpu::gemm_workspace_bytes(ex));
  CHECK(bws >= mb::gpu::gemm_workspace_bytes(ex));
  // Packed sequences: taken (batch 1); offsets that do not cover the tokens refused by name,
  // before anything runs.
  const std::int32_t offsets[] = {0, 1, static_cast<std::int32_t>(s.seq)}, short_offsets[] = {0, 1, 2};
  mb::ttt_shape packed = s;
  packed.batch = 1;
  packed.offsets = offsets;
  packed.sequences = 2;
  CHECK(gpu_l::can_implement(packed).ok);
  packed.offsets = short_offsets;
  CHECK(std::string(gpu_l::can_implement(packed).argument) == "shape.offsets");
  EXPECT_THROW(mb::invalid_argument,
               gpu_l::forward(packed, wd, x.get(), y.get(), saved.get(), saved.size(), ws.get(), fws, ex));
}

// What the inner loop keeps on chip (host only; runs without a device): the parts on chip fit the
// limit and nothing that would fit beside them is left out; for the issue's shapes
// on sm_90 (227 KiB opt-in) and sm_80 (163 KiB) it is what the header's comment says.
void on_chip_report_on_host() {
  using K = mb::backend_kernels<mb::cuda_backend, mb::ttt_shape>;
  constexpr std::size_t sm90 = 232448, sm80 = 167936, all = static_cast<std::size_t>(-1);
  const auto show = [](const char* what, const mb::gpu::ttt_placement_t& f,
                       const mb::gpu::ttt_placement_t& b) {
    std::printf("  %-34s forward place %u, %6zu B; backward place %u, %6zu B\n", what, f.place,
                f.shared_bytes, b.place, b.shared_bytes);
  };
  // C = 768, 12 heads: head_dim 64 (the example trainer's TTT blocks).
  const mb::ttt_shape s64{8, 2048, 768, 12};
  const auto lin = K::on_chip<false, 16, 1>(s64, sm90);
  show("linear D=64 b=16 G=1, sm_90", lin.forward, lin.backward);
  CHECK(lin.forward.place == 3u);   // rows and state
  CHECK(lin.backward.place == 7u);  // rows, running state and dS, the one group state
  const auto lin80 = K::on_chip<false, 16, 1>(s64, sm80);
  show("linear D=64 b=16 G=1, sm_80", lin80.forward, lin80.backward);
  CHECK(lin80.forward.place == 3u);
  const auto mlp = K::on_chip<true, 16, 1>(s64, sm90);
  show("mlp D=64 b=16 G=1, sm_90", mlp.forward, mlp.backward);
  CHECK(mlp.forward.place == 1u);  // the rows; the 129 KiB state streams
  const auto lin64 = K::on_chip<false, 64, all>(s64, sm90);
  show("linear D=64 b=64 G=all, sm_90", lin64.forward, lin64.backward);
  // C = 2048, 16 heads: head_dim 128.
  const mb::ttt_shape s128{1, 4096, 2048, 16};
  const auto l128 = K::on_chip<false, 16, 1>(s128, sm90);
  show("linear D=128 b=16 G=1, sm_90", l128.forward, l128.backward);
  const auto m128 = K::on_chip<true, 16, 1>(s128, sm90);
  show("mlp D=128 b=16 G=1, sm_90", m128.forward, m128.backward);
  CHECK((m128.forward.place & 2u) == 0u);  // W1 alone is 256 KiB
  CHECK(lin64.backward.place == 2u);  // its rows and 32 group states do not fit; the running state does
  // Invariants over a sweep: the bytes are the placed parts' sum, within the limit, and every
  // part left off would not fit beside them.
  for (const std::size_t limit : {std::size_t{0}, std::size_t{4096}, std::size_t{49152}, sm80, sm90}) {
    for (const std::size_t D : {std::size_t{16}, std::size_t{64}, std::size_t{128}}) {
      const mb::ttt_shape s{2, 100, 4 * D, 4};
      const auto check = [&](bool mlp, std::size_t b, std::size_t gsz, const auto& r) {
        const std::size_t F = mlp ? 4 * D : D, SZ = mlp ? 2 * D * F + F + D : D * D + D;
        const std::size_t fp[3] = {mb::gpu::ttt_forward_rows(D, F, b, mlp), SZ, 0};
        const std::size_t bp[3] = {mb::gpu::ttt_backward_rows(D, F, b, mlp), 2 * SZ, gsz * SZ};
        for (int k = 0; k < 2; ++k) {
          const auto& p = k == 0 ? r.forward : r.backward;
          const std::size_t* parts = k == 0 ? fp : bp;
          std::size_t sum = 0;
          for (int i = 0; i < 3; ++i)
            if (p.place & (1u << i)) sum += parts[i] * sizeof(float);
          CHECK(p.shared_bytes == sum);
          CHECK(sum <= limit);
          for (int i = 0; i < 3; ++i)
            if (!(p.place & (1u << i)) && parts[i] != 0) CHECK(sum + parts[i] * sizeof(float) > limit);
        }
      };
      check(false, 16, 2, K::on_chip<false, 16, 2>(s, limit));
      check(true, 16, 2, K::on_chip<true, 16, 2>(s, limit));
      check(false, 64, 2, K::on_chip<false, 64, all>(s, limit));  // 100 tokens: 2 mini-batches
    }
  }
}

}  // namespace

int main() {
  // The host part first: a failure there fails the test even without a device.
  on_chip_report_on_host();
  if (mbt::failures != 0) return 1;
  static const mbt::test_case cases[] = {
      {"ttt_linear cuda_backend fp32 forward equals the CPU backend", linear_fp32},
      {"ttt_mlp cuda_backend fp32 forward equals the CPU backend", mlp_fp32},
      {"ttt_linear cuda_backend bf16 forward within the stated bound", linear_bf16},
      {"ttt_mlp cuda_backend bf16 forward within the stated bound", mlp_bf16},
      {"ttt_linear cuda_backend fp32 backward equals the CPU backend", linear_backward_fp32},
      {"ttt_mlp cuda_backend fp32 backward equals the CPU backend", mlp_backward_fp32},
      {"ttt_linear cuda_backend bf16 backward within the stated bound", linear_backward_bf16},
      {"ttt_mlp cuda_backend bf16 backward within the stated bound", mlp_backward_bf16},
      {"ttt cuda_backend peak through a device budget is saved + the larger workspace",
       peak_is_saved_plus_workspace},
      {"ttt cuda_backend step equals the forward's row", step_fp32},
      {"ttt cuda_backend packed sequences equal the CPU backend's", packed_matches_cpu},
      {"ttt cuda_backend typed errors", typed_errors},
  };
  return mbt::run_suite("test_cuda_ttt", cases);
}
