// SPDX-License-Identifier: Apache-2.0
// The opt-in curvature modes (options.statistics, averaging, damping_mode, relative_damping)
// and the curvature report, each against its definition written out here: the per-example
// Fisher from per-example gradients, KFC's factors as loops, the weighted moving average,
// factored Tikhonov damping, and the curvature share.
#include <catch2/catch.hpp>

#include <Eigen/Eigenvalues>
#include <unsupported/Eigen/KroneckerProduct>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {

template <class T, class M = kfac::compute::eigendecomposition>
using modes_precond = kfac::KFAC<backend<T>, kfac::comm::serial, M>;

/// Options with the per-example statistics and a first update that is the batch statistic
/// itself (bias-corrected averaging), so that the running factors are F̂.
kfac::options per_example_options() {
    kfac::options o;
    o.statistics = kfac::statistic_scale::per_example;
    o.averaging = kfac::factor_averaging::bias_corrected;
    o.kl_clip = std::nullopt;
    return o;
}

template <class T>
mat<double> full_factor(const mat<T>& f) {
    mat<double> d = f.template cast<double>();
    if (d.cols() == 1) return d.col(0).asDiagonal();
    return d;
}

/// (1/N) Σ_n vec(DW_n) vec(DW_n)ᵀ, DW_n = Ds_n x̃_nᵀ the example's own weight gradient
/// (out × a_dim, vec column-major: vec(Ds x̃ᵀ) = x̃ ⊗ Ds), from the rows x̃_n (bias column
/// included) and Ds_n.
mat<double> exact_fisher(const mat<double>& x, const mat<double>& ds) {
    const auto n = x.rows();
    mat<double> f = mat<double>::Zero(x.cols() * ds.cols(), x.cols() * ds.cols());
    for (Eigen::Index i = 0; i < n; ++i) {
        const Eigen::VectorXd v = Eigen::kroneckerProduct(x.row(i).transpose(), ds.row(i).transpose());
        f += v * v.transpose();
    }
    return f / static_cast<double>(n);
}

}  // namespace

// For one example per batch the Fisher block is a Kronecker product exactly; for N examples it
// is one when every example has the same inputs (or the same output gradients): then
// E[x̃x̃ᵀ ⊗ Ds Dsᵀ] = x̃x̃ᵀ ⊗ E[Ds Dsᵀ]. Both cases, for a Linear layer and for a convolution with
// one output position (its patch is its whole input). The host's loss is the batch mean, so
// its output gradients are Ds/N.
TEST_CASE("per-example statistics make A ⊗ G the exact Fisher block of a Linear layer", "[curvature_modes]") {
    const std::int64_t n = 6, in = 3, out = 2;
    for (bool same_inputs : {true, false}) {
        INFO("same inputs: " << same_inputs);
        auto l = random_linear<double>(n, in, out, true, 11);
        const auto row = random_vector<double>(static_cast<std::size_t>(in), 5);
        const auto grad_row = random_vector<double>(static_cast<std::size_t>(out), 6);
        mat<double> x = mat<double>::Ones(n, in + 1), ds(n, out);
        const auto examples = random_vector<double>(static_cast<std::size_t>(n * out), 7);
        for (std::int64_t i = 0; i < n; ++i) {
            for (std::int64_t j = 0; j < in; ++j) {
                if (same_inputs) l.input[static_cast<std::size_t>(i * in + j)] = row[static_cast<std::size_t>(j)];
                x(i, j) = l.input[static_cast<std::size_t>(i * in + j)];
            }
            for (std::int64_t j = 0; j < out; ++j) {
                ds(i, j) = same_inputs ? examples[static_cast<std::size_t>(i * out + j)] : grad_row[static_cast<std::size_t>(j)];
                l.grad_output[static_cast<std::size_t>(i * out + j)] = ds(i, j) / static_cast<double>(n);
            }
        }
        l.bind();
        modes_precond<double> p(per_example_options());
        p.register_layer("fc", l.view);
        p.step();
        const mat<double> kron = Eigen::kroneckerProduct(full_factor(p.a_factor("fc")), full_factor(p.g_factor("fc")));
        const mat<double> exact = exact_fisher(x, ds);
        // A few roundings per entry of sums of N products, relative to the largest entry.
        CHECK(rel_err(kron.reshaped(), exact.reshaped()) < 64 * n * eps<double>());
    }
}

