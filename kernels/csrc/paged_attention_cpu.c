/* Paged attention on CPU reading K/V pages where they are in the pool (no gather).
 *
 * Every query token i (of sequence token_seq[i]) attends the first token_limit[i] cached tokens of
 * its sequence, found through the sequence's block table. One (token, KV head) pair is one task,
 * with its g = num_heads / num_kv_heads query heads taken one after another over each block (the
 * block's K/V rows come from cache after the first). Pages are taken a block at a time with an
 * online softmax (one rescale per block); the scores of a block are exponentiated in one pass, and
 * the output rows accumulate in a local array. The head size is a compile-time
 * constant for the common sizes (32, 64, 128), so the per-row loops unroll and vectorize.
 * float32 throughout. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline __attribute__((always_inline)) void attend(
    const float *restrict qh, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, int64_t n, int64_t head_offset, int64_t row, int64_t g,
    const int64_t dim, int64_t block_size, float scale, float *restrict oh) {
  float m[g], l[g], s[g][block_size];
  float acc[g][dim];
  for (int64_t h = 0; h < g; h++) {
    m[h] = -FLT_MAX;
    l[h] = 0.0f;
    for (int64_t d = 0; d < dim; d++) acc[h][d] = 0.0f;
  }
  for (int64_t start = 0; start < n; start += block_size) {
    const int64_t len = n - start < block_size ? n - start : block_size;
    const int64_t base = (int64_t)table[start / block_size] * block_size * row + head_offset;
    /* Scores, head by head: one head's query row stays in registers over the block's K rows
     * (with all g heads at once, g x 128 floats no longer fit them); the rows come from cache
     * after the first head. */
    for (int64_t h = 0; h < g; h++) {
      const float *restrict qv = qh + h * dim;
      for (int64_t t = 0; t < len; t++) {
        const float *restrict kv = k_cache + base + t * row;
        float dot = 0.0f;
        for (int64_t d = 0; d < dim; d++) dot += qv[d] * kv[d];
        s[h][t] = dot * scale;
      }
    }
    for (int64_t h = 0; h < g; h++) {
      float block_max = -FLT_MAX;
      for (int64_t t = 0; t < len; t++) block_max = s[h][t] > block_max ? s[h][t] : block_max;
      if (block_max > m[h]) {
        const float corr = expf(m[h] - block_max);
        l[h] *= corr;
        for (int64_t d = 0; d < dim; d++) acc[h][d] *= corr;
        m[h] = block_max;
      }
      float sum = 0.0f;
      for (int64_t t = 0; t < len; t++) {
        s[h][t] = expf(s[h][t] - m[h]);
        sum += s[h][t];
      }
      l[h] += sum;
    }
    /* Values, head by head likewise: one head's output row stays in registers. */
    for (int64_t h = 0; h < g; h++) {
      for (int64_t t = 0; t < len; t++) {
        const float *restrict vv = v_cache + base + t * row;
        const float p = s[h][t];
        for (int64_t d = 0; d < dim; d++) acc[h][d] += p * vv[d];
      }
    }
  }
  for (int64_t h = 0; h < g; h++) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
    for (int64_t d = 0; d < dim; d++) oh[h * dim + d] = acc[h][d] * inv;
  }
}

/* Not inlined into the batch entry point below: both run this one compiled body. */
__attribute__((noinline)) void paged_attention_f32(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
    int64_t table_stride, const int64_t *token_seq, const int64_t *token_limit, float *out,
    int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int num_threads) {
  const int64_t g = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim; /* floats per cached token */
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
  for (int64_t i = 0; i < num_tokens; i++) {
    for (int64_t kh = 0; kh < num_kv_heads; kh++) {
      const int32_t *table = block_tables + token_seq[i] * table_stride;
      const int64_t n = token_limit[i];
      const float *qh = q + (i * num_heads + kh * g) * head_dim;
      float *oh = out + (i * num_heads + kh * g) * head_dim;
      const int64_t off = kh * head_dim;
      switch (head_dim) {
        case 32:
          attend(qh, k_cache, v_cache, table, n, off, row, g, 32, block_size, scale, oh);
          break;
        case 64:
          attend(qh, k_cache, v_cache, table, n, off, row, g, 64, block_size, scale, oh);
          break;
        case 128:
          attend(qh, k_cache, v_cache, table, n, off, row, g, 128, block_size, scale, oh);
          break;
        default:
          attend(qh, k_cache, v_cache, table, n, off, row, g, head_dim, block_size, scale, oh);
      }
    }
  }
}

/* The same, from the batch's sequence lengths (context after this step) and query start offsets
 * (num_seqs + 1 of them): each token's sequence and limit are derived here, once per call, rather
 * than by a handful of tensor ops in Python for every layer of every step. Returns 0, or -1 when
 * the offsets do not cover exactly num_tokens tokens in order (nothing written), -2 when out of
 * memory. */
int paged_attention_f32_batch(const float *q, const float *k_cache, const float *v_cache,
                              const int32_t *block_tables, int64_t table_stride,
                              const int64_t *seq_lens, const int64_t *query_start_loc,
                              int64_t num_seqs, float *out, int64_t num_tokens, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              float scale, int num_threads) {
  if (query_start_loc[0] != 0 || query_start_loc[num_seqs] != num_tokens) return -1;
  for (int64_t s = 0; s < num_seqs; s++)
    if (query_start_loc[s + 1] < query_start_loc[s]) return -1;
  int64_t *token_seq = malloc(2 * (size_t)(num_tokens > 0 ? num_tokens : 1) * sizeof(int64_t));
  if (token_seq == NULL) return -2;
  int64_t *token_limit = token_seq + num_tokens;
  for (int64_t s = 0; s < num_seqs; s++) {
    const int64_t start = query_start_loc[s], end = query_start_loc[s + 1];
    const int64_t first = seq_lens[s] - (end - start) + 1; /* the limit of its first token */
    for (int64_t i = start; i < end; i++) {
      token_seq[i] = s;
      token_limit[i] = first + (i - start);
    }
  }
  paged_attention_f32(q, k_cache, v_cache, block_tables, table_stride, token_seq, token_limit, out,
                      num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale,
                      num_threads);
  free(token_seq);
  return 0;
}
