// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file shifted_patch_gram.hpp
/// The patch second moment Σ x̃ x̃ᵀ of a stride-1 convolution without im2col, from its shift
/// structure.
///
/// For stride 1 the product of tap p = (u, v) and tap p' = (u', v') of one patch reads input
/// pixels a fixed offset Δ = ((u' − u)·d_h, (v' − v)·d_w) apart. Summed over the patches,
///   block(p, p')[c, c'] = Σ_n Σ_{(r, s) ∈ W_p} X[n, c, r, s] · X[n, c', r + Δ_r, s + Δ_s],
/// where W_p is the window of input pixels tap p visits. The windows of the tap pairs with one
/// offset differ only by a few border rows and columns, so the work is shared: the image is cut
/// into cells along every window's bounds (border rows and columns, and the wide middle), the
/// cells inside every pair's window of an offset are summed once into full(Δ), and each pair
/// adds full(Δ) and the cross-products of its own remaining border cells. A 3 × 3 kernel has
/// 81 tap pairs but 25 offsets, 13 up to symmetry (block(p', p) = block(p, p')ᵀ): for C
/// channels the work falls from (9C)²/2 to about 13·C² multiply-adds per pixel, plus thin
/// border terms.
///
/// Nothing is ever subtracted: every entry is a sum of exactly the products the definition
/// has, so it is as accurate as im2col's (within γ_n·Σ|x̃ᵢ x̃ⱼ| for n patches, whatever the
/// input), and a diagonal entry is a sum of squares, never negative. (An inclusion–exclusion
/// over whole-image products, which this replaced, cancels catastrophically when a large pixel
/// sits on the border: its square is added, then subtracted again.)
///
/// Layout: the input is copied once per group of images to [row][image][column][channel],
/// each image row followed by a gap of (k_w − 1)·d_w zero columns. Then
///   * a run of whole rows is one contiguous matrix (positions × channels), and the same run
///     shifted by Δ starts Δ_r·(row stride) + Δ_s positions later; a column shift that leaves
///     the image lands in a gap. The middle columns of a run of rows are one GEMM over a
///     second copy whose border columns are zero (only the left operand is masked: a zero
///     times its partner adds nothing).
///   * one column over a run of rows is a matrix with leading dimension (row stride) ×
///     channels: a border column's cell is one GEMM too.
/// Exact up to the order of the additions, so the reference's numbers are kept;
/// `shifted_patch_gram_pays` decides from the multiply-add counts when it is worth it.

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

/// The columns cut at every bound of every tap pair's window: each part lies wholly inside or
/// wholly outside any window. The widest part is the `middle` (one GEMM over the masked copy
/// per run of rows), every other column is a part of its own (one strided GEMM per run).
/// Rows need no parts: a run of whole rows is contiguous in any case.
struct window_parts {
    std::vector<pixel_range> cols;
    std::int64_t middle = -1;  ///< index in cols of the wide middle part; −1: none
    [[nodiscard]] bool is_middle(std::size_t j) const noexcept { return static_cast<std::int64_t>(j) == middle; }
};

/// A tap pair (p, p') of one offset and where it reads: the rows of tap p's window whose
/// partner row is inside the image, and the columns tap p visits. (Columns whose partner
/// column leaves the image may stay: the partner lands in a zero gap, and adds nothing. So
/// the columns are cut only where taps' windows end, not at every offset's image bound.)
struct tap_pair {
    std::int64_t p = 0, q = 0;
    pixel_range rows, cols;
};

/// Visits every tap pair (p, p') with p' − p in the half space of offsets (row offset > 0, or
/// 0 with column offset ≥ 0) whose window has a pixel pair inside the image, grouped by
/// offset: `offset(a, b, pairs)` once per offset (in tap units) with the offset's pairs.
template <class Offset>
void for_each_offset(const shifted_gram_geometry& g, Offset&& offset) {
    const std::int64_t kh = g.kernel_h, kw = g.kernel_w;
    std::vector<tap_pair> pairs;
    for (std::int64_t a = 0; a < kh; ++a) {
        for (std::int64_t b = a == 0 ? 0 : -(kw - 1); b < kw; ++b) {
            const pixel_range all_rows = shifted_gram_geometry::both_inside(g.height, a * g.dil_h);
            const pixel_range all_cols = shifted_gram_geometry::both_inside(g.width, b * g.dil_w);
            if (all_rows.empty() || all_cols.empty()) continue;
            pairs.clear();
            for (std::int64_t u = 0; u + a < kh; ++u) {
                for (std::int64_t v = std::max<std::int64_t>(0, -b); v < kw && v + b < kw; ++v) {
                    const pixel_range r = shifted_gram_geometry::visited(u, g.dil_h, g.pad_h, g.grid_rows, g.height);
                    const pixel_range c = shifted_gram_geometry::visited(v, g.dil_w, g.pad_w, g.grid_cols, g.width);
                    const pixel_range rows{std::max(r.lo, all_rows.lo), std::min(r.hi, all_rows.hi)};
                    const pixel_range inside_cols{std::max(c.lo, all_cols.lo), std::min(c.hi, all_cols.hi)};
                    if (rows.empty() || inside_cols.empty()) continue;
                    pairs.push_back({u * kw + v, (u + a) * kw + v + b, rows, c});
                }
            }
            if (!pairs.empty()) offset(a, b, pairs);
        }
    }
}

