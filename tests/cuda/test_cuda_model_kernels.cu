// The model kernels of backend/cuda/model.cuh against the CPU backend (backend/cpu/model.hpp, the
// CPU AdamW and global_norm), for float and bf16 storage at odd sizes, plus bit-identical repeats
// and the typed errors. Without a device it exits 77 (skipped).
//
// Tolerances: float results differ from the CPU's by summation order, FMA contraction and the
// device's expf (a few ulps, compounded over one reduction): 1e-4 relative above a 1e-5 floor
// (RMSNorm's dg above 0.1: a sum of N terms of size ~1 that cancel, so its error is the terms').
// bf16 outputs are one rounding of such a float (2^-8 relative): one bf16 ulp apart at most,
// 1e-2. The embedding scatter adds in the CPU's order and must match it bit for bit.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "cuda_test_support.cuh"
#include "membound/train/schedule_lr.hpp"

namespace mb = membound;
namespace mc = membound::gpu;

namespace {

template <typename S>
std::vector<S> random_values(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<S> v(n);
  std::uint32_t s = seed * 2654435761u + 1;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    const float u = static_cast<float>(s >> 8) / static_cast<float>(1u << 24);
    x = mb::from_accum<S>(lo + (hi - lo) * u);
  }
  return v;
}

template <typename T>
std::vector<double> as_double(const std::vector<T>& v) {
  std::vector<double> d(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<T, double>) {
      d[i] = v[i];
    } else {
      d[i] = static_cast<double>(mb::to_accum<float>(v[i]));
    }
  }
  return d;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename S>
constexpr double tol() {
  return std::is_same_v<S, float> ? 1e-4 : 1e-2;
}

std::vector<std::int32_t> token_ids(std::size_t n, std::size_t vocab, std::uint32_t seed) {
  std::vector<std::int32_t> t(n);
  std::uint32_t s = seed;
  for (auto& x : t) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<std::int32_t>((s >> 8) % vocab);
  }
  return t;
}

template <typename S>
void rmsnorm_case(std::size_t N, std::size_t C) {
  mb::cuda_executor ex;
  mb::thread_pool pool(2);
  const auto x = random_values<S>(N * C, 1), g = random_values<S>(C, 2, 0.5f, 1.5f);
  const auto dy = random_values<S>(N * C, 3), res = random_values<S>(N * C, 4);
  const auto dg0 = random_values<S>(C, 5);

  std::vector<S> y(N * C), dx(N * C), dg = dg0;
  std::vector<float> rstd(N), part(mb::cpu::row_partials(N, C));
  mb::cpu::rmsnorm_forward<float>(pool, x.data(), g.data(), y.data(), rstd.data(), N, C, 1e-5);
  mb::cpu::rmsnorm_backward<float>(pool, x.data(), g.data(), rstd.data(), dy.data(), res.data(), dx.data(), dg.data(),
                                   part.data(), N, C);

  mbt::device_buffer<S> dx_in(x), dg_in(g), ddy(dy), dres(res), dy_out(N * C), ddx(N * C), ddg(dg0);
  mbt::device_buffer<float> drstd(N);
  const std::size_t wsb = mc::rmsnorm_backward_workspace_bytes(N, C);
  mbt::device_buffer<unsigned char> ws(wsb);
  mc::rmsnorm_forward(ex, dx_in.get(), dg_in.get(), dy_out.get(), drstd.get(), N, C, 1e-5);
  mc::rmsnorm_backward(ex, dx_in.get(), dg_in.get(), drstd.get(), ddy.get(), dres.get(), ddx.get(), ddg.get(),
                       ws.get(), wsb, N, C);
  ex.synchronize();
  mbt::close("rmsnorm y", as_double(dy_out.download()), as_double(y), tol<S>(), 1e-5);
  mbt::close("rmsnorm rstd", as_double(drstd.download()), as_double(rstd), 1e-5);
  mbt::close("rmsnorm dx", as_double(ddx.download()), as_double(dx), tol<S>(), 1e-3);
  // dg sums N rows of terms of size ~1 that cancel: its error is a few ulps of the terms, not of
  // the result, so the floor is 0.1 (a fp32 dg of -0.0029 over 70 rows differed by 8e-7 on the
  // H200, 2026-11-29: 2.1e-4 relative to itself, 8e-6 relative to the floor).
  mbt::close("rmsnorm dg", as_double(ddg.download()), as_double(dg), tol<S>(), 0.1);

  // Bit-identical repeats: the same dx and dg (dg starts over from dg0).
  const auto dx1 = ddx.download(), dg1 = ddg.download();
  ddg.upload(dg0);
  mc::rmsnorm_backward(ex, dx_in.get(), dg_in.get(), drstd.get(), ddy.get(), dres.get(), ddx.get(), ddg.get(),
                       ws.get(), wsb, N, C);
  ex.synchronize();
  CHECK(same_bits(ddx.download(), dx1));
  CHECK(same_bits(ddg.download(), dg1));

  EXPECT_THROW(mb::workspace_too_small,
               mc::rmsnorm_backward(ex, dx_in.get(), dg_in.get(), drstd.get(), ddy.get(), dres.get(), ddx.get(),
                                    ddg.get(), ws.get(), wsb - 1, N, C));
  EXPECT_THROW(mb::invalid_argument, mc::rmsnorm_forward(ex, dx_in.get(), dg_in.get(), dy_out.get(), drstd.get(), N, C, 0.0));
  EXPECT_THROW(mb::invalid_argument,
               mc::rmsnorm_forward(ex, static_cast<const S*>(nullptr), dg_in.get(), dy_out.get(), drstd.get(), N, C, 1e-5));
  EXPECT_THROW(mb::invalid_argument, mc::rmsnorm_forward(ex, dx_in.get(), dg_in.get(), dy_out.get(), drstd.get(), N, 0, 1e-5));
}

