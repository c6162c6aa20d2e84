// SPDX-License-Identifier: Apache-2.0
// Consumes the installed kfac::kfac: one preconditioner step in one process.

#include <cstdio>
#include <exception>

#include <kfac/kfac.hpp>

#include "tiny_step.hpp"

int main() {
    try {
        consumer::tiny_linear layer;
        kfac::KFAC<> precond(consumer::tiny_options());
        return consumer::step_and_check(precond, layer, "kfac_consumer");
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kfac_consumer: %s\n", e.what());
        return 1;
    }
}
