// pebble_cpu.cc: the host library's CPU kernels (pebble_cpu.h).
//
// Decode on a CPU reads every weight once per token, so its speed is the speed of reading quantized
// bytes and multiplying them without expanding them to float. As llama.cpp's CPU backend does, the
// activation is quantized once per call to 8-bit blocks (per 256 elements for the K-quants, with sums
// of each 16; per 32 for the 32-element types), and each weight block is multiplied by it with integer
// SIMD dot products (AVX2's vpmaddubsw/vpmaddwd), its scales applied once per block. The instruction
// set is chosen at run time (__builtin_cpu_supports), so the library runs on any x86-64 (and, through
// the portable kernels, anywhere); the kernels are our own.
//
// Threads: one pool for the process, started on first use, its size the CPUs this process may run on
// (sched_getaffinity) or PEBBLING_THREADS. Work is handed out in small ranges that any thread takes
// from a shared counter, so a thread held up by a busy neighbour core delays one range, not a share;
// idle workers spin briefly and then sleep on a condition variable, so they take no core from others.

#include "pebble_cpu.h"
#include "pebble_cpu_simd.h"

#include "pebble_device.h"
#include "pebble_internal.h"
#include "pebble_kv.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#    define PEBBLE_X86 1
// GCC 12's AVX-512 headers start their undefined registers from themselves (GCC bug 105593), which
// -Wuninitialized reports wherever such an intrinsic is inlined; GCC 13's headers do not.
#    if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#        pragma GCC diagnostic ignored "-Wuninitialized"
#        pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#    endif
#    include <immintrin.h>
#endif

using pebble_internal::fail;
using pebble_internal::half_from_float;
using pebble_internal::half_to_float;
using pebble_internal::kv_block;
using pebble_internal::kv_blocked;
using pebble_internal::kv_block_bytes;
using pebble_internal::kv_f16;
using pebble_internal::kv_f32;
using pebble_internal::kv_load;
using pebble_internal::kv_q8_0;

namespace pebble_cpu {
namespace {

// ---------------------------------------------------------------------------------------------------
// the pool

constexpr int max_threads = 256;

// The threads to use and, for a malformed PEBBLING_THREADS, why it was refused (empty when accepted).
struct thread_setting {
    int  threads = 1;
    char error[256] = {};
};

thread_setting read_thread_setting() {
    thread_setting s;
    const char * simd = std::getenv("PEBBLING_SIMD");
    if (simd && *simd && std::strcmp(simd, "portable") != 0 && std::strcmp(simd, "auto") != 0 &&
        std::strcmp(simd, "avx2") != 0 && std::strcmp(simd, "gpu") != 0) {
        std::snprintf(s.error, sizeof s.error, "PEBBLING_SIMD is '%.40s'; 'auto' (the best this CPU has), 'avx2' "
                      "(no AVX-512 even where the CPU has it), 'portable' (no SIMD intrinsics) or 'gpu' (the GPU's "
                      "matvec kernels' code, slowly) is accepted", simd);
        return s;
    }
    const char * env = std::getenv("PEBBLING_THREADS");
    if (env && *env) {
        char * end = nullptr;
        errno = 0;
        const long n = std::strtol(env, &end, 10);
        if (errno || *end || n < 1 || n > max_threads) {
            std::snprintf(s.error, sizeof s.error, "PEBBLING_THREADS is '%.40s'; a whole number of threads from 1 "
                          "to %d is accepted (unset: one per CPU this process may run on)", env, max_threads);
            return s;
        }
        s.threads = static_cast<int>(n);
        return s;
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    const int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                               : static_cast<int>(std::thread::hardware_concurrency());
    s.threads = std::clamp(n, 1, max_threads);
    return s;
}

// A job's ranges are split into one stretch per thread, in order: each thread runs its own stretch from
// the front, range after range, so that what it reads lies in one run of memory (its prefetches, two
// groups of rows ahead, land in what it reads next); a thread whose stretch is done takes ranges from
// the back of the stretch with the most left. Against ranges handed out in turn (thread 0 range 0,
// thread 1 range 1, thread 0 range 2, ...), each thread's next range cold: one vector through
// Qwen2.5-1.5B's matrices on two threads of an AMD EPYC (Zen 4), 28 of each not in the CPU's caches, the
// two pools' libraries in turn in one process: 8960 x 1536 Q4_K 27.9 -> 30.1 GB/s, 1536 x 8960 Q6_K
// 26.1 -> 30.5, 1536 x 1536 Q4_K 29.0 -> 35.3.
// `state` packs the job's generation (16 bits) and number of ranges (24); each stretch, the generation
// and its next and end ranges (24 bits each): a worker that wakes late sees another generation, or no
// range left, and touches nothing of a job it did not claim part of. The caller waits until every range
// is done, not until every worker has looked.
class pool {
public:
    explicit pool(int threads) {
        for (int i = 0; i < threads - 1; i++) {
            try {
                workers_.emplace_back([this, i] { work(i + 1); });
            } catch (...) { // std::system_error: no more threads; the ones started share the work
                break;
            }
        }
        n_threads_ = static_cast<int>(workers_.size()) + 1;
    }

    int threads() const { return n_threads_; }

    // False when another call holds the pool: the caller then does the work itself.
    bool run(int64_t n_ranges, void (*fn)(void *, int64_t), void * ctx) {
        std::unique_lock<std::mutex> busy(submit_, std::try_to_lock);
        if (!busy.owns_lock()) return false;
        fn_ = fn;
        ctx_ = ctx;
        done_.store(0, std::memory_order_relaxed);
        const uint64_t generation = ((state_.load(std::memory_order_relaxed) >> 48) + 1) & 0xffff;
        for (int t = 0; t < n_threads_; t++) {
            const uint64_t first = static_cast<uint64_t>(n_ranges * t / n_threads_);
            const uint64_t end = static_cast<uint64_t>(n_ranges * (t + 1) / n_threads_);
            stretch_[t].v.store(pack(generation, first, end), std::memory_order_relaxed);
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            state_.store(generation << 48 | static_cast<uint64_t>(n_ranges) << 24, std::memory_order_release);
        }
        wake_.notify_all();
        drain(0); // the calling thread takes ranges too
        const auto spin_until = std::chrono::steady_clock::now() + spin_time;
        for (int spin = 0; done_.load(std::memory_order_acquire) < n_ranges; spin++) {
            if ((spin & 63) != 63 || std::chrono::steady_clock::now() < spin_until) {
                pause();
                continue;
            }
            std::unique_lock<std::mutex> lock(mutex_);
            waiting_ = true;
            finished_.wait(lock, [&] { return done_.load(std::memory_order_acquire) >= n_ranges; });
            waiting_ = false;
        }
        return true;
    }

private:
    // How long a thread waits by spinning before it sleeps: long enough to span the gap between the
    // matrix products of one decode step (the calls come microseconds apart), short enough that an
    // idle pool gives its cores back at once. Counted in time, as a pause lasts 10 to 150 cycles.
    static constexpr std::chrono::microseconds spin_time{50};

    static void pause() {
#ifdef PEBBLE_X86
        _mm_pause();
#else
        std::this_thread::yield();
#endif
    }

    static uint64_t pack(uint64_t generation, uint64_t next, uint64_t end) { return generation << 48 | next << 24 | end; }
    static uint64_t generation_of(uint64_t s) { return s >> 48; }
    static uint64_t next_of(uint64_t s) { return (s >> 24) & 0xffffff; }
    static uint64_t end_of(uint64_t s) { return s & 0xffffff; }

    // Claims one range of job `generation` from stretch t: its front (the owner) or its back (a thief).
    // -1 when the stretch has none left, or belongs to another job.
    int64_t claim(int t, uint64_t generation, bool front) {
        uint64_t s = stretch_[t].v.load(std::memory_order_acquire);
        for (;;) {
            if (generation_of(s) != generation || next_of(s) >= end_of(s)) return -1;
            const uint64_t taken = front ? pack(generation, next_of(s) + 1, end_of(s))
                                         : pack(generation, next_of(s), end_of(s) - 1);
            if (stretch_[t].v.compare_exchange_weak(s, taken, std::memory_order_acq_rel, std::memory_order_acquire)) {
                return static_cast<int64_t>(front ? next_of(s) : end_of(s) - 1);
            }
        }
    }

    // Runs ranges of the current job until none is left: thread `me`'s own stretch, then the others'.
    void drain(int me) {
        const uint64_t s = state_.load(std::memory_order_acquire);
        const uint64_t generation = s >> 48, n = (s >> 24) & 0xffffff;
        for (;;) {
            int64_t r = claim(me, generation, true);
            if (r < 0) { // steal from the stretch with the most left
                int most = -1;
                uint64_t left = 0;
                for (int t = 0; t < n_threads_; t++) {
                    const uint64_t st = stretch_[t].v.load(std::memory_order_acquire);
                    if (generation_of(st) == generation && next_of(st) < end_of(st) && end_of(st) - next_of(st) > left) {
                        most = t;
                        left = end_of(st) - next_of(st);
                    }
                }
                if (most < 0) return;
                r = claim(most, generation, false);
                if (r < 0) continue;
            }
            fn_(ctx_, r);
            if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<int64_t>(n)) {
                std::lock_guard<std::mutex> lock(mutex_);
                if (waiting_) finished_.notify_one();
            }
        }
    }

    void work(int me) {
        uint64_t seen = state_.load(std::memory_order_acquire) >> 48;
        for (;;) {
            const auto spin_until = std::chrono::steady_clock::now() + spin_time;
            for (int spin = 1; (state_.load(std::memory_order_acquire) >> 48) == seen; spin++) {
                if ((spin & 63) == 0 && std::chrono::steady_clock::now() >= spin_until) break;
                pause();
            }
            if ((state_.load(std::memory_order_acquire) >> 48) == seen) {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return (state_.load(std::memory_order_acquire) >> 48) != seen; });
            }
            seen = state_.load(std::memory_order_acquire) >> 48;
            drain(me);
        }
    }

    std::vector<std::thread> workers_;
    int n_threads_ = 1;
    std::mutex submit_, mutex_;
    std::condition_variable wake_, finished_;
    std::atomic<uint64_t> state_{0};
    struct alignas(64) stretch { std::atomic<uint64_t> v{0}; }; // a line each: claimed from by different threads
    stretch stretch_[max_threads];
    std::atomic<int64_t> done_{0};
    bool waiting_ = false;
    void (*fn_)(void *, int64_t) = nullptr;
    void * ctx_ = nullptr;
};

// The process's pool, made on first use. After fork() the child has none of the parent's threads: the
// parent's pool is forgotten there (not freed: its locks may be held) and the child makes its own.
std::atomic<pool *> g_pool{nullptr};
std::mutex g_pool_mutex;
thread_setting g_setting;
bool g_setting_read = false;

void forget_pool_in_child() {
    g_pool.store(nullptr);
    new (&g_pool_mutex) std::mutex;
}

const thread_setting & setting() {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    if (!g_setting_read) {
        g_setting = read_thread_setting();
        g_setting_read = true;
        pthread_atfork(nullptr, nullptr, forget_pool_in_child);
    }
    return g_setting;
}

pool * the_pool() {
    pool * p = g_pool.load(std::memory_order_acquire);
    if (p) return p;
    const thread_setting & s = setting();
    if (s.error[0] || s.threads <= 1) return nullptr;
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    p = g_pool.load(std::memory_order_acquire);
    if (!p) {
        p = new (std::nothrow) pool(s.threads);
        g_pool.store(p, std::memory_order_release);
    }
    return p;
}

// Work below this many multiply-adds (tens of microseconds on one core) is done on the calling thread:
// waking a sleeping worker costs as much, and its spinning afterwards takes a core that the server's
// other threads want (8 requests decoding together on a small model: 2094 tok/s with 2^18 here,
// 2310 with this and matmul's own measure of a decode call).
constexpr int64_t min_parallel_work = 1 << 20;

struct ranges_job {
    int64_t n, per_range;
    void (*fn)(void *, int64_t, int64_t);
    void * ctx;
};

} // namespace

void parallel_ranges(int64_t n, int64_t work, void (*fn)(void *, int64_t, int64_t), void * ctx) {
    if (n <= 0) return;
    pool * p = work >= min_parallel_work && n > 1 ? the_pool() : nullptr;
    if (!p) {
        fn(ctx, 0, n);
        return;
    }
    // Several ranges per thread, so that a slow thread's share is taken by the others.
    const int64_t ranges = std::min<int64_t>({n, int64_t(p->threads()) * 8, int64_t(1) << 23});
    ranges_job job{n, (n + ranges - 1) / ranges, fn, ctx};
    const int64_t n_ranges = (n + job.per_range - 1) / job.per_range;
    const bool ran = p->run(n_ranges, [](void * c, int64_t i) {
        const ranges_job & j = *static_cast<ranges_job *>(c);
        j.fn(j.ctx, i * j.per_range, std::min(j.n, (i + 1) * j.per_range));
    }, &job);
    if (!ran) fn(ctx, 0, n);
}

pebble_status check_threads(const char * fn) {
    const thread_setting & s = setting();
    if (s.error[0]) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s", fn, s.error);
    return PEBBLE_OK;
}

