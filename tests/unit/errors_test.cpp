// SPDX-License-Identifier: Apache-2.0
// Misuse is reported with kfac::error, naming the layer, the shapes and the fix.
#include <catch2/catch.hpp>

#include "unit/test_util.hpp"

using namespace kfac_test;
using Catch::Contains;
using precond_t = kfac::KFAC<kfac::backend::cpu_eigen<double>>;

TEST_CASE("invalid options are rejected with the valid range", "[errors][options]") {
    auto make = [](auto edit) {
        kfac::options o;
        edit(o);
        return precond_t(o);
    };
    CHECK_THROWS_AS(make([](kfac::options& o) { o.damping = -0.1; }), kfac::error);
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.damping = -0.1; }), Contains("damping") && Contains("> 0"));
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.damping = 0.0; }), Contains("damping"));
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.factor_decay = 1.0; }), Contains("factor_decay") && Contains("[0, 1)"));
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.factor_decay = -0.5; }), Contains("factor_decay"));
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.kl_clip = 0.0; }), Contains("kl_clip"));
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.lr = -1.0; }), Contains("lr"));
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.factor_update_steps = std::int64_t{0}; }), Contains("factor_update_steps"));
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.inv_update_steps = std::int64_t{-3}; }), Contains("inv_update_steps"));
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.accumulation_steps = 0; }), Contains("accumulation_steps"));
    CHECK_THROWS_WITH(make([](kfac::options& o) { o.skip_layers = {"("}; }), Contains("skip_layers") && Contains("'('"));
    CHECK_NOTHROW(make([](kfac::options& o) { o.factor_decay = 0.0; o.kl_clip = std::nullopt; o.lr = 0.0; }));
}

TEST_CASE("scheduled options are checked when read", "[errors][options]") {
    auto l = random_linear<double>(4, 3, 2, false, 1);
    kfac::options o;
    o.damping = [](std::int64_t k) { return k < 1 ? 0.01 : -1.0; };
    precond_t p(o);
    p.register_layer("fc", l.view);
    CHECK_NOTHROW(p.step());
    CHECK_THROWS_WITH(p.step(), Contains("damping evaluated to") && Contains("step 1"));
}

TEST_CASE("registration errors", "[errors][registration]") {
    precond_t p;
    auto l = random_linear<double>(4, 3, 2, false, 1);
    p.register_layer("fc", l.view);
    CHECK_THROWS_WITH(p.register_layer("fc", l.view), Contains("'fc' is already registered"));

    kfac::layer_view<double> grouped;
    grouped.description = kfac::conv2d_description(4, 4, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 3}, false);
    CHECK_THROWS_WITH(p.register_layer("dw", grouped), Contains("layer 'dw'") && Contains("groups = 3") &&
                                                           Contains("must be positive and divide both"));

    kfac::layer_view<double> empty;
    empty.description = kfac::linear_description(0, 3, false);
    CHECK_THROWS_WITH(p.register_layer("zero", empty), Contains("layer 'zero'") && Contains("positive"));

    p.step();
    auto late = random_linear<double>(4, 3, 2, false, 2);
    CHECK_THROWS_WITH(p.register_layer("late", late.view), Contains("after the first"));
}

