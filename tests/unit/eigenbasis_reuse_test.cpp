// SPDX-License-Identifier: Apache-2.0
// options.eigenbasis_reuse_tolerance: an inverse update keeps a factor's previous eigenvectors
// with its new Rayleigh quotients exactly when they diagonalise the factor to within the
// tolerance, and decomposes it otherwise. Checked against the definition computed here.

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include <Eigen/Eigenvalues>
#include <Eigen/QR>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {

using eigen_kfac = kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial, kfac::compute::eigendecomposition>;

/// A random orthogonal n × n matrix (Q of a Gaussian matrix's QR).
template <class T>
mat<T> random_orthogonal(Eigen::Index n, std::uint32_t seed) {
    const auto v = random_vector<double>(static_cast<std::size_t>(n * n), seed);
    const mat<double> g = Eigen::Map<const mat<double>>(v.data(), n, n);
    const mat<double> q = Eigen::HouseholderQR<mat<double>>(g).householderQ();
    return q.template cast<T>();
}

/// ‖F Q − Q diag(qᵢᵀ F qᵢ)‖_F / ‖F‖_F, the definition the option states, in double.
double relative_residual(const mat<double>& F, const mat<double>& Q) {
    const mat<double> fq = F * Q;
    const Eigen::VectorXd quotients = (Q.array() * fq.array()).colwise().sum().transpose();
    return (fq - Q * quotients.asDiagonal()).norm() / F.norm();
}

/// Eigenvectors of F (ascending eigenvalues), and the smallest gap between eigenvalues
/// relative to ‖F‖₂, which bounds how far two solvers' eigenvectors can differ.
struct decomposition {
    mat<double> q;
    double relative_gap = 0.0;
};
decomposition decompose(const mat<double>& F) {
    Eigen::SelfAdjointEigenSolver<mat<double>> s(F);
    const auto& l = s.eigenvalues();
    double gap = std::numeric_limits<double>::infinity();
    for (Eigen::Index i = 1; i < l.size(); ++i) gap = std::min(gap, l(i) - l(i - 1));
    return {s.eigenvectors(), gap / l.cwiseAbs().maxCoeff()};
}

/// A Linear(6 → 4, bias) layer stepped over fresh batches with a fixed Γ; after each step the
/// factors and the preconditioned [∇W | ∇b] (4 × 7) are recorded.
struct linear_run {
    owned_layer<double> layer = random_linear<double>(32, 6, 4, true, 7);
    std::vector<double> gw0 = layer.grad_weight, gb0 = layer.grad_bias;
    std::vector<mat<double>> a, g, p;

    explicit linear_run(double tolerance, int steps, double decay = 0.5) {
        kfac::options o;
        o.kl_clip = std::nullopt;  // P itself, unscaled
        o.factor_decay = decay;
        o.damping = 0.01;
        o.eigenbasis_reuse_tolerance = tolerance;
        eigen_kfac k(o);
        k.register_layer("fc", layer.view);
        for (int t = 0; t < steps; ++t) {
            layer.input = random_vector<double>(layer.input.size(), 200 + static_cast<std::uint32_t>(t));
            layer.grad_output = random_vector<double>(layer.grad_output.size(), 300 + static_cast<std::uint32_t>(t), 1.0 / 8);
            layer.grad_weight = gw0;
            layer.grad_bias = gb0;
            layer.bind();
            k.step();
            a.push_back(k.a_factor("fc"));
            g.push_back(k.g_factor("fc"));
            p.push_back(gradient(layer.grad_weight, layer.grad_bias));
        }
        counts = k.eigenbasis_counts();
    }
    static mat<double> gradient(const std::vector<double>& w, const std::vector<double>& b) {
        mat<double> m(4, 7);
        m.leftCols(6) = Eigen::Map<const row_mat<double>>(w.data(), 4, 6);
        m.col(6) = Eigen::Map<const Eigen::VectorXd>(b.data(), 4);
        return m;
    }
    eigen_kfac::eigenbasis_count counts{};
};

}  // namespace

