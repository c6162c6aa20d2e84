// SPDX-License-Identifier: Apache-2.0
// Replays every golden case folder discovered in the repository's tests/data/golden and in
// the optional extra folder (generated/golden_dirs.hpp); the cases are not listed anywhere.
#include <catch2/catch.hpp>

#include "golden_dirs.hpp"
#include "replay/golden_case.hpp"

namespace {

std::vector<kfac_replay::fs::path> golden_cases() {
    return kfac_replay::discover_cases_in(kfac_replay::golden_dirs);
}

void check(const kfac_replay::golden_case& c, kfac_replay::precision p) {
    const auto r = kfac_replay::replay(c, p);
    for (const auto& [what, e] : r.max_error) {
        INFO(c.name() << " " << what << " max_rel_err=" << e << " rtol=" << r.rtol);
        CHECK(e <= r.rtol);
    }
    INFO(c.name());
    CHECK(r.problems.empty());
    CHECK(r.max_error.count("pgrad_w") == 1);
    CHECK(r.max_error.count("A") == 1);
}

}  // namespace

TEST_CASE("golden cases exist", "[golden]") {
    REQUIRE_FALSE(golden_cases().empty());
    // The repository's own cases are always among them: a bare clone replays them.
    CHECK_FALSE(kfac_replay::discover_cases(kfac_replay::golden_dirs[0]).empty());
}

TEST_CASE("every golden case replays in double precision at the case tolerance", "[golden]") {
    for (const auto& folder : golden_cases()) {
        const kfac_replay::golden_case c(folder);
        SECTION(c.name()) { check(c, kfac_replay::precision::float64); }
    }
}

// Tolerance: kfac_replay::float_replay_rtol(damping), justified beside its definition: the
// float32 rounding error amplified by the damped Kronecker system's condition number.
TEST_CASE("every golden case replays in single precision", "[golden]") {
    for (const auto& folder : golden_cases()) {
        const kfac_replay::golden_case c(folder);
        SECTION(c.name()) { check(c, kfac_replay::precision::float32); }
    }
}
