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

#include "kfac/detail/group_views.hpp"
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

/// Whether the backend converts device views itself (a device backend: widen_device_view and
/// narrow_device_view, kfac/backend/cuda.cuh).
template <class Backend>
concept backend_with_device_conversion = requires(const number_view<const void>& v, const number_view<void>& w,
                                                  typename Backend::channel_buffer& buffer,
                                                  const typename Backend::scalar_type* from) {
    Backend::widen_device_view(v, buffer);
    Backend::narrow_device_view(from, w);
};

/// Where a record keeps the compute-type copy of one view: host memory for a host view, the
/// backend's device buffer for a device view.
template <class Backend>
struct converted_view {
    using scalar = typename Backend::scalar_type;
    std::vector<scalar> host;
    typename channel_buffer_of<Backend, scalar>::type device{};
    [[nodiscard]] std::size_t bytes() const noexcept { return (host.size() + device.size()) * sizeof(scalar); }
};

/// A view in another format than the compute type is read on the host, or in device memory
/// by a backend that converts device views; anything else names the view and the fix.
template <class Backend, class Void>
void check_convertible(const named_layer& who, const char* what, const number_view<Void>& v) {
    using scalar = typename Backend::scalar_type;
    if (!needs_conversion<scalar>(v) || v.space == memory_space::host || backend_with_device_conversion<Backend>)
        return;
    throw layer_error(who, std::string("the ") + what + " view " + v.shape_string() + " holds " +
                               precision_name(v.format) + " elements in device memory, and the backend computes in " +
                               precision_name(precision_of<scalar>) +
                               " without converting device views; hand the layer's tensors in " +
                               precision_name(precision_of<scalar>) + ", or host views in any format");
}

/// The view as the compute type: in place when it is, else widened (or, double into float,
/// rounded to nearest) into `copy`, which then holds the elements.
template <class Backend>
[[nodiscard]] tensor_view<const typename Backend::scalar_type> in_compute_precision(const number_view<const void>& v,
                                                                                   converted_view<Backend>& copy) {
    using scalar = typename Backend::scalar_type;
    tensor_view<const scalar> out = v.template as<const scalar>();
    if (!needs_conversion<scalar>(v)) return out;
    if (v.space == memory_space::device) {
        if constexpr (backend_with_device_conversion<Backend>) return Backend::widen_device_view(v, copy.device);
    }
    copy.host.resize(static_cast<std::size_t>(v.size()));
    widen(v.data, v.size(), v.format, copy.host.data());
    out.data = copy.host.data();
    return out;
}

/// A writable view as the compute type: in place when it is, else a copy in `copy` (which
/// store_converted() writes back).
template <class Backend>
[[nodiscard]] tensor_view<typename Backend::scalar_type> in_compute_precision(const number_view<void>& v,
                                                                             converted_view<Backend>& copy) {
    using scalar = typename Backend::scalar_type;
    const tensor_view<const scalar> read = in_compute_precision(as_const(v), copy);
    tensor_view<scalar> out = v.template as<scalar>();
    out.data = const_cast<scalar*>(read.data);  // the host's buffer, or our own copy
    return out;
}

/// Whether the host's view is in a format narrower than the compute type (a finite value of the
/// compute type may round to ±Inf there): a 16-bit format, or float on a double backend.
template <class Scalar, class Void>
[[nodiscard]] bool narrower_than_compute(const number_view<Void>& v) noexcept {
    return needs_conversion<Scalar>(v) && largest_finite(v.format) < largest_finite(precision_of<Scalar>);
}

/// Whether every value of a converted copy rounds to a finite value of the host view's format
/// (true for a view read in place, or one at least as wide as the compute type): counted by
/// the backend for a device view (count_beyond_format, kfac/backend/cuda.cuh), on the host else.
template <class Backend>
[[nodiscard]] bool converted_fits(const converted_view<Backend>& copy, const number_view<void>& v) {
    using scalar = typename Backend::scalar_type;
    if (!narrower_than_compute<scalar>(v)) return true;
    if (v.space == memory_space::device) {
        if constexpr (requires { Backend::count_beyond_format(copy.device.data(), v.size(), v.format); })
            return Backend::count_beyond_format(copy.device.data(), v.size(), v.format) == 0;
        else
            throw error("a device view narrower than the compute type needs a backend that counts values beyond "
                        "its format (count_beyond_format); this backend has none");
    }
    return count_beyond_format(copy.host.data(), v.size(), v.format) == 0;
}

/// Writes a converted copy back into the host's view, each element rounded once to the
/// view's format (nothing to do for a view read in place).
template <class Backend>
void store_converted(const converted_view<Backend>& copy, const number_view<void>& v) {
    using scalar = typename Backend::scalar_type;
    if (!needs_conversion<scalar>(v)) return;
    if (v.space == memory_space::device) {
        if constexpr (backend_with_device_conversion<Backend>) {
            Backend::narrow_device_view(copy.device.data(), v);
            return;
        }
    }
    narrow(copy.host.data(), v.size(), v.format, v.data);
}

}  // namespace kfac::detail
