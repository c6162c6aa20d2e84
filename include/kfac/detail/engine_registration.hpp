// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_registration.hpp
/// Layers in: the checks of a description against the backend and the layers already
/// registered, the skip and reduce filters (compiled once, at construction), and the records a
/// layer becomes: one, or one per group of a grouped convolution.

#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kfac/detail/engine.hpp"
#include "kfac/detail/layer_binding.hpp"
#include "kfac/layers/any_layer.hpp"
#include "kfac/layers/layer_traits.hpp"

namespace kfac::detail {

template <class Backend, class CommPolicy, class ComputeMethod>
template <class Layer>
bool engine<Backend, CommPolicy, ComputeMethod>::register_layer(const std::string& name, Layer& layer) {
    auto records = make_records(name, layer, {});
    if (records.empty()) return false;
    for (auto& r : records) layers_.push_back(std::move(r));
    return true;
}

template <class Backend, class CommPolicy, class ComputeMethod>
template <class Layer>
std::size_t engine<Backend, CommPolicy, ComputeMethod>::register_layers(
    const std::vector<std::pair<std::string, Layer*>>& list) {
    std::vector<layer_record> records;
    records.reserve(list.size());
    std::size_t registered = 0;
    for (const auto& [name, layer] : list) {
        if (layer == nullptr) throw error("layer '" + name + "': register_layers() was given a null layer");
        auto blocks = make_records(name, *layer, records);
        registered += blocks.empty() ? 0 : 1;
        for (auto& r : blocks) records.push_back(std::move(r));
    }
    layers_.reserve(layers_.size() + records.size());
    for (auto& r : records) layers_.push_back(std::move(r));
    return registered;
}

/// The checked records of `layer` (none when options.skip_layers matches it), also checked
/// against `pending`, records about to be registered with it: one record, or one per group
/// of a grouped convolution. Changes nothing.
template <class Backend, class CommPolicy, class ComputeMethod>
template <class Layer>
auto engine<Backend, CommPolicy, ComputeMethod>::make_records(const std::string& name, Layer& layer,
                                                              const std::vector<layer_record>& pending) const
    -> std::vector<layer_record> {
    static_assert(detail::check_layer_adapter<Layer>());
    if constexpr (layer_adapter<Layer>) {
        using traits = layer_traits<Layer>;
        if (steps_ > 0 || started_)
            throw error("layer '" + name +
                        "': register_layer() after the first accumulate() "
                        "or step(); register every layer before training starts");
        const void* object = detail::bind_layer(layer).layer;
        layer_description d = traits::describe(layer);
        const std::int64_t groups = d.groups() > 1 ? d.groups() : 1;
        const std::string block_prefix = name + "/group";
        auto block_name = [&](std::int64_t j) { return groups == 1 ? name : block_prefix + std::to_string(j); };
        // Taken: the name itself, or (for a grouped layer) any "<name>/group..." record name;
        // one comparison per registered record, however many groups either layer has.
        for (const auto* registered : {&layers_, &pending})
            for (const auto& l : *registered) {
                const bool taken = l.host.name == name || l.host.registered_name == name ||
                                   (groups > 1 && l.host.name.rfind(block_prefix, 0) == 0);
                if (taken)
                    throw error("layer '" + name +
                                "' is already registered; give each layer a "
                                "unique name");
                // Two registrations of one object would fold its statistics in twice and
                // precondition its gradient twice.
                if (l.host.layer == object)
                    throw error("layer '" + name + "': this layer object is already registered as '" +
                                l.host.registered_name + "'; register each layer object once, under one name");
            }
        if (skipped(name, d.kind)) return {};
        if (reduces(name, d.kind)) d.sharing = weight_sharing::reduce;
        detail::check_description(name, d);
        check_backend_supports(name, d);
        std::vector<layer_record> records(static_cast<std::size_t>(d.groups()));
        for (std::int64_t j = 0; j < d.groups(); ++j) {
            auto& r = records[static_cast<std::size_t>(j)];
            r.host = detail::bind_layer(layer);
            r.host.name = block_name(j);
            r.host.registered_name = name;
            r.host.group = j;
            r.host.description = d;
            r.block = &block_of(d);
            r.block->start(r.state, d);
            const blocks::block_layout b = r.block->layout(d);
            storage_.store(r.state, b.a_structure, b.g_structure);  // the identity start: fp16 holds it
            r.block->clear_statistic(r.statistics, d);
        }
        return records;
    }
    return {};
}

/// What this backend and scalar type cannot hold, refused by name before registration.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::check_backend_supports(const std::string& name,
                                                                        const layer_description& d) {
    const named_layer who{name, describe_layer(name, d)};
    if constexpr (requires { Backend::unsupported_layer(d); }) {
        const std::string why = Backend::unsupported_layer(d);
        if (!why.empty()) throw layer_error(who, why);
    }
    if constexpr (requires { method::unsupported_layer(d); }) {
        const std::string why = method::unsupported_layer(d);
        if (!why.empty()) throw layer_error(who, why);
    }
    block_of(d).check_backend(who, d);
}

template <class Backend, class CommPolicy, class ComputeMethod>
auto engine<Backend, CommPolicy, ComputeMethod>::block_of(const layer_description& d)
    -> const blocks::block<Backend, method>& {
    return blocks::block_for<Backend, method>(d);
}

template <class Backend, class CommPolicy, class ComputeMethod>
bool engine<Backend, CommPolicy, ComputeMethod>::skipped(const std::string& name, layer_kind kind) const {
    return skip_filter_.match_layer(name, kind);
}

/// An Embedding has no positions to share a weight over (its rows are the tokens): the
/// reduce_layers patterns leave it as it is.
template <class Backend, class CommPolicy, class ComputeMethod>
bool engine<Backend, CommPolicy, ComputeMethod>::reduces(const std::string& name, layer_kind kind) const {
    return kind != layer_kind::embedding && reduce_filter_.match_name(name);
}

template <class Backend, class CommPolicy, class ComputeMethod>
std::size_t engine<Backend, CommPolicy, ComputeMethod>::index_of(const std::string& name) const {
    for (std::size_t i = 0; i < layers_.size(); ++i)
        if (layers_[i].host.name == name) return i;
    throw error("no layer named '" + name + "' is registered");
}

}  // namespace kfac::detail
