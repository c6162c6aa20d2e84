// SPDX-License-Identifier: Apache-2.0
// NaN and Inf never reach the gradients the preconditioner writes; each event is counted
// and reported.
#include <catch2/catch.hpp>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {

/// A backend whose eigensolver can be made to fail, to exercise "keep the previous
/// decomposition". Everything else is the CPU backend.
struct flaky_backend : kfac::backend::cpu_eigen<double> {
    static inline bool fail = false;
    static bool symmetric_eigen(const matrix& m, matrix& q, vector& lambda) {
        if (fail) return false;
        return cpu_eigen<double>::symmetric_eigen(m, q, lambda);
    }
};


}  // namespace

TEST_CASE("non-finite activations do not enter the factors", "[non_finite]") {
    kfac::KFAC<kfac::backend::cpu_eigen<double>> p;
    auto l = random_linear<double>(8, 4, 3, true, 1);
    p.register_layer("fc", l.view);
    std::vector<kfac::non_finite_event> events;
    p.on_non_finite([&](const kfac::non_finite_event& e) { events.push_back(e); });
    p.step();
    const auto a_before = p.a_factor("fc");
    const auto g_before = p.g_factor("fc");
    l.input[5] = std::numeric_limits<double>::quiet_NaN();
    l.grad_weight = random_vector<double>(12, 9, 0.1);
    l.bind();
    p.step();
    CHECK(p.a_factor("fc") == a_before);
    CHECK(p.g_factor("fc") == g_before);
    CHECK(p.health().skipped_factor_updates == 1);
    REQUIRE(events.size() == 1);
    CHECK(events[0].layer == "fc");
    CHECK(events[0].source == kfac::non_finite_source::factor_statistics);
    CHECK(events[0].step == 1);
    CHECK(all_finite(l.grad_weight));
    CHECK(all_finite(l.grad_bias));
}

TEST_CASE("a non-finite gradient zeroes that layer only and keeps kl_clip finite", "[non_finite]") {
    kfac::KFAC<kfac::backend::cpu_eigen<double>> p;
    auto bad = random_linear<double>(8, 4, 3, true, 1);
    auto good = random_linear<double>(8, 3, 2, false, 2);
    p.register_layer("bad", bad.view);
    p.register_layer("good", good.view);
    bad.grad_weight[0] = std::numeric_limits<double>::infinity();
    p.step();
    CHECK(p.health().zeroed_gradients == 1);
    CHECK(std::isfinite(p.last_kl_scale()));
    for (double x : bad.grad_weight) CHECK(x == 0.0);
    for (double x : bad.grad_bias) CHECK(x == 0.0);
    CHECK(all_finite(good.grad_weight));
    double norm = 0;
    for (double x : good.grad_weight) norm += x * x;
    CHECK(norm > 0.0);
}

TEST_CASE("a failed decomposition keeps the previous one", "[non_finite]") {
    kfac::options o;
    o.kl_clip = std::nullopt;
    kfac::KFAC<flaky_backend> p(o);
    auto l = random_linear<double>(8, 4, 3, true, 1);
    p.register_layer("fc", l.view);
    const auto gw = l.grad_weight;
    const auto gb = l.grad_bias;
    flaky_backend::fail = false;
    p.step();
    const auto p0 = l.grad_weight;
    // New data, same Γ: with the decomposition failing, step 1 must precondition with step 0's.
    l.input = random_vector<double>(l.input.size(), 77);
    l.grad_weight = gw;
    l.grad_bias = gb;
    l.bind();
    flaky_backend::fail = true;
    std::vector<kfac::non_finite_event> events;
    p.on_non_finite([&](const kfac::non_finite_event& e) { events.push_back(e); });
    p.step();
    flaky_backend::fail = false;
    CHECK(p.health().kept_decompositions == 1);
    REQUIRE(events.size() == 1);
    CHECK(events[0].source == kfac::non_finite_source::decomposition);
    CHECK(l.grad_weight == p0);
}

TEST_CASE("float overflow in the statistics is contained", "[non_finite]") {
    kfac::KFAC<kfac::backend::cpu_eigen<float>> p;
    owned_layer<float> l;
    l.view.description = kfac::linear_description(3, 2, false);
    l.input = {1e30f, 1e30f, 1e30f, 1, 2, 3};  // squares overflow float
    l.grad_output = {0.1f, 0.2f, 0.3f, 0.4f};
    l.grad_weight = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
    l.input_shape = {2, 3};
    l.output_shape = {2, 2};
    l.bind();
    p.register_layer("fc", l.view);
    p.step();
    CHECK(p.health().skipped_factor_updates == 1);
    CHECK(p.a_factor("fc").isIdentity());
    for (float x : l.grad_weight) CHECK(std::isfinite(x));
}
