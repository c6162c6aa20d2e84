// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file blas_context.hpp
/// What every CPU benchmark's report says about the BLAS that produced its figures: the thread
/// count asked for, whether the LAPACK fast paths are compiled in, and which library and kernels
/// really ran (Debian's OpenBLAS falls back to generic kernels on CPUs it does not know).

#include <benchmark/benchmark.h>

#include <cstdlib>

#include <kfac/backend/blas_kernels.hpp>
#include <kfac/config.hpp>

namespace kfac_bench {

inline void add_blas_context() {
    const char* threads = std::getenv("OPENBLAS_NUM_THREADS");
    benchmark::AddCustomContext("OPENBLAS_NUM_THREADS", threads ? threads : "(unset)");
    benchmark::AddCustomContext("KFAC_HAS_LAPACK", KFAC_HAS_LAPACK ? "1" : "0");
    const auto& blas = kfac::backend::blas_kernels();
    benchmark::AddCustomContext("BLAS", blas.library);
    benchmark::AddCustomContext("BLAS kernels", blas.core_name + (blas.generic ? " (generic: LAPACK via Eigen)" : ""));
}

}  // namespace kfac_bench
