// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/modules.hpp
/// The torch::nn module types the adapter takes, as a table: per type (module_entry<Impl>) its
/// parameters, its description (a convolution's geometry from its options) and why it is left
/// out; module_types lists them, parts_of() probes a module against the list.
/// A room of the LibTorch adapter (kfac/layers/torch.hpp, which says how the adapter works).

#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/functional/instancenorm.h>  // before the module, whose header uses it unincluded
#include <torch/nn/modules/instancenorm.h>
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

/// The alternative T of a module option's variant, or null: LibTorch 1.x keeps its own
/// c10::variant (its get_if found by argument-dependent lookup), LibTorch 2.x uses std::variant.
template <class T, class Variant>
const T* alternative_if(const Variant* v) noexcept {
    using std::get_if;
    return get_if<T>(v);
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
    const bool zeros = alternative_if<::torch::enumtype::kZeros>(&o.padding_mode()) != nullptr;
    if (const auto* explicit_padding = alternative_if<::torch::ExpandingArray<D>>(&o.padding())) {
        g.padding = axes_of<D>(*explicit_padding, 0);
    } else if (alternative_if<::torch::enumtype::kValid>(&o.padding()) != nullptr) {
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

/// What the adapter reads of a module of a type it takes.
struct module_parts {
    const char* type = "";  ///< "Linear", "BatchNorm2d"
    layer_kind kind = layer_kind::linear;
    at::Tensor* weight = nullptr;  ///< undefined for a normalisation module without affine parameters
    at::Tensor* bias = nullptr;    ///< nullptr where the module has none to precondition
    /// Its description (may throw: padding 'same' that pads unevenly); `name` names it in errors.
    std::function<layer_description(const std::string& name)> describe;
    /// Why register_modules leaves it out and track() refuses it, beyond what every type is
    /// checked for (frozen, no affine parameters); empty when it can be preconditioned.
    std::string left_out;
};

/// How the adapter reads one torch::nn module type: its entry, a specialisation per type, listed in
/// module_types below. (Adding a module type is one specialisation, one entry in the list, and
/// the handler of its operator in operator_calls.hpp and observer.hpp.)
template <class Impl>
struct module_entry;

template <>
struct module_entry<::torch::nn::LinearImpl> {
    static constexpr const char* name = "Linear";
    static module_parts parts(::torch::nn::LinearImpl& m) {
        return {name, layer_kind::linear, &m.weight, &m.bias, [&m](const std::string&) {
                    return linear_description(m.options.in_features(), m.options.out_features(), m.bias.defined());
                }, {}};
    }
};

/// A convolution of D spatial dimensions: its geometry from the module's options (describe_conv).
template <std::size_t D, class ConvImpl>
module_parts conv_parts(ConvImpl& m, const char* type) {
    return {type, D == 1 ? layer_kind::conv1d : layer_kind::conv2d, &m.weight, &m.bias,
            [&m](const std::string& layer) { return describe_conv<D>(layer, m); }, {}};
}

template <>
struct module_entry<::torch::nn::Conv2dImpl> {
    static constexpr const char* name = "Conv2d";
    static module_parts parts(::torch::nn::Conv2dImpl& m) { return conv_parts<2>(m, name); }
};

template <>
struct module_entry<::torch::nn::Conv1dImpl> {
    static constexpr const char* name = "Conv1d";
    static module_parts parts(::torch::nn::Conv1dImpl& m) { return conv_parts<1>(m, name); }
};

template <>
struct module_entry<::torch::nn::EmbeddingImpl> {
    static constexpr const char* name = "Embedding";
    static module_parts parts(::torch::nn::EmbeddingImpl& m) {
        std::string why;
        if (m.options.sparse())
            why = "sparse = true: a sparse gradient cannot be preconditioned in place";
        else if (m.options.scale_grad_by_freq())
            why = "scale_grad_by_freq = true: its gradient is already divided by the token counts, which K-FAC's "
                  "A factor would divide again";
        return {name, layer_kind::embedding, &m.weight, nullptr, [&m](const std::string&) {
                    return embedding_description(m.options.num_embeddings(), m.options.embedding_dim());
                }, std::move(why)};
    }
};

/// A normalisation module's affine part: weight (scale) and bias (shift) per channel.
template <class Impl>
module_parts norm_parts(Impl& m, const char* type, layer_kind kind, std::int64_t channels) {
    at::Tensor* bias = m.bias.defined() ? &m.bias : nullptr;
    return {type, kind, &m.weight, bias, [channels, kind, with_bias = bias != nullptr](const std::string&) {
                return layer_description{kind, channels, channels, with_bias, {}, default_sharing(kind)};
            }, {}};
}

template <>
struct module_entry<::torch::nn::LayerNormImpl> {
    static constexpr const char* name = "LayerNorm";
    static module_parts parts(::torch::nn::LayerNormImpl& m) {
        std::int64_t features = 1;  // a LayerNorm over several dimensions is one over their product
        for (auto e : m.options.normalized_shape()) features *= e;
        return norm_parts(m, name, layer_kind::layer_norm, features);
    }
};

template <>
struct module_entry<::torch::nn::BatchNorm1dImpl> {
    static constexpr const char* name = "BatchNorm1d";
    static module_parts parts(::torch::nn::BatchNorm1dImpl& m) {
        return norm_parts(m, name, layer_kind::batch_norm, m.options.num_features());
    }
};

template <>
struct module_entry<::torch::nn::BatchNorm2dImpl> {
    static constexpr const char* name = "BatchNorm2d";
    static module_parts parts(::torch::nn::BatchNorm2dImpl& m) {
        return norm_parts(m, name, layer_kind::batch_norm, m.options.num_features());
    }
};

template <>
struct module_entry<::torch::nn::BatchNorm3dImpl> {
    static constexpr const char* name = "BatchNorm3d";
    static module_parts parts(::torch::nn::BatchNorm3dImpl& m) {
        return norm_parts(m, name, layer_kind::batch_norm, m.options.num_features());
    }
};

/// GroupNorm: x̂ normalised over each example's groups of channels; its affine part (when
/// affine) one scale and shift per channel, as BatchNorm's.
template <>
struct module_entry<::torch::nn::GroupNormImpl> {
    static constexpr const char* name = "GroupNorm";
    static module_parts parts(::torch::nn::GroupNormImpl& m) {
        return norm_parts(m, name, layer_kind::group_norm, m.options.num_channels());
    }
};

/// InstanceNorm1d/2d/3d: x̂ normalised over each example's channel (or by the running
/// statistics); affine (not LibTorch's default) gives it a scale and shift per channel.
template <>
struct module_entry<::torch::nn::InstanceNorm1dImpl> {
    static constexpr const char* name = "InstanceNorm1d";
    static module_parts parts(::torch::nn::InstanceNorm1dImpl& m) {
        return norm_parts(m, name, layer_kind::instance_norm, m.options.num_features());
    }
};
template <>
struct module_entry<::torch::nn::InstanceNorm2dImpl> {
    static constexpr const char* name = "InstanceNorm2d";
    static module_parts parts(::torch::nn::InstanceNorm2dImpl& m) {
        return norm_parts(m, name, layer_kind::instance_norm, m.options.num_features());
    }
};
template <>
struct module_entry<::torch::nn::InstanceNorm3dImpl> {
    static constexpr const char* name = "InstanceNorm3d";
    static module_parts parts(::torch::nn::InstanceNorm3dImpl& m) {
        return norm_parts(m, name, layer_kind::instance_norm, m.options.num_features());
    }
};

/// The module types the adapter takes, in the order a module is probed.
using module_types =
    std::tuple<::torch::nn::LinearImpl, ::torch::nn::Conv2dImpl, ::torch::nn::Conv1dImpl, ::torch::nn::EmbeddingImpl,
               ::torch::nn::LayerNormImpl, ::torch::nn::BatchNorm1dImpl, ::torch::nn::BatchNorm2dImpl,
               ::torch::nn::BatchNorm3dImpl, ::torch::nn::GroupNormImpl, ::torch::nn::InstanceNorm1dImpl,
               ::torch::nn::InstanceNorm2dImpl, ::torch::nn::InstanceNorm3dImpl>;

template <class Impl, class Tuple>
inline constexpr bool is_module_type = false;
template <class Impl, class... Impls>
inline constexpr bool is_module_type<Impl, std::tuple<Impls...>> = (std::is_same_v<Impl, Impls> || ...);

/// A module holder (torch::nn::Linear, ...) of a type the adapter takes.
template <class Holder>
concept known_module_holder = requires { typename Holder::ContainedType; } &&
                              is_module_type<typename Holder::ContainedType, module_types>;

/// Calls f(static_cast<Impl*>(nullptr)) for each type Impl of module_types, in order.
template <class F>
void for_each_module_type(F&& f) {
    [&]<class... Impls>(std::tuple<Impls...>*) { (f(static_cast<Impls*>(nullptr)), ...); }(
        static_cast<module_types*>(nullptr));
}

/// The parts of `m` if its type is one of module_types (nullopt otherwise, and for nullptr).
inline std::optional<module_parts> parts_of(::torch::nn::Module* m) {
    std::optional<module_parts> found;
    for_each_module_type([&]<class Impl>(Impl*) {
        if (found || m == nullptr) return;
        if (auto* typed = dynamic_cast<Impl*>(m)) found = module_entry<Impl>::parts(*typed);
    });
    return found;
}

/// "torch::nn::Linear, Conv2d, ...": the types the adapter takes, for its errors.
inline std::string module_type_list() {
    std::string list;
    for_each_module_type([&]<class Impl>(Impl*) {
        list += (list.empty() ? "torch::nn::" : ", ") + std::string(module_entry<Impl>::name);
    });
    return list;
}

}  // namespace detail
}  // namespace kfac::torch
