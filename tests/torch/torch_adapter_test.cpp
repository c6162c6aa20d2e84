// SPDX-License-Identifier: Apache-2.0
// The LibTorch adapter (kfac/layers/torch.hpp): what it captures is the input and output
// gradient of each module, and preconditioning through it gives the same gradients as plain
// kfac::layer_views built by hand from the same data; its errors name the layer.
#include <torch/torch.h>
// LibTorch includes glog, whose CHECK(condition) would shadow Catch's.
#undef CHECK
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <kfac/kfac.hpp>
#include <kfac/layers/torch.hpp>

#include <ATen/autocast_mode.h>

#include "common/mixed_precision.hpp"

#include "trace_models.hpp"

namespace F = torch::nn::functional;
namespace nn = torch::nn;

static_assert(kfac::layer_adapter<kfac::torch::tracked_layer<float>>);
static_assert(kfac::layer_adapter<kfac::torch::tracked_layer<double>>);

namespace {

// Conv2d with bias and padding; Conv2d with a 3×2 kernel, stride 2 and no bias; Conv2d with
// reflect padding; Linear without bias (the matmul path); Linear with bias (the addmm path).
struct small_net_impl : nn::Module {
    nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
    nn::Linear fc1{nullptr}, fc2{nullptr};

    small_net_impl() {
        conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(2, 4, 3).padding(1)));
        conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(4, 5, {3, 2}).stride(2).bias(false)));
        conv3 = register_module("conv3", nn::Conv2d(nn::Conv2dOptions(5, 3, 3).padding(1).padding_mode(torch::kReflect)));
        fc1 = register_module("fc1", nn::Linear(nn::LinearOptions(27, 7).bias(false)));
        fc2 = register_module("fc2", nn::Linear(7, 3));
    }

    // Written as a user writes it: modules called directly, in-place activations.
    torch::Tensor forward(torch::Tensor x) {
        x = conv1(x).relu_();
        x = torch::tanh(conv2(x));
        x = torch::relu(conv3(x)).flatten(1);
        x = fc1(x).relu_();
        return fc2(x);
    }
};
TORCH_MODULE_IMPL(small_net, small_net_impl);

const std::vector<std::string> layer_names{"conv1", "conv2", "conv3", "fc1", "fc2"};

/// The same network evaluated step by step, keeping each layer's input and output (with
/// retain_grad) without any help from the tracker. conv3's input is the reflect-padded
/// tensor its convolution multiplies.
struct reference_pass {
    std::vector<torch::Tensor> inputs, outputs;

    torch::Tensor keep(const torch::Tensor& in, torch::Tensor out) {
        inputs.push_back(in);
        out.retain_grad();
        outputs.push_back(out);
        return out;
    }

    torch::Tensor forward(small_net& net, const torch::Tensor& x) {
        auto y = torch::relu(keep(x, net->conv1(x)));
        y = torch::tanh(keep(y, net->conv2(y)));
        auto padded = F::pad(y, F::PadFuncOptions({1, 1, 1, 1}).mode(torch::kReflect));
        inputs.push_back(padded);
        outputs.push_back(net->conv3(y));
        outputs.back().retain_grad();
        y = torch::relu(outputs.back()).flatten(1);
        y = torch::relu(keep(y, net->fc1(y)));
        return keep(y, net->fc2(y));
    }
};

/// The descriptions written out by hand (not read from the modules).
std::vector<kfac::layer_description> reference_descriptions() {
    kfac::conv2d_geometry g1, g2, g3;
    g1.kernel = {3, 3};
    g1.padding = {1, 1};
    g2.kernel = {3, 2};
    g2.stride = {2, 2};
    g3.kernel = {3, 3};  // reflect padding: the captured input is already padded
    return {kfac::conv2d_description(2, 4, g1, true), kfac::conv2d_description(4, 5, g2, false),
            kfac::conv2d_description(5, 3, g3, true), kfac::linear_description(27, 7, false),
            kfac::linear_description(7, 3, true)};
}

template <class T>
std::vector<T> to_vector(const torch::Tensor& t) {
    const auto c = t.detach().contiguous();
    return {c.data_ptr<T>(), c.data_ptr<T>() + c.numel()};
}

/// A layer's data copied out of LibTorch into plain vectors, exposed as a kfac::layer_view.
template <class T>
struct copied_layer {
    kfac::layer_view<T> view;
    std::vector<T> input, grad_output, grad_weight, grad_bias;
    std::vector<std::int64_t> input_shape, output_shape, weight_shape;

    void set_statistics(const torch::Tensor& in, const torch::Tensor& gout) {
        input = to_vector<T>(in);
        grad_output = to_vector<T>(gout);
        input_shape = in.sizes().vec();
        output_shape = gout.sizes().vec();
        view.input = kfac::tensor_view<const T>::from_extents(input.data(), input_shape);
        view.grad_output = kfac::tensor_view<const T>::from_extents(grad_output.data(), output_shape);
    }
    void set_gradients(const torch::Tensor& w, const torch::Tensor& b) {
        grad_weight = to_vector<T>(w.grad());
        weight_shape = w.sizes().vec();
        view.grad_weight = kfac::tensor_view<T>::from_extents(grad_weight.data(), weight_shape);
        if (b.defined()) {
            grad_bias = to_vector<T>(b.grad());
            view.grad_bias = kfac::tensor_view<T>(grad_bias.data(), {b.numel()});
        }
    }
};

/// max |x − r| / max |r|.
template <class T>
double rel_err(const torch::Tensor& x, const std::vector<T>& r) {
    const auto xs = to_vector<T>(x);
    double num = 0.0, den = 0.0;
    for (std::size_t i = 0; i < r.size(); ++i) {
        num = std::max(num, std::abs(static_cast<double>(xs[i]) - static_cast<double>(r[i])));
        den = std::max(den, std::abs(static_cast<double>(r[i])));
    }
    return den > 0 ? num / den : num;
}

template <class T>
constexpr torch::Dtype dtype_of() {
    return std::is_same_v<T, float> ? torch::kFloat : torch::kDouble;
}

std::pair<torch::Tensor, torch::Tensor> batch(torch::Dtype dtype) {
    return {torch::randn({6, 2, 7, 7}, torch::TensorOptions().dtype(dtype)), torch::randint(0, 3, {6}, torch::kLong)};
}

std::pair<torch::Tensor, torch::Tensor> params_of(small_net& net, std::size_t i) {
    switch (i) {
        case 0: return {net->conv1->weight, net->conv1->bias};
        case 1: return {net->conv2->weight, net->conv2->bias};
        case 2: return {net->conv3->weight, net->conv3->bias};
        case 3: return {net->fc1->weight, net->fc1->bias};
        default: return {net->fc2->weight, net->fc2->bias};
    }
}

}  // namespace

TEMPLATE_TEST_CASE("the torch adapter preconditions like plain views of the same data", "[torch]", float, double) {
    using T = TestType;
    torch::manual_seed(7);
    small_net net;
    net->to(dtype_of<T>());

    kfac::options opts;
    opts.lr = 0.1;
    opts.damping = 0.01;
    opts.inv_update_steps = 2;  // decompositions at steps 0 and 2, reused at 1 and 3
    opts.threads = 1;
    using precond_t = kfac::KFAC<kfac::backend::cpu_eigen<T>>;
    kfac::torch::tracker<T> tracker;
    precond_t through_torch(opts), through_views(opts);
    REQUIRE(kfac::torch::register_modules(through_torch, tracker, net).size() == layer_names.size());

    const auto descriptions = reference_descriptions();
    std::vector<copied_layer<T>> copies(layer_names.size());
    for (std::size_t i = 0; i < copies.size(); ++i) {
        CHECK(tracker.layer(layer_names[i]).description().a_dim() == descriptions[i].a_dim());
        CHECK(tracker.layer(layer_names[i]).description().conv.padding == descriptions[i].conv.padding);
        copies[i].view.description = descriptions[i];
        through_views.register_layer(layer_names[i], copies[i].view);
    }

    // Both preconditioners see bitwise the same numbers (the captured tensors are checked
    // equal to the reference ones below) and run the same code, so the results can differ
    // only where a vectorised kernel sums in another order because the buffers (LibTorch's,
    // 64-byte aligned, against std::vector's) are aligned differently. Such a reordering
    // changes a sum of n products by at most ~n·u of the sum of their magnitudes, and the
    // damped eigenbasis solve (condition ≤ (λ_max + γ)/γ, about 10² here with γ = 0.01 and
    // factors of norm ~1) amplifies that: 2¹⁰·u (1.2e-4 in float, 2.3e-13 in double) bounds it
    // with room to spare while still catching a wrong tensor, whose error is O(1). (Observed
    // with Debian's LibTorch 1.13.1 and OpenBLAS 0.3.21: no difference at all.)
    const double tol = 1024.0 * static_cast<double>(std::numeric_limits<T>::epsilon());
    for (int step = 0; step < 4; ++step) {
        INFO("step " << step);
        const auto [x, target] = batch(dtype_of<T>());

        // Reference: the layers' inputs and output gradients, without the tracker's help.
        net->zero_grad();
        reference_pass ref;
        F::cross_entropy(ref.forward(net, x), target).backward();
        for (std::size_t i = 0; i < copies.size(); ++i) {
            copies[i].set_statistics(ref.inputs[i], ref.outputs[i].grad());
            tracker.layer(layer_names[i]).end_pass();  // the tracker saw this pass too: not part of the step
        }

        // The training step as a user writes it.
        net->zero_grad();
        F::cross_entropy(net->forward(x), target).backward();
        for (std::size_t i = 0; i < copies.size(); ++i) {
            INFO("layer " << layer_names[i]);
            const auto& l = tracker.layer(layer_names[i]);
            REQUIRE(l.input().defined());
            CHECK(torch::equal(l.input(), ref.inputs[i]));
            CHECK(torch::equal(l.grad_output(), ref.outputs[i].grad()));
            const auto [w, b] = params_of(net, i);
            copies[i].set_gradients(w, b);
        }

        through_torch.step();
        through_views.step();
        CHECK(through_torch.last_kl_scale() == Approx(through_views.last_kl_scale()).epsilon(tol));
        for (std::size_t i = 0; i < copies.size(); ++i) {
            INFO("layer " << layer_names[i]);
            const auto [w, b] = params_of(net, i);
            CHECK(rel_err(w.grad(), copies[i].grad_weight) <= tol);
            if (b.defined()) CHECK(rel_err(b.grad(), copies[i].grad_bias) <= tol);
        }
        torch::NoGradGuard no_grad;
        for (auto& p : net->parameters()) p.sub_(0.1 * p.grad());
    }
    CHECK(tracker.layer("fc2").passes() == 8);  // 4 reference passes and 4 training passes
}

