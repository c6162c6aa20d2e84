// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file configuration_check.hpp
/// What every rank must agree on before the first step (the registered layers and the
/// options), as items of text, so that a mismatch can be named: ranks first compare one
/// digest of the whole text, and only when the digests differ does rank 0's text travel to
/// the others, each of which finds the first item where it differs.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "kfac/detail/digest.hpp"

namespace kfac::detail {

/// One thing the ranks must agree on: "layer #2" → "'fc' (linear 6->5, bias)".
struct config_item {
    std::string key;
    std::string value;
};

/// A double that reads back as the same double: the short form when it is exact
/// (0.001), all 17 digits otherwise (so 0.001 and 0.0010000000000000002 differ in text too).
inline std::string exact_number_text(double v) {
    char buffer[40];
    std::snprintf(buffer, sizeof buffer, "%.6g", v);
    if (std::strtod(buffer, nullptr) == v) return buffer;
    std::snprintf(buffer, sizeof buffer, "%.17g", v);
    return buffer;
}

// Items are joined with ASCII unit (0x1f) and record (0x1e) separators, which no layer
// name or value text contains in practice; a name that does only makes the message odd.
inline std::string serialize(const std::vector<config_item>& items) {
    std::string s;
    for (const auto& item : items) {
        s += item.key;
        s += '\x1f';
        s += item.value;
        s += '\x1e';
    }
    return s;
}

inline std::vector<config_item> deserialize(const std::string& text) {
    std::vector<config_item> items;
    std::size_t begin = 0;
    while (begin < text.size()) {
        const std::size_t end = text.find('\x1e', begin);
        const std::string record = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
        const std::size_t split = record.find('\x1f');
        items.push_back({record.substr(0, split), split == std::string::npos ? "" : record.substr(split + 1)});
        if (end == std::string::npos) break;
        begin = end + 1;
    }
    return items;
}

inline std::uint64_t configuration_digest(const std::vector<config_item>& items) {
    return digest().add(serialize(items)).value();
}

/// The first item where `mine` (this rank's) differs from `reference` (rank 0's), as the
/// sentence of an error message; nullopt when they agree. Items are matched by key, so a
/// layer that one rank registered in addition is named as that layer.
inline constexpr const char* configuration_subject = "the registered layers or the options";
inline constexpr const char* configuration_fix =
    "Register the same layers, in the same order, with the same shapes and options on every rank";

/// `subject` names what the items are, `fix` what to do (the configuration's by default).
inline std::optional<std::string> first_difference(const std::vector<config_item>& reference,
                                                   const std::vector<config_item>& mine, int rank,
                                                   const std::string& subject = configuration_subject,
                                                   const std::string& fix = configuration_fix) {
    const std::string here = "rank " + std::to_string(rank);
    auto find = [](const std::vector<config_item>& items, const std::string& key) -> const config_item* {
        for (const auto& item : items)
            if (item.key == key) return &item;
        return nullptr;
    };
    auto sentence = [&](const std::string& key, const config_item* r, const config_item* m) {
        return "ranks disagree on " + subject + ": " + here + " differs from rank 0 in " + key + ": rank 0 has " +
               (r ? r->value : "nothing") + ", " + here + " has " + (m ? m->value : "nothing") + ". " + fix;
    };
    for (const auto& m : mine) {
        const config_item* r = find(reference, m.key);
        if (!r || r->value != m.value) return sentence(m.key, r, &m);
    }
    for (const auto& r : reference)
        if (!find(mine, r.key)) return sentence(r.key, &r, nullptr);
    return std::nullopt;
}

}  // namespace kfac::detail
