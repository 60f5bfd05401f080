// The Mamba block against the naive double reference (tests/support/mamba_reference.hpp, itself
// checked by finite differences and against PyTorch): fp64 to 1e-10 for the output and every
// gradient, thread-count independence, the recompute policies agreeing bit for bit, fp32 and
// bf16/fp16 to stated tolerances, stepping against the full forward, the memory taken from an
// allocator (saved state bytes shrinking with the chunk), and typed errors for bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include "../support/layer_test_util.hpp"
#include "../support/mamba_reference.hpp"
#include "../support/test_rng.hpp"
#include "membound/membound.hpp"

namespace ref = membound::reference;
using membound::mamba;
using membound::mamba_shape;
using membound::thread_pool;
using membound_test::aligned_buffer;
using membound_test::rel_err;
using membound_test::rng;
using membound_test::rounded;
using membound_test::to_double;
using membound_test::to_storage;

namespace {

constexpr mamba_shape shape_of(std::size_t B, std::size_t T, std::size_t C, std::size_t Di, std::size_t Ns,
                     std::size_t K, std::size_t R) {
  mamba_shape s;
  s.batch = B;
  s.seq = T;
  s.d_model = C;
  s.d_inner = Di;
  s.d_state = Ns;
  s.d_conv = K;
  s.dt_rank = R;
  return s;
}

ref::mamba_config to_config(const mamba_shape& s) {
  return ref::mamba_config{s.batch, s.seq, s.d_model, s.d_inner, s.d_state, s.d_conv, s.dt_rank};
}

struct problem {
  mamba_shape shape;
  ref::mamba_weights w;
  std::vector<double> x, dy;
};

// mamba_init, then x_proj scaled up and Δ drawn from [0.05, 1] so that every gradient is well
// away from zero (the reference's tests do the same), with a perturbed A_log and D.
problem make_problem(const mamba_shape& s, std::uint64_t seed) {
  rng r{seed};
  problem p;
  p.shape = s;
  p.w = ref::mamba_init(to_config(s), r, 0.05, 1.0);
  for (double& v : p.w.x_proj) v *= 3.0;
  for (double& v : p.w.a_log) v += r.uniform(-0.3, 0.3);
  for (double& v : p.w.d) v += r.uniform(-0.5, 0.5);
  p.x = r.fill(s.batch * s.seq * s.d_model, 1.0);
  p.dy = r.fill(s.batch * s.seq * s.d_model, 1.0);
  return p;
}

template <typename S>
problem rounded_problem(problem p) {
  for (auto* v : {&p.w.in_proj, &p.w.conv_w, &p.w.conv_b, &p.w.x_proj, &p.w.dt_proj, &p.w.dt_bias,
                  &p.w.a_log, &p.w.d, &p.w.out_proj, &p.x, &p.dy})
    *v = rounded<S>(*v);
  return p;
}

struct outputs {
  std::vector<double> out, dx, in_proj, conv_w, conv_b, x_proj, dt_proj, dt_bias, a_log, d,
      out_proj;
};
constexpr int n_outputs = 11;
const char* const output_names[n_outputs] = {"out",     "dx",      "d_in_proj", "d_conv_w",
                                             "d_conv_b", "d_x_proj", "d_dt_proj", "d_dt_bias",
                                             "d_a_log", "d_d",     "d_out_proj"};
std::vector<const std::vector<double>*> fields(const outputs& o) {
  return {&o.out,     &o.dx,      &o.in_proj, &o.conv_w, &o.conv_b,  &o.x_proj,
          &o.dt_proj, &o.dt_bias, &o.a_log,   &o.d,      &o.out_proj};
}

// The largest per-tensor relative error; CHECKs each against tol.
double compare(const outputs& a, const outputs& b, double tol) {
  const auto fa = fields(a), fb = fields(b);
  double worst = 0.0;
  for (int i = 0; i < n_outputs; ++i) {
    const double e = rel_err(*fa[static_cast<std::size_t>(i)], *fb[static_cast<std::size_t>(i)]);
    INFO(output_names[i] << " relative error " << e);
    CHECK(e <= tol);
    worst = std::max(worst, e);
  }
  return worst;
}

template <typename S>
struct storage_weights {
  std::vector<S> in_proj, conv_w, conv_b, x_proj, dt_proj, dt_bias, a_log, d, out_proj;
  explicit storage_weights(const ref::mamba_weights& w)
      : in_proj(to_storage<S>(w.in_proj)), conv_w(to_storage<S>(w.conv_w)),
        conv_b(to_storage<S>(w.conv_b)), x_proj(to_storage<S>(w.x_proj)),
        dt_proj(to_storage<S>(w.dt_proj)), dt_bias(to_storage<S>(w.dt_bias)),
        a_log(to_storage<S>(w.a_log)), d(to_storage<S>(w.d)), out_proj(to_storage<S>(w.out_proj)) {}
  template <typename Block>
  typename Block::weights view() const {
    return {in_proj.data(), conv_w.data(), conv_b.data(), x_proj.data(), dt_proj.data(),
            dt_bias.data(), a_log.data(),  d.data(),      out_proj.data()};
  }
};

template <typename S>
struct storage_grads {
  std::vector<S> in_proj, conv_w, conv_b, x_proj, dt_proj, dt_bias, a_log, d, out_proj;
  explicit storage_grads(const ref::mamba_weights& w)
      : in_proj(w.in_proj.size(), S(0.0f)), conv_w(w.conv_w.size(), S(0.0f)),
        conv_b(w.conv_b.size(), S(0.0f)), x_proj(w.x_proj.size(), S(0.0f)),
        dt_proj(w.dt_proj.size(), S(0.0f)), dt_bias(w.dt_bias.size(), S(0.0f)),
        a_log(w.a_log.size(), S(0.0f)), d(w.d.size(), S(0.0f)), out_proj(w.out_proj.size(), S(0.0f)) {}
  template <typename Block>
  typename Block::gradients view() {
    return {in_proj.data(), conv_w.data(), conv_b.data(), x_proj.data(), dt_proj.data(),
            dt_bias.data(), a_log.data(),  d.data(),      out_proj.data()};
  }
};

template <typename Block>
outputs run_block(const problem& p, std::size_t threads) {
  using S = typename Block::storage_type;
  const mamba_shape& s = p.shape;
  thread_pool pool(threads);
  const storage_weights<S> w(p.w);
  storage_grads<S> g(p.w);
  const std::vector<S> x = to_storage<S>(p.x), dy = to_storage<S>(p.dy);
  std::vector<S> out(x.size()), dx(x.size());
  aligned_buffer saved(Block::saved_bytes(s));
  {
    aligned_buffer ws(Block::forward_workspace_bytes(s, pool.size()));
    Block::forward(s, w.template view<Block>(), x.data(), out.data(), saved.get(), saved.bytes,
                   ws.get(), ws.bytes, pool);
  }
  {
    aligned_buffer ws(Block::backward_workspace_bytes(s, pool.size()));
    Block::backward(s, w.template view<Block>(), x.data(), saved.get(), saved.bytes, dy.data(),
                    dx.data(), g.template view<Block>(), ws.get(), ws.bytes, pool);
  }
  const auto d = [](const std::vector<S>& v) { return to_double(v.data(), v.size()); };
  return outputs{d(out),       d(dx),      d(g.in_proj), d(g.conv_w), d(g.conv_b), d(g.x_proj),
                 d(g.dt_proj), d(g.dt_bias), d(g.a_log),  d(g.d),      d(g.out_proj)};
}

outputs run_reference(const problem& p) {
  const ref::mamba_config c = to_config(p.shape);
  const ref::mamba_forward_result f = ref::mamba_forward(c, p.w, p.x);
  const ref::mamba_grads g = ref::mamba_backward(c, p.w, p.x, f, p.dy);
  return outputs{f.out,       g.dx,        g.d_in_proj, g.d_conv_w, g.d_conv_b, g.d_x_proj,
                 g.d_dt_proj, g.d_dt_bias, g.d_a_log,   g.d_d,      g.d_out_proj};
}

struct fp64_case {
  const char* name;
  mamba_shape shape;
};

template <typename Block>
void fp64_cases(const std::vector<fp64_case>& cases) {
  for (const fp64_case& c : cases) {
    INFO(c.name);
    const problem p = make_problem(c.shape, 42);
    const outputs want = run_reference(p);
    const outputs one = run_block<Block>(p, 1);
    MESSAGE(std::string(c.name) << ": worst relative error " << compare(one, want, 1e-10));
    // Identical, not merely close: the scan's tasks are a fixed partition of the channels.
    compare(run_block<Block>(p, 2), one, 0.0);
    compare(run_block<Block>(p, 3), one, 0.0);
  }
}

}  // namespace

