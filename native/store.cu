// store.cu: the pebble store, the calls of pebble.h on it. Entries live in a device tier bounded by a byte
// limit and a pinned host tier (store_tiers.cu). An entry may hold a device copy, a host copy, or both
// (after a prefetch, or an eviction of an entry that already had a host copy); every write updates each
// copy, so the copies never disagree. Every copy touching an entry waits on, then records, the entry's
// event, which orders copies of one entry across streams and tells when a buffer may be freed. Here: the
// handles, a store's lifetime and strategy, saving an entry (copied into the tier its strategy names, or
// in the host library borrowed from the caller's memory), restoring, reading and writing it on a caller's
// stream, erasing it, keeping it on the host, prefetching a layer, lending a copy in place (a device
// pointer, or a lease that outlives the entry's copy until its last release), and the stats.
//
// Built by nvcc for the GPU, or by the host C++ compiler with -DPEBBLE_HOST_BUILD, where cuda_host.h
// maps the runtime onto host memory.

#include "store.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

using pebble_internal::fail;
using namespace store_internal;

namespace store_internal {

// The lease and borrowed-buffer tables (store.h) are defined here, before the handle table, not beside the
// tier code that uses them: one file's statics are destroyed in the reverse order of their definitions,
// and a store the handle table still holds at exit frees its entries through them (a borrowed buffer not
// found there would be freed as the store's own: a process ended with a store open crashed at exit).
std::mutex                           g_leases_mu;
std::unordered_map<void *, lease>    g_leases;
std::unordered_map<void *, uint64_t> g_borrowed;

} // namespace store_internal

namespace {

// ---------------------------------------------------------------------------------------------------
// handles: ids, never reused, so that a freed handle is detected rather than dereferenced

std::mutex                                         g_handles_mu;
std::unordered_map<uintptr_t, std::shared_ptr<store>> g_handles;
uintptr_t                                          g_next_handle = 1;

std::shared_ptr<store> find_store(pebble_store_t handle) {
    std::lock_guard<std::mutex> lock(g_handles_mu);
    auto it = g_handles.find(reinterpret_cast<uintptr_t>(handle));
    return it == g_handles.end() ? nullptr : it->second;
}

#define OPEN_STORE(handle, s)                                                                      \
    std::shared_ptr<store> s##_ref = find_store(handle);                                           \
    if (!s##_ref) return fail(PEBBLE_ERR_CLOSED, "%s: the store handle is closed or invalid", __func__); \
    store & s = *s##_ref;                                                                          \
    std::lock_guard<std::mutex> s##_lock(s.mu);                                                    \
    CUDA_CHECK(cudaSetDevice(s.device))

pebble_status check_layer(const store & s, int32_t layer, const char * fn) {
    if (layer < 0 || layer >= s.n_layers) {
        return fail(PEBBLE_ERR_LAYER_RANGE, "%s: layer %d is out of range: the store has %d layers (0..%d)",
                    fn, layer, s.n_layers, s.n_layers - 1);
    }
    return PEBBLE_OK;
}

pebble_status find_entry(store & s, int32_t layer, int32_t tensor_id, const char * fn, entry ** out) {
    TRY(check_layer(s, layer, fn));
    if (tensor_id < 0) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: tensor id %d is negative", fn, tensor_id);
    auto it = s.entries.find(make_key(layer, tensor_id));
    if (it == s.entries.end()) {
        return fail(PEBBLE_ERR_UNKNOWN_ENTRY, "%s: no entry saved for layer %d tensor %d", fn, layer, tensor_id);
    }
    *out = &it->second;
    return PEBBLE_OK;
}

pebble_status check_range(const entry & e, int32_t layer, int32_t tensor_id, uint64_t offset, uint64_t nbytes,
                          const char * fn) {
    if (nbytes == 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d tensor %d: a copy needs at least one byte", fn, layer,
                    tensor_id);
    }
    if (offset > e.nbytes || nbytes > e.nbytes - offset) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d tensor %d holds %" PRIu64 " bytes; bytes [%" PRIu64
                    ", %" PRIu64 ") are not a non-empty range inside it", fn, layer, tensor_id, e.nbytes,
                    offset, offset + nbytes);
    }
    return PEBBLE_OK;
}

} // namespace

// ---------------------------------------------------------------------------------------------------
// lifetime

