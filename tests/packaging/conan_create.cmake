# SPDX-License-Identifier: Apache-2.0
# `conan create` of the recipe at SOURCE_DIR with its test_package, offline and hermetic:
# the Conan home (profiles, cache) is CONAN_HOME inside the build tree, no remote is asked,
# and test_package builds under TEST_FOLDER, not in the source tree.
#
#   cmake -DCONAN=<conan> -DSOURCE_DIR=<src> -DCONAN_HOME=<dir> -DTEST_FOLDER=<dir>
#         -DGENERATOR=<Ninja|Unix Makefiles> -DCMAKE_PROGRAM=<cmake> -DWITH_MPI=<True|False>
#         -P conan_create.cmake
cmake_minimum_required(VERSION 3.25)

foreach(var CONAN SOURCE_DIR CONAN_HOME TEST_FOLDER GENERATOR CMAKE_PROGRAM WITH_MPI)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "conan_create.cmake: ${var} is required")
  endif()
endforeach()

set(ENV{CONAN_HOME} "${CONAN_HOME}")
set(ENV{NO_COLOR} 1)

execute_process(COMMAND "${CONAN}" profile detect --exist-ok RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "conan_create.cmake: `conan profile detect` failed (${rc})")
endif()

file(REMOVE_RECURSE "${TEST_FOLDER}")
execute_process(
  COMMAND "${CONAN}" create "${SOURCE_DIR}" --build=missing --no-remote
          -s build_type=Release -s compiler.cppstd=20
          -o "kfac/*:with_mpi=${WITH_MPI}"
          -c "tools.cmake.cmaketoolchain:generator=${GENERATOR}"
          -c "tools.cmake:cmake_program=${CMAKE_PROGRAM}"
          -c "tools.cmake.cmake_layout:test_folder=${TEST_FOLDER}"
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE output
  ERROR_VARIABLE output)
message("${output}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "conan_create.cmake: `conan create` failed (${rc})")
endif()
# The package must come with our config and test_package must have run its step.
if(NOT output MATCHES "test_package: kfac [0-9.]+ from [^\n]*/share/cmake/kfac")
  message(FATAL_ERROR "conan_create.cmake: test_package did not find kfac's own kfacConfig.cmake")
endif()
if(NOT output MATCHES "test_package: comm=[a-z]+ steps=1 [^\n]*: PASS")
  message(FATAL_ERROR "conan_create.cmake: test_package did not report a passing step")
endif()
