// pybind11 registration of diffuspec_search in dspec._C (see diffuspec_search.h).  Tensors
// cross as integer addresses (tensor.data_ptr() / ndarray.ctypes.data), all contiguous.
// Every argument is validated before anything is read or written; a bad one raises
// ValueError naming it.  The token ids of the lattice and of the history are checked against
// the n-gram's vocabulary here (one pass over B * L * M ids), so the search itself never
// reads out of bounds.
#include "diffuspec_search_bindings.h"

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "checks.h"
#include "diffuspec_search.h"

namespace py = pybind11;

namespace dspec {
namespace {

void diffuspec_search(std::int64_t cand_tokens_ptr, std::int64_t cand_logprobs_ptr, std::int64_t lengths_ptr,
                      std::int64_t history_ptr, std::int64_t eos_ptr, std::int64_t num_eos, std::int64_t batch,
                      std::int64_t slots, std::int64_t cands, std::int64_t beam, double lam, std::int64_t uniforms_ptr,
                      std::int64_t vocab, std::int64_t unigram_logp_ptr, std::int64_t unigram_bow_ptr,
                      std::int64_t bigram_keys_ptr, std::int64_t bigram_logp_ptr, std::int64_t bigram_bow_ptr,
                      std::int64_t num_bigrams, std::int64_t trigram_keys_ptr, std::int64_t trigram_logp_ptr,
                      std::int64_t num_trigrams, std::int64_t out_tokens_ptr, std::int64_t out_length_ptr,
                      std::int64_t out_score_ptr, std::int64_t out_q_ptr, int num_threads) {
  const Checker c{"diffuspec_search"};
  c.at_least(batch, 0, "batch");
  c.at_least(slots, 0, "slots");
  c.at_least(cands, 1, "cands");
  c.at_least(beam, 1, "beam");
  c.at_least(num_eos, 0, "num_eos");
  if (!(lam >= 0.0 && lam <= 1.0)) c.fail("lam must be in [0, 1], got " + std::to_string(lam));
  const bool with_ngram = vocab > 0;
  if (!with_ngram && lam != 1.0) c.fail("lam must be 1 without an n-gram (vocab = 0), got " + std::to_string(lam));
  if (vocab < 0 || vocab > 2000000) c.fail("vocab must be in [0, 2e6], got " + std::to_string(vocab));
  c.at_least(num_bigrams, 0, "num_bigrams");
  c.at_least(num_trigrams, 0, "num_trigrams");
  if (slots > 0 && cands > kI64Max / slots / std::max<std::int64_t>(batch, 1))
    c.fail("batch * slots * cands overflows");
  if (batch == 0) return;
  c.ptr(lengths_ptr, "lengths_ptr", 8);
  c.ptr(history_ptr, "history_ptr", 8);
  c.ptr(out_length_ptr, "out_length_ptr", 8);
  c.ptr(out_score_ptr, "out_score_ptr", 8);
  if (num_eos > 0) c.ptr(eos_ptr, "eos_ptr", 8);
  const std::int64_t cells = batch * slots * cands;
  if (cells > 0) {
    c.ptr(cand_tokens_ptr, "cand_tokens_ptr", 8);
    c.ptr(cand_logprobs_ptr, "cand_logprobs_ptr", 4);
    c.ptr(out_tokens_ptr, "out_tokens_ptr", 8);
    c.ptr(out_q_ptr, "out_q_ptr", 4);
    c.optional_ptr(uniforms_ptr, "uniforms_ptr", 4);
  }
  NgramTables t;
  if (with_ngram) {
    c.ptr(unigram_logp_ptr, "unigram_logp_ptr", 4);
    c.ptr(unigram_bow_ptr, "unigram_bow_ptr", 4);
    if (num_bigrams > 0) {
      c.ptr(bigram_keys_ptr, "bigram_keys_ptr", 8);
      c.ptr(bigram_logp_ptr, "bigram_logp_ptr", 4);
      c.ptr(bigram_bow_ptr, "bigram_bow_ptr", 4);
    }
    if (num_trigrams > 0) {
      c.ptr(trigram_keys_ptr, "trigram_keys_ptr", 8);
      c.ptr(trigram_logp_ptr, "trigram_logp_ptr", 4);
    }
    t.vocab = vocab;
    t.unigram_logp = as_ptr<const float>(unigram_logp_ptr);
    t.unigram_bow = as_ptr<const float>(unigram_bow_ptr);
    t.bigram_keys = as_ptr<const std::int64_t>(bigram_keys_ptr);
    t.bigram_logp = as_ptr<const float>(bigram_logp_ptr);
    t.bigram_bow = as_ptr<const float>(bigram_bow_ptr);
    t.n2 = num_bigrams;
    t.trigram_keys = as_ptr<const std::int64_t>(trigram_keys_ptr);
    t.trigram_logp = as_ptr<const float>(trigram_logp_ptr);
    t.n3 = num_trigrams;
  }
  // values: lengths in [0, slots], ids < vocab (when an n-gram reads them), uniforms in [0, 1)
  const auto* lengths = as_ptr<const std::int64_t>(lengths_ptr);
  const auto* history = as_ptr<const std::int64_t>(history_ptr);
  const auto* tok = as_ptr<const std::int64_t>(cand_tokens_ptr);
  const std::int64_t id_limit = with_ngram ? vocab : kI64Max;
  for (std::int64_t b = 0; b < batch; ++b) {
    if (lengths[b] < 0 || lengths[b] > slots) {
      c.fail("lengths[" + std::to_string(b) + "] must be in [0, slots = " + std::to_string(slots) + "], got " +
             std::to_string(lengths[b]));
    }
    for (int j = 0; j < 2; ++j) {
      const std::int64_t h = history[2 * b + j];
      if (h < -1 || h >= id_limit) {
        c.fail("history[" + std::to_string(b) + ", " + std::to_string(j) + "] must be -1 or an id in [0, " +
               std::to_string(id_limit) + "), got " + std::to_string(h));
      }
    }
  }
  for (std::int64_t i = 0; i < cells; ++i) {
    if (tok[i] < -1 || tok[i] >= id_limit) {
      c.fail("cand_tokens must hold -1 or ids in [0, " + std::to_string(id_limit) + "), got " + std::to_string(tok[i]) +
             " at flat index " + std::to_string(i));
    }
  }
  if (uniforms_ptr != 0) {
    const auto* u = as_ptr<const float>(uniforms_ptr);
    for (std::int64_t i = 0; i < batch * slots; ++i) {
      if (!(u[i] >= 0.0f && u[i] < 1.0f)) c.fail("uniforms must lie in [0, 1), got " + std::to_string(u[i]));
    }
  }
  PathSearchArgs a;
  a.cand_tokens = tok;
  a.cand_logprobs = as_ptr<const float>(cand_logprobs_ptr);
  a.lengths = lengths;
  a.history = history;
  a.eos = as_ptr<const std::int64_t>(eos_ptr);
  a.num_eos = num_eos;
  a.ngram = with_ngram ? &t : nullptr;
  a.uniforms = as_ptr<const float>(uniforms_ptr);
  a.batch = batch;
  a.slots = slots;
  a.cands = cands;
  a.beam = beam;
  a.lam = lam;
  a.out_tokens = as_ptr<std::int64_t>(out_tokens_ptr);
  a.out_length = as_ptr<std::int64_t>(out_length_ptr);
  a.out_score = as_ptr<double>(out_score_ptr);
  a.out_q = as_ptr<float>(out_q_ptr);
  if (cells == 0) {
    for (std::int64_t b = 0; b < batch; ++b) {
      a.out_length[b] = 0;
      a.out_score[b] = 0.0;
    }
    return;
  }
  a.num_threads = caller_threads(num_threads);
  py::gil_scoped_release release;
  diffuspec_search_cpu(a);
}

}  // namespace

void register_diffuspec_search(py::module_& m) {
  m.def("diffuspec_search", &diffuspec_search, py::arg("cand_tokens_ptr"), py::arg("cand_logprobs_ptr"),
        py::arg("lengths_ptr"), py::arg("history_ptr"), py::arg("eos_ptr"), py::arg("num_eos"), py::arg("batch"),
        py::arg("slots"), py::arg("cands"), py::arg("beam"), py::arg("lam"), py::arg("uniforms_ptr"), py::arg("vocab"),
        py::arg("unigram_logp_ptr"), py::arg("unigram_bow_ptr"), py::arg("bigram_keys_ptr"), py::arg("bigram_logp_ptr"),
        py::arg("bigram_bow_ptr"), py::arg("num_bigrams"), py::arg("trigram_keys_ptr"), py::arg("trigram_logp_ptr"),
        py::arg("num_trigrams"), py::arg("out_tokens_ptr"), py::arg("out_length_ptr"), py::arg("out_score_ptr"),
        py::arg("out_q_ptr"), py::arg("num_threads") = 0,
        R"doc(DiffuSpec's causal-consistency path search over a pruned token lattice (CPU).

cand_tokens int64 [B, L, M] (-1 = none), cand_logprobs float32 [B, L, M], lengths int64 [B],
history int64 [B, 2], eos int64 [num_eos]; uniforms float32 [B, L] samples one path left to
right (0 = beam search of width `beam`); the 3-gram tables of dspec.decode.ngram.NgramLM
(vocab = 0: no n-gram, lam must be 1).  Outputs: tokens int64 [B, L] (-1 past the path),
length int64 [B], score float64 [B], q float32 [B, L, M].  Semantics: the docstring of
dspec/reference/path_search.py, which this code equals exactly.  num_threads:
threads at most (0: dspec.cpu.kernel_threads()).  Use
dspec.decode.path_search.path_search rather than this raw entry point.)doc");
}

}  // namespace dspec
