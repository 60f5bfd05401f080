// The hybrid whose blocks are chosen at run time: an embedding, a pattern of TTT-Linear,
// attention, Mamba, TTT-MLP and sliding-window attention blocks (each with its SwiGLU MLP) and
// attention with a mixture of experts, and the LM head, at precision P on a backend.
// The example trainer (both halves), the benchmarks and the Python package build this one model;
// model::mixer_index maps the names "ttt_linear", "attention", "mamba", "ttt_mlp",
// "local_attention" and "attention_moe" to the pattern's indices. The local blocks'
// window is model_config::attention_window, the mixture's settings model_config::moe.
//
//   membound::hybrid_model<membound::bf16_precision> m(config, {0, 1, 2, 1});
#pragma once

#include "membound/core/config.hpp"
#include "membound/layers/attention.hpp"
#include "membound/layers/lm_head.hpp"
#include "membound/layers/mamba.hpp"
#include "membound/layers/ttt.hpp"
#include "membound/model/block.hpp"
#include "membound/model/model.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {
template <typename P, typename Backend>
struct hybrid_of {
  using type = model<embedding<P>,
                     block_pattern<ttt_linear<P, Backend>, attention<P, Backend>, mamba<P, Backend>, ttt_mlp<P, Backend>,
                                   attention<P, Backend, local_attention>, block<attention<P, Backend>, moe_ffn>>,
                     lm_head<P, Backend>>;
};
// On the CPU the layers' own default: the very types the library's CPU models have always used.
template <typename P>
struct hybrid_of<P, cpu_backend> {
  using type = model<embedding<P>,
                     block_pattern<ttt_linear<P>, attention<P>, mamba<P>, ttt_mlp<P>, attention<P, local_attention>,
                                   block<attention<P>, moe_ffn>>,
                     lm_head<P>>;
};
}  // namespace detail

// The pattern's mixers in index order: 0 TTT-Linear, 1 attention, 2 Mamba, 3 TTT-MLP, 4 local
// (sliding-window) attention, 5 attention with a mixture of experts ("attention_moe",
// model_config::moe). Backend:
// cpu_backend, or cuda_backend (backend/cuda.cuh, in a .cu file).
template <typename P = fp32_precision, typename Backend = cpu_backend>
using hybrid_model = typename detail::hybrid_of<P, Backend>::type;

MEMBOUND_NAMESPACE_END
