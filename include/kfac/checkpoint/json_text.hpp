// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file json_text.hpp
/// The little JSON a safetensors header needs: quoting strings when writing, and a strict
/// parser (RFC 8259: objects, arrays, strings with every escape, numbers, true, false, null;
/// a member name twice in one object refused) when reading headers that other writers
/// (Python's safetensors) produced. Kept here so the core needs no JSON library.

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kfac/config.hpp"

namespace kfac::checkpoint::json_text {

/// `text` as a JSON string literal, with quotes, backslashes and control characters escaped.
[[nodiscard]] inline std::string quote(std::string_view text) {
    std::string out = "\"";
    for (const char c : text) {
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            default:
                if (static_cast<unsigned char>(c) < 0x20) {
                    static constexpr char digits[] = "0123456789abcdef";
                    out += "\\u00";
                    out += digits[(c >> 4) & 0xf];
                    out += digits[c & 0xf];
                } else {
                    out += c;
                }
        }
    }
    return out + '"';
}

struct object_member;

/// A parsed JSON value: its kind, and the member of that kind's value.
struct value {
    /// JSON's kinds of value; `integer` is a number without fraction or exponent.
    enum class kind {
        null,     ///< `null`
        boolean,  ///< `true` or `false`
        integer,  ///< a number without fraction or exponent
        number,   ///< any other number
        string,   ///< a string
        array,    ///< an array
        object,   ///< an object
    };
    kind type = kind::null;  ///< which kind it is
    bool flag = false;       ///< for booleans
    std::int64_t integer = 0;  ///< for integers (numbers without fraction or exponent)
    double number = 0.0;       ///< for every number
    std::string text;          ///< for strings, unescaped
    std::vector<value> array;  ///< for arrays, in order
    /// For objects, the members in the order written. (A struct of its own, not a std::pair:
    /// a pair of this still incomplete type is an error for Clang with libstdc++.)
    std::vector<object_member> object;

    [[nodiscard]] bool is_object() const { return type == kind::object; }    ///< whether it is an object
    [[nodiscard]] bool is_array() const { return type == kind::array; }      ///< whether it is an array
    [[nodiscard]] bool is_string() const { return type == kind::string; }    ///< whether it is a string
    [[nodiscard]] bool is_integer() const { return type == kind::integer; }  ///< whether it is an integer
    /// An object's member of that name, or nullptr when it has none (or is no object).
    [[nodiscard]] const value* member(std::string_view name) const;
};

/// A member of a JSON object: its name (`first`) and its value (`second`), as in a std::pair.
struct object_member {
    std::string first;  ///< the member's name
    value second;       ///< the member's value
};

inline const value* value::member(std::string_view name) const {
    // Not a structured binding: nvcc's front end takes &v of one for a local's address.
    for (const auto& m : object)
        if (m.first == name) return &m.second;
    return nullptr;
}

namespace detail {

class parser {
public:
    explicit parser(std::string_view text) : s_(text) {}

    value document() {
        value v = parse_value(0);
        skip_space();
        if (i_ != s_.size()) fail("unexpected text after the value");
        return v;
    }

private:
    [[noreturn]] void fail(const std::string& what) const {
        throw error("JSON: " + what + " at byte " + std::to_string(i_));
    }
    void skip_space() {
        while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
    }
    char peek() {
        skip_space();
        if (i_ >= s_.size()) fail("unexpected end");
        return s_[i_];
    }
    void expect(char c) {
        if (peek() != c) fail(std::string("expected '") + c + "'");
        ++i_;
    }
    bool literal(std::string_view word) {
        if (s_.substr(i_, word.size()) != word) return false;
        i_ += word.size();
        return true;
    }

