/* Paged attention on CPU reading K/V pages where they are in the pool (no gather).
 *
 * Every query token i (of sequence token_seq[i]) attends cached tokens token_first[i] ..
 * token_limit[i] - 1 of its sequence (from 0 without a sliding window or local chunk), found
 * through the sequence's block table; pages before token_first[i] are not read (they may be
 * freed: -1). Attention sinks (one logit per q head, no value) start each head's online softmax.
 * One (token, KV head) pair is one task, with its g = num_heads / num_kv_heads query heads taken
 * one after another over each block (the block's K/V rows come from cache after the first).
 * Pages are taken a block at a time with an online softmax (one rescale per block); the scores
 * of a block are exponentiated in one pass, and the output rows accumulate in a local array. The
 * head size is a compile-time constant for the common sizes (32, 64, 128), so the per-row loops
 * unroll and vectorize. float32 throughout. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline __attribute__((always_inline)) void attend(
    const float *restrict qh, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, int64_t first, int64_t n, int64_t head_offset, int64_t row,
    int64_t g, const int64_t dim, int64_t block_size, float scale, const float *restrict sinks,
    float *restrict oh) {
  float m[g], l[g], s[g][block_size];
  float acc[g][dim];
  for (int64_t h = 0; h < g; h++) {
    /* A sink is a score of its own whose exponent joins the sum: the softmax starts from it. */
    m[h] = sinks ? sinks[h] : -FLT_MAX;
    l[h] = sinks ? 1.0f : 0.0f;
    for (int64_t d = 0; d < dim; d++) acc[h][d] = 0.0f;
  }
  for (int64_t start = first; start < n;) {
    /* The keys of one page from `start` on: a window's first page is read from its middle. */
    const int64_t offset = start % block_size;
    const int64_t len = n - start < block_size - offset ? n - start : block_size - offset;
    const int64_t base =
        ((int64_t)table[start / block_size] * block_size + offset) * row + head_offset;
    start += len;
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

/* Not inlined into the entry points below: they all run this one compiled body. token_first and
 * sinks may be NULL (every key from 0; no sinks). */
__attribute__((noinline)) static void attend_tokens(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
    int64_t table_stride, const int64_t *token_seq, const int64_t *token_first,
    const int64_t *token_limit, const float *sinks, float *out, int64_t num_tokens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
    int num_threads) {
  const int64_t g = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim; /* floats per cached token */
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
  for (int64_t i = 0; i < num_tokens; i++) {
    for (int64_t kh = 0; kh < num_kv_heads; kh++) {
      const int32_t *table = block_tables + token_seq[i] * table_stride;
      const int64_t first = token_first ? token_first[i] : 0, n = token_limit[i];
      const float *qh = q + (i * num_heads + kh * g) * head_dim;
      const float *sh = sinks ? sinks + kh * g : NULL;
      float *oh = out + (i * num_heads + kh * g) * head_dim;
      const int64_t off = kh * head_dim;
      switch (head_dim) {
        case 32:
          attend(qh, k_cache, v_cache, table, first, n, off, row, g, 32, block_size, scale, sh, oh);
          break;
        case 64:
          attend(qh, k_cache, v_cache, table, first, n, off, row, g, 64, block_size, scale, sh, oh);
          break;
        case 128:
          attend(qh, k_cache, v_cache, table, first, n, off, row, g, 128, block_size, scale, sh,
                 oh);
          break;
        default:
          attend(qh, k_cache, v_cache, table, first, n, off, row, g, head_dim, block_size, scale,
                 sh, oh);
      }
    }
  }
}

/* Every query token i attends the first token_limit[i] cached tokens of its sequence. */
void paged_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *block_tables, int64_t table_stride,
                         const int64_t *token_seq, const int64_t *token_limit, float *out,
                         int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, int num_threads) {
  attend_tokens(q, k_cache, v_cache, block_tables, table_stride, token_seq, NULL, token_limit,
                NULL, out, num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale,
                num_threads);
}

/* The same, from the batch's sequence lengths (context after this step) and query start offsets
 * (num_seqs + 1 of them), with a layer's sliding window and local chunk (keys k of a query at
 * position p: p - window < k, k / chunk == p / chunk; 0: off) and its sinks (num_heads logits,
 * or NULL): each token's sequence and key range are derived here, once per call, rather than by
 * a handful of tensor ops in Python for every layer of every step. Returns 0, or -1 when the
 * offsets do not cover exactly num_tokens tokens in order (nothing written), -2 when out of
 * memory. */
int paged_attention_f32_layer(const float *q, const float *k_cache, const float *v_cache,
                              const int32_t *block_tables, int64_t table_stride,
                              const int64_t *seq_lens, const int64_t *query_start_loc,
                              int64_t num_seqs, float *out, int64_t num_tokens, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              float scale, int64_t window, int64_t chunk, const float *sinks,
                              int num_threads) {
  if (query_start_loc[0] != 0 || query_start_loc[num_seqs] != num_tokens) return -1;
  for (int64_t s = 0; s < num_seqs; s++)
    if (query_start_loc[s + 1] < query_start_loc[s]) return -1;
  int64_t *token_seq = malloc(3 * (size_t)(num_tokens > 0 ? num_tokens : 1) * sizeof(int64_t));
  if (token_seq == NULL) return -2;
  int64_t *token_first = token_seq + num_tokens, *token_limit = token_first + num_tokens;
  for (int64_t s = 0; s < num_seqs; s++) {
    const int64_t start = query_start_loc[s], end = query_start_loc[s + 1];
    const int64_t p0 = seq_lens[s] - (end - start); /* the position of its first token */
    for (int64_t i = start; i < end; i++) {
      const int64_t p = p0 + (i - start);
      int64_t from = 0;
      if (window > 0 && p - window + 1 > from) from = p - window + 1;
      if (chunk > 0 && p - p % chunk > from) from = p - p % chunk;
      token_seq[i] = s;
      token_first[i] = from;
      token_limit[i] = p + 1;
    }
  }
  attend_tokens(q, k_cache, v_cache, block_tables, table_stride, token_seq, token_first,
                token_limit, sinks, out, num_tokens, num_heads, num_kv_heads, head_dim, block_size,
                scale, num_threads);
  free(token_seq);
  return 0;
}
