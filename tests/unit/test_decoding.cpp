// Decoding a whole model one token at a time (model::start_decoding, decode_step):
//   - after every token, the logits equal next_token_logits over every token fed so far, relative
//     to the largest logit: fp64 1e-12 (the same formulas, sums in another order: measured ~1e-15),
//     fp32 1e-5 (3e-7 measured), bf16 2e-2 (4e-3 measured: intermediates rounded to 2^-8 at other
//     points), for every mixer, local attention past its window, TTT-MLP, mixtures of experts, a
//     run-time pattern;
//   - a sequence decoded beside others gets its logits alone (1e-12: the products' row count differs);
//   - the state and workspace are all it needs: nothing else is allocated, and a local layer's
//     state is the same at any max_len;
//   - start_decoding again on the same bytes repeats the run bit for bit;
//   - bad input is refused by name before anything is written, and the decoding goes on unharmed.
// (trainer::decode: test_trainer.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "membound/memory/budget.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/model/model.hpp"

#include "../support/small_models.hpp"

namespace mb = membound;

namespace {

template <typename P>
using local_global = mb::model<mb::embedding<P>, mb::block<mb::attention<P, mb::local_attention>>,
                               mb::block<mb::ttt_mlp<P>>, mb::block<mb::attention<P>>,
                               mb::block<mb::attention<P, mb::local_attention>>, mb::lm_head<P>>;
template <typename P>
using experts = mb::model<mb::embedding<P>, mb::block<mb::attention<P>, mb::moe_ffn>, mb::block<mb::mamba<P>>,
                          mb::block<mb::ttt_linear<P>, mb::moe_ffn>, mb::lm_head<P>>;

mb::model_config local_config() {
  mb::model_config c = membound_test::small_config();
  c.attention_window = 4;  // the sequences below run well past it: the ring wraps
  return c;
}
mb::model_config moe_config() {
  mb::model_config c = membound_test::small_config();
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.hidden = 24;
  c.moe.capacity_factor = 1.0;  // decoding computes every choice, as next_token_logits
  return c;
}

// Token t of sequence s: a fixed pseudo-random id.
std::vector<std::int32_t> make_tokens(std::size_t batch, std::size_t seq, std::size_t vocab, std::uint32_t seed) {
  std::vector<std::int32_t> t(batch * seq);
  std::uint32_t s = seed;
  for (auto& v : t) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<std::int32_t>((s >> 8) % vocab);
  }
  return t;
}

// A decoding's bytes and its step's workspace, taken from `alloc`.
template <typename Model, typename Alloc>
struct decode_buffers {
  Alloc& alloc;
  std::size_t state_bytes, ws_bytes;
  void* state;
  void* ws;
  decode_buffers(const Model& m, Alloc& a, std::size_t batch, std::size_t max_len, std::size_t threads)
      : alloc(a),
        state_bytes(m.decode_state_bytes(batch, max_len)),
        ws_bytes(m.decode_workspace_bytes(batch, max_len, threads)),
        state(a.allocate(state_bytes, mb::default_alignment)),
        ws(a.allocate(ws_bytes, mb::default_alignment)) {}
  ~decode_buffers() {
    alloc.deallocate(ws, ws_bytes, mb::default_alignment);
    alloc.deallocate(state, state_bytes, mb::default_alignment);
  }
  decode_buffers(const decode_buffers&) = delete;
  decode_buffers& operator=(const decode_buffers&) = delete;
};

// Every position's logits by decoding [batch, seq] tokens (column t fed at step t): [seq][batch·V].
template <typename Model, typename S>
std::vector<std::vector<double>> decode_all(const Model& m, const std::vector<S>& w, const std::vector<std::int32_t>& tok,
                                            std::size_t batch, std::size_t seq, std::size_t threads) {
  mb::thread_pool pool(threads);
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 30);
  const std::size_t V = m.config().vocab;
  std::vector<std::vector<double>> out(seq, std::vector<double>(batch * V));
  {
    decode_buffers<Model, decltype(alloc)> buf(m, alloc, batch, seq, threads);
    auto d = m.start_decoding(w.data(), buf.state, buf.state_bytes, batch, seq, pool);
    std::vector<std::int32_t> column(batch);
    for (std::size_t t = 0; t < seq; ++t) {
      for (std::size_t s = 0; s < batch; ++s) column[s] = tok[s * seq + t];
      m.decode_step(w.data(), d, column.data(), out[t].data(), buf.ws, buf.ws_bytes, pool);
    }
    CHECK(d.length == seq);
    // Nothing but the two buffers: decoding allocates nothing of its own.
    CHECK(alloc.stats().peak_requested == buf.state_bytes + buf.ws_bytes);
  }
  return out;
}

