// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_traits.hpp
/// The customisation point through which any host framework hands layers to the library.
///
/// Specialise `kfac::layer_traits<Layer>` for your layer type. A specialisation provides
/// exactly these members (all static; views are non-owning and C-order contiguous):
///
/// ```
/// template <> struct kfac::layer_traits<MyLayer> {
///     using scalar_type = float;  // float, double, or bf16/fp16 (kfac/precision.hpp)
///     static kfac::layer_description describe(const MyLayer&);   // kind and shapes
///     // Input of the last forward pass: Linear [..., in] (leading dims are flattened into
///     // rows), Conv2d [N, C_in, H, W], Conv1d [N, C_in, L], Embedding the token ids
///     // [positions...] as scalar_type values. An empty view means "nothing captured".
///     static kfac::tensor_view<const scalar_type> activations(const MyLayer&);
///     // Gradient of the loss w.r.t. the layer output: Linear [..., out],
///     // Conv2d [N, C_out, H_out, W_out], Embedding [positions..., E]; as the framework
///     // delivers it (not rescaled).
///     static kfac::tensor_view<const scalar_type> output_gradients(const MyLayer&);
///     // Weight gradient [out, in], [C_out, C_in, k_h, k_w], [C_out, C_in, k] or an
///     // Embedding's [V, E]; overwritten by step().
///     static kfac::tensor_view<scalar_type> weight_gradient(MyLayer&);
///     // Bias gradient [out]; an empty view when the layer has no bias.
///     static kfac::tensor_view<scalar_type> bias_gradient(MyLayer&);
/// };
/// ```
///
/// activations() and output_gradients() are read only on factor-update steps (by
/// preconditioner::accumulate() and step()); the gradients on every step().
/// The views must stay valid until the call that reads them returns.
///
/// scalar_type need not be the backend's: views in another format are read into the
/// backend's compute type (exactly, but for double into float, which rounds), statistics are
/// formed there, and the preconditioned gradient is rounded once back into scalar_type. A
/// 16-bit scalar_type is any type declared through kfac::number_format: Eigen::bfloat16 and
/// Eigen::half (kfac/layers/eigen_number_formats.hpp), LibTorch's and CUDA's. An adapter whose
/// tensors' formats are known only at run time may return kfac::number_view<const void> (and
/// number_view<void> for the gradients) from any view member instead (kfac/layers/number_view.hpp).
///
/// ## Optional members
///
/// A host that sees each call of a layer (a framework with hooks, say) can describe a pass
/// more precisely with these; the preconditioner uses each one it finds:
///
/// ```
///     // How many times the layer was applied in the pass being folded in: 0 when it was not
///     // called (a branch not taken), more than 1 when one layer object is applied several
///     // times in one forward pass (shared weights). With it, these replace the two
///     // single-view members above (which may then be left out):
///     static std::int64_t applications(const MyLayer&);
///     static kfac::tensor_view<const scalar_type> activations(const MyLayer&, std::int64_t i);
///     static kfac::tensor_view<const scalar_type> output_gradients(const MyLayer&, std::int64_t i);
///     // Whether the layer took part in this step's loss: false leaves its gradient buffers
///     // alone (they are not read; weight_gradient() may then return an empty view).
///     static bool has_gradient(const MyLayer&);
///     // Called once the preconditioner is done with the current pass: at the end of every
///     // successful accumulate() and step(), factor-update step or not. An adapter that
///     // collects applications forgets them here, so that the next pass starts empty.
///     static void end_pass(MyLayer&);
/// ```
///
/// The batch statistic of a step is the mean over every application of every pass of the
/// step (KAISA's and kfac-pytorch's rule for a module called several times: each call's
/// statistic is summed and the sum divided by the count), and a layer applied in no pass of a
/// factor-update step keeps its factors unchanged, without decay (kfac-pytorch skips a
/// module whose hooks did not fire).

#include <concepts>
#include <cstdint>

#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/number_view.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/precision.hpp"

