// store_tiers.cu: how the pebble store's entries live in its two tiers, a device tier bounded by a byte
// limit and a pinned host tier: which layers the strategy keeps resident, the device and host buffers an
// entry's copies are (leased buffers detached rather than freed under a view, borrowed ones given back),
// the copies between them on streams (each ordered by the entry's event), eviction of the least recently
// used device copies to the host tier, and the byte counts of each tier. The calls of pebble.h that use
// them are store.cu's.
//
// Built by nvcc for the GPU, or by the host C++ compiler with -DPEBBLE_HOST_BUILD, where cuda_host.h
// maps the runtime onto host memory.

#include "store.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>

using pebble_internal::fail;
using namespace store_internal;

namespace {

// ---------------------------------------------------------------------------------------------------
// strategies (mirrored by pyplugin/strategy.py; a test holds the two together)

int64_t resident_count(int32_t strategy, int64_t arg, int32_t n_layers) {
    switch (strategy) {
        case PEBBLE_STRATEGY_NONE:     return n_layers;
        case PEBBLE_STRATEGY_SQRT: {
            int64_t k = 0;
            while (k * k < n_layers) ++k; // ceil(sqrt(L)), exact in integers
            return k;
        }
        case PEBBLE_STRATEGY_ADAPTIVE: return arg;
        case PEBBLE_STRATEGY_MINIMAL:  return 0;
        case PEBBLE_STRATEGY_EVERY:    return (n_layers + arg - 1) / arg;
    }
    return -1;
}

// ---------------------------------------------------------------------------------------------------
// device leases and borrowed buffers (store.h)

// Forgets one user of `ptr` if it is borrowed; whether it was (the caller then must not free it).
bool give_back_borrowed(void * ptr) { // g_leases_mu held
    auto it = g_borrowed.find(ptr);
    if (it == g_borrowed.end()) return false;
    if (--it->second == 0) g_borrowed.erase(it);
    return true;
}

bool borrowed(const void * ptr) {
    std::lock_guard<std::mutex> lock(g_leases_mu);
    return g_borrowed.count(const_cast<void *>(ptr)) != 0;
}

// Every device buffer the store gives up goes through here, so that none is freed under a lease.
cudaError_t free_device_buffer(void * ptr) {
    {
        std::lock_guard<std::mutex> lock(g_leases_mu);
        if (give_back_borrowed(ptr)) return cudaSuccess; // the caller's, whoever leases it
        auto it = g_leases.find(ptr);
        if (it != g_leases.end()) {
            it->second.detached = true;
            return cudaSuccess;
        }
    }
    // No lease can appear now: acquiring one needs the store's mutex, which the caller holds (or, in
    // the destructor, no other call can reach the store).
    return cudaFree(ptr);
}

bool leased(void * ptr) {
    std::lock_guard<std::mutex> lock(g_leases_mu);
    return g_leases.count(ptr) != 0;
}

// The same for host copies, which pebble_host_acquire leases.
cudaError_t free_host_buffer(void * ptr) {
    {
        std::lock_guard<std::mutex> lock(g_leases_mu);
        if (give_back_borrowed(ptr)) return cudaSuccess;
        auto it = g_leases.find(ptr);
        if (it != g_leases.end()) {
            it->second.detached = true;
            return cudaSuccess;
        }
    }
    return cudaFreeHost(ptr);
}

// ---------------------------------------------------------------------------------------------------
// the tiers

void note_device(store & s, int64_t delta) {
    s.stats.device_bytes += delta;
    s.stats.device_peak_bytes = std::max(s.stats.device_peak_bytes, s.stats.device_bytes);
}

} // namespace