// Packed sequences against each sequence run alone through the float64 reference: out and dx row
// for row, the weight gradients as the sum over sequences. Scan chunks of 8 so that sequences
// start inside chunks, on their borders, and span several; lengths 1 (shorter than the
// convolution), K − 1, K, an empty one, a long one among short ones; the same bits on 1, 2, 3
// threads; save_all as recompute.
TEST_CASE("mamba: packed sequences equal each sequence run alone") {
  using block = mamba<membound::fp64_precision, membound::scan_chunk<8>>;
  const std::vector<std::size_t> lengths = {1, 3, 4, 8, 0, 29, 2, 9};
  std::vector<std::int32_t> offsets{0};
  for (const std::size_t n : lengths) offsets.push_back(offsets.back() + static_cast<std::int32_t>(n));
  const auto N = static_cast<std::size_t>(offsets.back());
  mamba_shape s = shape_of(1, N, 8, 16, 4, 4, 2);
  s.offsets = offsets.data();
  s.sequences = lengths.size();
  REQUIRE(block::can_implement(s).ok);
  const problem p = make_problem(s, 17);
  const outputs got = run_block<block>(p, 2);
  compare(run_block<block>(p, 1), got, 0.0);
  compare(run_block<block>(p, 3), got, 0.0);
  compare(run_block<mamba<membound::fp64_precision, membound::scan_chunk<8>, membound::save_all>>(p, 2), got, 0.0);

  const std::size_t C = s.d_model;
  outputs want = run_reference(make_problem(shape_of(1, 1, 8, 16, 4, 4, 2), 17));  // shapes only
  for (auto* v : fields(want)) std::fill(const_cast<std::vector<double>*>(v)->begin(), const_cast<std::vector<double>*>(v)->end(), 0.0);
  want.out.assign(N * C, 0.0);
  want.dx.assign(N * C, 0.0);
  for (std::size_t q = 0; q < lengths.size(); ++q) {
    const std::size_t T = lengths[q], o = static_cast<std::size_t>(offsets[q]);
    if (T == 0) continue;
    problem one = p;
    one.shape = shape_of(1, T, 8, 16, 4, 4, 2);
    one.x.assign(p.x.begin() + o * C, p.x.begin() + (o + T) * C);
    one.dy.assign(p.dy.begin() + o * C, p.dy.begin() + (o + T) * C);
    const outputs alone = run_reference(one);
    std::copy(alone.out.begin(), alone.out.end(), want.out.begin() + o * C);
    std::copy(alone.dx.begin(), alone.dx.end(), want.dx.begin() + o * C);
    const auto fa = fields(alone), fw = fields(want);
    for (std::size_t f = 2; f < fa.size(); ++f) {
      auto& to = *const_cast<std::vector<double>*>(fw[f]);
      for (std::size_t e = 0; e < to.size(); ++e) to[e] += (*fa[f])[e];
    }
  }
  MESSAGE("packed Mamba: worst relative error " << compare(got, want, 1e-10));
}

