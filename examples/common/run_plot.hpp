// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file run_plot.hpp
/// Runs an example's matplotlib script on its CSV. A missing script, python3 or matplotlib is
/// a note, not an error: the CSV holds everything.

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include <sys/wait.h>  // WIFEXITED / WEXITSTATUS of std::system

#include "read_file.hpp"  // shell_quote

namespace kfac_examples {

/// `script` next to the executable (CMake copies it there), else in `source_dir`.
inline std::optional<std::filesystem::path> find_script(const std::string& script, const std::string& source_dir) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec && fs::is_regular_file(exe.parent_path() / script, ec)) return exe.parent_path() / script;
    if (!source_dir.empty() && fs::is_regular_file(fs::path(source_dir) / script, ec))
        return fs::path(source_dir) / script;
    return std::nullopt;
}

/// Runs `script CSV PNG`. The first of $KFAC_PYTHON, the python3 on PATH and Debian's
/// /usr/bin/python3 (where python3-matplotlib installs; PATH may lead to another one, e.g. a
/// pyenv or venv interpreter) that can import matplotlib runs it.
inline void run_plot(const std::string& script_name, const std::string& source_dir, const std::filesystem::path& csv,
                     const std::filesystem::path& png) {
    const auto script = find_script(script_name, source_dir);
    if (!script) {
        std::printf("note: %s not found next to the executable; no plot (the CSV has the data)\n", script_name.c_str());
        return;
    }
    std::vector<std::string> pythons;
    if (const char* p = std::getenv("KFAC_PYTHON"); p && *p) pythons.emplace_back(p);
    pythons.insert(pythons.end(), {"python3", "/usr/bin/python3"});
    std::fflush(stdout);
    for (const auto& python : pythons) {
        const std::string probe = shell_quote(python) + " -c 'import matplotlib' >/dev/null 2>&1";
        if (std::system(probe.c_str()) != 0) continue;
        const std::string cmd = shell_quote(python) + " " + shell_quote(script->string()) + " " +
                                shell_quote(csv.string()) + " " + shell_quote(png.string());
        const int status = std::system(cmd.c_str());
        if (status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) std::printf("plot: %s\n", png.c_str());
        else std::printf("note: %s %s failed; no plot (the CSV has the data)\n", python.c_str(), script->c_str());
        return;
    }
    std::printf("note: no python3 with matplotlib found (apt install python3-matplotlib, or set KFAC_PYTHON); "
                "no plot, the CSV has the data\n");
}

}  // namespace kfac_examples
