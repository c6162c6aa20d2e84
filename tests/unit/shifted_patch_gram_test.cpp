// SPDX-License-Identifier: Apache-2.0
// The shift-structured patch Gram of a stride-1 convolution (kfac/backend/detail/
// shifted_patch_gram.hpp) against the definition: Σ over every patch of x̃ x̃ᵀ, the patch
// built tap by tap with zero padding, as loops. Geometries are drawn at random (kernels 1–4,
// padding 0–3, dilation 1–3 in both patch modes, images down to one pixel), so that every
// border case of the inclusion–exclusion is reached: windows that lose rows and columns at
// either side, offsets with no pixel pair inside the image, taps that never see the image.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>

#include "kfac/backend/detail/shifted_patch_gram.hpp"
#include "unit/test_util.hpp"

using namespace kfac_test;
namespace sg = kfac::backend::detail;

namespace {

using idx_t = std::int64_t;

struct conv_input {
    idx_t n, c, h, w;
    kfac::conv2d_geometry g;
    kfac::conv_patch_mode mode;
};

/// Σ_patches x̃ x̃ᵀ (full K × K, column-major) and Σ_patches x̃, from the definition.
struct patch_moments {
    std::vector<double> gram, sums;
    double max_abs_input = 0.0;
};

template <class T>
patch_moments moments_by_definition(const std::vector<T>& x, const conv_input& in) {
    const kfac::patch_grid grid = kfac::make_patch_grid(in.g, in.h, in.w, in.mode);
    const idx_t kh = in.g.kernel[0], kw = in.g.kernel[1], k = in.c * kh * kw;
    patch_moments m;
    m.gram.assign(static_cast<std::size_t>(k * k), 0.0);
    m.sums.assign(static_cast<std::size_t>(k), 0.0);
    for (const T v : x) m.max_abs_input = std::max(m.max_abs_input, std::abs(static_cast<double>(v)));
    std::vector<double> patch(static_cast<std::size_t>(k));
    for (idx_t s = 0; s < in.n; ++s)
        for (idx_t i = 0; i < grid.rows; ++i)
            for (idx_t j = 0; j < grid.cols; ++j) {
                for (idx_t c = 0; c < in.c; ++c)
                    for (idx_t u = 0; u < kh; ++u)
                        for (idx_t v = 0; v < kw; ++v) {
                            const idx_t r = i * in.g.stride[0] + u * grid.dil_h - in.g.padding[0];
                            const idx_t q = j * in.g.stride[1] + v * grid.dil_w - in.g.padding[1];
                            const bool inside = r >= 0 && r < in.h && q >= 0 && q < in.w;
                            patch[static_cast<std::size_t>((c * kh + u) * kw + v)] =
                                inside ? static_cast<double>(x[static_cast<std::size_t>(((s * in.c + c) * in.h + r) * in.w + q)])
                                       : 0.0;
                        }
                for (idx_t a = 0; a < k; ++a) {
                    m.sums[static_cast<std::size_t>(a)] += patch[static_cast<std::size_t>(a)];
                    for (idx_t b = 0; b < k; ++b)
                        m.gram[static_cast<std::size_t>(a + b * k)] += patch[static_cast<std::size_t>(a)] * patch[static_cast<std::size_t>(b)];
                }
            }
    return m;
}

/// Largest error, over the lower triangle, of sum = beta·old + alpha·Gram against the
/// definition, and of the patch-element sums.
template <class T>
std::pair<double, double> shifted_errors(const std::vector<T>& x, const conv_input& in, const patch_moments& m,
                                         T alpha, T beta, T old) {
    const kfac::patch_grid grid = kfac::make_patch_grid(in.g, in.h, in.w, in.mode);
    const auto geometry = sg::make_shifted_gram_geometry(in.g, grid, in.c, in.h, in.w);
    const idx_t k = in.c * in.g.kernel[0] * in.g.kernel[1];
    const idx_t ld = k + 2;  // a leading dimension larger than the block
    std::vector<T> sum(static_cast<std::size_t>(ld * k), old);
    sg::shifted_gram_scratch<T> scratch;
    sg::accumulate_shifted_patch_gram(sum.data(), ld, x.data(), in.n, geometry, alpha, beta, scratch);
    double gram_error = 0.0;
    for (idx_t j = 0; j < k; ++j)
        for (idx_t i = j; i < k; ++i) {
            const double expected = static_cast<double>(beta) * static_cast<double>(old) +
                                    static_cast<double>(alpha) * m.gram[static_cast<std::size_t>(i + j * k)];
            gram_error = std::max(gram_error, std::abs(static_cast<double>(sum[static_cast<std::size_t>(i + j * ld)]) - expected));
        }
    Eigen::Matrix<T, 1, Eigen::Dynamic> sums = Eigen::Matrix<T, 1, Eigen::Dynamic>::Zero(k);
    sg::add_patch_element_sums(sums, x.data(), in.n, geometry);
    double sum_error = 0.0;
    for (idx_t i = 0; i < k; ++i)
        sum_error = std::max(sum_error, std::abs(static_cast<double>(sums(i)) - m.sums[static_cast<std::size_t>(i)]));
    return {gram_error, sum_error};
}

conv_input random_stride1_input(std::mt19937& rng, int trial) {
    auto pick = [&](int lo, int hi) { return static_cast<idx_t>(std::uniform_int_distribution<int>(lo, hi)(rng)); };
    conv_input in{pick(1, 4), pick(1, 5), pick(1, 9), pick(1, 9), {}, kfac::conv_patch_mode::reference};
    in.g.kernel = {pick(1, 4), pick(1, 4)};
    in.g.padding = {pick(0, 3), pick(0, 3)};
    in.g.dilation = {pick(1, 3), pick(1, 3)};
    in.mode = trial % 2 == 0 ? kfac::conv_patch_mode::reference : kfac::conv_patch_mode::dilated;
    return in;
}

}  // namespace

