// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_description.hpp
/// What kind of layer a registered layer is and its shapes: everything the library needs to
/// size the Kronecker factors and to check the views an adapter hands it.

#include <array>
#include <cstdint>
#include <string>

namespace kfac {

/// Conv1d is a Conv2d whose first spatial axis is trivial: its geometry is stored as the
/// 2-D one with kernel, stride and dilation 1 and padding 0 on that axis (conv1d_description()
/// builds it), and its views [N, C, L] are read as [N, C, 1, L].
/// Embedding is the Linear layer of a one-hot input: `in` = num_embeddings V, `out` =
/// embedding_dim E, its activations the token ids, its weight [V, E] (embedding_description()).
/// LayerNorm, BatchNorm, GroupNorm and InstanceNorm are their affine part y = scale ⊙ x̂ + shift
/// over C features (`in` = `out` = C, `bias` = the shift): the activations are the normalised
/// input x̂, LayerNorm's [rows..., C] (features last), the others' [N, C, spatial...] (channels
/// second: features_last()); their weight (scale) and bias (shift) gradients are [C]
/// (layer_norm_description(), batch_norm_description(), group_norm_description(),
/// instance_norm_description()). The four differ only in the statistics x̂ was normalised
/// with (the batch's, a group of channels', an example's channel's), which the adapter that
/// forms x̂ applies; to the curvature each is one scale and shift per channel.
enum class layer_kind {
    linear,      ///< y = x Wᵀ + b (torch.nn.Linear)
    conv2d,      ///< 2-D convolution, grouped and depthwise too (torch.nn.Conv2d)
    conv1d,      ///< 1-D convolution (torch.nn.Conv1d)
    embedding,   ///< a lookup table of rows (torch.nn.Embedding): a diagonal A
    layer_norm,  ///< LayerNorm's scale and shift, features last: unit-wise blocks
    batch_norm,  ///< BatchNorm's scale and shift, channels second: unit-wise blocks
    group_norm,  ///< GroupNorm's scale and shift, channels second: unit-wise blocks
    instance_norm,  ///< InstanceNorm's scale and shift (affine), channels second: unit-wise blocks
};

/// The kind's name as messages and checkpoints write it: "linear", "conv2d", ... (the enumerator).
[[nodiscard]] inline const char* kind_name(layer_kind k) noexcept {
    switch (k) {
        case layer_kind::linear: return "linear";
        case layer_kind::conv2d: return "conv2d";
        case layer_kind::conv1d: return "conv1d";
        case layer_kind::embedding: return "embedding";
        case layer_kind::layer_norm: return "layer_norm";
        case layer_kind::batch_norm: return "batch_norm";
        case layer_kind::group_norm: return "group_norm";
        case layer_kind::instance_norm: return "instance_norm";
    }
    return "unknown";
}

/// The name PyTorch gives the module of a kind ("Linear", "Conv2d", "Conv1d", ...), which
/// options.skip_layers patterns may match as well; one name, "BatchNorm", for BatchNorm1d/2d/3d
/// (and "InstanceNorm" for InstanceNorm1d/2d/3d).
[[nodiscard]] inline const char* pytorch_module_name(layer_kind k) noexcept {
    switch (k) {
        case layer_kind::linear: return "Linear";
        case layer_kind::conv2d: return "Conv2d";
        case layer_kind::conv1d: return "Conv1d";
        case layer_kind::embedding: return "Embedding";
        case layer_kind::layer_norm: return "LayerNorm";
        case layer_kind::batch_norm: return "BatchNorm";
        case layer_kind::group_norm: return "GroupNorm";
        case layer_kind::instance_norm: return "InstanceNorm";
    }
    return "unknown";
}

/// Conv2d or Conv1d.
[[nodiscard]] constexpr bool is_convolution(layer_kind k) noexcept {
    return k == layer_kind::conv2d || k == layer_kind::conv1d;
}

/// The scale-and-shift of a normalisation layer (LayerNorm, BatchNorm, GroupNorm, InstanceNorm).
[[nodiscard]] constexpr bool is_normalization(layer_kind k) noexcept {
    return k == layer_kind::layer_norm || k == layer_kind::batch_norm || k == layer_kind::group_norm ||
           k == layer_kind::instance_norm;
}

/// Whether the kind's views hold its features in their last dimension, [rows..., features]
/// (Linear, LayerNorm: dimension 0 the example), rather than its channels second,
/// [N, C, spatial...] (convolutions, BatchNorm, GroupNorm, InstanceNorm); an Embedding's token
/// ids have no feature dimension (false). The one place this is decided: a new kind answers
/// here, and the views' checks, examples and layouts follow.
[[nodiscard]] constexpr bool features_last(layer_kind k) noexcept {
    switch (k) {
        case layer_kind::linear:
        case layer_kind::layer_norm: return true;
        case layer_kind::conv2d:
        case layer_kind::conv1d:
        case layer_kind::embedding:
        case layer_kind::batch_norm:
        case layer_kind::group_norm:
        case layer_kind::instance_norm: return false;
    }
    return false;
}

/// How a Kronecker factor is stored. Dense: the n × n symmetric matrix. Diagonal: its diagonal
/// as an n × 1 column, for a factor that is diagonal by construction (an Embedding's A: one-hot
/// inputs have no cross terms), so that neither its statistics, its decomposition nor its
/// preconditioning ever forms the n × n matrix.
///
/// Unit-wise and identity are the two halves of a normalisation layer's curvature, which is
/// not a Kronecker product: one exact k × k block per channel c (k = 2 for scale and shift, 1
/// for scale alone), F_c = mean over rows r of t_{r,c} t_{r,c}ᵀ, t_{r,c} = (Σ x̂ ⊙ dy, Σ dy)
/// summed over the row's positions of channel c (kfac-jax's ScaleAndShift blocks; the
/// "unit-wise" Fisher of Osawa et al., ASDL). A stores the C blocks, C × k(k+1)/2 (columns
/// F_γγ, F_γβ, F_ββ); G is the 1 × 1 identity, never estimated, so that the eigen method's
/// 1/(λ_A·λ_G + γ) and the inverse method both give (F_c + γI)⁻¹ per channel.
enum class factor_structure {
    dense,      ///< a full symmetric matrix (Linear's and convolutions' A and G)
    diagonal,   ///< its diagonal only (an Embedding's A: one-hot rows make A diagonal)
    unit_wise,  ///< one exact k × k block per channel (a normalisation layer's A)
    identity,   ///< the identity, never estimated (a normalisation layer's G)
};

/// How the factors treat a weight applied at several positions of one example (the tokens of
/// a sequence, the output locations of a convolution); Eschenhagen et al., "Kronecker-Factored
/// Approximate Curvature for Modern Neural Network Architectures", NeurIPS 2023, §3.
/// Either way the output gradients g are used as the framework delivers them (for a loss that
/// is a mean over the batch they carry its 1/N), and each factor is a mean over its rows.
enum class weight_sharing {
    /// Every (example, position) pair is a row: A = mean over them of ã ãᵀ, G = mean of g gᵀ
    /// (a convolution keeps the reference's extra 1/S² on each factor, golden §4.2). KAISA's
    /// and kfac-pytorch's behaviour; right for a loss with a term per position (language
    /// modelling, per-pixel losses).
    expand,
    /// Positions are aggregated first, one row per example: ā_n = mean over positions of
    /// ã_{n,r}, ĝ_n = sum over positions of g_{n,r}; A = mean over n of ā_n ā_nᵀ, G = mean of
    /// ĝ_n ĝ_nᵀ. Right for a loss computed after pooling the positions (classification of a
    /// sequence or image), and cheaper: O(N·d²) instead of O(N·R·d²). Linear inputs are then
    /// [N, positions..., in] (dimension 0 is the example); a rank-2 input has one position.
    reduce,
};

/// The weight sharing a kind is described with unless told otherwise: reduce for the
/// channels-second normalisations, BatchNorm, GroupNorm and InstanceNorm (the per-example
/// gradient of their definition), expand for every other kind.
[[nodiscard]] constexpr weight_sharing default_sharing(layer_kind k) noexcept {
    return is_normalization(k) && !features_last(k) ? weight_sharing::reduce : weight_sharing::expand;
}

/// "expand" or "reduce".
[[nodiscard]] inline const char* sharing_name(weight_sharing s) noexcept {
    return s == weight_sharing::expand ? "expand" : "reduce";
}

/// Geometry of a 2-D convolution, each pair {height, width}.
struct conv2d_geometry {
    std::array<std::int64_t, 2> kernel{1, 1};    ///< k_h, k_w
    std::array<std::int64_t, 2> stride{1, 1};    ///< ≥ 1
    std::array<std::int64_t, 2> padding{0, 0};   ///< zeros added on each side, ≥ 0
    std::array<std::int64_t, 2> dilation{1, 1};  ///< spacing of the kernel's taps, ≥ 1
    std::int64_t groups = 1;                     ///< g: dividing C_in and C_out (layer_description)
};

/// Geometry of a 1-D convolution (torch::nn::Conv1d's options).
struct conv1d_geometry {
    std::int64_t kernel = 1;    ///< k
    std::int64_t stride = 1;    ///< ≥ 1
    std::int64_t padding = 0;   ///< zeros added on each side, ≥ 0
    std::int64_t dilation = 1;  ///< spacing of the kernel's taps, ≥ 1
    std::int64_t groups = 1;    ///< g: dividing C_in and C_out
};

/// Linear: `in` = in_features, `out` = out_features. Conv: `in` = C_in, `out` = C_out.
///
/// A grouped convolution (conv.groups = g > 1; depthwise when g = C_in) is g independent
/// convolutions: output channels [j·C_out/g, (j+1)·C_out/g) see only input channels
/// [j·C_in/g, (j+1)·C_in/g). Its curvature has one Kronecker block per group, A_j over the
/// group's input patches and G_j over its output channels (frontier.md §3.6), so a_dim() and
/// g_dim() are the dimensions of one group's block, and group_block() is the groups = 1
/// layer that block belongs to.
struct layer_description {
    layer_kind kind = layer_kind::linear;  ///< what the layer is
    std::int64_t in = 0;                   ///< in_features, C_in, V (Embedding) or C (normalisation)
    std::int64_t out = 0;                  ///< out_features, C_out, E (Embedding) or C (normalisation)
    bool bias = false;                     ///< whether it has a bias (a normalisation layer's shift)
    conv2d_geometry conv{};  ///< ignored for linear layers; {1, k}-style for conv1d
    weight_sharing sharing = weight_sharing::expand;  ///< how the factors treat positions (weight_sharing)

