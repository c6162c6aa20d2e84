// SPDX-License-Identifier: Apache-2.0
// The block kinds (kfac/blocks/) on their own, from their definitions: which layers each holds,
// that the storage they start from is the storage their layout() states, and that the
// second-order data of their identity start preconditions as the method's formula says.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "test_util.hpp"

// A named namespace: the Catch2 suite is built as unity translation units, where another
// test's `backend` would clash with an unnamed one's.
namespace blocks_test {

using backend = kfac::backend::cpu_eigen<double>;
using matrix = backend::matrix;

std::vector<kfac::layer_description> one_of_each_kind() {
    kfac::conv2d_geometry grouped;
    grouped.kernel = {3, 3};
    grouped.groups = 2;
    return {kfac::linear_description(5, 3, true),
            kfac::conv2d_description(4, 6, grouped, false),
            kfac::conv1d_description(2, 3, kfac::conv1d_geometry{}, true),
            kfac::embedding_description(7, 4),
            kfac::layer_norm_description(5, true),
            kfac::batch_norm_description(3, false)};
}

/// The block kinds that hold `d`.
int holders(const kfac::layer_description& d) {
    int n = 0;
    [&]<class... Kinds>(kfac::blocks::kind_list<Kinds...>) {
        ((n += Kinds::holds(d) ? 1 : 0), ...);
    }(kfac::blocks::block_kinds{});
    return n;
}

template <class Method>
void check_identity_start(const kfac::layer_description& d, double expected_scale) {
    using impl = kfac::detail::compute_impl<Method, backend>;
    const auto& block = kfac::blocks::block_for<backend, impl>(d);
    const kfac::blocks::block_layout layout = kfac::blocks::layout_of(d);
    INFO(kfac::kind_name(d.kind) << " as " << layout.name << " under " << Method::name);

    kfac::detail::layer_state<backend, impl> state;
    kfac::detail::step_statistics<backend> statistics;
    block.start(state, d);
    block.clear_statistic(statistics, d);
    // The storage is the layout's: a checkpoint and the placement read the layout, the engine the matrices.
    CHECK(state.a_factor.rows() == layout.a_rows);
    CHECK(state.a_factor.cols() == layout.a_cols);
    CHECK(state.g_factor.rows() == layout.g_dim);
    CHECK(state.g_factor.cols() == layout.g_dim);
    CHECK(statistics.a_sum.rows() == layout.a_rows);
    CHECK(statistics.a_sum.cols() == layout.a_cols);
    CHECK(statistics.g_sum.rows() == layout.g_dim);
    CHECK(statistics.a_sum.isZero(0.0));
    CHECK(statistics.g_sum.isZero(0.0));

    const double damping = 0.25;
    kfac::options o;
    typename impl::layer_data computed{}, identity{}, full{};
    // Where the reference damping goes: the product (eigen method) or each factor (inverse).
    const kfac::detail::damping_terms t = block.damping_of(state, damping, o);
    REQUIRE(block.compute(kfac::detail::factor_side::a, state.a_factor, t.a, o, {}, computed.a));
    REQUIRE(block.compute(kfac::detail::factor_side::g, state.g_factor, t.g, o, {}, computed.g));
    block.finalize(computed, t.product, o);
    block.identity_data(identity, d, t, o);
    // The full data's sizes (what a checkpoint expects) are those of the data computed.
    block.prepare_full(full, d, o);
    std::vector<std::pair<long, long>> expected_shapes, computed_shapes;
    impl::for_each_tensor(full,
                          [&](const char*, const auto& x, int) { expected_shapes.emplace_back(x.rows(), x.cols()); });
    impl::for_each_tensor(computed,
                          [&](const char*, const auto& x, int) { computed_shapes.emplace_back(x.rows(), x.cols()); });
    CHECK(computed_shapes == expected_shapes);

    // Γᵀ is A_dim × G_dim for every block. The identity factors' data multiplies it by
    // expected_scale; each entry is a few roundings from that (the products with Q = I and the
    // division by 1·1 + γ are exact up to one rounding each): 8 ulps of a value of order 1.
    const matrix gamma = matrix::Random(d.a_dim(), d.g_dim());
    typename impl::workspace w;
    for (const auto* data : {&computed, &identity}) {
        matrix p;
        block.precondition(*data, gamma, damping, o, w, p);
        REQUIRE(p.rows() == gamma.rows());
        REQUIRE(p.cols() == gamma.cols());
        CHECK((p - expected_scale * gamma).cwiseAbs().maxCoeff() <= 8 * std::numeric_limits<double>::epsilon());
    }
}

}  // namespace blocks_test

TEST_CASE("blocks: every layer kind is held by exactly one block kind", "[blocks]") {
    for (const auto& d : blocks_test::one_of_each_kind()) {
        INFO(kfac::kind_name(d.kind));
        CHECK(blocks_test::holders(d) == 1);
    }
    CHECK(std::string(kfac::blocks::layout_of(kfac::linear_description(2, 2, false)).name) == "dense Kronecker pair");
    CHECK(kfac::blocks::layout_of(kfac::embedding_description(9, 2)).a_structure == kfac::factor_structure::diagonal);
    CHECK(kfac::blocks::layout_of(kfac::layer_norm_description(4, true)).a_structure ==
          kfac::factor_structure::unit_wise);
}

TEST_CASE("blocks: the layout is the storage, and the identity start preconditions as its method says", "[blocks]") {
    const double damping = 0.25;
    for (const auto& d : blocks_test::one_of_each_kind()) {
        const bool unit_wise = kfac::is_normalization(d.kind);
        // Eigendecomposition: Pᵀ = Γᵀ / (λ_A λ_G + γ) with every λ = 1. Inverse: each factor is
        // damped, (I + γI)⁻¹ Γᵀ (I + γI)⁻¹ = Γᵀ / (1 + γ)², but a normalisation layer's G is the
        // identity that is not a factor and is not damped: Γᵀ / (1 + γ).
        blocks_test::check_identity_start<kfac::compute::eigendecomposition>(d, 1.0 / (1.0 + damping));
        blocks_test::check_identity_start<kfac::compute::inverse>(
            d, unit_wise ? 1.0 / (1.0 + damping) : 1.0 / ((1.0 + damping) * (1.0 + damping)));
    }
}

TEST_CASE("blocks: a layout's placement is the cost the strategies weigh", "[blocks]") {
    // A dense factor by its dimension; n stored entries as the ⌈√n⌉ × ⌈√n⌉ dense one.
    const auto embedding = kfac::blocks::layout_of(kfac::embedding_description(10, 3));
    CHECK(embedding.placement == std::pair<std::int64_t, std::int64_t>{4, 3});  // ⌈√10⌉ = 4
    const auto norm = kfac::blocks::layout_of(kfac::layer_norm_description(6, true));
    CHECK(norm.a_rows == 6);
    CHECK(norm.a_cols == 3);                                               // F_γγ, F_γβ, F_ββ
    CHECK(norm.placement == std::pair<std::int64_t, std::int64_t>{5, 1});  // ⌈√18⌉ = 5
    const auto costs =
        kfac::assignment::placement_costs({kfac::linear_description(5, 3, true), kfac::embedding_description(10, 3)});
    REQUIRE(costs.size() == 2);
    CHECK(costs[0] == std::pair<std::int64_t, std::int64_t>{6, 3});
    CHECK(costs[1] == embedding.placement);
}
