// Attention span policies: which keys an attention layer may see beyond its causal mask. A model
// mixes local and global layers (Mistral, Gemma) by giving blocks either one: a local layer takes
// model_config::attention_window as its sliding window, a global one sees every key.
#pragma once

#include "membound/core/config.hpp"
#include "membound/policy/policy_kind.hpp"

MEMBOUND_NAMESPACE_BEGIN

MEMBOUND_POLICY_KIND(attention_span_kind, "attention span");

// The default: the layer runs the shape's window as given (0: every key the mask allows); in a
// model, every key.
struct global_attention {
  using policy_kind = attention_span_kind;
};

// A sliding-window layer: its shape must set a window (check() refuses window 0, so a local
// layer never silently attends to everything); in a model, model_config::attention_window.
struct local_attention {
  using policy_kind = attention_span_kind;
};

MEMBOUND_NAMESPACE_END