template <typename S>
void elementwise_case(std::size_t n) {
  mb::cuda_executor ex;
  const auto a = random_values<S>(n, 11, -6.0f, 6.0f), b = random_values<S>(n, 12), d = random_values<S>(n, 13);
  std::vector<S> sum(n);
  std::vector<float> act(n), da(n), db(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float av = mb::to_accum<float>(a[i]), bv = mb::to_accum<float>(b[i]);
    sum[i] = mb::from_accum<S>(av + bv);
    act[i] = mb::swiglu(av, bv);
    mb::swiglu_backward(av, bv, mb::to_accum<float>(d[i]), da[i], db[i]);
  }
  mbt::device_buffer<S> da_(a), db_(b), dd(d), dsum(n), dact_s(n);
  std::vector<float> dhost(n);
  for (std::size_t i = 0; i < n; ++i) dhost[i] = mb::to_accum<float>(d[i]);
  mbt::device_buffer<float> dact(n), dga(n), dgb(n), ddf(dhost);
  mc::add_rows(ex, da_.get(), db_.get(), dsum.get(), n);
  mc::swiglu_forward(ex, da_.get(), db_.get(), dact.get(), n);
  mc::swiglu_forward(ex, da_.get(), db_.get(), dact_s.get(), n);
  mc::swiglu_backward(ex, da_.get(), db_.get(), static_cast<const float*>(ddf.get()), dga.get(), dgb.get(), n);
  ex.synchronize();
  CHECK(same_bits(dsum.download(), sum));  // one float add, one rounding: exact on both
  mbt::close("swiglu act", as_double(dact.download()), as_double(act), 1e-5, 1e-5);
  mbt::close("swiglu act (storage)", as_double(dact_s.download()), as_double(act), tol<S>(), 1e-3);
  mbt::close("swiglu da", as_double(dga.download()), as_double(da), 1e-5, 1e-5);
  mbt::close("swiglu db", as_double(dgb.download()), as_double(db), 1e-5, 1e-5);

  // In place over dact (db = dact), as the CPU MLP does.
  mbt::device_buffer<float> dinplace(n), dga2(n);
  dinplace.upload(dhost);
  mc::swiglu_backward(ex, da_.get(), db_.get(), static_cast<const float*>(dinplace.get()), dga2.get(), dinplace.get(), n);
  ex.synchronize();
  CHECK(same_bits(dinplace.download(), dgb.download()));
  CHECK(same_bits(dga2.download(), dga.download()));
  EXPECT_THROW(mb::invalid_argument, mc::swiglu_backward(ex, da_.get(), db_.get(), dd.get(), dd.get(), dd.get(), n));
}