namespace {

// ---------------------------------------------------------------------------------------------------
// activations: x quantized to 8-bit blocks, once per call

// For the K-quants: 256 elements, d = max|x| / 127, q = round(x / d), and the sum of each 16 q.
struct q8_256 {
    float   d;
    int16_t sums[16];
    int8_t  qs[256];
};

// For the 32-element types: the same per 32 elements, with the sum of all 32.
struct q8_32 {
    float   d;
    int32_t sum;
    int8_t  qs[32];
};

enum class simd { portable, avx2, avx512 };

// The best instruction set this CPU has that PEBBLING_SIMD allows: 'portable' turns the SIMD kernels
// off and 'avx2' AVX-512's (to test each set on one machine); read_thread_setting refuses other values.
simd simd_in_use() {
#ifdef PEBBLE_X86
    static const simd level = [] {
        const char * env = std::getenv("PEBBLING_SIMD");
        const bool portable = env && std::strcmp(env, "portable") == 0, avx2_only = env && std::strcmp(env, "avx2") == 0;
        const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
        return portable || !avx2 ? simd::portable : avx512 && !avx2_only ? simd::avx512 : simd::avx2;
    }();
    return level;
#else
    return simd::portable;
#endif
}

#ifdef PEBBLE_X86
// quantize_block for N a multiple of 32, or false (nothing written) when the block holds an infinity or
// a NaN, which the scalar loop then takes. The products v * id round to nearest even in
// _mm256_cvtps_epi32, as std::nearbyint does.
template <int N>
__attribute__((target("avx2,fma,f16c"))) bool quantize_block_avx2(const uint16_t * x, float & d, int8_t * q) {
    static_assert(N % 32 == 0, "whole groups of 32");
    __m256 v[N / 8];
    __m256 amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    for (int i = 0; i < N / 8; i++) {
        v[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(x + 8 * i)));
        finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_mul_ps(v[i], zero), zero, _CMP_EQ_OQ)); // inf*0, NaN*0: NaN
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    if (_mm256_movemask_ps(finite) != 0xff) return false;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < N / 8; i += 4) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], id));
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 2], id)), e = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 3], id));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(q + 8 * i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    return true;
}
#endif

// n elements of fp16 x into d and q (the rounding is nearest-even, as numpy's rint: the stub's
// reference computes the very same q). A block with an infinity or NaN gets d = NaN and q = 0, so its
// products are NaN, as float products with it would be.
template <int N>
void quantize_block(const uint16_t * x, float & d, int8_t * q) {
#ifdef PEBBLE_X86
    if (simd_in_use() != simd::portable && quantize_block_avx2<N>(x, d, q)) return;
#endif
    float v[N], amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < N; i++) {
        v[i] = half_to_float(x[i]);
        finite = finite && std::isfinite(v[i]);
        amax = std::max(amax, std::fabs(v[i]));
    }
    if (!finite) {
        d = NAN;
        std::memset(q, 0, N);
        return;
    }
    d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < N; i++) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
}

void quantize_256(const uint16_t * x, int64_t n, q8_256 * out) {
    for (int64_t b = 0; b < n / 256; b++) {
        q8_256 & o = out[b];
        quantize_block<256>(x + 256 * b, o.d, o.qs);
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += o.qs[16 * g + i];
            o.sums[g] = static_cast<int16_t>(s);
        }
    }
}

void quantize_32(const uint16_t * x, int64_t n, q8_32 * out) {
    for (int64_t b = 0; b < n / 32; b++) {
        q8_32 & o = out[b];
        quantize_block<32>(x + 32 * b, o.d, o.qs);
        int s = 0;
        for (int i = 0; i < 32; i++) s += o.qs[i];
        o.sum = s;
    }
}

// float32 to fp16 bits, rounded to nearest even as numpy's astype(float16) and F16C's conversion round
// (out of range: +-inf), with F16C where the CPU has it.
#ifdef PEBBLE_X86
__attribute__((target("avx2,f16c"))) void to_half_f16c(const float * x, int64_t n, uint16_t * out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i *>(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; i < n; i++) out[i] = half_from_float(x[i]);
}
#endif

void to_half(const float * x, int64_t n, uint16_t * out) {
#ifdef PEBBLE_X86
    if (simd_in_use() != simd::portable) {
        to_half_f16c(x, n, out);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) out[i] = half_from_float(x[i]);
}

void to_float(const uint16_t * x, int64_t n, float * out) {
    for (int64_t i = 0; i < n; i++) out[i] = half_to_float(x[i]);
}

inline uint16_t u16(const uint8_t * p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
inline float f16(const uint8_t * p) { return half_to_float(u16(p)); }

// Q4_K's and Q5_K's 6-bit scale and min of sub-block j (GGML's layout; see type_q4_k in pebble_quant.cu).
inline void scale_min_k4(const uint8_t * s, int j, int & scale, int & min) {
    if (j < 4) {
        scale = s[j] & 63;
        min   = s[j + 4] & 63;
    } else {
        scale = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        min   = (s[j + 4] >> 4)  | ((s[j] >> 6) << 4);
    }
}

// ---------------------------------------------------------------------------------------------------
// row kernels: one weight row (nb blocks) times NV activations, each xs bytes after the last.
// out[v] = the dot product with activation v. Portable versions first: each block is decoded once to
// integers and multiplied by every activation.

enum kind { k_q4_0, k_q4_1, k_q5_0, k_q5_1, k_q8_0, k_q4_k, k_q5_k, k_q6_k, k_f32, k_f16, k_bf16 };

// A 32-element block as integers q and how its value follows: d * (q - offset) (+ m).
template <int K>
void decode_32(const uint8_t * b, int * q, float & d, float & m) {
    m = 0.0f;
    if constexpr (K == k_q8_0) {
        d = f16(b);
        for (int i = 0; i < 32; i++) q[i] = static_cast<int8_t>(b[2 + i]);
    } else if constexpr (K == k_q4_0 || K == k_q4_1) {
        d = f16(b);
        const uint8_t * qs = b + (K == k_q4_0 ? 2 : 4);
        if (K == k_q4_1) m = f16(b + 2);
        for (int i = 0; i < 16; i++) {
            q[i] = (qs[i] & 0xf) - (K == k_q4_0 ? 8 : 0);
            q[i + 16] = (qs[i] >> 4) - (K == k_q4_0 ? 8 : 0);
        }
    } else {
        d = f16(b);
        const int o = K == k_q5_0 ? 2 : 4;
        if (K == k_q5_1) m = f16(b + 2);
        const uint32_t qh = b[o] | b[o + 1] << 8 | b[o + 2] << 16 | static_cast<uint32_t>(b[o + 3]) << 24;
        const uint8_t * qs = b + o + 4;
        for (int i = 0; i < 16; i++) {
            q[i] = static_cast<int>((qs[i] & 0xf) | ((qh >> i) & 1) << 4) - (K == k_q5_0 ? 16 : 0);
            q[i + 16] = static_cast<int>((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - (K == k_q5_0 ? 16 : 0);
        }
    }
}

constexpr int block_bytes_32(int k) {
    return k == k_q4_0 ? 18 : k == k_q4_1 ? 20 : k == k_q5_0 ? 22 : k == k_q5_1 ? 24 : 34;
}

template <int K, int NV>
void dot_32_portable(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    float acc[NV] = {};
    for (int64_t i = 0; i < nb; i++) {
        int q[32];
        float d, m;
        decode_32<K>(w + i * block_bytes_32(K), q, d, m);
        for (int v = 0; v < NV; v++) {
            const q8_32 & a = reinterpret_cast<const q8_32 *>(xq + v * xs)[i];
            int s = 0;
            for (int l = 0; l < 32; l++) s += q[l] * a.qs[l];
            acc[v] += d * a.d * static_cast<float>(s);
            if (K == k_q4_1 || K == k_q5_1) acc[v] += m * a.d * static_cast<float>(a.sum);
        }
    }
    for (int v = 0; v < NV; v++) out[v] = acc[v];
}

// Q4_K / Q5_K: q in 0..15 (0..31), value d * scale_j * q - dmin * min_j per 32-element sub-block j.
template <int K, int NV>
void dot_k45_portable(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr int bb = K == k_q4_k ? 144 : 176;
    float acc[NV] = {};
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        const float d = f16(b), dmin = f16(b + 2);
        int sc[8], mn[8];
        for (int j = 0; j < 8; j++) scale_min_k4(b + 4, j, sc[j], mn[j]);
        int8_t q[256];
        const uint8_t * qs = b + (K == k_q4_k ? 16 : 48);
        for (int j = 0; j < 8; j++) {
            for (int l = 0; l < 32; l++) {
                int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xf;
                if (K == k_q5_k) v |= ((b[16 + l] >> j) & 1) << 4;
                q[32 * j + l] = static_cast<int8_t>(v);
            }
        }
        for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            int sumi = 0, summ = 0;
            for (int j = 0; j < 8; j++) {
                int s = 0;
                for (int l = 0; l < 32; l++) s += q[32 * j + l] * a.qs[32 * j + l];
                sumi += sc[j] * s;
                summ += mn[j] * (a.sums[2 * j] + a.sums[2 * j + 1]);
            }
            acc[v] += a.d * d * static_cast<float>(sumi) - a.d * dmin * static_cast<float>(summ);
        }
    }
    for (int v = 0; v < NV; v++) out[v] = acc[v];
}

// Q6_K: q in -32..31, value d * scale_g * q per 16-element group g.
template <int NV>
void dot_q6_k_portable(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    float acc[NV] = {};
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * 210;
        const float d = f16(b + 208);
        const int8_t * sc = reinterpret_cast<const int8_t *>(b + 192);
        int8_t q[256];
        for (int h = 0; h < 2; h++) {
            for (int j = 0; j < 4; j++) {
                for (int l = 0; l < 32; l++) {
                    const int lo = (b[64 * h + 32 * (j % 2) + l] >> (4 * (j / 2))) & 0xf;
                    const int hi = (b[128 + 32 * h + l] >> (2 * j)) & 3;
                    q[128 * h + 32 * j + l] = static_cast<int8_t>((lo | hi << 4) - 32);
                }
            }
        }
        for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            int sumi = 0;
            for (int g = 0; g < 16; g++) {
                int s = 0;
                for (int l = 0; l < 16; l++) s += q[16 * g + l] * a.qs[16 * g + l];
                sumi += sc[g] * s;
            }
            acc[v] += a.d * d * static_cast<float>(sumi);
        }
    }
    for (int v = 0; v < NV; v++) out[v] = acc[v];
}

template <int K>
inline float float_weight(const uint8_t * w, int64_t c) {
    if constexpr (K == k_f32) {
        float f;
        std::memcpy(&f, w + 4 * c, 4);
        return f;
    } else if constexpr (K == k_f16) {
        return f16(w + 2 * c);
    } else {
        return pebble_internal::float_from_bits(static_cast<uint32_t>(u16(w + 2 * c)) << 16);
    }
}

// F32 / F16 / BF16: x is float32 (nb = the row's elements).
template <int K, int NV>
void dot_float_portable(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    float acc[NV] = {};
    for (int64_t c = 0; c < nb; c++) {
        const float wc = float_weight<K>(w, c);
        for (int v = 0; v < NV; v++) acc[v] += wc * reinterpret_cast<const float *>(xq + v * xs)[c];
    }
    for (int v = 0; v < NV; v++) out[v] = acc[v];
}

// ---------------------------------------------------------------------------------------------------
// AVX2 (+FMA, F16C) row kernels

#ifdef PEBBLE_X86
#    define AVX2 __attribute__((target("avx2,fma,f16c")))
// Loops over a kernel's vectors, unrolled whole where they are written, so that each vector's accumulator is
// a register of its own (left to the optimizer, an array of them went to the stack, zeroed per row).
#    define UNROLL _Pragma("GCC unroll 16")

// fp16 bits to float with F16C's conversion (pebble_internal::half_to_float's values, in one instruction).
AVX2 inline float f16c(const uint8_t * p) { return _cvtsh_ss(u16(p)); }

AVX2 inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

// Sums of 4 products of unsigned bytes u and signed bytes s, as 8 int32 (no pair can saturate here:
// u <= 63 or, for the signed types, |u| <= 128 with |s| <= 127).
AVX2 inline __m256i dot_u8_i8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The same for two signed operands: |a| times s with a's sign.
AVX2 inline __m256i dot_i8_i8(__m256i a, __m256i s) {
    return dot_u8_i8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(s, a));
}

// 32 bits into 32 bytes, byte i = 0x10 where bit i is set.
AVX2 inline __m256i bits_to_0x10(uint32_t bits) {
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
    const __m256i mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    v = _mm256_or_si256(v, mask);
    v = _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

// A 32-element block's quants as 32 signed bytes (Q4_0, Q5_0, Q8_0) or unsigned ones (Q4_1, Q5_1).
template <int K>
AVX2 inline __m256i decode_32_avx2(const uint8_t * b) {
    if constexpr (K == k_q8_0) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 2));
    } else {
        const int o = K == k_q4_0 ? 2 : K == k_q4_1 ? 4 : K == k_q5_0 ? 6 : 8;
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + o));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        __m256i q = _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
        if constexpr (K == k_q5_0 || K == k_q5_1) {
            uint32_t qh;
            std::memcpy(&qh, b + o - 4, 4);
            q = _mm256_or_si256(q, bits_to_0x10(qh));
        }
        if constexpr (K == k_q4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
        if constexpr (K == k_q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        return q;
    }
}

template <int K, int NV>
AVX2 void dot_32_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr bool has_min = K == k_q4_1 || K == k_q5_1;
    __m256 acc[NV];
    float macc[NV];
    UNROLL for (int v = 0; v < NV; v++) {
        acc[v] = _mm256_setzero_ps();
        macc[v] = 0.0f;
    }
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * block_bytes_32(K);
        const float d = f16c(b);
        const __m256i q = decode_32_avx2<K>(b);
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_32 & a = reinterpret_cast<const q8_32 *>(xq + v * xs)[i];
            const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs));
            const __m256i p = has_min ? dot_u8_i8(q, y) : dot_i8_i8(q, y);
            acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(p), acc[v]);
            if constexpr (has_min) macc[v] += f16c(b + 2) * a.d * static_cast<float>(a.sum);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = hsum_ps(acc[v]) + macc[v];
}

