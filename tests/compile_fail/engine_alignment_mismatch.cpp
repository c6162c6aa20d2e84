// SPDX-License-Identifier: Apache-2.0
// Built with -mavx (Eigen's alignment 32 bytes) against kfac_engines, compiled for the
// baseline (16 bytes): the engines' layout would differ, so the link must fail, naming the
// alignment, rather than the program crash (cmake/kfacEngineInstances.cmake).
#include <kfac/kfac.hpp>

int main() {
    kfac::KFAC<kfac::backend::cpu_eigen<double>> precond;
    return static_cast<int>(precond.steps());
}
