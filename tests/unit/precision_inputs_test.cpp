// SPDX-License-Identifier: Apache-2.0
// Views in another format than the backend computes in: bf16/fp16 read exactly, double into
// float rounded once, every conversion to a 16-bit format rounded once to nearest (ties to
// even), and the preconditioned gradient written back in the view's own format.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <random>

#include <kfac/detail/number_conversion.hpp>

#include "unit/layer_kinds.hpp"
#include "unit/test_util.hpp"

using namespace kfac_test;
using kfac::precision;

namespace {

/// Every finite non-negative value of a 16-bit format, in increasing order with its bits
/// (the positive patterns of both formats increase with their bits).
std::vector<std::pair<double, std::uint16_t>> finite_values(precision f) {
    std::vector<std::pair<double, std::uint16_t>> out;
    const std::uint16_t last = f == precision::bf16 ? 0x7F7F : 0x7BFF;
    for (std::uint32_t b = 0; b <= last; ++b) {
        const auto bits = static_cast<std::uint16_t>(b);
        out.emplace_back(kfac::detail::element_as_double(&bits, 0, f), bits);
    }
    return out;
}

/// The definition of rounding to nearest, ties to even: the nearest finite value of the
/// format (the even pattern of two at equal distance), infinity from half an ulp above the
/// largest; found by search over every value, not by the bit manipulation under test.
std::uint16_t nearest_in_format(double x, precision f, const std::vector<std::pair<double, std::uint16_t>>& values) {
    const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double m = std::abs(x);
    const auto top = values.back();
    const double top_ulp = top.first - values[values.size() - 2].first;
    if (m >= top.first + top_ulp / 2) return sign | (f == precision::bf16 ? 0x7F80 : 0x7C00);
    auto hi = std::lower_bound(values.begin(), values.end(), std::pair{m, std::uint16_t{0}});
    if (hi == values.end()) return sign | top.second;
    if (hi->first == m || hi == values.begin()) return sign | hi->second;
    const auto lo = hi - 1;
    const double dl = m - lo->first, dh = hi->first - m;
    if (dl < dh) return sign | lo->second;
    if (dh < dl) return sign | hi->second;
    return sign | ((lo->second & 1) == 0 ? lo->second : hi->second);
}

/// Doubles spread over the formats' whole ranges (normals, subnormals, overflow), with the
/// ties and near-ties that catch double rounding.
std::vector<double> probe_values(precision f, std::uint32_t seed) {
    std::mt19937_64 gen(seed);
    std::uniform_real_distribution<double> exponent(f == precision::bf16 ? -140.0 : -28.0,
                                                    f == precision::bf16 ? 129.0 : 17.0);
    std::uniform_real_distribution<double> unit(1.0, 2.0);
    std::vector<double> xs;
    for (int i = 0; i < 20000; ++i) {
        const double x = unit(gen) * std::exp2(std::floor(exponent(gen)));
        xs.push_back(i % 2 == 0 ? x : -x);
    }
    const auto values = finite_values(f);
    for (std::size_t i = 1; i < values.size(); i += 97) {  // midpoints, and a hair either side
        const double mid = (values[i - 1].first + values[i].first) / 2;
        for (double x : {mid, std::nextafter(mid, 0.0), std::nextafter(mid, 1e300)}) xs.push_back(x);
    }
    return xs;
}

}  // namespace

TEST_CASE("16-bit formats widen exactly", "[precision]") {
    using kfac::detail::element_as_double;
    const auto value = [](std::uint16_t bits, precision f) { return element_as_double(&bits, 0, f); };
    CHECK(value(0x3F80, precision::bf16) == 1.0);
    CHECK(value(0xC040, precision::bf16) == -3.0);
    CHECK(value(0x7F7F, precision::bf16) == kfac::largest_finite(precision::bf16));
    CHECK(value(0x0001, precision::bf16) == 0x1p-133);  // smallest subnormal
    CHECK(value(0x3C00, precision::fp16) == 1.0);
    CHECK(value(0x7BFF, precision::fp16) == 65504.0);
    CHECK(value(0x0001, precision::fp16) == 0x1p-24);   // smallest subnormal
    CHECK(value(0x0400, precision::fp16) == 0x1p-14);   // smallest normal
    CHECK(value(0x83FF, precision::fp16) == -1023 * 0x1p-24);
    CHECK(std::isinf(value(0x7C00, precision::fp16)));
    CHECK(std::isnan(value(0x7E00, precision::fp16)));
    CHECK(std::isinf(value(0xFF80, precision::bf16)));
}

