// The attention layer against the naive double reference (tests/support/attention_reference.hpp):
// the front end's checks and sizes, fp64 to 1e-10, fp32 and bf16/fp16 to stated tolerances,
// single-step decoding against the causal forward, and the memory it takes from an allocator.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "../support/attention_reference.hpp"
#include "../support/layer_test_util.hpp"
#include "../support/test_rng.hpp"
#include "membound/membound.hpp"

namespace ref = membound::reference;
using membound::attention;
using membound::attention_shape;
using membound::thread_pool;

namespace {

using membound_test::aligned_buffer;
using membound_test::rel_err;
using membound_test::rng;
using membound_test::rounded;
using membound_test::to_double;
using membound_test::to_storage;

ref::attention_config to_config(const attention_shape& s) {
  return ref::attention_config{s.batch, s.seq, s.d_model, s.heads, s.kv_heads, s.head_dim,
                               s.causal, s.rope_base, s.window};
}

ref::attention_weights random_weights(const attention_shape& c, rng& r) {
  const std::size_t HD = c.heads * c.head_dim, KD = c.kv_heads * c.head_dim;
  ref::attention_weights w;
  w.wq = r.fill(c.d_model * HD, 1.5 / std::sqrt(static_cast<double>(c.d_model)));
  w.wk = r.fill(c.d_model * KD, 1.5 / std::sqrt(static_cast<double>(c.d_model)));
  w.wv = r.fill(c.d_model * KD, 1.0 / std::sqrt(static_cast<double>(c.d_model)));
  w.wo = r.fill(HD * c.d_model, 1.0 / std::sqrt(static_cast<double>(HD)));
  return w;
}

struct problem {
  attention_shape shape;
  ref::attention_weights w;
  std::vector<double> x, dy;
};

problem make_problem(const attention_shape& s, std::uint64_t seed) {
  rng r{seed};
  problem p{s, random_weights(s, r), {}, {}};
  p.x = r.fill(s.batch * s.seq * s.d_model, 1.0);
  p.dy = r.fill(s.batch * s.seq * s.d_model, 1.0);
  return p;
}

// Rounds the problem's inputs to S, so that layers of different precisions see the same values.
template <typename S>
problem rounded_problem(problem p) {
  p.w.wq = rounded<S>(p.w.wq);
  p.w.wk = rounded<S>(p.w.wk);
  p.w.wv = rounded<S>(p.w.wv);
  p.w.wo = rounded<S>(p.w.wo);
  p.x = rounded<S>(p.x);
  p.dy = rounded<S>(p.dy);
  return p;
}

struct outputs {
  std::vector<double> y, lse, dx, dwq, dwk, dwv, dwo;
};

template <typename Attn>
outputs run_layer(const problem& p, std::size_t threads) {
  using S = typename Attn::storage_type;
  const attention_shape& s = p.shape;
  thread_pool pool(threads);
  const std::vector<S> wq = to_storage<S>(p.w.wq), wk = to_storage<S>(p.w.wk),
                       wv = to_storage<S>(p.w.wv), wo = to_storage<S>(p.w.wo);
  const std::vector<S> x = to_storage<S>(p.x), dy = to_storage<S>(p.dy);
  std::vector<S> y(x.size()), dx(x.size());
  std::vector<S> gq(wq.size(), S(0.0f)), gk(wk.size(), S(0.0f)), gv(wv.size(), S(0.0f)),
      go(wo.size(), S(0.0f));
  const typename Attn::weights w{wq.data(), wk.data(), wv.data(), wo.data()};
  aligned_buffer saved(Attn::saved_bytes(s));
  {
    aligned_buffer ws(Attn::forward_workspace_bytes(s, pool.size()));
    Attn::forward(s, w, x.data(), y.data(), saved.get(), saved.bytes, ws.get(), ws.bytes, pool);
  }
  {
    aligned_buffer ws(Attn::backward_workspace_bytes(s, pool.size()));
    Attn::backward(s, w, x.data(), saved.get(), saved.bytes, dy.data(), dx.data(),
                   typename Attn::gradients{gq.data(), gk.data(), gv.data(), go.data()}, ws.get(),
                   ws.bytes, pool);
  }
  outputs o;
  o.y = to_double(y.data(), y.size());
  const auto* lse = Attn::saved_lse(s, saved.get());
  o.lse.assign(lse, lse + s.batch * s.heads * s.seq);
  o.dx = to_double(dx.data(), dx.size());
  o.dwq = to_double(gq.data(), gq.size());
  o.dwk = to_double(gk.data(), gk.size());
  o.dwv = to_double(gv.data(), gv.size());
  o.dwo = to_double(go.data(), go.size());
  return o;
}

outputs run_reference(const problem& p) {
  const ref::attention_config c = to_config(p.shape);
  const ref::attention_forward_result f = ref::attention_forward(c, p.w, p.x);
  const ref::attention_grads g = ref::attention_backward(c, p.w, p.x, f, p.dy);
  return outputs{f.y, f.lse, g.dx, g.dwq, g.dwk, g.dwv, g.dwo};
}

// The largest per-tensor relative error, and CHECKs each against tol.
double compare(const outputs& a, const outputs& b, double tol) {
  const std::vector<double>* pa[] = {&a.y, &a.lse, &a.dx, &a.dwq, &a.dwk, &a.dwv, &a.dwo};
  const std::vector<double>* pb[] = {&b.y, &b.lse, &b.dx, &b.dwq, &b.dwk, &b.dwv, &b.dwo};
  const char* names[] = {"y", "lse", "dx", "dwq", "dwk", "dwv", "dwo"};
  double worst = 0.0;
  for (int i = 0; i < 7; ++i) {
    const double e = rel_err(*pa[i], *pb[i]);
    INFO(names[i] << " relative error " << e);
    CHECK(e <= tol);
    worst = std::max(worst, e);
  }
  return worst;
}

attention_shape shape_of(std::size_t B, std::size_t T, std::size_t C, std::size_t H,
                         std::size_t Hkv, std::size_t D, bool causal) {
  attention_shape s;
  s.batch = B;
  s.seq = T;
  s.d_model = C;
  s.heads = H;
  s.kv_heads = Hkv;
  s.head_dim = D;
  s.causal = causal;
  return s;
}

}  // namespace

