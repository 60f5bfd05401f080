# cmake -DPREFIX=... -DCXX=... -DSOURCE=... -DOUT=... [-DCUDA=ON] -P pkg_config.cmake
# A build without CMake: the installed membound.pc gives the flags (Eigen's through eigen3.pc);
# the program is compiled with them alone, linked and run. With CUDA, membound-cuda.pc must
# resolve too and name the runtime and cuBLASLt.
set(ENV{PKG_CONFIG_PATH} "${PREFIX}/share/pkgconfig")
find_program(PKG_CONFIG pkg-config REQUIRED)
execute_process(COMMAND ${PKG_CONFIG} --cflags membound OUTPUT_VARIABLE cflags RESULT_VARIABLE rc
                OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "pkg-config --cflags membound failed (${rc}) with PKG_CONFIG_PATH=${PREFIX}/share/pkgconfig")
endif()
if(NOT cflags MATCHES "-std=c\\+\\+20" OR NOT cflags MATCHES "/share/pkgconfig/../../include")
  message(FATAL_ERROR "pkg-config --cflags membound: '${cflags}' lacks -std=c++20 or the installed include folder")
endif()
separate_arguments(flags UNIX_COMMAND "${cflags}")
execute_process(COMMAND ${CXX} ${flags} ${SOURCE} -o ${OUT} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${CXX} $(pkg-config --cflags membound) ${SOURCE} failed (${rc})")
endif()
execute_process(COMMAND ${OUT} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${OUT} failed (${rc})")
endif()
if(CUDA)
  execute_process(COMMAND ${PKG_CONFIG} --cflags --libs membound-cuda OUTPUT_VARIABLE flags RESULT_VARIABLE rc
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0 OR NOT flags MATCHES "-lcudart" OR NOT flags MATCHES "-lcublasLt")
    message(FATAL_ERROR "pkg-config --cflags --libs membound-cuda: '${flags}' (${rc})")
  endif()
endif()
message(STATUS "pkg-config: membound ${cflags}: built and ran")
