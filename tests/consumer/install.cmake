# cmake -DBUILD_DIR=... -DPREFIX=... [-DCONFIG=...] -P install.cmake
# Starts from an empty prefix so a stale earlier install cannot hide a missing install rule.
file(REMOVE_RECURSE ${PREFIX})
set(config_args)
if(CONFIG)
  set(config_args --config ${CONFIG})
endif()
execute_process(
  COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX} ${config_args}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed (${rc})")
endif()