TEST_CASE("per-example statistics make A ⊗ G the exact Fisher block of a one-position convolution",
          "[curvature_modes]") {
    const std::int64_t n = 5, c = 2, k = 3, c_out = 2;
    const kfac::conv2d_geometry g{{k, k}, {1, 1}, {0, 0}, {1, 1}, 1};
    auto l = random_conv<double>(n, c, c_out, g, true, k, k, 21);
    const auto one_input = random_vector<double>(static_cast<std::size_t>(c * k * k), 22);
    mat<double> x = mat<double>::Ones(n, c * k * k + 1), ds(n, c_out);
    for (std::int64_t i = 0; i < n; ++i) {
        for (std::int64_t j = 0; j < c * k * k; ++j) {  // patch order (channel, row, col) = input order
            l.input[static_cast<std::size_t>(i * c * k * k + j)] = one_input[static_cast<std::size_t>(j)];
            x(i, j) = one_input[static_cast<std::size_t>(j)];
        }
        for (std::int64_t o = 0; o < c_out; ++o) ds(i, o) = l.grad_output[static_cast<std::size_t>(i * c_out + o)] * n;
    }
    l.bind();
    modes_precond<double> p(per_example_options());
    p.register_layer("conv", l.view);
    p.step();
    const mat<double> kron = Eigen::kroneckerProduct(full_factor(p.a_factor("conv")), full_factor(p.g_factor("conv")));
    CHECK(rel_err(kron.reshaped(), exact_fisher(x, ds).reshaped()) < 64 * n * eps<double>());
}

// KFC (Grosse & Martens 2016): Ω = (1/N) Σ_n Σ_t p_nt p_ntᵀ over the patches (ones last), and
// Γ = (1/(N·T)) Σ_n Σ_t Ds_nt Ds_ntᵀ over the T output positions, Ds = N·g.
TEMPLATE_TEST_CASE("per-example convolution factors are KFC's, written as loops", "[curvature_modes]", float, double) {
    using T = TestType;
    const std::int64_t n = 3, c = 2, c_out = 3, h = 6, w = 5;
    const kfac::conv2d_geometry geo{{3, 2}, {2, 1}, {1, 0}, {1, 1}, 1};
    auto l = random_conv<T>(n, c, c_out, geo, true, h, w, 31);
    modes_precond<T> p(per_example_options());
    p.register_layer("conv", l.view);
    p.step();
    const std::int64_t ho = l.output_shape[2], wo = l.output_shape[3], positions = ho * wo;
    const std::int64_t cols = c * 3 * 2 + 1;
    mat<double> omega = mat<double>::Zero(cols, cols), gamma = mat<double>::Zero(c_out, c_out);
    for (std::int64_t s = 0; s < n; ++s)
        for (std::int64_t i = 0; i < ho; ++i)
            for (std::int64_t j = 0; j < wo; ++j) {
                Eigen::VectorXd patch = Eigen::VectorXd::Ones(cols);
                for (std::int64_t ci = 0; ci < c; ++ci)
                    for (std::int64_t u = 0; u < 3; ++u)
                        for (std::int64_t v = 0; v < 2; ++v) {
                            const std::int64_t ih = i * 2 + u - 1, iw = j + v;
                            const bool inside = ih >= 0 && ih < h && iw >= 0 && iw < w;
                            patch((ci * 3 + u) * 2 + v) =
                                inside ? static_cast<double>(l.input[static_cast<std::size_t>(((s * c + ci) * h + ih) * w + iw)]) : 0.0;
                        }
                omega += patch * patch.transpose();
                Eigen::VectorXd d(c_out);
                for (std::int64_t o = 0; o < c_out; ++o)
                    d(o) = n * static_cast<double>(l.grad_output[static_cast<std::size_t>(((s * c_out + o) * ho + i) * wo + j)]);
                gamma += d * d.transpose();
            }
    omega /= static_cast<double>(n);
    gamma /= static_cast<double>(n * positions);
    // Sums of N·T products of unit-scale values, a few roundings each (T's unit roundoff).
    const double tolerance = 16.0 * static_cast<double>(n * positions) * eps<T>();
    CHECK(rel_err(full_factor(p.a_factor("conv")).reshaped(), omega.reshaped()) < tolerance);
    CHECK(rel_err(full_factor(p.g_factor("conv")).reshaped(), gamma.reshaped()) < tolerance);
}

