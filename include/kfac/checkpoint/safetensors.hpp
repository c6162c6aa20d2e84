// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file safetensors.hpp
/// The safetensors container that checkpoints are written in: an 8-byte little-endian header
/// size N, N bytes of JSON (`{name: {dtype, shape, data_offsets}, "__metadata__": {string:
/// string}}`, possibly padded with spaces), then the raw little-endian, C-order data, each
/// tensor at [begin, end) of the data section. Python's `safetensors` package and a few lines
/// of NumPy read it. This header knows the container only; what a checkpoint of the
/// preconditioner holds is decided elsewhere.
///
/// Reading checks everything a corrupt or foreign file could get wrong (sizes, offsets,
/// dtypes, shapes, overlaps, trailing bytes) and says what and where. Files are read and
/// written by kfac/checkpoint/files.hpp.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/checkpoint/json_text.hpp"
#include "kfac/config.hpp"
#include "kfac/detail/number_conversion.hpp"
#include "kfac/precision.hpp"

namespace kfac::checkpoint {

static_assert(std::endian::native == std::endian::little,
              "kfac checkpoints store little-endian data; this host is big-endian");

/// Element types a checkpoint uses (safetensors' names): BF16 and F16 hold factors kept in
/// options.factor_storage.
enum class dtype {
    f32,   ///< F32: IEEE binary32
    f64,   ///< F64: IEEE binary64
    i64,   ///< I64: signed 64-bit integers
    bf16,  ///< BF16: bfloat16
    f16,   ///< F16: IEEE binary16
};

/// safetensors' name of the type: "F32", "F64", "I64", "BF16" or "F16".
[[nodiscard]] inline const char* dtype_name(dtype t) noexcept {
    switch (t) {
        case dtype::f32: return "F32";
        case dtype::f64: return "F64";
        case dtype::i64: return "I64";
        case dtype::bf16: return "BF16";
        case dtype::f16: return "F16";
    }
    return "?";
}

/// Bytes of one element.
[[nodiscard]] inline std::size_t dtype_size(dtype t) noexcept {
    return t == dtype::f32 ? 4 : t == dtype::bf16 || t == dtype::f16 ? 2 : 8;
}

/// The type of a safetensors name (dtype_name()'s inverse); std::nullopt for any other name.
[[nodiscard]] inline std::optional<dtype> parse_dtype(std::string_view name) {
    if (name == "F32") return dtype::f32;
    if (name == "F64") return dtype::f64;
    if (name == "I64") return dtype::i64;
    if (name == "BF16") return dtype::bf16;
    if (name == "F16") return dtype::f16;
    return std::nullopt;
}

/// The number format of a floating-point dtype.
[[nodiscard]] inline precision precision_of_dtype(dtype t) noexcept {
    return t == dtype::f64 ? precision::fp64 : t == dtype::bf16 ? precision::bf16 : t == dtype::f16 ? precision::fp16
                                                                                                    : precision::fp32;
}

/// The dtype of float, double or std::int64_t (any other T does not compile).
template <class T>
constexpr dtype dtype_of() {
    if constexpr (std::is_same_v<T, float>) return dtype::f32;
    else if constexpr (std::is_same_v<T, double>) return dtype::f64;
    else {
        static_assert(std::is_same_v<T, std::int64_t>, "checkpoint tensors are float, double or int64");
        return dtype::i64;
    }
}

/// One named tensor: its type, its shape (C order) and its bytes.
struct tensor {
    std::string name;                 ///< unique within its archive
    dtype type = dtype::f32;          ///< the elements' type
    std::vector<std::int64_t> shape;  ///< dimensions, outermost first
    std::vector<std::byte> bytes;     ///< the elements, C order, little-endian
    /// An F16 tensor's values are its elements times 2^exponent (a factor stored at a power-of-
    /// two scale, kfac/detail/factor_storage.hpp; metadata "fp16_exponent.<name>"); 0 otherwise.
    int exponent = 0;

