// Must not compile: a layer whose elements are integers, which kfac does not read.
#include <kfac/kfac.hpp>

int main() {
    kfac::KFAC<kfac::backend::cpu_eigen<float>> precond;
    kfac::layer_view<int> layer;
    precond.register_layer("fc1", layer);
}