// ---- Milestone 1: front end ------------------------------------------------------------------

TEST_CASE("attention: the size functions are constexpr and exact") {
  constexpr attention_shape s{1, 16, 32, 4, 2, 8, true, 10000.0};
  static_assert(attention<>::can_implement(s).ok);
  static_assert(attention<>::weight_elements(s) == 32 * 32 + 2 * 32 * 16 + 32 * 32);
  // O: 16·32 floats = 2048 B at offset 0; lse: 4·16 floats = 256 B at the next 256-B boundary.
  static_assert(attention<>::saved_bytes(s) == 2048 + 256);
  static_assert(attention<membound::fp64_precision>::saved_bytes(s) == 4096 + 512);
  static_assert(attention<>::kv_cache_bytes(s, 10) == 2 * 1 * 2 * 10 * 8 * 4);
  static_assert(attention<>::forward_workspace_bytes(s, 2) > 0);
  static_assert(attention<>::backward_workspace_bytes(s, 2) > 0);
  static_assert(attention<>::step_workspace_bytes(s, 10, 2) > 0);
  // Absurd shapes saturate to SIZE_MAX instead of wrapping around.
  constexpr attention_shape huge{1u << 20, 1u << 30, 1u << 20, 64, 64, 256, true, 10000.0};
  static_assert(attention<>::saved_bytes(huge) == static_cast<std::size_t>(-1));
  static_assert(attention<>::backward_workspace_bytes(huge, 4) == static_cast<std::size_t>(-1));
}

TEST_CASE("attention: check names the argument at fault") {
  const attention_shape good = shape_of(1, 4, 16, 4, 2, 8, true);
  CHECK(attention<>::can_implement(good).ok);
  CHECK_NOTHROW(attention<>::check(good));
  struct bad_case {
    attention_shape s;
    const char* argument;
  };
  std::vector<bad_case> cases;
  auto with = [&](auto f, const char* arg) {
    attention_shape s = good;
    f(s);
    cases.push_back({s, arg});
  };
  with([](attention_shape& s) { s.batch = 0; }, "shape.batch");
  with([](attention_shape& s) { s.seq = 0; }, "shape.seq");
  with([](attention_shape& s) { s.d_model = 0; }, "shape.d_model");
  with([](attention_shape& s) { s.heads = 0; }, "shape.heads");
  with([](attention_shape& s) { s.kv_heads = 0; }, "shape.kv_heads");
  with([](attention_shape& s) { s.kv_heads = 3; }, "shape.kv_heads");
  with([](attention_shape& s) { s.head_dim = 12; }, "shape.head_dim");
  with([](attention_shape& s) { s.head_dim = 264; }, "shape.head_dim");
  with([](attention_shape& s) { s.head_dim = 0; }, "shape.head_dim");
  with([](attention_shape& s) { s.rope_base = 0.0; }, "shape.rope_base");
  with([](attention_shape& s) { s.rope_base = std::nan(""); }, "shape.rope_base");
  with([](attention_shape& s) { s.rope_base = HUGE_VAL; }, "shape.rope_base");
  for (const bad_case& c : cases) {
    INFO(c.argument);
    const auto r = attention<>::can_implement(c.s);
    CHECK_FALSE(r.ok);
    CHECK(std::string(r.argument) == c.argument);
    try {
      attention<>::check(c.s);
      FAIL("check did not throw");
    } catch (const membound::invalid_argument& e) {
      CHECK(e.argument() == c.argument);
    }
  }
}

