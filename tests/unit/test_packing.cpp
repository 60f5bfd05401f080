// Packed variable-length training (train/token_packing.hpp, the trainer's packed rows, fit_tokens):
//   - token_packing puts every token of every sample (of at least 2 tokens) in exactly one row, in
//     order within its pieces, rows of at most seq tokens and `sequences` pieces, cutting only
//     samples longer than a row; write() gives offsets a layer accepts, next-token targets inside
//     each sample, ignore_target at each sample's end and on the padding;
//   - a trainer over packed rows runs within its plan, learns, resumes bit for bit, and refuses a
//     source of the other kind by name;
//   - fit_tokens finds the most tokens per row that fit, as a scan over every row length does.
#include <doctest/doctest.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wfree-nonheap-object"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "membound/memory/budget.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/model/planner.hpp"
#include "membound/train/token_packing.hpp"
#include "membound/train/trainer.hpp"

#include "../support/small_models.hpp"

namespace mb = membound;

namespace {

// Samples of lengths 0 to 3·seq from a fixed generator, each a learnable phrase with some noise.
std::vector<std::vector<std::int32_t>> make_samples(std::size_t n, std::size_t max_len, std::size_t vocab,
                                                    std::uint32_t seed) {
  std::vector<std::vector<std::int32_t>> v(n);
  std::uint32_t s = seed;
  for (auto& sample : v) {
    s = s * 1664525u + 1013904223u;
    const std::size_t len = (s >> 8) % (max_len + 1);
    const std::size_t start = (s >> 4) % vocab;
    for (std::size_t i = 0; i < len; ++i) {
      s = s * 1664525u + 1013904223u;
      const bool noise = (s >> 24) % 10 == 0;
      sample.push_back(static_cast<std::int32_t>(noise ? (s >> 8) % vocab : (start + i * 7 + i / 5) % vocab));
    }
  }
  return v;
}

std::vector<std::size_t> lengths_of(const std::vector<std::vector<std::int32_t>>& samples) {
  std::vector<std::size_t> l;
  for (const auto& s : samples) l.push_back(s.size());
  return l;
}

// A packed_source over a packing: row = the request's random bits modulo the rows (as the example
// trainer's windows draw their starts).
struct packed_rows {
  const mb::token_packing* pack;
  const std::vector<std::vector<std::int32_t>>* samples;
  void operator()(const mb::sequence_request& r, const mb::packed_row& row) const {
    pack->write(r.random % pack->rows(), [&](std::size_t i) { return std::span<const std::int32_t>((*samples)[i]); },
                row);
  }
};

}  // namespace