extern "C" pebble_status pebble_init(uint64_t device_limit, int32_t n_layers, int32_t strategy,
                                     int64_t strategy_arg, int32_t device, pebble_store_t * out) {
    if (!out) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_init: out is NULL");
    *out = nullptr;
    if (n_layers < 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_init: n_layers must be at least 1, got %d", n_layers);
    }
    TRY(check_strategy(strategy, strategy_arg, n_layers, __func__));
    if (device < 0) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_init: device %d is negative", device);

    CUDA_CHECK(cudaSetDevice(device));
    auto s = std::make_shared<store>();
    s->limit    = device_limit;
    s->n_layers = n_layers;
    s->strategy = strategy;
    s->arg      = strategy_arg;
    s->device   = device;
    s->stats.device_limit_bytes = device_limit;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s->evict_stream, cudaStreamNonBlocking));

    std::lock_guard<std::mutex> lock(g_handles_mu);
    const uintptr_t id = g_next_handle++;
    g_handles.emplace(id, std::move(s));
    *out = reinterpret_cast<pebble_store_t>(id);
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_set_strategy(pebble_store_t handle, uint64_t device_limit, int32_t strategy,
                                             int64_t strategy_arg) {
    OPEN_STORE(handle, s);
    TRY(check_strategy(strategy, strategy_arg, s.n_layers, __func__));
    s.limit    = s.stats.device_limit_bytes = device_limit;
    s.strategy = strategy;
    s.arg      = strategy_arg;

    std::vector<entry_key> keys;
    for (const auto & kv : s.entries) keys.push_back(kv.first);
    std::sort(keys.begin(), keys.end()); // ascending layer, then tensor id
    auto resident = [&](entry_key k) {
        return !s.entries.at(k).kept && is_resident(s.strategy, s.arg, s.n_layers, static_cast<int32_t>(k >> 32));
    };
    for (entry_key key : keys) {
        if (!resident(key) && s.entries.at(key).dev) TRY(evict(s, key));
    }
    bool fits = false;
    TRY(make_room(s, 0, [](entry_key) { return false; }, &fits));
    for (entry_key key : keys) {
        entry & e = s.entries.at(key);
        if (!resident(key) || e.dev || s.stats.device_bytes + device_footprint(e.nbytes) > s.limit) continue;
        TRY(device_copy_from_host(s, e, key, s.evict_stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(s.evict_stream));
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_free(pebble_store_t handle) {
    if (!handle) return PEBBLE_OK;
    std::shared_ptr<store> s;
    {
        std::lock_guard<std::mutex> lock(g_handles_mu);
        auto it = g_handles.find(reinterpret_cast<uintptr_t>(handle));
        if (it == g_handles.end()) return fail(PEBBLE_ERR_CLOSED, "pebble_free: the store handle is closed or invalid");
        s = std::move(it->second);
        g_handles.erase(it);
    }
    // The store is destroyed when the last call still using it returns.
    return PEBBLE_OK;
}

// ---------------------------------------------------------------------------------------------------
// entries

namespace {

// A desc's shape describes the bytes saved: no dimension is negative; a type with kernels has rows of whole
// blocks (ne[0]) and exactly its elements' bytes; untyped bytes a whole number of bytes per element. (A type
// without kernels is taken as described: its block size is not this library's to know.)
pebble_status check_desc_bytes(const char * fn, int32_t layer, int32_t tensor_id, uint64_t nbytes,
                               const pebble_tensor_desc & desc) {
    char shape[4 * 24 + 8] = "[";
    for (int32_t d = 0; d < desc.n_dims; d++) {
        const size_t used = std::strlen(shape);
        std::snprintf(shape + used, sizeof shape - used, "%s%" PRId64, d ? ", " : "", desc.ne[d]);
    }
    std::strncat(shape, "]", sizeof shape - std::strlen(shape) - 1);
    uint64_t elements = 1;
    bool overflow = false;
    for (int32_t d = 0; d < desc.n_dims; d++) {
        if (desc.ne[d] < 0) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d tensor %d: shape %s has a negative dimension; each "
                        "must be at least 0", fn, layer, tensor_id, shape);
        }
        const uint64_t n = uint64_t(desc.ne[d]);
        overflow = overflow || (n != 0 && elements > UINT64_MAX / n);
        elements *= n;
    }
    int64_t block_elements = 1, block_bytes = 0;
    if (desc.ggml_type == PEBBLE_TYPE_BYTES) {
        if (overflow || elements == 0 || nbytes % elements != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d tensor %d: %" PRIu64 " bytes are not a whole number of "
                        "bytes for each element of shape %s", fn, layer, tensor_id, nbytes, shape);
        }
    } else if (pebble_internal::type_block(desc.ggml_type, &block_elements, &block_bytes)) {
        const char * type = pebble_internal::ggml_type_name(desc.ggml_type);
        if (desc.ne[0] % block_elements != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d tensor %d: %s shape %s: the first dimension must be a "
                        "multiple of the type's %" PRId64 "-element blocks", fn, layer, tensor_id, type, shape,
                        block_elements);
        }
        const uint64_t blocks = elements / uint64_t(block_elements);
        overflow = overflow || blocks > UINT64_MAX / uint64_t(block_bytes);
        if (overflow || blocks * uint64_t(block_bytes) != nbytes) {
            char need[32] = "more than 2^64";
            if (!overflow) std::snprintf(need, sizeof need, "%" PRIu64, blocks * uint64_t(block_bytes));
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d tensor %d holds %" PRIu64 " bytes; %s shape %s needs "
                        "%s", fn, layer, tensor_id, nbytes, type, shape, need);
        }
    }
    return PEBBLE_OK;
}

