/*
 * blkhog: a self-verifying block job with many requests in flight.
 *
 * THREADS threads each own an equal slice of the first SIZE bytes of a
 * block device (or file), opened with O_DIRECT, so there are THREADS
 * requests in flight at once. Every block holds a pattern derived from
 * (seed, block, generation); each thread keeps its blocks' generations.
 *
 *   1. each thread writes every block of its slice (generation 1) and the
 *      job prints "blkhog: filled";
 *   2. until FILE exists (--until), each thread picks random blocks of its
 *      slice and either rewrites one with its next generation or reads one
 *      back and checks it, half and half;
 *   3. each thread reads back and checks every block of its slice.
 *
 * A test that must do things while requests are in flight (kill a donor)
 * keeps the job running until it has done them, then lets it verify.
 * --flip BLOCK flips one bit of BLOCK after the fill, so a test can show
 * that the check catches a damaged block.
 *
 * Exit 0 with a one-line summary; exit 1 naming the first bad block, offset
 * and word; exit 2 on bad usage or an I/O error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "verify.h"

#define BLOCK 4096
#define WORDS (BLOCK / sizeof(uint64_t))

struct job {
	int fd;
	uint64_t seed;
	uint64_t first, blocks; /* this thread's slice, in blocks */
	uint32_t *gen;
	int id;
	uint64_t writes, reads;
	int failed; /* 1: bad data, 2: I/O error */
};

static atomic_int stop_now;
static atomic_int failing;

static uint64_t block_key(uint64_t seed, uint64_t block, uint32_t gen)
{
	return splitmix64(seed ^ splitmix64(block * 0x100000001ULL + gen));
}

static int io(struct job *j, int write, uint64_t *buf, uint64_t block)
{
	off_t at = (off_t)(block * BLOCK);
	ssize_t n = write ? pwrite(j->fd, buf, BLOCK, at) : pread(j->fd, buf, BLOCK, at);
	if (n != BLOCK) {
		fprintf(stderr, "blkhog: thread %d: %s of block %" PRIu64 " (offset %" PRIu64 "): %s\n",
			j->id, write ? "write" : "read", block, (uint64_t)at,
			n < 0 ? strerror(errno) : "short transfer");
		j->failed = 2;
		atomic_store(&failing, 1);
		return -1;
	}
	return 0;
}

static int write_block(struct job *j, uint64_t *buf, uint64_t i)
{
	uint64_t block = j->first + i;
	fill_words(buf, WORDS, block_key(j->seed, block, ++j->gen[i]));
	j->writes++;
	return io(j, 1, buf, block);
}

static int check_block(struct job *j, uint64_t *buf, uint64_t i)
{
	uint64_t block = j->first + i;
	if (io(j, 0, buf, block))
		return -1;
	j->reads++;
	uint64_t key = block_key(j->seed, block, j->gen[i]);
	size_t w = check_words(buf, WORDS, key);
	if (w == WORDS)
		return 0;
	fprintf(stderr,
		"blkhog: FAILED thread %d: bad block %" PRIu64 " (offset 0x%" PRIx64
		") word %zu: expected 0x%016" PRIx64 " got 0x%016" PRIx64
		" (generation %" PRIu32 ")\n",
		j->id, block, block * BLOCK + w * sizeof(uint64_t), w,
		splitmix64(key + w), buf[w], j->gen[i]);
	j->failed = 1;
	atomic_store(&failing, 1);
	return -1;
}

static uint64_t next_random(uint64_t *state)
{
	*state = splitmix64(*state);
	return *state;
}

enum phase { FILL, MIX, VERIFY };
static enum phase phase;

static void *run(void *arg)
{
	struct job *j = arg;
	uint64_t *buf;
	if (posix_memalign((void **)&buf, BLOCK, BLOCK)) {
		j->failed = 2;
		atomic_store(&failing, 1);
		return NULL;
	}
	uint64_t rng = splitmix64(j->seed + (uint64_t)j->id + 1);
	switch (phase) {
	case FILL:
		for (uint64_t i = 0; i < j->blocks && !atomic_load(&failing); i++)
			if (write_block(j, buf, i))
				break;
		break;
	case MIX:
		while (!atomic_load(&stop_now) && !atomic_load(&failing)) {
			uint64_t r = next_random(&rng);
			uint64_t i = (r >> 1) % j->blocks;
			if ((r & 1) ? write_block(j, buf, i) : check_block(j, buf, i))
				break;
		}
		break;
	case VERIFY:
		for (uint64_t i = 0; i < j->blocks && !atomic_load(&failing); i++)
			if (check_block(j, buf, i))
				break;
		break;
	}
	free(buf);
	return NULL;
}

/* Runs every thread through phase `p` (the mix until `until` exists);
 * 0 when none failed, else 1 for bad data, 2 for an I/O error. */