TEMPLATE_TEST_CASE("rayleigh_quotients: the quotients and the relative off-diagonal mass", "[eigenbasis_reuse]", float, double) {
    using T = TestType;
    using backend = kfac::backend::cpu_eigen<T>;
    constexpr Eigen::Index n = 40;
    const mat<double> q = random_orthogonal<double>(n, 11);
    // F = Q (D + E) Qᵀ with E symmetric and zero on the diagonal: the quotients are D, the
    // residual ‖E‖_F / ‖D + E‖_F (Q orthogonal preserves both norms).
    mat<double> inner = mat<double>::Zero(n, n);
    const auto e = random_vector<double>(static_cast<std::size_t>(n * n), 12, 0.01);
    for (Eigen::Index j = 0; j < n; ++j)
        for (Eigen::Index i = j + 1; i < n; ++i) inner(i, j) = inner(j, i) = e[static_cast<std::size_t>(j * n + i)];
    const mat<double> off_diagonal = inner;
    for (Eigen::Index i = 0; i < n; ++i) inner(i, i) = 1.0 + static_cast<double>(i) / 10.0;
    const mat<double> F = q * inner * q.transpose();
    const double expected = off_diagonal.norm() / inner.norm();
    REQUIRE(expected > 0.01);

    typename backend::vector lambda;
    const double residual = backend::rayleigh_quotients(F.cast<T>(), q.cast<T>(), lambda);
    // Inputs rounded to T and a GEMM in T: each entry of F Q is off by ≤ n·u·‖F‖_max·‖Q‖_max
    // per term (γ_n), so the residual's numerator moves by ≤ n·u·‖F‖_F·√n and the quotients
    // by ≤ 2n·u·max|λ|; 10× margin for the rounding of Q and F themselves.
    const double u = eps<T>() / 2;
    const double bound = 10.0 * static_cast<double>(n) * u * std::sqrt(static_cast<double>(n));
    CHECK(std::abs(residual - expected) <= bound);
    REQUIRE(lambda.size() == n);
    for (Eigen::Index i = 0; i < n; ++i) CHECK(std::abs(static_cast<double>(lambda(i)) - inner(i, i)) <= 20.0 * n * u * 5.0);

    SECTION("a zero or non-finite factor is never accepted") {
        CHECK(std::isnan(backend::rayleigh_quotients(mat<T>::Zero(n, n), q.cast<T>(), lambda)));
        mat<T> bad = F.cast<T>();
        bad(3, 5) = std::numeric_limits<T>::quiet_NaN();
        CHECK_FALSE(backend::rayleigh_quotients(bad, q.cast<T>(), lambda) <= 0.99);
        bad(3, 5) = std::numeric_limits<T>::infinity();
        CHECK_FALSE(backend::rayleigh_quotients(bad, q.cast<T>(), lambda) <= 0.99);
    }
}

TEST_CASE("a reused basis: previous eigenvectors with the new factor's Rayleigh quotients", "[eigenbasis_reuse]") {
    // τ = 0.99 accepts any basis that is not far off: step 1 keeps step 0's eigenvectors.
    const linear_run reused(0.99, 2), exact(0.0, 2);
    CHECK(reused.counts.decomposed == 2);  // step 0: nothing to reuse
    CHECK(reused.counts.reused == 2);      // step 1: both factors
    CHECK(exact.counts.decomposed == 4);
    CHECK(exact.counts.reused == 0);
    REQUIRE(reused.a[1] == exact.a[1]);  // the factors themselves are untouched

    // P = Q_G [(Q_Gᵀ Γ Q_A) ⊘ (λ̃_G λ̃_Aᵀ + γ)] Q_Aᵀ with Q from step 0's factors, λ̃ the
    // Rayleigh quotients of step 1's (clamped at 0).
    const auto da = decompose(reused.a[0]), dg = decompose(reused.g[0]);
    // Our solver and Eigen's agree on eigenvectors to ≈ n·u / relative gap (Davis–Kahan):
    // with gaps ≥ 1e-3 that is ≤ 7·1.1e-16/1e-3 ≈ 1e-12; P inherits it times a small
    // constant, so 1e-10 leaves a margin of 100 and still fails for any other basis.
    REQUIRE(da.relative_gap > 1e-3);
    REQUIRE(dg.relative_gap > 1e-3);
    const Eigen::VectorXd la = (da.q.transpose() * reused.a[1] * da.q).diagonal().cwiseMax(0.0);
    const Eigen::VectorXd lg = (dg.q.transpose() * reused.g[1] * dg.q).diagonal().cwiseMax(0.0);
    const mat<double> gamma = linear_run::gradient(reused.gw0, reused.gb0);
    mat<double> v = dg.q.transpose() * gamma * da.q;
    v.array() /= (lg * la.transpose()).array() + 0.01;
    const mat<double> expected = dg.q * v * da.q.transpose();
    CHECK(rel_err(reused.p[1].reshaped(), expected.reshaped()) < 1e-10);
    // and it is not the exact answer: the basis did move
    CHECK(rel_err(exact.p[1].reshaped(), expected.reshaped()) > 1e-6);
    CHECK(reused.p[0] == exact.p[0]);
}

