# cmake -DCOMPILER=... -DSOURCE=... -DINCLUDE_DIRS=dir1|dir2 [-DSTD=c++17] -P expect_compile_failure.cmake
# Prints the compiler's diagnostics when it rejects SOURCE (ctest then matches the expected
# sentence), and a marker that the FAIL regex catches when it accepts it.
foreach(var COMPILER SOURCE INCLUDE_DIRS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "expect_compile_failure.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT DEFINED STD)
  set(STD c++20)
endif()
string(REPLACE "|" ";" include_dirs "${INCLUDE_DIRS}")
set(include_flags)
foreach(dir IN LISTS include_dirs)
  list(APPEND include_flags "-I${dir}")
endforeach()
execute_process(
  COMMAND ${COMPILER} -std=${STD} -fsyntax-only ${include_flags} ${SOURCE}
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE out
  ERROR_VARIABLE out)
if(rc EQUAL 0)
  message(FATAL_ERROR "MEMBOUND_UNEXPECTEDLY_COMPILED: ${SOURCE} compiled, but it must not")
endif()
message("${out}")
