// SPDX-License-Identifier: Apache-2.0
// Run under `mpiexec -n W` (kfac_mpi_tests), or as W processes of tests/mpi/launch.sh over Gloo
// (kfac_process_group_tests, built from this file with KFAC_TEST_PROCESS_GROUP; test_world.hpp):
// the communication each strategy performs (collectives and bytes per step), symmetric
// packing, bucketing, and mismatches that must raise the same error on every rank instead of
// hanging. A failure on any rank fails the test on every rank.
#include <catch2/catch.hpp>

#include "mpi/test_world.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <kfac/kfac.hpp>

#include "replay/staged_backend.hpp"
#include "unit/applied_layer.hpp"
#include "unit/flaky_layer.hpp"
#include "unit/layer_kinds.hpp"
#include "unit/test_util.hpp"

using namespace kfac_test;
using Catch::Contains;

namespace {

/// "l<i>", built by appending: GCC 12 warns falsely (-Wrestrict, bug 105329) on
/// `"l" + std::to_string(i)` at -O3.
std::string layer_name(std::size_t i) {
    std::string name = "l";
    name += std::to_string(i);
    return name;
}

template <class Method = kfac::compute::eigendecomposition>
using mpi_kfac = kfac::KFAC<kfac::backend::cpu_eigen<double>, comm_under_test, Method>;

/// Three layers of different sizes; the same data on every rank (rows split is irrelevant
/// for counting).
struct model {
    std::vector<owned_layer<double>> layers;
    model() {
        layers.push_back(random_linear<double>(8, 6, 5, true, 1));
        layers.push_back(random_linear<double>(8, 5, 4, false, 2));
        layers.push_back(random_linear<double>(8, 9, 3, true, 3));
    }
    template <class P>
    void register_all(P& p) {
        for (std::size_t i = 0; i < layers.size(); ++i) p.register_layer(layer_name(i), layers[i].view);
    }
    void reset_gradients() {
        for (auto& l : layers) {
            l.grad_weight = random_vector<double>(l.grad_weight.size(), 9, 0.1);
            l.grad_bias = random_vector<double>(l.grad_bias.size(), 10, 0.1);
            l.bind();
        }
    }
    /// The gradients reset and fresh inputs for `step`: layer i's from seed first_seed + 10·step + i.
    void next_pass(std::uint32_t first_seed, std::uint32_t step) {
        reset_gradients();
        for (std::size_t i = 0; i < layers.size(); ++i) {
            auto& l = layers[i];
            l.input = random_vector<double>(l.input.size(), first_seed + 10 * step + static_cast<std::uint32_t>(i));
            l.bind();
        }
    }
};

/// The options of every strategy this world size runs, named: KAISA's COMM_OPT, HYBRID_OPT (an
/// even world, or one process), MEM_OPT, and DP-KFAC; everything else default.
std::vector<std::pair<std::string, kfac::options>> every_strategy() {
    struct setup {
        kfac::distribution strategy;
        double fraction;
        const char* name;
    };
    std::vector<std::pair<std::string, kfac::options>> out;
    for (const setup s : {setup{kfac::distribution::kaisa, kfac::comm_opt, "kaisa comm_opt"},
                          setup{kfac::distribution::kaisa, kfac::hybrid_opt, "kaisa hybrid_opt"},
                          setup{kfac::distribution::kaisa, kfac::mem_opt, "kaisa mem_opt"},
                          setup{kfac::distribution::dp_kfac, kfac::comm_opt, "dp_kfac"}}) {
        if (s.fraction == kfac::hybrid_opt && world_size() % 2 != 0 && world_size() != 1) continue;
        kfac::options o;
        o.strategy = s.strategy;
        o.grad_worker_fraction = s.fraction;
        out.emplace_back(s.name, o);
    }
    return out;
}

/// `steps` steps of the same fresh passes (model::next_pass(first_seed, step)) for `spread`,
/// preconditioned by the ranks' `p`, and `one`, by one process's `whole`; after each, every layer's
/// preconditioned gradient of the ranks within `tolerance` of one process's.
template <class Ranks, class Whole>
void step_alike(Ranks& p, Whole& whole, model& spread, model& one, std::uint32_t first_seed, std::uint32_t steps,
                double tolerance) {
    for (std::uint32_t step = 0; step < steps; ++step) {
        for (auto* m : {&spread, &one}) m->next_pass(first_seed, step);
        p.step();
        whole.step();
        INFO("step " << step);
        for (std::size_t i = 0; i < one.layers.size(); ++i) {
            INFO("layer " << i);
            CHECK(buffer_rel_err(spread.layers[i].grad_weight, one.layers[i].grad_weight) < tolerance);
        }
    }
}

kfac::comm_counters delta(const kfac::comm_counters& after, const kfac::comm_counters& before) {
    return {after.allreduce_calls - before.allreduce_calls, after.allreduce_bytes - before.allreduce_bytes,
            after.broadcast_calls - before.broadcast_calls, after.broadcast_bytes - before.broadcast_bytes,
            after.control_calls - before.control_calls,
            after.broadcast_wait_seconds - before.broadcast_wait_seconds,
            after.allreduce_wait_seconds - before.allreduce_wait_seconds};
}

/// Expected table for KAISA with fraction f, computed from the grid's definition.
struct expectation {
    std::int64_t factor_values = 0, factor_calls = 0;
    std::int64_t second_calls = 0, second_values = 0;
    std::int64_t grad_calls = 0, grad_values = 0;
};

template <class P>
expectation expected_table(P& p, model& m, double fraction, bool eigen, bool product, bool packed) {
    const int w = world_size(), me = world_rank();
    const int g = fraction == 0.0 ? 1 : static_cast<int>(w * fraction + 0.5);
    const int columns = w / g;
    expectation e;
    for (std::size_t i = 0; i < m.layers.size(); ++i) {
        const auto& d = m.layers[i].view.description;
        const std::int64_t a = d.a_dim(), gd = d.g_dim();
        e.factor_values += packed ? a * (a + 1) / 2 + gd * (gd + 1) / 2 : a * a + gd * gd;
        const auto workers = p.workers(layer_name(i));
        const bool in_column = me % columns == workers.g % columns;
        if (g > 1 && in_column) {
            if (!eigen) {
                e.second_calls += 2;
                e.second_values += a * a + gd * gd;
            } else if (product) {  // Q_A | Q_G, D
                e.second_calls += 3;
                e.second_values += a * a + gd * gd + gd * a;
            } else {  // Q_A, λ_A | Q_G, λ_G
                e.second_calls += 4;
                e.second_values += a * a + a + gd * gd + gd;
            }
        }
        if (g < w) {
            e.grad_calls += 1;
            e.grad_values += gd * a;
        }
    }
    e.factor_values += static_cast<std::int64_t>(m.layers.size());  // the row weights
    e.factor_calls = w > 1 ? 1 : 0;
    if (w == 1) e.factor_values = 0;
    return e;
}

template <class Method>
void check_table(double fraction, bool product, bool packed) {
    const int w = world_size();
    if (fraction == kfac::hybrid_opt && w % 2 != 0 && w != 1) return;  // not valid here
    model m;
    kfac::options o;
    o.grad_worker_fraction = fraction;
    o.compute_eigenvalue_outer_product = product;
    o.symmetry_aware = packed;
    o.factor_update_steps = std::int64_t{2};
    o.inv_update_steps = std::int64_t{4};
    mpi_kfac<Method> p(o, make_comm());
    m.register_all(p);
    const bool eigen = std::is_same_v<Method, kfac::compute::eigendecomposition>;
    std::vector<kfac::comm_counters> per_step;
    for (int t = 0; t < 5; ++t) {
        m.reset_gradients();
        const auto before = p.comm().counters();
        p.step();
        per_step.push_back(delta(p.comm().counters(), before));
    }
    const auto e = expected_table(p, m, fraction, eigen, product, packed);
    INFO("W=" << w << " rank=" << world_rank() << " strategy=" << p.strategy_name() << " packed=" << packed);
    for (int t = 0; t < 5; ++t) {
        INFO("step " << t);
        const bool factor_step = t % 2 == 0, inverse_step = t % 4 == 0;
        const auto& c = per_step[static_cast<std::size_t>(t)];
        // Factor-update steps: one bucketed allreduce pass over all factors; else none.
        CHECK(c.allreduce_calls == (factor_step ? e.factor_calls : 0));
        CHECK(c.allreduce_bytes == (factor_step ? e.factor_values * 8 : 0));
        // Inverse-update steps add second-order broadcasts within columns; every step
        // carries the gradient broadcasts within rows (none under COMM_OPT).
        const std::int64_t calls = (inverse_step ? e.second_calls : 0) + e.grad_calls;
        const std::int64_t values = (inverse_step ? e.second_values : 0) + e.grad_values;
        CHECK(c.broadcast_calls == calls);
        CHECK(c.broadcast_bytes == values * 8);
    }
    if (fraction == kfac::mem_opt || w == 1) CHECK(e.second_calls == 0);
    if (fraction == kfac::comm_opt) CHECK(e.grad_calls == 0);
}

}  // namespace

TEST_CASE("communication table per strategy", "[mpi][comm]") {
    for (double f : {kfac::comm_opt, kfac::hybrid_opt, kfac::mem_opt}) {
        for (bool packed : {false, true}) {
            check_table<kfac::compute::eigendecomposition>(f, true, packed);
            check_table<kfac::compute::eigendecomposition>(f, false, packed);
            check_table<kfac::compute::inverse>(f, true, packed);
        }
    }
}

TEST_CASE("symmetric packing sends n(n+1)/2 values per factor", "[mpi][comm]") {
    if (world_size() == 1) return;
    std::int64_t bytes[2] = {0, 0};
    for (int packed = 0; packed < 2; ++packed) {
        model m;
        kfac::options o;
        o.symmetry_aware = packed == 1;
        mpi_kfac<> p(o, make_comm());
        m.register_all(p);
        p.step();
        bytes[packed] = p.comm().counters().allreduce_bytes;
    }
    // Layers: A 7, 5, 10; G 5, 4, 3 (+3 weights).
    CHECK(bytes[0] == (49 + 25 + 100 + 25 + 16 + 9 + 3) * 8);
    CHECK(bytes[1] == (28 + 15 + 55 + 15 + 10 + 6 + 3) * 8);
}

TEST_CASE("bucketing splits the factor allreduce by the cap", "[mpi][comm]") {
    if (world_size() == 1) return;
    model m;
    kfac::options o;
    o.allreduce_bucket_cap_mb = 600.0 / (1024.0 * 1024.0);  // 600 bytes: 75 doubles
    mpi_kfac<> p(o, make_comm());
    m.register_all(p);
    p.step();
    // Items in order (values): 49, 25 | 25, 16 | 100 (alone, over the cap) | 9, 3.
    CHECK(p.comm().counters().allreduce_calls == 4);
    kfac::options none;
    none.allreduce_bucket_cap_mb = 0.0;  // one call per item: 6 factors + the weights
    model m2;
    mpi_kfac<> q(none, make_comm());
    m2.register_all(q);
    q.step();
    CHECK(q.comm().counters().allreduce_calls == 7);
}

TEST_CASE("ranks that registered different layers all raise the same error", "[mpi][mismatch]") {
    if (world_size() == 1) return;
    model m;
    mpi_kfac<> p(kfac::options{}, make_comm());
    m.register_all(p);
    auto extra = random_linear<double>(8, 2, 2, false, 4);
    if (world_rank() == world_size() - 1) p.register_layer("extra", extra.view);
    const std::string last = "rank " + std::to_string(world_size() - 1);
    CHECK_THROWS_WITH(p.step(), Contains("ranks disagree on the registered layers or the options") &&
                                    Contains(last + " differs from rank 0 in layer #3: rank 0 has nothing, " + last +
                                             " has 'extra' (linear 2->2, no bias)"));
}