    /// The number of elements: the product of the shape (1 for a scalar's empty shape).
    [[nodiscard]] std::int64_t elements() const {
        std::int64_t n = 1;
        for (auto e : shape) n *= e;
        return n;
    }
    /// Copies `count` values into a new tensor.
    template <class T>
    static tensor from(std::string name, const T* values, std::vector<std::int64_t> shape) {
        tensor t{std::move(name), dtype_of<T>(), std::move(shape), {}};
        t.bytes.resize(static_cast<std::size_t>(t.elements()) * sizeof(T));
        if (!t.bytes.empty() && values != nullptr) std::memcpy(t.bytes.data(), values, t.bytes.size());
        return t;
    }
    /// The values as T; float ↔ double converts, anything else must match.
    template <class T>
    [[nodiscard]] std::vector<T> values() const {
        std::vector<T> out(static_cast<std::size_t>(elements()));
        auto convert = [&](auto tag) {
            using S = decltype(tag);
            for (std::size_t i = 0; i < out.size(); ++i) {
                S v;
                std::memcpy(&v, bytes.data() + i * sizeof(S), sizeof(S));
                out[i] = static_cast<T>(v);
            }
        };
        if (type == dtype::bf16 || type == dtype::f16) {
            for (std::size_t i = 0; i < out.size(); ++i)
                out[i] = static_cast<T>(std::ldexp(element(i), exponent));
        } else if (type == dtype::f32) convert(float{});
        else if (type == dtype::f64) convert(double{});
        else convert(std::int64_t{});
        return out;
    }
    /// Element i of a floating-point tensor as stored (without the exponent), widened exactly.
    [[nodiscard]] double element(std::size_t i) const {
        return detail::element_as_double(bytes.data(), static_cast<std::int64_t>(i), precision_of_dtype(type));
    }
};

/// A whole file: the tensors in the order they are stored, and the metadata.
struct archive {
    std::vector<tensor> tensors;                  ///< in storage order
    std::map<std::string, std::string> metadata;  ///< the header's `__metadata__`: key → text

