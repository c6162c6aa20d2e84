// SPDX-License-Identifier: Apache-2.0
// Writes a checkpoint of a small double preconditioner after three steps, and beside it the
// preconditioner's own a_factor() and g_factor() of each layer as text (%.17g, which reads
// back exactly), for read_with_numpy.py to compare with what NumPy reads from the file.
//
//   kfac_checkpoint_writer FOLDER

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <vector>

#include <kfac/kfac.hpp>

#include "unit/test_util.hpp"

int main(int argc, char** argv) {
    if (argc != 2) {
        std::cerr << "usage: kfac_checkpoint_writer FOLDER\n";
        return 2;
    }
    const std::filesystem::path folder = argv[1];
    std::filesystem::create_directories(folder);
    kfac::conv2d_geometry g;
    g.kernel = {3, 3};
    g.padding = {1, 1};
    auto fc1 = kfac_test::random_linear<double>(8, 5, 4, true, 11);
    auto conv = kfac_test::random_conv<double>(2, 2, 3, g, false, 5, 5, 12);
    kfac::options o;
    o.damping = 0.01;
    kfac::KFAC<kfac::backend::cpu_eigen<double>> precond(o);
    precond.register_layer("fc1", fc1.view);
    precond.register_layer("block.conv", conv.view);
    for (int k = 0; k < 3; ++k) precond.step();
    precond.save(folder / "run.safetensors");
    for (const auto& info : precond.layers()) {
        for (const char side : {'A', 'G'}) {
            const auto& f = side == 'A' ? precond.a_factor(info.name) : precond.g_factor(info.name);
            std::ofstream out(folder / (info.name + "." + side + ".txt"));
            char buffer[32];
            for (Eigen::Index i = 0; i < f.rows(); ++i) {
                for (Eigen::Index j = 0; j < f.cols(); ++j) {
                    std::snprintf(buffer, sizeof buffer, "%.17g", f(i, j));
                    out << buffer << (j + 1 < f.cols() ? " " : "\n");
                }
            }
        }
    }
    std::cout << "wrote " << (folder / "run.safetensors").string() << "\n";
    return 0;
}