TEST_CASE("the tolerance decides on the relative off-diagonal mass", "[eigenbasis_reuse]") {
    const linear_run probe(0.0, 2);
    const double ra = relative_residual(probe.a[1], decompose(probe.a[0]).q);
    const double rg = relative_residual(probe.g[1], decompose(probe.g[0]).q);
    INFO("residual A " << ra << ", G " << rg);
    REQUIRE(ra > 1e-4);
    REQUIRE(rg > 1e-4);
    REQUIRE(std::abs(ra - rg) > 1e-3 * std::max(ra, rg));
    // Our quotients and residual are those of our own eigenvectors, which differ from Eigen's
    // in the last digits: a relative margin of 1e-6 keeps the decision away from that.
    const double above = 1.0 + 1e-6, below = 1.0 - 1e-6;

    const linear_run both(std::max(ra, rg) * above, 2);
    CHECK(both.counts.reused == 2);
    const linear_run one(std::min(ra, rg) * above, 2);
    CHECK(one.counts.reused == 1);
    CHECK(one.counts.decomposed == 3);
    const linear_run none(std::min(ra, rg) * below, 2);
    CHECK(none.counts.reused == 0);
    CHECK(none.p[1] == probe.p[1]);  // decomposed: bitwise the exact run
}

TEST_CASE("a reused basis is measured against each new factor, not only the last decomposed one", "[eigenbasis_reuse]") {
    // Over 12 steps with τ = 0.2 the basis is kept while the factors drift, and replaced once
    // they moved too far: every reuse (checked through the run with τ large) must have been
    // within τ of the factor of its own step, measured from the basis in force then.
    const double tau = 0.2;
    const linear_run run(tau, 12, 0.3);
    CHECK(run.counts.reused > 0);
    CHECK(run.counts.decomposed > 2);
    // Replay the rule here: the basis of each factor is the last one decomposed.
    int reused = 0, decomposed = 0;
    mat<double> qa = decompose(run.a[0]).q, qg = decompose(run.g[0]).q;
    decomposed += 2;
    for (std::size_t t = 1; t < run.a.size(); ++t) {
        for (auto [f, q] : {std::pair{&run.a[t], &qa}, std::pair{&run.g[t], &qg}}) {
            if (relative_residual(*f, *q) <= tau) {
                ++reused;
            } else {
                *q = decompose(*f).q;
                ++decomposed;
            }
        }
    }
    CHECK(run.counts.reused == reused);
    CHECK(run.counts.decomposed == decomposed);
}

TEST_CASE("eigenbasis_reuse_tolerance: range and method are checked", "[eigenbasis_reuse][errors]") {
    for (double bad : {-0.1, 1.0, 2.0, std::numeric_limits<double>::quiet_NaN()}) {
        kfac::options o;
        o.eigenbasis_reuse_tolerance = bad;
        CHECK_THROWS_WITH(eigen_kfac(o), Catch::Contains("options.eigenbasis_reuse_tolerance") && Catch::Contains("[0, 1)"));
    }
    kfac::options o;
    o.eigenbasis_reuse_tolerance = 0.05;
    using inverse_kfac = kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial, kfac::compute::inverse>;
    CHECK_THROWS_WITH(inverse_kfac(o), Catch::Contains("eigenbasis_reuse_tolerance") && Catch::Contains("'inverse'") &&
                                           Catch::Contains("kfac::compute::eigendecomposition"));
    CHECK_NOTHROW(eigen_kfac(o));
}
