// Must NOT compile: a type without a policy_kind is not a policy, and policy_set must say what
// to pass instead (tests/CMakeLists.txt matches the sentence).
#include "membound/policy/chunking.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"

using namespace membound;

struct not_a_policy {};

using defaults = type_list<fp32_precision, attention_tiles<64, 64>>;
using prec = policy_set<defaults, bf16_precision, not_a_policy>::get<precision_kind>;

int main() {}