TEST_CASE("the torch adapter captures Sequential members and Linear on 3-D inputs", "[torch]") {
    torch::manual_seed(3);
    struct model_impl : nn::Module {
        nn::Sequential body{nullptr};
        model_impl() {
            body = register_module("body", nn::Sequential(nn::Linear(4, 5), nn::ReLU(),
                                                          nn::Linear(nn::LinearOptions(5, 2).bias(false))));
        }
        torch::Tensor forward(const torch::Tensor& x) { return body->forward(x); }
    };
    auto model = std::make_shared<model_impl>();
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> precond;
    REQUIRE(kfac::torch::register_modules(precond, tracker, model).size() == 2);
    CHECK(precond.is_registered("body.0"));
    CHECK(precond.is_registered("body.2"));

    const auto x = torch::randn({3, 4, 4});  // [batch, sequence, features]
    auto h = x.matmul(model->body[0]->as<nn::Linear>()->weight.t()) + model->body[0]->as<nn::Linear>()->bias;
    h.retain_grad();
    auto out = torch::relu(h).matmul(model->body[2]->as<nn::Linear>()->weight.t());
    out.retain_grad();
    out.square().sum().backward();
    const auto h_grad = h.grad().clone(), out_grad = out.grad().clone();
    const auto second_input = torch::relu(h).detach();

    model->zero_grad();
    model->forward(x).square().sum().backward();
    CHECK(torch::equal(tracker.layer("body.0").input(), x));
    CHECK(torch::allclose(tracker.layer("body.0").grad_output(), h_grad));
    CHECK(torch::allclose(tracker.layer("body.2").input(), second_input));
    CHECK(torch::allclose(tracker.layer("body.2").grad_output(), out_grad));
    CHECK(tracker.layer("body.0").grad_output().sizes() == torch::IntArrayRef({3, 4, 5}));
    CHECK_NOTHROW(precond.step());
}

TEST_CASE("only training-mode passes with a backward pass are captured", "[torch]") {
    torch::manual_seed(5);
    auto fc = nn::Linear(3, 2);
    kfac::torch::tracker<float> tracker;
    auto& layer = tracker.track("fc", fc);
    CHECK(layer.passes() == 0);
    CHECK(layer.applications() == 0);
    CHECK_FALSE(layer.input().defined());

    const auto x = torch::randn({4, 3});
    fc(x).sum().backward();
    REQUIRE(layer.passes() == 1);
    CHECK(layer.applications() == 1);
    CHECK(torch::equal(layer.input(), x));
    {
        torch::NoGradGuard no_grad;  // evaluation
        (void)fc(torch::randn({5, 3}));
    }
    (void)fc(torch::randn({6, 3}));  // gradients enabled, but no backward
    fc->eval();                      // evaluation mode, with gradients (as kfac-pytorch: not captured)
    fc(torch::randn({7, 3})).sum().backward();
    fc->train();
    CHECK(layer.passes() == 1);
    CHECK(layer.applications() == 1);
    CHECK(torch::equal(layer.input(), x));
    CHECK(layer.grad_output().sizes() == torch::IntArrayRef({4, 2}));
    layer.end_pass();
    CHECK(layer.applications() == 0);
    CHECK(layer.passes() == 1);
}

TEST_CASE("a tracker removes its observer when the last one goes", "[torch]") {
    CHECK_FALSE(at::hasThreadLocalCallbacks());
    {
        kfac::torch::tracker<float> a;
        {
            kfac::torch::tracker<double> b;
            CHECK(at::hasThreadLocalCallbacks());
        }
        CHECK(at::hasThreadLocalCallbacks());
    }
    CHECK_FALSE(at::hasThreadLocalCallbacks());
}

TEST_CASE("torch adapter errors name the layer", "[torch][errors]") {
    torch::manual_seed(11);
    auto fc = nn::Linear(3, 2);
    const auto x = torch::randn({4, 3});

    SECTION("a dtype kfac does not read") {
        auto fc_complex = nn::Linear(3, 2);
        fc_complex->to(torch::kComplexFloat);
        kfac::torch::tracker<float> tracker;
        CHECK_THROWS_WITH(tracker.track("head", fc_complex),
                          Catch::Contains("layer 'head'") && Catch::Contains("ComplexFloat") &&
                              Catch::Contains("bfloat16"));
    }
    SECTION("gradient not contiguous") {
        kfac::torch::tracker<float> tracker;
        kfac::KFAC<> precond;
        precond.register_layer("head", tracker.track("head", fc));
        fc(x).sum().backward();
        fc->weight.mutable_grad() = torch::zeros({3, 2}).t();
        CHECK_THROWS_WITH(precond.step(), Catch::Contains("layer 'head'") &&
                                              Catch::Contains("weight.grad() is not contiguous"));
    }
    SECTION("gradient not on the CPU") {
        kfac::torch::tracker<float> tracker;
        kfac::KFAC<> precond;
        precond.register_layer("head", tracker.track("head", fc));
        fc(x).sum().backward();
        fc->bias.mutable_grad() = torch::zeros({2}, torch::TensorOptions().device(torch::kMeta));
        CHECK_THROWS_WITH(precond.step(), Catch::Contains("layer 'head'") && Catch::Contains("bias.grad() is on device meta"));
    }
    SECTION("no gradient") {
        kfac::torch::tracker<float> tracker;
        kfac::KFAC<> precond;
        precond.register_layer("head", tracker.track("head", fc));
        fc(x).sum().backward();
        fc->weight.mutable_grad() = torch::Tensor();
        CHECK_THROWS_WITH(precond.step(), Catch::Contains("layer 'head'") && Catch::Contains("weight.grad() is undefined"));
    }
    SECTION("nothing captured") {
        kfac::torch::tracker<float> tracker;
        kfac::KFAC<> precond;
        precond.register_layer("head", tracker.track("head", fc));
        {
            torch::NoGradGuard no_grad;
            (void)fc(x);
        }
        fc->weight.mutable_grad() = torch::zeros({2, 3});
        fc->bias.mutable_grad() = torch::zeros({2});
        CHECK_THROWS_WITH(precond.step(), Catch::Contains("no registered layer was applied") &&
                                              Catch::Contains("training mode, with gradients enabled"));
        CHECK(precond.steps() == 0);
    }
    SECTION("modules that are not Linear or Conv2d, and duplicates") {
        kfac::torch::tracker<float> tracker;
        CHECK_THROWS_WITH(tracker.track("act", nn::ReLU().ptr()), Catch::Contains("'act'") && Catch::Contains("none of torch::nn::Linear, Conv2d, Conv1d"));
        tracker.track("head", fc);
        CHECK_THROWS_WITH(tracker.track("head", nn::Linear(3, 2)), Catch::Contains("'head' is already tracked"));
        CHECK_THROWS_WITH(tracker.track("again", fc), Catch::Contains("already tracked as 'head'"));
        CHECK_THROWS_WITH(tracker.layer("tail"), Catch::Contains("no layer named 'tail'"));
    }
    SECTION("unsupported convolutions") {
        kfac::torch::tracker<float> tracker;
        auto same_even = nn::Conv2d(nn::Conv2dOptions(1, 2, 2).padding(torch::kSame));
        CHECK_THROWS_WITH(tracker.track("same", same_even), Catch::Contains("layer 'same'") && Catch::Contains("unevenly"));
        auto same_odd = nn::Conv2d(nn::Conv2dOptions(1, 2, 3).padding(torch::kSame).dilation(2));
        CHECK(tracker.track("same_odd", same_odd).description().conv.padding == std::array<std::int64_t, 2>{2, 2});
    }
    SECTION("register_modules honours skip_layers before tracking") {
        struct model_impl : nn::Module {
            nn::Conv2d grouped{nullptr}, same{nullptr};
            nn::Linear head{nullptr};
            model_impl() {
                grouped = register_module("grouped", nn::Conv2d(nn::Conv2dOptions(4, 4, 3).groups(2)));
                same = register_module("same", nn::Conv2d(nn::Conv2dOptions(4, 4, 2).padding(torch::kSame)));
                head = register_module("head", nn::Linear(4, 2));
            }
        };
        auto model = std::make_shared<model_impl>();
        kfac::torch::tracker<float> tracker;
        kfac::options opts;
        opts.skip_layers = {"grouped", "^same$"};
        kfac::KFAC<> precond(opts);
        const auto report = kfac::torch::register_modules(precond, tracker, model);
        CHECK(report.registered == std::vector<std::string>{"head"});
        CHECK(tracker.size() == 1);
        CHECK(precond.is_registered("head"));
        REQUIRE(report.not_preconditioned.size() == 2);
        CHECK(report.not_preconditioned[0].name == "grouped");
        CHECK(report.not_preconditioned[0].reason == "matched by options.skip_layers");
    }
    SECTION("a malformed skip pattern is the preconditioner's kfac::error, not std::regex_error") {
        // track_modules takes the options without a preconditioner to check them first.
        auto model = nn::Sequential(nn::Linear(4, 2));
        kfac::torch::tracker<float> tracker;
        kfac::options opts;
        opts.skip_layers = {"head", "("};
        CHECK_THROWS_AS(kfac::torch::track_modules(tracker, model, opts), kfac::error);
        CHECK_THROWS_WITH(kfac::torch::track_modules(tracker, model, opts),
                          Catch::Contains("options.skip_layers: '('"));
        CHECK(tracker.size() == 0);
    }
}

