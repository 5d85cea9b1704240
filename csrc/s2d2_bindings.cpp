// pybind11 registrations of S2D2's step (s2d2.h).  Tensors cross as integer addresses; the
// configuration and every row record's values that index anything are checked before
// anything is written, and a bad one raises ValueError naming it.
#include "s2d2_bindings.h"

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "checks.h"
#include "masks.h"
#include "s2d2.h"

namespace py = pybind11;

namespace dspec {
namespace {

// flags: 1 right-shifted, 2 shared prefix (clean rows attend causally), 4 redraft blocks,
// 8 the boundary state (with all three)
S2D2Config config_of(const Checker& c, std::int64_t rows, std::int64_t bs, std::int64_t draft_len, std::int64_t mask_id,
                     std::int64_t flags) {
  c.at_least(rows, 1, "rows");
  if (rows > (1 << 24)) c.fail("rows must be < 2^24, got " + std::to_string(rows));
  c.at_least(bs, 1, "block_size");
  if (bs > kS2D2MaxBlock)
    c.fail("block_size must be <= " + std::to_string(kS2D2MaxBlock) + ", got " + std::to_string(bs));
  c.at_least(draft_len, 1, "draft_len");
  if (draft_len > bs) c.fail("draft_len must be <= block_size, got " + std::to_string(draft_len));
  c.at_least(mask_id, 0, "mask_id");
  if (flags < 0 || flags > 15) c.fail("flags must be in 0 .. 15, got " + std::to_string(flags));
  if ((flags & 8) && (flags & 7) != 7)
    c.fail("flags 8 (boundary state) needs 1, 2 and 4, got " + std::to_string(flags));
  S2D2Config cfg;
  cfg.rows = rows;
  cfg.bs = bs;
  cfg.draft_len = draft_len;
  cfg.mask_id = mask_id;
  cfg.shifted = flags & 1;
  cfg.share_prefix = flags & 2;
  cfg.redraft = flags & 4;
  cfg.boundary = flags & 8;
  return cfg;
}

// The record fields the step indexes with: phase, span, flags, masked slots.
std::int64_t* checked_state(const Checker& c, const S2D2Config& cfg, std::int64_t state_ptr) {
  c.ptr(state_ptr, "state_ptr", 8);
  std::int64_t* state = as_ptr<std::int64_t>(state_ptr);
  const S2D2Record f{cfg.bs};
  for (std::int64_t b = 0; b < cfg.rows; ++b) {
    const std::int64_t* r = state + b * f.width();
    const std::string at = " at row " + std::to_string(b);
    const std::int64_t phase = r[S2D2Record::kPhase], s = r[S2D2Record::kSpanStart], n = r[S2D2Record::kSpanLen];
    if (phase < kS2D2Draft || phase > kS2D2Done)
      c.fail("state phase must be 0 .. 3, got " + std::to_string(phase) + at);
    if (s < 0 || s >= cfg.bs) c.fail("state span_start must be in [0, block_size), got " + std::to_string(s) + at);
    if (n < 0 || n > cfg.draft_len || s + n > cfg.bs || (phase == kS2D2Verify && n < 1)) {
      c.fail("state span_len must be in [1, min(draft_len, block_size - span_start)] when verifying, got " +
             std::to_string(n) + at);
    }
    for (std::int64_t k : {S2D2Record::kExactFirst, S2D2Record::kPending}) {
      if (r[k] != 0 && r[k] != 1) c.fail("state flags must be 0 or 1, got " + std::to_string(r[k]) + at);
    }
    for (std::int64_t t = 0; t < cfg.bs; ++t) {
      if (r[f.masked() + t] != 0 && r[f.masked() + t] != 1) c.fail("state masked must be 0 or 1" + at);
    }
  }
  return state;
}

py::tuple plan(std::int64_t state_ptr, std::int64_t rows, std::int64_t block_size, std::int64_t draft_len,
               std::int64_t mask_id, std::int64_t flags, std::int64_t suffix_ptr, std::int64_t positions_ptr,
               std::int64_t words_ptr, std::int64_t logit_rows_ptr) {
  const Checker c{"s2d2_plan"};
  const S2D2Config cfg = config_of(c, rows, block_size, draft_len, mask_id, flags);
  std::int64_t* state = checked_state(c, cfg, state_ptr);
  c.ptr(suffix_ptr, "suffix_ptr", 8);
  c.ptr(positions_ptr, "positions_ptr", 8);
  c.ptr(words_ptr, "words_ptr", 4);
  c.ptr(logit_rows_ptr, "logit_rows_ptr", 8);
  const S2D2Plan p = s2d2_plan(cfg, state, as_ptr<std::int64_t>(suffix_ptr), as_ptr<std::int64_t>(positions_ptr),
                               as_ptr<std::int32_t>(words_ptr), as_ptr<std::int64_t>(logit_rows_ptr));
  return py::make_tuple(p.width, p.logit_rows, p.plain, p.any_draft, p.any_verify, p.any_pending);
}

S2D2Plan plan_of(const Checker& c, const S2D2Config& cfg, std::int64_t logit_rows, bool any_verify, bool any_pending) {
  S2D2Plan p;
  p.logit_rows = logit_rows;
  p.any_verify = any_verify;
  p.any_pending = any_pending;
  p.plain = !any_verify && !any_pending;
  const std::int64_t least = p.plain ? cfg.bs : cfg.bs + 1;
  if (logit_rows < least || logit_rows > s2d2_max_logit_rows(cfg.bs)) {
    c.fail("logit_rows must be s2d2_plan's (in [" + std::to_string(least) + ", " +
           std::to_string(s2d2_max_logit_rows(cfg.bs)) + "]), got " + std::to_string(logit_rows));
  }
  return p;
}

py::tuple advance(std::int64_t state_ptr, std::int64_t rows, std::int64_t block_size, std::int64_t draft_len,
                  std::int64_t mask_id, std::int64_t flags, std::int64_t logit_rows, bool any_verify, bool any_pending,
                  std::int64_t logits_ptr, int dtype, std::int64_t row_stride, std::int64_t vocab,
                  std::int64_t argmax_ptr, std::int64_t keep_ptr, std::int64_t counters_ptr, int num_threads) {
  const Checker c{"s2d2_advance"};
  S2D2Config cfg = config_of(c, rows, block_size, draft_len, mask_id, flags);
  cfg.num_threads = caller_threads(num_threads);
  const S2D2Plan p = plan_of(c, cfg, logit_rows, any_verify, any_pending);
  std::int64_t* state = checked_state(c, cfg, state_ptr);
  c.float_dtype(dtype, "dtype");
  c.vocab(vocab);
  c.rows_stride(rows * logit_rows, vocab, row_stride, "vocab");
  c.ptr(logits_ptr, "logits_ptr", element_size(dtype));
  c.ptr(argmax_ptr, "argmax_ptr", 8);
  c.ptr(keep_ptr, "keep_ptr", 8);
  c.ptr(counters_ptr, "counters_ptr", 8);
  const S2D2Advance a = s2d2_advance(cfg, p, state, as_ptr<const void>(logits_ptr), dtype, row_stride, vocab,
                                     as_ptr<std::int64_t>(argmax_ptr), as_ptr<std::int64_t>(keep_ptr),
                                     as_ptr<std::int64_t>(counters_ptr));
  return py::make_tuple(a.committed, a.append, a.finishing, a.two_blocks);
}

bool open(std::int64_t state_ptr, std::int64_t rows, std::int64_t block_size, std::int64_t draft_len,
          std::int64_t mask_id, std::int64_t flags, std::int64_t logit_rows, bool any_verify, bool any_pending,
          std::int64_t done_ptr, std::int64_t argmax_ptr, std::int64_t counters_ptr) {
  const Checker c{"s2d2_open"};
  const S2D2Config cfg = config_of(c, rows, block_size, draft_len, mask_id, flags);
  const S2D2Plan p = plan_of(c, cfg, logit_rows, any_verify, any_pending);
  std::int64_t* state = checked_state(c, cfg, state_ptr);
  c.ptr(done_ptr, "done_ptr", 1);
  c.ptr(argmax_ptr, "argmax_ptr", 8);
  c.ptr(counters_ptr, "counters_ptr", 8);
  return s2d2_open(cfg, p, state, as_ptr<const std::uint8_t>(done_ptr), as_ptr<const std::int64_t>(argmax_ptr),
                   as_ptr<std::int64_t>(counters_ptr));
}

}  // namespace

void register_s2d2(py::module_& m) {
  m.def(
      "s2d2_record_layout",
      [](std::int64_t bs) {
        const Checker c{"s2d2_record_layout"};
        c.at_least(bs, 1, "block_size");
        const S2D2Record f{bs};
        py::dict d;
        const char* scalars[] = {"phase",       "span_start",   "span_len",     "exact_first", "pending",
                                 "block_start", "carry",        "prompt_len",   "tail_start",  "has_next",
                                 "offset",      "redraft_rows", "logit_blocks", "chain_final", "spec_final",
                                 "finishing",   "complete",     "has_boundary", "bounded"};
        static_assert(sizeof(scalars) / sizeof(scalars[0]) == S2D2Record::kScalars, "a name per scalar field");
        for (std::int64_t k = 0; k < S2D2Record::kScalars; ++k) d[scalars[k]] = k;
        d["tokens"] = f.tokens();
        d["masked"] = f.masked();
        d["drafts"] = f.drafts();
        d["prev"] = f.prev();
        d["tail"] = f.tail();
        d["used"] = f.used();
        d["first"] = f.first();
        d["starts"] = f.starts();
        d["logit_starts"] = f.logit_starts();
        d["width"] = f.width();
        return d;
      },
      py::arg("block_size"),
      "Offsets of a row record's fields (s2d2.h S2D2Record): each scalar's, each [bs] / [bs + 1] array's first, "
      "and the record's width.");
  m.def(
      "s2d2_counter_layout",
      []() {
        py::dict d;
        d["verifications"] = static_cast<std::int64_t>(S2D2Counters::kVerifications);
        d["committed"] = static_cast<std::int64_t>(S2D2Counters::kCommitted);
        d["accepted"] = static_cast<std::int64_t>(S2D2Counters::kAccepted);
        d["drafted"] = static_cast<std::int64_t>(S2D2Counters::kDrafted);
        d["reused"] = static_cast<std::int64_t>(S2D2Counters::kReused);
        d["spec_final"] = static_cast<std::int64_t>(S2D2Counters::kSpecFinal);
        d["ahead"] = static_cast<std::int64_t>(S2D2Counters::kAhead);
        d["boundary"] = static_cast<std::int64_t>(S2D2Counters::kBoundary);
        d["decisions"] = static_cast<std::int64_t>(S2D2Counters::kDecisions);
        d["verify_decisions"] = static_cast<std::int64_t>(S2D2Counters::kVerifyDecisions);
        d["hist"] = static_cast<std::int64_t>(S2D2Counters::kHist);
        return d;
      },
      "Indices of the counters s2d2_advance / s2d2_open add to (s2d2.h S2D2Counters); the accepted-drafts "
      "histogram starts at 'hist' (draft_len + 1 entries).");
  m.attr("s2d2_max_block") = py::int_(kS2D2MaxBlock);
  m.def(
      "s2d2_buffer_sizes",
      [](std::int64_t bs) {
        const Checker c{"s2d2_buffer_sizes"};
        c.at_least(bs, 1, "block_size");
        if (bs > kS2D2MaxBlock) c.fail("block_size must be <= " + std::to_string(kS2D2MaxBlock));
        const std::int64_t w = s2d2_max_width(bs);
        return py::make_tuple(w, w * mask_words(w), s2d2_max_logit_rows(bs));
      },
      py::arg("block_size"), "Per row: the most suffix tokens, mask words and logit rows a step writes.");
  m.def("s2d2_plan", &plan, py::arg("state_ptr"), py::arg("rows"), py::arg("block_size"), py::arg("draft_len"),
        py::arg("mask_id"), py::arg("flags"), py::arg("suffix_ptr"), py::arg("positions_ptr"), py::arg("words_ptr"),
        py::arg("logit_rows_ptr"),
        R"doc(Lay out every row's suffix for S2D2's next forward (CPU).

state: int64 [rows, s2d2_record_width(block_size)] row records (s2d2.h), their layout
fields written.  flags: 1 right-shifted, 2 clean rows attend causally, 4 redraft blocks,
8 the boundary state (with 1, 2 and 4).
Writes, compactly at each buffer's start (room: s2d2_buffer_sizes per row), suffix /
positions int64 [rows, width], mask words int32 [rows, width, ceil(width / 32)] and the
logit rows int64 [rows, logit_rows].  Returns (width, logit_rows, plain, any_draft,
any_verify, any_pending): width 0 when every row is done; plain: every row drafts its block
alone (nothing written: the shared block mask and every row's logits).)doc");
  m.def("s2d2_advance", &advance, py::arg("state_ptr"), py::arg("rows"), py::arg("block_size"), py::arg("draft_len"),
        py::arg("mask_id"), py::arg("flags"), py::arg("logit_rows"), py::arg("any_verify"), py::arg("any_pending"),
        py::arg("logits_ptr"), py::arg("dtype"), py::arg("row_stride"), py::arg("vocab"), py::arg("argmax_ptr"),
        py::arg("keep_ptr"), py::arg("counters_ptr"), py::arg("num_threads") = 0,
        R"doc(Every row's transition after the forward (CPU, greedy, policy "always").

logits: [rows x logit_rows, vocab] (dtype 0 float32, 1 float16, 2 bfloat16).  Writes argmax
int64 [rows, logit_rows], keep int64 [rows, 2 * block_size] (suffix rows of the block KV to
append, in order, -1: none), the row records, and adds to counters int64 [hist + draft_len + 1]
(s2d2_counter_layout).
Returns (tokens committed by verifications, append, finishing, two_blocks): two_blocks --
keep's second half is in use.  num_threads: threads at most (0: dspec.cpu.kernel_threads()).)doc");
  m.def("s2d2_open", &open, py::arg("state_ptr"), py::arg("rows"), py::arg("block_size"), py::arg("draft_len"),
        py::arg("mask_id"), py::arg("flags"), py::arg("logit_rows"), py::arg("any_verify"), py::arg("any_pending"),
        py::arg("done_ptr"), py::arg("argmax_ptr"), py::arg("counters_ptr"),
        R"doc(Open the next block of every finishing row after s2d2_advance (CPU).

done: bool [rows], the requests that ended with their finished block.  Drafts a next block
that rode along the forward; returns True when a row finished a block again.)doc");
}

}  // namespace dspec
