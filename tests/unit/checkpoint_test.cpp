// SPDX-License-Identifier: Apache-2.0
// Checkpoint and resume: a run saved and loaded into a new preconditioner continues bitwise
// as the uninterrupted run does; every corrupt or mismatched file is refused with a named
// error and leaves the preconditioner as it was.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <kfac/checkpoint/format.hpp>
#include <kfac/checkpoint/state_dict.hpp>
#include <kfac/kfac.hpp>

#include "unit/layer_kinds.hpp"
#include "unit/test_util.hpp"

namespace {

using kfac_test::owned_layer;

/// Three layers (linear with bias, linear without, conv with bias) whose inputs and
/// gradients at step k, pass m are a function of (k, m) alone, so two runs see the same data.
template <class T>
struct model {
    std::vector<owned_layer<T>> layers;

    model() {
        kfac::conv2d_geometry g;
        g.kernel = {3, 3};
        g.padding = {1, 1};
        layers.push_back(kfac_test::random_linear<T>(6, 5, 4, true, 1));
        layers.push_back(kfac_test::random_linear<T>(6, 4, 3, false, 2));
        layers.push_back(kfac_test::random_conv<T>(2, 2, 3, g, true, 4, 4, 3));
    }
    void fill(std::int64_t k, std::int64_t pass) {
        for (std::size_t i = 0; i < layers.size(); ++i) {
            auto& l = layers[i];
            const auto seed = static_cast<std::uint32_t>(1000 * k + 100 * pass + 10 * static_cast<std::int64_t>(i));
            l.input = kfac_test::random_vector<T>(l.input.size(), seed);
            l.grad_output = kfac_test::random_vector<T>(l.grad_output.size(), seed + 1, 0.5);
            l.grad_weight = kfac_test::random_vector<T>(l.grad_weight.size(), seed + 2, 0.1);
            l.grad_bias = kfac_test::random_vector<T>(l.grad_bias.size(), seed + 3, 0.1);
            l.bind();
        }
    }
    template <class P>
    void register_with(P& p) {
        const char* names[] = {"fc1", "fc2", "conv"};
        for (std::size_t i = 0; i < layers.size(); ++i) p.register_layer(names[i], layers[i].view);
    }
    /// Runs steps [from, to) and appends every preconditioned gradient to `out`.
    template <class P>
    void run(P& p, std::int64_t from, std::int64_t to, std::int64_t passes, std::vector<std::vector<T>>& out) {
        for (std::int64_t k = from; k < to; ++k) {
            for (std::int64_t m = 0; m < passes; ++m) {
                fill(k, m);
                if (m + 1 < passes) p.accumulate();
            }
            p.step();
            for (auto& l : layers) {
                out.push_back(l.grad_weight);
                out.push_back(l.grad_bias);
            }
        }
    }
};

template <class Backend, class Method>
using precond_of = kfac::KFAC<Backend, kfac::comm::serial, Method>;

kfac::options resume_options(std::int64_t passes) {
    kfac::options o;
    o.damping = 0.003;
    o.factor_decay = 0.9;
    o.factor_update_steps = 3;  // neither interval divides the save point
    o.inv_update_steps = 5;
    o.accumulation_steps = passes;
    o.kl_clip = 0.01;
    o.lr = 0.1;
    return o;
}

/// The checkpoint of a double eigen preconditioner over model<double> after steps 0 and 1.
std::string bytes_after_two_steps(const kfac::options& o) {
    model<double> m;
    precond_of<kfac::backend::cpu_eigen<double>, kfac::compute::eigendecomposition> saved(o);
    m.register_with(saved);
    std::vector<std::vector<double>> grads;
    m.run(saved, 0, 2, 1, grads);
    return saved.save_bytes();
}

/// N steps straight, and N/2 + save + load into a new preconditioner (and new layer objects)
/// + N/2: every gradient and the final factors are bitwise equal.
template <class T, class Method>
void check_bitwise_resume(std::int64_t passes, bool eigen_product, double reuse_tolerance = 0.0) {
    using P = precond_of<kfac::backend::cpu_eigen<T>, Method>;
    constexpr std::int64_t n = 14, half = 7;
    auto opts = resume_options(passes);
    opts.compute_eigenvalue_outer_product = eigen_product;
    opts.eigenbasis_reuse_tolerance = reuse_tolerance;

    model<T> straight_model;
    P straight(opts);
    straight_model.register_with(straight);
    std::vector<std::vector<T>> straight_grads;
    straight_model.run(straight, 0, n, passes, straight_grads);

    model<T> first_model;
    P first(opts);
    first_model.register_with(first);
    std::vector<std::vector<T>> resumed_grads;
    first_model.run(first, 0, half, passes, resumed_grads);
    const std::string bytes = first.save_bytes();

    model<T> second_model;
    P second(opts);
    second_model.register_with(second);
    second.load_bytes(bytes);
    REQUIRE(second.steps() == half);
    second_model.run(second, half, n, passes, resumed_grads);

    REQUIRE(resumed_grads.size() == straight_grads.size());
    for (std::size_t i = 0; i < straight_grads.size(); ++i) {
        INFO("gradient " << i << " (step " << i / 6 << ")");
        CHECK(resumed_grads[i] == straight_grads[i]);
    }
    for (const char* name : {"fc1", "fc2", "conv"}) {
        CHECK(second.a_factor(name) == straight.a_factor(name));
        CHECK(second.g_factor(name) == straight.g_factor(name));
    }
    CHECK(second.steps() == straight.steps());
    if (reuse_tolerance > 0.0) {  // the resumed half reused bases from the file's eigenvectors
        CHECK(second.eigenbasis_counts().reused > 0);
        CHECK(second.eigenbasis_counts().reused + first.eigenbasis_counts().reused == straight.eigenbasis_counts().reused);
    }
}

}  // namespace

TEST_CASE("resume is bitwise: eigendecomposition, double", "[checkpoint]") {
    check_bitwise_resume<double, kfac::compute::eigendecomposition>(1, true);
    check_bitwise_resume<double, kfac::compute::eigendecomposition>(1, false);
}
TEST_CASE("resume is bitwise with eigenbasis reuse: its decisions come from the saved eigenvectors",
          "[checkpoint][eigenbasis_reuse]") {
    check_bitwise_resume<double, kfac::compute::eigendecomposition>(1, true, 0.5);
    check_bitwise_resume<float, kfac::compute::eigendecomposition>(1, false, 0.5);
}
TEST_CASE("a checkpoint refuses another eigenbasis_reuse_tolerance unless changes are allowed",
          "[checkpoint][eigenbasis_reuse]") {
    using P = precond_of<kfac::backend::cpu_eigen<double>, kfac::compute::eigendecomposition>;
    auto opts = resume_options(1);
    const std::string bytes = bytes_after_two_steps(opts);
    model<double> m;
    opts.eigenbasis_reuse_tolerance = 0.05;
    P other(opts);
    m.register_with(other);
    CHECK_THROWS_WITH(other.load_bytes(bytes), Catch::Contains("options.eigenbasis_reuse_tolerance was 0") &&
                                                   Catch::Contains("is 0.05 now"));
    CHECK(other.steps() == 0);
    other.load_bytes(bytes, kfac::checkpoint::load_options{.allow_changed_options = true});
    CHECK(other.steps() == 2);
}
TEST_CASE("resume is bitwise: inverse, double", "[checkpoint]") {
    check_bitwise_resume<double, kfac::compute::inverse>(1, false);
}
TEST_CASE("resume is bitwise: float, both methods", "[checkpoint]") {
    check_bitwise_resume<float, kfac::compute::eigendecomposition>(1, true);
    check_bitwise_resume<float, kfac::compute::inverse>(1, false);
}
TEST_CASE("resume is bitwise with gradient accumulation", "[checkpoint]") {
    check_bitwise_resume<double, kfac::compute::eigendecomposition>(3, true);
    check_bitwise_resume<float, kfac::compute::inverse>(2, false);
}

