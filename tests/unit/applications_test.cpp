// SPDX-License-Identifier: Apache-2.0
// The optional members of kfac::layer_traits (layer_traits.hpp): several applications of a
// layer in one pass (shared weights), none (a branch not taken), no gradient, and end_pass();
// and register_layers(), all or nothing.
#include <catch2/catch.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <kfac/kfac.hpp>

#include "applied_layer.hpp"
#include "test_util.hpp"

using kfac_test::applied_layer;
using kfac_test::eps;
using kfac_test::random_linear;
using kfac_test::rel_err;

namespace {

using P = kfac::KFAC<kfac::backend::cpu_eigen<double>>;

kfac::options opts() {
    kfac::options o;
    o.damping = 0.01;
    o.threads = 1;
    return o;
}

}  // namespace

TEST_CASE("a layer applied twice in a pass: the statistic is the mean of the applications'", "[applications]") {
    // Two applications of unequal batch (6 and 10 rows): KAISA's rule averages the two
    // statistics, which is what two accumulated passes of the same data give.
    applied_layer<double> shared(4, 3, true);
    shared.apply(6, 11);
    shared.apply(10, 21);
    auto first = shared.applications[0], second = shared.applications[1];
    first.bind();  // the copies' views point into their own buffers
    second.bind();
    applied_layer<double> untouched(4, 3, true);  // the gradient before the step

    P p(opts());
    p.register_layer("shared", shared);
    p.step();
    CHECK(shared.ended == 1);
    CHECK(shared.applications.empty());

    auto reference_layer = first;
    reference_layer.grad_weight = untouched.grad_weight;
    reference_layer.grad_bias = untouched.grad_bias;
    reference_layer.bind();
    kfac::options acc = opts();
    acc.accumulation_steps = 2;
    P q(acc);
    q.register_layer("shared", reference_layer.view);
    q.accumulate();
    reference_layer.view.input = second.view.input;
    reference_layer.view.grad_output = second.view.grad_output;
    q.step();
    // The same operations in the same order: bitwise equal.
    CHECK(p.a_factor("shared") == q.a_factor("shared"));
    CHECK(p.g_factor("shared") == q.g_factor("shared"));
    CHECK(shared.grad_weight == reference_layer.grad_weight);
    CHECK(shared.grad_bias == reference_layer.grad_bias);

    // And by the definition: A = ξI + (1 − ξ)(Ã₁ᵀÃ₁/6 + Ã₂ᵀÃ₂/10)/2, not the pooled
    // (Ã₁ᵀÃ₁ + Ã₂ᵀÃ₂)/16. Rounding: sums of ≤ 10 products, relative error ≤ 16ε.
    auto cov = [](const kfac_test::owned_layer<double>& l) {
        const auto rows = l.input_shape[0];
        kfac_test::mat<double> a = kfac_test::mat<double>::Ones(rows, 5);
        for (std::int64_t r = 0; r < rows; ++r)
            for (int c = 0; c < 4; ++c) a(r, c) = l.input[static_cast<std::size_t>(r * 4 + c)];
        return kfac_test::mat<double>((a.transpose() * a) / static_cast<double>(rows));
    };
    const double xi = 0.95;
    const kfac_test::mat<double> expected =
        xi * kfac_test::mat<double>::Identity(5, 5) + (1 - xi) * (cov(first) + cov(second)) / 2.0;
    CHECK(rel_err(p.a_factor("shared").reshaped(), expected.reshaped()) < 16 * eps<double>());
}

