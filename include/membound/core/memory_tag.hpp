// What an allocation is for. Tags let statistics, traces and the planner speak the same language.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

enum class memory_tag : std::uint8_t {
  weights,
  gradients,
  optimizer,
  activations,
  workspace,
  other,
};

inline constexpr std::size_t memory_tag_count = 6;

inline constexpr std::array<memory_tag, memory_tag_count> all_memory_tags{
    memory_tag::weights,     memory_tag::gradients, memory_tag::optimizer,
    memory_tag::activations, memory_tag::workspace, memory_tag::other};

constexpr std::size_t index_of(memory_tag tag) noexcept { return static_cast<std::size_t>(tag); }

constexpr bool is_valid(memory_tag tag) noexcept {
  return static_cast<std::size_t>(tag) < memory_tag_count;
}

constexpr std::string_view to_string(memory_tag tag) noexcept {
  switch (tag) {
    case memory_tag::weights: return "weights";
    case memory_tag::gradients: return "gradients";
    case memory_tag::optimizer: return "optimizer";
    case memory_tag::activations: return "activations";
    case memory_tag::workspace: return "workspace";
    case memory_tag::other: return "other";
  }
  return "invalid";
}

// Where the bytes live: canary checks and memset-style debugging only make sense on host memory.
enum class memory_space : std::uint8_t { host, device };

MEMBOUND_NAMESPACE_END