namespace {

using P64 = precond_of<kfac::backend::cpu_eigen<double>, kfac::compute::eigendecomposition>;

/// load_bytes() throws a kfac::error whose message holds every phrase.
template <class P>
void check_load_error(P& p, const std::string& bytes, const std::vector<std::string>& phrases,
                      kfac::checkpoint::load_options o = {}) {
    try {
        p.load_bytes(bytes, o);
        FAIL("load succeeded");
    } catch (const kfac::error& e) {
        for (const auto& phrase : phrases) CHECK_THAT(e.what(), Catch::Contains(phrase));
    }
}

/// A preconditioner of `model` after 4 steps, and its checkpoint.
struct saved_run {
    model<double> m;
    P64 p{resume_options(1)};
    std::string bytes;
    saved_run() {
        m.register_with(p);
        std::vector<std::vector<double>> ignored;
        m.run(p, 0, 4, 1, ignored);
        bytes = p.save_bytes();
    }
};

/// The bytes of `a` with its checksum recomputed: a well-formed file with other content.
std::string reseal(kfac::checkpoint::archive a) {
    kfac::checkpoint::seal(a);
    return kfac::checkpoint::serialize(a);
}

/// A fresh preconditioner with one step done, to show a failed load changes nothing.
struct target {
    model<double> m;
    P64 p;
    explicit target(kfac::options o = resume_options(1)) : p(std::move(o)) {
        m.register_with(p);
        std::vector<std::vector<double>> ignored;
        m.run(p, 0, 1, 1, ignored);
    }
    void require_load_fails(const std::string& bytes, const std::vector<std::string>& phrases,
                            kfac::checkpoint::load_options o = {}) {
        const auto a_before = p.a_factor("fc1");
        const auto steps_before = p.steps();
        check_load_error(p, bytes, phrases, o);
        CHECK(p.steps() == steps_before);
        CHECK(p.a_factor("fc1") == a_before);
        // Still usable: a step runs.
        std::vector<std::vector<double>> ignored;
        m.run(p, steps_before, steps_before + 1, 1, ignored);
    }
};

}  // namespace

TEST_CASE("a checkpoint holds what the format names", "[checkpoint]") {
    saved_run run;
    const auto a = kfac::checkpoint::parse(run.bytes, "test");
    const auto h = kfac::checkpoint::check_header(a, "test");
    CHECK(h.step == 4);
    CHECK(h.scalar == "double");
    CHECK(h.method == "eigendecomposition");
    CHECK(h.second_order == "included");
    CHECK(a.metadata.at("option.damping") == "0.003");
    CHECK(a.metadata.at("layer.conv") == "'conv' (conv2d 2->3, kernel 3x3, stride 1x1, padding 1x1, dilation 1x1, groups 1, bias)");
    const auto* fc1_a = a.find("fc1.A");
    REQUIRE(fc1_a != nullptr);
    CHECK(fc1_a->shape == std::vector<std::int64_t>{6, 6});
    const auto values = fc1_a->values<double>();
    const auto& factor = run.p.a_factor("fc1");
    for (int i = 0; i < 6; ++i)
        for (int j = 0; j < 6; ++j) CHECK(values[static_cast<std::size_t>(i * 6 + j)] == factor(i, j));
    for (const char* t : {"fc1.G", "fc2.A", "fc2.G", "conv.A", "conv.G", "fc1.A.eigenvectors", "fc1.G.eigenvalues",
                          "conv.eigenvalue_product_inverse"})
        CHECK(a.find(t) != nullptr);
    // Without second-order data only the factors are stored.
    const auto small = kfac::checkpoint::parse(run.p.save_bytes({.second_order = false}), "test");
    CHECK(small.tensors.size() == 6);
    CHECK(small.metadata.at("second_order") == "omitted");
}

TEST_CASE("a checkpoint round-trips through a file and a stream", "[checkpoint]") {
    saved_run run;
    const auto dir = std::filesystem::temp_directory_path() / "kfac_checkpoint_test";
    std::filesystem::create_directories(dir);
    const auto path = dir / "run.safetensors";
    run.p.save(path);
    CHECK_FALSE(std::filesystem::exists(dir / "run.safetensors.tmp"));
    target t;
    t.p.load(path);
    CHECK(t.p.steps() == 4);
    CHECK(t.p.a_factor("conv") == run.p.a_factor("conv"));
    std::stringstream stream;
    run.p.save(stream);
    target u;
    u.p.load(stream);
    CHECK(u.p.g_factor("fc2") == run.p.g_factor("fc2"));
    target v;
    v.require_load_fails(std::string(), {"fewer than the 8"});
    try {
        v.p.load(dir / "missing.safetensors");
        FAIL("loading a missing file succeeded");
    } catch (const kfac::error& e) {
        CHECK_THAT(e.what(), Catch::Contains("missing.safetensors") && Catch::Contains("cannot open"));
    }
    std::filesystem::remove_all(dir);
}

TEST_CASE("a file from before eigenbasis_reuse_tolerance existed loads as saved with 0", "[checkpoint][eigenbasis_reuse]") {
    saved_run run;
    auto older = kfac::checkpoint::parse(run.bytes, "test");
    REQUIRE(older.metadata.erase("option.eigenbasis_reuse_tolerance") == 1);
    const std::string bytes = reseal(older);
    target exact;  // tolerance 0: what that library did
    exact.p.load_bytes(bytes);
    CHECK(exact.p.steps() == 4);
    auto o = resume_options(1);
    o.eigenbasis_reuse_tolerance = 0.1;
    target reusing(o);
    reusing.require_load_fails(bytes, {"options.eigenbasis_reuse_tolerance did not exist when it was saved", "is 0.1 now"});
}

