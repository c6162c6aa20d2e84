// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file process_group_nccl.hpp
/// NCCL groups for kfac::comm::process_group (CMake target kfac::c10d, with a LibTorch built
/// with CUDA and NCCL: a PyPI wheel's; Debian's has neither). With kfac's CUDA backend the
/// payloads stay in device memory:
///
///     auto options = c10d::ProcessGroupNCCL::Options::create();
///     auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, options);
///     kfac::comm::any comm(kfac::comm::process_group(nccl, store, kfac::comm::nccl_groups(options),
///                                                    std::chrono::minutes(5),
///                                                    c10::Device(c10::kCUDA, local_rank)));
///
/// (kfac::comm::any, kfac/comm/any.hpp, because LibTorch's headers and the CUDA backend meet in
/// no one translation unit.) Payloads and control values are tensors on that device, read and
/// written on its default stream, where the CUDA backend works (process_group_payloads.hpp).

#ifndef USE_C10D_NCCL
#error "kfac/comm/process_group_nccl.hpp needs a LibTorch built with NCCL (USE_C10D_NCCL, which its torch_cuda CMake target defines)"
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "kfac/comm/process_group.hpp"

namespace kfac::comm {

/// Builds each of KAISA's groups as a ProcessGroupNCCL with `options`.
inline group_factory nccl_groups(c10::intrusive_ptr<::c10d::ProcessGroupNCCL::Options> options) {
    if (!options) throw error("kfac::comm::nccl_groups: the options are null");
    return [options](const c10::intrusive_ptr<::c10d::Store>& store, int rank, int size)
               -> c10::intrusive_ptr<c10d_collectives> {
        return c10::make_intrusive<::c10d::ProcessGroupNCCL>(store, rank, size, options);
    };
}

}  // namespace kfac::comm
