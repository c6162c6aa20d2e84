// SPDX-License-Identifier: Apache-2.0
// Factor statistics of one batch against the formulas of golden/README.md §4 written out
// naively, and against values worked out by hand.
#include <catch2/catch.hpp>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {


}  // namespace

TEST_CASE("covariance of a small matrix (kfac-pytorch's get_cov values)", "[statistics]") {
    // cov(M) = Mᵀ M / rows for M = [[1,2,3],[4,5,6],[7,8,9]]: 3·[[22,26,30],[26,31,36],[30,36,42]] / 3.
    const std::vector<double> m = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    const auto d = kfac::linear_description(3, 3, false);
    const mat<double> a = factor_statistic(d, m, {3, 3}, factor_side::a);
    mat<double> expected(3, 3);
    expected << 22, 26, 30, 26, 31, 36, 30, 36, 42;
    CHECK(rel_err(a.reshaped(), expected.reshaped()) < 10 * eps<double>());
}

TEST_CASE("conv statistics of a worked example", "[statistics]") {
    // Conv2d(1→1, k 2, s 1, p 0, bias) on the 3×3 input 1..9 (N = 1, S = 4): A = X̃ᵀX̃ / S³,
    // worked by hand: diagonal [0.71875, 1.15625, 2.40625, 3.21875, 0.0625], A[0,4] = 0.1875;
    // with output gradient [[1,2],[3,4]]: G = 30 / 64.
    const std::vector<double> x = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    const auto d = kfac::conv2d_description(1, 1, {{2, 2}, {1, 1}, {0, 0}, {1, 1}, 1}, true);
    const mat<double> a = factor_statistic(d, x, {1, 1, 3, 3}, factor_side::a);
    CHECK(a(0, 0) == Approx(0.71875).epsilon(1e-15));
    CHECK(a(1, 1) == Approx(1.15625).epsilon(1e-15));
    CHECK(a(2, 2) == Approx(2.40625).epsilon(1e-15));
    CHECK(a(3, 3) == Approx(3.21875).epsilon(1e-15));
    CHECK(a(4, 4) == Approx(0.0625).epsilon(1e-15));
    CHECK(a(0, 4) == Approx(0.1875).epsilon(1e-15));
    CHECK(a(4, 0) == a(0, 4));
    const std::vector<double> g = {1, 2, 3, 4};
    const mat<double> gf = factor_statistic(d, g, {1, 1, 2, 2}, factor_side::g);
    CHECK(gf(0, 0) == Approx(30.0 / 64.0).epsilon(1e-15));
}

TEMPLATE_TEST_CASE("linear statistics match the naive formula", "[statistics]", float, double) {
    using T = TestType;
    for (bool bias : {false, true}) {
        INFO("bias " << bias);
        // Extra leading dimensions [2, 5, in] are flattened into 10 rows.
        const std::int64_t in = 7, out = 4, rows = 10;
        const auto a = random_vector<T>(static_cast<std::size_t>(rows * in), 1);
        const auto g = random_vector<T>(static_cast<std::size_t>(rows * out), 2);
        const auto d = kfac::linear_description(in, out, bias);
        const mat<T> A = factor_statistic(d, a, {2, 5, in}, factor_side::a);
        const mat<T> G = factor_statistic(d, g, {2, 5, out}, factor_side::g);

        mat<double> x = mat<double>::Ones(rows, d.a_dim());
        x.leftCols(in) = Eigen::Map<const row_mat<T>>(a.data(), rows, in).template cast<double>();
        const mat<double> a_ref = x.transpose() * x / double(rows);
        const mat<double> y = Eigen::Map<const row_mat<T>>(g.data(), rows, out).template cast<double>();
        const mat<double> g_ref = y.transpose() * y / double(rows);
        // Sums of `rows` products: error grows like rows·ε.
        CHECK(rel_err(A.template cast<double>().reshaped(), a_ref.reshaped()) < 4 * rows * eps<T>());
        CHECK(rel_err(G.template cast<double>().reshaped(), g_ref.reshaped()) < 4 * rows * eps<T>());
        CHECK(A == A.transpose());
    }
}

