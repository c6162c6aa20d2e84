// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_checks.hpp
/// Validation of layer descriptions and of the views adapters hand over, with messages that
/// name the layer, the shapes and the fix.

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kfac/config.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::detail {

/// "[5, 6]". Built by appending: GCC 12 at -O3 warns falsely (-Wrestrict, bug 105329) on
/// `"[" + std::to_string(...)`.
template <class Extents>
std::string shape_text(const Extents& extents) {
    std::string s(1, '[');
    for (auto e : extents) {
        if (s.size() > 1) s += ", ";
        s += std::to_string(e);
    }
    s += ']';
    return s;
}
inline std::string shape_text(std::initializer_list<std::int64_t> extents) {
    return shape_text<std::initializer_list<std::int64_t>>(extents);
}

/// "3x3" for conv2d, "3" for conv1d (its trivial first axis left out).
inline std::string geometry_text(const layer_description& d, const std::array<std::int64_t, 2>& p) {
    if (d.kind == layer_kind::conv1d) return std::to_string(p[1]);
    return std::to_string(p[0]) + "x" + std::to_string(p[1]);
}

/// "layer_norm 16, shift" for a normalisation layer (its C channels, with or without shift).
inline std::string norm_text(const layer_description& d) {
    return std::string(kind_name(d.kind)) + " " + std::to_string(d.out) + (d.bias ? ", shift" : ", no shift");
}

/// ", weight sharing reduce" when the layer's sharing is not its kind's default.
inline std::string sharing_text(const layer_description& d) {
    if (d.sharing == default_sharing(d.kind)) return {};
    return std::string(", weight sharing ") + sharing_name(d.sharing);
}

inline std::string describe_layer(const std::string& name, const layer_description& d) {
    if (is_normalization(d.kind)) return "layer '" + name + "' (" + norm_text(d) + sharing_text(d) + ")";
    std::string s =
        "layer '" + name + "' (" + kind_name(d.kind) + " " + std::to_string(d.in) + "->" + std::to_string(d.out);
    if (is_convolution(d.kind)) s += ", kernel " + geometry_text(d, d.conv.kernel);
    if (is_convolution(d.kind) && d.conv.groups != 1) s += ", groups " + std::to_string(d.conv.groups);
    s += sharing_text(d);
    return s + (d.bias ? ", bias)" : ", no bias)");
}

/// A layer as its errors name it: its registered name, which kfac::error::layer() carries, and
/// its description (describe_layer), which begins the message.
struct named_layer {
    std::string name;
    std::string text;
};

/// The error "<layer's description>: <what>", carrying the layer's name.
inline error layer_error(const named_layer& layer, const std::string& what) {
    return error(layer.text + ": " + what, layer.name);
}

/// Everything that identifies a layer, for the cross-rank configuration check and
/// checkpoints: "'conv1' (conv2d 3->4, kernel 3x3, stride 1x1, padding 1x1, dilation 1x1,
/// groups 1, bias)"; weight sharing is named when it is not the default (expand), so
/// signatures of checkpoints written before it existed still match.
inline std::string layer_signature(const std::string& name, const layer_description& d) {
    if (is_normalization(d.kind)) return "'" + name + "' (" + norm_text(d) + sharing_text(d) + ")";
    std::string s = "'" + name + "' (" + kind_name(d.kind) + " " + std::to_string(d.in) + "->" + std::to_string(d.out);
    if (is_convolution(d.kind)) {
        const auto& c = d.conv;
        s += ", kernel " + geometry_text(d, c.kernel) + ", stride " + geometry_text(d, c.stride) + ", padding " +
             geometry_text(d, c.padding) + ", dilation " + geometry_text(d, c.dilation) + ", groups " +
             std::to_string(c.groups);
    }
    s += sharing_text(d);
    return s + (d.bias ? ", bias)" : ", no bias)");
}

/// Largest count a BLAS or LAPACK call takes: both libraries the backends use (OpenBLAS's
/// LP64 interface, cuBLAS) pass dimensions as 32-bit ints.
inline constexpr std::int64_t blas_int_max = 2147483647;

inline void check_description(const std::string& name, const layer_description& d) {
    const named_layer who{name, describe_layer(name, d)};
    if (d.in <= 0 || d.out <= 0) throw layer_error(who, "input and output sizes must be positive");
    if (d.sharing != weight_sharing::expand && d.sharing != weight_sharing::reduce)
        throw layer_error(who, "description.sharing holds " + std::to_string(static_cast<int>(d.sharing)) +
                                   ", which is not a kfac::weight_sharing; use weight_sharing::expand or ::reduce");
    if (d.kind != layer_kind::linear && d.kind != layer_kind::conv2d && d.kind != layer_kind::conv1d &&
        d.kind != layer_kind::embedding && !is_normalization(d.kind))
        throw layer_error(who, "description.kind holds " + std::to_string(static_cast<int>(d.kind)) +
                                   ", which is not a kfac::layer_kind");
    if (is_normalization(d.kind) && d.in != d.out)
        throw layer_error(who, std::string("a ") + kind_name(d.kind) +
                                   " has one scale (and shift) per channel, so in and out are "
                                   "both its channel count, but they are " +
                                   std::to_string(d.in) + " and " + std::to_string(d.out) +
                                   "; describe it with kfac::" + kind_name(d.kind) + "_description()");
    if (d.kind == layer_kind::embedding) {
        if (d.bias) throw layer_error(who, "an Embedding has no bias; describe it with kfac::embedding_description()");
        if (d.sharing != weight_sharing::expand)
            throw layer_error(
                who,
                "an Embedding's statistics count each token (weight sharing 'expand'); 'reduce' "
                "would average one-hot rows into a dense V x V factor. Leave description.sharing at expand");
    }
    if (d.kind == layer_kind::conv1d) {
        const auto& c = d.conv;
        if (c.kernel[0] != 1 || c.stride[0] != 1 || c.dilation[0] != 1 || c.padding[0] != 0)
            throw layer_error(who,
                              "a conv1d's geometry has a trivial first axis (kernel, stride, dilation 1, "
                              "padding 0) but this one has kernel " +
                                  shape_text(c.kernel) + ", stride " + shape_text(c.stride) + ", padding " +
                                  shape_text(c.padding) + ", dilation " + shape_text(c.dilation) +
                                  "; build it with kfac::conv1d_description()");
    }
    if (is_convolution(d.kind)) {
        const auto& c = d.conv;
        for (int i = 0; i < 2; ++i) {
            if (c.kernel[i] <= 0 || c.stride[i] <= 0 || c.dilation[i] <= 0 || c.padding[i] < 0)
                throw layer_error(who,
                                  "kernel, stride and dilation must be positive and padding "
                                  "non-negative");
        }
        if (c.groups < 1 || d.in % c.groups != 0 || d.out % c.groups != 0)
            throw layer_error(who, "groups = " + std::to_string(c.groups) + " must be positive and divide both " +
                                       std::to_string(d.in) + " input and " + std::to_string(d.out) +
                                       " output channels, as the convolution's own groups do; describe the layer with "
                                       "the module's groups");
    }
    // A factor's dimension is a BLAS dimension (and its square the factor's size).
    std::int64_t columns = d.per_group(d.in);
    if (is_convolution(d.kind) && (__builtin_mul_overflow(columns, d.conv.kernel[0], &columns) ||
                                   __builtin_mul_overflow(columns, d.conv.kernel[1], &columns)))
        columns = blas_int_max + 1;
    if (columns >= blas_int_max || d.out > blas_int_max)
        throw layer_error(who, "a factor dimension of " + std::to_string(columns) + " x " + std::to_string(d.g_dim()) +
                                   " exceeds what a BLAS call takes (" + std::to_string(blas_int_max) +
                                   "); exclude the layer with options.skip_layers");
}

/// A device view handed to a host backend cannot be read: say which view and what to do.
/// Tells whether a pointer is memory the device backend can copy from (device, managed or
/// pinned host memory); nullptr where the backend cannot tell.
using device_memory_probe = bool (*)(const void*);

template <class T>
void check_memory_space(const named_layer& who, const char* what, const tensor_view<T>& v, bool device_backend,
                        device_memory_probe probe = nullptr) {
    if (v.empty() || v.space == memory_space::host) return;
    if (device_backend) {
        // A host address labelled device memory is not an error the driver reports: the copy
        // reads it as a device address and crashes inside the driver (seen on an H100).
        if (probe && !probe(static_cast<const void*>(v.data)))
            throw layer_error(who, std::string("the ") + what + " view " + v.shape_string() +
                                       " is marked memory_space::device, but " +
                                       "its pointer is not device memory (nor pinned host memory); mark host buffers "
                                       "memory_space::host, or pass the device allocation");
        return;
    }
    throw layer_error(who,
                      std::string("the ") + what + " view " + v.shape_string() +
                          " points to device memory, but the "
                          "backend works in host memory; use kfac::backend::cuda (kfac/backend/cuda.cuh) or copy the "
                          "buffer to the host");
}

/// A view's rank and extents must describe an array: rank within [0, max_view_rank], no
/// negative extent, and an element count that fits in 64 bits.
template <class T>
void check_extents(const named_layer& who, const char* what, const tensor_view<T>& v) {
    if (v.empty()) return;
    if (v.rank < 0 || v.rank > max_view_rank)
        throw layer_error(who, std::string("the ") + what + " view has rank " + std::to_string(v.rank) +
                                   "; views have 0 to " + std::to_string(max_view_rank) +
                                   " dimensions (flatten leading dimensions into one)");
    std::int64_t count = 1;
    for (int i = 0; i < v.rank; ++i) {
        if (v.extent(i) < 0)
            throw layer_error(who, std::string("the ") + what + " view has shape " + v.shape_string() +
                                       " with the negative extent " + std::to_string(v.extent(i)) + " in dimension " +
                                       std::to_string(i) +
                                       "; point the view at the array with its real, non-negative shape");
        if (__builtin_mul_overflow(count, v.extent(i), &count))
            throw layer_error(who, std::string("the ") + what + " view's shape " + v.shape_string() +
                                       " has more elements than a 64-bit count holds");
    }
}

/// A count passed to one BLAS call must fit its integer type.
inline void check_blas_count(const named_layer& who, const std::string& what, std::int64_t count) {
    if (count <= blas_int_max) return;
    throw layer_error(who,
                      what + " " + std::to_string(count) + ", more than the " + std::to_string(blas_int_max) +
                          " one BLAS call takes; split the batch into micro-batches (options.accumulation_steps and "
                          "accumulate())");
}

template <class T>
std::int64_t leading_rows(const tensor_view<T>& v) {
    return v.rank == 0 ? 0 : v.size() / v.extent(v.rank - 1);
}

/// An Embedding's views: token ids [positions...] (integers held as scalars) and output
/// gradients [positions..., E]. Every id is read: one that is not an integer in [0, V) would
/// count towards no row, or the wrong one.
template <class T>
void check_embedding_views(const named_layer& who, const layer_description& d, const tensor_view<const T>& a,
                           const tensor_view<const T>& g) {
    bool matching = a.rank >= 1 && a.size() > 0 && g.rank == a.rank + 1 && g.extent(a.rank) == d.out;
    for (int i = 0; matching && i < a.rank; ++i) matching = a.extent(i) == g.extent(i);
    if (!matching) {
        std::string expected = "[";
        for (int i = 0; i < a.rank; ++i) expected += std::to_string(a.extent(i)) + ", ";
        throw layer_error(
            who, "token ids " + a.shape_string() + " and output gradients " + g.shape_string() +
                     " do not match; pass non-empty ids [positions...] (rank 1 or more) and output gradients " +
                     expected + std::to_string(d.out) + "]");
    }
    check_blas_count(who, "token ids " + a.shape_string() + " hold positions:", a.size());
    if (a.space != memory_space::host) return;  // read on the device by a device backend
    for (std::int64_t i = 0, n = a.size(); i < n; ++i) {
        const T id = a.data[i];
        if (!(id >= T(0) && id < static_cast<T>(d.in) && id == static_cast<T>(static_cast<std::int64_t>(id))))
            throw layer_error(who, "token id " + std::to_string(static_cast<double>(id)) + " at flat position " +
                                       std::to_string(i) + " of " + a.shape_string() + " is not an integer in [0, " +
                                       std::to_string(d.in) +
                                       "); pass the layer's input indices, converted to the scalar type");
    }
}

/// A normalisation layer's views: the normalised input x̂ and the output gradient, of one
/// shape, LayerNorm's [rows..., C] (C last) or the other kinds' [N, C, spatial...] (C second:
/// features_last()).
template <class T>
void check_norm_views(const named_layer& who, const layer_description& d, const tensor_view<const T>& a,
                      const tensor_view<const T>& g) {
    const bool channels_last = features_last(d.kind);
    const int channel_axis = channels_last ? a.rank - 1 : 1;
    const bool shaped = a.rank >= (channels_last ? 1 : 2) && a.extent(channel_axis) == d.out && a.size() > 0;
    if (!shaped) {
        // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "[" + std::to_string(...).
        std::string expected(channels_last ? "[rows..., " : "[N, ");
        expected += std::to_string(d.out);
        expected += channels_last ? "] (features last)" : ", spatial...] (channels second)";
        throw layer_error(who, "the normalised input has shape " + a.shape_string() + "; expected " + expected +
                                   ", not empty. Pass x̂, the input the " + kind_name(d.kind) +
                                   " normalised, flattened to " + std::to_string(d.out) +
                                   " features where the layer normalises several dimensions");
    }
    bool same = g.rank == a.rank;
    for (int i = 0; same && i < a.rank; ++i) same = g.extent(i) == a.extent(i);
    if (!same)
        throw layer_error(who, "the output gradient has shape " + g.shape_string() + " but the normalised input " +
                                   a.shape_string() +
                                   "; the scale and shift act element-wise, so pass the gradient of the "
                                   "layer's output, of the input's shape");
    if (d.sharing == weight_sharing::expand)
        check_blas_count(who, "the normalised input " + a.shape_string() + " holds rows:", a.size() / d.out);
}

/// Views read for the factor statistics (activations and output gradients).
template <class T>
void check_statistics_views(const std::string& name, const layer_description& d, const tensor_view<const T>& a,
                            const tensor_view<const T>& g, std::int64_t step, bool device_backend = false,
                            device_memory_probe probe = nullptr) {
    const named_layer who{name, describe_layer(name, d)};
    check_extents(who, "activations", a);
    check_extents(who, "output gradients", g);
    check_memory_space(who, "activations", a, device_backend, probe);
    check_memory_space(who, "output gradients", g, device_backend, probe);
    if (a.empty())
        throw layer_error(who, "no activations captured for factor-update step " + std::to_string(step) +
                                   "; the adapter's activations() returned an empty "
                                   "view. Run the forward pass and point the view at this layer's input "
                                   "before accumulate()/step()");
    if (g.empty())
        throw layer_error(who, "no output gradients captured for factor-update step " + std::to_string(step) +
                                   "; run the backward pass and point the adapter's "
                                   "output_gradients() at this layer's output gradient before step()");
    if (d.kind == layer_kind::embedding) {
        check_embedding_views(who, d, a, g);
        return;
    }
    if (is_normalization(d.kind)) {
        check_norm_views(who, d, a, g);
        return;
    }
    if (d.kind == layer_kind::linear) {
        if (a.rank < 1 || a.extent(a.rank - 1) != d.in)
            throw layer_error(who, "activations have shape " + a.shape_string() +
                                       "; the last dimension must be in_features = " + std::to_string(d.in));
        if (g.rank < 1 || g.extent(g.rank - 1) != d.out)
            throw layer_error(who, "output gradients have shape " + g.shape_string() +
                                       "; the last dimension must be out_features = " + std::to_string(d.out));
        if (leading_rows(a) != leading_rows(g) || leading_rows(a) == 0)
            throw layer_error(who, "activations " + a.shape_string() + " and output gradients " + g.shape_string() +
                                       " must hold the same, non-zero number of rows");
        check_blas_count(who, "activations " + a.shape_string() + " hold rows:", leading_rows(a));
        if (d.sharing == weight_sharing::reduce && a.rank >= 2 && g.rank >= 2 && a.extent(0) != g.extent(0))
            throw layer_error(who, "with weight sharing 'reduce' dimension 0 counts the examples, but activations " +
                                       a.shape_string() + " and output gradients " + g.shape_string() +
                                       " differ in it; pass "
                                       "[N, positions..., features] views");
        return;
    }
    // Conv1d views [N, C, L] are the Conv2d views [N, C, 1, L].
    const bool one_d = d.kind == layer_kind::conv1d;
    const int rank = one_d ? 3 : 4;
    auto shape = [&](std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w) {
        return one_d ? shape_text({n, c, w}) : shape_text({n, c, h, w});
    };
    if (a.rank != rank || a.extent(1) != d.in)
        throw layer_error(who, "activations have shape " + a.shape_string() + "; expected [N, " + std::to_string(d.in) +
                                   (one_d ? ", L]" : ", H, W]"));
    const std::int64_t height = one_d ? 1 : a.extent(2), width = a.extent(rank - 1);
    const auto& c = d.conv;
    const std::int64_t ho = conv_output_extent(height, c.kernel[0], c.stride[0], c.padding[0], c.dilation[0]);
    const std::int64_t wo = conv_output_extent(width, c.kernel[1], c.stride[1], c.padding[1], c.dilation[1]);
    const std::int64_t ho_ref = conv_output_extent(height, c.kernel[0], c.stride[0], c.padding[0], 1);
    const std::int64_t wo_ref = conv_output_extent(width, c.kernel[1], c.stride[1], c.padding[1], 1);
    if (a.extent(0) <= 0 || ho <= 0 || wo <= 0 || ho_ref <= 0 || wo_ref <= 0)
        throw layer_error(who, "activations " + a.shape_string() + " are empty or smaller than the (padded) kernel");
    const bool g_ok = g.rank == rank && g.extent(0) == a.extent(0) && g.extent(1) == d.out &&
                      (one_d || g.extent(2) == ho) && g.extent(rank - 1) == wo;
    if (!g_ok)
        throw layer_error(who, "output gradients have shape " + g.shape_string() + "; for input " + a.shape_string() +
                                   " the convolution's output is " + shape(a.extent(0), d.out, ho, wo));
    // The G statistic is one rank-k update per sample over its output positions.
    check_blas_count(who, "output gradients " + g.shape_string() + " hold positions per sample:", ho * wo);
}

/// A normalisation layer's scale (weight) and shift (bias) gradients: [C] each.
template <class T>
void check_norm_gradients(const named_layer& who, const layer_description& d, const tensor_view<T>& w,
                          const tensor_view<T>& b) {
    const std::string expected = shape_text({d.out});
    auto text = [](const tensor_view<T>& v) { return v.empty() ? std::string("(empty)") : v.shape_string(); };
    if (w.empty() || w.rank != 1 || w.extent(0) != d.out)
        throw layer_error(who, "the scale (weight) gradient has shape " + text(w) + "; expected " + expected +
                                   " (flatten a LayerNorm's normalized_shape into one dimension)");
    if (d.bias && (b.empty() || b.rank != 1 || b.extent(0) != d.out))
        throw layer_error(who, "the shift (bias) gradient has shape " + text(b) + "; expected " + expected);
    if (!d.bias && !b.empty())
        throw layer_error(who, "the layer is described without shift but a shift gradient of shape " +
                                   b.shape_string() +
                                   " was given; set description.bias = true or return an empty view");
}

/// Views of the gradients that step() reads and overwrites.
template <class T>
void check_gradient_views(const std::string& name, const layer_description& d, const tensor_view<T>& w,
                          const tensor_view<T>& b, bool device_backend = false, device_memory_probe probe = nullptr) {
    const named_layer who{name, describe_layer(name, d)};
    check_extents(who, "weight gradient", w);
    check_extents(who, "bias gradient", b);
    check_memory_space(who, "weight gradient", w, device_backend, probe);
    check_memory_space(who, "bias gradient", b, device_backend, probe);
    if (is_normalization(d.kind)) {
        check_norm_gradients(who, d, w, b);
        return;
    }
    const bool one_d = d.kind == layer_kind::conv1d, embedding = d.kind == layer_kind::embedding;
    const bool linear = d.kind == layer_kind::linear || embedding;
    // A grouped convolution's weight is [C_out, C_in/groups, kernel...].
    const std::int64_t rows = embedding ? d.in : d.out, cols = embedding ? d.out : d.per_group(d.in);
    const std::string expected = linear  ? shape_text({rows, cols})
                                 : one_d ? shape_text({d.out, cols, d.conv.kernel[1]})
                                         : shape_text({d.out, cols, d.conv.kernel[0], d.conv.kernel[1]});
    bool ok = !w.empty() && w.rank == (linear ? 2 : one_d ? 3 : 4) && w.extent(0) == rows && w.extent(1) == cols;
    if (ok && one_d) ok = w.extent(2) == d.conv.kernel[1];
    if (ok && d.kind == layer_kind::conv2d) ok = w.extent(2) == d.conv.kernel[0] && w.extent(3) == d.conv.kernel[1];
    if (!ok)
        throw layer_error(who, "weight gradient has shape " + (w.empty() ? std::string("(empty)") : w.shape_string()) +
                                   "; expected " + expected +
                                   ". Point the adapter's weight_gradient() at the "
                                   "layer's weight gradient");
    if (d.bias && (b.empty() || b.size() != d.out))
        throw layer_error(who, "bias gradient has shape " + (b.empty() ? std::string("(empty)") : b.shape_string()) +
                                   "; expected [" + std::to_string(d.out) + "]");
    if (!d.bias && !b.empty())
        throw layer_error(who, "the layer is described without bias but a bias gradient of shape " + b.shape_string() +
                                   " was given; set description.bias = true or return an "
                                   "empty view");
}

}  // namespace kfac::detail