// Q4_K's and Q5_K's twelve bytes of scales and mins as eight scales (bytes 0..7 of out) and eight
// mins (bytes 8..15), with word operations rather than eight branches (the layout of scale_min_k4).
inline void unpack_scales_k4(const uint8_t * s, uint32_t out[4]) {
    uint32_t w[3];
    std::memcpy(w, s, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    out[0] = w[0] & low6;                                            // scales 0..3
    out[1] = (w[2] & low4) | (((w[0] >> 6) & top2) << 4);            // scales 4..7
    out[2] = w[1] & low6;                                            // mins 0..3
    out[3] = ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4);     // mins 4..7
}

template <int K, int NV>
AVX2 void dot_k45_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr int bb = K == k_q4_k ? 144 : 176;
    __m256 acc[NV];
    float macc[NV];
    UNROLL for (int v = 0; v < NV; v++) {
        acc[v] = _mm256_setzero_ps();
        macc[v] = 0.0f;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        const float d = f16c(b), dmin = f16c(b + 2);
        alignas(16) uint32_t sm[4];
        unpack_scales_k4(b + 4, sm);
        const uint8_t * scales = reinterpret_cast<const uint8_t *>(sm);
        const __m128i mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(sm + 2)));
        const uint8_t * qs = b + (K == k_q4_k ? 16 : 48);
        __m256i qh = _mm256_setzero_si256();
        if constexpr (K == k_q5_k) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 16));
        __m256i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm256_setzero_si256();
        UNROLL for (int p = 0; p < 4; p++) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * p));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if constexpr (K == k_q5_k) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
                qh = _mm256_srli_epi16(qh, 2);
            }
            const __m256i s_lo = _mm256_set1_epi16(static_cast<int16_t>(scales[2 * p]));
            const __m256i s_hi = _mm256_set1_epi16(static_cast<int16_t>(scales[2 * p + 1]));
            UNROLL for (int v = 0; v < NV; v++) {
                const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
                const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs + 64 * p));
                const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs + 64 * p + 32));
                sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y0), s_lo));
                sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y1), s_hi));
            }
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            // sum over sub-blocks j of min_j * (sum of x's 32 q): pairs of the 16-element sums, then madd
            const __m128i s0 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(a.sums));
            const __m128i s1 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(a.sums + 8));
            const __m128i prod = _mm_madd_epi16(mins16, _mm_hadd_epi16(s0, s1));
            __m128i t = _mm_add_epi32(prod, _mm_shuffle_epi32(prod, 0x4e));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
            const float ad = a.d;
            acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(ad * d), _mm256_cvtepi32_ps(sumi[v]), acc[v]);
            macc[v] += ad * dmin * static_cast<float>(_mm_cvtsi128_si32(t));
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = hsum_ps(acc[v]) - macc[v];
}

template <int NV>
AVX2 void dot_q6_k_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    __m256 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * 210;
        const float d = f16c(b + 208);
        const int8_t * sc = reinterpret_cast<const int8_t *>(b + 192);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(sc)));
        __m256i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) {
            // the -32 of every q, through x's 16-element sums: -32 * sum_g scale_g * sums_g
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            const __m256i corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.sums)));
            sumi[v] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5));
        }
        UNROLL for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 128 + 32 * h));
            // unsigned 0..63; the -32 is taken off above
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)), 4)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0c)), 2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, _mm256_set1_epi8(0x30))),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(static_cast<char>(0xc0))), 2)),
            };
            UNROLL for (int j = 0; j < 4; j++) {
                const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * j + 1]), _mm_set1_epi16(sc[8 * h + 2 * j]));
                UNROLL for (int v = 0; v < NV; v++) {
                    const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
                    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs + 128 * h + 32 * j));
                    sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], y), s));
                }
            }
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(a.d * d), _mm256_cvtepi32_ps(sumi[v]), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = hsum_ps(acc[v]);
}

template <int K>
AVX2 inline __m256 load8_weights(const uint8_t * w, int64_t c) {
    if constexpr (K == k_f32) {
        return _mm256_loadu_ps(reinterpret_cast<const float *>(w + 4 * c));
    } else if constexpr (K == k_f16) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w + 2 * c)));
    } else {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w + 2 * c)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    }
}

template <int K, int NV>
AVX2 void dot_float_avx2(const uint8_t * w, int64_t n, const uint8_t * xq, int64_t xs, float * out) {
    __m256 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 wv = load8_weights<K>(w, c);
        UNROLL for (int v = 0; v < NV; v++) {
            acc[v] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(reinterpret_cast<const float *>(xq + v * xs) + c), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) {
        float s = hsum_ps(acc[v]);
        for (int64_t t = c; t < n; t++) s += float_weight<K>(w, t) * reinterpret_cast<const float *>(xq + v * xs)[t];
        out[v] = s;
    }
}

// ---------------------------------------------------------------------------------------------------
// AVX-512 (F, BW, DQ, VL, VNNI) row kernels: 64 quants a register and VNNI's fused integer dot products
// (vpdpbusd: bytes to int32 sums of 4; vpdpwssd: a sub-block's 16-bit sums times its scale, added).
// Their activations are laid out for them (quantize_pairs, quantize_k512): the same d and q as the
// other kernels', only arranged so that one load gives what a register of weights meets.

#    define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))

// One 256-element block of x for the K-quants: its q in the order the weight type's registers hold
// its quants (see quantize_k512), the sum of each 16 in natural order, and d.
struct alignas(64) q8_k512 {
    int8_t  qs[256];
    int16_t sums[16];
    float   d;
};

// Q4_K's and Q5_K's 64 bytes of quants hold sub-blocks (0, 2) in their low nibbles and (1, 3) in their
// high ones (then 4..7 likewise), so their x goes in as sub-blocks 0 2 1 3 4 6 5 7; Q6_K's in order.
void quantize_k512(const uint16_t * x, int64_t n, bool paired, q8_k512 * out) {
    static constexpr int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    for (int64_t b = 0; b < n / 256; b++) {
        q8_k512 & o = out[b];
        int8_t q[256];
        quantize_block<256>(x + 256 * b, o.d, q);
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += q[16 * g + i];
            o.sums[g] = static_cast<int16_t>(sum);
        }
        for (int c = 0; c < 8; c++) std::memcpy(o.qs + 32 * c, q + 32 * (paired ? order[c] : c), 32);
    }
}

AVX512 inline __m512i pair_256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// 32 words: the first 16 word a of v, the last 16 word b (an index for vpermw).
AVX512 inline __m512i word_index(int a, int b) {
    return pair_256(_mm256_set1_epi16(static_cast<int16_t>(a)), _mm256_set1_epi16(static_cast<int16_t>(b)));
}

// out[v] = the sum of acc[v]'s 16 lanes, v < NV, in _mm512_reduce_add_ps's order (the halves added, then
// the quarters, then lanes 0 + 2 and 1 + 3, then those two), so that a row's sum is the same whatever
// NV. Several are reduced together, transposed: the shuffles and adds that one takes alone give 8.
template <int NV>
AVX512 __attribute__((always_inline)) inline void reduce_store(const __m512 * acc, float * out) {
    if constexpr (NV == 1) {
        out[0] = _mm512_reduce_add_ps(acc[0]);
    } else {
        __m512 a[8], s[4], t[2];
        UNROLL for (int v = 0; v < 8; v++) a[v] = v < NV ? acc[v] : _mm512_setzero_ps();
        UNROLL for (int p = 0; p < 4; p++) { // [a(2p) halves added | a(2p+1) halves added]
            s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        }
        UNROLL for (int p = 0; p < 2; p++) { // quarter k: a(4p + k)'s quarters added
            t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
        }
        // quarter k: (0 + 2, 1 + 3) of a(k), then of a(k + 4); then each pair added
        const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
        const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w, w, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_ps(w, w, _MM_SHUFFLE(3, 1, 3, 1)));
        // lane 4k holds a(k)'s sum, lane 4k + 1 a(k + 4)'s
        const __m512 sums = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), z);
        _mm256_mask_storeu_ps(out, static_cast<__mmask8>((1u << NV) - 1), _mm512_castps512_ps256(sums));
    }
}

// The 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) row by row, computing what rows16_32 computes for
// each of its lanes: per block the integer S = sum of the block's integers times x's q (exact), then
// acc += (d * x's d) * S and, for Q4_1 and Q5_1, acc += m * (x's d * x's sum), two fused multiply-adds. vpdpbusd
// multiplies unsigned by signed bytes, so the signed types' integers go in as q + 128 (bits xor 0x80) and
// 128 times x's sum comes off S again.
template <int K, int NV>
AVX512 void dot_32_avx512(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr bool has_min = K == k_q4_1 || K == k_q5_1;
    constexpr int  bb = block_bytes_32(K);
    float acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + bb * i;
        __m256i q = decode_32_avx2<K>(b);
        if constexpr (!has_min) q = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
        const float d = _cvtsh_ss(u16(b)), m = has_min ? _cvtsh_ss(u16(b + 2)) : 0.0f;
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_32 & a = reinterpret_cast<const q8_32 *>(xq + v * xs)[i];
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs)));
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(p)) - (has_min ? 0 : 128 * a.sum);
            acc[v] = std::fma(d * a.d, static_cast<float>(sum), acc[v]);
            if constexpr (has_min) acc[v] = std::fma(m, a.d * static_cast<float>(a.sum), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = acc[v];
}

// 128 quants of block i, unsigned, as two registers of 64 (lo: x's q at `at`, hi: at `at` + 64), times
// each of NV activations, each 16-bit pair sum times its scale (s_lo, s_hi), added to sumi[v].
template <int NV>
AVX512 __attribute__((always_inline)) inline void dot_128(__m512i * sumi, __m512i lo, __m512i hi, __m512i s_lo,
                                                          __m512i s_hi, const uint8_t * xq, int64_t xs, int64_t i,
                                                          int at) {
    UNROLL for (int v = 0; v < NV; v++) {
        const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
        const __m512i y0 = _mm512_load_si512(a.qs + at), y1 = _mm512_load_si512(a.qs + at + 64);
        sumi[v] = _mm512_dpwssd_epi32(sumi[v], _mm512_maddubs_epi16(lo, y0), s_lo);
        sumi[v] = _mm512_dpwssd_epi32(sumi[v], _mm512_maddubs_epi16(hi, y1), s_hi);
    }
}

template <int K, int NV>
AVX512 void dot_k45_avx512(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr int bb = K == k_q4_k ? 144 : 176;
    __m512 acc[NV];
    __m256 accm[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_setzero_ps(), accm[v] = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
    // the scale of each 16-bit sum: registers hold sub-blocks (4c, 4c+2) and (4c+1, 4c+3)
    const __m512i index[4] = {word_index(0, 2), word_index(1, 3), word_index(4, 6), word_index(5, 7)};
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        const float d = _cvtsh_ss(u16(b)), dmin = _cvtsh_ss(u16(b + 2));
        uint32_t sm[4];
        unpack_scales_k4(b + 4, sm);
        const __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(sm))));
        // each sub-block's min twice, beside x's two 16-element sums of that sub-block
        const __m128i mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(sm + 2)));
        const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mins16, mins16), _mm_unpacklo_epi16(mins16, mins16));
        const uint8_t * qs = b + (K == k_q4_k ? 16 : 48);
        __m512i qh = _mm512_setzero_si512();
        if constexpr (K == k_q5_k) {
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 16));
            qh = pair_256(h, _mm256_srli_epi16(h, 2));
        }
        __m512i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm512_setzero_si512();
        UNROLL for (int c = 0; c < 2; c++) {
            const __m512i raw = _mm512_loadu_si512(qs + 64 * c);
            __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
            if constexpr (K == k_q5_k) {
                lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(qh, one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 1), one), 4));
                qh = _mm512_srli_epi16(qh, 4);
            }
            const __m512i s_lo = _mm512_permutexvar_epi16(index[2 * c], scales);
            const __m512i s_hi = _mm512_permutexvar_epi16(index[2 * c + 1], scales);
            dot_128<NV>(sumi, lo, hi, s_lo, s_hi, xq, xs, i, 128 * c);
        }
        const __m512 dv = _mm512_set1_ps(d);
        const __m256 mdv = _mm256_set1_ps(-dmin);
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
            // min_j * (sum of x's 32 q of sub-block j), per j, taken off in an accumulator of its own (eight
            // lanes: AVX-512 units that run a 512-bit operation as two halves take it in one)
            const __m256i m = _mm256_madd_epi16(mins, _mm256_load_si256(reinterpret_cast<const __m256i *>(a.sums)));
            acc[v] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(a.d)), _mm512_cvtepi32_ps(sumi[v]), acc[v]);
            accm[v] = _mm256_fmadd_ps(_mm256_mul_ps(mdv, _mm256_set1_ps(a.d)), _mm256_cvtepi32_ps(m), accm[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_add_ps(acc[v], _mm512_zextps256_ps512(accm[v]));
    reduce_store<NV>(acc, out);
}

// Q6_K block b (block i of the row) times NV activations as integers: the lanes of sumi[v] add up to the
// block's sum of scale_g * (q - 32) * x's q; d its scale.
template <int NV>
AVX512 __attribute__((always_inline)) inline float q6_k_block_ints(const uint8_t * b, const uint8_t * xq, int64_t xs,
                                                                   int64_t i, __m512i * sumi) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03);
    // the scale of each 16-bit sum: a register holds 4 groups of 16, 8 sums each
    const __m512i group = _mm512_srli_epi16(
        _mm512_set_epi32(0x001f001e, 0x001d001c, 0x001b001a, 0x00190018, 0x00170016, 0x00150014, 0x00130012,
                         0x00110010, 0x000f000e, 0x000d000c, 0x000b000a, 0x00090008, 0x00070006, 0x00050004,
                         0x00030002, 0x00010000), 3);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 192)));
    const __m512i scales = _mm512_castsi256_si512(sc16);
    UNROLL for (int v = 0; v < NV; v++) {
        // the -32 of every q, through x's 16-element sums: -32 * sum_g scale_g * sums_g
        const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
        const __m256i corr = _mm256_madd_epi16(sc16, _mm256_load_si256(reinterpret_cast<const __m256i *>(a.sums)));
        sumi[v] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5)));
    }
    UNROLL for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(b + 64 * h);
        const __m256i qh256 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 128 + 32 * h));
        const __m512i qh = pair_256(qh256, _mm256_srli_epi16(qh256, 2));
        // unsigned 0..63, elements 128h + 0..63 and 128h + 64..127; the -32 is taken off above
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(qh, m2), 4));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4), m2), 4));
        const __m512i s_lo = _mm512_permutexvar_epi16(_mm512_add_epi16(group, _mm512_set1_epi16(static_cast<int16_t>(8 * h))), scales);
        const __m512i s_hi = _mm512_permutexvar_epi16(_mm512_add_epi16(group, _mm512_set1_epi16(static_cast<int16_t>(8 * h + 4))), scales);
        dot_128<NV>(sumi, lo, hi, s_lo, s_hi, xq, xs, i, 128 * h);
    }
    return _cvtsh_ss(u16(b + 208));
}

