// Must not compile: a double layer registered with a float backend.
#include <kfac/kfac.hpp>

int main() {
    kfac::KFAC<kfac::backend::cpu_eigen<float>> precond;
    kfac::layer_view<double> layer;
    precond.register_layer("fc1", layer);
}