TEST_CASE("attention: a refused call leaves y untouched") {
  using attn = attention<>;
  const attention_shape s = shape_of(2, 5, 16, 4, 2, 8, true);
  const problem p = make_problem(s, 1);
  thread_pool pool(2);
  const auto wq = to_storage<float>(p.w.wq), wk = to_storage<float>(p.w.wk),
             wv = to_storage<float>(p.w.wv), wo = to_storage<float>(p.w.wo);
  const auto x = to_storage<float>(p.x);
  const typename attn::weights w{wq.data(), wk.data(), wv.data(), wo.data()};
  const float sentinel = 12345.0f;
  std::vector<float> y(x.size(), sentinel);
  aligned_buffer saved(attn::saved_bytes(s));
  aligned_buffer ws(attn::forward_workspace_bytes(s, pool.size()));
  auto untouched = [&] {
    return std::all_of(y.begin(), y.end(), [&](float e) { return e == sentinel; });
  };
  auto expect = [&](auto call, const char* argument) {
    INFO(argument);
    try {
      call();
      FAIL("no throw");
    } catch (const membound::invalid_argument& e) {
      CHECK(e.argument() == argument);
    }
    CHECK(untouched());
  };
  expect([&] { attn::forward(s, w, x.data(), y.data(), saved.get(), saved.bytes, ws.get(),
                             ws.bytes - 1, pool); }, "workspace");
  expect([&] { attn::forward(s, w, x.data(), y.data(), saved.get(), saved.bytes, nullptr,
                             ws.bytes, pool); }, "workspace");
  expect([&] { attn::forward(s, w, x.data(), y.data(), saved.get(), saved.bytes - 1, ws.get(),
                             ws.bytes, pool); }, "saved");
  expect([&] { attn::forward(s, w, nullptr, y.data(), saved.get(), saved.bytes, ws.get(),
                             ws.bytes, pool); }, "x");
  expect([&] { attn::forward(s, attn::weights{wq.data(), nullptr, wv.data(), wo.data()}, x.data(),
                             y.data(), saved.get(), saved.bytes, ws.get(), ws.bytes, pool); },
         "weights.wk");
  attention_shape bad = s;
  bad.head_dim = 10;
  expect([&] { attn::forward(bad, w, x.data(), y.data(), saved.get(), saved.bytes, ws.get(),
                             ws.bytes, pool); }, "shape.head_dim");
  try {
    attn::forward(s, w, x.data(), y.data(), saved.get(), saved.bytes, ws.get(), 7, pool);
  } catch (const membound::workspace_too_small& e) {
    CHECK(e.required() == attn::forward_workspace_bytes(s, pool.size()));
    CHECK(e.given() == 7);
  }
  CHECK(untouched());
  CHECK_NOTHROW(attn::forward(s, w, x.data(), y.data(), saved.get(), saved.bytes, ws.get(),
                              ws.bytes, pool));
  CHECK_FALSE(untouched());
}

TEST_CASE("thread_pool: every task runs once and exceptions come back") {
  for (std::size_t threads : {1u, 2u, 3u}) {
    thread_pool pool(threads);
    CHECK(pool.size() == threads);
    std::vector<int> hits(1000, 0);
    for (int round = 0; round < 3; ++round)
      pool.parallel_for(hits.size(), [&](std::size_t i, std::size_t t) {
        CHECK(t < threads);
        ++hits[i];
      });
    CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 3; }));
    CHECK_THROWS_AS(pool.parallel_for(10, [](std::size_t i, std::size_t) {
                      if (i == 7) throw std::runtime_error("task 7");
                    }),
                    std::runtime_error);
  }
  CHECK_THROWS_AS(thread_pool(0), membound::invalid_argument);
}

// ---- Milestone 2: fp64 against the reference ----------------------------------------------------

namespace {
struct fp64_case {
  const char* name;
  attention_shape shape;
};
}  // namespace

template <typename Attn>
void fp64_cases(const std::vector<fp64_case>& cases) {
  for (const fp64_case& c : cases) {
    INFO(c.name);
    const problem p = make_problem(c.shape, 42);
    const outputs want = run_reference(p);
    const outputs one = run_layer<Attn>(p, 1);
    const double e = compare(one, want, 1e-10);
    MESSAGE(std::string(c.name) << ": worst relative error " << e);
    // Identical, not merely close: each task's result does not depend on the thread count.
    const outputs two = run_layer<Attn>(p, 2);
    compare(two, one, 0.0);
    const outputs three = run_layer<Attn>(p, 3);
    compare(three, one, 0.0);
  }
}

TEST_CASE("attention<fp64_precision> matches the reference to 1e-10") {
  using membound::attention_tiles;
  using membound::fp64_precision;
  // Tiles 16×16: T = 37 ends in a partial tile and the causal diagonal crosses tiles.
  fp64_cases<attention<fp64_precision, attention_tiles<16, 16>>>({
      {"causal GQA H4/Hkv2 T37", shape_of(2, 37, 24, 4, 2, 8, true)},
      {"non-causal GQA T37", shape_of(2, 37, 24, 4, 2, 8, false)},
      {"causal MQA Hkv1 T37", shape_of(1, 37, 24, 4, 1, 8, true)},
      {"non-causal MHA T37", shape_of(1, 37, 24, 2, 2, 8, false)},
      {"causal T1", shape_of(2, 1, 16, 2, 1, 8, true)},
      {"non-causal T1", shape_of(1, 1, 16, 2, 2, 8, false)},
      {"head_dim 64 T20", shape_of(1, 20, 32, 2, 1, 64, true)},
  });
  // Unequal tiles, and tiles larger than T.
  fp64_cases<attention<fp64_precision, attention_tiles<8, 24>>>({
      {"q8 kv24 causal T37", shape_of(1, 37, 16, 4, 2, 8, true)},
      {"q8 kv24 non-causal T37", shape_of(1, 37, 16, 4, 2, 8, false)},
  });
  fp64_cases<attention<fp64_precision, attention_tiles<24, 8>>>({
      {"q24 kv8 causal T37", shape_of(1, 37, 16, 4, 4, 8, true)},
  });
  fp64_cases<attention<fp64_precision>>({  // 64×64 tiles
      {"tile > T causal, head_dim 128", shape_of(1, 13, 32, 2, 1, 128, true)},
      {"tile > T non-causal GQA", shape_of(2, 11, 16, 4, 2, 16, false)},
  });
}

// ---- Sliding window ----------------------------------------------------------------------------

namespace {
attention_shape windowed(attention_shape s, std::size_t window) {
  s.window = window;
  return s;
}
}  // namespace

