// SPDX-License-Identifier: Apache-2.0
// kfac::comm::any (kfac/comm/any.hpp): a preconditioner over a policy held behind the virtual
// interface equals one over the policy itself, the optional parts of the contract reach the
// held policy, and a policy whose payloads are device memory is refused by a host backend and
// gets a device backend's buffers unstaged (kfac/detail/host_staging.hpp).

#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "replay/staged_backend.hpp"
#include "unit/test_util.hpp"

namespace {

using Catch::Contains;

/// comm::serial that records the optional calls it receives and may claim device payloads.
class recording_policy : public kfac::comm::serial {
public:
    explicit recording_policy(std::vector<std::string>* log, bool device = false) : log_(log), device_(device) {}
    void phase(const char* name) noexcept { log_->push_back(std::string("phase: ") + name); }
    void progress() { log_->push_back("progress"); }
    [[nodiscard]] bool reads_device_memory() const noexcept { return device_; }
    template <class T>
    void broadcast_host(T*, std::size_t, int, const group&) {
        log_->push_back("broadcast_host");
    }

private:
    std::vector<std::string>* log_;
    bool device_;
};

TEST_CASE("a preconditioner over comm::any(serial) equals one over serial, bit for bit", "[comm][any]") {
    kfac::options o;
    o.damping = 0.003;
    o.inv_update_steps = 2;
    auto a = kfac_test::random_linear<double>(6, 4, 3, true, 11);
    auto b = kfac_test::random_linear<double>(6, 4, 3, true, 11);
    kfac::KFAC<kfac::backend::cpu_eigen<double>> plain(o);
    kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::any> erased(o, kfac::comm::any(kfac::comm::serial{}));
    plain.register_layer("fc", a.view);
    erased.register_layer("fc", b.view);
    for (int step = 0; step < 4; ++step) {
        plain.step();
        erased.step();
        CHECK(a.grad_weight == b.grad_weight);
        CHECK(a.grad_bias == b.grad_bias);
        const auto next = kfac_test::random_vector<double>(a.grad_weight.size(), 100 + step, 0.1);
        std::copy(next.begin(), next.end(), a.grad_weight.begin());  // in place: the views point there
        std::copy(next.begin(), next.end(), b.grad_weight.begin());
    }
    CHECK(erased.comm().size() == 1);
    CHECK(erased.comm().get<kfac::comm::serial>() != nullptr);
    CHECK(erased.comm().get<recording_policy>() == nullptr);
}

TEST_CASE("comm::any forwards the contract's optional parts", "[comm][any]") {
    std::vector<std::string> log;
    kfac::comm::any comm{recording_policy(&log, true)};
    comm.phase("the factor update");
    comm.progress();
    double x = 1.0;
    comm.broadcast_host(&x, 1, 0, comm.world());
    CHECK(comm.reads_device_memory());
    CHECK(log == std::vector<std::string>{"phase: the factor update", "progress", "broadcast_host"});
    CHECK_FALSE(kfac::comm::any(kfac::comm::serial{}).reads_device_memory());  // a policy without it: host memory
}

TEST_CASE("a policy with device payloads is refused by a host backend", "[comm][any][staging][errors]") {
    std::vector<std::string> log;
    CHECK_THROWS_WITH((kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::any>(
                          kfac::options{}, kfac::comm::any(recording_policy(&log, true)))),
                      Contains("reads device memory") && Contains("use the CUDA backend"));
    // One with host payloads is fine.
    CHECK_NOTHROW(kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::any>(
        kfac::options{}, kfac::comm::any(recording_policy(&log, false))));
}

TEST_CASE("host staging hands a device-reading policy the device buffers themselves", "[comm][staging]") {
    kfac::detail::host_staging<kfac_replay::staged_backend<double>> staging;
    staging.follow(true);
    std::vector<double> v{1.0, 2.0, 3.0};
    double* p = staging.stage(v.data(), v.size(), kfac::detail::transfer::send_and_receive);
    CHECK(p == v.data());
    p[0] = 7.0;  // the "collective" writes the device buffer in place
    staging.complete();
    CHECK(v[0] == 7.0);
    CHECK(staging.bytes_staged() == 0);
    staging.follow(false);  // a host-reading policy again: staged
    CHECK(staging.stage(v.data(), v.size(), kfac::detail::transfer::send) != v.data());
    CHECK(staging.bytes_staged() == 3 * sizeof(double));
}

}  // namespace
