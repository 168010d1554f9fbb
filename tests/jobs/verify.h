/*
 * What the self-verifying jobs share: the pattern every page or block is
 * filled with (words of splitmix64 from a key derived from seed, index and
 * generation), its check, and the size parser of their command lines.
 */
#ifndef NETPAGER_JOBS_VERIFY_H
#define NETPAGER_JOBS_VERIFY_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint64_t splitmix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ULL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

static inline void fill_words(uint64_t *p, size_t words, uint64_t key)
{
	for (size_t j = 0; j < words; j++)
		p[j] = splitmix64(key + j);
}

/* Returns the index of the first wrong word, or words when all are right. */
static inline size_t check_words(const uint64_t *p, size_t words, uint64_t key)
{
	for (size_t j = 0; j < words; j++)
		if (p[j] != splitmix64(key + j))
			return j;
	return words;
}

/* A size with an optional K/M/G suffix (binary), optionally followed by
 * "i", "B" or "iB"; -1 when it is not one. */
static inline int parse_size(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || end == s)
		return -1;
	switch (*end) {
	case 'k': case 'K': v <<= 10; end++; break;
	case 'm': case 'M': v <<= 20; end++; break;
	case 'g': case 'G': v <<= 30; end++; break;
	default: break;
	}
	if (*end == 'i' || *end == 'B')
		end++;
	if (*end == 'B')
		end++;
	if (*end != '\0')
		return -1;
	*out = v;
	return 0;
}

/* The options every job takes: --seed S, --until FILE, --flip INDEX. */
struct job_options {
	uint64_t seed, flip;
	const char *until;
};

#define JOB_OPTIONS_DEFAULT { .seed = 1, .flip = UINT64_MAX, .until = NULL }

/* Takes argv[*i] (and its value, *i then at it) if it is one of those:
 * 1 when taken, 0 when it is none; a bad value calls `usage`. */
static inline int job_option(int argc, char **argv, int *i, struct job_options *o,
			     void (*usage)(void))
{
	const char *a = argv[*i];
	int bad = 0;
	if (*i + 1 >= argc)
		return 0;
	if (strcmp(a, "--seed") == 0)
		bad = parse_size(argv[++*i], &o->seed);
	else if (strcmp(a, "--flip") == 0)
		bad = parse_size(argv[++*i], &o->flip);
	else if (strcmp(a, "--until") == 0)
		o->until = argv[++*i];
	else
		return 0;
	if (bad)
		usage();
	return 1;
}

#endif
