// SPDX-License-Identifier: Apache-2.0
// The phases of a step, each called on its own on the engine (kfac/detail/engine.hpp) in the
// order preconditioner::step() calls them, and each checked against its definition right after
// it ran: the pass's statistic, the running average, the second-order data as it preconditions,
// the kl_clip scale, the write-back into the host's buffers and the commit.

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include <kfac/kfac.hpp>

#include "unit/flaky_layer.hpp"
#include "unit/test_util.hpp"

namespace {

using kfac_test::mat;
using engine = kfac::detail::engine<kfac::backend::cpu_eigen<double>, kfac::comm::serial, kfac::compute::eigendecomposition>;

/// Γ = [∇W | ∇b] (out × (in + 1)), as the preconditioner reads the host's buffers.
mat<double> gradient_of(const kfac_test::owned_layer<double>& l) {
    const auto& d = l.view.description;
    mat<double> g(d.out, d.in + 1);
    for (std::int64_t o = 0; o < d.out; ++o) {
        for (std::int64_t i = 0; i < d.in; ++i) g(o, i) = l.grad_weight[static_cast<std::size_t>(o * d.in + i)];
        g(o, d.in) = l.grad_bias[static_cast<std::size_t>(o)];
    }
    return g;
}

}  // namespace

TEST_CASE("each phase of a step runs on its own and does what it is defined to do", "[phases]") {
    auto layer = kfac_test::random_linear<double>(8, 5, 3, true, 11);
    const mat<double> gamma = gradient_of(layer);
    kfac::options o;
    o.damping = 0.01;
    o.factor_decay = 0.9;
    engine e(o, kfac::comm::serial{}, kfac::detail::assignment_policy_of<kfac::assignment::compute_balanced>());
    REQUIRE(e.register_layer("fc", layer.view));
    const auto& record = e.find("fc");
    const auto& d = layer.view.description;

    e.setup();
    const kfac::detail::step_plan plan = e.read_plan();
    REQUIRE(plan.step == 0);
    REQUIRE(plan.factor_update);
    REQUIRE(plan.inverse_update);
    engine::step_outcome outcome;

    // finish_pass: the pass's statistics, the lower triangles of A's and G's batch statistic.
    e.finish_pass(plan.factor_update);
    const mat<double> a_hat = kfac_test::factor_statistic(d, layer.input, layer.input_shape, kfac_test::factor_side::a);
    const mat<double> g_hat =
        kfac_test::factor_statistic(d, layer.grad_output, layer.output_shape, kfac_test::factor_side::g);
    // The same backend calls on the same views: equal to the last bit.
    CHECK(mat<double>(record.statistics.a_sum.triangularView<Eigen::Lower>()) ==
          mat<double>(a_hat.triangularView<Eigen::Lower>()));
    CHECK(mat<double>(record.statistics.g_sum.triangularView<Eigen::Lower>()) ==
          mat<double>(g_hat.triangularView<Eigen::Lower>()));
    CHECK(record.state.a_factor.isIdentity(0.0));  // nothing averaged yet

    // update_factors: F ← ξ·F + (1 − ξ)·F̂ from the identity start, one application. Each entry
    // is two products and a sum of values of its own size: within 2 ulp of the larger term.
    e.update_factors(plan, outcome);
    const mat<double> identity_a = mat<double>::Identity(d.in + 1, d.in + 1);
    const mat<double> identity_g = mat<double>::Identity(d.out, d.out);
    const mat<double> a_expected = 0.9 * identity_a + 0.1 * a_hat;
    const mat<double> g_expected = 0.9 * identity_g + 0.1 * g_hat;
    CHECK((record.state.a_factor - a_expected).cwiseAbs().maxCoeff() <= 4 * kfac_test::eps<double>());
    CHECK((record.state.g_factor - g_expected).cwiseAbs().maxCoeff() <= 4 * kfac_test::eps<double>());
    CHECK_FALSE(record.state.has_second);

    // update_second_order: the data in force, computed by this rank (the only one).
    e.update_second_order(plan, outcome);
    CHECK(record.state.has_second);
    CHECK(e.eigenbasis_counts().decomposed == 2);

    // precondition_all: Pᵀ in the scratch, P solving the damped Kronecker system
    // G·P·A + γ·P = Γ (eigendecomposition: P = Q_G [(Q_Gᵀ Γ Q_A) ⊘ (λ_G λ_Aᵀ + γ)] Q_Aᵀ). The
    // residual of a backward-stable solve is a few n·ε of (‖G‖‖A‖ + γ)‖P‖ (n = 6 here);
    // 1e-12 of it leaves room for the decompositions' own error and fails for any other formula.
    e.precondition_all(plan, outcome);
    const mat<double> p = record.scratch.preconditioned.transpose();
    const mat<double>& a = record.state.a_factor;
    const mat<double>& g = record.state.g_factor;
    const mat<double> residual = g * p * a + o.damping(0) * p - gamma;
    CHECK(residual.norm() <= 1e-12 * (g.norm() * a.norm() + o.damping(0)) * p.norm());
    CHECK(record.scratch.usable);

    // kl_clip_scale: ν = min(1, √(κ / |η² Σ P ⊙ Γ|)) with the defaults κ = 0.001, η = 0.1. A
    // sum of 18 products and a square root: within 32 ε relative.
    const double kl = *o.kl_clip(0), lr = o.lr(0);
    const double expected_scale = std::min(1.0, std::sqrt(kl / std::abs(lr * lr * (p.array() * gamma.array()).sum())));
    const double scale = e.kl_clip_scale(plan);
    CHECK(scale < 1.0);  // this gradient is clipped, so the formula is exercised
    CHECK(std::abs(scale - expected_scale) <= 32 * kfac_test::eps<double>() * expected_scale);

    // write_back: the host's buffers hold ν·P, weight then bias column (one product each).
    CHECK(gradient_of(layer) == gamma);  // untouched until now
    e.write_back(plan, scale, outcome);
    CHECK(gradient_of(layer) == mat<double>(scale * p));

    // commit: the step is counted, nothing unhealthy was met.
    CHECK(e.steps() == 0);
    e.commit(plan, scale, std::move(outcome));
    CHECK(e.steps() == 1);
    CHECK(e.health().skipped_factor_updates == 0);
    CHECK(e.health().zeroed_gradients == 0);
}