// What pebble_save and pebble_save_borrowed both refuse: a layer out of range, a negative tensor id, no
// source or no bytes, a desc of no dimensions, of a type that is no GGUF type or of a shape other than the bytes'.
pebble_status check_save(const store & s, const char * fn, int32_t layer, int32_t tensor_id, const void * src,
                         uint64_t nbytes, const pebble_tensor_desc * desc) {
    TRY(check_layer(s, layer, fn));
    if (tensor_id < 0 || !src || nbytes == 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d tensor %d: needs tensor id >= 0, a source and at least "
                    "one byte (got %" PRIu64 " bytes%s)", fn, layer, tensor_id, nbytes, src ? "" : ", no source");
    }
    if (desc && (desc->n_dims < 1 || desc->n_dims > PEBBLE_MAX_DIMS)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d tensor %d: n_dims %d is not in 1..%d", fn, layer,
                    tensor_id, desc->n_dims, PEBBLE_MAX_DIMS);
    }
    if (desc && (desc->ggml_type < PEBBLE_TYPE_BYTES || desc->ggml_type >= PEBBLE_TYPE_COUNT)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d tensor %d: GGUF type %d is not -1 (bytes) or a GGUF "
                    "type id 0..%d", fn, layer, tensor_id, desc->ggml_type, PEBBLE_TYPE_COUNT - 1);
    }
    return desc ? check_desc_bytes(fn, layer, tensor_id, nbytes, *desc) : PEBBLE_OK;
}

} // namespace

