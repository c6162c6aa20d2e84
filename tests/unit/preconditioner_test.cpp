// SPDX-License-Identifier: Apache-2.0
// The preconditioner end to end on small layers: a worked example, the damping → 0 limit,
// schedules, kl_clip, accumulation and skip patterns.
#include <catch2/catch.hpp>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {

template <class Method>
using kfac_d = kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial, Method>;

/// The worked example of reference/kfac-pytorch-spec.md §2.15, derived from the formulas:
/// Linear(2→2, bias), x = [[1,2],[3,4]], g = [[0.1,−0.2],[0.3,0.05]], step 0.
template <class Method>
owned_layer<double> worked_example_layer() {
    owned_layer<double> l;
    l.view.description = kfac::linear_description(2, 2, true);
    l.input = {1, 2, 3, 4};
    l.grad_output = {0.1, -0.2, 0.3, 0.05};
    l.grad_weight = {1.0, 1.4, -0.05, -0.2};
    l.grad_bias = {0.4, -0.15};
    l.input_shape = {2, 2};
    l.output_shape = {2, 2};
    l.bind();
    return l;
}

kfac::options worked_example_options() {
    kfac::options o;
    o.damping = 0.001;
    o.factor_decay = 0.95;
    o.kl_clip = 0.001;
    o.lr = 0.1;
    return o;
}

template <class Method>
void check_worked_example(const std::array<double, 6>& v, double scale) {
    auto l = worked_example_layer<Method>();
    kfac_d<Method> p(worked_example_options());
    p.register_layer("fc", l.view);
    p.step();
    // The published values carry 11 significant digits.
    CHECK(p.last_kl_scale() == Approx(scale).epsilon(1e-9));
    const std::array<double, 6> got = {l.grad_weight[0], l.grad_weight[1], l.grad_bias[0],
                                       l.grad_weight[2], l.grad_weight[3], l.grad_bias[1]};
    for (std::size_t i = 0; i < 6; ++i) CHECK(got[i] == Approx(scale * v[i]).epsilon(1e-9));
    mat<double> a0(3, 3);
    a0 << 1.2, 0.35, 0.1, 0.35, 1.45, 0.15, 0.1, 0.15, 1.0;
    CHECK(rel_err(p.a_factor("fc").reshaped(), a0.reshaped()) < 1e-15);
    CHECK(p.g_factor("fc")(1, 1) == Approx(0.9510625).epsilon(1e-15));
}

}  // namespace

TEST_CASE("worked example, inverse method", "[preconditioner]") {
    check_worked_example<kfac::compute::inverse>(
        {0.60880864083, 0.84102781692, 0.23221917609, 0.0063279081730, -0.13188198124, -0.13820988941},
        0.22786630948);
}

TEST_CASE("worked example, eigendecomposition method", "[preconditioner]") {
    check_worked_example<kfac::compute::eigendecomposition>(
        {0.60943001112, 0.84188677900, 0.23245676788, 0.0063324571003, -0.13201608944, -0.13834854654},
        0.22775007418);
}

TEMPLATE_TEST_CASE("with damping -> 0 the preconditioner is the exact Kronecker solve",
                   "[preconditioner][property]", kfac::compute::eigendecomposition, kfac::compute::inverse) {
    // factor_decay = 0 makes the factors the batch statistics; 64 rows of 5 features make A
    // well conditioned. P must solve G P A = Γ, i.e. P = G⁻¹ Γ A⁻¹.
    const double damping = 1e-12;
    auto l = random_linear<double>(64, 5, 3, true, 42);
    for (auto& g : l.grad_output) g *= 64.0;  // O(1) gradients: G's eigenvalues are O(1)
    const std::vector<double> gw0 = l.grad_weight, gb0 = l.grad_bias;
    kfac::options o;
    o.damping = damping;
    o.factor_decay = 0.0;
    o.kl_clip = std::nullopt;
    kfac_d<TestType> p(o);
    p.register_layer("fc", l.view);
    p.step();

    const mat<double> A = p.a_factor("fc"), G = p.g_factor("fc");
    mat<double> gamma(3, 6);
    gamma.leftCols(5) = Eigen::Map<const row_mat<double>>(gw0.data(), 3, 5);
    gamma.col(5) = Eigen::Map<const Eigen::VectorXd>(gb0.data(), 3);
    const mat<double> exact = G.ldlt().solve(gamma) * A.inverse();
    mat<double> got(3, 6);
    got.leftCols(5) = Eigen::Map<const row_mat<double>>(l.grad_weight.data(), 3, 5);
    got.col(5) = Eigen::Map<const Eigen::VectorXd>(l.grad_bias.data(), 3);

    // Bound: the damping's relative perturbation γ/λ_min plus rounding amplified by the
    // condition number of A ⊗ G.
    Eigen::SelfAdjointEigenSolver<mat<double>> ea(A), eg(G);
    const double lmin = ea.eigenvalues().minCoeff() * eg.eigenvalues().minCoeff();
    const double kappa = ea.eigenvalues().maxCoeff() * eg.eigenvalues().maxCoeff() / lmin;
    REQUIRE(lmin > 1e-3);
    CHECK(rel_err(got.reshaped(), exact.reshaped()) < 10 * (damping / lmin + 100 * kappa * eps<double>()));
}

