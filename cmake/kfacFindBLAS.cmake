# SPDX-License-Identifier: Apache-2.0
# Finds the BLAS/LAPACK behind kfac's CPU backend and describes it as an imported target.
# The top-level CMakeLists.txt calls it with the KFAC_BLAS option; the installed package
# (kfacConfig.cmake, beside which this file is installed) calls it again on the consumer's
# machine with the choice the build made, so no path of the build machine is recorded.
#
#   kfac_find_blas(<choice> <prefix>)
#
#   <choice>  auto              scipy-openblas32 when python3 can import it, else Debian's
#                               OpenBLAS when pkg-config finds it, else eigen
#             scipy-openblas32  OpenBLAS from the PyPI wheel (python3 -m pip install
#                               scipy-openblas32): a current release, so it knows current CPUs
#             openblas          pkg-config's lapacke + openblas (Debian: liblapacke-dev
#                               libopenblas-dev; 0.3.21 on Debian 12)
#             eigen             no BLAS: Eigen's own kernels only
#
#   Sets in the caller's scope:
#     <prefix>_FOUND        TRUE when <choice> (for auto: one of them) was found
#     <prefix>_CHOICE       what was found: scipy-openblas32, openblas or eigen
#     <prefix>_TARGET       the imported target to link; empty for eigen
#     <prefix>_DESCRIPTION  one line saying which library, for a status message
#     <prefix>_WHY          when not found: why, and what to install
#
#   The targets (imported, in the calling directory), each carrying KFAC_HAS_LAPACK=1:
#     kfac_blas::scipy_openblas32  the wheel's libscipy_openblas and headers, whose symbols carry
#                                  the prefix scipy_ (KFAC_BLAS_SYMBOL_PREFIX=scipy_); linked with
#                                  an rpath to the wheel's directory, as its own pkg-config file
#                                  does, so programs run without LD_LIBRARY_PATH
#     kfac_blas::openblas          PkgConfig::KFAC_LAPACKE + PkgConfig::KFAC_OPENBLAS
include_guard(GLOBAL)

set(KFAC_BLAS_CHOICES auto scipy-openblas32 openblas eigen)

