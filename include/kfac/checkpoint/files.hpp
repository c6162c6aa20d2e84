// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file files.hpp
/// Checkpoint files on disk. Writing goes through a temporary file beside the target and a
/// rename, so a crash never leaves a torn file behind; the temporary is created exclusively
/// under a fresh name, so a link planted at a predictable name (the old `FILE.tmp`, or this
/// scheme's `FILE.tmp.<pid>.<n>`) is never written through and never becomes the target.
/// Reading accepts a regular file only and turns every failure, of the stream library or of
/// an allocation too, into a kfac::error naming the file.

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <string>
#include <system_error>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <unistd.h>
#endif

#include "kfac/checkpoint/safetensors.hpp"
#include "kfac/config.hpp"

namespace kfac::checkpoint {

namespace file_detail {

/// Writes `bytes` to a new file `name`, created exclusively: creation fails when anything
/// has the name, a link included (dangling or not), so a link planted there is never written
/// through and a file of another save is never clobbered. Returns false when the name is
/// taken; @throws kfac::error for any other failure, the partial file removed.
inline bool write_new_file(const std::filesystem::path& name, const std::string& bytes, const std::string& who) {
    auto failed = [&](const std::string& what) {
        std::error_code ignored;
        std::filesystem::remove(name, ignored);
        return error(who + ": writing " + std::to_string(bytes.size()) + " bytes to " + name.string() +
                     " failed: " + what + " (is the disk full?)");
    };
#if defined(__unix__) || defined(__APPLE__)
    int fd = -1;
    do {
        fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        if (errno == EEXIST) return false;
        throw error(who + ": cannot create " + name.string() + ": " + std::strerror(errno) +
                    " (is the folder there and writable?)");
    }
    int failure = 0;
    for (std::size_t done = 0; done < bytes.size();) {
        const auto n = ::write(fd, bytes.data() + done, bytes.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            failure = n < 0 ? errno : EIO;
            break;
        }
        done += static_cast<std::size_t>(n);
    }
    // close() reports what a network file system deferred; the descriptor is gone either way.
    if (::close(fd) != 0 && failure == 0) failure = errno;
    if (failure != 0) throw failed(std::strerror(failure));
    return true;
#else
    // C11's exclusive mode "x" (O_EXCL on POSIX systems, CREATE_NEW on Windows): the
    // standard library's only exclusive creation before C++23's std::ios::noreplace.
    std::FILE* f = std::fopen(name.string().c_str(), "wbx");
    if (f == nullptr) {
        std::error_code ec;
        if (std::filesystem::exists(std::filesystem::symlink_status(name, ec))) return false;
        throw error(who + ": cannot create " + name.string() + " (is the folder there and writable?)");
    }
    const bool written = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    if ((std::fclose(f) != 0 || !written)) throw failed("the write did not complete");
    return true;
#endif
}

/// Candidate names of the temporary file beside `path`, tried in turn.
inline std::filesystem::path temporary_name(const std::filesystem::path& path, int attempt) {
    std::filesystem::path name = path;
#if defined(__unix__) || defined(__APPLE__)
    name += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(attempt);
#else
    name += ".tmp." + std::to_string(attempt);
#endif
    return name;
}

inline const char* file_kind(std::filesystem::file_type t) {
    switch (t) {
        case std::filesystem::file_type::directory: return "a folder";
        case std::filesystem::file_type::block:
        case std::filesystem::file_type::character: return "a device";
        case std::filesystem::file_type::fifo: return "a pipe (fifo)";
        case std::filesystem::file_type::socket: return "a socket";
        default: return "no ordinary file";
    }
}

}  // namespace file_detail

/// Temporary names tried before save() gives up: only a folder full of leftovers of saves
/// of this process id that crashed, or names planted on purpose, takes them all.
inline constexpr int temporary_name_attempts = 64;

/// Writes `a` to `path` through a temporary file beside it and a rename: a reader sees the
/// old file or the new one, never a torn one. The temporary file, `path.tmp.<pid>.<n>`, is
/// created exclusively (see file_detail::write_new_file), with the next n when a name is
/// taken, and removed when the write or the rename fails.
/// @throws kfac::error naming the path and the system's reason.
inline void write_file(const std::filesystem::path& path, const archive& a) {
    const std::string bytes = serialize(a);
    const std::string who = "checkpoint " + path.string();
    std::filesystem::path temporary;
    for (int attempt = 0; temporary.empty(); ++attempt) {
        if (attempt == temporary_name_attempts)
            throw error(who + ": cannot create a temporary file beside it: " + file_detail::temporary_name(path, 0).string() +
                        " and the next " + std::to_string(temporary_name_attempts - 1) +
                        " names exist (left by saves that crashed? remove them)");
        const auto candidate = file_detail::temporary_name(path, attempt);
        if (file_detail::write_new_file(candidate, bytes, who)) temporary = candidate;
    }
    std::error_code ec;
    std::filesystem::rename(temporary, path, ec);
    if (ec) {
        std::error_code ignored;
        std::filesystem::remove(temporary, ignored);
        throw error(who + ": cannot rename the temporary file into place: " + ec.message());
    }
}

/// The bytes of the file at `path`. Anything but a regular file (or a link to one) is refused
/// by its type before it is opened: a folder fails inside the stream library, a device such
/// as /dev/zero never ends (the read ran out of memory), and opening a pipe waits for a writer.
/// @throws kfac::error naming the path, whatever failed (a failure of the stream library or
///         of an allocation included, which agree_on would otherwise pass on without the path).
[[nodiscard]] inline std::string read_bytes(const std::filesystem::path& path) {
    const std::string who = "checkpoint " + path.string();
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    if (status.type() == std::filesystem::file_type::not_found)
        throw error(who + ": cannot open it (does it exist?)");
    if (ec) throw error(who + ": cannot open it: " + ec.message() + " (is it readable?)");
    if (!std::filesystem::is_regular_file(status))
        throw error(who + ": it is " + file_detail::file_kind(status.type()) +
                    ", not a regular file; load the file that save() wrote");
    try {
        std::ifstream in(path, std::ios::binary);
        if (!in) throw error(who + ": cannot open it (is it readable?)");
        const auto size = std::filesystem::file_size(path);
        std::string bytes(static_cast<std::size_t>(size), '\0');
        in.read(bytes.data(), static_cast<std::streamsize>(size));
        if (static_cast<std::uintmax_t>(in.gcount()) != size || in.peek() != std::ifstream::traits_type::eof())
            throw error(who + ": it changed while it was read (" + std::to_string(size) +
                        " bytes were expected); read it again when nothing writes to it");
        return bytes;
    } catch (const error&) {
        throw;
    } catch (const std::bad_alloc&) {
        throw error(who + ": its bytes do not fit in memory");
    } catch (const std::exception& e) {
        throw error(who + ": reading it failed: " + e.what());
    }
}

/// Reads and parses a whole file.
/// @throws kfac::error naming the path and what is wrong.
[[nodiscard]] inline archive read_file(const std::filesystem::path& path) { return parse(read_bytes(path), path.string()); }

}  // namespace kfac::checkpoint