// Against the reference's per-pair band mask in float64, every W from 1 to past T, both masks;
// 16×16 tiles over T = 37 put the band's edges inside tiles, on their borders and past the end.
TEST_CASE("attention: a sliding window matches the band-masked reference to 1e-10, every W") {
  using membound::attention_tiles;
  using membound::fp64_precision;
  std::vector<fp64_case> cases;
  std::vector<std::string> names;
  for (const bool causal : {true, false})
    for (std::size_t w = 1; w <= 39; ++w) {
      names.push_back(std::string(causal ? "causal" : "bidirectional") + " W" + std::to_string(w));
      cases.push_back({nullptr, windowed(shape_of(2, 37, 24, 4, 2, 8, causal), w)});
    }
  for (std::size_t i = 0; i < cases.size(); ++i) cases[i].name = names[i].c_str();
  fp64_cases<attention<fp64_precision, attention_tiles<16, 16>>>(cases);
  // Unequal tiles: the key tiles' alignment differs from the query tiles'.
  fp64_cases<attention<fp64_precision, attention_tiles<8, 24>>>({
      {"q8 kv24 causal W5", windowed(shape_of(1, 37, 16, 4, 2, 8, true), 5)},
      {"q8 kv24 bidirectional W9", windowed(shape_of(1, 37, 16, 4, 2, 8, false), 9)},
  });
  fp64_cases<attention<fp64_precision, attention_tiles<24, 8>>>({
      {"q24 kv8 causal W30", windowed(shape_of(1, 37, 16, 4, 4, 8, true), 30)},
  });
}

// A window that covers the sequence computes exactly what no window computes (the same tiles,
// the same sums), and the sizes never depend on it.
TEST_CASE("attention: a window of at least T is bit-identical to none") {
  using attn = attention<membound::attention_tiles<16, 16>>;
  for (const bool causal : {true, false}) {
    const attention_shape full = shape_of(2, 37, 32, 4, 2, 16, causal);
    const problem p = make_problem(full, 3);
    const outputs want = run_layer<attn>(p, 2);
    for (const std::size_t w : {std::size_t{37}, std::size_t{38}, std::size_t{1} << 40}) {
      problem q = p;
      q.shape.window = w;
      compare(run_layer<attn>(q, 2), want, 0.0);
      CHECK(attn::saved_bytes(q.shape) == attn::saved_bytes(full));
      CHECK(attn::forward_workspace_bytes(q.shape, 2) == attn::forward_workspace_bytes(full, 2));
      CHECK(attn::backward_workspace_bytes(q.shape, 2) == attn::backward_workspace_bytes(full, 2));
    }
  }
  // The pairs a FLOP count uses: T(T + 1)/2 causal, T² bidirectional, fewer under a window.
  constexpr attention_shape c{1, 10, 8, 1, 1, 8, true, 10000.0, 3};
  static_assert(membound::attention_pairs(c) == 1 + 2 + 3 * 8);
  static_assert(membound::attention_pairs(attention_shape{1, 10, 8, 1, 1, 8, false, 1e4, 3}) ==
                10 * 5 - 2 * 3);  // 5 keys a row, less the ends' 2 + 1 on each side
  static_assert(membound::attention_pairs(attention_shape{1, 10, 8, 1, 1, 8, true, 1e4, 0}) == 55);
}

// Decoding under a window keeps a ring of W positions: the cache's bytes are flat in max_len, and
// every step equals the windowed forward's row, long after the ring has wrapped.
TEST_CASE("attention::step with a window decodes from a ring of W positions") {
  using attn = attention<membound::fp64_precision>;
  for (const std::size_t W : {std::size_t{1}, std::size_t{4}, std::size_t{7}}) {
    const attention_shape s = windowed(shape_of(2, 23, 24, 4, 2, 16, true), W);
    const problem p = make_problem(s, 9);
    const ref::attention_forward_result f = ref::attention_forward(to_config(s), p.w, p.x);
    thread_pool pool(2);
    const std::size_t B = s.batch, T = s.seq, C = s.d_model;
    const std::size_t ring = 2 * B * s.kv_heads * W * s.head_dim * sizeof(double);
    CHECK(attn::kv_cache_bytes(s, T) == ring);
    CHECK(attn::kv_cache_bytes(s, std::size_t{1} << 40) == ring);  // flat at any length
    CHECK(attn::kv_cache_bytes(s, W - 1 + 1) == ring);
    aligned_buffer cache_bytes(attn::kv_cache_bytes(s, T));
    attn::kv_cache cache = attn::make_kv_cache(s, cache_bytes.get(), cache_bytes.bytes, T);
    aligned_buffer ws(attn::step_workspace_bytes(s, T, pool.size()));
    const attn::weights w{p.w.wq.data(), p.w.wk.data(), p.w.wv.data(), p.w.wo.data()};
    std::vector<double> x_t(B * C), y_t(B * C), got(B * T * C);
    for (std::size_t t = 0; t < T; ++t) {
      for (std::size_t b = 0; b < B; ++b) std::copy_n(&p.x[(b * T + t) * C], C, &x_t[b * C]);
      attn::step(s, w, cache, x_t.data(), y_t.data(), ws.get(), ws.bytes, pool);
      for (std::size_t b = 0; b < B; ++b) std::copy_n(&y_t[b * C], C, &got[(b * T + t) * C]);
    }
    INFO("W " << W);
    CHECK(rel_err(got, f.y) <= 1e-10);
  }
}

// ---- Packed variable-length sequences --------------------------------------------------------