TEST_CASE("corrupt, truncated and foreign files are refused and change nothing", "[checkpoint]") {
    saved_run run;
    target t;
    std::string flipped = run.bytes;
    flipped[flipped.size() - 3] ^= 0x10;
    t.require_load_fails(flipped, {"checksum", "corrupted"});
    t.require_load_fails(run.bytes.substr(0, run.bytes.size() - 100), {"(bytes in memory)", "truncated"});

    auto a = kfac::checkpoint::parse(run.bytes, "test");
    auto newer = a;
    newer.metadata["format_version"] = std::to_string(kfac::checkpoint::format_version + 1);
    t.require_load_fails(reseal(newer), {"format version " + std::to_string(kfac::checkpoint::format_version + 1), "newer"});
    auto foreign = a;
    foreign.metadata.erase("format");
    t.require_load_fails(reseal(foreign), {"'format' is missing"});
    auto bad_step = a;
    bad_step.metadata["step"] = "3x";
    t.require_load_fails(reseal(bad_step), {"metadata 'step' = '3x' is not a non-negative integer"});
    auto bad_damping = a;
    bad_damping.metadata["second_order_damping"] = "";
    t.require_load_fails(reseal(bad_damping), {"'second_order_damping' = '' is not a number"});
    auto extra = a;
    extra.tensors.push_back(kfac::checkpoint::tensor::from<double>("stray", std::vector<double>{1.0}.data(), {1}));
    t.require_load_fails(reseal(extra), {"tensor 'stray' belongs to no registered layer"});
    auto missing = a;
    std::erase_if(missing.tensors, [](const auto& x) { return x.name == "fc2.G"; });
    t.require_load_fails(reseal(missing), {"layer 'fc2'", "'fc2.G'", "missing"});
    auto integer = a;
    for (auto& x : integer.tensors)
        if (x.name == "fc1.A") x = kfac::checkpoint::tensor::from<std::int64_t>("fc1.A", std::vector<std::int64_t>(36, 1).data(), {6, 6});
    t.require_load_fails(reseal(integer), {"'fc1.A' has dtype I64"});
}

TEST_CASE("a checkpoint loads only into the layers it was saved from", "[checkpoint]") {
    saved_run run;
    SECTION("a re-shaped layer") {
        model<double> m;
        m.layers[1] = kfac_test::random_linear<double>(6, 4, 5, false, 2);
        P64 p(resume_options(1));
        m.register_with(p);
        check_load_error(p, run.bytes, {"layer 'fc2' was saved as 'fc2' (linear 4->3, no bias)",
                                        "registered as 'fc2' (linear 4->5, no bias)"});
        CHECK(p.steps() == 0);
    }
    SECTION("a layer the file lacks, and one it has but is not registered") {
        model<double> m;
        P64 p(resume_options(1));
        p.register_layer("fc1", m.layers[0].view);
        p.register_layer("fc2", m.layers[1].view);
        p.register_layer("conv2", m.layers[2].view);
        check_load_error(p, run.bytes, {"'conv2'", "not in the file"});
        P64 q(resume_options(1));
        q.register_layer("fc1", m.layers[0].view);
        q.register_layer("fc2", m.layers[1].view);
        check_load_error(q, run.bytes, {"holds layer 'conv'", "not registered"});
    }
}

TEST_CASE("changed options are refused unless allowed", "[checkpoint]") {
    saved_run run;
    auto changed = resume_options(1);
    changed.damping = 0.01;
    target t(changed);
    t.require_load_fails(run.bytes, {"options.damping was 0.003", "is 0.01", "allow_changed_options"});
    t.p.load_bytes(run.bytes, {.allow_changed_options = true});
    CHECK(t.p.steps() == 4);
    // The eigenvalue product decides which tensors the data has: not waived.
    auto no_product = resume_options(1);
    no_product.compute_eigenvalue_outer_product = false;
    target u(no_product);
    u.require_load_fails(run.bytes, {"compute_eigenvalue_outer_product = true"}, {.allow_changed_options = true});
    u.p.load_bytes(run.bytes, {.allow_changed_options = true, .recompute_second_order = true});
    CHECK(u.p.steps() == 4);
    // A schedule is a marker: the file says "schedule", a constant differs from it.
    auto scheduled = resume_options(1);
    scheduled.damping = kfac::hyperparameter<double>([](std::int64_t) { return 0.003; });
    target v(scheduled);
    v.require_load_fails(run.bytes, {"options.damping was 0.003 when it was saved and is schedule"});
}

TEST_CASE("the other compute method needs recomputed second-order data", "[checkpoint]") {
    saved_run run;
    using Pinv = precond_of<kfac::backend::cpu_eigen<double>, kfac::compute::inverse>;
    model<double> m;
    Pinv p(resume_options(1));
    m.register_with(p);
    check_load_error(p, run.bytes, {"eigendecomposition data", "recompute_second_order"});
    p.load_bytes(run.bytes, {.recompute_second_order = true});
    CHECK(p.steps() == 4);
    CHECK(p.a_factor("fc1") == run.p.a_factor("fc1"));
}

TEST_CASE("without second-order data, load recomputes it from the factors", "[checkpoint]") {
    // Saved after step 5, an inverse update (5 % 5 == 0) that is no factor update (5 % 3 != 0):
    // the data in force was computed from the saved factors, so recomputing it from them
    // with the recorded damping gives it again.
    model<double> m;
    P64 p(resume_options(1));
    m.register_with(p);
    std::vector<std::vector<double>> grads;
    m.run(p, 0, 6, 1, grads);  // steps 0..5; the last inverse update (5) saw the final factors
    const std::string small = p.save_bytes({.second_order = false});
    const std::string full = p.save_bytes();
    CHECK(small.size() < full.size() / 2);
    model<double> m2, m3;
    P64 from_small(resume_options(1)), from_full(resume_options(1));
    m2.register_with(from_small);
    m3.register_with(from_full);
    from_small.load_bytes(small);
    from_full.load_bytes(full);
    std::vector<std::vector<double>> a, b;
    m2.run(from_small, 6, 9, 1, a);
    m3.run(from_full, 6, 9, 1, b);
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i)
        for (std::size_t j = 0; j < a[i].size(); ++j)
            // The same factors, the same damping, the same solver: equal up to the solver's
            // own run-to-run reproducibility, which is exact on one thread.
            CHECK(a[i][j] == Approx(b[i][j]).epsilon(1e-12).margin(1e-15));
}

TEST_CASE("a double checkpoint loads into float and back", "[checkpoint]") {
    saved_run run;
    using P32 = precond_of<kfac::backend::cpu_eigen<float>, kfac::compute::eigendecomposition>;
    model<float> m;
    P32 p(resume_options(1));
    m.register_with(p);
    p.load_bytes(run.bytes);
    CHECK(p.steps() == 4);
    const auto& f = p.a_factor("fc1");
    const auto& d = run.p.a_factor("fc1");
    for (int i = 0; i < 6; ++i)
        for (int j = 0; j < 6; ++j) CHECK(f(i, j) == static_cast<float>(d(i, j)));  // rounded to nearest
    // float → double widens exactly.
    model<double> m2;
    P64 q(resume_options(1));
    m2.register_with(q);
    q.load_bytes(p.save_bytes());
    for (int i = 0; i < 6; ++i)
        for (int j = 0; j < 6; ++j) CHECK(q.a_factor("fc1")(i, j) == static_cast<double>(f(i, j)));
}

TEST_CASE("save refuses a step in progress; a step-0 checkpoint holds identities", "[checkpoint]") {
    auto opts = resume_options(2);
    opts.factor_update_steps = 1;
    model<double> m;
    P64 p(opts);
    m.register_with(p);
    const std::string at_zero = p.save_bytes();
    CHECK(kfac::checkpoint::parse(at_zero, "t").metadata.at("second_order") == "none yet");
    m.fill(0, 0);
    p.accumulate();
    CHECK_THROWS_WITH(p.save_bytes(), Catch::Contains("save() after 1 accumulate()") && Catch::Contains("after its step()"));
    model<double> m2;
    P64 q(opts);
    m2.register_with(q);
    q.load_bytes(at_zero);
    CHECK(q.steps() == 0);
    CHECK(q.a_factor("fc1") == Eigen::MatrixXd::Identity(6, 6));
}