// Decoding equals next_token_logits over the prefix, at every position of every sequence.
template <typename Model>
void check_against_forward(const Model& m, std::size_t batch, std::size_t seq, double tolerance) {
  using S = typename Model::storage_type;
  std::vector<S> w(m.parameter_elements());
  m.init_weights(w.data(), 7);
  const std::size_t V = m.config().vocab;
  const auto tok = make_tokens(batch, seq, V, 91);
  const auto decoded = decode_all(m, w, tok, batch, seq, 2);
  mb::thread_pool pool(2);
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 30);
  double worst = 0;
  for (std::size_t t = 0; t < seq; ++t) {
    std::vector<std::int32_t> prefix(batch * (t + 1));
    for (std::size_t s = 0; s < batch; ++s)
      std::copy_n(tok.begin() + static_cast<std::ptrdiff_t>(s * seq), t + 1, prefix.begin() + static_cast<std::ptrdiff_t>(s * (t + 1)));
    std::vector<double> ref(batch * V);
    m.next_token_logits(w.data(), prefix.data(), {batch, t + 1}, ref.data(), alloc, pool);
    double scale = 0, err = 0;
    for (std::size_t k = 0; k < ref.size(); ++k) {
      scale = std::max(scale, std::abs(ref[k]));
      err = std::max(err, std::abs(ref[k] - decoded[t][k]));
    }
    worst = std::max(worst, err / scale);
  }
  CAPTURE(worst);
  CHECK(worst <= tolerance);
}

}  // namespace

TEST_CASE("decoding: every position's logits are next_token_logits over the prefix") {
  const std::size_t B = 2, T = 19;  // 19: a TTT mini-batch of 16 and a partial one
  SUBCASE("hybrid (TTT-Linear, attention, Mamba) fp64") {
    check_against_forward(membound_test::hybrid<mb::fp64_precision>(membound_test::small_config()), B, T, 1e-12);
  }
  SUBCASE("hybrid fp32") {
    check_against_forward(membound_test::hybrid<mb::fp32_precision>(membound_test::small_config()), B, T, 1e-5);
  }
  SUBCASE("hybrid bf16") {
    check_against_forward(membound_test::hybrid<mb::bf16_precision>(membound_test::small_config()), B, T, 2e-2);
  }
  SUBCASE("local attention past its window, TTT-MLP, global attention fp64") {
    check_against_forward(local_global<mb::fp64_precision>(local_config()), B, T, 1e-12);
  }
  SUBCASE("mixtures of experts (every choice computed) fp64") {
    check_against_forward(experts<mb::fp64_precision>(moe_config()), B, T, 1e-12);
  }
  SUBCASE("a run-time pattern fp64") {
    using mixed = membound_test::mixed<mb::fp64_precision>;
    namespace k = membound_test::mixers;
    check_against_forward(mixed(membound_test::small_config(), {k::ttt_mini_batch_8, k::attn_tiles_32, k::mamba_chunk_8,
                                                                k::ttt_mlp, k::attn_save_all}),
                          1, 21, 1e-12);
  }
}

TEST_CASE("decoding: a sequence decoded beside others gets its logits alone; a restart repeats the run") {
  using P = mb::fp64_precision;
  const experts<P> m(moe_config());
  std::vector<double> w(m.parameter_elements());
  m.init_weights(w.data(), 5);
  const std::size_t B = 3, T = 13, V = m.config().vocab;
  const auto tok = make_tokens(B, T, V, 17);
  const auto together = decode_all(m, w, tok, B, T, 2);
  for (std::size_t s = 0; s < B; ++s) {
    const std::vector<std::int32_t> one(tok.begin() + static_cast<std::ptrdiff_t>(s * T),
                                        tok.begin() + static_cast<std::ptrdiff_t>((s + 1) * T));
    const auto alone = decode_all(m, w, one, 1, T, 1);
    double err = 0;
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t v = 0; v < V; ++v) err = std::max(err, std::abs(alone[t][v] - together[t][s * V + v]));
    CHECK(err <= 1e-12);
  }
  // Again on the same bytes (start_decoding rewrites every state): the same bits.
  mb::thread_pool pool(2);
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 30);
  decode_buffers<experts<P>, decltype(alloc)> buf(m, alloc, B, T, 2);
  std::vector<double> first(B * V), second(B * V);
  for (std::vector<double>* out : {&first, &second}) {
    auto d = m.start_decoding(w.data(), buf.state, buf.state_bytes, B, T, pool);
    for (std::size_t t = 0; t < T; ++t) {
      std::vector<std::int32_t> column(B);
      for (std::size_t s = 0; s < B; ++s) column[s] = tok[s * T + t];
      m.decode_step(w.data(), d, column.data(), t + 1 == T ? out->data() : nullptr, buf.ws, buf.ws_bytes, pool);
    }
  }
  CHECK(first == second);
  CHECK(first == together[T - 1]);
}