namespace {

/// One layer's (input, output gradient) applications and gradients, copied, as plain views
/// through a preconditioner that accumulates one pass per application.
std::vector<double> factor_values(const kfac::KFAC<>& p, const std::string& name) {
    const auto& a = p.a_factor(name);
    const auto& g = p.g_factor(name);
    std::vector<double> v(a.data(), a.data() + a.size());
    v.insert(v.end(), g.data(), g.data() + g.size());
    return v;
}

}  // namespace

TEST_CASE("a module applied twice in one forward pass contributes both applications", "[torch][applications]") {
    // Before: only the application whose gradient arrived last was folded in.
    torch::manual_seed(13);
    auto fc = nn::Linear(4, 4);
    kfac::options opts;
    opts.damping = 0.01;
    opts.threads = 1;
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> through_torch(opts);
    through_torch.register_layer("fc", tracker.track("fc", fc));

    const auto x = torch::randn({5, 4});
    auto y1 = fc(x);
    y1.retain_grad();
    const auto h = torch::tanh(y1);
    auto y2 = fc(h);
    y2.retain_grad();
    y2.square().sum().backward();
    CHECK(tracker.layer("fc").applications() == 2);

    // The definition: the mean of the two applications' statistics, which two accumulated
    // passes of plain views give.
    kfac::options acc = opts;
    acc.accumulation_steps = 2;
    kfac::KFAC<> through_views(acc);
    copied_layer<float> copy;
    copy.view.description = kfac::linear_description(4, 4, true);
    through_views.register_layer("fc", copy.view);
    copy.set_gradients(fc->weight, fc->bias);
    copy.set_statistics(x, y1.grad());
    through_views.accumulate();
    copy.set_statistics(h, y2.grad());
    through_views.step();

    through_torch.step();
    CHECK(tracker.layer("fc").applications() == 0);
    // The same numbers summed in another order (the tracker holds the applications in the
    // order their gradients arrived): a few ulps of the factors, amplified by the damped
    // solve's condition (≤ 10² with γ = 0.01) as in the first test: 2¹⁰·ε bounds it.
    const double tol = 1024.0 * static_cast<double>(std::numeric_limits<float>::epsilon());
    const auto ours = factor_values(through_torch, "fc"), reference = factor_values(through_views, "fc");
    REQUIRE(ours.size() == reference.size());
    double worst = 0.0, scale = 0.0;
    for (std::size_t i = 0; i < ours.size(); ++i) {
        worst = std::max(worst, std::abs(ours[i] - reference[i]));
        scale = std::max(scale, std::abs(reference[i]));
    }
    CHECK(worst <= tol * scale);
    CHECK(rel_err<float>(fc->weight.grad(), copy.grad_weight) <= tol);
    CHECK(rel_err<float>(fc->bias.grad(), copy.grad_bias) <= tol);
}

TEST_CASE("a module not called in a step keeps its factors and, without a gradient, its gradient", "[torch][applications]") {
    // Before: the branch's previous pass was folded into its factors again at every step.
    torch::manual_seed(17);
    auto trunk = nn::Linear(4, 3);
    auto branch = nn::Linear(3, 3);
    kfac::options opts;
    opts.damping = 0.01;
    opts.threads = 1;
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> precond(opts);
    precond.register_layer("trunk", tracker.track("trunk", trunk));
    precond.register_layer("branch", tracker.track("branch", branch));
    auto loss = [&](bool take_branch) {
        const auto x = torch::randn({6, 4});
        return (take_branch ? branch(trunk(x)) : trunk(x)).square().sum();
    };

    loss(true).backward();
    precond.step();
    const auto branch_a = factor_values(precond, "branch");
    const auto trunk_a = factor_values(precond, "trunk");

    // Step 1: the branch is not taken; its gradient is zero (zero_grad keeping the buffers,
    // LibTorch 1.13's default and not LibTorch 2's).
    trunk->zero_grad(/*set_to_none=*/false);
    branch->zero_grad(/*set_to_none=*/false);
    loss(false).backward();
    precond.step();
    CHECK(factor_values(precond, "branch") == branch_a);  // no data, no decay
    CHECK(factor_values(precond, "trunk") != trunk_a);
    CHECK(branch->weight.grad().abs().max().item<float>() == 0.0f);

    // Step 2: gradients set to none (LibTorch 2's default): the branch has none, and keeps none.
    trunk->zero_grad(/*set_to_none=*/true);
    branch->zero_grad(/*set_to_none=*/true);
    loss(false).backward();
    REQUIRE_FALSE(branch->weight.grad().defined());
    const auto trunk_gradient = trunk->weight.grad().clone();
    precond.step();
    CHECK_FALSE(branch->weight.grad().defined());
    CHECK_FALSE(torch::equal(trunk->weight.grad(), trunk_gradient));  // preconditioned
    CHECK(factor_values(precond, "branch") == branch_a);
    CHECK(precond.steps() == 3);
}

TEST_CASE("frozen layers are left out, and a frozen layer is not tracked", "[torch][registration]") {
    // Before: the frozen layer was registered, and step() failed with a message about threads
    // and grad mode.
    torch::manual_seed(19);
    struct model_impl : nn::Module {
        nn::Linear backbone{nullptr}, head{nullptr};
        model_impl() {
            backbone = register_module("backbone", nn::Linear(4, 3));
            head = register_module("head", nn::Linear(3, 2));
        }
        torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(backbone(x))); }
    };
    auto model = std::make_shared<model_impl>();
    for (auto& p : model->backbone->parameters()) p.set_requires_grad(false);
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> precond;
    const auto report = kfac::torch::register_modules(precond, tracker, model);
    CHECK(report.registered == std::vector<std::string>{"head"});
    REQUIRE(report.not_preconditioned.size() == 1);
    CHECK(report.not_preconditioned[0].name == "backbone");
    CHECK(report.not_preconditioned[0].module == "torch::nn::Linear");
    CHECK_THAT(report.not_preconditioned[0].reason, Catch::Contains("requires_grad = false"));
    CHECK_THAT(report.summary(), Catch::Contains("K-FAC preconditions 1 layer;") && Catch::Contains("backbone"));
    model->forward(torch::randn({5, 4})).square().sum().backward();
    CHECK_NOTHROW(precond.step());

    kfac::torch::tracker<float> other;
    CHECK_THROWS_WITH(other.track("backbone", model->backbone),
                      Catch::Contains("layer 'backbone'") && Catch::Contains("requires_grad = false"));
    CHECK(other.size() == 0);
}

