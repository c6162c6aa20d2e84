// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file view_conversion.hpp
/// A host's view in another format than the backend computes in (bf16 activations on a
/// float backend, float gradients on a double one): read into a buffer of the compute type,
/// and for a gradient written back, rounded once to the view's own format. A view already in
/// the compute type is used in place, as before.

#include <cstdint>
#include <string>
#include <vector>

#include "kfac/detail/layer_checks.hpp"
#include "kfac/detail/number_conversion.hpp"
#include "kfac/layers/number_view.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/precision.hpp"

namespace kfac::detail {

/// Whether the view must be converted to be read as Scalar.
template <class Scalar, class Void>
[[nodiscard]] bool needs_conversion(const number_view<Void>& v) noexcept {
    return !v.empty() && v.format != precision_of<Scalar>;
}

/// A view in another format than the compute type must be in host memory: a device backend
/// reads device views only in its own type.
template <class Scalar, class Void>
void check_convertible(const named_layer& who, const char* what, const number_view<Void>& v) {
    if (!needs_conversion<Scalar>(v) || v.space == memory_space::host) return;
    throw layer_error(who, std::string("the ") + what + " view " + v.shape_string() + " holds " +
                               precision_name(v.format) + " elements in device memory, and the backend computes in " +
                               precision_name(precision_of<Scalar>) +
                               "; device views are read in the backend's own type only: hand the layer's tensors "
                               "in " + precision_name(precision_of<Scalar>) + ", or host views in any format");
}

/// The view as Scalar: in place when it is, else widened (or, double into float, rounded to
/// nearest) into `buffer`, which then holds the elements.
template <class Scalar>
[[nodiscard]] tensor_view<const Scalar> in_compute_precision(const number_view<const void>& v,
                                                             std::vector<Scalar>& buffer) {
    tensor_view<const Scalar> out = v.template as<const Scalar>();
    if (!needs_conversion<Scalar>(v)) return out;
    buffer.resize(static_cast<std::size_t>(v.size()));
    widen(v.data, v.size(), v.format, buffer.data());
    out.data = buffer.data();
    return out;
}

/// A writable view as Scalar: in place when it is, else a copy in `buffer` (which
/// store_converted() writes back).
template <class Scalar>
[[nodiscard]] tensor_view<Scalar> in_compute_precision(const number_view<void>& v, std::vector<Scalar>& buffer) {
    tensor_view<Scalar> out = v.template as<Scalar>();
    if (!needs_conversion<Scalar>(v)) return out;
    buffer.resize(static_cast<std::size_t>(v.size()));
    widen(v.data, v.size(), v.format, buffer.data());
    out.data = buffer.data();
    return out;
}

/// Writes a converted copy back into the host's view, each element rounded once to the
/// view's format (nothing to do for a view read in place).
template <class Scalar>
void store_converted(const std::vector<Scalar>& buffer, const number_view<void>& v) {
    if (!needs_conversion<Scalar>(v)) return;
    narrow(buffer.data(), v.size(), v.format, v.data);
}

}  // namespace kfac::detail
