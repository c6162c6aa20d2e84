// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file fwd.hpp
/// Forward declarations of the policies and the preconditioner, with the default policies.

namespace kfac {

namespace backend {
template <class Scalar>
struct cpu_eigen;
}  // namespace backend

namespace comm {
class serial;
}  // namespace comm

namespace compute {
struct eigendecomposition;
struct inverse;
}  // namespace compute

namespace assignment {
struct compute_balanced;
struct memory_balanced;
struct round_robin;
}  // namespace assignment

/// The K-FAC preconditioner, one policy per axis (see kfac/preconditioner.hpp).
template <class Backend = backend::cpu_eigen<float>, class CommPolicy = comm::serial,
          class ComputeMethod = compute::eigendecomposition,
          class AssignmentStrategy = assignment::compute_balanced>
class preconditioner;

/// The name users write: `kfac::KFAC<> precond(options);`
template <class Backend = backend::cpu_eigen<float>, class CommPolicy = comm::serial,
          class ComputeMethod = compute::eigendecomposition,
          class AssignmentStrategy = assignment::compute_balanced>
using KFAC = preconditioner<Backend, CommPolicy, ComputeMethod, AssignmentStrategy>;

}  // namespace kfac
