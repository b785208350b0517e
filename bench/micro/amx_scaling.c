/* Where a block of the tile products goes, in C: the tile instructions alone, the float scaling alone, both as
 * decoding/kernels/amx.py ran them until whole rows went into a tile (lanes of half rows, half of A zero), both
 * with every other block on a second set of tile registers, and the forms whose lanes are whole rows (the halves
 * summed in integers): 16 rows of two groups, as the kernel now runs, and one group's 8 rows in an A of 8 rows.
 * One thread, 48 blocks (1,536 columns) against 16 token tiles; ns a block and tile of 16 tokens. Needs a CPU and
 * kernel that grant AMX (Linux >= 5.16):
 *
 *     gcc -O2 -march=sapphirerapids -o /tmp/amx_scaling bench/micro/amx_scaling.c && taskset -c 1 /tmp/amx_scaling
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define BLOCKS 48
#define TILES 16

typedef struct { uint8_t palette, start, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

static uint8_t a_tiles[BLOCKS][512] __attribute__((aligned(64)));  /* 16 lanes x 32 bytes */
static float lane_scales[BLOCKS][16], lane_mins[BLOCKS][16];
static int8_t b_tiles[TILES][BLOCKS][512] __attribute__((aligned(64)));  /* 8 rows x 64 bytes */
static float token_scales[TILES][BLOCKS][16], token_mass[TILES][BLOCKS][16];
static int32_t c_buffers[2][256] __attribute__((aligned(64)));
static float out[TILES][8][16];
static tile_config config;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

#define PRODUCT_SET0(b) do { _tile_loadd(1, a_tiles[b], 32); _tile_loadd(2, b_tiles[t][b], 64); _tile_zero(0); \
    _tile_dpbusd(0, 1, 2); _tile_stored(0, c_buffers[(b) % 2], 64); } while (0)
#define PRODUCT_SET1(b) do { _tile_loadd(4, a_tiles[b], 32); _tile_loadd(5, b_tiles[t][b], 64); _tile_zero(3); \
    _tile_dpbusd(3, 4, 5); _tile_stored(3, c_buffers[(b) % 2], 64); } while (0)
#define PRODUCT_ALTERNATING(b) do { if ((b) % 2) PRODUCT_SET1(b); else PRODUCT_SET0(b); } while (0)
/* the kernel's scaling of one block: per lane a conversion, a multiply, a fused multiply-add; even lanes' mins */
#define SCALE(b) do { int32_t *c = c_buffers[(b) % 2]; \
    __m512 xs = _mm512_loadu_ps(token_scales[t][b]), xm = _mm512_loadu_ps(token_mass[t][b]); \
    for (int l = 0; l < 16; l++) { \
        acc[l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * l)), \
                                 _mm512_mul_ps(_mm512_set1_ps(lane_scales[b][l]), xs), acc[l]); \
        if (!(l & 1)) acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(lane_mins[b][l]), xm, acc[l]); } } while (0)
#define BEGIN_TILE __m512 acc[16]; for (int l = 0; l < 16; l++) acc[l] = _mm512_setzero_ps();
#define END_TILE for (int r = 0; r < 8; r++) _mm512_storeu_ps(out[t][r], _mm512_add_ps(acc[2 * r], acc[2 * r + 1]));
/* pipelined by one block, as the kernel is: block b's scaling reads the buffer written a block before */
#define PIPELINED(NAME, PRODUCT) \
    __attribute__((noinline)) static void NAME(void) { _tile_loadconfig(&config); \
        for (int t = 0; t < TILES; t++) { BEGIN_TILE PRODUCT(0); \
            for (int b = 1; b < BLOCKS; b++) { PRODUCT(b); SCALE(b - 1); } \
            SCALE(BLOCKS - 1); END_TILE } _tile_release(); }
PIPELINED(both, PRODUCT_SET0)
PIPELINED(both_two_register_sets, PRODUCT_ALTERNATING)

