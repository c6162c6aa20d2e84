// SPDX-License-Identifier: Apache-2.0
/// @file bench_precision.cpp
/// What mixed precision costs and saves on the CPU backend: one full K-FAC step (statistics,
/// running averages, decompositions, preconditioning; both intervals 1) of a Linear(1024 →
/// 1024) over 4,096 rows and a Conv2d(64 → 64, 3 × 3) over [32, 64, 16, 16], float backend:
///
///   precision/fp32                 float views, float factors (the baseline)
///   precision/bf16_views           bf16 activations, output and weight gradients (converted)
///   precision/bf16_storage         float views, factors stored in bf16
///   precision/fp16_storage         float views, factors stored in fp16
///   precision/bf16_views_storage   both
///   precision/fp64_decompositions  float views, every decomposition in double
///
/// Counters: factor_MiB (memory_usage().factors) and err_vs_fp64, the relative error
/// max|P − P₆₄| / max|P₆₄| of the preconditioned weight gradients of one step against a double
/// backend fed the same (rounded) values. Ratios against precision/fp32 are the figures to
/// read (docs/precision.md). Run with OPENBLAS_NUM_THREADS=1.

#include <benchmark/benchmark.h>

#include "bench_main.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <kfac/detail/number_conversion.hpp>
#include <kfac/kfac.hpp>

