// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file any.hpp
/// A communication policy that holds any other behind a virtual interface, so that a
/// preconditioner compiled once talks over a transport its translation unit cannot see.
///
/// The case it exists for: kfac's CUDA backend compiles under nvcc, and LibTorch's headers do
/// not (in C++20), so KFAC<backend::cuda<T>, comm::process_group> cannot be compiled anywhere.
/// KFAC<backend::cuda<T>, comm::any> can: the nvcc translation unit sees this header only,
/// and the host one builds the process group and wraps it:
///
///     // host.cpp (g++, LibTorch)
///     kfac::comm::any comm(kfac::comm::process_group(nccl, store, kfac::comm::nccl_groups(options),
///                                                    timeout, c10::Device(c10::kCUDA, 0)));
///     train_on_gpu(std::move(comm));   // defined in a .cu file
///
/// Every call forwards to the held policy, which keeps its own guarantees (agreement, no
/// hang, errors naming rank and phase); the optional parts of the contract (phase, progress,
/// reads_device_memory, broadcast_host) forward when the held policy has them. Payloads are
/// float or double, the scalars of kfac's backends. The cost is one virtual call per
/// collective.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/comm/posted_allreduce.hpp"
#include "kfac/comm/serial.hpp"
#include "kfac/config.hpp"

namespace kfac::comm {

/// A CommPolicy holding any other (above): one virtual call per collective. Move-only.
class any {
public:
    /// A group of the held policy's, shared by copies.
    struct group {
        std::shared_ptr<const void> held;  ///< the held policy's group
        int size = 1;                      ///< its number of ranks
    };

    /// Holds `policy`, any CommPolicy (kfac/comm/serial.hpp).
    template <class Policy>
        requires(!std::is_same_v<std::remove_cvref_t<Policy>, any>)
    explicit any(Policy policy) : held_(std::make_unique<model<Policy>>(std::move(policy))) {}

    ///@{
    /// The CommPolicy member of that name (kfac/comm/serial.hpp), forwarded to the held policy;
    /// payloads are float or double. phase(), progress() and broadcast_host() fall back as
    /// kfac::comm::announce_phase(), progress() and broadcast_host() do, and
    /// reads_device_memory() is false, where the held policy lacks them.
    [[nodiscard]] int rank() const { return held_->rank(); }
    [[nodiscard]] int size() const { return held_->size(); }
    [[nodiscard]] group world() const { return held_->world(); }
    group split(int color) { return held_->split(color); }
    [[nodiscard]] int group_size(const group& g) const noexcept { return g.size; }

    template <class T>
    void allreduce_sum(const std::vector<allreduce_item<T>>& items, std::size_t cap_bytes, bool pack_symmetric,
                       const group& g) {
        static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "comm::any: float or double payloads");
        held_->allreduce_sum(items, cap_bytes, pack_symmetric, g);
    }
    template <class T>
    void allreduce_sum_each(const std::vector<allreduce_item<T>>& items, std::size_t cap_bytes, bool pack_symmetric,
                            const group& g, const bucket_landed& landed) {
        static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "comm::any: float or double payloads");
        held_->allreduce_sum_each(items, cap_bytes, pack_symmetric, g, landed);
    }
    template <class T>
    std::unique_ptr<posted_allreduce<T>> start_allreduce(std::size_t cap_bytes, bool pack_symmetric, const group& g) {
        static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "comm::any: float or double payloads");
        return held_->start_allreduce(cap_bytes, pack_symmetric, g, T{});
    }
    template <class T>
    void broadcast(T* data, std::size_t count, int root, const group& g) {
        static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "comm::any: float or double payloads");
        held_->broadcast(data, count, root, g, false);
    }
    template <class T>
    void broadcast_host(T* data, std::size_t count, int root, const group& g) {
        static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "comm::any: float or double payloads");
        held_->broadcast(data, count, root, g, true);
    }
    void wait() { held_->wait(); }
    std::optional<std::string> agree(const std::optional<std::string>& local_error) { return held_->agree(local_error); }
    std::vector<std::uint64_t> allgather(std::uint64_t value) { return held_->allgather(value); }
    std::string broadcast_text(const std::string& text, int root) { return held_->broadcast_text(text, root); }
    void allreduce_max(std::vector<std::int64_t>& values) { held_->allreduce_max(values); }
    [[nodiscard]] const comm_counters& counters() const { return held_->counters(); }
    void phase(const char* name) noexcept { held_->phase(name); }
    void progress() { held_->progress(); }
    [[nodiscard]] bool reads_device_memory() const { return held_->reads_device_memory(); }
    ///@}

    /// The held policy, when it is a `Policy` (else null).
    template <class Policy>
    [[nodiscard]] Policy* get() noexcept {
        auto* m = dynamic_cast<model<Policy>*>(held_.get());
        return m ? &m->policy : nullptr;
    }

