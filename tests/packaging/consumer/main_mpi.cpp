// SPDX-License-Identifier: Apache-2.0
// Consumes the installed kfac::mpi: one comm::mpi preconditioner step on every rank; fails
// when any rank fails.

#include <mpi.h>

#include <cstdio>
#include <exception>

#include <kfac/comm/mpi.hpp>
#include <kfac/kfac.hpp>

#include "tiny_step.hpp"

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int failed = 1;
    try {
        consumer::tiny_linear layer;
        kfac::KFAC<kfac::backend::cpu_eigen<float>, kfac::comm::mpi> precond(
            consumer::tiny_options(), kfac::comm::mpi(MPI_COMM_WORLD));
        failed = consumer::step_and_check(precond, layer, "kfac_consumer_mpi");
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kfac_consumer_mpi (rank %d): %s\n", rank, e.what());
    }
    int any_failed = 0;
    MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0) std::printf("kfac_consumer_mpi: world=%d %s\n", size, any_failed ? "FAIL" : "PASS");
    MPI_Finalize();
    return any_failed;
}