TEMPLATE_TEST_CASE("conv statistics match the naive formula", "[statistics]", float, double) {
    using T = TestType;
    struct c_case {
        std::int64_t n, c, h, w, c_out;
        kfac::conv2d_geometry g;
        bool bias;
        kfac::conv_patch_mode mode;
    };
    const std::vector<c_case> cases = {
        {3, 2, 7, 7, 4, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, kfac::conv_patch_mode::reference},
        {2, 3, 9, 8, 2, {{2, 3}, {2, 1}, {0, 1}, {1, 1}, 1}, false, kfac::conv_patch_mode::reference},
        {2, 2, 9, 9, 3, {{3, 3}, {1, 1}, {2, 2}, {2, 2}, 1}, true, kfac::conv_patch_mode::reference},
        {2, 2, 9, 9, 3, {{3, 3}, {1, 1}, {2, 2}, {2, 2}, 1}, true, kfac::conv_patch_mode::dilated},
    };
    for (std::size_t idx = 0; idx < cases.size(); ++idx) {
        const auto& cc = cases[idx];
        INFO("case " << idx);
        const auto d = kfac::conv2d_description(cc.c, cc.c_out, cc.g, cc.bias);
        const auto a = random_vector<T>(static_cast<std::size_t>(cc.n * cc.c * cc.h * cc.w), 3 + static_cast<std::uint32_t>(idx));
        const mat<T> A = factor_statistic(d, a, {cc.n, cc.c, cc.h, cc.w}, factor_side::a, cc.mode);

        // Naive: every patch as a row (with the grid the mode implies), ones column last.
        const std::int64_t dh = cc.mode == kfac::conv_patch_mode::dilated ? cc.g.dilation[0] : 1;
        const std::int64_t dw = cc.mode == kfac::conv_patch_mode::dilated ? cc.g.dilation[1] : 1;
        const std::int64_t ho = kfac::conv_output_extent(cc.h, cc.g.kernel[0], cc.g.stride[0], cc.g.padding[0], dh);
        const std::int64_t wo = kfac::conv_output_extent(cc.w, cc.g.kernel[1], cc.g.stride[1], cc.g.padding[1], dw);
        const std::int64_t k = d.weight_columns(), s = ho * wo;
        mat<double> x = mat<double>::Ones(cc.n * s, d.a_dim());
        for (std::int64_t n = 0; n < cc.n; ++n)
            for (std::int64_t i = 0; i < ho; ++i)
                for (std::int64_t j = 0; j < wo; ++j)
                    for (std::int64_t c = 0; c < cc.c; ++c)
                        for (std::int64_t u = 0; u < cc.g.kernel[0]; ++u)
                            for (std::int64_t v = 0; v < cc.g.kernel[1]; ++v) {
                                const std::int64_t ih = i * cc.g.stride[0] + u * dh - cc.g.padding[0];
                                const std::int64_t iw = j * cc.g.stride[1] + v * dw - cc.g.padding[1];
                                const bool inside = ih >= 0 && ih < cc.h && iw >= 0 && iw < cc.w;
                                x((n * ho + i) * wo + j, (c * cc.g.kernel[0] + u) * cc.g.kernel[1] + v) =
                                    inside ? static_cast<double>(a[static_cast<std::size_t>(((n * cc.c + c) * cc.h + ih) * cc.w + iw)]) : 0.0;
                            }
        (void)k;
        const mat<double> a_ref = (x / double(s)).transpose() * (x / double(s)) / double(cc.n * s);
        CHECK(rel_err(A.template cast<double>().reshaped(), a_ref.reshaped()) < 4 * cc.n * s * eps<T>());

        // G from the true output grid.
        const std::int64_t gho = kfac::conv_output_extent(cc.h, cc.g.kernel[0], cc.g.stride[0], cc.g.padding[0], cc.g.dilation[0]);
        const std::int64_t gwo = kfac::conv_output_extent(cc.w, cc.g.kernel[1], cc.g.stride[1], cc.g.padding[1], cc.g.dilation[1]);
        const std::int64_t sg = gho * gwo;
        const auto g = random_vector<T>(static_cast<std::size_t>(cc.n * cc.c_out * sg), 50 + static_cast<std::uint32_t>(idx));
        const mat<T> G = factor_statistic(d, g, {cc.n, cc.c_out, gho, gwo}, factor_side::g);
        mat<double> y(cc.n * sg, cc.c_out);
        for (std::int64_t n = 0; n < cc.n; ++n)
            for (std::int64_t o = 0; o < cc.c_out; ++o)
                for (std::int64_t q = 0; q < sg; ++q)
                    y(n * sg + q, o) = static_cast<double>(g[static_cast<std::size_t>((n * cc.c_out + o) * sg + q)]);
        const mat<double> g_ref = y.transpose() * y / (double(cc.n) * sg * sg * sg);
        CHECK(rel_err(G.template cast<double>().reshaped(), g_ref.reshaped()) < 4 * cc.n * sg * eps<T>());
    }
}

TEMPLATE_TEST_CASE("accumulating statistics with beta adds them", "[statistics]", float, double) {
    using T = TestType;
    const auto d = kfac::linear_description(5, 3, true);
    const auto a1 = random_vector<T>(40, 7), a2 = random_vector<T>(40, 8);
    mat<T> sum(6, 6);
    typename backend<T>::workspace ws;
    backend<T>::accumulate_a_statistic(sum, d, kfac::tensor_view<const T>(a1.data(), {8, 5}), kfac::conv_patch_mode::reference, T(0), ws);
    backend<T>::accumulate_a_statistic(sum, d, kfac::tensor_view<const T>(a2.data(), {8, 5}), kfac::conv_patch_mode::reference, T(1), ws);
    mat<T> f = mat<T>::Zero(6, 6);
    backend<T>::running_average(f, sum, T(0), T(0.5));
    std::vector<T> both(a1);
    both.insert(both.end(), a2.begin(), a2.end());
    const mat<T> whole = factor_statistic(d, both, {16, 5}, factor_side::a);
    // Mean of two 8-row covariances = covariance of the 16 rows.
    CHECK(rel_err(f.reshaped(), whole.reshaped()) < 64 * eps<T>());
}
