// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file number_view.hpp
/// A tensor_view whose element format is known at run time: how the preconditioner holds the
/// views of a layer whose elements are not its backend's compute type (bf16 activations on a
/// float backend, say), without a template parameter per element type.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kfac/layers/tensor_view.hpp"
#include "kfac/precision.hpp"

namespace kfac {

/// A view of `void` (writable) or `const void` (read-only) elements in `format`.
template <class Void>
struct number_view : tensor_view<Void> {
    precision format = precision::fp32;  ///< the elements' format

    number_view() = default;
    /// The view of a tensor_view of a number_type.
    template <class T>
        requires number_type<std::remove_const_t<T>> && std::is_convertible_v<T*, Void*>
    number_view(const tensor_view<T>& v)  // NOLINT(google-explicit-constructor): a view is a view
        : format(precision_of<std::remove_const_t<T>>) {
        this->data = v.data;
        this->rank = v.rank;
        this->extents = v.extents;
        this->space = v.space;
    }

    /// The view as elements of T (whose format must be this view's).
    template <class T>
    [[nodiscard]] tensor_view<T> as() const noexcept {
        tensor_view<T> v;
        v.data = static_cast<T*>(this->data);
        v.rank = this->rank;
        v.extents = this->extents;
        v.space = this->space;
        return v;
    }
    [[nodiscard]] std::size_t element_bytes() const noexcept { return bytes_of(format); }  ///< bytes of one element
};

/// The same view, read-only.
[[nodiscard]] inline number_view<const void> as_const(const number_view<void>& v) noexcept {
    number_view<const void> c;
    static_cast<tensor_view<const void>&>(c) = as_const(static_cast<const tensor_view<void>&>(v));
    c.format = v.format;
    return c;
}

/// Group `group` of `groups` equal blocks of dimension 0 of a number_view (see
/// detail::group_rows for typed views).
template <class Void>
[[nodiscard]] number_view<Void> group_rows(number_view<Void> v, std::int64_t group, std::int64_t groups) {
    if (v.empty() || groups == 1 || v.rank == 0 || v.extent(0) == 0) return v;
    const std::int64_t row_elements = v.size() / v.extent(0);
    const std::int64_t rows = v.extent(0) / groups;
    using byte = std::conditional_t<std::is_const_v<Void>, const std::byte, std::byte>;
    v.data = static_cast<byte*>(v.data) +
             static_cast<std::size_t>(group * rows * row_elements) * v.element_bytes();
    v.extents[0] = rows;
    return v;
}

}  // namespace kfac
