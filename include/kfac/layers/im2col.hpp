// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file im2col.hpp
/// Patch extraction of a Conv2d input for the A factor, in the column order of
/// `weight.reshape(C_out, C_in·k_h·k_w)`: index (c·k_h + u)·k_w + v.
///
/// Patches are written *transposed*: one buffer row per patch element (c, u, v), one buffer
/// column per patch. For a fixed (c, u, v) consecutive columns read one input row at a
/// stride, which is a streaming copy; the A statistic is then B·Bᵀ of that buffer.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kfac/layers/layer_description.hpp"
#include "kfac/options.hpp"

namespace kfac {

/// The patch grid of a conv input: extents of the grid and the dilation the patches use.
struct patch_grid {
    std::int64_t rows = 0;      ///< Ĥ
    std::int64_t cols = 0;      ///< Ŵ
    std::int64_t dil_h = 1;     ///< dilation used between kernel taps (1 in reference mode)
    std::int64_t dil_w = 1;     ///< the same across the width
    [[nodiscard]] std::int64_t positions() const noexcept { return rows * cols; }  ///< Ĥ·Ŵ
};

/// Grid of patches over an H × W input. In reference mode dilation is ignored, as
/// kfac-pytorch ignores it (golden/README.md §4.2), so the grid can differ from the output.
[[nodiscard]] inline patch_grid make_patch_grid(const conv2d_geometry& g, std::int64_t height,
                                                std::int64_t width, conv_patch_mode mode) {
    patch_grid p;
    p.dil_h = mode == conv_patch_mode::dilated ? g.dilation[0] : 1;
    p.dil_w = mode == conv_patch_mode::dilated ? g.dilation[1] : 1;
    p.rows = conv_output_extent(height, g.kernel[0], g.stride[0], g.padding[0], p.dil_h);
    p.cols = conv_output_extent(width, g.kernel[1], g.stride[1], g.padding[1], p.dil_w);
    return p;
}

/// Writes the patches of output rows [first_row, first_row + row_count) of the flattened
/// (sample, grid row) index space into `out`, a C_in·k_h·k_w × (row_count·Ŵ) row-major buffer
/// with leading dimension `ld` (≥ row_count·Ŵ). Out-of-image taps are zeros (zero padding).
/// @param input one contiguous [N, C_in, H, W] array.
/// @param channels,height,width the input's extents C_in, H, W.
/// @param g,grid the convolution's geometry and its patch grid (make_patch_grid()).
/// @param first_row,row_count the output rows written.
/// @param out,ld the buffer written and its leading dimension.
template <class T>
void extract_patches_transposed(const T* input, std::int64_t channels, std::int64_t height,
                                std::int64_t width, const conv2d_geometry& g,
                                const patch_grid& grid, std::int64_t first_row,
                                std::int64_t row_count, T* out, std::int64_t ld) {
    const std::int64_t kh = g.kernel[0], kw = g.kernel[1];
    const std::int64_t sh = g.stride[0], sw = g.stride[1];
    const std::int64_t ph = g.padding[0], pw = g.padding[1];
    const std::int64_t wcols = grid.cols;
    // Range of output columns j whose tap v lands inside the image: j_lo <= j < j_hi.
    auto valid_cols = [&](std::int64_t v, std::int64_t& j_lo, std::int64_t& j_hi) {
        const std::int64_t off = v * grid.dil_w - pw;  // iw = j·sw + off
        j_lo = off >= 0 ? 0 : (-off + sw - 1) / sw;
        const std::int64_t last = width - 1 - off;  // need j·sw <= last
        j_hi = last < 0 ? 0 : std::min(wcols, last / sw + 1);
        j_lo = std::min(j_lo, j_hi);
    };
    for (std::int64_t c = 0; c < channels; ++c) {
        for (std::int64_t u = 0; u < kh; ++u) {
            for (std::int64_t v = 0; v < kw; ++v) {
                T* dst_row = out + ((c * kh + u) * kw + v) * ld;
                std::int64_t j_lo = 0, j_hi = 0;
                valid_cols(v, j_lo, j_hi);
                const std::int64_t col_off = v * grid.dil_w - pw;
                for (std::int64_t r = 0; r < row_count; ++r) {
                    const std::int64_t flat = first_row + r;
                    const std::int64_t n = flat / grid.rows;
                    const std::int64_t i = flat % grid.rows;
                    T* dst = dst_row + r * wcols;
                    const std::int64_t ih = i * sh + u * grid.dil_h - ph;
                    if (ih < 0 || ih >= height) {
                        std::fill(dst, dst + wcols, T(0));
                        continue;
                    }
                    const T* src = input + ((n * channels + c) * height + ih) * width + col_off;
                    std::fill(dst, dst + j_lo, T(0));
                    if (sw == 1) {
                        std::memcpy(dst + j_lo, src + j_lo, sizeof(T) * static_cast<std::size_t>(j_hi - j_lo));
                    } else {
                        for (std::int64_t j = j_lo; j < j_hi; ++j) dst[j] = src[j * sw];
                    }
                    std::fill(dst + j_hi, dst + wcols, T(0));
                }
            }
        }
    }
}

}  // namespace kfac
