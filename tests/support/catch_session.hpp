// SPDX-License-Identifier: Apache-2.0
// The entry point of Catch2's implementation compiled once in catch_session.cpp. Catch2 v2
// declares Catch::Session only in the translation unit that holds its implementation, so a
// test program's own main (an MPI_Init around the run, a GPU check that exits 77) calls this.
#pragma once

namespace kfac_test {

/// Catch::Session().run(argc, argv): the command line parsed, the tests run, the number failed.
int run_catch_session(int argc, char** argv);

}  // namespace kfac_test
