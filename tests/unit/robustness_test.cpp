// SPDX-License-Identifier: Apache-2.0
// A kfac::error from step() or accumulate() leaves the preconditioner exactly as it was, so
// the next correct call works and gives what an undisturbed run gives; inputs that would
// give a silently wrong answer are rejected with the layer or variable, the value and the fix.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "unit/test_util.hpp"

using namespace kfac_test;
using Catch::Contains;
using precond_t = kfac::KFAC<kfac::backend::cpu_eigen<double>>;

namespace {

/// Two layers with fresh data for step `k` (the same for every run that asks for step k).
struct two_layers {
    owned_layer<double> a = random_linear<double>(8, 6, 5, true, 1);
    owned_layer<double> b = random_linear<double>(8, 5, 3, false, 2);
    void refresh(std::uint32_t k) {
        a = random_linear<double>(8, 6, 5, true, 10 + 7 * k);
        b = random_linear<double>(8, 5, 3, false, 11 + 7 * k);
    }
    template <class P>
    void register_all(P& p) {
        p.register_layer("a", a.view);
        p.register_layer("b", b.view);
    }
    // Registration keeps pointers to the views, so refreshing data re-points them in place.
    void rebind() {
        a.bind();
        b.bind();
    }
};

/// A schedule that is invalid (`bad`) the first time it is read at step `at`, and `good`
/// otherwise: a host schedule with a transient bug.
template <class T>
auto invalid_once_at(std::int64_t at, T good, T bad) {
    auto fired = std::make_shared<bool>(false);
    return [=](std::int64_t k) -> T {
        if (k == at && !*fired) {
            *fired = true;
            return bad;
        }
        return good;
    };
}

/// Runs `steps` steps of the two-layer model, refreshing its data each step.
void run_steps(precond_t& p, two_layers& m, std::int64_t from, std::int64_t to) {
    for (std::int64_t k = from; k < to; ++k) {
        m.refresh(static_cast<std::uint32_t>(k));
        m.rebind();
        p.step();
    }
}

/// Compares everything the host and a checkpoint could see.
void require_same_state(const precond_t& p, const two_layers& pm, const precond_t& q, const two_layers& qm) {
    CHECK(p.steps() == q.steps());
    CHECK(p.a_factor("a") == q.a_factor("a"));
    CHECK(p.g_factor("a") == q.g_factor("a"));
    CHECK(p.a_factor("b") == q.a_factor("b"));
    CHECK(p.g_factor("b") == q.g_factor("b"));
    CHECK(pm.a.grad_weight == qm.a.grad_weight);
    CHECK(pm.a.grad_bias == qm.a.grad_bias);
    CHECK(pm.b.grad_weight == qm.b.grad_weight);
    CHECK(p.last_kl_scale() == q.last_kl_scale());
}


/// Sets an environment variable for one scope and restores it after.
class scoped_env {
public:
    scoped_env(const char* name, const char* value) : name_(name) {
        if (const char* old = std::getenv(name)) old_ = old;
        ::setenv(name, value, 1);
    }
    ~scoped_env() {
        if (old_) ::setenv(name_, old_->c_str(), 1);
        else ::unsetenv(name_);
    }
    scoped_env(const scoped_env&) = delete;
    scoped_env& operator=(const scoped_env&) = delete;

private:
    const char* name_;
    std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("a schedule that is invalid once leaves the preconditioner as it was", "[robustness][exception_safety]") {
    // Each option is read at step 1 only (or first at step 1), so before the fix the factors
    // were already updated (kl_clip, lr) or the pass counter left at 1 (damping) when it threw.
    auto edit = GENERATE(as<std::string>{}, "damping", "kl_clip", "lr", "factor_decay", "inv_update_steps");
    kfac::options o;
    o.kl_clip = 0.01;
    kfac::options broken = o;
    if (edit == "damping") broken.damping = invalid_once_at(1, 0.001, -1.0);
    if (edit == "kl_clip") broken.kl_clip = invalid_once_at<std::optional<double>>(1, 0.01, -0.5);
    if (edit == "lr") broken.lr = invalid_once_at(1, 0.1, std::numeric_limits<double>::infinity());
    if (edit == "factor_decay") broken.factor_decay = invalid_once_at(1, 0.95, 1.5);
    if (edit == "inv_update_steps") broken.inv_update_steps = invalid_once_at<std::int64_t>(1, 1, 0);
    INFO(edit);
    two_layers pm, qm;
    precond_t p(broken), q(o);
    pm.register_all(p);
    qm.register_all(q);
    run_steps(p, pm, 0, 1);
    run_steps(q, qm, 0, 1);
    pm.refresh(1);
    pm.rebind();
    const auto before_a = p.a_factor("a");
    const auto grad_before = pm.a.grad_weight;
    CHECK_THROWS_WITH(p.step(), Contains("options." + edit) && Contains("at step 1"));
    CHECK(p.steps() == 1);
    CHECK(p.a_factor("a") == before_a);
    CHECK(pm.a.grad_weight == grad_before);  // the host's gradients are untouched
    // The retry and the steps after it give exactly the undisturbed run.
    p.step();
    run_steps(q, qm, 1, 2);
    require_same_state(p, pm, q, qm);
    run_steps(p, pm, 2, 4);
    run_steps(q, qm, 2, 4);
    require_same_state(p, pm, q, qm);
}

TEST_CASE("accumulate() misuse leaves the pass count as it was", "[robustness][exception_safety]") {
    kfac::options o;
    o.accumulation_steps = 2;
    two_layers pm, qm;
    precond_t p(o), q(o);
    pm.register_all(p);
    qm.register_all(q);
    SECTION("step() without the accumulate() of the first pass") {
        CHECK_THROWS_WITH(p.step(), Contains("step() after 0 accumulate() call(s)") &&
                                        Contains("accumulation_steps = 2"));
    }
    SECTION("accumulate() once too often") {
        p.accumulate();
        CHECK_THROWS_WITH(p.accumulate(), Contains("accumulate() called 2 times") && Contains("accumulation_steps = 2"));
        // The pass that was folded in stays; the correct sequence goes on from it.
        p.step();
        q.accumulate();
        q.step();
        require_same_state(p, pm, q, qm);
        return;
    }
    // The correct sequence works afterwards and matches a run that never erred.
    p.accumulate();
    p.step();
    q.accumulate();
    q.step();
    require_same_state(p, pm, q, qm);
}

TEST_CASE("a view error at a later step leaves the factors and counters as they were", "[robustness][exception_safety]") {
    two_layers pm, qm;
    precond_t p, q;
    pm.register_all(p);
    qm.register_all(q);
    run_steps(p, pm, 0, 2);
    run_steps(q, qm, 0, 2);
    pm.refresh(2);
    pm.rebind();
    pm.b.view.grad_output.extents[0] = 7;  // rows disagree with the activations
    CHECK_THROWS_WITH(p.step(), Contains("layer 'b'"));
    pm.rebind();
    p.step();
    run_steps(q, qm, 2, 3);
    require_same_state(p, pm, q, qm);
}

TEST_CASE("an exception from on_non_finite never leaves NaN in the host's gradients", "[robustness][non_finite]") {
    two_layers m;
    precond_t p;
    m.register_all(p);
    m.a.grad_weight[3] = std::numeric_limits<double>::quiet_NaN();
    m.b.grad_weight[0] = std::numeric_limits<double>::infinity();
    int calls = 0;
    p.on_non_finite([&](const kfac::non_finite_event&) {
        ++calls;
        throw std::runtime_error("host callback failed");
    });
    CHECK_THROWS_WITH(p.step(), "host callback failed");
    CHECK(calls == 2);  // every event is delivered; the first exception is rethrown
    CHECK(all_finite(m.a.grad_weight));
    CHECK(all_finite(m.a.grad_bias));
    CHECK(all_finite(m.b.grad_weight));
    for (double x : m.a.grad_weight) CHECK(x == 0.0);
    CHECK(p.steps() == 1);
    CHECK(p.health().zeroed_gradients == 2);
    // The preconditioner goes on normally.
    p.on_non_finite({});
    m.refresh(1);
    m.rebind();
    CHECK_NOTHROW(p.step());
    CHECK(all_finite(m.a.grad_weight));
}

TEST_CASE("views with negative extents are rejected naming the layer", "[robustness][validation]") {
    precond_t p;
    auto l = random_linear<double>(8, 6, 5, false, 1);
    // [-8, 6] and [-8, 5] agree on their (negative) row count: before, that passed the checks.
    l.view.input.extents[0] = -8;
    l.view.grad_output.extents[0] = -8;
    p.register_layer("fc", l.view);
    CHECK_THROWS_WITH(p.step(), Contains("layer 'fc' (linear 6->5, no bias)") && Contains("[-8, 6]") &&
                                    Contains("negative extent -8"));
    SECTION("in a gradient too") {
        l.bind();
        l.view.grad_weight.extents[1] = -6;
        l.view.grad_weight.extents[0] = -5;
        CHECK_THROWS_WITH(p.step(), Contains("layer 'fc'") && Contains("negative extent"));
    }
}

TEST_CASE("row counts beyond the BLAS integer range are rejected, not truncated", "[robustness][validation]") {
    // The views point at a small buffer: the check must come before anything is read.
    precond_t p;
    auto l = random_linear<double>(8, 6, 5, false, 1);
    const std::int64_t rows = std::int64_t{1} << 31;  // one more than INT32_MAX
    l.view.input.extents[0] = rows;
    l.view.grad_output.extents[0] = rows;
    p.register_layer("fc", l.view);
    CHECK_THROWS_WITH(p.step(), Contains("layer 'fc'") && Contains("2147483648") && Contains("2147483647") &&
                                    Contains("accumulation_steps"));

    precond_t q;
    kfac::layer_view<double> conv;
    conv.description = kfac::conv2d_description(1, 1, {{1, 1}, {1, 1}, {0, 0}, {1, 1}, 1}, false);
    std::vector<double> buffer(4, 0.0);
    conv.input = kfac::tensor_view<const double>(buffer.data(), {1, 1, 50000, 50000});
    conv.grad_output = kfac::tensor_view<const double>(buffer.data(), {1, 1, 50000, 50000});
    conv.grad_weight = kfac::tensor_view<double>(buffer.data(), {1, 1, 1, 1});
    q.register_layer("conv", conv);
    CHECK_THROWS_WITH(q.step(), Contains("layer 'conv'") && Contains("2500000000"));
}

namespace {
/// An adapter whose activations have nine dimensions: the view's own error must name the layer.
struct deep_layer {
    std::vector<float> buffer = std::vector<float>(8, 0.f);
};
}  // namespace

template <>
struct kfac::layer_traits<deep_layer> {
    using scalar_type = float;
    static layer_description describe(const deep_layer&) { return linear_description(1, 1, false); }
    static tensor_view<const float> activations(const deep_layer& l) {
        return tensor_view<const float>(l.buffer.data(), {1, 1, 1, 1, 1, 1, 1, 1, 1});
    }
    static tensor_view<const float> output_gradients(const deep_layer& l) {
        return tensor_view<const float>(l.buffer.data(), {1, 1});
    }
    static tensor_view<float> weight_gradient(deep_layer& l) { return tensor_view<float>(l.buffer.data(), {1, 1}); }
    static tensor_view<float> bias_gradient(deep_layer&) { return {}; }
};

TEST_CASE("a view of too many dimensions is reported with its layer", "[robustness][validation]") {
    kfac::KFAC<> p;
    deep_layer l;
    p.register_layer("deep", l);
    CHECK_THROWS_WITH(p.step(), Contains("layer 'deep' (linear 1->1, no bias)") && Contains("rank 9") &&
                                    Contains("at most 8"));
}

TEST_CASE("non-finite and underflowing hyper-parameters are rejected", "[robustness][validation]") {
    const double inf = std::numeric_limits<double>::infinity();
    const double nan = std::numeric_limits<double>::quiet_NaN();
    auto make = [](auto edit) {
        kfac::options o;
        edit(o);
        return kfac::KFAC<>(o);  // float
    };
    CHECK_THROWS_WITH(make([&](kfac::options& o) { o.lr = inf; }), Contains("options.lr = inf") && Contains("finite"));
    CHECK_THROWS_WITH(make([&](kfac::options& o) { o.lr = nan; }), Contains("options.lr = nan"));
    CHECK_THROWS_WITH(make([&](kfac::options& o) { o.damping = inf; }), Contains("options.damping = inf"));
    CHECK_THROWS_WITH(make([&](kfac::options& o) { o.damping = nan; }), Contains("options.damping = nan"));
    CHECK_THROWS_WITH(make([&](kfac::options& o) { o.kl_clip = inf; }), Contains("options.kl_clip = inf"));
    CHECK_THROWS_WITH(make([&](kfac::options& o) { o.allreduce_bucket_cap_mb = inf; }),
                      Contains("allreduce_bucket_cap_mb = inf"));
    // 1e-50 is 0 in float: every eigenvalue product + damping could be 0 and 1/0 = Inf.
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.damping = 1e-50; }),
                      Contains("options.damping = 1e-50") && Contains("too small for float") && Contains("2.93874e-39"));
    CHECK_NOTHROW(make([](kfac::options& o) { o.damping = 1e-30; }));
    kfac::options tiny;
    tiny.damping = 1e-50;
    CHECK_NOTHROW(precond_t(tiny));  // fine in double

    // Scheduled values are checked when read, with the same rules.
    kfac::options scheduled;
    scheduled.damping = [](std::int64_t k) { return k == 0 ? 0.001 : 1e-50; };
    kfac::KFAC<> p(scheduled);
    auto l = random_linear<float>(8, 3, 2, false, 1);
    p.register_layer("fc", l.view);
    CHECK_NOTHROW(p.step());
    CHECK_THROWS_WITH(p.step(), Contains("damping evaluated to 1e-50 at step 1") && Contains("too small for float"));
}

