// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kfac.hpp
/// Umbrella header: the core, the CPU backend, the single-process comm policy, comm::any (any
/// policy behind a virtual interface), the compute methods, the assignment strategies and
/// the plain view adapter. Never includes MPI or CUDA
/// (kfac/comm/mpi.hpp, kfac/backend/cuda.cuh) nor xtensor (kfac/layers/xtensor_layer.hpp).

#include "kfac/assignment/greedy.hpp"
#include "kfac/assignment/strategies.hpp"
#include "kfac/backend/blas_kernels.hpp"
#include "kfac/backend/cpu_eigen.hpp"
#include "kfac/comm/any.hpp"
#include "kfac/comm/serial.hpp"
#include "kfac/compute/ekfac.hpp"
#include "kfac/compute/eigendecomposition.hpp"
#include "kfac/compute/inverse.hpp"
#include "kfac/config.hpp"
#include "kfac/diagnostics.hpp"
#include "kfac/fwd.hpp"
#include "kfac/layers/any_layer.hpp"
#include "kfac/layers/eigen_number_formats.hpp"
#include "kfac/layers/im2col.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/layer_traits.hpp"
#include "kfac/layers/layer_view.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"
#include "kfac/precision.hpp"
#include "kfac/preconditioner.hpp"
