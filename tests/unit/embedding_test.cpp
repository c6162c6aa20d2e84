// SPDX-License-Identifier: Apache-2.0
// Embedding layers: an Embedding(V, E) applied to token ids is the Linear(V → E, no bias)
// applied to their one-hot rows, with its weight stored transposed ([V, E]). So its A factor is
// the diagonal of token frequencies and its G factor the Linear's; here the factors are checked
// against that definition, and the preconditioned gradient against a Linear layer fed the
// one-hot rows (whose dense K-FAC knows nothing of diagonals).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {


/// Token ids of `count` positions over a vocabulary of `vocabulary`, never `absent`, skewed
/// towards small ids (as real token frequencies are), as scalars.
template <class T>
std::vector<T> token_ids(std::int64_t count, std::int64_t vocabulary, std::int64_t absent, std::uint32_t seed) {
    std::vector<T> ids;
    const auto u = random_vector<double>(static_cast<std::size_t>(count), seed);
    for (double x : u) {
        auto id = static_cast<std::int64_t>(std::floor((x + 1.0) * (x + 1.0) / 4.0 * static_cast<double>(vocabulary)));
        id = std::clamp<std::int64_t>(id, 0, vocabulary - 1);
        if (id == absent) id = (id + 1) % vocabulary;
        ids.push_back(static_cast<T>(id));
    }
    return ids;
}

/// The one-hot rows [ids..., V] of the ids.
template <class T>
std::vector<T> one_hot(const std::vector<T>& ids, std::int64_t vocabulary) {
    std::vector<T> x(ids.size() * static_cast<std::size_t>(vocabulary), T(0));
    for (std::size_t i = 0; i < ids.size(); ++i)
        x[i * static_cast<std::size_t>(vocabulary) + static_cast<std::size_t>(ids[i])] = T(1);
    return x;
}

}  // namespace

TEMPLATE_TEST_CASE("embedding factors match their definition", "[statistics][embedding]", float, double) {
    using T = TestType;
    const std::int64_t n = 3, len = 5, v = 9, e = 4, r = n * len;
    const auto d = kfac::embedding_description(v, e);
    const auto ids = token_ids<T>(r, v, 2, 1);
    const auto g = random_vector<T>(static_cast<std::size_t>(r * e), 2);
    const mat<T> A = factor_statistic(d, ids, {n, len}, factor_side::a);
    const mat<T> G = factor_statistic(d, g, {n, len, e}, factor_side::g);

    // A = (1/R) Σ_r onehot(id_r) onehot(id_r)ᵀ = diag(count_v / R).
    mat<double> a_ref = mat<double>::Zero(v, v);
    for (T id : ids) a_ref(static_cast<std::int64_t>(id), static_cast<std::int64_t>(id)) += 1.0 / double(r);
    // Each entry is count·fl(1/R), rounded once more: 2u relative.
    CHECK(rel_err(A.template cast<double>().reshaped(), a_ref.reshaped()) < 2 * eps<T>());
    CHECK(A(2, 2) == T(0));  // the absent token
    // G = (1/R) Σ_r g_r g_rᵀ: sums of R products, error ≲ R·u of the entries' scale.
    mat<double> gm(e, r);
    for (std::int64_t i = 0; i < r; ++i)
        for (std::int64_t o = 0; o < e; ++o) gm(o, i) = double(g[static_cast<std::size_t>(i * e + o)]);
    CHECK(rel_err(G.template cast<double>().reshaped(), (gm * gm.transpose() / double(r)).reshaped()) < 4 * r * eps<T>());
}