// ---------------------------------------------------------------------------------------------------
// Sixteen rows at a time (AVX-512): a register's sixteen 32-bit lanes are sixteen weight rows, so that a
// block's scales multiply sixteen rows' integer sums in one operation, and x's four quants a dword are
// broadcast to every lane. A row kernel reduces its row across lanes instead, then pays its float
// epilogue per block and row: with 8 activations it took most of their time (Q4_K 512 x 1024 x 8 on one
// core: 123 GOP/s row by row, 211 sixteen rows at a time). A group's blocks are transposed on the way in
// (16 bytes of each of 16 rows: four 4 x 4 transposes of dwords); out[v * ys + r] for rows r < 16.

// t[m] lane r = dword m of the 16 bytes at p + r * rb.
AVX512 __attribute__((always_inline)) inline void load_16x4(const uint8_t * p, int64_t rb, __m512i t[4]) {
    __m512i u[4];
    UNROLL for (int i = 0; i < 4; i++) { // u[i]'s 128-bit lane q: row 4q + i
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + i * rb)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i *>(p + (4 + i) * rb)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i *>(p + (8 + i) * rb)), 2);
        u[i] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i *>(p + (12 + i) * rb)), 3);
    }
    const __m512i a = _mm512_unpacklo_epi32(u[0], u[1]), b = _mm512_unpackhi_epi32(u[0], u[1]);
    const __m512i c = _mm512_unpacklo_epi32(u[2], u[3]), d = _mm512_unpackhi_epi32(u[2], u[3]);
    t[0] = _mm512_unpacklo_epi64(a, c);
    t[1] = _mm512_unpackhi_epi64(a, c);
    t[2] = _mm512_unpacklo_epi64(b, d);
    t[3] = _mm512_unpackhi_epi64(b, d);
}

// A group's 16 rows are 16 * rb bytes in a row of memory, read a block column at a time: sixteen streams,
// more than the hardware's prefetchers follow. While a group reads its block i, the bytes two groups on
// are asked for in order, 16 blocks' worth, into the second-level cache only (prefetcht2: AMD's L2), so
// that a group's rows are there when it starts. Fetched into the first-level cache instead (prefetcht0),
// Qwen2.5-1.5B's 8960 x 1536 Q4_K matrices read half as fast; with no prefetch at all, a third as fast.
constexpr int64_t groups_ahead = 2;

inline void prefetch_group_bytes(const uint8_t * p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 1);
}

inline void prefetch_next_group(const uint8_t * w, int64_t rb, int64_t i, int64_t bb) {
    prefetch_group_bytes(w + 16 * rb * groups_ahead + i * 16 * bb, 16 * bb);
}

inline int32_t dword_at(const int8_t * p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Q4_K: sub-block j's 32 quants times x, a 32-bit integer per row, times the row's 6-bit scale of j, added
// up over the block; then d and dmin (each row's, in lanes) times x's d. vpdpwssd multiplies the low
// 16-bit half of each lane by the scale: a sum over 16 quants (at most 16 * 15 * 127) fits it, so each
// sub-block is two sums of 16. The mins: dmin * m_j * (x's sum over j), through x's sums of 16 in pairs.
template <int NV>
AVX512 void rows16_q4_k(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t xs, float * y,
                        int64_t ys) {
    // where x's q of sub-block s sit: quantize_k512's paired order (0 2 1 3 4 6 5 7, its own inverse)
    static constexpr int pos[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    __m512 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), byte = _mm512_set1_epi32(0xff);
    const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), low4 = _mm512_set1_epi32(0x0f0f0f0f),
                  top2 = _mm512_set1_epi32(0x03030303);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * 144;
        prefetch_next_group(w, rb, i, 144);
        __m512i h[4]; // d | dmin, then the twelve bytes of scales and mins
        load_16x4(b, rb, h);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h[0]));
        const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h[0], 16)));
        // unpack_scales_k4, a row a lane: scales 0..3, 4..7, mins 0..3, 4..7, a byte each
        const __m512i sc[2] = {_mm512_and_si512(h[1], low6),
                               _mm512_or_si512(_mm512_and_si512(h[3], low4),
                                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[1], 6), top2), 4))};
        const __m512i mn[2] = {_mm512_and_si512(h[2], low6),
                               _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h[3], 4), low4),
                                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[2], 6), top2), 4))};
        __m512i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm512_setzero_si512();
        UNROLL for (int c = 0; c < 4; c++) { // 32 bytes of quants: sub-block 2c low nibbles, 2c + 1 high
            const __m512i s_lo = _mm512_and_si512(_mm512_srli_epi32(sc[c / 2], 16 * (c % 2)), byte);
            const __m512i s_hi = _mm512_and_si512(_mm512_srli_epi32(sc[c / 2], 16 * (c % 2) + 8), byte);
            UNROLL for (int half = 0; half < 2; half++) { // quants 16 * half .. + 15 of each sub-block
                __m512i t[4], lo[4], hi[4];
                load_16x4(b + 16 + 32 * c + 16 * half, rb, t);
                UNROLL for (int m = 0; m < 4; m++) {
                    lo[m] = _mm512_and_si512(t[m], m4);
                    hi[m] = _mm512_and_si512(_mm512_srli_epi16(t[m], 4), m4);
                }
                UNROLL for (int v = 0; v < NV; v++) {
                    const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
                    const int8_t * xl = a.qs + 32 * pos[2 * c] + 16 * half, * xh = a.qs + 32 * pos[2 * c + 1] + 16 * half;
                    __m512i pl = _mm512_setzero_si512(), ph = _mm512_setzero_si512();
                    UNROLL for (int m = 0; m < 4; m++) {
                        pl = _mm512_dpbusd_epi32(pl, lo[m], _mm512_set1_epi32(dword_at(xl + 4 * m)));
                        ph = _mm512_dpbusd_epi32(ph, hi[m], _mm512_set1_epi32(dword_at(xh + 4 * m)));
                    }
                    sumi[v] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sumi[v], pl, s_lo), ph, s_hi);
                }
            }
        }
        __m512i mins[8]; // m_j in both 16-bit halves, beside x's two sums of 16 in sub-block j
        UNROLL for (int j = 0; j < 8; j++) {
            const __m512i m = _mm512_and_si512(_mm512_srli_epi32(mn[j / 4], 8 * (j % 4)), byte);
            mins[j] = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
            __m512i summ = _mm512_setzero_si512();
            UNROLL for (int j = 0; j < 8; j++) {
                summ = _mm512_dpwssd_epi32(summ, mins[j], _mm512_set1_epi32(dword_at(reinterpret_cast<const int8_t *>(a.sums + 2 * j))));
            }
            const __m512 dx = _mm512_set1_ps(a.d);
            acc[v] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(sumi[v]), acc[v]);
            acc[v] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(summ), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) _mm512_storeu_ps(y + v * ys, acc[v]);
}

// Q6_K: each group of 16 quants times x, less 32 times x's sum over the group (its offset), a 32-bit integer
// per row, times the row's signed 8-bit scale of the group, added up over the block; then d times x's d.
template <int NV>
AVX512 void rows16_q6_k(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t xs, float * y,
                        int64_t ys) {
    __m512 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * 210;
        prefetch_next_group(w, rb, i, 210);
        __m512i sc[4], tail[4]; // the sixteen scales; bytes 206..209, whose top half is d
        load_16x4(b + 192, rb, sc);
        load_16x4(b + 194, rb, tail);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(tail[3], 16)));
        __m512i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm512_setzero_si512();
        UNROLL for (int n = 0; n < 2; n++) {       // 128 quants: ql[64n..], qh[32n..]
            UNROLL for (int h = 0; h < 2; h++) {   // l = 16h .. 16h + 15 of each of the four runs of 32
                __m512i la[4], lb[4], qh[4], q[4][4];
                load_16x4(b + 64 * n + 16 * h, rb, la);
                load_16x4(b + 64 * n + 32 + 16 * h, rb, lb);
                load_16x4(b + 128 + 32 * n + 16 * h, rb, qh);
                UNROLL for (int m = 0; m < 4; m++) {
                    q[0][m] = _mm512_or_si512(_mm512_and_si512(la[m], m4), _mm512_slli_epi32(_mm512_and_si512(qh[m], m2), 4));
                    q[1][m] = _mm512_or_si512(_mm512_and_si512(lb[m], m4),
                                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[m], 2), m2), 4));
                    q[2][m] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(la[m], 4), m4),
                                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[m], 4), m2), 4));
                    q[3][m] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(lb[m], 4), m4),
                                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[m], 6), m2), 4));
                }
                UNROLL for (int run = 0; run < 4; run++) { // quants 128n + 32run + 16h + ..., group 8n + 2run + h
                    const int g = 8 * n + 2 * run + h;
                    const __m512i scale = _mm512_srai_epi32(_mm512_slli_epi32(sc[g / 4], 24 - 8 * (g % 4)), 24);
                    UNROLL for (int v = 0; v < NV; v++) {
                        const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
                        const int8_t * x = a.qs + 128 * n + 32 * run + 16 * h;
                        __m512i p = _mm512_set1_epi32(-32 * a.sums[g]); // the offset of 32, through x's sum
                        UNROLL for (int m = 0; m < 4; m++) p = _mm512_dpbusd_epi32(p, q[run][m], _mm512_set1_epi32(dword_at(x + 4 * m)));
                        sumi[v] = _mm512_add_epi32(sumi[v], _mm512_mullo_epi32(p, scale));
                    }
                }
            }
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
            acc[v] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.d)), _mm512_cvtepi32_ps(sumi[v]), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) _mm512_storeu_ps(y + v * ys, acc[v]);
}

// Q4_K block b (block i of the row) times NV activations as integers: the lanes of sumi[v] add up to the
// block's sum_j scale_j * S_j (S_j: sub-block j's quants times x's q), those of msum[v] to its
// sum_j min_j * (x's sum over sub-block j); d and dmin its scales.
template <int NV>
AVX512 __attribute__((always_inline)) inline void q4_k_block_ints(const uint8_t * b, const uint8_t * xq, int64_t xs,
                                                                  int64_t i, __m512i * sumi, __m256i * msum,
                                                                  float & d, float & dmin) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i index[4] = {word_index(0, 2), word_index(1, 3), word_index(4, 6), word_index(5, 7)};
    d = _cvtsh_ss(u16(b));
    dmin = _cvtsh_ss(u16(b + 2));
    uint32_t sm[4];
    unpack_scales_k4(b + 4, sm);
    const __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(sm))));
    const __m128i mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(sm + 2)));
    const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mins16, mins16), _mm_unpacklo_epi16(mins16, mins16));
    UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm512_setzero_si512();
    UNROLL for (int c = 0; c < 2; c++) {
        const __m512i raw = _mm512_loadu_si512(b + 16 + 64 * c);
        const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        dot_128<NV>(sumi, lo, hi, _mm512_permutexvar_epi16(index[2 * c], scales),
                    _mm512_permutexvar_epi16(index[2 * c + 1], scales), xq, xs, i, 128 * c);
    }
    UNROLL for (int v = 0; v < NV; v++) {
        const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
        msum[v] = _mm256_madd_epi16(mins, _mm256_load_si256(reinterpret_cast<const __m256i *>(a.sums)));
    }
}

// Q4_K and Q6_K row by row (a matrix's last rows, past its whole groups of 16): per block the integer
// sums, then the fused multiply-adds of rows16_q4_k's and rows16_q6_k's lanes, so that a row's result is
// the same bits whichever kernel took it.
template <int K, int NV>
AVX512 void dot_k_exact_avx512(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    float acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        __m512i sumi[NV];
        __m256i msum[NV];
        float d, dmin = 0.0f;
        if constexpr (K == k_q4_k) q4_k_block_ints<NV>(w + i * 144, xq, xs, i, sumi, msum, d, dmin);
        else d = q6_k_block_ints<NV>(w + i * 210, xq, xs, i, sumi);
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
            acc[v] = std::fma(d * a.d, static_cast<float>(_mm512_reduce_add_epi32(sumi[v])), acc[v]);
            if constexpr (K == k_q4_k) {
                acc[v] = std::fma(-(dmin * a.d), static_cast<float>(_mm512_reduce_add_epi32(_mm512_zextsi256_si512(msum[v]))), acc[v]);
            }
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = acc[v];
}

