// SPDX-License-Identifier: Apache-2.0
// Factor statistics of one batch against the formulas of golden/README.md §4 written out
// naively, and against values worked out by hand.
#include <catch2/catch.hpp>

#include <kfac/backend/detail/cpu_ekfac_scaling.hpp>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {

using wide = long double;  // the EKFAC references' type: their own rounding is negligible
using wide_mat = mat<wide>;

/// Per-example gradients of one application, by the layers' definitions, in long double:
/// gradient[n] is G_dim × A_dim (the bias column last), and magnitude[n] the same sums over
/// |terms| (|ĝ| |x̃|ᵀ summed over positions), which bound the rounding of any order of them.
struct ekfac_example_gradients {
    std::vector<wide_mat> gradient, magnitude;
};

/// A Linear layer's examples [N, R, in] and [N, R, out]: Γ_n = Σ_r g_{n,r} x̃_{n,r}ᵀ; under
/// `reduce`, ĝ_n x̄_nᵀ with x̄_n the mean of the example's rows and ĝ_n the sum of its gradients.
template <class T>
ekfac_example_gradients ekfac_linear_gradients(const kfac::layer_description& d, const std::vector<T>& x,
                                               const std::vector<T>& g, std::int64_t n, std::int64_t r) {
    ekfac_example_gradients out;
    const bool reduce = d.sharing == kfac::weight_sharing::reduce;
    for (std::int64_t e = 0; e < n; ++e) {
        wide_mat grad = wide_mat::Zero(d.out, d.a_dim()), mag = grad;
        Eigen::Matrix<wide, Eigen::Dynamic, 1> x_mean = Eigen::Matrix<wide, Eigen::Dynamic, 1>::Zero(d.a_dim());
        Eigen::Matrix<wide, Eigen::Dynamic, 1> g_sum = Eigen::Matrix<wide, Eigen::Dynamic, 1>::Zero(d.out);
        Eigen::Matrix<wide, Eigen::Dynamic, 1> x_abs_mean = x_mean, g_abs_sum = g_sum;
        for (std::int64_t p = 0; p < r; ++p) {
            Eigen::Matrix<wide, Eigen::Dynamic, 1> xt = Eigen::Matrix<wide, Eigen::Dynamic, 1>::Ones(d.a_dim());
            Eigen::Matrix<wide, Eigen::Dynamic, 1> gt(d.out);
            for (std::int64_t i = 0; i < d.in; ++i) xt(i) = x[static_cast<std::size_t>((e * r + p) * d.in + i)];
            for (std::int64_t o = 0; o < d.out; ++o) gt(o) = g[static_cast<std::size_t>((e * r + p) * d.out + o)];
            grad += gt * xt.transpose();
            mag += gt.cwiseAbs() * xt.cwiseAbs().transpose();
            x_mean += xt / static_cast<wide>(r);
            g_sum += gt;
            x_abs_mean += xt.cwiseAbs() / static_cast<wide>(r);
            g_abs_sum += gt.cwiseAbs();
        }
        if (reduce) {  // ĝ_n x̄_nᵀ, whose rounding is bounded by (Σ_r |g|)(Σ_r |x̃| / R)ᵀ
            grad = g_sum * x_mean.transpose();
            mag = g_abs_sum * x_abs_mean.transpose();
        }
        out.gradient.push_back(grad);
        out.magnitude.push_back(mag);
    }
    return out;
}

