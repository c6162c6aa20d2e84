// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_patterns.hpp
/// options.skip_layers and options.reduce_layers, compiled once: the preconditioner holds one
/// of each, and the LibTorch adapter's registration builds the same skip filter once per call,
/// so both leave out exactly the same layers and a malformed pattern fails the same way.

#include <regex>
#include <string>
#include <vector>

#include "kfac/config.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/options.hpp"

namespace kfac::detail {

/// A list of ECMAScript regular expressions, each matched anywhere in a string
/// (std::regex_search, case-sensitive). A template only so that std::regex's code is
/// instantiated where a filter is built or matched (with the engine), not in every translation
/// unit that includes this header: a program linking kfac::engines then compiles none of it.
template <class Regex = std::regex>
class basic_layer_patterns {
public:
    basic_layer_patterns() = default;

    /// Compiles `patterns`, the value of options.<option>.
    /// @throws kfac::error naming the option and the pattern that is not a regular expression.
    basic_layer_patterns(const char* option, const std::vector<std::string>& patterns) {
        compiled_.reserve(patterns.size());
        for (const auto& pattern : patterns) {
            try {
                compiled_.emplace_back(pattern, Regex::ECMAScript);
            } catch (const std::regex_error& e) {
                throw error(std::string("options.") + option + ": '" + pattern +
                            "' is not a valid ECMAScript regular expression (" + e.what() + ")");
            }
        }
    }

    /// Whether a pattern occurs in `name`.
    [[nodiscard]] bool match_name(const std::string& name) const {
        for (const auto& re : compiled_)
            if (std::regex_search(name, re)) return true;
        return false;
    }

    /// Whether a pattern occurs in the layer's name or in a name of its kind ("linear" or
    /// "Linear"): the rule of options.skip_layers.
    [[nodiscard]] bool match_layer(const std::string& name, layer_kind kind) const {
        const char* lower = kind_name(kind);
        const char* pytorch = pytorch_module_name(kind);
        for (const auto& re : compiled_)
            if (std::regex_search(name, re) || std::regex_search(lower, re) || std::regex_search(pytorch, re))
                return true;
        return false;
    }

private:
    std::vector<Regex> compiled_;
};

/// The filters the preconditioner and the LibTorch registration build.
using layer_patterns = basic_layer_patterns<>;

/// options.skip_layers compiled: match_layer(name, kind) says whether a layer is left out.
/// @throws kfac::error if a pattern is not a regular expression.
template <class Regex = std::regex>
[[nodiscard]] basic_layer_patterns<Regex> skip_filter(const options& opts) {
    return basic_layer_patterns<Regex>("skip_layers", opts.skip_layers);
}

/// options.reduce_layers compiled: match_name(name) says whether a layer's weight-sharing
/// dimension is reduced.
/// @throws kfac::error if a pattern is not a regular expression.
template <class Regex = std::regex>
[[nodiscard]] basic_layer_patterns<Regex> reduce_filter(const options& opts) {
    return basic_layer_patterns<Regex>("reduce_layers", opts.reduce_layers);
}

}  // namespace kfac::detail