extern "C" pebble_status pebble_save(pebble_store_t handle, int32_t layer, int32_t tensor_id, const void * src,
                                     uint64_t nbytes, const pebble_tensor_desc * desc, int32_t tier, void * stream) {
    OPEN_STORE(handle, s);
    TRY(check_save(s, __func__, layer, tensor_id, src, nbytes, desc));
    if (tier < PEBBLE_TIER_AUTO || tier > PEBBLE_TIER_HOST) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_save: tier %d is not 0 auto, 1 device or 2 host", tier);
    }
    const entry_key key = make_key(layer, tensor_id);
    auto found = s.entries.find(key);
    const bool kept = found != s.entries.end() && found->second.kept;
    const bool to_device = tier == PEBBLE_TIER_DEVICE ||
                           (tier == PEBBLE_TIER_AUTO && !kept && is_resident(s.strategy, s.arg, s.n_layers, layer));
    if (to_device && device_footprint(nbytes) > s.limit) {
        return fail(PEBBLE_ERR_TOO_LARGE, "pebble_save: layer %d tensor %d: %" PRIu64 " bytes (%" PRIu64 " on the "
                    "device) cannot fit a device tier limited to %" PRIu64 " bytes", layer, tensor_id, nbytes,
                    device_footprint(nbytes), s.limit);
    }

    if (found != s.entries.end() && found->second.nbytes == nbytes) TRY(own_bytes(s, found->second, layer, tensor_id));
    if (found != s.entries.end() && found->second.nbytes != nbytes) {
        // A different size replaces the entry outright.
        if (found->second.dev)  TRY(drop_device_copy(s, found->second));
        if (found->second.host) TRY(drop_host_copy(s, found->second));
    }
    const bool created = found == s.entries.end();
    entry & e = s.entries[key];
    if (created) {
        e.nbytes = nbytes;
        if (cudaEventCreateWithFlags(&e.last_use, cudaEventDisableTiming) != cudaSuccess) {
            cudaGetLastError();
            s.entries.erase(key);
            return fail(PEBBLE_ERR_CUDA, "pebble_save: could not create an event for layer %d tensor %d", layer, tensor_id);
        }
    }
    e.nbytes = nbytes;
    // From here on a failure leaves the entry without copies; remove it so the store stays consistent.
    auto abandon = [&](pebble_status st) {
        if (!e.dev && !e.host) {
            release_all(e);
            s.entries.erase(key);
        }
        return st;
    };

    const bool src_dev = is_device_pointer(src);
    cudaStream_t cs = static_cast<cudaStream_t>(stream);
    pebble_status st = PEBBLE_OK;
    if (to_device) {
        if (!e.dev) {
            bool fits = false;
            st = make_room(s, device_footprint(nbytes), [&](entry_key k) { return k == key; }, &fits);
            if (st == PEBBLE_OK && !fits) st = fail(PEBBLE_ERR_DEVICE_OOM, "pebble_save: no room for layer %d tensor %d", layer, tensor_id);
            if (st == PEBBLE_OK) st = alloc_device_copy(s, e, key);
            if (st != PEBBLE_OK) return abandon(st);
        }
        TRY(copy_async(e, e.dev, src, nbytes, cs));
        count_copy(s, src_dev, true, nbytes);
        if (e.host) TRY(drop_host_copy(s, e));
        touch(s, e);
    } else {
        if (aliased(e)) TRY(drop_device_copy(s, e)); // a leased view of it is detached before the bytes change
        if (!e.host && (st = alloc_host_copy(s, e, layer, tensor_id)) != PEBBLE_OK) return abandon(st);
        TRY(copy_async(e, e.host, src, nbytes, cs));
        count_copy(s, src_dev, false, nbytes);
        if (e.dev) TRY(drop_device_copy(s, e));
    }
    if (desc) {
        e.desc = *desc;
    } else {
        e.desc = pebble_tensor_desc{PEBBLE_TYPE_BYTES, 1, {static_cast<int64_t>(nbytes), 0, 0, 0}};
    }
    s.stats.entries = s.entries.size();
    s.stats.saves++;
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_save_borrowed(pebble_store_t handle, int32_t layer, int32_t tensor_id, const void * src,
                                              uint64_t nbytes, const pebble_tensor_desc * desc, int32_t * borrowed_out) {
#ifdef PEBBLE_HOST_BUILD
    {
        OPEN_STORE(handle, s);
        TRY(check_save(s, __func__, layer, tensor_id, src, nbytes, desc));
        const entry_key key = make_key(layer, tensor_id);
        auto found = s.entries.find(key);
        if (found == s.entries.end()) {
            entry fresh;
            if (cudaEventCreateWithFlags(&fresh.last_use, cudaEventDisableTiming) != cudaSuccess) {
                cudaGetLastError();
                return fail(PEBBLE_ERR_CUDA, "pebble_save_borrowed: could not create an event for layer %d tensor %d",
                            layer, tensor_id);
            }
            try {
                found = s.entries.emplace(key, fresh).first;
            } catch (const std::bad_alloc &) {
                cudaEventDestroy(fresh.last_use);
                return fail(PEBBLE_ERR_HOST_OOM, "pebble_save_borrowed: layer %d tensor %d: no memory for the entry",
                            layer, tensor_id);
            }
        }
        entry & e = found->second;
        if (e.dev)  TRY(drop_device_copy(s, e));  // the borrowed bytes replace whatever it held
        if (e.host) TRY(drop_host_copy(s, e));
        try {
            std::lock_guard<std::mutex> lock(g_leases_mu);
            g_borrowed[const_cast<void *>(src)]++;
        } catch (const std::bad_alloc &) {
            release_all(e);
            s.entries.erase(key);
            return fail(PEBBLE_ERR_HOST_OOM, "pebble_save_borrowed: layer %d tensor %d: no memory to note the "
                        "borrowed bytes", layer, tensor_id);
        }
        e.nbytes = nbytes;
        e.host = const_cast<void *>(src);
        note_host(s, static_cast<int64_t>(nbytes));
        e.desc = desc ? *desc : pebble_tensor_desc{PEBBLE_TYPE_BYTES, 1, {static_cast<int64_t>(nbytes), 0, 0, 0}};
        s.stats.entries = s.entries.size();
        s.stats.saves++;
    }
    if (borrowed_out) *borrowed_out = 1;
    return PEBBLE_OK;
#else
    TRY(pebble_save(handle, layer, tensor_id, src, nbytes, desc, PEBBLE_TIER_HOST, nullptr));
    if (borrowed_out) *borrowed_out = 0;
    return pebble_synchronize(handle); // the caller may let go of src once this returns
#endif
}