TEST_CASE("layers() and memory_usage() describe the preconditioner", "[checkpoint]") {
    saved_run run;
    const auto layers = run.p.layers();
    REQUIRE(layers.size() == 3);
    CHECK(layers[0].name == "fc1");
    CHECK(layers[0].a_dim == 6);
    CHECK(layers[0].g_dim == 4);
    CHECK(layers[2].kind == kfac::layer_kind::conv2d);
    CHECK(layers[2].a_dim == 2 * 9 + 1);
    CHECK(layers[1].grad_workers == std::vector<int>{0});
    const auto usage = run.p.memory_usage();
    // fc1 6+4, fc2 4+3, conv 19+3: factors n² doubles each.
    const std::size_t factors = (36 + 16 + 16 + 9 + 361 + 9) * sizeof(double);
    CHECK(usage.factors == factors);
    CHECK(usage.statistics == factors);
    // eigendecomposition with the product: Q_A, Q_G, λ_A, λ_G and D (A_dim × G_dim).
    CHECK(usage.second_order == factors + (6 + 4 + 4 + 3 + 19 + 3 + 24 + 12 + 57) * sizeof(double));
    CHECK(usage.total() == usage.factors + usage.statistics + usage.second_order + usage.gradients);
}

TEST_CASE("Conv1d and reduce layers resume bitwise, and refuse the other weight sharing", "[checkpoint][conv1d][weight_sharing]") {
    using namespace kfac_test;
    using T = double;
    auto make = [](owned_layer<T>& conv, owned_layer<T>& seq, std::uint32_t seed) {
        conv.view.description = kfac::conv1d_description(2, 3, {3, 2, 1, 1, 1}, true);
        conv.input = random_vector<T>(4 * 2 * 9, seed);
        conv.grad_output = random_vector<T>(4 * 3 * 5, seed + 1, 0.1);
        conv.grad_weight = random_vector<T>(3 * 2 * 3, seed + 2, 0.1);
        conv.grad_bias = random_vector<T>(3, seed + 3, 0.1);
        conv.input_shape = {4, 2, 9};
        conv.output_shape = {4, 3, 5};
        conv.bind();
        conv.view.grad_weight = kfac::tensor_view<T>(conv.grad_weight.data(), {3, 2, 3});
        seq.view.description = kfac::with_sharing(kfac::linear_description(3, 2, true), kfac::weight_sharing::reduce);
        seq.input = random_vector<T>(4 * 5 * 3, seed + 4);
        seq.grad_output = random_vector<T>(4 * 5 * 2, seed + 5, 0.1);
        seq.grad_weight = random_vector<T>(2 * 3, seed + 6, 0.1);
        seq.grad_bias = random_vector<T>(2, seed + 7, 0.1);
        seq.input_shape = {4, 5, 3};
        seq.output_shape = {4, 5, 2};
        seq.bind();
    };
    kfac::options o;
    o.inv_update_steps = 2;
    kfac::KFAC<kfac::backend::cpu_eigen<T>> first(o), second(o);
    owned_layer<T> c1, s1, c2, s2;
    make(c1, s1, 1);
    first.register_layer("conv", c1.view);
    first.register_layer("seq", s1.view);
    for (std::uint32_t k = 0; k < 3; ++k) {
        make(c1, s1, 10 * k);
        first.step();
    }
    const std::string bytes = first.save_bytes();
    make(c2, s2, 1);
    second.register_layer("conv", c2.view);
    second.register_layer("seq", s2.view);
    second.load_bytes(bytes);
    for (std::uint32_t k = 3; k < 5; ++k) {
        make(c1, s1, 10 * k);
        make(c2, s2, 10 * k);
        first.step();
        second.step();
        CHECK(c1.grad_weight == c2.grad_weight);
        CHECK(s1.grad_weight == s2.grad_weight);
    }
    CHECK(first.a_factor("seq") == second.a_factor("seq"));

    kfac::KFAC<kfac::backend::cpu_eigen<T>> expand(o);
    owned_layer<T> c3, s3;
    make(c3, s3, 1);
    s3.view.description.sharing = kfac::weight_sharing::expand;
    expand.register_layer("conv", c3.view);
    expand.register_layer("seq", s3.view);
    CHECK_THROWS_WITH(expand.load_bytes(bytes), Catch::Contains("weight sharing reduce"));
    CHECK(expand.steps() == 0);
}

// --- integrity (issue 25): the metadata and header are checksummed, every loaded value is
// checked, the temporary file is created exclusively, and reading errors name the file.

namespace {

/// `bytes` with one bit of metadata entry `key`'s value flipped, at character `at` of the
/// value: the damage a disk or a copy does, which leaves the data and the checksum intact.
std::string flip_metadata_bit(std::string bytes, const std::string& key, std::size_t at, int mask) {
    const std::string pattern = "\"" + key + "\":\"";
    const auto pos = bytes.find(pattern);
    REQUIRE(pos != std::string::npos);
    bytes[pos + pattern.size() + at] = static_cast<char>(bytes[pos + pattern.size() + at] ^ mask);
    return bytes;
}

/// `a` with element `index` (C order) of tensor `name` set to `value` (F64 tensors).
kfac::checkpoint::archive with_element(kfac::checkpoint::archive a, const std::string& name, std::size_t index, double value) {
    for (auto& t : a.tensors)
        if (t.name == name) {
            REQUIRE(t.type == kfac::checkpoint::dtype::f64);
            REQUIRE((index + 1) * sizeof(double) <= t.bytes.size());
            std::memcpy(t.bytes.data() + index * sizeof(double), &value, sizeof value);
            return a;
        }
    FAIL("no tensor " << name);
    return a;
}

double element(const kfac::checkpoint::archive& a, const std::string& name, std::size_t index) {
    const auto* t = a.find(name);
    REQUIRE(t != nullptr);
    return t->values<double>().at(index);
}

/// A fresh folder under the system's temporary one, removed at the end of the test.
struct scratch_folder {
    std::filesystem::path path;
    explicit scratch_folder(const std::string& name)
        : path(std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()))) {
        std::filesystem::remove_all(path);
        std::filesystem::create_directories(path);
    }
    ~scratch_folder() {
        std::error_code ignored;
        std::filesystem::remove_all(path, ignored);
    }
};


}  // namespace

