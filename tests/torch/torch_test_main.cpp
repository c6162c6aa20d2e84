// SPDX-License-Identifier: Apache-2.0
// Catch2's main for kfac_torch_tests, header-only (no prebuilt library whose ABI must match
// LibTorch's), in a translation unit of its own: compiled next to LibTorch's headers and the
// tests, GCC 12 inlined Catch's session code into a false -Wrestrict warning (bug 105329).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
