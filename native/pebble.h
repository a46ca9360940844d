// pebble.h: the C ABI of the pebble store.
//
// The store holds each transformer layer's state (weights, KV cache) as typed byte entries across two
// tiers: a device tier bounded by a byte limit, and a pinned host tier. A strategy, fixed at init,
// decides which layers are checkpoints (kept resident on the device); the rest are streamed by the
// caller through its own working buffers with pebble_restore.
//
// Every call returns an enum pebble_status; none aborts or exits. On error, pebble_last_error()
// returns a message for the calling thread that names the call, the layer and the sizes involved.
// A handle may be used from several threads at once; a freed handle is detected, never dereferenced.
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#    define PEBBLE_API __declspec(dllexport)
#else
#    define PEBBLE_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------------------------------
// status codes

enum pebble_status {
    PEBBLE_OK                   =   0,
    PEBBLE_ERR_INVALID_ARGUMENT =  -1, // a NULL pointer, zero size, negative id, unknown tier or type
    PEBBLE_ERR_UNKNOWN_ENTRY    =  -2, // no entry saved under (layer, tensor_id)
    PEBBLE_ERR_SIZE_MISMATCH    =  -3, // byte count or range does not match the entry
    PEBBLE_ERR_LAYER_RANGE      =  -4, // layer index outside [0, n_layers)
    PEBBLE_ERR_TOO_LARGE        =  -5, // entry bound for the device tier is larger than the whole limit
    PEBBLE_ERR_HOST_OOM         =  -6, // pinned host memory could not be allocated
    PEBBLE_ERR_DEVICE_OOM       =  -7, // device memory could not be allocated within the limit
    PEBBLE_ERR_CUDA             =  -8, // a CUDA runtime call failed (message has statement and line)
    PEBBLE_ERR_CLOSED           =  -9, // the handle was freed or never existed
    PEBBLE_ERR_STRATEGY         = -10, // unknown strategy or invalid strategy argument
};

// ---------------------------------------------------------------------------------------------------
// strategies: which layers are checkpoints (resident on the device)
//
// For k resident layers out of L, layer i is resident iff (i * k) mod L < k: exactly k layers, evenly
// spaced, layer 0 first; when k >= L/2 no two streamed layers are adjacent, so every transfer can
// overlap a resident layer's compute.

enum pebble_strategy {
    PEBBLE_STRATEGY_NONE     = 0, // every layer resident (arg ignored)
    PEBBLE_STRATEGY_SQRT     = 1, // k = ceil(sqrt(L)) (arg ignored)
    PEBBLE_STRATEGY_ADAPTIVE = 2, // k = arg, 0 <= arg <= L, chosen by the planner to fit a budget
    PEBBLE_STRATEGY_MINIMAL  = 3, // no layer resident (arg ignored)
    PEBBLE_STRATEGY_EVERY    = 4, // layer i resident iff i mod arg == 0, arg >= 1
};

// where pebble_save places an entry
enum pebble_tier {
    PEBBLE_TIER_AUTO   = 0, // device if the strategy keeps the layer resident, else host
    PEBBLE_TIER_DEVICE = 1,
    PEBBLE_TIER_HOST   = 2,
};

// GGUF tensor type of an entry's bytes; PEBBLE_TYPE_BYTES for untyped bytes
#define PEBBLE_TYPE_BYTES (-1)
#define PEBBLE_TYPE_COUNT 42 // GGUF type ids are 0..PEBBLE_TYPE_COUNT-1
#define PEBBLE_MAX_DIMS   4

struct pebble_tensor_desc {
    int32_t ggml_type;             // GGUF type id (0 F32, 1 F16, 2 Q4_0, 8 Q8_0, 12 Q4_K, 14 Q6_K, 30 BF16)
    int32_t n_dims;                // 1..PEBBLE_MAX_DIMS
    int64_t ne[PEBBLE_MAX_DIMS];   // elements per dimension, innermost first (GGUF order)
};

struct pebble_entry_info {
    uint64_t                  nbytes;
    struct pebble_tensor_desc desc;
    int32_t                   on_device; // a device copy exists
    int32_t                   on_host;   // a host copy exists
};

struct pebble_stats {
    uint64_t device_limit_bytes;
    uint64_t device_bytes;       // bytes held in the device tier now, each copy as the device holds it
                                 // (PEBBLE_DEVICE_PAGE_BYTES); the limit is in these bytes
    uint64_t device_peak_bytes;  // most ever held in the device tier
    uint64_t host_bytes;         // bytes held in the pinned host tier now
    uint64_t host_peak_bytes;
    uint64_t entries;
    uint64_t saves;
    uint64_t restores;           // pebble_restore and pebble_read calls that succeeded
    uint64_t hits;               // ... of which served from the device tier
    uint64_t evictions;          // entries moved from the device tier to the host tier
    uint64_t prefetches;         // entries copied from the host tier into the device tier
    uint64_t bytes_h2d;          // bytes copied host to device, by any call
    uint64_t bytes_d2h;          // bytes copied device to host, by any call
    uint64_t bytes_restored;     // bytes copied out by pebble_restore and pebble_read
};

typedef struct pebble_store * pebble_store_t;

