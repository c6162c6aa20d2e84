// SPDX-License-Identifier: Apache-2.0
// Failures a demanding host can cause, and what the preconditioner promises about each
// (issue 25): an adapter member that throws at any of its calls in a step leaves the
// preconditioner and the host's gradients as they were, and a retry equals the run that
// never failed; option values out of their range (a float damping that makes every gradient
// 0, enum values no enumerator has, a thread count far beyond any machine) are refused; and
// single-threaded BLAS scopes of several preconditioners nest in any order.
#include <catch2/catch.hpp>

#include <array>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <kfac/kfac.hpp>

#include "applied_layer.hpp"
#include "flaky_layer.hpp"
#include "test_util.hpp"

namespace {

using kfac_test::applied_layer;
using kfac_test::flaky_layer;
using kfac_test::member;
using kfac_test::member_names;
using kfac_test::members;
using kfac_test::random_vector;

using P = kfac::KFAC<kfac::backend::cpu_eigen<double>>;

/// Two layers (the second one fails) under a preconditioner that updates everything at
/// every step; with `accumulate`, each step folds one accumulate() pass in first.
struct model {
    flaky_layer first{4, 3, true}, second{3, 5, true};
    P p;
    bool accumulate;

    explicit model(bool accumulate_passes) : p(make_options(accumulate_passes)), accumulate(accumulate_passes) {
        p.register_layer("first", first);
        p.register_layer("second", second);
    }
    static kfac::options make_options(bool accumulate_passes) {
        kfac::options o;
        o.damping = 0.01;
        o.threads = 1;
        o.kl_clip = 0.001;
        o.accumulation_steps = accumulate_passes ? 2 : 1;
        return o;
    }
    void pass(std::uint32_t seed) {
        first.pass(seed);
        second.pass(seed + 100);
    }
    /// Step `k` from its first pass: the accumulate() pass, if any, then the step's own.
    void folded_pass(std::int64_t k) {
        if (!accumulate) return;
        pass(static_cast<std::uint32_t>(1000 + 10 * k));
        p.accumulate();
    }
    void step(std::int64_t k) {
        pass(static_cast<std::uint32_t>(10 * k + 1));
        p.step();
    }
};

bool same(const Eigen::MatrixXd& x, const Eigen::MatrixXd& y) {
    return x.rows() == y.rows() && x.cols() == y.cols() && (x.array() == y.array()).all();
}

/// What a failed step must leave as it was.
struct snapshot {
    std::int64_t steps;
    Eigen::MatrixXd a1, g1, a2, g2;
    std::vector<double> w1, b1, w2, b2;
    explicit snapshot(const model& m)
        : steps(m.p.steps()), a1(m.p.a_factor("first")), g1(m.p.g_factor("first")), a2(m.p.a_factor("second")),
          g2(m.p.g_factor("second")), w1(m.first.inner.grad_weight), b1(m.first.inner.grad_bias),
          w2(m.second.inner.grad_weight), b2(m.second.inner.grad_bias) {}
    bool operator==(const snapshot& o) const {
        return steps == o.steps && same(a1, o.a1) && same(g1, o.g1) && same(a2, o.a2) && same(g2, o.g2) && w1 == o.w1 &&
               b1 == o.b1 && w2 == o.w2 && b2 == o.b2;
    }
};

}  // namespace

TEST_CASE("an adapter that throws at any call of a step leaves the preconditioner and the host's gradients as they were",
          "[reliability][adapter]") {
    for (const bool accumulate : {false, true}) {
        // The run that never fails: three steps.
        model reference(accumulate);
        std::vector<snapshot> expected;
        for (std::int64_t k = 0; k < 3; ++k) {
            reference.folded_pass(k);
            reference.step(k);
            expected.emplace_back(reference);
        }
        for (int m = 0; m < members; ++m) {
            int failures = 0;
            for (int after = 0;; ++after) {
                INFO((accumulate ? "with an accumulate() pass, " : "") << "the second layer's " << member_names[m]
                                                                        << " throws at its call " << after + 1 << " of step 1");
                model x(accumulate);
                x.folded_pass(0);
                x.step(0);
                x.folded_pass(1);
                x.pass(11);
                x.second.fail = static_cast<member>(m);
                x.second.after = after;
                const snapshot before(x);
                bool threw = false;
                try {
                    x.p.step();
                } catch (const std::exception&) {
                    threw = true;
                }
                if (!threw) break;  // the member is called fewer times than that in a step
                ++failures;
                CHECK(snapshot(x) == before);
                // The retry: the host runs the pass again (an end_pass that went through on the
                // first layer forgot its applications) and steps; then one more step.
                x.second.fail.reset();
                x.pass(11);
                x.p.step();
                CHECK(snapshot(x) == expected[1]);
                x.folded_pass(2);
                x.step(2);
                CHECK(snapshot(x) == expected[2]);
            }
            INFO(member_names[m]);
            CHECK(failures >= 1);  // every member is called at least once in such a step
        }
    }
}

TEST_CASE("an adapter that throws in accumulate() leaves the folded statistics as they were", "[reliability][adapter]") {
    model reference(true), x(true);
    for (model* m : {&reference, &x}) {
        m->folded_pass(0);
        m->step(0);
    }
    reference.folded_pass(1);
    reference.step(1);
    for (const member m : {member::activations, member::output_gradients, member::end_pass}) {
        INFO(member_names[m]);
        x.pass(1010);
        x.second.fail = m;
        x.second.after = 0;
        CHECK_THROWS(x.p.accumulate());
        x.second.fail.reset();
    }
    x.folded_pass(1);
    x.step(1);
    CHECK(snapshot(x) == snapshot(reference));
}