namespace {

pebble_status read_entry(store & s, int32_t layer, int32_t tensor_id, uint64_t offset, void * dst, uint64_t nbytes,
                         void * stream, bool whole, const char * fn) {
    entry * e = nullptr;
    TRY(find_entry(s, layer, tensor_id, fn, &e));
    if (!dst) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d tensor %d: destination is NULL", fn, layer, tensor_id);
    if (whole && nbytes != e->nbytes && nbytes != 0) { // zero bytes: check_range's invalid argument
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d tensor %d holds %" PRIu64 " bytes, the destination "
                    "has %" PRIu64, fn, layer, tensor_id, e->nbytes, nbytes);
    }
    TRY(check_range(*e, layer, tensor_id, offset, nbytes, fn));
    const bool from_dev = e->dev != nullptr;
    const char * src = static_cast<const char *>(from_dev ? e->dev : e->host) + offset;
    TRY(copy_async(*e, dst, src, nbytes, static_cast<cudaStream_t>(stream)));
    count_copy(s, from_dev, is_device_pointer(dst), nbytes);
    s.stats.restores++;
    s.stats.hits += from_dev;
    s.stats.bytes_restored += nbytes;
    touch(s, *e);
    return PEBBLE_OK;
}

} // namespace

extern "C" pebble_status pebble_restore(pebble_store_t handle, int32_t layer, int32_t tensor_id, void * dst,
                                        uint64_t nbytes, void * stream) {
    OPEN_STORE(handle, s);
    return read_entry(s, layer, tensor_id, 0, dst, nbytes, stream, true, __func__);
}

extern "C" pebble_status pebble_read(pebble_store_t handle, int32_t layer, int32_t tensor_id, uint64_t offset,
                                     void * dst, uint64_t nbytes, void * stream) {
    OPEN_STORE(handle, s);
    return read_entry(s, layer, tensor_id, offset, dst, nbytes, stream, false, __func__);
}

