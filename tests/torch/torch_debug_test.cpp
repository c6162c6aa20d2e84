// SPDX-License-Identifier: Apache-2.0
// The LibTorch adapter in a translation unit built without NDEBUG (a user's Debug build)
// against a release LibTorch: the tracker must still see each module's arguments.

#ifdef NDEBUG
#error "this test must be built without NDEBUG"
#endif

#include <torch/torch.h>
// LibTorch includes glog, whose CHECK(condition) would shadow Catch's.
#undef CHECK
#include <catch2/catch.hpp>

#include <kfac/kfac.hpp>
#include <kfac/layers/torch.hpp>

TEST_CASE("the tracker captures Linear and Conv2d in a build without NDEBUG", "[torch]") {
    torch::manual_seed(1);
    auto conv = torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 2, 3).padding(1));
    auto fc = torch::nn::Linear(2 * 4 * 4, 3);
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> precond;
    precond.register_layer("conv", tracker.track("conv", conv));
    precond.register_layer("fc", tracker.track("fc", fc));

    const auto x = torch::randn({5, 1, 4, 4});
    auto y = conv(x);
    y.retain_grad();
    auto h = torch::relu(y).flatten(1);
    auto z = fc(h);
    z.retain_grad();
    z.square().sum().backward();

    CHECK(torch::equal(tracker.layer("conv").input(), x));
    CHECK(torch::equal(tracker.layer("conv").grad_output(), y.grad()));
    CHECK(torch::equal(tracker.layer("fc").input(), h));
    CHECK(torch::equal(tracker.layer("fc").grad_output(), z.grad()));
    CHECK_NOTHROW(precond.step());
}