/// A convolution's examples [N, C, H, W] and [N, O, H', W'] (true dilation): Γ_n[o, (c, i, j)] =
/// Σ_{y,x} g[n, o, y, x] · input[n, c, y·s_h − p_h + i·dil_h, x·s_w − p_w + j·dil_w] (zero outside),
/// and the bias column Σ_{y,x} g[n, o, y, x].
template <class T>
ekfac_example_gradients ekfac_conv_gradients(const kfac::layer_description& d, const std::vector<T>& x,
                                             const std::vector<T>& g, std::int64_t n, std::int64_t h, std::int64_t w) {
    const auto& c = d.conv;
    const std::int64_t ho = kfac::conv_output_extent(h, c.kernel[0], c.stride[0], c.padding[0], c.dilation[0]);
    const std::int64_t wo = kfac::conv_output_extent(w, c.kernel[1], c.stride[1], c.padding[1], c.dilation[1]);
    ekfac_example_gradients out;
    for (std::int64_t e = 0; e < n; ++e) {
        wide_mat grad = wide_mat::Zero(d.out, d.a_dim()), mag = grad;
        for (std::int64_t o = 0; o < d.out; ++o)
            for (std::int64_t y = 0; y < ho; ++y)
                for (std::int64_t xo = 0; xo < wo; ++xo) {
                    const wide go = g[static_cast<std::size_t>(((e * d.out + o) * ho + y) * wo + xo)];
                    if (d.bias) {
                        grad(o, d.a_dim() - 1) += go;
                        mag(o, d.a_dim() - 1) += std::abs(go);
                    }
                    for (std::int64_t ch = 0; ch < d.in; ++ch)
                        for (std::int64_t i = 0; i < c.kernel[0]; ++i)
                            for (std::int64_t j = 0; j < c.kernel[1]; ++j) {
                                const std::int64_t ih = y * c.stride[0] - c.padding[0] + i * c.dilation[0];
                                const std::int64_t iw = xo * c.stride[1] - c.padding[1] + j * c.dilation[1];
                                if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
                                const wide xi = x[static_cast<std::size_t>(((e * d.in + ch) * h + ih) * w + iw)];
                                const std::int64_t col = (ch * c.kernel[0] + i) * c.kernel[1] + j;
                                grad(o, col) += go * xi;
                                mag(o, col) += std::abs(go * xi);
                            }
                }
        out.gradient.push_back(grad);
        out.magnitude.push_back(mag);
    }
    return out;
}

/// Ŝᵀ of the definition (kfac/backend/detail/cpu_ekfac_scaling.hpp) in long double, and the
/// bound on the rounding of any computation of it in T: each projected entry (Q_Aᵀ Γ_nᵀ Q_G) is a
/// sum of k = A_dim + G_dim + R products of the inputs and the bases (k counting every sum the
/// kernel's order nests), so it is off by at most k·u times the same sum over |terms|, M_n =
/// |Q_A|ᵀ Mag_nᵀ |Q_G| with Mag_n = Σ_r |g_{n,r}| |x̃_{n,r}|ᵀ (ekfac_example_gradients::magnitude); squaring doubles the relative error, and the mean over N
/// examples adds N·u of its own: |Ŝ − S| ≤ (2k + N + 2)·u · (1/N) Σ_n M_n∘² (+ O(u²)).
struct ekfac_reference {
    wide_mat scaling, bound;
};
template <class T>
ekfac_reference ekfac_reference_of(const ekfac_example_gradients& ex, const mat<T>& q_a, const mat<T>& q_g,
                                   std::int64_t positions) {
    const wide_mat qa = q_a.template cast<wide>(), qg = q_g.template cast<wide>();
    ekfac_reference r{wide_mat::Zero(qa.rows(), qg.rows()), wide_mat::Zero(qa.rows(), qg.rows())};
    const auto n = static_cast<wide>(ex.gradient.size());
    for (std::size_t e = 0; e < ex.gradient.size(); ++e) {
        // lazyProduct: coefficient loops; Eigen's GEMM kernel for long double would add ~7 s of
        // compile time to this file for products of a few dozen rows.
        const wide_mat p = qa.transpose().lazyProduct(ex.gradient[e].transpose()).eval().lazyProduct(qg);
        const wide_mat m = qa.cwiseAbs().transpose().lazyProduct(ex.magnitude[e].transpose()).eval().lazyProduct(
            qg.cwiseAbs());
        r.scaling += p.array().square().matrix() / n;
        r.bound += m.array().square().matrix() / n;
    }
    const double k = static_cast<double>(qa.rows() + qg.rows() + positions);
    r.bound *= static_cast<wide>((2 * k + static_cast<double>(ex.gradient.size()) + 2) * eps<T>());
    return r;
}

/// Whether every entry of `s` is within its bound of the reference.
template <class T>
bool ekfac_within_bound(const mat<T>& s, const ekfac_reference& r) {
    if (s.rows() != r.scaling.rows() || s.cols() != r.scaling.cols()) return false;
    for (Eigen::Index i = 0; i < s.size(); ++i)
        if (!(std::abs(static_cast<wide>(s(i)) - r.scaling(i)) <= r.bound(i))) return false;
    return true;
}

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

// ---- EKFAC's scaling statistic (kfac/backend/detail/cpu_ekfac_scaling.hpp) ----

