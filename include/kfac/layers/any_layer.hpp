// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file any_layer.hpp
/// `kfac::any_layer<Scalar>`: a layer of any adapted type behind one type. It lets code that
/// cannot see a layer's type register it: typically a CUDA translation unit (nvcc) holding a
/// `KFAC<backend::cuda<float>>`, when the host framework's headers do not compile under nvcc
/// (LibTorch 1.13's do not in C++20). The host's own translation unit wraps its layers,
///
/// ```cpp
/// // host.cpp (g++): sees LibTorch
/// std::vector<kfac::any_layer<float>> layers;
/// for (auto* l : tracked) layers.emplace_back(*l);           // kfac::torch::tracked_layer<float>
/// // kfac.cu (nvcc): sees only kfac
/// for (auto& l : layers) precond.register_layer(name, l);
/// ```
///
/// and the preconditioner treats the wrapped layer exactly as the layer itself (its optional
/// members included). Keeps a pointer to the layer, which must outlive it; copies refer to the
/// same layer.

#include <cstdint>
#include <type_traits>

#include "kfac/detail/layer_binding.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/layer_traits.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac {

/// A layer of any adapted type with scalar type Scalar, behind one type (above).
template <class Scalar>
class any_layer {
public:
    /// Wraps `layer`, whose kfac::layer_traits must be complete and of scalar type Scalar.
    template <class Layer>
    explicit any_layer(Layer& layer) : binding_(make(layer)) {}

    /// The wrapped layer's description.
    [[nodiscard]] const layer_description& description() const noexcept { return binding_.description; }
    /// How the preconditioner reaches the wrapped layer (kfac/detail/layer_binding.hpp).
    [[nodiscard]] const detail::layer_binding& binding() const noexcept { return binding_; }

private:
    template <class Layer>
    static detail::layer_binding make(Layer& layer) {
        static_assert(detail::check_layer_adapter<Layer>());
        static_assert(std::is_same_v<typename layer_traits<Layer>::scalar_type, Scalar>,
                      "kfac::any_layer<Scalar>: the layer's layer_traits<Layer>::scalar_type differs from Scalar");
        return detail::bind_layer(layer);
    }

    detail::layer_binding binding_;
};

namespace detail {

/// An any_layer binds as the layer it wraps.
template <class Scalar>
layer_binding bind_layer(any_layer<Scalar>& layer) {
    return layer.binding();
}

}  // namespace detail

/// The per-application form, forwarded to the wrapped layer (for code that reads an
/// any_layer through its traits; the preconditioner uses the wrapped layer's binding itself).
template <class Scalar>
struct layer_traits<any_layer<Scalar>> {
    ///@{
    /// The layer_traits members (kfac/layers/layer_traits.hpp), each forwarded to the wrapped
    /// layer's (end_pass() does nothing when it has none).
    using scalar_type = Scalar;
    using layer = any_layer<Scalar>;
    static layer_description describe(const layer& l) { return l.description(); }
    static std::int64_t applications(const layer& l) { return l.binding().applications_now(); }
    static number_view<const void> activations(const layer& l, std::int64_t i) { return l.binding().activations_of(i); }
    static number_view<const void> output_gradients(const layer& l, std::int64_t i) {
        return l.binding().output_gradients_of(i);
    }
    static bool has_gradient(const layer& l) { return l.binding().gradient_present(); }
    static number_view<void> weight_gradient(layer& l) { return l.binding().weight_gradient(l.binding().layer); }
    static number_view<void> bias_gradient(layer& l) { return l.binding().bias_gradient(l.binding().layer); }
    static void end_pass(layer& l) {
        if (l.binding().end_pass) l.binding().end_pass(l.binding().layer);
    }
    ///@}
};

}  // namespace kfac