// The cuda library counts a device copy of half a page or more as whole pages of this size: the CUDA
// driver backs such an allocation with whole 2 MiB pages (NVML on an H200, 11-27: 32 layers of a
// Llama-3-8B Q4_K_M file held 200.5 MiB over their bytes, each tensor of 1 MiB or more rounded up to
// 2 MiB). The host library's device tier is memory of the host's and counts bytes.
#define PEBBLE_DEVICE_PAGE_BYTES 2097152

// ---------------------------------------------------------------------------------------------------
// lifetime

// Creates a store on CUDA device `device` whose device tier holds at most `device_limit` bytes.
PEBBLE_API enum pebble_status pebble_init  (uint64_t device_limit, int32_t n_layers, int32_t strategy,
                                            int64_t strategy_arg, int32_t device, pebble_store_t * out);
// Changes the limit and the strategy of a live store, then rebalances: device copies of layers the new
// strategy streams move to the host tier, least-recently-used entries move there until the new limit
// holds, and host-only entries of resident layers (ascending layer, then tensor id) move to the device
// as far as the limit allows. Nothing is dropped; the model's weights need not be saved again.
PEBBLE_API enum pebble_status pebble_set_strategy(pebble_store_t store, uint64_t device_limit, int32_t strategy,
                                                  int64_t strategy_arg);
// Frees every entry and the handle; later calls on it return PEBBLE_ERR_CLOSED. NULL is a no-op.
PEBBLE_API enum pebble_status pebble_free  (pebble_store_t store);

// ---------------------------------------------------------------------------------------------------
// entries
//
// Copies are enqueued on `stream` (a cudaStream_t; NULL for the default stream) and ordered after
// every earlier copy of the same entry on any stream; the caller keeps `src`/`dst` valid until
// `stream` has passed them. Host and device pointers are both accepted.

// Saves `nbytes` from `src` under (layer, tensor_id), replacing any entry there. Saving into the device
// tier past the limit first moves least-recently-used entries of other keys to the host tier.
PEBBLE_API enum pebble_status pebble_save   (pebble_store_t store, int32_t layer, int32_t tensor_id,
                                             const void * src, uint64_t nbytes,
                                             const struct pebble_tensor_desc * desc, // NULL: bytes
                                             int32_t tier, void * stream);
// As pebble_save into the host tier (with its checks and errors), except that the host library keeps
// `src` itself as the entry's host copy instead of copying it (a weight in a GGUF file's memory map
// loads without a copy, as llama.cpp's mmap does): the caller keeps `src` valid and unchanged until the
// entry is erased or replaced or the store freed, and writes through the entry's views reach it. A
// write or a save to the entry first gives it a copy of its own, so the store never writes into `src`;
// a device copy the host library makes of it is `src` too. The cuda library copies `src` as
// pebble_save does (a GPU's host tier is pinned memory). *borrowed = whether `src` was kept (NULL: not
// wanted).
PEBBLE_API enum pebble_status pebble_save_borrowed(pebble_store_t store, int32_t layer, int32_t tensor_id,
                                                   const void * src, uint64_t nbytes,
                                                   const struct pebble_tensor_desc * desc, int32_t * borrowed);
// Copies the whole entry into `dst`; `nbytes` must equal the entry's size.
PEBBLE_API enum pebble_status pebble_restore(pebble_store_t store, int32_t layer, int32_t tensor_id,
                                             void * dst, uint64_t nbytes, void * stream);
// Copies bytes [offset, offset + nbytes) of the entry into `dst`.
PEBBLE_API enum pebble_status pebble_read   (pebble_store_t store, int32_t layer, int32_t tensor_id,
                                             uint64_t offset, void * dst, uint64_t nbytes, void * stream);
// Overwrites bytes [offset, offset + nbytes) of the entry in every tier that holds it.
PEBBLE_API enum pebble_status pebble_write  (pebble_store_t store, int32_t layer, int32_t tensor_id,
                                             uint64_t offset, const void * src, uint64_t nbytes,
                                             void * stream);
// Removes the entry from both tiers.
PEBBLE_API enum pebble_status pebble_erase  (pebble_store_t store, int32_t layer, int32_t tensor_id);
// Copies every host-only entry of `layer` into the device tier, as far as the limit allows without
// evicting other entries of that layer; entries larger than the limit stay on the host.
PEBBLE_API enum pebble_status pebble_prefetch(pebble_store_t store, int32_t layer, void * stream);
// keep 1 keeps the entry in the host tier: a device copy it has moves there now, and pebble_set_strategy,
// pebble_prefetch and a save into PEBBLE_TIER_AUTO leave it there (a save into PEBBLE_TIER_DEVICE still
// places it on the device). keep 0 lets the strategy place it again (at the next pebble_set_strategy or
// pebble_prefetch). The mark lasts until the entry is erased. For a model whose experts are pebbles: its
// merged expert tensors then take no device memory, whatever the residency of their layers.
PEBBLE_API enum pebble_status pebble_keep_on_host(pebble_store_t store, int32_t layer, int32_t tensor_id,
                                                  int32_t keep);
PEBBLE_API enum pebble_status pebble_entry_info(pebble_store_t store, int32_t layer, int32_t tensor_id,
                                                struct pebble_entry_info * out);
// *out = the entry's device copy, for computing in place from a resident entry. The pointer is borrowed:
// it stays valid until the entry is evicted, replaced at another size or erased, or the store is freed,
// and no longer; PEBBLE_ERR_UNKNOWN_ENTRY if it has no device copy.
PEBBLE_API enum pebble_status pebble_device_pointer(pebble_store_t store, int32_t layer, int32_t tensor_id,
                                                    void ** out);