# The wheel's directories, library and symbol prefix, from python3 -c 'import scipy_openblas32'.
function(_kfac_find_scipy_openblas32 prefix)
  set(${prefix}_FOUND FALSE PARENT_SCOPE)
  if(Python3_EXECUTABLE)
    set(python ${Python3_EXECUTABLE})
  else()
    find_program(KFAC_PYTHON3_EXECUTABLE NAMES python3 python
                 DOC "python3 through which kfac looks for the scipy-openblas32 wheel")
    set(python ${KFAC_PYTHON3_EXECUTABLE})
  endif()
  if(NOT python)
    set(${prefix}_WHY "python3 was not found, so the scipy-openblas32 wheel cannot be located (put python3 on PATH or set KFAC_PYTHON3_EXECUTABLE)" PARENT_SCOPE)
    return()
  endif()
  # The prefix comes from the wheel's own pkg-config text (-DBLAS_SYMBOL_PREFIX=scipy_).
  set(script [=[
import re
import scipy_openblas32 as s
prefix = re.search(r"BLAS_SYMBOL_PREFIX=(\w+)", s.get_pkg_config())
print(s.get_include_dir())
print(s.get_lib_dir())
print(s.get_library())
print(s.__version__)
print(prefix.group(1) if prefix else "scipy_")
]=])
  execute_process(COMMAND ${python} -c "${script}" OUTPUT_VARIABLE output RESULT_VARIABLE rc
                  ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    set(${prefix}_WHY "${python} cannot import scipy_openblas32 (python3 -m pip install scipy-openblas32)" PARENT_SCOPE)
    return()
  endif()
  string(REPLACE "\n" ";" fields "${output}")
  list(LENGTH fields count)
  if(NOT count EQUAL 5)
    set(${prefix}_WHY "scipy_openblas32 answered unexpectedly: ${output}" PARENT_SCOPE)
    return()
  endif()
  list(GET fields 0 include_dir)
  list(GET fields 1 lib_dir)
  list(GET fields 2 library_name)
  list(GET fields 3 version)
  list(GET fields 4 symbol_prefix)
  find_library(library NAMES ${library_name} PATHS ${lib_dir} NO_DEFAULT_PATH NO_CACHE)
  if(NOT library OR NOT EXISTS "${include_dir}/cblas.h" OR NOT EXISTS "${include_dir}/lapacke.h")
    set(${prefix}_WHY "the scipy-openblas32 wheel at ${lib_dir} lacks lib${library_name} or its headers (reinstall it: python3 -m pip install --force-reinstall scipy-openblas32)" PARENT_SCOPE)
    return()
  endif()
  set(target kfac_blas::scipy_openblas32)
  if(NOT TARGET ${target})
    add_library(${target} SHARED IMPORTED)
    set_target_properties(${target} PROPERTIES
      IMPORTED_LOCATION "${library}"
      INTERFACE_INCLUDE_DIRECTORIES "${include_dir}"
      INTERFACE_COMPILE_DEFINITIONS "KFAC_HAS_LAPACK=1;KFAC_BLAS_SYMBOL_PREFIX=${symbol_prefix}"
      # CMake puts the directory in the build tree's rpath by itself; this keeps it in
      # installed programs too (the wheel's pkg-config file does the same).
      INTERFACE_LINK_OPTIONS "LINKER:-rpath,${lib_dir}")
  endif()
  set(${prefix}_FOUND TRUE PARENT_SCOPE)
  set(${prefix}_TARGET ${target} PARENT_SCOPE)
  set(${prefix}_DESCRIPTION "scipy-openblas32 ${version} (${library})" PARENT_SCOPE)
endfunction()

# Debian's OpenBLAS and LAPACKE through pkg-config.
function(_kfac_find_debian_openblas prefix)
  set(${prefix}_FOUND FALSE PARENT_SCOPE)
  set(why "pkg-config cannot find lapacke and openblas (Debian: apt install liblapacke-dev libopenblas-dev)")
  find_package(PkgConfig QUIET)
  if(NOT PkgConfig_FOUND)
    set(${prefix}_WHY "${why}; pkg-config itself is missing (apt install pkg-config)" PARENT_SCOPE)
    return()
  endif()
  pkg_check_modules(KFAC_LAPACKE QUIET IMPORTED_TARGET lapacke)
  pkg_check_modules(KFAC_OPENBLAS QUIET IMPORTED_TARGET openblas)
  if(NOT (TARGET PkgConfig::KFAC_LAPACKE AND TARGET PkgConfig::KFAC_OPENBLAS))
    set(${prefix}_WHY "${why}" PARENT_SCOPE)
    return()
  endif()
  set(target kfac_blas::openblas)
  if(NOT TARGET ${target})
    add_library(${target} INTERFACE IMPORTED)
    set_target_properties(${target} PROPERTIES
      INTERFACE_LINK_LIBRARIES "PkgConfig::KFAC_LAPACKE;PkgConfig::KFAC_OPENBLAS"
      INTERFACE_COMPILE_DEFINITIONS "KFAC_HAS_LAPACK=1")
  endif()
  set(${prefix}_FOUND TRUE PARENT_SCOPE)
  set(${prefix}_TARGET ${target} PARENT_SCOPE)
  set(${prefix}_DESCRIPTION "OpenBLAS ${KFAC_OPENBLAS_VERSION} + LAPACKE ${KFAC_LAPACKE_VERSION} through pkg-config" PARENT_SCOPE)
endfunction()

function(kfac_find_blas choice prefix)
  if(NOT choice IN_LIST KFAC_BLAS_CHOICES)
    list(JOIN KFAC_BLAS_CHOICES ", " known)
    message(FATAL_ERROR "kfac: unknown BLAS choice '${choice}' (KFAC_BLAS); the choices are: ${known}")
  endif()
  set(found FALSE)
  set(found_as)
  set(target)
  set(description "none: Eigen's own kernels only")
  set(why)
  if(choice STREQUAL "eigen")
    set(found TRUE)
    set(found_as eigen)
  endif()
  foreach(candidate IN ITEMS scipy-openblas32 openblas)
    if(found OR NOT (choice STREQUAL candidate OR choice STREQUAL "auto"))
      continue()
    endif()
    if(candidate STREQUAL "scipy-openblas32")
      _kfac_find_scipy_openblas32(candidate_blas)
    else()
      _kfac_find_debian_openblas(candidate_blas)
    endif()
    if(candidate_blas_FOUND)
      set(found TRUE)
      set(found_as ${candidate})
      set(target ${candidate_blas_TARGET})
      set(description "${candidate_blas_DESCRIPTION}")
    else()
      list(APPEND why "${candidate}: ${candidate_blas_WHY}")
    endif()
  endforeach()
  if(NOT found AND choice STREQUAL "auto")
    set(found TRUE)
    set(found_as eigen)
    list(JOIN why "; " reasons)
    set(description "none: Eigen's own kernels only (${reasons})")
  endif()
  list(JOIN why "; " why)
  set(${prefix}_FOUND ${found} PARENT_SCOPE)
  set(${prefix}_CHOICE ${found_as} PARENT_SCOPE)
  set(${prefix}_TARGET ${target} PARENT_SCOPE)
  set(${prefix}_DESCRIPTION "${description}" PARENT_SCOPE)
  set(${prefix}_WHY "${why}" PARENT_SCOPE)
endfunction()