TEST_CASE("a layer applied in no pass of a factor-update step keeps its factors, without decay", "[applications]") {
    applied_layer<double> branch(4, 3, false), trunk(4, 2, true);
    P p(opts());
    p.register_layer("branch", branch);
    p.register_layer("trunk", trunk);
    branch.apply(8, 1);
    trunk.apply(8, 2);
    p.step();
    const auto branch_a = p.a_factor("branch"), branch_g = p.g_factor("branch");
    const auto trunk_a = p.a_factor("trunk");
    CHECK(branch_a != kfac_test::mat<double>::Identity(4, 4));

    trunk.apply(8, 3);  // the branch is not taken in step 1
    const auto gradient_before = branch.grad_weight;
    p.step();
    CHECK(p.a_factor("branch") == branch_a);  // not ξ·A: no decay without data
    CHECK(p.g_factor("branch") == branch_g);
    CHECK(p.a_factor("trunk") != trunk_a);
    CHECK(branch.grad_weight != gradient_before);  // its gradient is still preconditioned
    CHECK(branch.ended == 2);
}

TEST_CASE("a layer without a gradient is left alone", "[applications]") {
    // The kl_clip scale over the other layers alone: equal to a run without the layer.
    kfac::options o = opts();
    o.kl_clip = 1e-6;  // binds
    applied_layer<double> idle(4, 3, true), busy(4, 2, true), busy_alone(4, 2, true);
    P p(o), q(o);
    p.register_layer("idle", idle);
    p.register_layer("busy", busy);
    q.register_layer("busy", busy_alone);
    idle.apply(8, 1);  // applied, but (say) its output never reached the loss
    busy.apply(8, 2);
    busy_alone.apply(8, 2);
    idle.gradient = false;
    const auto idle_weight = idle.grad_weight, idle_bias = idle.grad_bias;
    p.step();
    q.step();
    CHECK(idle.grad_weight == idle_weight);
    CHECK(idle.grad_bias == idle_bias);
    CHECK(p.last_kl_scale() == q.last_kl_scale());
    CHECK(p.last_kl_scale() < 1.0);
    CHECK(busy.grad_weight == busy_alone.grad_weight);
    CHECK(p.health().zeroed_gradients == 0);
}

TEST_CASE("end_pass() ends every successful accumulate() and step(), and no failed one", "[applications]") {
    kfac::options o = opts();
    o.factor_update_steps = 2;
    o.accumulation_steps = 2;
    applied_layer<double> l(4, 3, true);
    P p(o);
    p.register_layer("fc", l);
    l.apply(8, 1);
    p.accumulate();
    CHECK(l.ended == 1);
    CHECK(l.applications.empty());
    l.apply(8, 2);
    p.step();
    CHECK(l.ended == 2);
    // Step 1 updates no factor: its pass is not read, but still ended.
    l.apply(8, 3);
    p.accumulate();
    l.apply(8, 4);
    p.step();
    CHECK(l.ended == 4);
    // A failing step leaves the pass to the host, and the preconditioner as it was.
    l.apply(8, 5);
    l.applications.back().view.input.extents[1] = 5;  // not in_features
    P r(opts());
    r.register_layer("fc", l);
    CHECK_THROWS_WITH(r.step(), Catch::Contains("layer 'fc'") && Catch::Contains("in_features = 4"));
    CHECK(l.ended == 4);
    CHECK(l.applications.size() == 1);
    CHECK(r.steps() == 0);
}

TEST_CASE("a factor-update step in which no layer was applied is an error", "[applications][errors]") {
    kfac::options o = opts();
    o.factor_update_steps = 2;
    applied_layer<double> a(4, 3, true), b(3, 2, false);
    P p(o);
    p.register_layer("a", a);
    p.register_layer("b", b);
    const auto weight = a.grad_weight;
    CHECK_THROWS_WITH(p.step(), Catch::Contains("factor-update step 0") &&
                                    Catch::Contains("no registered layer was applied") &&
                                    Catch::Contains("training mode"));
    CHECK(p.steps() == 0);
    CHECK(a.grad_weight == weight);
    CHECK(a.ended == 0);
    a.apply(8, 1);
    p.step();  // b not applied: fine
    CHECK(p.steps() == 1);
    p.step();  // step 1 updates no factor: nothing needs to be applied
    CHECK(p.steps() == 2);

    SECTION("applications in an accumulated pass count") {
        kfac::options acc = opts();
        acc.accumulation_steps = 2;
        applied_layer<double> c(4, 3, true);
        P q(acc);
        q.register_layer("c", c);
        c.apply(8, 2);
        q.accumulate();
        q.step();  // nothing in the last pass, but the step has data
        CHECK(q.a_factor("c") != kfac_test::mat<double>::Identity(5, 5));
    }
    SECTION("a negative count is the adapter's error") {
        b.reported = -2;
        P r(opts());
        r.register_layer("b", b);
        CHECK_THROWS_WITH(r.step(), Catch::Contains("layer 'b'") && Catch::Contains("applications() returned -2"));
    }
}