TEMPLATE_TEST_CASE("EKFAC scaling of a Linear layer equals its per-example gradients in the basis",
                   "[statistics][ekfac]", float, double) {
    using T = TestType;
    struct l_case {
        std::int64_t n, r, in, out;
        bool bias;
        kfac::weight_sharing sharing;
    };
    const std::vector<l_case> cases = {
        {7, 1, 5, 3, true, kfac::weight_sharing::expand},   // one row per example: (Ã∘Ã)ᵀ(G̃∘G̃)/N
        {4, 3, 4, 5, true, kfac::weight_sharing::expand},   // tokens: Γ_n sums the example's rows
        {3, 4, 6, 2, false, kfac::weight_sharing::expand},
        {5, 3, 4, 3, true, kfac::weight_sharing::reduce},   // one reduced row per example
    };
    for (std::size_t idx = 0; idx < cases.size(); ++idx) {
        const auto& lc = cases[idx];
        INFO("case " << idx);
        auto d = kfac::linear_description(lc.in, lc.out, lc.bias);
        d.sharing = lc.sharing;
        const auto seed = static_cast<std::uint32_t>(100 + 10 * idx);
        const auto x = random_vector<T>(static_cast<std::size_t>(lc.n * lc.r * lc.in), seed);
        const auto g = random_vector<T>(static_cast<std::size_t>(lc.n * lc.r * lc.out), seed + 1, 0.1);
        const mat<T> q_a = kfac_test::random_orthonormal<T>(d.a_dim(), seed + 2);
        const mat<T> q_g = kfac_test::random_orthonormal<T>(d.g_dim(), seed + 3);
        const std::vector<std::int64_t> xs = lc.r == 1 ? std::vector<std::int64_t>{lc.n, lc.in}
                                                       : std::vector<std::int64_t>{lc.n, lc.r, lc.in};
        const std::vector<std::int64_t> gs = lc.r == 1 ? std::vector<std::int64_t>{lc.n, lc.out}
                                                       : std::vector<std::int64_t>{lc.n, lc.r, lc.out};
        mat<T> s = mat<T>::Constant(d.a_dim(), d.g_dim(), std::numeric_limits<T>::quiet_NaN());  // beta 0 never reads it
        kfac::backend::detail::ekfac_scaling_scratch<T> ws;
        kfac::backend::detail::accumulate_ekfac_scaling(s, d, kfac::tensor_view<const T>::from_extents(x.data(), xs),
                                                        kfac::tensor_view<const T>::from_extents(g.data(), gs), q_a, q_g,
                                                        T(0), ws);
        const ekfac_reference ref = ekfac_reference_of(ekfac_linear_gradients(d, x, g, lc.n, lc.r), q_a, q_g, lc.r);
        CHECK(ekfac_within_bound(s, ref));
    }
}

