// test_pebble.c: drives the C ABI (the store, the quantized kernels, the decode step) from C, built
// against the sanitized host library, so that LeakSanitizer sees every allocation the library makes
// (Python's own would drown it out).
#include "pebble.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

static int failures = 0;

#define EXPECT(cond)                                                                  \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "%s:%d: expected %s (last error: %s)\n", __FILE__, __LINE__, \
                    #cond, pebble_last_error());                                      \
            failures++;                                                               \
        }                                                                             \
    } while (0)

static void fill(unsigned char * buf, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(seed * 31u + i * 7u);
}

// Two decode steps of one sequence at position 0, each from x = 1 (n elements), each giving `want`.
static void two_steps_of_ones(pebble_decoder_t d, float * x, const float * want, int n) {
    int32_t seqs[1] = {0};
    int64_t pos[1] = {0};
    for (int step = 0; step < 2; step++) {
        for (int i = 0; i < n; i++) x[i] = 1.0f;
        EXPECT(pebble_decoder_step(d, 1, seqs, pos, x, NULL, NULL) == PEBBLE_OK &&
               memcmp(x, want, sizeof(float) * (size_t)n) == 0);
    }
}

int main(void) {
    enum { N = 4096 };
    unsigned char src[N], dst[N];
    pebble_store_t s = NULL;

    EXPECT(pebble_init(2 * N, 4, PEBBLE_STRATEGY_NONE, 0, 0, &s) == PEBBLE_OK);
    for (int layer = 0; layer < 4; layer++) {
        fill(src, N, (unsigned)layer);
        EXPECT(pebble_save(s, layer, 0, src, N, NULL, PEBBLE_TIER_DEVICE, NULL) == PEBBLE_OK);
    }
    struct pebble_stats st;
    EXPECT(pebble_stats(s, &st) == PEBBLE_OK);
    EXPECT(st.device_bytes == 2 * N && st.evictions == 2 && st.host_bytes == 2 * N);

    for (int layer = 0; layer < 4; layer++) {
        fill(src, N, (unsigned)layer);
        EXPECT(pebble_restore(s, layer, 0, dst, N, NULL) == PEBBLE_OK);
        EXPECT(memcmp(src, dst, N) == 0);
    }
    EXPECT(pebble_prefetch(s, 0, NULL) == PEBBLE_OK);
    EXPECT(pebble_write(s, 0, 0, 16, src, 32, NULL) == PEBBLE_OK);
    EXPECT(pebble_restore(s, 9, 0, dst, N, NULL) == PEBBLE_ERR_LAYER_RANGE);
    EXPECT(pebble_restore(s, 1, 5, dst, N, NULL) == PEBBLE_ERR_UNKNOWN_ENTRY);
    EXPECT(pebble_restore(s, 1, 0, dst, N - 1, NULL) == PEBBLE_ERR_SIZE_MISMATCH);
    EXPECT(pebble_save(s, 1, 1, src, 3 * N, NULL, PEBBLE_TIER_DEVICE, NULL) == PEBBLE_ERR_TOO_LARGE);
    EXPECT(pebble_save(s, 1, 0, src, N / 2, NULL, PEBBLE_TIER_HOST, NULL) == PEBBLE_OK); // resize
    EXPECT(pebble_erase(s, 2, 0) == PEBBLE_OK);
    // every:2 keeps layers 0 and 2 resident; with room for one entry, layer 0 is on the device
    EXPECT(pebble_set_strategy(s, N, PEBBLE_STRATEGY_EVERY, 2) == PEBBLE_OK);
    struct pebble_entry_info info;
    EXPECT(pebble_entry_info(s, 0, 0, &info) == PEBBLE_OK && info.on_device && info.on_host);
    EXPECT(pebble_entry_info(s, 3, 0, &info) == PEBBLE_OK && !info.on_device && info.on_host);
    EXPECT(pebble_stats(s, &st) == PEBBLE_OK && st.device_bytes <= N);
    EXPECT(pebble_set_strategy(s, N, PEBBLE_STRATEGY_EVERY, 0) == PEBBLE_ERR_STRATEGY);
    EXPECT(pebble_synchronize(s) == PEBBLE_OK);
    EXPECT(pebble_free(s) == PEBBLE_OK);
    EXPECT(pebble_restore(s, 0, 0, dst, N, NULL) == PEBBLE_ERR_CLOSED);
    EXPECT(pebble_free(s) == PEBBLE_ERR_CLOSED);
    EXPECT(pebble_init(N, 4, PEBBLE_STRATEGY_EVERY, 0, 0, &s) == PEBBLE_ERR_STRATEGY && s == NULL);

    // Borrowed bytes (here on the stack: freeing them would stop the sanitizer) are read, written only
    // through a copy of the entry's own, and never freed, whether prefetched, evicted, erased or freed.
    {
        unsigned char lent[N], before[N];
        int32_t kept = -1;
        fill(lent, N, 7u);
        memcpy(before, lent, N);
        EXPECT(pebble_init(N, 2, PEBBLE_STRATEGY_NONE, 0, 0, &s) == PEBBLE_OK);
        EXPECT(pebble_save_borrowed(s, 0, 0, lent, N, NULL, &kept) == PEBBLE_OK && kept == 1);
        EXPECT(pebble_save_borrowed(s, 1, 0, lent, N, NULL, NULL) == PEBBLE_OK);
        EXPECT(pebble_prefetch(s, 0, NULL) == PEBBLE_OK);
        EXPECT(pebble_prefetch(s, 1, NULL) == PEBBLE_OK); // no room: layer 0's copy stays
        EXPECT(pebble_set_strategy(s, N, PEBBLE_STRATEGY_MINIMAL, 0) == PEBBLE_OK); // evicted
        EXPECT(pebble_restore(s, 0, 0, dst, N, NULL) == PEBBLE_OK && memcmp(dst, before, N) == 0);
        EXPECT(pebble_write(s, 1, 0, 0, src, 64, NULL) == PEBBLE_OK);
        EXPECT(memcmp(lent, before, N) == 0);
        EXPECT(pebble_restore(s, 1, 0, dst, N, NULL) == PEBBLE_OK && memcmp(dst, src, 64) == 0);
        EXPECT(pebble_erase(s, 0, 0) == PEBBLE_OK);
        EXPECT(pebble_save_borrowed(s, 0, 0, NULL, N, NULL, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
        EXPECT(pebble_save_borrowed(s, 5, 0, lent, N, NULL, NULL) == PEBBLE_ERR_LAYER_RANGE);
        EXPECT(pebble_free(s) == PEBBLE_OK);
        EXPECT(memcmp(lent, before, N) == 0);
    }

    // leases: a leased device buffer outlives what frees its entry's copy (erase, pebble_free) and is freed
    // by its last release. Freed too early, the reads below are a use-after-free; never freed, a leak.
    {
        void * a = NULL, * again = NULL, * b = NULL;
        uint64_t nbytes = 0;
        fill(src, N, 7u);
        EXPECT(pebble_init(2 * N, 2, PEBBLE_STRATEGY_NONE, 0, 0, &s) == PEBBLE_OK);
        EXPECT(pebble_save(s, 0, 0, src, N, NULL, PEBBLE_TIER_DEVICE, NULL) == PEBBLE_OK);
        EXPECT(pebble_save(s, 0, 1, src, N, NULL, PEBBLE_TIER_DEVICE, NULL) == PEBBLE_OK);
        EXPECT(pebble_device_acquire(s, 0, 0, &a, &nbytes) == PEBBLE_OK && a != NULL && nbytes == N);
        EXPECT(pebble_device_acquire(s, 0, 0, &again, NULL) == PEBBLE_OK && again == a);
        EXPECT(pebble_device_acquire(s, 0, 1, &b, NULL) == PEBBLE_OK && b != a);
        EXPECT(pebble_device_acquire(s, 0, 5, &again, NULL) == PEBBLE_ERR_UNKNOWN_ENTRY);
        EXPECT(pebble_device_acquire(s, 0, 0, NULL, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
        EXPECT(pebble_erase(s, 0, 0) == PEBBLE_OK); // detached, not freed
        EXPECT(pebble_stats(s, &st) == PEBBLE_OK && st.device_bytes == N);
        EXPECT(memcmp(a, src, N) == 0);
        EXPECT(pebble_device_release(a) == PEBBLE_OK); // one of two
        EXPECT(memcmp(a, src, N) == 0);
        EXPECT(pebble_device_release(a) == PEBBLE_OK); // the last: freed here
        EXPECT(pebble_device_release(a) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "no lease") != NULL);
        EXPECT(pebble_device_release(NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
        EXPECT(pebble_free(s) == PEBBLE_OK); // b, still leased, outlives the store
        EXPECT(memcmp(b, src, N) == 0);
        EXPECT(pebble_device_release(b) == PEBBLE_OK);

        // released while still the entry's copy: the store keeps it, and frees it itself
        EXPECT(pebble_init(N, 1, PEBBLE_STRATEGY_NONE, 0, 0, &s) == PEBBLE_OK);
        EXPECT(pebble_save(s, 0, 0, src, N, NULL, PEBBLE_TIER_DEVICE, NULL) == PEBBLE_OK);
        EXPECT(pebble_device_acquire(s, 0, 0, &a, NULL) == PEBBLE_OK);
        EXPECT(pebble_device_release(a) == PEBBLE_OK);
        EXPECT(pebble_restore(s, 0, 0, dst, N, NULL) == PEBBLE_OK && memcmp(dst, src, N) == 0);
        EXPECT(pebble_free(s) == PEBBLE_OK);
    }

    // quantized kernels: a Q8_0 tensor of two blocks (d = 0.5, then d = -2), dequantized and multiplied
    unsigned char q8[2 * 34];
    memset(q8, 0, sizeof q8);
    q8[0] = 0x00; q8[1] = 0x38;  // fp16 0.5
    q8[34] = 0x00; q8[35] = 0xc0; // fp16 -2
    for (int i = 0; i < 32; i++) {
        q8[2 + i]  = (unsigned char)(i - 16);
        q8[36 + i] = (unsigned char)(i == 0 ? 0x80 : 1); // -128, then 1s
    }
    uint16_t half[64];
    EXPECT(pebble_dequantize(8, q8, sizeof q8, half, 64, NULL) == PEBBLE_OK);
    EXPECT(half[0] == 0xc800 && half[17] == 0x3800 && half[32] == 0x5c00 && half[33] == 0xc000); // -8, .5, 256, -2
    int64_t block_elements = 0, block_bytes = 0;
    EXPECT(pebble_type_block(12, &block_elements, &block_bytes) == PEBBLE_OK && block_elements == 256 &&
           block_bytes == 144);
    uint16_t ones[2 * 32];
    for (int i = 0; i < 64; i++) ones[i] = 0x3c00; // fp16 1
    float y[4] = {0, 0, 0, 0};
    // one row of 64 elements: 0.5 * sum(i - 16) + (-2) * (-128 + 31) = -8 + 194. The host library
    // multiplies x quantized to 8-bit blocks (1 = 127 * (1 / 127) in float32), so within float32 rounding.
#define NEAR(a, b) (fabsf((a) - (b)) <= 1e-5f * fabsf(b))
    EXPECT(pebble_matvec(8, q8, sizeof q8, 1, 64, ones, 1, y, NULL) == PEBBLE_OK && NEAR(y[0], 186.0f));
    // two rows of 32, two vectors: y[v * 2 + r]
    EXPECT(pebble_matvec(8, q8, sizeof q8, 2, 32, ones, 2, y, NULL) == PEBBLE_OK && NEAR(y[0], -8.0f) &&
           NEAR(y[1], 194.0f) && NEAR(y[2], -8.0f) && NEAR(y[3], 194.0f));
    EXPECT(pebble_dequantize(99, q8, sizeof q8, half, 64, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
    EXPECT(pebble_dequantize(16, q8, sizeof q8, half, 64, NULL) == PEBBLE_ERR_INVALID_ARGUMENT &&
           strstr(pebble_last_error(), "IQ2_XXS") != NULL);
    EXPECT(pebble_dequantize(8, q8, sizeof q8 - 1, half, 64, NULL) == PEBBLE_ERR_SIZE_MISMATCH);
    EXPECT(pebble_dequantize(8, NULL, sizeof q8, half, 64, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
    // the same two blocks as a table of two rows of 32, gathered in float32: row 1, then row 0
    float rows_out[2 * 32];
    const int64_t picked[2] = {1, 0};
    EXPECT(pebble_dequantize_rows(8, q8, sizeof q8, 32, picked, 2, rows_out) == PEBBLE_OK &&
           rows_out[0] == 256.0f && rows_out[1] == -2.0f && rows_out[32] == -8.0f && rows_out[49] == 0.5f);
    const int64_t past[1] = {2};
    EXPECT(pebble_dequantize_rows(8, q8, sizeof q8, 32, past, 1, rows_out) == PEBBLE_ERR_INVALID_ARGUMENT &&
           strstr(pebble_last_error(), "rows[0] is 2") != NULL);
    EXPECT(pebble_dequantize_rows(8, q8, sizeof q8 - 1, 32, picked, 2, rows_out) == PEBBLE_ERR_SIZE_MISMATCH);
    EXPECT(pebble_dequantize_rows(8, q8, sizeof q8, 32, NULL, 2, rows_out) == PEBBLE_ERR_INVALID_ARGUMENT);
    EXPECT(pebble_matvec(8, q8, sizeof q8, 1, 48, ones, 1, y, NULL) == PEBBLE_ERR_SIZE_MISMATCH);
    EXPECT(pebble_matvec(8, q8, sizeof q8, 1, 64, ones, 9, y, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
    EXPECT(pebble_matvec(8, q8, sizeof q8, 1, 64, NULL, 1, y, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
    // float32 vectors, rounded to fp16 by the library: 1 + 2^-12 rounds to 1, so the products are the same
    float ones_f32[2 * 32], y32[4] = {0, 0, 0, 0};
    for (int i = 0; i < 64; i++) ones_f32[i] = 1.0f + 1.0f / 4096;
    EXPECT(pebble_matmul_f32(8, q8, sizeof q8, 2, 32, ones_f32, 2, y32, NULL) == PEBBLE_OK &&
           memcmp(y32, y, sizeof y) == 0);
    EXPECT(pebble_matmul_f32(8, q8, sizeof q8, 2, 32, NULL, 2, y32, NULL) == PEBBLE_ERR_INVALID_ARGUMENT &&
           strstr(pebble_last_error(), "x") != NULL);
    EXPECT(pebble_matmul_f32(8, q8, sizeof q8, 2, 32, ones_f32, 0, y32, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);

    // the decode step: q = k = 0 makes attention a plain mean of the V rows; wv and wo are identities,
    // the feed-forward's gate is 0. With x = 1 (unit RMS) and row 0 of V at 3: V row 1 becomes x, the
    // mean of rows 0..1 is 2, and x comes out 1 + 2 = 3. The output's norm and identity matrix then give
    // logits of 1 (3 at unit RMS).
    {
        enum { E = 4 };
        float zero[E * E] = {0}, eye[E * E] = {0}, ones_f[E], cos_[3 * E], sin_[3 * E] = {0}, x[2 * E], logits[2 * E];
        float k0[2 * E], v0[2 * E], k1[2 * E] = {0}, v1[2 * E] = {0};
        for (int i = 0; i < E; i++) {
            eye[i * E + i] = 1.0f;
            ones_f[i] = cos_[i] = cos_[E + i] = cos_[2 * E + i] = x[i] = x[E + i] = 1.0f;
            k0[i] = k0[E + i] = 5.0f;
            v0[i] = 3.0f;
            v0[E + i] = 5.0f;
        }
        struct pebble_tensor_ref f32_zero = {0, zero}, f32_eye = {0, eye}, f32_ones = {0, ones_f};
        struct pebble_step_layer layer = {
            {E, 1, 1, E, E, 0, 0, 0.0f, 0, 0, 0.0f, 1.0f}, // SwiGLU, no ring
            {f32_ones, f32_zero, f32_zero, f32_eye, f32_eye, f32_ones, f32_zero, f32_zero, f32_zero,
             {0, NULL}, {0, NULL}, {0, NULL}, {0, NULL}, {0, NULL}, {0, NULL}, {0, NULL}},
            cos_, sin_, 3, 2, 0.5f};
        layer.shape.kv_layer = -1; // caches of its own (0 would read layer 0's)
        struct pebble_step_model model = {1, E, E, 2, 0, 0.0f, 1.0f, 0.0f, f32_ones, f32_eye};
        void * ks[2] = {k0, k1}, * vs[2] = {v0, v1};
        pebble_decoder_t d = NULL;
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_OK && d != NULL);
        int32_t seqs[2] = {0, 1};
        int64_t pos[2] = {1, 0};
        EXPECT(pebble_decoder_step(d, 2, seqs, pos, x, logits, NULL) == PEBBLE_OK);
        for (int i = 0; i < E; i++) {
            EXPECT(x[i] == 3.0f && logits[i] == 1.0f);
            EXPECT(x[E + i] == 2.0f);                       // sequence 1 attends over its own row 0 alone
            EXPECT(k0[E + i] == 0.0f && v0[E + i] == 1.0f); // row 1 written
            EXPECT(k0[i] == 5.0f && v0[i] == 3.0f);         // row 0 untouched
            EXPECT(v1[i] == 1.0f && v1[E + i] == 0.0f);
        }
        struct pebble_decoder_stats stats;
        EXPECT(pebble_decoder_stats(d, &stats) == PEBBLE_OK && stats.steps == 1 && stats.tokens == 2 &&
               stats.layer_passes == 1);
        pos[0] = 2; // past the cache
        EXPECT(pebble_decoder_step(d, 1, seqs, pos, x, NULL, NULL) == PEBBLE_ERR_SIZE_MISMATCH);
        pos[0] = 1;
        seqs[1] = 0;
        EXPECT(pebble_decoder_step(d, 2, seqs, pos, x, NULL, NULL) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "at most once") != NULL);
        seqs[1] = 2;
        EXPECT(pebble_decoder_step(d, 2, seqs, pos, x, NULL, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
        EXPECT(pebble_decoder_step(d, 0, seqs, pos, x, NULL, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
        EXPECT(pebble_decoder_step(d, 3, seqs, pos, x, NULL, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
        EXPECT(pebble_decoder_free(d) == PEBBLE_OK);
        EXPECT(pebble_decoder_step(d, 1, seqs, pos, x, NULL, NULL) == PEBBLE_ERR_CLOSED);
        EXPECT(pebble_decoder_free(d) == PEBBLE_ERR_CLOSED);
        EXPECT(pebble_decoder_free(NULL) == PEBBLE_OK);

        layer.shape.ring = 1; // a ring of 2 rows: position 2 is row 0, and rows 0 and 1 are attended
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_OK);
        seqs[0] = 0;
        pos[0] = 2;
        EXPECT(pebble_decoder_step(d, 1, seqs, pos, x, NULL, NULL) == PEBBLE_OK);
        for (int i = 0; i < E; i++) EXPECT(k0[i] == 0.0f && v0[i] == 1.0f); // row 0 rewritten
        EXPECT(pebble_decoder_free(d) == PEBBLE_OK);
        model.graphs = 1; // the same batch twice running is captured, then replayed (counted on the host)
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_OK);
        for (int step = 0; step < 4; step++) {
            pos[0] = step % 3; // positions change; the batch does not
            EXPECT(pebble_decoder_step(d, 1, seqs, pos, x, NULL, NULL) == PEBBLE_OK);
        }
        EXPECT(pebble_decoder_stats(d, &stats) == PEBBLE_OK && stats.steps == 4 && stats.graphs_captured == 1 &&
               stats.graph_replays == 2 && stats.graphs_dropped == 0);
        EXPECT(pebble_decoder_free(d) == PEBBLE_OK);
        model.graphs = 0;

        // streamed: the same layer's weights and caches as entries of a store, copied into the decoder's
        // slot for the step and the new K/V rows written back; the same results as resident
        layer.shape.ring = 0;
        pebble_store_t st = NULL;
        EXPECT(pebble_init(1 << 20, 1, PEBBLE_STRATEGY_NONE, 0, 0, &st) == PEBBLE_OK);
        const float * srcs[9] = {ones_f, zero, zero, eye, eye, ones_f, zero, zero, zero};
        for (int f = 0; f < 9; f++) {
            const uint64_t bytes = (f == 0 || f == 5 ? E : E * E) * sizeof(float);
            EXPECT(pebble_save(st, 0, f, srcs[f], bytes, NULL, PEBBLE_TIER_HOST, NULL) == PEBBLE_OK);
        }
        float kv_init[4][2 * E];
        memset(kv_init, 0, sizeof kv_init);
        for (int i = 0; i < E; i++) kv_init[0][i] = 5.0f, kv_init[1][i] = 3.0f; // sequence 0's row 0
        int32_t kv_ids[4] = {100, 101, 102, 103};
        for (int c = 0; c < 4; c++) EXPECT(pebble_save(st, 0, kv_ids[c], kv_init[c], sizeof kv_init[c], NULL,
                                                       PEBBLE_TIER_HOST, NULL) == PEBBLE_OK);
        struct pebble_step_layer streamed = layer;
        streamed.streamed = 1;
        for (int f = 0; f < PEBBLE_LAYER_WEIGHTS; f++) streamed.weight_ids[f] = f < 9 ? f : -1;
        struct pebble_step_model smodel = model;
        smodel.store = st;
        smodel.kv_ids = kv_ids;
        smodel.graphs = 1;
        void * no_caches[2] = {NULL, NULL};
        EXPECT(pebble_decoder_create(&smodel, &streamed, no_caches, no_caches, &d) == PEBBLE_OK);
        for (int i = 0; i < 2 * E; i++) x[i] = 1.0f;
        seqs[0] = 0, seqs[1] = 1, pos[0] = 1, pos[1] = 0;
        EXPECT(pebble_decoder_step(d, 2, seqs, pos, x, logits, NULL) == PEBBLE_OK);
        float row[E];
        for (int i = 0; i < E; i++) EXPECT(x[i] == 3.0f && logits[i] == 1.0f && x[E + i] == 2.0f);
        EXPECT(pebble_read(st, 0, 100, E * sizeof(float), row, sizeof row, NULL) == PEBBLE_OK && row[0] == 0.0f);
        EXPECT(pebble_read(st, 0, 101, E * sizeof(float), row, sizeof row, NULL) == PEBBLE_OK && row[0] == 1.0f);
        EXPECT(pebble_read(st, 0, 101, 0, row, sizeof row, NULL) == PEBBLE_OK && row[0] == 3.0f); // row 0 kept
        EXPECT(pebble_read(st, 0, 103, 0, row, sizeof row, NULL) == PEBBLE_OK && row[0] == 1.0f);
        EXPECT(pebble_decoder_step(d, 2, seqs, pos, x, logits, NULL) == PEBBLE_OK);
        EXPECT(pebble_decoder_stats(d, &stats) == PEBBLE_OK && stats.graphs_captured == 0 && stats.graph_replays == 0);
        EXPECT(pebble_decoder_free(d) == PEBBLE_OK);
        static uint8_t given[4096]; // the caller's slot: used as it is, or refused where too small
        smodel.slots[0] = given;
        smodel.slot_bytes = sizeof given;
        EXPECT(pebble_decoder_create(&smodel, &streamed, no_caches, no_caches, &d) == PEBBLE_OK);
        for (int i = 0; i < 2 * E; i++) x[i] = 1.0f;
        pos[0] = 1, pos[1] = 0;
        EXPECT(pebble_decoder_step(d, 2, seqs, pos, x, logits, NULL) == PEBBLE_OK);
        for (int i = 0; i < E; i++) EXPECT(x[i] == 3.0f && x[E + i] == 2.0f);
        EXPECT(pebble_decoder_free(d) == PEBBLE_OK);
        smodel.slot_bytes = 64;
        EXPECT(pebble_decoder_create(&smodel, &streamed, no_caches, no_caches, &d) == PEBBLE_ERR_SIZE_MISMATCH &&
               strstr(pebble_last_error(), "slot") != NULL);
        smodel.slots[0] = NULL;
        smodel.slot_bytes = 0;
        streamed.weight_ids[1] = 5; // the entry of a vector where a matrix belongs
        EXPECT(pebble_decoder_create(&smodel, &streamed, no_caches, no_caches, &d) == PEBBLE_ERR_SIZE_MISMATCH &&
               strstr(pebble_last_error(), "wq") != NULL);
        streamed.weight_ids[1] = 1;
        smodel.store = NULL;
        EXPECT(pebble_decoder_create(&smodel, &streamed, no_caches, no_caches, &d) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "store") != NULL);
        EXPECT(pebble_free(st) == PEBBLE_OK);
        layer.shape.ring = 2;
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "ring") != NULL && strstr(pebble_last_error(), "layer 0") != NULL);
        layer.shape.ring = 0;
        layer.weights.wq.data = NULL;
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "wq") != NULL);
        layer.weights.wq.data = zero;
        ks[1] = NULL;
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "sequence 1") != NULL);
        ks[1] = k1;
        model.n_seq = 0;
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_INVALID_ARGUMENT);
    }

    // a layer of experts: 2 experts of 4, 1 used. The router scores expert 1 above expert 0 for x = 1; the
    // experts' merged rows as one tensor each, or each expert an entry of a store, with a cache of 0 or 1
    // experts: the same hidden state, and the cache's hits and misses counted.
    {
        enum { E = 4, X = 2 };
        float zero[E * E] = {0}, eye[E * E] = {0}, ones_f[E], cos_[2 * E], sin_[2 * E] = {0};
        float router[X * E] = {0}, gate[X * E * E], up[X * E * E], down[X * E * E];
        for (int i = 0; i < E; i++) {
            eye[i * E + i] = 1.0f;
            ones_f[i] = cos_[i] = cos_[E + i] = 1.0f;
            router[E + i] = 1.0f;                                    // expert 1 scores 4, expert 0 scores 0
        }
        for (int i = 0; i < X * E * E; i++) gate[i] = up[i] = down[i] = (float)((i * 7) % 5) / 8.0f;
        struct pebble_tensor_ref f32_zero = {0, zero}, f32_eye = {0, eye}, f32_ones = {0, ones_f}, none = {0, NULL};
        struct pebble_step_layer layer = {
            {E, 1, 1, E, E, 0, 0, 0.0f, 0, 0, 0.0f, 1.0f, X, 1, E, 0, 1, 1.0f},
            {f32_ones, f32_zero, f32_zero, f32_eye, f32_eye, f32_ones, none, none, none, none, none, none, none, none,
             none, none, {0, router}, {0, gate}, {0, up}, {0, down}, none, none, none, none},
            cos_, sin_, 2, 2, 0.5f};
        layer.shape.kv_layer = -1; // caches of its own
        struct pebble_step_model model = {1, E, E, 1, 0, 0.0f, 1.0f, 0.0f, f32_ones, f32_eye};
        float k0[2 * E] = {0}, v0[2 * E] = {0}, x[E], merged[E];
        void * ks[1] = {k0}, * vs[1] = {v0};
        int32_t seqs[1] = {0};
        int64_t pos[1] = {0};
        pebble_decoder_t d = NULL;
        struct pebble_decoder_stats stats;
        for (int i = 0; i < E; i++) x[i] = 1.0f;
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_OK);
        EXPECT(pebble_decoder_step(d, 1, seqs, pos, x, NULL, NULL) == PEBBLE_OK);
        EXPECT(pebble_decoder_stats(d, &stats) == PEBBLE_OK && stats.graphs_captured == 0);
        EXPECT(pebble_decoder_free(d) == PEBBLE_OK);
        memcpy(merged, x, sizeof x);
        EXPECT(x[0] != 1.0f); // the expert's FFN added something
        pebble_store_t st = NULL;
        EXPECT(pebble_init(1 << 20, 1, PEBBLE_STRATEGY_MINIMAL, 0, 0, &st) == PEBBLE_OK);
        for (int j = 0; j < X; j++) { // expert j: its gate rows, up rows, down rows
            float entry[3 * E * E];
            memcpy(entry, gate + j * E * E, sizeof(float) * E * E);
            memcpy(entry + E * E, up + j * E * E, sizeof(float) * E * E);
            memcpy(entry + 2 * E * E, down + j * E * E, sizeof(float) * E * E);
            EXPECT(pebble_save(st, 0, 50 + j, entry, sizeof entry, NULL, PEBBLE_TIER_HOST, NULL) == PEBBLE_OK);
        }
        model.store = st;
        layer.experts_stored = 1, layer.expert_ids = 50;
        layer.weights.ffn_gate_exps.data = layer.weights.ffn_up_exps.data = layer.weights.ffn_down_exps.data = NULL;
        for (int cache = 0; cache < 2; cache++) {
            layer.expert_cache = cache;
            memset(k0, 0, sizeof k0), memset(v0, 0, sizeof v0);
            EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_OK);
            two_steps_of_ones(d, x, merged, E);
            EXPECT(pebble_decoder_stats(d, &stats) == PEBBLE_OK && stats.expert_hits == (uint64_t)cache &&
                   stats.expert_misses == (uint64_t)(2 - cache) &&
                   stats.expert_bytes_restored == (uint64_t)(2 - cache) * 3 * E * E * sizeof(float) &&
                   stats.expert_guesses == 0 && stats.expert_device_bytes == 256); // one slot: cache or staging
            EXPECT(pebble_decoder_free(d) == PEBBLE_OK);
        }
        // prefetch: the router on x entering the layer guesses expert 1, which the layer then runs: restored
        // early into the staging slot and run from there (no cache), or taken into the cache at the first
        // step and found there at the second (cache 1); the same hidden state either way.
        model.expert_prefetch = 1;
        for (int cache = 0; cache < 2; cache++) {
            layer.expert_cache = cache;
            memset(k0, 0, sizeof k0), memset(v0, 0, sizeof v0);
            EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_OK);
            two_steps_of_ones(d, x, merged, E);
            const uint64_t early = cache ? 1 : 2;
            EXPECT(pebble_decoder_stats(d, &stats) == PEBBLE_OK && stats.expert_hits == 2 && stats.expert_misses == 0 &&
                   stats.expert_guesses == 2 && stats.expert_guesses_right == 2 && stats.expert_prefetches == early &&
                   stats.expert_prefetch_hits == early &&
                   stats.expert_bytes_restored == early * 3 * E * E * sizeof(float) &&
                   stats.expert_device_bytes == (uint64_t)(1 + cache) * 256);
            EXPECT(pebble_decoder_free(d) == PEBBLE_OK);
        }
        model.expert_prefetch = 2;
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "expert_prefetch 2") != NULL);
        model.expert_prefetch = 0, model.expert_policy = 2;
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "expert_policy 2") != NULL);
        model.expert_policy = 1;  // least often used: with one slot, the same as least recently used here
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_OK);
        EXPECT(pebble_decoder_free(d) == PEBBLE_OK);
        model.expert_policy = 0;
        layer.expert_cache = 3; // more than the layer's experts
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "expert_cache") != NULL);
        layer.expert_cache = 1, layer.expert_ids = 51; // expert 1 is then entry 52, which does not exist
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_SIZE_MISMATCH &&
               strstr(pebble_last_error(), "expert 1 (tensor 52)") != NULL);
        layer.expert_ids = 50, layer.shape.n_expert_used = 3; // more used than there are
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "n_expert_used") != NULL);
        layer.shape.n_expert_used = 1, layer.weights.w_gate = f32_eye; // a dense FFN beside the experts
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "ffn_gate_inp_s must not be NULL: a dense FFN beside experts") != NULL);
        EXPECT(pebble_free(st) == PEBBLE_OK);
    }

    // pebble_attend: one query over a cache of 3 rows whose V rows are 1, 2, 3 and K rows 0 (a plain mean:
    // 2); then every malformed call refused before anything is read or written.
    {
        enum { ROWS = 3, HD = 4 };
        float q[HD] = {0}, k[ROWS * HD] = {0}, v[ROWS * HD], out[HD] = {0}, scratch[16];
        for (int r = 0; r < ROWS; r++) for (int i = 0; i < HD; i++) v[r * HD + i] = (float)(r + 1);
        void * kc[1] = {k}, * vc[1] = {v}, * none[1] = {NULL};
        int64_t n_pos[1] = {ROWS};
        uint64_t need = 0;
        EXPECT(pebble_attend_scratch_bytes(1, 1, ROWS, &need) == PEBBLE_OK && need <= sizeof scratch);
        EXPECT(pebble_attend(1, q, NULL, NULL, 0, kc, vc, n_pos, ROWS, 1, 1, HD, 1.0f, 0.0f, out, scratch,
                             sizeof scratch, NULL) == PEBBLE_OK && NEAR(out[0], 2.0f) && NEAR(out[3], 2.0f));
        EXPECT(pebble_attend(1, q, NULL, NULL, 0, none, vc, n_pos, ROWS, 1, 1, HD, 1.0f, 0.0f, out, scratch,
                             sizeof scratch, NULL) == PEBBLE_ERR_INVALID_ARGUMENT &&
               strstr(pebble_last_error(), "NULL cache") != NULL);
        EXPECT(pebble_attend(1, q, NULL, NULL, 0, kc, NULL, n_pos, ROWS, 1, 1, HD, 1.0f, 0.0f, out, scratch,
                             sizeof scratch, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
        n_pos[0] = ROWS + 1;
        EXPECT(pebble_attend(1, q, NULL, NULL, 0, kc, vc, n_pos, ROWS, 1, 1, HD, 1.0f, 0.0f, out, scratch,
                             sizeof scratch, NULL) == PEBBLE_ERR_SIZE_MISMATCH);
        n_pos[0] = ROWS;
        EXPECT(pebble_attend(1, q, NULL, NULL, 0, kc, vc, n_pos, ROWS, 1, 1, HD, 1.0f, 0.0f, out, scratch, 4,
                             NULL) == PEBBLE_ERR_SIZE_MISMATCH && strstr(pebble_last_error(), "scratch") != NULL);
        EXPECT(pebble_attend(0, q, NULL, NULL, 0, kc, vc, n_pos, ROWS, 1, 1, HD, 1.0f, 0.0f, out, scratch,
                             sizeof scratch, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
        // sizes whose byte offsets would overflow int64 are refused, not wrapped around into small ones
        EXPECT(pebble_attend(1, q, NULL, NULL, 0, kc, vc, n_pos, INT64_MAX / 8, 1, 1, 1 << 30, 1.0f, 0.0f,
                             out, scratch, UINT64_MAX, NULL) == PEBBLE_ERR_SIZE_MISMATCH &&
               strstr(pebble_last_error(), "too large") != NULL);
        EXPECT(pebble_attend(64, q, NULL, NULL, 0, kc, vc, n_pos, ROWS, 1 << 30, 1, 1 << 30, 1.0f, 0.0f, out,
                             scratch, UINT64_MAX, NULL) == PEBBLE_ERR_SIZE_MISMATCH);
        EXPECT(NEAR(out[0], 2.0f) && v[0] == 1.0f); // nothing written by a refused call
    }

    // pebble_attend over Q8_0 and Q4_0 caches (2 bytes of fp16 scale + 32 or 16 bytes a block of 32): rows
    // 1..4 written by the calls themselves (V all r, K all 0), then attended: the mean 2.5, within the
    // scale's fp16 rounding; a head_dim of part of a block is refused, naming it.
    {
        enum { ROWS = 4, HD = 32 };
        const int32_t types[2] = {8, 2};
        const int block_bytes[2] = {34, 18};
        for (int t = 0; t < 2; t++) {
            unsigned char k[ROWS * 34] = {0}, v[ROWS * 34] = {0};
            float q[HD] = {0}, k_new[HD] = {0}, v_new[HD], out[HD] = {0}, scratch[16];
            void * kc[1] = {k}, * vc[1] = {v};
            for (int r = 1; r <= ROWS; r++) {
                int64_t n_pos[1] = {r};
                for (int i = 0; i < HD; i++) v_new[i] = (float)r;
                EXPECT(pebble_attend(1, q, k_new, v_new, types[t], kc, vc, n_pos, ROWS, 1, 1, HD, 1.0f, 0.0f, out,
                                     scratch, sizeof scratch, NULL) == PEBBLE_OK);
            }
            EXPECT(fabsf(out[0] - 2.5f) < 2e-3f && fabsf(out[HD - 1] - 2.5f) < 2e-3f);
            EXPECT(v[block_bytes[t]] != 0 || v[block_bytes[t] + 1] != 0); // row 2's scale, written in place
            int64_t n_pos[1] = {2};
            EXPECT(pebble_attend(1, q, NULL, NULL, types[t], kc, vc, n_pos, ROWS, 1, 1, 24, 1.0f, 0.0f, out,
                                 scratch, sizeof scratch, NULL) == PEBBLE_ERR_INVALID_ARGUMENT &&
                   strstr(pebble_last_error(), "multiple of 32") != NULL);
        }
    }

    // a decoder whose caches or RoPE tables would be past what an int64 addresses is refused at create
    {
        enum { E = 4 };
        float w[E * E] = {0}, vec[E] = {1, 1, 1, 1}, rope[E] = {1, 1, 1, 1}, k[E], v[E];
        struct pebble_tensor_ref f32_w = {0, w}, f32_vec = {0, vec};
        struct pebble_step_layer layer = {
            {E, 1, 1, E, E, 0, 0, 0.0f, 0, 0, 0.0f, 1.0f},
            {f32_vec, f32_w, f32_w, f32_w, f32_w, f32_vec, f32_w, f32_w, f32_w,
             {0, NULL}, {0, NULL}, {0, NULL}, {0, NULL}, {0, NULL}, {0, NULL}, {0, NULL}},
            rope, rope, 1, INT64_MAX / 8, 1.0f};
        layer.shape.kv_layer = -1; // caches of its own
        struct pebble_step_model model = {1, E, E, 64, 0, 0.0f, 1.0f, 0.0f, f32_vec, f32_w};
        void * ks[64], * vs[64];
        for (int i = 0; i < 64; i++) { ks[i] = k; vs[i] = v; }
        pebble_decoder_t d = NULL;
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_SIZE_MISMATCH && d == NULL &&
               strstr(pebble_last_error(), "kv_rows") != NULL);
        layer.kv_rows = 1;
        layer.rope_rows = INT64_MAX / 4;
        EXPECT(pebble_decoder_create(&model, &layer, ks, vs, &d) == PEBBLE_ERR_SIZE_MISMATCH && d == NULL);
    }

    // a tensor description must describe the bytes saved (once kept as given)
    {
        pebble_store_t t = NULL;
        unsigned char b[68] = {0};
        EXPECT(pebble_init(1024, 1, PEBBLE_STRATEGY_NONE, 0, 0, &t) == PEBBLE_OK);
        struct pebble_tensor_desc f32_8 = {0, 1, {8, 0, 0, 0}}, q8_33 = {8, 2, {33, 2, 0, 0}},
                                  q8_17 = {8, 1, {17, 0, 0, 0}}, negative = {0, 2, {-4, -2, 0, 0}},
                                  zero = {0, 2, {4, 0, 0, 0}}, q8_ok = {8, 2, {32, 2, 0, 0}};
        EXPECT(pebble_save(t, 0, 0, b, 16, &f32_8, PEBBLE_TIER_AUTO, NULL) == PEBBLE_ERR_SIZE_MISMATCH &&
               strstr(pebble_last_error(), "32") != NULL && strstr(pebble_last_error(), "16") != NULL);
        EXPECT(pebble_save(t, 0, 0, b, 68, &q8_33, PEBBLE_TIER_AUTO, NULL) == PEBBLE_ERR_SIZE_MISMATCH &&
               strstr(pebble_last_error(), "Q8_0") != NULL);
        EXPECT(pebble_save(t, 0, 0, b, 34, &q8_17, PEBBLE_TIER_AUTO, NULL) == PEBBLE_ERR_SIZE_MISMATCH);
        EXPECT(pebble_save(t, 0, 0, b, 32, &negative, PEBBLE_TIER_AUTO, NULL) == PEBBLE_ERR_INVALID_ARGUMENT);
        EXPECT(pebble_save(t, 0, 0, b, 16, &zero, PEBBLE_TIER_AUTO, NULL) == PEBBLE_ERR_SIZE_MISMATCH);
        EXPECT(pebble_save_borrowed(t, 0, 0, b, 16, &f32_8, NULL) == PEBBLE_ERR_SIZE_MISMATCH);
        EXPECT(pebble_save(t, 0, 0, b, 68, &q8_ok, PEBBLE_TIER_AUTO, NULL) == PEBBLE_OK);
        struct pebble_stats ts;
        EXPECT(pebble_stats(t, &ts) == PEBBLE_OK && ts.entries == 1 && ts.saves == 1);
        EXPECT(pebble_free(t) == PEBBLE_OK);
    }

    if (failures) {
        fprintf(stderr, "test_pebble: %d failed\n", failures);
        return 1;
    }
    printf("test_pebble: all checks passed\n");
    return 0;
}