// Packed sequences against each sequence run alone through the float64 reference: y, lse and dx
// row for row, the weight gradients as the sum over sequences. Lengths around the 16-token tile
// (1, 15, 16, 17), an empty one, a long one among short ones; with and without a window; both
// masks; the same bits on 1, 2 and 3 threads.
TEST_CASE("attention: packed sequences equal each sequence run alone") {
  using attn = attention<membound::fp64_precision, membound::attention_tiles<16, 16>>;
  const std::vector<std::size_t> lengths = {1, 15, 16, 17, 0, 60, 3};
  std::vector<std::int32_t> offsets{0};
  for (const std::size_t n : lengths) offsets.push_back(offsets.back() + static_cast<std::int32_t>(n));
  const auto N = static_cast<std::size_t>(offsets.back());
  for (const bool causal : {true, false})
    for (const std::size_t window : {std::size_t{0}, std::size_t{5}}) {
      CAPTURE(causal);
      CAPTURE(window);
      attention_shape s = windowed(shape_of(1, N, 24, 4, 2, 8, causal), window);
      s.offsets = offsets.data();
      s.sequences = lengths.size();
      REQUIRE(attn::can_implement(s).ok);
      const problem p = make_problem(s, 21);
      const outputs got = run_layer<attn>(p, 2);
      compare(run_layer<attn>(p, 1), got, 0.0);
      compare(run_layer<attn>(p, 3), got, 0.0);

      const std::size_t C = s.d_model, H = s.heads;
      outputs want{std::vector<double>(N * C), std::vector<double>(H * N), std::vector<double>(N * C),
                   std::vector<double>(p.w.wq.size()), std::vector<double>(p.w.wk.size()),
                   std::vector<double>(p.w.wv.size()), std::vector<double>(p.w.wo.size())};
      for (std::size_t q = 0; q < lengths.size(); ++q) {
        const std::size_t T = lengths[q], o = static_cast<std::size_t>(offsets[q]);
        if (T == 0) continue;
        ref::attention_config c = to_config(shape_of(1, T, C, H, s.kv_heads, s.head_dim, causal));
        c.window = window;
        const std::vector<double> x(p.x.begin() + o * C, p.x.begin() + (o + T) * C);
        const std::vector<double> dy(p.dy.begin() + o * C, p.dy.begin() + (o + T) * C);
        const ref::attention_forward_result f = ref::attention_forward(c, p.w, x);
        const ref::attention_grads g = ref::attention_backward(c, p.w, x, f, dy);
        std::copy(f.y.begin(), f.y.end(), want.y.begin() + o * C);
        std::copy(g.dx.begin(), g.dx.end(), want.dx.begin() + o * C);
        for (std::size_t h = 0; h < H; ++h)
          std::copy_n(&f.lse[h * T], T, &want.lse[h * N + o]);
        const auto add = [](std::vector<double>& to, const std::vector<double>& from) {
          for (std::size_t e = 0; e < to.size(); ++e) to[e] += from[e];
        };
        add(want.dwq, g.dwq);
        add(want.dwk, g.dwk);
        add(want.dwv, g.dwv);
        add(want.dwo, g.dwo);
      }
      const double e = compare(got, want, 1e-10);
      MESSAGE("packed " << std::string(causal ? "causal" : "bidirectional") << " W" << window << ": worst relative error " << e);
    }
}

// Offsets that do not describe the token axis are refused naming the field, before any output.
TEST_CASE("attention: bad packed offsets get a typed error; y is untouched") {
  using attn = attention<membound::fp64_precision>;
  std::vector<std::int32_t> offsets{0, 3, 7};
  attention_shape s = shape_of(1, 7, 16, 2, 1, 8, true);
  s.offsets = offsets.data();
  s.sequences = 2;
  CHECK(attn::can_implement(s).ok);
  const auto refused = [&](attention_shape bad, const char* argument) {
    const auto r = attn::can_implement(bad);
    CHECK_FALSE(r.ok);
    CHECK(std::string(r.argument) == argument);
  };
  offsets = {1, 3, 7};
  refused(s, "shape.offsets");  // not from 0
  offsets = {0, 5, 3};
  refused(s, "shape.offsets");  // decreasing
  offsets = {0, 3, 6};
  refused(s, "shape.offsets");  // not the whole axis
  offsets = {0, 3, 7};
  attention_shape b2 = s;
  b2.batch = 2;
  refused(b2, "shape.batch");
  attention_shape none = s;
  none.sequences = 0;
  refused(none, "shape.sequences");
  // Sequences without offsets size a call for any packing (a plan's shape); running needs them.
  attention_shape null = s;
  null.offsets = nullptr;
  CHECK(attn::can_implement(null).ok);
  CHECK(attn::saved_bytes(null) == attn::saved_bytes(s));
  attention_shape null2 = null;
  null2.batch = 2;
  refused(null2, "shape.batch");
  // Packing does not skip the other checks (a NaN RoPE base is refused packed as unpacked).
  attention_shape nan = s;
  nan.rope_base = std::numeric_limits<double>::quiet_NaN();
  refused(nan, "shape.rope_base");
  // A negative offset is reported as given, not as a wrapped-around size_t.
  offsets = {-5, 3, 7};
  try {
    attn::check(s);
    FAIL("a negative offset was accepted");
  } catch (const membound::invalid_argument& e) {
    CHECK(e.argument() == "shape.offsets");
    CHECK(e.actual() == "-5");
  }
  offsets = {0, 3, 7};
  // Decoding refuses packed sequences by name, before checking them against shape.seq.
  {
    attention_shape d = s;
    d.seq = 1;
    thread_pool one(1);
    const problem q = make_problem(shape_of(1, 1, 16, 2, 1, 8, true), 4);
    aligned_buffer cache_bytes(attn::kv_cache_bytes(shape_of(1, 1, 16, 2, 1, 8, true), 4));
    attn::kv_cache cache = attn::make_kv_cache(shape_of(1, 1, 16, 2, 1, 8, true), cache_bytes.get(), cache_bytes.bytes, 4);
    aligned_buffer sws(attn::step_workspace_bytes(shape_of(1, 1, 16, 2, 1, 8, true), 4, 1));
    std::vector<double> yt(16);
    const attn::weights wq{q.w.wq.data(), q.w.wk.data(), q.w.wv.data(), q.w.wo.data()};
    try {
      attn::step(d, wq, cache, q.x.data(), yt.data(), sws.get(), sws.bytes, one);
      FAIL("decoding took packed sequences");
    } catch (const membound::invalid_argument& e) {
      CHECK(e.argument() == "shape.offsets");
    }
    CHECK(cache.length == 0);
  }
  // A forward with bad offsets throws before writing y.
  offsets = {0, 5, 3};
  const problem p = make_problem(shape_of(1, 7, 16, 2, 1, 8, true), 4);
  thread_pool pool(1);
  std::vector<double> y(7 * 16, 42.0);
  aligned_buffer saved(attn::saved_bytes(s)), ws(attn::forward_workspace_bytes(s, 1));
  const attn::weights w{p.w.wq.data(), p.w.wk.data(), p.w.wv.data(), p.w.wo.data()};
  CHECK_THROWS_AS(attn::forward(s, w, p.x.data(), y.data(), saved.get(), saved.bytes, ws.get(), ws.bytes, pool),
                  membound::invalid_argument);
  try {
    attn::forward(null, w, p.x.data(), y.data(), saved.get(), saved.bytes, ws.get(), ws.bytes, pool);
    FAIL("a forward ran packed sequences without their offsets");
  } catch (const membound::invalid_argument& e) {
    CHECK(e.argument() == "shape.offsets");
  }
  CHECK(std::all_of(y.begin(), y.end(), [](double v) { return v == 42.0; }));
}