// As pebble_device_pointer, with the same errors, but *out is leased: the buffer stays valid memory until
// pebble_device_release(*out) gives the lease back, whatever happens to the entry or the store meanwhile.
// While the buffer is the entry's copy, writes through it are writes to the entry (and a save of the
// same size overwrites it in place). When the store lets go of the copy (eviction, erase, a save at
// another size or to the host tier, pebble_free) a leased buffer is detached instead of freed: the entry
// no longer uses it, the device tier no longer counts it (so device memory in use may exceed the limit
// by the detached buffers), and the release of its last lease frees it. Leases nest: each acquire needs
// its own release. *nbytes = the entry's size, read under the same lock (NULL: not wanted).
PEBBLE_API enum pebble_status pebble_device_acquire(pebble_store_t store, int32_t layer, int32_t tensor_id,
                                                    void ** out, uint64_t * nbytes);
// As pebble_device_acquire for the entry's host copy (PEBBLE_ERR_UNKNOWN_ENTRY if it has none), after the
// copies in flight to it: for computing from the host tier in place where the kernels can read it
// (the host library's, whose two tiers are both host memory, so that a streamed layer need not be
// copied to be computed). Writes through it reach the host copy only. When the store lets go of the
// host copy the buffer is detached, as a device copy's is, and pebble_device_release frees it.
PEBBLE_API enum pebble_status pebble_host_acquire(pebble_store_t store, int32_t layer, int32_t tensor_id,
                                                  void ** out, uint64_t * nbytes);
// Gives back one lease taken by pebble_device_acquire or pebble_host_acquire; valid after the store was
// freed. A pointer that
// holds no lease (never acquired, or released as many times as acquired) is PEBBLE_ERR_INVALID_ARGUMENT.
PEBBLE_API enum pebble_status pebble_device_release(void * ptr);

// ---------------------------------------------------------------------------------------------------
// quantized tensors
//
// Kernels that compute from a tensor's GGUF bytes as stored (native/cuda/), so that weights
// stay quantized in the store and on the bus. Types, with GGML's block layouts: 0 F32, 1 F16, 2 Q4_0,
// 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 10 Q2_K, 11 Q3_K, 12 Q4_K, 13 Q5_K, 14 Q6_K, 20 IQ4_NL, 23 IQ4_XS,
// 30 BF16, 39 MXFP4. The cuda library enqueues the work on `stream` (a cudaStream_t;
// NULL for the default stream) and reads and writes device memory (device, managed or pinned host
// memory; pageable host memory is refused); the host library computes on host memory and returns when
// done. Elements are decoded in float32 exactly as gguf-py's dequantize does.
//
// Errors: PEBBLE_ERR_INVALID_ARGUMENT for a NULL pointer, a type without kernels, a count below 1 or
// n_vec outside 1..PEBBLE_MATVEC_MAX_VEC; PEBBLE_ERR_SIZE_MISMATCH for an element count that is not a
// whole number of the type's blocks, or a byte count other than those blocks' size; PEBBLE_ERR_CUDA
// when a kernel cannot be launched.

#define PEBBLE_MATVEC_MAX_VEC 8

// *block_elements, *block_bytes = the elements in one block of `ggml_type` and the bytes it takes.
PEBBLE_API enum pebble_status pebble_type_block(int32_t ggml_type, int64_t * block_elements,
                                                int64_t * block_bytes);
// dst_f16[i] = element i of the tensor in `src` as IEEE half bits (float32 rounded to nearest even,
// out of range to +-inf), for i < n_elements; src_bytes must be the size of those elements' blocks.
PEBBLE_API enum pebble_status pebble_dequantize(int32_t ggml_type, const void * src, uint64_t src_bytes,
                                                uint16_t * dst_f16, int64_t n_elements, void * stream);
// out[r * n_cols + c] = element c of row rows[r] of `table` (rows of n_cols elements, one after another as
// GGUF stores a matrix; table_bytes a whole number of them) in float32, for r < n_rows: an embedding's
// gather. Computed on the CPU from host memory, synchronously, by either library (llama.cpp, too, gathers
// the input embedding on the CPU). Errors: PEBBLE_ERR_INVALID_ARGUMENT for a type without kernels, a NULL
// pointer (with n_rows >= 1), n_cols below 1, n_rows below 0 or a row past the table (nothing written);
// PEBBLE_ERR_SIZE_MISMATCH for n_cols not whole blocks or table_bytes not whole rows.
PEBBLE_API enum pebble_status pebble_dequantize_rows(int32_t ggml_type, const void * table, uint64_t table_bytes,
                                                     int64_t n_cols, const int64_t * rows, int64_t n_rows,
                                                     float * out);
