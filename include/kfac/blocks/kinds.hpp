// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kinds.hpp
/// The list of block kinds (kfac/blocks/block.hpp), and a layer's kind found from its
/// description. A new kind of block is its own header plus one entry in `block_kinds`.

#include <string>

#include "kfac/blocks/block.hpp"
#include "kfac/blocks/diagonal.hpp"
#include "kfac/blocks/kronecker.hpp"
#include "kfac/blocks/unit_wise.hpp"
#include "kfac/config.hpp"

namespace kfac::blocks {

/// A list of block kinds, as a type.
template <class... Kinds>
struct kind_list {};

/// Every block kind; a layer is the first kind that holds() it.
using block_kinds = kind_list<kronecker, diagonal, unit_wise>;

/// visit_kind() among the kinds `Kind, Rest...`, in order.
/// @throws kfac::error when none of them holds `d`.
template <class Visit, class Kind, class... Rest>
decltype(auto) visit_kind_among(const layer_description& d, Visit& visit, kind_list<Kind, Rest...>) {
    if (Kind::holds(d)) return visit.template operator()<Kind>();
    if constexpr (sizeof...(Rest) > 0) {
        return visit_kind_among(d, visit, kind_list<Rest...>{});
    } else {
        throw error(std::string("no block kind (kfac/blocks/kinds.hpp) holds a layer of kind ") + kind_name(d.kind) +
                    "; add one");
    }
}

/// `visit.template operator()<Kind>()` for the kind of `d`.
template <class Visit>
decltype(auto) visit_kind(const layer_description& d, Visit&& visit) {
    return visit_kind_among(d, visit, block_kinds{});
}

/// The storage of `d`'s block, from its description alone.
[[nodiscard]] inline block_layout layout_of(const layer_description& d) {
    return visit_kind(d, [&]<class Kind>() { return Kind::layout(d); });
}

/// The operations of `d`'s block on Backend under Method: one instance per kind, shared.
template <class Backend, class Method>
[[nodiscard]] const block<Backend, Method>& block_for(const layer_description& d) {
    return visit_kind(d, [&]<class Kind>() -> const block<Backend, Method>& {
        static const typename Kind::template ops<Backend, Method> instance{};
        return instance;
    });
}

}  // namespace kfac::blocks