// Offsets that do not describe the token axis are refused naming the field; decoding refuses
// packed sequences (a state is one sequence's).
TEST_CASE("mamba: bad packed offsets get a typed error") {
  using block = mamba<>;
  std::vector<std::int32_t> offsets{0, 3, 7};
  mamba_shape s = shape_of(1, 7, 8, 16, 4, 4, 1);
  s.offsets = offsets.data();
  s.sequences = 2;
  CHECK(block::can_implement(s).ok);
  offsets = {0, 3, 8};
  CHECK(std::string(block::can_implement(s).argument) == "shape.offsets");
  offsets = {0, 4, 3};
  CHECK(std::string(block::can_implement(s).argument) == "shape.offsets");
  offsets = {0, 3, 7};
  mamba_shape b2 = s;
  b2.batch = 2;
  CHECK(std::string(block::can_implement(b2).argument) == "shape.batch");
  CHECK_THROWS_AS(block::check(b2), membound::invalid_argument);
  // Sequences without offsets size a call for any packing (a plan's shape): the same bytes.
  mamba_shape sizing = s;
  sizing.offsets = nullptr;
  CHECK(block::can_implement(sizing).ok);
  CHECK(block::saved_bytes(sizing) == block::saved_bytes(s));
  CHECK(block::backward_workspace_bytes(sizing, 2) == block::backward_workspace_bytes(s, 2));
  CHECK(block::backward_workspace_bytes(sizing, 2) > block::backward_workspace_bytes(shape_of(1, 7, 8, 16, 4, 4, 1), 2));
}

