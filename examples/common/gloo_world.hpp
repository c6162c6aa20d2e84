// SPDX-License-Identifier: Apache-2.0
#pragma once
// Joins the data-parallel job this process is a rank of, the way torch's launchers describe
// it, as a Gloo process group: the examples' data-parallel runs without MPI.
//
//   rank, size   RANK and WORLD_SIZE (torchrun, tests/mpi/launch.sh), else PMI_RANK and
//                PMI_SIZE (mpiexec: MPICH's Hydra sets them), else a world of one
//   rendezvous   the FileStore at KFAC_STORE when set (tests/mpi/launch.sh sets a fresh one),
//                else a TCPStore at MASTER_ADDR:MASTER_PORT (default 127.0.0.1:29500, as
//                torch.distributed's), served by rank 0
//   transport    Gloo on the interface GLOO_SOCKET_IFNAME names, else on 127.0.0.1 when the
//                store is local, else on the address the host name resolves to

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <kfac/comm/process_group_gloo.hpp>

namespace kfac_examples {

struct gloo_world {
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;

    /// kfac's communication policy over this world.
    [[nodiscard]] kfac::comm::process_group kfac_comm() const {
        return kfac::comm::process_group(pg, store, kfac::comm::gloo_groups(options), options->timeout);
    }
};

namespace detail {
inline const char* env(const char* name) {
    const char* v = std::getenv(name);
    return v && *v ? v : nullptr;
}
inline int env_int(const char* first, const char* second, int fallback) {
    const char* v = env(first) ? env(first) : env(second);
    if (!v) return fallback;
    try {
        return std::stoi(v);
    } catch (const std::exception&) {
        throw std::runtime_error(std::string(env(first) ? first : second) + "='" + v + "' is not a number");
    }
}
}  // namespace detail

inline gloo_world join_gloo_world(std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
    const int rank = detail::env_int("RANK", "PMI_RANK", 0);
    const int size = detail::env_int("WORLD_SIZE", "PMI_SIZE", 1);
    if (size < 1 || rank < 0 || rank >= size)
        throw std::runtime_error("rank " + std::to_string(rank) + " of a world of " + std::to_string(size) +
                                 ": RANK must lie in [0, WORLD_SIZE)");
    gloo_world w;
    std::string address = "127.0.0.1";
    if (const char* file = detail::env("KFAC_STORE")) {
        w.store = c10::make_intrusive<c10d::FileStore>(file, size);
    } else {
        if (const char* a = detail::env("MASTER_ADDR")) address = a;
        c10d::TCPStoreOptions o;
        o.port = static_cast<std::uint16_t>(detail::env_int("MASTER_PORT", "MASTER_PORT", 29500));
        o.isServer = rank == 0;
        o.numWorkers = static_cast<std::size_t>(size);
        o.timeout = timeout;
        w.store = c10::make_intrusive<c10d::TCPStore>(address, o);
    }
    w.options = c10d::ProcessGroupGloo::Options::create(timeout);
    if (const char* interface = detail::env("GLOO_SOCKET_IFNAME"))
        w.options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
    else if (address == "127.0.0.1" || address == "localhost")
        w.options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    else
        w.options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    w.pg = c10::make_intrusive<c10d::ProcessGroupGloo>(w.store, rank, size, w.options);
    return w;
}

}  // namespace kfac_examples