// Accumulated passes of different batch sizes: the step's statistic is the mean of the passes'
// per-example statistics (each scaled by its own N), as the reference's is the mean of theirs.
TEST_CASE("per-example statistics of accumulated passes of different batch sizes", "[curvature_modes]") {
    auto o = per_example_options();
    o.accumulation_steps = 2;
    auto first = random_linear<double>(4, 3, 2, true, 41), second = random_linear<double>(7, 3, 2, true, 43);
    kfac::layer_view<double> view = first.view;
    modes_precond<double> p(o);
    p.register_layer("fc", view);
    p.accumulate();
    view = second.view;
    p.step();
    auto per_example = [](const owned_layer<double>& l, std::int64_t examples, bool a) {
        const auto& d = l.view.description;
        return a ? full_factor(factor_statistic(d, l.input, l.input_shape, factor_side::a))
                 : mat<double>(double(examples * examples) *
                               full_factor(factor_statistic(d, l.grad_output, l.output_shape, factor_side::g)));
    };
    const mat<double> a = (per_example(first, 4, true) + per_example(second, 7, true)) / 2.0;
    const mat<double> g = (per_example(first, 4, false) + per_example(second, 7, false)) / 2.0;
    CHECK(rel_err(full_factor(p.a_factor("fc")).reshaped(), a.reshaped()) < 64 * eps<double>());
    CHECK(rel_err(full_factor(p.g_factor("fc")).reshaped(), g.reshaped()) < 64 * eps<double>());
}

