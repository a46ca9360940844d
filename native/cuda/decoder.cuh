// cuda/decoder.cuh: a decoder (pebble_decoder_create's handle) as the decode step's sources share it: its
// model and layers, its scratch's layout, its experts' slots and caches, its streamed layers' slots, when
// its steps run as CUDA graphs; and what each of those sources gives the others: cuda/decoder.cu (the ABI's
// pebble_decoder_*, the checks, the scratch), cuda/decode_step.cu (a step's layers, streamed layers),
// cuda/experts.cu (layers of experts), cuda/graph.cu (graphs). Not part of the ABI.
#pragma once

#include "cuda/common.cuh"

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <vector>

namespace pebble_internal {

constexpr int32_t max_experts = 1 << 12, max_experts_used = 16;

inline uint64_t aligned(uint64_t n) { return (n + 255) / 256 * 256; }

template <typename T> T * at_offset(uint8_t * base, uint64_t offset) { return reinterpret_cast<T *>(base + offset); }

// The entries of the merged expert tensors (experts_stored 2): weight_ids of ffn_gate_exps, ffn_up_exps and
// ffn_down_exps, in the order of an expert's slot.
constexpr int merged_expert_fields[3] = {17, 18, 19};

struct step_scratch {
    uint64_t h16, q, k, v, q_rot, kv_new, scores, parts, o, gate, up, pos, x, logits, bytes;
    uint64_t router, rows, act, y;  // experts: the router's scores, the gathered rows, the gated FFN, its out
};

// When a step is run as a CUDA graph. A step's launches depend on its batch (which sequences, in which
// order) and on whether it makes logits; positions are read from device memory and the hidden states and
// logits pass through the decoder's own buffers, so that a graph captured once replays for every later
// step of the same batch. A batch seen twice running is captured; one that has a graph replays it; any
// other runs directly (its launches enqueued one by one). Up to graph_slots graphs are kept, the least
// recently used dropped first. The host build makes the same decisions and counts them; it has no graphs,
// so it runs every step directly.
constexpr int graph_slots = PEBBLE_DECODER_GRAPHS;

struct step_key {
    int32_t n = 0;
    bool    logits = false;
    int32_t seqs[PEBBLE_DECODER_MAX_BATCH] = {};

    bool operator==(const step_key & o) const {
        return n == o.n && logits == o.logits && std::equal(seqs, seqs + n, o.seqs);
    }
};

enum class step_mode { direct, capture, replay };

struct graph_policy {
    bool     enabled = false;
    bool     seen_once = false;  // last_direct holds the last step run directly
    step_key last_direct;
    struct slot {
        bool     used = false;
        step_key key;
        uint64_t last_use = 0;
#ifndef PEBBLE_HOST_BUILD
        cudaGraphExec_t exec = nullptr;
#endif
    } slots[graph_slots];
    uint64_t clock = 0;
    uint64_t captured = 0, replays = 0, dropped = 0;

    // What to do with a step of this key; *at is the slot to replay or capture into.
    step_mode decide(const step_key & k, int * at);
    // The capture into slot i succeeded: its key replays from now on.
    void keep(int i, const step_key & k);
    void drop(int i);
    // Graphs cannot be made here (a capture or an instantiation failed): every step runs directly.
    void give_up();
};

} // namespace pebble_internal