TEST_CASE("a bit flipped in the metadata or the header is refused: the checksum covers them", "[checkpoint][integrity]") {
    saved_run run;  // 4 steps
    target t;
    // Each flip leaves a well-formed file whose data (and data checksum) is unchanged; the
    // data-only checksum loaded every one of them as a different state (step 4 as 5 or 0,
    // other health counters, another damping, another saved lr under allow_changed_options).
    const std::tuple<const char*, std::size_t, int> flips[] = {
        {"step", 0, 0x01},                        // "4" -> "5"
        {"step", 0, 0x04},                        // "4" -> "0"
        {"health.kept_decompositions", 0, 0x01},  // "0" -> "1"
        {"health.zeroed_gradients", 0, 0x02},     // "0" -> "2"
        {"second_order_damping", 4, 0x04},        // "0.003" -> "0.007"
        {"saved_strategy", 0, 0x20},              // a letter's case
        {"library_version", 0, 0x01},             // "0.1.0" -> "1.1.0"
        {"option.lr", 2, 0x02},                   // "0.1" -> "0.3"
        {"format_version", 0, 0x02},              // claims an older version than it has
    };
    for (const auto& [key, at, mask] : flips) {
        INFO("metadata '" << key << "', character " << at << ", bit mask " << mask);
        t.require_load_fails(flip_metadata_bit(run.bytes, key, at, mask), {"(bytes in memory)", "checksum", "corrupted"},
                             {.allow_changed_options = true});
    }
    // Two tensors of the same shape and dtype renamed into each other: the data section and
    // its checksum are unchanged, but fc1's G would load as fc2's A.
    auto swapped = kfac::checkpoint::parse(run.bytes, "test");
    REQUIRE(swapped.find("fc1.G")->shape == swapped.find("fc2.A")->shape);
    for (auto& x : swapped.tensors) {
        if (x.name == "fc1.G") x.name = "fc2.A";
        else if (x.name == "fc2.A") x.name = "fc1.G";
    }
    t.require_load_fails(kfac::checkpoint::serialize(swapped), {"checksum", "corrupted"});
}

TEST_CASE("a checkpoint of format version 1 (data-only checksum) still loads", "[checkpoint][integrity]") {
    saved_run run;
    // What kfac 0.1.0 wrote before the checksum covered the metadata: version 1, no scope
    // entry, the checksum of the data alone.
    auto a = kfac::checkpoint::parse(run.bytes, "test");
    a.metadata.erase("checksum_scope");
    a.metadata["format_version"] = "1";
    a.metadata["checksum"] = kfac::checkpoint::hex64(kfac::checkpoint::data_checksum(a.tensors));
    const std::string old_bytes = kfac::checkpoint::serialize(a);
    target t;
    t.p.load_bytes(old_bytes);
    CHECK(t.p.steps() == 4);
    for (const char* name : {"fc1", "fc2", "conv"}) {
        CHECK(t.p.a_factor(name) == run.p.a_factor(name));
        CHECK(t.p.g_factor(name) == run.p.g_factor(name));
    }
    // Its data is still checked against the checksum, the old way.
    std::string flipped = old_bytes;
    flipped[flipped.size() - 3] ^= 0x10;
    target u;
    u.require_load_fails(flipped, {"checksum", "corrupted"});
}

TEST_CASE("loaded metadata is checked as the options are", "[checkpoint][integrity]") {
    saved_run run;
    target t;
    const auto a = kfac::checkpoint::parse(run.bytes, "test");
    // Each file below is well-formed and correctly sealed: only the checks of the values stop it.
    for (const char* damping : {"nan", "inf", "-inf", "-1", "0", "-0"}) {
        INFO("second_order_damping = " << damping);
        auto bad = a;
        bad.metadata["second_order_damping"] = damping;
        t.require_load_fails(reseal(bad), {"(bytes in memory)", std::string("'second_order_damping' = '") + damping + "'",
                                           "finite and > 0", "corrupt"});
    }
    auto negative_health = a;
    negative_health.metadata["health.skipped_factor_updates"] = "-1";
    t.require_load_fails(reseal(negative_health), {"'health.skipped_factor_updates' = '-1'", "non-negative"});
    auto step_zero = a;  // step 0 has no second-order data yet
    step_zero.metadata["step"] = "0";
    t.require_load_fails(reseal(step_zero), {"'step' = '0'", "'second_order' = 'included'", "corrupt"});
    auto none_yet = a;
    none_yet.metadata["second_order"] = "none yet";
    t.require_load_fails(reseal(none_yet), {"'step' = '4'", "'second_order' = 'none yet'", "corrupt"});
    auto layer_count = a;
    layer_count.metadata["layers"] = "2";
    t.require_load_fails(reseal(layer_count), {"'layers' = '2'", "3 layer entries", "corrupt"});
    // A damping valid in double but whose inverse overflows float: as options.damping would be.
    using P32 = precond_of<kfac::backend::cpu_eigen<float>, kfac::compute::eigendecomposition>;
    auto tiny = a;
    tiny.metadata["second_order_damping"] = "1e-50";
    model<float> m;
    P32 p(resume_options(1));
    m.register_with(p);
    check_load_error(p, reseal(tiny), {"'second_order_damping' = '1e-50'", "too small for float"},
                     {.recompute_second_order = true});
    CHECK(p.steps() == 0);
}

TEST_CASE("a factor that is no covariance, or non-finite second-order data, is refused", "[checkpoint][integrity]") {
    saved_run run;
    target t;
    const auto a = kfac::checkpoint::parse(run.bytes, "test");
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    // fc1.A is 6 x 6: (1, 2) is element 8, (2, 1) element 13, (0, 1) element 1; fc2.G is 3 x 3,
    // (1, 1) element 4.
    t.require_load_fails(reseal(with_element(with_element(a, "fc1.A", 8, nan), "fc1.A", 13, nan)),
                         {"(bytes in memory)", "layer 'fc1'", "'fc1.A'", "nan", "corrupt"});
    t.require_load_fails(reseal(with_element(a, "conv.A", 0, inf)), {"layer 'conv'", "'conv.A'", "inf"});
    // Save writes the factors exactly symmetric (each update mirrors the statistic's lower
    // triangle, then applies the same formula to (i, j) and (j, i)), so one unit in the last
    // place of difference is already not a file save() wrote.
    const double a01 = element(a, "fc1.A", 1);
    t.require_load_fails(reseal(with_element(a, "fc1.A", 1, std::nextafter(a01, inf))),
                         {"layer 'fc1'", "'fc1.A'", "(0, 1)", "(1, 0)", "not symmetric"});
    const double g11 = element(a, "fc2.G", 4);
    REQUIRE(g11 > 0.0);
    t.require_load_fails(reseal(with_element(a, "fc2.G", 4, -g11)), {"layer 'fc2'", "'fc2.G'", "(1, 1)", "negative"});
    // Refused also when the second-order data is recomputed: the factors are what is loaded.
    t.require_load_fails(reseal(with_element(a, "fc2.G", 4, -g11)), {"'fc2.G'", "negative"},
                         {.recompute_second_order = true});
    t.require_load_fails(reseal(with_element(a, "fc1.A.eigenvectors", 7, nan)),
                         {"layer 'fc1'", "'fc1.A.eigenvectors'", "nan"});
    t.require_load_fails(reseal(with_element(a, "conv.eigenvalue_product_inverse", 3, -inf)),
                         {"layer 'conv'", "'conv.eigenvalue_product_inverse'", "-inf"});
    // The untouched file still loads.
    t.p.load_bytes(reseal(a));
    CHECK(t.p.steps() == 4);
}