TEST_CASE("factor and inverse update intervals", "[preconditioner][schedule]") {
    auto l = random_linear<double>(16, 4, 3, false, 1);
    kfac::options o;
    o.factor_update_steps = std::int64_t{2};
    o.inv_update_steps = std::int64_t{4};
    o.kl_clip = std::nullopt;
    kfac_d<kfac::compute::eigendecomposition> p(o);
    p.register_layer("fc", l.view);
    const std::vector<double> gw = l.grad_weight;
    std::vector<mat<double>> a_after, p_after;
    for (int t = 0; t < 6; ++t) {
        l.input = random_vector<double>(l.input.size(), 100 + static_cast<std::uint32_t>(t));  // a new batch
        l.grad_weight = gw;                                                                   // the same Γ
        l.bind();
        p.step();
        a_after.push_back(p.a_factor("fc"));
        p_after.push_back(Eigen::Map<const mat<double>>(l.grad_weight.data(), 12, 1));
    }
    CHECK(p.steps() == 6);
    // Factors change on steps 0, 2, 4 only.
    CHECK(a_after[1] == a_after[0]);
    CHECK(a_after[2] != a_after[1]);
    CHECK(a_after[3] == a_after[2]);
    CHECK(a_after[4] != a_after[3]);
    CHECK(a_after[5] == a_after[4]);
    // Decompositions are recomputed on steps 0 and 4 only: steps 1-3 reuse step 0's even
    // though the factors changed at step 2.
    CHECK(p_after[1] == p_after[0]);
    CHECK(p_after[2] == p_after[0]);
    CHECK(p_after[3] == p_after[0]);
    CHECK(p_after[4] != p_after[3]);
}

TEST_CASE("scheduled damping: outer product fixes it at inverse updates", "[preconditioner][schedule]") {
    for (bool outer : {true, false}) {
        INFO("compute_eigenvalue_outer_product " << outer);
        auto l = random_linear<double>(16, 4, 3, true, 2);
        kfac::options o;
        o.damping = [](std::int64_t k) { return k == 0 ? 1e-3 : 1.0; };
        o.inv_update_steps = std::int64_t{100};
        o.factor_update_steps = std::int64_t{100};
        o.kl_clip = std::nullopt;
        o.compute_eigenvalue_outer_product = outer;
        kfac_d<kfac::compute::eigendecomposition> p(o);
        p.register_layer("fc", l.view);
        const std::vector<double> gw = l.grad_weight, gb = l.grad_bias;
        p.step();
        const std::vector<double> p0 = l.grad_weight;
        l.grad_weight = gw;
        l.grad_bias = gb;
        l.bind();
        p.step();
        // With the outer product D the step-0 damping stays until the next inverse update;
        // without it the new damping applies at once.
        if (outer) CHECK(l.grad_weight == p0);
        else CHECK(l.grad_weight != p0);
    }
}

