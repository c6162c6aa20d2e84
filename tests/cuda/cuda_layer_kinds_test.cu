// SPDX-License-Identifier: Apache-2.0
// Every layer kind and weight-sharing mode on backend::cuda against backend::cpu_eigen on the
// same inputs: Linear and Conv2d under `reduce`, Conv1d, grouped and depthwise convolutions,
// an Embedding, LayerNorm and BatchNorm (with and without shift, both weight sharings); both
// compute methods, host and device views, gradient accumulation, eigenbasis reuse, and
// checkpoints written on one backend and read on the other. Compiled in gpu_tests.cu, the GPU
// test program's one translation unit.

#include <catch2/catch.hpp>

#include "support/catch_session.hpp"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <kfac/backend/cuda.cuh>
#include <kfac/kfac.hpp>

#include "cuda/twin_layer.hpp"
#include "unit/layer_kinds.hpp"
#include "unit/test_util.hpp"

// Every optional member is there, so the preconditioner takes each of these paths on the GPU.
static_assert(kfac::detail::backend_with_unit_wise_factors<kfac::backend::cuda<float>>);
static_assert(kfac::detail::backend_with_diagonal_factors<kfac::backend::cuda<float>>);
static_assert(kfac::detail::backend_with_eigenbasis_reuse<kfac::backend::cuda<float>>);
static_assert(kfac::detail::backend_with_gradient_checks<kfac::backend::cuda<float>>);
static_assert(kfac::detail::backend_with_batched_eigen<kfac::backend::cuda<double>>);
static_assert(kfac::backend::backend_with_fp64_decompositions<kfac::backend::cuda<float>>);
static_assert(kfac::detail::backend_with_device_conversion<kfac::backend::cuda<float>>);
static_assert(kfac::precision_of<__nv_bfloat16> == kfac::precision::bf16 && kfac::precision_of<__half> == kfac::precision::fp16);