// Each layer kind's per-example factor is its reference factor times the scale of the
// definition (kfac/detail/statistic_scale.hpp), with N the examples and S the rows of each.
TEST_CASE("per-example statistics of every layer kind scale the reference's by the definition", "[curvature_modes]") {
    struct kind_case {
        std::string name;
        owned_layer<double> layer;
        double a_scale, g_scale;
    };
    std::vector<kind_case> cases;
    {  // Linear over [N = 2, T = 5, in]: S = 5 rows per example
        auto l = random_linear<double>(10, 3, 4, true, 51);
        l.input_shape = {2, 5, 3};
        l.output_shape = {2, 5, 4};
        l.bind();
        cases.push_back({"linear [2, 5, in]", l, 5.0, 4.0});
    }
    // Embedding, ids [N = 3, T = 4] of a 6-token vocabulary: S = 4
    cases.push_back({"embedding [3, 4]", random_embedding<double>(6, 3, 3, 4, 5, 52), 4.0, 9.0});
    {  // Conv2d, N = 2, 4 × 4 output positions: S³ and N²·S²
        auto l = random_conv<double>(2, 2, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, 4, 4, 54);
        cases.push_back({"conv2d", l, 16.0 * 16.0 * 16.0, 4.0 * 16.0 * 16.0});
    }
    {  // the same convolution under weight sharing reduce: one row per example
        auto l = random_conv<double>(2, 2, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, 4, 4, 55);
        l.view.description.sharing = kfac::weight_sharing::reduce;
        l.bind();
        cases.push_back({"conv2d reduce", l, 1.0, 4.0});
    }
    {  // Conv1d, N = 3, length 7, kernel 3, padding 1: 7 output positions, S³ and N²·S²
        owned_layer<double> l;
        l.view.description = kfac::conv1d_description(2, 3, kfac::conv1d_geometry{3, 1, 1, 1, 1}, true);
        l.input = random_vector<double>(42, 60);
        l.grad_output = random_vector<double>(63, 61, 0.1);
        l.grad_weight = random_vector<double>(18, 62);
        l.grad_bias = random_vector<double>(3, 63);
        l.input_shape = {3, 2, 7};
        l.output_shape = {3, 3, 7};
        l.bind();
        l.view.grad_weight = kfac::tensor_view<double>(l.grad_weight.data(), {3, 2, 3});
        cases.push_back({"conv1d", l, 7.0 * 7.0 * 7.0, 9.0 * 7.0 * 7.0});
    }
    // BatchNorm2d over [N = 4, C = 3, 2, 2], weight sharing reduce: one row per example, N²
    cases.push_back({"batch_norm", random_norm<double>(kfac::batch_norm_description(3, true), {4, 3, 2, 2}, 64),
                     16.0, 1.0});
    // LayerNorm over [N = 3, T = 2, C = 4]: its blocks are quadratic in g, S·N² = 2·9
    cases.push_back({"layer_norm", random_norm<double>(kfac::layer_norm_description(4, true), {3, 2, 4}, 56), 18.0,
                     1.0});
    for (auto& kc : cases) {
        INFO(kc.name);
        kc.layer.bind();  // the copy's views onto its own buffers
        if (kc.layer.view.description.kind == kfac::layer_kind::conv1d)
            kc.layer.view.grad_weight = kfac::tensor_view<double>(kc.layer.grad_weight.data(), {3, 2, 3});
        kfac::options reference_options = per_example_options();
        reference_options.statistics = kfac::statistic_scale::reference;
        modes_precond<double> ref(reference_options), pe(per_example_options());
        ref.register_layer("x", kc.layer.view);
        pe.register_layer("x", kc.layer.view);
        ref.step();
        pe.step();
        const mat<double> a_ref = ref.a_factor("x"), g_ref = ref.g_factor("x");
        CHECK(rel_err(pe.a_factor("x").reshaped(), (kc.a_scale * a_ref).reshaped()) < 16 * eps<double>());
        CHECK(rel_err(pe.g_factor("x").reshaped(), (kc.g_scale * g_ref).reshaped()) < 16 * eps<double>());
    }
}

// kfac-jax's weighted moving average: F_k = Σ_i w_i F̂_i / Σ_i w_i, w_i = (1 − ξ) ξ^(k−i).
TEMPLATE_TEST_CASE("bias-corrected averaging is the weighted moving average", "[curvature_modes]", float, double) {
    using T = TestType;
    kfac::options o;
    o.averaging = kfac::factor_averaging::bias_corrected;
    o.factor_decay = 0.8;
    o.kl_clip = std::nullopt;
    modes_precond<T> p(o);
    auto l = random_linear<T>(5, 3, 2, true, 61);
    p.register_layer("fc", l.view);
    std::vector<mat<double>> stats;
    for (int k = 0; k < 4; ++k) {
        l = random_linear<T>(5, 3, 2, true, 70 + 10 * static_cast<std::uint32_t>(k));
        l.bind();  // the registered view (the same struct) now points at this step's buffers
        stats.push_back(full_factor(factor_statistic(l.view.description, l.input, l.input_shape, factor_side::a)));
        p.step();
        mat<double> expected = mat<double>::Zero(4, 4);
        double total = 0.0;
        for (int i = 0; i <= k; ++i) {
            const double weight = 0.2 * std::pow(0.8, k - i);
            expected += weight * stats[static_cast<std::size_t>(i)];
            total += weight;
        }
        expected /= total;
        INFO("update " << k);
        // A few roundings per update in T, compounded over at most 4 updates.
        CHECK(rel_err(full_factor(p.a_factor("fc")).reshaped(), expected.reshaped()) < 64 * eps<T>());
        const auto report = p.curvature();
        CHECK(report[0].identity_weight == 0.0);
    }
}

