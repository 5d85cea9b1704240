// topk_tokens and mass_candidates on the CPU (DESIGN.md "Scoring"; dspec/reference/topk.py):
// the k most likely tokens of each row without sorting the vocabulary.
#pragma once

#include <cstdint>

#include "dspec.h"

namespace dspec {

struct TopkArgs {
  const void* logits = nullptr;  // [rows, vocab], unit column stride
  int dtype = kFloat32;
  std::int64_t rows = 0;
  std::int64_t vocab = 0;
  std::int64_t row_stride = 0;  // elements between rows
  std::int64_t k = 1;           // top-k (topk_tokens) or max_m (mass_candidates)
  float inv_t = 1.0f;           // 1 / temperature
  // mass_candidates: count = smallest m <= k whose top-m mass reaches tau
  bool mass = false;
  float tau = 0.0f;
  std::int64_t* tokens = nullptr;  // [rows, k] ids (-1 in unused / invalid slots)
  float* values = nullptr;         // [rows, k] probs (topk) or logprobs (mass)
  std::int64_t* count = nullptr;   // [rows] (mass only)
  int num_threads = 1;
};

void topk_cpu(const TopkArgs& args);

}  // namespace dspec