// y[v * n_rows + r] = sum over c of W[r][c] * x_f16[v * n_cols + c], for r < n_rows, v < n_vec: W is
// n_rows rows of n_cols elements each (a row contiguous, as GGUF stores a weight), x_f16 holds n_vec
// fp16 vectors one after another. Each weight block is read once per call and decoded in registers;
// products and sums are float32. w_bytes must be the size of the n_rows * n_cols elements' blocks.
// The host library, as llama.cpp's CPU backend does, multiplies the quantized types by x quantized once
// per call to 8-bit blocks (per 256 elements for the types of 256-element blocks, Q2_K..Q6_K and IQ4_XS,
// per 32 for the others: d = max|x| / 127 in float32, q = x / d rounded to nearest even; a block holding
// inf or NaN gives NaN), with integer dot products: each element of x moves by at most d / 2, so a result
// differs from the product with x itself by at most sqrt(block) / 254 * ||W[r]|| * ||x|| (0.022 relative
// for blocks of 32, 0.063 for 256; about twenty times less on random data) beyond float32 rounding. F32, F16 and
// BF16 weights take x as it is. The cuda library quantizes x the same way for every quantized type where
// x (and Q4_K's and Q5_K's w) are 16-byte aligned (its integer kernel; PEBBLING_CUDA_MATVEC=float keeps x
// in fp16 there too), and multiplies x as it is otherwise. The host library splits rows
// among a pool of threads started once per process: one per CPU the process may run on, or
// PEBBLING_THREADS (1..256); its kernels use AVX-512 (F, BW, DQ, VL and VNNI) for Q4_0..Q8_0, Q4_K, Q5_K and
// Q6_K where the CPU has it, else AVX2 (with FMA and F16C), else portable C++; PEBBLING_SIMD=avx2 or
// PEBBLING_SIMD=portable holds them to that set. PEBBLING_SIMD=gpu runs pebble_matvec, pebble_matmul and
// pebble_matmul_f32 through the cuda library's integer and dense kernels' own code for a lane's parts
// instead, each of a warp's 32 lanes in turn on the host (slow: how the tests check those kernels without a
// GPU; dense rows that are not whole 8-element parts take the host's kernels). Another value of either
// makes every matvec call fail with PEBBLE_ERR_INVALID_ARGUMENT, naming it.
PEBBLE_API enum pebble_status pebble_matvec    (int32_t ggml_type, const void * w, uint64_t w_bytes,
                                                int64_t n_rows, int64_t n_cols, const uint16_t * x_f16,
                                                int32_t n_vec, float * y, void * stream);
// As pebble_matvec for any number of vectors n_vec >= 1 (a prefill chunk), with the same errors but
// no upper limit on n_vec. The host library multiplies the weights as stored, in tiles of rows that
// every vector passes before the next tile is read, so nothing is expanded to float; the cuda library
// runs pebble_matvec's kernel over groups of PEBBLE_MATVEC_MAX_VEC vectors.
PEBBLE_API enum pebble_status pebble_matmul    (int32_t ggml_type, const void * w, uint64_t w_bytes,
                                                int64_t n_rows, int64_t n_cols, const uint16_t * x_f16,
                                                int64_t n_vec, float * y, void * stream);
// As pebble_matmul with float32 vectors x: each element is rounded to fp16 first (to nearest even, as
// numpy's astype(float16) does; out of range to +-inf), so y is what pebble_matmul gives for those fp16
// vectors, bit for bit, without a conversion pass of the caller's over x. The cuda library rounds them on
// `stream` into memory it allocates there for the call (not yet run on a GPU).
PEBBLE_API enum pebble_status pebble_matmul_f32(int32_t ggml_type, const void * w, uint64_t w_bytes,
                                                int64_t n_rows, int64_t n_cols, const float * x,
                                                int64_t n_vec, float * y, void * stream);

// ---------------------------------------------------------------------------------------------------
// a transformer layer as the decode step computes it (native/cuda/decode_step.cu)
//
// RMS norm, the Q/K/V projections (+ biases), per-head Q/K RMS norms where given (qwen3, gemma3), RoPE,
// the new K/V row into the caches, attention over the rows filled (soft-capped where asked: gemma2), the
// output projection, its norm where given (the Gemmas), the residual (scaled where asked: Granite), RMS
// norm, the SwiGLU or GELU-tanh gated feed-forward, its norm where given, and its residual. A cache may be
// a ring (shape.ring): a sliding-window layer's rows hold its last positions, position p in row p % rows,
// and attention covers the rows filled so far, its window. A layer of experts replaces the gated
// feed-forward by its routed one (pebble_layer_shape.n_expert); a decode step computes it expert by
// expert, each expert's rows read once for the tokens of the step routed to it (the router's choice is
// read back to the host, so such a model's steps are not captured as CUDA graphs). Weight matrices may be
// of any type with kernels (the quantized bytes as stored, or F16/F32/BF16); vectors (norms, biases) are
// F32 or F16, the caches F32, F16, or llama.cpp's Q8_0 or Q4_0 blocks (32 values after an fp16 scale; a
// head of whole blocks, head_dim a multiple of 32), read from their blocks as they are. The residual
// stream is float32, the vectors handed to the matrix kernels fp16, sums float32.
// Layouts are llama.cpp's, as in pyplugin.model: a matrix is [out][in] rows, a cache is
// [rows][n_head_kv][head_dim] (a block type's rows its blocks in that order). Q/K norms together with Q/K
// biases are refused (no model has both; their order would be a guess), as are heads that do not divide
// and an odd or too large rope_dims.