TEST_CASE("diagonal and unit-wise factors are checked as what they store", "[checkpoint][integrity][embedding][norm]") {
    using T = double;
    const std::int64_t tokens = 7, vocabulary = 5, width = 2;
    owned_layer<T> emb, ln, bn;
    emb.view.description = kfac::embedding_description(vocabulary, width);
    emb.input = {0, 1, 2, 3, 4, 1, 2};
    emb.input_shape = {tokens};
    emb.grad_output = kfac_test::random_vector<T>(tokens * width, 5);
    emb.output_shape = {tokens, width};
    emb.grad_weight = kfac_test::random_vector<T>(vocabulary * width, 6);
    auto norm = [](owned_layer<T>& l, const kfac::layer_description& d, std::vector<std::int64_t> shape, std::uint32_t seed) {
        l.view.description = d;
        std::int64_t size = 1;
        for (auto e : shape) size *= e;
        l.input = kfac_test::random_vector<T>(static_cast<std::size_t>(size), seed);
        l.grad_output = kfac_test::random_vector<T>(static_cast<std::size_t>(size), seed + 1, 0.1);
        l.grad_weight = kfac_test::random_vector<T>(static_cast<std::size_t>(d.out), seed + 2);
        l.grad_bias = kfac_test::random_vector<T>(static_cast<std::size_t>(d.out), seed + 3);
        l.input_shape = l.output_shape = std::move(shape);
    };
    norm(ln, kfac::layer_norm_description(3, true), {2, 4, 3}, 10);
    norm(bn, kfac::batch_norm_description(2, false), {3, 2, 2, 2}, 20);
    auto make = [&] {
        auto p = std::make_unique<P64>(resume_options(1));
        for (auto* l : {&emb, &ln, &bn}) l->bind();
        p->register_layer("emb", emb.view);
        p->register_layer("ln", ln.view);
        p->register_layer("bn", bn.view);
        return p;
    };
    auto saved = make();
    saved->step();
    saved->step();
    const auto a = kfac::checkpoint::parse(saved->save_bytes(), "test");
    REQUIRE(a.find("emb.A")->shape == std::vector<std::int64_t>{vocabulary});
    REQUIRE(a.find("ln.A")->shape == std::vector<std::int64_t>{3, 3});  // per channel (γγ, γβ, ββ)
    REQUIRE(a.find("bn.A")->shape == std::vector<std::int64_t>{2, 1});  // per channel γγ
    auto fresh = make();
    auto refused = [&](const kfac::checkpoint::archive& bad, const std::vector<std::string>& phrases) {
        check_load_error(*fresh, reseal(bad), phrases);
        CHECK(fresh->steps() == 0);
    };
    const double nan = std::numeric_limits<double>::quiet_NaN();
    // The Embedding's A is the diagonal (token counts): every entry a diagonal entry.
    refused(with_element(a, "emb.A", 2, -1.0), {"layer 'emb'", "'emb.A'", "negative"});
    refused(with_element(a, "emb.A", 4, nan), {"'emb.A'", "nan"});
    // A norm layer's blocks: columns 0 and 2 are each block's diagonal, column 1 its
    // off-diagonal, which may be negative. Row 1 of ln.A is elements 3, 4, 5.
    refused(with_element(a, "ln.A", 3, -element(a, "ln.A", 3) - 1.0), {"layer 'ln'", "'ln.A'", "negative"});
    refused(with_element(a, "ln.A", 5, -element(a, "ln.A", 5) - 1.0), {"'ln.A'", "negative"});
    refused(with_element(a, "ln.A", 4, nan), {"'ln.A'", "nan"});
    refused(with_element(a, "bn.A", 1, -0.5), {"layer 'bn'", "'bn.A'", "negative"});
    const double off_diagonal = element(a, "ln.A", 4);
    fresh->load_bytes(reseal(with_element(a, "ln.A", 4, off_diagonal > 0 ? -off_diagonal : off_diagonal)));
    CHECK(fresh->steps() == 2);
}

TEST_CASE("save does not follow a link left at a temporary file's name", "[checkpoint][integrity]") {
    saved_run run;
    scratch_folder dir("kfac_checkpoint_link_test");
    const auto victim = dir.path / "victim.txt";
    std::ofstream(victim) << "precious";
    const auto path = dir.path / "run.safetensors";
    // The old fixed name, and the first names the exclusive scheme tries (FILE.tmp.<pid>.<n>):
    // none may be written through.
    std::vector<std::filesystem::path> links = {dir.path / "run.safetensors.tmp"};
    for (int n = 0; n < 3; ++n)
        links.push_back(dir.path / ("run.safetensors.tmp." + std::to_string(::getpid()) + "." + std::to_string(n)));
    for (const auto& link : links) std::filesystem::create_symlink(victim, link);
    run.p.save(path);
    CHECK(file_text(victim) == "precious");
    for (const auto& link : links) CHECK(std::filesystem::is_symlink(link));
    CHECK_FALSE(std::filesystem::is_symlink(path));
    target t;
    t.p.load(path);
    CHECK(t.p.steps() == 4);
    CHECK(t.p.a_factor("conv") == run.p.a_factor("conv"));
    // Nothing else was left behind: the victim, the links and the checkpoint.
    std::size_t entries = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path)) ++entries;
    CHECK(entries == 1 + links.size() + 1);
}

TEST_CASE("load of a folder or a device is a kfac::error naming it", "[checkpoint][integrity]") {
    target t;
    scratch_folder dir("kfac_checkpoint_folder_test");
    auto refused = [&](const std::filesystem::path& p) {
        try {
            t.p.load(p);
            FAIL("loading " << p << " succeeded");
        } catch (const kfac::error& e) {
            CHECK_THAT(e.what(), Catch::Contains("checkpoint " + p.string()) && Catch::Contains("not a regular file"));
        }
        CHECK(t.p.steps() == 1);
    };
    refused(dir.path);
    if (std::filesystem::exists("/dev/zero")) refused("/dev/zero");  // endless: would read until memory ran out
}

TEST_CASE("an option saved as 0 loads where it is -0, and the other way", "[checkpoint][eigenbasis_reuse]") {
    for (const double saved_value : {0.0, -0.0}) {
        INFO("saved with eigenbasis_reuse_tolerance = " << saved_value);
        auto o = resume_options(1);
        o.eigenbasis_reuse_tolerance = saved_value;
        const std::string bytes = bytes_after_two_steps(o);
        o.eigenbasis_reuse_tolerance = -saved_value;
        model<double> m2;
        P64 other(o);
        m2.register_with(other);
        CHECK_NOTHROW(other.load_bytes(bytes));
        CHECK(other.steps() == 2);
        // A file from before the option existed counts as 0: -0 loads it too.
        auto older = kfac::checkpoint::parse(bytes, "test");
        REQUIRE(older.metadata.erase("option.eigenbasis_reuse_tolerance") == 1);
        model<double> m3;
        P64 third(o);
        m3.register_with(third);
        CHECK_NOTHROW(third.load_bytes(reseal(older)));
        CHECK(third.steps() == 2);
    }
}