namespace {

using kfac_test::buffer_rel_err;
using kfac_test::eps;
using kfac_test::every_kind;
using kfac_test::mat;
using kfac_test::owned_layer;
using kfac_test::random_vector;
using kfac_test::rel_err;
using kfac_test::twin_layer;
using index = std::int64_t;

template <class T>
using named_layers = std::vector<std::pair<std::string, owned_layer<T>>>;

template <class T>
std::vector<twin_layer<T>> twins(bool device_views, const named_layers<T>& kinds = every_kind<T>()) {
    std::vector<twin_layer<T>> out;
    for (auto [name, l] : kinds) {
        (void)name;
        twin_layer<T> t;
        t.cpu = l;
        t.gpu = l;
        t.cpu.bind();
        t.gpu.bind();
        out.push_back(std::move(t));
        if (device_views) out.back().make_device_views();
    }
    return out;
}

/// Both backends' storage side by side: the tolerance of the step-by-step comparison. Double:
/// the golden replay's 1e-10. Float: 10 roundings of the storage amplified by the damped
/// inverse's condition (1 + γ)/γ at γ = 0.01, as the golden replay's float tolerance.
template <class T>
double backend_tolerance() {
    return std::is_same_v<T, float> ? 10 * eps<T>() * (1 + 0.01) / 0.01 : 1e-10;
}

/// What a method adds to backend_tolerance() because the backends' eigensolvers return
/// different bases: none under the eigen and inverse methods, whose results do not depend on
/// the basis of an eigenspace. EKFAC's S does (it is the second moment in the basis itself):
/// each solver's eigenvectors are within ~u·κ of the exact ones (Davis–Kahan; κ the largest
/// eigenvalue over the smallest gap between two of a layer's factors' eigenvalues), S and the
/// preconditioned gradient move by that at first order, and the damped division amplifies it
/// by at most (S + γ)/γ ≈ 10² here: 10³·u·κ. Eigenvalues within 100·u·λ_max of each other count
/// as one eigenspace: the directions no example has reached (identity left by the running
/// average, or zero), in which every Γ_n has no component, so S there is 0 in any basis of it.
/// Factors of one group (a grouped convolution's layer name) are read through the layer's own
/// name; a factor that is not square adds none.
template <class T, class Method, class Cpu>
double basis_tolerance(const Cpu& cpu, const std::string& name) {
    if constexpr (!std::is_same_v<Method, kfac::compute::ekfac>) {
        (void)cpu, (void)name;
        return 0.0;
    } else {
        double kappa = 1.0;
        for (const auto& info : cpu.layers()) {
            if (info.name != name && info.name.rfind(name + ".", 0) != 0) continue;
            for (const bool a : {true, false}) {
                const mat<T>& f = a ? cpu.a_factor(info.name) : cpu.g_factor(info.name);
                if (f.rows() != f.cols() || f.rows() < 2) continue;
                const Eigen::SelfAdjointEigenSolver<mat<double>> solver(f.template cast<double>());
                const auto& lambda = solver.eigenvalues();
                double gap = std::numeric_limits<double>::infinity();
                const double largest = lambda.cwiseAbs().maxCoeff();
                for (Eigen::Index i = 1; i < lambda.size(); ++i)
                    if (lambda(i) - lambda(i - 1) > 100 * eps<T>() * largest) gap = std::min(gap, lambda(i) - lambda(i - 1));
                kappa = std::max(kappa, largest / gap);
            }
        }
        return 1e3 * eps<T>() * kappa;
    }
}

/// Runs both preconditioners over `steps` steps (with accumulate() passes when
/// options.accumulation_steps > 1) and checks the preconditioned gradients, the kl_clip scale
/// and every factor after each step.
template <class T, class Method>
void compare_every_kind(const kfac::options& o, bool device_views, int steps, const named_layers<T>& names = every_kind<T>()) {
    using gpu_backend = kfac::backend::cuda<T>;
    const double tol = backend_tolerance<T>();
    kfac::KFAC<kfac::backend::cpu_eigen<T>, kfac::comm::serial, Method> cpu(o);
    kfac::KFAC<gpu_backend, kfac::comm::serial, Method> gpu(o);
    auto layers = twins<T>(device_views, names);
    for (std::size_t i = 0; i < layers.size(); ++i) {
        cpu.register_layer(names[i].first, layers[i].cpu.view);
        gpu.register_layer(names[i].first, layers[i].gpu.view);
    }
    for (int step = 0; step < steps; ++step) {
        for (std::int64_t pass = 1; pass < o.accumulation_steps; ++pass) {
            cpu.accumulate();
            gpu.accumulate();
        }
        cpu.step();
        gpu.step();
        for (std::size_t i = 0; i < layers.size(); ++i) {
            INFO("layer " << names[i].first << ", step " << step);
            const double layer_tol = tol + basis_tolerance<T, Method>(cpu, names[i].first);
            CHECK(buffer_rel_err(layers[i].gpu_weight_gradient(), layers[i].cpu.grad_weight) < layer_tol);
            CHECK(buffer_rel_err(layers[i].gpu_bias_gradient(), layers[i].cpu.grad_bias) < layer_tol);
        }
        CHECK(gpu.last_kl_scale() == Approx(cpu.last_kl_scale()).epsilon(tol));
        for (const auto& info : cpu.layers()) {
            INFO("factors of " << info.name << ", step " << step);
            CHECK(rel_err(gpu_backend::to_host(gpu.a_factor(info.name)), cpu.a_factor(info.name)) < tol);
            CHECK(rel_err(gpu_backend::to_host(gpu.g_factor(info.name)), cpu.g_factor(info.name)) < tol);
        }
        for (std::size_t i = 0; i < layers.size(); ++i) layers[i].refill_gradients(100 + 7 * static_cast<std::uint32_t>(i + 10 * step));
    }
}

kfac::options kinds_options() {
    kfac::options o;
    o.damping = 0.01;
    o.kl_clip = 0.001;
    o.lr = 0.1;
    o.inv_update_steps = 2;
    return o;
}

TEMPLATE_TEST_CASE("every layer kind on the GPU matches the CPU backend step by step", "[cuda][kinds]", float, double) {
    using T = TestType;
    for (bool device_views : {false, true}) {
        DYNAMIC_SECTION((device_views ? "device" : "host") << " views") {
            compare_every_kind<T, kfac::compute::eigendecomposition>(kinds_options(), device_views, 4);
            compare_every_kind<T, kfac::compute::inverse>(kinds_options(), device_views, 4);
        }
    }
}

TEST_CASE("every layer kind on the GPU: accumulation, eigenbasis reuse and the curvature modes", "[cuda][kinds]") {
    using T = double;
    auto o = kinds_options();
    o.accumulation_steps = 3;
    compare_every_kind<T, kfac::compute::eigendecomposition>(o, true, 3);
    compare_every_kind<T, kfac::compute::inverse>(o, true, 3);
    o = kinds_options();
    o.eigenbasis_reuse_tolerance = 0.2;  // every refresh tries the old basis first
    o.inv_update_steps = 1;
    compare_every_kind<T, kfac::compute::eigendecomposition>(o, false, 4);
    o = kinds_options();
    o.statistics = kfac::statistic_scale::per_example;
    o.averaging = kfac::factor_averaging::bias_corrected;
    o.damping_mode = kfac::damping_form::factored;
    o.relative_damping = true;
    o.compute_eigenvalue_outer_product = true;
    compare_every_kind<T, kfac::compute::eigendecomposition>(o, true, 3);
    compare_every_kind<T, kfac::compute::inverse>(o, true, 3);
}

/// The layers compute::ekfac preconditions (a dense Kronecker pair per group): every_kind()'s,
/// and a Linear layer over tokens and a Conv2d under `expand`, whose estimates take the rows
/// projected first (3 tokens) and the gradients formed first (25 positions against A_dim 28).
template <class T>
named_layers<T> ekfac_kinds() {
    named_layers<T> out;
    for (auto& [name, l] : every_kind<T>())
        if (kfac::detail::compute_impl<kfac::compute::ekfac, kfac::backend::cpu_eigen<T>>::unsupported_layer(
                l.view.description)
                .empty())
            out.emplace_back(name, l);
    auto tokens = kfac_test::random_linear<T>(12, 5, 4, true, 81);
    tokens.input_shape = {4, 3, 5};
    tokens.output_shape = {4, 3, 4};
    tokens.bind();
    out.emplace_back("fc_tokens", tokens);
    out.emplace_back("conv", kfac_test::random_conv<T>(3, 3, 4, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, 5, 5, 83));
    return out;
}

TEST_CASE("EKFAC on the GPU matches the CPU backend step by step", "[cuda][kinds][ekfac]") {
    // The scaling is summed in another order on the device (device_ekfac_scaling.cuh): the
    // factors' tolerance. S is invariant under the sign of each eigenvector (squares), which is
    // all that differs between cuSOLVER's and LAPACK's bases of distinct eigenvalues. In double,
    // where the tolerance is tightest; the float instantiation of the same code (cuBLAS's S
    // calls) is bench_cuda's, and the twin tests above cover float's storage of every kind.
    using T = double;
    const auto kinds = ekfac_kinds<T>();
    REQUIRE(kinds.size() == 7);  // fc_reduce, conv_reduce, conv1d, grouped, depthwise, fc_tokens, conv
    for (bool device_views : {false, true}) {
        DYNAMIC_SECTION((device_views ? "device" : "host") << " views") {
            compare_every_kind<T, kfac::compute::ekfac>(kinds_options(), device_views, 4, kinds);
        }
    }
    auto o = kinds_options();
    o.accumulation_steps = 3;  // every pass's rows kept to the step
    o.statistics = kfac::statistic_scale::per_example;
    compare_every_kind<T, kfac::compute::ekfac>(o, true, 3, kinds);
}

TEST_CASE("EKFAC's scaling moves between the CPU and the GPU in checkpoints", "[cuda][kinds][ekfac][checkpoint]") {
    using T = double;
    using gpu_backend = kfac::backend::cuda<T>;
    using ekfac = kfac::compute::ekfac;
    const auto o = kinds_options();
    const auto names = ekfac_kinds<T>();
    kfac::KFAC<kfac::backend::cpu_eigen<T>, kfac::comm::serial, ekfac> cpu(o), cpu_from_gpu(o);
    kfac::KFAC<gpu_backend, kfac::comm::serial, ekfac> gpu(o);
    auto layers = twins<T>(false, names);
    for (std::size_t i = 0; i < layers.size(); ++i) {
        cpu.register_layer(names[i].first, layers[i].cpu.view);
        gpu.register_layer(names[i].first, layers[i].gpu.view);
        cpu_from_gpu.register_layer(names[i].first, layers[i].cpu.view);
    }
    for (int k = 0; k < 3; ++k) {
        cpu.step();
        gpu.step();
        for (std::size_t i = 0; i < layers.size(); ++i) layers[i].refill_gradients(400 + static_cast<std::uint32_t>(10 * k + i));
    }
    // The GPU's state, S included, read by a CPU preconditioner: the next step (a factor update
    // re-estimating S, no inverse update) agrees with the CPU's own to the backends' tolerance.
    cpu_from_gpu.load_bytes(gpu.save_bytes());
    cpu_from_gpu.step();
    const auto from_gpu = [&] {
        std::vector<std::vector<T>> g;
        for (auto& l : layers) g.push_back(l.cpu.grad_weight);
        return g;
    }();
    for (std::size_t i = 0; i < layers.size(); ++i)  // the gradients cpu_from_gpu preconditioned
        layers[i].refill_gradients(400 + static_cast<std::uint32_t>(20 + i));
    cpu.step();
    for (std::size_t i = 0; i < layers.size(); ++i) {
        INFO(names[i].first);
        CHECK(buffer_rel_err(from_gpu[i], layers[i].cpu.grad_weight) <
              backend_tolerance<T>() + basis_tolerance<T, ekfac>(cpu, names[i].first));
    }
}

TEST_CASE("device token ids that are not ids are refused, and nothing changes", "[cuda][kinds][errors]") {
    using T = float;
    auto l = kfac_test::random_embedding<T>(6, 3, 2, 4, 1, 41);
    l.input[5] = T(6);  // one past the vocabulary
    twin_layer<T> t;
    t.gpu = l;
    t.gpu.bind();
    t.make_device_views();
    kfac::KFAC<kfac::backend::cuda<T>> gpu(kinds_options());
    gpu.register_layer("emb", t.gpu.view);
    const auto before = t.gpu_weight_gradient();
    CHECK_THROWS_WITH(gpu.step(), Catch::Contains("emb") && Catch::Contains("1 of the 8 token ids") &&
                                      Catch::Contains("[0, 6)"));
    CHECK(gpu.steps() == 0);
    CHECK(t.gpu_weight_gradient() == before);
}

TEMPLATE_TEST_CASE("checkpoints of every kind move between the CPU and the GPU", "[cuda][kinds][checkpoint]", float,
                   double) {
    using T = TestType;
    using gpu_backend = kfac::backend::cuda<T>;
    const auto o = kinds_options();
    kfac::KFAC<kfac::backend::cpu_eigen<T>> cpu(o);
    kfac::KFAC<gpu_backend> gpu(o);
    auto layers = twins<T>(false);
    const auto names = every_kind<T>();
    for (std::size_t i = 0; i < layers.size(); ++i) {
        cpu.register_layer(names[i].first, layers[i].cpu.view);
        gpu.register_layer(names[i].first, layers[i].gpu.view);
    }
    for (int k = 0; k < 3; ++k) {
        cpu.step();
        gpu.step();
        for (std::size_t i = 0; i < layers.size(); ++i) layers[i].refill_gradients(300 + static_cast<std::uint32_t>(10 * k + i));
    }
    kfac::KFAC<kfac::backend::cpu_eigen<T>> cpu_from_gpu(o);
    kfac::KFAC<gpu_backend> gpu_from_cpu(o);
    for (std::size_t i = 0; i < layers.size(); ++i) {
        cpu_from_gpu.register_layer(names[i].first, layers[i].cpu.view);
        gpu_from_cpu.register_layer(names[i].first, layers[i].gpu.view);
    }
    cpu_from_gpu.load_bytes(gpu.save_bytes());
    gpu_from_cpu.load_bytes(cpu.save_bytes());
    for (const auto& info : cpu.layers()) {
        INFO(info.name);
        // The file holds each backend's values exactly: a bitwise round trip either way.
        CHECK(cpu_from_gpu.a_factor(info.name) == gpu_backend::to_host(gpu.a_factor(info.name)));
        CHECK(cpu_from_gpu.g_factor(info.name) == gpu_backend::to_host(gpu.g_factor(info.name)));
        CHECK(gpu_backend::to_host(gpu_from_cpu.a_factor(info.name)) == cpu.a_factor(info.name));
    }
    // The next step (no inverse update: 3 % 2 != 0) preconditions with the loaded data.
    cpu_from_gpu.step();
    gpu_from_cpu.step();
    for (std::size_t i = 0; i < layers.size(); ++i) {
        INFO(names[i].first);
        CHECK(buffer_rel_err(layers[i].gpu.grad_weight, layers[i].cpu.grad_weight) < backend_tolerance<T>());
    }
}

TEMPLATE_TEST_CASE("depthwise blocks decomposed together equal those decomposed one by one", "[cuda][batched]", float,
                   double) {
    // 3 × 3 depthwise over 12 channels: twelve 9 × 9 A factors and twelve 1 × 1 G factors, each
    // size decomposed by one ?syevjBatched call, against ?syevd one at a time and the CPU
    // backend; then the update step's synchronisations with and without batching.
    using T = TestType;
    using gpu_backend = kfac::backend::cuda<T>;
    auto layer = kfac_test::random_conv<T>(4, 12, 12, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 12}, false, 6, 6, 51);
    auto o = kinds_options();
    o.inv_update_steps = 1;
    std::vector<std::vector<T>> gradients;
    std::vector<typename gpu_backend::transfer_counts> costs;
    for (bool batched : {true, false}) {
        gpu_backend::batch_small_factors(batched);
        kfac::KFAC<gpu_backend> gpu(o);
        auto copy = layer;
        copy.bind();
        gpu.register_layer("dw", copy.view);
        gpu.step();
        const auto before = gpu_backend::transfers();
        kfac_test::refill_gradients(copy, 61);
        gpu.step();
        costs.push_back(gpu_backend::transfers() - before);
        gradients.push_back(copy.grad_weight);
    }
    gpu_backend::batch_small_factors(true);
    kfac::KFAC<kfac::backend::cpu_eigen<T>> cpu(o);
    auto host = layer;
    host.bind();
    cpu.register_layer("dw", host.view);
    cpu.step();
    kfac_test::refill_gradients(host, 61);
    cpu.step();
    // Jacobi and divide-and-conquer give the same eigenpairs to the solvers' rounding, which the
    // damped product amplifies by at most (λ_max + γ)/γ: the step-by-step tolerance.
    CHECK(buffer_rel_err(gradients[0], gradients[1]) < backend_tolerance<T>());
    CHECK(buffer_rel_err(gradients[0], host.grad_weight) < backend_tolerance<T>());
    WARN("update step of 12 depthwise blocks: " << costs[0].synchronizations << " synchronisations batched, "
                                                << costs[1].synchronizations << " one by one");
    CHECK(costs[0].synchronizations < costs[1].synchronizations);
}

