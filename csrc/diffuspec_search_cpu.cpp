// CPU implementation of DiffuSpec's path search; see diffuspec_search.h and the oracle
// dspec/reference/path_search.py (whose docstring defines the search).  Requests are
// independent: large batches are split over threads.
// The scores must round exactly as the Python oracle's (one rounding per * and +): no fused
// multiply-add contraction, whatever the target ISA.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_parallel.h"
#include "diffuspec_search.h"

namespace dspec {
namespace {

std::int64_t find_key(const std::int64_t* keys, std::int64_t n, std::int64_t key) {
  if (n == 0) return -1;
  const std::int64_t* it = std::lower_bound(keys, keys + n, key);
  return (it != keys + n && *it == key) ? static_cast<std::int64_t>(it - keys) : -1;
}

struct Beam {
  double score;
  std::vector<std::int64_t> path;
  std::vector<std::int64_t> picked;  // candidate index per slot
  bool finished;
};

struct Expansion {
  double score;
  std::int64_t parent;
  std::int64_t cand;  // -1: a finished beam carried over
};

class Searcher {
 public:
  explicit Searcher(const PathSearchArgs& a) : a_(a) {}

  void run(std::int64_t b) const {
    const std::int64_t L = a_.slots, M = a_.cands;
    const std::int64_t* tok = a_.cand_tokens + b * L * M;
    const float* lp = a_.cand_logprobs + b * L * M;
    std::int64_t* out_tok = a_.out_tokens + b * L;
    float* out_q = a_.out_q + b * L * M;
    std::fill(out_tok, out_tok + L, std::int64_t{-1});
    std::fill(out_q, out_q + L * M, 0.0f);
    // usable candidates per slot; the lattice is cut at the first slot with none
    const std::int64_t len = std::min<std::int64_t>(a_.lengths[b], L);
    std::vector<std::vector<std::int64_t>> usable;
    for (std::int64_t i = 0; i < len; ++i) {
      std::vector<std::int64_t> u;
      for (std::int64_t m = 0; m < M; ++m) {
        if (tok[i * M + m] >= 0 && lp[i * M + m] != -std::numeric_limits<float>::infinity()) u.push_back(m);
      }
      if (u.empty()) break;
      usable.push_back(std::move(u));
    }
    const std::int64_t n = static_cast<std::int64_t>(usable.size());
    const std::int64_t h0 = a_.history[2 * b], h1 = a_.history[2 * b + 1];
    const double lam = a_.lam, rest = 1.0 - a_.lam;

    if (a_.uniforms != nullptr) {
      std::vector<std::int64_t> path;
      double score = 0.0;
      std::vector<double> s, w;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t u = i >= 2 ? path[i - 2] : (i == 0 ? h0 : h1);
        const std::int64_t v = i >= 1 ? path[i - 1] : h1;
        const auto& c = usable[i];
        s.assign(c.size(), 0.0);
        double mx = -std::numeric_limits<double>::infinity();
        for (std::size_t j = 0; j < c.size(); ++j) {
          s[j] = lam * static_cast<double>(lp[i * M + c[j]]) + rest * proxy(u, v, tok[i * M + c[j]]);
          mx = std::max(mx, s[j]);
        }
        w.assign(c.size(), 0.0);
        double total = 0.0;
        for (std::size_t j = 0; j < c.size(); ++j) {
          w[j] = std::exp(s[j] - mx);
          total += w[j];
        }
        const double target = static_cast<double>(a_.uniforms[b * L + i]) * total;
        std::size_t pick = c.size() - 1;
        double run = 0.0;
        for (std::size_t j = 0; j < c.size(); ++j) {
          run += w[j];
          if (run > target) {
            pick = j;
            break;
          }
        }
        for (std::size_t j = 0; j < c.size(); ++j) out_q[i * M + c[j]] = static_cast<float>(w[j] / total);
        const std::int64_t t = tok[i * M + c[pick]];
        path.push_back(t);
        score += s[pick];
        if (is_eos(t)) break;
      }
      std::copy(path.begin(), path.end(), out_tok);
      a_.out_length[b] = static_cast<std::int64_t>(path.size());
      a_.out_score[b] = score;
      return;
    }

