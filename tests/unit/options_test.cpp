// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include <kfac/options.hpp>

TEST_CASE("hyperparameters are values or schedules of the step", "[options]") {
    kfac::hyperparameter<double> v = 0.5;
    CHECK_FALSE(v.is_schedule());
    CHECK(v(0) == 0.5);
    CHECK(v(1000) == 0.5);
    kfac::hyperparameter<double> s = [](std::int64_t k) { return 1.0 / double(k + 1); };
    CHECK(s.is_schedule());
    CHECK(s(0) == 1.0);
    CHECK(s(3) == 0.25);
    kfac::hyperparameter<std::optional<double>> clip = std::nullopt;
    CHECK_FALSE(clip(0).has_value());
    clip = 0.01;
    CHECK(clip(0).value() == 0.01);
    clip = [](std::int64_t k) { return k < 2 ? std::optional<double>{} : std::optional<double>{0.1}; };
    CHECK_FALSE(clip(1).has_value());
    CHECK(clip(2).value() == 0.1);
    kfac::hyperparameter<std::int64_t> steps = std::int64_t{4};
    CHECK(steps(7) == 4);
}

TEST_CASE("defaults are kfac-pytorch's", "[options]") {
    const kfac::options o;
    CHECK(o.damping(0) == 0.001);
    CHECK(o.factor_decay(0) == 0.95);
    CHECK(o.kl_clip(0).value() == 0.001);
    CHECK(o.lr(0) == 0.1);
    CHECK(o.factor_update_steps(0) == 1);
    CHECK(o.inv_update_steps(0) == 1);
    CHECK(o.accumulation_steps == 1);
    CHECK(o.compute_eigenvalue_outer_product);
    CHECK(o.conv_patches == kfac::conv_patch_mode::reference);
    CHECK_NOTHROW(kfac::validate(o));
}

TEST_CASE("an allreduce bucket cap beyond its bound names the bound, not a rule it meets", "[options]") {
    // 1e300 is finite and >= 0; what it breaks is the upper bound (2^40 MiB), which the
    // message must name.
    kfac::options o;
    o.allreduce_bucket_cap_mb = 1e300;
    CHECK_THROWS_WITH(kfac::validate(o), Catch::Contains("allreduce_bucket_cap_mb = 1e+300") &&
                                             Catch::Contains("[0, 1099511627776]") &&
                                             !Catch::Contains("finite and >= 0"));
    o.allreduce_bucket_cap_mb = 1099511627776.0;
    CHECK_NOTHROW(kfac::validate(o));
}
