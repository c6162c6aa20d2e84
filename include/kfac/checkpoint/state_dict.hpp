// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file state_dict.hpp
/// A preconditioner's saved state as a value, between its records and the archive (as
/// Distributed Shampoo's distributed_state_dict() sits between its optimizer and the
/// checkpoint layer): save() gathers the records into a state_dict by the distribution plan
/// and writes to_archive() of it; load() reads from_archive() and scatters it back. This
/// header knows the metadata's names and checks (kfac/checkpoint/format.hpp) and nothing of
/// the preconditioner; kfac/detail/engine_checkpoint.hpp gathers and scatters.

#include <charconv>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kfac/checkpoint/format.hpp"
#include "kfac/checkpoint/saved_options.hpp"
#include "kfac/checkpoint/safetensors.hpp"
#include "kfac/detail/configuration_check.hpp"
#include "kfac/health.hpp"

namespace kfac::checkpoint {

/// Everything a checkpoint holds, as values.
struct state_dict {
    std::int64_t step = 0;        ///< steps taken
    std::string scalar;           ///< "float" or "double": the tensors' type
    std::string method;           ///< the compute method whose second-order data it holds
    std::string second_order;     ///< "included", "omitted" or "none yet" (step 0)
    double damping = 0.0;         ///< γ the second-order data was computed with
    std::int64_t world_size = 0;  ///< of the run that saved it (information only)
    std::string strategy;         ///< its distribution strategy (information only)
    health_counters health{};     ///< the counters at save()
    std::map<std::string, std::string> layers;   ///< name → signature (layer_signature())
    std::map<std::string, std::string> options;  ///< name → exact decimal text, or "schedule"
    /// Layer name → W, the weight of the statistics in its running factors (layer_state);
    /// absent for a layer whose W is unknown (a file written before kfac recorded it).
    std::map<std::string, double> statistics_weights;
    /// Per layer, in registration order: `<layer>.A`, `<layer>.G`, then its second-order tensors.
    std::vector<tensor> tensors;
    int version = format_version;  ///< the format version of the file it was read from
    std::string library;           ///< the kfac version that wrote it
};

/// Metadata "fp16_exponent.<tensor>": the power of two an F16 factor's values are scaled by.
inline constexpr const char* fp16_exponent_prefix = "fp16_exponent.";

/// An integer metadata entry that may be negative.
[[nodiscard]] inline std::int64_t metadata_count_or_negative(const archive& a, const std::string& k,
                                                             const std::string& source) {
    const std::string& v = a.metadata.at(k);
    std::int64_t out = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (ec != std::errc() || end != v.data() + v.size())
        throw error("checkpoint " + source + ": metadata '" + k + "' = '" + v + "' is not an integer (the file is corrupt)");
    return out;
}

/// The archive save() writes: the tensors, and the state's fields as metadata, sealed.
[[nodiscard]] inline archive to_archive(state_dict s) {
    archive a;
    a.tensors = std::move(s.tensors);
    auto& m = a.metadata;
    m[key::format] = format_name;
    m[key::version] = std::to_string(format_version);
    m[key::library] = library_version();
    m[key::step] = std::to_string(s.step);
    m[key::scalar] = s.scalar;
    m[key::method] = s.method;
    m[key::second_order] = s.second_order;
    m[key::layers] = std::to_string(s.layers.size());
    m[key::world_size] = std::to_string(s.world_size);
    m[key::strategy] = s.strategy;
    m[key::damping] = detail::exact_number_text(s.damping);
    for (const auto& [name, signature] : s.layers) m[key::layer_prefix + name] = signature;
    for (const auto& [name, value] : s.options) m[key::option_prefix + name] = value;
    for (const auto& [name, w] : s.statistics_weights)
        m[key::statistics_weight_prefix + name] = detail::exact_number_text(w);
    m[key::health_prefix + "skipped_factor_updates"] = std::to_string(s.health.skipped_factor_updates);
    m[key::health_prefix + "kept_decompositions"] = std::to_string(s.health.kept_decompositions);
    m[key::health_prefix + "zeroed_gradients"] = std::to_string(s.health.zeroed_gradients);
    // Written once there is one, so that the files of runs without them stay as they were.
    if (s.health.skipped_steps != 0) m[key::health_prefix + "skipped_steps"] = std::to_string(s.health.skipped_steps);
    if (s.health.fp64_retries != 0) m[key::health_prefix + "fp64_retries"] = std::to_string(s.health.fp64_retries);
    if (s.health.storage_fallbacks != 0)
        m[key::health_prefix + "storage_fallbacks"] = std::to_string(s.health.storage_fallbacks);
    for (const auto& t : a.tensors)  // options.factor_storage fp16: the scale each factor is stored at
        if (t.exponent != 0) m[std::string(fp16_exponent_prefix) + t.name] = std::to_string(t.exponent);
    m[key::checksum_scope] = checksum_scope_all;
    seal(a);  // last: the checksum digests every other entry
    return a;
}

/// The state an archive holds, its header and metadata checked (check_header(); the layer
/// count; the health counters). The tensors' names, shapes and values are checked against
/// the preconditioner that loads them. Files of version 1 carry no world size or strategy.
/// @throws kfac::error naming `source`, the entry, and what was wrong with it.
[[nodiscard]] inline state_dict from_archive(archive a, const std::string& source) {
    const header h = check_header(a, source);
    state_dict s;
    s.version = h.version;
    s.library = h.library;
    s.step = h.step;
    s.scalar = h.scalar;
    s.method = h.method;
    s.second_order = h.second_order;
    s.damping = h.damping;
    for (const auto& [k, v] : a.metadata) {
        if (k.rfind(key::layer_prefix, 0) == 0) s.layers[k.substr(key::layer_prefix.size())] = v;
        if (k.rfind(key::option_prefix, 0) == 0) s.options[k.substr(key::option_prefix.size())] = v;
    }
    for (const auto& [k, v] : a.metadata) {
        if (k.rfind(key::statistics_weight_prefix, 0) != 0) continue;
        const std::string layer = k.substr(key::statistics_weight_prefix.size());
        const double w = metadata_number(a, k, source);
        if (s.layers.count(layer) == 0 || !(w >= 0.0 && w <= 1.0))
            throw error("checkpoint " + source + ": metadata '" + k + "' = '" + v + "' is invalid: " +
                        (s.layers.count(layer) == 0 ? "the file has no layer '" + layer + "'"
                                                    : std::string("a statistics weight lies in [0, 1]")) +
                        "; the file is corrupt (use an earlier checkpoint)");
        s.statistics_weights[layer] = w;
    }
    if (const auto declared = metadata_count(a, key::layers, source); declared != static_cast<std::int64_t>(s.layers.size()))
        throw error("checkpoint " + source + ": metadata '" + key::layers + "' = '" + std::to_string(declared) +
                    "' but it holds " + std::to_string(s.layers.size()) + " layer entries; the file is corrupt (use "
                    "an earlier checkpoint)");
    // Recorded options: values the constructor accepts (kfac/checkpoint/saved_options.hpp).
    for (const auto& [name, text] : s.options)
        if (const std::string fault = saved_option_fault(name, text); !fault.empty())
            throw error("checkpoint " + source + ": metadata '" + key::option_prefix + name + "' = '" + text +
                        "' is invalid (" + fault + "); save() never writes that, so the file is corrupt (use an "
                        "earlier checkpoint)");
    // Information only, never compared on load; files of version 1 lack them. Where present
    // they must be what save() writes: a positive world size and a strategy's name.
    if (const auto it = a.metadata.find(key::world_size); it != a.metadata.end()) {
        s.world_size = metadata_count(a, key::world_size, source);
        if (s.world_size < 1)
            throw error("checkpoint " + source + ": metadata '" + key::world_size + "' = '" + it->second +
                        "' is not a world size (a positive integer); the file is corrupt (use an earlier checkpoint)");
    }
    if (const auto it = a.metadata.find(key::strategy); it != a.metadata.end()) {
        s.strategy = it->second;
        if (const std::string fault = saved_option_detail::one_of(s.strategy, {"comm_opt", "hybrid_opt", "mem_opt", "dp_kfac"});
            !fault.empty())
            throw error("checkpoint " + source + ": metadata '" + key::strategy + "' = '" + s.strategy + "' is invalid (" +
                        fault + "); the file is corrupt (use an earlier checkpoint)");
    }
    s.health.skipped_factor_updates = metadata_count(a, key::health_prefix + "skipped_factor_updates", source);
    s.health.kept_decompositions = metadata_count(a, key::health_prefix + "kept_decompositions", source);
    s.health.zeroed_gradients = metadata_count(a, key::health_prefix + "zeroed_gradients", source);
    if (a.metadata.contains(key::health_prefix + "skipped_steps"))
        s.health.skipped_steps = metadata_count(a, key::health_prefix + "skipped_steps", source);
    if (a.metadata.contains(key::health_prefix + "fp64_retries"))
        s.health.fp64_retries = metadata_count(a, key::health_prefix + "fp64_retries", source);
    if (a.metadata.contains(key::health_prefix + "storage_fallbacks"))
        s.health.storage_fallbacks = metadata_count(a, key::health_prefix + "storage_fallbacks", source);
    for (auto& t : a.tensors) {
        const auto it = a.metadata.find(std::string(fp16_exponent_prefix) + t.name);
        if (it == a.metadata.end()) continue;
        const std::int64_t k = metadata_count_or_negative(a, it->first, source);
        if (t.type != dtype::f16 || k < -1100 || k > 1100)
            throw error("checkpoint " + source + ": metadata '" + it->first + "' = '" + it->second +
                        "' is invalid: a power-of-two scale of an F16 tensor, an integer in [-1100, 1100] (the file "
                        "is corrupt)");
        t.exponent = static_cast<int>(k);
    }
    s.tensors = std::move(a.tensors);
    return s;
}

}  // namespace kfac::checkpoint
