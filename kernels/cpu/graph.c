/* A CPU graph's replay of a run of recorded kernel calls, from one loop here instead of one ctypes call
 * each from Python (~3 us apiece: about 0.9 ms of a one-stream decode step's 300 calls). Each call is a
 * kernel's packed twin (packed.h) and its argument array; the first status that is not 0 stops the run
 * (its call's index in *failed). */
#include <stdint.h>

typedef int (*packed_fn)(const int64_t *args);

int replay_calls(int64_t n, const packed_fn *fns, const int64_t *const *args, int64_t *failed) {
    for (int64_t i = 0; i < n; i++) {
        const int status = fns[i](args[i]);
        if (status) {
            *failed = i;
            return status;
        }
    }
    return 0;
}
