// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_binding.hpp
/// A host's layer behind one type: its views and optional members as function pointers over a
/// `void*`, made from the layer's kfac::layer_traits (layer_traits.hpp) by bind_layer().

#include <cstdint>
#include <string>

#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/layer_traits.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::detail {

/// The host's layer: type-erased access to the views its layer_traits give. A layer whose
/// traits have the single-view form reports one application per pass.
template <class Scalar>
struct layer_binding {
    /// The record's name: the registered name, or for group j of a grouped convolution (one
    /// record per group, see group_views.hpp) "<registered name>/group<j>".
    std::string name;
    std::string registered_name;  ///< the name register_layer() was given
    std::int64_t group = 0;       ///< which of description.groups() blocks the record is
    layer_description description;
    void* layer = nullptr;
    std::int64_t (*applications)(const void*) = nullptr;
    tensor_view<const Scalar> (*activations)(const void*, std::int64_t) = nullptr;
    tensor_view<const Scalar> (*output_gradients)(const void*, std::int64_t) = nullptr;
    tensor_view<Scalar> (*weight_gradient)(void*) = nullptr;
    tensor_view<Scalar> (*bias_gradient)(void*) = nullptr;
    bool (*has_gradient)(const void*) = nullptr;  ///< null: always has one
    void (*end_pass)(void*) = nullptr;            ///< null: nothing to tell the host

    [[nodiscard]] std::int64_t applications_now() const { return applications(layer); }
    [[nodiscard]] tensor_view<const Scalar> activations_of(std::int64_t i) const { return activations(layer, i); }
    [[nodiscard]] tensor_view<const Scalar> output_gradients_of(std::int64_t i) const {
        return output_gradients(layer, i);
    }
    [[nodiscard]] bool gradient_present() const { return has_gradient == nullptr || has_gradient(layer); }
};

/// The binding of `layer` (a layer_adapter of Scalar): everything but the name, the
/// description read through describe().
template <class Scalar, class Layer>
layer_binding<Scalar> bind_layer(Layer& layer) {
    using traits = layer_traits<Layer>;
    layer_binding<Scalar> b;
    b.description = traits::describe(layer);
    b.layer = static_cast<void*>(&layer);
    if constexpr (traits_have_applications<Layer>) {
        b.applications = [](const void* p) {
            return static_cast<std::int64_t>(traits::applications(*static_cast<const Layer*>(p)));
        };
        b.activations = [](const void* p, std::int64_t i) {
            return tensor_view<const Scalar>(traits::activations(*static_cast<const Layer*>(p), i));
        };
        b.output_gradients = [](const void* p, std::int64_t i) {
            return tensor_view<const Scalar>(traits::output_gradients(*static_cast<const Layer*>(p), i));
        };
    } else {
        b.applications = [](const void*) { return std::int64_t{1}; };
        b.activations = [](const void* p, std::int64_t) {
            return tensor_view<const Scalar>(traits::activations(*static_cast<const Layer*>(p)));
        };
        b.output_gradients = [](const void* p, std::int64_t) {
            return tensor_view<const Scalar>(traits::output_gradients(*static_cast<const Layer*>(p)));
        };
    }
    b.weight_gradient = [](void* p) { return tensor_view<Scalar>(traits::weight_gradient(*static_cast<Layer*>(p))); };
    b.bias_gradient = [](void* p) { return tensor_view<Scalar>(traits::bias_gradient(*static_cast<Layer*>(p))); };
    if constexpr (traits_have_gradient_presence<Layer>)
        b.has_gradient = [](const void* p) {
            return static_cast<bool>(traits::has_gradient(*static_cast<const Layer*>(p)));
        };
    if constexpr (traits_have_end_pass<Layer>)
        b.end_pass = [](void* p) { traits::end_pass(*static_cast<Layer*>(p)); };
    return b;
}

}  // namespace kfac::detail
