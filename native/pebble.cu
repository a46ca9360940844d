// pebble.cu: what every call of pebble.h ends with: a status, the per-thread message of the last failure
// (pebble_last_error: every source reports through pebble_internal::fail), the text of each status
// (pebble_strerror), and which library this is (pebble_backend). The store is store.cu and
// store_entries.cu; the kernels and the decode step are cuda/'s, and the host library's CPU kernels cpu/'s.

#include "pebble_internal.h"

#include <cstdarg>
#include <cstdio>
#include <string>

// ---------------------------------------------------------------------------------------------------
// errors (declared in pebble_internal.h, with CUDA_CHECK and TRY, for the library's other sources)

namespace pebble_internal {

// Per thread, so that threads sharing a handle each read the message of their own failed call.
thread_local std::string t_last_error;

pebble_status fail(pebble_status status, const char * fmt, ...) {
    char buf[512];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    t_last_error = buf;
    return status;
}

} // namespace pebble_internal

// ---------------------------------------------------------------------------------------------------
// errors and the library

extern "C" const char * pebble_strerror(int32_t status) {
    switch (status) {
        case PEBBLE_OK:                   return "ok";
        case PEBBLE_ERR_INVALID_ARGUMENT: return "invalid argument";
        case PEBBLE_ERR_UNKNOWN_ENTRY:    return "unknown entry";
        case PEBBLE_ERR_SIZE_MISMATCH:    return "size mismatch";
        case PEBBLE_ERR_LAYER_RANGE:      return "layer out of range";
        case PEBBLE_ERR_TOO_LARGE:        return "entry larger than the device limit";
        case PEBBLE_ERR_HOST_OOM:         return "out of pinned host memory";
        case PEBBLE_ERR_DEVICE_OOM:       return "out of device memory";
        case PEBBLE_ERR_CUDA:             return "CUDA error";
        case PEBBLE_ERR_CLOSED:           return "store is closed";
        case PEBBLE_ERR_STRATEGY:         return "invalid strategy";
    }
    return "unknown status";
}

extern "C" const char * pebble_last_error(void) {
    return pebble_internal::t_last_error.c_str();
}

extern "C" const char * pebble_backend(void) {
#ifdef PEBBLE_HOST_BUILD
    return "host";
#else
    return "cuda";
#endif
}
