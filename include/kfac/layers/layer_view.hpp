// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_view.hpp
/// The plain adapter: a struct of non-owning views (pointer + shape) over buffers the host
/// owns, for hosts that keep activations and gradients in their own arrays.

#include "kfac/layers/layer_traits.hpp"

namespace kfac {

/// A layer described by its shapes and four views (shapes by kind: Linear, Conv2d; a Conv1d
/// drops H; an Embedding's input is its token ids [positions...] as Scalar values, its output
/// gradient [positions..., E] and its weight gradient [V, E]). Point the views at the
/// current buffers before each accumulate()/step(); the preconditioner keeps a pointer to this
/// struct, not copies of the views.
template <class Scalar>
struct layer_view {
    layer_description description{};          ///< kind and shapes
    tensor_view<const Scalar> input{};        ///< [..., in] or [N, C_in, H, W]
    tensor_view<const Scalar> grad_output{};  ///< [..., out] or [N, C_out, H_out, W_out]
    tensor_view<Scalar> grad_weight{};        ///< [out, in] or [C_out, C_in, k_h, k_w]
    tensor_view<Scalar> grad_bias{};          ///< [out], empty without bias
};

/// The adapter of a layer_view: each member returns the view's field of that role.
template <class Scalar>
struct layer_traits<layer_view<Scalar>> {
    ///@{
    /// The layer_traits members (kfac/layers/layer_traits.hpp): `description`, `input`,
    /// `grad_output`, `grad_weight` and `grad_bias` of the layer_view, as they are.
    using scalar_type = Scalar;
    static layer_description describe(const layer_view<Scalar>& l) { return l.description; }
    static tensor_view<const Scalar> activations(const layer_view<Scalar>& l) { return l.input; }
    static tensor_view<const Scalar> output_gradients(const layer_view<Scalar>& l) {
        return l.grad_output;
    }
    static tensor_view<Scalar> weight_gradient(layer_view<Scalar>& l) { return l.grad_weight; }
    static tensor_view<Scalar> bias_gradient(layer_view<Scalar>& l) { return l.grad_bias; }
    ///@}
};

}  // namespace kfac
