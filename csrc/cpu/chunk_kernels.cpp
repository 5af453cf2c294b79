// fp32 row-range drivers, cloned per x86 ISA level (see chunk_kernels.h). Torch-free.
#include "chunk_kernels.h"

namespace mrtpo {

MRTPO_CLONES int64_t stats_rows_f32(const float* z, int64_t V, float inv_t,
                                    const int64_t* labels, int64_t ignore_index, bool with_ent,
                                    float* logp, float* ent, float* lse, int64_t begin,
                                    int64_t end) {
  return stats_rows<float>(z, V, inv_t, labels, ignore_index, with_ent, logp, ent, lse, begin, end);
}

MRTPO_CLONES int64_t grad_rows_f32(float* z, int64_t V, float inv_t, const int64_t* labels,
                                   int64_t ignore_index, const float* ent, const float* g_lp,
                                   const float* g_ent, int64_t begin, int64_t end,
                                   const LogitCap<float>& cap) {
  return grad_rows<float>(z, V, inv_t, labels, ignore_index, ent, g_lp, g_ent, begin, end, cap);
}

MRTPO_CLONES void js_rows_f32(const float* zp, const float* zq, int64_t V, float inv_t,
                              float* stat_p, bool have_stat_p, float* out, int64_t begin,
                              int64_t end) {
  js_rows<float>(zp, zq, V, inv_t, stat_p, have_stat_p, out, begin, end);
}

MRTPO_CLONES void js_many_rows_f32(const float* z, int64_t S, int64_t C, int64_t V, float inv_t,
                                   float* out, int64_t begin, int64_t end) {
  js_many_rows<float>(z, S, C, V, inv_t, out, begin, end);
}

MRTPO_CLONES int64_t policy_rows_f32(float* z, int64_t V, float inv_t, const int64_t* labels,
                                     int64_t ignore_index, const float* old_lp, const float* adv,
                                     const float* weight, const float* ref_lp, float clip_low,
                                     float clip_high, float beta, float clip_c, bool kl_iw,
                                     bool need_grad, float* loss, float* logp, float* clipped,
                                     int64_t begin, int64_t end, const LogitCap<float>& cap) {
  return policy_rows<float>(z, V, inv_t, labels, ignore_index, old_lp, adv, weight, ref_lp,
                            clip_low, clip_high, beta, clip_c, kl_iw, need_grad, loss, logp,
                            clipped, begin, end, cap);
}

}  // namespace mrtpo
