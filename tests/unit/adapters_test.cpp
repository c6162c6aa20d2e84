// SPDX-License-Identifier: Apache-2.0
// The shipped adapters: the trait concept, and xtensor containers giving the same result as
// the plain views over the same data.
#include <catch2/catch.hpp>

#include <xtensor/xadapt.hpp>
#include <xtensor/xarray.hpp>
#include <xtensor/xbuilder.hpp>
#include <xtensor/xtensor.hpp>

#include <kfac/layers/xtensor_layer.hpp>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {
struct no_adapter {};
struct half_adapter {};
}  // namespace

template <>
struct kfac::layer_traits<half_adapter> {
    using scalar_type = float;
    static kfac::layer_description describe(const half_adapter&) { return {}; }
};

static_assert(kfac::layer_adapter<kfac::layer_view<float>>);
static_assert(kfac::layer_adapter<kfac::xtensor_layer<xt::xarray<double>>>);
static_assert(kfac::layer_adapter<kfac::xtensor_layer<xt::xtensor<float, 2>>>);
static_assert(!kfac::is_layer_adapter_v<no_adapter>);
static_assert(!kfac::is_layer_adapter_v<half_adapter>);
static_assert(!kfac::is_layer_adapter_v<int>);

TEST_CASE("xtensor containers precondition like plain views", "[adapters]") {
    auto plain = random_linear<double>(10, 4, 3, true, 11);
    xt::xarray<double> in = xt::adapt(plain.input, std::vector<std::size_t>{10, 4});
    xt::xarray<double> gout = xt::adapt(plain.grad_output, std::vector<std::size_t>{10, 3});
    xt::xarray<double> gw = xt::adapt(plain.grad_weight, std::vector<std::size_t>{3, 4});
    xt::xarray<double> gb = xt::adapt(plain.grad_bias, std::vector<std::size_t>{3});
    kfac::xtensor_layer<xt::xarray<double>> xl{plain.view.description, &in, &gout, &gw, &gb};

    kfac::KFAC<kfac::backend::cpu_eigen<double>> p1, p2;
    p1.register_layer("fc", plain.view);
    p2.register_layer("fc", xl);
    p1.step();
    p2.step();
    for (std::size_t i = 0; i < plain.grad_weight.size(); ++i) CHECK(gw.data()[i] == plain.grad_weight[i]);
    for (std::size_t i = 0; i < plain.grad_bias.size(); ++i) CHECK(gb(i) == plain.grad_bias[i]);
    CHECK(p1.a_factor("fc") == p2.a_factor("fc"));
}

TEST_CASE("xtensor adapter rejects column-major containers", "[adapters][errors]") {
    xt::xarray<double, xt::layout_type::column_major> in = xt::ones<double>({4, 2});
    xt::xarray<double, xt::layout_type::column_major> gout = xt::ones<double>({4, 2});
    xt::xarray<double, xt::layout_type::column_major> gw = xt::ones<double>({2, 2});
    kfac::xtensor_layer<xt::xarray<double, xt::layout_type::column_major>> xl{
        kfac::linear_description(2, 2, false), &in, &gout, &gw, nullptr};
    kfac::KFAC<kfac::backend::cpu_eigen<double>> p;
    p.register_layer("fc", xl);
    CHECK_THROWS_WITH(p.step(), Catch::Contains("not row-major"));
}