TEMPLATE_TEST_CASE("EKFAC scaling of a convolution equals its per-example gradients in the basis",
                   "[statistics][ekfac]", float, double) {
    using T = TestType;
    struct c_case {
        std::int64_t n, c, h, w, c_out;
        kfac::conv2d_geometry g;
        bool bias;
        bool conv1d;
    };
    const std::vector<c_case> cases = {
        {3, 2, 6, 6, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, false},
        {2, 3, 7, 6, 2, {{2, 3}, {2, 1}, {0, 1}, {1, 1}, 1}, false, false},
        {2, 2, 8, 8, 3, {{3, 3}, {1, 1}, {2, 2}, {2, 2}, 1}, true, false},  // dilated: the true gradient's taps
        {3, 2, 1, 9, 2, {{1, 3}, {1, 2}, {0, 1}, {1, 1}, 1}, true, true},   // Conv1d, viewed with a unit height
        // One output position against A_dim 55: the rows projected into the bases first (the
        // cases above form each example's gradient first: example_gradient_first()).
        {2, 6, 3, 3, 3, {{3, 3}, {1, 1}, {0, 0}, {1, 1}, 1}, true, false},
    };
    for (std::size_t idx = 0; idx < cases.size(); ++idx) {
        const auto& cc = cases[idx];
        INFO("case " << idx);
        const auto d = cc.conv1d ? kfac::conv1d_description(cc.c, cc.c_out, {cc.g.kernel[1], cc.g.stride[1], cc.g.padding[1],
                                                                             cc.g.dilation[1], 1}, cc.bias)
                                 : kfac::conv2d_description(cc.c, cc.c_out, cc.g, cc.bias);
        const std::int64_t ho = kfac::conv_output_extent(cc.h, cc.g.kernel[0], cc.g.stride[0], cc.g.padding[0], cc.g.dilation[0]);
        const std::int64_t wo = kfac::conv_output_extent(cc.w, cc.g.kernel[1], cc.g.stride[1], cc.g.padding[1], cc.g.dilation[1]);
        const auto seed = static_cast<std::uint32_t>(200 + 10 * idx);
        const auto x = random_vector<T>(static_cast<std::size_t>(cc.n * cc.c * cc.h * cc.w), seed);
        const auto g = random_vector<T>(static_cast<std::size_t>(cc.n * cc.c_out * ho * wo), seed + 1, 0.1);
        const mat<T> q_a = kfac_test::random_orthonormal<T>(d.a_dim(), seed + 2);
        const mat<T> q_g = kfac_test::random_orthonormal<T>(d.g_dim(), seed + 3);
        // The views as the statistics read them: a Conv1d's [N, C, L] with a unit axis.
        const auto xv = cc.conv1d ? kfac::tensor_view<const T>(x.data(), {cc.n, cc.c, cc.w})
                                  : kfac::tensor_view<const T>(x.data(), {cc.n, cc.c, cc.h, cc.w});
        const auto gv = cc.conv1d ? kfac::tensor_view<const T>(g.data(), {cc.n, cc.c_out, wo})
                                  : kfac::tensor_view<const T>(g.data(), {cc.n, cc.c_out, ho, wo});
        mat<T> s;
        kfac::backend::detail::ekfac_scaling_scratch<T> ws;
        kfac::backend::detail::accumulate_ekfac_scaling(s, d, kfac::detail::statistic_view(d, xv),
                                                        kfac::detail::statistic_view(d, gv), q_a, q_g, T(0), ws);
        const ekfac_reference ref = ekfac_reference_of(ekfac_conv_gradients(d, x, g, cc.n, cc.h, cc.w), q_a, q_g, ho * wo);
        CHECK(ekfac_within_bound(s, ref));
    }
}