TEST_CASE("register_layers registers all of a list or none", "[registration]") {
    auto l1 = random_linear<double>(4, 3, 2, false, 1), l2 = random_linear<double>(4, 2, 2, false, 2);
    auto l3 = random_linear<double>(4, 2, 2, false, 3);
    using list = std::vector<std::pair<std::string, kfac::layer_view<double>*>>;
    kfac::options o = opts();
    o.skip_layers = {"^skipped$"};
    P p(o);
    p.register_layer("taken", l1.view);
    CHECK_THROWS_WITH(p.register_layers(list{{"a", &l2.view}, {"taken", &l3.view}}),
                      Catch::Contains("layer 'taken' is already registered"));
    CHECK(p.layer_count() == 1);
    CHECK_THROWS_WITH(p.register_layers(list{{"a", &l2.view}, {"b", &l2.view}}),
                      Catch::Contains("already registered as 'a'"));
    CHECK_THROWS_WITH(p.register_layers(list{{"a", &l2.view}, {"a", &l3.view}}),
                      Catch::Contains("layer 'a' is already registered"));
    CHECK(p.layer_count() == 1);
    CHECK(p.register_layers(list{{"a", &l2.view}, {"skipped", &l3.view}}) == 1);
    CHECK(p.layer_count() == 2);
    CHECK(p.is_registered("a"));
    CHECK_FALSE(p.is_registered("skipped"));
}

TEST_CASE("an any_layer preconditions exactly as the layer it wraps", "[applications][any_layer]") {
    // Both forms: the per-application test layer and the plain single-view layer_view.
    applied_layer<double> direct(4, 3, true), wrapped_target(4, 3, true);
    auto plain = random_linear<double>(8, 3, 2, false, 5), plain_copy = plain;
    plain_copy.bind();
    P p(opts()), q(opts());
    p.register_layer("shared", direct);
    p.register_layer("plain", plain.view);
    kfac::any_layer<double> wrapped(wrapped_target), wrapped_plain(plain_copy.view);
    q.register_layer("shared", wrapped);
    q.register_layer("plain", wrapped_plain);
    CHECK(wrapped.description().a_dim() == 5);
    // The wrapped object is the layer: registering it again, wrapped or not, is refused.
    CHECK_THROWS_WITH(q.register_layer("again", wrapped_target), Catch::Contains("already registered as 'shared'"));
    kfac::any_layer<double> wrapped_again(wrapped_target);
    CHECK_THROWS_WITH(q.register_layer("again", wrapped_again), Catch::Contains("already registered as 'shared'"));
    for (int step = 0; step < 3; ++step) {
        for (auto* l : {&direct, &wrapped_target}) {
            l->apply(6, static_cast<std::uint32_t>(10 * step + 1));
            l->apply(4, static_cast<std::uint32_t>(10 * step + 2));
        }
        p.step();
        q.step();
        CHECK(direct.grad_weight == wrapped_target.grad_weight);
        CHECK(plain.grad_weight == plain_copy.grad_weight);
    }
    CHECK(p.a_factor("shared") == q.a_factor("shared"));
    CHECK(wrapped_target.ended == 3);  // end_pass reaches the wrapped layer
}
