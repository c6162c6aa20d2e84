// SPDX-License-Identifier: Apache-2.0
// Patch extraction against a naive convolution: multiplying the extracted patches by the
// reshaped kernel must reproduce the convolution exactly (up to summation order).
#include <catch2/catch.hpp>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {

struct conv_case {
    std::int64_t n, c, h, w, c_out;
    kfac::conv2d_geometry g;
};

/// Output of the convolution computed as weight[C_out, C·kh·kw] × patches[C·kh·kw, positions].
std::vector<double> conv_via_patches(const std::vector<double>& x, const conv_case& cc,
                                     const std::vector<double>& weight, kfac::conv_patch_mode mode,
                                     kfac::patch_grid& grid) {
    grid = kfac::make_patch_grid(cc.g, cc.h, cc.w, mode);
    const std::int64_t k = cc.c * cc.g.kernel[0] * cc.g.kernel[1];
    const std::int64_t rows = cc.n * grid.rows;
    const std::int64_t cols = rows * grid.cols;
    std::vector<double> patches(static_cast<std::size_t>(k * cols), -1.0);
    // Extract in two uneven chunks to exercise first_row/row_count.
    const std::int64_t first = rows / 3;
    kfac::extract_patches_transposed(x.data(), cc.c, cc.h, cc.w, cc.g, grid, 0, first, patches.data(), cols);
    kfac::extract_patches_transposed(x.data(), cc.c, cc.h, cc.w, cc.g, grid, first, rows - first,
                                     patches.data() + first * grid.cols, cols);
    Eigen::Map<const row_mat<double>> p(patches.data(), k, cols);
    Eigen::Map<const row_mat<double>> wm(weight.data(), cc.c_out, k);
    const row_mat<double> y = wm * p;  // [C_out, N·Ĥ·Ŵ], columns ordered (n, i, j)
    std::vector<double> out(static_cast<std::size_t>(cc.n * cc.c_out * grid.positions()));
    for (std::int64_t s = 0; s < cc.n; ++s)
        for (std::int64_t o = 0; o < cc.c_out; ++o)
            for (std::int64_t q = 0; q < grid.positions(); ++q)
                out[static_cast<std::size_t>((s * cc.c_out + o) * grid.positions() + q)] = y(o, s * grid.positions() + q);
    return out;
}

}  // namespace

TEST_CASE("im2col times the kernel equals a naive convolution", "[im2col]") {
    const std::vector<conv_case> cases = {
        {2, 3, 7, 7, 4, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}},
        {2, 4, 7, 7, 2, {{3, 3}, {2, 2}, {0, 0}, {1, 1}, 1}},
        {1, 2, 9, 6, 3, {{2, 3}, {1, 2}, {1, 0}, {1, 1}, 1}},   // non-square kernel, mixed stride
        {3, 2, 8, 11, 2, {{3, 1}, {3, 2}, {2, 1}, {1, 1}, 1}},  // padding larger than needed
        {2, 2, 10, 9, 3, {{3, 2}, {1, 2}, {2, 1}, {2, 3}, 1}},  // dilation (dilated mode)
        {1, 1, 5, 5, 1, {{5, 5}, {1, 1}, {0, 0}, {1, 1}, 1}},   // kernel as large as the image
    };
    for (std::size_t idx = 0; idx < cases.size(); ++idx) {
        const auto& cc = cases[idx];
        INFO("case " << idx);
        const auto x = random_vector<double>(static_cast<std::size_t>(cc.n * cc.c * cc.h * cc.w), 10 + static_cast<std::uint32_t>(idx));
        const auto weight = random_vector<double>(static_cast<std::size_t>(cc.c_out * cc.c * cc.g.kernel[0] * cc.g.kernel[1]), 99);
        std::int64_t ho = 0, wo = 0;
        const auto expected = naive_conv2d(x, cc.n, cc.c, cc.h, cc.w, weight, cc.c_out, cc.g, ho, wo);
        kfac::patch_grid grid;
        const auto got = conv_via_patches(x, cc, weight, kfac::conv_patch_mode::dilated, grid);
        REQUIRE(grid.rows == ho);
        REQUIRE(grid.cols == wo);
        Eigen::Map<const Eigen::VectorXd> e(expected.data(), static_cast<Eigen::Index>(expected.size()));
        Eigen::Map<const Eigen::VectorXd> g(got.data(), static_cast<Eigen::Index>(got.size()));
        // Both sum C·kh·kw products of O(1) terms in different orders.
        CHECK(rel_err(g, e) < 100 * eps<double>());
    }
}

TEST_CASE("reference mode ignores dilation as kfac-pytorch does", "[im2col]") {
    // A dilated layer's patches in reference mode are the patches of the same layer with
    // dilation 1: contiguous windows, on a grid that differs from the true output.
    conv_case dilated{2, 2, 10, 9, 3, {{3, 2}, {1, 2}, {2, 1}, {2, 3}, 1}};
    conv_case contiguous = dilated;
    contiguous.g.dilation = {1, 1};
    const auto x = random_vector<double>(static_cast<std::size_t>(2 * 2 * 10 * 9), 5);
    const auto weight = random_vector<double>(static_cast<std::size_t>(3 * 2 * 3 * 2), 6);
    kfac::patch_grid grid_ref, grid_contig;
    const auto ref = conv_via_patches(x, dilated, weight, kfac::conv_patch_mode::reference, grid_ref);
    const auto contig = conv_via_patches(x, contiguous, weight, kfac::conv_patch_mode::dilated, grid_contig);
    CHECK(grid_ref.rows == grid_contig.rows);
    CHECK(grid_ref.cols == grid_contig.cols);
    CHECK(grid_ref.rows != kfac::conv_output_extent(10, 3, 1, 2, 2));
    CHECK(ref == contig);
}
