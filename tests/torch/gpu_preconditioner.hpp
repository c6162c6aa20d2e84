// SPDX-License-Identifier: Apache-2.0
#pragma once
// The seam between a LibTorch translation unit (g++) and a CUDA one (nvcc): LibTorch 1.13's
// headers do not compile under nvcc in C++20, and backend::cuda needs nvcc, so the layers
// cross as kfac::any_layer and the preconditioner stays behind this interface. Neither
// LibTorch nor CUDA is visible here.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <kfac/comm/any.hpp>
#include <kfac/kfac.hpp>

namespace kfac_test {

/// A KFAC<backend::cuda<float>> over the given layers, built in the CUDA translation unit.
class gpu_preconditioner {
public:
    virtual ~gpu_preconditioner() = default;
    virtual void step() = 0;
    [[nodiscard]] virtual std::int64_t steps() const = 0;
};

/// Whether a CUDA device is there for the backend.
bool cuda_device_present();

std::unique_ptr<gpu_preconditioner> make_gpu_preconditioner(
    const kfac::options& opts, std::vector<std::pair<std::string, kfac::any_layer<float>>>& layers);

#ifdef USE_C10D_NCCL  // a LibTorch with NCCL (its torch_cuda target defines it for both TUs)
/// The same over `comm` (a KFAC<backend::cuda<float>, kfac::comm::any>): a transport the CUDA
/// translation unit cannot see, such as a process group over NCCL.
std::unique_ptr<gpu_preconditioner> make_gpu_preconditioner(
    const kfac::options& opts, std::vector<std::pair<std::string, kfac::any_layer<float>>>& layers,
    kfac::comm::any comm);
#endif

}  // namespace kfac_test
