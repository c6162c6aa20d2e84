# SPDX-License-Identifier: Apache-2.0
# Installs a kfac build tree into a fresh prefix and checks what landed there.
#
#   cmake -DBUILD_DIR=<build> -DPREFIX=<prefix> [-DCONFIG=<cfg>] [-DHEADERS_FROM=<src>/include]
#         [-DEXPECT_COMPONENTS=mpi;cuda] [-DFORBIDDEN_PATHS=<dir>;<dir>] -P install_tree.cmake
#
# With -DSOURCE_DIR=<src> it first configures <src> into BUILD_DIR (any further -D options of
# the kfac project go in CONFIGURE_ARGS, generator in GENERATOR).
cmake_minimum_required(VERSION 3.25)

foreach(var BUILD_DIR PREFIX)
  if(NOT ${var})
    message(FATAL_ERROR "install_tree.cmake: ${var} is required")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " line "${ARGN}")
    message(FATAL_ERROR "install_tree.cmake: `${line}` failed (${rc})")
  endif()
endfunction()

if(SOURCE_DIR)
  file(REMOVE_RECURSE "${BUILD_DIR}")
  set(generator_args)
  if(GENERATOR)
    set(generator_args -G "${GENERATOR}")
  endif()
  run("${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${BUILD_DIR}" ${generator_args} ${CONFIGURE_ARGS})
endif()

file(REMOVE_RECURSE "${PREFIX}")
set(config_args)
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
run("${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${config_args})

# What every install has, and each component's targets file exactly when it was built.
set(cmakedir "${PREFIX}/share/cmake/kfac")
foreach(file IN ITEMS include/kfac/kfac.hpp include/kfac/comm/mpi.hpp
        share/cmake/kfac/kfacConfig.cmake share/cmake/kfac/kfacConfigVersion.cmake
        share/cmake/kfac/kfac-targets.cmake)
  if(NOT EXISTS "${PREFIX}/${file}")
    message(FATAL_ERROR "install_tree.cmake: ${PREFIX}/${file} was not installed")
  endif()
endforeach()
foreach(component IN ITEMS mpi cuda c10d engines engines_mpi)
  set(targets_file "${cmakedir}/kfac-${component}-targets.cmake")
  if(component IN_LIST EXPECT_COMPONENTS AND NOT EXISTS "${targets_file}")
    message(FATAL_ERROR "install_tree.cmake: ${targets_file} is missing although the build has ${component}")
  elseif(NOT component IN_LIST EXPECT_COMPONENTS AND EXISTS "${targets_file}")
    message(FATAL_ERROR "install_tree.cmake: ${targets_file} exists although the build lacks ${component}")
  endif()
endforeach()

# No package file points back into the source or build tree (a consumer must not depend on
# either still being there).
file(GLOB_RECURSE package_files "${cmakedir}/*.cmake")
foreach(file IN LISTS package_files)
  file(READ "${file}" text)
  foreach(path IN LISTS FORBIDDEN_PATHS)
    string(FIND "${text}" "${path}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "install_tree.cmake: ${file} mentions ${path}")
    endif()
  endforeach()
endforeach()

# The installed headers are exactly the source tree's .hpp and .cuh files.
file(GLOB_RECURSE headers RELATIVE "${PREFIX}/include" "${PREFIX}/include/*")
if(HEADERS_FROM)
  file(GLOB_RECURSE expected RELATIVE "${HEADERS_FROM}" "${HEADERS_FROM}/*.hpp" "${HEADERS_FROM}/*.cuh")
  # The engines' generated declarations, with their libraries, when the build has them.
  foreach(component IN ITEMS engines engines_mpi)
    if(component IN_LIST EXPECT_COMPONENTS)
      list(APPEND expected kfac/engines/kfac_${component}.hpp)
      if(NOT EXISTS "${PREFIX}/lib/libkfac_${component}.a" AND NOT EXISTS "${PREFIX}/lib64/libkfac_${component}.a")
        message(FATAL_ERROR "install_tree.cmake: libkfac_${component}.a was not installed")
      endif()
    endif()
  endforeach()
  set(missing ${expected})
  list(REMOVE_ITEM missing ${headers})
  set(extra ${headers})
  list(REMOVE_ITEM extra ${expected})
  if(missing OR extra)
    message(FATAL_ERROR "install_tree.cmake: installed headers differ from ${HEADERS_FROM}: "
                        "missing [${missing}], extra [${extra}] (headers added since the last build?)")
  endif()
endif()
list(LENGTH headers count)
message(STATUS "install_tree.cmake: ${count} headers and ${cmakedir} installed in ${PREFIX}")
