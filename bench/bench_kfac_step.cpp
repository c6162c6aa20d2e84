// SPDX-License-Identifier: Apache-2.0
/// @file bench_kfac_step.cpp
/// Cost of one preconditioner step() on the layer shapes of two float32 workloads, for both
/// compute methods:
///   * W1 "resnet32": the 31 bias-free 3×3 convolutions and the Linear(64, 10) of a CIFAR-10
///     ResNet-32, batch 128 (factor dims 10 ... 576; the A statistics dominate);
///   * W2 "mlp": Linear(1024, 2048) → Linear(2048, 2048) → Linear(2048, 1000), all with bias,
///     batch 256 (factor dims 1000 ... 2049; decompositions and preconditioning dominate);
///   * "mobilenet_v1": the 28 convolutions and the classifier of bench/models/mobilenet_v1.txt,
///     4,975 blocks of which 4,960 are depthwise channels (9 × 9 A, 1 × 1 G), at batch 2: the
///     non-update step's work does not depend on the batch, and its cost is issuing thousands of
///     tiny blocks (step benchmarks only);
///   * "tiny": one small conv and one linear layer, for the smoke test.
///
/// kfac_step/<workload>/<method>/update: factor statistics + running average + decompositions
///   + preconditioning (factor_update_steps = inv_update_steps = 1 on the timed steps).
/// kfac_step/<workload>/<method>/non_update: preconditioning only (both intervals 10⁶, step 0
///   done before timing).
/// kfac_step/<workload>/eigen_reuse/update: the eigen update step with
///   options.eigenbasis_reuse_tolerance = reuse_tolerance (below); counters `reused` and
///   `decomposed` say how many of the timed steps' dense factors kept their eigenvectors.
/// Each step benchmark also reports the median of each phase of the step it ran (counters
/// <phase>_ms, from preconditioner::last_step_times()).
/// kfac_phase/<workload>/<phase>: the backend calls of one phase over all layers, to see where
///   a step's time goes: a_stats, g_stats (batch statistics; a_stats_im2col: the conv A
///   statistics by im2col + SYRK, the route stride-1 convolutions no longer take, for the
///   ratio), running_average (symmetrise the
///   statistic and fold it into the factor), eigh, inverse (second-order data of every factor),
///   eigh_reuse (what replaces eigh when a basis is kept: rayleigh_quotients of every factor in
///   a basis computed before timing),
///   gradient_io (load_gradient + store_gradient: the copies between the host's row-major
///   gradients and the backend's column-major matrices, done on every step).
///
/// Activations and output gradients are random (fixed seed), output gradients scaled by
/// 1/batch as a mean loss makes them. step() overwrites the weight and bias gradients, so they
/// are restored from a saved copy before every step, outside the timed region (manual timing).
/// Times are wall-clock; run with OPENBLAS_NUM_THREADS=1 or 2 (the preconditioner also takes
/// its task-thread count from it). The phases run layer after layer, never as tasks.

#include <benchmark/benchmark.h>

#include "bench_main.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <kfac/kfac.hpp>

#include "model_file.hpp"

