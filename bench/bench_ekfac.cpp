// SPDX-License-Identifier: Apache-2.0
/// @file bench_ekfac.cpp
/// What EKFAC's scaling statistic costs (kfac/backend/detail/cpu_ekfac_scaling.hpp) beside the
/// K-FAC statistics it would be computed with: for one application of a layer, the A and G
/// statistics (accumulate_a_statistic + accumulate_g_statistic, as a factor-update step computes
/// them) against Ŝ in given eigenbases. Float32, on the CPU backend.
///
///   ekfac/<what>/linear_rows     Linear(512 → 512) on 256 examples, one row each
///   ekfac/<what>/linear_tokens   Linear(512 → 512) on [32, 64, 512]: Γ_n sums 64 rows
///   ekfac/<what>/conv            Conv2d(64 → 64, 3×3, padding 1) on [32, 64, 16, 16]
///
/// <what> is `statistics` or `scaling`; the ratio scaling / statistics of one layer is the figure
/// to read. Run with OPENBLAS_NUM_THREADS=1.

#include <benchmark/benchmark.h>

#include "bench_main.hpp"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <kfac/backend/detail/cpu_ekfac_scaling.hpp>
#include <kfac/kfac.hpp>

namespace {

using backend = kfac::backend::cpu_eigen<float>;
using matrix = backend::matrix;

enum class layer { linear_rows, linear_tokens, conv };

/// One application of a layer: its description, activations and output gradients as the
/// statistics read them, and orthonormal bases of its factors' sizes.
struct ekfac_case {
    kfac::layer_description d;
    std::vector<float> input, grad_output;
    std::vector<std::int64_t> input_shape, output_shape;
    matrix q_a, q_g;

    explicit ekfac_case(layer kind) {
        switch (kind) {
            case layer::linear_rows:
                d = kfac::linear_description(512, 512, true);
                input_shape = {256, 512};
                output_shape = {256, 512};
                break;
            case layer::linear_tokens:
                d = kfac::linear_description(512, 512, true);
                input_shape = {32, 64, 512};
                output_shape = {32, 64, 512};
                break;
            case layer::conv:
                d = kfac::conv2d_description(64, 64, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true);
                input_shape = {32, 64, 16, 16};
                output_shape = {32, 64, 16, 16};
                break;
        }
        std::mt19937 gen(5);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        input.resize(static_cast<std::size_t>(elements(input_shape)));
        grad_output.resize(static_cast<std::size_t>(elements(output_shape)));
        for (auto& x : input) x = normal(gen);
        for (auto& x : grad_output) x = 0.01f * normal(gen);
        q_a = basis(d.a_dim(), gen);
        q_g = basis(d.g_dim(), gen);
    }
    static std::int64_t elements(const std::vector<std::int64_t>& shape) {
        std::int64_t n = 1;
        for (auto e : shape) n *= e;
        return n;
    }
    /// The eigenvectors of a random covariance: orthonormal, as the eigen method's.
    static matrix basis(std::int64_t n, std::mt19937& gen) {
        std::normal_distribution<float> normal(0.0f, 1.0f);
        matrix m(n, n);
        for (std::int64_t i = 0; i < m.size(); ++i) m(i) = normal(gen);
        matrix q;
        backend::vector lambda;
        backend::symmetric_eigen(m * m.transpose(), q, lambda);
        return q;
    }
    kfac::tensor_view<const float> activations() const {
        return kfac::tensor_view<const float>::from_extents(input.data(), input_shape);
    }
    kfac::tensor_view<const float> output_gradients() const {
        return kfac::tensor_view<const float>::from_extents(grad_output.data(), output_shape);
    }
};

void bm_statistics(benchmark::State& state, layer kind) {
    const ekfac_case c(kind);
    matrix a_sum(c.d.a_dim(), c.d.a_dim()), g_sum(c.d.g_dim(), c.d.g_dim());
    backend::workspace a_ws, g_ws;
    for (auto _ : state) {
        backend::accumulate_a_statistic(a_sum, c.d, c.activations(), kfac::conv_patch_mode::reference, 0.0f, a_ws);
        backend::accumulate_g_statistic(g_sum, c.d, c.output_gradients(), 0.0f, g_ws);
        benchmark::DoNotOptimize(a_sum.data());
        benchmark::DoNotOptimize(g_sum.data());
    }
}

void bm_scaling(benchmark::State& state, layer kind) {
    const ekfac_case c(kind);
    matrix s;
    kfac::backend::detail::ekfac_scaling_scratch<float> ws;
    for (auto _ : state) {
        kfac::backend::detail::accumulate_ekfac_scaling(s, c.d, c.activations(), c.output_gradients(), c.q_a, c.q_g,
                                                        0.0f, ws);
        benchmark::DoNotOptimize(s.data());
    }
}

void register_all() {
    for (const auto& [name, kind] : {std::pair{"linear_rows", layer::linear_rows},
                                     std::pair{"linear_tokens", layer::linear_tokens}, std::pair{"conv", layer::conv}}) {
        benchmark::RegisterBenchmark((std::string("ekfac/statistics/") + name).c_str(), bm_statistics, kind)
            ->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark((std::string("ekfac/scaling/") + name).c_str(), bm_scaling, kind)
            ->Unit(benchmark::kMillisecond);
    }
}

}  // namespace

int main(int argc, char** argv) {
    register_all();
    return kfac_bench::run_cpu_benchmarks(argc, argv);
}
