// SPDX-License-Identifier: Apache-2.0
// The shift-structured patch Gram of a stride-1 convolution (kfac/backend/detail/
// shifted_patch_gram.hpp) against the definition: Σ over every patch of x̃ x̃ᵀ, the patch
// built tap by tap with zero padding, as loops. Geometries are drawn at random (kernels 1–4,
// padding 0–3, dilation 1–3 in both patch modes, images down to one pixel), so that every
// border case of the cell decomposition is reached: windows that lose rows and columns at
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

/// The patch at grid position (i, j) of image s, tap by tap with zero padding, in type R.
template <class R, class T>
void fill_patch(std::vector<R>& patch, const std::vector<T>& x, const conv_input& in, const kfac::patch_grid& grid,
                idx_t s, idx_t i, idx_t j) {
    const idx_t kh = in.g.kernel[0], kw = in.g.kernel[1];
    patch.resize(static_cast<std::size_t>(in.c * kh * kw));
    for (idx_t c = 0; c < in.c; ++c)
        for (idx_t u = 0; u < kh; ++u)
            for (idx_t v = 0; v < kw; ++v) {
                const idx_t r = i * in.g.stride[0] + u * grid.dil_h - in.g.padding[0];
                const idx_t q = j * in.g.stride[1] + v * grid.dil_w - in.g.padding[1];
                const bool inside = r >= 0 && r < in.h && q >= 0 && q < in.w;
                patch[static_cast<std::size_t>((c * kh + u) * kw + v)] =
                    inside ? static_cast<R>(x[static_cast<std::size_t>(((s * in.c + c) * in.h + r) * in.w + q)]) : R(0);
            }
}

/// Calls f(patch) for every patch of x in type R (fill_patch), image by image, row by row.
template <class R, class T, class F>
void for_each_patch(const std::vector<T>& x, const conv_input& in, const kfac::patch_grid& grid, F&& f) {
    std::vector<R> patch;
    for (idx_t s = 0; s < in.n; ++s)
        for (idx_t i = 0; i < grid.rows; ++i)
            for (idx_t j = 0; j < grid.cols; ++j) {
                fill_patch(patch, x, in, grid, s, i, j);
                f(patch);
            }
}

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
    for_each_patch<double>(x, in, grid, [&](const std::vector<double>& patch) {
        for (idx_t a = 0; a < k; ++a) {
            m.sums[static_cast<std::size_t>(a)] += patch[static_cast<std::size_t>(a)];
            for (idx_t b = 0; b < k; ++b)
                m.gram[static_cast<std::size_t>(a + b * k)] += patch[static_cast<std::size_t>(a)] * patch[static_cast<std::size_t>(b)];
        }
    });
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
        // Each entry is a sum of at most n = N·H·W products, each of size ≤ max|x|², in some
        // order: it errs by ≤ n·u·Σ|terms| ≤ n²·u·max|x|²; 4× that is loose, but a missing or
        // doubled term is of the size of the terms themselves (the adversarial cases below
        // bound each entry by its own magnitudes); α = 0.5 scales it and β·old = 2·3 adds one
        // rounding. The sums of patch elements: n terms of ≤ max|x|.
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

