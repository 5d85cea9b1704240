// The self-speculative engine's host-side round on the CPU (dspec/decode/selfspec.py, the
// engine of `ssd` and `spiffy`): three calls around the verification forward replace the
// ~200 small torch ops of a round (expand the draft graph at every row's state and lay out
// the copies to forward; score every slot of every copy; walk the graph along the real
// steps and advance each row's state), greedy only.  The torch composition in
// selfspec.SelfSpecEngine stays the reference (tested equal, field by field) and the path for
// sampling, tracing and other devices.
//
// Rows (requests) are independent; the graph tables are shared.  Every array is contiguous,
// row-major; bool arrays are bytes (0 / 1), as torch.bool stores them.
#pragma once

#include <cstdint>

namespace dspec {

// A draft graph's tables (DraftGraph.tables in selfspec.py), packed into one int64 buffer:
// assign [M, I] (candidate rank j of position rank i in the node, or -1), size [M],
// top_rank [M], next_node [M, I, J] (child adding step (i, j), or -1), parent_ptr [M + 1],
// parent_idx [P] (CSR: the parents of node n are parent_idx[parent_ptr[n] .. parent_ptr[n+1])).
struct SelfSpecGraph {
  std::int64_t nodes = 0;     // M (node 0 the root)
  std::int64_t max_rank = 0;  // I
  std::int64_t cands = 0;     // J of the graph (next_node's last dimension)
  std::int64_t depth = 0;     // longest path from the root, in edges
  const std::int64_t* assign = nullptr;
  const std::int64_t* size = nullptr;
  const std::int64_t* top_rank = nullptr;
  const std::int64_t* next_node = nullptr;
  const std::int64_t* parent_ptr = nullptr;
  const std::int64_t* parent_idx = nullptr;
};

// Elements of the packed graph buffer.
inline std::int64_t selfspec_graph_elems(std::int64_t m, std::int64_t i, std::int64_t j, std::int64_t parents) {
  return m * i + 2 * m + m * i * j + (m + 1) + parents;
}

// The per-round scratch the three calls share, carved from one byte workspace.
struct SelfSpecLayout {
  std::int64_t order, rank, node_tokens, node_copy, copy_node, anchor, num_kept, anchor_copy;  // int64
  std::int64_t choice, cand;                                                                   // int64
  std::int64_t logp, cand_logp, score, closed;                                                 // float
  std::int64_t node_masked, kept, complete, has_anchor, copy_masked;                           // bytes
  std::int64_t header;  // int64 [8]: rows, copies, need_next, the call sequence, nodes, big_j, block_size
  std::int64_t bytes;
};

// Byte offsets (8-byte aligned) for rows x block_size slots, M nodes, J candidates per slot.
SelfSpecLayout selfspec_layout(std::int64_t rows, std::int64_t block_size, std::int64_t nodes, std::int64_t big_j);

struct SelfSpecState {                   // a row's state S: the current block and what S's logits gave
  const float* conf = nullptr;           // [A, bs]: choice's confidence, -1 where not masked
  const std::uint8_t* masked = nullptr;  // [A, bs]
  const std::uint8_t* known = nullptr;   // [A]: S's logits are known (else S forwards itself)
  const std::int64_t* tokens = nullptr;  // [A, bs]
  const std::int64_t* cand = nullptr;    // [A, bs, big_j]: candidates per slot (choice first)
  const float* cand_logp = nullptr;      // [A, bs, big_j]
};

struct SelfSpecExpandArgs {
  SelfSpecGraph graph;
  SelfSpecState state;
  std::int64_t rows = 0, block_size = 0, big_j = 0, ranks_used = 0;
  std::int64_t prune_to = -1;  // keep this many non-root nodes per row (-1: every valid node)
  std::int64_t mask_id = 0;
  const std::int64_t* lengths = nullptr;  // [A]: cached tokens per row (the block's first position)
  std::uint8_t* workspace = nullptr;
  // the forward's inputs for S = copies + need_next segments, N = S bs: suffix tokens [A, N],
  // positions [A, N], mask words [A, N, ceil(N / 32)] (room for M + 1 segments each)
  std::int64_t* suffix = nullptr;
  std::int64_t* positions = nullptr;
  std::int32_t* words = nullptr;
};

struct SelfSpecCopies {
  std::int64_t copies;  // kept nodes forwarded per row (the most over the rows)
  bool need_next;       // some row forwards the next block's first state
};

SelfSpecCopies selfspec_expand_cpu(const SelfSpecExpandArgs& args);

struct SelfSpecScoreArgs {
  std::int64_t rows = 0, block_size = 0, nodes = 0, big_j = 0, copies = 0, vocab = 0;
  bool need_next = false, shifted = false;
  const void* logits = nullptr;  // [A * S * bs, vocab] of the forward, row_stride elements apart
  int dtype = 0;
  std::int64_t row_stride = 0;
  const float* carry = nullptr;       // [A, vocab] float32: last logits of each row's committed block
  std::uint8_t* workspace = nullptr;  // expand's (choices and candidates are written into it)
  float* logp = nullptr;              // [A, S, bs]: log-probability of each masked slot's choice (-inf elsewhere)
  int num_threads = 1;                // at most this many threads (the caller's count)
};

void selfspec_score_cpu(const SelfSpecScoreArgs& args);

struct SelfSpecAdvanceArgs {
  SelfSpecGraph graph;
  SelfSpecState state;  // the round's S (its cand is read by the walk)
  std::int64_t rows = 0, block_size = 0, big_j = 0, copies = 0, vocab = 0, mask_id = 0;
  bool need_next = false;
  const float* conf = nullptr;   // [A, S, bs]: exp(logp) of selfspec_score
  const void* logits = nullptr;  // as SelfSpecScoreArgs (the committed copies' last rows)
  int dtype = 0;
  std::int64_t row_stride = 0;
  float* carry = nullptr;  // [A, vocab], updated where a block is committed
  std::uint8_t* workspace = nullptr;
  // the next state (new buffers, not aliasing `state`)
  float* new_conf = nullptr;
  std::uint8_t* new_masked = nullptr;
  std::uint8_t* new_known = nullptr;
  std::int64_t* new_tokens = nullptr;
  std::int64_t* new_choice = nullptr;
  std::int64_t* new_cand = nullptr;
  float* new_cand_logp = nullptr;
  // host rows [A, 2 bs + 4]: committed, steps, block tokens (bs), nodes kept, last_step,
  // filled block (bs); keep [A, bs]: the committed copy's rows to append to the cache, or -1
  std::int64_t* host = nullptr;
  std::int64_t* keep = nullptr;
};

// Returns whether any row committed a block.
bool selfspec_advance_cpu(const SelfSpecAdvanceArgs& args);

}  // namespace dspec
