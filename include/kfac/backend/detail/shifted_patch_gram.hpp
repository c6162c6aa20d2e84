// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file shifted_patch_gram.hpp
/// The patch second moment Σ x̃ x̃ᵀ of a stride-1 convolution without im2col, from its shift
/// structure.
///
/// For stride 1 the product of tap p = (u, v) and tap p' = (u', v') of one patch reads input
/// pixels a fixed offset Δ = ((u' − u)·d_h, (v' − v)·d_w) apart. Summed over the patches,
///   block(p, p')[c, c'] = Σ_n Σ_{(r, s) ∈ W_p} X[n, c, r, s] · X[n, c', r + Δ_r, s + Δ_s],
/// where W_p is the window of input pixels tap p visits. Windows of taps with the same Δ
/// differ only by border rows and columns, so one cross-product per offset,
///   full(Δ) = Σ over every pixel pair Δ apart inside the image,
/// serves every tap pair with that offset after subtracting the border rows and columns
/// outside its window (inclusion–exclusion, corners added back). A 3 × 3 kernel has 81 tap
/// pairs but 25 offsets, 13 up to symmetry (block(p', p) = block(p, p')ᵀ): for C channels the
/// work falls from (9C)²/2 to about 13·C² multiply-adds per pixel, plus thin border terms.
///
/// Layout: the input is copied once per group of images to [row][image][column][channel],
/// each image row followed by a gap of (k_w − 1)·d_w zero columns. Then
///   * a run of whole rows is one contiguous matrix (positions × channels), and the same run
///     shifted by Δ starts Δ_r·(row stride) + Δ_s positions later: full(Δ) and a border row
///     are one GEMM each, with no copy; a column shift that leaves the image lands in a gap.
///   * one column over a run of rows is a matrix with leading dimension (row stride) ×
///     channels: a border column is one GEMM too.
/// Exact (only the order of the additions differs from im2col), so the reference's numbers
/// are kept; `shifted_patch_gram_pays` decides from the multiply-add counts when it is worth it.

#include <algorithm>
#include <cstdint>
#include <vector>

#include <Eigen/Core>

#include "kfac/backend/detail/blas_lapack.hpp"
#include "kfac/config.hpp"
#include "kfac/layers/im2col.hpp"
#include "kfac/layers/layer_description.hpp"

namespace kfac::backend::detail {

/// Half-open interval of input rows or columns.
struct pixel_range {
    std::int64_t lo = 0, hi = 0;
    [[nodiscard]] bool empty() const noexcept { return hi <= lo; }
    [[nodiscard]] std::int64_t size() const noexcept { return empty() ? 0 : hi - lo; }
};

/// The geometry the shift-structured Gram works with: one conv input, one patch grid.
struct shifted_gram_geometry {
    std::int64_t channels = 0, height = 0, width = 0;
    std::int64_t kernel_h = 1, kernel_w = 1, dil_h = 1, dil_w = 1;
    std::int64_t pad_h = 0, pad_w = 0;
    std::int64_t grid_rows = 0, grid_cols = 0;

    [[nodiscard]] std::int64_t taps() const noexcept { return kernel_h * kernel_w; }
    /// Zero columns after each image row: the widest column shift between two taps.
    [[nodiscard]] std::int64_t gap() const noexcept { return (kernel_w - 1) * dil_w; }
    [[nodiscard]] std::int64_t padded_width() const noexcept { return width + gap(); }

