// A model assembled at compile time: an embedding, a list of blocks and an LM head.
//
//   using net = membound::model<membound::embedding<>,
//                               membound::block<membound::ttt_linear<>>,
//                               membound::block<membound::attention<>>,
//                               membound::block<membound::mamba<>>,
//                               membound::lm_head<>>;
//   net m(config);                                  // runtime widths: model_config
//   auto p = membound::make_plan(m, {batch, seq}, membound::schedules::every<2>{}, opts);
//   double loss = m.forward_backward(w, g, tokens, targets, p, alloc, pool);
//
// The model owns no memory: weights and gradients are flat arrays the caller allocates
// (weight_bytes() each), and a training step takes every activation and workspace from the
// caller's allocator, in exactly the order model/recompute_schedule.hpp's simulate() assumes, so the plan's
// predicted peak is the allocator's measured one.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <concepts>
#include <cstdint>
#include <numbers>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/shard.hpp"
#include "membound/layers/lm_head.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/host_allocator_ref.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/model/block.hpp"
#include "membound/model/glue.hpp"
#include "membound/model/model_config.hpp"
#include "membound/model/recompute_schedule.hpp"
#include "membound/memory/stream.hpp"
#include "membound/core/check_point.hpp"

MEMBOUND_NAMESPACE_BEGIN

// The token embedding table [V, C]; its precision is the model's.
template <typename Precision = fp32_precision>
struct embedding {
  static_assert(is_precision_v<Precision>,
                "membound: embedding<P>: P is a precision policy, e.g. fp32_precision or "
                "bf16_precision.");
  // Storage and accumulator types; the blocks and the head must use the same.
  using precision = Precision;
};

// True for embedding<P>: what a model's first part must be.
template <typename T>
inline constexpr bool is_embedding_v = false;
// embedding<P>: true.
template <typename P>
inline constexpr bool is_embedding_v<embedding<P>> = true;
// What a block_pattern lists: a mixer (its block has the dense SwiGLU MLP) or a whole block
// (block<attention<P>, moe_ffn>).
template <typename T>
concept pattern_choice = block_mixer<T> || is_block_v<T>;

// A sequence of blocks chosen at run time from these mixers or blocks (model(config, pattern)):
// what a trainer whose --layers flag names the pattern uses. The compile-time spelling lists blocks.
template <pattern_choice... Mixers>
struct block_pattern {
  static_assert(sizeof...(Mixers) >= 1, "membound: block_pattern<Mixers...> needs at least one mixer type.");
};

// True for block_pattern<Mixers...>: a model whose blocks are chosen at run time.
template <typename T>
inline constexpr bool is_block_pattern_v = false;
// block_pattern<Mixers...>: true.
template <typename... M>
inline constexpr bool is_block_pattern_v<block_pattern<M...>> = true;

// True for lm_head<P...>: what a model's last part must be.
template <typename T>
inline constexpr bool is_lm_head_v = false;
// lm_head<P...>: true.
template <typename... P>
inline constexpr bool is_lm_head_v<lm_head<P...>> = true;

// One named parameter tensor inside the flat weight array.
struct param_entry {
  std::string name;         // "blocks.1.attention.wq", "embedding", ...
  std::size_t offset = 0;   // elements from the start
  std::size_t count = 0;  // elements, without padding
  param_spec spec{};      // how the layer declares and initializes it
  bool decay = false;       // matrices take weight decay, norms and biases do not
};

namespace detail {

template <typename... Parts>
struct model_parts {
  static_assert(sizeof...(Parts) >= 3,
                "membound: model<embedding<P>, block<Mixer>..., lm_head<P>> needs an embedding, at "
                "least one block and an LM head, in that order.");
  using tuple = std::tuple<Parts...>;
  using first = std::tuple_element_t<0, tuple>;
  using last = std::tuple_element_t<sizeof...(Parts) - 1, tuple>;
  static constexpr std::size_t depth = sizeof...(Parts) - 2;
  template <std::size_t... I>
  static auto middle(std::index_sequence<I...>) -> std::tuple<std::tuple_element_t<I + 1, tuple>...>;
  using listed = decltype(middle(std::make_index_sequence<depth>{}));
  static constexpr bool runtime = depth == 1 && is_block_pattern_v<std::tuple_element_t<0, listed>>;
  // A pattern lists mixers (a block<M> each) or whole blocks (block<M, moe_ffn>).
  template <typename T>
  struct as_block {
    using type = block<T>;
  };
  template <typename M, typename F>
  struct as_block<block<M, F>> {
    using type = block<M, F>;
  };
  template <typename... M>
  static auto choices(block_pattern<M...>*) -> std::tuple<typename as_block<M>::type...>;
  static auto pick() {
    if constexpr (runtime) {
      return static_cast<decltype(choices(static_cast<std::tuple_element_t<0, listed>*>(nullptr)))*>(nullptr);
    } else {
      return static_cast<listed*>(nullptr);
    }
  }
  // The block types a block index dispatches over: the listed blocks, or the pattern's choices.
  using blocks = std::remove_pointer_t<decltype(pick())>;
};

// splitmix64: a counter-based generator, so every tensor's values depend only on (seed, tensor).
inline std::uint64_t splitmix64(std::uint64_t& s) noexcept {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
inline double uniform01(std::uint64_t& s) noexcept {
  return static_cast<double>(splitmix64(s) >> 11) * 0x1.0p-53;
}

}  // namespace detail

// The model (see the file comment). Parts: embedding<P>, then block<Mixer>... or one
// block_pattern<Mixers...>, then lm_head<P...>.
template <typename... Parts>
class model {
  using parts = detail::model_parts<Parts...>;

 public:
  // The first part: embedding<P>, whose P is the model's precision.
  using embedding_type = typename parts::first;
  // The last part: lm_head<P...>, whose backend is the model's.
  using head_type = typename parts::last;
  using blocks = typename parts::blocks;  // listed blocks, or a block_pattern's choices
  // Whether the blocks are a block_pattern, chosen at run time (model(config, pattern)).
  static constexpr bool runtime_pattern = parts::runtime;
  // Entries of `blocks`: the listed blocks, or the pattern's mixers.
  static constexpr std::size_t block_types = std::tuple_size_v<blocks>;

  static_assert(is_embedding_v<embedding_type>,
                "membound: the first part of a model is its embedding: model<embedding<P>, "
                "block<Mixer>..., lm_head<P>>.");
  static_assert(is_lm_head_v<head_type>,
                "membound: the last part of a model is its head: model<embedding<P>, "
                "block<Mixer>..., lm_head<P>>.");

  // Element type of the weights, the gradients and the activations.
  using storage_type = typename embedding_type::precision::storage_type;
  // Type the layers accumulate in.
  using accum_type = typename embedding_type::precision::accum_type;
  // Where the whole model runs: its head's backend (the embedding follows it), which every block's
  // mixer must share. With cuda_backend every pointer a step takes (weights, gradients, tokens,
  // targets) is device memory and the executor is a cuda_executor.
  using backend = typename head_type::backend;
  // thread_pool on cpu_backend, cuda_executor on cuda_backend.
  using executor = typename backend::executor;

 private:
  using S = storage_type;
  using A = accum_type;
  using glue = model_glue_of<backend>;

