// SPDX-License-Identifier: Apache-2.0
// options.factor_storage: running factors kept in bf16 or fp16, each rounded once when stored,
// half of float's bytes, recorded in their dtype by checkpoints and loaded across storages.
#include <catch2/catch.hpp>

#include <cmath>

#include <kfac/detail/number_conversion.hpp>

#include "unit/layer_kinds.hpp"
#include "unit/test_util.hpp"

using namespace kfac_test;
using kfac::precision;

namespace {

using float_precond = kfac::KFAC<kfac::backend::cpu_eigen<float>>;

/// The value nearest to x in a 16-bit format (the conversion under test elsewhere,
/// precision_inputs_test.cpp, checks narrow() against its definition).
double rounded_to(double x, precision f) {
    std::uint16_t bits = 0;
    kfac::detail::narrow(&x, 1, f, &bits);
    return kfac::detail::element_as_double(&bits, 0, f);
}

/// F rounded entry by entry as fp16 storage rounds it: at 2^k, k = ⌈log₂ max|F|⌉ − 15.
Eigen::MatrixXf stored_as(const Eigen::MatrixXf& F, precision f) {
    int k = 0;
    if (f == precision::fp16) {
        const double largest = static_cast<double>(F.cwiseAbs().maxCoeff());
        if (largest > 0) k = static_cast<int>(std::ceil(std::log2(largest))) - 15;
    }
    Eigen::MatrixXf out = F;
    for (Eigen::Index i = 0; i < F.size(); ++i)
        out.data()[i] = static_cast<float>(std::ldexp(rounded_to(std::ldexp(static_cast<double>(F.data()[i]), -k), f), k));
    return out;
}

struct storage_model {
    std::vector<std::pair<std::string, owned_layer<float>>> layers;
    explicit storage_model(double input_scale) {
        for (auto& [name, l] : every_kind<float>()) layers.emplace_back(name, l);
        layers.emplace_back("fc", random_linear<float>(10, 6, 4, true, 51));
        for (auto& [name, l] : layers) {
            if (l.view.description.kind != kfac::layer_kind::embedding)
                for (float& x : l.input) x = static_cast<float>(x * input_scale);
            l.bind();
        }
    }
    template <class P>
    void register_with(P& p) {
        for (auto& [name, l] : layers) p.register_layer(name, l.view);
    }
};

}  // namespace

TEST_CASE("factors stored in bf16 or fp16 are the float update rounded once", "[precision][storage]") {
    // Inputs scaled by 300 put A's entries near 10⁵, beyond fp16's 65504: fp16 storage must
    // scale them into range, not overflow. Under EKFAC too (its layers: those with a dense
    // Kronecker pair), whose checkpoint carries its scaling S beside the stored factors.
    auto check_storage = [](auto method, const kfac::options& base, precision f) {
        using P = kfac::KFAC<kfac::backend::cpu_eigen<float>, kfac::comm::serial, decltype(method)>;
        kfac::options o = base;
        o.factor_storage = f;
        storage_model packed(300.0), plain(300.0);
        P p(o), q(base);
        packed.register_with(p);
        plain.register_with(q);
        // p's factors are q's, rounded to the storage format.
        auto check_stored = [&] {
            for (const auto& info : q.layers()) {
                INFO(info.name);
                CHECK(p.a_factor(info.name) == stored_as(q.a_factor(info.name), f));
                CHECK(p.g_factor(info.name) == stored_as(q.g_factor(info.name), f));
                CHECK(p.a_factor(info.name).allFinite());
            }
        };
        p.step();
        q.step();
        check_stored();
        // Half the bytes at rest.
        CHECK(2 * p.memory_usage().factors == q.memory_usage().factors);

        // A second step updates the rounded factors: the float preconditioner given them
        // (through a checkpoint, which records them in their dtype and loads them exactly)
        // computes the update that bf16 storage then rounds.
        q.load_bytes(p.save_bytes());
        for (const auto& info : q.layers()) CHECK(q.a_factor(info.name) == p.a_factor(info.name));
        p.step();
        q.step();
        check_stored();
    };
    kfac::options ekfac_layers;
    // No dense Kronecker pair: EKFAC refuses them (skip_layers matches kind names too).
    ekfac_layers.skip_layers = {"^(embedding|layer_norm|batch_norm|group_norm|instance_norm)$"};
    for (const precision f : {precision::bf16, precision::fp16}) {
        INFO(kfac::precision_name(f));
        check_storage(kfac::compute::eigendecomposition{}, kfac::options{}, f);
        check_storage(kfac::compute::ekfac{}, ekfac_layers, f);
    }
}