extern "C" pebble_status pebble_write(pebble_store_t handle, int32_t layer, int32_t tensor_id, uint64_t offset,
                                      const void * src, uint64_t nbytes, void * stream) {
    OPEN_STORE(handle, s);
    entry * e = nullptr;
    TRY(find_entry(s, layer, tensor_id, __func__, &e));
    if (!src) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_write: layer %d tensor %d: source is NULL", layer, tensor_id);
    TRY(check_range(*e, layer, tensor_id, offset, nbytes, __func__));
    TRY(own_bytes(s, *e, layer, tensor_id));
    const bool src_dev = is_device_pointer(src);
    cudaStream_t cs = static_cast<cudaStream_t>(stream);
    if (e->dev) {
        TRY(copy_async(*e, static_cast<char *>(e->dev) + offset, src, nbytes, cs));
        count_copy(s, src_dev, true, nbytes);
    }
    if (e->host) {
        if (!aliased(*e)) TRY(copy_async(*e, static_cast<char *>(e->host) + offset, src, nbytes, cs));
        count_copy(s, src_dev, false, nbytes);
    }
    touch(s, *e);
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_erase(pebble_store_t handle, int32_t layer, int32_t tensor_id) {
    OPEN_STORE(handle, s);
    entry * e = nullptr;
    TRY(find_entry(s, layer, tensor_id, __func__, &e));
    if (e->dev)  TRY(drop_device_copy(s, *e));
    if (e->host) TRY(drop_host_copy(s, *e));
    release_all(*e);
    s.entries.erase(make_key(layer, tensor_id));
    s.stats.entries = s.entries.size();
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_keep_on_host(pebble_store_t handle, int32_t layer, int32_t tensor_id, int32_t keep) {
    OPEN_STORE(handle, s);
    if (keep != 0 && keep != 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_keep_on_host: layer %d tensor %d: keep %d is not 0 or 1", layer,
                    tensor_id, keep);
    }
    entry * e = nullptr;
    TRY(find_entry(s, layer, tensor_id, __func__, &e));
    e->kept = keep == 1;
    if (e->kept && e->dev) {
        TRY(evict(s, make_key(layer, tensor_id)));
        CUDA_CHECK(cudaStreamSynchronize(s.evict_stream));
    }
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_prefetch(pebble_store_t handle, int32_t layer, void * stream) {
    OPEN_STORE(handle, s);
    TRY(check_layer(s, layer, __func__));
    std::vector<entry_key> keys;
    for (const auto & kv : s.entries) {
        if (static_cast<int32_t>(kv.first >> 32) == layer && !kv.second.dev && !kv.second.kept) keys.push_back(kv.first);
    }
    std::sort(keys.begin(), keys.end()); // ascending tensor id: the order every backend uses
    auto same_layer = [layer](entry_key k) { return static_cast<int32_t>(k >> 32) == layer; };
    uint64_t layer_device_bytes = 0; // this layer's device copies, which prefetch never evicts
    for (const auto & kv : s.entries) {
        if (same_layer(kv.first) && kv.second.dev) layer_device_bytes += device_footprint(kv.second.nbytes);
    }
    for (entry_key key : keys) {
        entry & e = s.entries.at(key);
        const uint64_t need = device_footprint(e.nbytes);
        if (layer_device_bytes + need > s.limit) continue; // could not fit even after evicting the rest
        bool fits = false;
        TRY(make_room(s, need, same_layer, &fits));
        if (!fits) continue;
        TRY(device_copy_from_host(s, e, key, static_cast<cudaStream_t>(stream)));
        layer_device_bytes += need;
    }
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_entry_info(pebble_store_t handle, int32_t layer, int32_t tensor_id,
                                           struct pebble_entry_info * out) {
    OPEN_STORE(handle, s);
    if (!out) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_entry_info: out is NULL");
    entry * e = nullptr;
    TRY(find_entry(s, layer, tensor_id, __func__, &e));
    out->nbytes    = e->nbytes;
    out->desc      = e->desc;
    out->on_device = e->dev != nullptr;
    out->on_host   = e->host != nullptr;
    return PEBBLE_OK;
}

namespace {

pebble_status find_device_copy(store & s, int32_t layer, int32_t tensor_id, void ** out, const char * fn,
                               entry ** found) {
    if (!out) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    TRY(find_entry(s, layer, tensor_id, fn, found));
    if (!(*found)->dev) {
        return fail(PEBBLE_ERR_UNKNOWN_ENTRY, "%s: layer %d tensor %d has no device copy (it is in the host "
                    "tier)", fn, layer, tensor_id);
    }
    return PEBBLE_OK;
}

} // namespace

extern "C" pebble_status pebble_device_pointer(pebble_store_t handle, int32_t layer, int32_t tensor_id, void ** out) {
    OPEN_STORE(handle, s);
    entry * e = nullptr;
    TRY(find_device_copy(s, layer, tensor_id, out, __func__, &e));
    *out = e->dev;
    touch(s, *e);
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_device_acquire(pebble_store_t handle, int32_t layer, int32_t tensor_id, void ** out,
                                               uint64_t * nbytes) {
    OPEN_STORE(handle, s);
    entry * e = nullptr;
    TRY(find_device_copy(s, layer, tensor_id, out, __func__, &e));
    try {
        std::lock_guard<std::mutex> lock(g_leases_mu);
        lease & l = g_leases[e->dev];
        l.count++;
        l.device = s.device;
    } catch (const std::bad_alloc &) {
        return fail(PEBBLE_ERR_HOST_OOM, "pebble_device_acquire: layer %d tensor %d: no memory for the lease",
                    layer, tensor_id);
    }
    *out = e->dev;
    if (nbytes) *nbytes = e->nbytes;
    touch(s, *e);
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_host_acquire(pebble_store_t handle, int32_t layer, int32_t tensor_id, void ** out,
                                             uint64_t * nbytes) {
    OPEN_STORE(handle, s);
    if (!out) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_host_acquire: out is NULL");
    entry * e = nullptr;
    TRY(find_entry(s, layer, tensor_id, __func__, &e));
    if (!e->host) {
        return fail(PEBBLE_ERR_UNKNOWN_ENTRY, "pebble_host_acquire: layer %d tensor %d has no host copy (it is "
                    "in the device tier only)", layer, tensor_id);
    }
    // Copies into it may be in flight on a stream: the lease is for reading what the entry holds.
    CUDA_CHECK(cudaEventSynchronize(e->last_use));
    try {
        std::lock_guard<std::mutex> lock(g_leases_mu);
        lease & l = g_leases[e->host];
        l.count++;
        l.host = !aliased(*e);
        l.device = s.device;
    } catch (const std::bad_alloc &) {
        return fail(PEBBLE_ERR_HOST_OOM, "pebble_host_acquire: layer %d tensor %d: no memory for the lease",
                    layer, tensor_id);
    }
    *out = e->host;
    if (nbytes) *nbytes = e->nbytes;
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_device_release(void * ptr) {
    if (!ptr) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_device_release: ptr is NULL");
    lease last;
    {
        std::lock_guard<std::mutex> lock(g_leases_mu);
        auto it = g_leases.find(ptr);
        if (it == g_leases.end()) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_device_release: %p holds no lease (never acquired, or "
                        "already released as many times as acquired)", ptr);
        }
        if (--it->second.count > 0) return PEBBLE_OK;
        last = it->second;
        g_leases.erase(it);
    }
    if (!last.detached) return PEBBLE_OK; // still an entry's copy: the store frees it in its time
    // The buffer's own device, then the caller's back: a release may come from any thread.
    int current = 0;
    const bool restore = cudaGetDevice(&current) == cudaSuccess;
    if (cudaSetDevice(last.device) != cudaSuccess) cudaGetLastError(); // cudaFree may still find it
    const cudaError_t err = last.host ? cudaFreeHost(ptr) : cudaFree(ptr);
    if (restore) cudaSetDevice(current);
    if (err != cudaSuccess) {
        return fail(PEBBLE_ERR_CUDA, "pebble_device_release: cudaFree(%p) of a detached buffer on device %d "
                    "failed: %s", ptr, last.device, cudaGetErrorString(err));
    }
    return PEBBLE_OK;
}

// ---------------------------------------------------------------------------------------------------
// strategy, stats, errors

extern "C" pebble_status pebble_should_checkpoint(pebble_store_t handle, int32_t layer, int32_t * out) {
    OPEN_STORE(handle, s);
    if (!out) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_should_checkpoint: out is NULL");
    TRY(check_layer(s, layer, __func__));
    *out = is_resident(s.strategy, s.arg, s.n_layers, layer) ? 1 : 0;
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_stats(pebble_store_t handle, struct pebble_stats * out) {
    OPEN_STORE(handle, s);
    if (!out) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_stats: out is NULL");
    *out = s.stats;
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_stats_reset(pebble_store_t handle) {
    OPEN_STORE(handle, s);
    struct pebble_stats fresh = {};
    fresh.device_limit_bytes = s.limit;
    fresh.device_bytes       = fresh.device_peak_bytes = s.stats.device_bytes;
    fresh.host_bytes         = fresh.host_peak_bytes   = s.stats.host_bytes;
    fresh.entries            = s.entries.size();
    s.stats = fresh;
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_synchronize(pebble_store_t handle) {
    OPEN_STORE(handle, s);
    // Only entries with copies since the last call: a caller that synchronizes after each of many
    // calls (the Python binding does, when no stream is given) then waits on one event, not all.
    for (auto & kv : s.entries) {
        entry & e = kv.second;
        if (!e.pending) continue;
        CUDA_CHECK(cudaEventSynchronize(e.last_use));
        e.pending = false;
    }
    CUDA_CHECK(cudaStreamSynchronize(s.evict_stream));
    return PEBBLE_OK;
}
