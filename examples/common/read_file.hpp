// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file read_file.hpp
/// A whole file into memory, decompressed when its name ends in `.gz`: the examples' data sets
/// are gzip'd and the examples may not depend on zlib, so a `.gz` file is read through
/// `gzip -dc` (popen). gzip is part of every Debian system (it is Essential), and a pipe is
/// simpler and safer than a hand-written inflate; when gzip cannot be run the error says so.

#include <array>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>

#include <sys/wait.h>  // WIFEXITED / WEXITSTATUS for pclose's status (POSIX)

namespace kfac_examples {

/// A file that could not be read or decompressed (the message names it).
class file_error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

/// The path quoted for /bin/sh: inside single quotes only ' itself needs care.
inline std::string shell_quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) {
        if (c == '\'') q += "'\\''";
        else q += c;
    }
    return q + "'";
}

/// The bytes of `path`, gunzipped when it ends in `.gz`.
/// @throws file_error when it cannot be opened, decompressed or read.
inline std::string read_file(const std::filesystem::path& path) {
    const std::string p = path.string();
    const bool gz = path.extension() == ".gz";
    std::FILE* f = gz ? ::popen(("gzip -dc -- " + shell_quote(p) + " 2>/dev/null").c_str(), "r")
                      : std::fopen(p.c_str(), "rb");
    if (!f) throw file_error("cannot " + std::string(gz ? "run gzip -dc on " : "open ") + p);
    std::string bytes;
    std::array<char, 1 << 16> buf{};
    for (std::size_t n; (n = std::fread(buf.data(), 1, buf.size(), f)) > 0;) bytes.append(buf.data(), n);
    if (!gz) {
        const bool failed = std::ferror(f) != 0;
        std::fclose(f);
        if (failed) throw file_error("reading " + p + " failed");
        return bytes;
    }
    const int status = ::pclose(f);
    if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) == 127)
        throw file_error("cannot decompress " + p + ": `gzip -dc` could not be run (is gzip installed and on PATH?)");
    if (WEXITSTATUS(status) != 0)
        throw file_error("`gzip -dc` failed on " + p + " (exit status " + std::to_string(WEXITSTATUS(status)) +
                         "): not a valid gzip file?");
    return bytes;
}

}  // namespace kfac_examples
