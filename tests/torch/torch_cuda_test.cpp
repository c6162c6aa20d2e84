// SPDX-License-Identifier: Apache-2.0
// A LibTorch model on a CUDA device, preconditioned by backend::cuda from the device views the
// tracker hands over, against the same model on the CPU preconditioned by the CPU backend.
// The preconditioner lives in a CUDA translation unit (gpu_preconditioner.cu) and receives
// the tracked layers as kfac::any_layer. Without a CUDA device, or with a LibTorch built
// without CUDA (Debian's), the program says so and exits 77, which CTest reports as skipped.

#include <torch/torch.h>
// LibTorch includes glog, whose CHECK(condition) would shadow Catch's.
#undef CHECK
#include <catch2/catch.hpp>

#include "support/catch_session.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <kfac/kfac.hpp>
#include <kfac/layers/torch.hpp>

#ifdef USE_C10D_NCCL  // a LibTorch with NCCL (a PyPI wheel's; Debian's has none)
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <kfac/comm/any.hpp>
#include <kfac/comm/process_group_nccl.hpp>
#endif

#include "gpu_preconditioner.hpp"

namespace nn = torch::nn;
namespace F = torch::nn::functional;

namespace {

struct net_impl : nn::Module {
    nn::Conv2d conv{nullptr};
    nn::Linear fc{nullptr};
    net_impl() {
        conv = register_module("conv", nn::Conv2d(nn::Conv2dOptions(2, 4, 3).padding(1)));
        fc = register_module("fc", nn::Linear(4 * 6 * 6, 3));
    }
    torch::Tensor forward(const torch::Tensor& x) { return fc(torch::relu(conv(x)).flatten(1)); }
};
TORCH_MODULE_IMPL(net, net_impl);

/// `model`'s layers tracked under `prefix`, as the CUDA translation unit receives them.
std::vector<std::pair<std::string, kfac::any_layer<float>>> tracked_layers(kfac::torch::tracker<float>& tracker,
                                                                           const net& model, const kfac::options& opts,
                                                                           const std::string& prefix) {
    std::vector<std::pair<std::string, kfac::any_layer<float>>> layers;
    for (auto* l : kfac::torch::track_modules(tracker, model, opts, prefix).layers)
        layers.emplace_back(l->name(), kfac::any_layer<float>(*l));  // the tracker owns the tracked layers
    return layers;
}

}  // namespace

TEST_CASE("a CUDA model through backend::cuda preconditions as the CPU model through the CPU backend", "[torch][cuda]") {
    kfac::options opts;
    opts.damping = 0.01;
    opts.inv_update_steps = 2;
    opts.threads = 1;

    torch::manual_seed(3);
    net on_cpu;
    torch::manual_seed(3);
    net on_gpu;
    on_gpu->to(torch::kCUDA);

    kfac::torch::tracker<float> tracker;  // observes both models (same thread)
    kfac::KFAC<> cpu_precond(opts);
    REQUIRE(kfac::torch::register_modules(cpu_precond, tracker, on_cpu, "cpu").size() == 2);
    auto layers = tracked_layers(tracker, on_gpu, opts, "gpu");
    REQUIRE(layers.size() == 2);
    auto gpu_precond = kfac_test::make_gpu_preconditioner(opts, layers);

    for (int step = 0; step < 4; ++step) {
        INFO("step " << step);
        const auto x = torch::randn({5, 2, 6, 6});
        const auto y = torch::randint(0, 3, {5});
        for (auto* model : {&on_cpu, &on_gpu}) {
            (*model)->zero_grad();
            const auto device = model == &on_cpu ? torch::kCPU : torch::kCUDA;
            F::cross_entropy((*model)->forward(x.to(device)), y.to(device)).backward();
        }
        REQUIRE(tracker.layer("gpu.conv").grad_output().is_cuda());
        cpu_precond.step();
        gpu_precond->step();
        // cuSOLVER's and LAPACK's eigenvectors of the same float factors differ by rounding
        // amplified by the eigenvalue gaps; the preconditioned gradients agree to ~1e-4 of
        // their size in the CUDA backend's own tests. 1e-3 still catches any wrong view.
        for (const char* name : {"conv", "fc"}) {
            const auto& cpu_grad = std::string(name) == "conv" ? on_cpu->conv->weight.grad() : on_cpu->fc->weight.grad();
            const auto gpu_grad = (std::string(name) == "conv" ? on_gpu->conv->weight.grad() : on_gpu->fc->weight.grad()).cpu();
            const double err = (gpu_grad - cpu_grad).abs().max().item<double>() / cpu_grad.abs().max().item<double>();
            INFO("layer " << name << ": relative error " << err);
            CHECK(err <= 1e-3);
        }
    }
    CHECK(gpu_precond->steps() == 4);
}