// --- Accuracy for any input (issue 25): the Gram of a stride-1 convolution from inputs that
// defeat a subtraction of border rows and columns (one large pixel on the image border, a huge
// dynamic range), entry by entry against the definition, against the im2col path, and with
// every diagonal entry ≥ 0.
namespace {

/// Σ_patches x̃ x̃ᵀ and Σ_patches |x̃| |x̃|ᵀ (full K × K, column-major) in long double, with the
/// number of patches.
struct exact_gram {
    std::vector<long double> gram, magnitude;
    idx_t patches = 0;
};

template <class T>
exact_gram gram_in_long_double(const std::vector<T>& x, const conv_input& in) {
    const kfac::patch_grid grid = kfac::make_patch_grid(in.g, in.h, in.w, in.mode);
    const idx_t kh = in.g.kernel[0], kw = in.g.kernel[1], k = in.c * kh * kw;
    exact_gram e;
    e.gram.assign(static_cast<std::size_t>(k * k), 0.0L);
    e.magnitude = e.gram;
    e.patches = in.n * grid.rows * grid.cols;
    for_each_patch<long double>(x, in, grid, [&](const std::vector<long double>& patch) {
        for (idx_t b = 0; b < k; ++b)
            for (idx_t a = 0; a < k; ++a) {
                const long double p = patch[static_cast<std::size_t>(a)] * patch[static_cast<std::size_t>(b)];
                e.gram[static_cast<std::size_t>(a + b * k)] += p;
                e.magnitude[static_cast<std::size_t>(a + b * k)] += std::fabs(p);
            }
    });
    return e;
}

/// Inputs that defeat cancellation: Gaussian noise with one pixel of `spike` at a border
/// position, or (spike == 0) magnitudes spread log-uniformly over 10^±`decades` with random signs.
template <class T>
std::vector<T> adversarial_input(const conv_input& in, double spike, double decades, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal;
    std::uniform_real_distribution<double> exponent(-decades, decades);
    std::vector<T> x(static_cast<std::size_t>(in.n * in.c * in.h * in.w));
    for (auto& v : x)
        v = static_cast<T>(spike != 0.0 ? normal(rng) : (rng() % 2 ? 1.0 : -1.0) * std::pow(10.0, exponent(rng)));
    if (spike != 0.0) {
        // A corner, an edge midpoint, or the far corner, of a random image and channel.
        const idx_t n = static_cast<idx_t>(rng() % static_cast<std::uint32_t>(in.n));
        const idx_t c = static_cast<idx_t>(rng() % static_cast<std::uint32_t>(in.c));
        const idx_t where = static_cast<idx_t>(rng() % 4u);
        const idx_t r = where == 0 ? 0 : where == 1 ? in.h / 2 : where == 2 ? 0 : in.h - 1;
        const idx_t q = where == 0 ? 0 : where == 1 ? 0 : where == 2 ? in.w / 2 : in.w - 1;
        x[static_cast<std::size_t>(((n * in.c + c) * in.h + r) * in.w + q)] = static_cast<T>(spike);
    }
    return x;
}

/// The stride-1 geometries of the checks: ResNet's 3 × 3 "same" conv at 8 and 16 channels,
/// a 5 × 5, a dilated 3 × 3, a "valid" 3 × 3 (no padding), a 1 × 3 and a padding wider than
/// the taps reach.
std::vector<conv_input> adversarial_geometries() {
    using kfac::conv2d_geometry;
    const auto ref = kfac::conv_patch_mode::reference;
    return {
        {2, 8, 6, 6, conv2d_geometry{{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, ref},
        {2, 16, 7, 9, conv2d_geometry{{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, ref},
        {1, 8, 9, 8, conv2d_geometry{{5, 5}, {1, 1}, {2, 2}, {1, 1}, 1}, ref},
        {2, 8, 8, 7, conv2d_geometry{{3, 3}, {1, 1}, {2, 2}, {2, 2}, 1}, kfac::conv_patch_mode::dilated},
        {3, 8, 6, 5, conv2d_geometry{{3, 3}, {1, 1}, {0, 0}, {1, 1}, 1}, ref},
        {2, 8, 4, 6, conv2d_geometry{{1, 3}, {1, 1}, {0, 1}, {1, 1}, 1}, ref},
        {1, 8, 5, 5, conv2d_geometry{{3, 3}, {1, 1}, {3, 3}, {1, 1}, 1}, ref},
    };
}

/// Checks one input on the shifted path: every lower entry of Σ x̃ x̃ᵀ within 2·γ_n·Σ|x̃ᵢ x̃ⱼ| of
/// the definition, n the patches (each entry is a sum of at most n products, and any order of
/// summation of n rounded products errs by at most γ_n = n·u/(1 − n·u) times the sum of their
/// magnitudes; 2 for the rounding of the reference and margin), and every diagonal entry ≥ 0.
/// Returns the largest error relative to that bound.
template <class T>
double check_against_definition(const std::vector<T>& x, const conv_input& in) {
    const kfac::patch_grid grid = kfac::make_patch_grid(in.g, in.h, in.w, in.mode);
    const auto geometry = sg::make_shifted_gram_geometry(in.g, grid, in.c, in.h, in.w);
    const idx_t k = in.c * in.g.kernel[0] * in.g.kernel[1];
    std::vector<T> sum(static_cast<std::size_t>(k * k), T(0));
    sg::shifted_gram_scratch<T> scratch;
    sg::accumulate_shifted_patch_gram(sum.data(), k, x.data(), in.n, geometry, T(1), T(0), scratch);
    const exact_gram e = gram_in_long_double(x, in);
    const long double u = std::numeric_limits<T>::epsilon() / 2;
    const auto n = static_cast<long double>(e.patches);
    const long double gamma = n * u / (1.0L - n * u);
    double worst = 0.0;
    for (idx_t j = 0; j < k; ++j) {
        CHECK(sum[static_cast<std::size_t>(j + j * k)] >= T(0));
        for (idx_t i = j; i < k; ++i) {
            const auto at = static_cast<std::size_t>(i + j * k);
            const long double error = std::fabs(static_cast<long double>(sum[at]) - e.gram[at]);
            const long double bound = 2.0L * gamma * e.magnitude[at];
            if (error > bound) {
                INFO("entry (" << i << ", " << j << "): " << static_cast<double>(sum[at]) << ", definition "
                               << static_cast<double>(e.gram[at]) << ", bound " << static_cast<double>(bound));
                CHECK(error <= bound);
            }
            if (bound > 0.0L) worst = std::max(worst, static_cast<double>(error / bound));
        }
    }
    return worst;
}

template <class T>
void check_adversarial_inputs(const std::vector<double>& spikes, double decades) {
    std::uint32_t seed = 1;
    for (const conv_input& in : adversarial_geometries()) {
        for (const double spike : spikes) {
            for (int repeat = 0; repeat < 4; ++repeat, ++seed) {
                INFO("C " << in.c << " " << in.h << "x" << in.w << " kernel " << in.g.kernel[0] << "x" << in.g.kernel[1]
                          << " padding " << in.g.padding[0] << "," << in.g.padding[1] << " dilation "
                          << in.g.dilation[0] << " spike " << spike << " seed " << seed);
                check_against_definition(adversarial_input<T>(in, spike, 0.0, seed), in);
            }
        }
        INFO("C " << in.c << " " << in.h << "x" << in.w << ": magnitudes over 10^+-" << decades);
        check_against_definition(adversarial_input<T>(in, 0.0, decades, seed++), in);
    }
}

}  // namespace

TEST_CASE("shift-structured patch Gram stays accurate with a large pixel on the border, in float", "[shifted][adversarial]") {
    check_adversarial_inputs<float>({300.0, 1e4, -1e6}, 6.0);
}

TEST_CASE("shift-structured patch Gram stays accurate with a large pixel on the border, in double", "[shifted][adversarial]") {
    check_adversarial_inputs<double>({300.0, 1e8, -1e12}, 12.0);
}

TEST_CASE("shift-structured and im2col A statistics agree entry by entry on adversarial inputs", "[shifted][adversarial]") {
    // Both paths of the backend, with bias and the reference's scaling α = 1/(N·S³): each entry
    // of either is within γ_n·α·Σ|x̃ᵢ x̃ⱼ| of the definition (α a power of two times a rounding,
    // one more u), so they are within 2·(γ_n + u)·α·Σ|x̃ᵢ x̃ⱼ| of each other.
    using backend = kfac::backend::cpu_eigen<float>;
    for (const conv_input& in : adversarial_geometries()) {
        const kfac::patch_grid grid = kfac::make_patch_grid(in.g, in.h, in.w, in.mode);
        const auto d = kfac::conv2d_description(in.c, 4, in.g, false);
        const idx_t k = d.weight_columns();
        for (const double spike : {300.0, 0.0}) {
            const auto x = adversarial_input<float>(in, spike, 6.0, 77);
            const kfac::tensor_view<const float> view(x.data(), {in.n, in.c, in.h, in.w});
            backend::matrix shifted = backend::matrix::Zero(k, k), im2col = shifted;
            backend::workspace ws;
            backend::accumulate_patch_gram_shifted(shifted, d, view, grid, 0.0f, ws);
            backend::accumulate_patch_gram_im2col(im2col, d, view, grid, 0.0f, ws);
            const exact_gram e = gram_in_long_double(x, in);
            const long double u = std::numeric_limits<float>::epsilon() / 2;
            const auto n = static_cast<long double>(e.patches);
            const long double s = grid.rows * grid.cols;
            const long double alpha = 1.0L / (static_cast<long double>(in.n) * s * s * s);
            for (idx_t j = 0; j < k; ++j) {
                CHECK(shifted(j, j) >= 0.0f);
                for (idx_t i = j; i < k; ++i) {
                    const long double bound =
                        2.0L * (n * u / (1.0L - n * u) + u) * alpha * e.magnitude[static_cast<std::size_t>(i + j * k)];
                    const long double error = std::fabs(static_cast<long double>(shifted(i, j)) - im2col(i, j));
                    if (error > bound) {
                        INFO("C " << in.c << " kernel " << in.g.kernel[0] << "x" << in.g.kernel[1] << " spike " << spike
                                  << " entry (" << i << ", " << j << "): shifted " << shifted(i, j) << ", im2col "
                                  << im2col(i, j));
                        CHECK(error <= bound);
                    }
                }
            }
        }
    }
}
