# The preconditioner engines this project's own programs (tests, benchmarks, examples) use,
# compiled once (docs/development.md, "Compile time"). The library stays header-only: a user's program
# instantiates what it uses, as before. Here, each engine (backend x scalar x communicator x
# compute method; the assignment strategy is a value, kfac/detail/engine.hpp) is instantiated
# once in a generated translation unit of a static library (one translation unit holding all
# four: the code the engines share whatever their types, checkpoint parsing, option checks, the
# skip filter's std::regex, was 40 % of an engine's object code, and is then compiled once for
# four engines; the float pair alone took 38.8 s of CPU, all four 59.1 s), and every program
# linked with that
# library sees, through a header the compiler includes first (-include; nvcc's --pre-include,
# so that a .cu file's CPU preconditioners are not compiled by nvcc either), the declaration
# `extern template class kfac::detail::engine<...>`: its member functions, which engine.hpp
# defines out of the class, are then not compiled again in that program.
#
#   kfac_engines       cpu_eigen<float|double> x comm::serial x eigendecomposition|inverse|ekfac, and
#                      the block kinds' operations (kfac/blocks/) on those backends and methods,
#                      which every communicator's engines share: measured, declaring them here
#                      took kfac_engines_mpi.cpp from 42.6 s to 18.0 s of CPU; and the backend
#                      cpu_eigen<float|double> itself with Eigen's solvers on its matrices
#                      (measured, each alone, old and new one after the other: the Catch2
#                      batches 80.7 -> 59.4 s and 56.3 -> 44.6 s, mpi_test.cpp 30.6 -> 21.9 s)
#   kfac_engines_mpi   the same with comm::mpi (when MPI is found), plus kfac_engines
#   kfac_engines_process_group   the same with comm::process_group (when LibTorch is found)
#   kfac_engines_cuda  backend::cuda<float|double> x comm::serial x both methods, by nvcc, for
#                      the CUDA sources of the programs that link it (kfac_add_cuda_engines)
#
# Only for programs built with the same definitions and target flags as the library they link
# (a program compiled with other BLAS or Eigen settings, as kfac_traces_fixed and the Prescott
# test are, must not link them; the -march=native benchmarks link their own, bench/). A layout
# that differs is a crash, not an error, so the header refers to a symbol named after Eigen's
# alignment (EIGEN_MAX_ALIGN_BYTES, which -mavx or -mavx512f change) and only the library's own
# alignment is defined: a program of another alignment fails to link.
set(kfac_engines_dir ${PROJECT_BINARY_DIR}/kfac_engines)

# In a build with the tests the engines are compiled at -Og (GCC's; nvcc's host compiler gets
# it as -Xcompiler): measured, kfac_engines.cpp took 42.8 s of CPU at -O1 against 64.9 s at
# -O3, and -Og took it and the MPI engines 13 % and 28 % below -O1 again (ninja's log,
# normalised), with the examples' runs no slower; the flagship's K-FAC runs took as long with
# either (their time is BLAS, LAPACK and LibTorch) with the same output; every level gives the
# same numbers (no -ffast-math, no FMA contraction; traces.* replays fixtures recorded at -O3
# bit for bit). A build of the benchmarks alone keeps the build type's level.
if(KFAC_BUILD_TESTS)
  set(kfac_engines_default_optimization -Og)
else()
  set(kfac_engines_default_optimization "")
endif()
set(KFAC_ENGINES_OPTIMIZATION "${kfac_engines_default_optimization}" CACHE STRING
    "Optimisation flag of the engine libraries (empty: the build type's; docs/development.md, \"Compile time\")")