TEST_CASE("ranks with different shapes or options all raise the same error", "[mpi][mismatch]") {
    if (world_size() == 1) return;
    {
        auto l = random_linear<double>(8, 6, world_rank() == 0 ? 5 : 4, false, 5);
        mpi_kfac<> p(kfac::options{}, make_comm());
        p.register_layer("fc", l.view);
        CHECK_THROWS_WITH(p.step(), Contains("ranks disagree") &&
                                        Contains("rank 1 differs from rank 0 in layer #0: rank 0 has 'fc' (linear 6->5, "
                                                 "no bias), rank 1 has 'fc' (linear 6->4, no bias)"));
    }
    {
        auto l = random_linear<double>(8, 6, 5, false, 5);
        kfac::options o;
        o.damping = world_rank() == 0 ? 0.001 : 0.002;
        mpi_kfac<> p(o, make_comm());
        p.register_layer("fc", l.view);
        CHECK_THROWS_WITH(p.step(), Contains("ranks disagree") &&
                                        Contains("in options.damping: rank 0 has 0.001, rank 1 has 0.002"));
    }
    {
        auto l = random_linear<double>(8, 6, 5, false, 5);
        kfac::options o;
        if (world_rank() == world_size() - 1) o.inv_update_steps = [](std::int64_t) { return std::int64_t{1}; };
        mpi_kfac<> p(o, make_comm());
        p.register_layer("fc", l.view);
        CHECK_THROWS_WITH(p.step(), Contains("in options.inv_update_steps: rank 0 has 1") && Contains("has a schedule"));
    }
}

TEST_CASE("a bad view on one rank raises its error on every rank", "[mpi][mismatch]") {
    if (world_size() == 1) return;
    auto l = random_linear<double>(8, 6, 5, true, 6);
    if (world_rank() == 1) l.view.grad_bias = {};
    mpi_kfac<> p(kfac::options{}, make_comm());
    p.register_layer("fc", l.view);
    CHECK_THROWS_WITH(p.step(), Contains("rank 1: layer 'fc'") && Contains("bias gradient"));
}

TEST_CASE("a schedule invalid on one rank only is an error on every rank, and the next step works",
          "[mpi][agreement]") {
    if (world_size() == 1) return;
    model m;
    kfac::options o;
    auto fired = std::make_shared<bool>(false);
    // A host schedule with a bug on the last rank at step 1, once. Before, that rank threw
    // alone and the others waited for it in a collective for ever.
    o.factor_decay = [fired, bad = world_rank() == world_size() - 1](std::int64_t k) {
        if (bad && k == 1 && !*fired) {
            *fired = true;
            return 2.0;
        }
        return 0.95;
    };
    mpi_kfac<> p(o, make_comm());
    m.register_all(p);
    p.step();
    m.reset_gradients();
    CHECK_THROWS_WITH(p.step(), Contains("rank " + std::to_string(world_size() - 1) +
                                         ": options.factor_decay evaluated to 2 at step 1"));
    CHECK(p.steps() == 1);
    CHECK_NOTHROW(p.step());
    CHECK(p.steps() == 2);
}

TEST_CASE("invalid options on one rank only fail the construction on every rank", "[mpi][agreement]") {
    if (world_size() == 1) return;
    kfac::options o;
    if (world_rank() == 1) o.lr = -1.0;
    CHECK_THROWS_WITH(mpi_kfac<>(o, make_comm()), Contains("rank 1: options.lr = -1"));
}

TEST_CASE("a malformed KFAC_NUM_THREADS on one rank is an error on every rank", "[mpi][agreement]") {
    if (world_size() == 1) return;
    const char* old = std::getenv("KFAC_NUM_THREADS");
    const std::string saved = old ? old : "";
    if (world_rank() == 1) ::setenv("KFAC_NUM_THREADS", "2x", 1);
    model m;
    mpi_kfac<> p(kfac::options{}, make_comm());
    m.register_all(p);
    CHECK_THROWS_WITH(p.step(), Contains("rank 1: KFAC_NUM_THREADS='2x'"));
    if (world_rank() == 1) {
        if (old) ::setenv("KFAC_NUM_THREADS", saved.c_str(), 1);
        else ::unsetenv("KFAC_NUM_THREADS");
    }
}

TEST_CASE("a non-finite gradient on one rank only zeroes the layer on every rank", "[mpi][agreement]") {
    // A host that forgot to average a NaN away: before, only that rank zeroed the layer and
    // the ranks' models drifted apart.
    for (double f : {kfac::comm_opt, kfac::mem_opt}) {
        model m;
        kfac::options o;
        o.grad_worker_fraction = f;
        mpi_kfac<> p(o, make_comm());
        m.register_all(p);
        if (world_rank() == world_size() - 1) m.layers[1].grad_weight[2] = std::numeric_limits<double>::quiet_NaN();
        std::vector<kfac::non_finite_event> events;
        p.on_non_finite([&](const kfac::non_finite_event& e) { events.push_back(e); });
        p.step();
        INFO("fraction " << f << " rank " << world_rank());
        CHECK(p.health().zeroed_gradients == 1);
        REQUIRE(events.size() == 1);
        CHECK(events[0].layer == "l1");
        for (double x : m.layers[1].grad_weight) CHECK(x == 0.0);
        // Every rank holds the same preconditioned gradients, bit for bit.
        for (const auto& l : m.layers) {
            kfac::detail::digest d;
            d.add_bytes(l.grad_weight.data(), l.grad_weight.size() * sizeof(double));
            d.add_bytes(l.grad_bias.data(), l.grad_bias.size() * sizeof(double));
            const auto all = p.comm().allgather(d.value());
            for (auto v : all) CHECK(v == all[0]);
        }
    }
}

TEST_CASE("a gradient beyond one rank's view format zeroes the layer on every rank", "[mpi][agreement][precision]") {
    // The last rank hands float views of the same values to the double backend: P, about
    // 10³ · 10³⁶ (1/damping times the gradient, tiny factors), is finite in double and beyond
    // float. That rank cannot write it; every rank zeroes the layer, so the models stay alike.
    kfac::options o;
    o.kl_clip = std::nullopt;
    o.factor_decay = 0.0;
    for (double f : {kfac::comm_opt, kfac::mem_opt}) {
        o.grad_worker_fraction = f;
        auto wide = random_linear<double>(16, 4, 3, true, 61);
        for (double& x : wide.input) x *= 1e-3;
        for (double& x : wide.grad_output) x *= 1e-3;
        for (double& x : wide.grad_weight) x = x < 0 ? -1e36 : 1e36;
        for (double& x : wide.grad_bias) x = x < 0 ? -1e36 : 1e36;
        owned_layer<float> narrow;
        narrow.view.description = wide.view.description;
        narrow.input_shape = wide.input_shape;
        narrow.output_shape = wide.output_shape;
        for (auto [from, to] : {std::pair{&wide.input, &narrow.input}, std::pair{&wide.grad_output, &narrow.grad_output},
                                std::pair{&wide.grad_weight, &narrow.grad_weight}, std::pair{&wide.grad_bias, &narrow.grad_bias}})
            for (double x : *from) to->push_back(static_cast<float>(x));
        for (auto* x : {&wide.input, &wide.grad_output, &wide.grad_weight, &wide.grad_bias})  // float's values exactly
            for (double& v : *x) v = static_cast<double>(static_cast<float>(v));
        wide.bind();
        narrow.bind();
        const bool narrow_views = world_rank() == world_size() - 1;
        mpi_kfac<> p(o, make_comm());
        if (narrow_views) p.register_layer("fc", narrow.view);
        else p.register_layer("fc", wide.view);
        std::vector<kfac::non_finite_event> events;
        p.on_non_finite([&](const kfac::non_finite_event& e) { events.push_back(e); });
        p.step();
        INFO("fraction " << f << " rank " << world_rank());
        CHECK(p.health().zeroed_gradients == 1);
        REQUIRE(events.size() == 1);
        CHECK(events[0].source == kfac::non_finite_source::gradient);
        if (narrow_views)
            for (float x : narrow.grad_weight) CHECK(x == 0.0f);
        else
            for (double x : wide.grad_weight) CHECK(x == 0.0);
    }
}

TEST_CASE("under a loss scale, an overflow on one rank only skips the step on every rank", "[mpi][agreement][precision]") {
    // The scaler of each rank sees the allreduced gradients; kfac's vote must reach the
    // same verdict everywhere, or the ranks' factors and step counts would drift apart.
    for (double f : {kfac::comm_opt, kfac::mem_opt}) {
        model m;
        kfac::options o;
        o.grad_worker_fraction = f;
        o.loss_scale = 256.0;
        mpi_kfac<> p(o, make_comm());
        m.register_all(p);
        CHECK_FALSE(p.step().skipped);
        std::vector<Eigen::MatrixXd> factors;  // what this rank holds, before the overflow
        for (const auto& info : p.layers()) factors.push_back(p.a_factor(info.name));
        if (world_rank() == world_size() - 1) m.layers[0].grad_weight[1] = std::numeric_limits<double>::infinity();
        const kfac::step_result r = p.step();
        INFO("fraction " << f << " rank " << world_rank());
        CHECK(r.skipped);
        CHECK(p.steps() == 1);
        CHECK(p.health().skipped_steps == 1);
        const auto layers = p.layers();
        for (std::size_t i = 0; i < layers.size(); ++i) CHECK(p.a_factor(layers[i].name) == factors[i]);
        if (world_rank() == world_size() - 1) m.layers[0].grad_weight[1] = 0.0;
        CHECK_FALSE(p.step().skipped);
        CHECK(p.steps() == 2);
    }
}

TEST_CASE("every transport gives the same numbers from the same data", "[mpi][transport]") {
    // With KFAC_TEST_DUMP_DIR set, rank 0 writes, for each strategy, the preconditioned
    // gradients after each of 4 steps and the factors it holds at the end, as raw doubles; CTest
    // compares the file of kfac_mpi_tests with that of kfac_process_group_tests at the same world
    // size (tests/process_group/CMakeLists.txt). Each rank reads other inputs, so the factor
    // allreduce sums different values.
    const char* dir = std::getenv("KFAC_TEST_DUMP_DIR");
    for (auto [strategy, o] : every_strategy()) {
        INFO(strategy);
        o.damping = 0.01;
        model m;
        mpi_kfac<> p(o, make_comm());
        m.register_all(p);
        std::vector<double> out;
        for (std::uint32_t step = 0; step < 4; ++step) {
            m.next_pass(1000 + 100 * static_cast<std::uint32_t>(world_rank()), step);
            p.step();
            for (const auto& l : m.layers) {
                out.insert(out.end(), l.grad_weight.begin(), l.grad_weight.end());
                out.insert(out.end(), l.grad_bias.begin(), l.grad_bias.end());
            }
        }
        for (std::size_t i = 0; i < m.layers.size(); ++i)
            if (p.workers(layer_name(i)).a == world_rank()) {
                const Eigen::MatrixXd& a = p.a_factor(layer_name(i));
                out.insert(out.end(), a.data(), a.data() + a.size());
            }
        CHECK(std::all_of(out.begin(), out.end(), [](double v) { return std::isfinite(v); }));
        if (dir == nullptr || world_rank() != 0) continue;
        std::string name = strategy;
        std::replace(name.begin(), name.end(), ' ', '_');
        const auto path = std::filesystem::path(dir) / (name + ".np" + std::to_string(world_size()) + ".bin");
        std::ofstream file(path, std::ios::binary);
        file.write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size() * sizeof(double)));
        REQUIRE(file.good());
    }
}