struct pebble_layer_shape {
    int32_t n_embd, n_head, n_head_kv, head_dim, n_ff;
    int32_t rope_dims;   // leading dims of each head that are rotated (even, <= head_dim)
    int32_t rope_neox;   // 0: GGML's normal mode, pairs (2i, 2i+1); 1: NeoX, pairs (i, i + rope_dims/2)
    float   rms_eps;
    int32_t activation;      // 0: SwiGLU, silu(gate) * up; 1: GELU (tanh) gate, gelu(gate) * up (the Gemmas);
                             // 2 (experts only, gpt-oss): g = min(gate, 7), u = clamp(up, -7, 7), then
                             // g * sigmoid(1.702 g) * (u + 1)
    int32_t ring;            // 1: the caches are rings of the last n_ctx positions (a sliding window)
    float   attn_softcap;    // above 0: each score s becomes c * tanh(s / c) (gemma2); 0: none
    float   residual_scale;  // multiplies each block's output before it joins x (1: none; Granite's)
    // A mixture of experts in place of the FFN where n_expert > 0 (w_gate, w_up, w_down then NULL, except in
    // Gemma 4's layer of both: pebble_layer_weights): the router's softmax over n_expert scores, the n_expert_used
    // most probable (ties to the lower index), their probabilities renormalised to sum to 1 where expert_norm is 1,
    // times expert_scale; each chosen expert a SwiGLU (or, activation 1, GELU-gated: Gemma 4's) FFN of n_ff_exp, summed by those weights in
    // increasing expert order; plus, where n_ff_shexp > 0, a shared SwiGLU FFN of n_ff_shexp times
    // sigmoid(ffn_gate_inp_shexp . h) (qwen2moe). With expert_gating 1 (gpt-oss) the n_expert_used highest scores (the
    // router's bias added where given) are chosen and their weights are a softmax over those scores alone (expert_norm
    // must be 0); the experts' biases, where given, join their gate, up and down products.
    int32_t n_expert, n_expert_used, n_ff_exp, n_ff_shexp;
    int32_t expert_norm;     // 0 or 1
    float   expert_scale;    // 1: none
    int32_t expert_gating;   // 0: a softmax over every expert; 1: a softmax over the chosen experts' scores
    // Gemma 4. kv_layer -1: the layer keeps caches of its own; else the index of an earlier layer (itself
    // with kv_layer -1, not streamed, of the same n_head_kv, head_dim, ring and kv_rows) whose caches this
    // layer attends over: it computes q only (wk, wv, bk, bv and k_norm NULL), writes no cache row (its
    // source wrote the step's row before it), and its k_caches/v_caches entries are not read (NULL or the
    // source's, either is accepted); streamed, it restores and writes back no cache entries (kv_ids are not
    // read for it). v_norm 1: each head of V is RMS-normed without a weight (eps rms_eps) before it is cached;
    // then wv may be NULL on a layer with caches of its own, V being K's projection itself (before k_norm
    // and RoPE). A shape initialised to zero reads layer 0's caches: -1 must be set.
    int32_t kv_layer;
    int32_t v_norm;          // 0 or 1
};

struct pebble_tensor_ref {
    int32_t      ggml_type;
    const void * data;   // NULL: absent (biases only)
};

#define PEBBLE_LAYER_WEIGHTS 39 // the fields of pebble_layer_weights

struct pebble_layer_weights {
    struct pebble_tensor_ref attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down, bq, bk, bv;
    struct pebble_tensor_ref q_norm, k_norm;                 // [head_dim] each, or NULL (qwen3, gemma3)
    struct pebble_tensor_ref post_attn_norm, post_ffn_norm;  // [n_embd] each, or NULL (the Gemmas)
    // experts (shape.n_expert > 0), else NULL: the router [n_expert][n_embd]; the experts' gate and up
    // [n_expert][n_ff_exp][n_embd] and down [n_expert][n_embd][n_ff_exp], expert j's rows one block of
    // rows after another as GGUF merges them; the shared expert's gate vector [n_embd] (F32 or F16) and
    // its gate and up [n_ff_shexp][n_embd] and down [n_embd][n_ff_shexp], or NULL where it has none.
    struct pebble_tensor_ref ffn_gate_inp, ffn_gate_exps, ffn_up_exps, ffn_down_exps;
    struct pebble_tensor_ref ffn_gate_inp_shexp, ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp;
    // gpt-oss, else NULL (F32 each): a sink logit per query head [n_head], which joins each head's softmax
    // as a score that weights no value (not scaled); the output projection's bias [n_embd]; the router's
    // bias [n_expert]; the experts' gate and up biases [n_expert][n_ff_exp] and down biases
    // [n_expert][n_embd].
    struct pebble_tensor_ref attn_sinks, bo, ffn_gate_inp_b, ffn_gate_exps_b, ffn_up_exps_b, ffn_down_exps_b;
    // Gemma 4, else NULL. After the feed-forward's residual, the per-layer embedding where per_layer_inp_gate
    // [n_pl][n_embd], per_layer_proj [n_embd][n_pl] (matrices) and per_layer_post_norm [n_embd] are given
    // (all three or none; n_pl = pebble_step_model.n_embd_per_layer): g = gelu_tanh(per_layer_inp_gate . x)
    // * in (in: the token's per-layer input of this layer, pebble_decoder_step's x), x += rms_norm(
    // per_layer_proj . g) * per_layer_post_norm; then x *= out_scale[0] where out_scale [1] is given.
    // The 26B-A4B's layer of experts beside a dense FFN (n_expert > 0 with w_gate, w_up, w_down of n_ff given;
    // pyplugin.model.transformer's ffn_block) needs ffn_gate_inp_s, ffn_pre_norm_2, ffn_post_norm_1 and
    // ffn_post_norm_2 [n_embd], and takes ffn_down_exps_s [n_expert] where given (any of them elsewhere is
    // refused, by name). With x the stream after attention: dense = rms_norm(the gated FFN of rms_norm(x) *
    // ffn_norm) * ffn_post_norm_1; the router scores rms_norm(x) (no weight) * ffn_gate_inp_s / sqrt(n_embd);
    // the chosen experts (gated as shape.activation says) run on rms_norm(x) * ffn_pre_norm_2, each one's
    // output times its weight and its ffn_down_exps_s; their sum moe; the FFN's output is dense +
    // rms_norm(moe) * ffn_post_norm_2, then post_ffn_norm and the residual as any layer's. Vectors F32 or F16.
    struct pebble_tensor_ref per_layer_inp_gate, per_layer_proj, per_layer_post_norm, out_scale;
    struct pebble_tensor_ref ffn_gate_inp_s, ffn_pre_norm_2, ffn_post_norm_1, ffn_post_norm_2, ffn_down_exps_s;
};