  template <typename B>
  static constexpr bool block_ok() {
    if constexpr (!is_block_v<B>) {
      return false;
    } else {
      return std::is_same_v<typename B::storage_type, S> && std::is_same_v<typename B::accum_type, A>;
    }
  }
  static_assert([]<std::size_t... I>(std::index_sequence<I...>) {
    return (block_ok<std::tuple_element_t<I, blocks>>() && ...);
  }(std::make_index_sequence<block_types>{}),
                "membound: every part between the embedding and the head must be a block<Mixer> "
                "whose mixer uses the embedding's precision (e.g. embedding<bf16_precision> with "
                "block<attention<bf16_precision>>).");
  static_assert(std::is_same_v<typename head_type::storage_type, S> &&
                    std::is_same_v<typename head_type::accum_type, A>,
                "membound: lm_head<P> must use the embedding's precision P.");
  // The allocator a step runs on hands out memory where the kernels read it. (The planner's
  // request-only calls take any allocator: nothing is dereferenced there.)
  template <typename Allocator>
  static constexpr bool in_backend_space() {
    static_assert(check_allocator<Allocator>());
    static_assert(Allocator::space == backend::space,
                  "membound: this allocator hands out memory in the wrong space for the model's backend: a "
                  "cpu_backend model takes a host allocator (system_allocator, ...), a cuda_backend model a "
                  "device one (cuda_device_allocator under caching_allocator / budget_allocator, or "
                  "cuda_expandable_arena).");
    return true;
  }
  template <typename B>
  static constexpr bool on_model_backend() {
    if constexpr (!is_block_v<B>) {
      return true;  // block_ok's assertion names that mistake
    } else {
      return std::is_same_v<typename B::backend, backend>;
    }
  }
  static_assert([]<std::size_t... I>(std::index_sequence<I...>) {
    return (on_model_backend<std::tuple_element_t<I, blocks>>() && ...);
  }(std::make_index_sequence<block_types>{}),
                "membound: every block's mixer must run on the head's backend: name the same backend "
                "in each, e.g. block<attention<bf16_precision, cuda_backend>> with "
                "lm_head<bf16_precision, cuda_backend>.");

 public:
  // pattern: for a block_pattern model, the index (into its mixer list) of every block; empty
  // for a model that lists its blocks.
  explicit model(const model_config& c, std::vector<std::size_t> pattern = {})
      : cfg_(c), pattern_(std::move(pattern)) {
    check_config(c);
    if constexpr (runtime_pattern) {
      if (pattern_.empty()) {
        throw invalid_argument("pattern", "at least one block", "none",
                               "Name the blocks, e.g. {0, 1, 2, 1} for block_pattern<A, B, C>");
      }
      for (std::size_t k = 0; k < pattern_.size(); ++k) {
        if (pattern_[k] >= block_types) {
          throw invalid_argument("pattern[" + std::to_string(k) + "]",
                                 "an index below " + std::to_string(block_types) + " (the mixers of block_pattern)",
                                 std::to_string(pattern_[k]), "Use mixer_index(name) to map names to indices");
        }
      }
    } else if (!pattern_.empty()) {
      throw invalid_argument("pattern", "empty (this model lists its blocks in its type)",
                             std::to_string(pattern_.size()) + " entries",
                             "Pass a pattern only to a model<embedding, block_pattern<...>, lm_head>");
    }
    build_params();
  }

  // Number of blocks.
  std::size_t depth() const noexcept { return runtime_pattern ? pattern_.size() : parts::depth; }
  // Each block's mixer index (block_pattern models); empty for a model that lists its blocks.
  const std::vector<std::size_t>& pattern() const noexcept { return pattern_; }
  // The index of the block type called `name` ("attention", "mamba", "ttt_linear", "ttt_mlp",
  // "local_attention", "attention_moe") among the block types, or block_types when there is none.
  static std::size_t mixer_index(const std::string& name) {
    std::size_t r = block_types;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((r == block_types && name == std::tuple_element_t<I, blocks>::name ? (r = I, 0) : 0), ...);
    }(std::make_index_sequence<block_types>{});
    return r;
  }

  // The widths it was made with.
  const model_config& config() const noexcept { return cfg_; }
  // Every parameter tensor, in the flat array's order.
  const std::vector<param_entry>& parameters() const noexcept { return params_; }
  std::size_t parameter_elements() const noexcept { return elements_; }  // with alignment padding
  // Parameters without the alignment padding: the count to report.
  std::size_t parameter_count() const noexcept {
    std::size_t n = 0;
    for (const auto& p : params_) n = sat_add(n, p.count);
    return n;
  }
  // Bytes of the flat weight array (and of the gradient array): parameter_elements() elements.
  std::size_t weight_bytes() const noexcept { return bytes_of<S>(elements_); }
  // What a trainer keeps in the backend's memory for steps of `tokens` tokens beyond weights,
  // gradients and optimizer state (on a device: the step's token and target ids, the gradient
  // norm's partials); 0 on the host. Part of every plan's persistent bytes.
  static constexpr std::size_t step_buffer_bytes(std::size_t tokens, std::size_t n) noexcept {
    return glue::step_buffer_bytes(tokens, n);
  }
  // The flat parameter array in three parts, padding included: the embedding table [0, e), the
  // blocks' tensors (block i: block_parameters(i)), and the head (final norm, untied LM head)
  // [h, parameter_elements()). ZeRO-2 exchanges each block's gradients as that block's backward
  // produces them, and the embedding's and head's once the micro-batch is done.
  shard_range embedding_parameters() const noexcept { return {0, depth() == 0 ? params_[head_first_].offset : params_[block_first_[0]].offset}; }
  // Block i's part of the flat array; throws invalid_argument for i >= depth().
  shard_range block_parameters(std::size_t i) const {
    if (i >= depth()) {
      throw invalid_argument("block", "an index below " + std::to_string(depth()), std::to_string(i),
                             "Blocks are numbered 0 to depth() - 1");
    }
    const std::size_t end = i + 1 < depth() ? params_[block_first_[i + 1]].offset : params_[head_first_].offset;
    return {params_[block_first_[i]].offset, end};
  }
  // The head's part: the final norm, then the LM head's table unless it is tied.
  shard_range head_parameters() const noexcept { return {params_[head_first_].offset, elements_}; }

  // The weight units a weight source is asked for (use(unit, next), see forward_backward_routed)
  // are blocks 0 .. depth() - 1 and these. The embedding's: its table, read by the lookup.
  std::size_t embedding_unit() const noexcept { return depth(); }
  // The head's: the final norm and the table it projects with (the embedding's when tied).
  std::size_t head_unit() const noexcept { return depth() + 1; }
  // No unit: the `next` of the last op that reads weights.
  static constexpr std::size_t no_unit = static_cast<std::size_t>(-1);
  // A unit's parts of the flat array, the second empty but for a tied head, whose table is the
  // embedding's: {head_parameters(), embedding_parameters()}, in that order (the flat array's
  // end, then its start: a rank's shard meets at most one of them unless it holds every block).
  std::array<shard_range, 2> unit_parameters(std::size_t unit) const {
    if (unit < depth()) return {block_parameters(unit), shard_range{}};
    if (unit == embedding_unit()) return {embedding_parameters(), shard_range{}};
    if (unit == head_unit())
      return {head_parameters(), cfg_.tie_embeddings ? embedding_parameters() : shard_range{}};
    throw invalid_argument("unit", "a block below " + std::to_string(depth()) + ", embedding_unit() or head_unit()",
                           std::to_string(unit), "Name a unit as the model numbers them");
  }
  // Block i's mixer name: "attention", "mamba", "ttt_linear", "ttt_mlp" or "local_attention".
  const char* block_name(std::size_t i) const {
    const char* n = "";
    visit_block(i, [&]<typename B>(B*) { n = B::name; });
    return n;
  }

  // Throws invalid_argument naming the first block or head argument the shape breaks.
  // inference: as next_token_logits runs it (a mixture of experts without its capacity).
  void check(batch_shape b, bool inference = false) const {
    if (b.batch == 0 || b.seq == 0) {
      throw invalid_argument(b.batch == 0 ? "batch" : "seq", "at least 1", "0",
                             "A step needs at least one sequence of one token");
    }
    for_each_block([&]<typename B>(std::size_t, B*) {
      auto d = B::make_dims(cfg_, b);
      if (inference) B::without_capacity(d);
      B::check(d);
    });
  }