TEST_CASE("one layer object registered under two names is rejected", "[robustness][registration]") {
    precond_t p;
    auto l = random_linear<double>(8, 6, 5, false, 1);
    p.register_layer("fc", l.view);
    CHECK_THROWS_WITH(p.register_layer("fc_again", l.view),
                      Contains("layer 'fc_again'") && Contains("already registered as 'fc'"));
    CHECK(p.layer_count() == 1);
}

TEST_CASE("KFAC_NUM_THREADS must be a thread count", "[robustness][validation]") {
    CHECK(kfac::detail::parse_thread_count("2") == 2);
    CHECK(kfac::detail::parse_thread_count("4096") == 4096);
    for (const char* bad : {"abc", "-1", "2x", "", "0", " 2", "4097", "99999999999999999999"})
        CHECK_FALSE(kfac::detail::parse_thread_count(bad).has_value());
    auto value = GENERATE(as<std::string>{}, "abc", "-1", "2x");
    INFO(value);
    const scoped_env env("KFAC_NUM_THREADS", value.c_str());
    precond_t p;  // threads = 0: from the environment
    auto l = random_linear<double>(8, 6, 5, false, 1);
    p.register_layer("fc", l.view);
    CHECK_THROWS_WITH(p.step(), Contains("KFAC_NUM_THREADS='" + value + "'") && Contains("1 to 4096"));
    CHECK(p.steps() == 0);
    // Fixed, the same preconditioner starts normally.
    const scoped_env fixed("KFAC_NUM_THREADS", "2");
    CHECK_NOTHROW(p.step());
}