    /// Input pixels along one axis where both taps of a pair Δ apart stay inside the image.
    [[nodiscard]] static pixel_range both_inside(std::int64_t extent, std::int64_t delta) noexcept {
        return {std::max<std::int64_t>(0, -delta), std::min(extent, extent - delta)};
    }
    /// Input pixels along one axis that tap `t` visits: [t·d − pad, t·d − pad + grid) ∩ image.
    [[nodiscard]] static pixel_range visited(std::int64_t t, std::int64_t dil, std::int64_t pad,
                                             std::int64_t grid, std::int64_t extent) noexcept {
        const std::int64_t first = t * dil - pad;
        return {std::max<std::int64_t>(0, first), std::min(extent, first + grid)};
    }
};

inline shifted_gram_geometry make_shifted_gram_geometry(const conv2d_geometry& g, const patch_grid& grid,
                                                        std::int64_t channels, std::int64_t height,
                                                        std::int64_t width) {
    return {channels,   height,     width,          g.kernel[0], g.kernel[1], grid.dil_h,
            grid.dil_w, g.padding[0], g.padding[1], grid.rows,   grid.cols};
}

/// Visits every tap pair (p, p') with p' − p in the half space of offsets (row offset > 0, or
/// 0 with column offset ≥ 0), grouped by offset: `offset(a, b)` once per offset in tap units,
/// then `pair(p, p', rows, cols, all_rows, all_cols)` for each of its pairs whose window is not
/// empty, with the pair's window (rows × cols) and the offset's (all_rows × all_cols).
template <class Offset, class Pair>
void for_each_offset_pair(const shifted_gram_geometry& g, Offset&& offset, Pair&& pair) {
    const std::int64_t kh = g.kernel_h, kw = g.kernel_w;
    for (std::int64_t a = 0; a < kh; ++a) {
        for (std::int64_t b = a == 0 ? 0 : -(kw - 1); b < kw; ++b) {
            const pixel_range all_rows = shifted_gram_geometry::both_inside(g.height, a * g.dil_h);
            const pixel_range all_cols = shifted_gram_geometry::both_inside(g.width, b * g.dil_w);
            if (all_rows.empty() || all_cols.empty()) continue;
            bool announced = false;
            for (std::int64_t u = 0; u + a < kh; ++u) {
                for (std::int64_t v = std::max<std::int64_t>(0, -b); v < kw && v + b < kw; ++v) {
                    const pixel_range r = shifted_gram_geometry::visited(u, g.dil_h, g.pad_h, g.grid_rows, g.height);
                    const pixel_range c = shifted_gram_geometry::visited(v, g.dil_w, g.pad_w, g.grid_cols, g.width);
                    const pixel_range rows{std::max(r.lo, all_rows.lo), std::min(r.hi, all_rows.hi)};
                    const pixel_range cols{std::max(c.lo, all_cols.lo), std::min(c.hi, all_cols.hi)};
                    if (rows.empty() || cols.empty()) continue;
                    if (!announced) offset(a, b, all_rows, all_cols);
                    announced = true;
                    pair(u * kw + v, (u + a) * kw + v + b, rows, cols, all_rows, all_cols);
                }
            }
        }
    }
}

/// Multiply-adds per image of the shift-structured Gram, per channel pair (× C² for the
/// total): the full cross-product of each offset, then each pair's border rows, columns and
/// corners.
inline double shifted_gram_work_per_image(const shifted_gram_geometry& g) {
    const auto wb = static_cast<double>(g.padded_width());
    double work = 0.0;
    for_each_offset_pair(
        g, [&](std::int64_t, std::int64_t, pixel_range all_rows, pixel_range) {
            work += static_cast<double>(all_rows.size()) * wb;
        },
        [&](std::int64_t, std::int64_t, pixel_range rows, pixel_range cols, pixel_range all_rows,
            pixel_range all_cols) {
            const auto excluded_rows = static_cast<double>(all_rows.size() - rows.size());
            const auto excluded_cols = static_cast<double>(all_cols.size() - cols.size());
            work += excluded_rows * wb + excluded_cols * static_cast<double>(all_rows.size()) +
                    excluded_rows * excluded_cols;
        });
    return work;
}

/// Whether the shift structure beats im2col + SYRK for this conv input: stride 1, a kernel of
/// more than one tap, enough channels for the C × C products to run at GEMM speed (below 8
/// they are mostly call overhead) and at most 0.7 of im2col's multiply-adds (the margin pays
/// for the copy to the channel-last layout and the shorter GEMMs). Decided from the shapes
/// alone, so a layer always takes the same path.
inline bool shifted_patch_gram_pays(const conv2d_geometry& conv, const patch_grid& grid, std::int64_t channels,
                                    std::int64_t height, std::int64_t width) {
    if (conv.stride[0] != 1 || conv.stride[1] != 1) return false;
    if (conv.kernel[0] * conv.kernel[1] < 2 || channels < 8) return false;
    if (grid.rows <= 0 || grid.cols <= 0) return false;
    const shifted_gram_geometry g = make_shifted_gram_geometry(conv, grid, channels, height, width);
    const double shifted = shifted_gram_work_per_image(g) * static_cast<double>(channels * channels);
    const auto k = static_cast<double>(channels * g.taps());
    const double im2col = k * (k + 1.0) / 2.0 * static_cast<double>(grid.positions());
    return shifted <= 0.7 * im2col;
}

/// C(m × m, leading dimension ldc) += alpha · X Yᵀ, X and Y m × k with leading dimension ld,
/// with Eigen alone (the path of builds without BLAS).
template <class Scalar>
void add_cross_product_portable(Scalar* C, std::int64_t ldc, const Scalar* X, const Scalar* Y, std::int64_t m,
                                std::int64_t k, std::int64_t ld, Scalar alpha) {
    using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
    Eigen::Map<const matrix, 0, Eigen::OuterStride<>> x(X, m, k, Eigen::OuterStride<>(ld));
    Eigen::Map<const matrix, 0, Eigen::OuterStride<>> y(Y, m, k, Eigen::OuterStride<>(ld));
    Eigen::Map<matrix, 0, Eigen::OuterStride<>> c(C, m, m, Eigen::OuterStride<>(ldc));
    c.noalias() += alpha * x * y.transpose();
}

/// C(m × m, leading dimension ldc) += alpha · X Yᵀ: one GEMM where BLAS is available.
template <class Scalar>
void add_cross_product(Scalar* C, std::int64_t ldc, const Scalar* X, const Scalar* Y, std::int64_t m,
                       std::int64_t k, std::int64_t ld, Scalar alpha) {
    if (k <= 0) return;
#if KFAC_HAS_LAPACK
    gemm(CblasNoTrans, CblasTrans, static_cast<blas_int>(m), static_cast<blas_int>(m), static_cast<blas_int>(k),
         alpha, X, static_cast<blas_int>(ld), Y, static_cast<blas_int>(ld), Scalar(1), C,
         static_cast<blas_int>(ldc));
#else
    add_cross_product_portable(C, ldc, X, Y, m, k, ld, alpha);
#endif
}

/// Scratch of the shift-structured Gram, kept by the caller between batches.
template <class Scalar>
struct shifted_gram_scratch {
    std::vector<Scalar> images;  ///< one group of images, channel-last with row gaps
    std::vector<Scalar> gram;    ///< tap-major (p·C + c) accumulator, upper block triangle (kept while small)
    std::vector<Scalar> full;    ///< full(Δ) of the current offset, C × C
};

/// Largest tap-major accumulator (scalars) kept in the scratch between batches: 4 MiB in float.
/// Above it the accumulator, as large as the statistic itself (85 MB in float for a 3 × 3 conv
/// of 512 channels), is freed after each call instead of staying with every such layer.
inline constexpr std::size_t shifted_gram_kept_scalars = std::size_t{1} << 20;

/// Images per group: the group's channel-last copy stays near 256 KiB, so that the GEMMs of
/// all offsets read it from L2.
inline std::int64_t shifted_gram_images_per_group(const shifted_gram_geometry& g, std::int64_t images,
                                                  std::size_t scalar_bytes) {
    const auto image_bytes = static_cast<double>(g.height * g.padded_width() * g.channels) *
                             static_cast<double>(scalar_bytes);
    const auto fit = static_cast<std::int64_t>((256.0 * 1024.0) / std::max(1.0, image_bytes));
    return std::clamp<std::int64_t>(fit, 1, std::max<std::int64_t>(1, images));
}

/// sum(i, j), i ≥ j, = beta·sum(i, j) + alpha · Σ_patches x̃_i x̃_j over the patches of
/// `images` images of `input` ([N, C, H, W], contiguous), patch index (c·k_h + u)·k_w + v as
/// im2col writes it (kfac/layers/im2col.hpp). Only the lower triangle of the leading
/// C·k_h·k_w block is written. Requires stride 1.
template <class Scalar>
void accumulate_shifted_patch_gram(Scalar* sum, std::int64_t ld_sum, const Scalar* input, std::int64_t images,
                                   const shifted_gram_geometry& g, Scalar alpha, Scalar beta,
                                   shifted_gram_scratch<Scalar>& scratch) {
    const std::int64_t C = g.channels, T = g.taps(), K = C * T;
    const std::int64_t H = g.height, W = g.width, wb = g.padded_width(), guard = g.gap();
    const std::int64_t group = shifted_gram_images_per_group(g, images, sizeof(Scalar));
    const std::int64_t row_stride = group * wb;  // positions from one row of the group to the next
    scratch.gram.assign(static_cast<std::size_t>(K * K), Scalar(0));
    scratch.full.resize(static_cast<std::size_t>(C * C));
    // A guard of `gap` zero positions before row 0 and after the last row: a column shift
    // read from the first or last position of the buffer lands there.
    scratch.images.resize(static_cast<std::size_t>((guard + H * row_stride + guard) * C));
    Scalar* const gram = scratch.gram.data();
    Scalar* const full = scratch.full.data();

    for (std::int64_t first = 0; first < images; first += group) {
        const std::int64_t count = std::min(group, images - first);
        // Channel-last copy; the gaps, the guards and the unused image slots of a
        // short last group are zeros.
        std::fill(scratch.images.begin(), scratch.images.end(), Scalar(0));
        Scalar* const base = scratch.images.data() + guard * C;  // position 0: row 0, image 0, column 0
        for (std::int64_t i = 0; i < count; ++i) {
            for (std::int64_t c = 0; c < C; ++c) {
                const Scalar* src = input + ((first + i) * C + c) * H * W;
                for (std::int64_t r = 0; r < H; ++r) {
                    Scalar* dst = base + ((r * group + i) * wb) * C + c;
                    for (std::int64_t s = 0; s < W; ++s) dst[s * C] = src[r * W + s];
                }
            }
        }
        auto at = [&](std::int64_t row, std::int64_t col) { return base + (row * row_stride + col) * C; };
        std::int64_t shift = 0;  // positions between a pixel and its partner Δ away
        // full(Δ): whole rows, one contiguous run; a border row: one row's run; a border
        // column: strided by a row of one image (wb positions) over the rows.
        for_each_offset_pair(
            g,
            [&](std::int64_t a, std::int64_t b, pixel_range all_rows, pixel_range) {
                shift = a * g.dil_h * row_stride + b * g.dil_w;
                std::fill(scratch.full.begin(), scratch.full.end(), Scalar(0));
                const Scalar* x = at(all_rows.lo, 0);
                add_cross_product(full, C, x, x + shift * C, C, all_rows.size() * row_stride, C, Scalar(1));
            },
            [&](std::int64_t p, std::int64_t q, pixel_range rows, pixel_range cols, pixel_range all_rows,
                pixel_range all_cols) {
                Scalar* block = gram + (p * C) + (q * C) * K;
                for (std::int64_t j = 0; j < C; ++j)
                    for (std::int64_t i = 0; i < C; ++i) block[i + j * K] += full[i + j * C];
                auto subtract_row = [&](std::int64_t r) {
                    const Scalar* x = at(r, 0);
                    add_cross_product(block, K, x, x + shift * C, C, row_stride, C, Scalar(-1));
                };
                auto subtract_col = [&](std::int64_t s) {
                    const Scalar* x = at(all_rows.lo, s);
                    add_cross_product(block, K, x, x + shift * C, C, all_rows.size() * group, wb * C, Scalar(-1));
                };
                auto add_corners = [&](std::int64_t r) {
                    auto corner = [&](std::int64_t s) {
                        const Scalar* x = at(r, s);
                        add_cross_product(block, K, x, x + shift * C, C, group, wb * C, Scalar(1));
                    };
                    for (std::int64_t s = all_cols.lo; s < cols.lo; ++s) corner(s);
                    for (std::int64_t s = cols.hi; s < all_cols.hi; ++s) corner(s);
                };
                for (std::int64_t r = all_rows.lo; r < rows.lo; ++r) subtract_row(r), add_corners(r);
                for (std::int64_t r = rows.hi; r < all_rows.hi; ++r) subtract_row(r), add_corners(r);
                for (std::int64_t s = all_cols.lo; s < cols.lo; ++s) subtract_col(s);
                for (std::int64_t s = cols.hi; s < all_cols.hi; ++s) subtract_col(s);
            });
    }

    // Tap-major blocks (p ≤ q) into the lower triangle of the channel-major result. Within a
    // diagonal block (p = q) each unordered channel pair is written once.
    for (std::int64_t q = 0; q < T; ++q) {
        for (std::int64_t p = 0; p <= q; ++p) {
            for (std::int64_t cq = 0; cq < C; ++cq) {
                for (std::int64_t cp = p == q ? cq : 0; cp < C; ++cp) {
                    const std::int64_t i = cp * T + p, j = cq * T + q;
                    Scalar& out = i >= j ? sum[i + j * ld_sum] : sum[j + i * ld_sum];
                    const Scalar value = alpha * gram[(p * C + cp) + (q * C + cq) * K];
                    out = beta == Scalar(0) ? value : beta * out + value;  // β = 0 reads nothing
                }
            }
        }
    }
    if (scratch.gram.size() > shifted_gram_kept_scalars) std::vector<Scalar>().swap(scratch.gram);
}

/// Σ over the patches of each patch element (c, u, v), added to sums[(c·k_h + u)·k_w + v]:
/// the bias row of the A statistic. Each tap's sum is the sum of its visited window.
template <class Scalar, class Sums>
void add_patch_element_sums(Sums& sums, const Scalar* input, std::int64_t images, const shifted_gram_geometry& g) {
    const std::int64_t C = g.channels, H = g.height, W = g.width;
    std::vector<Scalar> plane(static_cast<std::size_t>(H * W));
    for (std::int64_t c = 0; c < C; ++c) {
        std::fill(plane.begin(), plane.end(), Scalar(0));
        for (std::int64_t n = 0; n < images; ++n) {
            const Scalar* src = input + (n * C + c) * H * W;
            for (std::int64_t i = 0; i < H * W; ++i) plane[static_cast<std::size_t>(i)] += src[i];
        }
        for (std::int64_t u = 0; u < g.kernel_h; ++u) {
            const pixel_range rows = shifted_gram_geometry::visited(u, g.dil_h, g.pad_h, g.grid_rows, H);
            for (std::int64_t v = 0; v < g.kernel_w; ++v) {
                const pixel_range cols = shifted_gram_geometry::visited(v, g.dil_w, g.pad_w, g.grid_cols, W);
                Scalar total(0);
                for (std::int64_t r = rows.lo; r < rows.hi; ++r)
                    for (std::int64_t s = cols.lo; s < cols.hi; ++s) total += plane[static_cast<std::size_t>(r * W + s)];
                sums((c * g.kernel_h + u) * g.kernel_w + v) += total;
            }
        }
    }
}

}  // namespace kfac::backend::detail
