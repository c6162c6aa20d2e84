// Must not compile: registering a type that has no kfac::layer_traits specialisation.
#include <kfac/kfac.hpp>

struct my_dense_layer {
    float* weights = nullptr;
};

int main() {
    kfac::KFAC<> precond;
    my_dense_layer layer;
    precond.register_layer("fc1", layer);
}