TEST_CASE("narrowing to bf16 and fp16 rounds once to nearest, ties to even", "[precision]") {
    for (precision f : {precision::bf16, precision::fp16}) {
        const auto values = finite_values(f);
        std::size_t wrong_double = 0, wrong_float = 0;
        for (double x : probe_values(f, 7)) {
            std::uint16_t got = 0;
            kfac::detail::narrow(&x, 1, f, &got);
            if (got != nearest_in_format(x, f, values)) ++wrong_double;
            const auto xf = static_cast<float>(x);
            kfac::detail::narrow(&xf, 1, f, &got);
            if (got != nearest_in_format(static_cast<double>(xf), f, values)) ++wrong_float;
        }
        INFO(kfac::precision_name(f));
        CHECK(wrong_double == 0);
        CHECK(wrong_float == 0);
    }
    // 1 + 2^-8 + 2^-40 is above bf16's tie between 1 and 1 + 2^-7, and goes up; rounded
    // through float first (to 1 + 2^-8, the tie) it would go to 1.
    const double above_tie = 1.0 + 0x1p-8 + 0x1p-40;
    std::uint16_t bits = 0;
    kfac::detail::narrow(&above_tie, 1, precision::bf16, &bits);
    CHECK(bits == 0x3F81);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    kfac::detail::narrow(&nan, 1, precision::fp16, &bits);
    CHECK(std::isnan(kfac::detail::element_as_double(&bits, 0, precision::fp16)));
}

