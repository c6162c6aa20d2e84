// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file tensor_view.hpp
/// A non-owning view of a dense, C-order (row-major, contiguous) array in host or device memory.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>

#include "kfac/config.hpp"

namespace kfac {

/// Most dimensions a view may have (a Linear input may carry extra leading dimensions).
inline constexpr int max_view_rank = 8;

/// Where a view's elements live. Every backend reads host views; device views (a GPU
/// framework's buffers, used in place without a copy) need a device backend such as
/// kfac::backend::cuda, and a host backend rejects them with an error naming the layer.
enum class memory_space {
    host,    ///< the CPU's memory
    device,  ///< a GPU's memory (a device backend's)
};

/// "host" or "device".
[[nodiscard]] constexpr const char* memory_space_name(memory_space m) noexcept {
    return m == memory_space::host ? "host" : "device";
}

/// Pointer plus extents and the memory the pointer refers to; the elements are contiguous
/// in C order. `T` may be const. A default-constructed view is empty (data == nullptr),
/// which means "not available".
template <class T>
struct tensor_view {
    T* data = nullptr;                                   ///< the first element; null: an empty view
    int rank = 0;                                        ///< dimensions, 0 to max_view_rank
    std::array<std::int64_t, max_view_rank> extents{};  ///< the first `rank` are the shape
    memory_space space = memory_space::host;             ///< where `data` points

    tensor_view() = default;
    /// A view of `ptr` with `shape`, in `where`.
    /// @throws kfac::error when the shape has more than max_view_rank dimensions.
    tensor_view(T* ptr, std::initializer_list<std::int64_t> shape, memory_space where = memory_space::host)
        : data(ptr), space(where) {
        if (shape.size() > static_cast<std::size_t>(max_view_rank)) throw rank_error(shape.size());
        for (std::int64_t e : shape) extents[static_cast<std::size_t>(rank++)] = e;
    }
    /// A view of `ptr` with the extents of any range `shape` (an xtensor shape, say).
    /// @throws kfac::error when the shape has more than max_view_rank dimensions.
    template <class Extents>
    static tensor_view from_extents(T* ptr, const Extents& shape, memory_space where = memory_space::host) {
        tensor_view v;
        v.data = ptr;
        v.space = where;
        for (auto e : shape) {
            if (v.rank == max_view_rank) throw rank_error(std::size(shape));
            v.extents[static_cast<std::size_t>(v.rank++)] = static_cast<std::int64_t>(e);
        }
        return v;
    }

    [[nodiscard]] bool empty() const noexcept { return data == nullptr; }  ///< whether it is "not available"

    /// The error for a shape of too many dimensions (the preconditioner adds the layer's name).
    static error rank_error(std::size_t rank) {
        return error("a tensor_view of rank " + std::to_string(rank) + " was requested; views have at most " +
                     std::to_string(max_view_rank) + " dimensions (kfac::max_view_rank): flatten leading "
                     "dimensions into one");
    }
    /// Extent of dimension i, for i in [0, rank).
    [[nodiscard]] std::int64_t extent(int i) const { return extents[static_cast<std::size_t>(i)]; }
    /// The number of elements: the product of the extents (1 for rank 0).
    [[nodiscard]] std::int64_t size() const noexcept {
        std::int64_t n = 1;
        for (int i = 0; i < rank; ++i) n *= extents[static_cast<std::size_t>(i)];
        return n;
    }
    /// "[8, 6]"-style text for error messages.
    [[nodiscard]] std::string shape_string() const {
        std::string s = "[";
        for (int i = 0; i < rank; ++i) {
            if (i) s += ", ";
            s += std::to_string(extents[static_cast<std::size_t>(i)]);
        }
        return s + "]";
    }
};

/// The same view, read-only.
template <class T>
[[nodiscard]] tensor_view<const T> as_const(const tensor_view<T>& v) noexcept {
    tensor_view<const T> c;
    c.data = v.data;
    c.rank = v.rank;
    c.extents = v.extents;
    c.space = v.space;
    return c;
}

}  // namespace kfac