namespace store_internal {

bool is_resident(int32_t strategy, int64_t arg, int32_t n_layers, int32_t layer) {
    if (strategy == PEBBLE_STRATEGY_EVERY) return layer % arg == 0;
    const int64_t k = resident_count(strategy, arg, n_layers);
    return (layer * k) % n_layers < k;
}

pebble_status check_strategy(int32_t strategy, int64_t arg, int32_t n_layers, const char * fn) {
    if (strategy < PEBBLE_STRATEGY_NONE || strategy > PEBBLE_STRATEGY_EVERY) {
        return fail(PEBBLE_ERR_STRATEGY, "%s: unknown strategy %d; valid: 0 none, 1 sqrt, 2 adaptive, "
                    "3 minimal, 4 every", fn, strategy);
    }
    if (strategy == PEBBLE_STRATEGY_ADAPTIVE && (arg < 0 || arg > n_layers)) {
        return fail(PEBBLE_ERR_STRATEGY, "%s: adaptive keeps 0..%d layers resident, got %" PRId64, fn,
                    n_layers, arg);
    }
    if (strategy == PEBBLE_STRATEGY_EVERY && arg < 1) {
        return fail(PEBBLE_ERR_STRATEGY, "%s: every:N needs N >= 1, got %" PRId64, fn, arg);
    }
    return PEBBLE_OK;
}

// In the host library both tiers are host memory: a device copy made from the host copy (a prefetch,
// a rebalance) is that very buffer, not a second one. The entry then holds one buffer in two roles,
// and each tier's byte count still counts it (the accounting is of tiers, not of memory). Dropping one
// role leaves the buffer to the other; only a device copy dropped under a lease is split off, so that
// the leased view is detached as pebble.h says and the host copy lives on in a buffer of its own.
bool aliased(const entry & e) {
#ifdef PEBBLE_HOST_BUILD
    return e.dev && e.dev == e.host;
#else
    (void)e;
    return false;
#endif
}

// Waits for the entry's copies, then frees its buffers. Used where failing is not an option.
void release_all(entry & e) {
    if (e.last_use) cudaEventSynchronize(e.last_use);
    if (aliased(e)) e.host = nullptr; // one buffer: freed once, as the device copy (leases respected)
    if (e.dev)  free_device_buffer(e.dev);
    if (e.host) free_host_buffer(e.host);
    if (e.last_use) cudaEventDestroy(e.last_use);
    e.dev = e.host = nullptr;
    e.last_use = nullptr;
}

store::~store() {
    cudaSetDevice(device);
    for (auto & kv : entries) release_all(kv.second);
    if (evict_stream) cudaStreamDestroy(evict_stream);
}

void touch(store & s, entry & e) {
    if (e.dev) s.lru.splice(s.lru.end(), s.lru, e.lru);
}

bool is_device_pointer(const void * ptr) {
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
        cudaGetLastError(); // plain host memory on old runtimes: clear the sticky-free error
        return false;
    }
    return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

void count_copy(store & s, bool src_dev, bool dst_dev, uint64_t n) {
    if (!src_dev && dst_dev) s.stats.bytes_h2d += n;
    if (src_dev && !dst_dev) s.stats.bytes_d2h += n;
}

// Enqueues one copy touching entry e on `stream`, after every earlier copy of e.
pebble_status copy_async(entry & e, void * dst, const void * src, uint64_t n, cudaStream_t stream) {
    CUDA_CHECK(cudaStreamWaitEvent(stream, e.last_use, 0));
    CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream));
    CUDA_CHECK(cudaEventRecord(e.last_use, stream));
    e.pending = true;
    return PEBBLE_OK;
}

// What a device copy of n bytes takes of the device (PEBBLE_DEVICE_PAGE_BYTES): the device tier's unit.
uint64_t device_footprint(uint64_t n) {
#ifdef PEBBLE_HOST_BUILD
    return n;
#else
    constexpr uint64_t page = PEBBLE_DEVICE_PAGE_BYTES;
    return n < page / 2 ? n : (n + page - 1) / page * page;
#endif
}

void note_host(store & s, int64_t delta) {
    s.stats.host_bytes += delta;
    s.stats.host_peak_bytes = std::max(s.stats.host_peak_bytes, s.stats.host_bytes);
}

pebble_status drop_device_copy(store & s, entry & e) {
    CUDA_CHECK(cudaEventSynchronize(e.last_use));
    if (aliased(e) && !leased(e.dev)) {
        e.dev = nullptr; // the buffer stays, as the host copy
    } else if (aliased(e)) { // a view leases it: the view keeps this buffer, the host copy moves
        void * fresh = nullptr;
        if (cudaHostAlloc(&fresh, e.nbytes, cudaHostAllocPortable) != cudaSuccess) {
            cudaGetLastError();
            return fail(PEBBLE_ERR_HOST_OOM, "could not allocate %" PRIu64 " bytes of host memory to detach a "
                        "leased copy from its entry (host tier holds %" PRIu64 " bytes)", e.nbytes, s.stats.host_bytes);
        }
        std::memcpy(fresh, e.host, e.nbytes);
        e.host = fresh;
    }
    if (e.dev) CUDA_CHECK(free_device_buffer(e.dev));
    e.dev = nullptr;
    s.lru.erase(e.lru);
    note_device(s, -static_cast<int64_t>(device_footprint(e.nbytes)));
    return PEBBLE_OK;
}