TEMPLATE_TEST_CASE("overlapping the second-order broadcasts with preconditioning changes no number and no collective",
                   "[mpi][overlap]", kfac::compute::eigendecomposition, kfac::compute::inverse) {
    // options.overlap_communication only moves the wait for the second-order broadcasts after
    // the layers a rank holds the data of: the same collectives in the same order, and every
    // layer's arithmetic unchanged, so the gradients are bitwise equal at every size. A and G
    // on different ranks (colocate_factors off, without the eigenvalue outer product, which
    // needs both on one rank) make a rank receive one factor's data only.
    auto setups = every_strategy();
    kfac::options split;
    split.colocate_factors = false;
    split.compute_eigenvalue_outer_product = false;
    setups.emplace_back("kaisa comm_opt, A and G apart", split);
    for (auto [strategy, o] : setups) {
        INFO(strategy << ", W=" << world_size() << ", rank " << world_rank());
        o.damping = 0.01;
        model m_off, m_on;
        kfac::options off = o, on = o;
        off.overlap_communication = false;
        mpi_kfac<TestType> p_off(off, make_comm()), p_on(on, make_comm());
        m_off.register_all(p_off);
        m_on.register_all(p_on);
        for (std::uint32_t step = 0; step < 4; ++step) {
            INFO("step " << step);
            for (auto* m : {&m_off, &m_on}) m->next_pass(2000 + 100 * static_cast<std::uint32_t>(world_rank()), step);
            const auto before_off = p_off.comm().counters(), before_on = p_on.comm().counters();
            p_off.step();
            p_on.step();
            for (std::size_t i = 0; i < m_on.layers.size(); ++i) {
                CHECK(m_on.layers[i].grad_weight == m_off.layers[i].grad_weight);
                CHECK(m_on.layers[i].grad_bias == m_off.layers[i].grad_bias);
            }
            const auto c_off = delta(p_off.comm().counters(), before_off);
            const auto c_on = delta(p_on.comm().counters(), before_on);
            CHECK(c_on.allreduce_calls == c_off.allreduce_calls);
            CHECK(c_on.allreduce_bytes == c_off.allreduce_bytes);
            CHECK(c_on.broadcast_calls == c_off.broadcast_calls);
            CHECK(c_on.broadcast_bytes == c_off.broadcast_bytes);
            CHECK(c_on.control_calls == c_off.control_calls);
        }
    }
}

TEST_CASE("an invalid fraction names the valid values", "[mpi][errors]") {
    if (world_size() != 3) return;
    model m;
    kfac::options o;
    o.grad_worker_fraction = kfac::hybrid_opt;
    mpi_kfac<> p(o, make_comm());
    m.register_all(p);
    CHECK_THROWS_WITH(p.step(), Contains("does not divide the world size 3") && Contains("0.333333"));
}

TEST_CASE("overlapped factor allreduce: the numbers of the blocking one, bit for bit", "[mpi][overlap]") {
    // options.overlap_factor_allreduce completes the factor buckets one by one, averaging each
    // layer and (on inverse-update steps) decomposing its factors as its buckets land. The
    // buckets are the same, so are the sums; the rest is the same local arithmetic. A tiny cap
    // makes a bucket of every item, so layers land while others still travel.
    for (auto [strategy, o] : every_strategy()) {
        INFO(strategy);
        o.damping = 0.01;
        o.inv_update_steps = 2;  // decompositions overlapped at steps 0 and 2
        o.allreduce_bucket_cap_mb = 1e-5;
        kfac::options on = o;
        on.overlap_factor_allreduce = true;
        model a, b;
        mpi_kfac<> blocking(o, make_comm()), overlapped(on, make_comm());
        a.register_all(blocking);
        b.register_all(overlapped);
        for (std::uint32_t step = 0; step < 4; ++step) {
            INFO("step " << step);
            a.next_pass(500 + 100 * static_cast<std::uint32_t>(world_rank()), step);
            b.next_pass(500 + 100 * static_cast<std::uint32_t>(world_rank()), step);
            blocking.step();
            overlapped.step();
            for (std::size_t i = 0; i < a.layers.size(); ++i) {
                INFO("layer " << i);
                CHECK(a.layers[i].grad_weight == b.layers[i].grad_weight);
                CHECK(a.layers[i].grad_bias == b.layers[i].grad_bias);
            }
        }
        const auto layers = blocking.layers();
        for (std::size_t i = 0; i < a.layers.size(); ++i) {
            const auto& holders = layers[i].factor_holders;  // under DP-KFAC, the owner alone
            if (std::find(holders.begin(), holders.end(), world_rank()) == holders.end()) continue;
            CHECK(blocking.a_factor(layer_name(i)) == overlapped.a_factor(layer_name(i)));
            CHECK(blocking.g_factor(layer_name(i)) == overlapped.g_factor(layer_name(i)));
        }
        // The rows' sums travel first, apart: one allreduce more per step under KAISA.
        const bool averaged = o.strategy == kfac::distribution::kaisa && world_size() > 1;
        CHECK(overlapped.comm().counters().allreduce_calls - blocking.comm().counters().allreduce_calls ==
              (averaged ? 4 : 0));
    }
}

TEST_CASE("a failure between allreduce buckets leaves no collective pending", "[mpi][overlap]") {
    // The last rank's callback throws at the first bucket: it still completes every bucket,
    // so the sums are whole on every rank and the next collective finds the ranks in step.
    auto comm = make_comm();
    std::vector<double> x(40), y(7);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<double>(i + 1);
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = 0.5 * static_cast<double>(i);
    std::vector<kfac::allreduce_item<double>> items{{x.data(), x.size(), false, 0}, {y.data(), y.size(), false, 0}};
    const bool fails = world_rank() == world_size() - 1 && world_size() > 1;
    std::vector<std::pair<std::size_t, std::size_t>> landed;
    const auto each = [&](std::size_t first, std::size_t last) {
        landed.emplace_back(first, last);
        if (fails) throw std::runtime_error("a layer's work failed");
    };
    if (fails) {
        CHECK_THROWS_WITH(kfac::comm::allreduce_sum_each(comm, items, 64, false, comm.world(), each),
                          Contains("a layer's work failed"));
        CHECK(landed.size() == 1);  // no callback after the failure
    } else {
        kfac::comm::allreduce_sum_each(comm, items, 64, false, comm.world(), each);
        if (world_size() > 1) CHECK(landed == std::vector<std::pair<std::size_t, std::size_t>>{{0, 1}, {1, 2}});
        else CHECK(landed == std::vector<std::pair<std::size_t, std::size_t>>{{0, 2}});
    }
    // Every rank's sums are whole (the W ranks held the same values) ...
    CHECK(x[39] == 40.0 * world_size());
    CHECK(y[6] == 3.0 * world_size());
    // ... and the world answers the next collective together.
    CHECK(comm.agree(std::nullopt) == std::nullopt);
}

TEST_CASE("a posted allreduce starts each bucket once the next item does not fit, with allreduce_sum's sums",
          "[mpi][overlap]") {
    // A cap of 8 doubles: items of 5, 5 and 3 values make the buckets {0} and {1, 2}, as
    // plan_buckets makes them. kfac::comm::mpi starts bucket {0} when item 1 is added, and
    // bucket {1, 2} at close(); a policy without start_allreduce starts nothing before complete().
    auto comm = make_comm();
    const auto values = [](std::size_t n, double first) {
        std::vector<double> v(n);
        for (std::size_t i = 0; i < n; ++i) v[i] = first + 0.25 * static_cast<double>(i) + world_rank();
        return v;
    };
    std::vector<std::vector<double>> posted_data{values(5, 1.0), values(5, 2.0), values(3, 3.0)};
    auto blocking_data = posted_data;
    const auto items_of = [](std::vector<std::vector<double>>& data) {
        std::vector<kfac::allreduce_item<double>> items;
        for (auto& d : data) items.push_back({d.data(), d.size(), false, 0});
        return items;
    };
    const auto blocking_items = items_of(blocking_data);
    comm.allreduce_sum(blocking_items, 64, false, comm.world());
    const auto posted_items = items_of(posted_data);
    const bool starts_early = kfac::comm::starts_allreduce_early<comm_under_test, double>;
    const bool travels = world_size() > 1;
    const auto calls = [&] { return comm.counters().allreduce_calls; };
    const auto before = calls();
    auto sums = kfac::comm::start_allreduce<double>(comm, 64, false, comm.world());
    sums->add(posted_items[0]);
    CHECK(calls() == before);  // bucket {0} may still grow
    sums->add(posted_items[1]);
    CHECK(calls() == before + (starts_early && travels ? 1 : 0));
    sums->add(posted_items[2]);
    sums->close();
    CHECK(calls() == before + (starts_early && travels ? 2 : 0));
    std::vector<std::pair<std::size_t, std::size_t>> landed;
    sums->complete([&](std::size_t first, std::size_t last) { landed.emplace_back(first, last); });
    CHECK(calls() == before + (travels ? 2 : 0));
    if (travels) CHECK(landed == std::vector<std::pair<std::size_t, std::size_t>>{{0, 1}, {1, 3}});
    else CHECK(landed == std::vector<std::pair<std::size_t, std::size_t>>{{0, 3}});
    CHECK(posted_data == blocking_data);  // the same buckets summed: the same bits
}

TEST_CASE("a posted allreduce released before complete() leaves no collective pending", "[mpi][overlap]") {
    // What every rank does when a failure during the capture was agreed: the buckets it started
    // and its last one are completed as it is destroyed, so the next collective finds the ranks
    // in step.
    auto comm = make_comm();
    std::vector<double> x(40, 1.0), y(7, 2.0);
    {
        auto sums = kfac::comm::start_allreduce<double>(comm, 64, false, comm.world());
        sums->add({x.data(), x.size(), false, 0});
        sums->add({y.data(), y.size(), false, 0});
        if (world_rank() == 0) sums->close();  // with or without close(), the same buckets
    }
    CHECK(comm.agree(std::nullopt) == std::nullopt);
    const auto again = kfac::comm::start_allreduce<double>(comm, 64, false, comm.world());
    again->add({y.data(), y.size(), false, 0});
    again->complete({});
    CHECK(comm.agree(std::nullopt) == std::nullopt);
}

TEST_CASE("overlapped factor allreduce: the buckets start during the capture, before the host's end_pass",
          "[mpi][overlap]") {
    // A cap that makes a bucket of every item: 2 layers' A and G and the rows weights are 5
    // buckets, after the rows' own allreduce. By the last end_pass() of the step, a policy that
    // posts early (kfac::comm::mpi) has started all 6; one without has summed the rows only; and
    // without overlap nothing has travelled yet.
    for (const bool overlap : {false, true}) {
        INFO("overlap_factor_allreduce " << overlap);
        flaky_layer first{4, 3, true}, second{3, 5, true};
        kfac::options o;
        o.damping = 0.01;
        o.overlap_factor_allreduce = overlap;
        o.allreduce_bucket_cap_mb = 1e-6;
        mpi_kfac<> p(o, make_comm());
        p.register_layer("first", first);
        p.register_layer("second", second);
        std::int64_t at_step = 0, at_end_pass = -1;
        second.observe = [&](kfac_test::member m) {
            if (m == kfac_test::member::end_pass) at_end_pass = p.comm().counters().allreduce_calls - at_step;
        };
        for (std::uint32_t k = 0; k < 2; ++k) {
            first.pass(10 * k + 1);
            second.pass(10 * k + 101);
            at_step = p.comm().counters().allreduce_calls;
            p.step();
            const bool starts_early = kfac::comm::starts_allreduce_early<comm_under_test, double>;
            const std::int64_t expected = !overlap || world_size() == 1 ? 0 : (starts_early ? 6 : 1);
            CHECK(at_end_pass == expected);
        }
    }
}