namespace {

/// One layer's values (held as double), and its views in element type T.
template <class T>
struct layer_in {
    std::vector<T> input, grad_output, grad_weight, grad_bias, saved_weight;
    kfac::layer_view<T> view;
};

struct layer_values {
    kfac::layer_description description;
    std::vector<std::int64_t> input_shape, output_shape, weight_shape;
    std::vector<double> input, grad_output, grad_weight, grad_bias;
};

std::vector<double> normal(std::size_t n, std::uint32_t seed, double scale) {
    std::mt19937 gen(seed);
    std::normal_distribution<double> d(0.0, scale);
    std::vector<double> v(n);
    for (auto& x : v) x = d(gen);
    return v;
}

std::vector<layer_values> model() {
    std::vector<layer_values> m(2);
    m[0].description = kfac::linear_description(1024, 1024, true);
    m[0].input_shape = {4096, 1024};
    m[0].output_shape = {4096, 1024};
    m[0].weight_shape = {1024, 1024};
    m[1].description = kfac::conv2d_description(64, 64, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true);
    m[1].input_shape = {32, 64, 16, 16};
    m[1].output_shape = {32, 64, 16, 16};
    m[1].weight_shape = {64, 64, 3, 3};
    std::uint32_t seed = 1;
    for (auto& l : m) {
        auto count = [](const std::vector<std::int64_t>& s) {
            std::int64_t n = 1;
            for (auto e : s) n *= e;
            return static_cast<std::size_t>(n);
        };
        l.input = normal(count(l.input_shape), seed++, 1.0);
        l.grad_output = normal(count(l.output_shape), seed++, 1.0 / static_cast<double>(l.output_shape[0]));
        l.grad_weight = normal(count(l.weight_shape), seed++, 0.01);
        l.grad_bias = normal(static_cast<std::size_t>(l.description.out), seed++, 0.01);
    }
    return m;
}

/// The values rounded to T (once, to nearest).
template <class T>
std::vector<T> as(const std::vector<double>& v) {
    std::vector<T> out(v.size());
    kfac::detail::narrow(v.data(), static_cast<std::int64_t>(v.size()), kfac::precision_of<T>, out.data());
    return out;
}

template <class T>
std::vector<double> widened(const std::vector<T>& v) {
    std::vector<double> out(v.size());
    kfac::detail::widen(v.data(), static_cast<std::int64_t>(v.size()), kfac::precision_of<T>, out.data());
    return out;
}

template <class T>
std::vector<layer_in<T>> layers_in(const std::vector<layer_values>& m) {
    std::vector<layer_in<T>> out(m.size());
    for (std::size_t i = 0; i < m.size(); ++i) {
        auto& l = out[i];
        l.input = as<T>(m[i].input);
        l.grad_output = as<T>(m[i].grad_output);
        l.grad_weight = as<T>(m[i].grad_weight);
        l.grad_bias = as<T>(m[i].grad_bias);
        l.saved_weight = l.grad_weight;
        l.view.description = m[i].description;
        l.view.input = kfac::tensor_view<const T>::from_extents(l.input.data(), m[i].input_shape);
        l.view.grad_output = kfac::tensor_view<const T>::from_extents(l.grad_output.data(), m[i].output_shape);
        l.view.grad_weight = kfac::tensor_view<T>::from_extents(l.grad_weight.data(), m[i].weight_shape);
        l.view.grad_bias = kfac::tensor_view<T>(l.grad_bias.data(), {m[i].description.out});
    }
    return out;
}

/// max|x − r| / max|r| over every layer's weight gradient.
double relative_error(const std::vector<std::vector<double>>& x, const std::vector<std::vector<double>>& r) {
    double num = 0.0, den = 0.0;
    for (std::size_t l = 0; l < r.size(); ++l)
        for (std::size_t i = 0; i < r[l].size(); ++i) {
            num = std::max(num, std::abs(x[l][i] - r[l][i]));
            den = std::max(den, std::abs(r[l][i]));
        }
    return num / den;
}

kfac::options step_options() {
    kfac::options o;
    o.factor_update_steps = 1;
    o.inv_update_steps = 1;
    o.damping = 0.003;
    return o;
}

/// Views in T on a float backend with options `o`: timed steps, factor bytes, error vs fp64.
template <class T>
void bm_precision(benchmark::State& state, kfac::options o) {
    const auto values = model();
    // The reference: a double backend fed exactly the values the T views hold.
    std::vector<std::vector<double>> reference;
    {
        auto exact = layers_in<double>(values);
        for (std::size_t i = 0; i < exact.size(); ++i) {
            // Into the buffers the views point to: the values T holds, exactly.
            const auto round_into = [](const std::vector<double>& v, std::vector<double>& into) {
                const auto r = widened(as<T>(v));
                std::copy(r.begin(), r.end(), into.begin());
            };
            round_into(values[i].input, exact[i].input);
            round_into(values[i].grad_output, exact[i].grad_output);
            round_into(values[i].grad_bias, exact[i].grad_bias);
            round_into(values[i].grad_weight, exact[i].grad_weight);
        }
        kfac::options od = step_options();
        kfac::KFAC<kfac::backend::cpu_eigen<double>> p(od);
        for (std::size_t i = 0; i < exact.size(); ++i) p.register_layer("l" + std::to_string(i), exact[i].view);
        p.step();
        for (auto& l : exact) reference.push_back(l.grad_weight);
    }
    auto layers = layers_in<T>(values);
    kfac::KFAC<kfac::backend::cpu_eigen<float>> p(o);
    for (std::size_t i = 0; i < layers.size(); ++i) p.register_layer("l" + std::to_string(i), layers[i].view);
    p.step();  // the first step: allocations, not timed
    std::vector<std::vector<double>> got;
    for (auto& l : layers) got.push_back(widened(l.grad_weight));
    for (auto _ : state) {
        state.PauseTiming();
        for (auto& l : layers) std::copy(l.saved_weight.begin(), l.saved_weight.end(), l.grad_weight.begin());
        state.ResumeTiming();
        p.step();
        benchmark::DoNotOptimize(layers[0].grad_weight.data());
    }
    state.counters["factor_MiB"] = static_cast<double>(p.memory_usage().factors) / (1024.0 * 1024.0);
    state.counters["err_vs_fp64"] = relative_error(got, reference);
}

void register_all() {
    auto with = [](auto change) {
        kfac::options o = step_options();
        change(o);
        return o;
    };
    const auto none = [](kfac::options&) {};
    const auto bf16 = [](kfac::options& o) { o.factor_storage = kfac::precision::bf16; };
    const auto fp16 = [](kfac::options& o) { o.factor_storage = kfac::precision::fp16; };
    const auto fp64 = [](kfac::options& o) { o.fp64_decompositions = true; };
    auto add = [](const char* name, auto fn, kfac::options o) {
        benchmark::RegisterBenchmark((std::string("precision/") + name).c_str(), fn, o)->Unit(benchmark::kMillisecond);
    };
    add("fp32", bm_precision<float>, with(none));
    add("bf16_views", bm_precision<Eigen::bfloat16>, with(none));
    add("bf16_storage", bm_precision<float>, with(bf16));
    add("fp16_storage", bm_precision<float>, with(fp16));
    add("bf16_views_storage", bm_precision<Eigen::bfloat16>, with(bf16));
    add("fp16_views", bm_precision<Eigen::half>, with(none));
    add("fp64_decompositions", bm_precision<float>, with(fp64));
}

}  // namespace

int main(int argc, char** argv) {
    register_all();
    return kfac_bench::run_cpu_benchmarks(argc, argv);
}
