/* Paged attention on CPU reading K/V pages where they are in the pool (no gather).
 *
 * Every query token i (of sequence token_seq[i]) attends the first token_limit[i] cached tokens of
 * its sequence, found through the sequence's block table. One (token, KV head) pair is one task: its
 * g = num_heads / num_kv_heads query heads share each K/V row read. Pages are taken a block at a
 * time with an online softmax (one rescale per block). float32 throughout. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

void paged_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *block_tables, int64_t table_stride,
                         const int64_t *token_seq, const int64_t *token_limit, float *out,
                         int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, int num_threads) {
  const int64_t g = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim; /* floats per cached token */
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
  for (int64_t i = 0; i < num_tokens; i++) {
    for (int64_t kh = 0; kh < num_kv_heads; kh++) {
      const int32_t *table = block_tables + token_seq[i] * table_stride;
      const int64_t n = token_limit[i];
      const float *qh = q + (i * num_heads + kh * g) * head_dim;
      float *oh = out + (i * num_heads + kh * g) * head_dim;
      float m[g], l[g], s[g][block_size];
      for (int64_t h = 0; h < g; h++) {
        m[h] = -FLT_MAX;
        l[h] = 0.0f;
      }
      memset(oh, 0, sizeof(float) * g * head_dim);
      for (int64_t start = 0; start < n; start += block_size) {
        const int64_t len = n - start < block_size ? n - start : block_size;
        const int64_t base = (int64_t)table[start / block_size] * block_size * row + kh * head_dim;
        for (int64_t h = 0; h < g; h++) {
          const float *qv = qh + h * head_dim;
          float block_max = -FLT_MAX;
          for (int64_t t = 0; t < len; t++) {
            const float *kv = k_cache + base + t * row;
            float dot = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) dot += qv[d] * kv[d];
            dot *= scale;
            s[h][t] = dot;
            if (dot > block_max) block_max = dot;
          }
          float *acc = oh + h * head_dim;
          if (block_max > m[h]) {
            const float corr = expf(m[h] - block_max);
            l[h] *= corr;
            for (int64_t d = 0; d < head_dim; d++) acc[d] *= corr;
            m[h] = block_max;
          }
          for (int64_t t = 0; t < len; t++) {
            const float p = expf(s[h][t] - m[h]);
            const float *vv = v_cache + base + t * row;
            l[h] += p;
            for (int64_t d = 0; d < head_dim; d++) acc[d] += p * vv[d];
          }
        }
      }
      for (int64_t h = 0; h < g; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) oh[h * head_dim + d] *= inv;
      }
    }
  }
}