// The 32-element types: S per row (the block's integers times x's q: unsigned quants from dpbusd, less
// x's sum times what they lie above the integers: 8 for Q4_0, 16 for Q5_0, 128 for Q8_0 taken as q + 128),
// then dot_32_avx512's two multiply-adds. The block's first dword (d, m or the first of qh) of each row
// is gathered; the quants transposed.
template <int K, int NV>
AVX512 void rows16_32(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t xs, float * y,
                      int64_t ys) {
    constexpr bool has_min = K == k_q4_1 || K == k_q5_1;
    constexpr int  bb = block_bytes_32(K);
    constexpr int  at = K == k_q4_0 || K == k_q8_0 ? 2 : K == k_q4_1 ? 4 : K == k_q5_0 ? 6 : 8; // the quants
    constexpr int  above = K == k_q4_0 ? 8 : K == k_q5_0 ? 16 : K == k_q8_0 ? 128 : 0;
    // bits (4 of them) to bytes of 0x10: a permutation's table, indexed by the low 4 bits of each lane
    const __m512i fifth = _mm512_setr_epi32(0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000, 0x00100010,
                                            0x00101000, 0x00101010, 0x10000000, 0x10000010, 0x10001000, 0x10001010,
                                            0x10100000, 0x10100010, 0x10101000, 0x10101010);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int32_t>(rb)));
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        prefetch_next_group(w, rb, i, bb);
        const __m512i head = _mm512_i32gather_epi32(rows, b, 1);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        __m512 m = _mm512_setzero_ps();
        if constexpr (has_min) m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
        __m512i q[8]; // q[k] lane r: quants 4k .. 4k + 3 of row r
        if constexpr (K == k_q8_0) {
            load_16x4(b + 2, rb, q);
            load_16x4(b + 18, rb, q + 4);
            UNROLL for (int k = 0; k < 8; k++) q[k] = _mm512_xor_si512(q[k], _mm512_set1_epi8(static_cast<char>(0x80)));
        } else {
            __m512i t[4];
            load_16x4(b + at, rb, t);
            UNROLL for (int k = 0; k < 4; k++) {
                q[k] = _mm512_and_si512(t[k], m4);
                q[k + 4] = _mm512_and_si512(_mm512_srli_epi16(t[k], 4), m4);
            }
            if constexpr (K == k_q5_0 || K == k_q5_1) {
                const __m512i qh = _mm512_i32gather_epi32(rows, b + at - 4, 1);
                UNROLL for (int k = 0; k < 8; k++) {
                    q[k] = _mm512_or_si512(q[k], _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 4 * k), fifth));
                }
            }
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_32 & a = reinterpret_cast<const q8_32 *>(xq + v * xs)[i];
            __m512i p = _mm512_set1_epi32(-above * a.sum);
            UNROLL for (int k = 0; k < 8; k++) p = _mm512_dpbusd_epi32(p, q[k], _mm512_set1_epi32(dword_at(a.qs + 4 * k)));
            acc[v] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.d)), _mm512_cvtepi32_ps(p), acc[v]);
            if constexpr (has_min) acc[v] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.d * static_cast<float>(a.sum)), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) _mm512_storeu_ps(y + v * ys, acc[v]);
}

// The sums of a, b, c and d's lanes, in lanes 0..3 (integers: exact in any order).
AVX512 __attribute__((always_inline)) inline __m128i sum4_lanes(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

AVX512 __attribute__((always_inline)) inline __m256i fold_512(__m512i z) {
    return _mm256_add_epi32(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1));
}

// One activation through sixteen rows of Q4_K or Q6_K, four rows at a time read in order (the prefetchers
// follow four streams; sixteen, not), to the bits of rows16_q4_k's and rows16_q6_k's lanes: per block the
// four rows' integer sums (as the row kernels make them) added up across their lanes together, then the
// same float multiply-adds, four rows a register. Qwen2.5-1.5B's decode step, against the row kernels of
// before the sixteen-row ones: a scalar epilogue per row and block (one reduction per sum) ran it 10-14%
// slower, and the sixteen-row kernel itself as slow or slower.
template <int K>
AVX512 void rows16_one_k(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t, float * y, int64_t) {
    constexpr int bb = K == k_q4_k ? 144 : 210;
    const q8_k512 * x = reinterpret_cast<const q8_k512 *>(xq);
    for (int r0 = 0; r0 < 16; r0 += 4) {
        __m128 acc = _mm_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            // the group two on, in order, as rows16's kernels ask for it: 4 blocks' bytes a step here
            prefetch_group_bytes(w + 16 * rb * groups_ahead + ((r0 / 4) * nb + i) * 4 * bb, 4 * bb);
            __m512i si[4];
            __m256i mi[4];
            float d[4], dm[4];
            UNROLL for (int r = 0; r < 4; r++) {
                const uint8_t * b = w + (r0 + r) * rb + i * bb;
                if constexpr (K == k_q4_k) q4_k_block_ints<1>(b, xq, 0, i, &si[r], &mi[r], d[r], dm[r]);
                else d[r] = q6_k_block_ints<1>(b, xq, 0, i, &si[r]);
            }
            const __m128 dx = _mm_set1_ps(x[i].d);
            const __m128i s = sum4_lanes(fold_512(si[0]), fold_512(si[1]), fold_512(si[2]), fold_512(si[3]));
            acc = _mm_fmadd_ps(_mm_mul_ps(_mm_loadu_ps(d), dx), _mm_cvtepi32_ps(s), acc);
            if constexpr (K == k_q4_k) {
                const __m128i m = sum4_lanes(mi[0], mi[1], mi[2], mi[3]);
                acc = _mm_fnmadd_ps(_mm_mul_ps(_mm_loadu_ps(dm), dx), _mm_cvtepi32_ps(m), acc);
            }
        }
        _mm_storeu_ps(y + r0, acc);
    }
}

#endif // PEBBLE_X86

// ---------------------------------------------------------------------------------------------------
// dispatch

using dot_fn = void (*)(const uint8_t *, int64_t, const uint8_t *, int64_t, float *);
// Sixteen rows (row_bytes apart) times NV activations: (w, row_bytes, nb, xq, xs, out, out_stride).
using rows_fn = void (*)(const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, float *, int64_t);
constexpr int max_nv = 8; // the most activations any kernel multiplies per pass over a row
constexpr int group_rows = 16; // the rows a rows_fn takes

// How x is laid out for a kernel set: q8_32 (the 32-element types, every kernel), q8_256 (the K-quants
// but on AVX-512), q8_k512 in natural order (AVX-512's Q6_K) or paired sub-blocks (its Q4_K, Q5_K).
enum class act { q8_256, q8_32, f32, q8_k512, q8_k512_paired };

struct kernel_set {
    act     activation;
    int     block_elements, block_bytes;
    int     nv;          // activations per pass: dot[0..nv-1] are set
    dot_fn  dot[max_nv]; // dot[n - 1] multiplies n activations
    // rows[n - 1]: sixteen rows times n activations, in the same activation layout, or none. A type's rows
    // kernels give each row the bits its row kernels (which take a matrix's last rows, past its whole
    // groups of 16) give it: the same integer sums per block, the same float operations after them. So a
    // sequence's logits depend neither on the batch it is in nor on where a row falls in a matrix;
    // tests/test_quant_kernels.py holds them to it.
    rows_fn rows[max_nv];
};

template <template <int> class D, int... NV>
kernel_set make_set(act a, int elements, int bytes, std::integer_sequence<int, NV...>) {
    kernel_set k{a, elements, bytes, static_cast<int>(sizeof...(NV)), {}, {}};
    ((k.dot[NV] = D<NV + 1>::fn), ...);
    return k;
}

// Kernels with a fixed type K and every width up to N: wrappers that name the template's row function.
template <int N> using upto = std::make_integer_sequence<int, N>;
#define PEBBLE_DOT(name, fn_template)                                                  \
    template <int K> struct name {                                                      \
        template <int NV> struct at { static constexpr dot_fn fn = fn_template<K, NV>; }; \
    };
PEBBLE_DOT(dot32_portable, dot_32_portable)
PEBBLE_DOT(k45_portable, dot_k45_portable)
PEBBLE_DOT(float_portable, dot_float_portable)
template <int K> struct q6_portable { template <int NV> struct at { static constexpr dot_fn fn = dot_q6_k_portable<NV>; }; };
#ifdef PEBBLE_X86
PEBBLE_DOT(dot32_avx2, dot_32_avx2)
PEBBLE_DOT(k45_avx2, dot_k45_avx2)
PEBBLE_DOT(float_avx2, dot_float_avx2)
PEBBLE_DOT(k45_avx512, dot_k45_avx512)
template <int K> struct q6_avx2 { template <int NV> struct at { static constexpr dot_fn fn = dot_q6_k_avx2<NV>; }; };
PEBBLE_DOT(k_exact_avx512, dot_k_exact_avx512)
PEBBLE_DOT(dot32_avx512, dot_32_avx512)
#endif
#undef PEBBLE_DOT

// The portable and AVX2 kernels take 4 activations a pass (AVX2 has 16 registers), AVX-512's 8.
template <template <int> class D, int K> kernel_set set_of(act a, int elements, int bytes, int nv_count) {
    return nv_count == 8 ? make_set<D<K>::template at>(a, elements, bytes, upto<8>{})
                         : make_set<D<K>::template at>(a, elements, bytes, upto<4>{});
}

#ifdef PEBBLE_X86
// A kernel set with sixteen-row kernels R<n>::fn beside its row kernels.
template <template <int> class R, int... NV>
kernel_set with_rows(kernel_set k, std::integer_sequence<int, NV...>) {
    ((k.rows[NV] = R<NV + 1>::fn), ...);
    return k;
}
template <int NV> struct q4_k_rows { static constexpr rows_fn fn = NV == 1 ? rows16_one_k<k_q4_k> : rows16_q4_k<NV>; };
template <int NV> struct q6_k_rows { static constexpr rows_fn fn = NV == 1 ? rows16_one_k<k_q6_k> : rows16_q6_k<NV>; };
// (for one activation too: SmolLM2's Q4_1 decode step 6.96 -> 5.91 ms, Gemma-3's Q5_0/Q8_0 11.9 -> 9.4)
template <int K> struct rows32 { template <int NV> struct at { static constexpr rows_fn fn = rows16_32<K, NV>; }; };
#endif

// The AVX2 and the portable kernels of a type: one table, the families of row functions its arguments.
template <template <int> class Float, template <int> class Dot32, template <int> class K45, template <int> class Q6>
kernel_set four_at_a_time(int32_t type) {
    switch (type) {
        case 0:  return set_of<Float, k_f32>(act::f32, 1, 4, 4);
        case 1:  return set_of<Float, k_f16>(act::f32, 1, 2, 4);
        case 30: return set_of<Float, k_bf16>(act::f32, 1, 2, 4);
        case 2:  return set_of<Dot32, k_q4_0>(act::q8_32, 32, 18, 4);
        case 3:  return set_of<Dot32, k_q4_1>(act::q8_32, 32, 20, 4);
        case 6:  return set_of<Dot32, k_q5_0>(act::q8_32, 32, 22, 4);
        case 7:  return set_of<Dot32, k_q5_1>(act::q8_32, 32, 24, 4);
        case 8:  return set_of<Dot32, k_q8_0>(act::q8_32, 32, 34, 4);
        case 12: return set_of<K45, k_q4_k>(act::q8_256, 256, 144, 4);
        case 13: return set_of<K45, k_q5_k>(act::q8_256, 256, 176, 4);
        case 14: return set_of<Q6, 0>(act::q8_256, 256, 210, 4);
    }
    return {act::f32, 0, 0, 0, {}, {}};
}

// The kernels of a GGUF type id on this CPU; block_elements 0 for a type without them (the callers have
// refused those already).
kernel_set kernels_for(int32_t type) {
    const simd level = simd_in_use();
#ifdef PEBBLE_X86
    if (level == simd::avx512) {
        switch (type) {
            case 2:  return with_rows<rows32<k_q4_0>::template at>(set_of<dot32_avx512, k_q4_0>(act::q8_32, 32, 18, 8), upto<8>{});
            case 3:  return with_rows<rows32<k_q4_1>::template at>(set_of<dot32_avx512, k_q4_1>(act::q8_32, 32, 20, 8), upto<8>{});
            case 6:  return with_rows<rows32<k_q5_0>::template at>(set_of<dot32_avx512, k_q5_0>(act::q8_32, 32, 22, 8), upto<8>{});
            case 7:  return with_rows<rows32<k_q5_1>::template at>(set_of<dot32_avx512, k_q5_1>(act::q8_32, 32, 24, 8), upto<8>{});
            case 8:  return with_rows<rows32<k_q8_0>::template at>(set_of<dot32_avx512, k_q8_0>(act::q8_32, 32, 34, 8), upto<8>{});
            case 12: return with_rows<q4_k_rows>(set_of<k_exact_avx512, k_q4_k>(act::q8_k512_paired, 256, 144, 8), upto<8>{});
            case 13: return set_of<k45_avx512, k_q5_k>(act::q8_k512_paired, 256, 176, 8);
            case 14: return with_rows<q6_k_rows>(set_of<k_exact_avx512, k_q6_k>(act::q8_k512, 256, 210, 8), upto<8>{});
        }
    }
    if (level != simd::portable) return four_at_a_time<float_avx2, dot32_avx2, k45_avx2, q6_avx2>(type);
#endif
    (void)level;
    return four_at_a_time<float_portable, dot32_portable, k45_portable, q6_portable>(type);
}

// Bytes of one activation of n_cols elements in layout a.
int64_t activation_bytes(act a, int64_t n_cols) {
    switch (a) {
        case act::q8_256:         return (n_cols / 256) * static_cast<int64_t>(sizeof(q8_256));
        case act::q8_32:          return (n_cols / 32) * static_cast<int64_t>(sizeof(q8_32));
        case act::f32:            return n_cols * static_cast<int64_t>(sizeof(float));
#ifdef PEBBLE_X86
        case act::q8_k512:
        case act::q8_k512_paired: return (n_cols / 256) * static_cast<int64_t>(sizeof(q8_k512));
#else
        default:                  break;
#endif
    }
    return 0;
}

