// S2D2's host-side step on the CPU (dspec/decode/s2d2.py, greedy, policy "always"): two calls
// around the model forward and one after the finished blocks are output replace the several
// hundred small torch ops of a step -- lay out every row's suffix (drafting block,
// verification chain with its 2L copies and redraft blocks, pending block), then take the
// argmax of every logit row once and run every row's transition (acceptance, the redraft
// block of the outcome, the next drafts), then open the blocks that finished.  The torch
// composition in s2d2.S2D2Run stays the reference (tested equal, step by step) and the path
// for sampling, the other policies and other devices.
//
// Each row's state is one int64 record (S2D2Record): scalars, then [bs] arrays, then
// [bs + 1] arrays per redraft block.  Rows are independent; every array is contiguous.
#pragma once

#include <cstdint>

namespace dspec {

enum S2D2Phase : std::int64_t { kS2D2Draft = 0, kS2D2Verify = 1, kS2D2Commit = 2, kS2D2Done = 3 };

// Field offsets of a row's record for block size bs.
struct S2D2Record {
  enum Scalar : std::int64_t {
    kPhase,
    kSpanStart,
    kSpanLen,
    kExactFirst,
    kPending,
    kBlockStart,
    kCarry,
    kPromptLen,
    kTailStart,
    // the step's layout and outcome (written by s2d2_plan / s2d2_advance)
    kHasNext,
    kOffset,
    kRedraftRows,
    kLogitBlocks,
    kChainFinal,
    kSpecFinal,
    kFinishing,
    kComplete,
    kHasBoundary,
    kBounded,
    kScalars
  };
  std::int64_t bs;
  std::int64_t tokens() const { return kScalars; }                 // [bs] the block
  std::int64_t masked() const { return kScalars + bs; }            // [bs] 0 / 1
  std::int64_t drafts() const { return kScalars + 2 * bs; }        // [bs] span drafts, left-aligned
  std::int64_t prev() const { return kScalars + 3 * bs; }          // [bs] the pending block's tokens
  std::int64_t tail() const { return kScalars + 4 * bs; }          // [bs] the prompt's block at kTailStart
  std::int64_t used() const { return kScalars + 5 * bs; }          // [bs + 1] redraft block r forwarded
  std::int64_t first() const { return used() + bs + 1; }           // [bs + 1] its first own slot
  std::int64_t starts() const { return first() + bs + 1; }         // [bs + 1] its suffix offset after kOffset
  std::int64_t logit_starts() const { return starts() + bs + 1; }  // [bs + 1] its first drafting logit row
  std::int64_t width() const { return logit_starts() + bs + 1; }
};

struct S2D2Config {
  std::int64_t rows = 0, bs = 0, draft_len = 0, mask_id = 0;
  // boundary: with redraft blocks on a right-shifted model whose clean rows attend causally,
  // the next block's state also rides behind redraft block L - 1 when the span ends the block
  // (drafts for a rejected last draft, verified behind the pending block: s2d2.py)
  bool shifted = false, share_prefix = false, redraft = false, boundary = false;
  int num_threads = 1;  // at most this many threads (the caller's count)
};

// Largest suffix (tokens per row) and logit rows per row a step may need: a pending block,
// the chain, its 2L copies or the boundary state, the redraft blocks and the next block.
constexpr std::int64_t s2d2_max_width(std::int64_t bs) { return bs * bs + 5 * bs + 1; }
constexpr std::int64_t kS2D2MaxBlock = 30;  // the step's scratch lives on the stack
constexpr std::int64_t kS2D2MaxWidth = s2d2_max_width(kS2D2MaxBlock);
constexpr std::int64_t s2d2_max_logit_rows(std::int64_t bs) { return bs * bs + 4 * bs + 1; }

struct S2D2Plan {
  std::int64_t width = 0;       // suffix tokens per row (0: every row is done)
  std::int64_t logit_rows = 0;  // logit rows per row (plain: bs)
  bool plain = false;           // every row drafts its block alone: the shared block mask, all rows' logits
  bool any_draft = false, any_verify = false, any_pending = false;
};

// Lay out every row's suffix: suffix tokens [rows, width], positions [rows, width], mask
// words [rows, width, mask_words(width)] and the logit rows [rows, logit_rows] (each written
// compactly at the start of its buffer; nothing written when plain).
S2D2Plan s2d2_plan(const S2D2Config& cfg, std::int64_t* state, std::int64_t* suffix, std::int64_t* positions,
                   std::int32_t* words, std::int64_t* logit_rows);

struct S2D2Counters {  // int64 [10 + draft_len + 1], accumulated
  // verifications, tokens they committed, accepted drafts, verified drafts, redraft blocks
  // reused, blocks committed from a verification, next blocks drafted along (every draft
  // passed / the last one rejected: the boundary state), routing decisions, verify
  // decisions; then the accepted-drafts histogram
  enum : std::int64_t {
    kVerifications,
    kCommitted,
    kAccepted,
    kDrafted,
    kReused,
    kSpecFinal,
    kAhead,
    kBoundary,
    kDecisions,
    kVerifyDecisions,
    kHist
  };
};

struct S2D2Advance {
  std::int64_t committed = 0;  // tokens the verifications committed
  bool append = false;         // some row's block KV is in this forward (keep [rows, 2 * bs])
  bool two_blocks = false;     // keep's second half is in use (a verifying row has a pending block)
  bool finishing = false;      // some row finished its block (kFinishing)
};

// The transition after the forward: argmax of every logit row (argmax [rows, logit_rows],
// written), then each row's acceptance, drafts and phase; keep [rows, 2 * bs]: the suffix rows
// of the block KV to append, in order (-1: none; two blocks where a verifying row's pending
// block rides in front of a block its drafts finish).
S2D2Advance s2d2_advance(const S2D2Config& cfg, const S2D2Plan& plan, std::int64_t* state, const void* logits,
                         int dtype, std::int64_t row_stride, std::int64_t vocab, std::int64_t* argmax,
                         std::int64_t* keep, std::int64_t* counters);

// Open the next block of each finishing row (done [rows] bytes: the request ended with it),
// and draft a next block that rode along; true when a row finished a block again.
bool s2d2_open(const S2D2Config& cfg, const S2D2Plan& plan, std::int64_t* state, const std::uint8_t* done,
               const std::int64_t* argmax, std::int64_t* counters);

}  // namespace dspec
