# Included by each consumer route: a .cu consumer (membound::cuda), examples/01_cuda_layer.cu,
# compiled and linked wherever membound's tests found nvcc (MEMBOUND_CONSUMER_CUDA), run where a
# GPU is. Nothing but the target gives nvcc C++20: its default dialect is C++17, which membound
# refuses in one sentence.
if(MEMBOUND_CONSUMER_CUDA)
  enable_language(CUDA)
  add_executable(consumer_cuda ${CMAKE_CURRENT_LIST_DIR}/../../examples/01_cuda_layer.cu)
  target_link_libraries(consumer_cuda PRIVATE membound::cuda)
  add_test(NAME consumer_cuda COMMAND consumer_cuda)
  set_tests_properties(consumer_cuda PROPERTIES SKIP_RETURN_CODE 77)
endif()
