// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_binding.hpp
/// A host's layer behind one type: its views and optional members as function pointers over a
/// `void*`, made from the layer's kfac::layer_traits (layer_traits.hpp) by bind_layer(). The
/// views come as number_views: their element format (bf16, fp16, float or double) is data, so
/// one binding type serves every layer whatever the backend computes in.

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/layer_traits.hpp"
#include "kfac/layers/number_view.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::detail {

/// The host's layer: type-erased access to the views its layer_traits give. A layer whose
/// traits have the single-view form reports one application per pass.
struct layer_binding {
    /// The record's name: the registered name, or for group j of a grouped convolution (one
    /// record per group, see group_views.hpp) "<registered name>/group<j>".
    std::string name;
    std::string registered_name;  ///< the name register_layer() was given
    std::int64_t group = 0;       ///< which of description.groups() blocks the record is
    layer_description description;
    void* layer = nullptr;
    std::int64_t (*applications)(const void*) = nullptr;
    number_view<const void> (*activations)(const void*, std::int64_t) = nullptr;
    number_view<const void> (*output_gradients)(const void*, std::int64_t) = nullptr;
    number_view<void> (*weight_gradient)(void*) = nullptr;
    number_view<void> (*bias_gradient)(void*) = nullptr;
    bool (*has_gradient)(const void*) = nullptr;  ///< null: always has one
    void (*end_pass)(void*) = nullptr;            ///< null: nothing to tell the host

    [[nodiscard]] std::int64_t applications_now() const { return applications(layer); }
    [[nodiscard]] number_view<const void> activations_of(std::int64_t i) const { return activations(layer, i); }
    [[nodiscard]] number_view<const void> output_gradients_of(std::int64_t i) const {
        return output_gradients(layer, i);
    }
    [[nodiscard]] bool gradient_present() const { return has_gradient == nullptr || has_gradient(layer); }
};

/// A view member's result as a number_view: as it is, or through a tensor_view of the
/// layer's scalar type (which accepts whatever converts to one).
template <class Scalar, class View>
number_view<const void> read_view(View&& v) {
    if constexpr (std::is_same_v<std::decay_t<View>, number_view<const void>>) return v;
    else return number_view<const void>(tensor_view<const Scalar>(std::forward<View>(v)));
}
template <class Scalar, class View>
number_view<void> write_view(View&& v) {
    if constexpr (std::is_same_v<std::decay_t<View>, number_view<void>>) return v;
    else return number_view<void>(tensor_view<Scalar>(std::forward<View>(v)));
}

/// The binding of `layer` (a layer_adapter): everything but the name, the description read
/// through describe().
template <class Layer>
layer_binding bind_layer(Layer& layer) {
    using traits = layer_traits<Layer>;
    using scalar = typename traits::scalar_type;
    layer_binding b;
    b.description = traits::describe(layer);
    b.layer = static_cast<void*>(&layer);
    if constexpr (traits_have_applications<Layer>) {
        b.applications = [](const void* p) {
            return static_cast<std::int64_t>(traits::applications(*static_cast<const Layer*>(p)));
        };
        b.activations = [](const void* p, std::int64_t i) {
            return read_view<scalar>(traits::activations(*static_cast<const Layer*>(p), i));
        };
        b.output_gradients = [](const void* p, std::int64_t i) {
            return read_view<scalar>(traits::output_gradients(*static_cast<const Layer*>(p), i));
        };
    } else {
        b.applications = [](const void*) { return std::int64_t{1}; };
        b.activations = [](const void* p, std::int64_t) {
            return read_view<scalar>(traits::activations(*static_cast<const Layer*>(p)));
        };
        b.output_gradients = [](const void* p, std::int64_t) {
            return read_view<scalar>(traits::output_gradients(*static_cast<const Layer*>(p)));
        };
    }
    b.weight_gradient = [](void* p) {
        return write_view<scalar>(traits::weight_gradient(*static_cast<Layer*>(p)));
    };
    b.bias_gradient = [](void* p) {
        return write_view<scalar>(traits::bias_gradient(*static_cast<Layer*>(p)));
    };
    if constexpr (traits_have_gradient_presence<Layer>)
        b.has_gradient = [](const void* p) {
            return static_cast<bool>(traits::has_gradient(*static_cast<const Layer*>(p)));
        };
    if constexpr (traits_have_end_pass<Layer>)
        b.end_pass = [](void* p) { traits::end_pass(*static_cast<Layer*>(p)); };
    return b;
}

}  // namespace kfac::detail