    value parse_value(int depth) {
        if (depth > 64) fail("nesting deeper than 64");
        const char c = peek();
        value v;
        if (c == '{') {
            v.type = value::kind::object;
            ++i_;
            if (peek() == '}') return ++i_, v;
            // RFC 8259 leaves duplicate names to the reader; here a name twice in one object
            // is an error: which copy wins would decide a tensor or a metadata entry silently.
            std::set<std::string, std::less<>> names;
            for (;;) {
                if (peek() != '"') fail("expected a member name");
                std::string key = parse_string();
                if (!names.insert(key).second) fail("the member name " + quote(key) + " appears twice in one object");
                expect(':');
                v.object.push_back(object_member{std::move(key), parse_value(depth + 1)});
                if (peek() == ',') { ++i_; continue; }
                expect('}');
                return v;
            }
        }
        if (c == '[') {
            v.type = value::kind::array;
            ++i_;
            if (peek() == ']') return ++i_, v;
            for (;;) {
                v.array.push_back(parse_value(depth + 1));
                if (peek() == ',') { ++i_; continue; }
                expect(']');
                return v;
            }
        }
        if (c == '"') {
            v.type = value::kind::string;
            v.text = parse_string();
            return v;
        }
        if (literal("true")) return v.type = value::kind::boolean, v.flag = true, v;
        if (literal("false")) return v.type = value::kind::boolean, v;
        if (literal("null")) return v;
        return parse_number();
    }

    value parse_number() {
        const std::size_t start = i_;
        if (i_ < s_.size() && s_[i_] == '-') ++i_;
        auto digits = [&] {
            const std::size_t from = i_;
            while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
            return i_ - from;
        };
        if (digits() == 0) fail("expected a value");
        bool integral = true;
        if (i_ < s_.size() && s_[i_] == '.') {
            ++i_;
            integral = false;
            if (digits() == 0) fail("expected digits after '.'");
        }
        if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
            ++i_;
            integral = false;
            if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
            if (digits() == 0) fail("expected digits in the exponent");
        }
        const std::string token(s_.substr(start, i_ - start));
        value v;
        v.type = value::kind::number;
        v.number = std::strtod(token.c_str(), nullptr);
        if (integral) {
            errno = 0;
            char* end = nullptr;
            const long long n = std::strtoll(token.c_str(), &end, 10);
            if (errno == 0 && end == token.c_str() + token.size()) {
                v.type = value::kind::integer;
                v.integer = n;
            }
        }
        return v;
    }

    unsigned hex4() {
        if (i_ + 4 > s_.size()) fail("truncated \\u escape");
        unsigned code = 0;
        for (int k = 0; k < 4; ++k) {
            const char h = s_[i_++];
            code <<= 4;
            if (h >= '0' && h <= '9') code |= static_cast<unsigned>(h - '0');
            else if (h >= 'a' && h <= 'f') code |= static_cast<unsigned>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') code |= static_cast<unsigned>(h - 'A' + 10);
            else fail("bad hex digit in a \\u escape");
        }
        return code;
    }

    static void append_utf8(std::string& out, unsigned code) {
        if (code < 0x80) {
            out += static_cast<char>(code);
        } else if (code < 0x800) {
            out += static_cast<char>(0xc0 | (code >> 6));
            out += static_cast<char>(0x80 | (code & 0x3f));
        } else if (code < 0x10000) {
            out += static_cast<char>(0xe0 | (code >> 12));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (code & 0x3f));
        } else {
            out += static_cast<char>(0xf0 | (code >> 18));
            out += static_cast<char>(0x80 | ((code >> 12) & 0x3f));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (code & 0x3f));
        }
    }

    std::string parse_string() {
        ++i_;  // the opening quote
        std::string out;
        while (i_ < s_.size()) {
            const char c = s_[i_++];
            if (c == '"') return out;
            if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
            if (c != '\\') {
                out += c;
                continue;
            }
            if (i_ >= s_.size()) break;
            switch (s_[i_++]) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    unsigned code = hex4();
                    if (code >= 0xd800 && code < 0xdc00) {  // a surrogate pair
                        if (!literal("\\u")) fail("lone high surrogate");
                        const unsigned low = hex4();
                        if (low < 0xdc00 || low >= 0xe000) fail("bad low surrogate");
                        code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
                    }
                    append_utf8(out, code);
                    break;
                }
                default: fail("unknown escape");
            }
        }
        fail("unterminated string");
    }

    std::string_view s_;
    std::size_t i_ = 0;
};

}  // namespace detail

/// Parses one JSON document (surrounding whitespace allowed).
/// @throws kfac::error saying what is wrong and at which byte.
[[nodiscard]] inline value parse(std::string_view text) { return detail::parser(text).document(); }

}  // namespace kfac::checkpoint::json_text
