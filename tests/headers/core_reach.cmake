# SPDX-License-Identifier: Apache-2.0
# headers.core_reach (cmake -P): kfac/kfac.hpp includes, directly or through others, every core
# header. kfac_headers_core compiles kfac.hpp without the optional parts and, on their own, only
# the headers whose text depends on the configuration; a core header outside kfac.hpp's reach
# would never be compiled without the optional parts.
#   -DCXX=<compiler> -DSOURCE=<a file including kfac/kfac.hpp> -DINCLUDE=<include/>
#   -DEIGEN=<Eigen's include directories, |-separated> -DHEADERS=<core headers, relative to include/>
foreach(var CXX SOURCE INCLUDE EIGEN HEADERS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "core_reach.cmake: -D${var}=... is required")
  endif()
endforeach()
string(REPLACE "|" ";" eigen_dirs "${EIGEN}")
set(includes -I${INCLUDE})
foreach(dir IN LISTS eigen_dirs)
  list(APPEND includes -isystem ${dir})
endforeach()
# -MM would leave out headers found through -isystem, not ours; -M lists everything.
execute_process(COMMAND ${CXX} -std=c++20 -M ${includes} ${SOURCE}
                RESULT_VARIABLE rc OUTPUT_VARIABLE deps ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "core_reach.cmake: ${CXX} -M failed (${rc}):\n${err}")
endif()
set(missing)
foreach(header IN LISTS HEADERS)
  string(FIND "${deps}" "${INCLUDE}/${header}" at)
  if(at EQUAL -1)
    list(APPEND missing ${header})
  endif()
endforeach()
if(missing)
  list(JOIN missing "\n  " missing)
  message(FATAL_ERROR "kfac/kfac.hpp does not include these core headers, directly or through others:\n  ${missing}\n"
                      "Include them from kfac/kfac.hpp (or from a header it includes), or add them to the "
                      "optional parts' pattern in tests/headers/CMakeLists.txt.")
endif()
list(LENGTH HEADERS n)
message("kfac/kfac.hpp reaches all ${n} core headers")
