// S2D2's step on the CPU (s2d2.h): the layout, the transitions and the block openings of
// dspec/decode/s2d2.py's S2D2Run, row by row on the host, for greedy decoding with policy
// "always".  Each function mirrors a torch function of s2d2.py (named where it starts), so
// the two stay checkable against each other line by line.
#include "s2d2.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dspec.h"
#include "masks.h"

namespace dspec {
namespace {

using R = S2D2Record;

struct Row {
  std::int64_t* p;
  const S2D2Record& f;
  std::int64_t& operator[](std::int64_t i) const { return p[i]; }
  std::int64_t* tokens() const { return p + f.tokens(); }
  std::int64_t* masked() const { return p + f.masked(); }
  std::int64_t* drafts() const { return p + f.drafts(); }
  std::int64_t* prev() const { return p + f.prev(); }
  std::int64_t* tail() const { return p + f.tail(); }
  std::int64_t* used() const { return p + f.used(); }
  std::int64_t* first() const { return p + f.first(); }
  std::int64_t* starts() const { return p + f.starts(); }
  std::int64_t* logit_starts() const { return p + f.logit_starts(); }
  bool any_masked() const {
    for (std::int64_t t = 0; t < f.bs; ++t)
      if (p[f.masked() + t]) return true;
    return false;
  }
  // _Layout.lead: the chain rows before block slot 0 (a verifying row's pending block)
  std::int64_t lead() const { return p[R::kPending] && p[R::kPhase] == kS2D2Verify ? f.bs : 0; }
  // _Layout.row_of: the suffix row of block slot `slot` in redraft block r (shared-prefix
  // slots are the chain's rows, at their slot after the lead)
  std::int64_t row_of(std::int64_t r, std::int64_t slot) const {
    const std::int64_t fr = first()[r];
    return slot < fr ? lead() + slot : p[R::kOffset] + starts()[r] + slot - fr;
  }
};

// Logit row i of a row's argmax [nr], clamped into it as the torch step's gathers clamp: the
// layout fields that index it come from the caller's record.
std::int64_t argmax_at(const std::int64_t* a, std::int64_t i, std::int64_t nr) {
  return a[std::clamp<std::int64_t>(i, 0, nr - 1)];
}

// _redraft_blocks + useless_blocks + _verify_width: the redraft blocks of a verifying row and
// the row's suffix width; returns the drafting logit rows the row adds (0 unless verifying).
std::int64_t plan_row(const S2D2Config& cfg, const Row& row, std::int64_t& width) {
  const std::int64_t bs = cfg.bs, phase = row[R::kPhase], s = row[R::kSpanStart], n = row[R::kSpanLen];
  const bool verify = phase == kS2D2Verify;
  bool after_masked = false;  // a masked slot after the span
  for (std::int64_t t = s + n; t < bs; ++t)
    if (row.masked()[t]) after_masked = true;
  // outcome L - 1 fills the block: useless, unless the boundary state rides behind it
  const bool fills = !after_masked && !(cfg.boundary && s + n == bs);
  std::int64_t total = 0, logit_blocks = 0;
  bool any_used = false;
  for (std::int64_t r = 0; r <= bs; ++r) {
    bool used = verify && (cfg.redraft ? r <= n : r == n);
    const bool useless = (r == n - 1 && fills) || (cfg.shifted && cfg.share_prefix && r == 0 && row[R::kExactFirst]);
    if (r != n && useless) used = false;
    const std::int64_t first = cfg.share_prefix && cfg.redraft ? std::min(s + r, bs) : 0;
    row.used()[r] = used;
    row.first()[r] = first;
    row.starts()[r] = total;
    row.logit_starts()[r] = logit_blocks;
    if (used) {
      total += bs - first;
      logit_blocks += std::max<std::int64_t>(bs - 1 - s - r, 0);
      any_used = true;
    }
  }
  const bool has_next = verify && cfg.redraft && s + n == bs;
  const bool has_boundary = cfg.boundary && has_next && row.used()[std::max<std::int64_t>(n - 1, 0)];
  const bool pend = row[R::kPending] && phase == kS2D2Draft;
  const std::int64_t chain = phase == kS2D2Draft ? (pend ? 2 * bs : bs) : verify ? row.lead() + s + n : 0;
  row[R::kHasNext] = has_next;
  row[R::kHasBoundary] = has_boundary;
  row[R::kOffset] = chain + (verify && !cfg.shifted ? n + 1 : 0);
  row[R::kRedraftRows] = total;
  row[R::kLogitBlocks] = logit_blocks;
  if (verify) {
    width = row[R::kOffset] + total + (has_next ? bs : 0) + (has_boundary ? bs : 0);
  } else {
    width = phase == kS2D2Done ? 1 : row[R::kPending] ? 2 * bs : bs;
  }
  if (!verify || !any_used) return 0;
  return logit_blocks + (cfg.shifted ? 1 : 0) + (has_next ? (cfg.shifted ? bs - 1 : bs) : 0) + (has_boundary ? bs : 0);
}

// _row_layout for one row: suffix tokens, positions and mask words of `width` rows.
void layout_row(const S2D2Config& cfg, const Row& row, std::int64_t width, std::int64_t* suffix,
                std::int64_t* positions, std::int32_t* words) {
  const std::int64_t bs = cfg.bs, phase = row[R::kPhase], s = row[R::kSpanStart], n = row[R::kSpanLen];
  const bool verify = phase == kS2D2Verify, block_rows = phase == kS2D2Draft;
  const bool pend = row[R::kPending] && block_rows;
  const std::int64_t lead = row.lead();
  const std::int64_t cl = block_rows ? (pend ? 2 * bs : bs) : verify ? lead + s + n : 0;
  const std::int64_t off = row[R::kOffset], total = row[R::kRedraftRows];
  const bool has_next = row[R::kHasNext], has_boundary = row[R::kHasBoundary];
  const std::int64_t* first = row.first();
  const std::int64_t* starts = row.starts();
  // per suffix row: its region and, in a redraft block, the block and its block slot
  enum Region : std::uint8_t { kPad, kChain, kCopy, kRed, kNext, kBound };
  Region region[kS2D2MaxWidth];
  std::int64_t rb[kS2D2MaxWidth], red_first[kS2D2MaxWidth];
  for (std::int64_t i = 0; i < width; ++i) {
    const std::int64_t u = i - off;
    std::int64_t b = 0;  // the redraft blocks ending at or before u
    for (std::int64_t r = 0; r <= bs; ++r) b += u >= (r < bs ? starts[r + 1] : total);
    b = std::min(b, bs);
    rb[i] = b;
    red_first[i] = first[b];
    region[i] = i < cl                                                    ? kChain
                : i < off                                                 ? kCopy
                : (u >= 0 && u < total)                                   ? kRed
                : (has_next && u >= total && u < total + bs)              ? kNext
                : (has_boundary && u >= total + bs && u < total + 2 * bs) ? kBound
                                                                          : kPad;
  }
  const std::int64_t nw = mask_words(width);
  const std::int64_t* tokens = row.tokens();
  const std::int64_t* drafts = row.drafts();
  for (std::int64_t q = 0; q < width; ++q) {
    std::int32_t* wq = words + q * nw;
    std::fill(wq, wq + nw, 0);
    const Region rq = region[q];
    for (std::int64_t k = 0; k < width; ++k) {
      const Region rk = region[k];
      bool see = false;
      switch (rq) {
        case kChain:  // token-causal, or a drafting block (and its pending block) bidirectional
          see = rk == kChain && ((block_rows && (!pend || k / bs <= q / bs)) || k <= q);
          break;
        case kCopy:  // copy j: the context and drafts before s + j, and itself
          see = k < lead + s + (q - cl) || k == q;
          break;
        case kRed:  // its own block and, shared prefix, the chain rows before its first row (block
                    // L - 1 with the boundary state behind it: one [MASK] run with it)
          see = (rk == kRed && rb[k] == rb[q]) || (rk == kChain && k < lead + red_first[q]) ||
                (rk == kBound && rb[q] == n - 1);
          break;
        case kNext:  // itself and the finished block
          see = rk == kNext || (cfg.share_prefix ? rk == kChain : (rk == kRed && rb[k] == n));
          break;
        case kBound:  // itself, the chain before the block's last slot and redraft block L - 1
          see = rk == kBound || (rk == kChain && k < lead + bs - 1) || (rk == kRed && rb[k] == n - 1);
          break;
        case kPad: see = k == q; break;
      }
      if (see) wq[k >> 5] |= static_cast<std::int32_t>(1u << (k & 31));
    }
  }
  for (std::int64_t i = 0; i < width; ++i) {
    const Region ri = region[i];
    const std::int64_t u = i - off;
    const std::int64_t red_slot = red_first[i] + u - starts[rb[i]];
    std::int64_t slot = ri == kChain ? i - lead : ri == kCopy ? s + i - cl : ri == kRed ? red_slot : 0;
    if (pend && ri == kChain) slot -= bs;
    const std::int64_t c = std::clamp<std::int64_t>(slot, 0, bs - 1);
    // the block with the span's drafts in place (verifying rows)
    std::int64_t tok = verify && c >= s && c < s + n ? drafts[c - s] : tokens[c];
    if ((pend || lead > 0) && i < bs) tok = row.prev()[std::clamp<std::int64_t>(slot + bs, 0, bs - 1)];
    const bool red_keep = !(red_slot >= s + rb[i] && red_slot < s + n);
    suffix[i] = ri == kChain || (ri == kRed && red_keep) ? tok : cfg.mask_id;
    if (ri == kNext) slot = bs + u - total;
    if (ri == kBound) slot = u - total;
    positions[i] = row[R::kBlockStart] + std::clamp<std::int64_t>(slot, -bs, 2 * bs - 1);
  }
}

// _logit_rows and _Layout.drafting_rows for one row: `count` rows in all.
void logit_rows_of(const S2D2Config& cfg, const Row& row, std::int64_t count, std::int64_t* out) {
  const std::int64_t bs = cfg.bs, phase = row[R::kPhase], s = row[R::kSpanStart], n = row[R::kSpanLen];
  const bool pend = row[R::kPending] && phase == kS2D2Draft;
  const std::int64_t lead = row.lead(), chain = lead + s + n;
  for (std::int64_t j = 0; j <= bs; ++j) {
    std::int64_t block = std::min(j, bs - 1);
    if (pend) block = j < bs ? bs + j : bs - 1;
    if (phase == kS2D2Done) block = 0;
    const std::int64_t ver =
        cfg.shifted ? std::min(std::max<std::int64_t>(lead + s - 1 + j, 0), std::max<std::int64_t>(chain - 1, 0))
                    : std::min(chain + j, chain + n);
    out[j] = phase == kS2D2Verify ? ver : block;
  }
  const std::int64_t extra = count - (bs + 1);
  const bool verify = phase == kS2D2Verify;
  const std::int64_t logit_blocks = row[R::kLogitBlocks];
  const bool has_next = row[R::kHasNext], has_boundary = row[R::kHasBoundary];
  const std::int64_t* ls = row.logit_starts();
  const std::int64_t next_off = row[R::kOffset] + row[R::kRedraftRows];
  const std::int64_t last =
      logit_blocks + (cfg.shifted ? 1 : 0) + (has_next ? bs - (cfg.shifted ? 1 : 0) : 0) + (has_boundary ? bs : 0);
  for (std::int64_t k = 0; k < extra; ++k) {
    std::int64_t r = 0;  // the blocks whose logit rows end at or before k
    for (std::int64_t e = 0; e <= bs; ++e) r += k >= (e < bs ? ls[e + 1] : logit_blocks);
    r = std::min(r, bs);
    const std::int64_t slot = s + r + (k - ls[r]) + (cfg.shifted ? 0 : 1);
    std::int64_t rows = row.row_of(r, slot);
    std::int64_t after = k - logit_blocks;
    if (cfg.shifted) {
      if (after == 0) rows = row.row_of(n, bs - 1);
      after -= 1;
    }
    if (has_next && after >= 0) rows = next_off + after;
    // the boundary state (right-shifted): block L - 1's [MASK] row predicts slot 0
    after -= bs - 1;
    if (has_boundary && after == 0) rows = row.row_of(std::max<std::int64_t>(n - 1, 0), bs - 1);
    if (has_boundary && after > 0) rows = next_off + bs + after - 1;
    out[bs + 1 + k] = verify && k < last ? rows : 0;
  }
}

// S2D2Run.draft for one drafting row (policy "always", greedy): the span drafts from the
// slot-aligned choices; returns the next phase.
std::int64_t draft_row(const S2D2Config& cfg, const Row& row, const std::int64_t* choice, bool stale,
                       std::int64_t* counters) {
  const std::int64_t bs = cfg.bs;
  const std::int64_t* masked = row.masked();
  std::int64_t first = -1;
  for (std::int64_t t = 0; t < bs && first < 0; ++t)
    if (masked[t]) first = t;
  if (first < 0) return kS2D2Commit;  // nothing to decide: the block is complete
  std::int64_t length = 0;
  while (first + length < bs && masked[first + length]) ++length;
  length = std::min(length, cfg.draft_len);
  counters[S2D2Counters::kDecisions] += 1;
  counters[S2D2Counters::kVerifyDecisions] += 1;
  for (std::int64_t t = 0; t < bs; ++t) row.drafts()[t] = choice[std::min(first + t, bs - 1)];
  row[R::kSpanStart] = first;
  row[R::kSpanLen] = length;
  row[R::kExactFirst] = !stale;
  return kS2D2Verify;
}

// A row's new block at its block start: the prompt's tokens where it reaches in, else [MASK].
void fresh_block(const S2D2Config& cfg, const Row& row) {
  const std::int64_t start = row[R::kBlockStart];
  for (std::int64_t t = 0; t < cfg.bs; ++t) {
    const std::int64_t pos = start + t, at = pos - row[R::kTailStart];
    const bool in_prompt = pos < row[R::kPromptLen] && at >= 0 && at < cfg.bs;
    row.tokens()[t] = in_prompt ? row.tail()[at] : cfg.mask_id;
    row.masked()[t] = !in_prompt;
  }
}

}  // namespace

S2D2Plan s2d2_plan(const S2D2Config& cfg, std::int64_t* state, std::int64_t* suffix, std::int64_t* positions,
                   std::int32_t* words, std::int64_t* logit_rows) {
  const S2D2Record f{cfg.bs};
  const std::int64_t rec = f.width();
  S2D2Plan plan;
  bool all_done = true, all_draft = true;
  std::int64_t draft_rows = 0;
  for (std::int64_t b = 0; b < cfg.rows; ++b) {
    const Row row{state + b * rec, f};
    std::int64_t w = 0;
    const std::int64_t extra = plan_row(cfg, row, w);
    const std::int64_t phase = row[R::kPhase];
    plan.width = std::max(plan.width, w);
    draft_rows = std::max(draft_rows, extra);
    all_done = all_done && phase == kS2D2Done;
    all_draft = all_draft && phase == kS2D2Draft;
    plan.any_draft = plan.any_draft || phase == kS2D2Draft;
    plan.any_verify = plan.any_verify || phase == kS2D2Verify;
    plan.any_pending = plan.any_pending || row[R::kPending];
  }
  if (all_done) {
    plan.width = 0;
    return plan;
  }
  plan.plain = all_draft && !plan.any_pending;
  if (plan.plain) {
    plan.width = cfg.bs;
    plan.logit_rows = cfg.bs;
    return plan;
  }
  plan.logit_rows = cfg.bs + 1 + (plan.any_verify ? draft_rows : 0);
  const std::int64_t width = plan.width, nw = mask_words(width);
  for (std::int64_t b = 0; b < cfg.rows; ++b) {
    const Row row{state + b * rec, f};
    layout_row(cfg, row, width, suffix + b * width, positions + b * width, words + b * width * nw);
    logit_rows_of(cfg, row, plan.logit_rows, logit_rows + b * plan.logit_rows);
  }
  return plan;
}

S2D2Advance s2d2_advance(const S2D2Config& cfg, const S2D2Plan& plan, std::int64_t* state, const void* logits,
                         int dtype, std::int64_t row_stride, std::int64_t vocab, std::int64_t* argmax,
                         std::int64_t* keep, std::int64_t* counters) {
  const S2D2Record f{cfg.bs};
  const std::int64_t rec = f.width(), bs = cfg.bs, nr = plan.logit_rows;
  TokenStatsArgs ts;
  ts.logits = logits;
  ts.dtype = dtype;
  ts.rows = cfg.rows * nr;
  ts.vocab = vocab;
  ts.row_stride = row_stride;
  ts.token = argmax;
  ts.argmax_only = true;
  ts.num_threads = cfg.num_threads;
  std::vector<float> unused(static_cast<std::size_t>(4 * ts.rows));  // the statistics argmax_only leaves
  ts.prob = unused.data();
  ts.margin = ts.prob + ts.rows;
  ts.entropy = ts.margin + ts.rows;
  ts.lse = ts.entropy + ts.rows;
  token_stats_cpu(ts);
  S2D2Advance res;
  const bool keeps = plan.any_pending || plan.any_verify;
  std::int64_t choice[kS2D2MaxBlock];
  for (std::int64_t b = 0; b < cfg.rows; ++b) {
    const Row row{state + b * rec, f};
    const std::int64_t* a = argmax + b * nr;
    const std::int64_t phase = row[R::kPhase], s = row[R::kSpanStart], n = row[R::kSpanLen];
    const bool pending = row[R::kPending];
    // the pending block's last row predicts slot 0 (a verifying row's: its chain's row 0)
    const std::int64_t lead = row.lead();
    if (plan.any_pending && cfg.shifted && pending) row[R::kCarry] = lead ? a[0] : a[bs];
    std::int64_t nxt = phase;
    bool reuse = false, spec_final = false, chain_final = false, stale = false, bounded = false;
    if (plan.any_verify && phase == kS2D2Verify) {  // S2D2Run.verify + accept_span
      const auto target = [&](std::int64_t j) {
        return cfg.shifted && j == 0 && s == 0 && !lead ? row[R::kCarry] : a[j];
      };
      std::int64_t acc = 0;
      while (acc < n && row.drafts()[acc] == target(acc)) ++acc;
      const bool bonus_ok = s + n < bs && row.masked()[std::min(s + n, bs - 1)];
      const std::int64_t committed = acc + ((acc < n || bonus_ok) ? 1 : 0);
      for (std::int64_t t = 0; t < committed; ++t) {
        row.tokens()[s + t] = t < acc ? row.drafts()[t] : target(acc);
        row.masked()[s + t] = 0;
      }
      const bool left = row.any_masked();
      reuse = left && row.used()[acc];
      spec_final = acc == n && !left && committed == acc;
      chain_final = cfg.share_prefix && spec_final && s + n == bs;
      bounded = row[R::kHasBoundary] && acc == n - 1 && !left;
      counters[S2D2Counters::kVerifications] += 1;
      counters[S2D2Counters::kCommitted] += committed;
      counters[S2D2Counters::kAccepted] += acc;
      counters[S2D2Counters::kDrafted] += n;
      counters[S2D2Counters::kReused] += reuse;
      counters[S2D2Counters::kSpecFinal] += spec_final;
      counters[S2D2Counters::kHist + acc] += 1;
      res.committed += committed;
      nxt = left ? kS2D2Draft : kS2D2Commit;
      stale = reuse && committed > acc;
      // S2D2Run.redraft_logits: the outcome's redraft block (slot-aligned) and the carry
      const std::int64_t base = bs + 1;
      if (cfg.shifted && spec_final)
        row[R::kCarry] = chain_final ? a[bs] : argmax_at(a, base + row[R::kLogitBlocks], nr);
      if (reuse) {
        for (std::int64_t t = 0; t < bs; ++t) {
          const std::int64_t idx = row.logit_starts()[acc] + std::max<std::int64_t>(t - (s + acc + 1), 0);
          choice[t] = argmax_at(a, base + idx, nr);
        }
      }
    }
    if (phase == kS2D2Draft || reuse) {  // S2D2Run.draft
      if (!reuse) {
        for (std::int64_t t = 0; t < bs; ++t) choice[t] = cfg.shifted ? (t == 0 ? row[R::kCarry] : a[t - 1]) : a[t];
      }
      nxt = draft_row(cfg, row, choice, stale, counters);
    }
    // S2D2Run.append_kv: a pending block (the rows in front) and / or a finished verified block
    const bool appended = keeps && (pending || spec_final);
    std::int64_t* kb = keep + b * 2 * bs;
    for (std::int64_t t = 0; t < bs; ++t) {
      const std::int64_t fin = !keeps || !spec_final ? -1 : chain_final ? lead + t : row.row_of(n, t);
      kb[t] = keeps && pending ? t : fin;
      kb[bs + t] = keeps && pending ? fin : -1;
    }
    res.append = res.append || appended;
    res.two_blocks = res.two_blocks || lead > 0;
    row[R::kPending] = 0;
    row[R::kBounded] = bounded;
    const bool complete = nxt == kS2D2Commit && !spec_final;
    row[R::kChainFinal] = chain_final;
    row[R::kSpecFinal] = spec_final;
    row[R::kComplete] = complete;
    row[R::kFinishing] = complete || spec_final;
    res.finishing = res.finishing || complete || spec_final;
    row[R::kPhase] = nxt;
  }
  return res;
}

bool s2d2_open(const S2D2Config& cfg, const S2D2Plan& plan, std::int64_t* state, const std::uint8_t* done,
               const std::int64_t* argmax, std::int64_t* counters) {
  const S2D2Record f{cfg.bs};
  const std::int64_t rec = f.width(), bs = cfg.bs, nr = plan.logit_rows;
  bool again = false;
  std::int64_t choice[kS2D2MaxBlock];
  for (std::int64_t b = 0; b < cfg.rows; ++b) {  // S2D2Run.finish_blocks
    const Row row{state + b * rec, f};
    if (!row[R::kFinishing]) continue;
    const bool complete = row[R::kComplete], ended = done[b];
    if (complete) std::copy(row.tokens(), row.tokens() + bs, row.prev());
    row[R::kPending] = complete && !ended;
    row[R::kBlockStart] += bs;
    fresh_block(cfg, row);
    row[R::kPhase] = ended ? kS2D2Done : kS2D2Draft;
    row[R::kFinishing] = 0;
    row[R::kComplete] = 0;
    const bool ahead = cfg.redraft && !ended && row[R::kSpecFinal] && row[R::kHasNext];
    const bool bounded = cfg.boundary && !ended && row[R::kBounded];
    row[R::kSpecFinal] = 0;
    row[R::kBounded] = 0;
    if (!ahead && !bounded) continue;
    // the next block's first drafting step rode along (S2D2Run.step): after every draft
    // passed, or (proposals, not yet seeing the drawn token) the boundary state's
    counters[ahead ? S2D2Counters::kAhead : S2D2Counters::kBoundary] += 1;
    const std::int64_t* a = argmax + b * nr;
    const std::int64_t from = bs + 1 + row[R::kLogitBlocks] + (bounded ? bs : 0);
    for (std::int64_t t = 0; t < bs; ++t) choice[t] = argmax_at(a, from + t, nr);
    row[R::kPhase] = draft_row(cfg, row, choice, bounded, counters);
    if (row[R::kPhase] == kS2D2Commit) {
      row[R::kFinishing] = row[R::kComplete] = 1;
      again = true;
    }
  }
  return again;
}

}  // namespace dspec