template <typename S>
void embedding_case() {
  const std::size_t N = 203, C = 97, V = 13;  // few rows: many repeated tokens
  mb::cuda_executor ex;
  mb::thread_pool pool(2);
  const auto tokens = token_ids(N, V, 21);
  const auto table = random_values<S>(V * C, 22), dx = random_values<S>(N * C, 23), dt0 = random_values<S>(V * C, 24);
  std::vector<S> x(N * C), dt = dt0;
  mb::cpu::embedding_gather(pool, tokens.data(), table.data(), x.data(), N, C);
  mb::cpu::embedding_scatter<float>(pool, tokens.data(), dx.data(), dt.data(), N, C);

  mbt::device_buffer<std::int32_t> dtok(tokens);
  mbt::device_buffer<S> dtable(table), dxo(N * C), ddx(dx), ddt(dt0);
  mbt::device_buffer<unsigned> bad(1);
  bad.upload({0u});
  mc::embedding_gather(ex, dtok.get(), dtable.get(), dxo.get(), N, C, V, bad.get());
  mc::embedding_scatter(ex, dtok.get(), ddx.get(), ddt.get(), N, C, V, bad.get());
  ex.synchronize();
  CHECK(same_bits(dxo.download(), x));
  CHECK(same_bits(ddt.download(), dt));  // the CPU's order of adds: the same bits
  CHECK(bad.download()[0] == 0u);

  // A bad id is flagged and touches nothing outside the table.
  auto wrong = tokens;
  wrong[5] = static_cast<std::int32_t>(V);
  wrong[9] = -1;
  dtok.upload(wrong);
  mc::embedding_gather(ex, dtok.get(), dtable.get(), dxo.get(), N, C, V, bad.get());
  ex.synchronize();
  CHECK(bad.download()[0] == 1u);
  const auto xo = dxo.download();
  for (std::size_t c = 0; c < C; ++c) CHECK(mb::to_accum<float>(xo[5 * C + c]) == 0.0f);
  EXPECT_THROW(mb::invalid_argument, mc::embedding_gather(ex, dtok.get(), dtable.get(), dxo.get(), N, C, 0, bad.get()));
  EXPECT_THROW(mb::invalid_argument,
               mc::embedding_scatter(ex, static_cast<const std::int32_t*>(nullptr), ddx.get(), ddt.get(), N, C, V));
}

void cross_entropy_case(std::size_t R, std::size_t V) {
  mb::cuda_executor ex;
  mb::thread_pool pool(2);
  auto logits = random_values<float>(R * V, 31, -8.0f, 8.0f);
  const auto targets = token_ids(R, V, 32);
  const float scale = 1.0f / 29.0f;
  mbt::device_buffer<float> dl(logits);
  mbt::device_buffer<std::int32_t> dt(targets);
  mbt::device_buffer<double> total(1);
  total.upload({0.5});  // the kernel adds to what is there
  const std::size_t wsb = mc::cross_entropy_workspace_bytes(R);
  mbt::device_buffer<unsigned char> ws(wsb);
  mc::cross_entropy_chunk(ex, dl.get(), dt.get(), R, V, scale, total.get(), ws.get(), wsb);
  std::vector<double> row_loss(R);
  const double want = mb::cpu::cross_entropy_chunk(pool, logits.data(), targets.data(), R, V, scale, row_loss.data());
  ex.synchronize();
  mbt::close("cross-entropy loss", std::vector<double>{total.download()[0]}, std::vector<double>{0.5 + want}, 1e-6);
  mbt::close("cross-entropy gradient", as_double(dl.download()), as_double(logits), 1e-4, 1e-7);

  // Repeats give the same bits.
  const auto g1 = dl.download();
  const double l1 = total.download()[0];
  dl.upload(random_values<float>(R * V, 31, -8.0f, 8.0f));
  total.upload({0.5});
  mc::cross_entropy_chunk(ex, dl.get(), dt.get(), R, V, scale, total.get(), ws.get(), wsb);
  ex.synchronize();
  CHECK(same_bits(dl.download(), g1));
  CHECK(total.download()[0] == l1);

  EXPECT_THROW(mb::workspace_too_small, mc::cross_entropy_chunk(ex, dl.get(), dt.get(), R, V, scale, total.get(), ws.get(), 8));
  EXPECT_THROW(mb::invalid_argument,
               mc::cross_entropy_chunk(ex, dl.get(), dt.get(), R, V, std::nan(""), total.get(), ws.get(), wsb));
  EXPECT_THROW(mb::invalid_argument, mc::cross_entropy_chunk(ex, dl.get(), dt.get(), R, V, scale, nullptr, ws.get(), wsb));
}

