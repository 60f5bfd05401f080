// The small hybrid model the model, planner and trainer tests share: every block type in the
// order the example trainer uses, at sizes that run in milliseconds.
#pragma once

#include "membound/model/model.hpp"
#include "membound/model/model_config.hpp"

namespace membound_test {

template <typename P>
using hybrid = membound::model<membound::embedding<P>, membound::block<membound::ttt_linear<P>>,
                               membound::block<membound::attention<P>>, membound::block<membound::mamba<P>>,
                               membound::block<membound::attention<P>>, membound::lm_head<P>>;

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