TEST_CASE("a checkpoint is its state_dict: the fields read back, and writing them again gives the same bytes",
          "[checkpoint][state_dict]") {
    namespace ck = kfac::checkpoint;
    auto o = resume_options(1);
    const std::string bytes = bytes_after_two_steps(o);
    const ck::state_dict s = ck::from_archive(ck::parse(bytes, "test"), "test");
    CHECK(s.step == 2);
    CHECK(s.scalar == "double");
    CHECK(s.method == "eigendecomposition");
    CHECK(s.second_order == "included");
    CHECK(s.damping == 0.003);  // resume_options().damping, the inverse update's γ, in exact decimal
    CHECK(s.world_size == 1);
    CHECK(s.version == ck::format_version);
    REQUIRE(s.layers.size() == 3);
    CHECK_THAT(s.layers.at("fc1"), Catch::Contains("fc1"));
    CHECK(s.options.at("damping") == "0.003");
    CHECK(s.options.at("kl_clip") == "0.01");
    // Per layer in registration order, its factors first, then its second-order data.
    REQUIRE(s.tensors.size() >= 6);
    CHECK(s.tensors[0].name == "fc1.A");
    CHECK(s.tensors[1].name == "fc1.G");
    CHECK(s.tensors.back().name.rfind("conv.", 0) == 0);
    // The archive is a function of the state: the same fields give the same bytes, and a
    // changed field gives other ones that read back as that field.
    CHECK(ck::serialize(ck::to_archive(s)) == bytes);
    auto later = s;
    later.step = 3;
    later.health.zeroed_gradients = 5;
    const ck::state_dict again = ck::from_archive(ck::parse(ck::serialize(ck::to_archive(later)), "test"), "test");
    CHECK(again.step == 3);
    CHECK(again.health.zeroed_gradients == 5);
    // A layer count that disagrees with the layer entries is refused before anything is read.
    auto a = ck::parse(bytes, "test");
    a.metadata["layers"] = "4";
    CHECK_THROWS_WITH(ck::from_archive(ck::parse(reseal(a), "test"), "test"),
                      Catch::Contains("metadata 'layers' = '4' but it holds 3 layer entries"));
}

namespace {

/// `a` with every element of tensor `name` multiplied by `factor` (F64 tensors).
kfac::checkpoint::archive with_scaled_tensor(kfac::checkpoint::archive a, const std::string& name, double factor) {
    const auto* t = a.find(name);
    REQUIRE(t != nullptr);
    const std::vector<double> v = t->values<double>();
    for (std::size_t i = 0; i < v.size(); ++i) a = with_element(std::move(a), name, i, factor * v[i]);
    return a;
}

}  // namespace

TEST_CASE("second-order data that no save() writes is refused: signs, scales, products", "[checkpoint][integrity]") {
    // Each edit below loaded before, finite and symmetric as it is, and the next step then ran
    // on it: a negated D reverses every gradient of its layer, eigenvectors scaled by 10^6
    // multiply it by 10^12.
    saved_run run;
    target t;
    const auto a = kfac::checkpoint::parse(run.bytes, "test");
    t.require_load_fails(reseal(with_scaled_tensor(a, "conv.eigenvalue_product_inverse", -1.0)),
                         {"(bytes in memory)", "layer 'conv'", "'conv.eigenvalue_product_inverse'", "positive", "corrupt",
                          "recompute_second_order"});
    // One entry 10^30, above 1/γ: it is no longer 1/(λ_A λ_G + γ).
    t.require_load_fails(reseal(with_element(a, "fc1.eigenvalue_product_inverse", 0, 1e30)),
                         {"layer 'fc1'", "'fc1.eigenvalue_product_inverse'", "1/(λ_A λ_G + p)", "(0, 0)"});
    // One unit in the last place too many is rounding; a relative 1e-12 too many is not either's.
    const double d0 = element(a, "fc1.eigenvalue_product_inverse", 0);
    t.require_load_fails(reseal(with_element(a, "fc1.eigenvalue_product_inverse", 0, d0 * (1 + 1e-12))),
                         {"'fc1.eigenvalue_product_inverse'"});
    CHECK_NOTHROW(target().p.load_bytes(
        reseal(with_element(a, "fc1.eigenvalue_product_inverse", 0, std::nextafter(d0, 2 * d0)))));
    t.require_load_fails(reseal(with_scaled_tensor(a, "fc2.G.eigenvectors", 1e6)),
                         {"layer 'fc2'", "'fc2.G.eigenvectors'", "squared norm", "orthonormal"});
    // Two equal columns: unit norms, but not orthogonal. fc1.A is 6 x 6: column 1 is elements
    // 1, 7, 13, ...
    auto twin = a;
    for (std::size_t i = 0; i < 6; ++i) twin = with_element(twin, "fc1.A.eigenvectors", 6 * i + 1, element(a, "fc1.A.eigenvectors", 6 * i));
    t.require_load_fails(reseal(twin), {"'fc1.A.eigenvectors'", "not orthogonal"});
    t.require_load_fails(reseal(with_element(a, "fc1.A.eigenvalues", 2, -0.5)),
                         {"'fc1.A.eigenvalues'", "-0.5", ">= 0"});
    // A negated eigenvector is as valid as the original: it loads.
    auto flipped = a;
    for (std::size_t i = 0; i < 6; ++i) flipped = with_element(flipped, "fc1.A.eigenvectors", 6 * i + 2, -element(a, "fc1.A.eigenvectors", 6 * i + 2));
    CHECK_NOTHROW(target().p.load_bytes(reseal(flipped)));
    // Recomputing the data from the factors ignores the file's: the edited file then loads.
    target r;
    r.p.load_bytes(reseal(with_scaled_tensor(a, "conv.eigenvalue_product_inverse", -1.0)),
                   {.recompute_second_order = true});
    CHECK(r.p.steps() == 4);
    t.p.load_bytes(run.bytes);
    CHECK(t.p.steps() == 4);
}

TEST_CASE("a damped inverse whose diagonal is not positive is refused", "[checkpoint][integrity]") {
    using P = precond_of<kfac::backend::cpu_eigen<double>, kfac::compute::inverse>;
    auto run = [](P& p, model<double>& m, std::int64_t steps) {
        std::vector<std::vector<double>> ignored;
        m.run(p, 0, steps, 1, ignored);
    };
    model<double> m;
    P saved(resume_options(1));
    m.register_with(saved);
    run(saved, m, 4);
    const auto a = kfac::checkpoint::parse(saved.save_bytes(), "test");
    model<double> m2;
    P fresh(resume_options(1));
    m2.register_with(fresh);
    // A negated inverse reversed every gradient of its layer (cosine -1 with the saved run's).
    check_load_error(fresh, reseal(with_scaled_tensor(a, "fc1.A.inverse", -1.0)),
                     {"layer 'fc1'", "'fc1.A.inverse'", "(0, 0)", "positive", "corrupt"});
    check_load_error(fresh, reseal(with_element(a, "conv.G.inverse", 4, 0.0)), {"'conv.G.inverse'", "(1, 1)"});
    CHECK(fresh.steps() == 0);
    fresh.load_bytes(reseal(a));
    CHECK(fresh.steps() == 4);
}

