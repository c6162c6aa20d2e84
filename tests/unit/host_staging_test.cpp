// SPDX-License-Identifier: Apache-2.0
// Host staging of collectives over device-resident data (kfac/detail/host_staging.hpp),
// with the CPU stand-in for a device backend, and the errors for device views handed to a
// host backend.

#include <catch2/catch.hpp>

#include <numeric>

#include "replay/staged_backend.hpp"
#include "unit/test_util.hpp"

namespace {

using staged = kfac_replay::staged_backend<double>;

TEST_CASE("host staging downloads what is sent and uploads what is received", "[staging]") {
    static_assert(kfac::detail::device_resident<staged>);
    static_assert(!kfac::detail::device_resident<kfac::backend::cpu_eigen<double>>);
    kfac::detail::host_staging<staged> staging;
    std::vector<double> send(5), receive(7, -1.0), big(100, 3.0);
    std::iota(send.begin(), send.end(), 1.0);
    for (int round = 0; round < 3; ++round) {
        double* s = staging.stage(send.data(), send.size(), kfac::detail::transfer::send);
        double* r = staging.stage(receive.data(), receive.size(), kfac::detail::transfer::receive);
        double* b = staging.stage(big.data(), big.size(), kfac::detail::transfer::send_and_receive);  // beyond the first chunk
        REQUIRE(s != send.data());
        CHECK(std::equal(send.begin(), send.end(), s));  // downloaded at stage()
        CHECK(b[99] == 3.0);
        // The "collective": the received values arrive in host memory.
        for (std::size_t i = 0; i < receive.size(); ++i) r[i] = 10.0 * round + static_cast<double>(i);
        s[0] = -99.0;  // a sent buffer is not written back
        b[0] = 42.0;
        staging.complete();
        CHECK(receive[6] == 10.0 * round + 6.0);
        CHECK(send[0] == 1.0);
        CHECK(big[0] == 42.0);
        big[0] = 3.0;
    }
    CHECK(staging.bytes_staged() == 3 * (5 + 7 + 100) * sizeof(double));
}

TEST_CASE("host backends compile staging away", "[staging]") {
    kfac::detail::host_staging<kfac::backend::cpu_eigen<float>> staging;
    std::vector<float> v(4);
    CHECK(staging.stage(v.data(), v.size(), kfac::detail::transfer::send_and_receive) == v.data());
    staging.complete();
    CHECK(staging.bytes_staged() == 0);
}

TEST_CASE("a device view handed to the CPU backend names the layer and the fix", "[staging][errors]") {
    auto layer = kfac_test::random_linear<float>(4, 3, 2, true, 5);
    kfac::KFAC<> precond;
    precond.register_layer("head", layer.view);
    layer.view.grad_weight.space = kfac::memory_space::device;
    try {
        precond.step();
        FAIL("a device view was accepted by the CPU backend");
    } catch (const kfac::error& e) {
        const std::string what = e.what();
        CHECK_THAT(what, Catch::Contains("layer 'head'"));
        CHECK_THAT(what, Catch::Contains("weight gradient view [2, 3] points to device memory"));
        CHECK_THAT(what, Catch::Contains("kfac::backend::cuda"));
    }
}

}  // namespace