pebble_status drop_host_copy(store & s, entry & e) {
    CUDA_CHECK(cudaEventSynchronize(e.last_use));
    if (!aliased(e)) CUDA_CHECK(free_host_buffer(e.host)); // else the buffer stays, as the device copy
    e.host = nullptr;
    note_host(s, -static_cast<int64_t>(e.nbytes));
    return PEBBLE_OK;
}

pebble_status alloc_host_copy(store & s, entry & e, int32_t layer, int32_t tensor_id) {
    if (cudaHostAlloc(&e.host, e.nbytes, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();
        e.host = nullptr;
        return fail(PEBBLE_ERR_HOST_OOM, "layer %d tensor %d: could not allocate %" PRIu64
                    " bytes of pinned host memory (host tier holds %" PRIu64 " bytes)",
                    layer, tensor_id, e.nbytes, s.stats.host_bytes);
    }
    note_host(s, static_cast<int64_t>(e.nbytes));
    return PEBBLE_OK;
}

// Moves the device copy of `victim` to the host tier; nothing is dropped.
pebble_status evict(store & s, entry_key victim) {
    entry & e = s.entries.at(victim);
    if (!e.host && borrowed(e.dev)) { // the host library's: the borrowed bytes are the host copy too
        e.host = e.dev;
        note_host(s, static_cast<int64_t>(e.nbytes));
    } else if (!e.host) {
        TRY(alloc_host_copy(s, e, static_cast<int32_t>(victim >> 32), static_cast<int32_t>(victim)));
        TRY(copy_async(e, e.host, e.dev, e.nbytes, s.evict_stream));
        s.stats.bytes_d2h += e.nbytes;
    }
    TRY(drop_device_copy(s, e));
    s.stats.evictions++;
    return PEBBLE_OK;
}

pebble_status alloc_device_copy(store & s, entry & e, entry_key key) {
    CUDA_CHECK(cudaMalloc(&e.dev, e.nbytes));
    e.lru = s.lru.insert(s.lru.end(), key);
    note_device(s, static_cast<int64_t>(device_footprint(e.nbytes)));
    return PEBBLE_OK;
}

// Before the store writes into an entry: a buffer of it that is borrowed (pebble_save_borrowed) is
// replaced by a copy of its own, in both of its roles, so that the caller's bytes are never written.
pebble_status own_bytes(store & s, entry & e, int32_t layer, int32_t tensor_id) {
#ifdef PEBBLE_HOST_BUILD
    void * lent = e.dev && borrowed(e.dev) ? e.dev : e.host && borrowed(e.host) ? e.host : nullptr;
    if (!lent) return PEBBLE_OK;
    void * fresh = nullptr;
    if (cudaHostAlloc(&fresh, e.nbytes, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_HOST_OOM, "layer %d tensor %d: could not allocate %" PRIu64 " bytes for a copy of "
                    "borrowed bytes about to be written (host tier holds %" PRIu64 " bytes)", layer, tensor_id,
                    e.nbytes, s.stats.host_bytes);
    }
    std::memcpy(fresh, lent, e.nbytes);
    if (e.dev == lent) e.dev = fresh;
    if (e.host == lent) e.host = fresh;
    CUDA_CHECK(free_host_buffer(lent)); // gives it back: the caller's, never freed here
#else
    (void)s, (void)e, (void)layer, (void)tensor_id; // the cuda library borrows nothing
#endif
    return PEBBLE_OK;
}

// A device copy of the entry's host copy (room already made): copied on `stream` on a GPU; in the host
// library the host copy's own buffer (see aliased). Counted as a transfer either way, so that the
// stats mean the same on every backend.
pebble_status device_copy_from_host(store & s, entry & e, entry_key key, cudaStream_t stream) {
#ifdef PEBBLE_HOST_BUILD
    (void)stream;
    e.dev = e.host;
    e.lru = s.lru.insert(s.lru.end(), key);
    note_device(s, static_cast<int64_t>(device_footprint(e.nbytes)));
#else
    TRY(alloc_device_copy(s, e, key));
    TRY(copy_async(e, e.dev, e.host, e.nbytes, stream));
#endif
    s.stats.bytes_h2d += e.nbytes;
    s.stats.prefetches++;
    return PEBBLE_OK;
}

} // namespace store_internal