// ---- Milestone 3: fp32, bf16, fp16 ----------------------------------------------------------------

// fp32: unit roundoff u = 2^-24 ≈ 6e-8. The longest sums here are C = 32 and T = 37 terms, each
// error bound ~ n·u ≈ 2e-6 worst case and ~ √n·u in practice, and softmax/lse add a few u:
// 1e-5 relative (per tensor) leaves a margin of ~5 over the worst case.
TEST_CASE("attention<> (fp32) matches the reference to 1e-5") {
  const attention_shape shapes[] = {shape_of(2, 37, 32, 4, 2, 16, true),
                                    shape_of(2, 37, 32, 4, 1, 8, false)};
  for (const attention_shape& s : shapes) {
    const problem p = make_problem(s, 7);
    const double e = compare(run_layer<attention<membound::attention_tiles<16, 16>>>(p, 2),
                             run_reference(p), 1e-5);
    MESSAGE("fp32 worst relative error " << e);
  }
}

// bf16/fp16 against fp32 on the same (rounded) inputs: only the layer's own roundings differ.
// Those are one rounding of each stored output (y, dx, the weight gradients, saved O), each
// ≤ u relative, plus the rounded O feeding y (through Wo) and dWo, and dO·O in backward: a
// handful of u-sized terms, so 4u (bf16: u = 2^-8, 4u ≈ 1.6e-2; fp16: u = 2^-11, 4u ≈ 2e-3).
// lse is kept in float for both, so it matches fp32 to float accuracy.
template <typename Prec>
void low_precision_case(double u) {
  using S = typename Prec::storage_type;
  const attention_shape s = shape_of(2, 37, 32, 4, 2, 16, true);
  const problem p = rounded_problem<S>(make_problem(s, 11));
  const outputs want = run_layer<attention<membound::attention_tiles<16, 16>>>(p, 2);
  const outputs got = run_layer<attention<Prec, membound::attention_tiles<16, 16>>>(p, 2);
  const double e = compare(got, want, 4 * u);
  MESSAGE(membound::dtype_name<S>() << " worst relative error vs fp32 " << e << " (u = " << u
                                    << ")");
  CHECK(rel_err(got.lse, want.lse) <= 1e-5);
}

TEST_CASE("attention<bf16_precision> matches fp32 to 4u") {
  low_precision_case<membound::bf16_precision>(0x1.0p-8);
}
TEST_CASE("attention<fp16_precision> matches fp32 to 4u") {
  low_precision_case<membound::fp16_precision>(0x1.0p-11);
}

// ---- Milestone 4: decoding with the KV cache ------------------------------------------------------

