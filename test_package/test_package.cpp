// SPDX-License-Identifier: Apache-2.0
// One K-FAC step on a tiny Linear layer through the packaged headers: the preconditioned
// gradient must differ from the plain one and be finite.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include <kfac/kfac.hpp>
#if KFAC_TEST_PACKAGE_MPI
#include <mpi.h>

#include <kfac/comm/mpi.hpp>
#endif

namespace {

int run() {
    constexpr std::int64_t in = 3, out = 2, batch = 4;
    std::vector<float> x(batch * in), dy(batch * out), dw(out * in), db(out);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.9f * static_cast<float>(i));
    for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = 0.1f * std::sin(0.5f * static_cast<float>(i) + 0.3f);
    for (std::int64_t o = 0; o < out; ++o) {
        for (std::int64_t n = 0; n < batch; ++n) {
            const float g = dy[static_cast<std::size_t>(n * out + o)];
            db[static_cast<std::size_t>(o)] += g;
            for (std::int64_t i = 0; i < in; ++i)
                dw[static_cast<std::size_t>(o * in + i)] += g * x[static_cast<std::size_t>(n * in + i)];
        }
    }
    kfac::layer_view<float> layer;
    layer.description = kfac::linear_description(in, out, /*bias=*/true);
    layer.input = {x.data(), {batch, in}};
    layer.grad_output = {dy.data(), {batch, out}};
    layer.grad_weight = {dw.data(), {out, in}};
    layer.grad_bias = {db.data(), {out}};

    kfac::options opts;
    opts.lr = 0.1;
#if KFAC_TEST_PACKAGE_MPI
    kfac::KFAC<kfac::backend::cpu_eigen<float>, kfac::comm::mpi> precond(opts, kfac::comm::mpi(MPI_COMM_WORLD));
    const char* comm = "mpi";
#else
    kfac::KFAC<> precond(opts);
    const char* comm = "serial";
#endif
    precond.register_layer("fc", layer);
    const std::vector<float> dw0 = dw;
    precond.step();

    bool finite = true;
    double change = 0.0;
    for (std::size_t i = 0; i < dw.size(); ++i) {
        finite = finite && std::isfinite(dw[i]);
        change += std::fabs(static_cast<double>(dw[i]) - dw0[i]);
    }
    const bool ok = finite && change > 0.0 && precond.steps() == 1;
    std::printf("test_package: comm=%s steps=%lld |change|=%g finite=%s: %s\n", comm,
                static_cast<long long>(precond.steps()), change, finite ? "yes" : "no",
                ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
#if KFAC_TEST_PACKAGE_MPI
    MPI_Init(&argc, &argv);
#else
    (void)argc;
    (void)argv;
#endif
    int rc = 1;
    try {
        rc = run();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "test_package: %s\n", e.what());
    }
#if KFAC_TEST_PACKAGE_MPI
    MPI_Finalize();
#endif
    return rc;
}
