// Must NOT compile: attention's chunking policy is attention_tiles; a Mamba scan chunk is not
// (tests/CMakeLists.txt matches the sentence).
#include "membound/layers/attention.hpp"

using layer = membound::attention<membound::scan_chunk<64>>;
static_assert(sizeof(layer::storage_type) == 4);

int main() {}