private:
    struct interface {
        virtual ~interface() = default;
        virtual int rank() const = 0;
        virtual int size() const = 0;
        virtual group world() const = 0;
        virtual group split(int color) = 0;
        virtual void allreduce_sum(const std::vector<allreduce_item<float>>&, std::size_t, bool, const group&) = 0;
        virtual void allreduce_sum(const std::vector<allreduce_item<double>>&, std::size_t, bool, const group&) = 0;
        virtual void allreduce_sum_each(const std::vector<allreduce_item<float>>&, std::size_t, bool, const group&,
                                        const bucket_landed&) = 0;
        virtual void allreduce_sum_each(const std::vector<allreduce_item<double>>&, std::size_t, bool, const group&,
                                        const bucket_landed&) = 0;
        // (the last argument picks the scalar type)
        virtual std::unique_ptr<posted_allreduce<float>> start_allreduce(std::size_t, bool, const group&, float) = 0;
        virtual std::unique_ptr<posted_allreduce<double>> start_allreduce(std::size_t, bool, const group&, double) = 0;
        virtual void broadcast(float*, std::size_t, int, const group&, bool host) = 0;
        virtual void broadcast(double*, std::size_t, int, const group&, bool host) = 0;
        virtual void wait() = 0;
        virtual std::optional<std::string> agree(const std::optional<std::string>&) = 0;
        virtual std::vector<std::uint64_t> allgather(std::uint64_t) = 0;
        virtual std::string broadcast_text(const std::string&, int) = 0;
        virtual void allreduce_max(std::vector<std::int64_t>&) = 0;
        virtual const comm_counters& counters() const = 0;
        virtual void phase(const char*) noexcept = 0;
        virtual void progress() = 0;
        virtual bool reads_device_memory() const = 0;
    };

    template <class Policy>
    struct model final : interface {
        using held_group = typename Policy::group;
        explicit model(Policy p) : policy(std::move(p)) {}

        group wrap(held_group g) const {
            const int n = policy.group_size(g);
            return {std::make_shared<const held_group>(std::move(g)), n};
        }
        static const held_group& unwrap(const group& g) { return *static_cast<const held_group*>(g.held.get()); }

        int rank() const override { return policy.rank(); }
        int size() const override { return policy.size(); }
        group world() const override { return wrap(policy.world()); }
        group split(int color) override { return wrap(policy.split(color)); }
        void allreduce_sum(const std::vector<allreduce_item<float>>& items, std::size_t cap, bool symmetric,
                           const group& g) override {
            policy.allreduce_sum(items, cap, symmetric, unwrap(g));
        }
        void allreduce_sum(const std::vector<allreduce_item<double>>& items, std::size_t cap, bool symmetric,
                           const group& g) override {
            policy.allreduce_sum(items, cap, symmetric, unwrap(g));
        }
        void allreduce_sum_each(const std::vector<allreduce_item<float>>& items, std::size_t cap, bool symmetric,
                                const group& g, const bucket_landed& landed) override {
            comm::allreduce_sum_each(policy, items, cap, symmetric, unwrap(g), landed);
        }
        void allreduce_sum_each(const std::vector<allreduce_item<double>>& items, std::size_t cap, bool symmetric,
                                const group& g, const bucket_landed& landed) override {
            comm::allreduce_sum_each(policy, items, cap, symmetric, unwrap(g), landed);
        }
        std::unique_ptr<posted_allreduce<float>> start_allreduce(std::size_t cap, bool symmetric, const group& g,
                                                                 float) override {
            return comm::start_allreduce<float>(policy, cap, symmetric, unwrap(g));
        }
        std::unique_ptr<posted_allreduce<double>> start_allreduce(std::size_t cap, bool symmetric, const group& g,
                                                                  double) override {
            return comm::start_allreduce<double>(policy, cap, symmetric, unwrap(g));
        }
        void broadcast(float* data, std::size_t count, int root, const group& g, bool host) override {
            send(data, count, root, g, host);
        }
        void broadcast(double* data, std::size_t count, int root, const group& g, bool host) override {
            send(data, count, root, g, host);
        }
        template <class T>
        void send(T* data, std::size_t count, int root, const group& g, bool host) {
            if (host) comm::broadcast_host(policy, data, count, root, unwrap(g));
            else policy.broadcast(data, count, root, unwrap(g));
        }
        void wait() override { policy.wait(); }
        std::optional<std::string> agree(const std::optional<std::string>& e) override { return policy.agree(e); }
        std::vector<std::uint64_t> allgather(std::uint64_t v) override { return policy.allgather(v); }
        std::string broadcast_text(const std::string& t, int root) override { return policy.broadcast_text(t, root); }
        void allreduce_max(std::vector<std::int64_t>& v) override { policy.allreduce_max(v); }
        const comm_counters& counters() const override { return policy.counters(); }
        void phase(const char* name) noexcept override { comm::announce_phase(policy, name); }
        void progress() override { comm::progress(policy); }
        bool reads_device_memory() const override {
            if constexpr (requires { policy.reads_device_memory(); }) return policy.reads_device_memory();
            else return false;
        }

        Policy policy;
    };

    std::unique_ptr<interface> held_;
};

}  // namespace kfac::comm
