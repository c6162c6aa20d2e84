// SPDX-License-Identifier: Apache-2.0
// options.loss_scale: G's statistics divided by s², and a step whose gradients or statistics
// overflowed skipped whole, changing nothing.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "unit/layer_kinds.hpp"
#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {

std::vector<std::pair<std::string, owned_layer<double>>> loss_scale_model() {
    auto layers = every_kind<double>();
    layers.emplace_back("fc", random_linear<double>(10, 5, 4, true, 41));
    layers.emplace_back("conv", random_conv<double>(3, 2, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, 5, 4, 43));
    for (auto& [name, l] : layers) l.bind();
    return layers;
}

/// The host's output gradients of a loss multiplied by s (its weight gradients unscaled, as
/// after the scaler's unscale).
void scale_output_gradients(std::vector<std::pair<std::string, owned_layer<double>>>& layers, double s) {
    for (auto& [name, l] : layers)
        for (double& x : l.grad_output) x *= s;
}

using scaled_precond = kfac::KFAC<kfac::backend::cpu_eigen<double>>;

void run_steps(scaled_precond& p, std::vector<std::pair<std::string, owned_layer<double>>>& layers, int steps) {
    for (auto& [name, l] : layers) p.register_layer(name, l.view);
    for (int k = 0; k < steps; ++k) {
        for (std::size_t i = 0; i < layers.size(); ++i) refill_gradients(layers[i].second, 500 + 10 * k + 2 * i);
        const kfac::step_result r = p.step();
        CHECK_FALSE(r.skipped);
        CHECK(r.step == k);
    }
}

}  // namespace

TEST_CASE("with the loss scale given, loss-scaled output gradients give the unscaled factors and steps",
          "[loss_scale]") {
    for (const auto mode : {kfac::statistic_scale::reference, kfac::statistic_scale::per_example}) {
        kfac::options plain;
        plain.statistics = mode;
        auto unscaled = loss_scale_model();
        scaled_precond p(plain);
        run_steps(p, unscaled, 3);

        // s = 2^16, a dynamic scaler's first scale: g·s and the division by s² are exact in
        // double, so the factors and the steps are the unscaled ones bit for bit.
        kfac::options scaled_options = plain;
        scaled_options.loss_scale = 65536.0;
        auto scaled = loss_scale_model();
        scale_output_gradients(scaled, 65536.0);
        scaled_precond q(scaled_options);
        run_steps(q, scaled, 3);
        for (const auto& info : p.layers()) {
            INFO(info.name);
            CHECK(q.a_factor(info.name) == p.a_factor(info.name));
            CHECK(q.g_factor(info.name) == p.g_factor(info.name));
        }
        for (std::size_t i = 0; i < scaled.size(); ++i) {
            CHECK(scaled[i].second.grad_weight == unscaled[i].second.grad_weight);
            CHECK(scaled[i].second.grad_bias == unscaled[i].second.grad_bias);
        }

        // s = 3, read from a schedule: g·s and the division by s² each round, so each factor
        // entry differs by a few units in the last place: the statistic is a sum of products
        // (g_i·s)(g_j·s), each off by ≤ 2u relatively, then divided by s² (≤ u more): ≤ 4u of
        // the sum of magnitudes, bounded here by 16u of the largest entry.
        kfac::options three = plain;
        three.loss_scale = [](std::int64_t) { return 3.0; };
        auto by_three = loss_scale_model();
        scale_output_gradients(by_three, 3.0);
        scaled_precond r(three);
        run_steps(r, by_three, 1);
        scaled_precond once(plain);
        auto reference = loss_scale_model();
        run_steps(once, reference, 1);
        for (const auto& info : once.layers()) {
            INFO(info.name);
            CHECK(rel_err(r.g_factor(info.name).reshaped(), once.g_factor(info.name).reshaped()) <= 16 * 0x1p-53);
            CHECK(rel_err(r.a_factor(info.name).reshaped(), once.a_factor(info.name).reshaped()) <= 16 * 0x1p-53);
        }
    }
}

TEST_CASE("an overflowed step under loss scaling changes nothing and says so", "[loss_scale]") {
    kfac::options o;
    o.loss_scale = 1024.0;
    auto layers = loss_scale_model();
    scaled_precond p(o);
    run_steps(p, layers, 1);
    const auto before = p.save_bytes();
    const auto a_before = p.a_factor("fc");
    auto& fc = layers[layers.size() - 2].second;  // "fc"

    SECTION("an inf in an output gradient") { fc.grad_output[3] = std::numeric_limits<double>::infinity(); }
    SECTION("a NaN in a weight gradient") { fc.grad_weight[1] = std::numeric_limits<double>::quiet_NaN(); }
    REQUIRE(layers[layers.size() - 2].first == "fc");
    std::vector<std::vector<double>> gradients;
    for (auto& [name, l] : layers) gradients.push_back(l.grad_weight);
    const kfac::step_result r = p.step();
    CHECK(r.skipped);
    CHECK(r.step == 1);
    CHECK(p.steps() == 1);  // not counted
    CHECK(p.health().skipped_steps == 1);
    CHECK(p.health().skipped_factor_updates == 0);
    CHECK(p.health().zeroed_gradients == 0);
    for (std::size_t i = 0; i < layers.size(); ++i)  // left for the scaler to see (and skip)
        CHECK(std::equal(layers[i].second.grad_weight.begin(), layers[i].second.grad_weight.end(),
                         gradients[i].begin(), [](double x, double y) { return x == y || (std::isnan(x) && std::isnan(y)); }));
    CHECK(p.a_factor("fc") == a_before);
    // Everything a checkpoint holds is as it was, but the counter of skipped steps.
    scaled_precond reloaded(o);
    auto again = loss_scale_model();
    for (auto& [name, l] : again) reloaded.register_layer(name, l.view);
    reloaded.load_bytes(before);
    for (const auto& info : p.layers()) {
        CHECK(p.a_factor(info.name) == reloaded.a_factor(info.name));
        CHECK(p.g_factor(info.name) == reloaded.g_factor(info.name));
    }
    // The next step (the scaler lowered s) is step 1 again, and counts.
    for (auto& [name, l] : layers) {
        for (double& x : l.grad_output) x = std::isfinite(x) ? x : 0.5;
        for (double& x : l.grad_weight) x = std::isfinite(x) ? x : 0.5;
    }
    const kfac::step_result next = p.step();
    CHECK_FALSE(next.skipped);
    CHECK(next.step == 1);
    CHECK(p.steps() == 2);
}