TEST_CASE("mamba: can_implement and check name the argument at fault") {
  using block = mamba<>;
  const mamba_shape good = shape_of(1, 8, 8, 16, 4, 4, 1);
  CHECK(block::can_implement(good));
  const auto refused = [&](mamba_shape s, const char* argument) {
    INFO(argument);
    const membound::layer_support r = block::can_implement(s);
    CHECK_FALSE(r);
    CHECK(std::string(r.argument) == argument);
    try {
      block::check(s);
      FAIL("no throw");
    } catch (const membound::invalid_argument& e) {
      CHECK(e.argument() == argument);
    }
  };
  mamba_shape s = good;
  s.batch = 0;
  refused(s, "shape.batch");
  s = good;
  s.seq = 0;
  refused(s, "shape.seq");
  s = good;
  s.d_inner = 0;
  refused(s, "shape.d_inner");
  s = good;
  s.d_state = 0;
  refused(s, "shape.d_state");
  s = good;
  s.d_state = 257;
  refused(s, "shape.d_state");
  s = good;
  s.d_conv = 0;
  refused(s, "shape.d_conv");
  s = good;
  s.dt_rank = 0;
  refused(s, "shape.dt_rank");
  const mamba_shape d = mamba_shape::defaults(2, 100, 768);
  CHECK(d.d_inner == 1536);
  CHECK(d.dt_rank == 48);
  CHECK(d.d_state == 16);
  CHECK(d.d_conv == 4);
}

TEST_CASE("mamba: sizes are constexpr, and saved state bytes follow the chunk") {
  constexpr mamba_shape s = shape_of(2, 1000, 64, 128, 16, 4, 4);
  using c64 = mamba<membound::scan_chunk<64>>;
  using c256 = mamba<membound::scan_chunk<256>>;
  static_assert(c64::saved_bytes(s) > 0 && c64::forward_workspace_bytes(s, 2) > 0 &&
                c64::backward_workspace_bytes(s, 2) > 0 && c64::state_bytes(s) > 0);
  // The state entering each chunk but the first: B · (ceil(T / L) − 1) · Di · Ns floats.
  CHECK(c64::saved_state_bytes(s) == 2 * (16 - 1) * 128 * 16 * sizeof(float));
  CHECK(c256::saved_state_bytes(s) == 2 * (4 - 1) * 128 * 16 * sizeof(float));
  CHECK(c64::saved_bytes(s) - c256::saved_bytes(s) ==
        c64::saved_state_bytes(s) - c256::saved_state_bytes(s));
  // save_all keeps the conv output and Δ too: 2 · B · T · Di storage elements.
  using kept = mamba<membound::scan_chunk<64>, membound::save_all>;
  CHECK(kept::saved_bytes(s) - c64::saved_bytes(s) == 2 * 2 * 1000 * 128 * sizeof(float));
  // The decoding state is constant in T.
  mamba_shape longer = s;
  longer.seq = 100000;
  CHECK(c64::state_bytes(longer) == c64::state_bytes(s));
  CHECK(c64::state_bytes(s) == 2 * 128 * (3 + 16) * sizeof(float));
}