namespace {

/// Saves a preconditioner of every layer kind after three inverse updates and loads the file
/// into a fresh one of the same options (and of the other precision): the second-order checks
/// must pass every file save() writes.
template <class T, class U, class Method>
void check_every_kind_reloads(const kfac::options& o) {
    auto layers = kfac_test::every_kind<T>();
    layers.emplace_back("fc", kfac_test::random_linear<T>(10, 6, 4, true, 51));
    kfac::KFAC<kfac::backend::cpu_eigen<T>, kfac::comm::serial, Method> p(o);
    for (auto& [name, l] : layers) p.register_layer(name, l.view);
    for (int k = 0; k < 3; ++k) {
        for (std::size_t i = 0; i < layers.size(); ++i) kfac_test::refill_gradients(layers[i].second, 10 * static_cast<std::uint32_t>(k + i));
        p.step();
    }
    const std::string bytes = p.save_bytes();
    auto other_layers = kfac_test::every_kind<U>();
    other_layers.emplace_back("fc", kfac_test::random_linear<U>(10, 6, 4, true, 51));
    kfac::KFAC<kfac::backend::cpu_eigen<U>, kfac::comm::serial, Method> q(o);
    for (auto& [name, l] : other_layers) q.register_layer(name, l.view);
    q.load_bytes(bytes);
    CHECK(q.steps() == 3);
}

}  // namespace

TEMPLATE_TEST_CASE("every file save() writes passes the second-order checks: layer kinds, damping, precisions",
                   "[checkpoint][integrity]", kfac::compute::eigendecomposition, kfac::compute::inverse) {
    kfac::options o;
    o.damping = 0.003;
    o.threads = 1;
    SECTION("reference damping") {}
    SECTION("relative damping") { o.relative_damping = true; }
    SECTION("factored damping") { o.damping_mode = kfac::damping_form::factored; }
    SECTION("relative factored damping, a small γ") {
        o.relative_damping = true;
        o.damping_mode = kfac::damping_form::factored;
        o.damping = 1e-7;
    }
    SECTION("a large γ") { o.damping = 10.0; }
    check_every_kind_reloads<double, double, TestType>(o);
    check_every_kind_reloads<float, float, TestType>(o);
    check_every_kind_reloads<double, float, TestType>(o);
    check_every_kind_reloads<float, double, TestType>(o);
}

TEST_CASE("a step count step() cannot advance is refused, and no counter wraps", "[checkpoint][integrity]") {
    saved_run run;
    target t;
    const auto a = kfac::checkpoint::parse(run.bytes, "test");
    auto at_max = a;
    at_max.metadata["step"] = std::to_string(std::numeric_limits<std::int64_t>::max());
    t.require_load_fails(reseal(at_max), {"'step' = '9223372036854775807'", "cannot advance", "corrupt"});
    // One below: it loads, one step counts, and the next is refused before anything changes.
    auto below = a;
    below.metadata["step"] = std::to_string(std::numeric_limits<std::int64_t>::max() - 1);
    below.metadata["health.zeroed_gradients"] = std::to_string(std::numeric_limits<std::int64_t>::max());
    target u;
    u.p.load_bytes(reseal(below));
    u.m.fill(0, 0);
    u.p.step();
    CHECK(u.p.steps() == std::numeric_limits<std::int64_t>::max());
    CHECK_THROWS_WITH(u.p.step(), Catch::Contains("step count") && Catch::Contains("cannot advance"));
    CHECK(u.p.steps() == std::numeric_limits<std::int64_t>::max());
    CHECK(u.p.health().zeroed_gradients == std::numeric_limits<std::int64_t>::max());
    kfac::health_counters h{.zeroed_gradients = std::numeric_limits<std::int64_t>::max() - 1};
    h.add({.zeroed_gradients = 5, .skipped_steps = 2});
    CHECK(h.zeroed_gradients == std::numeric_limits<std::int64_t>::max());  // saturates, never wraps
    CHECK(h.skipped_steps == 2);
}

TEST_CASE("recorded option values are checked as the constructor checks them", "[checkpoint][integrity]") {
    saved_run run;
    target t;
    const auto a = kfac::checkpoint::parse(run.bytes, "test");
    struct edit {
        const char* key;
        const char* value;
        std::vector<std::string> phrases;
    };
    const std::vector<edit> edits = {
        {"option.damping", "nan", {"'option.damping' = 'nan'", "damping must be finite and > 0"}},
        {"option.factor_decay", "7", {"'option.factor_decay' = '7'", "[0, 1)"}},
        {"option.averaging", "bogus", {"'option.averaging' = 'bogus'", "'reference', 'bias_corrected'"}},
        {"option.kl_clip", "-1", {"'option.kl_clip' = '-1'", "> 0"}},
        {"option.inv_update_steps", "0", {"'option.inv_update_steps' = '0'", "positive"}},
        {"option.accumulation_steps", "two", {"'option.accumulation_steps' = 'two'", "not an integer"}},
        {"option.symmetry_aware", "yes", {"'option.symmetry_aware' = 'yes'", "'true', 'false'"}},
        {"option.grad_worker_fraction", "1.5", {"'option.grad_worker_fraction' = '1.5'"}},
        {"saved_world_size", "-7", {"'saved_world_size' = '-7'"}},
        {"saved_world_size", "0", {"'saved_world_size' = '0'", "world size"}},
        {"saved_strategy", "fastest", {"'saved_strategy' = 'fastest'", "'comm_opt'"}},
        {"scalar", "half", {"'scalar' = 'half'", "neither float nor double"}},
    };
    for (const auto& e : edits) {
        INFO(e.key << " = " << e.value);
        auto bad = a;
        bad.metadata[e.key] = e.value;
        auto phrases = e.phrases;
        phrases.push_back("corrupt");
        t.require_load_fails(reseal(bad), phrases);
        // Allowing changed options does not make an invalid value valid.
        t.require_load_fails(reseal(bad), phrases, {.allow_changed_options = true});
    }
    // What save() writes for a schedule, and a later library's option, load.
    auto scheduled = a;
    scheduled.metadata["option.option_of_a_later_version"] = "anything";
    CHECK_NOTHROW(target().p.load_bytes(reseal(scheduled)));
    CHECK(kfac::checkpoint::saved_option_fault("damping", "schedule").empty());
    CHECK(kfac::checkpoint::saved_option_fault("kl_clip", "none").empty());
    CHECK(kfac::checkpoint::saved_option_fault("factor_storage", "bf16").empty());
    CHECK_FALSE(kfac::checkpoint::saved_option_fault("accumulation_steps", "schedule").empty());
}

TEST_CASE("load refuses a step in progress, as save does, and changes nothing", "[checkpoint]") {
    auto opts = resume_options(2);
    saved_run run;
    model<double> m;
    P64 p(opts);
    m.register_with(p);
    m.fill(0, 0);
    p.accumulate();
    // Before, load() was accepted and dropped the pending pass: the next step() then blamed the
    // host ("step() after 0 accumulate() call(s)").
    check_load_error(p, run.bytes, {"load()", "after 1 accumulate() call(s)", "before the step's first accumulate()"},
                     {.allow_changed_options = true});
    CHECK(p.steps() == 0);
    m.fill(0, 1);
    CHECK_NOTHROW(p.step());  // the pending pass is still there: the step completes it
    CHECK(p.steps() == 1);
    CHECK_NOTHROW(p.load_bytes(run.bytes, {.allow_changed_options = true}));
    CHECK(p.steps() == 4);
}