namespace {

using index = std::int64_t;
using backend = kfac::backend::cpu_eigen<float>;
using matrix = backend::matrix;

/// The tolerance of the eigen_reuse steps. These workloads' data are i.i.d. Gaussian, the
/// hardest case for reuse: each step's statistic is a fresh sample whose off-diagonal part in
/// any fixed basis is large (W2's factors move by ≈ 0.1 relative off-diagonal mass per step),
/// so a tolerance of 0.2 is needed here for the basis to be kept at all; the flagship's
/// trained network (docs/performance.md, "Approximate eigenbasis refresh") is the measure of its effect.
constexpr double reuse_tolerance = 0.2;

struct layer_spec {
    std::string name;
    kfac::layer_description description;
    std::vector<index> input_shape;   // one batch: [N, in] or [N, C_in, H, W]
    std::vector<index> output_shape;  // one batch: [N, out] or [N, C_out, H_out, W_out]
};

struct workload_spec {
    std::string name;
    std::vector<layer_spec> layers;
    /// Distinct batches, cycled through step by step. More than one only where a single
    /// batch cannot make the factors full rank (W2: 256 rows against dims up to 2049).
    index batches = 1;
    /// Steps run before an update step is timed. Step 0 decomposes; the others only update
    /// factors, so that the timed decompositions see steady-state (full-rank) factors, as in
    /// the kfac-pytorch measurements of perf-anchors §7.
    index warmup_steps = 1;
    index update_iterations = 3;
    index non_update_iterations = 10;
    index phase_iterations = 3;
    bool phase_benchmarks = true;  ///< kfac_phase/<workload>/* (one backend call per layer)
};

layer_spec conv3x3(const std::string& name, index batch, index c_in, index c_out, index size_in,
                   index stride) {
    const kfac::conv2d_geometry g{{3, 3}, {stride, stride}, {1, 1}, {1, 1}, 1};
    const index size_out = kfac::conv_output_extent(size_in, 3, stride, 1, 1);
    return {name, kfac::conv2d_description(c_in, c_out, g, false),
            {batch, c_in, size_in, size_in}, {batch, c_out, size_out, size_out}};
}

layer_spec linear(const std::string& name, index batch, index in, index out) {
    return {name, kfac::linear_description(in, out, true), {batch, in}, {batch, out}};
}

/// CIFAR-10 ResNet-32 (He et al. 2016, option-A shortcuts: the shortcuts have no weights).
workload_spec resnet32() {
    constexpr index batch = 128;
    workload_spec w;
    w.name = "W1_resnet32";
    w.layers.push_back(conv3x3("conv1", batch, 3, 16, 32, 1));
    for (int i = 0; i < 10; ++i)
        w.layers.push_back(conv3x3("stage1." + std::to_string(i), batch, 16, 16, 32, 1));
    w.layers.push_back(conv3x3("stage2.0", batch, 16, 32, 32, 2));
    for (int i = 1; i < 10; ++i)
        w.layers.push_back(conv3x3("stage2." + std::to_string(i), batch, 32, 32, 16, 1));
    w.layers.push_back(conv3x3("stage3.0", batch, 32, 64, 16, 2));
    for (int i = 1; i < 10; ++i)
        w.layers.push_back(conv3x3("stage3." + std::to_string(i), batch, 64, 64, 8, 1));
    w.layers.push_back(linear("fc", batch, 64, 10));
    w.batches = 1;  // im2col gives >= 8192 rows per factor: full rank from one batch
    w.warmup_steps = 1;
    w.update_iterations = 5;
    w.non_update_iterations = 50;
    w.phase_iterations = 3;
    return w;
}

workload_spec mlp() {
    constexpr index batch = 256;
    workload_spec w;
    w.name = "W2_mlp";
    w.layers.push_back(linear("fc1", batch, 1024, 2048));
    w.layers.push_back(linear("fc2", batch, 2048, 2048));
    w.layers.push_back(linear("fc3", batch, 2048, 1000));
    // 12 batches × 256 rows > 2049: the running factors are full rank after the warm-up.
    w.batches = 12;
    w.warmup_steps = 12;
    w.update_iterations = 3;
    w.non_update_iterations = 5;
    w.phase_iterations = 3;
    return w;
}

workload_spec tiny() {
    constexpr index batch = 4;
    workload_spec w;
    w.name = "tiny";
    w.layers.push_back(conv3x3("conv", batch, 3, 8, 8, 1));
    w.layers.push_back(linear("fc", batch, 32, 10));
    w.batches = 2;
    w.warmup_steps = 2;
    w.update_iterations = 20;
    w.non_update_iterations = 20;
    w.phase_iterations = 20;
    return w;
}

/// A model file's convolutions and linear layers (bench/models/*.txt) at `batch`.
workload_spec from_model_file(const std::string& name, const std::string& file, index batch) {
    const kfac_bench::model m = kfac_bench::read_model(std::string(KFAC_BENCH_MODELS_DIR) + "/" + file);
    workload_spec w;
    w.name = name;
    for (const auto& l : m.layers) {
        const auto& d = l.description;
        if (d.kind == kfac::layer_kind::conv2d) {
            const index ho = kfac::conv_output_extent(l.height, d.conv.kernel[0], d.conv.stride[0], d.conv.padding[0], 1);
            const index wo = kfac::conv_output_extent(l.width, d.conv.kernel[1], d.conv.stride[1], d.conv.padding[1], 1);
            w.layers.push_back({l.name, d, {batch, d.in, l.height, l.width}, {batch, d.out, ho, wo}});
        } else if (d.kind == kfac::layer_kind::linear) {
            w.layers.push_back({l.name, d, {batch * l.rows_per_sample, d.in}, {batch * l.rows_per_sample, d.out}});
        }
    }
    w.batches = 1;
    w.warmup_steps = 1;
    w.update_iterations = 1;
    w.non_update_iterations = 5;
    w.phase_benchmarks = false;
    return w;
}

const std::vector<workload_spec>& workloads() {
    static const std::vector<workload_spec> all{tiny(), resnet32(), mlp(),
                                                from_model_file("mobilenet_v1", "mobilenet_v1.txt", 2)};
    return all;
}

index volume(const std::vector<index>& shape) {
    index n = 1;
    for (index e : shape) n *= e;
    return n;
}

index weight_size(const kfac::layer_description& d) { return d.out * d.weight_columns(); }

std::vector<index> weight_shape(const kfac::layer_description& d) {
    if (d.kind == kfac::layer_kind::linear) return {d.out, d.in};
    return {d.out, d.per_group(d.in), d.conv.kernel[0], d.conv.kernel[1]};
}

// ---- data ----------------------------------------------------------------------------------

struct layer_buffers {
    std::vector<std::vector<float>> inputs;        // one per batch
    std::vector<std::vector<float>> grad_outputs;  // one per batch
    std::vector<float> grad_weight, grad_bias;     // as the backward pass left them
};

std::vector<float> random_vector(index n, float scale, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = scale * normal(rng);
    return v;
}

/// Random data of a workload, built once per process (W1 holds ~300 MB of activations).
const std::vector<layer_buffers>& data_of(const workload_spec& w) {
    static std::map<std::string, std::vector<layer_buffers>> cache;
    auto it = cache.find(w.name);
    if (it != cache.end()) return it->second;
    std::mt19937 rng(1234u);
    std::vector<layer_buffers> layers;
    for (const auto& l : w.layers) {
        const float inv_batch = 1.0f / static_cast<float>(l.input_shape[0]);
        layer_buffers b;
        for (index k = 0; k < w.batches; ++k) {
            b.inputs.push_back(random_vector(volume(l.input_shape), 1.0f, rng));
            b.grad_outputs.push_back(random_vector(volume(l.output_shape), inv_batch, rng));
        }
        b.grad_weight = random_vector(weight_size(l.description), inv_batch, rng);
        if (l.description.bias) b.grad_bias = random_vector(l.description.out, inv_batch, rng);
        layers.push_back(std::move(b));
    }
    return cache.emplace(w.name, std::move(layers)).first->second;
}

/// The host side of one layer: the view the preconditioner reads and the gradient buffers
/// it overwrites.
struct live_layer {
    kfac::layer_view<float> view;
    std::vector<float> grad_weight, grad_bias;
};

/// Restores the gradients and points the views at batch k (mod the distinct batches).
void prepare_step(std::vector<live_layer>& live, const workload_spec& w,
                  const std::vector<layer_buffers>& data, index k) {
    const auto b = static_cast<std::size_t>(k % w.batches);
    for (std::size_t i = 0; i < live.size(); ++i) {
        const layer_spec& spec = w.layers[i];
        live_layer& l = live[i];
        std::copy(data[i].grad_weight.begin(), data[i].grad_weight.end(), l.grad_weight.begin());
        std::copy(data[i].grad_bias.begin(), data[i].grad_bias.end(), l.grad_bias.begin());
        l.view.input = kfac::tensor_view<const float>::from_extents(data[i].inputs[b].data(),
                                                                    spec.input_shape);
        l.view.grad_output = kfac::tensor_view<const float>::from_extents(
            data[i].grad_outputs[b].data(), spec.output_shape);
    }
}

// ---- whole steps ---------------------------------------------------------------------------

kfac::options step_options(const workload_spec& w, bool update) {
    kfac::options o;
    o.damping = 0.003;
    o.kl_clip = 0.001;
    o.lr = 0.1;
    // Start the running factors from data (decay 0 at step 0) instead of the identity, as the
    // kfac-pytorch reference runs did: the identity start clusters the spectrum and makes
    // divide and conquer look cheaper than in steady state.
    o.factor_decay = [](std::int64_t k) { return k == 0 ? 0.0 : 0.95; };
    if (update) {
        // Interval 1 on every timed step; during the warm-up (k < warmup) only step 0
        // decomposes, the others update factors only.
        o.factor_update_steps = std::int64_t{1};
        const std::int64_t warmup = w.warmup_steps;
        o.inv_update_steps = [warmup](std::int64_t k) { return k < warmup ? warmup : std::int64_t{1}; };
    } else {
        o.factor_update_steps = std::int64_t{1000000};
        o.inv_update_steps = std::int64_t{1000000};
    }
    return o;
}

double median(std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    const std::size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

template <class Method>
void bm_step(benchmark::State& state, const workload_spec* w, bool update, double tolerance) {
    const auto& data = data_of(*w);
    std::vector<live_layer> live(w->layers.size());  // never resized: the views must not move
    auto options = step_options(*w, update);
    options.eigenbasis_reuse_tolerance = tolerance;
    kfac::KFAC<backend, kfac::comm::serial, Method> precond(options);
    for (std::size_t i = 0; i < live.size(); ++i) {
        const layer_spec& spec = w->layers[i];
        live_layer& l = live[i];
        l.grad_weight.resize(data[i].grad_weight.size());
        l.grad_bias.resize(data[i].grad_bias.size());
        l.view.description = spec.description;
        l.view.grad_weight = kfac::tensor_view<float>::from_extents(l.grad_weight.data(),
                                                                   weight_shape(spec.description));
        if (spec.description.bias)
            l.view.grad_bias = kfac::tensor_view<float>(l.grad_bias.data(), {spec.description.out});
        precond.register_layer(spec.name, l.view);
    }
    const index setup_steps = update ? w->warmup_steps : 1;
    for (index k = 0; k < setup_steps; ++k) {
        prepare_step(live, *w, data, k);
        precond.step();
    }
    std::vector<double> times;
    std::vector<std::vector<double>> phase_times(kfac::step_phase_count);  // the step's own laps
    const auto bases_before = precond.eigenbasis_counts();
    for (auto _ : state) {
        prepare_step(live, *w, data, precond.steps());
        const auto start = std::chrono::steady_clock::now();
        precond.step();
        const auto stop = std::chrono::steady_clock::now();
        const double seconds = std::chrono::duration<double>(stop - start).count();
        state.SetIterationTime(seconds);
        times.push_back(seconds);
        for (std::size_t p = 0; p < kfac::step_phase_count; ++p)
            phase_times[p].push_back(precond.last_step_times().seconds[p]);
        benchmark::DoNotOptimize(live.front().grad_weight.data());
    }
    // Where the median step's time goes (preconditioner::last_step_times()), phases it ran.
    for (std::size_t p = 0; p < kfac::step_phase_count; ++p)
        if (const double ms = median(phase_times[p]) * 1e3; ms > 0.0)
            state.counters[std::string(kfac::step_phase_name(static_cast<kfac::step_phase>(p))) + "_ms"] = ms;
    const auto& h = precond.health();
    if (h.skipped_factor_updates || h.kept_decompositions || h.zeroed_gradients)
        state.SkipWithError("the preconditioner met non-finite values (see health())");
    state.counters["median_ms"] = median(times) * 1e3;
    state.counters["min_ms"] = times.empty() ? 0.0 : *std::min_element(times.begin(), times.end()) * 1e3;
    state.counters["layers"] = static_cast<double>(precond.layer_count());
    if (tolerance > 0.0) {
        state.counters["reused"] = static_cast<double>(precond.eigenbasis_counts().reused - bases_before.reused);
        state.counters["decomposed"] = static_cast<double>(precond.eigenbasis_counts().decomposed - bases_before.decomposed);
    }
}

// ---- phases (backend calls as the step makes them) -----------------------------------------

struct factor_set {
    std::vector<matrix> a, g;
};

/// Running factors after the warm-up, built with the same backend calls and decay schedule
/// as step_options(): what the decompositions of a timed update step see.
const factor_set& factors_of(const workload_spec& w) {
    static std::map<std::string, factor_set> cache;
    auto it = cache.find(w.name);
    if (it != cache.end()) return it->second;
    const auto& data = data_of(w);
    factor_set f;
    for (std::size_t i = 0; i < w.layers.size(); ++i) {
        const layer_spec& spec = w.layers[i];
        const index a_dim = spec.description.a_dim(), g_dim = spec.description.g_dim();
        matrix a = matrix::Zero(a_dim, a_dim), g = matrix::Zero(g_dim, g_dim);
        matrix a_sum = a, g_sum = g;
        backend::workspace ws;
        for (index k = 0; k < w.warmup_steps; ++k) {
            const auto b = static_cast<std::size_t>(k % w.batches);
            backend::accumulate_a_statistic(
                a_sum, spec.description,
                kfac::tensor_view<const float>::from_extents(data[i].inputs[b].data(), spec.input_shape),
                kfac::conv_patch_mode::reference, 0.0f, ws);
            backend::accumulate_g_statistic(
                g_sum, spec.description,
                kfac::tensor_view<const float>::from_extents(data[i].grad_outputs[b].data(),
                                                            spec.output_shape),
                0.0f, ws);
            const float decay = k == 0 ? 0.0f : 0.95f;
            backend::running_average(a, a_sum, decay, 1.0f - decay);
            backend::running_average(g, g_sum, decay, 1.0f - decay);
        }
        f.a.push_back(std::move(a));
        f.g.push_back(std::move(g));
    }
    return cache.emplace(w.name, std::move(f)).first->second;
}

enum class phase { a_stats, a_stats_im2col, g_stats, running_average, eigh, eigh_reuse, inverse, gradient_io };

void bm_phase(benchmark::State& state, const workload_spec* w, phase p) {
    const auto& data = data_of(*w);
    const auto& factors = factors_of(*w);
    const std::size_t n = w->layers.size();
    std::vector<matrix> sums(n), q(n);
    std::vector<backend::vector> lambda(n);
    std::vector<backend::workspace> ws(n);
    std::vector<matrix> running;           // running_average: factors it updates
    std::vector<std::vector<float>> out_w(n), out_b(n);  // gradient_io: host buffers
    for (std::size_t i = 0; i < n; ++i) {
        const auto& d = w->layers[i].description;
        const index dim = p == phase::g_stats ? d.g_dim() : d.a_dim();
        sums[i] = matrix::Zero(dim, dim);
        out_w[i].resize(data[i].grad_weight.size());
        out_b[i].resize(data[i].grad_bias.size());
    }
    std::vector<matrix> basis_a(n), basis_g(n);  // eigh_reuse: the kept eigenvectors
    if (p == phase::eigh_reuse)
        for (std::size_t i = 0; i < n; ++i)
            if (!backend::symmetric_eigen(factors.a[i], basis_a[i], lambda[i]) ||
                !backend::symmetric_eigen(factors.g[i], basis_g[i], lambda[i]))
                state.SkipWithError("a decomposition failed");
    if (p == phase::running_average) {
        // Both factors of every layer; the statistic is the factor itself (values do not matter).
        for (std::size_t i = 0; i < n; ++i) {
            running.push_back(factors.a[i]);
            running.push_back(factors.g[i]);
        }
        sums = running;
    }
    bool ok = true;
    for (auto _ : state) {
        for (std::size_t i = 0; i < n && ok; ++i) {
            const layer_spec& spec = w->layers[i];
            switch (p) {
                case phase::a_stats:
                    backend::accumulate_a_statistic(
                        sums[i], spec.description,
                        kfac::tensor_view<const float>::from_extents(data[i].inputs[0].data(),
                                                                    spec.input_shape),
                        kfac::conv_patch_mode::reference, 0.0f, ws[i]);
                    break;
                case phase::a_stats_im2col: {
                    // The conv statistic by im2col + SYRK even where the step takes the shift
                    // structure: a_stats_im2col / a_stats is what that route saves.
                    const auto view = kfac::tensor_view<const float>::from_extents(data[i].inputs[0].data(),
                                                                                  spec.input_shape);
                    if (spec.description.kind == kfac::layer_kind::conv2d) {
                        const auto grid = kfac::make_patch_grid(spec.description.conv, view.extent(2),
                                                                view.extent(3), kfac::conv_patch_mode::reference);
                        backend::accumulate_patch_gram_im2col(sums[i], spec.description, view, grid, 0.0f, ws[i]);
                    } else {
                        backend::accumulate_a_statistic(sums[i], spec.description, view,
                                                        kfac::conv_patch_mode::reference, 0.0f, ws[i]);
                    }
                    break;
                }
                case phase::g_stats:
                    backend::accumulate_g_statistic(
                        sums[i], spec.description,
                        kfac::tensor_view<const float>::from_extents(data[i].grad_outputs[0].data(),
                                                                    spec.output_shape),
                        0.0f, ws[i]);
                    break;
                case phase::running_average:
                    backend::running_average(running[2 * i], sums[2 * i], 0.95f, 0.05f);
                    backend::running_average(running[2 * i + 1], sums[2 * i + 1], 0.95f, 0.05f);
                    break;
                case phase::gradient_io: {
                    const auto& d = spec.description;
                    const auto shape = weight_shape(d);
                    backend::load_gradient(
                        q[i], kfac::tensor_view<const float>::from_extents(data[i].grad_weight.data(), shape),
                        d.bias ? kfac::tensor_view<const float>(data[i].grad_bias.data(), {d.out})
                               : kfac::tensor_view<const float>{});
                    backend::store_gradient(
                        q[i], 1.0f, kfac::tensor_view<float>::from_extents(out_w[i].data(), shape),
                        d.bias ? kfac::tensor_view<float>(out_b[i].data(), {d.out})
                               : kfac::tensor_view<float>{});
                    break;
                }
                case phase::eigh:
                    ok = backend::symmetric_eigen(factors.a[i], q[i], lambda[i]) &&
                         backend::symmetric_eigen(factors.g[i], q[i], lambda[i]);
                    break;
                case phase::eigh_reuse:  // the quotients and residual a kept basis costs
                    ok = !std::isnan(backend::rayleigh_quotients(factors.a[i], basis_a[i], lambda[i]) +
                                     backend::rayleigh_quotients(factors.g[i], basis_g[i], lambda[i]));
                    break;
                case phase::inverse:
                    ok = backend::damped_inverse(factors.a[i], 0.003f, q[i]) &&
                         backend::damped_inverse(factors.g[i], 0.003f, q[i]);
                    break;
            }
        }
        benchmark::ClobberMemory();
    }
    if (!ok) state.SkipWithError("a decomposition failed");
}

void register_all() {
    for (const auto& w : workloads()) {
        const auto* wp = &w;
        for (bool update : {true, false}) {
            const std::string mode = update ? "update" : "non_update";
            const index iterations = update ? w.update_iterations : w.non_update_iterations;
            benchmark::RegisterBenchmark(("kfac_step/" + w.name + "/eigen/" + mode).c_str(),
                                         bm_step<kfac::compute::eigendecomposition>, wp, update, 0.0)
                ->UseManualTime()
                ->Iterations(iterations)
                ->Unit(benchmark::kMillisecond);
            benchmark::RegisterBenchmark(("kfac_step/" + w.name + "/inverse/" + mode).c_str(),
                                         bm_step<kfac::compute::inverse>, wp, update, 0.0)
                ->UseManualTime()
                ->Iterations(iterations)
                ->Unit(benchmark::kMillisecond);
        }
        benchmark::RegisterBenchmark(("kfac_step/" + w.name + "/eigen_reuse/update").c_str(),
                                     bm_step<kfac::compute::eigendecomposition>, wp, true, reuse_tolerance)
            ->UseManualTime()
            ->Iterations(w.update_iterations)
            ->Unit(benchmark::kMillisecond);
        if (!w.phase_benchmarks) continue;
        const std::pair<const char*, phase> phases[] = {{"a_stats", phase::a_stats},
                                                        {"a_stats_im2col", phase::a_stats_im2col},
                                                        {"g_stats", phase::g_stats},
                                                        {"running_average", phase::running_average},
                                                        {"eigh", phase::eigh},
                                                        {"eigh_reuse", phase::eigh_reuse},
                                                        {"inverse", phase::inverse},
                                                        {"gradient_io", phase::gradient_io}};
        for (const auto& [name, p] : phases)
            benchmark::RegisterBenchmark(("kfac_phase/" + w.name + "/" + name).c_str(), bm_phase,
                                         wp, p)
                ->UseRealTime()
                ->Iterations(w.phase_iterations)
                ->Unit(benchmark::kMillisecond);
    }
}

}  // namespace

int main(int argc, char** argv) {
    register_all();
    return kfac_bench::run_cpu_benchmarks(argc, argv);
}
