// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_description.hpp
/// What kind of layer a registered layer is and its shapes: everything the library needs to
/// size the Kronecker factors and to check the views an adapter hands it.

#include <array>
#include <cstdint>
#include <string>

namespace kfac {

enum class layer_kind { linear, conv2d };

[[nodiscard]] inline const char* kind_name(layer_kind k) noexcept {
    return k == layer_kind::linear ? "linear" : "conv2d";
}

/// Geometry of a 2-D convolution, each pair {height, width}.
struct conv2d_geometry {
    std::array<std::int64_t, 2> kernel{1, 1};
    std::array<std::int64_t, 2> stride{1, 1};
    std::array<std::int64_t, 2> padding{0, 0};
    std::array<std::int64_t, 2> dilation{1, 1};
    std::int64_t groups = 1;
};

/// Linear: `in` = in_features, `out` = out_features. Conv2d: `in` = C_in, `out` = C_out.
struct layer_description {
    layer_kind kind = layer_kind::linear;
    std::int64_t in = 0;
    std::int64_t out = 0;
    bool bias = false;
    conv2d_geometry conv{};  ///< ignored for linear layers

    /// Columns of the weight gradient reshaped to [out, ·]: in or C_in·k_h·k_w.
    [[nodiscard]] std::int64_t weight_columns() const noexcept {
        return kind == layer_kind::linear ? in : in * conv.kernel[0] * conv.kernel[1];
    }
    /// Dimension of the A factor (bias adds one, the last, row and column).
    [[nodiscard]] std::int64_t a_dim() const noexcept { return weight_columns() + (bias ? 1 : 0); }
    /// Dimension of the G factor.
    [[nodiscard]] std::int64_t g_dim() const noexcept { return out; }
};

[[nodiscard]] inline layer_description linear_description(std::int64_t in_features,
                                                          std::int64_t out_features, bool bias) {
    return {layer_kind::linear, in_features, out_features, bias, {}};
}

[[nodiscard]] inline layer_description conv2d_description(std::int64_t in_channels,
                                                          std::int64_t out_channels,
                                                          const conv2d_geometry& geometry,
                                                          bool bias) {
    return {layer_kind::conv2d, in_channels, out_channels, bias, geometry};
}

/// Output extent of a convolution along one axis, as the convolution computes it.
[[nodiscard]] constexpr std::int64_t conv_output_extent(std::int64_t input, std::int64_t kernel,
                                                        std::int64_t stride, std::int64_t padding,
                                                        std::int64_t dilation) noexcept {
    return (input + 2 * padding - dilation * (kernel - 1) - 1) / stride + 1;
}

}  // namespace kfac