TEST_CASE("a float damping whose inverse is not a normal float is refused", "[reliability][options]") {
    using F = kfac::KFAC<kfac::backend::cpu_eigen<float>>;
    // 1/FLT_MAX = 2.9e-39 is subnormal: every preconditioned gradient would be 0 (or
    // Inf for 1e39, which rounds to Inf in float).
    for (const double too_large : {static_cast<double>(FLT_MAX), 1e38, 1e39}) {
        INFO(too_large);
        kfac::options o;
        o.damping = too_large;
        CHECK_THROWS_WITH(F(o), Catch::Contains("too large for float") && Catch::Contains("options.damping"));
    }
    kfac::options o;
    o.damping = 8e37;  // below 1/FLT_MIN = 8.507e37
    CHECK_NOTHROW(F(o));
    o.damping = 1e100;  // a double has room for it
    CHECK_NOTHROW(P(o));
    // A scheduled one is checked where it is read.
    applied_layer<float> layer(3, 2, true);
    layer.apply(4, 3);
    kfac::options s;
    s.damping = kfac::hyperparameter<double>([](std::int64_t) { return 1e39; });
    F p(s);
    p.register_layer("l", layer);
    const auto w = layer.grad_weight;
    CHECK_THROWS_WITH(p.step(), Catch::Contains("too large for float") && Catch::Contains("at step 0"));
    CHECK(layer.grad_weight == w);
    CHECK(p.steps() == 0);
}

TEST_CASE("option values no enumerator has, and a thread count beyond any machine, are refused", "[reliability][options]") {
    kfac::options o;
    o.strategy = static_cast<kfac::distribution>(7);
    CHECK_THROWS_WITH(P(o), Catch::Contains("options.strategy = 7") && Catch::Contains("distribution::kaisa"));
    o = {};
    o.conv_patches = static_cast<kfac::conv_patch_mode>(-1);
    CHECK_THROWS_WITH(P(o), Catch::Contains("options.conv_patches = -1"));
    o = {};
    o.threads = INT_MAX;
    CHECK_THROWS_WITH(P(o), Catch::Contains("options.threads = 2147483647") && Catch::Contains("[0, 4096]"));
    o.threads = 4096;
    CHECK_NOTHROW(P(o));
}

#if KFAC_HAS_LAPACK
TEST_CASE("single-threaded BLAS scopes that interleave restore the thread count the first one found", "[reliability][blas]") {
    // Two preconditioners stepping in two threads open and close their scopes in any order:
    // A opens, B opens, A closes, B closes. Each scope restoring what it found would leave
    // B's 1 behind.
    using backend = kfac::backend::cpu_eigen<float>;
    namespace bd = kfac::backend::detail;
    const int original = bd::blas_thread_count();
    bd::set_blas_thread_count(2);
    auto a = std::make_unique<backend::serial_blas_scope>();
    auto b = std::make_unique<backend::serial_blas_scope>();
    CHECK(bd::blas_thread_count() == 1);
    a.reset();
    CHECK(bd::blas_thread_count() == 1);  // B is still open
    b.reset();
    CHECK(bd::blas_thread_count() == 2);
    bd::set_blas_thread_count(original);
}
#endif

TEST_CASE("a second call while one is in progress on another thread is refused, and the first completes",
          "[reliability][threads]") {
    // Two step() calls on one preconditioner from two threads freed the same buffers twice
    // (an abort), and step() beside load() raced on the factors. The first call is held inside
    // its end_pass() while the second is made, so the two overlap on every run.
    const std::string saved = [] {
        model m(false);
        m.step(0);
        return m.p.save_bytes();
    }();
    using second_call = std::pair<const char*, std::function<void(model&)>>;
    const std::vector<second_call> calls = {
        {"step()", [](model& m) { m.p.step(); }},
        {"accumulate()", [](model& m) { m.p.accumulate(); }},
        {"save_bytes()", [](model& m) { static_cast<void>(m.p.save_bytes()); }},
        {"save()", [](model& m) {
             std::ostringstream out;
             m.p.save(out);
         }},
        {"load_bytes()", [&](model& m) { m.p.load_bytes(saved); }},
        {"register_layer()", [](model& m) {
             kfac_test::flaky_layer extra{2, 2, false};
             m.p.register_layer("extra", extra);
         }},
        {"curvature()", [](model& m) { static_cast<void>(m.p.curvature()); }},
    };
    model reference(false);
    reference.step(0);
    for (const auto& [name, call] : calls) {
        INFO("the second call: " << name);
        model m(false);
        std::promise<void> inside, go;
        std::shared_future<void> released = go.get_future().share();
        bool held = false;
        m.first.observe = [&](member x) {
            if (x != member::end_pass || held) return;
            held = true;
            inside.set_value();
            released.wait();
        };
        m.pass(1);
        std::exception_ptr first_failure;
        std::thread first([&] {
            try {
                m.p.step();
            } catch (...) {
                first_failure = std::current_exception();
            }
        });
        inside.get_future().wait();
        CHECK_THROWS_WITH(call(m), Catch::Contains(std::string(name) + " was called while step() is in progress") &&
                                       Catch::Contains("one call at a time"));
        go.set_value();
        first.join();
        CHECK_FALSE(first_failure);
        // The first call completed as if alone, and the object takes calls again.
        CHECK(m.p.steps() == 1);
        CHECK(same(m.p.a_factor("first"), reference.p.a_factor("first")));
        CHECK(m.first.inner.grad_weight == reference.first.inner.grad_weight);
        CHECK_NOTHROW(m.step(1));
        CHECK(m.p.steps() == 2);
    }
}
