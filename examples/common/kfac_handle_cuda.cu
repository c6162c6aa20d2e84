// SPDX-License-Identifier: Apache-2.0
// The CUDA side of kfac_handle.hpp: compiled by nvcc, sees kfac and CUDA only; the LibTorch
// layers arrive as kfac::any_layer<float>.
#include <kfac/backend/cuda.cuh>

#include "kfac_handle.hpp"

namespace kfac_examples {

std::unique_ptr<kfac_handle> make_cuda_kfac(const kfac::options& opts) {
    return std::make_unique<held_kfac<kfac::KFAC<kfac::backend::cuda<float>>>>("cuda<float>", opts);
}

}  // namespace kfac_examples