TEST_CASE("attention::step reproduces the rows of the causal forward") {
  using attn = attention<membound::fp64_precision>;
  const attention_shape s = shape_of(2, 19, 24, 4, 2, 16, true);
  const problem p = make_problem(s, 5);
  const ref::attention_forward_result f = ref::attention_forward(to_config(s), p.w, p.x);
  thread_pool pool(2);
  const std::size_t B = s.batch, T = s.seq, C = s.d_model;
  const std::size_t max_len = T;
  aligned_buffer cache_bytes(attn::kv_cache_bytes(s, max_len));
  CHECK(cache_bytes.bytes == 2 * B * s.kv_heads * max_len * s.head_dim * sizeof(double));
  attn::kv_cache cache = attn::make_kv_cache(s, cache_bytes.get(), cache_bytes.bytes, max_len);
  aligned_buffer ws(attn::step_workspace_bytes(s, max_len, pool.size()));
  const attn::weights w{p.w.wq.data(), p.w.wk.data(), p.w.wv.data(), p.w.wo.data()};
  std::vector<double> x_t(B * C), y_t(B * C), got(B * T * C);
  for (std::size_t t = 0; t < T; ++t) {
    for (std::size_t b = 0; b < B; ++b)
      std::copy_n(&p.x[(b * T + t) * C], C, &x_t[b * C]);
    attn::step(s, w, cache, x_t.data(), y_t.data(), ws.get(), ws.bytes, pool);
    CHECK(cache.length == t + 1);
    for (std::size_t b = 0; b < B; ++b) std::copy_n(&y_t[b * C], C, &got[(b * T + t) * C]);
  }
  CHECK(rel_err(got, f.y) <= 1e-10);
  // A full cache refuses, and neither it nor y_t changes.
  const std::vector<double> before = y_t;
  CHECK_THROWS_AS(attn::step(s, w, cache, x_t.data(), y_t.data(), ws.get(), ws.bytes, pool),
                  membound::invalid_argument);
  CHECK(cache.length == T);
  CHECK(y_t == before);
  CHECK_THROWS_AS(attn::make_kv_cache(s, cache_bytes.get(), cache_bytes.bytes - 1, max_len),
                  membound::workspace_too_small);
}

// ---- Milestone 5: memory ----------------------------------------------------------------------

// Forward then backward with saved (tag activations) and each workspace (tag workspace) from a
// budget over a caching allocator; the forward workspace is freed before backward's is taken.
// So the peak of requested bytes is exactly saved + max(forward, backward workspace).
namespace {

// One forward+backward with saved and workspace from a budget allocator; returns its peak
// requested bytes after checking it equals the reported sizes.
template <typename attn>
std::size_t measured_peak(const attention_shape& s, thread_pool& pool) {
  using alloc_t = membound::budget_allocator<membound::caching_allocator<membound::system_allocator>>;
  rng r{3};
  const std::size_t HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim, C = s.d_model,
                    N = s.batch * s.seq;
  std::vector<float> wq(C * HD), wk(C * KD), wv(C * KD), wo(HD * C), x(N * C), dy(N * C),
      y(N * C), dx(N * C), gq(C * HD), gk(C * KD), gv(C * KD), go(HD * C);
  for (auto* v : {&wq, &wk, &wv, &wo})
    for (float& e : *v) e = static_cast<float>(r.uniform(-0.2, 0.2));
  for (auto* v : {&x, &dy})
    for (float& e : *v) e = static_cast<float>(r.uniform(-1.0, 1.0));
  const typename attn::weights w{wq.data(), wk.data(), wv.data(), wo.data()};
  alloc_t alloc(std::size_t{1} << 30);
  const std::size_t saved_n = attn::saved_bytes(s);
  const std::size_t fws = attn::forward_workspace_bytes(s, pool.size());
  const std::size_t bws = attn::backward_workspace_bytes(s, pool.size());
  void* saved = alloc.allocate(saved_n, membound::default_alignment, membound::memory_tag::activations);
  void* ws = alloc.allocate(fws, membound::default_alignment, membound::memory_tag::workspace);
  attn::forward(s, w, x.data(), y.data(), saved, saved_n, ws, fws, pool);
  alloc.deallocate(ws, fws, membound::default_alignment, membound::memory_tag::workspace);
  ws = alloc.allocate(bws, membound::default_alignment, membound::memory_tag::workspace);
  attn::backward(s, w, x.data(), saved, saved_n, dy.data(), dx.data(),
                 typename attn::gradients{gq.data(), gk.data(), gv.data(), go.data()}, ws, bws, pool);
  alloc.deallocate(ws, bws, membound::default_alignment, membound::memory_tag::workspace);
  alloc.deallocate(saved, saved_n, membound::default_alignment, membound::memory_tag::activations);
  const membound::memory_stats st = alloc.stats();
  CHECK(st.peak_requested == saved_n + std::max(fws, bws));
  CHECK(std::isfinite(dx[0]));
  MESSAGE("T = " << s.seq << ": peak requested " << st.peak_requested << " B (saved "
                 << saved_n << ", forward ws " << fws << ", backward ws " << bws << ")");
  return st.peak_requested;
}

}  // namespace

TEST_CASE("attention: peak memory is as reported, linear in T, far below T×T") {
  thread_pool pool(2);
  std::size_t peaks[3] = {};
  const std::size_t seqs[3] = {1024, 2048, 4096};
  for (int i = 0; i < 3; ++i)
    peaks[i] = measured_peak<attention<>>(shape_of(1, seqs[i], 64, 8, 8, 64, true), pool);
  // Linear in T: doubling T doubles everything but the per-thread tile and GEMM packing scratch
  // (constant), so the increments double: peak = a + b·T.
  const double inc1 = static_cast<double>(peaks[1] - peaks[0]);
  const double inc2 = static_cast<double>(peaks[2] - peaks[1]);
  CHECK(inc2 / inc1 > 1.99);
  CHECK(inc2 / inc1 < 2.01);
  CHECK(peaks[2] < 2 * peaks[1]);
  // The naive layer keeps P and needs dP in backward: B·H·T² floats each.
  const double T = 4096.0, naive = 1.0 * 8.0 * T * T * 4.0 * 2.0;
  CHECK(static_cast<double>(peaks[2]) <= naive / 10.0);
}