  // Where the host reads the ids in place (the CPU), tokens and targets against the vocabulary;
  // device ids are the caller's to check on the host before the upload.
  void check_ids(const std::int32_t* tokens, const std::int32_t* targets, std::size_t n) const {
    if (const std::int32_t* t = glue::host_ids(tokens)) check_tokens(t, n);
    if (const std::int32_t* t = glue::host_ids(targets)) head_type::check_targets(t, n, cfg_.vocab);
  }
  // The mean's denominator: the targets that are not ignore_target (at least 1, so a micro-batch
  // of ignored targets has loss 0), read in place on the host. Device ids are not read (that
  // would be a copy and a sync): a device micro-batch divides by every position.
  static double counted_targets(const std::int32_t* targets, std::size_t n) noexcept {
    const std::int32_t* t = glue::host_ids(targets);
    if (t == nullptr) return static_cast<double>(n);
    const std::size_t c = ::membound::counted_targets(t, n);
    return static_cast<double>(c == 0 ? 1 : c);
  }
  // Throws invalid_argument naming the first id outside [0, vocab): host arrays only (a device
  // model's caller checks its host copy before the upload).
  void check_tokens(const std::int32_t* t, std::size_t n) const {
    for (std::size_t i = 0; i < n; ++i) {
      if (t[i] < 0 || static_cast<std::size_t>(t[i]) >= cfg_.vocab) {
        throw invalid_argument("tokens[" + std::to_string(i) + "]",
                               "a token id in [0, " + std::to_string(cfg_.vocab) + ")",
                               std::to_string(t[i]), "Encode the data with the model's vocabulary");
      }
    }
  }

