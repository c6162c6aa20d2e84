// SPDX-License-Identifier: Apache-2.0
#pragma once
// The world the distributed tests run in, so one test source checks every transport:
// MPI ranks under `mpiexec -n W` (kfac::comm::mpi), or, with KFAC_TEST_PROCESS_GROUP,
// processes started by tests/mpi/launch.sh over a Gloo process group on the loopback
// interface (kfac::comm::process_group): RANK and WORLD_SIZE as torch's launchers set them,
// and KFAC_STORE, the FileStore's path. A process started alone is a world of one.
//
// The tests' own collectives (comparing results across ranks) go through the same world.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "support/catch_session.hpp"

#if KFAC_TEST_PROCESS_GROUP
#include <filesystem>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <kfac/comm/process_group_gloo.hpp>
#else
#include <mpi.h>

#include <kfac/comm/mpi.hpp>
#endif

namespace kfac_test {

#if KFAC_TEST_PROCESS_GROUP

using comm_under_test = kfac::comm::process_group;

namespace detail {
struct gloo_world {
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
    std::string own_store;  // the store file of a world of one, removed at exit
    ~gloo_world() {
        if (!own_store.empty()) std::filesystem::remove(own_store);
    }
};
inline gloo_world& the_world() {
    static gloo_world w;
    return w;
}
inline int env_int(const char* name, int fallback) {
    const char* v = std::getenv(name);
    return v && *v ? std::atoi(v) : fallback;
}
/// The timeout of every collective: KFAC_TEST_TIMEOUT_MS (the timeout tests make it short).
inline std::chrono::milliseconds test_timeout() {
    return std::chrono::milliseconds(env_int("KFAC_TEST_TIMEOUT_MS", 60000));
}
}  // namespace detail

inline void init_world(int, char**) {
    auto& w = detail::the_world();
    const int rank = detail::env_int("RANK", 0), size = detail::env_int("WORLD_SIZE", 1);
    std::string path = std::getenv("KFAC_STORE") ? std::getenv("KFAC_STORE") : "";
    if (path.empty()) {
        if (size != 1) throw kfac::error("KFAC_STORE is not set: start the ranks with tests/mpi/launch.sh");
        path = (std::filesystem::temp_directory_path() / ("kfac_test_store_" + std::to_string(::getpid()))).string();
        w.own_store = path;
    }
    w.store = c10::make_intrusive<c10d::FileStore>(path, size);
    w.options = c10d::ProcessGroupGloo::Options::create(detail::test_timeout());
    w.options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    // One Gloo worker thread per group (the default is 2): the tests start up to 4 ranks on 2
    // cores, each with a group per KAISA role, and their threads' hand-offs were most of the
    // time (process_group_tests at 4 ranks: 11.6 s with 2 threads, 7.4 s with 1).
    w.options->threads = 1;
    w.pg = c10::make_intrusive<c10d::ProcessGroupGloo>(w.store, rank, size, w.options);
}
inline void finalize_world() {
    auto& w = detail::the_world();
    w.pg.reset();
    w.store.reset();
}
/// KFAC_TEST_PAYLOADS=tensors: payloads travel as tensors packed with ATen operations (the path
/// device payloads take over NCCL), here on the CPU's memory, instead of through host buckets.
inline comm_under_test make_comm() {
    auto& w = detail::the_world();
    const char* payloads = std::getenv("KFAC_TEST_PAYLOADS");
    std::optional<c10::Device> device;
    if (payloads && std::string(payloads) == "tensors") device = c10::Device(c10::kCPU);
    return comm_under_test(w.pg, w.store, kfac::comm::gloo_groups(w.options), detail::test_timeout(), device);
}
inline int world_rank() { return detail::the_world().pg->getRank(); }
inline int world_size() { return detail::the_world().pg->getSize(); }

namespace detail {
template <class T>
void world_reduce(T* values, std::size_t count, c10d::ReduceOp::RedOpType op) {
    std::vector<at::Tensor> t{kfac::comm::detail::host_tensor(values, count)};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    the_world().pg->allreduce(t, o)->wait();
}
}  // namespace detail
inline void world_sum(std::int64_t* values, std::size_t count) { detail::world_reduce(values, count, c10d::ReduceOp::SUM); }
inline std::int64_t world_min(std::int64_t v) {
    detail::world_reduce(&v, 1, c10d::ReduceOp::MIN);
    return v;
}
inline std::int64_t world_max(std::int64_t v) {
    detail::world_reduce(&v, 1, c10d::ReduceOp::MAX);
    return v;
}
inline double world_largest(double v) {
    detail::world_reduce(&v, 1, c10d::ReduceOp::MAX);
    return v;
}
inline void world_broadcast(double* data, std::size_t count, int root) {
    std::vector<at::Tensor> t{kfac::comm::detail::host_tensor(data, count)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    detail::the_world().pg->broadcast(t, o)->wait();
}

#else

using comm_under_test = kfac::comm::mpi;

inline void init_world(int argc, char** argv) { MPI_Init(&argc, &argv); }
inline void finalize_world() { MPI_Finalize(); }
inline comm_under_test make_comm() { return kfac::comm::mpi(MPI_COMM_WORLD); }
inline int world_size() {
    int w = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &w);
    return w;
}
inline int world_rank() {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}
inline void world_sum(std::int64_t* values, std::size_t count) {
    MPI_Allreduce(MPI_IN_PLACE, values, static_cast<int>(count), MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
}
inline std::int64_t world_min(std::int64_t v) {
    MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
    return v;
}
inline std::int64_t world_max(std::int64_t v) {
    MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    return v;
}
inline double world_largest(double v) {
    MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return v;
}
inline void world_broadcast(double* data, std::size_t count, int root) {
    MPI_Bcast(data, static_cast<int>(count), MPI_DOUBLE, root, MPI_COMM_WORLD);
}

#endif

/// Set by a test that leaves the world unable to communicate (a timeout): each rank then
/// reports its own result, and the launcher fails when any rank failed.
inline bool& world_broken() {
    static bool broken = false;
    return broken;
}

/// Runs the Catch session in the world; the exit status is nonzero on every rank when a test
/// failed on any.
inline int run_in_world(int argc, char** argv) {
    init_world(argc, argv);
    const int failed = kfac_test::run_catch_session(argc, argv);
    const auto any = world_broken() ? failed : world_max(failed);
    finalize_world();
    return static_cast<int>(any);
}

}  // namespace kfac_test