TEST_CASE("configuration differences name the first layer or option", "[robustness][configuration]") {
    using kfac::detail::config_item;
    const std::vector<config_item> zero = {{"layer #0", "'fc' (linear 6->5, bias)"}, {"options.damping", "0.001"}};
    CHECK(kfac::detail::deserialize(kfac::detail::serialize(zero)).size() == 2);
    CHECK(kfac::detail::deserialize(kfac::detail::serialize(zero))[1].value == "0.001");
    CHECK_FALSE(kfac::detail::first_difference(zero, zero, 1).has_value());
    auto other = zero;
    other[1].value = "0.002";
    CHECK_THAT(*kfac::detail::first_difference(zero, other, 2),
               Contains("rank 2 differs from rank 0 in options.damping: rank 0 has 0.001, rank 2 has 0.002"));
    auto fewer = zero;
    fewer.erase(fewer.begin());
    CHECK_THAT(*kfac::detail::first_difference(zero, fewer, 1),
               Contains("in layer #0: rank 0 has 'fc' (linear 6->5, bias), rank 1 has nothing"));
    CHECK(kfac::detail::configuration_digest(zero) != kfac::detail::configuration_digest(other));
    // Doubles are compared exactly, and printed short when that is exact.
    CHECK(kfac::detail::exact_number_text(0.001) == "0.001");
    CHECK(kfac::detail::exact_number_text(0.001 + 1e-18) != kfac::detail::exact_number_text(0.0010000000000000002));
}