/* the form that halves the scaling a multiply-accumulate: each row's two halves summed in integers, so a
 * tile's 16 lanes are 16 rows (two 8-row groups) and its product twice the useful work, 8192 MACs; every lane
 * then has a min. The same tile shapes and instructions: only the float work per MAC differs. */
#define SCALE_ROWS(b, ROWS) do { int32_t *c = c_buffers[(b) % 2]; \
    __m512 xs = _mm512_loadu_ps(token_scales[t][b]), xm = _mm512_loadu_ps(token_mass[t][b]); \
    for (int l = 0; l < (ROWS); l++) { \
        acc[l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * l)), \
                                 _mm512_mul_ps(_mm512_set1_ps(lane_scales[b][l]), xs), acc[l]); \
        acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(lane_mins[b][l]), xm, acc[l]); } } while (0)

__attribute__((noinline)) static void row_sums(void) {
    _tile_loadconfig(&config);
    for (int t = 0; t < TILES; t++) {
        BEGIN_TILE PRODUCT_SET0(0);
        for (int b = 1; b < BLOCKS; b++) { PRODUCT_SET0(b); SCALE_ROWS(b - 1, 16); }
        SCALE_ROWS(BLOCKS - 1, 16);
        for (int r = 0; r < 16; r++) _mm512_storeu_ps(out[t][r % 8], acc[r]);
    }
    _tile_release();
}

/* the row-sum form on one 8-row group: A is 8 rows x 32 bytes (no zeros), C 8 rows x 16 tokens, on the second
 * register set configured with 8 rows; the useful MACs of the half-row form (4096), half its float work */

__attribute__((noinline)) static void row_sums_one_group(void) {
    _tile_loadconfig(&config);
    for (int t = 0; t < TILES; t++) {
        BEGIN_TILE PRODUCT_SET1(0);
        for (int b = 1; b < BLOCKS; b++) { PRODUCT_SET1(b); SCALE_ROWS(b - 1, 8); }
        SCALE_ROWS(BLOCKS - 1, 8);
        for (int r = 0; r < 8; r++) _mm512_storeu_ps(out[t][r], acc[r]);
    }
    _tile_release();
}

__attribute__((noinline)) static void products_alone(void) {
    _tile_loadconfig(&config);
    for (int t = 0; t < TILES; t++) for (int b = 0; b < BLOCKS; b++) PRODUCT_SET0(b);
    _tile_release();
}

__attribute__((noinline)) static void scaling_alone(void) {
    for (int t = 0; t < TILES; t++) { BEGIN_TILE for (int b = 0; b < BLOCKS; b++) SCALE(b); END_TILE }
}

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) { puts("AMX not granted"); return 1; }
    config.palette = 1;
    for (int set = 0; set < 2; set++) {
        config.rows[3 * set] = 16; config.colsb[3 * set] = 64;      /* C */
        config.rows[3 * set + 1] = 16; config.colsb[3 * set + 1] = 32;  /* A */
        config.rows[3 * set + 2] = 8; config.colsb[3 * set + 2] = 64;   /* B */
    }
    void (*kernels[])(void) = {products_alone, scaling_alone, both, both_two_register_sets, row_sums,
                               row_sums_one_group};
    const char *names[] = {"tile loads, product, store alone", "float scaling alone", "both, half rows",
                           "both, a second register set", "row sums: 16 rows, twice the MACs",
                           "row sums: one 8-row group, M = 8"};
    for (int round = 0; round < 3; round++)
        for (int k = 0; k < 6; k++) {
            /* the second register set: full-size for both_two_register_sets, C and A of 8 rows for row_sums_one_group */
            config.rows[3] = config.rows[4] = k == 5 ? 8 : 16;
            int repeats = 20000;
            kernels[k]();
            double started = now();
            for (int i = 0; i < repeats; i++) kernels[k]();
            printf("%-34s %5.1f ns a block and tile\n", names[k], (now() - started) / repeats / TILES / BLOCKS * 1e9);
        }
    return 0;
}
