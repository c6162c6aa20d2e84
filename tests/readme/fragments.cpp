// The code fragments of the README and the manual, compiled as written: each ```cpp block marked
// `<!-- fragment: NAME -->` in a Markdown file is extracted at configure time into
// fragments/NAME.inc (tests/readme/readme_code_block.cmake), and included here inside a function
// that declares what the fragment uses. One translation unit for all of them, linked with
// kfac_engines (kfac_engines_mpi where MPI is found). docs.code_blocks fails when a marked
// fragment is not included here; a compile error points at the Markdown file's line.
//
// The test docs.fragments runs those that need no other process, in order (the checkpoint
// fragments share their file, run/kfac.safetensors, in the test's working directory).

#include <cstdio>
#include <string>
#include <vector>

#include <kfac/kfac.hpp>
#if KFAC_DOCS_HAVE_MPI
#include <kfac/comm/mpi.hpp>
#endif

namespace {

/// A Linear layer with bias over plain buffers, filled with fixed values.
struct dense_buffers {
    std::vector<float> x, dy, dw, db;
    kfac::layer_view<float> view;
    dense_buffers(std::int64_t in, std::int64_t out, std::int64_t batch)
        : x(batch * in), dy(batch * out), dw(out * in), db(out) {
        for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.01f * static_cast<float>(i % 17) - 0.05f;
        for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = 0.02f * static_cast<float>(i % 7) - 0.06f;
        view.description = kfac::linear_description(in, out, true);
        view.input = kfac::tensor_view<const float>(x.data(), {batch, in});
        view.grad_output = kfac::tensor_view<const float>(dy.data(), {batch, out});
        view.grad_weight = kfac::tensor_view<float>(dw.data(), {out, in});
        view.grad_bias = kfac::tensor_view<float>(db.data(), {out});
    }
    /// Fresh gradients before a step (step() overwrites them).
    void refill() {
        for (std::size_t i = 0; i < dw.size(); ++i) dw[i] = 0.001f * static_cast<float>(i % 11);
        for (std::size_t i = 0; i < db.size(); ++i) db[i] = 0.001f * static_cast<float>(i % 5);
    }
};

}  // namespace

// docs/k-fac.md, "Policy axes": a preconditioner over MPI (compiled, not run: it needs MPI_Init).
#if KFAC_DOCS_HAVE_MPI
namespace fragment_mpi_policy {
[[maybe_unused]] void run(const kfac::options& opts) {
#include "fragments/mpi_policy.inc"
}
}  // namespace fragment_mpi_policy
#endif

// docs/curvature-modes.md: the options the flagship trains with.
namespace fragment_curvature_modes {
kfac::options run() {
#include "fragments/curvature_modes.inc"
    return opts;
}
}  // namespace fragment_curvature_modes

// docs/checkpoints.md, "Save and resume".
namespace fragment_checkpoint_resume {
void run(kfac::KFAC<>& precond, const kfac::options& opts, kfac::layer_view<float>& fc1,
         kfac::layer_view<float>& fc2) {
#include "fragments/checkpoint_resume.inc"
}
}  // namespace fragment_checkpoint_resume

// docs/checkpoints.md, "Load checks everything before it changes anything": load_options.
namespace fragment_checkpoint_load_options {
void run(kfac::options opts, kfac::layer_view<float>& fc1, kfac::layer_view<float>& fc2) {
#include "fragments/checkpoint_load_options.inc"
}
}  // namespace fragment_checkpoint_load_options

// docs/performance.md, "Where a step's time goes".
namespace fragment_step_times {
void run(kfac::KFAC<>& precond) {
#include "fragments/step_times.inc"
}
}  // namespace fragment_step_times

// docs/troubleshooting.md, "Non-finite values".
namespace fragment_non_finite {
void run(kfac::KFAC<>& precond) {
#include "fragments/non_finite.inc"
}
}  // namespace fragment_non_finite

// docs/development.md, "BLAS": the diagnostic channel redirected, then silenced.
namespace fragment_ekfac_method {
/// The EKFAC preconditioner of docs/k-fac.md steps a Linear layer: its gradient changes.
bool run(const kfac::options& opts, kfac::layer_view<float>& fc) {
#include "fragments/ekfac_method.inc"
    precond.register_layer("fc", fc);
    const std::vector<float> before(fc.grad_weight.data, fc.grad_weight.data + fc.grad_weight.size());
    precond.step();
    return std::vector<float>(fc.grad_weight.data, fc.grad_weight.data + fc.grad_weight.size()) != before;
}
}  // namespace fragment_ekfac_method

namespace fragment_diagnostic_handler {
struct logger {
    std::vector<std::string> lines;
    void warn(const std::string& line) { lines.push_back(line); }
};
void run() {
    logger my_log;
#include "fragments/diagnostic_handler.inc"
    kfac::set_diagnostic_handler(kfac::write_diagnostic_to_stderr);  // the default again
}
}  // namespace fragment_diagnostic_handler

int main() {
    int ran = 0;
    const auto done = [&ran](const char* name) {
        std::printf("fragment %s: ran\n", name);
        ++ran;
    };

    kfac::options opts = fragment_curvature_modes::run();
    done("curvature_modes");

    dense_buffers l1(6, 4, 8), l2(4, 3, 8);
    kfac::KFAC<> precond(opts);
    precond.register_layer("fc1", l1.view);
    precond.register_layer("fc2", l2.view);
    l1.refill();
    l2.refill();
    fragment_step_times::run(precond);
    done("step_times");
    l1.refill();
    l2.refill();
    fragment_non_finite::run(precond);
    done("non_finite");

    fragment_checkpoint_resume::run(precond, opts, l1.view, l2.view);
    done("checkpoint_resume");
    fragment_checkpoint_load_options::run(opts, l1.view, l2.view);
    done("checkpoint_load_options");

    fragment_diagnostic_handler::run();
    done("diagnostic_handler");

    dense_buffers l3(5, 3, 8);
    l3.refill();
    if (!fragment_ekfac_method::run(kfac::options{}, l3.view)) {
        std::printf("fragment ekfac_method: the step left the gradient unchanged\n");
        return 1;
    }
    done("ekfac_method");

    std::printf("%d fragments ran\n", ran);
    return 0;
}
