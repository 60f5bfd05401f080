// Must NOT compile: double storage with float accumulation would round every read, and
// precision must say what to use instead (tests/CMakeLists.txt matches the sentence).
#include "membound/policy/precision.hpp"

using storage = membound::precision<double, float>::storage_type;

int main() {}