TEST_CASE("shift-structured patch Gram equals the definition over random stride-1 geometries", "[im2col][shifted]") {
    std::mt19937 rng(2026);
    int checked = 0;
    for (int trial = 0; trial < 300; ++trial) {
        const conv_input in = random_stride1_input(rng, trial);
        const kfac::patch_grid grid = kfac::make_patch_grid(in.g, in.h, in.w, in.mode);
        if (grid.rows <= 0 || grid.cols <= 0) continue;  // no patch: the layer is refused upstream
        INFO("trial " << trial << ": N " << in.n << " C " << in.c << " " << in.h << "x" << in.w << " kernel "
                      << in.g.kernel[0] << "x" << in.g.kernel[1] << " padding " << in.g.padding[0] << ","
                      << in.g.padding[1] << " taps dilated " << grid.dil_h << "," << grid.dil_w);
        const auto x = random_vector<double>(static_cast<std::size_t>(in.n * in.c * in.h * in.w),
                                             100 + static_cast<std::uint32_t>(trial));
        const patch_moments m = moments_by_definition(x, in);
        // Each block is full(Δ) − border rows − border columns + corners: at most 4 sums of at
        // most n = N·H·W products, each of size ≤ max|x|². Recursive summation of n terms errs
        // by ≤ n·u·Σ|terms| ≤ n²·u·max|x|², so the block errs by ≤ 4·n²·u·max|x|² (loose, but
        // a wrong border term is of the size of the terms themselves); α = 0.5 scales it and
        // β·old = 2·3 adds one rounding. The sums of patch elements: n terms of ≤ max|x|.
        const double u = std::numeric_limits<double>::epsilon() / 2;
        const auto n = static_cast<double>(in.n * in.h * in.w);
        const double scale = m.max_abs_input * m.max_abs_input;
        const double tolerance = 4.0 * n * n * u * scale * 0.5 + 4 * u * 6.0;
        const auto [gram_error, sum_error] = shifted_errors<double>(x, in, m, 0.5, 2.0, 3.0);
        CHECK(gram_error <= tolerance);
        CHECK(sum_error <= n * n * u * m.max_abs_input);
        ++checked;
    }
    CHECK(checked > 200);
}