# kfac_add_engines(<target> <backend: cpu_eigen|cuda> <comm: serial|mpi|process_group>
#                  <quoted header to include>...)
# The scalar types are kfac_engine_scalars when the caller sets it, else float and double. A
# cuda library is compiled by nvcc (call it where the CUDA language is enabled) and declared to
# the CUDA sources of the programs that link it only (--pre-include; their C++ sources never
# see backend::cuda).
function(kfac_add_engines target backend comm)
  # A call of an older signature (without the backend) generated C++ that does not compile, in
  # a configuration the test build does not configure (bench/, KFAC_BENCH_NATIVE): say so here.
  if(NOT backend MATCHES "^(cpu_eigen|cuda)$" OR NOT comm MATCHES "^(serial|mpi|process_group)$")
    message(FATAL_ERROR "kfac_add_engines(${target} ${backend} ${comm} ...): the backend must be "
                        "cpu_eigen or cuda and the communicator serial, mpi or process_group")
  endif()
  if(NOT kfac_engine_scalars)
    set(kfac_engine_scalars float double)
  endif()
  if(backend STREQUAL "cuda")
    set(header ${kfac_engines_dir}/${target}.cuh)
    set(sources ${kfac_engines_dir}/${target}.cu)
  else()
    set(header ${kfac_engines_dir}/${target}.hpp)
    set(sources ${kfac_engines_dir}/${target}.cpp)
  endif()
  string(TOUPPER ${target} TARGET)
  set(includes)
  foreach(h IN LISTS ARGN)
    string(APPEND includes "#include ${h}\n")
  endforeach()
  set(declarations)
  set(definitions)
  foreach(scalar IN LISTS kfac_engine_scalars)
    if(backend STREQUAL "cpu_eigen" AND comm STREQUAL "serial")
      # The CPU backend itself: its Eigen solvers (kfac/backend/cpu_eigen.hpp defines them out
      # of the class) are then compiled here once, not again in every program that instantiates
      # a preconditioner of another communicator or backend, or calls the backend directly.
      string(APPEND declarations "extern template class kfac::backend::cpu_eigen<${scalar}>;\n")
      string(APPEND definitions "template class kfac::backend::cpu_eigen<${scalar}>;\n")
      # And Eigen's solvers on the backend's matrix type, which the tests' oracles and the
      # benchmarks also call: the symmetric eigensolver's and LLT's compute (member templates,
      # named with their argument type) and PartialPivLU.
      set(eigen_matrix "Eigen::Matrix<${scalar}, Eigen::Dynamic, Eigen::Dynamic>")
      set(eigen_solver "Eigen::SelfAdjointEigenSolver<${eigen_matrix}>")
      set(eigen_llt "Eigen::LLT<${eigen_matrix}, Eigen::Lower>")
      foreach(instance
              "${eigen_solver}& ${eigen_solver}::compute(const Eigen::EigenBase<${eigen_matrix}>&, int)"
              "${eigen_llt}& ${eigen_llt}::compute(const Eigen::EigenBase<${eigen_matrix}>&)"
              "class Eigen::PartialPivLU<${eigen_matrix}>")
        string(APPEND declarations "extern template ${instance};\n")
        string(APPEND definitions "template ${instance};\n")
      endforeach()
    endif()
    # compute::ekfac: the CPU engines; the CUDA test program instantiates its one use itself
    # (here it would add a third method to every nvcc build of these engines).
    set(methods eigendecomposition inverse)
    if(backend STREQUAL "cpu_eigen")
      list(APPEND methods ekfac)
    endif()
    foreach(method IN LISTS methods)
      set(backend_type "kfac::backend::${backend}<${scalar}>")
      set(types "kfac::detail::engine<${backend_type}, kfac::comm::${comm}, kfac::compute::${method}>")
      if(backend STREQUAL "cpu_eigen" AND comm STREQUAL "serial")
        # The block kinds' operations do not depend on the communicator: the serial library
        # compiles them once for the engines of every communicator (the others link it).
        set(impl "kfac::detail::compute_impl<kfac::compute::${method}, ${backend_type}>")
        foreach(kind kronecker diagonal unit_wise)
          list(APPEND types "kfac::blocks::${kind}::ops<${backend_type}, ${impl}>")
        endforeach()
      endif()
      foreach(type IN LISTS types)
        string(APPEND declarations "extern template class ${type};\n")
        string(APPEND definitions "template class ${type};\n")
      endforeach()
      # The registration of the library's own views (member templates, which an explicit
      # instantiation of the class leaves out): the layer checks and the layer records.
      set(engine "kfac::detail::engine<${backend_type}, kfac::comm::${comm}, kfac::compute::${method}>")
      set(view "kfac::layer_view<${scalar}>")
      foreach(member
              "bool ${engine}::register_layer<${view}>(const std::string&, ${view}&)"
              "std::size_t ${engine}::register_layers<${view}>(const std::vector<std::pair<std::string, ${view}*>>&)")
        string(APPEND declarations "extern template ${member};\n")
        string(APPEND definitions "template ${member};\n")
      endforeach()
    endforeach()
  endforeach()
  get_filename_component(header_name ${header} NAME)
  file(CONFIGURE OUTPUT ${sources} CONTENT "// Generated by cmake/kfacEngineInstances.cmake.
#include \"${header_name}\"
const int ${TARGET}_ABI = EIGEN_MAX_ALIGN_BYTES;  // external: declared extern above
${definitions}")
  file(CONFIGURE OUTPUT ${header} CONTENT "// Generated by cmake/kfacEngineInstances.cmake: the engines the ${target} library
// compiles once; a translation unit that sees these declarations links them.
#pragma once
${includes}
${declarations}
// Refers to the symbol only a library of this program's Eigen alignment defines.
#define ${TARGET}_ABI_NAME(align) ${target}_eigen_align_##align
#define ${TARGET}_ABI_EXPAND(align) ${TARGET}_ABI_NAME(align)
#define ${TARGET}_ABI ${TARGET}_ABI_EXPAND(EIGEN_MAX_ALIGN_BYTES)
extern const int ${TARGET}_ABI;
[[gnu::used]] static const int* const ${target}_abi_check = &${TARGET}_ABI;
")
  add_library(${target} STATIC ${sources})
  if(backend STREQUAL "cuda")
    target_link_libraries(${target} PUBLIC kfac::cuda kfac_engines)
    set_target_properties(${target} PROPERTIES CUDA_EXTENSIONS OFF)
    # nvcc takes -O0 to -O3 only: the level reaches its host compiler as -Xcompiler.
    if(KFAC_ENGINES_OPTIMIZATION)
      target_compile_options(${target} PRIVATE -Xcompiler=${KFAC_ENGINES_OPTIMIZATION})
    endif()
    target_compile_options(${target} PRIVATE -std=c++20
                           INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:--pre-include=${header}>)
    # EIGEN_NO_CUDA for this library and every nvcc program linking it (the project's own; the
    # headers' checks compile without it, as a user's file does): nvcc also compiles the CPU
    # backend kfac.hpp brings, and without it every Eigen function is __host__ __device__, so
    # nvcc's device pass instantiates the CPU backend's Eigen code too (and warns, diagnostic
    # 20014, that those call host functions). No device code here uses Eigen. Measured: this
    # library's file 80.9 s of CPU without, 65.1 s with; cuda_backend_test.cu 88.6 / 82.7 s.
    target_compile_definitions(${target} PUBLIC $<$<COMPILE_LANGUAGE:CUDA>:EIGEN_NO_CUDA>)
  else()
    target_link_libraries(${target} PUBLIC kfac::kfac)
    # The declarations' header from the build tree, or, for an installed kfac::engines, from
    # the install prefix (kfacInstall.cmake installs it there).
    set(used_header "$<BUILD_INTERFACE:${header}>$<INSTALL_INTERFACE:$<INSTALL_PREFIX>/${CMAKE_INSTALL_INCLUDEDIR}/kfac/engines/${header_name}>")
    target_compile_options(${target} PRIVATE ${KFAC_ENGINES_OPTIMIZATION} -Wall -Wextra -Werror
                           INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-include${used_header}>
                                     $<$<COMPILE_LANGUAGE:CUDA>:--pre-include=${used_header}>)
  endif()
  set_target_properties(${target} PROPERTIES KFAC_ENGINES_HEADER ${header})
endfunction()

include(GNUInstallDirs)  # CMAKE_INSTALL_INCLUDEDIR, where an installed library finds its header
kfac_add_engines(kfac_engines cpu_eigen serial "\"kfac/kfac.hpp\"")
add_library(kfac::engines ALIAS kfac_engines)
set_target_properties(kfac_engines PROPERTIES EXPORT_NAME engines)
if(KFAC_HAS_MPI)
  kfac_add_engines(kfac_engines_mpi cpu_eigen mpi "\"kfac/kfac.hpp\"" "\"kfac/comm/mpi.hpp\"")
  target_link_libraries(kfac_engines_mpi PUBLIC kfac::mpi kfac_engines)
  add_library(kfac::engines_mpi ALIAS kfac_engines_mpi)
  set_target_properties(kfac_engines_mpi PROPERTIES EXPORT_NAME engines_mpi)
endif()
# The process-group engines serve this project's own programs only (not installed).
if(KFAC_HAS_C10D AND (KFAC_BUILD_TESTS OR KFAC_BUILD_BENCHMARKS OR KFAC_BUILD_EXAMPLES))
  kfac_add_engines(kfac_engines_process_group cpu_eigen process_group "\"kfac/kfac.hpp\""
                   "\"kfac/comm/process_group_gloo.hpp\"")
  target_link_libraries(kfac_engines_process_group PUBLIC kfac::c10d kfac_engines)
  kfac_torch_precompiled(kfac_engines_process_group)
endif()

# kfac_add_cuda_engines(<target>): backend::cuda<float|double> x comm::serial x both methods,
# for the nvcc programs of the directory that calls it (once per build). Tried with fewer nvcc
# programs and measured as a loss; with five programs using these engines it pays: the four
# engines took 51 s of CPU in one translation unit, and declaring them took
# kfac_handle_cuda.cu from 36.6 s to 18.8 s and cuda_backend_test.cu from 94 s to 70 s.
function(kfac_add_cuda_engines target)
  if(NOT TARGET ${target})
    kfac_add_engines(${target} cuda serial "\"kfac/kfac.hpp\"" "\"kfac/backend/cuda.cuh\"")
  endif()
endfunction()

# kfac_glue_program(<target>): a program whose numerical work runs in code compiled elsewhere
# (LibTorch's library, the engines above) is compiled at -O1: what is left in it is glue (models
# defined through LibTorch's API, the adapter's hooks, the training loop), where -O3 buys no speed
# but costs build time. Measured (docs/development.md, "Compile time"): kfac_fashion_mnist.cpp 62 s at -O3 and
# 51 s at -O1, its CNN test 17.0 s either way, with the same output to the last digit. Its .cu
# sources too (nvcc's -O is its host compiler's level; the test programs' -Og is C++ only).
function(kfac_glue_program target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX,CUDA>:-O1>)
endfunction()
