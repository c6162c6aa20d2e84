// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file process_group_gloo.hpp
/// Gloo groups for kfac::comm::process_group (CMake target kfac::c10d): KAISA's groups of
/// some ranks as ProcessGroupGloo over the same devices and timeout as the world's.
///
///     auto store = c10::make_intrusive<c10d::FileStore>(path, world_size);
///     auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
///     options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
///     auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
///     kfac::comm::process_group comm(pg, store, kfac::comm::gloo_groups(options), options->timeout);

// LibTorch declares ProcessGroupGloo only when this is defined, as its own build defines it;
// its CMake package does not pass it on (kfac::c10d does).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "kfac/comm/process_group.hpp"

namespace kfac::comm {

/// Builds each group as a ProcessGroupGloo with `options` (its devices, timeout and threads).
inline group_factory gloo_groups(c10::intrusive_ptr<::c10d::ProcessGroupGloo::Options> options) {
    if (!options) throw error("kfac::comm::gloo_groups: the options are null");
    if (options->devices.empty())
        throw error("kfac::comm::gloo_groups: the options name no device; add the world's, e.g. "
                    "c10d::ProcessGroupGloo::createDefaultDevice()");
    return [options](const c10::intrusive_ptr<::c10d::Store>& store, int rank, int size)
               -> c10::intrusive_ptr<c10d_collectives> {
        return c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, size, options);
    };
}

}  // namespace kfac::comm