TEST_CASE("register_modules registers all layers or none, and reports what it leaves out", "[torch][registration]") {
    // Before: a failure half-way left the tracker half-filled, and a retry with skip_layers
    // failed with "already tracked"; a grouped convolution failed the registration (it is
    // now registered, one block per group), and so did a BatchNorm (now registered too). A
    // PReLU has parameters and no K-FAC block: it is reported.
    torch::manual_seed(23);
    struct model_impl : nn::Module {
        nn::Conv2d stem{nullptr}, grouped{nullptr}, same{nullptr};
        nn::BatchNorm2d bn{nullptr};
        nn::PReLU act{nullptr};
        nn::Linear head{nullptr};
        model_impl() {
            stem = register_module("stem", nn::Conv2d(nn::Conv2dOptions(1, 4, 3).padding(1)));
            bn = register_module("bn", nn::BatchNorm2d(4));
            act = register_module("act", nn::PReLU());
            grouped = register_module("grouped", nn::Conv2d(nn::Conv2dOptions(4, 4, 3).padding(1).groups(2)));
            same = register_module("same", nn::Conv2d(nn::Conv2dOptions(4, 4, 2).padding(torch::kSame)));
            head = register_module("head", nn::Linear(4, 2));
        }
        torch::Tensor forward(torch::Tensor x) {
            x = torch::relu(bn(stem(x)));
            x = act(grouped(x));
            return head(x.mean({2, 3}));
        }
    };
    auto model = std::make_shared<model_impl>();
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> first;
    CHECK_THROWS_WITH(kfac::torch::register_modules(first, tracker, model),
                      Catch::Contains("layer 'same'") && Catch::Contains("unevenly"));
    CHECK(tracker.size() == 0);
    CHECK(first.layer_count() == 0);

    kfac::options opts;
    opts.skip_layers = {"^same$"};
    kfac::KFAC<> precond(opts);
    const auto report = kfac::torch::register_modules(precond, tracker, model);
    CHECK(report.registered == std::vector<std::string>{"stem", "bn", "grouped", "head"});
    CHECK(tracker.size() == 4);
    CHECK(precond.is_registered("grouped/group1"));
    REQUIRE(report.not_preconditioned.size() == 2);
    CHECK(report.not_preconditioned[0].name == "act");
    CHECK(report.not_preconditioned[0].module == "torch::nn::PReLU");
    CHECK(report.not_preconditioned[1].name == "same");
    CHECK_THAT(report.summary(), Catch::Contains("K-FAC preconditions 4 layers;") &&
                                     Catch::Contains("torch::nn::PReLU (no K-FAC block for this module type): act;") &&
                                     Catch::Contains("(matched by options.skip_layers): same"));
    model->forward(torch::randn({3, 1, 6, 6})).square().sum().backward();
    CHECK_NOTHROW(precond.step());

    SECTION("a name the preconditioner has already: nothing is tracked") {
        kfac::torch::tracker<float> again;
        kfac::options skip_same = opts;
        kfac::KFAC<> p(skip_same);
        auto other = nn::Linear(2, 2);
        p.register_layer("head", again.track("elsewhere", other));
        CHECK_THROWS_WITH(kfac::torch::register_modules(p, again, model), Catch::Contains("'head' is already registered"));
        CHECK(again.size() == 1);
        CHECK(p.layer_count() == 1);
    }
}

TEST_CASE("a functional call reusing a module's weight with other options names the cause", "[torch][errors]") {
    // Before: a shape error about the output gradients, without the cause.
    torch::manual_seed(29);
    auto conv = nn::Conv2d(nn::Conv2dOptions(2, 3, 3).padding(1));
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> precond;
    precond.register_layer("conv", tracker.track("conv", conv));
    const auto x = torch::randn({2, 2, 8, 8});
    F::conv2d(x, conv->weight, F::Conv2dFuncOptions().bias(conv->bias).stride(2)).sum().backward();
    CHECK_THROWS_WITH(precond.step(), Catch::Contains("layer 'conv' (torch::nn::Conv2d)") &&
                                          Catch::Contains("stride [2, 2], padding [0, 0], dilation [1, 1], groups 1") &&
                                          Catch::Contains("give stride [1, 1], padding [1, 1]") &&
                                          Catch::Contains("functional call"));
    CHECK(precond.steps() == 0);
    tracker.layer("conv").end_pass();

    // The module's own options through a functional call are the module's computation.
    conv->zero_grad();
    F::conv2d(x, conv->weight, F::Conv2dFuncOptions().bias(conv->bias).padding(1)).sum().backward();
    CHECK_NOTHROW(precond.step());

    // padding 'same' reaches the convolution as a string, and is the module's padding.
    auto same = nn::Conv2d(nn::Conv2dOptions(2, 3, 5).padding(torch::kSame).dilation(2));
    kfac::KFAC<> q;
    q.register_layer("same", tracker.track("same", same));
    same(x).sum().backward();
    CHECK_NOTHROW(q.step());
}

TEST_CASE("CUDA tensors give device views, which a host backend refuses by name", "[torch][cuda]") {
    // Before: any tensor not on the CPU was refused, although kfac has a CUDA backend.
    kfac::torch::detail::layer_state s;
    s.name = "fc";
    s.type = "Linear";
    using kfac::torch::detail::memory_space_of;
    CHECK(memory_space_of(s, "x", c10::Device(c10::kCUDA, 0)) == kfac::memory_space::device);
    CHECK(memory_space_of(s, "x", c10::Device(c10::kCPU)) == kfac::memory_space::host);
    CHECK_THROWS_WITH(memory_space_of(s, "the weight", c10::Device(c10::kMeta)),
                      Catch::Contains("layer 'fc'") && Catch::Contains("CUDA tensors (kfac::backend::cuda)"));

    // A tensor that says it is on a CUDA device (its metadata only: no kernel runs on it, so
    // this works without CUDA) as the weight's gradient: the view is a device view, which the
    // CPU backend refuses, naming the layer and the backend that reads it.
    auto fc = nn::Linear(3, 2);
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> precond;
    auto& layer = tracker.track("fc", fc);
    precond.register_layer("fc", layer);
    fc(torch::randn({4, 3})).sum().backward();
    std::vector<float> storage(6);
    fc->weight.mutable_grad() = at::for_blob(storage.data(), {2, 3})
                                    .options(torch::TensorOptions().dtype(torch::kFloat))
                                    .target_device(c10::Device(c10::kCUDA, 0))
                                    .make_tensor();
    REQUIRE(fc->weight.grad().is_cuda());
    const auto view = layer.weight_gradient_view();
    CHECK(view.space == kfac::memory_space::device);
    CHECK(view.data == storage.data());
    CHECK_THROWS_WITH(precond.step(), Catch::Contains("layer 'fc'") && Catch::Contains("weight gradient") &&
                                          Catch::Contains("use kfac::backend::cuda"));
    CHECK(precond.steps() == 0);
}

TEST_CASE("track_modules and any_layer: the seam for a preconditioner in another translation unit", "[torch][any_layer]") {
    // What a CUDA translation unit receives (tests/torch/torch_cuda_test.cpp): the same
    // preconditioning as register_modules, here on the CPU.
    torch::manual_seed(31);
    small_net a;
    torch::manual_seed(31);
    small_net b;  // the same weights
    kfac::options opts;
    opts.damping = 0.01;
    opts.threads = 1;
    opts.skip_layers = {"\\.conv3$"};
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> direct(opts), through_any(opts);
    REQUIRE(kfac::torch::register_modules(direct, tracker, a, "a").size() == 4);
    auto tracked = kfac::torch::track_modules(tracker, b, opts, "b");
    REQUIRE(tracked.layers.size() == 4);
    CHECK(tracked.report.registered == std::vector<std::string>{"b.conv1", "b.conv2", "b.fc1", "b.fc2"});
    REQUIRE(tracked.report.not_preconditioned.size() == 1);
    CHECK(tracked.report.not_preconditioned[0].name == "b.conv3");
    std::vector<kfac::any_layer<float>> layers;
    for (auto* l : tracked.layers) layers.emplace_back(*l);
    for (std::size_t i = 0; i < layers.size(); ++i) through_any.register_layer(tracked.layers[i]->name(), layers[i]);
    for (int step = 0; step < 3; ++step) {
        const auto [x, target] = batch(torch::kFloat);
        for (auto* net : {&a, &b}) {
            (*net)->zero_grad();
            F::cross_entropy((*net)->forward(x), target).backward();
        }
        direct.step();
        through_any.step();
        CHECK(tracker.layer("b.fc1").applications() == 0);  // end_pass reached the tracked layer
        CHECK(torch::equal(a->conv1->weight.grad(), b->conv1->weight.grad()));
        CHECK(torch::equal(a->fc2->weight.grad(), b->fc2->weight.grad()));
    }
}

