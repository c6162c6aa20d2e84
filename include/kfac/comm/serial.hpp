// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file serial.hpp
/// The single-process communication policy.
///
/// **CommPolicy.** A communication policy is a type with
/// ```
///   int rank() const;  int size() const;
///   // Replace each matrix by its average over all ranks (one bucketed pass).
///   template <class Matrix> void allreduce_average(const std::vector<Matrix*>& factors);
///   // Counters of collectives and bytes sent, per kind (see comm_counters).
///   const comm_counters& counters() const;
/// ```
/// The preconditioner calls the collectives on every rank in the same order; a policy must
/// never block on a rank that does not call it.

#include <cstdint>
#include <vector>

namespace kfac {

/// What a communication policy did, by kind of collective.
struct comm_counters {
    std::int64_t allreduce_calls = 0;
    std::int64_t allreduce_bytes = 0;
    std::int64_t broadcast_calls = 0;
    std::int64_t broadcast_bytes = 0;
};

namespace comm {

/// One process: every collective is the identity and nothing is sent.
class serial {
public:
    [[nodiscard]] int rank() const noexcept { return 0; }
    [[nodiscard]] int size() const noexcept { return 1; }
    template <class Matrix>
    void allreduce_average(const std::vector<Matrix*>&) noexcept {}
    [[nodiscard]] const comm_counters& counters() const noexcept { return counters_; }

private:
    comm_counters counters_{};
};

}  // namespace comm
}  // namespace kfac