    /// The tensor of that name, or nullptr when there is none.
    [[nodiscard]] const tensor* find(std::string_view name) const {
        for (const auto& t : tensors)
            if (t.name == name) return &t;
        return nullptr;
    }
};

/// A 64-bit digest of byte runs, 8 bytes at a time (FNV-1a's constants on words, with a final
/// avalanche), fast enough for gigabytes of factors. Each run ends with a word holding its
/// length, so moving a byte from one run to the next changes the digest.
class digest64 {
public:
    /// Digests the run of `n` bytes at `p`.
    void add(const std::byte* p, std::size_t n) {
        std::size_t i = 0;
        for (; i + 8 <= n; i += 8) {
            std::uint64_t word;
            std::memcpy(&word, p + i, 8);
            mix(word);
        }
        std::uint64_t tail = 0;
        if (i < n) std::memcpy(&tail, p + i, n - i);
        mix(tail ^ (static_cast<std::uint64_t>(n) << 56));
    }
    /// Digests the bytes of `text`, as one run.
    void add(std::string_view text) { add(reinterpret_cast<const std::byte*>(text.data()), text.size()); }
    /// The digest of the runs added so far.
    [[nodiscard]] std::uint64_t value() const {
        std::uint64_t h = h_;
        h ^= h >> 33;
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 33;
        return h;
    }

private:
    void mix(std::uint64_t word) {
        h_ ^= word;
        h_ *= 1099511628211ull;
        h_ ^= h_ >> 29;
    }
    std::uint64_t h_ = 14695981039346656037ull;
};

/// The digest of the data section alone (one run per tensor), as format version 1 of
/// checkpoints records it: a bit flipped in the data is found, one in the header is not.
[[nodiscard]] inline std::uint64_t data_checksum(const std::vector<tensor>& tensors) {
    digest64 d;
    for (const auto& t : tensors) d.add(t.bytes.data(), t.bytes.size());
    return d.value();
}

/// The digest of the whole archive: every metadata entry but `excluded_key` (the one that
/// will hold the digest), each tensor's name, dtype and shape in stored order, then the data
/// as data_checksum() reads it. The header is digested in a canonical form (entries sorted
/// by key, every string length-prefixed), not as its JSON text, so that the digest does not
/// depend on how a writer spaced, ordered or escaped the JSON (Python's safetensors writes it
/// otherwise) while any change of a key, a value, a name, a dtype or a shape changes it.
[[nodiscard]] inline std::uint64_t archive_checksum(const archive& a, std::string_view excluded_key) {
    std::string canonical = "kfac.archive_checksum.1\n";
    auto field = [&](std::string_view text) {
        canonical += std::to_string(text.size());
        canonical += ':';
        canonical += text;
    };
    for (const auto& [key, value] : a.metadata) {  // std::map: sorted by key
        if (key == excluded_key) continue;
        canonical += 'm';
        field(key);
        field(value);
    }
    for (const auto& t : a.tensors) {
        canonical += 't';
        field(t.name);
        field(dtype_name(t.type));
        canonical += std::to_string(t.shape.size());
        for (const auto e : t.shape) {
            canonical += ',';
            canonical += std::to_string(e);
        }
    }
    digest64 d;
    d.add(canonical);
    for (const auto& t : a.tensors) d.add(t.bytes.data(), t.bytes.size());
    return d.value();
}

/// "0x0123456789abcdef".
[[nodiscard]] inline std::string hex64(std::uint64_t v) {
    char buffer[19];
    std::snprintf(buffer, sizeof buffer, "0x%016llx", static_cast<unsigned long long>(v));
    return buffer;
}

/// The file's bytes. The JSON header is padded with spaces to a multiple of 8 bytes, as the
/// safetensors package does, so that the data section is 8-byte aligned.
[[nodiscard]] inline std::string serialize(const archive& a) {
    std::string header = "{";
    bool first = true;
    if (!a.metadata.empty()) {
        header += "\"__metadata__\":{";
        for (const auto& [key, value] : a.metadata) {
            if (!first) header += ',';
            first = false;
            header += json_text::quote(key) + ':' + json_text::quote(value);
        }
        header += '}';
        first = false;
    }
    std::uint64_t offset = 0;
    for (const auto& t : a.tensors) {
        if (t.name == "__metadata__") throw error("checkpoint: a tensor may not be named __metadata__");
        if (t.bytes.size() != static_cast<std::size_t>(t.elements()) * dtype_size(t.type))
            throw error("checkpoint: tensor '" + t.name + "' holds " + std::to_string(t.bytes.size()) +
                        " bytes, not the " + std::to_string(t.elements() * static_cast<std::int64_t>(dtype_size(t.type))) +
                        " its shape and dtype need");
        if (!first) header += ',';
        first = false;
        // Appended piece by piece: GCC 12 at -O3 warns falsely (-Wrestrict, bug 105329) on
        // `"," + std::to_string(...)`.
        header += json_text::quote(t.name);
        header += ":{\"dtype\":\"";
        header += dtype_name(t.type);
        header += "\",\"shape\":[";
        for (std::size_t i = 0; i < t.shape.size(); ++i) {
            if (i) header += ',';
            header += std::to_string(t.shape[i]);
        }
        header += "],\"data_offsets\":[";
        header += std::to_string(offset);
        header += ',';
        header += std::to_string(offset + t.bytes.size());
        header += "]}";
        offset += t.bytes.size();
    }
    header += '}';
    header.append((8 - header.size() % 8) % 8, ' ');
    std::string out(8, '\0');
    const std::uint64_t n = header.size();
    std::memcpy(out.data(), &n, 8);
    out += header;
    out.reserve(out.size() + offset);
    for (const auto& t : a.tensors) out.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    return out;
}

/// Parses a whole file's bytes. `source` names the file in messages.
/// @throws kfac::error naming the source, the tensor and what is wrong.
[[nodiscard]] inline archive parse(std::string_view bytes, const std::string& source) {
    auto fail = [&](const std::string& what) -> error {
        return error("checkpoint " + source + ": " + what + " (the file is truncated, corrupt or not a safetensors file)");
    };
    if (bytes.size() < 8) throw fail("it holds " + std::to_string(bytes.size()) + " bytes, fewer than the 8 of the header size");
    std::uint64_t header_size = 0;
    std::memcpy(&header_size, bytes.data(), 8);
    if (header_size > bytes.size() - 8)
        throw fail("the header size " + std::to_string(header_size) + " exceeds the " + std::to_string(bytes.size() - 8) +
                   " bytes that follow it");
    const std::string_view header = bytes.substr(8, static_cast<std::size_t>(header_size));
    const std::string_view data = bytes.substr(8 + static_cast<std::size_t>(header_size));
    json_text::value root;
    try {
        root = json_text::parse(header);
    } catch (const error& e) {
        throw fail(std::string("its JSON header does not parse: ") + e.what());
    }
    if (!root.is_object()) throw fail("its JSON header is not an object");
    archive a;
    struct placed {
        std::uint64_t begin, end;
        std::size_t index;
    };
    std::vector<placed> spans;
    for (const auto& [name, entry] : root.object) {
        if (name == "__metadata__") {
            if (!entry.is_object()) throw fail("__metadata__ is not an object");
            for (const auto& [key, value] : entry.object) {
                if (!value.is_string()) throw fail("metadata '" + key + "' is not a string");
                a.metadata[key] = value.text;
            }
            continue;
        }
        const std::string who = "tensor '" + name + "'";
        if (!entry.is_object()) throw fail(who + " is not an object");
        const auto* type = entry.member("dtype");
        const auto* shape = entry.member("shape");
        const auto* offsets = entry.member("data_offsets");
        if (!type || !type->is_string() || !shape || !shape->is_array() || !offsets || !offsets->is_array() ||
            offsets->array.size() != 2)
            throw fail(who + " lacks dtype, shape or data_offsets");
        const auto t = parse_dtype(type->text);
        if (!t) throw fail(who + " has dtype " + type->text + "; kfac checkpoints use F32, F64, BF16, F16 and I64");
        tensor x{name, *t, {}, {}};
        for (const auto& e : shape->array) {
            if (!e.is_integer() || e.integer < 0) throw fail(who + " has a shape entry that is not a non-negative integer");
            x.shape.push_back(e.integer);
        }
        for (const auto& e : offsets->array)
            if (!e.is_integer() || e.integer < 0) throw fail(who + " has data_offsets that are not non-negative integers");
        const auto begin = static_cast<std::uint64_t>(offsets->array[0].integer);
        const auto end = static_cast<std::uint64_t>(offsets->array[1].integer);
        const auto expected = static_cast<std::uint64_t>(x.elements()) * dtype_size(x.type);
        if (end < begin || end - begin != expected)
            throw fail(who + " spans " + std::to_string(end - begin) + " bytes, but its shape and dtype need " +
                       std::to_string(expected));
        if (end > data.size())
            throw fail(who + " ends at byte " + std::to_string(end) + " of a data section of " + std::to_string(data.size()));
        x.bytes.resize(static_cast<std::size_t>(expected));
        if (expected) std::memcpy(x.bytes.data(), data.data() + begin, static_cast<std::size_t>(expected));
        spans.push_back({begin, end, a.tensors.size()});
        a.tensors.push_back(std::move(x));
    }
    // The data section is covered exactly once, in order (the safetensors rule).
    std::sort(spans.begin(), spans.end(), [](const placed& l, const placed& r) { return l.begin < r.begin; });
    std::uint64_t covered = 0;
    for (const auto& s : spans) {
        if (s.begin != covered)
            throw fail("tensor '" + a.tensors[s.index].name + "' starts at byte " + std::to_string(s.begin) +
                       " where " + std::to_string(covered) + " was expected (overlap or gap)");
        covered = s.end;
    }
    if (covered != data.size())
        throw fail("the data section holds " + std::to_string(data.size()) + " bytes, the tensors " + std::to_string(covered));
    // Stored order, which is the order the writer chose.
    std::vector<tensor> ordered;
    ordered.reserve(a.tensors.size());
    for (const auto& s : spans) ordered.push_back(std::move(a.tensors[s.index]));
    a.tensors = std::move(ordered);
    return a;
}

}  // namespace kfac::checkpoint