TEST_CASE("a non-update step with device views waits for the device once", "[cuda][syncs]") {
    // Every layer's gradient checks and kl_clip's dots in one batched call (gradient_checks):
    // its tables go up in one copy and its results come back in one. Nothing else of a step
    // without a factor or inverse update waits for the device when the views are device memory.
    using T = float;
    using gpu_backend = kfac::backend::cuda<T>;
    auto o = kinds_options();
    o.factor_update_steps = 2;
    o.inv_update_steps = 2;
    kfac::KFAC<gpu_backend> gpu(o);
    auto layers = twins<T>(true);
    const auto names = every_kind<T>();
    for (std::size_t i = 0; i < layers.size(); ++i) gpu.register_layer(names[i].first, layers[i].gpu.view);
    gpu.step();  // factor and inverse update
    const auto before = gpu_backend::transfers();
    gpu.step();  // neither
    const auto cost = gpu_backend::transfers() - before;
    WARN("non-update step, " << gpu.layers().size() << " blocks: " << cost.synchronizations << " synchronisations, "
                             << cost.device_to_host << " downloads, " << cost.host_to_device << " uploads");
    CHECK(cost.synchronizations == 1);
    CHECK(cost.device_to_host == 1);
    CHECK(cost.host_to_device == 1);
}