TEST_CASE("token_packing: every token once, rows within their budget, offsets and targets as a layer takes them") {
  const auto samples = make_samples(300, 90, 40, 11);
  for (const std::size_t S : {std::size_t{1}, std::size_t{3}, std::size_t{16}}) {
    CAPTURE(S);
    const mb::token_packing pack(lengths_of(samples), 32, S);
    std::vector<std::vector<int>> seen(samples.size());
    for (std::size_t i = 0; i < samples.size(); ++i) seen[i].assign(samples[i].size(), 0);
    std::size_t tokens = 0;
    std::vector<std::int32_t> x(32), y(32), offsets(S + 1);
    for (std::size_t r = 0; r < pack.rows(); ++r) {
      std::size_t used = 0;
      CHECK(pack.row(r).size() <= S);
      for (const mb::token_piece& p : pack.row(r)) {
        CHECK(p.length >= 1);
        CHECK(p.length <= 32);
        // Only a sample longer than a row is cut, at multiples of the row.
        CHECK(p.begin % 32 == 0);
        CHECK((p.length == 32 || p.begin + p.length == samples[p.sample].size()));
        for (std::size_t j = 0; j < p.length; ++j) ++seen[p.sample][p.begin + j];
        used += p.length;
      }
      CHECK(used <= 32);
      tokens += used;
      pack.write(r, [&](std::size_t i) { return std::span<const std::int32_t>(samples[i]); },
                 mb::packed_row{x.data(), y.data(), offsets.data(), 32, S});
      REQUIRE(mb::check_packing(offsets.data(), S, 1, 32).ok);
      // Each piece's tokens and targets: the sample's ids and their successors, ignore at its end.
      std::size_t t = 0;
      for (const mb::token_piece& p : pack.row(r)) {
        const auto& smp = samples[p.sample];
        for (std::size_t j = 0; j < p.length; ++j, ++t) {
          CHECK(x[t] == smp[p.begin + j]);
          CHECK(y[t] == (p.begin + j + 1 < smp.size() ? smp[p.begin + j + 1] : mb::ignore_target));
        }
      }
      for (; t < 32; ++t) CHECK(y[t] == mb::ignore_target);  // padding
    }
    for (std::size_t i = 0; i < samples.size(); ++i) {
      for (const int c : seen[i]) CHECK(c == (samples[i].size() >= 2 ? 1 : 0));  // shorter: no target, left out
    }
    CHECK(tokens == pack.tokens());
    CHECK(pack.padding() == pack.rows() * 32 - tokens);
    CHECK(pack.rows() >= (tokens + 31) / 32);
    MESSAGE("packing 300 samples of 0..90 tokens into rows of 32, at most " << S << " per row: " << pack.rows()
                                                                            << " rows, efficiency " << pack.efficiency());
    if (S == 16) CHECK(pack.efficiency() > 0.97);  // best fit leaves little room with enough slots
  }
  // Bad arguments, by name.
  const std::vector<std::size_t> l{3, 4};
  CHECK_THROWS_AS(mb::token_packing(l, 1, 2), mb::invalid_argument);
  CHECK_THROWS_AS(mb::token_packing(l, 8, 0), mb::invalid_argument);
  const mb::token_packing p(l, 8, 2);
  std::vector<std::int32_t> x(8), y(8), o(3);
  const std::vector<std::int32_t> three{1, 2, 3};
  try {
    p.write(0, [&](std::size_t) { return std::span<const std::int32_t>(three); }, mb::packed_row{x.data(), y.data(), o.data(), 8, 2});
    FAIL("a sample of the wrong length was written");
  } catch (const mb::invalid_argument& e) {
    CHECK(e.argument().starts_with("sample("));
  }
  try {
    std::vector<std::int32_t> x16(16), y16(16);
    p.write(0, [&](std::size_t) { return std::span<const std::int32_t>(three); }, mb::packed_row{x16.data(), y16.data(), o.data(), 16, 2});
    FAIL("a row of another length was written");
  } catch (const mb::invalid_argument& e) {
    CHECK(e.argument() == "out");
  }
}

