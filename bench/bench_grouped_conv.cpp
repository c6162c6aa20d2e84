// SPDX-License-Identifier: Apache-2.0
/// @file bench_grouped_conv.cpp
/// What a depthwise convolution's per-group blocks cost: one full K-FAC step (statistics,
/// running averages, decompositions or inverses, preconditioning; both intervals 1) of a
/// depthwise Conv2d(C → C, 3×3, padding 1, groups = C, bias) on [16, C, 16, 16] float inputs,
/// registered as C blocks with a 10 × 10 A and a 1 × 1 G each.
///
///   grouped_conv/<method>/depthwise/C   the C group blocks
///   grouped_conv/<method>/dense/C       a groups = 1 Conv2d of the same channels (A of
///                                       dimension 9C + 1, G of C), C ≤ 128, for scale
///
/// The counter us_per_group (wall time / C) stays flat in C when the per-block overhead
/// (one record, its tasks and its channel gather per group) does not grow with the count.

#include <benchmark/benchmark.h>

#include "bench_main.hpp"
#include "one_layer_steps.hpp"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <kfac/kfac.hpp>

namespace {

constexpr std::int64_t batch = 16, side = 16;

struct conv_case {
    std::vector<float> input, grad_output, grad_weight, saved_weight, grad_bias, saved_bias;
    kfac::layer_view<float> view;

    conv_case(std::int64_t channels, std::int64_t groups) {
        kfac::conv2d_geometry g;
        g.kernel = {3, 3};
        g.padding = {1, 1};
        g.groups = groups;
        view.description = kfac::conv2d_description(channels, channels, g, true);
        std::mt19937 gen(11);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        const std::int64_t elements = batch * channels * side * side;
        for (std::int64_t i = 0; i < elements; ++i) input.push_back(normal(gen));
        for (std::int64_t i = 0; i < elements; ++i) grad_output.push_back(normal(gen) / batch);
        const std::int64_t weights = channels * (channels / groups) * 9;
        for (std::int64_t i = 0; i < weights; ++i) saved_weight.push_back(0.01f * normal(gen));
        for (std::int64_t i = 0; i < channels; ++i) saved_bias.push_back(0.01f * normal(gen));
        grad_weight = saved_weight;
        grad_bias = saved_bias;
        view.input = kfac::tensor_view<const float>(input.data(), {batch, channels, side, side});
        view.grad_output = kfac::tensor_view<const float>(grad_output.data(), {batch, channels, side, side});
        view.grad_weight = kfac::tensor_view<float>(grad_weight.data(), {channels, channels / groups, 3, 3});
        view.grad_bias = kfac::tensor_view<float>(grad_bias.data(), {channels});
    }
};

template <class Method>
void bm_conv(benchmark::State& state, bool depthwise) {
    const std::int64_t channels = state.range(0);
    conv_case c(channels, depthwise ? channels : 1);
    const std::size_t blocks = kfac_bench::time_full_steps<Method>(state, c.view, [&] {
        c.grad_weight = c.saved_weight;
        c.grad_bias = c.saved_bias;
    });
    state.counters["C"] = static_cast<double>(channels);
    state.counters["blocks"] = static_cast<double>(blocks);
    // Wall seconds / (iterations · C · 1e-6): microseconds per group and step.
    state.counters["us_per_group"] = benchmark::Counter(static_cast<double>(state.iterations()) * static_cast<double>(channels) * 1e-6,
                                                        benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void register_all() {
    auto both = [](const char* method, auto fn) {
        benchmark::RegisterBenchmark((std::string("grouped_conv/") + method + "/depthwise").c_str(), fn, true)
            ->Arg(32)->Arg(128)->Arg(512)->UseRealTime()->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark((std::string("grouped_conv/") + method + "/dense").c_str(), fn, false)
            ->Arg(32)->Arg(128)->UseRealTime()->Unit(benchmark::kMillisecond);
    };
    both("eigen", bm_conv<kfac::compute::eigendecomposition>);
    both("inverse", bm_conv<kfac::compute::inverse>);
}

}  // namespace

int main(int argc, char** argv) {
    register_all();
    return kfac_bench::run_cpu_benchmarks(argc, argv);
}