namespace {

/// The values rounded to nearest U.
template <class U>
std::vector<U> to_format(const std::vector<double>& v) {
    std::vector<U> r(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
        if constexpr (std::is_floating_point_v<U>) r[i] = static_cast<U>(v[i]);
        else kfac::detail::narrow(&v[i], 1, kfac::precision_of<U>, &r[i]);
    }
    return r;
}

/// A layer of element type U holding `src`'s values converted to U (rounded to nearest).
template <class U>
owned_layer<U> as_layer_of(const owned_layer<double>& src) {
    owned_layer<U> out;
    out.view.description = src.view.description;
    out.input_shape = src.input_shape;
    out.output_shape = src.output_shape;
    out.input = to_format<U>(src.input);
    out.grad_output = to_format<U>(src.grad_output);
    out.grad_weight = to_format<U>(src.grad_weight);
    out.grad_bias = to_format<U>(src.grad_bias);
    out.bind();
    return out;
}

template <class U>
std::vector<double> widened(const std::vector<U>& v) {
    std::vector<double> r(v.size());
    kfac::detail::widen(v.data(), static_cast<std::int64_t>(v.size()), kfac::precision_of<U>, r.data());
    return r;
}

/// Two steps (factor and inverse updates, new gradients between: seeded values rounded to V,
/// held in U) of every layer kind.
template <class Compute, class V, class U>
std::vector<owned_layer<U>> run_two_steps(std::vector<owned_layer<U>> layers,
                                          kfac::KFAC<kfac::backend::cpu_eigen<Compute>>& p) {
    for (auto& l : layers) l.bind();
    for (std::size_t i = 0; i < layers.size(); ++i) p.register_layer("l" + std::to_string(i), layers[i].view);
    p.step();
    for (std::size_t i = 0; i < layers.size(); ++i) {
        auto& l = layers[i];
        const auto r = random_vector<double>(l.grad_weight.size(), 900 + static_cast<std::uint32_t>(i), 0.1);
        const auto w = to_format<U>(widened(to_format<V>(r)));
        std::copy(w.begin(), w.end(), l.grad_weight.begin());
        const auto rb = random_vector<double>(l.grad_bias.size(), 800 + static_cast<std::uint32_t>(i), 0.1);
        const auto b = to_format<U>(widened(to_format<V>(rb)));
        std::copy(b.begin(), b.end(), l.grad_bias.begin());
    }
    p.step();
    return layers;
}

std::vector<owned_layer<double>> precision_model() {
    std::vector<owned_layer<double>> layers{random_linear<double>(12, 5, 4, true, 3),
                                            random_conv<double>(3, 2, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, 5, 4, 5)};
    for (auto& [name, l] : every_kind<double>()) layers.push_back(l);
    for (auto& l : layers) l.bind();
    return layers;
}

template <class T>
std::vector<owned_layer<T>> model_in() {
    std::vector<owned_layer<T>> out;
    for (const auto& l : precision_model()) out.push_back(as_layer_of<T>(l));
    return out;
}

/// The layer's values exactly, as a layer of Compute (U's values are Compute's too).
template <class Compute, class U>
owned_layer<Compute> same_values_in(const owned_layer<U>& l) {
    owned_layer<double> d;
    d.view.description = l.view.description;
    d.input_shape = l.input_shape;
    d.output_shape = l.output_shape;
    d.input = widened(l.input);
    d.grad_output = widened(l.grad_output);
    d.grad_weight = widened(l.grad_weight);
    d.grad_bias = widened(l.grad_bias);
    return as_layer_of<Compute>(d);
}

/// U views on a Compute backend against Compute views of the same values: the factors are
/// the same bit for bit, and every gradient is the Compute result rounded once to U.
template <class Compute, class U>
void check_same_as_compute_views() {
    kfac::options o;
    o.damping = 0.01;
    const auto inputs = model_in<U>();
    std::vector<owned_layer<Compute>> same_values;
    for (const auto& l : inputs) same_values.push_back(same_values_in<Compute>(l));  // U's values, as Compute reads them
    kfac::KFAC<kfac::backend::cpu_eigen<Compute>> pu(o), pc(o);
    const auto u = run_two_steps<Compute, U>(inputs, pu);
    const auto c = run_two_steps<Compute, U>(same_values, pc);
    for (const auto& record : pu.layers()) {  // every block: a grouped convolution's groups too
        INFO(record.name);
        CHECK(pu.a_factor(record.name) == pc.a_factor(record.name));
        CHECK(pu.g_factor(record.name) == pc.g_factor(record.name));
    }
    for (std::size_t i = 0; i < u.size(); ++i) {
        INFO("l" << i);
        const auto rounded = [](const std::vector<Compute>& v) {
            std::vector<U> r(v.size());
            kfac::detail::narrow(v.data(), static_cast<std::int64_t>(v.size()), kfac::precision_of<U>, r.data());
            return widened(r);
        };
        CHECK(widened(u[i].grad_weight) == rounded(c[i].grad_weight));
        if (!u[i].view.grad_bias.empty()) CHECK(widened(u[i].grad_bias) == rounded(c[i].grad_bias));
    }
}

}  // namespace

TEST_CASE("bf16, fp16 and double views on a float backend compute as float views of their values",
          "[precision]") {
    check_same_as_compute_views<float, Eigen::bfloat16>();
    check_same_as_compute_views<float, Eigen::half>();
    check_same_as_compute_views<float, double>();
}

TEST_CASE("float and bf16 views on a double backend compute as double views of their values", "[precision]") {
    check_same_as_compute_views<double, float>();
    check_same_as_compute_views<double, Eigen::bfloat16>();
}