TEST_CASE("DP-KFAC: only the owner holds a layer's factors", "[mpi][dp_kfac]") {
    model m;
    kfac::options o;
    o.strategy = kfac::distribution::dp_kfac;
    mpi_kfac<> p(o, make_comm());
    m.register_all(p);
    const auto before = p.comm().counters();
    p.step();
    const auto c = delta(p.comm().counters(), before);
    CHECK(c.allreduce_calls == 0);  // no factor communication
    CHECK(c.broadcast_calls == (world_size() > 1 ? 3 : 0));  // one gradient broadcast per layer
    for (std::size_t i = 0; i < m.layers.size(); ++i) {
        const std::string name = layer_name(i);
        const int owner = p.workers(name).a;
        if (owner == world_rank()) {
            CHECK_FALSE(p.a_factor(name).isIdentity());
            CHECK_FALSE(p.g_factor(name).isIdentity());
            continue;
        }
        // A non-owner keeps no factors: its matrices are the identity they started at, which
        // must not pass for the layer's factor. The error names the rank that has it.
        const std::string owner_text = "rank " + std::to_string(owner) + " does (its owner)";
        CHECK_THROWS_WITH(p.a_factor(name), Catch::Contains(name) && Catch::Contains(owner_text) &&
                                                Catch::Contains("dp_kfac") && Catch::Contains("a_factor()"));
        CHECK_THROWS_WITH(p.g_factor(name), Catch::Contains(owner_text) && Catch::Contains("g_factor()"));
    }
}

int main(int argc, char** argv) { return kfac_test::run_in_world(argc, argv); }

#if KFAC_TEST_PROCESS_GROUP
// Hidden ([.]): it leaves the world unable to communicate, so it runs alone, with a short
// KFAC_TEST_TIMEOUT_MS (tests/mpi/CMakeLists.txt).
TEST_CASE("a rank that never joins a step is a timeout error naming the rank and the phase on the others",
          "[.timeout][process_group]") {
    world_broken() = true;
    if (world_size() == 1) return;
    model m;
    mpi_kfac<> p(kfac::options{}, make_comm());
    m.register_all(p);
    p.step();  // set up together; the next step's first collective is the plan's agreement
    if (world_rank() == world_size() - 1) {
        // Stays away longer than the timeout, then leaves without a word.
        std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(std::getenv("KFAC_TEST_TIMEOUT_MS")) * 2));
        return;
    }
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(p.step(), Contains("kfac::comm::process_group: rank " + std::to_string(world_rank()) + " of " +
                                         std::to_string(world_size()) + ": ") &&
                                    Contains("the failure agreement in the step's plan") &&
                                    Contains("timed out after " + std::string(std::getenv("KFAC_TEST_TIMEOUT_MS")) + " ms") &&
                                    !Contains("frame #"));  // LibTorch's backtrace left out
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
}

