// What a machine without a GPU can check of attention's cuDNN path (backend/cuda/cudnn_attention.cuh):
// libcudnn is opened by dlopen, not linked, and its version read through the frontend's dynamic
// loading; a library that is not there leaves the path off with a reason that says what to do.
// `cudnn_library_loading loads` requires the load (ctest puts the toolkit's lib64 on the path),
// `... refuses` requires the refusal (ctest sets MEMBOUND_CUDNN_LIBRARY to a missing file).
#include <cstdio>
#include <cstring>
#include <mutex>

// Only the cuDNN path (the loading needs no kernel): a third of the whole backend's compile time.
#include "membound/backend/cuda/cudnn_attention.cuh"

namespace mb = membound;

int main(int argc, char** argv) {
  if (argc != 2 || (std::strcmp(argv[1], "loads") != 0 && std::strcmp(argv[1], "refuses") != 0)) {
    std::fprintf(stderr, "usage: cudnn_library_loading loads|refuses\n");
    return 2;
  }
  const bool want = std::strcmp(argv[1], "loads") == 0;
  auto& st = mb::gpu::cudnn_detail::state();
  {
    const std::lock_guard<std::mutex> lock(st.m);
    (void)mb::gpu::cudnn_detail::load_library(st);
  }
  const mb::gpu::cudnn_attention_counts c = mb::gpu::cudnn_attention_report();
  if (!c.compiled) {
    std::printf("FAILED: the report says the program was built without cuDNN\n");
    return 1;
  }
  if (want) {
    if (!c.loaded || c.version < 90000) {
      std::printf("FAILED: libcudnn did not load (%s), version %ld\n", c.library.c_str(), c.version);
      return 1;
    }
    std::printf("cudnn loaded: %s, version %ld\n", c.library.c_str(), c.version);
    return 0;
  }
  if (c.loaded || c.library.find("MEMBOUND_CUDNN_LIBRARY") == std::string::npos) {
    std::printf("FAILED: expected a refusal naming MEMBOUND_CUDNN_LIBRARY, got loaded=%d: %s\n", c.loaded,
                c.library.c_str());
    return 1;
  }
  std::printf("cudnn refused: %s\n", c.library.c_str());
  return 0;
}