TEST_CASE("shift-structured patch Gram in float, beta 0 reads nothing", "[im2col][shifted]") {
    const conv_input in{3, 8, 7, 6, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, kfac::conv_patch_mode::reference};
    const auto x = random_vector<float>(static_cast<std::size_t>(in.n * in.c * in.h * in.w), 7);
    const patch_moments m = moments_by_definition(x, in);
    // β = 0 over a NaN-filled result: nothing of the old value may survive.
    const auto [gram_error, sum_error] =
        shifted_errors<float>(x, in, m, 1.0f, 0.0f, std::numeric_limits<float>::quiet_NaN());
    const double u = std::numeric_limits<float>::epsilon() / 2;
    const auto n = static_cast<double>(in.n * in.h * in.w);
    const double scale = m.max_abs_input * m.max_abs_input;
    CHECK(gram_error <= 4.0 * n * n * u * scale);  // as above, α = 1
    CHECK(sum_error <= n * n * u * m.max_abs_input);
}

TEST_CASE("the portable cross product equals the BLAS one on strided operands", "[shifted]") {
    // The Eigen path serves builds without BLAS; here both run on the same strided views.
    const idx_t m = 5, k = 7, ld = 9, ldc = 6;
    const auto x = random_vector<double>(static_cast<std::size_t>(ld * k), 1);
    const auto y = random_vector<double>(static_cast<std::size_t>(ld * k), 2);
    std::vector<double> blas(static_cast<std::size_t>(ldc * m), 1.0), portable = blas;
    sg::add_cross_product(blas.data(), ldc, x.data(), y.data(), m, k, ld, -0.5);
    sg::add_cross_product_portable(portable.data(), ldc, x.data(), y.data(), m, k, ld, -0.5);
    for (idx_t j = 0; j < m; ++j)
        for (idx_t i = 0; i < m; ++i) {
            double expected = 1.0, magnitude = 1.0;
            for (idx_t q = 0; q < k; ++q) {
                const double product = x[static_cast<std::size_t>(i + q * ld)] * y[static_cast<std::size_t>(j + q * ld)];
                expected -= 0.5 * product;
                magnitude += 0.5 * std::abs(product);
            }
            // k + 1 terms, any order of summation: error ≤ (k + 1)·u·Σ|terms|; doubled for margin.
            const double tolerance = 2.0 * static_cast<double>(k + 1) * 1.12e-16 * magnitude;
            CHECK(std::abs(blas[static_cast<std::size_t>(i + j * ldc)] - expected) <= tolerance);
            CHECK(std::abs(portable[static_cast<std::size_t>(i + j * ldc)] - expected) <= tolerance);
        }
    CHECK(blas[static_cast<std::size_t>(m)] == 1.0);  // rows past m in each column are untouched
}