TEST_CASE("views that disagree with the layer name the layer, the shapes and the fix", "[errors][views]") {
    SECTION("wrong input features") {
        precond_t p;
        auto l = random_linear<double>(8, 6, 5, true, 1);
        l.view.input.extents[1] = 7;
        l.view.input.extents[0] = 6;  // same element count, wrong shape
        p.register_layer("fc1", l.view);
        CHECK_THROWS_WITH(p.step(), Contains("layer 'fc1' (linear 6->5, bias)") && Contains("[6, 7]") &&
                                        Contains("in_features = 6"));
    }
    SECTION("rows of input and output gradient differ") {
        precond_t p;
        auto l = random_linear<double>(8, 6, 5, false, 1);
        l.view.grad_output.extents[0] = 4;
        p.register_layer("fc1", l.view);
        CHECK_THROWS_WITH(p.step(), Contains("[8, 6]") && Contains("[4, 5]") && Contains("same"));
    }
    SECTION("missing activations") {
        precond_t p;
        auto l = random_linear<double>(8, 6, 5, false, 1);
        l.view.input = {};
        p.register_layer("fc1", l.view);
        CHECK_THROWS_WITH(p.step(), Contains("layer 'fc1'") && Contains("no activations captured") && Contains("step 0"));
    }
    SECTION("missing activations are fine on steps without factor update") {
        precond_t::backend_type::matrix dummy;
        kfac::options o;
        o.factor_update_steps = std::int64_t{10};
        precond_t p(o);
        auto l = random_linear<double>(8, 6, 5, false, 1);
        p.register_layer("fc1", l.view);
        p.step();
        l.view.input = {};
        l.view.grad_output = {};
        CHECK_NOTHROW(p.step());
    }
    SECTION("weight gradient of the wrong shape") {
        precond_t p;
        auto l = random_linear<double>(8, 6, 5, false, 1);
        l.view.grad_weight = kfac::tensor_view<double>(l.grad_weight.data(), {6, 5});
        p.register_layer("fc1", l.view);
        CHECK_THROWS_WITH(p.step(), Contains("weight gradient has shape [6, 5]") && Contains("expected [5, 6]"));
    }
    SECTION("bias gradient missing, or given without bias") {
        precond_t p;
        auto l = random_linear<double>(8, 6, 5, true, 1);
        l.view.grad_bias = {};
        p.register_layer("fc1", l.view);
        CHECK_THROWS_WITH(p.step(), Contains("bias gradient has shape (empty)") && Contains("expected [5]"));
        precond_t q;
        auto m = random_linear<double>(8, 6, 5, false, 1);
        m.view.grad_bias = kfac::tensor_view<double>(m.grad_bias.data(), {5});
        q.register_layer("fc2", m.view);
        CHECK_THROWS_WITH(q.step(), Contains("described without bias"));
    }
    SECTION("conv output gradient of the wrong spatial size") {
        precond_t p;
        kfac::layer_view<double> conv;
        conv.description = kfac::conv2d_description(2, 3, {{3, 3}, {2, 2}, {1, 1}, {1, 1}, 1}, false);
        std::vector<double> a(2 * 2 * 8 * 8, 0.5), g(2 * 3 * 8 * 8, 0.1), w(3 * 2 * 9, 0.2);
        conv.input = kfac::tensor_view<const double>(a.data(), {2, 2, 8, 8});
        conv.grad_output = kfac::tensor_view<const double>(g.data(), {2, 3, 8, 8});
        conv.grad_weight = kfac::tensor_view<double>(w.data(), {3, 2, 3, 3});
        p.register_layer("conv1", conv);
        CHECK_THROWS_WITH(p.step(), Contains("layer 'conv1' (conv2d 2->3, kernel 3x3, no bias)") &&
                                        Contains("[2, 3, 8, 8]") && Contains("output is [2, 3, 4, 4]"));
    }
    SECTION("unknown layer name in an accessor") {
        precond_t p;
        CHECK_THROWS_WITH(p.a_factor("nope"), Contains("no layer named 'nope'"));
    }
}

TEST_CASE("an error about one layer carries the layer's name, and its message names the layer once", "[errors]") {
    CHECK(kfac::error("about no layer").layer().empty());
    CHECK(kfac::error("about no layer").message() == "about no layer");

    precond_t p;
    kfac::layer_view<double> empty;
    empty.description = kfac::linear_description(0, 3, false);
    try {
        p.register_layer("zero", empty);
        FAIL("register_layer accepted a layer of 0 inputs");
    } catch (const kfac::error& e) {
        CHECK(e.layer() == "zero");
        CHECK_THAT(e.what(), Contains("layer 'zero'") && Contains("positive"));
    }

    // Raised inside the step's agreed checks, through the per-layer wrapper that names the
    // layer of an error that does not name one yet.
    auto l = random_linear<double>(8, 6, 5, true, 1);
    l.view.input.extents[1] = 7;
    l.view.input.extents[0] = 6;
    p.register_layer("fc1", l.view);
    try {
        p.step();
        FAIL("step() accepted activations of the wrong shape");
    } catch (const kfac::error& e) {
        CHECK(e.layer() == "fc1");
        const std::string what = e.what();
        const auto first = what.find("layer 'fc1'");
        CHECK(first != std::string::npos);
        CHECK(what.find("layer 'fc1'", first + 1) == std::string::npos);
    }
}