TEMPLATE_TEST_CASE("an Embedding preconditions as the Linear layer of its one-hot rows", "[preconditioner][embedding]",
                   kfac::compute::eigendecomposition, kfac::compute::inverse) {
    using T = double;
    using method = TestType;
    const std::int64_t n = 4, len = 6, v = 11, e = 5, r = n * len;
    kfac::options opts;
    opts.damping = 0.01;
    opts.factor_decay = 0.9;
    opts.kl_clip = 0.05;
    opts.threads = 1;
    kfac::KFAC<backend<T>, kfac::comm::serial, method> emb(opts), lin(opts);
    owned_layer<T> le, ll;
    le.view.description = kfac::embedding_description(v, e);
    ll.view.description = kfac::linear_description(v, e, false);
    emb.register_layer("tokens", le.view);
    lin.register_layer("tokens", ll.view);
    double largest_difference = 0.0;
    for (int step = 0; step < 4; ++step) {
        INFO("step " << step);
        const auto seed = static_cast<std::uint32_t>(10 * step);
        const auto ids = token_ids<T>(r, v, 3, seed + 1);  // token 3 never occurs
        le.input = ids;
        le.input_shape = {n, len};
        ll.input = one_hot(ids, v);
        ll.input_shape = {n, len, v};
        le.grad_output = ll.grad_output = random_vector<T>(static_cast<std::size_t>(r * e), seed + 2, 0.1);
        le.output_shape = ll.output_shape = {n, len, e};
        // Γ of the Embedding is [V, E]; the Linear's [E, V] is its transpose.
        le.grad_weight = random_vector<T>(static_cast<std::size_t>(v * e), seed + 3, 0.1);
        ll.grad_weight.assign(le.grad_weight.size(), T(0));
        for (std::int64_t t = 0; t < v; ++t)
            for (std::int64_t o = 0; o < e; ++o)
                ll.grad_weight[static_cast<std::size_t>(o * v + t)] = le.grad_weight[static_cast<std::size_t>(t * e + o)];
        le.bind();
        ll.bind();
        emb.step();
        lin.step();
        // The A factors: the Embedding's diagonal is the Linear's dense factor, which has no
        // off-diagonal entry (sums of products of one-hot entries are exact).
        const mat<T> a_dense = lin.a_factor("tokens");
        CHECK(emb.a_factor("tokens").cols() == 1);
        CHECK(mat<T>(emb.a_factor("tokens").col(0).asDiagonal()) == a_dense);
        CHECK(emb.g_factor("tokens") == lin.g_factor("tokens"));
        // The Linear's dense solver decomposes (or inverts) the diagonal A to O(V·u) relative
        // to its largest entry; through 1/(λ_A λ_G + γ) that is amplified by at most
        // κ = (max λ_A · max λ_G + γ) / γ. Eigen's solver returns a diagonal matrix's exact
        // eigenpairs in practice, so this bound is loose.
        const double kappa = (a_dense.maxCoeff() * lin.g_factor("tokens").norm() + opts.damping(0)) / opts.damping(0);
        mat<double> p_emb(v, e), p_lin(v, e);
        for (std::int64_t t = 0; t < v; ++t)
            for (std::int64_t o = 0; o < e; ++o) {
                p_emb(t, o) = le.grad_weight[static_cast<std::size_t>(t * e + o)];
                p_lin(t, o) = ll.grad_weight[static_cast<std::size_t>(o * v + t)];
            }
        const double diff = rel_err(p_emb.reshaped(), p_lin.reshaped());
        largest_difference = std::max(largest_difference, diff);
        CHECK(diff < 8 * double(v) * kappa * eps<T>());
        CHECK(emb.last_kl_scale() == Approx(lin.last_kl_scale()).epsilon(8 * double(v) * kappa * eps<T>()));
    }
    INFO("largest relative difference " << largest_difference);
    CHECK(emb.layers()[0].kind == kfac::layer_kind::embedding);
    CHECK(emb.layers()[0].a_dim == v);
}

TEST_CASE("a token that never occurs is preconditioned by the damping alone", "[preconditioner][embedding]") {
    using T = double;
    // Its frequency decays as ξ^k from the identity's 1: after k = 40 steps with ξ = 0.5,
    // a = 2^-40, so 1/(a·λ_G + γ) = (1/γ)(1 − O(a·λ_G/γ)) and its row of P is Γ_row / γ.
    const std::int64_t len = 8, v = 6, e = 3, absent = 4;
    kfac::options opts;
    opts.damping = 0.1;
    opts.factor_decay = 0.5;
    opts.kl_clip = std::nullopt;
    opts.threads = 1;
    kfac::KFAC<backend<T>> p(opts);
    owned_layer<T> l;
    l.view.description = kfac::embedding_description(v, e);
    p.register_layer("tokens", l.view);
    for (int step = 0; step < 40; ++step) {
        const auto seed = static_cast<std::uint32_t>(step);
        l.input = token_ids<T>(len, v, absent, seed);
        l.input_shape = {len};
        l.grad_output = random_vector<T>(static_cast<std::size_t>(len * e), seed + 100);
        l.output_shape = {len, e};
        l.grad_weight = random_vector<T>(static_cast<std::size_t>(v * e), seed + 200);
        l.bind();
        const std::vector<T> before = l.grad_weight;
        p.step();
        if (step < 39) continue;
        CHECK(p.a_factor("tokens")(absent, 0) == std::ldexp(1.0, -40));
        const double lambda_g = p.g_factor("tokens").norm();
        const double bound = std::ldexp(1.0, -40) * lambda_g / 0.1 + 8 * eps<T>();
        for (std::int64_t o = 0; o < e; ++o) {
            const auto i = static_cast<std::size_t>(absent * e + o);
            CHECK(std::abs(l.grad_weight[i] - before[i] / 0.1) <= bound * std::abs(before[i] / 0.1));
        }
    }
}