TEST_CASE("mamba<fp64_precision> matches the reference to 1e-10") {
  using membound::fp64_precision;
  using membound::scan_chunk;
  // Di = 70: two scan blocks, the second partial. Chunk 8 against T = 37: a partial last chunk.
  fp64_cases<mamba<fp64_precision, scan_chunk<8>>>({
      {"B2 T37 C12 Di70 Ns5 K4 R3", shape_of(2, 37, 12, 70, 5, 4, 3)},
      {"T1", shape_of(2, 1, 8, 16, 4, 4, 1)},
      {"T = chunk", shape_of(1, 8, 8, 16, 4, 4, 2)},
      {"K1 Ns1", shape_of(1, 19, 6, 12, 1, 1, 1)},
      {"K3 T2 (shorter than the window)", shape_of(2, 2, 6, 12, 3, 3, 2)},
  });
  fp64_cases<mamba<fp64_precision, scan_chunk<1>>>({
      {"chunk 1 (every state kept)", shape_of(1, 13, 8, 16, 4, 4, 1)},
  });
  fp64_cases<mamba<fp64_precision, scan_chunk<64>>>({
      {"chunk > T, defaults C16", mamba_shape::defaults(2, 21, 16)},
  });
  fp64_cases<mamba<fp64_precision, scan_chunk<8>, membound::save_all>>({
      {"save_all B2 T37", shape_of(2, 37, 12, 70, 5, 4, 3)},
  });
}

TEST_CASE("mamba: save_all and recompute give identical results") {
  using membound::save_all;
  using membound::scan_chunk;
  const problem p = make_problem(shape_of(2, 29, 10, 24, 6, 4, 2), 7);
  compare(run_block<mamba<membound::fp64_precision, scan_chunk<8>, save_all>>(p, 2),
          run_block<mamba<membound::fp64_precision, scan_chunk<8>>>(p, 2), 0.0);
  compare(run_block<mamba<scan_chunk<8>, save_all>>(p, 2), run_block<mamba<scan_chunk<8>>>(p, 2),
          0.0);
  // bf16: kept values are rounded once and used as stored, so recomputing them matches too.
  compare(run_block<mamba<membound::bf16_precision, scan_chunk<8>, save_all>>(p, 2),
          run_block<mamba<membound::bf16_precision, scan_chunk<8>>>(p, 2), 0.0);
}

// fp32: unit roundoff u = 2^-24 ≈ 6e-8. The longest sums are the weight gradients' B·T = 74
// terms and in_proj's C = 12; the scan multiplies up to T = 37 decays and sums Ns = 5 terms per
// step. Worst-case bounds are ~n·u ≈ 5e-6; 2e-5 relative per tensor leaves a margin of ~4.
TEST_CASE("mamba<> (fp32) matches the reference to 2e-5") {
  const problem p = rounded_problem<float>(make_problem(shape_of(2, 37, 12, 70, 5, 4, 3), 11));
  MESSAGE("fp32 worst relative error "
          << compare(run_block<mamba<membound::scan_chunk<8>>>(p, 2), run_reference(p), 2e-5));
}

// bf16/fp16 store xz, the conv output, x_dbl and Δ (and the output and gradients) in 8 or 11
// mantissa bits, with u = 2^-8 or 2^-11; everything is computed in fp32 between the roundings.
// Compared with fp32 on the same (rounded) inputs, each tensor carries a handful of such
// roundings propagated through the block: we allow 16u (6.3e-2 bf16, 7.8e-3 fp16) relative.
template <typename P>
void low_precision_case(double u) {
  using S = typename P::storage_type;
  const problem p = rounded_problem<S>(make_problem(shape_of(2, 37, 12, 70, 5, 4, 3), 13));
  const outputs want = run_block<mamba<membound::scan_chunk<8>>>(p, 2);
  MESSAGE("worst relative error against fp32: "
          << compare(run_block<mamba<P, membound::scan_chunk<8>>>(p, 2), want, 16.0 * u));
}
TEST_CASE("mamba<bf16_precision> matches fp32 to 16u") {
  low_precision_case<membound::bf16_precision>(0x1.0p-8);
}
TEST_CASE("mamba<fp16_precision> matches fp32 to 16u") {
  low_precision_case<membound::fp16_precision>(0x1.0p-11);
}