#ifdef USE_C10D_NCCL
namespace {
/// A ProcessGroupNCCL of one rank (this machine has one GPU; NCCL refuses two ranks on one
/// device) and kfac's policy over it with payloads in the GPU's memory.
struct nccl_world {
    c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
    c10::intrusive_ptr<c10d::ProcessGroupNCCL::Options> options = c10d::ProcessGroupNCCL::Options::create();
    c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, 0, 1, options);
    ~nccl_world() { pg->shutdown(); }  // as destroy_process_group() does (else NCCL warns at exit)
    kfac::comm::process_group policy() const {
        return kfac::comm::process_group(pg, store, kfac::comm::nccl_groups(options), std::chrono::seconds(60),
                                         c10::Device(c10::kCUDA, 0));
    }
};
}  // namespace

TEST_CASE("NCCL: device payloads are packed, reduced and unpacked on the GPU", "[torch][cuda][nccl]") {
    nccl_world w;
    auto comm = w.policy();
    CHECK(comm.reads_device_memory());
    // A world of one sends nothing; a group that claims two ranks over the one-rank NCCL group
    // makes the policy take its device path for real (NCCL's sum over one rank is the identity).
    const kfac::comm::process_group::group two{comm.world().pg, 2};
    const auto on_gpu = torch::TensorOptions().dtype(torch::kDouble).device(torch::kCUDA);
    for (std::size_t cap : {std::size_t{0}, std::size_t{1} << 20}) {  // a bucket per item; one bucket
        INFO("cap " << cap);
        // Column-major 4 x 4 whose two triangles differ: entry k holds k; and a plain vector.
        auto m = torch::arange(16, on_gpu);
        auto v = torch::arange(5, on_gpu) + 100;
        std::vector<kfac::allreduce_item<double>> items{{m.data_ptr<double>(), 16, true, 4},
                                                        {v.data_ptr<double>(), 5, false, 0}};
        comm.allreduce_sum(items, cap, true, two);
        const auto got = m.cpu();
        for (int j = 0; j < 4; ++j) {
            for (int i = j; i < 4; ++i) {  // the lower triangle (row i >= column j) kept and mirrored
                CHECK(got[j * 4 + i].item<double>() == j * 4 + i);
                CHECK(got[i * 4 + j].item<double>() == j * 4 + i);
            }
        }
        CHECK(torch::equal(v.cpu(), torch::arange(5, torch::kDouble) + 100));
    }
    CHECK(comm.counters().allreduce_calls == 3);  // two buckets, then one
    // Broadcasts of device memory, and of host memory (checkpoints) through a device copy.
    auto d = torch::arange(7, on_gpu);
    std::vector<double> h{1.5, -2.0, 3.25};
    comm.broadcast(d.data_ptr<double>(), 7, 0, two);
    comm.broadcast_host(h.data(), h.size(), 0, two);
    comm.wait();
    CHECK(torch::equal(d.cpu(), torch::arange(7, torch::kDouble)));
    CHECK(h == std::vector<double>{1.5, -2.0, 3.25});
    CHECK(comm.counters().broadcast_calls == 2);
}

TEST_CASE("NCCL: the CUDA backend over a process group (comm::any) preconditions as over comm::serial",
          "[torch][cuda][nccl]") {
    kfac::options opts;
    opts.damping = 0.01;
    opts.inv_update_steps = 2;
    torch::manual_seed(5);
    net a;
    torch::manual_seed(5);
    net b;
    a->to(torch::kCUDA);
    b->to(torch::kCUDA);
    kfac::torch::tracker<float> tracker;
    auto layers_a = tracked_layers(tracker, a, opts, "a");
    auto layers_b = tracked_layers(tracker, b, opts, "b");
    nccl_world w;
    auto over_serial = kfac_test::make_gpu_preconditioner(opts, layers_a);
    auto over_nccl = kfac_test::make_gpu_preconditioner(opts, layers_b, kfac::comm::any(w.policy()));
    for (int step = 0; step < 3; ++step) {
        INFO("step " << step);
        const auto x = torch::randn({5, 2, 6, 6}).to(torch::kCUDA);
        const auto y = torch::randint(0, 3, {5}).to(torch::kCUDA);
        for (auto* model : {&a, &b}) {
            (*model)->zero_grad();
            F::cross_entropy((*model)->forward(x), y).backward();
        }
        over_serial->step();
        over_nccl->step();
        // One rank: the same kernels on the same data, so the same bits.
        CHECK(torch::equal(a->conv->weight.grad(), b->conv->weight.grad()));
        CHECK(torch::equal(a->fc->weight.grad(), b->fc->weight.grad()));
    }
    CHECK(over_nccl->steps() == 3);
}
#endif

int main(int argc, char** argv) {
    if (!torch::cuda::is_available() || !kfac_test::cuda_device_present()) {
        std::printf("skipped: %s\n", torch::cuda::is_available() ? "no CUDA device for kfac's backend"
                                                                  : "LibTorch has no CUDA device (or was built without CUDA)");
        return 77;
    }
    return kfac_test::run_catch_session(argc, argv);
}
