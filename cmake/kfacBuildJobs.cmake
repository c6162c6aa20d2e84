# How many of this project's compiles and links Ninja runs at once. Ninja's default is the
# number of cores + 2, meant to hide a job's waits on the disk; this project's jobs wait on
# nothing (a compile is 2-150 s of CPU over headers the page cache holds), so the two extra jobs
# only take turns on the cores with the others, and each one's caches are flushed at every turn.
# Measured on the 2-core development machine with four translation units of this build (the
# replay tool, the serial replay instances, the MPI engines, the Catch2 session) compiled four
# at once or two at a time: 38.4-41.1 s against 34.7-36.1 s of wall time, 73-79 s against
# 66-69 s of CPU (one at a time: 64 s).
#
# KFAC_BUILD_JOBS (Ninja generators, this project at the top level): the jobs at once, through
# a Ninja job pool that every compile and link joins; default the machine's logical cores;
# 0 leaves Ninja's own limit (-j). A `-j N` below the pool's size still limits the build to N.
# Custom commands (a precompiled header's link, generated sources) stay outside the pool.
if(CMAKE_GENERATOR MATCHES "Ninja" AND PROJECT_IS_TOP_LEVEL)
  cmake_host_system_information(RESULT kfac_logical_cores QUERY NUMBER_OF_LOGICAL_CORES)
  set(KFAC_BUILD_JOBS ${kfac_logical_cores} CACHE STRING
      "Compiles and links Ninja runs at once in this project (0: Ninja's own -j)")
  if(KFAC_BUILD_JOBS GREATER 0)
    set_property(GLOBAL APPEND PROPERTY JOB_POOLS kfac_jobs=${KFAC_BUILD_JOBS})
    set(CMAKE_JOB_POOL_COMPILE kfac_jobs)
    set(CMAKE_JOB_POOL_LINK kfac_jobs)
    set(CMAKE_JOB_POOL_PRECOMPILE_HEADER kfac_jobs)
    message(STATUS "kfac: at most ${KFAC_BUILD_JOBS} compiles and links at once (KFAC_BUILD_JOBS)")
  endif()
endif()