TEST_CASE("the curvature report: the identity's weight and the share from their definitions", "[curvature_modes]") {
    for (bool inverse : {false, true}) {
        INFO("inverse method: " << inverse);
        kfac::options o;
        o.factor_decay = 0.9;
        o.damping = 0.05;
        o.kl_clip = std::nullopt;
        auto l = random_linear<double>(8, 4, 3, true, 81);
        std::vector<kfac::layer_curvature> report;
        mat<double> a, g;
        auto run = [&](auto& p) {
            p.register_layer("fc", l.view);
            CHECK(p.curvature()[0].identity_weight == 1.0);
            for (int k = 0; k < 3; ++k) p.step();
            report = p.curvature();
            a = p.a_factor("fc");
            g = p.g_factor("fc");
        };
        if (inverse) {
            modes_precond<double, kfac::compute::inverse> p(o);
            run(p);
        } else {
            modes_precond<double> p(o);
            run(p);
        }
        REQUIRE(report.size() == 1);
        const auto& r = report[0];
        CHECK(r.held);
        CHECK(r.identity_weight == Approx(0.9 * 0.9 * 0.9).epsilon(1e-14));
        const Eigen::VectorXd la = Eigen::SelfAdjointEigenSolver<mat<double>>(a).eigenvalues().cwiseMax(0.0);
        const Eigen::VectorXd lg = Eigen::SelfAdjointEigenSolver<mat<double>>(g).eigenvalues().cwiseMax(0.0);
        double share = 0.0;
        for (double x : la)
            for (double y : lg) share += x * y / (inverse ? (x + 0.05) * (y + 0.05) : x * y + 0.05);
        share /= static_cast<double>(la.size() * lg.size());
        CHECK(r.a.dim == 5);
        CHECK(r.g.dim == 3);
        CHECK(r.a.mean == Approx(la.mean()).epsilon(1e-12));
        CHECK(r.g.max == Approx(lg.maxCoeff()).epsilon(1e-12));
        CHECK(r.mean_product == Approx(la.mean() * lg.mean()).epsilon(1e-12));
        CHECK(r.curvature_share == Approx(share).epsilon(1e-12));
        CHECK(r.damping == 0.05);
    }
}

// Factored Tikhonov damping (Martens & Grosse 2015, §6.3) and relative damping, against the
// preconditioned gradient computed from their definitions with dense solves.
TEMPLATE_TEST_CASE("factored and relative damping precondition as defined", "[curvature_modes]",
                   kfac::compute::eigendecomposition, kfac::compute::inverse) {
    using M = TestType;
    constexpr bool eigen = std::is_same_v<M, kfac::compute::eigendecomposition>;
    const double gamma = 0.02;
    for (int mode = 0; mode < 3; ++mode) {
        const bool factored = mode != 1, relative = mode != 0;
        INFO("factored " << factored << ", relative " << relative);
        kfac::options o = per_example_options();
        o.damping = gamma;
        o.damping_mode = factored ? kfac::damping_form::factored : kfac::damping_form::reference;
        o.relative_damping = relative;
        auto l = random_linear<double>(9, 4, 3, true, 91);
        const std::vector<double> grad_w = l.grad_weight, grad_b = l.grad_bias;
        modes_precond<double, M> p(o);
        p.register_layer("fc", l.view);
        p.step();
        const mat<double> a = p.a_factor("fc"), g = p.g_factor("fc");
        const double m_a = a.trace() / 5.0, m_g = g.trace() / 3.0;
        const double damping = relative ? gamma * m_a * m_g : gamma;
        // Γ = [W | b] (out × a_dim); P = the preconditioned gradient as the host sees it.
        mat<double> grad(3, 5), expected;
        for (int i = 0; i < 3; ++i) {
            for (int j = 0; j < 4; ++j) grad(i, j) = grad_w[static_cast<std::size_t>(i * 4 + j)];
            grad(i, 4) = grad_b[static_cast<std::size_t>(i)];
        }
        if (factored) {
            const double pi = std::sqrt(m_a / m_g);
            const mat<double> a_damped = a + pi * std::sqrt(damping) * mat<double>::Identity(5, 5);
            const mat<double> g_damped = g + std::sqrt(damping) / pi * mat<double>::Identity(3, 3);
            expected = g_damped.inverse() * grad * a_damped.inverse();
        } else if (eigen) {  // vec P = (A ⊗ G + γ' I)⁻¹ vec Γ
            const mat<double> f = Eigen::kroneckerProduct(a, g) + damping * mat<double>::Identity(15, 15);
            const Eigen::VectorXd v = f.ldlt().solve(grad.reshaped());
            expected = v.reshaped(3, 5);
        } else {
            expected = (g + damping * mat<double>::Identity(3, 3)).inverse() * grad *
                       (a + damping * mat<double>::Identity(5, 5)).inverse();
        }
        mat<double> got(3, 5);
        for (int i = 0; i < 3; ++i) {
            for (int j = 0; j < 4; ++j) got(i, j) = l.grad_weight[static_cast<std::size_t>(i * 4 + j)];
            got(i, 4) = l.grad_bias[static_cast<std::size_t>(i)];
        }
        // Decompositions and solves of 5 × 5 and 3 × 3 matrices with condition numbers below
        // 1e4 here: 1e-9 relative bounds their error with a wide margin.
        CHECK(rel_err(got.reshaped(), expected.reshaped()) < 1e-9);
        const auto r = p.curvature()[0];
        if (factored) {
            const double pi = std::sqrt(m_a / m_g);
            CHECK(r.damping_a == Approx(pi * std::sqrt(damping)).epsilon(1e-12));
            CHECK(r.damping_g == Approx(std::sqrt(damping) / pi).epsilon(1e-12));
            CHECK(r.damping_product == 0.0);
        }
    }
}