TEST_CASE("bf16 views on a float backend against fp64 of the same values", "[precision]") {
    // The fp64 reference: a double backend fed the bf16 values exactly. The float pipeline's
    // error is that of forming and decomposing damped factors in float, ≲ c·n·κ·u_fp32 with
    // n ≤ 64 the longest sum and κ ≤ (‖F‖ + λ)/λ ≤ 10³ for these factors (‖F‖ ≲ 10, λ = 0.01
    // plus the identity start's weight): 64·10³·2^-24 ≈ 4e-3 taken as the bound; the result
    // is then rounded once to bf16 (relative error ≤ u_bf16 = 2^-8 of the largest element,
    // the error measure's denominator).
    kfac::options o;
    o.damping = 0.01;
    kfac::KFAC<kfac::backend::cpu_eigen<float>> pb(o);
    kfac::KFAC<kfac::backend::cpu_eigen<double>> pd(o);
    const auto inputs = model_in<Eigen::bfloat16>();
    std::vector<owned_layer<double>> exact;
    for (const auto& l : inputs) exact.push_back(same_values_in<double>(l));
    const auto b = run_two_steps<float, Eigen::bfloat16>(inputs, pb);
    const auto d = run_two_steps<double, Eigen::bfloat16>(exact, pd);
    const double tolerance = kfac::unit_roundoff(precision::bf16) + 64 * 1e3 * kfac::unit_roundoff(precision::fp32);
    for (std::size_t i = 0; i < b.size(); ++i) {
        INFO("layer " << i);
        CHECK(buffer_rel_err(widened(b[i].grad_weight), d[i].grad_weight) <= tolerance);
        if (!d[i].view.grad_bias.empty()) CHECK(buffer_rel_err(widened(b[i].grad_bias), d[i].grad_bias) <= tolerance);
    }
}

TEST_CASE("a bf16 device view on a host backend names the view and the fix", "[precision]") {
    kfac::KFAC<kfac::backend::cpu_eigen<float>> p;
    auto l = as_layer_of<Eigen::bfloat16>(random_linear<double>(6, 3, 2, true, 1));
    l.view.input.space = kfac::memory_space::device;
    p.register_layer("fc", l.view);
    CHECK_THROWS_WITH(p.step(), Catch::Contains("fc") && Catch::Contains("device memory"));
}

TEST_CASE("rounds_to_finite is narrow()'s overflow rule", "[precision]") {
    // Against the definition: the value narrow() writes is finite.
    for (precision f : {precision::bf16, precision::fp16}) {
        for (double x : probe_values(f, 11)) {
            std::uint16_t bits = 0;
            kfac::detail::narrow(&x, 1, f, &bits);
            INFO(kfac::precision_name(f) << " " << x);
            CHECK(kfac::detail::rounds_to_finite(x, f) == std::isfinite(kfac::detail::element_as_double(&bits, 0, f)));
            const auto xf = static_cast<float>(x);
            kfac::detail::narrow(&xf, 1, f, &bits);
            CHECK(kfac::detail::rounds_to_finite(xf, f) == std::isfinite(kfac::detail::element_as_double(&bits, 0, f)));
        }
    }
    // Double into float: float's infinity from the midpoint between its largest value and 2^128.
    const double midpoint = 0x1.ffffffp127;
    CHECK(kfac::detail::rounds_to_finite(std::nextafter(midpoint, 0.0), precision::fp32));
    CHECK_FALSE(kfac::detail::rounds_to_finite(midpoint, precision::fp32));
    CHECK_FALSE(kfac::detail::rounds_to_finite(-midpoint, precision::fp32));
    CHECK(std::isinf(static_cast<float>(midpoint)));
    CHECK(static_cast<float>(std::nextafter(midpoint, 0.0)) == std::numeric_limits<float>::max());
    CHECK(kfac::detail::rounds_to_finite(std::numeric_limits<float>::max(), precision::fp32));
    CHECK_FALSE(kfac::detail::rounds_to_finite(std::numeric_limits<double>::quiet_NaN(), precision::fp64));
    CHECK_FALSE(kfac::detail::rounds_to_finite(std::numeric_limits<float>::infinity(), precision::fp32));
    CHECK(kfac::detail::rounds_to_finite(1e300, precision::fp64));
}