TEST_CASE("checkpoints record stored factors in their dtype and load across storages", "[precision][storage]") {
    for (const precision f : {precision::bf16, precision::fp16}) {
        INFO(kfac::precision_name(f));
        kfac::options o;
        o.factor_storage = f;
        storage_model m(300.0);
        float_precond p(o);
        m.register_with(p);
        p.step();
        const auto archive = kfac::checkpoint::parse(p.save_bytes(), "memory");
        const auto* a = archive.find("fc.A");
        REQUIRE(a != nullptr);
        CHECK(a->type == (f == precision::bf16 ? kfac::checkpoint::dtype::bf16 : kfac::checkpoint::dtype::f16));
        CHECK(archive.metadata.contains("fp16_exponent.fc.A") == (f == precision::fp16));
        // Another storage rounds what it loads once: a float file into bf16 storage.
        storage_model plain_model(300.0), into_model(300.0);
        float_precond plain;
        plain_model.register_with(plain);
        plain.step();
        kfac::options bf16;
        bf16.factor_storage = precision::bf16;
        float_precond into(bf16);
        into_model.register_with(into);
        into.load_bytes(plain.save_bytes());
        for (const auto& info : plain.layers())
            CHECK(into.a_factor(info.name) == stored_as(plain.a_factor(info.name), precision::bf16));
    }
}

TEST_CASE("factor_storage refuses a format it does not store", "[precision][storage]") {
    kfac::options o;
    o.factor_storage = precision::fp64;
    CHECK_THROWS_WITH(float_precond(o), Catch::Contains("factor_storage") && Catch::Contains("bf16"));
    o.factor_storage = precision::fp32;  // the backend's own type: nothing to do
    float_precond p(o);
    auto l = random_linear<float>(6, 3, 2, true, 5);
    p.register_layer("fc", l.view);
    p.step();
    CHECK(p.memory_usage().factors == sizeof(float) * (4 * 4 + 2 * 2));
}

TEST_CASE("fp16 storage keeps a factor whose variances it would flush in bf16, counted, reported and saved so",
          "[precision][storage][non_finite]") {
    // Rows (1e6, 0) and (0, 1e-6) make A = diag(5e11, 5e-13) exactly. At the scale that puts
    // 5e11 at fp16's top, 5e-13 is 3e-20: flushed to 0. With damping 1e-20 that direction's
    // 1/(λ_A λ_G + γ) then became 10^20 instead of about 2·10^12, and the step's gradient 10^7
    // times too large, unannounced. bf16 holds both variances (float's range, 8 bits).
    auto make_layer = [] {
        auto l = random_linear<float>(8, 2, 1, false, 71);
        for (std::size_t r = 0; r < 8; ++r) {
            l.input[2 * r] = r % 2 == 0 ? 1e6f : 0.0f;
            l.input[2 * r + 1] = r % 2 == 0 ? 0.0f : 1e-6f;
        }
        for (float& g : l.grad_output) g = g < 0 ? -1.0f : 1.0f;
        l.bind();
        return l;
    };
    kfac::options o;
    o.damping = 1e-20;
    o.kl_clip = std::nullopt;
    o.factor_decay = 0.0;  // the factors are the step's statistics
    kfac::options o16 = o;
    o16.factor_storage = precision::fp16;
    float_precond p(o16), reference(o), resumed(o16);
    auto l = make_layer(), r = make_layer(), again = make_layer();
    p.register_layer("fc", l.view);
    reference.register_layer("fc", r.view);
    resumed.register_layer("fc", again.view);
    std::vector<kfac::non_finite_event> events;
    p.on_non_finite([&](const kfac::non_finite_event& e) { events.push_back(e); });
    p.step();
    reference.step();
    REQUIRE(reference.a_factor("fc")(1, 1) == 5e-13f);
    CHECK(p.health().storage_fallbacks == 1);  // A; G (1 x 1) fits fp16
    REQUIRE(events.size() == 1);
    CHECK(events[0].layer == "fc");
    CHECK(events[0].source == kfac::non_finite_source::factor_storage);
    CHECK(events[0].step == 0);
    CHECK(p.a_factor("fc") == stored_as(reference.a_factor("fc"), precision::bf16));
    CHECK(p.g_factor("fc") == stored_as(reference.g_factor("fc"), precision::fp16));
    // A is diagonal, so P_j = Γ_j / (λ_A,j λ_G + γ): off by A's bf16 rounding (2^-9) and G's
    // fp16 rounding (2^-12) at most, 2^-8 taken as the bound.
    CHECK(buffer_rel_err(l.grad_weight, r.grad_weight) <= 0x1p-8);
    // A checkpoint records each factor in the format it is stored in, and loads it exactly.
    const std::string bytes = p.save_bytes();
    const auto archive = kfac::checkpoint::parse(bytes, "memory");
    CHECK(archive.find("fc.A")->type == kfac::checkpoint::dtype::bf16);
    CHECK(archive.find("fc.G")->type == kfac::checkpoint::dtype::f16);
    CHECK(archive.metadata.at("health.storage_fallbacks") == "1");
    resumed.load_bytes(bytes);
    CHECK(resumed.a_factor("fc") == p.a_factor("fc"));
    CHECK(resumed.g_factor("fc") == p.g_factor("fc"));
    CHECK(resumed.health().storage_fallbacks == 1);
    CHECK(resumed.save_bytes() == bytes);
}