static int run_phase(struct job *jobs, int threads, enum phase p, const char *until)
{
	pthread_t *t = calloc((size_t)threads, sizeof(*t));
	if (!t)
		return 2;
	phase = p;
	for (int i = 0; i < threads; i++)
		if (pthread_create(&t[i], NULL, run, &jobs[i])) {
			fprintf(stderr, "blkhog: cannot start thread %d\n", i);
			exit(2);
		}
	if (p == MIX) {
		struct stat st;
		while (stat(until, &st) != 0 && !atomic_load(&failing))
			usleep(10000);
		atomic_store(&stop_now, 1);
	}
	for (int i = 0; i < threads; i++)
		pthread_join(t[i], NULL);
	free(t);
	int worst = 0;
	for (int i = 0; i < threads; i++)
		if (jobs[i].failed == 1 || (jobs[i].failed == 2 && worst == 0))
			worst = jobs[i].failed;
	return worst;
}

/* Flips one bit in the middle of `block`, behind the job's back. */
static int flip_bit(int fd, uint64_t block)
{
	uint8_t *buf;
	off_t at = (off_t)(block * BLOCK);
	if (posix_memalign((void **)&buf, BLOCK, BLOCK))
		return 2;
	int rc = pread(fd, buf, BLOCK, at) == BLOCK ? 0 : 2;
	buf[100] ^= 0x10;
	if (rc == 0 && pwrite(fd, buf, BLOCK, at) != BLOCK)
		rc = 2;
	free(buf);
	return rc;
}

static void usage(void)
{
	fprintf(stderr,
		"usage: blkhog DEVICE SIZE [--threads N] [--until F] [--seed S] [--flip B]\n"
		"  SIZE         bytes from the start of DEVICE (K/M/G suffix), a multiple\n"
		"               of 4096 x N\n"
		"  --threads N  threads, each with one request in flight (default 32)\n"
		"  --seed S     pattern seed (default 1)\n"
		"  --until F    random rewrites and checks until file F exists (without:\n"
		"               none), then every block is checked\n"
		"  --flip B     flip one bit of block B after the fill (proves the check)\n");
	exit(2);
}

int main(int argc, char **argv)
{
	const char *path = NULL;
	uint64_t size = 0, threads = 32;
	struct job_options opt = JOB_OPTIONS_DEFAULT;
	int have_size = 0;
	for (int i = 1; i < argc; i++) {
		if (job_option(argc, argv, &i, &opt, usage))
			continue;
		if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
			if (parse_size(argv[++i], &threads) || threads == 0 || threads > 1024)
				usage();
		} else if (!path) {
			path = argv[i];
		} else if (!have_size && parse_size(argv[i], &size) == 0) {
			have_size = 1;
		} else {
			usage();
		}
	}
	if (!path || !have_size || size == 0 || size % (BLOCK * threads))
		usage();
	if (opt.flip != UINT64_MAX && opt.flip >= size / BLOCK) {
		fprintf(stderr, "blkhog: --flip %" PRIu64 " is past the last block %" PRIu64 "\n",
			opt.flip, size / BLOCK - 1);
		return 2;
	}
	int fd = open(path, O_RDWR | O_DIRECT);
	if (fd < 0) {
		fprintf(stderr, "blkhog: open %s: %s\n", path, strerror(errno));
		return 2;
	}
	uint64_t per = size / BLOCK / threads;
	struct job *jobs = calloc(threads, sizeof(*jobs));
	if (!jobs)
		return 2;
	for (uint64_t i = 0; i < threads; i++) {
		jobs[i] = (struct job){ .fd = fd, .seed = opt.seed, .first = i * per, .blocks = per,
					.gen = calloc(per, sizeof(uint32_t)), .id = (int)i };
		if (!jobs[i].gen)
			return 2;
	}
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	int rc = run_phase(jobs, (int)threads, FILL, NULL);
	if (rc == 0 && opt.flip != UINT64_MAX)
		rc = flip_bit(fd, opt.flip);
	if (rc == 0) {
		printf("blkhog: filled\n");
		fflush(stdout);
		if (opt.until)
			rc = run_phase(jobs, (int)threads, MIX, opt.until);
	}
	if (rc == 0)
		rc = run_phase(jobs, (int)threads, VERIFY, NULL);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	if (rc)
		return rc;
	uint64_t writes = 0, reads = 0;
	for (uint64_t i = 0; i < threads; i++) {
		writes += jobs[i].writes;
		reads += jobs[i].reads;
	}
	printf("blkhog: OK blocks=%" PRIu64 " threads=%" PRIu64 " writes=%" PRIu64
	       " reads=%" PRIu64 " seconds=%.2f\n", per * threads, threads, writes, reads,
	       (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
	return 0;
}