TEST_CASE("kl_clip scales every layer by one factor", "[preconditioner][kl_clip]") {
    auto run = [](std::optional<double> clip, double& nu) {
        auto l1 = random_linear<double>(16, 4, 3, true, 3);
        auto l2 = random_linear<double>(16, 3, 2, false, 4);
        std::vector<double> gamma;
        for (auto* l : {&l1, &l2}) {
            gamma.insert(gamma.end(), l->grad_weight.begin(), l->grad_weight.end());
            gamma.insert(gamma.end(), l->grad_bias.begin(), l->grad_bias.begin() + (l->view.description.bias ? 3 : 0));
        }
        kfac::options o;
        o.kl_clip = clip;
        o.lr = 0.5;
        kfac_d<kfac::compute::inverse> p(o);
        p.register_layer("a", l1.view);
        p.register_layer("b", l2.view);
        p.step();
        nu = p.last_kl_scale();
        std::vector<double> out;
        for (auto* l : {&l1, &l2}) {
            out.insert(out.end(), l->grad_weight.begin(), l->grad_weight.end());
            out.insert(out.end(), l->grad_bias.begin(), l->grad_bias.begin() + (l->view.description.bias ? 3 : 0));
        }
        return std::pair(out, gamma);
    };
    double nu_none = 0, nu_tight = 0, nu_loose = 0;
    const auto [unclipped, gamma] = run(std::nullopt, nu_none);
    CHECK(nu_none == 1.0);
    double s = 0;
    for (std::size_t i = 0; i < gamma.size(); ++i) s += unclipped[i] * gamma[i];
    s *= 0.25;  // lr²
    const double kappa = std::abs(s) / 16;  // binds: ν = sqrt(κ/|s|) = 1/4
    const auto clipped = run(kappa, nu_tight).first;
    CHECK(nu_tight == Approx(0.25).epsilon(1e-12));
    for (std::size_t i = 0; i < clipped.size(); ++i) CHECK(clipped[i] == Approx(0.25 * unclipped[i]).epsilon(1e-12));
    const auto loose = run(std::abs(s) * 4, nu_loose).first;  // does not bind
    CHECK(nu_loose == 1.0);
    CHECK(loose == unclipped);
}

TEMPLATE_TEST_CASE("accumulation over micro-batches equals one batch", "[preconditioner][accumulation]", float, double) {
    using T = TestType;
    using kfac_t = kfac::KFAC<kfac::backend::cpu_eigen<T>>;
    auto whole = random_linear<T>(12, 4, 3, true, 5);
    auto halves = whole;
    kfac::options single;
    kfac_t p1(single);
    p1.register_layer("fc", whole.view);
    p1.step();

    kfac::options acc;
    acc.accumulation_steps = 2;
    kfac_t p2(acc);
    halves.bind();
    p2.register_layer("fc", halves.view);
    halves.view.input.extents[0] = 6;  // first micro-batch: rows 0-5
    halves.view.grad_output.extents[0] = 6;
    p2.accumulate();
    halves.view.input.data += 6 * 4;  // second: rows 6-11
    halves.view.grad_output.data += 6 * 3;
    p2.step();
    CHECK(rel_err(p2.a_factor("fc").reshaped(), p1.a_factor("fc").reshaped()) < 64 * eps<T>());
    CHECK(rel_err(p2.g_factor("fc").reshaped(), p1.g_factor("fc").reshaped()) < 64 * eps<T>());
    Eigen::Map<const Eigen::Matrix<T, -1, 1>> w1(whole.grad_weight.data(), 12), w2(halves.grad_weight.data(), 12);
    // The eigenvectors amplify the factor's rounding by the spectrum's gaps; 1e4·ε is far
    // below the size of any formula error.
    CHECK(rel_err(w2, w1) < 1e4 * eps<T>());
}

TEST_CASE("accumulation misuse is reported", "[preconditioner][accumulation][errors]") {
    auto l = random_linear<double>(8, 4, 3, false, 6);
    kfac::options o;
    o.accumulation_steps = 3;
    kfac_d<kfac::compute::inverse> p(o);
    p.register_layer("fc", l.view);
    p.accumulate();
    CHECK_THROWS_WITH(p.step(), Catch::Contains("step() after 1 accumulate() call(s)") && Catch::Contains("accumulation_steps = 3"));
    kfac_d<kfac::compute::inverse> q(o);
    q.register_layer("fc", l.view);
    q.accumulate();
    q.accumulate();
    CHECK_THROWS_WITH(q.accumulate(), Catch::Contains("accumulate() called 3 times"));
}

TEST_CASE("skip_layers matches names and kinds", "[preconditioner][registration]") {
    kfac::options o;
    o.skip_layers = {"^head$", "Conv2d"};
    kfac_d<kfac::compute::inverse> p(o);
    auto fc = random_linear<double>(4, 3, 2, false, 7);
    auto head = random_linear<double>(4, 2, 2, false, 8);
    kfac::layer_view<double> conv;
    conv.description = kfac::conv2d_description(3, 4, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, false);
    CHECK(p.register_layer("fc", fc.view));
    CHECK_FALSE(p.register_layer("head", head.view));
    CHECK_FALSE(p.register_layer("features.0", conv));
    CHECK(p.layer_count() == 1);
    CHECK(p.is_registered("fc"));
    CHECK_FALSE(p.is_registered("head"));
}