TEST_CASE("the backend takes the shift structure where it pays and gives the reference statistic", "[im2col][shifted]") {
    using backend = kfac::backend::cpu_eigen<double>;
    // ResNet's 3×3 stride-1 convolutions take it; stride 2, 1×1 and fewer than 8 channels do not.
    const kfac::conv2d_geometry same{{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1};
    const kfac::conv2d_geometry strided{{3, 3}, {2, 2}, {1, 1}, {1, 1}, 1};
    const kfac::conv2d_geometry pointwise{{1, 1}, {1, 1}, {0, 0}, {1, 1}, 1};
    auto pays = [](const kfac::conv2d_geometry& g, idx_t c, idx_t h) {
        return sg::shifted_patch_gram_pays(g, kfac::make_patch_grid(g, h, h, kfac::conv_patch_mode::reference), c, h, h);
    };
    CHECK(pays(same, 16, 32));
    CHECK(pays(same, 32, 16));
    CHECK(pays(same, 64, 8));
    CHECK_FALSE(pays(strided, 16, 32));
    CHECK_FALSE(pays(pointwise, 64, 8));
    CHECK_FALSE(pays(same, 3, 32));

    // Through accumulate_a_statistic, with bias, on both paths: the reference's scaling
    // X̃ᵀX̃ / (N·S³) and the bias row Σ x̃ / (N·S³), corner N·S / (N·S³).
    for (const auto& g : {same, strided}) {
        const conv_input in{2, 8, 6, 5, g, kfac::conv_patch_mode::reference};
        const auto d = kfac::conv2d_description(in.c, 4, g, true);
        const kfac::patch_grid grid = kfac::make_patch_grid(g, in.h, in.w, in.mode);
        const auto x = random_vector<double>(static_cast<std::size_t>(in.n * in.c * in.h * in.w), 11);
        const patch_moments m = moments_by_definition(x, in);
        const idx_t k = d.weight_columns();
        backend::matrix sum = backend::matrix::Constant(k + 1, k + 1, 5.0);
        backend::workspace ws;
        backend::accumulate_a_statistic(sum, d, kfac::tensor_view<const double>(x.data(), {in.n, in.c, in.h, in.w}),
                                        in.mode, 0.25, ws);
        const double s = static_cast<double>(grid.positions());
        const double alpha = 1.0 / (static_cast<double>(in.n) * s * s * s);
        double error = 0.0;
        for (idx_t j = 0; j <= k; ++j)
            for (idx_t i = j; i <= k; ++i) {
                const double raw = i == k ? (j == k ? static_cast<double>(in.n) * s : m.sums[static_cast<std::size_t>(j)])
                                          : m.gram[static_cast<std::size_t>(i + j * k)];
                error = std::max(error, std::abs(sum(i, j) - (1.25 + alpha * raw)));
            }
        // As above: 4·n²·u·α·max|x|² for the Gram (the bias sums err less), plus the rounding
        // of β·old = 1.25.
        const double u = std::numeric_limits<double>::epsilon() / 2;
        const auto n = static_cast<double>(in.n * in.h * in.w);
        const double bound = 4.0 * n * n * u * alpha *
                                 std::max(m.max_abs_input * m.max_abs_input, m.max_abs_input) +
                             4.0 * u * 1.25;
        CHECK(error <= bound);
    }
}

TEST_CASE("a large tap-major accumulator is freed after the call, a small one kept", "[shifted]") {
    // K = C·9 channels × taps: 120 channels give K² = 1,166,400 scalars, above the 2²⁰ kept.
    for (const idx_t channels : {8, 120}) {
        INFO(channels << " channels");
        const conv_input in{1, channels, 3, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, kfac::conv_patch_mode::reference};
        const kfac::patch_grid grid = kfac::make_patch_grid(in.g, in.h, in.w, in.mode);
        const auto geometry = sg::make_shifted_gram_geometry(in.g, grid, in.c, in.h, in.w);
        const idx_t k = channels * 9;
        const auto x = random_vector<float>(static_cast<std::size_t>(in.c * in.h * in.w), 5);
        std::vector<float> sum(static_cast<std::size_t>(k * k), 0.0f);
        sg::shifted_gram_scratch<float> scratch;
        sg::accumulate_shifted_patch_gram(sum.data(), k, x.data(), 1, geometry, 1.0f, 0.0f, scratch);
        const bool large = static_cast<std::size_t>(k * k) > sg::shifted_gram_kept_scalars;
        CHECK(large == (channels == 120));
        CHECK(scratch.gram.empty() == large);
        CHECK(scratch.gram.capacity() == (large ? 0u : static_cast<std::size_t>(k * k)));
        // The diagonal entry of the centre tap of channel 0: Σ over the 9 patches of x(0, r, s)²
        // = every pixel once (3 × 3 image, padding 1).
        double expected = 0.0;
        for (idx_t i = 0; i < 9; ++i) expected += static_cast<double>(x[static_cast<std::size_t>(i)]) * x[static_cast<std::size_t>(i)];
        CHECK(std::abs(sum[static_cast<std::size_t>(4 + 4 * k)] - expected) <= 1e-5 * expected);
    }
}
