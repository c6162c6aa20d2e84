// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file host_staging.hpp
/// Collectives over device-resident data with a communication library that reads host memory
/// only (Debian's MPICH is not CUDA-aware). Before a collective the payloads are copied into
/// pinned host buffers, and afterwards the received values are copied back to the device.
/// For host backends every call is the identity and compiles away.
///
/// The pinned memory is one arena that grows to the largest step's payload: a step that
/// needs more than the arena holds takes extra chunks, and the next step finds one chunk of
/// the combined size, so steady-state steps do not allocate.
///
/// A policy whose collectives read device memory themselves (reads_device_memory(): c10d's
/// NCCL, kfac/comm/process_group.hpp) gets the device buffers as they are: see follow().

#include <algorithm>
#include <cstddef>
#include <list>
#include <vector>

namespace kfac::detail {

/// True for backends whose matrices live in device memory (Backend::device_memory).
template <class Backend>
inline constexpr bool device_resident = [] {
    if constexpr (requires { Backend::device_memory; }) return static_cast<bool>(Backend::device_memory);
    else return false;
}();

/// What a collective does with a staged payload on this rank: sends it (its values are copied
/// to the host first), receives it (the host's values are copied back after), or both (an
/// allreduce).
enum class transfer { send, receive, send_and_receive };

/// Whether `comm`'s collectives take device memory (an optional part of the CommPolicy
/// contract; a policy without reads_device_memory() reads host memory).
template <class CommPolicy>
[[nodiscard]] bool reads_device_memory(const CommPolicy& comm) {
    if constexpr (requires { comm.reads_device_memory(); }) return comm.reads_device_memory();
    else return false;
}

/// A broadcast's transfer on this rank: the root sends, every other rank receives.
[[nodiscard]] constexpr transfer broadcast_transfer(bool root) noexcept {
    return root ? transfer::send : transfer::receive;
}

template <class Backend, bool Device = device_resident<Backend>>
class host_staging {
public:
    using scalar = typename Backend::scalar_type;
    /// A host backend's data is already where the collective reads it.
    scalar* stage(scalar* data, std::size_t, transfer) noexcept { return data; }
    void complete() noexcept {}
    void follow(bool) noexcept {}
    [[nodiscard]] bool direct() const noexcept { return true; }
    [[nodiscard]] std::size_t bytes_staged() const noexcept { return 0; }
};

template <class Backend>
class host_staging<Backend, true> {
public:
    using scalar = typename Backend::scalar_type;

    /// Host memory standing in for `count` device values at `device` until complete(): the
    /// device values are copied to the host now when this rank sends them, and the host values
    /// back to `device` at complete() when it receives.
    scalar* stage(scalar* device, std::size_t count, transfer t) {
        if (direct_) return device;
        scalar* host = reserve(count);
        if (t != transfer::receive) Backend::download(device, host, count);
        if (t != transfer::send) pending_.push_back({device, host, count});
        bytes_ += count * sizeof(scalar);
        return host;
    }

    /// After the collectives have completed: uploads what was received and frees the staged
    /// space for the next round.
    void complete() {
        for (const auto& p : pending_) Backend::upload(p.host, p.device, p.count);
        pending_.clear();
        if (chunks_.size() > 1) {  // consolidate so the next round fits one chunk
            std::size_t total = 0;
            for (const auto& c : chunks_) total += c.buffer.size();
            chunks_.clear();
            chunks_.push_back(chunk{typename Backend::pinned_buffer(total), 0});
        }
        for (auto& c : chunks_) c.used = 0;
    }

    /// A communication policy that reads device memory (`comm_reads_device`) gets the device
    /// buffers themselves from stage(), and nothing is copied.
    void follow(bool comm_reads_device) noexcept { direct_ = comm_reads_device; }
    /// Whether stage() hands out the device buffers themselves (received values are in place
    /// as soon as a collective completes, not at complete()).
    [[nodiscard]] bool direct() const noexcept { return direct_; }

    /// Payload bytes staged since construction (for tests and benchmarks).
    [[nodiscard]] std::size_t bytes_staged() const noexcept { return bytes_; }

private:
    struct chunk {
        typename Backend::pinned_buffer buffer;
        std::size_t used = 0;
    };
    struct upload {
        scalar* device;
        scalar* host;
        std::size_t count;
    };

    scalar* reserve(std::size_t count) {
        if (chunks_.empty() || chunks_.back().buffer.size() - chunks_.back().used < count) {
            const std::size_t last = chunks_.empty() ? 0 : chunks_.back().buffer.size();
            chunks_.push_back(chunk{typename Backend::pinned_buffer(std::max(count, 2 * last)), 0});
        }
        chunk& c = chunks_.back();
        scalar* p = c.buffer.data() + c.used;
        c.used += count;
        return p;
    }

    std::list<chunk> chunks_;  // a list: staged pointers stay valid while chunks are added
    std::vector<upload> pending_;
    std::size_t bytes_ = 0;
    bool direct_ = false;
};

}  // namespace kfac::detail