    std::vector<Beam> beams{Beam{0.0, {}, {}, false}};
    std::vector<Expansion> cands;
    for (std::int64_t i = 0; i < n; ++i) {
      cands.clear();
      for (std::size_t bi = 0; bi < beams.size(); ++bi) {
        const Beam& be = beams[bi];
        if (be.finished) {
          cands.push_back({be.score, static_cast<std::int64_t>(bi), -1});
          continue;
        }
        const std::int64_t u = i >= 2 ? be.path[i - 2] : (i == 0 ? h0 : h1);
        const std::int64_t v = i >= 1 ? be.path[i - 1] : h1;
        for (std::int64_t m : usable[i]) {
          const std::int64_t t = tok[i * M + m];
          cands.push_back({be.score + (lam * static_cast<double>(lp[i * M + m]) + rest * proxy(u, v, t)),
                           static_cast<std::int64_t>(bi), m});
        }
      }
      const std::size_t keep = std::min<std::size_t>(cands.size(), static_cast<std::size_t>(a_.beam));
      std::partial_sort(cands.begin(), cands.begin() + keep, cands.end(), [](const Expansion& x, const Expansion& y) {
        if (x.score != y.score) return x.score > y.score;
        if (x.parent != y.parent) return x.parent < y.parent;
        return x.cand < y.cand;
      });
      std::vector<Beam> next;
      next.reserve(keep);
      bool all_done = true;
      for (std::size_t k = 0; k < keep; ++k) {
        const Expansion& e = cands[k];
        Beam nb = beams[e.parent];
        nb.score = e.score;
        if (e.cand < 0) {
          nb.finished = true;
        } else {
          const std::int64_t t = tok[i * M + e.cand];
          nb.path.push_back(t);
          nb.picked.push_back(e.cand);
          nb.finished = is_eos(t);
        }
        all_done = all_done && nb.finished;
        next.push_back(std::move(nb));
      }
      beams.swap(next);
      if (all_done) break;
    }
    const Beam& best = beams[0];
    std::copy(best.path.begin(), best.path.end(), out_tok);
    for (std::size_t i = 0; i < best.picked.size(); ++i) out_q[i * M + best.picked[i]] = 1.0f;
    a_.out_length[b] = static_cast<std::int64_t>(best.path.size());
    a_.out_score[b] = best.score;
  }

 private:
  bool is_eos(std::int64_t t) const {
    for (std::int64_t e = 0; e < a_.num_eos; ++e) {
      if (a_.eos[e] == t) return true;
    }
    return false;
  }

  double proxy(std::int64_t u, std::int64_t v, std::int64_t w) const {
    return a_.ngram == nullptr ? 0.0 : ngram_logprob(*a_.ngram, u, v, w);
  }

  const PathSearchArgs& a_;
};

}  // namespace

double ngram_logprob(const NgramTables& t, std::int64_t u, std::int64_t v, std::int64_t w) {
  const std::int64_t V = t.vocab;
  if (v >= 0) {
    double bow = 0.0;
    if (u >= 0) {
      const std::int64_t k = find_key(t.trigram_keys, t.n3, (u * V + v) * V + w);
      if (k >= 0) return static_cast<double>(t.trigram_logp[k]);
      const std::int64_t c = find_key(t.bigram_keys, t.n2, u * V + v);
      if (c >= 0) bow = static_cast<double>(t.bigram_bow[c]);
    }
    const std::int64_t k = find_key(t.bigram_keys, t.n2, v * V + w);
    if (k >= 0) return bow + static_cast<double>(t.bigram_logp[k]);
    return bow + (static_cast<double>(t.unigram_bow[v]) + static_cast<double>(t.unigram_logp[w]));
  }
  return static_cast<double>(t.unigram_logp[w]);
}

void diffuspec_search_cpu(const PathSearchArgs& a) {
  const Searcher s(a);
  const std::int64_t work = a.slots * a.cands * std::max<std::int64_t>(a.beam, 1);
  // requests are independent: the pool splits them over the caller's threads (capped by
  // $DSPEC_CPU_THREADS), small searches stay on the calling thread
  cpu::parallel_rows(
      a.batch, work, a.num_threads,
      [&](std::int64_t lo, std::int64_t hi) {
        for (std::int64_t b = lo; b < hi; ++b) s.run(b);
      },
      20000);
}

}  // namespace dspec
