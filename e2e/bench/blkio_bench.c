/*
 * A polling libblkio client: random 4k (or any size) reads or writes at a fixed queue depth for a
 * number of seconds, from memory registered with the driver (no bounce buffer), on one queue (a poll
 * queue for vhost-user-blk).
 * What a VM's virtio-blk driver with polling does to a vhost-user-blk export, without a guest.
 *
 *   blkio_bench DRIVER PATH read|write BLOCK_SIZE QUEUE_DEPTH SECONDS SIZE_BYTES
 *
 * DRIVER is a libblkio driver: virtio-blk-vhost-user (PATH a vhost-user-blk socket) or io_uring
 * (PATH a file or block device, opened O_DIRECT): the same client on both sides of a comparison.
 * Prints "iops=N" on success. Built by e2e/bench/blkio_client.py.
 */
#include <blkio.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void check(int ret, const char *what)
{
    if (ret < 0) {
        fprintf(stderr, "%s: %s: %s\n", what, strerror(-ret), blkio_get_error_msg());
        exit(1);
    }
}

static uint64_t rnd(uint64_t *state)
{
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

int main(int argc, char **argv)
{
    if (argc != 8) {
        fprintf(stderr, "usage: %s DRIVER PATH read|write BLOCK_SIZE QUEUE_DEPTH SECONDS SIZE_BYTES\n", argv[0]);
        return 2;
    }
    const char *driver = argv[1], *path = argv[2];
    int write = strcmp(argv[3], "write") == 0;
    size_t bs = strtoull(argv[4], NULL, 10);
    int qd = atoi(argv[5]);
    double seconds = atof(argv[6]);
    uint64_t size = strtoull(argv[7], NULL, 10);
    uint64_t blocks = size / bs;
    if (bs == 0 || qd <= 0 || blocks == 0) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }

    struct blkio *b;
    check(blkio_create(driver, &b), "blkio_create");
    check(blkio_set_str(b, "path", path), "path");
    if (strcmp(driver, "io_uring") == 0) {
        check(blkio_set_bool(b, "direct", true), "direct");
    }
    check(blkio_connect(b), "blkio_connect");
    /* io_uring polls only devices with poll queues (not a file, nor a loop device): it waits instead */
    int polled = strcmp(driver, "io_uring") != 0;
    check(blkio_set_int(b, "num-queues", polled ? 0 : 1), "num-queues");
    check(blkio_set_int(b, "num-poll-queues", polled ? 1 : 0), "num-poll-queues");
    check(blkio_start(b), "blkio_start");

    struct blkio_mem_region region;
    check(blkio_alloc_mem_region(b, &region, bs * qd), "blkio_alloc_mem_region");
    check(blkio_map_mem_region(b, &region), "blkio_map_mem_region");
    memset(region.addr, 0xa5, bs * qd);
    struct blkioq *q = polled ? blkio_get_poll_queue(b, 0) : blkio_get_queue(b, 0);
    if (!q) {
        fprintf(stderr, "no queue: %s\n", blkio_get_error_msg());
        return 1;
    }

    uint64_t state = 0x9e3779b97f4a7c15ULL, done = 0;
    struct blkio_completion *completions = calloc(qd, sizeof(*completions));
    for (int i = 0; i < qd; i++) {
        void *buf = (char *)region.addr + (size_t)i * bs;
        uint64_t offset = (rnd(&state) % blocks) * bs;
        if (write) {
            blkioq_write(q, offset, buf, bs, (void *)(intptr_t)i, 0);
        } else {
            blkioq_read(q, offset, buf, bs, (void *)(intptr_t)i, 0);
        }
    }
    double start = now(), end = start + seconds;
    double t = start;
    while (t < end) {
        int n = blkioq_do_io(q, completions, 1, qd, NULL);
        check(n, "blkioq_do_io");
        for (int i = 0; i < n; i++) {
            if (completions[i].ret != 0) {
                fprintf(stderr, "request failed: %s\n", strerror(-completions[i].ret));
                return 1;
            }
            intptr_t slot = (intptr_t)completions[i].user_data;
            void *buf = (char *)region.addr + (size_t)slot * bs;
            uint64_t offset = (rnd(&state) % blocks) * bs;
            if (write) {
                blkioq_write(q, offset, buf, bs, (void *)slot, 0);
            } else {
                blkioq_read(q, offset, buf, bs, (void *)slot, 0);
            }
        }
        done += n;
        t = now();
    }
    double elapsed = now() - start;
    /* the requests still in flight complete before the queue goes */
    int pending = qd;
    while (pending > 0) {
        int n = blkioq_do_io(q, completions, 1, qd, NULL);
        check(n, "drain");
        pending -= n;
    }
    printf("iops=%.0f\n", done / elapsed);
    blkio_destroy(&b);
    return 0;
}
