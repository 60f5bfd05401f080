// Must NOT compile: the type has everything an optimizer policy needs except update, and
// check_optimizer_policy must say exactly that (tests/CMakeLists.txt matches the sentence).
#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "membound/optimizer/optimizer_policy.hpp"

struct no_update {
  using storage_type = float;
  static constexpr std::string_view name = "none";
  static std::string description() { return "none"; }
  static constexpr std::size_t state_bytes(std::size_t n) noexcept { return n; }
  static void init(const float*, std::size_t, void*, std::size_t) {}
  static std::span<const std::byte> save_state(const void*, std::size_t) { return {}; }
  static void load_state(std::span<const std::byte>, void*, std::size_t) {}
};

static_assert(membound::check_optimizer_policy<no_update, float>());

int main() {}
