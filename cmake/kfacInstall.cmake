# SPDX-License-Identifier: Apache-2.0
# Install rules and the CMake package (kfacConfig.cmake + kfacConfigVersion.cmake) for kfac.
#
# Included at the end of the top-level CMakeLists.txt, after the targets exist. Each target
# gets its own export set, so the core package file never mentions MPI or CUDA:
#
#   <prefix>/include/kfac/...                       the headers (the targets' FILE_SETs)
#   <prefix>/share/cmake/kfac/kfacConfig.cmake      components: mpi, cuda, c10d
#   <prefix>/share/cmake/kfac/kfacConfigVersion.cmake
#   <prefix>/share/cmake/kfac/kfacFindBLAS.cmake       the BLAS finder, run again by the config
#   <prefix>/share/cmake/kfac/kfac-targets.cmake        kfac::kfac  (always)
#   <prefix>/share/cmake/kfac/kfac-mpi-targets.cmake    kfac::mpi   (when KFAC_HAS_MPI)
#   <prefix>/share/cmake/kfac/kfac-cuda-targets.cmake   kfac::cuda  (when KFAC_HAS_CUDA)
#   <prefix>/share/cmake/kfac/kfac-c10d-targets.cmake   kfac::c10d  (when KFAC_HAS_C10D)
#   <prefix>/share/cmake/kfac/kfac-engines-targets.cmake kfac::engines (KFAC_BUILD_ENGINES),
#   <prefix>/share/cmake/kfac/kfac-engines_mpi-targets.cmake kfac::engines_mpi (and MPI), with
#   <prefix>/lib/libkfac_engines*.a and <prefix>/include/kfac/engines/kfac_engines*.hpp
#
# The headers need no compiled part, so the package goes under DATADIR (share/) and its version
# file is ARCH_INDEPENDENT; the optional engines libraries are for the compiler and platform
# they were built with (kfacConfig.cmake checks the compiler when they are asked for). What the build found (the BLAS, MPI, CUDA) is recorded in kfacConfig.cmake,
# which finds the same dependencies again on the consumer's machine.

option(KFAC_INSTALL "Generate kfac's install rules and CMake package files" ${PROJECT_IS_TOP_LEVEL})
if(NOT KFAC_INSTALL)
  return()
endif()

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KFAC_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/kfac"
    CACHE STRING "Where kfacConfig.cmake is installed, relative to the install prefix")
mark_as_advanced(KFAC_INSTALL_CMAKEDIR)

# install(TARGETS) must name every interface header set a target has (the core has HEADERS;
# a component may get its own later), or CMake refuses to export it.
function(_kfac_install_target target export_set)
  set(file_sets)
  get_target_property(header_sets ${target} INTERFACE_HEADER_SETS)
  if(header_sets)
    foreach(set_name IN LISTS header_sets)
      list(APPEND file_sets FILE_SET ${set_name} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
    endforeach()
  endif()
  install(TARGETS ${target} EXPORT ${export_set} ${file_sets})
endfunction()

_kfac_install_target(kfac kfac-targets)
install(EXPORT kfac-targets NAMESPACE kfac:: DESTINATION ${KFAC_INSTALL_CMAKEDIR}
        COMPONENT kfac_development)

# CUDA sources (.cuh) are not in the core's .hpp file set; install whatever exists.
install(DIRECTORY ${kfac_SOURCE_DIR}/include/kfac DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        COMPONENT kfac_development FILES_MATCHING PATTERN "*.cuh")

# One export set per component the build has (kfac_<component> targets, exported as kfac::<component>).
set(_kfac_available_components)
foreach(_kfac_component IN ITEMS mpi c10d cuda)
  string(TOUPPER ${_kfac_component} _kfac_upper)
  if(KFAC_HAS_${_kfac_upper} AND TARGET kfac_${_kfac_component})
    _kfac_install_target(kfac_${_kfac_component} kfac-${_kfac_component}-targets)
    install(EXPORT kfac-${_kfac_component}-targets NAMESPACE kfac:: DESTINATION ${KFAC_INSTALL_CMAKEDIR}
            COMPONENT kfac_development)
    list(APPEND _kfac_available_components ${_kfac_component})
  endif()
endforeach()

# kfac::engines (and kfac::engines_mpi): static libraries of the common engines, each with the
# header of its `extern template` declarations, which a program linking it includes first.
if(KFAC_BUILD_ENGINES)
  foreach(_kfac_engines IN ITEMS engines engines_mpi)
    if(TARGET kfac_${_kfac_engines})
      get_target_property(_kfac_header kfac_${_kfac_engines} KFAC_ENGINES_HEADER)
      install(TARGETS kfac_${_kfac_engines} EXPORT kfac-${_kfac_engines}-targets
              ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT kfac_development)
      install(FILES ${_kfac_header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kfac/engines
              COMPONENT kfac_development)
      install(EXPORT kfac-${_kfac_engines}-targets NAMESPACE kfac:: DESTINATION ${KFAC_INSTALL_CMAKEDIR}
              COMPONENT kfac_development)
      list(APPEND _kfac_available_components ${_kfac_engines})
    endif()
  endforeach()
  unset(_kfac_header)
  unset(_kfac_engines)
endif()

# The BLAS finder goes beside kfacConfig.cmake, which runs it again with the choice this build
# made (KFAC_BLAS_USED), so the consumer's own scipy-openblas32 or OpenBLAS is linked.
install(FILES ${CMAKE_CURRENT_LIST_DIR}/kfacFindBLAS.cmake DESTINATION ${KFAC_INSTALL_CMAKEDIR}
        COMPONENT kfac_development)

configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/kfacConfig.cmake.in
  ${PROJECT_BINARY_DIR}/kfac-package/kfacConfig.cmake
  INSTALL_DESTINATION ${KFAC_INSTALL_CMAKEDIR}
  NO_SET_AND_CHECK_MACRO)
# 0.x: a minor release may break the API, so only the same major.minor satisfies a request.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/kfac-package/kfacConfigVersion.cmake
  VERSION ${kfac_VERSION}
  COMPATIBILITY SameMinorVersion
  ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/kfac-package/kfacConfig.cmake
              ${PROJECT_BINARY_DIR}/kfac-package/kfacConfigVersion.cmake
        DESTINATION ${KFAC_INSTALL_CMAKEDIR} COMPONENT kfac_development)

unset(_kfac_available_components)