TEST_CASE("the last step's time per phase: where it went, 0 for the phases it skipped", "[phases][timing]") {
    // The host's weight_gradient() sleeps 20 ms: the plan phase (which reads the views) holds
    // those 20 ms, and the phases add up to the step's wall time.
    kfac::options o;
    o.factor_update_steps = std::int64_t{2};
    o.inv_update_steps = std::int64_t{2};
    kfac::KFAC<kfac::backend::cpu_eigen<double>> p(o);
    kfac_test::flaky_layer l(5, 3, true);
    l.observe = [](kfac_test::member m) {
        if (m == kfac_test::member::weight_gradient) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    };
    p.register_layer("fc", l);
    CHECK(p.last_step_times().total() == 0.0);  // before the first step
    for (std::uint32_t k = 0; k < 2; ++k) {
        INFO("step " << k);
        l.pass(10 * k + 1);
        const auto start = std::chrono::steady_clock::now();
        p.step();
        const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const kfac::step_times& t = p.last_step_times();
        CHECK(t[kfac::step_phase::plan] >= 0.02);
        CHECK(t.total() <= wall);
        CHECK(t.total() >= t[kfac::step_phase::plan]);
        CHECK(t[kfac::step_phase::precondition] > 0.0);
        const bool update = k == 0;  // both intervals 2: step 0 updates, step 1 does not
        CHECK((t[kfac::step_phase::factors] > 0.0) == update);
        CHECK((t[kfac::step_phase::second_order] > 0.0) == update);
    }
    CHECK(std::string(kfac::step_phase_name(kfac::step_phase::second_order)) == "second_order");
}
