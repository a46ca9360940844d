// cpu/pool.cc: the host library's run-time setup for its CPU kernels: PEBBLING_THREADS and PEBBLING_SIMD
// read once and checked, the instruction set the kernels use chosen (simd_in_use: the best this CPU has
// that PEBBLING_SIMD allows, found with __builtin_cpu_supports, so the library runs on any x86-64 and,
// through the portable kernels, anywhere), and the thread pool every kernel's work is split among.
//
// Threads: one pool for the process, started on first use, its size the CPUs this process may run on
// (sched_getaffinity) or PEBBLING_THREADS. Work is handed out in small ranges that any thread takes
// from a shared counter, so a thread held up by a busy neighbour core delays one range, not a share;
// idle workers spin briefly and then sleep on a condition variable, so they take no core from others.

#include "cpu/cpu.h"
#include "cpu/simd.h"
#include "pebble_internal.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

using pebble_internal::fail;

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

bool gpu_arithmetic() {
    static const bool gpu = [] {
        const char * env = std::getenv("PEBBLING_SIMD");
        return env && std::strcmp(env, "gpu") == 0;
    }();
    return gpu;
}

const char * simd_level() {
    switch (simd_in_use()) {
        case simd::avx512: return "avx512";
        case simd::avx2:   return "avx2";
        default:           return "portable";
    }
}

} // namespace pebble_cpu
