// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cli.hpp
/// A minimal command-line reader for the examples: `--name value`, `--name=value` and bare
/// `--flag`s. Each option is read once with its default; finish() rejects what was not read,
/// so a misspelt option is an error instead of being silently ignored.

#include <cerrno>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kfac_examples {

class cli_error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

class cli {
public:
    /// @param flags the options that take no value.
    cli(int argc, char** argv, std::set<std::string> flags) : flags_(std::move(flags)) {
        for (int i = 1; i < argc; ++i) {
            std::string a = argv[i];
            if (a.rfind("--", 0) != 0 || a.size() == 2) throw cli_error("unexpected argument '" + a + "'");
            a.erase(0, 2);
            std::string value;
            if (const auto eq = a.find('='); eq != std::string::npos) {
                value = a.substr(eq + 1);
                a.erase(eq);
            } else if (!flags_.count(a)) {
                if (i + 1 >= argc) throw cli_error("--" + a + " needs a value");
                value = argv[++i];
            }
            values_[a] = value;
        }
    }

    [[nodiscard]] bool flag(const std::string& name) {
        read_.insert(name);
        return values_.count(name) != 0;
    }

    [[nodiscard]] std::optional<std::string> text(const std::string& name) {
        read_.insert(name);
        const auto it = values_.find(name);
        if (it == values_.end()) return std::nullopt;
        return it->second;
    }
    [[nodiscard]] std::string text(const std::string& name, std::string fallback) {
        return text(name).value_or(std::move(fallback));
    }

    [[nodiscard]] double number(const std::string& name, double fallback) {
        const auto s = text(name);
        if (!s) return fallback;
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(s->c_str(), &end);
        if (s->empty() || *end != '\0' || errno != 0) throw cli_error("--" + name + " takes a number, not '" + *s + "'");
        return v;
    }

    [[nodiscard]] long integer(const std::string& name, long fallback) {
        const auto s = text(name);
        if (!s) return fallback;
        char* end = nullptr;
        errno = 0;
        const long v = std::strtol(s->c_str(), &end, 10);
        if (s->empty() || *end != '\0' || errno != 0) throw cli_error("--" + name + " takes an integer, not '" + *s + "'");
        return v;
    }

    /// Throws on options that were given but never read.
    void finish() const {
        for (const auto& [name, value] : values_)
            if (!read_.count(name)) throw cli_error("unknown option --" + name + " (see --help)");
    }

private:
    std::set<std::string> flags_;
    std::map<std::string, std::string> values_;
    std::set<std::string> read_;
};

}  // namespace kfac_examples
