# GCC's garbage collector and this project's build time. GCC collects its heap whenever it has
# grown past a threshold that depends on the machine's memory (at most 128 MiB, then 100 %
# growth); a translation unit that instantiates whole preconditioners allocates 1.5 to 4 GiB and
# is collected many times. Raising the threshold (--param ggc-min-heapsize, ggc-min-expand) lets
# it finish with one collection or none: measured on the 2-core development machine, the
# Catch2 suite's first unity batch took 103 s of CPU and 2.2 GiB with the defaults, 85 s and
# 2.9 GiB with collection deferred; an engine translation unit 60 s and 56 s. The objects are
# the same either way (the collector decides when memory is reclaimed, not what is compiled).
#
# Only this project's own programs get the flags (tests, examples, benchmarks and their
# engines; add_compile_options does not reach kfac::kfac's users). KFAC_GCC_DEFER_COLLECTION:
# default ON with GCC when the machine has 5 GiB of memory for each job Ninja runs at once
# (cores + 2), since each compiler may then hold up to about 4.5 GiB.
set(kfac_defer_default OFF)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  cmake_host_system_information(RESULT kfac_memory_mib QUERY TOTAL_PHYSICAL_MEMORY)
  cmake_host_system_information(RESULT kfac_cores QUERY NUMBER_OF_LOGICAL_CORES)
  math(EXPR kfac_memory_wanted "5120 * (${kfac_cores} + 2)")
  if(kfac_memory_mib GREATER_EQUAL kfac_memory_wanted)
    set(kfac_defer_default ON)
  endif()
endif()
option(KFAC_GCC_DEFER_COLLECTION "Let GCC collect its heap less often while compiling this project's programs"
       ${kfac_defer_default})
if(KFAC_GCC_DEFER_COLLECTION)
  # 4 GiB before the first collection, then 400 % growth (the values are in KiB and percent).
  set(kfac_ggc_heap --param=ggc-min-heapsize=4194304)
  set(kfac_ggc_expand --param=ggc-min-expand=400)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:${kfac_ggc_heap}> $<$<COMPILE_LANGUAGE:CXX>:${kfac_ggc_expand}>
                      # nvcc hands its host compilation to the same GCC.
                      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${kfac_ggc_heap},${kfac_ggc_expand}>)
  message(STATUS "kfac: GCC's heap collected less often in this build (KFAC_GCC_DEFER_COLLECTION)")
endif()
