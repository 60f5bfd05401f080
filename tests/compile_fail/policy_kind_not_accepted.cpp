// Must NOT compile: a layer whose defaults name no recompute policy does not take one, and
// policy_set must name the kind (tests/CMakeLists.txt matches the sentence).
#include "membound/policy/recompute.hpp"
#include "membound/policy/chunking.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"

using namespace membound;

using defaults = type_list<fp32_precision, scan_chunk<64>>;
using prec = policy_set<defaults, recompute>::get<precision_kind>;

int main() {}
