// SPDX-License-Identifier: Apache-2.0
// LD_PRELOADed into the test launches that start more MPI ranks than the machine has cores
// (kfac_mpiexec in tests/CMakeLists.txt); never part of the library.
//
// Why: MPICH's ch4:ucx device (Debian 12's MPICH) waits for a message by calling
// ucp_worker_progress in a tight loop. With 3 or 4 ranks on 2 cores, a rank that waits keeps
// its core from the rank it waits for, and every collective costs the scheduler's time slice:
// mpi_tests took 0.21 s at 2 ranks and 5.2 s at 3 on this 2-core machine, 90 % of it spent
// polling. This wrapper calls the real ucp_worker_progress and, after 64 polls in a row that
// found nothing, sleeps 20 µs before returning, so a waiting rank gives its core away. It
// changes when a rank looks for messages, never what any MPI call does or returns: 0.59 s at
// 3 ranks, 0.78 s at 4 (5.2 s and 6.2 s without).
#include <dlfcn.h>

#include <ctime>

extern "C" unsigned ucp_worker_progress(void* worker) {
    using progress_function = unsigned (*)(void*);
    static const auto next = reinterpret_cast<progress_function>(dlsym(RTLD_NEXT, "ucp_worker_progress"));
    thread_local unsigned idle_polls = 0;
    if (next == nullptr) return 0;  // no UCX below this process: nothing to progress
    const unsigned events = next(worker);
    if (events != 0) {
        idle_polls = 0;
    } else if (++idle_polls > 64) {
        timespec pause{0, 20000};
        nanosleep(&pause, nullptr);
    }
    return events;
}