// The attention of one new query in each of n_seq sequences, each over a cache of its own: what a
// decode step over a batch computes per sequence, in one call. q is n_seq x n_head x head_dim float32
// (rotated, not yet scaled; scale multiplies q before the dot products); sequence b attends over rows
// 0..n_pos[b]-1 of k_caches[b] and v_caches[b], each n_rows x n_head_kv x head_dim of kv_type (0 F32,
// 1 F16, 8 Q8_0 or 2 Q4_0, the latter two with head_dim a multiple of 32); query head h reads KV head h / (n_head / n_head_kv); softcap above 0 makes each score
// c * tanh(s / c). k_new and v_new (n_seq x n_head_kv x head_dim float32 each, or both NULL) are the new
// tokens' K and V rows: sequence b's go into row n_pos[b]-1 of its caches (converted to kv_type: fp16
// rounding to nearest even, blocks as llama.cpp's reference quantizers write them) before it attends, so a decode step stores and attends in this one call.
// out (n_seq x n_head x head_dim float32) = the softmax-weighted sum of V. Each
// sequence's result is the same whatever the others in the call. scratch holds at least
// pebble_attend_scratch_bytes. The host library splits each sequence's rows into chunks of up to 128,
// read in the order they lie, among its threads, and combines the chunks' softmaxes; the cuda library
// runs the decode step's attention kernels for up to eight sequences a launch, V summed in one pass.
// Errors: PEBBLE_ERR_INVALID_ARGUMENT for a NULL pointer (k_new without v_new or the
// reverse included), a count below 1, heads that do not divide, another kv_type, or
// a block type with a head_dim of part of a block;
// PEBBLE_ERR_SIZE_MISMATCH for an n_pos outside 1..n_rows or scratch too small.
PEBBLE_API enum pebble_status pebble_attend_scratch_bytes(int32_t n_seq, int32_t n_head, int64_t n_rows,
                                                          uint64_t * out);
PEBBLE_API enum pebble_status pebble_attend(int32_t n_seq, const float * q, const float * k_new,
                                            const float * v_new, int32_t kv_type,
                                            void * const * k_caches, void * const * v_caches,
                                            const int64_t * n_pos, int64_t n_rows, int32_t n_head,
                                            int32_t n_head_kv, int32_t head_dim, float scale, float softcap,
                                            float * out, void * scratch, uint64_t scratch_bytes, void * stream);

// The causal attention of a prompt chunk: n_tok queries of one sequence at positions pos..pos+n_tok-1
// (q n_tok x n_head x head_dim float32, rotated, not yet scaled) over rows 0..pos+n_tok-1 of its caches
// (each n_rows x n_head_kv x head_dim of kv_type, as pebble_attend's; the chunk's own K and V rows already
// written). A query at p sees the keys at p and before, and where window > 0 only the last `window` of
// them (p - window + 1 .. p); scale and softcap as pebble_attend's; sinks (n_head float32, or NULL: none) a
// logit per query head that joins its softmax and weights no value (gpt-oss). out (n_tok x n_head x head_dim
// float32) = the softmax-weighted sum of V for each query and head. The host library computes it without
// the n_tok x n_rows scores (tiles of queries, blocks of keys, a running softmax) on its threads; the
// cuda library refuses the call (PEBBLE_ERR_INVALID_ARGUMENT, saying so). Errors: PEBBLE_ERR_INVALID_ARGUMENT
// for a NULL pointer, a count below 1, a negative pos or window, heads that do not divide, or a kv_type
// pebble_attend refuses; PEBBLE_ERR_SIZE_MISMATCH where pos + n_tok exceeds n_rows; PEBBLE_ERR_HOST_OOM
// where a thread's buffers cannot be allocated.
PEBBLE_API enum pebble_status pebble_attend_prompt(const float * q, int64_t n_tok, int64_t pos, int32_t kv_type,
                                                   const void * k_cache, const void * v_cache, int64_t n_rows,
                                                   int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                                                   int64_t window, float scale, float softcap,
                                                   const float * sinks, float * out, void * stream);