void quantize_activation(act a, const uint16_t * x, int64_t n_cols, uint8_t * out) {
    switch (a) {
        case act::q8_256: quantize_256(x, n_cols, reinterpret_cast<q8_256 *>(out)); break;
        case act::q8_32:  quantize_32(x, n_cols, reinterpret_cast<q8_32 *>(out)); break;
        case act::f32:    to_float(x, n_cols, reinterpret_cast<float *>(out)); break;
#ifdef PEBBLE_X86
        case act::q8_k512:        quantize_k512(x, n_cols, false, reinterpret_cast<q8_k512 *>(out)); break;
        case act::q8_k512_paired: quantize_k512(x, n_cols, true, reinterpret_cast<q8_k512 *>(out)); break;
#else
        default: break;
#endif
    }
}

// One call's work: W (n_rows rows of row_bytes) times n_tok activations of xs bytes each.
struct matmul_job {
    const kernel_set * k;
    const uint8_t *    w;
    int64_t            row_bytes, nb, n_rows, n_tok;
    const uint8_t *    xq;
    int64_t            xs;
    float *            y;
    int64_t            tile_rows;
};

// Tiles [begin, end) of tile_rows rows each: every activation (the kernel set's nv at a time) through the
// tile's rows, so that the tile stays in cache while they pass.
// How far ahead of the row multiplied its thread asks memory for the rows to come: a decode step reads
// each weight once, from memory, and the hardware's prefetcher alone left half the bandwidth unused.
constexpr int64_t prefetch_bytes = 8192;

inline void prefetch_row(const uint8_t * row, int64_t nbytes) {
    for (int64_t o = 0; o < nbytes; o += 64) __builtin_prefetch(row + o, 0, 3);
}

void matmul_tiles(void * ctx, int64_t begin, int64_t end) {
    const matmul_job & j = *static_cast<const matmul_job *>(ctx);
    const int64_t r0 = begin * j.tile_rows, r1 = std::min(j.n_rows, end * j.tile_rows);
    const int64_t ahead = (prefetch_bytes + j.row_bytes - 1) / j.row_bytes;
    for (int64_t rt = r0; rt < r1; rt += j.tile_rows) {
        const int64_t rt_end = std::min(r1, rt + j.tile_rows);
        for (int64_t t = 0; t < j.n_tok; t += j.k->nv) {
            const int nv = static_cast<int>(std::min<int64_t>(j.k->nv, j.n_tok - t));
            int64_t r = rt; // whole groups of 16 rows first where the set has rows kernels, then row by row
            // (the 32-element types gather each row's first dword at 32-bit offsets: rows of under 128 MiB)
            if (const rows_fn rows = j.k->rows[nv - 1]; rows && j.row_bytes <= INT32_MAX / group_rows) {
                for (; r + group_rows <= rt_end; r += group_rows) {
                    rows(j.w + r * j.row_bytes, j.row_bytes, j.nb, j.xq + t * j.xs, j.xs, j.y + t * j.n_rows + r, j.n_rows);
                }
            }
            for (; r < rt_end; r++) {
                float out[max_nv];
                if (t == 0 && r + ahead < r1) prefetch_row(j.w + (r + ahead) * j.row_bytes, j.row_bytes);
                j.k->dot[nv - 1](j.w + r * j.row_bytes, j.nb, j.xq + t * j.xs, j.xs, out);
                for (int v = 0; v < nv; v++) j.y[(t + v) * j.n_rows + r] = out[v];
            }
        }
    }
}

} // namespace

namespace {

// ---------------------------------------------------------------------------------------------------
// attention of one query per (sequence, head)

struct attend_job {
    const float *        q;
    int32_t              type;      // the caches' KV type (pebble_kv.h)
    void * const *       k, * const * v;
    const int64_t *      n_pos;
    int64_t              n_rows;
    int32_t              n_head, n_head_kv, head_dim;
    float                scale, softcap;
    float *              out, * scratch;
};

inline float cache_value(const void * p, int32_t type, int64_t i) { return kv_load(p, type, i); }

// The n scores, whose largest is top, as their softmax: exp(s - top) over the sum of them all.
inline void softmax_scores(float * sc, int64_t n, float top) {
    float total = 0.0f;
    for (int64_t s = 0; s < n; s++) {
        sc[s] = std::exp(sc[s] - top);
        total += sc[s];
    }
    for (int64_t s = 0; s < n; s++) sc[s] = sc[s] / total;
}

// The scores of row s: (q * scale) . k[s], soft-capped where asked; then softmax; then the weighted sum
// of V. Written once for both instruction sets: `dot` and `axpy` are the SIMD or portable loops.
template <typename Dot, typename Axpy>
inline void attend_head(const attend_job & j, int64_t unit, Dot dot, Axpy axpy) {
    const int64_t b = unit / j.n_head, h = unit % j.n_head;
    const int64_t group = j.n_head / j.n_head_kv, row = int64_t(j.n_head_kv) * j.head_dim;
    const int64_t kv = (h / group) * j.head_dim, n = j.n_pos[b];
    const float * qh = j.q + (b * j.n_head + h) * j.head_dim;
    float * sc = j.scratch + unit * j.n_rows;
    float top = -INFINITY;
    for (int64_t s = 0; s < n; s++) {
        float d = dot(qh, j.k[b], s * row + kv);
        if (j.softcap > 0.0f) d = std::tanh(d / j.softcap) * j.softcap;
        sc[s] = d;
        top = std::max(top, d);
    }
    softmax_scores(sc, n, top);
    float * o = j.out + (b * j.n_head + h) * j.head_dim;
    for (int32_t d = 0; d < j.head_dim; d++) o[d] = 0.0f;
    for (int64_t s = 0; s < n; s++) axpy(o, sc[s], j.v[b], s * row + kv);
}

void attend_portable(void * ctx, int64_t begin, int64_t end) {
    const attend_job & j = *static_cast<const attend_job *>(ctx);
    const int32_t hd = j.head_dim;
    for (int64_t u = begin; u < end; u++) {
        attend_head(j, u, [&](const float * qh, const void * k, int64_t at) {
            float acc = 0.0f;
            for (int32_t d = 0; d < hd; d++) acc += (qh[d] * j.scale) * cache_value(k, j.type, at + d);
            return acc;
        }, [&](float * o, float p, const void * v, int64_t at) {
            for (int32_t d = 0; d < hd; d++) o[d] += p * cache_value(v, j.type, at + d);
        });
    }
}

#ifdef PEBBLE_X86
// Values i..i+7 of a cache (i a multiple of 8, so a block type's eight lie in one block), as float32: the
// same products of scale and value as kv_load, so either way a score is the same.
AVX2 __attribute__((always_inline)) inline __m256 load8_cache(const void * p, int32_t type, int64_t i) {
    if (type == kv_f16) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(p) + i)));
    }
    if (type == kv_f32) return _mm256_loadu_ps(static_cast<const float *>(p) + i);
    const uint8_t * b = static_cast<const uint8_t *>(p) + (i / kv_block) * kv_block_bytes(type);
    const __m256 d = _mm256_set1_ps(f16c(b));
    const int64_t o = i % kv_block;
    if (type == kv_q8_0) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(b + 2 + o));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(b + 2 + (o & 15))));
    if (o >= 16) q = _mm256_srli_epi32(q, 4);
    q = _mm256_sub_epi32(_mm256_and_si256(q, _mm256_set1_epi32(0x0F)), _mm256_set1_epi32(8));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
}

// The sums of four registers' lanes, each in hsum_ps's order (so a score is the same whichever way it
// was summed): out[i] = hsum_ps(a_i).
AVX2 inline void hsum4_ps(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float * out) {
    const __m256 x01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
    const __m256 x23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
    // lane 0 of each half: (0 + 2, 1 + 3) of a0 then a2; lane 1: of a1 then a3
    const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(x01, x23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(x01, x23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(w, w, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(w, w, _MM_SHUFFLE(3, 1, 3, 1)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, z);
    out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[1], out[3] = lanes[5];
}

// attend_head's arithmetic, restructured: the scores four rows at a time (q scaled once per four), and the
// weighted sum of V 64 dims at a time held in registers over every row. Each score and each output is
// summed in the same order as attend_head sums it, so the results are the same bit for bit.
AVX2 void attend_avx2(void * ctx, int64_t begin, int64_t end) {
    const attend_job & j = *static_cast<const attend_job *>(ctx);
    const int32_t hd = j.head_dim, whole = hd / 8 * 8;
    const __m256 scale = _mm256_set1_ps(j.scale);
    const int64_t group = j.n_head / j.n_head_kv, row = int64_t(j.n_head_kv) * j.head_dim;
    for (int64_t u = begin; u < end; u++) {
        const int64_t b = u / j.n_head, h = u % j.n_head;
        const int64_t kv = (h / group) * j.head_dim, n = j.n_pos[b];
        const float * qh = j.q + (b * j.n_head + h) * j.head_dim;
        const void * k = j.k[b], * v = j.v[b];
        float * sc = j.scratch + u * j.n_rows;
        float top = -INFINITY;
        auto tail = [&](int64_t s, float sum) AVX2 {
            for (int32_t d = whole; d < hd; d++) sum += (qh[d] * j.scale) * cache_value(k, j.type, s * row + kv + d);
            if (j.softcap > 0.0f) sum = std::tanh(sum / j.softcap) * j.softcap;
            sc[s] = sum;
            top = std::max(top, sum);
        };
        int64_t s = 0;
        for (; s + 4 <= n; s += 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int32_t d = 0; d < whole; d += 8) {
                const __m256 qv = _mm256_mul_ps(_mm256_loadu_ps(qh + d), scale);
                const int64_t at = s * row + kv + d;
                a0 = _mm256_fmadd_ps(qv, load8_cache(k, j.type, at), a0);
                a1 = _mm256_fmadd_ps(qv, load8_cache(k, j.type, at + row), a1);
                a2 = _mm256_fmadd_ps(qv, load8_cache(k, j.type, at + 2 * row), a2);
                a3 = _mm256_fmadd_ps(qv, load8_cache(k, j.type, at + 3 * row), a3);
            }
            float sums[4];
            hsum4_ps(a0, a1, a2, a3, sums);
            for (int i = 0; i < 4; i++) tail(s + i, sums[i]);
        }
        for (; s < n; s++) {
            __m256 acc = _mm256_setzero_ps();
            for (int32_t d = 0; d < whole; d += 8) {
                acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(qh + d), scale), load8_cache(k, j.type, s * row + kv + d),
                                      acc);
            }
            tail(s, hsum_ps(acc));
        }
        softmax_scores(sc, n, top);
        float * o = j.out + (b * j.n_head + h) * j.head_dim;
        int32_t d = 0;
        for (; d + 64 <= whole; d += 64) { // 8 registers over every row
            __m256 acc[8];
            UNROLL for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const __m256 pv = _mm256_set1_ps(sc[t]);
                UNROLL for (int r = 0; r < 8; r++) {
                    acc[r] = _mm256_fmadd_ps(pv, load8_cache(v, j.type, t * row + kv + d + 8 * r), acc[r]);
                }
            }
            UNROLL for (int r = 0; r < 8; r++) _mm256_storeu_ps(o + d + 8 * r, acc[r]);
        }
        for (; d < whole; d += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[t]), load8_cache(v, j.type, t * row + kv + d), acc);
            _mm256_storeu_ps(o + d, acc);
        }
        for (; d < hd; d++) {
            float acc = 0.0f;
            for (int64_t t = 0; t < n; t++) acc += sc[t] * cache_value(v, j.type, t * row + kv + d);
            o[d] = acc;
        }
    }
}

// The 32 values of a Q8_0 or Q4_0 block's quants (qs: the bytes after its scale), unscaled, as float32 in
// four registers of eight: the quants read once (16 bytes of Q4_0 hold all 32: low nibbles, then high).
AVX2 inline void block32(const uint8_t * qs, int32_t type, __m256 out[4]) {
    if (type == kv_q8_0) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs + 16));
        out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
        out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
        out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
        return;
    }
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs)), mask = _mm_set1_epi8(0x0F);
    const __m128i eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, mask), eight);                     // values 0..15
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), eight);  // values 16..31
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// Caches of every type (F32 and F16 with head_dim a multiple of 8; Q8_0 and Q4_0, whose head_dim is a
// multiple of 32), read in the order they lie in memory. A cache row holds
// every KV head of one position; reading one KV head down all the rows (256 of every 2048 bytes for
// Qwen3-0.6B's 8 heads of 128) left the hardware's prefetchers behind: on two threads of an AMD EPYC (Zen 4)
// over caches not in its caches, 0.44-0.67 ms a layer at 1000 rows, 0.23-0.30 ms read row after row (28
// layers of caches attended in turn, the two orders interleaved). Reading even two rows side by side
// (rows t and t + 1 for each KV head) lost half of that again. So a unit is a chunk of one sequence's rows
// (flash-decoding's split of the context) and its K rows are read in order, every query head's score from
// each, while the same rows of V are asked into L2 (software prefetch, in order); then each score s
// becomes exp(s - m), m the chunk's largest, l their total; then V, now in L2, is summed in registers over
// all the chunk's rows, 16 or 32 dims of up to 6 heads at a time (a 32-value block of up to 2 heads for
// Q8_0 and Q4_0): o = sum exp(s - m) v. A sequence of one
// chunk ends there (out = o / l); the chunks of a longer one are combined by attend_combine_avx2:
// out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c, M the largest m_c. How a sequence's rows are
// chunked depends on its own row count alone, so its result is the same beside any others.
constexpr int64_t attend_chunk_rows = 128, attend_most_chunks = 64;