/// The consecutive intervals between the sorted distinct `bounds`.
inline std::vector<pixel_range> intervals_between(std::vector<std::int64_t> bounds) {
    std::sort(bounds.begin(), bounds.end());
    bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
    std::vector<pixel_range> parts;
    for (std::size_t i = 0; i + 1 < bounds.size(); ++i) parts.push_back({bounds[i], bounds[i + 1]});
    return parts;
}

inline window_parts make_window_parts(const shifted_gram_geometry& g) {
    std::vector<std::int64_t> col_bounds{0, g.width};
    for_each_offset(g, [&](std::int64_t, std::int64_t, const std::vector<tap_pair>& pairs) {
        for (const tap_pair& t : pairs) col_bounds.insert(col_bounds.end(), {t.cols.lo, t.cols.hi});
    });
    window_parts parts;
    const std::vector<pixel_range> col_intervals = intervals_between(std::move(col_bounds));
    std::size_t widest = 0;
    for (std::size_t j = 1; j < col_intervals.size(); ++j)
        if (col_intervals[j].size() > col_intervals[widest].size()) widest = j;
    for (std::size_t j = 0; j < col_intervals.size(); ++j) {
        const pixel_range c = col_intervals[j];
        if (j == widest && c.size() > 1) {
            parts.middle = static_cast<std::int64_t>(parts.cols.size());
            parts.cols.push_back(c);
        } else {
            for (std::int64_t s = c.lo; s < c.hi; ++s) parts.cols.push_back({s, s + 1});
        }
    }
    return parts;
}

/// The cells of each offset, in the order they are summed: `offset(a, b)` starts an offset
/// (full(Δ) ← 0); `cell(false, rows, j)` adds the cell of column part j over `rows` inside
/// every pair's window (the common part) to full(Δ); then for each pair, `pair(p, q)`
/// (block(p, q) += full(Δ)) and `cell(true, rows, j)` for its cells outside the common part:
/// a column part inside the common columns over the window's rows above and below the common
/// rows, any other column part of the window over all its rows. Every pixel pair of a window
/// is in exactly one of its cells and the common part.
template <class Offset, class Pair, class Cell>
void for_each_offset_cell(const shifted_gram_geometry& g, const window_parts& parts, Offset&& offset, Pair&& pair,
                          Cell&& cell) {
    auto within = [](pixel_range part, pixel_range window) { return part.lo >= window.lo && part.hi <= window.hi; };
    for_each_offset(g, [&](std::int64_t a, std::int64_t b, const std::vector<tap_pair>& pairs) {
        pixel_range common_rows = pairs.front().rows, common_cols = pairs.front().cols;
        for (const tap_pair& t : pairs) {
            common_rows = {std::max(common_rows.lo, t.rows.lo), std::min(common_rows.hi, t.rows.hi)};
            common_cols = {std::max(common_cols.lo, t.cols.lo), std::min(common_cols.hi, t.cols.hi)};
        }
        const bool has_common = !common_rows.empty() && !common_cols.empty();
        offset(a, b);
        if (has_common)
            for (std::size_t j = 0; j < parts.cols.size(); ++j)
                if (within(parts.cols[j], common_cols)) cell(false, common_rows, j);
        for (const tap_pair& t : pairs) {
            pair(t.p, t.q);
            for (std::size_t j = 0; j < parts.cols.size(); ++j) {
                if (!within(parts.cols[j], t.cols)) continue;
                if (has_common && within(parts.cols[j], common_cols)) {
                    if (t.rows.lo < common_rows.lo) cell(true, pixel_range{t.rows.lo, common_rows.lo}, j);
                    if (common_rows.hi < t.rows.hi) cell(true, pixel_range{common_rows.hi, t.rows.hi}, j);
                } else {
                    cell(true, t.rows, j);
                }
            }
        }
    });
}