// ---------------------------------------------------------------------------------------------------
// the decode step of a whole model: one call per generated token
//
// A decoder holds, for as long as a plan runs, what every step reads: each layer's shape, weights, RoPE
// tables and the K/V caches of each of its n_seq sequences, and the output norm and matrix. The caller
// keeps every buffer it names valid until pebble_decoder_free; nothing is copied (streamed layers aside:
// pebble_step_layer.streamed). A step then runs one token of each of 1..n_seq sequences (each at its own
// position, over its own caches) through every layer and the output: per layer, the weights are read once
// for the whole batch (pebble_matmul's kernels), each sequence's new K/V row is written (row pos % kv_rows
// of a ring) and it attends over its own rows (pebble_attend's arithmetic), every operation as the layer
// above describes, in its order; each sequence's result is the same whatever the others in the step.
//
// Errors: the layer's (its shape, weights and caches as above), named by layer, when the
// decoder is made; at a step, PEBBLE_ERR_INVALID_ARGUMENT for a count outside 1..n_seq, a sequence outside
// 0..n_seq-1 or twice in one step, a NULL x; PEBBLE_ERR_SIZE_MISMATCH for a position outside a layer's
// RoPE table or past a full cache; PEBBLE_ERR_CLOSED for a freed decoder.

struct pebble_step_layer {
    struct pebble_layer_shape   shape;
    struct pebble_layer_weights weights;
    const float * rope_cos;     // [rope_rows][head_dim] float32: cos and sin of every position's rotations
    const float * rope_sin;
    int64_t       rope_rows;
    int64_t       kv_rows;      // rows of each of this layer's caches (a ring's window where shape.ring)
    float         attn_scale;   // multiplies q before the dot products
    // 1: the layer is streamed. Its weights and each sequence's K and V are entries of the model's store,
    // weight_ids[f] the entry of field f of pebble_layer_weights in its order (-1: absent; the refs give
    // each one's type, their data is not read) and kv_ids the caches'. Every step copies them into one of
    // two slots of the decoder's (device memory) before the layer computes, on a copy stream of its own
    // ordered by events, the next streamed layer's while this one computes, and writes each new K and V
    // row back after; k_caches and v_caches are not read for it. Graphs are not captured where a layer
    // is streamed (the store's copies are not).
    int32_t       streamed;
    int32_t       weight_ids[PEBBLE_LAYER_WEIGHTS];
    // Experts as pebbles (shape.n_expert > 0 and experts_stored 1 or 2; 0: the merged tensors of `weights`):
    // with 1, expert j of the layer is the store entry expert_ids + j of the model's store (or expert_store),
    // its gate rows, then its up rows, then its down rows; with 2, it is read out of the merged tensors'
    // own entries in the model's store, weight_ids[17], [18] and [19] (ffn_gate_exps, ffn_up_exps,
    // ffn_down_exps: expert j's rows are the j-th n_expert-th of each), so the host tier holds each
    // expert's bytes once (expert_ids is not read). Either way in the types weights.ffn_gate_exps,
    // ffn_up_exps and ffn_down_exps give (their data are not read). The decoder keeps expert_cache of the layer's experts in device memory, the least recently used replaced;
    // a step restores each expert its tokens chose that the cache lacks before that expert's FFN runs (0:
    // every routed expert restored at each use, into the decoder's staging slots; pebble_step_model's
    // expert_policy and expert_prefetch).
    int32_t       experts_stored;
    int32_t       expert_ids;
    int32_t       expert_cache;
};

struct pebble_step_model {
    int32_t n_layer, n_embd, n_vocab;
    int32_t n_seq;              // sequences the decoder holds caches for
    int32_t kv_type;            // 0 F32, 1 F16, 8 Q8_0 or 2 Q4_0 (head_dim a multiple of 32), every cache
    float   rms_eps;            // the output norm's
    float   logit_scale;        // multiplies the logits (1: none)
    float   final_softcap;      // above 0: each logit becomes c * tanh(l / c)
    struct pebble_tensor_ref output_norm, output; // [n_embd]; [n_vocab][n_embd] of any type with kernels
    int32_t graphs;             // 1: a batch stepped twice running is captured as a CUDA graph and replayed
    pebble_store_t store;       // the streamed layers' entries (NULL where none is streamed)
    const int32_t * kv_ids;     // [n_seq][2]: the K and V entries of each sequence, the same in every layer
    // The streamed layers' two slots (device memory of slot_bytes each, the caller's until the decoder is
    // freed), or NULL for the decoder to make its own. A slot holds a layer's weights, then each sequence's
    // K and V cache, each at a multiple of 256 bytes; slot_bytes must cover the largest streamed layer.
    void *   slots[2];
    uint64_t slot_bytes;
    // The experts' entries where a layer's experts_stored is 1 (an entry per expert), or NULL for `store`'s:
    // a store of their own keeps them in its host tier whatever residency the layers' store gives the
    // layers. Not read for experts_stored 2 (the merged tensors' entries are `store`'s).
    pebble_store_t expert_store;
    // Experts as pebbles: the decoder's device memory for them is slots of one expert each (the largest of
    // the layers' experts, aligned to 256 bytes): expert_cache slots per layer, plus staging slots shared by
    // the layers, n_expert_used of them (the most any layer uses) where expert_prefetch is 1, else one
    // where a layer has no cache, else none (pebble_decoder_stats.expert_device_bytes says what was made).
    // expert_policy picks a cache's victim: 0 the least recently used; 1 the least often used (the times
    // the step ran each expert of the layer since the decoder was made; ties to the least recently used).
    // An empty slot is always taken first, and an expert the step has still to run only where every cached
    // one is.
    // expert_prefetch 1: before each such layer computes, its router is applied to the hidden state entering it
    // (RMS-normed with the layer's ffn_norm; where the layer has ffn_gate_inp_s, made as its router's own input is:
    // normed without a weight, times ffn_gate_inp_s / sqrt(n_embd)): the n_expert_used experts with the highest
    // probability summed over the step's tokens are the guesses, and each one its cache lacks is restored into a
    // staging slot then, while the layer's attention computes. A guessed expert the layer then runs is a hit (with a
    // cache it takes the victim's slot, the victim's buffer becoming a staging slot); the staging slots are free again
    // once the layer has run. A wrong guess costs its restore, never a result: the layer's experts are chosen from its
    // own router as without prefetch. Where a layer without a cache must restore a miss and every staging slot holds a
    // guess still to run, the one of the highest expert index gives way (it is restored again when it runs).
    int32_t expert_policy;
    int32_t expert_prefetch;
    // Gemma 4's per-layer embeddings: the width of a layer's per-layer input (0: none, and no layer may give
    // per_layer_inp_gate). Above 0, pebble_decoder_step's x holds after the n x n_embd hidden states the
    // n x n_layer x n_embd_per_layer per-layer inputs (token b's of layer i at (b * n_layer + i) *
    // n_embd_per_layer), read only.
    int32_t n_embd_per_layer;
};

