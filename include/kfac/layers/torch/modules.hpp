// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/modules.hpp
/// The torch::nn module types the adapter knows: their descriptions (convolution geometry), which
/// are left out and why, their weights, and the skip filter.
/// A room of the LibTorch adapter (kfac/layers/torch.hpp, which says how the adapter works).

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "kfac/config.hpp"
#include "kfac/detail/layer_checks.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/layer_traits.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"
#include "kfac/layers/torch/capture.hpp"

namespace kfac::torch {
namespace detail {

/// A module option as the two axes of the Conv2d geometry; a Conv1d's single axis is the
/// second, the first is `trivial` (1 for kernel, stride and dilation, 0 for padding).
template <std::size_t D>
std::array<std::int64_t, 2> axes_of(const ::torch::ExpandingArray<D>& a, std::int64_t trivial) {
    static_assert(D == 1 || D == 2);
    if constexpr (D == 1) return {trivial, (*a)[0]};
    else return {(*a)[0], (*a)[1]};
}

/// The description of a torch::nn::Conv2d or Conv1d (D spatial dimensions) from its options.
template <std::size_t D, class ConvImpl>
layer_description describe_conv(const std::string& name, const ConvImpl& m) {
    const auto& o = m.options;
    const char* type = D == 1 ? "torch::nn::Conv1d" : "torch::nn::Conv2d";
    conv2d_geometry g;
    g.kernel = axes_of<D>(o.kernel_size(), 1);
    g.stride = axes_of<D>(o.stride(), 1);
    g.dilation = axes_of<D>(o.dilation(), 1);
    g.groups = o.groups();
    const bool zeros = c10::get_if<::torch::enumtype::kZeros>(&o.padding_mode()) != nullptr;
    if (const auto* explicit_padding = c10::get_if<::torch::ExpandingArray<D>>(&o.padding())) {
        g.padding = axes_of<D>(*explicit_padding, 0);
    } else if (c10::get_if<::torch::enumtype::kValid>(&o.padding()) != nullptr) {
        g.padding = {0, 0};
    } else {  // kSame: total padding dilation·(kernel − 1) per axis, split left/right
        for (std::size_t i = 0; i < 2; ++i) {
            const std::int64_t total = g.dilation[i] * (g.kernel[i] - 1);
            if (zeros && total % 2 != 0)
                throw error("torch adapter: layer '" + name + "' (" + type + "): padding 'same' "
                            "with kernel " + std::to_string(g.kernel[i]) + " and dilation " +
                            std::to_string(g.dilation[i]) + " pads unevenly (" + std::to_string(total / 2) +
                            " and " + std::to_string(total - total / 2) + "), which K-FAC's patch "
                            "extraction cannot describe; use an odd kernel or explicit padding, or "
                            "exclude the layer with options.skip_layers");
            g.padding[i] = total / 2;
        }
    }
    // A non-zero padding mode pads the input itself before an unpadded convolution, and that
    // padded input is what the observer captures.
    if (!zeros) g.padding = {0, 0};
    layer_description d = conv2d_description(o.in_channels(), o.out_channels(), g, m.bias.defined());
    if constexpr (D == 1) d.kind = layer_kind::conv1d;
    return d;
}

/// Why register_modules leaves an Embedding out (empty when it can be preconditioned).
inline std::string embedding_left_out(const ::torch::nn::EmbeddingImpl& e) {
    if (e.options.sparse())
        return "sparse = true: a sparse gradient cannot be preconditioned in place";
    if (e.options.scale_grad_by_freq())
        return "scale_grad_by_freq = true: its gradient is already divided by the token counts, which K-FAC's "
               "A factor would divide again";
    return {};
}

/// The weight (scale) and bias (shift) of a normalisation module, its channels and its type.
struct norm_module {
    at::Tensor* weight = nullptr;
    at::Tensor* bias = nullptr;
    std::int64_t channels = 0;
    const char* type = "";
    layer_kind kind = layer_kind::layer_norm;
};

/// A LayerNorm or BatchNorm1d/2d/3d module's parts (nullopt for other modules).
inline std::optional<norm_module> as_norm_module(::torch::nn::Module* m) {
    if (auto* n = dynamic_cast<::torch::nn::LayerNormImpl*>(m)) {
        std::int64_t features = 1;
        for (auto e : n->options.normalized_shape()) features *= e;
        return norm_module{&n->weight, &n->bias, features, "LayerNorm", layer_kind::layer_norm};
    }
    if (auto* b = dynamic_cast<::torch::nn::BatchNorm1dImpl*>(m))
        return norm_module{&b->weight, &b->bias, b->options.num_features(), "BatchNorm1d", layer_kind::batch_norm};
    if (auto* b = dynamic_cast<::torch::nn::BatchNorm2dImpl*>(m))
        return norm_module{&b->weight, &b->bias, b->options.num_features(), "BatchNorm2d", layer_kind::batch_norm};
    if (auto* b = dynamic_cast<::torch::nn::BatchNorm3dImpl*>(m))
        return norm_module{&b->weight, &b->bias, b->options.num_features(), "BatchNorm3d", layer_kind::batch_norm};
    return std::nullopt;
}

/// The weight of a module the tracker can take (nullptr for other modules); undefined for a
/// normalisation module without affine parameters.
inline const at::Tensor* tracked_weight(::torch::nn::Module* m) {
    if (auto* c = dynamic_cast<::torch::nn::Conv2dImpl*>(m)) return &c->weight;
    if (auto* c = dynamic_cast<::torch::nn::Conv1dImpl*>(m)) return &c->weight;
    if (auto* l = dynamic_cast<::torch::nn::LinearImpl*>(m)) return &l->weight;
    if (auto* e = dynamic_cast<::torch::nn::EmbeddingImpl*>(m)) return &e->weight;
    if (const auto n = as_norm_module(m)) return n->weight;
    return nullptr;
}

/// The kind of a module the tracker can take (nullopt for any other module).
inline std::optional<layer_kind> trackable_kind(::torch::nn::Module* m) {
    if (dynamic_cast<const ::torch::nn::LinearImpl*>(m) != nullptr) return layer_kind::linear;
    if (dynamic_cast<const ::torch::nn::Conv2dImpl*>(m) != nullptr) return layer_kind::conv2d;
    if (dynamic_cast<const ::torch::nn::Conv1dImpl*>(m) != nullptr) return layer_kind::conv1d;
    if (dynamic_cast<const ::torch::nn::EmbeddingImpl*>(m) != nullptr) return layer_kind::embedding;
    if (const auto n = as_norm_module(m)) return n->kind;
    return std::nullopt;
}

}  // namespace detail
}  // namespace kfac::torch