namespace kfac {

/// Primary template: defined and empty, so `layer_adapter<T>` can be asked of any type.
template <class Layer>
struct layer_traits {};

namespace detail {

template <class L>
concept traits_have_scalar_type = requires { typename layer_traits<L>::scalar_type; };

template <class L>
concept traits_have_number_scalar = traits_have_scalar_type<L> && number_type<typename layer_traits<L>::scalar_type>;

template <class L>
concept traits_have_describe = requires(const L& l) {
    { layer_traits<L>::describe(l) } -> std::convertible_to<layer_description>;
};

/// A view member's result: a tensor_view of scalar_type, or a number_view whose format is
/// known at run time (an adapter whose tensors' dtypes vary, as LibTorch's under autocast).
template <class R, class Scalar>
concept read_view_of = std::convertible_to<R, tensor_view<const Scalar>> || std::same_as<R, number_view<const void>>;
template <class R, class Scalar>
concept write_view_of = std::convertible_to<R, tensor_view<Scalar>> || std::same_as<R, number_view<void>>;

template <class L>
concept traits_have_activations = traits_have_scalar_type<L> && requires(const L& l) {
    { layer_traits<L>::activations(l) } -> read_view_of<typename layer_traits<L>::scalar_type>;
};

template <class L>
concept traits_have_output_gradients = traits_have_scalar_type<L> && requires(const L& l) {
    { layer_traits<L>::output_gradients(l) } -> read_view_of<typename layer_traits<L>::scalar_type>;
};

/// The optional per-application form (see the file comment).
template <class L>
concept traits_have_applications = traits_have_scalar_type<L> && requires(const L& l, std::int64_t i) {
    { layer_traits<L>::applications(l) } -> std::convertible_to<std::int64_t>;
    { layer_traits<L>::activations(l, i) } -> read_view_of<typename layer_traits<L>::scalar_type>;
    { layer_traits<L>::output_gradients(l, i) } -> read_view_of<typename layer_traits<L>::scalar_type>;
};

/// Either form of the statistics' views.
template <class L>
concept traits_have_statistics =
    (traits_have_activations<L> && traits_have_output_gradients<L>) || traits_have_applications<L>;

template <class L>
concept traits_have_gradient_presence = requires(const L& l) {
    { layer_traits<L>::has_gradient(l) } -> std::convertible_to<bool>;
};

template <class L>
concept traits_have_end_pass = requires(L& l) { layer_traits<L>::end_pass(l); };

template <class L>
concept traits_have_weight_gradient = traits_have_scalar_type<L> && requires(L& l) {
    { layer_traits<L>::weight_gradient(l) } -> write_view_of<typename layer_traits<L>::scalar_type>;
};

template <class L>
concept traits_have_bias_gradient = traits_have_scalar_type<L> && requires(L& l) {
    { layer_traits<L>::bias_gradient(l) } -> write_view_of<typename layer_traits<L>::scalar_type>;
};

}  // namespace detail

/// True when `layer_traits<Layer>` provides every member listed above.
template <class Layer>
concept layer_adapter =
    detail::traits_have_number_scalar<Layer> && detail::traits_have_describe<Layer> &&
    detail::traits_have_statistics<Layer> && detail::traits_have_weight_gradient<Layer> &&
    detail::traits_have_bias_gradient<Layer>;

/// layer_adapter<Layer> as a value.
template <class Layer>
inline constexpr bool is_layer_adapter_v = layer_adapter<Layer>;

namespace detail {

/// Turns a failed `layer_adapter` check into one message per missing member.
template <class Layer>
consteval bool check_layer_adapter() {
    static_assert(traits_have_scalar_type<Layer>,
                  "kfac::layer_traits<Layer> has no `scalar_type`: this layer type has no "
                  "adapter. Specialise kfac::layer_traits for it (see kfac/layers/layer_traits.hpp) "
                  "or wrap it in kfac::layer_view.");
    static_assert(!traits_have_scalar_type<Layer> || traits_have_number_scalar<Layer>,
                  "kfac::layer_traits<Layer>::scalar_type is not an element type kfac reads: use float, "
                  "double, or a bf16/fp16 type declared through kfac::number_format (Eigen::bfloat16 and "
                  "Eigen::half with kfac/layers/eigen_number_formats.hpp; see kfac/precision.hpp).");
    static_assert(traits_have_describe<Layer>,
                  "kfac::layer_traits<Layer> lacks `static layer_description describe(const Layer&)`.");
    static_assert(traits_have_activations<Layer> || traits_have_applications<Layer>,
                  "kfac::layer_traits<Layer> lacks `static tensor_view<const scalar_type> "
                  "activations(const Layer&)` (or the per-application form: applications(), "
                  "activations(const Layer&, std::int64_t) and output_gradients(const Layer&, std::int64_t)).");
    static_assert(traits_have_output_gradients<Layer> || traits_have_applications<Layer>,
                  "kfac::layer_traits<Layer> lacks `static tensor_view<const scalar_type> "
                  "output_gradients(const Layer&)` (or the per-application form).");
    static_assert(traits_have_weight_gradient<Layer>,
                  "kfac::layer_traits<Layer> lacks `static tensor_view<scalar_type> "
                  "weight_gradient(Layer&)`.");
    static_assert(traits_have_bias_gradient<Layer>,
                  "kfac::layer_traits<Layer> lacks `static tensor_view<scalar_type> "
                  "bias_gradient(Layer&)` (return an empty view when there is no bias).");
    return true;
}

}  // namespace detail
}  // namespace kfac
