// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file digest.hpp
/// A 64-bit FNV-1a digest of what every rank must agree on: the registered layers (names,
/// kinds, shapes) and the constant options. Ranks compare digests when the preconditioner
/// is set up, so a mismatch is an error on every rank instead of a hang in a collective.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace kfac::detail {

class digest {
public:
    digest& add_bytes(const void* p, std::size_t n) {
        const auto* b = static_cast<const unsigned char*>(p);
        for (std::size_t i = 0; i < n; ++i) {
            value_ ^= b[i];
            value_ *= 1099511628211ull;
        }
        return *this;
    }
    template <class T>
        requires std::is_trivially_copyable_v<T>
    digest& add(const T& v) {
        return add_bytes(&v, sizeof v);
    }
    digest& add(const std::string& s) {
        add(s.size());
        return add_bytes(s.data(), s.size());
    }
    [[nodiscard]] std::uint64_t value() const noexcept { return value_; }

private:
    std::uint64_t value_ = 14695981039346656037ull;
};

}  // namespace kfac::detail