TEST_CASE("curvature modes: errors and checkpoints", "[curvature_modes][checkpoint]") {
    SECTION("the eigen method without the outer product refuses per-layer damping") {
        kfac::options o;
        o.compute_eigenvalue_outer_product = false;
        o.relative_damping = true;
        CHECK_THROWS_WITH(modes_precond<double>(o), Catch::Contains("options.relative_damping = true") &&
                                                  Catch::Contains("compute_eigenvalue_outer_product = true"));
        o.relative_damping = false;
        o.damping_mode = kfac::damping_form::factored;
        CHECK_THROWS_WITH(modes_precond<double>(o), Catch::Contains("damping_form::factored"));
        CHECK_NOTHROW(modes_precond<double, kfac::compute::inverse>(o));
    }
    SECTION("invalid enumerators are named") {
        kfac::options o;
        o.averaging = static_cast<kfac::factor_averaging>(7);
        CHECK_THROWS_WITH(modes_precond<double>(o), Catch::Contains("options.averaging = 7"));
    }
    SECTION("a checkpoint records the modes and W; another mode is refused unless allowed") {
        auto o = per_example_options();
        o.damping_mode = kfac::damping_form::factored;
        o.relative_damping = true;
        o.factor_decay = 0.7;
        auto l = random_linear<double>(6, 3, 2, true, 101);
        auto run = [&](modes_precond<double>& p, int steps) {
            for (int k = 0; k < steps; ++k) {
                l = random_linear<double>(6, 3, 2, true, 200 + static_cast<std::uint32_t>(p.steps()));
                l.bind();
                p.step();
            }
        };
        modes_precond<double> a(o);
        a.register_layer("fc", l.view);
        run(a, 2);
        const std::string bytes = a.save_bytes();
        modes_precond<double> b(o);
        b.register_layer("fc", l.view);
        b.load_bytes(bytes);
        run(a, 2);
        const std::vector<double> after_a = l.grad_weight;
        run(b, 2);
        CHECK(l.grad_weight == after_a);  // bitwise resume: W and the modes came back
        CHECK(a.save_bytes() == b.save_bytes());

        kfac::options other = o;
        other.averaging = kfac::factor_averaging::reference;
        modes_precond<double> c(other);
        c.register_layer("fc", l.view);
        CHECK_THROWS_WITH(c.load_bytes(bytes), Catch::Contains("averaging"));
        CHECK_NOTHROW(c.load_bytes(bytes, {.allow_changed_options = true}));

        // A file without W (as files before it was recorded): the identity's weight is unknown.
        auto state = kfac::checkpoint::from_archive(kfac::checkpoint::parse(bytes, "bytes"), "bytes");
        CHECK(state.statistics_weights.at("fc") == Approx(1.0 - 0.7 * 0.7).epsilon(1e-15));
        state.statistics_weights.clear();
        kfac::options ref = o;
        ref.averaging = kfac::factor_averaging::reference;
        state.options["averaging"] = "reference";
        modes_precond<double> d(ref);
        d.register_layer("fc", l.view);
        d.load_bytes(kfac::checkpoint::serialize(kfac::checkpoint::to_archive(state)));
        CHECK(std::isnan(d.curvature()[0].identity_weight));
    }
}

