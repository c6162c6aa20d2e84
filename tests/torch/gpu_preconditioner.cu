// SPDX-License-Identifier: Apache-2.0
// The CUDA side of the seam (gpu_preconditioner.hpp): compiled by nvcc, sees kfac and CUDA
// only; the LibTorch layers arrive as kfac::any_layer.
#include <cuda_runtime.h>

#include <kfac/backend/cuda.cuh>

#include "gpu_preconditioner.hpp"

namespace kfac_test {

namespace {

template <class Comm>
class gpu_kfac final : public gpu_preconditioner {
public:
    gpu_kfac(const kfac::options& opts, std::vector<std::pair<std::string, kfac::any_layer<float>>>& layers,
             Comm comm = Comm())
        : precond_(opts, std::move(comm)) {
        std::vector<std::pair<std::string, kfac::any_layer<float>*>> list;
        for (auto& [name, layer] : layers) list.emplace_back(name, &layer);
        precond_.register_layers(list);
    }
    void step() override { precond_.step(); }
    [[nodiscard]] std::int64_t steps() const override { return precond_.steps(); }

private:
    kfac::KFAC<kfac::backend::cuda<float>, Comm> precond_;
};

}  // namespace

bool cuda_device_present() {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::unique_ptr<gpu_preconditioner> make_gpu_preconditioner(
    const kfac::options& opts, std::vector<std::pair<std::string, kfac::any_layer<float>>>& layers) {
    return std::make_unique<gpu_kfac<kfac::comm::serial>>(opts, layers);
}

#ifdef USE_C10D_NCCL  // the NCCL tests' only (an engine instance fewer to build otherwise)
std::unique_ptr<gpu_preconditioner> make_gpu_preconditioner(
    const kfac::options& opts, std::vector<std::pair<std::string, kfac::any_layer<float>>>& layers,
    kfac::comm::any comm) {
    return std::make_unique<gpu_kfac<kfac::comm::any>>(opts, layers, std::move(comm));
}
#endif

}  // namespace kfac_test