TEST_CASE("decoding: a local layer's state is the same at any length; a global one's grows with it") {
  using P = mb::bf16_precision;
  using local_only = mb::model<mb::embedding<P>, mb::block<mb::attention<P, mb::local_attention>>,
                               mb::block<mb::mamba<P>>, mb::block<mb::ttt_linear<P>>, mb::lm_head<P>>;
  const local_only local(local_config());
  CHECK(local.decode_state_bytes(2, 1000) == local.decode_state_bytes(2, 1000000));
  CHECK(local.decode_workspace_bytes(2, 1000, 2) == local.decode_workspace_bytes(2, 1000000, 2));
  const local_global<P> mixed(local_config());
  // The global layer's cache: keys and values, B · Hkv · max_len · D bf16 each.
  const mb::model_config c = local_config();
  const std::size_t D = c.width / c.heads;
  CHECK(mixed.decode_state_bytes(2, 2000) - mixed.decode_state_bytes(2, 1000) == 2 * 2 * c.kv() * 1000 * D * 2);
}

TEST_CASE("decoding: bad input is refused by name and leaves the decoding as it was") {
  using P = mb::fp64_precision;
  const membound_test::hybrid<P> m(membound_test::small_config());
  std::vector<double> w(m.parameter_elements());
  m.init_weights(w.data(), 3);
  mb::thread_pool pool(1);
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 30);
  const std::size_t B = 2, L = 4, V = m.config().vocab;
  decode_buffers<membound_test::hybrid<P>, decltype(alloc)> buf(m, alloc, B, L, 1);
  CHECK_THROWS_WITH_AS(m.start_decoding(w.data(), buf.state, buf.state_bytes, 0, L, pool), doctest::Contains("batch"),
                       mb::invalid_argument);
  CHECK_THROWS_WITH_AS(m.start_decoding(w.data(), buf.state, buf.state_bytes, B, 0, pool), doctest::Contains("max_len"),
                       mb::invalid_argument);
  CHECK_THROWS_WITH_AS(m.start_decoding(w.data(), buf.state, buf.state_bytes - 1, B, L, pool),
                       doctest::Contains("state"), mb::workspace_too_small);
  CHECK_THROWS_WITH_AS(m.start_decoding(w.data(), nullptr, buf.state_bytes, B, L, pool), doctest::Contains("state"),
                       mb::workspace_too_small);

  auto d = m.start_decoding(w.data(), buf.state, buf.state_bytes, B, L, pool);
  const std::int32_t first[2] = {3, 9}, bad[2] = {3, 40}, next[2] = {11, 0};
  std::vector<double> logits(B * V), again(B * V);
  m.decode_step(w.data(), d, first, nullptr, buf.ws, buf.ws_bytes, pool);
  CHECK_THROWS_WITH_AS(m.decode_step(w.data(), d, bad, logits.data(), buf.ws, buf.ws_bytes, pool),
                       doctest::Contains("tokens[1]"), mb::invalid_argument);
  CHECK_THROWS_WITH_AS(m.decode_step(w.data(), d, next, logits.data(), buf.ws, buf.ws_bytes - 1, pool),
                       doctest::Contains("workspace"), mb::workspace_too_small);
  CHECK_THROWS_WITH_AS(m.decode_step(w.data(), d, nullptr, logits.data(), buf.ws, buf.ws_bytes, pool),
                       doctest::Contains("tokens"), mb::invalid_argument);
  CHECK(d.length == 1);
  m.decode_step(w.data(), d, next, logits.data(), buf.ws, buf.ws_bytes, pool);
  // The refusals changed nothing: the same two tokens from a fresh start give the same bits.
  auto fresh = m.start_decoding(w.data(), buf.state, buf.state_bytes, B, L, pool);
  m.decode_step(w.data(), fresh, first, nullptr, buf.ws, buf.ws_bytes, pool);
  m.decode_step(w.data(), fresh, next, again.data(), buf.ws, buf.ws_bytes, pool);
  CHECK(logits == again);
  // Full: max_len tokens fed, the next is refused by name.
  m.decode_step(w.data(), fresh, next, nullptr, buf.ws, buf.ws_bytes, pool);
  m.decode_step(w.data(), fresh, next, nullptr, buf.ws, buf.ws_bytes, pool);
  CHECK_THROWS_WITH_AS(m.decode_step(w.data(), fresh, next, nullptr, buf.ws, buf.ws_bytes, pool),
                       doctest::Contains("decoding.length"), mb::invalid_argument);
  CHECK(fresh.length == L);
}