inline int64_t attend_chunks(int64_t n) { return std::min(attend_most_chunks, (n + attend_chunk_rows - 1) / attend_chunk_rows); }

struct rows_job {
    const attend_job * j;
    const int64_t *    first;  // first[b]: sequence b's first unit; first[n_seq]: every unit
    const float *      qs;     // [n_seq][n_head][head_dim]: q times scale
    float *            part;   // per unit: o [n_head][head_dim], then m [n_head], then l [n_head]
};

inline int64_t part_floats(const attend_job & j) { return int64_t(j.n_head) * (j.head_dim + 2); }

// Up to 8 query heads of one KV head: their scores against one cache row (out[i * stride]). Each head sums
// in A registers (8 for one head, 4 for two, 2 for up to six, else 1), so that several chains of
// multiply-adds run side by side: with one a head, Qwen3's pairs of heads waited on each add's latency.
template <int G>
AVX2 inline void row_scores(const float * q, int32_t hd, const void * k, int32_t type, int64_t at, float * out,
                            int64_t stride) {
    constexpr int A = G == 1 ? 8 : G == 2 ? 4 : G <= 6 ? 2 : 1;
    __m256 acc[G][A];
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int a = 0; a < A; a++) acc[i][a] = _mm256_setzero_ps();
    int32_t d = 0;
    for (; d + 8 * A <= hd; d += 8 * A) {
        UNROLL for (int a = 0; a < A; a++) {
            const __m256 x = load8_cache(k, type, at + d + 8 * a);
            UNROLL for (int i = 0; i < G; i++) {
                acc[i][a] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * hd + d + 8 * a), x, acc[i][a]);
            }
        }
    }
    for (; d < hd; d += 8) {
        const __m256 x = load8_cache(k, type, at + d);
        UNROLL for (int i = 0; i < G; i++) acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * hd + d), x, acc[i][0]);
    }
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int a = 1; a < A; a++) acc[i][0] = _mm256_add_ps(acc[i][0], acc[i][a]);
    int i = 0;
    for (; i + 4 <= G; i += 4) { // four heads' lanes summed together, each as hsum_ps sums
        float sums[4];
        hsum4_ps(acc[i][0], acc[i + 1][0], acc[i + 2][0], acc[i + 3][0], sums);
        UNROLL for (int c = 0; c < 4; c++) out[(i + c) * stride] = sums[c];
    }
    for (; i < G; i++) out[i * stride] = hsum_ps(acc[i][0]);
}

// 8 * NB dims of up to 6 query heads of one KV head, summed over the rows s0..s1 of V (in L2 by now):
// o[i * hd + d] = sum_t p[i * stride + t] v_t[d], for the NB blocks of 8 dims from `at`.
template <int G, int NB>
AVX2 inline void column_values(const float * p, int64_t stride, const void * v, int32_t type, int64_t at, int64_t row,
                               int64_t s0, int64_t s1, float * o, int32_t hd) {
    __m256 acc[G][NB];
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int c = 0; c < NB; c++) acc[i][c] = _mm256_setzero_ps();
    for (int64_t t = s0; t < s1; t++) {
        __m256 x[NB];
        UNROLL for (int c = 0; c < NB; c++) x[c] = load8_cache(v, type, at + t * row + 8 * c);
        UNROLL for (int i = 0; i < G; i++) {
            const __m256 w = _mm256_broadcast_ss(p + i * stride + t);
            UNROLL for (int c = 0; c < NB; c++) acc[i][c] = _mm256_fmadd_ps(w, x[c], acc[i][c]);
        }
    }
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int c = 0; c < NB; c++) _mm256_storeu_ps(o + i * hd + 8 * c, acc[i][c]);
}

// row_scores over Q8_0 or Q4_0 blocks (k: the KV head's first block in the row): a block's quants converted
// in registers once for the G heads and its scale applied once to each head's part of the score.
template <int G>
AVX2 inline void row_scores_blocks(const float * q, int32_t hd, const uint8_t * k, int32_t type, float * out,
                                   int64_t stride) {
    const int64_t bb = kv_block_bytes(type);
    __m256 acc[G];
    UNROLL for (int i = 0; i < G; i++) acc[i] = _mm256_setzero_ps();
    for (int32_t c = 0; c < hd; c += kv_block, k += bb) {
        __m256 x[4];
        block32(k + 2, type, x);
        const __m256 d = _mm256_set1_ps(f16c(k));
        UNROLL for (int i = 0; i < G; i++) {
            const float * qi = q + i * hd + c;
            __m256 part = _mm256_mul_ps(_mm256_loadu_ps(qi), x[0]);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 8), x[1], part);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 16), x[2], part);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 24), x[3], part);
            acc[i] = _mm256_fmadd_ps(d, part, acc[i]);
        }
    }
    UNROLL for (int i = 0; i < G; i++) out[i * stride] = hsum_ps(acc[i]);
}

// column_values over one block (32 dims) of Q8_0 or Q4_0 for G <= 2 heads (v: the block in row 0), the
// block's scale folded into each row's weight.
template <int G>
AVX2 inline void column_values_blocks(const float * p, int64_t stride, const uint8_t * v, int32_t type,
                                      int64_t row_bytes, int64_t s0, int64_t s1, float * o, int32_t hd) {
    __m256 acc[G][4];
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int c = 0; c < 4; c++) acc[i][c] = _mm256_setzero_ps();
    for (int64_t t = s0; t < s1; t++) {
        const uint8_t * blk = v + t * row_bytes;
        __m256 x[4];
        block32(blk + 2, type, x);
        const float d = f16c(blk);
        UNROLL for (int i = 0; i < G; i++) {
            const __m256 w = _mm256_set1_ps(p[i * stride + t] * d);
            UNROLL for (int c = 0; c < 4; c++) acc[i][c] = _mm256_fmadd_ps(w, x[c], acc[i][c]);
        }
    }
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + i * hd + 8 * c, acc[i][c]);
}

// f(std::integral_constant<int, g>) for g in 1..8.
template <typename F>
AVX2 inline void with_heads(int g, F && f) {
    switch (g) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

// The query heads of one KV head in runs of at most `most`, as even as they come (8 in 6s: 4 and 4): how
// many a run takes (worked out once per call: two divisions a row and KV head cost a fifth of the scores).
inline int64_t run_heads(int64_t group, int64_t most) {
    const int64_t runs = (group + most - 1) / most;
    return (group + runs - 1) / runs;
}

// f(first head, heads) for the runs of `per` (run_heads) of query heads h0 .. h0 + group - 1.
template <typename F>
inline void head_runs(int64_t h0, int64_t group, int64_t per, F && f) {
    for (int64_t h = 0; h < group; h += per) f(h0 + h, std::min(per, group - h));
}

// The chunk's scores into exp(s - m), m their largest (returned), and their total into *l.
AVX2 inline float chunk_softmax(float * p, int64_t s0, int64_t s1, float softcap, float * l) {
    if (softcap > 0.0f) {
        for (int64_t s = s0; s < s1; s++) p[s] = std::tanh(p[s] / softcap) * softcap;
    }
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t s = s0;
    for (; s + 8 <= s1; s += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(p + s));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top8);
    float top = -INFINITY;
    for (float x : lanes) top = std::max(top, x);
    for (; s < s1; s++) top = std::max(top, p[s]);
    const __m256 t = _mm256_set1_ps(top);
    __m256 total8 = _mm256_setzero_ps();
    for (s = s0; s + 8 <= s1; s += 8) {
        const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + s), t));
        _mm256_storeu_ps(p + s, e);
        total8 = _mm256_add_ps(total8, e);
    }
    float total = hsum_ps(total8);
    for (; s < s1; s++) {
        p[s] = exp_nonpositive(p[s] - top);
        total += p[s];
    }
    *l = total;
    return top;
}

AVX2 void attend_rows_avx2(void * ctx, int64_t begin, int64_t end) {
    const rows_job & r = *static_cast<const rows_job *>(ctx);
    const attend_job & j = *r.j;
    const int32_t hd = j.head_dim;
    const int64_t group = j.n_head / j.n_head_kv, row = int64_t(j.n_head_kv) * hd;
    const int64_t row_bytes = pebble_internal::kv_bytes(j.type, row);
    const int64_t score_run = run_heads(group, 8), value_run = run_heads(group, 6), block_run = run_heads(group, 2);
    const bool blocked = kv_blocked(j.type);
    const int64_t head_bytes = pebble_internal::kv_bytes(j.type, hd); // a KV head's part of a row
    int64_t b = 0;
    for (int64_t u = begin; u < end; u++) {
        while (r.first[b + 1] <= u) b++;
        const int64_t n = j.n_pos[b], chunks = r.first[b + 1] - r.first[b], c = u - r.first[b];
        const int64_t s0 = n * c / chunks, s1 = n * (c + 1) / chunks;
        const float * q = r.qs + b * j.n_head * hd;
        float * sc = j.scratch + b * j.n_head * j.n_rows;
        // one chunk: straight into the output, divided by l below; else the unit's partial sums
        float * o = chunks == 1 ? j.out + b * j.n_head * hd : r.part + u * part_floats(j);
        float * m = r.part + u * part_floats(j) + int64_t(j.n_head) * hd, * l = m + j.n_head;
        const void * k = j.k[b], * v = j.v[b];
        for (int64_t s = s0; s < s1; s++) {
            const char * vr = static_cast<const char *>(v) + s * row_bytes;
            for (int64_t i = 0; i < row_bytes; i += 64) _mm_prefetch(vr + i, _MM_HINT_T1);
            for (int64_t g = 0; g < j.n_head_kv; g++) {
                head_runs(g * group, group, score_run, [&](int64_t h, int64_t heads) AVX2 {
                    with_heads(int(heads), [&](auto G) AVX2 {
                        constexpr int H = decltype(G)::value;
                        if (blocked) {
                            row_scores_blocks<H>(q + h * hd, hd, static_cast<const uint8_t *>(k) + s * row_bytes +
                                                 g * head_bytes, j.type, sc + h * j.n_rows + s, j.n_rows);
                        } else {
                            row_scores<H>(q + h * hd, hd, k, j.type, s * row + g * hd, sc + h * j.n_rows + s, j.n_rows);
                        }
                    });
                });
            }
        }
        for (int64_t h = 0; h < j.n_head; h++) m[h] = chunk_softmax(sc + h * j.n_rows, s0, s1, j.softcap, l + h);
        for (int64_t g = 0; blocked && g < j.n_head_kv; g++) {
            head_runs(g * group, group, block_run, [&](int64_t h, int64_t heads) AVX2 {
                for (int32_t c = 0; c < hd; c += kv_block) {
                    const uint8_t * vb = static_cast<const uint8_t *>(v) + g * head_bytes + c / kv_block * kv_block_bytes(j.type);
                    if (heads == 2) {
                        column_values_blocks<2>(sc + h * j.n_rows, j.n_rows, vb, j.type, row_bytes, s0, s1, o + h * hd + c, hd);
                    } else {
                        column_values_blocks<1>(sc + h * j.n_rows, j.n_rows, vb, j.type, row_bytes, s0, s1, o + h * hd + c, hd);
                    }
                }
            });
        }
        for (int64_t g = 0; !blocked && g < j.n_head_kv; g++) {
            head_runs(g * group, group, value_run, [&](int64_t h, int64_t heads) AVX2 {
                with_heads(int(heads), [&](auto G) AVX2 {
                    constexpr int H = decltype(G)::value;
                    if constexpr (H <= 6) {
                        constexpr int NB = H <= 2 ? 4 : 2;
                        int32_t d = 0;
                        for (; d + 8 * NB <= hd; d += 8 * NB) {
                            column_values<H, NB>(sc + h * j.n_rows, j.n_rows, v, j.type, g * hd + d, row, s0, s1,
                                                 o + h * hd + d, hd);
                        }
                        for (; d < hd; d += 8) {
                            column_values<H, 1>(sc + h * j.n_rows, j.n_rows, v, j.type, g * hd + d, row, s0, s1,
                                                o + h * hd + d, hd);
                        }
                    }
                });
            });
        }
        if (chunks == 1) {
            for (int64_t h = 0; h < j.n_head; h++) {
                const __m256 inv = _mm256_set1_ps(1.0f / l[h]);
                for (int32_t d = 0; d < hd; d += 8) {
                    _mm256_storeu_ps(o + h * hd + d, _mm256_mul_ps(_mm256_loadu_ps(o + h * hd + d), inv));
                }
            }
        }
    }
}

// The chunks of sequence u / n_head, head u % n_head, combined into its output (sequences of one chunk
// are done already).
AVX2 void attend_combine_avx2(void * ctx, int64_t begin, int64_t end) {
    const rows_job & r = *static_cast<const rows_job *>(ctx);
    const attend_job & j = *r.j;
    const int32_t hd = j.head_dim;
    const int64_t per = part_floats(j), ml = int64_t(j.n_head) * hd; // a unit's floats; where its m begin
    for (int64_t u = begin; u < end; u++) {
        const int64_t b = u / j.n_head, h = u % j.n_head, first = r.first[b], chunks = r.first[b + 1] - first;
        if (chunks == 1) continue;
        const float * part = r.part + first * per;
        float top = -INFINITY, total = 0.0f, w[attend_most_chunks];
        for (int64_t c = 0; c < chunks; c++) top = std::max(top, part[c * per + ml + h]);
        for (int64_t c = 0; c < chunks; c++) {
            w[c] = exp_nonpositive(part[c * per + ml + h] - top);
            total += w[c] * part[c * per + ml + j.n_head + h];
        }
        for (int64_t c = 0; c < chunks; c++) w[c] /= total;
        float * out = j.out + u * hd;
        for (int32_t d = 0; d < hd; d += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) {
                acc = _mm256_fmadd_ps(_mm256_set1_ps(w[c]), _mm256_loadu_ps(part + c * per + h * hd + d), acc);
            }
            _mm256_storeu_ps(out + d, acc);
        }
    }
}
#endif

} // namespace