namespace {

// Steps through the problem's sequence one token at a time: out [B, T, C].
template <typename Block>
std::vector<double> stepped(const problem& p) {
  using S = typename Block::storage_type;
  const mamba_shape& s = p.shape;
  thread_pool pool(2);
  const storage_weights<S> w(p.w);
  aligned_buffer state_bytes(Block::state_bytes(s)), ws(Block::step_workspace_bytes(s));
  typename Block::state st = Block::make_state(s, state_bytes.get(), state_bytes.bytes);
  const std::size_t B = s.batch, T = s.seq, C = s.d_model;
  std::vector<double> out(B * T * C);
  std::vector<S> xt(B * C), yt(B * C);
  for (std::size_t t = 0; t < T; ++t) {
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t c = 0; c < C; ++c)
        xt[b * C + c] = membound::from_accum<S>(p.x[(b * T + t) * C + c]);
    Block::step(s, w.template view<Block>(), st, xt.data(), yt.data(), ws.get(), ws.bytes, pool);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t c = 0; c < C; ++c)
        out[(b * T + t) * C + c] = membound::to_accum<double>(yt[b * C + c]);
  }
  CHECK(st.position == T);
  return out;
}

}  // namespace

TEST_CASE("mamba::step reproduces the full forward, token by token") {
  const problem p = make_problem(shape_of(2, 23, 12, 70, 5, 4, 3), 17);
  // fp64: the same operations in the same order but for the GEMMs' blocking over B rows
  // instead of B·T: agreement to a few ulps.
  CHECK(rel_err(stepped<mamba<membound::fp64_precision>>(p), run_reference(p).out) <= 1e-12);
  // bf16: forward and step round the same stored values; the GEMMs' blocking may differ by an
  // fp32 ulp before the final bf16 rounding, so allow 2 bf16 ulps.
  const problem q = rounded_problem<membound::bf16>(p);
  const outputs full = run_block<mamba<membound::bf16_precision>>(q, 2);
  CHECK(rel_err(stepped<mamba<membound::bf16_precision>>(q), full.out) <= 2.0 * 0x1.0p-8);
  // 300 sequences: the projections run as two 256-row tasks, each with its own packing buffers.
  const problem wide = make_problem(shape_of(300, 3, 12, 70, 5, 4, 3), 19);
  CHECK(rel_err(stepped<mamba<membound::fp64_precision>>(wide), run_reference(wide).out) <= 1e-12);
}