TEST_CASE("trainer: packed rows run within the plan, learn, resume bit for bit; a source of the other kind is refused") {
  using P = mb::fp32_precision;
  const membound_test::hybrid<P> m(membound_test::small_config());
  const auto samples = make_samples(400, 60, 40, 5);
  const mb::token_packing pack(lengths_of(samples), 48, 6);
  const mb::batch_shape eff{3, 48, 6};  // 3 packed rows per step, 48 tokens, at most 6 sequences each
  mb::thread_pool pool(2);
  mb::fit_options fo;
  fo.threads = 2;
  fo.head_chunks = {64, 16};
  const mb::training_plan plan = mb::fit(m, eff, 1ull << 30, fo);
  CHECK(plan.micro == mb::batch_shape{1, 48, 6});
  CHECK(plan.accumulation == 3);
  mb::trainer_options o;
  o.seed = 3;
  o.lr = mb::cosine_lr{1e-2, 1e-3, 2, 20};
  o.head_chunks = {64, 16};
  const packed_rows src{&pack, &samples};

  mb::budget_allocator<mb::system_allocator> a(1ull << 30);
  mb::trainer t(m, eff, plan, a, pool, o);
  std::vector<double> whole;
  for (int k = 0; k < 10; ++k) whole.push_back(t.step(src).loss);
  CHECK(whole.back() < whole.front() - 0.3);
  CHECK(a.stats().peak_requested <= t.largest_predicted_peak());
  CHECK(t.data_position() == 30);
  const double e = t.evaluate(src, 4, 1);
  CHECK(std::isfinite(e));

  // Resumed at step 4: the same losses and weights.
  const std::string path = (std::filesystem::temp_directory_path() / "membound_test_packing.ckpt").string();
  std::vector<double> resumed;
  {
    mb::budget_allocator<mb::system_allocator> a1(1ull << 30);
    mb::trainer first(m, eff, plan, a1, pool, o);
    for (int k = 0; k < 4; ++k) resumed.push_back(first.step(src).loss);
    first.save(path);
  }
  {
    mb::budget_allocator<mb::system_allocator> a2(1ull << 30);
    mb::trainer second(m, eff, plan, a2, pool, o);
    CHECK(second.load(path));
    for (int k = 0; k < 6; ++k) resumed.push_back(second.step(src).loss);
    CHECK(std::memcmp(second.weights(), t.weights(), m.weight_bytes()) == 0);
    // A checkpoint records the row's sequences: an unpacked trainer of the same rows refuses it.
    mb::budget_allocator<mb::system_allocator> a3(1ull << 30);
    const mb::batch_shape plain{3, 48};
    mb::trainer other(m, plain, mb::fit(m, plain, 1ull << 30, fo), a3, pool, o);
    CHECK_THROWS_AS(other.load(path), mb::checkpoint_mismatch);
  }
  std::filesystem::remove(path);
  CHECK(resumed == whole);

  // The source must match the batch: rows of single sequences for a packed batch are refused.
  auto plain_src = [](const mb::sequence_request&, std::int32_t* x, std::int32_t* y) {
    for (int i = 0; i < 48; ++i) x[i] = y[i] = 1;
  };
  try {
    (void)t.step(plain_src);
    FAIL("a sequence_source ran a packed batch");
  } catch (const mb::invalid_argument& e2) {
    CHECK(e2.argument() == "source");
  }
  // Offsets from the source are checked, by name, before anything runs.
  auto bad_src = [](const mb::sequence_request&, const mb::packed_row& row) {
    for (std::size_t i = 0; i < row.seq; ++i) row.tokens[i] = row.targets[i] = 1;
    for (std::size_t k = 0; k <= row.sequences; ++k) row.offsets[k] = static_cast<std::int32_t>(k == 0 ? 0 : row.seq - 1);
  };
  try {
    (void)t.step(bad_src);
    FAIL("offsets short of the row were accepted");
  } catch (const mb::invalid_argument& e3) {
    CHECK(e3.argument() == "source's offsets");
  }
}

