// SPDX-License-Identifier: Apache-2.0
/// @file bench_embedding.cpp
/// What the diagonal A factor of an Embedding saves: one full K-FAC step (statistics, running
/// average, decomposition or inverse, preconditioning; both intervals 1) of an Embedding(V, E)
/// against the same layer written as the Linear(V → E) of one-hot inputs, whose A is a dense
/// V × V. Float32, R = 512 tokens per step, E = 128.
///
///   embedding/<method>/embedding/V   the Embedding (A stored and applied as V numbers)
///   embedding/<method>/one_hot/V     the one-hot Linear (A decomposed as V × V), V ≤ 2048
///
/// Both give the same preconditioned gradient (tests/unit/embedding_test.cpp); the ratio
/// one_hot / embedding at one V is the figure to read. Run with OPENBLAS_NUM_THREADS=1 or 2.

#include <benchmark/benchmark.h>

#include "bench_main.hpp"
#include "one_layer_steps.hpp"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <kfac/kfac.hpp>

namespace {

constexpr std::int64_t tokens = 512, width = 128;

/// The buffers of one layer, either way of writing it.
struct embedding_case {
    std::vector<float> ids, one_hot, grad_output, grad_weight, saved_weight;
    kfac::layer_view<float> view;

    embedding_case(std::int64_t vocabulary, bool as_one_hot) {
        std::mt19937 gen(7);
        std::uniform_int_distribution<std::int64_t> token(0, vocabulary - 1);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (std::int64_t i = 0; i < tokens; ++i) ids.push_back(static_cast<float>(token(gen)));
        for (std::int64_t i = 0; i < tokens * width; ++i) grad_output.push_back(normal(gen) / tokens);
        for (std::int64_t i = 0; i < vocabulary * width; ++i) saved_weight.push_back(0.01f * normal(gen));
        grad_weight = saved_weight;
        view.grad_output = kfac::tensor_view<const float>(grad_output.data(), {tokens, width});
        if (as_one_hot) {
            one_hot.assign(static_cast<std::size_t>(tokens * vocabulary), 0.0f);
            for (std::int64_t i = 0; i < tokens; ++i)
                one_hot[static_cast<std::size_t>(i * vocabulary + static_cast<std::int64_t>(ids[static_cast<std::size_t>(i)]))] = 1.0f;
            view.description = kfac::linear_description(vocabulary, width, false);
            view.input = kfac::tensor_view<const float>(one_hot.data(), {tokens, vocabulary});
            view.grad_weight = kfac::tensor_view<float>(grad_weight.data(), {width, vocabulary});
        } else {
            view.description = kfac::embedding_description(vocabulary, width);
            view.input = kfac::tensor_view<const float>(ids.data(), {tokens});
            view.grad_weight = kfac::tensor_view<float>(grad_weight.data(), {vocabulary, width});
        }
    }
};

template <class Method>
void bm_embedding(benchmark::State& state, bool as_one_hot) {
    const std::int64_t vocabulary = state.range(0);
    embedding_case c(vocabulary, as_one_hot);
    kfac_bench::time_full_steps<Method>(state, c.view, [&] { c.grad_weight = c.saved_weight; });
    state.counters["V"] = static_cast<double>(vocabulary);
}

void register_all() {
    auto both = [](const char* method, auto fn) {
        benchmark::RegisterBenchmark((std::string("embedding/") + method + "/embedding").c_str(), fn, false)
            ->Arg(512)->Arg(2048)->Arg(32768)->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark((std::string("embedding/") + method + "/one_hot").c_str(), fn, true)
            ->Arg(512)->Arg(2048)->Unit(benchmark::kMillisecond);
    };
    both("eigen", bm_embedding<kfac::compute::eigendecomposition>);
    both("inverse", bm_embedding<kfac::compute::inverse>);
}

}  // namespace

int main(int argc, char** argv) {
    register_all();
    return kfac_bench::run_cpu_benchmarks(argc, argv);
}
