/*
 * memhog: a self-verifying memory-hungry job.
 *
 * Touches SIZE bytes of anonymous memory page by page. Every page is filled
 * with a pseudo-random pattern derived from (seed, page index, generation),
 * so a page that went out to swap and came back must be bit-exact. Passes:
 *
 *   1. write every page in address order (generation 0);
 *   2. PASSES times: verify every page in a fresh shuffled order, then
 *      rewrite one page in three with the next generation;
 *   3. verify every page in reverse order.
 *
 * --until FILE repeats step 2 (at least PASSES times) until FILE exists, so
 * a test that must do things while the job runs keeps it running until it
 * has done them, then lets it verify and end. Each round of step 2 prints
 * "memhog: round N verified" (flushed), an event a test can wait for.
 *
 * --flip PAGE flips one bit of PAGE after the first pass, so a test can show
 * that the verifier catches a damaged page.
 *
 * --compressible PCT (0-90, default 0) leaves the last PCT% of every page's
 * words zero (checked as well), so that a compressor keeps a page in about
 * (100 - PCT)% of its size; the pattern fills the rest as above.
 *
 * Exit 0 with a one-line summary; exit 1 naming the first bad page, offset
 * and word; exit 2 on bad usage or when the memory cannot be mapped.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "verify.h"

static uint64_t page_key(uint64_t seed, uint64_t page, uint8_t gen)
{
	return splitmix64(seed ^ splitmix64(page * 256 + gen));
}

/* The first `fill` words of a page carry the pattern, the rest are zeros
 * (--compressible): the index of the first wrong word, or words. */
static size_t check_page(const uint64_t *p, size_t words, size_t fill, uint64_t key)
{
	size_t bad = check_words(p, fill, key);
	if (bad != fill)
		return bad;
	for (size_t j = fill; j < words; j++)
		if (p[j] != 0)
			return j;
	return words;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void usage(void)
{
	fprintf(stderr,
		"usage: memhog SIZE [--passes N] [--until F] [--seed S] [--flip P] [--compressible PCT]\n"
		"  SIZE   bytes to touch, with optional K/M/G suffix (binary)\n"
		"  --passes N  shuffled verify+rewrite rounds (default 2)\n"
		"  --until F   more rounds until file F exists (at least N)\n"
		"  --seed S    pattern seed (default 1)\n"
		"  --flip P    flip one bit of page P after writing (proves the check)\n"
		"  --compressible PCT  the last PCT%% (0-90) of every page zero\n");
	exit(2);
}

static uint64_t rng_state;

static uint64_t next_random(void)
{
	rng_state = splitmix64(rng_state);
	return rng_state;
}

int main(int argc, char **argv)
{
	uint64_t size = 0, passes = 2, compressible = 0;
	struct job_options opt = JOB_OPTIONS_DEFAULT;
	int have_size = 0;

	for (int i = 1; i < argc; i++) {
		if (job_option(argc, argv, &i, &opt, usage))
			continue;
		if (strcmp(argv[i], "--passes") == 0 && i + 1 < argc) {
			if (parse_size(argv[++i], &passes))
				usage();
		} else if (strcmp(argv[i], "--compressible") == 0 && i + 1 < argc) {
			if (parse_size(argv[++i], &compressible) || compressible > 90)
				usage();
		} else if (!have_size && parse_size(argv[i], &size) == 0) {
			have_size = 1;
		} else {
			usage();
		}
	}
	if (!have_size || size == 0)
		usage();

	const size_t page_size = (size_t)sysconf(_SC_PAGESIZE);
	const size_t words = page_size / sizeof(uint64_t);
	/* Words of the pattern; the rest of a page stays zero (mmap's). */
	const size_t fill = words - words * compressible / 100;
	const uint64_t pages = (size + page_size - 1) / page_size;
	if (opt.flip != UINT64_MAX && opt.flip >= pages) {
		fprintf(stderr, "memhog: --flip %" PRIu64 " is past the last page %" PRIu64 "\n",
			opt.flip, pages - 1);
		return 2;
	}

	uint8_t *base = mmap(NULL, pages * page_size, PROT_READ | PROT_WRITE,
			     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (base == MAP_FAILED) {
		fprintf(stderr, "memhog: mmap of %" PRIu64 " bytes: %s\n",
			pages * page_size, strerror(errno));
		return 2;
	}
	uint8_t *gen = calloc(pages, 1);
	uint32_t *order = malloc(pages * sizeof(uint32_t));
	if (!gen || !order) {
		fprintf(stderr, "memhog: bookkeeping for %" PRIu64 " pages: out of memory\n", pages);
		return 2;
	}
	rng_state = opt.seed;

	double t0 = now_s();
	uint64_t touched = 0;

	for (uint64_t i = 0; i < pages; i++)
		fill_words((uint64_t *)(base + i * page_size), fill, page_key(opt.seed, i, 0));
	touched += pages;
	if (opt.flip < pages)
		base[opt.flip * page_size + 100] ^= 0x10;

	struct stat st;
	for (uint64_t round = 0; round <= passes; round++) {
		/* With --until, one more round while the file is not there yet. */
		if (round == passes && opt.until && stat(opt.until, &st) != 0)
			passes++;
		const int last = round == passes;
		for (uint64_t i = 0; i < pages; i++)
			order[i] = (uint32_t)(last ? pages - 1 - i : i);
		if (!last)
			for (uint64_t i = pages - 1; i > 0; i--) {
				uint64_t j = next_random() % (i + 1);
				uint32_t t = order[i];
				order[i] = order[j];
				order[j] = t;
			}
		for (uint64_t k = 0; k < pages; k++) {
			uint64_t i = order[k];
			const uint64_t *p = (const uint64_t *)(base + i * page_size);
			uint64_t key = page_key(opt.seed, i, gen[i]);
			size_t bad = check_page(p, words, fill, key);
			if (bad != words) {
				fprintf(stderr,
					"memhog: FAILED verify round %" PRIu64 ": bad page %" PRIu64
					" (offset 0x%" PRIx64 ") word %zu: expected 0x%016" PRIx64
					" got 0x%016" PRIx64 " (generation %u)\n",
					round + 1, i, i * page_size + bad * sizeof(uint64_t), bad,
					bad < fill ? splitmix64(key + bad) : 0, p[bad], gen[i]);
				return 1;
			}
		}
		touched += pages;
		if (last)
			break;
		printf("memhog: round %" PRIu64 " verified\n", round + 1);
		fflush(stdout);
		for (uint64_t i = round % 3; i < pages; i += 3) {
			gen[i]++;
			fill_words((uint64_t *)(base + i * page_size), fill, page_key(opt.seed, i, gen[i]));
		}
		touched += (pages + 2) / 3;
	}

	double secs = now_s() - t0;
	printf("memhog: OK pages=%" PRIu64 " page_size=%zu bytes=%" PRIu64
	       " passes=%" PRIu64 " verified=%" PRIu64 " seconds=%.2f MB/s=%.1f\n",
	       pages, page_size, pages * page_size, passes + 2, passes + 1, secs,
	       (double)touched * (double)page_size / 1e6 / (secs > 0 ? secs : 1e-9));
	return 0;
}
