// store.h: the pebble store's state as its two sources share it: an entry and its copies, a store and its
// device tier's LRU list, the table of leased and borrowed buffers, and the functions that move entries
// between the tiers and answer the strategy (store_tiers.cu) for the store's calls (store.cu). Not part of
// the ABI.
#pragma once

#include "pebble_internal.h"

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace store_internal {

// ---------------------------------------------------------------------------------------------------
// the store

using entry_key = uint64_t;

inline entry_key make_key(int32_t layer, int32_t tensor_id) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(layer)) << 32) | static_cast<uint32_t>(tensor_id);
}

struct entry {
    uint64_t                    nbytes   = 0;
    pebble_tensor_desc          desc     = {};
    void *                      dev      = nullptr; // device copy
    void *                      host     = nullptr; // pinned host copy
    cudaEvent_t                 last_use = nullptr; // recorded after every copy that touches the entry
    bool                        pending  = false;   // a copy enqueued since the last pebble_synchronize
    bool                        kept     = false;   // pebble_keep_on_host: the strategy leaves it in the host tier
    std::list<entry_key>::iterator lru;                 // position in the device LRU list, valid iff dev
};

struct store {
    std::mutex  mu;
    uint64_t    limit    = 0;
    int32_t     n_layers = 0;
    int32_t     strategy = 0;
    int64_t     arg      = 0;
    int32_t     device   = 0;
    cudaStream_t evict_stream = nullptr;

    std::unordered_map<entry_key, entry> entries;
    std::list<entry_key>                 lru; // device copies, least recently used first
    struct pebble_stats               stats = {};

    ~store();
};

// ---------------------------------------------------------------------------------------------------
// device leases (pebble_device_acquire): a view computing in place from an entry may outlive the
// entry's device copy, or the store. Rather than free a leased buffer under the view, the store
// detaches it and the release of its last lease frees it. The table is global, keyed by pointer and
// guarded by its own mutex, because a release may come after its store was freed. Lock order: a
// store's mutex, then g_leases_mu, never the reverse (a release takes only g_leases_mu).

struct lease {
    uint64_t count    = 0;
    bool     detached = false; // the store let go of the buffer: the last release frees it
    bool     host     = false; // a host copy (pebble_host_acquire): freed as pinned host memory
    int32_t  device   = 0;     // the device the buffer lives on, for that free
};

extern std::mutex                        g_leases_mu;
extern std::unordered_map<void *, lease> g_leases;

// Buffers entries use without owning them (pebble_save_borrowed), each with its count of users: freeing
// one forgets it instead. Guarded by g_leases_mu, since a lease's release may meet one.
extern std::unordered_map<void *, uint64_t> g_borrowed;

// ---------------------------------------------------------------------------------------------------
// strategies and tiers (store_tiers.cu)

// Whether the strategy keeps `layer` resident (pyplugin/store/strategy.py is the same).
bool is_resident(int32_t strategy, int64_t arg, int32_t n_layers, int32_t layer);
// PEBBLE_OK for a strategy and argument a store of n_layers can take, else a failure naming `fn`.
pebble_status check_strategy(int32_t strategy, int64_t arg, int32_t n_layers, const char * fn);
// Whether the entry's device and host copies are one buffer (the host library's; see store_tiers.cu).
bool aliased(const entry & e);
// Waits for the entry's copies, then frees its buffers. Used where failing is not an option.
void release_all(entry & e);
// The entry becomes the most recently used of the device tier.
void touch(store & s, entry & e);
bool is_device_pointer(const void * ptr);
void count_copy(store & s, bool src_dev, bool dst_dev, uint64_t n);
// Enqueues one copy touching entry e on `stream`, after every earlier copy of e.
pebble_status copy_async(entry & e, void * dst, const void * src, uint64_t n, cudaStream_t stream);
// What a device copy of n bytes takes of the device (PEBBLE_DEVICE_PAGE_BYTES): the device tier's unit.
uint64_t device_footprint(uint64_t n);
void note_host(store & s, int64_t delta);
pebble_status drop_device_copy(store & s, entry & e);
pebble_status drop_host_copy(store & s, entry & e);
pebble_status alloc_host_copy(store & s, entry & e, int32_t layer, int32_t tensor_id);
// Moves the device copy of `victim` to the host tier; nothing is dropped.
pebble_status evict(store & s, entry_key victim);
// Evicts least-recently-used device copies until `need` more bytes fit the limit. Entries for which
// `keep(key)` holds are never chosen; *fits tells whether room was made.
template <typename Keep>
pebble_status make_room(store & s, uint64_t need, Keep keep, bool * fits) {
    auto it = s.lru.begin();
    while (s.stats.device_bytes + need > s.limit && it != s.lru.end()) {
        const entry_key victim = *it++;
        if (!keep(victim)) TRY(evict(s, victim));
    }
    *fits = s.stats.device_bytes + need <= s.limit;
    return PEBBLE_OK;
}
pebble_status alloc_device_copy(store & s, entry & e, entry_key key);
// Before the store writes into an entry: its borrowed buffer replaced by a copy of its own.
pebble_status own_bytes(store & s, entry & e, int32_t layer, int32_t tensor_id);
// A device copy of the entry's host copy (room already made), on `stream`.
pebble_status device_copy_from_host(store & s, entry & e, entry_key key, cudaStream_t stream);

} // namespace store_internal