// The damping modes on the other block kinds: an Embedding's diagonal A (factored damping:
// (A + π√γ)⁻¹ Γ (G + √γ/π)⁻¹ on its [V, E] gradient) and a LayerNorm's unit-wise blocks, whose
// one estimated factor takes the relative damping γ·m_A whole: (F_c + γ m_A I)⁻¹ Γ_c.
TEMPLATE_TEST_CASE("factored and relative damping on diagonal and unit-wise blocks", "[curvature_modes]",
                   kfac::compute::eigendecomposition, kfac::compute::inverse) {
    using M = TestType;
    const double gamma = 0.05;
    SECTION("Embedding, factored") {
        auto l = random_embedding<double>(5, 3, 4, 3, 3, 301);
        const std::vector<double> grad = l.grad_weight;
        kfac::options o = per_example_options();
        o.damping = gamma;
        o.damping_mode = kfac::damping_form::factored;
        modes_precond<double, M> p(o);
        p.register_layer("emb", l.view);
        p.step();
        const mat<double> a = full_factor(p.a_factor("emb")), g = p.g_factor("emb");
        const double m_a = a.trace() / 5.0, m_g = g.trace() / 3.0, pi = std::sqrt(m_a / m_g);
        const mat<double> gamma_w = Eigen::Map<const row_mat<double>>(grad.data(), 5, 3);
        const mat<double> expected = (a + pi * std::sqrt(gamma) * mat<double>::Identity(5, 5)).inverse() * gamma_w *
                                     (g + std::sqrt(gamma) / pi * mat<double>::Identity(3, 3)).inverse();
        const mat<double> got = Eigen::Map<const row_mat<double>>(l.grad_weight.data(), 5, 3);
        // Solves of a diagonal and a 3 × 3 matrix, condition numbers below 1e3: 1e-10 bounds the error.
        CHECK(rel_err(got.reshaped(), expected.reshaped()) < 1e-10);
    }
    SECTION("LayerNorm, relative and factored") {
        auto l = random_norm<double>(kfac::layer_norm_description(4, true), {3, 2, 4}, 311);
        const std::vector<double> gw = l.grad_weight, gb = l.grad_bias;
        kfac::options o = per_example_options();
        o.damping = gamma;
        o.damping_mode = kfac::damping_form::factored;
        o.relative_damping = true;
        modes_precond<double, M> p(o);
        p.register_layer("ln", l.view);
        p.step();
        const mat<double> blocks = p.a_factor("ln");  // C × 3: F_γγ, F_γβ, F_ββ
        const double m_a = (blocks.col(0).sum() + blocks.col(2).sum()) / 8.0;
        for (int c = 0; c < 4; ++c) {
            mat<double> f(2, 2);
            f << blocks(c, 0), blocks(c, 1), blocks(c, 1), blocks(c, 2);
            const Eigen::Vector2d expected =
                (f + gamma * m_a * mat<double>::Identity(2, 2)).inverse() * Eigen::Vector2d(gw[c], gb[c]);
            INFO("channel " << c);
            // A 2 × 2 closed-form inverse against Eigen's: a few roundings, relative to the result.
            CHECK(l.grad_weight[static_cast<std::size_t>(c)] == Approx(expected(0)).epsilon(1e-10));
            CHECK(l.grad_bias[static_cast<std::size_t>(c)] == Approx(expected(1)).epsilon(1e-10));
        }
    }
}
