// SPDX-License-Identifier: Apache-2.0
// Catch2's implementation (v2, the single header Debian 12 ships), compiled once for every test
// program that has a main of its own (an MPI_Init around the session, a GPU check that exits
// 77) or that must not link Debian's prebuilt Catch2WithMain (the LibTorch programs).
// Compiling it inside each of those programs cost about 20 s of CPU apiece, more under nvcc.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "catch_session.hpp"

int kfac_test::run_catch_session(int argc, char** argv) { return Catch::Session().run(argc, argv); }