TEST_CASE("an overflow in an accumulated pass skips the step and drops the pass", "[loss_scale]") {
    kfac::options o;
    o.loss_scale = 8.0;
    o.accumulation_steps = 2;
    auto layers = loss_scale_model();
    scaled_precond p(o);
    for (auto& [name, l] : layers) p.register_layer(name, l.view);
    auto& l0 = layers[0].second;
    const double kept = l0.grad_output[0];
    l0.grad_output[0] = std::numeric_limits<double>::infinity();
    p.accumulate();
    l0.grad_output[0] = kept;
    l0.grad_weight[0] = std::numeric_limits<double>::infinity();  // the host's accumulated gradient overflowed
    CHECK(p.step().skipped);
    l0.grad_weight[0] = 0.25;
    // The next step's two passes alone make the factors: the same as a fresh preconditioner's.
    p.accumulate();
    CHECK_FALSE(p.step().skipped);
    auto fresh_layers = loss_scale_model();
    fresh_layers[0].second.grad_weight[0] = 0.25;
    scaled_precond fresh(o);
    for (auto& [name, l] : fresh_layers) fresh.register_layer(name, l.view);
    fresh.accumulate();
    fresh.step();
    for (const auto& info : fresh.layers()) {
        INFO(info.name);
        CHECK(p.a_factor(info.name) == fresh.a_factor(info.name));
        CHECK(p.g_factor(info.name) == fresh.g_factor(info.name));
    }
}

TEST_CASE("an invalid loss scale is an error that names it and changes nothing", "[loss_scale]") {
    kfac::options o;
    o.loss_scale = 0.0;
    CHECK_THROWS_WITH(scaled_precond(o), Catch::Contains("loss_scale") && Catch::Contains("> 0"));
    double scale = 4.0;
    kfac::options scheduled;
    scheduled.loss_scale = [&](std::int64_t) { return scale; };
    kfac::KFAC<kfac::backend::cpu_eigen<float>> p(scheduled);
    auto l = random_linear<float>(6, 3, 2, true, 5);
    p.register_layer("fc", l.view);
    p.step();
    const auto a = p.a_factor("fc");
    scale = std::numeric_limits<double>::quiet_NaN();
    CHECK_THROWS_WITH(p.step(), Catch::Contains("loss_scale") && Catch::Contains("step 1"));
    scale = 0x1p70;  // s² beyond float
    CHECK_THROWS_WITH(p.step(), Catch::Contains("loss_scale") && Catch::Contains("range"));
    CHECK(p.steps() == 1);
    CHECK(p.a_factor("fc") == a);
}

TEST_CASE("a loss scale whose square is not normal in the compute type is refused, constant or scheduled",
          "[loss_scale]") {
    // The G statistics are divided by s²: s = 1e-30 makes s² underflow in float (every statistic
    // then overflows and every factor update was skipped), 2^64 makes it overflow. Both ends are
    // refused, and the bounds themselves (2^-63 and 2^63 in float) are accepted.
    using float_precond = kfac::KFAC<kfac::backend::cpu_eigen<float>>;
    for (const double s : {1e-30, 0x1p-64, 0x1p64, 1e300}) {
        kfac::options o;
        o.loss_scale = s;
        CHECK_THROWS_WITH(float_precond(o), Catch::Contains("options.loss_scale = ") && Catch::Contains("range") &&
                                                Catch::Contains("<= s <="));
    }
    for (const double s : {1e-300, 1e300}) {
        kfac::options o;
        o.loss_scale = s;
        CHECK_THROWS_WITH(scaled_precond(o), Catch::Contains("options.loss_scale = ") && Catch::Contains("range"));
    }
    for (const double s : {0x1p-63, 0x1p63}) {
        kfac::options o;
        o.loss_scale = s;
        CHECK_NOTHROW(float_precond(o));
    }
    double scale = 4.0;
    kfac::options scheduled;
    scheduled.loss_scale = [&](std::int64_t) { return scale; };
    float_precond p(scheduled);
    auto l = random_linear<float>(6, 3, 2, true, 5);
    p.register_layer("fc", l.view);
    p.step();
    scale = 1e-30;  // s² below float's smallest normal: a statistic divided by it overflows
    CHECK_THROWS_WITH(p.step(), Catch::Contains("loss_scale") && Catch::Contains("step 1") && Catch::Contains("range"));
    CHECK(p.steps() == 1);
    CHECK(p.health().skipped_factor_updates == 0);
}
