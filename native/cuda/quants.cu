// cuda/quants.cu: the table of the types with kernels (cuda/quants.cuh) answering the rest of the library
// and the ABI: a type's GGUF name, its block's elements and bytes (pebble_type_block, and type_block for
// the store's checks of a tensor's shape), and whether a matrix is whole rows of its blocks.

#include "cuda/quants.cuh"

#include <cinttypes>

using namespace pebble_internal;

namespace pebble_internal {

// GGUF type names, for messages (ids without a type are left empty).
const char * type_name(int32_t ggml_type) {
    static const char * const names[PEBBLE_TYPE_COUNT] = {
        "F32", "F16", "Q4_0", "Q4_1", nullptr, nullptr, "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K",
        "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S",
        "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16", nullptr, nullptr, nullptr,
        "TQ1_0", "TQ2_0", nullptr, nullptr, nullptr, "MXFP4", "NVFP4", "Q1_0",
    };
    const char * name = ggml_type >= 0 && ggml_type < PEBBLE_TYPE_COUNT ? names[ggml_type] : nullptr;
    return name ? name : "?";
}

const char * ggml_type_name(int32_t ggml_type) { return type_name(ggml_type); }

bool type_block(int32_t ggml_type, int64_t * block_elements, int64_t * block_bytes) {
    return visit_type(ggml_type, [&](auto t) {
        *block_elements = decltype(t)::block_elements;
        *block_bytes    = decltype(t)::block_bytes;
    });
}

pebble_status check_matrix(const char * fn, const char * what, int32_t ggml_type, int64_t n_rows, int64_t n_cols) {
    return with_type(ggml_type, fn, [&](auto t) {
        using T = decltype(t);
        if (n_rows < 1 || n_cols < 1 || n_cols % T::block_elements != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %s: %s %" PRId64 " x %" PRId64 ": rows of whole %d-element "
                        "blocks are needed", fn, what, type_name(T::id), n_rows, n_cols, T::block_elements);
        }
        return PEBBLE_OK;
    });
}

} // namespace pebble_internal

// ---------------------------------------------------------------------------------------------------
// quantized tensors

extern "C" pebble_status pebble_type_block(int32_t ggml_type, int64_t * block_elements, int64_t * block_bytes) {
    return with_type(ggml_type, __func__, [&](auto t) {
        using T = decltype(t);
        if (!block_elements || !block_bytes) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_type_block: %s: block_elements and block_bytes must "
                        "not be NULL", type_name(T::id));
        }
        *block_elements = T::block_elements;
        *block_bytes    = T::block_bytes;
        return PEBBLE_OK;
    });
}