TEST_CASE("Conv1d modules and reduce Linear layers on sequences precondition like plain views", "[torch][conv1d][weight_sharing]") {
    // A 1-D convolutional sequence model: Conv1d with reflect padding and dilation 2 (the
    // captured input is the padded one), Conv1d with padding 'same' and no bias, then a
    // Linear applied to every position of [N, L, C], pooled before the loss (reduce).
    using T = double;
    torch::manual_seed(31);
    auto c1 = nn::Conv1d(nn::Conv1dOptions(3, 4, 3).padding(2).dilation(2).padding_mode(torch::kReflect));
    auto c2 = nn::Conv1d(nn::Conv1dOptions(4, 5, 3).padding(torch::kSame).bias(false));
    auto fc = nn::Linear(5, 2);
    auto model = nn::Sequential();
    model->push_back("c1", c1);
    model->push_back("c2", c2);
    model->push_back("fc", fc);
    model->to(torch::kDouble);  // the members are shared: c1, c2 and fc are double too

    kfac::options opts;
    opts.damping = 0.01;
    opts.conv_patches = kfac::conv_patch_mode::dilated;
    opts.reduce_layers = {"^fc$"};
    opts.threads = 1;
    using precond_t = kfac::KFAC<kfac::backend::cpu_eigen<T>>;
    kfac::torch::tracker<T> tracker;
    precond_t through_torch(opts), through_views(opts);
    const auto report = kfac::torch::register_modules(through_torch, tracker, model);
    CHECK(report.registered == std::vector<std::string>{"c1", "c2", "fc"});
    const auto layers = through_torch.layers();
    CHECK(layers[0].kind == kfac::layer_kind::conv1d);
    CHECK(layers[0].a_dim == 3 * 3 + 1);

    // The descriptions written out by hand.
    std::vector<copied_layer<T>> copies(3);
    copies[0].view.description = kfac::conv1d_description(3, 4, {3, 1, 0, 2, 1}, true);  // padding done by the pad
    copies[1].view.description = kfac::conv1d_description(4, 5, {3, 1, 1, 1, 1}, false);
    copies[2].view.description = kfac::with_sharing(kfac::linear_description(5, 2, true), kfac::weight_sharing::reduce);
    const std::vector<std::string> names{"c1", "c2", "fc"};
    for (std::size_t i = 0; i < 3; ++i) through_views.register_layer(names[i], copies[i].view);

    auto forward = [&](const torch::Tensor& x, std::vector<torch::Tensor>* keep) {
        auto o1 = c1(x);
        auto o2 = c2(torch::relu(o1));
        auto seq = torch::tanh(o2).transpose(1, 2);  // [N, L, 5]
        auto o3 = fc(seq);
        if (keep) {
            for (auto* o : {&o1, &o2, &o3}) o->retain_grad();
            *keep = {F::pad(x, F::PadFuncOptions({2, 2}).mode(torch::kReflect)), torch::relu(o1), seq, o1, o2, o3};
        }
        return o3.mean(1);  // pooled over positions: reduce's setting
    };
    const double tol = 1024.0 * std::numeric_limits<T>::epsilon();  // as in the first test of this file
    for (int step = 0; step < 3; ++step) {
        INFO("step " << step);
        const auto x = torch::randn({4, 3, 9}, torch::kDouble);
        const auto target = torch::randint(0, 2, {4}, torch::kLong);
        model->zero_grad();
        std::vector<torch::Tensor> ref;
        F::cross_entropy(forward(x, &ref), target).backward();
        for (std::size_t i = 0; i < 3; ++i) {
            copies[i].set_statistics(ref[i], ref[3 + i].grad());
            tracker.layer(names[i]).end_pass();
        }
        model->zero_grad();
        F::cross_entropy(forward(x, nullptr), target).backward();
        for (std::size_t i = 0; i < 3; ++i) {
            INFO("layer " << names[i]);
            CHECK(torch::equal(tracker.layer(names[i]).input(), ref[i]));
        }
        copies[0].set_gradients(c1->weight, c1->bias);
        copies[1].set_gradients(c2->weight, c2->bias);
        copies[2].set_gradients(fc->weight, fc->bias);
        through_torch.step();
        through_views.step();
        CHECK(rel_err<T>(c1->weight.grad(), copies[0].grad_weight) <= tol);
        CHECK(rel_err<T>(c1->bias.grad(), copies[0].grad_bias) <= tol);
        CHECK(rel_err<T>(c2->weight.grad(), copies[1].grad_weight) <= tol);
        CHECK(rel_err<T>(fc->weight.grad(), copies[2].grad_weight) <= tol);
        CHECK(rel_err<T>(fc->bias.grad(), copies[2].grad_bias) <= tol);
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.sub_(0.1 * p.grad());
    }
    // fc's A factor averages 4 per-example means (reduce), as the views' does.
    CHECK(through_torch.a_factor("fc").isApprox(through_views.a_factor("fc"), tol));
}

TEST_CASE("Embedding modules precondition like plain views of their token ids", "[torch][embedding]") {
    // An Embedding (with padding_idx: its row's gradient is zero, and stays zero, A being
    // diagonal) feeding a Linear applied at every position of [N, L, E].
    using T = double;
    torch::manual_seed(37);
    const std::int64_t vocabulary = 10, width = 4;
    auto emb = nn::Embedding(nn::EmbeddingOptions(vocabulary, width).padding_idx(0));
    auto fc = nn::Linear(width, 3);
    auto model = nn::Sequential();
    model->push_back("emb", emb);
    model->push_back("fc", fc);
    model->to(torch::kDouble);

    kfac::options opts;
    opts.damping = 0.01;
    opts.threads = 1;
    using precond_t = kfac::KFAC<kfac::backend::cpu_eigen<T>>;
    kfac::torch::tracker<T> tracker;
    precond_t through_torch(opts), through_views(opts);
    const auto report = kfac::torch::register_modules(through_torch, tracker, model);
    CHECK(report.registered == std::vector<std::string>{"emb", "fc"});
    CHECK(through_torch.layers()[0].kind == kfac::layer_kind::embedding);

    std::vector<copied_layer<T>> copies(2);
    copies[0].view.description = kfac::embedding_description(vocabulary, width);
    copies[1].view.description = kfac::linear_description(width, 3, true);
    through_views.register_layer("emb", copies[0].view);
    through_views.register_layer("fc", copies[1].view);
    const double tol = 1024.0 * std::numeric_limits<T>::epsilon();  // as in the first test of this file
    for (int step = 0; step < 3; ++step) {
        INFO("step " << step);
        const auto ids = torch::randint(0, vocabulary, {5, 6}, torch::kLong);
        const auto target = torch::randint(0, 3, {5}, torch::kLong);
        model->zero_grad();
        auto e = emb(ids);
        e.retain_grad();
        auto o = fc(e);
        o.retain_grad();
        F::cross_entropy(o.mean(1), target).backward();
        copies[0].set_statistics(ids.to(torch::kDouble), e.grad());
        copies[1].set_statistics(e, o.grad());
        copies[0].set_gradients(emb->weight, torch::Tensor());
        copies[1].set_gradients(fc->weight, fc->bias);
        CHECK(torch::equal(tracker.layer("emb").input(), ids.to(torch::kDouble)));
        CHECK(to_vector<T>(emb->weight.grad()[0]) == std::vector<T>(width, 0.0));
        through_torch.step();
        through_views.step();
        CHECK(rel_err<T>(emb->weight.grad(), copies[0].grad_weight) <= tol);
        CHECK(rel_err<T>(fc->weight.grad(), copies[1].grad_weight) <= tol);
        CHECK(to_vector<T>(emb->weight.grad()[0]) == std::vector<T>(width, 0.0));  // padding_idx's row
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.sub_(0.1 * p.grad());
    }
}

TEST_CASE("Embeddings whose gradient is not the plain one are left out, by reason", "[torch][embedding][registration]") {
    auto sparse = nn::Embedding(nn::EmbeddingOptions(8, 3).sparse(true));
    auto by_freq = nn::Embedding(nn::EmbeddingOptions(8, 3).scale_grad_by_freq(true));
    auto model = nn::Sequential();
    model->push_back("sparse", sparse);
    model->push_back("by_freq", by_freq);
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> precond;
    const auto report = kfac::torch::register_modules(precond, tracker, model);
    CHECK(report.registered.empty());
    REQUIRE(report.not_preconditioned.size() == 2);
    CHECK_THAT(report.not_preconditioned[0].reason, Catch::Contains("sparse = true"));
    CHECK_THAT(report.not_preconditioned[1].reason, Catch::Contains("scale_grad_by_freq = true"));
    CHECK_THROWS_WITH(tracker.track("by_freq", by_freq), Catch::Contains("layer 'by_freq' (torch::nn::Embedding)") &&
                                                             Catch::Contains("scale_grad_by_freq"));
    CHECK(tracker.size() == 0);
}