TEST_CASE("attention<save_all> keeps q, k, v: more saved bytes, as reported, same results") {
  using membound::save_all;
  thread_pool pool(2);
  const attention_shape s = shape_of(1, 1024, 64, 8, 2, 64, true);
  measured_peak<attention<save_all>>(s, pool);
  const std::size_t qkv = (1024 * 8 * 64 + 2 * 1024 * 2 * 64) * sizeof(float);
  CHECK(attention<save_all>::saved_bytes(s) == attention<>::saved_bytes(s) + qkv);
  CHECK(attention<save_all>::backward_workspace_bytes(s, 2) <
        attention<>::backward_workspace_bytes(s, 2));
  // Kept q, k, v are the ones backward would recompute, bit for bit.
  using membound::attention_tiles;
  using membound::fp64_precision;
  const problem p = make_problem(shape_of(2, 37, 24, 4, 2, 8, true), 5);
  const outputs kept = run_layer<attention<fp64_precision, save_all, attention_tiles<16, 16>>>(p, 2);
  const outputs again = run_layer<attention<fp64_precision, attention_tiles<16, 16>>>(p, 2);
  compare(kept, again, 0.0);
  compare(kept, run_reference(p), 1e-10);
}

TEST_CASE("attention: backward accumulates weight gradients and writes dx") {
  using attn = attention<membound::fp64_precision, membound::attention_tiles<16, 16>>;
  const attention_shape s = shape_of(1, 21, 16, 4, 2, 8, true);
  const problem p = make_problem(s, 9);
  thread_pool pool(2);
  const attn::weights w{p.w.wq.data(), p.w.wk.data(), p.w.wv.data(), p.w.wo.data()};
  std::vector<double> y(p.x.size()), dx(p.x.size(), 7.0);
  std::vector<double> gq(p.w.wq.size()), gk(p.w.wk.size()), gv(p.w.wv.size()), go(p.w.wo.size());
  aligned_buffer saved(attn::saved_bytes(s));
  aligned_buffer ws(std::max(attn::forward_workspace_bytes(s, 2), attn::backward_workspace_bytes(s, 2)));
  attn::forward(s, w, p.x.data(), y.data(), saved.get(), saved.bytes, ws.get(), ws.bytes, pool);
  const attn::gradients g{gq.data(), gk.data(), gv.data(), go.data()};
  attn::backward(s, w, p.x.data(), saved.get(), saved.bytes, p.dy.data(), dx.data(), g, ws.get(),
                 ws.bytes, pool);
  const std::vector<double> dx1 = dx, gq1 = gq, go1 = go;
  attn::backward(s, w, p.x.data(), saved.get(), saved.bytes, p.dy.data(), dx.data(), g, ws.get(),
                 ws.bytes, pool);
  CHECK(dx == dx1);  // written, not accumulated
  std::vector<double> twice_q(gq1.size()), twice_o(go1.size());
  for (std::size_t i = 0; i < gq1.size(); ++i) twice_q[i] = 2.0 * gq1[i];
  for (std::size_t i = 0; i < go1.size(); ++i) twice_o[i] = 2.0 * go1[i];
  CHECK(rel_err(gq, twice_q) <= 1e-14);
  CHECK(rel_err(go, twice_o) <= 1e-14);
  // Decoding is causal only: a bidirectional shape is refused by name.
  attention_shape bidir = s;
  bidir.causal = false;
  aligned_buffer cache_bytes(attn::kv_cache_bytes(s, 4));
  attn::kv_cache cache = attn::make_kv_cache(s, cache_bytes.get(), cache_bytes.bytes, 4);
  try {
    attn::step(bidir, w, cache, p.x.data(), y.data(), ws.get(), ws.bytes, pool);
    FAIL("no throw");
  } catch (const membound::invalid_argument& e) {
    CHECK(e.argument() == "shape.causal");
  }
  CHECK(cache.length == 0);
}

TEST_CASE("attention<bf16_precision>::step follows the bf16 forward") {
  using attn = attention<membound::bf16_precision, membound::attention_tiles<8, 8>>;
  using membound::bf16;
  const attention_shape s = shape_of(1, 9, 16, 2, 1, 16, true);
  const problem p = make_problem(s, 13);
  thread_pool pool(2);
  const auto wq = to_storage<bf16>(p.w.wq), wk = to_storage<bf16>(p.w.wk),
             wv = to_storage<bf16>(p.w.wv), wo = to_storage<bf16>(p.w.wo);
  const auto x = to_storage<bf16>(p.x);
  const typename attn::weights w{wq.data(), wk.data(), wv.data(), wo.data()};
  std::vector<bf16> y(x.size()), y_steps(x.size());
  aligned_buffer saved(attn::saved_bytes(s));
  aligned_buffer ws(attn::forward_workspace_bytes(s, 2));
  attn::forward(s, w, x.data(), y.data(), saved.get(), saved.bytes, ws.get(), ws.bytes, pool);
  aligned_buffer cache_bytes(attn::kv_cache_bytes(s, s.seq));
  attn::kv_cache cache = attn::make_kv_cache(s, cache_bytes.get(), cache_bytes.bytes, s.seq);
  aligned_buffer sws(attn::step_workspace_bytes(s, s.seq, 2));
  for (std::size_t t = 0; t < s.seq; ++t)
    attn::step(s, w, cache, &x[t * s.d_model], &y_steps[t * s.d_model], sws.get(), sws.bytes,
               pool);
  // The cache holds bf16 keys and values (one rounding each), the forward float ones, and O is
  // rounded only by the forward: a few u apart (u = 2^-8).
  CHECK(rel_err(to_double(y_steps.data(), y_steps.size()), to_double(y.data(), y.size())) <=
        4 * 0x1.0p-8);
}
