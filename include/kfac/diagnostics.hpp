// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file diagnostics.hpp
/// The library's channel for warnings: conditions a program can run with but should know
/// about, which are not errors (those throw kfac::error). Today there is one: OpenBLAS
/// running kernels older than the CPU supports (kfac/backend/blas_kernels.hpp). Each warning
/// is said once per process, as one line starting with "kfac: warning:".
///
/// By default the line goes to std::cerr. A program redirects it (to its own log) or silences
/// it by installing a handler before its first step():
/// ```
///   kfac::set_diagnostic_handler([&](const std::string& line) { log.warn(line); });
///   kfac::set_diagnostic_handler(nullptr);   // silence
///   kfac::set_diagnostic_handler(kfac::write_diagnostic_to_stderr);  // the default again
/// ```

#include <functional>
#include <iostream>
#include <mutex>
#include <string>
#include <utility>

namespace kfac {

/// Receives one diagnostic line, without a trailing newline.
using diagnostic_handler = std::function<void(const std::string&)>;

/// The default handler: the line and a newline on std::cerr.
inline void write_diagnostic_to_stderr(const std::string& line) { std::cerr << line << '\n'; }

namespace detail {

/// The handler of the process, and the mutex that orders its calls against each other and
/// against its replacement.
struct diagnostic_channel {
    std::mutex mutex;
    diagnostic_handler handler = write_diagnostic_to_stderr;
};

/// One channel per process: an inline function's static is shared by every translation unit.
inline diagnostic_channel& diagnostics() {
    static diagnostic_channel channel;
    return channel;
}

}  // namespace detail

/// Installs `handler` for every later diagnostic and returns the one it replaces; an empty
/// handler (nullptr) silences them. Thread-safe: the handler is called under a lock, so lines
/// never interleave and, once this returns, the previous handler is not called any more. The
/// handler therefore must not call set_diagnostic_handler or emit_diagnostic itself.
inline diagnostic_handler set_diagnostic_handler(diagnostic_handler handler) {
    auto& channel = detail::diagnostics();
    const std::lock_guard<std::mutex> lock(channel.mutex);
    return std::exchange(channel.handler, std::move(handler));
}

/// Hands `line` to the installed handler (the library's own warnings come through here).
inline void emit_diagnostic(const std::string& line) {
    auto& channel = detail::diagnostics();
    const std::lock_guard<std::mutex> lock(channel.mutex);
    if (channel.handler) channel.handler(line);
}

}  // namespace kfac