TEST_CASE("grouped and depthwise Conv2d modules precondition like plain views, one block per group", "[torch][grouped_conv]") {
    // A ResNeXt-style bottleneck (1x1 reduce, 3x3 grouped conv of cardinality 4, 1x1 expand,
    // shortcut) followed by a MobileNet-style depthwise 3x3 (multiplier 2, stride 2), pooled
    // into a Linear head.
    using T = double;
    torch::manual_seed(41);
    auto reduce = nn::Conv2d(nn::Conv2dOptions(8, 8, 1).bias(false));
    auto grouped = nn::Conv2d(nn::Conv2dOptions(8, 8, 3).padding(1).groups(4).bias(false));
    auto expand = nn::Conv2d(nn::Conv2dOptions(8, 8, 1));
    auto depthwise = nn::Conv2d(nn::Conv2dOptions(8, 16, 3).stride(2).padding(1).groups(8));
    auto head = nn::Linear(16, 3);
    auto model = nn::Sequential();
    model->push_back("reduce", reduce);
    model->push_back("grouped", grouped);
    model->push_back("expand", expand);
    model->push_back("depthwise", depthwise);
    model->push_back("head", head);
    model->to(torch::kDouble);

    kfac::options opts;
    opts.damping = 0.01;
    opts.threads = 2;
    using precond_t = kfac::KFAC<kfac::backend::cpu_eigen<T>>;
    kfac::torch::tracker<T> tracker;
    precond_t through_torch(opts), through_views(opts);
    const auto report = kfac::torch::register_modules(through_torch, tracker, model);
    const std::vector<std::string> names{"reduce", "grouped", "expand", "depthwise", "head"};
    CHECK(report.registered == names);
    CHECK(report.not_preconditioned.empty());
    CHECK(through_torch.layer_count() == 1 + 4 + 1 + 8 + 1);
    const auto layers = through_torch.layers();
    CHECK(layers[1].name == "grouped/group0");
    CHECK(layers[1].a_dim == 2 * 9);
    CHECK(layers[1].g_dim == 2);
    CHECK(layers[6].name == "depthwise/group0");
    CHECK(layers[6].a_dim == 9 + 1);
    CHECK(layers[6].g_dim == 2);

    std::vector<copied_layer<T>> copies(5);
    auto conv = [](std::int64_t k, std::int64_t stride, std::int64_t padding, std::int64_t groups) {
        kfac::conv2d_geometry g;
        g.kernel = {k, k};
        g.stride = {stride, stride};
        g.padding = {padding, padding};
        g.groups = groups;
        return g;
    };
    copies[0].view.description = kfac::conv2d_description(8, 8, conv(1, 1, 0, 1), false);
    copies[1].view.description = kfac::conv2d_description(8, 8, conv(3, 1, 1, 4), false);
    copies[2].view.description = kfac::conv2d_description(8, 8, conv(1, 1, 0, 1), true);
    copies[3].view.description = kfac::conv2d_description(8, 16, conv(3, 2, 1, 8), true);
    copies[4].view.description = kfac::linear_description(16, 3, true);
    for (std::size_t i = 0; i < 5; ++i) through_views.register_layer(names[i], copies[i].view);

    const double tol = 1024.0 * std::numeric_limits<T>::epsilon();  // as in the first test of this file
    for (int step = 0; step < 3; ++step) {
        INFO("step " << step);
        const auto x = torch::randn({4, 8, 6, 6}, torch::kDouble);
        const auto target = torch::randint(0, 3, {4}, torch::kLong);
        model->zero_grad();
        auto o1 = reduce(x);
        auto a2 = torch::relu(o1);
        auto o2 = grouped(a2);
        auto a3 = torch::relu(o2);
        auto o3 = expand(a3);
        auto a4 = torch::relu(o3 + x);  // the shortcut
        auto o4 = depthwise(a4);
        auto a5 = torch::relu(o4).mean({2, 3});
        auto o5 = head(a5);
        for (auto* o : {&o1, &o2, &o3, &o4, &o5}) o->retain_grad();
        F::cross_entropy(o5, target).backward();
        const std::vector<torch::Tensor> inputs{x, a2, a3, a4, a5}, outputs{o1, o2, o3, o4, o5};
        for (std::size_t i = 0; i < 5; ++i) {
            INFO("layer " << names[i]);
            copies[i].set_statistics(inputs[i], outputs[i].grad());
            CHECK(torch::equal(tracker.layer(names[i]).input(), inputs[i]));
        }
        copies[0].set_gradients(reduce->weight, torch::Tensor());
        copies[1].set_gradients(grouped->weight, torch::Tensor());
        copies[2].set_gradients(expand->weight, expand->bias);
        copies[3].set_gradients(depthwise->weight, depthwise->bias);
        copies[4].set_gradients(head->weight, head->bias);
        through_torch.step();
        through_views.step();
        CHECK(rel_err<T>(reduce->weight.grad(), copies[0].grad_weight) <= tol);
        CHECK(rel_err<T>(grouped->weight.grad(), copies[1].grad_weight) <= tol);
        CHECK(rel_err<T>(expand->weight.grad(), copies[2].grad_weight) <= tol);
        CHECK(rel_err<T>(depthwise->weight.grad(), copies[3].grad_weight) <= tol);
        CHECK(rel_err<T>(depthwise->bias.grad(), copies[3].grad_bias) <= tol);
        CHECK(rel_err<T>(head->weight.grad(), copies[4].grad_weight) <= tol);
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.sub_(0.1 * p.grad());
    }
    CHECK(through_torch.a_factor("grouped/group3").isApprox(through_views.a_factor("grouped/group3"), tol));
}

namespace {

/// (y − shift) / scale: the normalised input a LayerNorm or BatchNorm multiplied, read back
/// from its own output (scale broadcast as the module broadcasts it), independent of the
/// adapter's recomputation from the input.
torch::Tensor normalized_from_output(const torch::Tensor& y, const torch::Tensor& scale, const torch::Tensor& shift,
                                     bool channels_second) {
    const torch::NoGradGuard no_grad;
    if (!channels_second) return (y - shift) / scale;
    std::vector<std::int64_t> shape(static_cast<std::size_t>(y.dim()), 1);
    shape[1] = scale.numel();
    return (y - shift.reshape(shape)) / scale.reshape(shape);
}

/// Scales in [0.5, 1.5] and shifts of 0.1·N(0, 1): a normalisation layer away from its
/// identity initialisation, so that y ≠ x̂.
void perturb_affine(const torch::Tensor& scale, const torch::Tensor& shift) {
    const torch::NoGradGuard no_grad;
    scale.uniform_(0.5, 1.5);
    shift.normal_(0.0, 0.1);
}

}  // namespace

