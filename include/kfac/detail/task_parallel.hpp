// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file task_parallel.hpp
/// Layer-level task parallelism: independent per-layer work (factor statistics,
/// decompositions, preconditioning) runs as tasks, largest first, on a few threads, each
/// task calling single-threaded BLAS. Threaded BLAS barely helps the many small and
/// skinny calls of a conv net (reference/perf-anchors.md §8), while tasks keep every core
/// busy. When one task dominates, threaded BLAS inside it is the better use of the cores.

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kfac/config.hpp"

namespace kfac::detail {

struct task {
    double cost = 0.0;  ///< relative cost; only the order and the shares matter
    std::function<void()> run;
};

/// A thread count as an environment variable gives it: a positive decimal integer of at most
/// 4096 and nothing else ("2x", "-1", "abc" and "" are not counts); nullopt otherwise.
inline std::optional<int> parse_thread_count(const char* text) {
    if (text == nullptr || *text == '\0') return std::nullopt;
    long long n = 0;
    for (const char* c = text; *c; ++c) {
        if (*c < '0' || *c > '9') return std::nullopt;
        n = n * 10 + (*c - '0');
        if (n > 4096) return std::nullopt;
    }
    if (n < 1) return std::nullopt;
    return static_cast<int>(n);
}

/// Threads to use when options.threads is 0: KFAC_NUM_THREADS, else OPENBLAS_NUM_THREADS,
/// else OMP_NUM_THREADS, else the hardware's; 1 when several ranks share the machine and
/// nothing was set (the ranks already use the cores). KFAC_NUM_THREADS is ours, so a value
/// that is not a count is an error; the other two belong to their libraries, which define
/// their own syntax (OMP_NUM_THREADS=4,2 nests), so only a plain count of theirs is used.
/// @throws kfac::error naming KFAC_NUM_THREADS, its value and the fix.
inline int default_thread_count(int ranks) {
    if (const char* v = std::getenv("KFAC_NUM_THREADS")) {
        if (const auto n = parse_thread_count(v)) return *n;
        throw error(std::string("KFAC_NUM_THREADS='") + v + "' is not a thread count: set it to a whole number "
                    "from 1 to 4096 (e.g. KFAC_NUM_THREADS=2), or unset it to use the cores available");
    }
    for (const char* name : {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"})
        if (const auto n = parse_thread_count(std::getenv(name))) return *n;
    if (ranks > 1) return 1;
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

/// True when the environment names a thread count default_thread_count() takes.
inline bool thread_count_in_environment() {
    if (std::getenv("KFAC_NUM_THREADS")) return true;
    for (const char* name : {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"})
        if (parse_thread_count(std::getenv(name))) return true;
    return false;
}

/// True when running the tasks side by side beats running them one after another with
/// threaded BLAS: more than one task and no task above half of the total work.
inline bool worth_parallel(const std::vector<task>& tasks, int threads) {
    if (threads <= 1 || tasks.size() <= 1) return false;
    double total = 0.0, largest = 0.0;
    for (const auto& t : tasks) total += t.cost, largest = std::max(largest, t.cost);
    return largest <= 0.5 * total;
}

/// Runs every task, largest first, on up to `threads` threads (the caller is one of them).
/// `Scope` is constructed around the parallel run (the backend's single-threaded-BLAS
/// guard). The first exception thrown by a task is rethrown after all tasks finished.
template <class Scope>
void run_tasks(std::vector<task>& tasks, int threads) {
    if (!worth_parallel(tasks, threads)) {
        for (auto& t : tasks) t.run();
        return;
    }
    std::vector<std::size_t> order(tasks.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return tasks[a].cost > tasks[b].cost; });
    std::atomic<std::size_t> next{0};
    std::exception_ptr failure;
    std::mutex failure_mutex;
    auto worker = [&] {
        for (std::size_t i; (i = next.fetch_add(1)) < order.size();) {
            try {
                tasks[order[i]].run();
            } catch (...) {
                const std::lock_guard<std::mutex> lock(failure_mutex);
                if (!failure) failure = std::current_exception();
            }
        }
    };
    {
        [[maybe_unused]] const Scope single_threaded_blas;  // empty without LAPACK
        const std::size_t helpers = std::min<std::size_t>(static_cast<std::size_t>(threads), tasks.size()) - 1;
        std::vector<std::thread> pool;
        pool.reserve(helpers);
        for (std::size_t h = 0; h < helpers; ++h) pool.emplace_back(worker);
        worker();
        for (auto& t : pool) t.join();
    }
    if (failure) std::rethrow_exception(failure);
}

}  // namespace kfac::detail