/// Multiply-adds per image of the shift-structured Gram, per channel pair (× C² for the
/// total): the inner dimension of every cell's cross-product (a middle cell runs over whole
/// rows with their gaps, a column cell over its rows).
inline double shifted_gram_work_per_image(const shifted_gram_geometry& g) {
    const window_parts parts = make_window_parts(g);
    const auto wb = static_cast<double>(g.padded_width());
    double work = 0.0;
    for_each_offset_cell(
        g, parts, [](std::int64_t, std::int64_t) {}, [](std::int64_t, std::int64_t) {},
        [&](bool, pixel_range rows, std::size_t j) {
            work += static_cast<double>(rows.size()) * (parts.is_middle(j) ? wb : 1.0);
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
    std::vector<Scalar> middle;  ///< the same with every column outside the middle part zero
    std::vector<Scalar> gram;    ///< tap-major (p·C + c) accumulator, upper block triangle (kept while small)
    std::vector<Scalar> full;    ///< full(Δ) of the current offset, C × C
};

/// Largest tap-major accumulator (scalars) kept in the scratch between batches: 4 MiB in float.
/// Above it the accumulator, as large as the statistic itself (85 MB in float for a 3 × 3 conv
/// of 512 channels), is freed after each call instead of staying with every such layer.
inline constexpr std::size_t shifted_gram_kept_scalars = std::size_t{1} << 20;

/// Images per group: the group's channel-last copies stay near 256 KiB, so that the GEMMs of
/// all offsets read them from L2.
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
    const window_parts parts = make_window_parts(g);
    // The middle part spans the whole row when no window cuts a column: no mask to apply.
    const pixel_range middle = parts.middle >= 0 ? parts.cols[static_cast<std::size_t>(parts.middle)] : pixel_range{};
    const bool masked = parts.middle >= 0 && middle.size() < W;
    scratch.gram.assign(static_cast<std::size_t>(K * K), Scalar(0));
    scratch.full.resize(static_cast<std::size_t>(C * C));
    // A guard of `gap` zero positions before row 0 and after the last row: a column shift
    // read from the first or last position of the buffer lands there. The guards, the gaps
    // and the masked columns are zeroed here once and never written after.
    const auto buffer = static_cast<std::size_t>((guard + H * row_stride + guard) * C);
    scratch.images.assign(buffer, Scalar(0));
    scratch.middle.assign(masked ? buffer : 0, Scalar(0));
    Scalar* const gram = scratch.gram.data();
    Scalar* const full = scratch.full.data();
    Scalar* const base = scratch.images.data() + guard * C;  // position 0: row 0, image 0, column 0
    Scalar* const middle_base = masked ? scratch.middle.data() + guard * C : base;

    for (std::int64_t first = 0; first < images; first += group) {
        const std::int64_t count = std::min(group, images - first);
        // Channel-last copies of the group's images; a short last group zeroes the slots it
        // leaves unused (they hold the previous group's images).
        for (std::int64_t i = 0; i < group; ++i) {
            for (std::int64_t r = 0; r < H; ++r) {
                const std::int64_t row = ((r * group + i) * wb) * C;
                if (i >= count) {
                    std::fill(base + row, base + row + W * C, Scalar(0));
                    if (masked) std::fill(middle_base + row + middle.lo * C, middle_base + row + middle.hi * C, Scalar(0));
                    continue;
                }
                for (std::int64_t c = 0; c < C; ++c) {
                    const Scalar* src = input + (((first + i) * C + c) * H + r) * W;
                    for (std::int64_t s = 0; s < W; ++s) base[row + s * C + c] = src[s];
                }
                if (masked) std::copy(base + row + middle.lo * C, base + row + middle.hi * C, middle_base + row + middle.lo * C);
            }
        }
        auto at = [&](std::int64_t row, std::int64_t col) { return (row * row_stride + col) * C; };
        std::int64_t shift = 0;  // positions between a pixel and its partner Δ away
        Scalar* block = nullptr;
        // A middle cell: whole rows of the masked copy against the image; a column cell: one
        // column strided by a row of one image (wb positions) over its rows.
        auto add_cell = [&](Scalar* into, std::int64_t ld, pixel_range rows, std::size_t j) {
            if (parts.is_middle(j)) {
                const std::int64_t offset = at(rows.lo, 0);
                add_cross_product(into, ld, middle_base + offset, base + offset + shift * C, C, rows.size() * row_stride,
                                  C, Scalar(1));
            } else {
                const Scalar* x = base + at(rows.lo, parts.cols[j].lo);
                add_cross_product(into, ld, x, x + shift * C, C, rows.size() * group, wb * C, Scalar(1));
            }
        };
        for_each_offset_cell(
            g, parts,
            [&](std::int64_t a, std::int64_t b) {
                shift = a * g.dil_h * row_stride + b * g.dil_w;
                std::fill(scratch.full.begin(), scratch.full.end(), Scalar(0));
            },
            [&](std::int64_t p, std::int64_t q) {
                block = gram + (p * C) + (q * C) * K;
                for (std::int64_t j = 0; j < C; ++j)
                    for (std::int64_t i = 0; i < C; ++i) block[i + j * K] += full[i + j * C];
            },
            [&](bool into_pair, pixel_range rows, std::size_t j) {
                if (into_pair)
                    add_cell(block, K, rows, j);
                else
                    add_cell(full, C, rows, j);
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
    if (scratch.gram.size() > shifted_gram_kept_scalars) {
        std::vector<Scalar>().swap(scratch.gram);
        std::vector<Scalar>().swap(scratch.middle);
    }
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
