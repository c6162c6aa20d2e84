// SPDX-License-Identifier: Apache-2.0
/// @file bench_torch_step.cpp
/// What K-FAC adds to a LibTorch training step, on the flagship's ResNet-8 (10 Conv2d/Linear
/// layers, 9 BatchNorm) at batch 128 of 28×28 images, float32: one whole step each (zero_grad,
/// forward, cross-entropy, backward, [K-FAC], SGD with momentum), random data, fixed seed.
///
///   torch_step/sgd             the plain step
///   torch_step/tracked         the same with a kfac::torch::tracker observing it (the capture's
///                              cost: the RecordFunction observer and the gradient hooks)
///   torch_step/kfac/non_update K-FAC preconditioning only (factors and decompositions reused)
///   torch_step/kfac/factor_update    + the factor statistics and running averages
///   torch_step/kfac/inverse_update   + every factor's eigendecomposition
///
/// The flagship's schedule (factors every 10 steps, decompositions every 100) costs on average
/// non_update + (factor_update − non_update)/10 + (inverse_update − factor_update)/100 per step;
/// docs/layers.md gives that as a ratio to torch_step/sgd, measured in one run. Threads: LibTorch's
/// and kfac's both take --threads-like control from KFAC_BENCH_THREADS (default 1); the system
/// BLAS that LibTorch's Linear layers use is kept to one thread, as the flagship does.

#include <benchmark/benchmark.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>

#include <torch/torch.h>

#include <kfac/kfac.hpp>
#include <kfac/layers/torch.hpp>

#include "models.hpp"

namespace {

namespace F = torch::nn::functional;
using preconditioner = kfac::KFAC<kfac::backend::cpu_eigen<float>>;

int threads() {
    const char* t = std::getenv("KFAC_BENCH_THREADS");
    return t != nullptr && std::atoi(t) > 0 ? std::atoi(t) : 1;
}

/// As the flagship: LibTorch's system BLAS on one thread (its pool would compete with OpenMP's).
void setup_threads() {
    static const bool done = [] {
        using setter = void (*)(int);
        if (auto* set = reinterpret_cast<setter>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(1);
        torch::set_num_threads(threads());
        return true;
    }();
    (void)done;
}

enum class mode { sgd, tracked, non_update, factor_update, inverse_update };

void torch_step(benchmark::State& state, mode m) {
    setup_threads();
    torch::manual_seed(1);
    kfac_examples::fashion::resnet model;
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    const auto x = torch::randn({128, 1, 28, 28});
    const auto y = torch::randint(0, 10, {128});

    std::optional<preconditioner::backend_type::serial_blas_scope> one_blas_thread;
    std::unique_ptr<kfac::torch::tracker<float>> tracker;
    std::unique_ptr<preconditioner> precond;
    if (m != mode::sgd) {
        one_blas_thread.emplace();
        tracker = std::make_unique<kfac::torch::tracker<float>>();
    }
    if (m == mode::tracked) {
        for (const auto& name : {"stem", "layer1.conv1", "layer1.conv2", "layer2.conv1", "layer2.conv2",
                                 "layer2.projection", "layer3.conv1", "layer3.conv2", "layer3.projection", "fc"})
            tracker->track(name, model->named_modules()[name]);
    } else if (m != mode::sgd) {
        constexpr std::int64_t never = std::numeric_limits<std::int32_t>::max();
        kfac::options o;
        o.damping = 0.003;
        o.lr = 0.01;
        o.threads = threads();
        o.skip_layers = {"BatchNorm"};  // as kfac-pytorch, which it is compared with, leaves them
        o.factor_update_steps = m == mode::non_update ? never : 1;
        o.inv_update_steps = m == mode::inverse_update ? 1 : never;
        precond = std::make_unique<preconditioner>(o);
        kfac::torch::register_modules(*precond, *tracker, model);
    }
    auto step = [&] {
        sgd.zero_grad();
        F::cross_entropy(model->forward(x), y).backward();
        if (precond) precond->step();
        if (tracker && !precond)  // captured but not consumed: forget the pass as step() would
            for (const auto& name : {"stem", "layer1.conv1", "layer1.conv2", "layer2.conv1", "layer2.conv2",
                                     "layer2.projection", "layer3.conv1", "layer3.conv2", "layer3.projection", "fc"})
                tracker->layer(name).end_pass();
        sgd.step();
    };
    step();  // step 0 updates and decomposes everything (and warms LibTorch up)
    for (auto _ : state) step();
    state.counters["threads"] = threads();
}

}  // namespace

BENCHMARK_CAPTURE(torch_step, sgd, mode::sgd)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(torch_step, tracked, mode::tracked)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(torch_step, kfac/non_update, mode::non_update)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(torch_step, kfac/factor_update, mode::factor_update)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(torch_step, kfac/inverse_update, mode::inverse_update)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
