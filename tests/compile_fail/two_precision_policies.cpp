// Must NOT compile: a policy_set takes at most one policy per kind, and two precision policies
// must be named as such (tests/CMakeLists.txt matches the sentence).
#include "membound/policy/chunking.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"

using namespace membound;

using defaults = type_list<fp32_precision, attention_tiles<64, 64>>;
using prec = policy_set<defaults, bf16_precision, attention_tiles<32, 32>, fp16_precision>::get<
    precision_kind>;

int main() {}
