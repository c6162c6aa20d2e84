// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file bench_main.hpp
/// The end of every CPU benchmark binary's main(), once its benchmarks are registered: the
/// BLAS context in the report (blas_context.hpp), then Google Benchmark's own run.

#include <benchmark/benchmark.h>

#include "blas_context.hpp"

namespace kfac_bench {

inline int run_cpu_benchmarks(int argc, char** argv) {
    add_blas_context();
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}

}  // namespace kfac_bench
