// cuda/graph.cu: a decode step captured once as a CUDA graph and replayed wherever its batch repeats:
// when a step is captured, replayed or run directly (graph_policy, whose choices the host build makes and
// counts too, though it runs every step directly), and on the GPU the step's run on the decoder's own
// stream: ordered after the caller's stream, x and the logits through the decoder's fixed buffers (a
// graph names fixed addresses), the capture or the replay, the caller's stream ordered after it.

#include "cuda/decoder.cuh"

#include <cstring>

namespace pebble_internal {

step_mode graph_policy::decide(const step_key & k, int * at) {
    clock++;
    if (!enabled) return step_mode::direct;
    for (int i = 0; i < graph_slots; i++) {
        if (slots[i].used && slots[i].key == k) {
            slots[i].last_use = clock;
            replays++;
            *at = i;
            return step_mode::replay;
        }
    }
    if (seen_once && last_direct == k) {
        int victim = 0;
        for (int i = 0; i < graph_slots; i++) {
            if (!slots[i].used) {
                victim = i;
                break;
            }
            if (slots[i].last_use < slots[victim].last_use) victim = i;
        }
        if (slots[victim].used) drop(victim);
        seen_once = false;
        *at = victim;
        return step_mode::capture;
    }
    last_direct = k;
    seen_once = true;
    return step_mode::direct;
}

void graph_policy::keep(int i, const step_key & k) {
    slots[i].used = true;
    slots[i].key = k;
    slots[i].last_use = clock;
    captured++;
}

void graph_policy::drop(int i) {
#ifndef PEBBLE_HOST_BUILD
    if (slots[i].exec) cudaGraphExecDestroy(slots[i].exec);
    slots[i].exec = nullptr;
#endif
    slots[i].used = false;
    dropped++;
}

void graph_policy::give_up() {
    for (int i = 0; i < graph_slots; i++) {
        if (slots[i].used) drop(i);
    }
    enabled = false;
}

} // namespace pebble_internal

#ifndef PEBBLE_HOST_BUILD
using namespace pebble_internal;

namespace {

pebble_status cuda_failed(cudaError_t err, const char * what) {
    cudaGetLastError();
    return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: %s: %s", what, cudaGetErrorString(err));
}

#    define CUDA_TRY(call, what)                              \
        do {                                                  \
            const cudaError_t err_ = (call);                  \
            if (err_ != cudaSuccess) return cuda_failed(err_, what); \
        } while (0)

// The positions' copy and the step, enqueued on the decoder's stream; captured into the graph of `slot`
// first where mode is capture (a capture that fails turns graphs off for this decoder: the step then runs
// directly).
pebble_status enqueue_or_capture(pebble_decoder & d, step_mode mode, int slot, const step_key & key,
                                 const int64_t * pos) {
    const int32_t n = key.n;
    float * x = at_offset<float>(d.scratch, d.at.x);
    float * logits = key.logits ? at_offset<float>(d.scratch, d.at.logits) : nullptr;
    auto body = [&]() -> pebble_status {
        CUDA_TRY(cudaMemcpyAsync(at_offset<int64_t>(d.scratch, d.at.pos), d.pos_host, sizeof(int64_t) * size_t(n),
                                 cudaMemcpyDefault, d.own), "copying the positions");
        return enqueue_step(d, n, key.seqs, pos, x, logits, d.own);
    };
    if (mode == step_mode::replay) {
        CUDA_TRY(cudaGraphLaunch(d.graphs.slots[slot].exec, d.own), "replaying the step's graph");
        return PEBBLE_OK;
    }
    if (mode == step_mode::capture) {
        cudaGraph_t graph = nullptr;
        if (cudaStreamBeginCapture(d.own, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
            const pebble_status st = body();
            const cudaError_t ended = cudaStreamEndCapture(d.own, &graph);
            if (st != PEBBLE_OK) {
                if (graph) cudaGraphDestroy(graph);
                return st;
            }
            cudaGraphExec_t exec = nullptr;
            if (ended == cudaSuccess && graph && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
                cudaGraphDestroy(graph);
                d.graphs.slots[slot].exec = exec;
                d.graphs.keep(slot, key);
                CUDA_TRY(cudaGraphLaunch(exec, d.own), "launching the step's graph");
                return PEBBLE_OK;
            }
            if (graph) cudaGraphDestroy(graph);
        }
        cudaGetLastError();
        d.graphs.give_up();
    }
    return body();
}

} // namespace

namespace pebble_internal {

// A step on the GPU: ordered after the caller's stream, x in and out of the decoder's own buffer (a graph
// names fixed addresses), the caller's stream ordered after it.
pebble_status run_on_device(pebble_decoder & d, step_mode mode, int slot, const step_key & key, const int64_t * pos,
                            float * x, float * logits, cudaStream_t caller) {
    const int32_t n = key.n;
    const size_t x_bytes = sizeof(float) * size_t(n) * size_t(d.model.n_embd);
    // the per-layer inputs after x go in (Gemma 4's), never out
    const size_t in_bytes = x_bytes + sizeof(float) * size_t(n) * size_t(d.model.n_layer) * size_t(d.model.n_embd_per_layer);
    CUDA_TRY(cudaEventSynchronize(d.done), "waiting for the previous step"); // its graph may still read pos_host
    std::memcpy(d.pos_host, pos, sizeof(int64_t) * size_t(n));
    CUDA_TRY(cudaEventRecord(d.ready, caller), "ordering the step after its stream");
    CUDA_TRY(cudaStreamWaitEvent(d.own, d.ready, 0), "ordering the step after its stream");
    CUDA_TRY(cudaMemcpyAsync(at_offset<float>(d.scratch, d.at.x), x, in_bytes, cudaMemcpyDefault, d.own),
             "copying x in");
    const pebble_status st = enqueue_or_capture(d, mode, slot, key, pos);
    if (st == PEBBLE_OK) {
        CUDA_TRY(cudaMemcpyAsync(x, at_offset<float>(d.scratch, d.at.x), x_bytes, cudaMemcpyDefault, d.own),
                 "copying x out");
        if (logits) {
            CUDA_TRY(cudaMemcpyAsync(logits, at_offset<float>(d.scratch, d.at.logits),
                                     sizeof(float) * size_t(n) * size_t(d.model.n_vocab), cudaMemcpyDefault,
                                     d.own), "copying the logits out");
        }
    }
    CUDA_TRY(cudaEventRecord(d.done, d.own), "ordering the stream after the step");
    CUDA_TRY(cudaStreamWaitEvent(caller, d.done, 0), "ordering the stream after the step");
    return st;
}

} // namespace pebble_internal
#    undef CUDA_TRY
#endif