TEST_CASE("LayerNorm and BatchNorm modules precondition like plain views of x-hat", "[torch][norm]") {
    // A ResNeXt-style bottleneck with a BatchNorm after each convolution (1x1, 3x3 of
    // cardinality 4, 1x1, shortcut), its positions then read as tokens through a LayerNorm
    // over the features and one over (tokens, features), pooled into a Linear head: every
    // module with parameters is registered. The views are built from (y − β)/γ of each norm's
    // own output, not from the adapter's recomputation of x̂ from its input.
    using T = double;
    torch::manual_seed(43);
    struct block_impl : nn::Module {
        nn::Conv2d reduce{nullptr}, grouped{nullptr}, expand{nullptr};
        nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
        nn::LayerNorm ln{nullptr}, ln2{nullptr};
        nn::Linear head{nullptr};
        block_impl() {
            reduce = register_module("reduce", nn::Conv2d(nn::Conv2dOptions(8, 8, 1).bias(false)));
            bn1 = register_module("bn1", nn::BatchNorm2d(8));
            grouped = register_module("grouped", nn::Conv2d(nn::Conv2dOptions(8, 8, 3).padding(1).groups(4).bias(false)));
            bn2 = register_module("bn2", nn::BatchNorm2d(8));
            expand = register_module("expand", nn::Conv2d(nn::Conv2dOptions(8, 8, 1).bias(false)));
            bn3 = register_module("bn3", nn::BatchNorm2d(8));
            ln = register_module("ln", nn::LayerNorm(nn::LayerNormOptions({8})));
            ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({16, 8})));
            head = register_module("head", nn::Linear(8, 3));
        }
    };
    auto model = std::make_shared<block_impl>();
    model->to(torch::kDouble);
    for (auto* bn : {&model->bn1, &model->bn2, &model->bn3}) perturb_affine((*bn)->weight, (*bn)->bias);
    perturb_affine(model->ln->weight, model->ln->bias);
    perturb_affine(model->ln2->weight, model->ln2->bias);

    kfac::options opts;
    opts.damping = 0.01;
    opts.threads = 2;
    using precond_t = kfac::KFAC<kfac::backend::cpu_eigen<T>>;
    kfac::torch::tracker<T> tracker;
    precond_t through_torch(opts), through_views(opts);
    const auto report = kfac::torch::register_modules(through_torch, tracker, model);
    const std::vector<std::string> names{"reduce", "bn1", "grouped", "bn2", "expand", "bn3", "ln", "ln2", "head"};
    CHECK(report.registered == names);
    CHECK(report.not_preconditioned.empty());
    CHECK(tracker.layer("ln2").description().out == 16 * 8);

    std::vector<copied_layer<T>> copies(names.size());
    kfac::conv2d_geometry one, three;
    three.kernel = {3, 3};
    three.padding = {1, 1};
    three.groups = 4;
    copies[0].view.description = kfac::conv2d_description(8, 8, one, false);
    copies[1].view.description = kfac::batch_norm_description(8, true);
    copies[2].view.description = kfac::conv2d_description(8, 8, three, false);
    copies[3].view.description = kfac::batch_norm_description(8, true);
    copies[4].view.description = kfac::conv2d_description(8, 8, one, false);
    copies[5].view.description = kfac::batch_norm_description(8, true);
    copies[6].view.description = kfac::layer_norm_description(8, true);
    copies[7].view.description = kfac::layer_norm_description(16 * 8, true);
    copies[8].view.description = kfac::linear_description(8, 3, true);
    for (std::size_t i = 0; i < names.size(); ++i) through_views.register_layer(names[i], copies[i].view);

    // The norm layers' x̂ two ways ((x − μ)/√(σ² + ε) and (y − β)/γ) agree to ~10u; the block
    // sums (t_γ = Σ x̂ dy may cancel) and the 2 × 2 solve (κ ≤ (‖F_c‖ + γ)/γ) amplify that;
    // kl_clip's ν carries it to every layer.
    const double norm_tol = 1e-9;
    auto& m = *model;
    for (int step = 0; step < 3; ++step) {
        INFO("step " << step);
        const auto x = torch::randn({4, 8, 4, 4}, torch::kDouble);
        const auto target = torch::randint(0, 3, {4}, torch::kLong);
        model->zero_grad();
        auto o0 = m.reduce(x);
        auto o1 = m.bn1(o0);
        auto a2 = torch::relu(o1);
        auto o2 = m.grouped(a2);
        auto o3 = m.bn2(o2);
        auto a4 = torch::relu(o3);
        auto o4 = m.expand(a4);
        auto o5 = m.bn3(o4);
        auto tokens = torch::relu(o5 + x).flatten(2).transpose(1, 2);  // [N, 16, 8]
        auto o6 = m.ln(tokens);
        auto o7 = m.ln2(o6);
        auto a8 = o7.mean(1);
        auto o8 = m.head(a8);
        for (auto* o : {&o0, &o1, &o2, &o3, &o4, &o5, &o6, &o7, &o8}) o->retain_grad();
        F::cross_entropy(o8, target).backward();
        const auto xhat1 = normalized_from_output(o1, m.bn1->weight, m.bn1->bias, true);
        const auto xhat3 = normalized_from_output(o3, m.bn2->weight, m.bn2->bias, true);
        const auto xhat5 = normalized_from_output(o5, m.bn3->weight, m.bn3->bias, true);
        const auto xhat6 = normalized_from_output(o6, m.ln->weight, m.ln->bias, false);
        const auto xhat7 = normalized_from_output(o7, m.ln2->weight, m.ln2->bias, false).reshape({4, 16 * 8});
        const std::vector<torch::Tensor> inputs{x, xhat1, a2, xhat3, a4, xhat5, xhat6, xhat7, a8};
        const std::vector<torch::Tensor> grads{o0.grad(), o1.grad(), o2.grad(), o3.grad(), o4.grad(), o5.grad(),
                                               o6.grad(), o7.grad().reshape({4, 16 * 8}), o8.grad()};
        for (std::size_t i = 0; i < names.size(); ++i) copies[i].set_statistics(inputs[i], grads[i]);
        copies[0].set_gradients(m.reduce->weight, torch::Tensor());
        copies[1].set_gradients(m.bn1->weight, m.bn1->bias);
        copies[2].set_gradients(m.grouped->weight, torch::Tensor());
        copies[3].set_gradients(m.bn2->weight, m.bn2->bias);
        copies[4].set_gradients(m.expand->weight, torch::Tensor());
        copies[5].set_gradients(m.bn3->weight, m.bn3->bias);
        copies[6].set_gradients(m.ln->weight, m.ln->bias);
        copies[7].set_gradients(m.ln2->weight, m.ln2->bias);
        copies[7].view.grad_weight = kfac::tensor_view<T>(copies[7].grad_weight.data(), {16 * 8});  // [16, 8] as one
        copies[8].set_gradients(m.head->weight, m.head->bias);
        through_torch.step();
        through_views.step();
        CHECK(rel_err<T>(m.reduce->weight.grad(), copies[0].grad_weight) <= norm_tol);
        CHECK(rel_err<T>(m.grouped->weight.grad(), copies[2].grad_weight) <= norm_tol);
        CHECK(rel_err<T>(m.head->weight.grad(), copies[8].grad_weight) <= norm_tol);  // kl_clip couples the layers
        const std::vector<std::pair<std::size_t, nn::Module*>> norms{
            {1, m.bn1.get()}, {3, m.bn2.get()}, {5, m.bn3.get()}, {6, m.ln.get()}, {7, m.ln2.get()}};
        for (const auto& [i, module] : norms) {
            INFO("layer " << names[i]);
            const auto params = module->named_parameters();
            CHECK(rel_err<T>(params["weight"].grad(), copies[i].grad_weight) <= norm_tol);
            CHECK(rel_err<T>(params["bias"].grad(), copies[i].grad_bias) <= norm_tol);
        }
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.sub_(0.1 * p.grad());
    }
    CHECK(through_torch.a_factor("bn2").isApprox(through_views.a_factor("bn2"), norm_tol));
    CHECK(through_torch.a_factor("ln2").rows() == 16 * 8);
}

TEST_CASE("a norm layer's blocks are the mean outer product of its per-example gradients", "[torch][norm]") {
    // Item 7's definition from first principles: t_n = ∂(loss_n / N)/∂(γ, β), example n's share
    // of the mean loss, from autograd one example at a time (the gradient the host's
    // backward delivers is the sum of these); F_c = (1/N) Σ_n t_{n,c} t_{n,c}ᵀ. A LayerNorm
    // over tokens with weight sharing reduce (one row per example) and a BatchNorm, each
    // followed by per-example operations only; factor_decay 0 makes the factor F̂ itself.
    using T = double;
    torch::manual_seed(47);
    const std::int64_t n = 5;
    auto check_blocks = [&](const std::shared_ptr<nn::Module>& norm, const torch::Tensor& scale, const torch::Tensor& shift,
                            const std::function<torch::Tensor(const torch::Tensor&)>& forward, const torch::Tensor& x) {
        kfac::options opts;
        opts.factor_decay = 0.0;
        opts.reduce_layers = {"^norm$"};
        kfac::torch::tracker<T> tracker;
        kfac::KFAC<kfac::backend::cpu_eigen<T>> precond(opts);
        precond.register_layer("norm", tracker.track("norm", norm));
        const auto target = torch::randint(0, 3, {n}, torch::kLong);
        const auto out = forward(x);
        // The step first: the per-example backward passes below reach the tracker's hook too,
        // each an application of the next pass.
        F::cross_entropy(out, target).backward({}, /*retain_graph=*/true);
        precond.step();
        const auto c = scale.numel();
        Eigen::MatrixXd f = Eigen::MatrixXd::Zero(c, 3);
        for (std::int64_t e = 0; e < n; ++e) {
            const auto loss = F::cross_entropy(out.slice(0, e, e + 1), target.slice(0, e, e + 1)) / double(n);
            const auto g = torch::autograd::grad({loss}, {scale, shift}, {}, /*retain_graph=*/true);
            const auto gw = to_vector<T>(g[0]), gb = to_vector<T>(g[1]);
            for (std::int64_t ch = 0; ch < c; ++ch) {
                const auto k = static_cast<std::size_t>(ch);
                f(ch, 0) += gw[k] * gw[k] / double(n);
                f(ch, 1) += gw[k] * gb[k] / double(n);
                f(ch, 2) += gb[k] * gb[k] / double(n);
            }
        }
        const auto& a = precond.a_factor("norm");
        REQUIRE(a.rows() == c);
        REQUIRE(a.cols() == 3);
        // Two summation orders of the same products (autograd's, the statistic's), in double;
        // the entries are sums of ≲ 100 terms: 1e-12 of the largest is generous.
        CHECK((a - f).cwiseAbs().maxCoeff() <= 1e-12 * f.cwiseAbs().maxCoeff());
    };
    SECTION("LayerNorm over tokens, weight sharing reduce") {
        auto ln = nn::LayerNorm(nn::LayerNormOptions({6}));
        auto fc = nn::Linear(6, 3);
        ln->to(torch::kDouble);
        fc->to(torch::kDouble);
        perturb_affine(ln->weight, ln->bias);
        check_blocks(ln.ptr(), ln->weight, ln->bias, [&](const torch::Tensor& x) { return fc(ln(x)).mean(1); },
                     torch::randn({n, 4, 6}, torch::kDouble));
    }
    SECTION("BatchNorm2d, its batch statistics, per-example gradients") {
        auto bn = nn::BatchNorm2d(4);
        auto fc = nn::Linear(4, 3);
        bn->to(torch::kDouble);
        fc->to(torch::kDouble);
        perturb_affine(bn->weight, bn->bias);
        check_blocks(bn.ptr(), bn->weight, bn->bias,
                     [&](const torch::Tensor& x) { return fc(torch::tanh(bn(x)).mean({2, 3})); },
                     torch::randn({n, 4, 3, 3}, torch::kDouble));
    }
    SECTION("GroupNorm, two groups of two channels") {
        auto gn = nn::GroupNorm(nn::GroupNormOptions(2, 4));
        auto fc = nn::Linear(4, 3);
        gn->to(torch::kDouble);
        fc->to(torch::kDouble);
        perturb_affine(gn->weight, gn->bias);
        check_blocks(gn.ptr(), gn->weight, gn->bias,
                     [&](const torch::Tensor& x) { return fc(torch::tanh(gn(x)).mean({2, 3})); },
                     torch::randn({n, 4, 3, 3}, torch::kDouble));
    }
    SECTION("InstanceNorm1d, affine") {
        auto in = nn::InstanceNorm1d(nn::InstanceNorm1dOptions(4).affine(true));
        auto fc = nn::Linear(4, 3);
        in->to(torch::kDouble);
        fc->to(torch::kDouble);
        perturb_affine(in->weight, in->bias);
        check_blocks(in.ptr(), in->weight, in->bias, [&](const torch::Tensor& x) { return fc(torch::tanh(in(x)).mean(2)); },
                     torch::randn({n, 4, 6}, torch::kDouble));
    }
}

