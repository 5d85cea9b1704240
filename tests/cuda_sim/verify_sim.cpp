// csrc/verify.cu compiled for the host simulator (cuda_sim.h), with a C interface for
// ctypes (tests/test_verify_ext.py).  All four stages run their CUDA kernels: stage 1 is
// csrc/token_stats.cu's token_stats_cuda (one or several vocabulary splits), compiled into
// this translation unit too.
#define DSPEC_CUDA_SIM 1
#include "cuda_sim.h"

#include <exception>

#include "token_stats.cu"
#include "verify.cu"

namespace {

void fill_common(dspec::VerifyCommon& c, const void* logits, int dtype, std::int64_t batch, std::int64_t positions,
                 std::int64_t vocab, std::int64_t row_stride, const float* coins, const float* uniforms,
                 double temperature, std::int64_t ts_splits, std::int64_t draw_splits, void* workspace) {
  c.logits = logits;
  c.dtype = dtype;
  c.batch = batch;
  c.positions = positions;
  c.vocab = vocab;
  c.row_stride = row_stride;
  c.greedy = temperature <= 0.0;
  c.inv_t = c.greedy ? 1.0f : static_cast<float>(1.0 / temperature);
  c.coins = coins;
  c.uniforms = uniforms;
  c.ts_splits = ts_splits;
  const std::int64_t tiles = dspec::draw_num_tiles(vocab, dtype);
  c.draw_splits = draw_splits < tiles ? draw_splits : tiles;
  c.workspace = workspace;
}

int report(const std::exception& e, char* err, int errlen) {
  std::snprintf(err, static_cast<std::size_t>(errlen), "%s", e.what());
  return 1;
}

}  // namespace

extern "C" {

std::int64_t dspec_sim_workspace_bytes(std::int64_t batch, std::int64_t positions, std::int64_t vocab, int dtype,
                                       std::int64_t excl_cap, int sampling, std::int64_t ts_splits) {
  return dspec::verify_layout(batch, positions, vocab, dtype, excl_cap, sampling != 0, ts_splits).bytes;
}

// The workspace of verify_chain with rule 1 (block) when sampling.
std::int64_t dspec_sim_block_workspace_bytes(std::int64_t batch, std::int64_t positions, std::int64_t vocab, int dtype,
                                             int sampling, std::int64_t ts_splits) {
  return dspec::verify_layout(batch, positions, vocab, dtype, 1, sampling != 0, ts_splits, true).bytes;
}

int dspec_sim_verify_chain_rule(const void* logits, int dtype, std::int64_t batch, std::int64_t length,
                                std::int64_t vocab, std::int64_t row_stride, const void* drafts, int draft_dtype,
                                const std::int64_t* num_drafts, const void* q, int q_dtype, std::int64_t q_stride_b,
                                std::int64_t q_stride_l, const float* coins, const float* uniforms, double temperature,
                                std::int64_t* num_accepted, std::int64_t* tokens, std::int64_t ts_splits,
                                std::int64_t draw_splits, void* workspace, int rule, char* err, int errlen) {
  try {
    dspec::VerifyChainArgs a;
    fill_common(a, logits, dtype, batch, length + 1, vocab, row_stride, coins, uniforms, temperature, ts_splits,
                draw_splits, workspace);
    a.drafts = drafts;
    a.draft_dtype = draft_dtype;
    a.num_drafts = num_drafts;
    a.q = length > 0 ? q : nullptr;
    a.q_dtype = q_dtype;
    a.q_stride_b = q_stride_b;
    a.q_stride_l = q_stride_l;
    a.num_accepted = num_accepted;
    a.tokens = tokens;
    a.block = rule == 1;
    dspec::verify_chain_cuda(a, 0);
  } catch (const std::exception& e) {
    return report(e, err, errlen);
  }
  return 0;
}

int dspec_sim_verify_chain(const void* logits, int dtype, std::int64_t batch, std::int64_t length, std::int64_t vocab,
                           std::int64_t row_stride, const void* drafts, int draft_dtype, const std::int64_t* num_drafts,
                           const void* q, int q_dtype, std::int64_t q_stride_b, std::int64_t q_stride_l,
                           const float* coins, const float* uniforms, double temperature, std::int64_t* num_accepted,
                           std::int64_t* tokens, std::int64_t ts_splits, std::int64_t draw_splits, void* workspace,
                           char* err, int errlen) {
  return dspec_sim_verify_chain_rule(logits, dtype, batch, length, vocab, row_stride, drafts, draft_dtype, num_drafts,
                                     q, q_dtype, q_stride_b, q_stride_l, coins, uniforms, temperature, num_accepted,
                                     tokens, ts_splits, draw_splits, workspace, 0, err, errlen);
}

int dspec_sim_verify_tree(const void* logits, int dtype, std::int64_t batch, std::int64_t nodes, std::int64_t vocab,
                          std::int64_t row_stride, const void* tokens, int token_dtype, const void* parents,
                          int parent_dtype, const float* coins, const float* uniforms, double temperature,
                          std::int64_t* num_accepted, std::int64_t* path, std::int64_t* out, std::int64_t ts_splits,
                          std::int64_t draw_splits, void* workspace, char* err, int errlen) {
  try {
    dspec::VerifyTreeArgs a;
    fill_common(a, logits, dtype, batch, nodes, vocab, row_stride, coins, uniforms, temperature, ts_splits, draw_splits,
                workspace);
    a.tokens = tokens;
    a.token_dtype = token_dtype;
    a.parents = parents;
    a.parent_dtype = parent_dtype;
    a.num_accepted = num_accepted;
    a.path = path;
    a.out = out;
    dspec::verify_tree_cuda(a, 0);
  } catch (const std::exception& e) {
    return report(e, err, errlen);
  }
  return 0;
}

std::int64_t dspec_sim_tree_q_workspace_bytes(std::int64_t batch, std::int64_t nodes, std::int64_t vocab, int dtype,
                                              int with_q, std::int64_t ts_splits) {
  return dspec::verify_layout(batch, nodes, vocab, dtype, nodes, true, ts_splits, false, with_q != 0 ? batch : 0).bytes;
}

// verify_tree sampling with draft_probs q (null: one-hot drafts); draft_sampling 0
// independent, 1 without replacement.
int dspec_sim_verify_tree_q(const void* logits, int dtype, std::int64_t batch, std::int64_t nodes, std::int64_t vocab,
                            std::int64_t row_stride, const void* tokens, int token_dtype, const void* parents,
                            int parent_dtype, const void* q, int q_dtype, std::int64_t q_stride_b,
                            std::int64_t q_stride_n, int draft_sampling, const float* coins, const float* uniforms,
                            double temperature, std::int64_t* num_accepted, std::int64_t* path, std::int64_t* out,
                            std::int64_t ts_splits, std::int64_t draw_splits, void* workspace, char* err, int errlen) {
  try {
    dspec::VerifyTreeArgs a;
    fill_common(a, logits, dtype, batch, nodes, vocab, row_stride, coins, uniforms, temperature, ts_splits, draw_splits,
                workspace);
    a.tokens = tokens;
    a.token_dtype = token_dtype;
    a.parents = parents;
    a.parent_dtype = parent_dtype;
    a.num_accepted = num_accepted;
    a.path = path;
    a.out = out;
    a.q = q;
    a.q_dtype = q_dtype;
    a.q_stride_b = q_stride_b;
    a.q_stride_n = q_stride_n;
    a.without_replacement = draft_sampling == 1;
    dspec::verify_tree_cuda(a, 0);
  } catch (const std::exception& e) {
    return report(e, err, errlen);
  }
  return 0;
}

}  // extern "C"
