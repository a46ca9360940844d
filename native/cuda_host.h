// cuda_host.h: the few CUDA runtime calls the library's .cu sources use, mapped onto host memory.
//
// With it the host C++ compiler builds the .cu sources into libpebble_host.so, so that CI (no GPU) runs
// the store's and the kernels' own code, under sanitizers too. "Device" memory is plain heap memory,
// copies are synchronous memcpy, streams and events are inert tokens.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

typedef enum cudaError {
    cudaSuccess               = 0,
    cudaErrorInvalidValue     = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidDevice    = 101,
} cudaError_t;

typedef struct host_stream * cudaStream_t;
typedef struct host_event  * cudaEvent_t;

enum cudaMemcpyKind   { cudaMemcpyDefault = 4 };
enum cudaMemoryType   { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2,
                        cudaMemoryTypeManaged = 3 };
struct cudaPointerAttributes { enum cudaMemoryType type; int device; };

#define cudaStreamNonBlocking     0x01
#define cudaEventDisableTiming    0x02
#define cudaHostAllocPortable     0x01

static inline const char * cudaGetErrorString(cudaError_t err) {
    switch (err) {
        case cudaSuccess:               return "no error";
        case cudaErrorInvalidValue:     return "invalid argument";
        case cudaErrorMemoryAllocation: return "out of memory";
        case cudaErrorInvalidDevice:    return "invalid device ordinal";
    }
    return "unknown error";
}

// One host "device": ordinal 0.
static inline cudaError_t cudaSetDevice(int device) {
    return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}
static inline cudaError_t cudaGetDevice(int * device) { *device = 0; return cudaSuccess; }

static inline cudaError_t cudaMalloc(void ** ptr, size_t size) {
    *ptr = std::malloc(size);
    return *ptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
static inline cudaError_t cudaFree(void * ptr) { std::free(ptr); return cudaSuccess; }

static inline cudaError_t cudaHostAlloc(void ** ptr, size_t size, unsigned int) {
    *ptr = std::malloc(size);
    return *ptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
static inline cudaError_t cudaFreeHost(void * ptr) { std::free(ptr); return cudaSuccess; }

static inline cudaError_t cudaMemcpyAsync(void * dst, const void * src, size_t n, cudaMemcpyKind, cudaStream_t) {
    std::memmove(dst, src, n);
    return cudaSuccess;
}

// Caller memory is always host memory here; the store tracks the tier of its own buffers itself.
static inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes * attr, const void *) {
    attr->type   = cudaMemoryTypeUnregistered;
    attr->device = -1;
    return cudaSuccess;
}
static inline cudaError_t cudaGetLastError(void) { return cudaSuccess; }

static inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t * s, unsigned int) {
    *s = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(1));
    return cudaSuccess;
}
static inline cudaError_t cudaStreamDestroy(cudaStream_t)                      { return cudaSuccess; }
static inline cudaError_t cudaStreamSynchronize(cudaStream_t)                  { return cudaSuccess; }
static inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }

static inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t * e, unsigned int) {
    *e = reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(1));
    return cudaSuccess;
}
static inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
static inline cudaError_t cudaEventSynchronize(cudaEvent_t)          { return cudaSuccess; }
static inline cudaError_t cudaEventDestroy(cudaEvent_t)              { return cudaSuccess; }