template <typename S>
void adamw_case() {
  const std::size_t n = 5003;
  const mc::adamw_segment segs[] = {{0, 1200, true}, {1200, 3, false}, {1300, 3000, true}, {4300, 703, false}};
  mb::cuda_executor ex;
  mb::thread_pool pool(2);
  using opt = mb::adamw<S>;
  auto w = random_values<S>(n, 41);
  const auto g = random_values<S>(n, 42, -0.1f, 0.1f);
  std::vector<unsigned char> state(opt::state_bytes(n));
  opt::init(w.data(), n, state.data(), state.size());
  mbt::device_buffer<S> dw(w), dg(g);
  mbt::device_buffer<unsigned char> dstate(state);
  mb::adamw_config c;
  c.weight_decay = 0.2;
  const double lr = 2e-3, gs = 0.75;
  for (std::uint64_t t = 1; t <= 3; ++t) {
    for (const auto& s : segs) opt::update(w.data(), g.data(), state.data(), n, s.offset, s.count, t, lr, c, s.decay, gs, pool);
    mc::adamw_update(ex, dw.get(), dg.get(), dstate.get(), dstate.size(), n, std::span<const mc::adamw_segment>(segs), t, lr,
                     c, gs);
  }
  ex.synchronize();
  mbt::close("adamw weights", as_double(dw.download()), as_double(w), tol<S>(), 1e-3);
  const auto st = dstate.download();
  std::vector<float> got(st.size() / 4), want(state.size() / 4);
  std::memcpy(got.data(), st.data(), st.size());
  std::memcpy(want.data(), state.data(), state.size());
  mbt::close("adamw state", as_double(got), as_double(want), 1e-4, 1e-6);

  // Clipping from a device norm, and the skip flag.
  mbt::device_buffer<double> norm(1);
  norm.upload({40.0});
  mbt::device_buffer<unsigned> skip(1);
  skip.upload({1u});
  const auto before = dw.download();
  mc::adamw_update(ex, dw.get(), dg.get(), dstate.get(), dstate.size(), n, std::span<const mc::adamw_segment>(segs), 4, lr, c,
                   1.0, {norm.get(), 1.0, 4.0, skip.get()});
  ex.synchronize();
  CHECK(same_bits(dw.download(), before));
  skip.upload({0u});
  mc::adamw_update(ex, dw.get(), dg.get(), dstate.get(), dstate.size(), n, std::span<const mc::adamw_segment>(segs), 4, lr, c,
                   1.0, {norm.get(), 1.0, 4.0, skip.get()});
  const double clip = mb::clip_factor(40.0 / 4.0, 1.0) / 4.0;
  for (const auto& s : segs) opt::update(w.data(), g.data(), state.data(), n, s.offset, s.count, 4, lr, c, s.decay, clip, pool);
  ex.synchronize();
  mbt::close("adamw clipped weights", as_double(dw.download()), as_double(w), tol<S>(), 1e-3);

  const mc::adamw_segment overlapping[] = {{0, 10, true}, {5, 10, true}};
  const mc::adamw_segment outside[] = {{n - 2, 3, true}};
  const auto all = std::span<const mc::adamw_segment>(segs);
  EXPECT_THROW(mb::invalid_argument, mc::adamw_update(ex, dw.get(), dg.get(), dstate.get(), dstate.size(), n,
                                                      std::span<const mc::adamw_segment>(overlapping), 1, lr, c));
  EXPECT_THROW(mb::invalid_argument, mc::adamw_update(ex, dw.get(), dg.get(), dstate.get(), dstate.size(), n,
                                                      std::span<const mc::adamw_segment>(outside), 1, lr, c));
  EXPECT_THROW(mb::invalid_argument, mc::adamw_update(ex, dw.get(), dg.get(), dstate.get(), dstate.size(), n, all, 0, lr, c));
  EXPECT_THROW(mb::workspace_too_small,
               mc::adamw_update(ex, dw.get(), dg.get(), dstate.get(), dstate.size() - 4, n, all, 1, lr, c));
  mb::adamw_config bad = c;
  bad.beta2 = 1.0;
  EXPECT_THROW(mb::invalid_argument, mc::adamw_update(ex, dw.get(), dg.get(), dstate.get(), dstate.size(), n, all, 1, lr, bad));
}