TEST_CASE("two preconditioners over one process group step at once, each on its own thread",
          "[process_group][threads]") {
    // A process group matches collectives by the order each rank issues them: two
    // preconditioners' collectives, interleaved differently on two ranks, met the wrong peers
    // (Gloo aborted a rank, or a wait timed out). A policy constructed while another is alive
    // over the group builds a world of its own: each preconditioner's numbers are then those of
    // running it alone, bit for bit.
    auto run = [](mpi_kfac<>& p, model& m, std::uint32_t seed, std::vector<double>& out) {
        for (std::uint32_t step = 0; step < 6; ++step) {
            m.next_pass(seed + 100 * static_cast<std::uint32_t>(world_rank()), step);
            p.step();
            for (const auto& l : m.layers) out.insert(out.end(), l.grad_weight.begin(), l.grad_weight.end());
        }
    };
    kfac::options o;
    o.damping = 0.01;
    o.threads = 1;
    std::vector<double> alone[2], together[2];
    for (int i = 0; i < 2; ++i) {
        model m;
        mpi_kfac<> p(o, make_comm());
        CHECK_FALSE(p.comm().has_own_world());  // alone over the group: it uses it
        m.register_all(p);
        run(p, m, 300 + 400 * static_cast<std::uint32_t>(i), alone[i]);
    }
    model m[2];
    mpi_kfac<> first(o, make_comm()), second(o, make_comm());
    CHECK_FALSE(first.comm().has_own_world());
    CHECK(second.comm().has_own_world() == (world_size() > 1));
    mpi_kfac<>* p[2] = {&first, &second};
    std::exception_ptr failure[2];
    std::vector<std::thread> threads;
    for (int i = 0; i < 2; ++i) {
        m[i].register_all(*p[i]);
        threads.emplace_back([&, i] {
            try {
                run(*p[i], m[i], 300 + 400 * static_cast<std::uint32_t>(i), together[i]);
            } catch (...) {
                failure[i] = std::current_exception();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < 2; ++i) {
        INFO("preconditioner " << i);
        if (failure[i]) std::rethrow_exception(failure[i]);
        CHECK(together[i] == alone[i]);
    }
}

TEST_CASE("a process group timeout beyond 24 hours is refused, naming the bound", "[process_group][errors]") {
    // milliseconds::max() overflowed every wait's deadline: each collective failed at once,
    // "timed out after 9223372036854775807 ms".
    auto& w = kfac_test::detail::the_world();
    auto make = [&](std::chrono::milliseconds t) {
        return kfac::comm::process_group(w.pg, w.store, kfac::comm::gloo_groups(w.options), t);
    };
    CHECK_THROWS_WITH(make(std::chrono::milliseconds::max()),
                      Contains("at most 24 hours (86400000 ms)") && Contains("not 9223372036854775807 ms"));
    CHECK_THROWS_WITH(make(std::chrono::hours(24) + std::chrono::milliseconds(1)), Contains("at most 24 hours"));
    CHECK_NOTHROW(make(std::chrono::hours(24)));
}

// A world of one only: a policy with CUDA payloads runs its control collectives (the
// agreement on this very error) on CUDA tensors, which this machine may not have; alone, the
// agreement sends nothing.
TEST_CASE("a process group with CUDA payloads is refused by a host backend", "[process_group][payloads]") {
    if (world_size() != 1) return;
    auto& w = kfac_test::detail::the_world();
    kfac::comm::process_group comm(w.pg, w.store, kfac::comm::gloo_groups(w.options), kfac_test::detail::test_timeout(),
                                   c10::Device(c10::kCUDA, 0));
    CHECK(comm.reads_device_memory());
    CHECK_THROWS_WITH(mpi_kfac<>(kfac::options{}, std::move(comm)),
                      Contains("reads device memory") && Contains("use the CUDA backend"));
    kfac::comm::process_group on_host(w.pg, w.store, kfac::comm::gloo_groups(w.options),
                                      kfac_test::detail::test_timeout(), c10::Device(c10::kCPU));
    CHECK_FALSE(on_host.reads_device_memory());  // CPU tensors are host memory
}
#endif

TEST_CASE("checkpoints: one file from every strategy, and failures raised on every rank", "[mpi][checkpoint]") {
    const int world = world_size();
    // Save under each distribution valid at this world size; a single-process preconditioner
    // loads each file and must hold the saving run's factors (rank 0's, which under KAISA
    // every rank holds, and under DP-KFAC each owner sent).
    struct config {
        kfac::distribution strategy;
        double fraction;
    };
    std::vector<config> configs = {{kfac::distribution::kaisa, kfac::comm_opt}, {kfac::distribution::kaisa, kfac::mem_opt}};
    if (world > 1) configs.push_back({kfac::distribution::dp_kfac, kfac::comm_opt});
    for (const auto& c : configs) {
        model m;
        kfac::options o;
        o.strategy = c.strategy;
        o.grad_worker_fraction = c.fraction;
        mpi_kfac<> p(o, make_comm());
        m.register_all(p);
        for (int k = 0; k < 3; ++k) {
            m.reset_gradients();
            p.step();
        }
        const std::string bytes = p.save_bytes();
        CHECK((world_rank() == 0) == !bytes.empty());
        // Every rank's own factors for the layers it holds, sent to rank 0 for comparison.
        const auto layers = p.layers();
        for (std::size_t i = 0; i < layers.size(); ++i) {
            const int holder = layers[i].factor_holders.front();
            // Only a holder keeps the factors (under DP-KFAC the others raise an error).
            Eigen::MatrixXd a = world_rank() == holder ? p.a_factor(layer_name(i))
                                                       : Eigen::MatrixXd(layers[i].a_dim, layers[i].a_dim);
            world_broadcast(a.data(), static_cast<std::size_t>(a.size()), holder);
            if (world_rank() != 0) continue;
            kfac::KFAC<kfac::backend::cpu_eigen<double>> single(o);
            model m2;
            m2.register_all(single);
            single.load_bytes(bytes, {.allow_changed_options = true});
            CHECK(single.steps() == 3);
            CHECK(single.a_factor(layer_name(i)) == a);
        }
    }
    // A file only rank 0 cannot read: every rank raises rank 0's error, none hangs.
    model m;
    mpi_kfac<> p(kfac::options{}, make_comm());
    m.register_all(p);
    const std::string who = world > 1 ? "rank 0: " : "";
    CHECK_THROWS_WITH(p.load("no/such/folder/kfac.safetensors"), Contains(who + "checkpoint") && Contains("cannot open"));
    // A folder is no checkpoint: a kfac::error naming it on rank 0, so every rank's names it
    // too (a stream library's exception reached the other ranks as its text, without the path).
    const std::string folder = std::filesystem::temp_directory_path().string();
    CHECK_THROWS_WITH(p.load(folder), Contains(who + "checkpoint " + folder) && Contains("not a regular file"));
    CHECK_THROWS_WITH(p.save("no/such/folder/kfac.safetensors"), Contains(who + "checkpoint") && Contains("cannot create"));
    m.reset_gradients();
    p.step();  // still usable on every rank
    CHECK(p.steps() == 1);
}

TEST_CASE("a layer applied on some ranks only: the factors average the ranks that applied it", "[mpi][applications]") {
    // Rank r applies "branch" iff r is even, on 8 rows of its own data; every rank applies
    // "trunk". With equal rows the rows-weighted mean over the applying ranks is the
    // statistic of their rows together, which one process computes from the concatenation.
    const int w = world_size(), me = world_rank();
    applied_layer<double> branch(4, 3, true), trunk(3, 2, false);
    kfac::options o;
    o.damping = 0.01;
    mpi_kfac<> p(o, make_comm());
    p.register_layer("branch", branch);
    p.register_layer("trunk", trunk);
    if (me % 2 == 0) branch.apply(8, static_cast<std::uint32_t>(100 + me));
    trunk.apply(8, 7);
    p.step();

    std::vector<double> input, grad_output;
    std::int64_t rows = 0;
    for (int r = 0; r < w; r += 2) {
        const auto l = random_linear<double>(8, 4, 3, true, static_cast<std::uint32_t>(100 + r));
        input.insert(input.end(), l.input.begin(), l.input.end());
        grad_output.insert(grad_output.end(), l.grad_output.begin(), l.grad_output.end());
        rows += 8;
    }
    kfac::layer_view<double> together;
    together.description = kfac::linear_description(4, 3, true);
    together.input = kfac::tensor_view<const double>(input.data(), {rows, 4});
    together.grad_output = kfac::tensor_view<const double>(grad_output.data(), {rows, 3});
    std::vector<double> gw(12), gb(3);
    together.grad_weight = kfac::tensor_view<double>(gw.data(), {3, 4});
    together.grad_bias = kfac::tensor_view<double>(gb.data(), {3});
    kfac::KFAC<kfac::backend::cpu_eigen<double>> single(o);
    single.register_layer("branch", together);
    single.step();
    INFO("W=" << w << " rank " << me);
    // Sums of ≤ 16 products, scaled and averaged over ≤ 2 ranks: 64ε is ample.
    CHECK(rel_err(p.a_factor("branch").reshaped(), single.a_factor("branch").reshaped()) < 64 * eps<double>());
    CHECK(rel_err(p.g_factor("branch").reshaped(), single.g_factor("branch").reshaped()) < 64 * eps<double>());
}

TEST_CASE("a layer with a gradient on some ranks only is an error on every rank", "[mpi][applications]") {
    const int w = world_size(), me = world_rank();
    applied_layer<double> a(4, 3, true), b(3, 2, false);
    mpi_kfac<> p({}, make_comm());
    p.register_layer("a", a);
    p.register_layer("b", b);
    a.apply(8, 1);
    b.apply(8, 2);
    b.gradient = me != w - 1;  // the last rank has none
    const auto weight = a.grad_weight;
    if (w == 1) {  // alone, a missing gradient is simply left alone
        p.step();
        CHECK(p.steps() == 1);
        return;
    }
    CHECK_THROWS_WITH(p.step(), Contains("layer 'b'") && Contains("has a gradient on some ranks and none on others"));
    CHECK(p.steps() == 0);
    CHECK(a.grad_weight == weight);
    // None on every rank: left alone everywhere, and the step goes through.
    b.gradient = false;
    p.step();
    CHECK(p.steps() == 1);
}

namespace {

/// Examples [first, first + count) of a batch spread over the ranks, each an input of `in_tail`
/// extents and an output gradient of `out_tail` extents, into `l`: example e of the whole batch
/// has the same data wherever it is held (seeded by seed + e).
void fill_examples(owned_layer<double>& l, std::int64_t first, std::int64_t count, std::uint32_t seed,
                   std::vector<std::int64_t> in_tail, std::vector<std::int64_t> out_tail) {
    auto elements = [](const std::vector<std::int64_t>& tail) {
        std::int64_t n = 1;
        for (auto e : tail) n *= e;
        return static_cast<std::size_t>(n);
    };
    l.input.clear();
    l.grad_output.clear();
    for (std::int64_t e = first; e < first + count; ++e) {
        const auto x = random_vector<double>(elements(in_tail), seed + static_cast<std::uint32_t>(e));
        const auto g = random_vector<double>(elements(out_tail), seed + 100 + static_cast<std::uint32_t>(e), 0.1);
        l.input.insert(l.input.end(), x.begin(), x.end());
        l.grad_output.insert(l.grad_output.end(), g.begin(), g.end());
    }
    in_tail.insert(in_tail.begin(), count);
    out_tail.insert(out_tail.begin(), count);
    l.input_shape = in_tail;
    l.output_shape = out_tail;
}

/// A Conv1d(2 → 3, kernel 3, padding 1) over length 9 and a Linear(5 → 2) over 4 tokens, named
/// "conv" and "seq", holding examples [from, from + count) of a batch spread over the ranks:
/// rank r holds N_r = 2 + r of them, after the lower ranks' (fill_examples).
struct conv1d_and_tokens {
    static constexpr std::int64_t c = 2, len = 9, c_out = 3, k = 3, r = 4, in = 5, out = 2;
    static constexpr kfac::conv1d_geometry geometry{k, 1, 1, 1, 1};
    owned_layer<double> conv, seq;

    conv1d_and_tokens() {
        conv.view.description = kfac::conv1d_description(c, c_out, geometry, true);
        seq.view.description = kfac::linear_description(in, out, true);
    }
    static std::int64_t examples_of(int rank) { return std::int64_t{2} + rank; }
    /// The first example a rank holds, and the examples of all ranks.
    static std::int64_t first_example_of(int rank) {
        std::int64_t first = 0;
        for (int q = 0; q < rank; ++q) first += examples_of(q);
        return first;
    }
    static std::int64_t first_example() { return first_example_of(world_rank()); }
    static std::int64_t total_examples() {
        std::int64_t total = 0;
        for (int q = 0; q < world_size(); ++q) total += examples_of(q);
        return total;
    }
    template <class P>
    void register_with(P& p) {
        p.register_layer("conv", conv.view);
        p.register_layer("seq", seq.view);
    }
    /// The step's examples [from, from + count) and fresh gradients.
    void load(std::int64_t from, std::int64_t count, std::uint32_t step) { load(from, count, from, count, step); }
    /// The step with the conv layer's examples and the Linear's from different ranges.
    void load(std::int64_t conv_from, std::int64_t conv_count, std::int64_t seq_from, std::int64_t seq_count,
              std::uint32_t step) {
        const std::int64_t lo = kfac::conv_output_extent(len, k, 1, 1, 1);
        fill_examples(conv, conv_from, conv_count, 1000 * step + 100, {c, len}, {c_out, lo});
        fill_examples(seq, seq_from, seq_count, 1000 * step + 300, {r, in}, {r, out});
        conv.grad_weight = random_vector<double>(static_cast<std::size_t>(c_out * c * k), 500 + step, 0.1);
        conv.grad_bias = random_vector<double>(static_cast<std::size_t>(c_out), 600 + step, 0.1);
        seq.grad_weight = random_vector<double>(static_cast<std::size_t>(out * in), 700 + step, 0.1);
        seq.grad_bias = random_vector<double>(static_cast<std::size_t>(out), 800 + step, 0.1);
        conv.bind();
        conv.view.grad_weight = kfac::tensor_view<double>(conv.grad_weight.data(), {c_out, c, k});
        seq.bind();
    }
    /// This rank's share of the step.
    void load_mine(std::uint32_t step) { load(first_example(), examples_of(world_rank()), step); }
    /// Every rank's examples, as one process holds them.
    void load_all(std::uint32_t step) { load(0, total_examples(), step); }
    /// Each layer's owner's examples, as DP-KFAC's owners see them.
    void load_owners(int conv_owner, int seq_owner, std::uint32_t step) {
        load(first_example_of(conv_owner), examples_of(conv_owner), first_example_of(seq_owner), examples_of(seq_owner),
             step);
    }
};

}  // namespace

TEST_CASE("Conv1d and reduce layers: ranks with different batches equal one process with all of them", "[mpi][conv1d][weight_sharing]") {
    // Rank r holds N_r = 2 + r examples. Under every KAISA strategy the factors average the
    // ranks' statistics weighted by their examples (statistic_rows: the examples of a Conv1d
    // and of a reduce Linear, not its positions), which equals one process over every rank's
    // examples; the preconditioned gradients must then agree with that process's.
    const int world = world_size();
    for (double fraction : {kfac::comm_opt, kfac::hybrid_opt, kfac::mem_opt}) {
        if (fraction == kfac::hybrid_opt && world % 2 != 0 && world != 1) continue;
        INFO("fraction " << fraction);
        kfac::options o;
        o.grad_worker_fraction = fraction;
        o.damping = 0.01;
        o.reduce_layers = {"^seq$"};
        mpi_kfac<> p(o, make_comm());
        kfac::KFAC<kfac::backend::cpu_eigen<double>> whole(o);
        conv1d_and_tokens mine, all;
        mine.register_with(p);
        all.register_with(whole);
        for (std::uint32_t step = 0; step < 2; ++step) {
            mine.load_mine(step);
            all.load_all(step);
            p.step();
            whole.step();
            // Sums in another order (per rank, then across): ~1e-15 relative in the factors,
            // amplified by the damped solve (≤ (λ_max + γ)/γ ≈ 10² here): 1e-10 bounds it.
            CHECK(buffer_rel_err(mine.conv.grad_weight, all.conv.grad_weight) < 1e-10);
            CHECK(buffer_rel_err(mine.seq.grad_weight, all.seq.grad_weight) < 1e-10);
            CHECK(buffer_rel_err(mine.seq.grad_bias, all.seq.grad_bias) < 1e-10);
        }
    }
}

TEST_CASE("EKFAC under every strategy: ranks with different batches equal one process with all of them",
          "[mpi][ekfac]") {
    // Rank r holds N_r = 2 + r examples of a Conv1d and of a Linear over 4 tokens (weight sharing
    // expand: each example's gradient sums its tokens). Under KAISA each rank estimates the scaling
    // from its own examples in the layer's bases (every rank holds them under COMM_OPT; under
    // HYBRID_OPT and MEM_OPT the layer's column broadcasts them to the others first); the ranks'
    // estimates weighted by their examples average to the estimate over all of them, one
    // process's. Under DP-KFAC a layer's owner estimates it from its own examples, as its factors:
    // one process over the owner's examples. Step 0 computes bases and S afresh, step 1 averages S
    // into the old bases, step 2 again afresh. Under the per-example statistics each rank's output
    // gradients are its own mean loss's, N/N_r times one process's (as a data-parallel host's are),
    // and S is N_r² times its estimate there (under DP-KFAC the owner's own, which one process over
    // its examples sees too).
    const int world = world_size();
    struct setup {
        kfac::distribution strategy;
        double fraction;
    };
    for (const setup s : {setup{kfac::distribution::kaisa, kfac::comm_opt}, setup{kfac::distribution::kaisa, kfac::hybrid_opt},
                          setup{kfac::distribution::kaisa, kfac::mem_opt}, setup{kfac::distribution::dp_kfac, kfac::comm_opt}})
        for (const auto statistics : {kfac::statistic_scale::reference, kfac::statistic_scale::per_example}) {
            if (s.fraction == kfac::hybrid_opt && world % 2 != 0 && world != 1) continue;
            const bool dp = s.strategy == kfac::distribution::dp_kfac;
            INFO("dp_kfac " << dp << ", fraction " << s.fraction << ", " << kfac::detail::option_value_name(statistics));
            kfac::options o;
            o.strategy = s.strategy;
            o.grad_worker_fraction = s.fraction;
            o.damping = 0.01;
            o.inv_update_steps = 2;
            o.statistics = statistics;
            if (statistics == kfac::statistic_scale::per_example) o.averaging = kfac::factor_averaging::bias_corrected;
            mpi_kfac<kfac::compute::ekfac> p(o, make_comm());
            kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial, kfac::compute::ekfac> whole(o);
            conv1d_and_tokens mine, all;
            mine.register_with(p);
            all.register_with(whole);
            const double mean_loss_ratio = static_cast<double>(conv1d_and_tokens::total_examples()) /
                                           static_cast<double>(conv1d_and_tokens::examples_of(world_rank()));
            for (std::uint32_t step = 0; step < 3; ++step) {
                INFO("step " << step);
                mine.load_mine(step);
                if (dp)
                    all.load_owners(p.workers("conv").g, p.workers("seq").g, step);
                else
                    all.load_all(step);
                if (statistics == kfac::statistic_scale::per_example && !dp)
                    for (auto* g : {&mine.conv.grad_output, &mine.seq.grad_output})
                        for (auto& x : *g) x *= mean_loss_ratio;
                p.step();
                whole.step();
                // The factors are summed in another order (per rank, then across): ~1e-15 relative.
                // Unlike K-FAC's P, EKFAC's S is not invariant under a rotation of the bases, and the
                // eigenvectors move by that perturbation over the relative eigengap (Davis–Kahan): with
                // κ = λ_max / min gap of a layer's factors, the bases, S and P (S enters through a
                // division damped by γ = 0.01, ≤ 10² amplification) differ by about 1e-15 · κ · 10²,
                // bounded by 1e-12 · κ (+ 1e-10, the eigen method's bound for these layers). An
                // estimate not weighted by the ranks' examples misses it by orders of magnitude more.
                auto conditioning = [&](const std::string& name) {
                    double kappa = 1.0;
                    for (const bool a : {true, false}) {
                        const mat<double> f = a ? whole.a_factor(name) : whole.g_factor(name);
                        Eigen::SelfAdjointEigenSolver<mat<double>> solver(f);
                        const auto& lambda = solver.eigenvalues();
                        double gap = std::numeric_limits<double>::infinity();
                        for (Eigen::Index i = 1; i < lambda.size(); ++i) gap = std::min(gap, lambda(i) - lambda(i - 1));
                        kappa = std::max(kappa, lambda.cwiseAbs().maxCoeff() / gap);
                    }
                    return kappa;
                };
                const double conv_tolerance = 1e-10 + 1e-12 * conditioning("conv");
                const double seq_tolerance = 1e-10 + 1e-12 * conditioning("seq");
                INFO("tolerances " << conv_tolerance << ", " << seq_tolerance);
                CHECK(buffer_rel_err(mine.conv.grad_weight, all.conv.grad_weight) < conv_tolerance);
                CHECK(buffer_rel_err(mine.conv.grad_bias, all.conv.grad_bias) < conv_tolerance);
                CHECK(buffer_rel_err(mine.seq.grad_weight, all.seq.grad_weight) < seq_tolerance);
            }
        }
}

TEST_CASE("EKFAC checkpoints: S saved under MEM_OPT resumes under every KAISA strategy and in one process",
          "[mpi][ekfac][checkpoint]") {
    // Bases are new at steps 0, 2 and 4 (inv_update_steps = 2). The save after step 2 holds S as
    // just estimated in that step's bases, and step 3 averages into it (S ← ξS + (1 − ξ)Ŝ): step
    // 3's gradient reads the saved S and bases. Under MEM_OPT a layer's S lives on its one
    // gradient worker; the checkpoint gathers it from there and a loading strategy hands it to
    // the ranks that keep it. At the same world size every strategy does the same arithmetic on
    // the same values (the same allreduces; each decomposition on one rank, with the same code),
    // so the resumed steps equal the straight run's bit for bit. One process over every rank's
    // examples continues step 3 from the file with its factors and S summed in another order
    // (~1e-15 relative) and no decomposition between: 1e-10 bounds it.
    const int world = world_size();
    using ekfac_mpi = mpi_kfac<kfac::compute::ekfac>;
    auto options_for = [](double fraction) {
        kfac::options o;
        o.grad_worker_fraction = fraction;
        o.damping = 0.01;
        o.inv_update_steps = 2;
        o.factor_decay = 0.7;
        return o;
    };
    auto run = [](auto& p, conv1d_and_tokens& m, std::uint32_t from, std::uint32_t to) {
        std::vector<std::vector<double>> grads;
        for (std::uint32_t step = from; step < to; ++step) {
            m.load_mine(step);
            p.step();
            grads.push_back(m.conv.grad_weight);
            grads.push_back(m.seq.grad_weight);
        }
        return grads;
    };
    ekfac_mpi straight(options_for(kfac::mem_opt), make_comm());
    conv1d_and_tokens s;
    s.register_with(straight);
    const auto expected = run(straight, s, 0, 5);  // steps 3 and 4 at [6, 10)
    ekfac_mpi saving(options_for(kfac::mem_opt), make_comm());
    conv1d_and_tokens m;
    m.register_with(saving);
    run(saving, m, 0, 3);
    const std::string bytes = saving.save_bytes();
    for (const double fraction : {kfac::comm_opt, kfac::hybrid_opt, kfac::mem_opt}) {
        if (fraction == kfac::hybrid_opt && world % 2 != 0 && world != 1) continue;
        INFO("resumed with grad_worker_fraction " << fraction);
        ekfac_mpi resumed(options_for(fraction), make_comm());
        conv1d_and_tokens r;
        r.register_with(resumed);
        resumed.load_bytes(bytes, {.allow_changed_options = true});
        const auto got = run(resumed, r, 3, 5);
        for (std::size_t k = 0; k < got.size(); ++k) CHECK(got[k] == expected[6 + k]);
    }
    if (world_rank() != 0) return;
    kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial, kfac::compute::ekfac> single(options_for(kfac::comm_opt));
    conv1d_and_tokens all;
    all.register_with(single);
    single.load_bytes(bytes, {.allow_changed_options = true});
    all.load_all(3);
    single.step();
    CHECK(buffer_rel_err(all.conv.grad_weight, expected[6]) < 1e-10);
    CHECK(buffer_rel_err(all.seq.grad_weight, expected[7]) < 1e-10);
}

TEMPLATE_TEST_CASE("Embedding layers: ranks with different token counts equal one process with all of them",
                   "[mpi][embedding]", kfac::compute::eigendecomposition, kfac::compute::inverse) {
    // Rank r holds R_r = 3 + 2r token positions; its statistics weigh by R_r (every token is a
    // row), so the factors and the preconditioned gradients equal one process's over every
    // rank's tokens, under KAISA's strategies (the diagonal A travels in the factor allreduce
    // and, when shared, as its eigenvalues or reciprocals). Under DP-KFAC the owner builds
    // the factors from its own tokens and broadcasts the result: every rank then equals one
    // process over the owner's tokens.
    const int world = world_size(), me = world_rank();
    const std::int64_t v = 13, e = 4;
    auto positions_of = [](int rank) { return std::int64_t{3} + 2 * rank; };
    // Position p of the whole batch has the same id and output gradient wherever it is held.
    auto fill = [&](owned_layer<double>& l, std::int64_t first, std::int64_t count, std::uint32_t step) {
        l.input.clear();
        l.grad_output.clear();
        for (std::int64_t p = first; p < first + count; ++p) {
            const auto u = random_vector<double>(1, 1000 * step + static_cast<std::uint32_t>(p));  // normal
            l.input.push_back(std::clamp(std::floor((u[0] + 1.0) / 2.0 * double(v - 1)), 0.0, double(v - 2)));  // never v − 1
            const auto g = random_vector<double>(static_cast<std::size_t>(e), 5000 * step + static_cast<std::uint32_t>(p), 0.1);
            l.grad_output.insert(l.grad_output.end(), g.begin(), g.end());
        }
        l.input_shape = {count};
        l.output_shape = {count, e};
        l.grad_weight = random_vector<double>(static_cast<std::size_t>(v * e), 900 + step, 0.1);
        l.bind();
    };
    auto first_of = [&](int rank) {  // positions held by the ranks before `rank`
        std::int64_t f = 0;
        for (int q = 0; q < rank; ++q) f += positions_of(q);
        return f;
    };
    const std::int64_t first = first_of(me), total = first_of(world);
    struct setup {
        kfac::distribution strategy;
        double fraction;
    };
    for (const setup s : {setup{kfac::distribution::kaisa, kfac::comm_opt}, setup{kfac::distribution::kaisa, kfac::mem_opt},
                          setup{kfac::distribution::dp_kfac, kfac::comm_opt}}) {
        const bool dp = s.strategy == kfac::distribution::dp_kfac;
        INFO("dp_kfac " << dp << ", fraction " << s.fraction);
        kfac::options o;
        o.strategy = s.strategy;
        o.grad_worker_fraction = s.fraction;
        o.damping = 0.01;
        mpi_kfac<TestType> p(o, make_comm());
        kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial, TestType> whole(o);
        owned_layer<double> emb, emb_all;
        for (auto* l : {&emb, &emb_all}) l->view.description = kfac::embedding_description(v, e);
        p.register_layer("emb", emb.view);
        whole.register_layer("emb", emb_all.view);
        const int owner = p.workers("emb").g;
        for (std::uint32_t step = 0; step < 2; ++step) {
            fill(emb, first, positions_of(me), step);
            if (dp) fill(emb_all, first_of(owner), positions_of(owner), step);
            else fill(emb_all, 0, total, step);
            p.step();
            whole.step();
            // Sums in another order: ~1e-15 relative in the factors, amplified by the damped
            // solve by at most (λ_max + γ)/γ ≈ 10²: 1e-10 bounds it.
            CHECK(buffer_rel_err(emb.grad_weight, emb_all.grad_weight) < 1e-10);
        }
    }
}

TEST_CASE("grouped convolutions: ranks with different batches equal one process with all of them", "[mpi][grouped_conv]") {
    // A depthwise-style grouped conv (4 groups) and a grouped conv with bias (2 groups): their
    // group blocks are placed, averaged and shared like separate layers. Rank r holds
    // N_r = 1 + r examples; every KAISA strategy must equal one process over all examples.
    const int world = world_size(), me = world_rank();
    const std::int64_t c = 4, h = 5, w = 5;
    auto examples_of = [](int rank) { return std::int64_t{1} + rank; };
    std::int64_t first = 0, total = 0;
    for (int q = 0; q < world; ++q) {
        if (q < me) first += examples_of(q);
        total += examples_of(q);
    }
    kfac::conv2d_geometry depthwise_geometry, grouped_geometry;
    depthwise_geometry.kernel = {3, 3};
    depthwise_geometry.padding = {1, 1};
    depthwise_geometry.groups = 4;
    grouped_geometry.kernel = {1, 1};
    grouped_geometry.groups = 2;
    // Example e of the whole batch has the same data wherever it is held.
    auto fill = [&](owned_layer<double>& l, std::int64_t from, std::int64_t count, std::uint32_t seed) {
        const auto& d = l.view.description;
        l.input.clear();
        l.grad_output.clear();
        for (std::int64_t e = from; e < from + count; ++e) {
            const auto x = random_vector<double>(static_cast<std::size_t>(d.in * h * w), seed + static_cast<std::uint32_t>(e));
            const auto g = random_vector<double>(static_cast<std::size_t>(d.out * h * w), seed + 100 + static_cast<std::uint32_t>(e), 0.1);
            l.input.insert(l.input.end(), x.begin(), x.end());
            l.grad_output.insert(l.grad_output.end(), g.begin(), g.end());
        }
        l.input_shape = {count, d.in, h, w};
        l.output_shape = {count, d.out, h, w};
        l.grad_weight = random_vector<double>(static_cast<std::size_t>(d.out * d.weight_columns()), seed + 500, 0.1);
        l.grad_bias = random_vector<double>(static_cast<std::size_t>(d.out), seed + 600, 0.1);
        l.bind();
    };
    for (double fraction : {kfac::comm_opt, kfac::hybrid_opt, kfac::mem_opt}) {
        if (fraction == kfac::hybrid_opt && world % 2 != 0 && world != 1) continue;
        INFO("fraction " << fraction);
        kfac::options o;
        o.grad_worker_fraction = fraction;
        o.damping = 0.01;
        mpi_kfac<> p(o, make_comm());
        kfac::KFAC<kfac::backend::cpu_eigen<double>> whole(o);
        owned_layer<double> dw, gc, dw_all, gc_all;
        for (auto* l : {&dw, &dw_all}) l->view.description = kfac::conv2d_description(c, 2 * c, depthwise_geometry, false);
        for (auto* l : {&gc, &gc_all}) l->view.description = kfac::conv2d_description(2 * c, c, grouped_geometry, true);
        p.register_layer("dw", dw.view);
        p.register_layer("gc", gc.view);
        whole.register_layer("dw", dw_all.view);
        whole.register_layer("gc", gc_all.view);
        REQUIRE(p.layer_count() == 6);
        for (std::uint32_t step = 0; step < 2; ++step) {
            fill(dw, first, examples_of(me), 1000 * step + 100);
            fill(gc, first, examples_of(me), 1000 * step + 300);
            fill(dw_all, 0, total, 1000 * step + 100);
            fill(gc_all, 0, total, 1000 * step + 300);
            p.step();
            whole.step();
            // As in the Conv1d test above: sums in another order, amplified by the damped solve.
            CHECK(buffer_rel_err(dw.grad_weight, dw_all.grad_weight) < 1e-10);
            CHECK(buffer_rel_err(gc.grad_weight, gc_all.grad_weight) < 1e-10);
            CHECK(buffer_rel_err(gc.grad_bias, gc_all.grad_bias) < 1e-10);
        }
    }
}

TEMPLATE_TEST_CASE("normalisation layers: ranks with different batches equal one process with all of them",
                   "[mpi][norm]", kfac::compute::eigendecomposition, kfac::compute::inverse) {
    // A LayerNorm without shift over tokens (rows: every token, expand) and a BatchNorm of 3
    // channels (rows: the examples, reduce; its blocks a square 3 × 3 storage, sent whole even
    // by the symmetry-aware allreduce). Rank r holds N_r = 1 + r examples: the unit-wise blocks
    // travel in the factor allreduce weighted by the rows, and as blocks, inverses or D when
    // shared, so every KAISA strategy equals one process over all examples. Under DP-KFAC the
    // owner's batch alone makes the factors, broadcast to the others.
    const int world = world_size(), me = world_rank();
    const std::int64_t tokens = 3, features = 5, channels = 3, spatial = 4;
    auto examples_of = [](int rank) { return std::int64_t{1} + rank; };
    auto first_of = [&](int rank) {
        std::int64_t f = 0;
        for (int q = 0; q < rank; ++q) f += examples_of(q);
        return f;
    };
    // Example e of the whole batch has the same x̂ and dy wherever it is held.
    auto fill = [&](owned_layer<double>& l, std::vector<std::int64_t> tail, std::int64_t from, std::int64_t count,
                    std::uint32_t seed) {
        std::size_t elements = 1;
        for (auto e : tail) elements *= static_cast<std::size_t>(e);
        l.input.clear();
        l.grad_output.clear();
        for (std::int64_t e = from; e < from + count; ++e) {
            const auto x = random_vector<double>(elements, seed + static_cast<std::uint32_t>(e));
            const auto g = random_vector<double>(elements, seed + 100 + static_cast<std::uint32_t>(e), 0.1);
            l.input.insert(l.input.end(), x.begin(), x.end());
            l.grad_output.insert(l.grad_output.end(), g.begin(), g.end());
        }
        tail.insert(tail.begin(), count);
        l.input_shape = l.output_shape = tail;
        const auto c = static_cast<std::size_t>(l.view.description.out);
        l.grad_weight = random_vector<double>(c, seed + 500, 0.1);
        l.grad_bias = random_vector<double>(c, seed + 600, 0.1);
        l.bind();
    };
    struct setup {
        kfac::distribution strategy;
        double fraction;
    };
    for (const setup s : {setup{kfac::distribution::kaisa, kfac::comm_opt}, setup{kfac::distribution::kaisa, kfac::hybrid_opt},
                          setup{kfac::distribution::kaisa, kfac::mem_opt}, setup{kfac::distribution::dp_kfac, kfac::comm_opt}}) {
        if (s.fraction == kfac::hybrid_opt && world % 2 != 0 && world != 1) continue;
        const bool dp = s.strategy == kfac::distribution::dp_kfac;
        INFO("dp_kfac " << dp << ", fraction " << s.fraction);
        kfac::options o;
        o.strategy = s.strategy;
        o.grad_worker_fraction = s.fraction;
        o.damping = 0.01;
        o.symmetry_aware = true;
        mpi_kfac<TestType> p(o, make_comm());
        kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial, TestType> whole(o);
        owned_layer<double> ln, bn, ln_all, bn_all;
        for (auto* l : {&ln, &ln_all}) l->view.description = kfac::layer_norm_description(features, false);
        for (auto* l : {&bn, &bn_all}) l->view.description = kfac::batch_norm_description(channels, true);
        p.register_layer("ln", ln.view);
        p.register_layer("bn", bn.view);
        whole.register_layer("ln", ln_all.view);
        whole.register_layer("bn", bn_all.view);
        for (std::uint32_t step = 0; step < 2; ++step) {
            const std::uint32_t ln_seed = 1000 * step + 100, bn_seed = 1000 * step + 300;
            fill(ln, {tokens, features}, first_of(me), examples_of(me), ln_seed);
            fill(bn, {channels, spatial}, first_of(me), examples_of(me), bn_seed);
            const int ln_owner = p.workers("ln").g, bn_owner = p.workers("bn").g;
            fill(ln_all, {tokens, features}, dp ? first_of(ln_owner) : 0, dp ? examples_of(ln_owner) : first_of(world), ln_seed);
            fill(bn_all, {channels, spatial}, dp ? first_of(bn_owner) : 0, dp ? examples_of(bn_owner) : first_of(world), bn_seed);
            p.step();
            whole.step();
            // Sums in another order (per rank, then across): ~1e-15 relative in the blocks,
            // amplified by the damped 2 × 2 solve by at most (‖F_c‖ + γ)/γ ≈ 10²: 1e-10 bounds it.
            CHECK(buffer_rel_err(ln.grad_weight, ln_all.grad_weight) < 1e-10);
            CHECK(buffer_rel_err(bn.grad_weight, bn_all.grad_weight) < 1e-10);
            CHECK(buffer_rel_err(bn.grad_bias, bn_all.grad_bias) < 1e-10);
        }
    }
}

TEST_CASE("eigenbasis reuse: every strategy equals one process, each factor decided on one rank", "[mpi][eigenbasis_reuse]") {
    // The same batches on every rank, so the averaged factors are one process's (up to the
    // allreduce's rounding, ~1e-16 relative; τ = 0.5 is far from any residual that rounding
    // could move across it). The rank that computes a factor decides from its own previous
    // eigenvectors; the others receive them: the counts summed over ranks are one process's.
    // 16 rows against dimensions up to 10 keep every eigenvalue simple: in a repeated one's
    // eigenspace a solver may return any basis, and which one it returns for factors that
    // differ by rounding (the 3-rank average) decides what a kept basis approximates.
    const int world = world_size();
    struct setup {
        kfac::distribution strategy;
        double fraction;
        bool colocate;
    };
    for (const setup s : {setup{kfac::distribution::kaisa, kfac::comm_opt, true}, setup{kfac::distribution::kaisa, kfac::hybrid_opt, true},
                          setup{kfac::distribution::kaisa, kfac::mem_opt, true}, setup{kfac::distribution::kaisa, kfac::comm_opt, false},
                          setup{kfac::distribution::dp_kfac, kfac::comm_opt, true}}) {
        if (s.fraction == kfac::hybrid_opt && world % 2 != 0 && world != 1) continue;
        INFO("dp_kfac " << (s.strategy == kfac::distribution::dp_kfac) << ", fraction " << s.fraction << ", colocate "
                        << s.colocate);
        kfac::options o;
        o.strategy = s.strategy;
        o.grad_worker_fraction = s.fraction;
        o.colocate_factors = s.colocate;
        o.compute_eigenvalue_outer_product = s.colocate;  // the product needs both factors on one rank
        o.factor_decay = 0.5;
        o.eigenbasis_reuse_tolerance = 0.5;
        mpi_kfac<> p(o, make_comm());
        kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial> whole(o);
        model spread, one;
        for (auto* m : {&spread, &one})
            m->layers = {random_linear<double>(16, 6, 5, true, 1), random_linear<double>(16, 5, 4, false, 2),
                         random_linear<double>(16, 9, 3, true, 3)};
        spread.register_all(p);
        one.register_all(whole);
        // Factors equal to ~1e-16; eigenvectors and the damped division amplify that by
        // (‖F‖ + γ)/γ ≈ 10³ at most (γ = 0.001): 1e-10 bounds it with a wide margin.
        step_alike(p, whole, spread, one, 7000, 6, 1e-10);
        const auto mine = p.eigenbasis_counts();
        std::int64_t totals[2] = {mine.reused, mine.decomposed};
        world_sum(totals, 2);
        CHECK(whole.eigenbasis_counts().reused > 0);
        CHECK(totals[0] == whole.eigenbasis_counts().reused);
        CHECK(totals[1] == whole.eigenbasis_counts().decomposed);
    }
}

TEMPLATE_TEST_CASE("curvature modes: every strategy equals one process", "[mpi][curvature_modes]",
                   kfac::compute::eigendecomposition, kfac::compute::inverse) {
    // Per-example statistics, bias-corrected averaging, factored and relative damping all on;
    // the same batches on every rank (so KAISA's average and DP-KFAC's owner see one process's
    // statistics, up to the allreduce's rounding, ~1e-16 relative). The per-layer damping is
    // computed by the rank that computes the layer's data from the factors it holds; W travels
    // in the checkpoint from a rank that holds the factors.
    for (auto [strategy, o] : every_strategy()) {
        INFO(strategy);
        o.statistics = kfac::statistic_scale::per_example;
        o.averaging = kfac::factor_averaging::bias_corrected;
        o.damping_mode = kfac::damping_form::factored;
        o.relative_damping = true;
        o.damping = 0.01;
        o.factor_decay = 0.6;
        mpi_kfac<TestType> p(o, make_comm());
        kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial, TestType> whole(o);
        model spread, one;
        spread.register_all(p);
        one.register_all(whole);
        // Factors equal to ~1e-16; the damped solve amplifies that by at most
        // (λ_max + damping)/damping ≈ 10³ (relative damping 0.01): 1e-10 bounds it.
        step_alike(p, whole, spread, one, 8000, 3, 1e-10);
        const auto bytes = p.save_bytes();
        if (world_rank() == 0) {
            const auto saved = kfac::checkpoint::from_archive(kfac::checkpoint::parse(bytes, "bytes"), "bytes");
            const auto alone = kfac::checkpoint::from_archive(kfac::checkpoint::parse(whole.save_bytes(), "b"), "b");
            CHECK(saved.statistics_weights == alone.statistics_weights);
            CHECK(saved.statistics_weights.size() == one.layers.size());
        }
    }
}

TEMPLATE_TEST_CASE("every layer kind through host staging equals direct collectives, under every strategy",
                   "[mpi][staging]", kfac::compute::eigendecomposition, kfac::compute::inverse, kfac::compute::ekfac) {
    // backend::cuda with MPI moves every collective payload through pinned host buffers
    // (host_staging.hpp). The staged backend is the CPU backend declared device-resident, so the
    // same path runs here for every layer kind: the same arithmetic and collectives on the same
    // values as the plain CPU backend, so the results agree to the collectives' rounding (their
    // reduction order may follow the buffer sizes, which staging does not change; 1e-12).
    // EKFAC: the kinds it preconditions, its bases lent and its estimates summed through the
    // staging too.
    const int world = world_size();
    auto every_kind = [] {
        auto kinds = kfac_test::every_kind<double>();
        if constexpr (std::is_same_v<TestType, kfac::compute::ekfac>)
            std::erase_if(kinds, [](const auto& named) {
                return !kfac::detail::compute_impl<kfac::compute::ekfac, kfac::backend::cpu_eigen<double>>::unsupported_layer(
                            named.second.view.description)
                            .empty();
            });
        return kinds;
    };
    for (auto [strategy, o] : every_strategy()) {
        INFO(strategy);
        o.damping = 0.01;
        o.kl_clip = 0.001;
        o.inv_update_steps = 2;
        kfac::KFAC<kfac_replay::staged_backend<double>, comm_under_test, TestType> staged(o, make_comm());
        kfac::KFAC<kfac::backend::cpu_eigen<double>, comm_under_test, TestType> direct(o, make_comm());
        auto staged_layers = every_kind(), direct_layers = every_kind();
        for (std::size_t i = 0; i < staged_layers.size(); ++i) {
            staged.register_layer(staged_layers[i].first, staged_layers[i].second.view);
            direct.register_layer(direct_layers[i].first, direct_layers[i].second.view);
        }
        kfac_replay::staged_bytes() = 0;
        kfac_replay::prefetched_taken() = 0;
        for (std::uint32_t step = 0; step < 3; ++step) {
            staged.step();
            direct.step();
            for (std::size_t i = 0; i < staged_layers.size(); ++i) {
                INFO("layer " << staged_layers[i].first << ", step " << step);
                CHECK(buffer_rel_err(staged_layers[i].second.grad_weight, direct_layers[i].second.grad_weight) < 1e-12);
                CHECK(buffer_rel_err(staged_layers[i].second.grad_bias, direct_layers[i].second.grad_bias) < 1e-12);
                refill_gradients(staged_layers[i].second, 500 + 10 * step + static_cast<std::uint32_t>(i));
                refill_gradients(direct_layers[i].second, 500 + 10 * step + static_cast<std::uint32_t>(i));
            }
        }
        if (world > 1) CHECK(kfac_replay::staged_bytes() > 0);  // the collectives went through the staging
        if constexpr (std::is_same_v<TestType, kfac::compute::eigendecomposition>) {
            // The decompositions came through the prefetch (on the ranks that computed some).
            auto all = static_cast<std::int64_t>(kfac_replay::prefetched_taken());
            world_sum(&all, 1);
            CHECK(all > 0);
        }
    }
}

// --- Issue 25: failures on one rank only, raised on every rank ----------------------------

namespace {

/// Two layers whose adapters throw on the last rank only (flaky_layer.hpp), the same data on
/// every rank, every factor and inverse updated at every step.
struct flaky_model {
    flaky_layer first{4, 3, true}, second{3, 5, true};
    mpi_kfac<> p;
    explicit flaky_model(bool overlap = false) : p(options(overlap), make_comm()) {
        p.register_layer("first", first);
        p.register_layer("second", second);
    }
    /// With `overlap`, the factor allreduce started during the capture, a bucket per item.
    static kfac::options options(bool overlap) {
        kfac::options o;
        o.damping = 0.01;
        o.kl_clip = 0.001;
        o.overlap_factor_allreduce = overlap;
        if (overlap) o.allreduce_bucket_cap_mb = 1e-6;
        return o;
    }
    void step(std::uint32_t k) {
        first.pass(10 * k + 1);
        second.pass(10 * k + 101);
        p.step();
    }
    [[nodiscard]] std::vector<double> state() const {
        std::vector<double> v(first.inner.grad_weight);
        for (const auto* w : {&first.inner.grad_bias, &second.inner.grad_weight, &second.inner.grad_bias})
            v.insert(v.end(), w->begin(), w->end());
        for (const char* name : {"first", "second"})
            for (const auto* f : {&p.a_factor(name), &p.g_factor(name)}) v.insert(v.end(), f->data(), f->data() + f->size());
        v.push_back(static_cast<double>(p.steps()));
        return v;
    }
};

bool on_every_rank(bool mine) {
    return world_min(mine ? 1 : 0) == 1;
}
bool on_some_rank(bool mine) {
    return world_max(mine ? 1 : 0) == 1;
}

}  // namespace

TEST_CASE("an adapter that throws on one rank only, at any call of a step, is an error on every rank", "[mpi][adapter]") {
    // Before, a throw after the checked phase (the second activations() call, the gradients at
    // write-back, end_pass()) hung the other ranks, aborted MPI, or left steps() different.
    // With overlap_factor_allreduce, end_pass() fails after the factor buckets have started
    // (during the capture): every rank still completes them before the error is raised.
    const bool failing_rank = world_rank() == world_size() - 1;
    const bool overlap = GENERATE(false, true);
    INFO("overlap_factor_allreduce " << overlap);
    flaky_model reference(overlap);
    for (std::uint32_t k = 0; k < 3; ++k) reference.step(k);
    for (int m = 0; m < kfac_test::members; ++m) {
        for (int after = 0;; ++after) {
            INFO("the last rank's " << kfac_test::member_names[m] << " throws at its call " << after + 1 << " of step 1");
            flaky_model x(overlap);
            x.step(0);
            x.first.pass(11);
            x.second.pass(111);
            if (failing_rank) {
                x.second.fail = static_cast<kfac_test::member>(m);
                x.second.after = after;
            }
            const auto before = x.state();
            std::string message;
            try {
                x.p.step();
            } catch (const std::exception& e) {  // alone (W = 1), the adapter's own exception
                message = e.what();
            }
            const bool threw = !message.empty();
            CHECK(on_every_rank(threw) == on_some_rank(threw));  // all or none
            if (!on_some_rank(threw)) break;
            CHECK_THAT(message, Contains("the host's " + std::string(kfac_test::member_names[m]) + " failed"));
            CHECK(x.state() == before);
            x.second.fail.reset();
            x.first.pass(11);
            x.second.pass(111);
            x.p.step();
            x.step(2);
            CHECK(x.state() == reference.state());
        }
    }
}

#if !KFAC_TEST_PROCESS_GROUP  // comm::mpi's buckets start during the capture; Gloo's at complete()

namespace {

/// The CPU backend whose G statistic throws at one call (counted over the process, across the
/// engine's threads) with a kfac::error, as backend::cuda's kernels report a failure on one rank.
struct statistics_failing_backend : kfac::backend::cpu_eigen<double> {
    using base = kfac::backend::cpu_eigen<double>;
    static inline std::atomic<int> calls{0};
    static inline int fail_at = -1;  ///< the call that throws; -1: none
    static void accumulate_g_statistic(matrix& sum, const kfac::layer_description& d,
                                       kfac::tensor_view<const double> g, double beta, workspace& ws) {
        if (calls++ == fail_at) throw kfac::error("the G statistic's kernel failed");
        base::accumulate_g_statistic(sum, d, g, beta, ws);
    }
};

}  // namespace

TEST_CASE("statistics that fail on one rank while the factor buckets travel are an error on every rank",
          "[mpi][overlap]") {
    // With overlap_factor_allreduce the step's last pass adds each layer's statistics to the
    // allreduce as they are computed, a bucket per item here, so the first layer's buckets
    // have started when the second layer's statistics are computed. A rank whose statistics
    // throw must still add the same items (zeros of their shape), or the ranks' buckets differ
    // and the collectives hang or mix; the error is then raised on every rank, the state is
    // as before the step, and a retry equals a run without the failure.
    using failing_kfac = kfac::KFAC<statistics_failing_backend, comm_under_test, kfac::compute::eigendecomposition>;
    struct two_layers {
        owned_layer<double> first = random_linear<double>(6, 4, 3, true, 21), second = random_linear<double>(6, 3, 5, true, 22);
        failing_kfac p{flaky_model::options(true), make_comm()};
        two_layers() {
            p.register_layer("first", first.view);
            p.register_layer("second", second.view);
        }
        void step() { p.step(); }  // (the gradients preconditioned again each step, alike in both runs)
        [[nodiscard]] std::vector<double> state() const {
            std::vector<double> v;
            for (const auto* l : {&first, &second}) {
                v.insert(v.end(), l->grad_weight.begin(), l->grad_weight.end());
                v.insert(v.end(), l->grad_bias.begin(), l->grad_bias.end());
            }
            for (const char* name : {"first", "second"})
                for (const auto* f : {&p.a_factor(name), &p.g_factor(name)}) v.insert(v.end(), f->data(), f->data() + f->size());
            v.push_back(static_cast<double>(p.steps()));
            return v;
        }
    };
    two_layers reference;
    for (int k = 0; k < 3; ++k) reference.step();
    // At the first step the failing layer has no statistics yet (it must still add items of
    // their shape); at the second it has the last step's. The call: the first layer's G
    // statistic, or the second's (at one rank, which does not post, the threads' order).
    const int failing_step = GENERATE(0, 1), failing_call = GENERATE(0, 1);
    INFO("the last rank's G statistic throws at its call " << failing_call + 1 << " of step " << failing_step + 1);
    two_layers x;
    for (int k = 0; k < failing_step; ++k) x.step();
    const auto before = x.state();
    statistics_failing_backend::calls = 0;
    statistics_failing_backend::fail_at = world_rank() == world_size() - 1 ? failing_call : -1;
    std::string message;
    try {
        x.step();
    } catch (const std::exception& e) {
        message = e.what();
    }
    statistics_failing_backend::fail_at = -1;
    CHECK(on_every_rank(!message.empty()));
    CHECK_THAT(message, Contains("the G statistic's kernel failed"));
    if (world_size() > 1) {  // posted: the layers' statistics in order, the failing layer's and the next computed
        CHECK_THAT(message, Contains(failing_call == 0 ? "layer 'first'" : "layer 'second'"));
        CHECK(statistics_failing_backend::calls.load() == 2);
    } else {
        CHECK_THAT(message, Contains("layer '"));
    }
    CHECK(x.state() == before);
    while (x.p.steps() < 3) x.step();
    CHECK(x.state() == reference.state());
}

#endif

TEST_CASE("ranks with another compute method or assignment strategy all raise the same error", "[mpi][mismatch]") {
    // Before, the first step hung (or aborted in MPI_Waitall): the ranks issued different
    // collectives.
    if (world_size() == 1) return;
    auto l = random_linear<double>(8, 6, 5, true, 5);
    const std::string last = "rank " + std::to_string(world_size() - 1);
    if (world_rank() == world_size() - 1) {
        mpi_kfac<kfac::compute::inverse> p(kfac::options{}, make_comm());
        p.register_layer("fc", l.view);
        CHECK_THROWS_WITH(p.step(), Contains(last + " differs from rank 0 in the compute method: rank 0 has "
                                                    "eigendecomposition, " + last + " has inverse"));
    } else {
        mpi_kfac<> p(kfac::options{}, make_comm());
        p.register_layer("fc", l.view);
        CHECK_THROWS_WITH(p.step(), Contains("in the compute method"));
    }
    using memory_kfac = kfac::KFAC<kfac::backend::cpu_eigen<double>, comm_under_test, kfac::compute::eigendecomposition,
                                   kfac::assignment::memory_balanced>;
    if (world_rank() == world_size() - 1) {
        memory_kfac p(kfac::options{}, make_comm());
        p.register_layer("fc", l.view);
        CHECK_THROWS_WITH(p.step(), Contains(last + " differs from rank 0 in the assignment strategy: rank 0 has "
                                                    "compute, " + last + " has memory"));
    } else {
        mpi_kfac<> p(kfac::options{}, make_comm());
        p.register_layer("fc", l.view);
        CHECK_THROWS_WITH(p.step(), Contains("in the assignment strategy"));
    }
}

TEST_CASE("a schedule with another value on one rank is an error on every rank, at the step it differs",
          "[mpi][agreement]") {
    // Before, the gradients drifted apart silently (a damping), or the ranks issued different
    // collectives (a factor-update interval).
    if (world_size() == 1) return;
    const bool odd = world_rank() == world_size() - 1;
    const std::string last = "rank " + std::to_string(world_size() - 1);
    {
        model m;
        kfac::options o;
        o.damping = [odd](std::int64_t k) { return k == 1 && odd ? 0.002 : 0.001; };
        mpi_kfac<> p(o, make_comm());
        m.register_all(p);
        p.step();
        m.reset_gradients();
        const auto before = m.layers[0].grad_weight;
        CHECK_THROWS_WITH(p.step(), Contains("ranks disagree on the values of the scheduled options: " + last +
                                             " differs from rank 0 in options.damping at step 1: rank 0 has 0.001, " +
                                             last + " has 0.002") &&
                                        Contains("must return the same value on every rank"));
        CHECK(p.steps() == 1);
        CHECK(m.layers[0].grad_weight == before);
    }
    {
        model m;
        kfac::options o;
        o.factor_update_steps = [odd](std::int64_t k) { return std::int64_t{k == 1 && odd ? 2 : 1}; };
        mpi_kfac<> p(o, make_comm());
        m.register_all(p);
        p.step();
        CHECK_THROWS_WITH(p.step(), Contains("options.factor_update_steps at step 1: rank 0 has a factor update, " + last +
                                             " has no factor update"));
        CHECK(p.steps() == 1);
    }
    {
        // accumulate() reads the interval too.
        model m;
        kfac::options o;
        o.accumulation_steps = 2;
        o.factor_update_steps = [odd](std::int64_t k) { return std::int64_t{k == 1 && odd ? 2 : 1}; };
        mpi_kfac<> p(o, make_comm());
        m.register_all(p);
        p.accumulate();
        p.step();
        CHECK_THROWS_WITH(p.accumulate(), Contains("options.factor_update_steps at step 1"));
    }
}

TEST_CASE("-0 and 0 are one value of an option across ranks", "[mpi][agreement]") {
    if (world_size() == 1) return;
    model m;
    kfac::options o;
    o.eigenbasis_reuse_tolerance = world_rank() == 0 ? 0.0 : -0.0;
    mpi_kfac<> p(o, make_comm());
    m.register_all(p);
    CHECK_NOTHROW(p.step());
}