TEST_CASE("the registration reports of the flagship's models and of a transformer-like stack are as recorded",
          "[torch][registration]") {
    // Recorded on the commit before the adapter was split into rooms; the reports depend on the
    // module types and options alone, not on the machine (tests/torch/torch_traces.cpp prints
    // them with its step traces).
    std::ifstream in(KFAC_TORCH_REGISTRATION_FIXTURE);
    REQUIRE(in);
    std::vector<std::string> expected;
    for (std::string line; std::getline(in, line);) expected.push_back(line);
    const std::vector<std::string> actual = kfac_test::registration_reports();
    REQUIRE(actual.size() == expected.size());
    for (std::size_t i = 0; i < actual.size(); ++i) CHECK(actual[i] == expected[i]);
}

TEST_CASE("track() takes a holder of every module type in the adapter's table, and names them when refusing another",
          "[torch][registration]") {
    kfac::torch::tracker<float> tracker;
    nn::Linear linear(3, 4);
    nn::Conv2d conv2d(nn::Conv2dOptions(2, 3, 3));
    nn::Conv1d conv1d(nn::Conv1dOptions(2, 3, 3));
    nn::Embedding embedding(10, 4);
    nn::LayerNorm layer_norm(nn::LayerNormOptions({2, 3}));
    nn::BatchNorm1d bn1(5);
    nn::BatchNorm2d bn2(6);
    nn::BatchNorm3d bn3(7);
    CHECK(tracker.track("linear", linear).description().kind == kfac::layer_kind::linear);
    CHECK(tracker.track("conv2d", conv2d).description().kind == kfac::layer_kind::conv2d);
    CHECK(tracker.track("conv1d", conv1d).description().kind == kfac::layer_kind::conv1d);
    CHECK(tracker.track("embedding", embedding).description().kind == kfac::layer_kind::embedding);
    const auto& ln = tracker.track("layer_norm", layer_norm).description();
    CHECK(ln.kind == kfac::layer_kind::layer_norm);
    CHECK(ln.out == 6);  // normalized_shape {2, 3}, seen as one dimension of their product
    const auto& d1 = tracker.track("bn1", bn1).description();
    const auto& d2 = tracker.track("bn2", bn2).description();
    const auto& d3 = tracker.track("bn3", bn3).description();
    CHECK((d1.kind == kfac::layer_kind::batch_norm && d2.kind == d1.kind && d3.kind == d1.kind));
    CHECK((d1.out == 5 && d2.out == 6 && d3.out == 7));
    nn::GroupNorm group_norm(2, 4);
    nn::InstanceNorm1d in1(nn::InstanceNorm1dOptions(3).affine(true));
    nn::InstanceNorm2d in2(nn::InstanceNorm2dOptions(4).affine(true));
    nn::InstanceNorm3d in3(nn::InstanceNorm3dOptions(5).affine(true));
    const auto& gn = tracker.track("group_norm", group_norm).description();
    CHECK((gn.kind == kfac::layer_kind::group_norm && gn.out == 4 && gn.bias));
    CHECK(gn.sharing == kfac::weight_sharing::reduce);
    const auto& i1 = tracker.track("in1", in1).description();
    const auto& i2 = tracker.track("in2", in2).description();
    const auto& i3 = tracker.track("in3", in3).description();
    CHECK((i1.kind == kfac::layer_kind::instance_norm && i2.kind == i1.kind && i3.kind == i1.kind));
    CHECK((i1.out == 3 && i2.out == 4 && i3.out == 5));
    CHECK(tracker.size() == 12);
    nn::LSTM lstm(nn::LSTMOptions(3, 4));
    CHECK_THROWS_WITH(tracker.track("lstm", lstm.ptr()),
                      Catch::Contains("module 'lstm'") &&
                          Catch::Contains("is none of torch::nn::Linear, Conv2d, Conv1d, Embedding, LayerNorm, "
                                          "BatchNorm1d, BatchNorm2d, BatchNorm3d, GroupNorm, InstanceNorm1d, "
                                          "InstanceNorm2d, InstanceNorm3d"));
    CHECK(tracker.size() == 12);
}

// ---- mixed precision (docs/precision.md) -------------------------------------------------

TEST_CASE("a bf16 model registers and trains, its gradients written back in bf16", "[torch][precision]") {
    torch::manual_seed(5);
    auto conv = nn::Conv2d(nn::Conv2dOptions(2, 3, 3).padding(1));
    auto bn = nn::BatchNorm2d(3);
    auto fc = nn::Linear(3 * 4 * 4, 5);
    // The same parameters in float, for the first layer's A factor, which depends on the
    // input alone: bf16 values read exactly and summed in float give the float model's bits.
    auto conv32 = nn::Conv2d(nn::Conv2dOptions(2, 3, 3).padding(1));
    for (nn::Module* m : {static_cast<nn::Module*>(conv.ptr().get()), static_cast<nn::Module*>(bn.ptr().get()),
                          static_cast<nn::Module*>(fc.ptr().get())})
        m->to(torch::kBFloat16);
    {
        torch::NoGradGuard no_grad;
        conv32->weight.copy_(conv->weight.to(torch::kFloat));
        conv32->bias.copy_(conv->bias.to(torch::kFloat));
    }
    const auto x = torch::randn({4, 2, 4, 4}).to(torch::kBFloat16);
    kfac::torch::tracker<float> tracker, tracker32;
    kfac::KFAC<> precond, precond32;
    precond.register_layer("conv", tracker.track("conv", conv));
    precond.register_layer("bn", tracker.track("bn", bn));
    precond.register_layer("fc", tracker.track("fc", fc));
    precond32.register_layer("conv", tracker32.track("conv", conv32));
    for (int step = 0; step < 2; ++step) {
        conv->zero_grad();
        bn->zero_grad();
        fc->zero_grad();
        fc(torch::relu(bn(conv(x))).flatten(1)).square().sum().backward();
        const auto before = fc->weight.grad().clone();
        const kfac::step_result r = precond.step();
        CHECK_FALSE(r.skipped);
        CHECK(fc->weight.grad().scalar_type() == torch::kBFloat16);
        CHECK(torch::isfinite(fc->weight.grad()).all().item<bool>());
        CHECK_FALSE(torch::equal(before, fc->weight.grad()));
        conv32->zero_grad();
        conv32(x.to(torch::kFloat)).square().sum().backward();
        precond32.step();
        CHECK(precond.a_factor("conv") == precond32.a_factor("conv"));
    }
}

TEST_CASE("a model under CPU autocast registers and trains", "[torch][precision]") {
    torch::manual_seed(6);
    auto conv = nn::Conv2d(nn::Conv2dOptions(2, 3, 3).padding(1));
    auto bn = nn::BatchNorm2d(3);
    auto fc = nn::Linear(3 * 4 * 4, 5);
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> precond;
    precond.register_layer("conv", tracker.track("conv", conv));
    precond.register_layer("bn", tracker.track("bn", bn));
    precond.register_layer("fc", tracker.track("fc", fc));
    const auto x = torch::randn({4, 2, 4, 4});
    {
        // CPU autocast: matmul and convolutions in bf16, their outputs bf16 (the switch of the
        // LibTorch at hand, examples/common/mixed_precision.hpp).
        mixed_precision::set_autocast(false, true, at::kBFloat16);
        const auto y = fc(torch::relu(bn(conv(x))).flatten(1));
        mixed_precision::set_autocast(false, false);
        at::autocast::clear_cache();
        CHECK(y.scalar_type() == torch::kBFloat16);
        y.to(torch::kFloat).square().sum().backward();
    }
    CHECK(fc->weight.grad().scalar_type() == torch::kFloat);
    CHECK_FALSE(precond.step().skipped);
    CHECK(torch::isfinite(fc->weight.grad()).all().item<bool>());
    CHECK(precond.a_factor("fc").allFinite());
}

TEST_CASE("the grad scaler and K-FAC skip the same overflowed step", "[torch][precision]") {
    torch::manual_seed(7);
    auto fc = nn::Linear(4, 3);
    // s = 2^62 on inputs of 10^10: the weight gradient s·Σ 2y·x ≈ 10^40 overflows float, while
    // s² stays within float's range (the preconditioner checks that).
    kfac::torch::grad_scaler scaler({.initial_scale = 0x1p62});
    kfac::options o;
    o.loss_scale = scaler.loss_scale();
    kfac::torch::tracker<float> tracker;
    kfac::KFAC<> precond(o);
    precond.register_layer("fc", tracker.track("fc", fc));
    torch::optim::SGD sgd(fc->parameters(), 0.1);
    const auto x = torch::randn({8, 4}) * 1e10;
    const auto weight = fc->weight.clone();
    for (int step = 0; step < 2; ++step) {
        sgd.zero_grad();
        scaler.scale(fc(x).square().sum()).backward();
        scaler.unscale(sgd);
        const kfac::step_result r = precond.step();
        CHECK(r.skipped == scaler.found_inf());
        if (!r.skipped) sgd.step();
        scaler.update();
    }
    // Both steps overflow (the backed-off 2^61 too): skipped by both, weights untouched.
    CHECK(precond.health().skipped_steps == 2);
    CHECK(torch::equal(fc->weight, weight));
    CHECK(scaler.current_scale() == 0x1p60);
}