/// A buffer of any number type, widened to double.
template <class T>
std::vector<double> as_doubles(const std::vector<T>& v) {
    std::vector<double> out(v.size());
    kfac::detail::widen(v.data(), static_cast<index>(v.size()), kfac::precision_of<T>, out.data());
    return out;
}

TEST_CASE("bf16 host and device views on the GPU match bf16 views on the CPU, under a loss scale", "[cuda][precision]") {
    // Both backends compute in float from the same bf16 values: the float backends' tolerance,
    // plus the written gradients' one rounding to bf16 each side (2 u_bf16 apart at most).
    using gpu_backend = kfac::backend::cuda<float>;
    const double tol = backend_tolerance<float>() + 2 * kfac::unit_roundoff(kfac::precision::bf16);
    for (bool device_views : {false, true}) {
        INFO((device_views ? "device" : "host") << " views");
        auto o = kinds_options();
        o.loss_scale = 4.0;  // the overflow vote reads every view (on the device: a kernel)
        kfac::KFAC<kfac::backend::cpu_eigen<float>> cpu(o);
        kfac::KFAC<gpu_backend> gpu(o);
        auto layers = twins<Eigen::bfloat16>(device_views);
        const auto names = every_kind<Eigen::bfloat16>();
        for (std::size_t i = 0; i < layers.size(); ++i) {
            cpu.register_layer(names[i].first, layers[i].cpu.view);
            gpu.register_layer(names[i].first, layers[i].gpu.view);
        }
        for (int step = 0; step < 3; ++step) {
            CHECK_FALSE(cpu.step().skipped);
            CHECK_FALSE(gpu.step().skipped);
            for (std::size_t i = 0; i < layers.size(); ++i) {
                INFO("layer " << names[i].first << ", step " << step);
                CHECK(buffer_rel_err(as_doubles(layers[i].gpu_weight_gradient()), as_doubles(layers[i].cpu.grad_weight)) < tol);
                CHECK(buffer_rel_err(as_doubles(layers[i].gpu_bias_gradient()), as_doubles(layers[i].cpu.grad_bias)) < tol);
            }
            for (const auto& info : cpu.layers()) {
                INFO("factors of " << info.name << ", step " << step);
                CHECK(rel_err(gpu_backend::to_host(gpu.a_factor(info.name)), cpu.a_factor(info.name)) < tol);
                CHECK(rel_err(gpu_backend::to_host(gpu.g_factor(info.name)), cpu.g_factor(info.name)) < tol);
            }
            for (std::size_t i = 0; i < layers.size(); ++i) layers[i].refill_gradients(300 + 7 * static_cast<std::uint32_t>(i + 10 * step));
        }
    }
}