// A step's loss and gradients are the mean over every counted target of the step, not a mean of
// the rows' means: a row that is mostly padding weighs by its few targets (as one batch of the
// same tokens would).
TEST_CASE("trainer: packed rows weigh by their counted targets") {
  using P = mb::fp32_precision;
  const membound_test::hybrid<P> m(membound_test::small_config());
  // Row 0 full of long samples, row 1 nearly empty: a 3-token sample in a row of 48.
  std::vector<std::vector<std::int32_t>> samples = make_samples(60, 40, 40, 9);
  samples.push_back({3, 4, 5});
  const mb::token_packing pack(lengths_of(samples), 48, 1);  // one sample per row
  std::size_t small_row = pack.rows();
  for (std::size_t r = 0; r < pack.rows(); ++r)
    if (pack.row(r)[0].length == 3) small_row = r;
  REQUIRE(small_row < pack.rows());
  // Requests 0 and 1 take row 0 and the small row.
  auto src = [&](const mb::sequence_request& q, const mb::packed_row& row) {
    pack.write(q.index == 0 ? 0 : small_row, [&](std::size_t i) { return std::span<const std::int32_t>(samples[i]); },
               row);
  };
  const mb::batch_shape eff{2, 48, 1};
  mb::fit_options fo;
  fo.threads = 1;
  fo.head_chunks = {64};
  mb::trainer_options o;
  o.seed = 3;
  o.clip = 0;
  mb::thread_pool pool(1);
  mb::budget_allocator<mb::system_allocator> a(1ull << 30);
  mb::trainer t(m, eff, mb::fit(m, eff, 1ull << 30, fo), a, pool, o);
  // The expected mean, from each row alone with the same starting weights.
  std::vector<float> w(m.parameter_elements()), g(w.size(), 0.0f);
  m.init_weights(w.data(), o.seed);
  double loss_sum = 0, counted = 0, mean_of_means = 0;
  std::vector<std::vector<std::int32_t>> x(2, std::vector<std::int32_t>(48)), y = x, off(2, std::vector<std::int32_t>(2));
  for (std::size_t k = 0; k < 2; ++k) {
    src(mb::sequence_request{k, 0}, mb::packed_row{x[k].data(), y[k].data(), off[k].data(), 48, 1});
    const double c = static_cast<double>(std::count_if(y[k].begin(), y[k].end(), [](std::int32_t v) { return v != mb::ignore_target; }));
    const double l = m.loss(w.data(), x[k].data(), y[k].data(), mb::batch_shape{1, 48, 1, off[k].data()}, 64, a, pool);
    loss_sum += c * l;
    counted += c;
    mean_of_means += l / 2;
  }
  for (std::size_t k = 0; k < 2; ++k) {
    const double c = static_cast<double>(std::count_if(y[k].begin(), y[k].end(), [](std::int32_t v) { return v != mb::ignore_target; }));
    const mb::training_plan p = mb::make_plan(m, mb::batch_shape{1, 48, 1}, mb::schedules::none{}, {});
    (void)m.forward_backward(w.data(), g.data(), x[k].data(), y[k].data(), mb::batch_shape{1, 48, 1, off[k].data()},
                             p.ops, 64, c / counted, a, pool);
  }
  double norm = 0;
  for (const float v : g) norm += static_cast<double>(v) * v;
  const mb::step_result r = t.step(src);
  // fp32: the same terms summed in another order (1e-6 relative).
  CHECK(r.loss == doctest::Approx(loss_sum / counted).epsilon(1e-6));
  CHECK(r.grad_norm == doctest::Approx(std::sqrt(norm)).epsilon(1e-5));
  // The weighting matters here: a mean of the two rows' means is far off.
  CHECK(std::abs(mean_of_means - loss_sum / counted) > 1e-3 * std::abs(loss_sum / counted));
}

// fit_tokens bisects over the row length; a scan over every length gives the same answer (the
// peak grows with the tokens), and below the least row's peak it names that peak.
TEST_CASE("fit_tokens: the most tokens per row that fit, as a scan finds them") {
  using P = mb::fp32_precision;
  const membound_test::hybrid<P> m(membound_test::small_config());
  mb::fit_options fo;
  fo.threads = 1;
  fo.head_chunks = {16};
  const std::size_t S = 4;
  std::size_t least = 0;
  try {
    (void)mb::fit(m, {1, 8, 4}, 0, fo);
  } catch (const mb::budget_too_small& e) {
    least = e.minimum();
  }
  REQUIRE(least > 0);
  for (const std::size_t budget : {least, least + 20000, least + 100000, least + 400000}) {
    CAPTURE(budget);
    const mb::training_plan p = mb::fit_tokens(m, 200, S, budget, fo, 8);
    std::size_t scan = 0;
    for (std::size_t n = 8; n <= 200; n += 8) {
      try {
        (void)mb::fit(m, {1, n, std::min(S, n)}, budget, fo);
        scan = n;
      } catch (const mb::budget_too_small&) {
      }
    }
    CHECK(p.micro.seq == scan);
    CHECK(p.micro.sequences == S);
    CHECK(p.budgeted_peak() <= budget);
  }
  try {
    (void)mb::fit_tokens(m, 200, S, least - 1, fo, 8);
    FAIL("a budget below the least row's peak was met");
  } catch (const mb::budget_too_small& e) {
    CHECK(e.minimum() == least);
  }
  CHECK_THROWS_AS(mb::fit_tokens(m, 200, S, least, fo, 0), mb::invalid_argument);
  CHECK_THROWS_AS(mb::fit_tokens(m, 200, 0, least, fo, 8), mb::invalid_argument);
}