namespace {

/// A Linear layer of U views whose preconditioned gradient is about 10³ (1/damping) times its
/// gradient, whose entries are ±`gradient`, with tiny activations and output gradients.
template <class U>
owned_layer<U> oversized_gradient_layer(double gradient) {
    auto l = random_linear<double>(16, 4, 3, true, 61);
    for (double& x : l.input) x *= 1e-3;
    for (double& x : l.grad_output) x *= 1e-3;
    for (double& x : l.grad_weight) x = gradient * (x < 0 ? -1.0 : 1.0);
    for (double& x : l.grad_bias) x = gradient * (x < 0 ? -1.0 : 1.0);
    return as_layer_of<U>(l);
}

template <class Compute, class U>
void check_oversized_gradient_zeroed(double gradient) {
    kfac::options o;
    o.kl_clip = std::nullopt;
    o.factor_decay = 0.0;  // the factors are the step's statistics, without the identity start
    kfac::KFAC<kfac::backend::cpu_eigen<Compute>> p(o), wide(o);
    auto l = oversized_gradient_layer<U>(gradient);
    auto w = same_values_in<Compute>(l);
    p.register_layer("fc", l.view);
    wide.register_layer("fc", w.view);
    std::vector<kfac::non_finite_event> events;
    p.on_non_finite([&](const kfac::non_finite_event& e) { events.push_back(e); });
    p.step();
    wide.step();
    // In the compute type P is finite, and beyond U's range: written back it held ±Inf (every
    // entry of the weight). Instead the layer is zeroed, counted and reported.
    CHECK(wide.health().zeroed_gradients == 0);
    const auto largest = std::abs(*std::max_element(w.grad_weight.begin(), w.grad_weight.end(),
                                                    [](Compute x, Compute y) { return std::abs(x) < std::abs(y); }));
    CHECK(std::isfinite(largest));
    CHECK(static_cast<double>(largest) > kfac::largest_finite(kfac::precision_of<U>));
    CHECK(widened(l.grad_weight) == std::vector<double>(l.grad_weight.size(), 0.0));
    CHECK(widened(l.grad_bias) == std::vector<double>(l.grad_bias.size(), 0.0));
    CHECK(p.health().zeroed_gradients == 1);
    REQUIRE(events.size() == 1);
    CHECK(events[0].layer == "fc");
    CHECK(events[0].source == kfac::non_finite_source::gradient);
    CHECK(events[0].step == 0);
}

}  // namespace

TEST_CASE("a preconditioned gradient beyond its view's format is zeroed, counted and reported, not written as Inf",
          "[precision][non_finite]") {
    // 1/damping = 10³ times gradients of 200 is 2·10⁵, beyond fp16's 65504; 10³ times 10³⁶ is
    // beyond float's 3.4·10³⁸, but not double's.
    check_oversized_gradient_zeroed<float, Eigen::half>(200.0);
    check_oversized_gradient_zeroed<double, float>(1e36);
    check_oversized_gradient_zeroed<double, Eigen::half>(200.0);
}

TEST_CASE("the write-back checks ν·P, so a P beyond the format that kl_clip scales into it is written",
          "[precision][non_finite]") {
    kfac::options o;
    o.kl_clip = 1e-3;
    o.lr = 0.1;
    o.factor_decay = 0.0;
    kfac::KFAC<kfac::backend::cpu_eigen<float>> p(o), reference(o);
    auto l = oversized_gradient_layer<Eigen::half>(200.0);
    auto f = same_values_in<float>(l);
    p.register_layer("fc", l.view);
    reference.register_layer("fc", f.view);
    const kfac::step_result r = p.step();
    reference.step();
    REQUIRE(r.kl_scale < 1e-3);  // ν brings 2·10⁵ well inside fp16
    CHECK(p.health().zeroed_gradients == 0);
    const auto written = widened(l.grad_weight);
    CHECK(std::all_of(written.begin(), written.end(), [](double x) { return std::isfinite(x) && x != 0.0; }));
    // The float result of the same values, rounded once to fp16.
    std::vector<Eigen::half> rounded(f.grad_weight.size());
    kfac::detail::narrow(f.grad_weight.data(), static_cast<std::int64_t>(f.grad_weight.size()), precision::fp16,
                         rounded.data());
    CHECK(written == widened(rounded));
}
