// The small hybrid model the model, planner and trainer tests share: every block type in the
// order the example trainer uses, at sizes that run in milliseconds.
#pragma once

#include <cstddef>

#include "membound/model/model.hpp"
#include "membound/model/model_config.hpp"

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
                            membound::ttt_linear<P, membound::ttt_checkpoint_groups<1>>,
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

}  // namespace membound_test
