// DiffuSpec's causal-consistency path search (CPS) on the CPU: beam search (or left-to-right
// sampling) over a pruned token lattice, scored by lam * dLLM log-prob + (1 - lam) * a
// token-id 3-gram's log-prob.  The plain-Python oracle is dspec/reference/path_search.py; this
// code gives exactly its output (same float64 arithmetic in the same order, same tie order).
// Latency-bound and branchy (a few beams x a few candidates x tens of slots): CPU code only.
#pragma once

#include <cstdint>

namespace dspec {

// A 3-gram in ARPA backoff form (dspec/decode/ngram.py): sorted int64 keys, float32 tables.
struct NgramTables {
  std::int64_t vocab = 0;                     // V
  const float* unigram_logp = nullptr;        // [V]
  const float* unigram_bow = nullptr;         // [V]
  const std::int64_t* bigram_keys = nullptr;  // [n2], v * V + w, strictly increasing
  const float* bigram_logp = nullptr;         // [n2]
  const float* bigram_bow = nullptr;          // [n2]
  std::int64_t n2 = 0;
  const std::int64_t* trigram_keys = nullptr;  // [n3], (u * V + v) * V + w, strictly increasing
  const float* trigram_logp = nullptr;         // [n3]
  std::int64_t n3 = 0;
};

struct PathSearchArgs {
  const std::int64_t* cand_tokens = nullptr;  // [B, L, M], -1 = no candidate
  const float* cand_logprobs = nullptr;       // [B, L, M], dLLM log-probs (-inf = unusable)
  const std::int64_t* lengths = nullptr;      // [B], slots used per request (<= L)
  const std::int64_t* history = nullptr;      // [B, 2], the two committed tokens before the path (-1 unknown)
  const std::int64_t* eos = nullptr;          // [num_eos]
  std::int64_t num_eos = 0;
  const NgramTables* ngram = nullptr;            // null: no proxy term (lam must be 1)
  const float* uniforms = nullptr;               // [B, L]: sample one path; null: beam search
  std::int64_t batch = 0, slots = 0, cands = 0;  // B, L, M
  std::int64_t beam = 1;
  double lam = 0.5;
  std::int64_t* out_tokens = nullptr;  // [B, L]
  std::int64_t* out_length = nullptr;  // [B]
  double* out_score = nullptr;         // [B]
  float* out_q = nullptr;              // [B, L, M]
  int num_threads = 1;                 // at most this many threads (the caller's count)
};

// log p(w | u, v) of the 3-gram (u, v = -1: no such history token); the exact arithmetic of
// NgramLM.logprob.
double ngram_logprob(const NgramTables& t, std::int64_t u, std::int64_t v, std::int64_t w);

void diffuspec_search_cpu(const PathSearchArgs& a);

}  // namespace dspec
