// SPDX-License-Identifier: Apache-2.0
/// @file bench_norm.cpp
/// What a normalisation layer's unit-wise blocks cost: one full K-FAC step (statistics, running
/// average, closed-form block inverses, preconditioning; both intervals 1) of a LayerNorm(C)
/// over 4,096 tokens ([32, 128, C], weight sharing expand) and of a BatchNorm2d(C) over
/// [32, C, 8, 8], against a Linear(C → C) on the same tokens, the layer a transformer block
/// puts next to each LayerNorm. Float32.
///
///   norm/<method>/layer_norm/C   the LayerNorm's C blocks of 2 × 2
///   norm/<method>/batch_norm/C   the BatchNorm's, from per-example sums over 64 positions
///   norm/<method>/linear/C       the Linear's C × C (+ bias) Kronecker factors
///
/// The ratio linear / layer_norm at one C is the figure to read. Run with OPENBLAS_NUM_THREADS=1.

#include <benchmark/benchmark.h>

#include "bench_main.hpp"
#include "one_layer_steps.hpp"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <kfac/kfac.hpp>

namespace {

constexpr std::int64_t examples = 32, tokens = 128, positions = 8 * 8;

enum class layer { layer_norm, batch_norm, linear };

/// The buffers of one layer of width C with a bias (shift).
struct norm_case {
    std::vector<float> input, grad_output, grad_weight, grad_bias, saved_weight, saved_bias;
    kfac::layer_view<float> view;

    norm_case(layer kind, std::int64_t c) {
        std::mt19937 gen(11);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        const std::int64_t rows = kind == layer::batch_norm ? examples * positions : examples * tokens;
        for (std::int64_t i = 0; i < rows * c; ++i) input.push_back(normal(gen));
        for (std::int64_t i = 0; i < rows * c; ++i) grad_output.push_back(normal(gen) / float(rows));
        const std::int64_t weights = kind == layer::linear ? c * c : c;
        for (std::int64_t i = 0; i < weights; ++i) saved_weight.push_back(0.01f * normal(gen));
        for (std::int64_t i = 0; i < c; ++i) saved_bias.push_back(0.01f * normal(gen));
        grad_weight = saved_weight;
        grad_bias = saved_bias;
        const std::vector<std::int64_t> shape = kind == layer::batch_norm ? std::vector<std::int64_t>{examples, c, 8, 8}
                                                                          : std::vector<std::int64_t>{examples, tokens, c};
        view.input = kfac::tensor_view<const float>::from_extents(input.data(), shape);
        view.grad_output = kfac::tensor_view<const float>::from_extents(grad_output.data(), shape);
        view.grad_bias = kfac::tensor_view<float>(grad_bias.data(), {c});
        switch (kind) {
            case layer::layer_norm: view.description = kfac::layer_norm_description(c, true); break;
            case layer::batch_norm: view.description = kfac::batch_norm_description(c, true); break;
            case layer::linear: view.description = kfac::linear_description(c, c, true); break;
        }
        view.grad_weight = kind == layer::linear ? kfac::tensor_view<float>(grad_weight.data(), {c, c})
                                                 : kfac::tensor_view<float>(grad_weight.data(), {c});
    }
};

template <class Method>
void bm_norm(benchmark::State& state, layer kind) {
    const std::int64_t c = state.range(0);
    norm_case n(kind, c);
    kfac_bench::time_full_steps<Method>(state, n.view, [&] {
        n.grad_weight = n.saved_weight;
        n.grad_bias = n.saved_bias;
    });
    state.counters["C"] = static_cast<double>(c);
}

void register_all() {
    auto all = [](const char* method, auto fn) {
        for (const auto& [name, kind] : {std::pair{"layer_norm", layer::layer_norm}, std::pair{"batch_norm", layer::batch_norm},
                                         std::pair{"linear", layer::linear}})
            benchmark::RegisterBenchmark((std::string("norm/") + method + "/" + name).c_str(), fn, kind)
                ->Arg(256)->Arg(1024)->Unit(benchmark::kMillisecond);
    };
    all("eigen", bm_norm<kfac::compute::eigendecomposition>);
    all("inverse", bm_norm<kfac::compute::inverse>);
}

}  // namespace

int main(int argc, char** argv) {
    register_all();
    return kfac_bench::run_cpu_benchmarks(argc, argv);
}