struct pebble_decoder_stats {
    uint64_t steps;             // steps run
    uint64_t tokens;            // sequences summed over steps
    uint64_t layer_passes;      // layers computed, one per layer per step
    // CUDA graphs (where the model asks for them): batches captured, steps replayed, graphs dropped (the
    // least recently used past PEBBLE_DECODER_GRAPHS, or all where a capture failed). The host build makes the same decisions
    // and counts them, and runs every step directly: it has no graphs.
    uint64_t graphs_captured, graph_replays, graphs_dropped;
    // Experts as pebbles (pebble_step_layer.experts_stored): experts a step ran without restoring them then
    // (from a cache, or prefetched), experts it restored first, and the bytes every expert restore copied
    // (prefetches included).
    uint64_t expert_hits, expert_misses, expert_bytes_restored;
    // Prefetch (pebble_step_model.expert_prefetch): experts guessed, guesses the layer then ran, experts
    // restored early (guesses no cache held), and of those the ones the layer ran.
    uint64_t expert_guesses, expert_guesses_right, expert_prefetches, expert_prefetch_hits;
    uint64_t expert_device_bytes;  // the device memory of the decoder's expert slots (pebble_step_model)
    uint64_t scratch_bytes;        // the memory of the decoder's own for a step's activations (the device's on cuda)
};

typedef struct pebble_decoder * pebble_decoder_t;

#define PEBBLE_DECODER_MAX_BATCH 64 // sequences one decoder holds
#define PEBBLE_DECODER_GRAPHS    8  // CUDA graphs one decoder keeps
#define PEBBLE_DECODER_SPLIT_ROWS 64 // a decode step's attention sums V over this many rows a part, then the parts

// layers: n_layer entries; k_caches, v_caches: n_layer * n_seq pointers, layer i's cache of sequence s at
// [i * n_seq + s], each kv_rows x n_head_kv x head_dim of kv_type.
PEBBLE_API enum pebble_status pebble_decoder_create(const struct pebble_step_model * model,
                                                    const struct pebble_step_layer * layers,
                                                    void * const * k_caches, void * const * v_caches,
                                                    pebble_decoder_t * out);
// Token b of the step is sequence seqs[b] at position pos[b]: x (n x n_embd float32) holds their embeddings
// and comes out as their last hidden states, before the output norm (where the model's n_embd_per_layer is
// above 0, x is followed by the tokens' per-layer inputs, which the step reads and leaves as they are);
// logits (n x n_vocab float32), where not NULL, receives the output's logits (scaled and capped as the
// model says).
PEBBLE_API enum pebble_status pebble_decoder_step (pebble_decoder_t decoder, int32_t n, const int32_t * seqs,
                                                   const int64_t * pos, float * x, float * logits, void * stream);
PEBBLE_API enum pebble_status pebble_decoder_stats(pebble_decoder_t decoder, struct pebble_decoder_stats * out);
// Frees the decoder (not the buffers it names); NULL is a no-op.
PEBBLE_API enum pebble_status pebble_decoder_free (pebble_decoder_t decoder);

// ---------------------------------------------------------------------------------------------------
// strategy, stats, errors

// *out = 1 if the strategy keeps `layer` resident on the device, else 0.
PEBBLE_API enum pebble_status pebble_should_checkpoint(pebble_store_t store, int32_t layer, int32_t * out);
PEBBLE_API enum pebble_status pebble_stats      (pebble_store_t store, struct pebble_stats * out);
// Resets the peak counters to the current holdings and zeroes the event counters.
PEBBLE_API enum pebble_status pebble_stats_reset(pebble_store_t store);
// Waits until every copy the store enqueued has completed.
PEBBLE_API enum pebble_status pebble_synchronize(pebble_store_t store);

PEBBLE_API const char * pebble_strerror  (int32_t status);
// The message of the calling thread's last failed call ("" if none); valid until its next call.
PEBBLE_API const char * pebble_last_error(void);
// "cuda" or "host": what this library was built as.
PEBBLE_API const char * pebble_backend   (void);

#ifdef __cplusplus
}
#endif