  // Deterministic initialization: tensor k draws from splitmix64 seeded by (seed, k).
  void init_weights(S* w, std::uint64_t seed) const { init_weights(w, seed, {0, elements_}); }
  // The elements [r.begin, r.end) of that initialization, into w[0, r.size()) (ZeRO-3: a rank's
  // shard, the same bits as its part of the whole array). Each tensor's draws up to the range's
  // end are made, the others skipped.
  void init_weights(S* w, std::uint64_t seed, shard_range r) const {
    detail::need_pointer(w, "weights");
    if (r.begin > r.end || r.end > elements_) {
      throw invalid_argument("range", "a range within [0, " + std::to_string(elements_) + ") (parameter_elements())",
                             "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")",
                             "Pass a shard_of(parameter_elements(), ranks, rank)");
    }
    std::fill(w, w + r.size(), from_accum<S>(A(0)));
    for (std::size_t k = 0; k < params_.size(); ++k) {
      const param_entry& p = params_[k];
      if (p.offset >= r.end || p.offset + p.count <= r.begin) continue;
      std::uint64_t st = seed * 0x2545f4914f6cdd1dULL + k;
      const std::size_t last = std::min(p.count, r.end - p.offset);
      for (std::size_t i = 0; i < last; ++i) {
        const S v = from_accum<S>(static_cast<A>(draw(p.spec, i, st)));
        if (p.offset + i >= r.begin) w[p.offset + i - r.begin] = v;
      }
    }
  }

  // ---- Sizes of one micro-batch step ------------------------------------------------------------
  // Bytes of one activation, [B·T, C] in storage_type.
  std::size_t activation_bytes(batch_shape b) const noexcept { return bytes_of<S>(b.tokens(), cfg_.width); }
  // The LM head's shape for b, computing `chunk` logit rows at a time.
  lm_head_shape head_shape(batch_shape b, std::size_t chunk) const noexcept {
    return {b.tokens(), cfg_.width, cfg_.vocab, chunk, cfg_.norm_eps};
  }

  // The chain model/recompute_schedule.hpp plans over: exact bytes of every op of this model's step.
  chain make_chain(batch_shape b, std::size_t threads, std::size_t head_chunk,
                   std::size_t base_bytes) const {
    check(b);
    head_type::check(head_shape(b, head_chunk));
    chain c;
    const std::size_t a = activation_bytes(b);
    for_each_block([&]<typename B>(std::size_t, B*) { c.links.push_back(link_of<B>(cfg_, b, threads)); });
    c.output_bytes = a;
    c.loss_peak = sat_add(a, head_type::workspace_bytes(head_shape(b, head_chunk), threads));
    c.base_bytes = base_bytes;
    return c;
  }

  // ---- The same sizes as constant expressions (models that list their blocks) -----------------
  // What static_plan (model/planner.hpp) evaluates at compile time: no model object, no names.
  static constexpr std::size_t count_elements(const model_config& c)
    requires(!runtime_pattern)
  {
    std::size_t n = round_param(sat_mul(c.vocab, c.width));
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((n = sat_add(n, block_elements<std::tuple_element_t<I, blocks>>(c))), ...);
    }(std::make_index_sequence<block_types>{});
    n = sat_add(n, round_param(c.width));
    if (!c.tie_embeddings) n = sat_add(n, round_param(sat_mul(c.vocab, c.width)));
    return n;
  }
  // make_chain's chain from the config alone, for static_plan.
  static constexpr chain static_chain(const model_config& c, batch_shape b, std::size_t threads,
                                      std::size_t head_chunk, std::size_t base_bytes)
    requires(!runtime_pattern)
  {
    chain ch;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (ch.links.push_back(link_of<std::tuple_element_t<I, blocks>>(c, b, threads)), ...);
    }(std::make_index_sequence<block_types>{});
    const std::size_t a = bytes_of<S>(b.tokens(), c.width);
    ch.output_bytes = a;
    ch.loss_peak = sat_add(a, head_type::workspace_bytes({b.tokens(), c.width, c.vocab, head_chunk, c.norm_eps}, threads));
    ch.base_bytes = base_bytes;
    return ch;
  }

  // One block's link: its exact bytes in every forward mode and its forward FLOPs.
  template <typename B>
  static constexpr chain_link link_of(const model_config& c, batch_shape b, std::size_t threads) {
    const auto d = B::make_dims(c, b);
    const std::size_t a = bytes_of<S>(b.tokens(), c.width);
    chain_link l;
    l.input_bytes = a;
    l.saved_bytes = B::saved_bytes(d);
    l.advance_peak = sat_add(a, B::forward_workspace_bytes(d, threads, forward_mode::advance));
    l.tape_peak = sat_add(a, l.saved_bytes, B::forward_workspace_bytes(d, threads, forward_mode::tape));
    l.retape_peak = sat_add(l.saved_bytes, B::forward_workspace_bytes(d, threads, forward_mode::retape));
    l.backward_peak = sat_add(a, B::backward_workspace_bytes(d, threads));
    l.forward_cost = flops_of<B>(c, b);
    return l;
  }

  // ---- One micro-batch: forward, loss and backward under a schedule -----------------------------
  // tokens and targets: [B, T] ids. Gradients accumulate into g (zero them per optimizer step).
  // loss_scale multiplies the mean loss's gradient (1/accumulation for gradient accumulation).
  // Returns the mean cross-entropy over the micro-batch's targets other than ignore_target (on
  // cuda_backend over every position, see counted_targets; the trainer corrects it from its host
  // copy of the targets). A packed b (b.sequences, with
  // b.offsets set for this micro-batch: one row of sequences end to end) runs every block on its
  // sequences alone; give each sequence's last token ignore_target so that no loss crosses a
  // boundary. On any exception every byte this call
  // allocated is given back; weights are untouched (gradients may hold a partial sum).
  //
  // On cuda_backend, tokens and targets are device arrays whose ids the caller checked on the
  // host before the upload (check_tokens; lm_head's check_targets): the device cannot throw
  // without a sync. A bad id still reads nothing outside a table (its row is zero). The
  // returned loss is a host double, so the call synchronizes the executor's stream once, at the
  // loss; the backward after it is only enqueued. Blocks come from `alloc` on the executor's
  // stream (stream_view) and are used there only, so a block freed and handed out again is
  // ordered after its last use, and another stream sharing a stream-ordered allocator never
  // receives one early; work of other streams on these blocks goes through record_stream.
  //
  // observe(check_point) runs at after_forward (all blocks forward, before the loss), at
  // before_backward (loss and its gradient computed) and at after_backward (before the last
  // gradient is freed): where a pressure monitor looks. An observer may throw to abandon the
  // micro-batch; everything is given back as for any exception.
  //
  // moe (optional): what the mixture-of-experts blocks did, summed over them (zero without such
  // blocks): the balancing loss the returned loss includes, the choices their capacity dropped.
  //
  // host: where a schedule's offload ops keep block inputs (activation offload, chain::
  // offload_inputs), another allocator than `alloc`; required when `ops` offload, on a backend
  // that offloads activations (cpu_backend).
  template <typename Allocator, typename Observer = ignore_check_points>
    requires std::invocable<Observer&, check_point>
  double forward_backward(const S* w, S* g, const std::int32_t* tokens, const std::int32_t* targets,
                          batch_shape b, std::span<const chain_op> ops, std::size_t head_chunk,
                          double loss_scale, Allocator& alloc, executor& ex,
                          Observer observe = {}, moe_stats* moe = nullptr, host_allocator_ref host = {}) const {
    static_assert(in_backend_space<Allocator>());
    detail::need_pointer(w, "weights");
    detail::need_pointer(g, "gradients");
    detail::need_pointer(tokens, "tokens");
    detail::need_pointer(targets, "targets");
    flat_gradients flat{g};
    flat_weights weights{w};
    return step<true>(weights, flat, tokens, targets, b, ops, head_chunk, loss_scale, alloc, &ex, workspace_threads(ex),
                      observe, moe, host);
  }

  // forward_backward with the gradients kept elsewhere than one flat array (ZeRO-2's per-block
  // buckets): `grads` is a gradient_router (see flat_gradients). grads.at(offset) is where the
  // gradient of the parameter element at `offset` accumulates; in block i's backward,
  // grads.begin_block(i) runs after the block's new δ is allocated and before its workspace,
  // grads.end_block(i) after the workspace is given back and before its input δ and saved
  // tensors are (so a caller that allocates there adds its bytes on top of that op's own).
  //
  // w: the weights, one flat array, or a weight source kept elsewhere (ZeRO-3's shards, see
  // flat_weights): w.use(unit, next) runs before every op that reads a weight unit (block i's
  // forwards and backward: unit i; the embedding lookup: embedding_unit(); the loss:
  // head_unit()), next being the unit the next such op reads (no_unit when none); then
  // w.at(offset) is where the weight at `offset` is read, until the next use().
  template <typename Allocator, typename Weights, typename Router, typename Observer = ignore_check_points>
    requires std::invocable<Observer&, check_point>
  double forward_backward_routed(Weights&& w, Router& grads, const std::int32_t* tokens, const std::int32_t* targets,
                                 batch_shape b, std::span<const chain_op> ops, std::size_t head_chunk,
                                 double loss_scale, Allocator& alloc, executor& ex, Observer observe = {},
                                 moe_stats* moe = nullptr, host_allocator_ref host = {}) const {
    static_assert(in_backend_space<Allocator>());
    static_assert(requires(Router& r, std::size_t k) {
      { r.at(k) } -> std::same_as<S*>;
      r.begin_block(k);
      r.end_block(k);
    }, "membound: a gradient router offers S* at(offset), begin_block(i) and end_block(i): see flat_gradients");
    auto&& weights = weight_source(w);
    detail::need_pointer(tokens, "tokens");
    detail::need_pointer(targets, "targets");
    return step<true>(weights, grads, tokens, targets, b, ops, head_chunk, loss_scale, alloc, &ex, workspace_threads(ex),
                      observe, moe, host);
  }

  // The default weight source: one flat array of parameter_elements() weights.
  struct flat_weights {
    const S* w = nullptr;  // the weight array, parameter_elements() long
    // Where the weight at `offset` is read.
    const S* at(std::size_t offset) const noexcept { return w + offset; }
    // Nothing to do: the flat array holds every unit's weights throughout.
    void use(std::size_t, std::size_t) const noexcept {}
  };

  // The default router: one flat array of parameter_elements() gradients.
  struct flat_gradients {
    S* g = nullptr;  // the gradient array, parameter_elements() long
    // Where the gradient of the element at `offset` accumulates.
    S* at(std::size_t offset) const noexcept { return g + offset; }
    // Nothing to do: the flat array holds every block's gradients throughout.
    void begin_block(std::size_t) const noexcept {}
    // Nothing to do, as for begin_block.
    void end_block(std::size_t) const noexcept {}
  };

  // The requests forward_backward makes for (b, ops, head_chunk, threads), in its order, made on
  // `alloc` without running any work: what the planner replays through a shadow of an allocator
  // stack (model/reserve_plan.hpp) to know the reserve a step takes before the first one runs.
  template <typename Allocator>
  void step_requests(batch_shape b, std::span<const chain_op> ops, std::size_t head_chunk, std::size_t threads,
                     Allocator& alloc) const {
    static_assert(check_allocator<Allocator>());
    ignore_check_points none;
    flat_gradients flat{};
    flat_weights weights{};
    (void)step<false>(weights, flat, nullptr, nullptr, b, ops, head_chunk, 1.0, alloc, nullptr, threads, none, nullptr, {});
  }
  // The same with a gradient router whose begin_block and end_block make requests too (ZeRO-2's
  // buckets, replayed by model/reserve_plan.hpp); at() is not called.
  template <typename Allocator, typename Router>
  void step_requests_routed(batch_shape b, std::span<const chain_op> ops, std::size_t head_chunk, std::size_t threads,
                            Allocator& alloc, Router& grads) const {
    static_assert(check_allocator<Allocator>());
    ignore_check_points none;
    flat_weights weights{};
    (void)step<false>(weights, grads, nullptr, nullptr, b, ops, head_chunk, 1.0, alloc, nullptr, threads, none, nullptr, {});
  }

  // ---- Inference: the next-token logits of every sequence -------------------------------------
  // tokens [B, T] in the backend's memory (ids checked on the host; on a device the caller checks
  // them before the upload, as the trainer does); logits [B, V] (double, host) for position T−1 of
  // each sequence. Forward only: each block runs in advance mode and its input is freed as soon as
  // its output exists, so the peak is two activations plus one block's workspace, all from
  // `alloc`. The head is a host loop (accumulating in A) on every backend: on a device
  // the B last rows, the final norm and the head's V×C weights are copied to host buffers first
  // (B·C + C + V·C elements per call, the price of sampling without a logits kernel).
  // w: the weights, or a weight source (see forward_backward_routed).
  template <typename Allocator, typename Weights>
  void next_token_logits(Weights&& weights, const std::int32_t* tokens, batch_shape b, double* logits,
                         Allocator& alloc, executor& ex) const {
    static_assert(in_backend_space<Allocator>());
    auto&& w = weight_source(weights);
    detail::need_pointer(tokens, "tokens");
    detail::need_pointer(logits, "logits");
    check(b, true);
    if (const std::int32_t* t = glue::host_ids(tokens)) check_tokens(t, b.tokens());
    const std::size_t C = cfg_.width, V = cfg_.vocab;
    live_set<Allocator> live(alloc, &ex, depth());
    const S* x = forward_only<true>(w, tokens, b, live, &ex, workspace_threads(ex), true, nullptr);
    w.use(head_unit(), no_unit);
    const auto hw = head_weights(w);
    std::vector<S> row_copy, norm_copy, head_copy;  // stay empty where the host reads in place
    const S* norm = glue::host_view(ex, hw.norm, C, norm_copy);
    const S* head = glue::host_view(ex, hw.w, V * C, head_copy);
    for (std::size_t s = 0; s < b.batch; ++s) {
      const S* row = glue::host_view(ex, x + (s * b.seq + b.seq - 1) * C, C, row_copy);
      head_logits(row, norm, head, logits + s * V);
    }
  }

  // ---- Decoding: one token per sequence, each block carrying its state ------------------------
  // Generation without recomputing the past. start_decoding lays every block's state over the
  // caller's decode_state_bytes(batch, max_len) bytes: attention's KV cache of max_len positions
  // (of its window W under one, so flat at any length), Mamba's convolution and scan state and
  // TTT's inner model (the same at any length). Each decode_step feeds one token per sequence
  // and gives the next-token logits: next_token_logits over every token fed so far, within the
  // order of sums (decoding's attention sums keys one by one, forward's by tiles; a mixture of
  // experts computes every choice, as there). A prompt is fed by steps, logits nullptr until its
  // last token (no parallel prefill yet). A step's buffers are the caller's workspace of
  // decode_workspace_bytes(batch, max_len, threads); nothing is allocated, except the head's host
  // copies on a device (as next_token_logits).
  struct decoding {
    void* state = nullptr;    // the caller's bytes: every block's state, block after block
    std::size_t bytes = 0;    // their size, at least decode_state_bytes(batch, max_len)
    std::size_t batch = 0;    // sequences decoded together: the rows of tokens and logits
    std::size_t max_len = 0;  // tokens each sequence can take
    std::size_t length = 0;   // tokens fed to each sequence; the next one goes to position `length`
  };
  // Bytes of every block's decoding state for `batch` sequences of up to max_len tokens.
  std::size_t decode_state_bytes(std::size_t batch, std::size_t max_len) const {
    return for_each_decode_state(batch, max_len, []<typename B>(std::size_t, B*, const auto&, std::size_t, std::size_t) {});
  }
  // Workspace bytes of one decode_step: the step's input and output rows and the largest block's.
  std::size_t decode_workspace_bytes(std::size_t batch, std::size_t max_len, std::size_t threads) const {
    return decode_layout(batch, max_len, threads).size();
  }
  // A decoding of `batch` sequences over `state` (decode_state_bytes(batch, max_len) bytes,
  // aligned to accum_type), at position 0; again on the same bytes to start over. Checks
  // everything before writing. w: the weights, or a weight source (TTT's state starts from them).
  template <typename Weights>
  decoding start_decoding(Weights&& weights, void* state, std::size_t bytes, std::size_t batch,
                          std::size_t max_len, executor& ex) const {
    auto&& w = weight_source(weights);
    check_decoding({state, bytes, batch, max_len, 0});
    for_each_decode_state(batch, max_len, [&]<typename B>(std::size_t i, B*, const auto& d, std::size_t at, std::size_t n) {
      w.use(i, i + 1 < depth() ? i + 1 : no_unit);
      B::start_decoding(d, block_weights<B>(w, i), static_cast<std::byte*>(state) + at, n, max_len, ex);
    });
    return {state, bytes, batch, max_len, 0};
  }
  // Feeds tokens [batch] (one per sequence, in the backend's memory; ids checked on the host, a
  // device caller checks them before the upload) at position d.length, and writes the logits of
  // the next token [batch, V] (double, host) unless `logits` is nullptr. Checks everything
  // (room for the token included) before writing; d.length advances by one.
  template <typename Weights>
  void decode_step(Weights&& weights, decoding& d, const std::int32_t* tokens, double* logits, void* workspace,
                   std::size_t workspace_size, executor& ex) const {
    auto&& w = weight_source(weights);
    check_decoding(d);
    detail::need_pointer(tokens, "tokens");
    if (d.length >= d.max_len) {
      throw invalid_argument("decoding.length", "below max_len " + std::to_string(d.max_len),
                             std::to_string(d.length),
                             "Start the decoding again (start_decoding) with a larger max_len, or from the last tokens");
    }
    const std::size_t B = d.batch, C = cfg_.width, V = cfg_.vocab, threads = workspace_threads(ex);
    const auto dl = decode_layout(B, d.max_len, threads);
    detail::check_workspace_size(dl.size(), workspace, workspace_size);
    if (const std::int32_t* t = glue::host_ids(tokens)) check_tokens(t, B);
    const auto ws = carve(dl, workspace, dl.size());
    S* x = ws.template get<S>(dw_x);
    S* y = ws.template get<S>(dw_y);
    void* bws = ws.template get<std::byte>(dw_block);
    w.use(embedding_unit(), depth() > 0 ? 0 : head_unit());
    glue::template embedding_gather<A>(ex, tokens, w.at(params_[0].offset), x, B, C, V);
    for_each_decode_state(B, d.max_len, [&]<typename B_>(std::size_t i, B_*, const auto& bd, std::size_t at, std::size_t n) {
      w.use(i, i + 1 < depth() ? i + 1 : (logits != nullptr ? head_unit() : no_unit));
      B_::decode_step(bd, block_weights<B_>(w, i), static_cast<std::byte*>(d.state) + at, n, d.max_len, d.length, x,
                      y, bws, ex);
      std::swap(x, y);
    });
    ++d.length;
    if (logits == nullptr) return;
    w.use(head_unit(), no_unit);
    const auto hw = head_weights(w);
    std::vector<S> row_copy, norm_copy, head_copy;  // stay empty where the host reads in place
    const S* norm = glue::host_view(ex, hw.norm, C, norm_copy);
    const S* head = glue::host_view(ex, hw.w, V * C, head_copy);
    for (std::size_t s = 0; s < B; ++s) head_logits(glue::host_view(ex, x + s * C, C, row_copy), norm, head, logits + s * V);
  }

  // ---- Evaluation: the mean cross-entropy without a backward pass ------------------------------
  // The same value, to the bit, as forward_backward's (a mixture's balancing loss included; moe
  // as there); forward only, each block's input freed once its output exists, so the peak is two
  // activations plus the larger of one block's forward workspace and the head's, all from
  // `alloc` (below any training plan's for b).
  // w: the weights, or a weight source (see forward_backward_routed).
  template <typename Allocator, typename Weights>
  double loss(Weights&& weights, const std::int32_t* tokens, const std::int32_t* targets, batch_shape b,
              std::size_t head_chunk, Allocator& alloc, executor& ex, moe_stats* moe = nullptr) const {
    static_assert(in_backend_space<Allocator>());
    auto&& w = weight_source(weights);
    detail::need_pointer(tokens, "tokens");
    detail::need_pointer(targets, "targets");
    return loss_pass<true>(w, tokens, targets, b, head_chunk, alloc, &ex, workspace_threads(ex), moe);
  }
  // The requests loss() makes, in its order, without running any work (see step_requests).
  template <typename Allocator>
  void loss_requests(batch_shape b, std::size_t head_chunk, std::size_t threads, Allocator& alloc) const {
    flat_weights weights{};
    (void)loss_pass<false>(weights, nullptr, nullptr, b, head_chunk, alloc, nullptr, threads, nullptr);
  }

  // Forward FLOPs of one block of type B on b: its MLP, its mixer's projections and its mixing.
  template <typename B>
  static constexpr double flops_of(const model_config& cfg, batch_shape b) noexcept {
    const double N = static_cast<double>(b.tokens()), C = static_cast<double>(cfg.width);
    const double T = static_cast<double>(b.seq);
    using M = typename B::mixer;
    const auto d = B::make_dims(cfg, b);
    double f = B::feed_forward_flops(d);
    std::size_t mixer_params = 0;
    for (const auto& p : mixer_traits<M>::params(d.p1.layer)) mixer_params += p.count;
    f += 2.0 * N * static_cast<double>(mixer_params);
    if constexpr (std::is_same_v<typename mixer_traits<M>::shape_type, attention_shape>) {
      // QKᵀ and PV over the pairs the mask keeps: T²/2 causal (as it always counted, also for a
      // window that covers the sequence), the band's exact count under a narrower window.
      const attention_shape& a = d.p1.layer;
      f += a.window == 0 || a.window >= a.seq ? 2.0 * N * T * C
                                              : 4.0 * static_cast<double>(b.batch) * attention_pairs(a) * C;
    } else if constexpr (std::is_same_v<typename mixer_traits<M>::shape_type, mamba_shape>) {
      f += 9.0 * N * static_cast<double>(d.p1.layer.d_inner * d.p1.layer.d_state);
    } else {
      f += 8.0 * N * C * static_cast<double>(M::mini_batch);  // dual form inside mini-batches
    }
    return f;
  }
  // FLOPs of the LM head on b: logits, dW and dxn products.
  double head_flops(batch_shape b) const noexcept {
    return head_type::flops(head_shape(b, 1));
  }

  // Typed access for tests and tools: the weights of block i as its block type takes them.
  template <typename B>
  typename B::weight_ptrs block_weights(const S* w, std::size_t i) const {
    return block_weights<B>(flat_weights{w}, i);
  }
  // The same from a weight source (flat_weights, ZeRO-3's gathered block).
  template <typename B, typename Weights>
    requires(!std::is_pointer_v<std::remove_cvref_t<Weights>>)
  typename B::weight_ptrs block_weights(const Weights& w, std::size_t i) const {
    typename B::weight_ptrs p{};
    const std::size_t first = block_first_[i];
    for (std::size_t k = 0; k < p.size(); ++k) {
      const param_entry& e = params_[first + k];
      p[k] = e.count == 0 ? nullptr : w.at(e.offset);
    }
    return p;
  }

  // f(i, (B*)nullptr) for every block, in order.
  template <typename F>
  void for_each_block(F&& f) const {
    for (std::size_t i = 0; i < depth(); ++i)
      visit_block(i, [&]<typename B>(B* tag) { f.template operator()<B>(i, tag); });
  }
  // f((B*)nullptr) with B the type of block i.
  template <typename F>
  void visit_block(std::size_t i, F&& f) const {
    if (i >= depth()) {
      throw invalid_argument("block", "an index below " + std::to_string(depth()), std::to_string(i),
                             "Blocks are numbered 0 to depth() - 1");
    }
    const std::size_t k = runtime_pattern ? pattern_[i] : i;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((k == I ? (f.template operator()<std::tuple_element_t<I, blocks>>(static_cast<std::tuple_element_t<I, blocks>*>(nullptr)), 0) : 0), ...);
    }(std::make_index_sequence<block_types>{});
  }

 private:
  // One micro-batch under a schedule. Run: the work too (forward_backward); otherwise only the
  // requests, in the same order (step_requests; the host space's are not the device's, and not
  // made), so that the two cannot drift apart. The ops are checked first as simulate() checks
  // them: a dropped backward or a duplicated tape is an invalid_argument naming the op, before
  // anything is allocated.
  template <bool Run, typename Weights, typename Allocator, typename Router, typename Observer>
  double step(Weights& w, Router& g, const std::int32_t* tokens, const std::int32_t* targets, batch_shape b,
              std::span<const chain_op> ops, std::size_t head_chunk, double loss_scale, Allocator& alloc,
              executor* ex, std::size_t threads, Observer& observe, moe_stats* moe, host_allocator_ref host) const {
    const schedule_stats checked = simulate(make_chain(b, threads, head_chunk, 0), ops);  // checks b and the head's shape too
    if constexpr (Run) {
      if (checked.offloaded_bytes != 0) check_host_space(host, alloc);
    }
    const std::size_t N = b.tokens(), C = cfg_.width, L = depth();
    const lm_head_shape hs = head_shape(b, head_chunk);
    if constexpr (Run) check_ids(tokens, targets, N);
    const double counted = Run ? counted_targets(targets, N) : 1.0;
    const std::size_t a = activation_bytes(b);
    moe_stats experts{};  // the mixture blocks' first forwards

    live_set<Allocator> live(alloc, ex, L);
    std::vector<char> reported(L, 0);  // a block's stats count once: recomputations repeat them
    std::vector<S*> x(L + 1, nullptr);
    std::vector<void*> saved(L, nullptr);
    host_set offloaded(Run ? host : host_allocator_ref{}, L);  // block inputs in the host space
    S* delta = nullptr;
    double loss_sum = 0;

    // For each op, the unit the next op that reads weights reads (no_unit: none); a flat array
    // needs no word of it.
    constexpr bool flat = std::is_same_v<Weights, flat_weights>;
    std::vector<std::size_t> next_use(flat ? 0 : ops.size(), no_unit);
    std::size_t first_use = no_unit;
    for (std::size_t k = next_use.size(); k-- > 0;) {
      next_use[k] = first_use;
      if (reads_weights(ops[k].kind)) first_use = unit_read(ops[k]);
    }

    x[0] = static_cast<S*>(live.get(a, memory_tag::activations));
    if constexpr (!flat) w.use(embedding_unit(), first_use);
    if constexpr (Run) glue::template embedding_gather<A>(*ex, tokens, w.at(params_[0].offset), x[0], N, C, cfg_.vocab);

    for (std::size_t k = 0; k < ops.size(); ++k) {
      const chain_op& op = ops[k];
      const std::size_t i = op.block;
      if constexpr (!flat) {
        if (reads_weights(op.kind)) w.use(unit_read(op), next_use[k]);
      }
      switch (op.kind) {
        case chain_op_kind::advance:
        case chain_op_kind::tape:
        case chain_op_kind::retape: {
          const forward_mode mode = op.kind == chain_op_kind::advance ? forward_mode::advance
                                    : op.kind == chain_op_kind::tape  ? forward_mode::tape
                                                                      : forward_mode::retape;
          visit_block(i, [&]<typename B>(B*) {
            const auto d = B::make_dims(cfg_, b);
            if (mode != forward_mode::retape) x[i + 1] = static_cast<S*>(live.get(a, memory_tag::activations));
            if (mode != forward_mode::advance)
              saved[i] = live.get(B::saved_bytes(d), memory_tag::activations);
            const std::size_t wsb = B::forward_workspace_bytes(d, threads, mode);
            void* ws = live.get(wsb, memory_tag::workspace);
            if constexpr (Run) {
              // A block's first forward reports; a recomputation repeats the same routing.
              moe_stats st;
              B::forward(d, block_weights<B>(w, i), x[i], x[i + 1], saved[i], ws, mode, *ex,
                         reported[i] != 0 ? nullptr : &st);
              reported[i] = 1;
              experts += st;
            }
            live.put(ws);
          });
          break;
        }
        case chain_op_kind::loss: {
          if constexpr (Run) observe(check_point::after_forward);
          S* d_out = static_cast<S*>(live.get(a, memory_tag::activations));
          const std::size_t wsb = head_type::workspace_bytes(hs, threads);
          void* ws = live.get(wsb, memory_tag::workspace);
          if constexpr (Run) {
            const double scale = loss_scale / counted;
            loss_sum = head_type::loss_backward(hs, head_weights(w), x[L], targets, scale, d_out, routed_head_grads(g), ws,
                                                wsb, *ex);
          }
          live.put(ws);
          delta = d_out;
          if constexpr (Run) observe(check_point::before_backward);
          break;
        }
        case chain_op_kind::backward: {
          visit_block(i, [&]<typename B>(B*) {
            auto d = B::make_dims(cfg_, b);
            B::scale_aux_loss(d, loss_scale);
            S* dx = static_cast<S*>(live.get(a, memory_tag::activations));
            g.begin_block(i);
            void* ws = live.get(B::backward_workspace_bytes(d, threads), memory_tag::workspace);
            if constexpr (Run)
              B::backward(d, block_weights<B>(w, i), routed_block_grads<B>(g, i), x[i], saved[i], delta, dx, ws, *ex);
            live.put(ws);
            g.end_block(i);
            live.put(delta);
            live.put(saved[i]);
            saved[i] = nullptr;
            delta = dx;
          });
          break;
        }
        case chain_op_kind::discard:
          live.put(x[i]);
          x[i] = nullptr;
          break;
        case chain_op_kind::offload:
          // (Run on a backend without offload never gets here: check_host_space threw.)
          if constexpr (Run && glue::offloads_activations) glue::offload_copy(*ex, offloaded.get(i, a), x[i], a);
          live.put(x[i]);
          x[i] = nullptr;
          break;
        case chain_op_kind::fetch:
          x[i] = static_cast<S*>(live.get(a, memory_tag::activations));
          if constexpr (Run && glue::offloads_activations) {
            glue::offload_copy(*ex, x[i], offloaded.at(i), a);
            offloaded.put(i);
          }
          break;
      }
    }
    if constexpr (Run) {
      glue::template embedding_scatter<A>(*ex, tokens, delta, g.at(params_[0].offset), N, C, cfg_.vocab);
      observe(check_point::after_backward);
    }
    live.put(delta);
    if (moe != nullptr) *moe = experts;
    return loss_sum / counted + experts.aux_loss;
  }

  template <bool Run, typename Weights, typename Allocator>
  double loss_pass(Weights& w, const std::int32_t* tokens, const std::int32_t* targets, batch_shape b,
                   std::size_t head_chunk, Allocator& alloc, executor* ex, std::size_t threads,
                   moe_stats* moe) const {
    static_assert(check_allocator<Allocator>());
    check(b);
    const std::size_t N = b.tokens();
    const lm_head_shape hs = head_shape(b, head_chunk);
    head_type::check(hs);
    if constexpr (Run) check_ids(tokens, targets, N);
    const double counted = Run ? counted_targets(targets, N) : 1.0;
    live_set<Allocator> live(alloc, ex, depth());
    moe_stats experts{};
    S* x = forward_only<Run>(w, tokens, b, live, ex, threads, false, &experts);
    w.use(head_unit(), no_unit);
    const std::size_t wsb = head_type::workspace_bytes(hs, threads);
    void* ws = live.get(wsb, memory_tag::workspace);
    double total = 0;
    if constexpr (Run) total = head_type::loss(hs, head_weights(w), x, targets, ws, wsb, *ex);
    live.put(ws);
    live.put(x);
    if (moe != nullptr) *moe = experts;
    return total / counted + experts.aux_loss;
  }

  // Embedding and every block in advance mode; returns the last block's output (held by live).
  // The caller reads the head next (w.use(head_unit(), ...)).
  // inference: a mixture of experts computes every choice (no capacity, as Mixtral and
  // Switch's evaluation do: a prompt of a few tokens would otherwise leave experts no slot).
  template <bool Run, typename Weights, typename Live>
  S* forward_only(Weights& w, const std::int32_t* tokens, batch_shape b, Live& live, executor* ex,
                  std::size_t threads, bool inference, moe_stats* moe) const {
    const std::size_t N = b.tokens(), C = cfg_.width, a = activation_bytes(b);
    S* x = static_cast<S*>(live.get(a, memory_tag::activations));
    w.use(embedding_unit(), depth() > 0 ? 0 : head_unit());
    if constexpr (Run) glue::template embedding_gather<A>(*ex, tokens, w.at(params_[0].offset), x, N, C, cfg_.vocab);
    for (std::size_t i = 0; i < depth(); ++i) {
      w.use(i, i + 1 < depth() ? i + 1 : head_unit());
      visit_block(i, [&]<typename B>(B*) {
        auto d = B::make_dims(cfg_, b);
        if (inference) B::without_capacity(d);
        S* y = static_cast<S*>(live.get(a, memory_tag::activations));
        void* ws = live.get(B::forward_workspace_bytes(d, threads, forward_mode::advance), memory_tag::workspace);
        if constexpr (Run) {
          moe_stats st;
          B::forward(d, block_weights<B>(w, i), x, y, nullptr, ws, forward_mode::advance, *ex, moe ? &st : nullptr);
          if (moe != nullptr) *moe += st;
        }
        live.put(ws);
        live.put(x);
        x = y;
      });
    }
    return x;
  }

  // f(i, (B*)nullptr, block i's decode dims, where its state starts, its bytes) for every block,
  // in order: the one layout of a decoding's state, block after block, each start aligned to
  // default_alignment. Returns the bytes of all (saturated).
  template <typename F>
  std::size_t for_each_decode_state(std::size_t batch, std::size_t max_len, F&& f) const {
    std::size_t end = 0;
    for_each_block([&]<typename B>(std::size_t i, B* tag) {
      const auto d = B::decode_dims(cfg_, batch);
      const std::size_t n = B::decode_state_bytes(d, max_len);
      const std::size_t at = end > size_max - default_alignment ? size_max : align_up(end, default_alignment);
      end = sat_add(at, n);
      f(i, tag, d, at, n);
    });
    return end;
  }
  // decode_step's workspace: the rows in and out (swapped block by block), one block's step.
  enum decode_slot : std::size_t { dw_x, dw_y, dw_block };
  workspace_layout<3> decode_layout(std::size_t batch, std::size_t max_len, std::size_t threads) const {
    std::size_t block = 0;
    for_each_block([&]<typename B>(std::size_t, B*) {
      block = std::max(block, B::decode_workspace_bytes(B::decode_dims(cfg_, batch), max_len, threads));
    });
    workspace_layout<3> l;
    l.add(bytes_of<S>(batch, cfg_.width));
    l.add(bytes_of<S>(batch, cfg_.width));
    l.add(block);
    return l;
  }
  // A decoding's arguments, as start_decoding and decode_step take them.
  void check_decoding(const decoding& d) const {
    if (d.batch == 0) {
      throw invalid_argument("batch", "at least 1", "0", "Decode at least one sequence");
    }
    if (d.max_len == 0) {
      throw invalid_argument("max_len", "at least 1", "0", "A decoding holds at least the token being fed");
    }
    for_each_block([&]<typename B>(std::size_t, B*) { B::check(B::decode_dims(cfg_, d.batch)); });
    const std::size_t need = decode_state_bytes(d.batch, d.max_len);
    if (d.state == nullptr || d.bytes < need) throw workspace_too_small("state", need, d.state == nullptr ? 0 : d.bytes);
    detail::need_aligned(d.state, alignof(A), "state");
  }

  // A schedule that offloads needs a backend that can and a host space apart from the device's.
  template <typename Allocator>
  static void check_host_space(host_allocator_ref host, const Allocator& alloc) {
    if constexpr (!glue::offloads_activations) {
      throw invalid_argument("ops", "a schedule without offload ops on this backend (activation offload runs on "
                             "cpu_backend only)", "offload ops",
                             "Plan without offload_options::activations: its device path is not built yet");
    } else {
      if (host.empty()) {
        throw invalid_argument("host", "a host allocator for the block inputs the schedule offloads", "none",
                               "Pass host_allocator_ref(your host allocator) (the trainer's options.host)");
      }
      if (host.refers_to(&alloc)) {
        throw invalid_argument("host", "another allocator than the device's (alloc)", "the same allocator",
                               "Give the offloaded block inputs their own host allocator: the plan counts them apart");
      }
    }
  }

  // The block inputs a step keeps in the host space, given back on every exit.
  class host_set {
   public:
    host_set(host_allocator_ref h, std::size_t depth) : h_(h), p_(depth + 1, nullptr), bytes_(depth + 1, 0) {}
    host_set(const host_set&) = delete;
    host_set& operator=(const host_set&) = delete;
    ~host_set() {
      for (std::size_t i = 0; i < p_.size(); ++i)
        if (p_[i] != nullptr) h_.deallocate(p_[i], bytes_[i], default_alignment, memory_tag::activations);
    }
    void* get(std::size_t i, std::size_t bytes) {
      try {
        p_[i] = h_.allocate(bytes, default_alignment, memory_tag::activations);
      } catch (const out_of_memory& e) {
        throw host_space_exhausted(e.report());
      }
      bytes_[i] = bytes;
      return p_[i];
    }
    const void* at(std::size_t i) const noexcept { return p_[i]; }
    void put(std::size_t i) {
      h_.deallocate(p_[i], bytes_[i], default_alignment, memory_tag::activations);
      p_[i] = nullptr;
    }

   private:
    host_allocator_ref h_;
    std::vector<void*> p_;
    std::vector<std::size_t> bytes_;
  };

  // Every allocation of a step, so that an exception gives all of them back. Served on the
  // executor's stream (stream_view): a block freed here is reused only by later work of that
  // stream, never handed early to another stream sharing the allocator.
  template <typename Allocator>
  class live_set {
   public:
    live_set(Allocator& a, const executor* ex, std::size_t depth)
        : a_(a, ex != nullptr ? stream_of(*ex) : host_stream) {
      blocks_.reserve(4 * depth + 8);
    }
    live_set(const live_set&) = delete;
    live_set& operator=(const live_set&) = delete;
    ~live_set() {
      for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) a_.deallocate(it->p, it->bytes, default_alignment, it->tag);
    }
    void* get(std::size_t bytes, memory_tag tag) {
      void* p = a_.allocate(bytes, default_alignment, tag);
      blocks_.push_back({p, bytes, tag});
      return p;
    }
    void put(const void* p) {
      for (std::size_t k = blocks_.size(); k-- > 0;) {
        if (blocks_[k].p == p) {
          a_.deallocate(blocks_[k].p, blocks_[k].bytes, default_alignment, blocks_[k].tag);
          blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(k));
          return;
        }
      }
    }

   private:
    struct rec {
      void* p;
      std::size_t bytes;
      memory_tag tag;
    };
    stream_view<Allocator> a_;
    std::vector<rec> blocks_;
  };

  static void check_config(const model_config& c) {
    if (c.vocab == 0 || c.vocab > static_cast<std::size_t>(INT32_MAX)) {
      throw invalid_argument("config.vocab", "between 1 and 2^31 − 1", std::to_string(c.vocab),
                             "Set the vocabulary size (256 for bytes)");
    }
    if (c.width == 0) {
      throw invalid_argument("config.width", "at least 1", "0", "Set the model width");
    }
    if (c.heads == 0 || c.width % c.heads != 0) {
      throw invalid_argument("config.heads", "a divisor of config.width (" + std::to_string(c.width) + ")",
                             std::to_string(c.heads), "Choose heads so that width / heads is the head size");
    }
    if (c.kv() == 0 || c.heads % c.kv() != 0) {
      throw invalid_argument("config.kv_heads", "a divisor of config.heads", std::to_string(c.kv_heads),
                             "Use 0 (= heads), or a divisor of heads for GQA");
    }
    if (!(c.norm_eps > 0.0)) {
      throw invalid_argument("config.norm_eps", "above 0", std::to_string(c.norm_eps), "Use e.g. 1e-5");
    }
  }

  // Every tensor starts on a 64-byte boundary.
  static constexpr std::size_t round_param(std::size_t n) noexcept {
    constexpr std::size_t align = 64 / sizeof(S) == 0 ? 1 : 64 / sizeof(S);
    return sat_round_up(n, align);
  }
  template <typename B>
  static constexpr std::size_t block_elements(const model_config& c) {
    std::size_t n = 0;
    for (const param_spec& p : B::params(B::make_dims(c, {1, 1}))) n = sat_add(n, round_param(p.count));
    return n;
  }
  void add_param(std::string name, const param_spec& s) {
    param_entry e;
    e.name = std::move(name);
    e.offset = elements_;
    e.count = s.count;
    e.spec = s;
    e.decay = s.init == param_init::normal;
    elements_ = sat_add(elements_, round_param(s.count));
    params_.push_back(std::move(e));
  }

  void build_params() {
    const batch_shape one{1, 1};
    add_param("embedding", {"embedding", sat_mul(cfg_.vocab, cfg_.width), param_init::normal, detail::init_std, 0});
    for_each_block([&]<typename B>(std::size_t i, B*) {
      block_first_.push_back(params_.size());
      const auto d = B::make_dims(cfg_, one);
      for (const param_spec& s : B::params(d))
        add_param("blocks." + std::to_string(i) + "." + B::name + "." + s.name, s);
    });
    head_first_ = params_.size();
    add_param("final_norm", {"final_norm", cfg_.width, param_init::constant, 1.0, 0});
    if (!cfg_.tie_embeddings)
      add_param("lm_head", {"lm_head", sat_mul(cfg_.vocab, cfg_.width), param_init::normal, detail::init_std, 0});
  }

  // One row's logits on the host: RMSNorm (stored as S, as the head's forward stores it), then
  // the V dot products in A.
  void head_logits(const S* row, const S* norm, const S* hw, double* logits) const {
    const std::size_t C = cfg_.width;
    A ss = 0;
    for (std::size_t c = 0; c < C; ++c) ss += to_accum<A>(row[c]) * to_accum<A>(row[c]);
    const A r = A(1) / std::sqrt(ss / A(C) + A(cfg_.norm_eps));
    for (std::size_t v = 0; v < cfg_.vocab; ++v) {
      A dot = 0;
      for (std::size_t c = 0; c < C; ++c)
        dot += to_accum<A>(from_accum<S>(to_accum<A>(row[c]) * r * to_accum<A>(norm[c]))) * to_accum<A>(hw[v * C + c]);
      logits[v] = static_cast<double>(dot);
    }
  }
  template <typename Weights>
  typename head_type::weights head_weights(const Weights& w) const noexcept {
    const std::size_t table = cfg_.tie_embeddings ? 0 : head_first_ + 1;
    return {w.at(params_[head_first_].offset), w.at(params_[table].offset)};
  }
  // Which ops read weights: a block's forwards and its backward (its unit), the loss (the head's).
  static constexpr bool reads_weights(chain_op_kind k) noexcept {
    return k == chain_op_kind::advance || k == chain_op_kind::tape || k == chain_op_kind::retape ||
           k == chain_op_kind::backward || k == chain_op_kind::loss;
  }
  std::size_t unit_read(const chain_op& op) const noexcept {
    return op.kind == chain_op_kind::loss ? head_unit() : op.block;
  }
  // A weight array as flat_weights; a weight source as it is. A null array is named.
  static flat_weights weight_source(const S* w) {
    detail::need_pointer(w, "weights");
    return {w};
  }
  static flat_weights weight_source(S* w) { return weight_source(static_cast<const S*>(w)); }
  static flat_weights weight_source(std::nullptr_t) { return weight_source(static_cast<const S*>(nullptr)); }
  template <typename Weights>
    requires(!std::is_pointer_v<std::remove_cvref_t<Weights>> && !std::is_null_pointer_v<std::remove_cvref_t<Weights>>)
  static Weights& weight_source(Weights& w) noexcept {
    static_assert(requires(const Weights& c, Weights& m, std::size_t k) {
      { c.at(k) } -> std::convertible_to<const S*>;
      m.use(k, k);
    }, "membound: a weight source offers const S* at(offset) and use(unit, next): see flat_weights");
    return w;
  }
  template <typename Router>
  typename head_type::gradients routed_head_grads(Router& g) const {
    const std::size_t table = cfg_.tie_embeddings ? 0 : head_first_ + 1;
    return {g.at(params_[head_first_].offset), g.at(params_[table].offset)};
  }
  template <typename B, typename Router>
  typename B::grad_ptrs routed_block_grads(Router& g, std::size_t i) const {
    typename B::grad_ptrs p{};
    const std::size_t first = block_first_[i];
    for (std::size_t k = 0; k < p.size(); ++k) {
      const param_entry& e = params_[first + k];
      p[k] = e.count == 0 ? nullptr : g.at(e.offset);
    }
    return p;
  }

  static double draw(const param_spec& s, std::size_t i, std::uint64_t& st) {
    switch (s.init) {
      case param_init::constant:
        return s.value;
      case param_init::normal: {  // Box–Muller, one value per pair of uniforms
        const double u1 = 1.0 - detail::uniform01(st), u2 = detail::uniform01(st);
        return s.value * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
      }
      case param_init::mamba_a_log:
        return std::log(1.0 + static_cast<double>(i % (s.period == 0 ? 1 : s.period)));
      case param_init::mamba_dt_bias: {
        const double lo = std::log(1e-3), hi = std::log(0.1);
        const double dt = std::max(1e-4, std::exp(lo + (hi - lo) * detail::uniform01(st)));
        return dt + std::log(-std::expm1(-dt));  // softplus⁻¹(dt)
      }
    }
    return 0.0;
  }

  model_config cfg_;
  std::vector<std::size_t> pattern_;
  std::vector<param_entry> params_;
  std::vector<std::size_t> block_first_;
  std::size_t head_first_ = 0;
  std::size_t elements_ = 0;
};

MEMBOUND_NAMESPACE_END
