// Must NOT compile: a zero query tile is not a tile (tests/CMakeLists.txt matches the sentence).
#include "membound/policy/chunking.hpp"

static_assert(membound::attention_tiles<0, 64>::kv_tile == 64);

int main() {}
