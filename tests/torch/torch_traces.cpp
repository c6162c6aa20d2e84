// SPDX-License-Identifier: Apache-2.0
// kfac_torch_traces: step traces of the LibTorch adapter on the flagship's ResNet-8 (Conv2d
// strided and 1×1, BatchNorm2d, Linear) and on a small transformer-like stack (Embedding,
// LayerNorm, Linear expand/reduce, Conv1d, BatchNorm1d, GroupNorm), in double, one line per step: a digest of every
// parameter's preconditioned .grad(), of save_bytes(), of layers(), and the health counters,
// eigenbasis counts, memory_usage() and the kl_clip scale; first the registration reports.
// LibTorch's own kernels (convolutions, matrix products) round differently on other CPUs, so
// the lines are for comparing two commits on one machine, as kfac_traces is:
//   cmake --build build --target kfac_torch_traces && build/tests/torch/kfac_torch_traces > before.txt
// (tests/traces/CMakeLists.txt). The registration reports alone do not depend on the machine:
// torch_adapter_test.cpp holds them to tests/data/traces/torch_registration.txt, which
//   build/tests/torch/kfac_torch_traces --registration > tests/data/traces/torch_registration.txt
// writes.
#include <cinttypes>
#include <cstdio>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <kfac/kfac.hpp>
#include <kfac/layers/torch.hpp>

#include "trace_models.hpp"

namespace {

std::string hex(std::uint64_t v) {
    char b[17];
    std::snprintf(b, sizeof b, "%016" PRIx64, v);
    return b;
}

template <class P>
std::string trace_line(const std::string& run, std::int64_t step, const torch::nn::Module& model, const P& p,
                       std::string state) {
    kfac::detail::digest grads;
    for (const auto& item : model.named_parameters()) {
        const at::Tensor g = item.value().grad();
        grads.add(item.key());
        if (!g.defined()) {
            grads.add(-1);
            continue;
        }
        const at::Tensor c = g.contiguous();
        grads.add_bytes(c.data_ptr(), static_cast<std::size_t>(c.numel()) * c.element_size());
    }
    kfac::detail::digest layers;
    for (const auto& info : p.layers()) {
        layers.add(info.name).add(static_cast<int>(info.kind)).add(info.a_dim).add(info.g_dim).add(info.bias);
        layers.add(info.a_worker).add(info.g_worker);
    }
    kfac::detail::digest saved;
    saved.add_bytes(state.data(), state.size());
    const auto h = p.health();
    const auto b = p.eigenbasis_counts();
    const auto m = p.memory_usage();
    char line[512];
    std::snprintf(line, sizeof line,
                  "%s step=%" PRId64 " grads=%s state=%s layers=%s health=%" PRId64 ",%" PRId64 ",%" PRId64
                  " bases=%" PRId64 ",%" PRId64 " memory=%zu,%zu,%zu,%zu kl=%a",
                  run.c_str(), step, hex(grads.value()).c_str(), hex(saved.value()).c_str(), hex(layers.value()).c_str(),
                  h.skipped_factor_updates, h.kept_decompositions, h.zeroed_gradients, b.decomposed, b.reused, m.factors,
                  m.statistics, m.second_order, m.gradients, p.last_kl_scale());
    return line;
}

/// Six steps of SGD on preconditioned gradients, with data drawn from a seeded generator.
template <class Method, class MakeModel, class Batch>
void run(const std::string& name, MakeModel make_model, Batch batch, kfac::options o) {
    torch::manual_seed(7);  // before the model: its initial weights come from the global generator
    auto model = make_model();
    model->to(torch::kDouble);
    kfac::torch::tracker<double> tracker;
    kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial, Method> p(o);
    const auto report = kfac::torch::register_modules(p, tracker, model.ptr());
    std::printf("%s: %s\n", name.c_str(), report.summary().c_str());
    for (std::int64_t step = 0; step < 6; ++step) {
        model->zero_grad();
        batch(model, step).backward();
        p.step();
        std::printf("%s\n", trace_line(name, step, *model, p, p.save_bytes()).c_str());
        torch::NoGradGuard no_grad;
        for (auto& w : model->parameters())
            if (w.grad().defined()) w.sub_(0.1 * w.grad());
    }
}

kfac::options trace_options(bool eigen_outer) {
    kfac::options o;
    o.damping = 0.003;
    o.factor_update_steps = 1;
    o.inv_update_steps = 2;
    o.kl_clip = 0.001;
    o.lr = 0.1;
    o.compute_eigenvalue_outer_product = eigen_outer;
    return o;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc > 1 && std::string(argv[1]) == "--registration") {
        for (const auto& line : kfac_test::registration_reports()) std::printf("%s\n", line.c_str());
        return 0;
    }
    torch::set_num_threads(1);
    namespace fashion = kfac_examples::fashion;
    auto images = [](auto& model, std::int64_t step) {
        auto g = at::detail::createCPUGenerator(static_cast<std::uint64_t>(100 + step));
        const auto x = torch::randn({8, 1, 28, 28}, g, torch::kDouble);
        const auto y = torch::randint(0, 10, {8}, g, torch::kLong);
        return torch::nn::functional::cross_entropy(model->forward(x), y);
    };
    auto resnet = [] { return fashion::resnet(); };
    run<kfac::compute::eigendecomposition>("resnet8.eigen", resnet, images, trace_options(true));
    run<kfac::compute::inverse>("resnet8.inverse", resnet, images, trace_options(false));
    auto tokens = [](auto& model, std::int64_t step) {
        auto g = at::detail::createCPUGenerator(static_cast<std::uint64_t>(200 + step));
        const auto ids = torch::randint(0, kfac_test::transformer_stack_impl::vocabulary, {4, 6}, g, torch::kLong);
        return model->forward(ids).square().mean();
    };
    run<kfac::compute::eigendecomposition>("stack.eigen", [] { return kfac_test::transformer_stack(); }, tokens,
                                           trace_options(false));
    return 0;
}