pebble_status attend(int32_t n_seq, const float * q, int32_t kv_type, void * const * k_caches, void * const * v_caches,
                     const int64_t * n_pos, int64_t n_rows, int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                     float scale, float softcap, float * out, float * scratch) {
    TRY(check_threads("pebble_attend"));
    attend_job job{q, kv_type, k_caches, v_caches, n_pos, n_rows, n_head, n_head_kv, head_dim, scale, softcap, out, scratch};
    // What the pool judges the call by: its multiply-adds, eight times over, as a decode step's caches come
    // from memory, not from cache (their rows were last read a whole step of weights ago): SmolLM2's 8
    // sequences of 48 rows, serial by their multiply-adds alone, took 30% less time on two threads.
    int64_t work = 0;
    for (int32_t b = 0; b < n_seq; b++) work += 2 * n_pos[b] * n_head * head_dim;
    work *= 8;
#ifdef PEBBLE_X86
    if (simd_in_use() != simd::portable) {
        if (head_dim % 8 == 0) { // the block types' head_dim is a multiple of 32 (pebble_attend's check)
            // The scaled queries and each chunk's partial sums: the calling thread's, kept for its next call.
            thread_local std::vector<int64_t> first;
            thread_local std::vector<float> floats;
            int64_t units = 0;
            try {
                first.resize(size_t(n_seq) + 1);
                for (int32_t b = 0; b < n_seq; b++) first[b] = units, units += attend_chunks(n_pos[b]);
                first[n_seq] = units;
                floats.resize(size_t(int64_t(n_seq) * n_head * head_dim + units * part_floats(job)));
            } catch (const std::bad_alloc &) {
                return fail(PEBBLE_ERR_HOST_OOM, "pebble_attend: no host memory for the partial sums of %" PRId64
                            " chunks of %" PRId64 " rows", units, attend_chunk_rows);
            }
            float * qs = floats.data();
            for (int64_t i = 0; i < int64_t(n_seq) * n_head * head_dim; i++) qs[i] = q[i] * scale;
            rows_job rows{&job, first.data(), qs, qs + int64_t(n_seq) * n_head * head_dim};
            parallel_ranges(units, work, attend_rows_avx2, &rows);
            if (units > n_seq) {
                parallel_ranges(int64_t(n_seq) * n_head, units * n_head * head_dim, attend_combine_avx2, &rows);
            }
            return PEBBLE_OK;
        }
        parallel_ranges(int64_t(n_seq) * n_head, work, attend_avx2, &job);
        return PEBBLE_OK;
    }
#endif
    parallel_ranges(int64_t(n_seq) * n_head, work, attend_portable, &job);
    return PEBBLE_OK;
}

bool gpu_arithmetic() {
    static const bool gpu = [] {
        const char * env = std::getenv("PEBBLING_SIMD");
        return env && std::strcmp(env, "gpu") == 0;
    }();
    return gpu;
}

void quantize(const uint16_t * x, int n, float & d, int8_t * q) {
    if (n == 256) {
        quantize_block<256>(x, d, q);
    } else {
        quantize_block<32>(x, d, q);
    }
}

const char * simd_level() {
    switch (simd_in_use()) {
        case simd::avx512: return "avx512";
        case simd::avx2:   return "avx2";
        default:           return "portable";
    }
}

namespace {

// The portable gate, as the CUDA kernels compute it (swiglu_kernel, geglu_kernel in pebble_decode.cu).
float gated_one(bool gelu, float g, float u) {
    if (gelu) return 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    return g / (1.0f + std::exp(-g)) * u;
}

#ifdef PEBBLE_X86
// Eight elements: sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below, e = exp(-|g|); tanh(y) =
// sign(y) (1 - e) / (1 + e), e = exp(-2|y|). Every exp's argument is <= 0, as exp8_nonpositive wants.
AVX2 void gated_avx2(bool gelu, const float * g, const float * u, int64_t begin, int64_t end, float * out) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    for (int64_t i = begin; i < end; i += 8) {
        const int left = static_cast<int>(std::min<int64_t>(8, end - i));
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 x = _mm256_maskload_ps(g + i, mask), up = _mm256_maskload_ps(u + i, mask);
        __m256 f;
        if (gelu) {
            const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                           _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), _mm256_mul_ps(x, x)), x, x));
            const __m256 e = exp8_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, y)));
            const __m256 t = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), _mm256_and_ps(y, sign));
            f = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t));
        } else {
            const __m256 e = exp8_nonpositive(_mm256_or_ps(x, sign));
            const __m256 s = _mm256_div_ps(_mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ)),
                                           _mm256_add_ps(one, e));
            f = _mm256_mul_ps(x, s);
        }
        _mm256_maskstore_ps(out + i, mask, _mm256_mul_ps(f, up));
    }
}
#endif

} // namespace

void gated(bool gelu, const float * gate, const float * up, int64_t n, float * out) {
    // ranges of whole groups of eight, so that no thread's range ends inside one
    const int64_t groups = (n + 7) / 8;
    parallel_for(groups, n * 16, [=](int64_t begin, int64_t end) {
        const int64_t b = begin * 8, e = std::min(n, end * 8);
#ifdef PEBBLE_X86
        if (simd_in_use() != simd::portable) {
            gated_avx2(gelu, gate, up, b, e, out);
            return;
        }
#endif
        for (int64_t i = b; i < e; i++) out[i] = gated_one(gelu, gate[i], up[i]);
    });
}

namespace {

const kernel_set & kernels_of(int32_t ggml_type) {
    static const kernel_set sets[PEBBLE_TYPE_COUNT] = {
        kernels_for(0), kernels_for(1), kernels_for(2), kernels_for(3), kernels_for(4), kernels_for(5),
        kernels_for(6), kernels_for(7), kernels_for(8), kernels_for(9), kernels_for(10), kernels_for(11),
        kernels_for(12), kernels_for(13), kernels_for(14), kernels_for(15), kernels_for(16), kernels_for(17),
        kernels_for(18), kernels_for(19), kernels_for(20), kernels_for(21), kernels_for(22), kernels_for(23),
        kernels_for(24), kernels_for(25), kernels_for(26), kernels_for(27), kernels_for(28), kernels_for(29),
        kernels_for(30),
    };
    return sets[ggml_type];
}

// x's n_tok vectors as kernel set k's activations, quantized once (one 64-byte aligned buffer of n_tok rows
// of *xs bytes, the caller's to std::free), or taken as they are where dense weights are given float32
// vectors and exact_f32 asks for it.
pebble_status quantize_x(const kernel_set & k, int32_t ggml_type, int64_t n_cols, const void * x, bool x_f32,
                         int64_t n_tok, bool exact_f32, const char * fn, uint8_t ** out, int64_t * xs_out) {
    const int64_t xs = activation_bytes(k.activation, n_cols); // a multiple of 64 where a kernel needs it
    if (n_tok > (INT64_MAX - 63) / xs) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %s: %" PRId64 " activations of %" PRId64 " take more than "
                    "2^63 bytes", fn, pebble_internal::ggml_type_name(ggml_type), n_tok, n_cols);
    }
    uint8_t * xq = static_cast<uint8_t *>(std::aligned_alloc(64, static_cast<size_t>((n_tok * xs + 63) / 64 * 64)));
    if (!xq) {
        return fail(PEBBLE_ERR_HOST_OOM, "%s: %s: no memory for %" PRId64 " quantized activations of %" PRId64
                    " (%" PRId64 " bytes)", fn, pebble_internal::ggml_type_name(ggml_type), n_tok, n_cols, n_tok * xs);
    }
    const bool as_they_are = x_f32 && exact_f32 && k.activation == act::f32;
    if (as_they_are) std::memcpy(xq, x, static_cast<size_t>(n_tok * n_cols) * sizeof(float));
    struct quantize_ctx { act a; const void * x; bool f32; int64_t n_cols, xs; uint8_t * xq; } qc{k.activation, x, x_f32,
                                                                                                n_cols, xs, xq};
    std::atomic<bool> no_memory{false};
    parallel_for(as_they_are ? 0 : n_tok, n_tok * n_cols * 4, [&qc, &no_memory](int64_t begin, int64_t end) {
        // float32 vectors: each rounded to fp16 here, then quantized as an fp16 vector is
        std::unique_ptr<uint16_t[]> half(qc.f32 ? new (std::nothrow) uint16_t[qc.n_cols] : nullptr);
        if (qc.f32 && !half) {
            no_memory = true;
            return;
        }
        for (int64_t t = begin; t < end; t++) {
            const uint16_t * xt = static_cast<const uint16_t *>(qc.x) + t * qc.n_cols;
            if (qc.f32) {
                to_half(static_cast<const float *>(qc.x) + t * qc.n_cols, qc.n_cols, half.get());
                xt = half.get();
            }
            quantize_activation(qc.a, xt, qc.n_cols, qc.xq + t * qc.xs);
        }
    });
    if (no_memory) {
        std::free(xq);
        return fail(PEBBLE_ERR_HOST_OOM, "%s: %s: no memory for a vector of %" PRId64 " fp16 elements", fn,
                    pebble_internal::ggml_type_name(ggml_type), n_cols);
    }
    *out = xq;
    *xs_out = xs;
    return PEBBLE_OK;
}

// The job of one matrix: tiles of rows small enough that the threads share decode's few rows evenly, large
// enough that a prefill tile is read once for many activations; and what the pool judges it by (*work): a
// prefill's multiply-adds; a decode call's weights, four times over whatever its number of vectors (each
// row is one pass for all of them), so that a matrix of 2^18 weights or more is split: a single request's
// 512 x 512 product ran 1.5x faster on two threads, while a 128 x 384 matrix times 8 vectors ran faster on
// one.
matmul_job job_of(const kernel_set & k, const uint8_t * w, int64_t n_rows, int64_t n_cols, int64_t n_tok,
                  const uint8_t * xq, int64_t xs, float * y, int64_t * tiles, int64_t * work) {
    const int64_t nb = n_cols / k.block_elements, row_bytes = nb * k.block_bytes;
    int64_t tile_rows = n_tok > k.nv ? std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(row_bytes, 1)) : 8;
    tile_rows = std::clamp<int64_t>(tile_rows, 1, 64);
    if (k.rows[max_nv - 1]) tile_rows = (tile_rows + group_rows - 1) / group_rows * group_rows; // whole groups
    *tiles = (n_rows + tile_rows - 1) / tile_rows;
    *work = n_tok > k.nv ? n_rows * n_cols * n_tok : n_rows * n_cols * 4;
    return matmul_job{&k, w, row_bytes, nb, n_rows, n_tok, xq, xs, y, tile_rows};
}

} // namespace

pebble_status matmul(int32_t ggml_type, const uint8_t * w, int64_t n_rows, int64_t n_cols, const void * x, bool x_f32,
                     int64_t n_tok, float * y, const char * fn, bool exact_f32) {
    const matmul_part part{ggml_type, w, n_rows, y};
    return matmul_parts(&part, 1, n_cols, x, x_f32, n_tok, fn, exact_f32);
}

pebble_status matmul_parts(const matmul_part * parts, int n_parts, int64_t n_cols, const void * x, bool x_f32,
                           int64_t n_tok, const char * fn, bool exact_f32) {
    TRY(check_threads(fn));
    if (n_parts < 1 || n_parts > max_matmul_parts) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %d matrices in one product; 1 to %d are accepted", fn,
                    n_parts, max_matmul_parts);
    }
    struct parts_job {
        matmul_job jobs[max_matmul_parts];
        int64_t    first_tile[max_matmul_parts + 1]; // part p's tiles are [first_tile[p], first_tile[p + 1])
        int        n;
    } job{};
    uint8_t * xq[max_matmul_parts] = {};
    int64_t xs[max_matmul_parts] = {}, work = 0;
    pebble_status status = PEBBLE_OK;
    job.n = n_parts;
    for (int p = 0; p < n_parts && status == PEBBLE_OK; p++) {
        const kernel_set & k = kernels_of(parts[p].ggml_type);
        if (k.block_elements == 0) {
            status = fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s has no CPU kernels", fn,
                          pebble_internal::ggml_type_name(parts[p].ggml_type));
            break;
        }
        // x quantized once per kind of activation the parts take
        int same = -1;
        for (int e = 0; e < p && same < 0; e++) same = job.jobs[e].k->activation == k.activation ? e : -1;
        if (same >= 0) {
            xq[p] = nullptr;
            xs[p] = xs[same];
        } else {
            status = quantize_x(k, parts[p].ggml_type, n_cols, x, x_f32, n_tok, exact_f32, fn, &xq[p], &xs[p]);
            if (status != PEBBLE_OK) break;
        }
        int64_t tiles = 0, part_work = 0;
        job.jobs[p] = job_of(k, parts[p].w, parts[p].n_rows, n_cols, n_tok, same >= 0 ? job.jobs[same].xq : xq[p],
                             xs[p], parts[p].y, &tiles, &part_work);
        job.first_tile[p + 1] = job.first_tile[p] + tiles;
        work += part_work;
    }
    if (status == PEBBLE_OK) {
        parallel_ranges(job.first_tile[n_parts], work, [](void * ctx, int64_t begin, int64_t end) {
            const parts_job & j = *static_cast<const parts_job *>(ctx);
            for (int p = 0; p < j.n; p++) {
                const int64_t b = std::max(begin, j.first_tile[p]), e = std::min(end, j.first_tile[p + 1]);
                if (b < e) matmul_tiles(const_cast<matmul_job *>(&j.jobs[p]), b - j.first_tile[p], e - j.first_tile[p]);
            }
        }, &job);
    }
    for (int p = 0; p < n_parts; p++) std::free(xq[p]);
    return status;
}

} // namespace pebble_cpu
