// SPDX-License-Identifier: Apache-2.0
// The default main of a Catch2 program that links kfac_catch_session (catch_session.cpp).
#include "catch_session.hpp"

int main(int argc, char** argv) { return kfac_test::run_catch_session(argc, argv); }
