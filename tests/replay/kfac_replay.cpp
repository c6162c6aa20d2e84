// SPDX-License-Identifier: Apache-2.0
// kfac_replay: replays a golden case folder through the public API and compares every
// dumped quantity (see ../shared/golden/README.md).
//
//   kfac_replay CASE_DIR [--float | --double] [--rtol R]
//
// Prints the largest error per quantity and ends with
//   max_rel_err=<value> rtol=<value> PASS|FAIL
// Exit status: 0 on PASS, 1 on FAIL, 2 on a usage or input error.

#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <string>

#include "golden_case.hpp"

int main(int argc, char** argv) {
    std::string folder;
    auto p = kfac_replay::precision::case_dtype;
    std::optional<double> rtol;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--float") p = kfac_replay::precision::float32;
        else if (arg == "--double") p = kfac_replay::precision::float64;
        else if (arg == "--rtol" && i + 1 < argc) rtol = std::stod(argv[++i]);
        else if (arg == "-h" || arg == "--help") {
            std::cout << "usage: kfac_replay CASE_DIR [--float | --double] [--rtol R]\n";
            return 0;
        } else if (!arg.empty() && arg[0] != '-' && folder.empty()) folder = arg;
        else {
            std::cerr << "kfac_replay: unknown argument '" << arg << "'\n";
            return 2;
        }
    }
    if (folder.empty()) {
        std::cerr << "usage: kfac_replay CASE_DIR [--float | --double] [--rtol R]\n";
        return 2;
    }
    try {
        const kfac_replay::golden_case c(folder);
        const bool as_float = p == kfac_replay::precision::float32 ||
                              (p == kfac_replay::precision::case_dtype && c.dtype() == "float32");
        const auto r = kfac_replay::replay(c, p, rtol);
        std::cout << "case " << c.name() << " (" << c.dtype() << " recording, replayed in "
                  << (as_float ? "float32" : "float64") << ", method "
                  << c.meta().at("kfac").at("compute_method").get<std::string>() << ")\n";
        for (const auto& [what, e] : r.max_error) std::printf("  %-9s max_rel_err=%.3e\n", what.c_str(), e);
        for (const auto& problem : r.problems) std::cout << "  problem: " << problem << "\n";
        std::printf("max_rel_err=%.3e rtol=%.1e %s\n", r.worst, r.rtol, r.passed() ? "PASS" : "FAIL");
        return r.passed() ? 0 : 1;
    } catch (const std::exception& e) {
        std::cerr << "kfac_replay: " << e.what() << "\n";
        std::printf("max_rel_err=nan rtol=nan FAIL\n");
        return 2;
    }
}
