// SPDX-License-Identifier: Apache-2.0
// KAISA's greedy placement, with the cases of kfac-pytorch's assignment tests (the group
// lists are given explicitly, so the reference's set order does not enter).
#include <catch2/catch.hpp>

#include <kfac/kfac.hpp>

using kfac::assignment::factor_workers;
using kfac::assignment::greedy_assignment;

namespace {
bool same(const factor_workers& x, int a, int g) { return x.a == a && x.g == g; }
}  // namespace

TEST_CASE("greedy assignment, two layers on four ranks", "[assignment]") {
    const std::vector<kfac::assignment::layer_work> work = {{1, 2}, {3, 4}};
    const auto colocated = greedy_assignment(work, {{0, 1, 2, 3}}, 4, true);
    CHECK(same(colocated[0], 1, 1));
    CHECK(same(colocated[1], 0, 0));
    const auto split = greedy_assignment(work, {{0, 1, 2, 3}}, 4, false);
    CHECK(same(split[0], 3, 2));
    CHECK(same(split[1], 1, 0));
}

TEST_CASE("greedy assignment, equal costs place G first", "[assignment]") {
    const auto out = greedy_assignment({{1, 1}}, {{0, 1, 2, 3, 4, 5, 6, 7}}, 8, false);
    CHECK(same(out[0], 1, 0));
}

TEST_CASE("greedy assignment over column groups", "[assignment]") {
    const std::vector<kfac::assignment::layer_work> work = {{5, 1}, {0.02, 0.01}};
    const auto cols = greedy_assignment(work, {{0}, {1}}, 2, false);
    CHECK(same(cols[0], 0, 0));
    CHECK(same(cols[1], 1, 1));
    const auto one = greedy_assignment(work, {{0, 1}}, 2, true);
    CHECK(same(one[0], 0, 0));
    CHECK(same(one[1], 1, 1));
}

TEST_CASE("assignment strategies use n^3 and n^2 costs", "[assignment]") {
    // Dimensions (A, G): layer 0 (10, 10) costs 2000 / 200; layer 1 (12, 2) costs 1736 / 148;
    // layer 2 (3, 14) costs 2771 / 205. Longest first on two ranks.
    const std::vector<std::pair<std::int64_t, std::int64_t>> dims = {{10, 10}, {12, 2}, {3, 14}};
    const auto c = kfac::assignment::compute_balanced::assign(dims, {{0, 1}}, 2, true);
    CHECK(c[2].a == 0);  // 2771 first → rank 0
    CHECK(c[0].a == 1);  // 2000 → rank 1
    CHECK(c[1].a == 1);  // 1736 → rank 1 (2000 < 2771)
    const auto m = kfac::assignment::memory_balanced::assign(dims, {{0, 1}}, 2, true);
    CHECK(m[2].a == 0);  // 205
    CHECK(m[0].a == 1);  // 200
    CHECK(m[1].a == 1);  // 148 → rank 1 (200 < 205)
    const auto r = kfac::assignment::round_robin::assign(dims, {{0, 1}}, 2, false);
    CHECK((r[0].a == 0 && r[0].g == 1 && r[1].a == 0 && r[1].g == 1));
}

TEST_CASE("invalid worker groups are errors", "[assignment][errors]") {
    CHECK_THROWS_AS(greedy_assignment({{1, 1}}, {}, 2, true), kfac::error);
    CHECK_THROWS_WITH(greedy_assignment({{1, 1}}, {{0, 5}}, 2, true), Catch::Contains("rank 5"));
}

TEST_CASE("the distribution plan places every layer's work", "[assignment][plan]") {
    using kfac::assignment::plan_distribution;
    const std::vector<std::pair<std::int64_t, std::int64_t>> dims = {{577, 64}, {65, 10}, {129, 128}};
    SECTION("KAISA HYBRID_OPT at W = 4: columns {0, 2} and {1, 3}") {
        const auto plan = plan_distribution<kfac::assignment::compute_balanced>(dims, 4, kfac::distribution::kaisa, 0.5, true);
        CHECK(plan.name == "hybrid_opt");
        CHECK(plan.columns == 2);
        CHECK(plan.broadcast_second_order());
        CHECK(plan.broadcast_gradients());
        for (std::size_t i = 0; i < dims.size(); ++i) {
            const auto& l = plan.layers[i];
            CHECK(l.factor_holders == std::vector<int>{0, 1, 2, 3});
            CHECK(l.a_worker == l.g_worker);  // colocated
            const int column = l.g_worker % 2;
            CHECK(l.grad_workers == std::vector<int>{column, column + 2});
            for (int r = 0; r < 4; ++r) {
                const auto role = plan.role(i, r);
                CHECK(role.grad_worker == (r % 2 == column));
                CHECK(role.share_second_order == role.grad_worker);
                CHECK(role.computes_a == (r == l.a_worker));
                CHECK(role.g_root == l.g_worker / 2);
                CHECK(role.grad_root == column);
            }
        }
    }
    SECTION("DP-KFAC at W = 3: one owner holds, computes and preconditions") {
        const auto plan = plan_distribution<kfac::assignment::compute_balanced>(dims, 3, kfac::distribution::dp_kfac, 1.0, true);
        CHECK(plan.name == "dp_kfac");
        CHECK_FALSE(plan.broadcast_second_order());
        for (std::size_t i = 0; i < dims.size(); ++i) {
            const auto& l = plan.layers[i];
            CHECK(l.factor_holders == std::vector<int>{l.a_worker});
            CHECK(l.grad_workers == std::vector<int>{l.a_worker});
            const auto owner = plan.role(i, l.a_worker);
            CHECK((owner.holds_factors && owner.computes_a && owner.computes_g && owner.share_gradient));
            CHECK(owner.grad_root == l.a_worker);
            const auto other = plan.role(i, (l.a_worker + 1) % 3);
            CHECK_FALSE((other.holds_factors || other.grad_worker || other.computes_a));
        }
    }
    SECTION("a fraction that does not fit, and MEM_OPT without colocation, are errors") {
        CHECK_THROWS_WITH((plan_distribution<kfac::assignment::compute_balanced>(dims, 3, kfac::distribution::kaisa, 0.5, true)),
                          Catch::Contains("does not divide the world size 3"));
        CHECK_THROWS_WITH((plan_distribution<kfac::assignment::compute_balanced>(dims, 4, kfac::distribution::kaisa, 0.0, false)),
                          Catch::Contains("colocate_factors = false with MEM_OPT"));
    }
}