struct pebble_decoder {
    pebble_step_model model{};
    std::vector<pebble_step_layer> layers;
    std::vector<void *> k, v;          // [layer * n_seq + s]
    pebble_internal::step_scratch at{};
    int64_t widest = 0, max_q = 0, max_kv = 0, max_ff = 0, max_heads = 0, max_rows = 0, max_expert = 0;
    int64_t parts_per_seq = 0; // floats of a sequence's attention parts (attention_args.parts)
    std::vector<float> router_host;    // the router's scores of a step, read back
    std::vector<float> exps_scale_host; // a layer's ffn_down_exps_s (its F32 or F16 bytes), read back with them
    std::vector<float> router_p;       // one token's expert probabilities, and the experts by them (kept, so
    std::vector<int32_t> router_order; // that a step allocates nothing)
    // experts as pebbles (pebble_step_model's expert_policy): slots of one expert each in one buffer; per
    // layer its cache's slots, the expert each holds (-1: none), when it was last used, and how often the
    // step ran each expert of the layer; the staging slots, each free (layer -1) or holding a guess for
    // (layer, expert) not yet run; the guesses of the layer about to run and, while a layer of experts
    // runs, which of its experts the step has still to run.
    struct expert_cache {
        uint64_t part_bytes[3] = {}, nbytes = 0; // an expert's gate, up and down rows; their sum
        std::vector<uint8_t *> slot;
        std::vector<int32_t>   expert;
        std::vector<uint64_t>  used;
        std::vector<uint64_t>  uses;
    };
    struct staged {
        uint8_t * slot = nullptr;
        int32_t   layer = -1, expert = -1;
    };
    std::vector<expert_cache> experts;
    std::vector<staged> staging;
    std::vector<int32_t> guessed;
    std::vector<uint8_t> to_run;
    std::vector<float> guess_score;
    uint8_t * expert_buffer = nullptr;
    uint64_t expert_clock = 0;
    uint8_t * scratch = nullptr;
    pebble_internal::graph_policy graphs;
    // streamed layers (pebble_step_layer.streamed): their order, and per layer where each weight and each
    // sequence's caches lie in its slot (the n-th streamed layer's is slot n % 2)
    std::vector<int32_t> streamed;                 // layer of the n-th streamed layer
    std::vector<int32_t> stream_order;             // per layer: n, or -1 where resident
    std::vector<std::array<uint64_t, PEBBLE_LAYER_WEIGHTS>> weight_bytes; // per layer and field: entry size
    uint8_t * slots[2] = {nullptr, nullptr};         // made here (freed with the decoder) ...
    uint8_t * slots_given[2] = {nullptr, nullptr};   // ... or the caller's
    uint64_t  slot_bytes = 0;
#ifndef PEBBLE_HOST_BUILD
    cudaStream_t copy = nullptr;       // the slots' copies
    cudaEvent_t  slot_ready[2] = {nullptr, nullptr}, slot_free[2] = {nullptr, nullptr}, copied = nullptr;
#endif
#ifndef PEBBLE_HOST_BUILD
    int64_t *    pos_host = nullptr;   // pinned: the positions a step (or its graph) copies to the device
    cudaStream_t own = nullptr;        // where steps run and graphs are captured (never the legacy stream)
    cudaEvent_t  ready = nullptr, done = nullptr;
#endif
    std::mutex lock;                   // one step at a time
    struct pebble_decoder_stats stats{};
};

namespace pebble_internal {

// cuda/decoder.cu
// The last failure's message again, after `where`.
pebble_status with_place(pebble_status st, const char * where);
// Device memory in the cuda library, host memory in the host library (a decoder's own, freed with it).
pebble_status alloc_scratch(uint8_t ** out, uint64_t bytes);
void free_scratch(uint8_t * p);

// cuda/decode_step.cu
// The whole step enqueued on `stream`: every layer, then the output norm and logits where asked.
pebble_status enqueue_step(pebble_decoder & d, int32_t n, const int32_t * seqs, const int64_t * host_pos, float * x,
                           float * logits, cudaStream_t stream);
// A streamed layer as the store holds it, checked; then every streamed layer placed in its slot.
pebble_status describe_streamed(pebble_decoder & d, const char * fn, int32_t i);
pebble_status place_streamed(pebble_decoder & d, const char * fn);
// The fields of pebble_layer_weights by name, in their order (pebble_step_layer.weight_ids).
extern const char * const weight_names[PEBBLE_LAYER_WEIGHTS];

// cuda/experts.cu
// The slots of layers whose experts are pebbles, made; a layer's experts guessed and restored early; the
// routed FFN of a layer of experts.
pebble_status place_experts(pebble_decoder & d, const char * fn);
pebble_status prefetch_experts(pebble_decoder & d, int32_t i, int32_t n, const float * x, cudaStream_t stream);
pebble_status experts_ffn(pebble_decoder & d, int32_t layer, int32_t n, const act_t * h, const float * x, float * out,
                          cudaStream_t stream);

// cuda/graph.cu
#ifndef PEBBLE_HOST_BUILD
// A step on the GPU, directly, captured into a graph or replayed from one (mode).
pebble_status run_on_device(pebble_decoder & d, step_mode mode, int slot, const step_key & key, const int64_t * pos,
                            float * x, float * logits, cudaStream_t caller);
#endif

} // namespace pebble_internal