TEMPLATE_TEST_CASE("EKFAC scaling of a layer applied several times sums each example's gradients first",
                   "[statistics][ekfac]", float, double) {
    // A shared weight's gradient of example n is Σ_k Γ_{n,k} over its applications k: the
    // reference sums the applications' per-example gradients (and their magnitudes, for the bound,
    // whose position count is every application's), then squares in the basis.
    using T = TestType;
    using views = std::vector<kfac::tensor_view<const T>>;
    auto sum_examples = [](ekfac_example_gradients x, const ekfac_example_gradients& y) {
        for (std::size_t e = 0; e < x.gradient.size(); ++e) {
            x.gradient[e] += y.gradient[e];
            x.magnitude[e] += y.magnitude[e];
        }
        return x;
    };
    const std::int64_t n = 3;
    for (const auto sharing : {kfac::weight_sharing::expand, kfac::weight_sharing::reduce}) {
        INFO("Linear, two applications of 2 and 3 tokens, " << (sharing == kfac::weight_sharing::reduce ? "reduce" : "expand"));
        auto d = kfac::linear_description(4, 3, true);
        d.sharing = sharing;
        const std::int64_t r0 = 2, r1 = 3;
        const auto x0 = random_vector<T>(static_cast<std::size_t>(n * r0 * d.in), 401);
        const auto g0 = random_vector<T>(static_cast<std::size_t>(n * r0 * d.out), 402, 0.1);
        const auto x1 = random_vector<T>(static_cast<std::size_t>(n * r1 * d.in), 403);
        const auto g1 = random_vector<T>(static_cast<std::size_t>(n * r1 * d.out), 404, 0.1);
        const mat<T> q_a = kfac_test::random_orthonormal<T>(d.a_dim(), 405);
        const mat<T> q_g = kfac_test::random_orthonormal<T>(d.g_dim(), 406);
        mat<T> s;
        kfac::backend::detail::ekfac_scaling_scratch<T> ws;
        kfac::backend::detail::accumulate_ekfac_scaling(
            s, d, views{kfac::tensor_view<const T>(x0.data(), {n, r0, d.in}), kfac::tensor_view<const T>(x1.data(), {n, r1, d.in})},
            views{kfac::tensor_view<const T>(g0.data(), {n, r0, d.out}), kfac::tensor_view<const T>(g1.data(), {n, r1, d.out})},
            q_a, q_g, T(0), ws);
        const auto both = sum_examples(ekfac_linear_gradients(d, x0, g0, n, r0), ekfac_linear_gradients(d, x1, g1, n, r1));
        CHECK(ekfac_within_bound(s, ekfac_reference_of(both, q_a, q_g, r0 + r1)));
        // Not the sum of the applications' own scalings: the cross terms 2·Γ_{n,0}Γ_{n,1} count.
        mat<T> apart0, apart1;
        kfac::backend::detail::accumulate_ekfac_scaling(apart0, d, kfac::tensor_view<const T>(x0.data(), {n, r0, d.in}),
                                                        kfac::tensor_view<const T>(g0.data(), {n, r0, d.out}), q_a, q_g, T(0), ws);
        kfac::backend::detail::accumulate_ekfac_scaling(apart1, d, kfac::tensor_view<const T>(x1.data(), {n, r1, d.in}),
                                                        kfac::tensor_view<const T>(g1.data(), {n, r1, d.out}), q_a, q_g, T(0), ws);
        CHECK_FALSE(ekfac_within_bound(mat<T>(apart0 + apart1), ekfac_reference_of(both, q_a, q_g, r0 + r1)));
    }
    struct conv_case {
        const char* what;
        std::int64_t c_in, padding, h0, w0, h1, w1;
    };
    // Padding 1 keeps a 3 × 3 convolution's outputs at its inputs' size: 36 + 35 positions form
    // each example's gradient first; without padding 3 × 3 inputs give one position each, against
    // A_dim 55: the rows are projected first (example_gradient_first()).
    for (const conv_case& cc : {conv_case{"6x6 and 5x7 inputs, padding 1", 2, 1, 6, 6, 5, 7},
                                conv_case{"two 3x3 inputs of 6 channels, no padding", 6, 0, 3, 3, 3, 3}}) {
        INFO("Conv2d, two applications: " << cc.what);
        const kfac::conv2d_geometry geometry{{3, 3}, {1, 1}, {cc.padding, cc.padding}, {1, 1}, 1};
        const auto d = kfac::conv2d_description(cc.c_in, 3, geometry, true);
        const std::int64_t h0 = cc.h0, w0 = cc.w0, h1 = cc.h1, w1 = cc.w1;
        auto out = [&](std::int64_t extent) { return kfac::conv_output_extent(extent, 3, 1, cc.padding, 1); };
        const auto x0 = random_vector<T>(static_cast<std::size_t>(n * d.in * h0 * w0), 411);
        const auto g0 = random_vector<T>(static_cast<std::size_t>(n * d.out * out(h0) * out(w0)), 412, 0.1);
        const auto x1 = random_vector<T>(static_cast<std::size_t>(n * d.in * h1 * w1), 413);
        const auto g1 = random_vector<T>(static_cast<std::size_t>(n * d.out * out(h1) * out(w1)), 414, 0.1);
        const mat<T> q_a = kfac_test::random_orthonormal<T>(d.a_dim(), 415);
        const mat<T> q_g = kfac_test::random_orthonormal<T>(d.g_dim(), 416);
        mat<T> s;
        kfac::backend::detail::ekfac_scaling_scratch<T> ws;
        kfac::backend::detail::accumulate_ekfac_scaling(
            s, d,
            views{kfac::tensor_view<const T>(x0.data(), {n, d.in, h0, w0}), kfac::tensor_view<const T>(x1.data(), {n, d.in, h1, w1})},
            views{kfac::tensor_view<const T>(g0.data(), {n, d.out, out(h0), out(w0)}),
                  kfac::tensor_view<const T>(g1.data(), {n, d.out, out(h1), out(w1)})},
            q_a, q_g, T(0), ws);
        const auto both = sum_examples(ekfac_conv_gradients(d, x0, g0, n, h0, w0), ekfac_conv_gradients(d, x1, g1, n, h1, w1));
        CHECK(ekfac_within_bound(s, ekfac_reference_of(both, q_a, q_g, out(h0) * out(w0) + out(h1) * out(w1))));
    }
    {
        INFO("one application is the one-application kernel, to the bit; different examples are refused");
        const auto d = kfac::linear_description(4, 3, true);
        const auto x = random_vector<T>(static_cast<std::size_t>(n * 2 * d.in), 421);
        const auto g = random_vector<T>(static_cast<std::size_t>(n * 2 * d.out), 422, 0.1);
        const mat<T> q_a = kfac_test::random_orthonormal<T>(d.a_dim(), 423);
        const mat<T> q_g = kfac_test::random_orthonormal<T>(d.g_dim(), 424);
        const kfac::tensor_view<const T> xv(x.data(), {n, 2, d.in}), gv(g.data(), {n, 2, d.out});
        mat<T> one, many;
        kfac::backend::detail::ekfac_scaling_scratch<T> ws;
        kfac::backend::detail::accumulate_ekfac_scaling(one, d, xv, gv, q_a, q_g, T(0), ws);
        kfac::backend::detail::accumulate_ekfac_scaling(many, d, views{xv}, views{gv}, q_a, q_g, T(0), ws);
        CHECK(one == many);
        const kfac::tensor_view<const T> fewer_x(x.data(), {n - 1, 2, d.in}), fewer_g(g.data(), {n - 1, 2, d.out});
        CHECK_THROWS_WITH(kfac::backend::detail::accumulate_ekfac_scaling(many, d, views{xv, fewer_x}, views{gv, fewer_g},
                                                                          q_a, q_g, T(0), ws),
                          Catch::Contains("application 1 holds 2 examples, application 0 3"));
    }
}

