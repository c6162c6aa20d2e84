// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file xtensor_layer.hpp
/// Adapter for hosts that keep a layer's tensors in xtensor containers (`xt::xtensor`,
/// `xt::xarray`, or any row-major xtensor container with data() and shape()). Optional: only
/// this header needs xtensor.

#include <string>

#include <xtensor/xlayout.hpp>

#include "kfac/layers/layer_traits.hpp"

namespace kfac {

/// References to the four containers of one layer. The containers are read in place (no
/// copy); they must be row-major, which is xtensor's default layout.
template <class Container>
struct xtensor_layer {
    using scalar_type = typename Container::value_type;  ///< the containers' element type
    layer_description description{};                     ///< kind and shapes
    const Container* input = nullptr;        ///< activations, shaped as layer_view::input
    const Container* grad_output = nullptr;  ///< output gradients, shaped as layer_view::grad_output
    Container* grad_weight = nullptr;        ///< weight gradient, shaped as layer_view::grad_weight
    Container* grad_bias = nullptr;  ///< nullptr without bias
};

namespace detail {

template <class T, class Container>
tensor_view<T> view_of(Container* c, const char* what) {
    if (c == nullptr) return {};
    if (c->layout() != xt::layout_type::row_major)
        throw error(std::string("xtensor_layer: the ") + what +
                    " container is not row-major; use xt::layout_type::row_major containers");
    return tensor_view<T>::from_extents(c->data(), c->shape());
}

}  // namespace detail

/// The adapter of an xtensor_layer: views of its containers, read in place.
template <class Container>
struct layer_traits<xtensor_layer<Container>> {
    ///@{
    /// The layer_traits members (kfac/layers/layer_traits.hpp): the description, and a view of
    /// each container (an empty one for a null pointer).
    /// @throws kfac::error from a view member when its container is not row-major.
    using scalar_type = typename Container::value_type;
    using layer = xtensor_layer<Container>;
    static layer_description describe(const layer& l) { return l.description; }
    static tensor_view<const scalar_type> activations(const layer& l) {
        return detail::view_of<const scalar_type>(l.input, "input");
    }
    static tensor_view<const scalar_type> output_gradients(const layer& l) {
        return detail::view_of<const scalar_type>(l.grad_output, "grad_output");
    }
    static tensor_view<scalar_type> weight_gradient(layer& l) {
        return detail::view_of<scalar_type>(l.grad_weight, "grad_weight");
    }
    static tensor_view<scalar_type> bias_gradient(layer& l) {
        return detail::view_of<scalar_type>(l.grad_bias, "grad_bias");
    }
    ///@}
};

}  // namespace kfac
