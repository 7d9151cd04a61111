/* Replay of a recorded sequence of kernel calls (hybridkv/ops/native/program.py).
 *
 * A decode step of a captured batch size makes the same kernel calls on the same buffers every
 * time; only the values in its input buffers change. program.py records the calls once (kernel
 * and argument values) and this loop makes them again, without the interpreter between them:
 *
 *     ops    [n]       adapter of each call (one per declared kernel, generated from the
 *                      ctypes signatures when the library is built)
 *     starts [n]       where each call's arguments begin in `args`
 *     args   [total]   argument slots: pointers and integers as int64, floats as double
 *
 * A kernel that returns a status (non-zero: it failed, e.g. could not allocate) stops the
 * replay: the result is the 1-based position of that call, 0 when every call ran. Each kernel
 * starts its own OpenMP team where it parallelises, as it does when called from Python. */

#include <stdint.h>
#include <time.h>

typedef union {
    int64_t i;
    double f;
} hkv_arg;

typedef int64_t (*hkv_adapter)(const hkv_arg *);

extern const hkv_adapter hkv_program_adapters[];
extern const int64_t hkv_program_num_adapters;

int64_t hkv_program_adapter_count(void) { return hkv_program_num_adapters; }

int64_t hkv_program_run(const int32_t *ops, const int64_t *starts, const hkv_arg *args,
                        int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (hkv_program_adapters[ops[i]](args + starts[i]) != 0) return i + 1;
    return 0;
}

/* The same, adding each call's wall time in nanoseconds to nanoseconds[i] (a profile of replays:
 * Program.run(profile=...)). */
int64_t hkv_program_run_timed(const int32_t *ops, const int64_t *starts, const hkv_arg *args,
                              int64_t n, int64_t *nanoseconds) {
    struct timespec t0, t1;
    for (int64_t i = 0; i < n; i++) {
        clock_gettime(CLOCK_MONOTONIC, &t0);
        const int64_t rc = hkv_program_adapters[ops[i]](args + starts[i]);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        nanoseconds[i] += (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
        if (rc != 0) return i + 1;
    }
    return 0;
}
