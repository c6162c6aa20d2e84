// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file one_layer_steps.hpp
/// The timed loop of the one-layer benchmarks (bench_embedding, bench_grouped_conv): full
/// K-FAC steps (statistics, running averages, decompositions or inverses, preconditioning;
/// both intervals 1) of one float layer view on the CPU backend.

#include <benchmark/benchmark.h>

#include <cstddef>

#include <kfac/kfac.hpp>

namespace kfac_bench {

/// Times one step per iteration; `restore()` puts back, outside the timing, the gradients
/// step() overwrote. The first step (its allocations) is not timed.
/// @return the blocks the layer registered as (kfac::preconditioner::layer_count()).
template <class Method, class Restore>
std::size_t time_full_steps(benchmark::State& state, kfac::layer_view<float>& view, Restore&& restore) {
    kfac::options o;
    o.factor_update_steps = 1;
    o.inv_update_steps = 1;
    kfac::KFAC<kfac::backend::cpu_eigen<float>, kfac::comm::serial, Method> p(o);
    p.register_layer("layer", view);
    p.step();
    for (auto _ : state) {
        state.PauseTiming();
        restore();
        state.ResumeTiming();
        p.step();
        benchmark::DoNotOptimize(view.grad_weight.data);
    }
    return p.layer_count();
}

}  // namespace kfac_bench
