// cuda/common.cu: what cuda/common.cuh declares for every source under cuda/, defined once: the GPU decode
// path's run-time switches (read once from the environment), and on the GPU the checks that a pointer a
// kernel is given is one it can read and that a launch went out.

#include "cuda/common.cuh"
#include "cuda/quants.cuh"

#include <cstdlib>
#include <cstring>

namespace pebble_internal {

const cuda_switches & switches() {
    static const cuda_switches read = [] {
        auto is = [](const char * name, const char * value) {
            const char * env = std::getenv(name);
            return env && std::strcmp(env, value) == 0;
        };
        cuda_switches s = {!is("PEBBLING_CUDA_MATVEC", "float"), !is("PEBBLING_CUDA_PERSIST", "0"),
                           !is("PEBBLING_CUDA_STACK", "0"), max_launch_group, !is("PEBBLING_CUDA_SPLIT", "0"),
                           !is("PEBBLING_CUDA_DENSE", "0")};
        const char * group = std::getenv("PEBBLING_CUDA_GROUP");
        if (group && group[0] >= '1' && group[0] < '1' + max_launch_group && group[1] == '\0') s.group = group[0] - '0';
        return s;
    }();
    return read;
}

#ifndef PEBBLE_HOST_BUILD
pebble_status check_device_pointer(const void * ptr, const char * what, const char * fn) {
    cudaPointerAttributes attr = {};
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
        cudaGetLastError();
        attr.type = cudaMemoryTypeUnregistered;
    }
    if (attr.type == cudaMemoryTypeUnregistered) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s (%p) is pageable host memory; kernels need device, "
                    "managed or pinned host memory", fn, what, ptr);
    }
    return PEBBLE_OK;
}

// A kernel reading pageable host memory would fault, and a fault ends the whole CUDA context.
pebble_status check_reachable(const void * ptr, const char * what, const char * fn, int32_t ggml_type) {
    cudaPointerAttributes attr = {};
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
        cudaGetLastError(); // clear the error the runtime keeps for the next call
        attr.type = cudaMemoryTypeUnregistered;
    }
    if (attr.type == cudaMemoryTypeUnregistered) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s: %s (%p) is pageable host memory; the cuda library's "
                    "kernels need device, managed or pinned host memory", fn, type_name(ggml_type), what, ptr);
    }
    return PEBBLE_OK;
}

pebble_status check_launch(const char * fn, int32_t ggml_type) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        return fail(PEBBLE_ERR_CUDA, "%s: %s: the kernel could not be launched: %s", fn, type_name(ggml_type),
                    cudaGetErrorString(err));
    }
    return PEBBLE_OK;
}
#endif

} // namespace pebble_internal