TEST_CASE("Embedding checkpoints hold the diagonal and resume bitwise", "[checkpoint][embedding]") {
    using T = float;
    const std::int64_t len = 10, v = 7, e = 3;
    auto run = [&](kfac::KFAC<backend<T>>& p, owned_layer<T>& l, int first, int last) {
        for (int step = first; step < last; ++step) {
            const auto seed = static_cast<std::uint32_t>(step);
            l.input = token_ids<T>(len, v, 0, seed);
            l.input_shape = {len};
            l.grad_output = random_vector<T>(static_cast<std::size_t>(len * e), seed + 50);
            l.output_shape = {len, e};
            l.grad_weight = random_vector<T>(static_cast<std::size_t>(v * e), seed + 90);
            l.bind();
            p.step();
        }
    };
    kfac::options opts;
    opts.inv_update_steps = 2;
    opts.threads = 1;
    owned_layer<T> la, lb, lc;
    for (auto* l : {&la, &lb, &lc}) l->view.description = kfac::embedding_description(v, e);
    kfac::KFAC<backend<T>> straight(opts), first(opts), resumed(opts);
    straight.register_layer("emb", la.view);
    first.register_layer("emb", lb.view);
    resumed.register_layer("emb", lc.view);
    run(straight, la, 0, 6);
    run(first, lb, 0, 3);
    const std::string bytes = first.save_bytes();
    CHECK(bytes.find("\"emb.A\"") != std::string::npos);
    resumed.load_bytes(bytes);
    run(resumed, lc, 3, 6);
    CHECK(la.grad_weight == lc.grad_weight);
    CHECK(straight.a_factor("emb") == resumed.a_factor("emb"));
    CHECK(resumed.a_factor("emb").cols() == 1);

    // A Linear of the same shapes is another layer: the file refuses it by name.
    owned_layer<T> linear = random_linear<T>(4, v, e, false, 3);
    kfac::KFAC<backend<T>> other(opts);
    other.register_layer("emb", linear.view);
    CHECK_THROWS_WITH(other.load_bytes(bytes), Catch::Contains("'emb' (embedding 7->3, no bias)") &&
                                                   Catch::Contains("'emb' (linear 7->3, no bias)"));
}

TEST_CASE("Embedding errors name the layer, the shapes and the fix", "[errors][embedding]") {
    using T = float;
    const std::int64_t v = 5, e = 2;
    owned_layer<T> l;
    l.view.description = kfac::embedding_description(v, e);
    l.input = {0, 1, 4, 2};
    l.input_shape = {2, 2};
    l.grad_output = random_vector<T>(8, 1);
    l.output_shape = {2, 2, e};
    l.grad_weight = random_vector<T>(static_cast<std::size_t>(v * e), 2);
    l.bind();
    SECTION("a bias, or weight sharing reduce") {
        kfac::KFAC<backend<T>> p;
        auto with_bias = l.view;
        with_bias.description.bias = true;
        CHECK_THROWS_WITH(p.register_layer("emb", with_bias), Catch::Contains("layer 'emb' (embedding 5->2, bias)") &&
                                                                   Catch::Contains("an Embedding has no bias"));
        auto reduced = l.view;
        reduced.description.sharing = kfac::weight_sharing::reduce;
        CHECK_THROWS_WITH(p.register_layer("emb", reduced), Catch::Contains("Leave description.sharing at expand"));
        CHECK(p.layer_count() == 0);
        // options.reduce_layers names Linear and convolution layers; an Embedding stays expand.
        kfac::options o;
        o.reduce_layers = {".*"};
        kfac::KFAC<backend<T>> q(o);
        CHECK(q.register_layer("emb", l.view));
    }
    SECTION("ids that are not token ids, and gradients of other positions") {
        kfac::KFAC<backend<T>> p;
        p.register_layer("emb", l.view);
        l.input = {0, 1, 5, 2};  // 5 is not in [0, 5)
        CHECK_THROWS_WITH(p.step(), Catch::Contains("layer 'emb' (embedding 5->2") &&
                                        Catch::Contains("token id 5.000000 at flat position 2 of [2, 2]") &&
                                        Catch::Contains("not an integer in [0, 5)"));
        l.input = {0, 1, 2.5f, 2};
        CHECK_THROWS_WITH(p.step(), Catch::Contains("token id 2.500000"));
        l.input = {0, 1, 4, 2};
        l.output_shape = {4, e};
        l.bind();
        CHECK_THROWS_WITH(p.step(), Catch::Contains("token ids [2, 2] and output gradients [4, 2] do not match") &&
                                        Catch::Contains("output gradients [2, 2, 2]"));
        l.output_shape = {2, 2, e};
        l.bind();
        l.view.grad_weight = kfac::tensor_view<T>(l.grad_weight.data(), {e, v});  // a Linear's [out, in]
        CHECK_THROWS_WITH(p.step(), Catch::Contains("weight gradient has shape [2, 5]; expected [5, 2]"));
        CHECK(p.steps() == 0);
        l.bind();
        p.step();
        CHECK(p.steps() == 1);
    }
    SECTION("a vocabulary a float cannot count exactly") {
        kfac::layer_view<T> big;
        big.description = kfac::embedding_description((std::int64_t{1} << 24) + 1, 4);
        kfac::KFAC<backend<T>> p;
        CHECK_THROWS_WITH(p.register_layer("huge", big), Catch::Contains("use a double backend"));
        CHECK(p.layer_count() == 0);
    }
}
