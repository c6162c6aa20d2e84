// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file progress_bar.hpp
/// A one-line progress bar on stderr, drawn only when stderr is a terminal, so that a log
/// redirected to a file holds just the examples' per-epoch tables.

#include <cstddef>
#include <cstdio>
#include <string>

#include <unistd.h>  // isatty

namespace kfac_examples {

class progress_bar {
public:
    progress_bar() : enabled_(::isatty(STDERR_FILENO) == 1) {}

    /// "  epoch   3/10  SGD+K-FAC   [##########....................] 156/469 <note>"
    void draw(int epoch, int epochs, const std::string& what, std::size_t done, std::size_t total,
              const std::string& note = "") {
        if (!enabled_) return;
        constexpr int width = 30;
        const int filled = total ? static_cast<int>(width * done / total) : width;
        std::fprintf(stderr, "\r  epoch %3d/%-3d %-11s [%s%s] %3zu/%zu %s", epoch, epochs, what.c_str(),
                     std::string(static_cast<std::size_t>(filled), '#').c_str(),
                     std::string(static_cast<std::size_t>(width - filled), '.').c_str(), done, total, note.c_str());
        std::fflush(stderr);
    }
    void clear() {
        if (enabled_) std::fprintf(stderr, "\r%*s\r", 100, "");
    }

private:
    bool enabled_;
};

}  // namespace kfac_examples
