// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file group_views.hpp
/// The views of one group of a grouped convolution (layer_description::groups() > 1). The
/// preconditioner keeps one record per group: its statistics read the group's channels, copied
/// out of the host's [N, C, spatial...] views (into host memory, or into device memory by a
/// backend with gather_group_channels), and its gradient is the group's rows of the weight and
/// bias gradients, which are contiguous and read in place.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kfac/layers/tensor_view.hpp"

namespace kfac::detail {

/// Group `group` of `groups` equal blocks of dimension 0: the rows of one group's output
/// channels in a [C_out, C_in/groups, kernel...] weight gradient or a [C_out] bias gradient.
/// An empty view stays empty.
template <class T>
[[nodiscard]] tensor_view<T> group_rows(tensor_view<T> v, std::int64_t group, std::int64_t groups) {
    if (v.empty() || groups == 1 || v.rank == 0 || v.extent(0) == 0) return v;
    const std::int64_t row_elements = v.size() / v.extent(0);
    const std::int64_t rows = v.extent(0) / groups;
    v.data += group * rows * row_elements;
    v.extents[0] = rows;
    return v;
}

/// Channels [group·C/groups, (group + 1)·C/groups) of a host view [N, C, spatial...], copied
/// into `buffer`, as the contiguous view [N, C/groups, spatial...] over it. The view must
/// have been checked against its layer (rank ≥ 2, C divisible by groups).
template <class T>
[[nodiscard]] tensor_view<const T> gather_group_channels(const tensor_view<const T>& v, std::int64_t group,
                                                         std::int64_t groups, std::vector<T>& buffer) {
    if (groups == 1 || v.empty()) return v;
    const std::int64_t n = v.extent(0), channels = v.extent(1);
    const std::int64_t per_group = channels / groups;
    const std::int64_t inner = n * channels == 0 ? 0 : v.size() / (n * channels);  // spatial elements
    const std::int64_t block = per_group * inner;
    buffer.resize(static_cast<std::size_t>(n * block));
    for (std::int64_t i = 0; i < n; ++i) {
        const T* src = v.data + (i * channels + group * per_group) * inner;
        std::copy(src, src + block, buffer.data() + i * block);
    }
    tensor_view<const T> out = v;
    out.data = buffer.data();
    out.extents[1] = per_group;
    return out;
}

/// Where a backend gathers a group's channels: its `channel_buffer` (a device backend's device
/// memory), else a host vector.
template <class Backend, class T>
struct channel_buffer_of {
    using type = std::vector<T>;
};
template <class Backend, class T>
    requires requires { typename Backend::channel_buffer; }
struct channel_buffer_of<Backend, T> {
    using type = typename Backend::channel_buffer;
};

/// gather_group_channels by the backend when it has its own (reading host or device views
/// into device memory), else on the host.
template <class Backend, class T>
[[nodiscard]] tensor_view<const T> gather_group_channels_for(const tensor_view<const T>& v, std::int64_t group,
                                                             std::int64_t groups,
                                                             typename channel_buffer_of<Backend, T>::type& buffer) {
    if constexpr (requires { Backend::gather_group_channels(v, group, groups, buffer); })
        return Backend::gather_group_channels(v, group, groups, buffer);
    else
        return gather_group_channels(v, group, groups, buffer);
}

}  // namespace kfac::detail