template <typename S>
void norm_case() {
  const std::size_t n = 100003;
  mb::cuda_executor ex;
  mb::thread_pool pool(2);
  const auto g = random_values<S>(n, 51);
  mbt::device_buffer<S> dg(g);
  mbt::device_buffer<double> norm(1);
  const std::size_t wsb = mc::global_norm_workspace_bytes(n);
  mbt::device_buffer<unsigned char> ws(wsb);
  mc::global_norm(ex, dg.get(), n, norm.get(), ws.get(), wsb);
  ex.synchronize();
  const double got = norm.download()[0];
  const double want = mb::global_norm(g.data(), n, pool);
  mbt::close("global norm", std::vector<double>{got}, std::vector<double>{want}, 1e-12);
  mc::global_norm(ex, dg.get(), n, norm.get(), ws.get(), wsb);
  ex.synchronize();
  CHECK(norm.download()[0] == got);

  mbt::device_buffer<unsigned> flag(1);
  flag.upload({0u});
  mc::check_finite(ex, dg.get(), n, flag.get());
  ex.synchronize();
  CHECK(flag.download()[0] == 0u);
  auto h = g;
  h[n - 1] = mb::from_accum<S>(std::numeric_limits<float>::infinity());
  dg.upload(h);
  mc::check_finite(ex, dg.get(), n, flag.get());
  ex.synchronize();
  CHECK(flag.download()[0] == 1u);
  flag.upload({0u});
  h[n - 1] = mb::from_accum<S>(0.0f);
  h[7] = mb::from_accum<S>(std::numeric_limits<float>::quiet_NaN());
  dg.upload(h);
  mc::check_finite(ex, dg.get(), n, flag.get());
  ex.synchronize();
  CHECK(flag.download()[0] == 1u);
  EXPECT_THROW(mb::workspace_too_small, mc::global_norm(ex, dg.get(), n, norm.get(), ws.get(), 0));
  EXPECT_THROW(mb::invalid_argument, mc::check_finite(ex, dg.get(), n, nullptr));
}

void fp16_builds() {  // fp16 storage through the same kernels: a smoke run of each
  const std::size_t N = 3, C = 40;
  mb::cuda_executor ex;
  const auto x = random_values<mb::fp16>(N * C, 61);
  mbt::device_buffer<mb::fp16> dx(x), dy(N * C), dgm(C);
  dgm.upload(random_values<mb::fp16>(C, 62, 0.5f, 1.5f));
  mbt::device_buffer<float> rstd(N);
  mc::rmsnorm_forward(ex, dx.get(), dgm.get(), dy.get(), rstd.get(), N, C, 1e-5);
  mc::add_rows(ex, dx.get(), dy.get(), dy.get(), N * C);
  ex.synchronize();
  const auto y = dy.download();
  for (std::size_t i = 0; i < y.size(); ++i) CHECK(std::isfinite(mb::to_accum<float>(y[i])));
}

// Kernels that only the model and trainer tests and the programs launch. A check build (CI)
// compiles those to PTX at cicc -O1 (CMakeLists.txt, membound_cuda_device_checked_elsewhere), so
// their addresses are taken here: this unit puts them through cicc -O3 and ptxas with warnings as
// errors. `python3 tools/cuda_kernel_lists.py build/ci` lists any kernel that still escapes.
[[maybe_unused]] const void* const compiled_in_full[] = {
    reinterpret_cast<const void*>(&mc::detail::norm_final_kernel<false>),
    reinterpret_cast<const void*>(&mc::detail::adamw8bit_kernel<float, 256u>),
    reinterpret_cast<const void*>(&mc::detail::adamw8bit_kernel<float, 2048u>),
    reinterpret_cast<const void*>(&mc::detail::adamw8bit_kernel<mb::bf16, 2048u>),
};

}  // namespace

int main() {
  static const mbt::test_case cases[] = {
      // N 37: 2 row blocks of the dweight reduce; C 301: not a group multiple (the element path);
      // C 768: the 16-byte path; C 7300: rows too wide for the shared partials (the wide kernel).
      {"rmsnorm float", [] { rmsnorm_case<float>(37, 301); }},
      {"rmsnorm bf16", [] { rmsnorm_case<mb::bf16>(37, 301); }},
      {"rmsnorm float (16-byte path)", [] { rmsnorm_case<float>(70, 768); }},
      {"rmsnorm bf16 (16-byte path)", [] { rmsnorm_case<mb::bf16>(70, 768); }},
      {"rmsnorm bf16 (wide rows)", [] { rmsnorm_case<mb::bf16>(5, 7300); }},
      {"add and swiglu float", [] { elementwise_case<float>(10007); }},
      {"add and swiglu bf16", [] { elementwise_case<mb::bf16>(10007); }},
      {"embedding float", embedding_case<float>},
      {"embedding bf16", embedding_case<mb::bf16>},
      {"cross-entropy chunk", [] { cross_entropy_case(13, 1001); }},
      {"cross-entropy chunk (16-byte path)", [] { cross_entropy_case(13, 1000); }},
      {"adamw float", adamw_case<float>},
      {"adamw bf16", adamw_case<mb::bf16>},
      {"global norm and finite check float", norm_case<float>},
      {"global norm and finite check bf16", norm_case<mb::bf16>},
      {"fp16 storage", fp16_builds},
  };
  return mbt::run_suite("test_cuda_model_kernels", cases);
}
