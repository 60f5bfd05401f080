// The runtime sizes of a model (its type fixes the layers and policies; these fix the widths),
// and how each parameter tensor is named, sized and initialized.
#pragma once

#include <cstddef>
#include <cstdint>

#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

// The mixture-of-experts feed-forward of the blocks that take one (block<Mixer, moe_ffn>;
// layers/moe_mlp.hpp and shape/moe_shape.hpp say what each field does).
struct moe_config {
  std::size_t experts = 8;        // E
  std::size_t top_k = 2;          // k: 1 (Switch) or 2 (GShard, Mixtral)
  std::size_t hidden = 0;         // F of each expert (0: the dense MLP's, model_config::hidden())
  double capacity_factor = 1.25;  // slots per expert floor(factor · tokens · k / E); 0: no limit
  bool renormalize = true;        // the k gates divided by their sum (k = 2; one gate stays p)
  double aux_loss_weight = 0.01;  // α of the load-balancing loss the model adds to its loss
};

struct model_config {
  std::size_t vocab = 256;      // byte-level by default
  std::size_t width = 0;        // C, the residual stream
  std::size_t heads = 0;        // attention and TTT heads; divides width
  std::size_t kv_heads = 0;     // attention's key/value heads (0: = heads)
  std::size_t mlp_hidden = 0;   // F of the SwiGLU MLP (0: 8/3·C rounded up to a multiple of 8)
  bool tie_embeddings = true;   // the LM head reuses the embedding table
  double norm_eps = 1e-5;       // RMSNorm
  double rope_base = 10000.0;   // attention and TTT
  double ttt_base_lr = 1.0;     // TTT's inner learning rate scale
  std::size_t attention_window = 0;  // W of the local_attention layers (keys i − W + 1 .. i)
  moe_config moe{};               // the moe_ffn blocks' experts

  constexpr std::size_t hidden() const noexcept {
    // 8/3·C up to a multiple of 8, saturating (a width near SIZE_MAX is refused by its sizes).
    return mlp_hidden != 0 ? mlp_hidden : sat_round_up(sat_mul(width, 8) / 3, 8);
  }
  constexpr std::size_t kv() const noexcept { return kv_heads != 0 ? kv_heads : heads; }
  constexpr std::size_t expert_hidden() const noexcept { return moe.hidden != 0 ? moe.hidden : hidden(); }
};

// The work one micro-batch step does: batch sequences of seq tokens, or (sequences > 0) one row
// of seq tokens packed with `sequences` variable-length sequences end to end
// (shape/packed_sequences.hpp; empty ones pad a batch with fewer). Sizes, and so every plan,
// depend on the three counts only: offsets are the step's data, set on the plan's shape for each
// micro-batch (sequences + 1 entries, 0 first, seq last), and left out of ==.
struct batch_shape {
  std::size_t batch = 1;
  std::size_t seq = 1;
  std::size_t sequences = 0;
  const std::int32_t* offsets = nullptr;
  constexpr std::size_t tokens() const noexcept { return sat_mul(batch, seq); }
  constexpr bool packed() const noexcept { return sequences != 0; }
  friend constexpr bool operator==(const batch_shape& a, const batch_shape& b) noexcept {
    return a.batch == b.batch && a.seq == b.seq && a.sequences == b.sequences;
  }
  // The shape one step runs: the batch itself, or one packed row of it (a step runs packed rows
  // one at a time; an effective batch of `batch` packed rows accumulates over them).
  // (A batch of 0 rows stays 0, so that checks refuse it.)
  constexpr batch_shape row() const noexcept {
    return packed() ? batch_shape{batch == 0 ? 0 : std::size_t{1}, seq, sequences, offsets} : *this;
  }
};

// How a parameter tensor starts. Each rule is the one its layer's reference uses.
enum class param_init : std::uint8_t {
  normal,         // N(0, value²)
  constant,       // value
  mamba_a_log,    // log(1 + j) for state index j: A = −(1 … Ns), S4D-real
  mamba_dt_bias,  // softplus⁻¹ of Δ log-uniform in [1e-3, 0.1]: Mamba's dt initialization
};

struct param_spec {
  const char* name = "";
  std::size_t count = 0;
  param_init init = param_init::normal;
  double value = 0.0;
  std::size_t period = 0;  // mamba_a_log: the state size Ns
};

MEMBOUND_NAMESPACE_END
