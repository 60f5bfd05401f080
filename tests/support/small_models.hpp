// The small hybrid model the model, planner and trainer tests share: every block type in the
// order the example trainer uses, at sizes that run in milliseconds.
#pragma once

#include <cstddef>

#include <cstdint>
#include <vector>

#include "membound/model/model.hpp"
#include "membound/model/model_config.hpp"
#include "test_rng.hpp"

namespace membound_test {

template <typename P>
using hybrid = membound::model<membound::embedding<P>, membound::block<membound::ttt_linear<P>>,
                               membound::block<membound::attention<P>>, membound::block<membound::mamba<P>>,
                               membound::block<membound::attention<P>>, membound::lm_head<P>>;

// The same mixers and variants of them (another family, a math-changing policy, a memory-only
// policy), chosen per block at run time: model(config, pattern). {ttt, attn, mamba, attn} is
// hybrid's layout; the trainer's tests change one block at a time.
template <typename P>
using mixed = membound::model<
    membound::embedding<P>,
    membound::block_pattern<membound::ttt_linear<P>, membound::attention<P>, membound::mamba<P>, membound::ttt_mlp<P>,
                            membound::ttt_linear<P, membound::ttt_mini_batch<8>>,
                            membound::attention<P, membound::attention_tiles<32, 32>>,
                            membound::attention<P, membound::save_all>, membound::mamba<P, membound::scan_chunk<8>>,
                            membound::ttt_linear<P, membound::ttt_state_groups<1>>,
                            membound::mamba<P, membound::save_all>>,
    membound::lm_head<P>>;
namespace mixers {
enum : std::size_t {
  ttt,
  attn,
  mamba,
  ttt_mlp,
  ttt_mini_batch_8,  // math: one inner step per 8 tokens, not 16
  attn_tiles_32,     // math: another summation order in the online softmax
  attn_save_all,     // memory only: keeps q, k, v
  mamba_chunk_8,     // math: the scan in chunks of 8
  ttt_groups_1,      // memory only: keeps every inner state
  mamba_save_all,    // memory only: keeps the conv output and delta
};
}  // namespace mixers

// 40-token vocabulary, width 32, 4 heads, grouped-query attention with 2 key/value heads.
inline membound::model_config small_config() {
  membound::model_config c;
  c.vocab = 40;
  c.width = 32;
  c.heads = 4;
  c.kv_heads = 2;
  return c;
}

// Token ids and next-token targets from a fixed linear congruential sequence.
struct token_data {
  std::vector<std::int32_t> tokens, targets;
};
inline token_data make_token_data(membound::batch_shape b, std::size_t vocab, std::uint32_t seed) {
  token_data d;
  std::uint32_t s = seed;
  for (std::size_t i = 0; i < b.tokens(); ++i) {
    s = s * 1664525u + 1013904223u;
    d.tokens.push_back(static_cast<std::int32_t>((s >> 8) % vocab));
    s = s * 1664525u + 1013904223u;
    d.targets.push_back(static_cast<std::int32_t>((s >> 8) % vocab));
  }
  return d;
}

// Every mixer, chosen at run time: what the randomized planner tests draw models from.
template <typename P>
using any_blocks = membound::model<
    membound::embedding<P>,
    membound::block_pattern<membound::ttt_linear<P>, membound::attention<P>, membound::mamba<P>, membound::ttt_mlp<P>>,
    membound::lm_head<P>>;

// A random small config (1, 2 or 4 heads of 8 to 32 wide) and a pattern of up to `max_blocks`.
inline membound::model_config random_config(rng& r, std::size_t max_vocab, std::vector<std::size_t>& pattern,
                                            std::size_t max_blocks) {
  const std::size_t heads = std::size_t{1} << r.below(3);
  membound::model_config cfg;
  cfg.vocab = 16 + r.below(max_vocab);
  cfg.width = heads * 8 * (1 + r.below(4));
  cfg.heads = heads;
  pattern.assign(1 + r.below(max_blocks), 0);
  for (auto& k : pattern) k = r.below(4);
  return cfg;
}

}  // namespace membound_test