TEST_CASE("EKFAC scaling with identity bases is the empirical Fisher's diagonal, and beta adds",
          "[statistics][ekfac]") {
    // Q = I: Ŝᵀ(j, i) = (1/N) Σ_n Γ_n(i, j)², each example's own squared gradient.
    const auto d = kfac::linear_description(2, 2, false);
    const std::vector<double> x = {1, 2, 3, -1}, g = {0.5, -1, 2, 0.25};  // two examples
    const mat<double> eye = mat<double>::Identity(2, 2);
    mat<double> s;
    kfac::backend::detail::ekfac_scaling_scratch<double> ws;
    const kfac::tensor_view<const double> xv(x.data(), {2, 2}), gv(g.data(), {2, 2});
    kfac::backend::detail::accumulate_ekfac_scaling(s, d, xv, gv, eye, eye, 0.0, ws);
    // Γ_1 = [0.5, −1]ᵀ [1, 2] = [[0.5, 1], [−1, −2]]; Γ_2 = [2, 0.25]ᵀ [3, −1] = [[6, −2], [0.75, −0.25]].
    mat<double> expected(2, 2);  // Ŝᵀ(j, i) = (Γ_1(i, j)² + Γ_2(i, j)²) / 2
    expected << (0.25 + 36) / 2, (1 + 0.5625) / 2, (1 + 4) / 2.0, (4 + 0.0625) / 2;
    CHECK(s == expected);  // every entry exact in double
    kfac::backend::detail::accumulate_ekfac_scaling(s, d, xv, gv, eye, eye, 0.5, ws);
    CHECK(s == 1.5 * expected);
}

TEST_CASE("EKFAC scaling refuses what has no dense Kronecker pair, naming it", "[statistics][ekfac]") {
    using kfac::backend::detail::accumulate_ekfac_scaling;
    kfac::backend::detail::ekfac_scaling_scratch<double> ws;
    const std::vector<double> data(64, 1.0);
    mat<double> s;
    const mat<double> eye2 = mat<double>::Identity(2, 2), eye4 = mat<double>::Identity(4, 4);
    const kfac::tensor_view<const double> v(data.data(), {4, 4});
    const auto embedding = kfac::embedding_description(4, 4);
    CHECK_THROWS_WITH(accumulate_ekfac_scaling(s, embedding, v, v, eye4,
                                               eye4, 0.0, ws),
                      Catch::Contains("layer kind 'embedding' has none"));
    const auto grouped = kfac::conv2d_description(4, 4, {{1, 1}, {1, 1}, {0, 0}, {1, 1}, 2}, false);
    CHECK_THROWS_WITH(accumulate_ekfac_scaling(s, grouped, v, v, eye2, eye2,
                                               0.0, ws),
                      Catch::Contains("'conv2d' with 2 groups has one per group") && Catch::Contains("group_block()"));
    const auto linear = kfac::linear_description(4, 4, true);
    CHECK_THROWS_WITH(accumulate_ekfac_scaling(s, linear, v, v, eye4, eye4,
                                               0.0, ws),
                      Catch::Contains("A_dim 5 and G_dim 4 got Q_A 4x4"));
}
