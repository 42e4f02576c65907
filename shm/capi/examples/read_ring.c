/*
 * read_ring: read COUNT records of a kvbridge ring from START and print one line per record,
 * then report what the next read finds. A minimal, complete C reader of kvbridge_shm.h.
 *
 *   cc -std=c11 -Wall -Wextra -I shm/capi/include read_ring.c -L <dir> -lkvbridge_shm_c
 *   ./read_ring /dev/shm/kvbridge.ring 1 10
 *
 * Output: "record SEQ UPSTREAM_SEQ DP_RANK FLAGS LEN FNV1A64" per record, then
 * "next STATUS RESUME_AT" for the read after the last one (1 s timeout).
 * Exit status 0, or 1 with a message on stderr.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvbridge_shm.h"

static uint64_t fnv1a64(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s RING START COUNT\n", argv[0]);
        return 1;
    }
    uint64_t start = strtoull(argv[2], NULL, 10);
    long count = strtol(argv[3], NULL, 10);

    kvb_reader *r = NULL;
    int32_t st = kvb_open(argv[1], &r);
    if (st != KVB_OK) {
        fprintf(stderr, "kvb_open %s: %s\n", argv[1], kvb_strerror(st));
        return 1;
    }
    uint64_t oldest, newest;
    kvb_window(r, &oldest, &newest);
    printf("window %" PRIu64 " %" PRIu64 "\n", oldest, newest);
    if ((st = kvb_seek(r, start)) != KVB_OK) {
        fprintf(stderr, "kvb_seek %" PRIu64 ": %s\n", start, kvb_strerror(st));
        kvb_close(r);
        return 1;
    }
    kvb_record rec;
    kvb_event ev;
    for (long i = 0; i < count;) {
        st = kvb_next(r, 5 * 1000 * 1000, &rec, &ev);
        if (st == KVB_OK) {
            printf("record %" PRIu64 " %" PRIu64 " %" PRIu32 " %" PRIu32 " %zu %016" PRIx64 "\n",
                   rec.sequence, rec.upstream_seq, rec.dp_rank, rec.flags, rec.len,
                   fnv1a64(rec.payload, rec.len));
            i++;
        } else if (st == KVB_LAPPED) {
            printf("lapped %" PRIu64 " %" PRIu64 "\n", ev.missed, ev.resume_at);
        } else {
            fprintf(stderr, "kvb_next: %s (%d)\n", kvb_strerror(st), st);
            kvb_close(r);
            return 1;
        }
    }
    st = kvb_next(r, 1000 * 1000, &rec, &ev);
    printf("next %d %" PRIu64 "\n", st, st == KVB_OK ? rec.sequence : ev.resume_at);
    kvb_close(r);
    return 0;
}