TEST_CASE("fp16 device views whose preconditioned gradient is beyond fp16 are zeroed on the GPU as on the CPU",
          "[cuda][precision][non_finite]") {
    // Tiny factors and damping 10⁻³ make P about 10³ times the gradient, ±200: 2·10⁵ is beyond
    // fp16's 65504. The GPU counts the values beyond the view's format on the device
    // (count_beyond_format) before it narrows them; the layer is zeroed, counted and reported.
    using gpu_backend = kfac::backend::cuda<float>;
    kfac::options o;
    o.kl_clip = std::nullopt;
    o.factor_decay = 0.0;
    auto base = kfac_test::random_linear<double>(16, 4, 3, true, 61);
    for (double& x : base.input) x *= 1e-3;
    for (double& x : base.grad_output) x *= 1e-3;
    for (double& x : base.grad_weight) x = x < 0 ? -200.0 : 200.0;
    for (double& x : base.grad_bias) x = x < 0 ? -200.0 : 200.0;
    auto half_values = [](const std::vector<double>& v) {
        std::vector<Eigen::half> out;
        for (double x : v) out.push_back(static_cast<Eigen::half>(static_cast<float>(x)));
        return out;
    };
    owned_layer<Eigen::half> h;
    h.view.description = base.view.description;
    h.input_shape = base.input_shape;
    h.output_shape = base.output_shape;
    h.input = half_values(base.input);
    h.grad_output = half_values(base.grad_output);
    h.grad_weight = half_values(base.grad_weight);
    h.grad_bias = half_values(base.grad_bias);
    for (bool device_views : {false, true}) {
        INFO((device_views ? "device" : "host") << " views");
        twin_layer<Eigen::half> t;
        t.cpu = h;
        t.gpu = h;
        t.cpu.bind();
        t.gpu.bind();
        if (device_views) t.make_device_views();
        kfac::KFAC<kfac::backend::cpu_eigen<float>> cpu(o);
        kfac::KFAC<gpu_backend> gpu(o);
        cpu.register_layer("fc", t.cpu.view);
        gpu.register_layer("fc", t.gpu.view);
        cpu.step();
        gpu.step();
        CHECK(cpu.health().zeroed_gradients == 1);
        CHECK(gpu.health().zeroed_gradients == 1);
        for (double x : as_doubles(t.gpu_weight_gradient())) CHECK(x == 0.0);
        for (double x : as_doubles(t.gpu_bias_gradient())) CHECK(x == 0.0);
    }
}

TEST_CASE("fp64 decompositions on the GPU equal the CPU's", "[cuda][precision]") {
    using gpu_backend = kfac::backend::cuda<float>;
    auto o = kinds_options();
    o.fp64_decompositions = true;
    kfac::KFAC<kfac::backend::cpu_eigen<float>> cpu(o);
    kfac::KFAC<gpu_backend> gpu(o);
    auto layers = twins<float>(true);
    const auto names = every_kind<float>();
    for (std::size_t i = 0; i < layers.size(); ++i) {
        cpu.register_layer(names[i].first, layers[i].cpu.view);
        gpu.register_layer(names[i].first, layers[i].gpu.view);
    }
    cpu.step();
    gpu.step();
    for (std::size_t i = 0; i < layers.size(); ++i) {
        INFO("layer " << names[i].first);
        CHECK(buffer_rel_err(layers[i].gpu_weight_gradient(), layers[i].cpu.grad_weight) < backend_tolerance<float>());
    }
}

}  // namespace