TEST_CASE("mamba: peak memory is as reported; saved state bytes shrink with the chunk") {
  using alloc_t = membound::budget_allocator<membound::caching_allocator<membound::system_allocator>>;
  const auto measure = [](auto tag, const mamba_shape& s) {
    using Block = typename decltype(tag)::type;
    thread_pool pool(2);
    const problem p = make_problem(s, 3);
    const storage_weights<float> w(p.w);
    storage_grads<float> g(p.w);
    const std::vector<float> x = to_storage<float>(p.x), dy = to_storage<float>(p.dy);
    std::vector<float> out(x.size()), dx(x.size());
    alloc_t alloc(std::size_t{1} << 30);
    const std::size_t sn = Block::saved_bytes(s), fws = Block::forward_workspace_bytes(s, 2),
                      bws = Block::backward_workspace_bytes(s, 2);
    const auto act = membound::memory_tag::activations, wst = membound::memory_tag::workspace;
    void* saved = alloc.allocate(sn, membound::default_alignment, act);
    void* ws = alloc.allocate(fws, membound::default_alignment, wst);
    Block::forward(s, w.template view<Block>(), x.data(), out.data(), saved, sn, ws, fws, pool);
    alloc.deallocate(ws, fws, membound::default_alignment, wst);
    const std::size_t after_forward = alloc.stats().requested;
    ws = alloc.allocate(bws, membound::default_alignment, wst);
    Block::backward(s, w.template view<Block>(), x.data(), saved, sn, dy.data(), dx.data(),
                    g.template view<Block>(), ws, bws, pool);
    alloc.deallocate(ws, bws, membound::default_alignment, wst);
    alloc.deallocate(saved, sn, membound::default_alignment, act);
    const membound::memory_stats st = alloc.stats();
    CHECK(st.peak_requested == sn + std::max(fws, bws));
    CHECK(after_forward == sn);
    CHECK(std::isfinite(dx[0]));
    MESSAGE("chunk " << Block::chunk << ": saved " << sn << " B (states "
                     << Block::saved_state_bytes(s) << "), forward ws " << fws
                     << ", backward ws " << bws);
    return sn;
  };
  const mamba_shape s = shape_of(1, 1024, 64, 128, 16, 4, 4);
  const std::size_t s64 = measure(std::type_identity<mamba<membound::scan_chunk<64>>>{}, s);
  const std::size_t s256 = measure(std::type_identity<mamba<membound::scan_chunk<256>>>{}, s);
  const std::size_t s1024 = measure(std::type_identity<mamba<membound::scan_chunk<1024>>>{}, s);
  // States: (T/L − 1) · Di · Ns · 4 bytes = 15, 3 and 0 blocks of 8 KiB.
  CHECK(s64 - s256 == (15 - 3) * 128 * 16 * 4);
  CHECK(s256 - s1024 == 3 * 128 * 16 * 4);
}

TEST_CASE("mamba: bad input is refused by name and writes nothing") {
  using block = mamba<membound::fp64_precision, membound::scan_chunk<8>>;
  const problem p = make_problem(shape_of(1, 9, 8, 16, 4, 4, 2), 5);
  const mamba_shape& s = p.shape;
  thread_pool pool(2);
  const storage_weights<double> w(p.w);
  std::vector<double> out(p.x.size(), 7.0);
  aligned_buffer saved(block::saved_bytes(s)), ws(block::forward_workspace_bytes(s, 2));
  const auto refused = [&](auto&& call, const char* argument) {
    INFO(argument);
    try {
      call();
      FAIL("no throw");
    } catch (const membound::invalid_argument& e) {
      CHECK(e.argument() == argument);
    }
    CHECK(std::all_of(out.begin(), out.end(), [](double v) { return v == 7.0; }));
  };
  refused([&] { block::forward(s, w.view<block>(), p.x.data(), out.data(), saved.get(),
                               saved.bytes, ws.get(), ws.bytes - 1, pool); },
          "workspace");
  refused([&] { block::forward(s, w.view<block>(), p.x.data(), out.data(), saved.get(),
                               saved.bytes - 8, ws.get(), ws.bytes, pool); },
          "saved");
  refused([&] { block::forward(s, w.view<block>(), p.x.data(), out.data(), nullptr, 0, ws.get(),
                               ws.bytes, pool); },
          "saved");
  auto bad_w = w.view<block>();
  bad_w.a_log = nullptr;
  refused([&] { block::forward(s, bad_w, p.x.data(), out.data(), saved.get(), saved.bytes,
                               ws.get(), ws.bytes, pool); },
          "weights.a_log");
  mamba_shape bad = s;
  bad.d_state = 0;
  refused([&] { block::forward(bad, w.view<block>(), p.x.data(), out.data(), saved.get(),
                               saved.bytes, ws.get(), ws.bytes, pool); },
          "shape.d_state");
  // Decoding: a state too small is refused before anything is touched.
  aligned_buffer st_bytes(block::state_bytes(s)), st_ws(block::step_workspace_bytes(s));
  block::state st = block::make_state(s, st_bytes.get(), st_bytes.bytes);
  block::state small = st;
  small.bytes -= 8;
  refused([&] { block::step(s, w.view<block>(), small, p.x.data(), out.data(), st_ws.get(),
                            st_ws.bytes, pool); },
          "state");
  refused([&] { block::step(s, w.view<block>(), st, p.x.data(), out.data(), st_ws.get(),
                            st_ws.bytes / 2, pool); },
          "workspace");
  CHECK(st.position == 0);
}
