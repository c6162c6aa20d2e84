// Must not compile: a ComputeMethod tag with no detail::compute_impl.
#include <kfac/kfac.hpp>

struct my_method {};

int main() {
    kfac::KFAC<kfac::backend::cpu_eigen<float>, kfac::comm::serial, my_method> precond;
    precond.step();
}