    /// Kronecker blocks of the layer: a convolution's groups, 1 for every other kind.
    [[nodiscard]] std::int64_t groups() const noexcept { return is_convolution(kind) ? conv.groups : 1; }
    /// Columns of the weight gradient reshaped to [out, ·]: in, (C_in/groups)·k_h·k_w, or 1
    /// for a normalisation layer (its scale is one weight per channel).
    [[nodiscard]] std::int64_t weight_columns() const noexcept {
        if (is_normalization(kind)) return 1;
        return is_convolution(kind) ? per_group(in) * conv.kernel[0] * conv.kernel[1] : in;
    }
    /// Dimension of the A factor (of one group's block; bias adds one, the last, row and column).
    [[nodiscard]] std::int64_t a_dim() const noexcept { return weight_columns() + (bias ? 1 : 0); }
    /// Dimension of the G factor (of one group's block).
    [[nodiscard]] std::int64_t g_dim() const noexcept { return per_group(out); }
    /// The layer of one group's block: the same geometry with C_in/groups inputs, C_out/groups
    /// outputs and groups = 1 (the layer itself when it has one group).
    [[nodiscard]] layer_description group_block() const noexcept {
        layer_description b = *this;
        b.in = per_group(in);
        b.out = g_dim();
        b.conv.groups = 1;
        return b;
    }
    /// `channels` split over the groups (a description with groups < 1, which registration
    /// refuses, is read as one group so that its arithmetic stays defined).
    [[nodiscard]] std::int64_t per_group(std::int64_t channels) const noexcept {
        return groups() > 0 ? channels / groups() : channels;
    }
};

/// A Linear layer, `in_features` → `out_features`, with a bias when `bias`.
[[nodiscard]] inline layer_description linear_description(std::int64_t in_features,
                                                          std::int64_t out_features, bool bias) {
    return {layer_kind::linear, in_features, out_features, bias, {}, weight_sharing::expand};
}

/// A Conv2d of `in_channels` → `out_channels` with `geometry`, with a bias when `bias`.
[[nodiscard]] inline layer_description conv2d_description(std::int64_t in_channels,
                                                          std::int64_t out_channels,
                                                          const conv2d_geometry& geometry,
                                                          bool bias) {
    return {layer_kind::conv2d, in_channels, out_channels, bias, geometry, weight_sharing::expand};
}

/// A Conv1d over [N, C_in, L] inputs, stored as the Conv2d over [N, C_in, 1, L] it equals.
[[nodiscard]] inline layer_description conv1d_description(std::int64_t in_channels,
                                                          std::int64_t out_channels,
                                                          const conv1d_geometry& geometry,
                                                          bool bias) {
    conv2d_geometry g;
    g.kernel = {1, geometry.kernel};
    g.stride = {1, geometry.stride};
    g.padding = {0, geometry.padding};
    g.dilation = {1, geometry.dilation};
    g.groups = geometry.groups;
    return {layer_kind::conv1d, in_channels, out_channels, bias, g, weight_sharing::expand};
}

/// An Embedding of `num_embeddings` (V) rows of `embedding_dim` (E): K-FAC's A is the
/// diagonal of token frequencies, G the E × E output-gradient factor.
[[nodiscard]] inline layer_description embedding_description(std::int64_t num_embeddings,
                                                             std::int64_t embedding_dim) {
    return {layer_kind::embedding, num_embeddings, embedding_dim, false, {}, weight_sharing::expand};
}

///@{
/// The scale-and-shift of a LayerNorm over `features` (C, the product of normalized_shape) or
/// of a BatchNorm, GroupNorm or (affine) InstanceNorm over `channels`, with a shift when
/// `shift`. Rows of the curvature blocks: a LayerNorm's every row of [rows..., C] (weight
/// sharing expand, as a Linear layer on tokens; `reduce` sums each example's positions,
/// dimension 0 being the example); the channels-second kinds' examples, each summing its
/// spatial positions (weight sharing reduce: the per-example gradient of kfac-jax's
/// definition; `expand` makes every position a row).
[[nodiscard]] inline layer_description layer_norm_description(std::int64_t features, bool shift) {
    return {layer_kind::layer_norm, features, features, shift, {}, weight_sharing::expand};
}
[[nodiscard]] inline layer_description batch_norm_description(std::int64_t channels, bool shift) {
    return {layer_kind::batch_norm, channels, channels, shift, {}, default_sharing(layer_kind::batch_norm)};
}
[[nodiscard]] inline layer_description group_norm_description(std::int64_t channels, bool shift) {
    return {layer_kind::group_norm, channels, channels, shift, {}, default_sharing(layer_kind::group_norm)};
}
[[nodiscard]] inline layer_description instance_norm_description(std::int64_t channels, bool shift) {
    return {layer_kind::instance_norm, channels, channels, shift, {}, default_sharing(layer_kind::instance_norm)};
}
///@}

/// The same layer with another weight-sharing treatment.
[[nodiscard]] inline layer_description with_sharing(layer_description d, weight_sharing s) noexcept {
    d.sharing = s;
    return d;
}

/// Output extent of a convolution along one axis, as the convolution computes it.
[[nodiscard]] constexpr std::int64_t conv_output_extent(std::int64_t input, std::int64_t kernel,
                                                        std::int64_t stride, std::int64_t padding,
                                                        std::int64_t dilation) noexcept {
    return (input + 2 * padding - dilation * (kernel - 1) - 1) / stride + 1;
}

}  // namespace kfac
