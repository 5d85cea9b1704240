// pybind11 registrations of the self-speculative engine's round (selfspec.h).  Tensors cross
// as integer addresses; every argument -- the graph tables' values, the workspace's size and
// the order of the three calls included -- is checked before anything is written, and a bad
// one raises ValueError naming it.
#include "selfspec_bindings.h"

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "checks.h"
#include "masks.h"
#include "selfspec.h"

namespace py = pybind11;

namespace dspec {
namespace {

// The packed graph buffer (selfspec.h), its values checked.
SelfSpecGraph unpack_graph(const Checker& c, std::int64_t graph_ptr, std::int64_t nodes, std::int64_t max_rank,
                           std::int64_t cands, std::int64_t depth, std::int64_t num_parents) {
  c.at_least(nodes, 1, "nodes");
  c.at_least(max_rank, 1, "max_rank");
  c.at_least(cands, 1, "graph_cands");
  c.at_least(depth, 0, "depth");
  c.at_least(num_parents, 0, "num_parents");
  if (nodes > (1 << 20) || max_rank > (1 << 20) || cands > (1 << 20)) c.fail("graph tables too large");
  c.product(nodes * max_rank, cands, "nodes * max_rank * graph_cands");
  c.ptr(graph_ptr, "graph_ptr", 8);
  const std::int64_t* p = as_ptr<const std::int64_t>(graph_ptr);
  SelfSpecGraph g;
  g.nodes = nodes;
  g.max_rank = max_rank;
  g.cands = cands;
  g.depth = depth;
  g.assign = p;
  g.size = g.assign + nodes * max_rank;
  g.top_rank = g.size + nodes;
  g.next_node = g.top_rank + nodes;
  g.parent_ptr = g.next_node + nodes * max_rank * cands;
  g.parent_idx = g.parent_ptr + nodes + 1;
  for (std::int64_t e = 0; e < nodes * max_rank; ++e) {
    if (g.assign[e] < -1 || g.assign[e] >= cands) c.fail("graph assign holds " + std::to_string(g.assign[e]));
  }
  for (std::int64_t n = 0; n < nodes; ++n) {
    if (g.size[n] < 1 || g.size[n] > max_rank) c.fail("graph size holds " + std::to_string(g.size[n]));
    if (g.top_rank[n] < 0 || g.top_rank[n] >= max_rank) c.fail("graph top_rank holds " + std::to_string(g.top_rank[n]));
  }
  for (std::int64_t e = 0; e < nodes * max_rank * cands; ++e) {
    if (g.next_node[e] < -1 || g.next_node[e] >= nodes)
      c.fail("graph next_node holds " + std::to_string(g.next_node[e]));
  }
  if (g.parent_ptr[0] != 0 || g.parent_ptr[nodes] != num_parents) c.fail("graph parent_ptr must run 0 .. num_parents");
  for (std::int64_t n = 0; n < nodes; ++n) {
    if (g.parent_ptr[n + 1] < g.parent_ptr[n]) c.fail("graph parent_ptr must be non-decreasing");
    if (n > 0 && g.parent_ptr[n + 1] == g.parent_ptr[n]) c.fail("graph node " + std::to_string(n) + " has no parent");
    for (std::int64_t q = g.parent_ptr[n]; q < g.parent_ptr[n + 1]; ++q) {
      if (g.parent_idx[q] < 0 || g.parent_idx[q] >= n) c.fail("graph parents must come before their children");
    }
  }
  return g;
}

// The workspace's size and the round's call order (header[3]: 1 expanded, 2 scored).
std::int64_t* checked_workspace(const Checker& c, std::int64_t ws_ptr, std::int64_t ws_bytes, std::int64_t rows,
                                std::int64_t bs, std::int64_t nodes, std::int64_t big_j) {
  const SelfSpecLayout l = selfspec_layout(rows, bs, nodes, big_j);
  if (ws_bytes < l.bytes) {
    c.fail("workspace_bytes must be >= selfspec_workspace_bytes(...) = " + std::to_string(l.bytes) + ", got " +
           std::to_string(ws_bytes));
  }
  c.ptr(ws_ptr, "workspace_ptr", 8);
  return reinterpret_cast<std::int64_t*>(as_ptr<std::uint8_t>(ws_ptr) + l.header);
}

void check_shape(const Checker& c, std::int64_t rows, std::int64_t bs, std::int64_t big_j, std::int64_t graph_cands) {
  c.at_least(rows, 1, "rows");
  c.at_least(bs, 1, "block_size");
  c.at_least(big_j, graph_cands, "big_j (the graph's candidates at least)");
  if (rows > (1 << 24) || bs > (1 << 20) || big_j > (1 << 10)) c.fail("rows, block_size or big_j too large");
}

std::int64_t workspace_bytes(std::int64_t rows, std::int64_t bs, std::int64_t nodes, std::int64_t big_j) {
  const Checker c{"selfspec_workspace_bytes"};
  c.at_least(rows, 0, "rows");
  c.at_least(bs, 0, "block_size");
  c.at_least(nodes, 0, "nodes");
  c.at_least(big_j, 0, "big_j");
  if (rows > (1 << 24) || bs > (1 << 20) || nodes > (1 << 20) || big_j > (1 << 10)) c.fail("arguments too large");
  return selfspec_layout(rows, bs, nodes, big_j).bytes;
}

SelfSpecState state_of(const Checker& c, std::int64_t conf, std::int64_t masked, std::int64_t known,
                       std::int64_t tokens, std::int64_t cand, std::int64_t cand_logp) {
  c.ptr(conf, "conf_ptr", 4);
  c.ptr(masked, "masked_ptr", 1);
  c.ptr(known, "known_ptr", 1);
  c.ptr(tokens, "tokens_ptr", 8);
  c.ptr(cand, "cand_ptr", 8);
  c.ptr(cand_logp, "cand_logp_ptr", 4);
  SelfSpecState s;
  s.conf = as_ptr<const float>(conf);
  s.masked = as_ptr<const std::uint8_t>(masked);
  s.known = as_ptr<const std::uint8_t>(known);
  s.tokens = as_ptr<const std::int64_t>(tokens);
  s.cand = as_ptr<const std::int64_t>(cand);
  s.cand_logp = as_ptr<const float>(cand_logp);
  return s;
}

py::tuple expand(std::int64_t graph_ptr, std::int64_t nodes, std::int64_t max_rank, std::int64_t graph_cands,
                 std::int64_t depth, std::int64_t num_parents, std::int64_t conf_ptr, std::int64_t masked_ptr,
                 std::int64_t known_ptr, std::int64_t tokens_ptr, std::int64_t cand_ptr, std::int64_t cand_logp_ptr,
                 std::int64_t lengths_ptr, std::int64_t rows, std::int64_t block_size, std::int64_t big_j,
                 std::int64_t prune_to, std::int64_t mask_id, std::int64_t workspace_ptr, std::int64_t workspace_bytes_,
                 std::int64_t suffix_ptr, std::int64_t positions_ptr, std::int64_t words_ptr) {
  const Checker c{"selfspec_expand"};
  SelfSpecExpandArgs a;
  a.graph = unpack_graph(c, graph_ptr, nodes, max_rank, graph_cands, depth, num_parents);
  check_shape(c, rows, block_size, big_j, graph_cands);
  c.at_least(prune_to, -1, "prune_to");
  c.at_least(mask_id, 0, "mask_id");
  checked_workspace(c, workspace_ptr, workspace_bytes_, rows, block_size, nodes, big_j);
  a.state = state_of(c, conf_ptr, masked_ptr, known_ptr, tokens_ptr, cand_ptr, cand_logp_ptr);
  c.ptr(lengths_ptr, "lengths_ptr", 8);
  c.ptr(suffix_ptr, "suffix_ptr", 8);
  c.ptr(positions_ptr, "positions_ptr", 8);
  c.ptr(words_ptr, "words_ptr", 4);
  for (std::int64_t e = 0; e < rows * block_size; ++e) {
    if (std::isnan(a.state.conf[e])) c.fail("conf holds NaN at flat index " + std::to_string(e));
  }
  a.rows = rows;
  a.block_size = block_size;
  a.big_j = big_j;
  a.ranks_used = std::min(max_rank, block_size);
  a.prune_to = prune_to;
  a.mask_id = mask_id;
  a.lengths = as_ptr<const std::int64_t>(lengths_ptr);
  a.workspace = as_ptr<std::uint8_t>(workspace_ptr);
  a.suffix = as_ptr<std::int64_t>(suffix_ptr);
  a.positions = as_ptr<std::int64_t>(positions_ptr);
  a.words = as_ptr<std::int32_t>(words_ptr);
  SelfSpecCopies out;
  {
    py::gil_scoped_release release;
    out = selfspec_expand_cpu(a);
  }
  return py::make_tuple(out.copies, out.need_next);
}

// The round's shape as selfspec_expand wrote it in the workspace's header: a later call with
// another shape would read the workspace's arrays at other offsets.
void check_round(const Checker& c, const std::int64_t* header, std::int64_t rows, std::int64_t copies, bool need_next,
                 std::int64_t phase, const char* before, std::int64_t nodes, std::int64_t big_j,
                 std::int64_t block_size) {
  if (header[3] != phase) c.fail(std::string("must follow ") + before + " on this workspace");
  if (header[0] != rows || header[1] != copies || (header[2] != 0) != need_next) {
    c.fail("rows / copies / need_next must be selfspec_expand's (" + std::to_string(header[0]) + ", " +
           std::to_string(header[1]) + ", " + std::to_string(header[2]) + ")");
  }
  if (header[4] != nodes || header[5] != big_j || header[6] != block_size) {
    c.fail("nodes / big_j / block_size must be selfspec_expand's (" + std::to_string(header[4]) + ", " +
           std::to_string(header[5]) + ", " + std::to_string(header[6]) + ")");
  }
}

void check_logits(const Checker& c, std::int64_t logits_ptr, int dtype, std::int64_t rows, std::int64_t vocab,
                  std::int64_t row_stride) {
  c.float_dtype(dtype, "dtype");
  c.vocab(vocab);
  c.rows_stride(rows, vocab, row_stride, "vocab");
  c.ptr(logits_ptr, "logits_ptr", element_size(dtype));
}

void score(std::int64_t workspace_ptr, std::int64_t workspace_bytes_, std::int64_t rows, std::int64_t block_size,
           std::int64_t nodes, std::int64_t big_j, std::int64_t copies, bool need_next, std::int64_t logits_ptr,
           int dtype, std::int64_t row_stride, std::int64_t vocab, std::int64_t carry_ptr, bool shifted,
           std::int64_t logp_ptr, int num_threads) {
  const Checker c{"selfspec_score"};
  check_shape(c, rows, block_size, big_j, 1);
  c.at_least(nodes, 1, "nodes");
  c.at_least(copies, 1, "copies");
  if (copies > nodes) c.fail("copies must be <= nodes");
  const std::int64_t* header = checked_workspace(c, workspace_ptr, workspace_bytes_, rows, block_size, nodes, big_j);
  check_round(c, header, rows, copies, need_next, 1, "selfspec_expand", nodes, big_j, block_size);
  const std::int64_t seg = copies + (need_next ? 1 : 0);
  check_logits(c, logits_ptr, dtype, rows * seg * block_size, vocab, row_stride);
  c.ptr(carry_ptr, "carry_ptr", 4);
  c.ptr(logp_ptr, "logp_ptr", 4);
  SelfSpecScoreArgs a;
  a.rows = rows;
  a.block_size = block_size;
  a.nodes = nodes;
  a.big_j = big_j;
  a.copies = copies;
  a.vocab = vocab;
  a.need_next = need_next;
  a.shifted = shifted;
  a.logits = as_ptr<const void>(logits_ptr);
  a.dtype = dtype;
  a.row_stride = row_stride;
  a.carry = as_ptr<const float>(carry_ptr);
  a.workspace = as_ptr<std::uint8_t>(workspace_ptr);
  a.logp = as_ptr<float>(logp_ptr);
  a.num_threads = caller_threads(num_threads);
  py::gil_scoped_release release;
  selfspec_score_cpu(a);
}

bool advance(std::int64_t graph_ptr, std::int64_t nodes, std::int64_t max_rank, std::int64_t graph_cands,
             std::int64_t depth, std::int64_t num_parents, std::int64_t conf_ptr, std::int64_t masked_ptr,
             std::int64_t known_ptr, std::int64_t tokens_ptr, std::int64_t cand_ptr, std::int64_t cand_logp_ptr,
             std::int64_t rows, std::int64_t block_size, std::int64_t big_j, std::int64_t copies, bool need_next,
             std::int64_t mask_id, std::int64_t round_conf_ptr, std::int64_t logits_ptr, int dtype,
             std::int64_t row_stride, std::int64_t vocab, std::int64_t carry_ptr, std::int64_t workspace_ptr,
             std::int64_t workspace_bytes_, std::int64_t new_conf_ptr, std::int64_t new_masked_ptr,
             std::int64_t new_known_ptr, std::int64_t new_tokens_ptr, std::int64_t new_choice_ptr,
             std::int64_t new_cand_ptr, std::int64_t new_cand_logp_ptr, std::int64_t host_ptr, std::int64_t keep_ptr) {
  const Checker c{"selfspec_advance"};
  SelfSpecAdvanceArgs a;
  a.graph = unpack_graph(c, graph_ptr, nodes, max_rank, graph_cands, depth, num_parents);
  check_shape(c, rows, block_size, big_j, graph_cands);
  std::int64_t* header = checked_workspace(c, workspace_ptr, workspace_bytes_, rows, block_size, nodes, big_j);
  check_round(c, header, rows, copies, need_next, 2, "selfspec_score", nodes, big_j, block_size);
  a.state = state_of(c, conf_ptr, masked_ptr, known_ptr, tokens_ptr, cand_ptr, cand_logp_ptr);
  const std::int64_t seg = copies + (need_next ? 1 : 0);
  check_logits(c, logits_ptr, dtype, rows * seg * block_size, vocab, row_stride);
  c.ptr(round_conf_ptr, "round_conf_ptr", 4);
  c.ptr(carry_ptr, "carry_ptr", 4);
  c.ptr(new_conf_ptr, "new_conf_ptr", 4);
  c.ptr(new_masked_ptr, "new_masked_ptr", 1);
  c.ptr(new_known_ptr, "new_known_ptr", 1);
  c.ptr(new_tokens_ptr, "new_tokens_ptr", 8);
  c.ptr(new_choice_ptr, "new_choice_ptr", 8);
  c.ptr(new_cand_ptr, "new_cand_ptr", 8);
  c.ptr(new_cand_logp_ptr, "new_cand_logp_ptr", 4);
  c.ptr(host_ptr, "host_ptr", 8);
  c.ptr(keep_ptr, "keep_ptr", 8);
  if (new_conf_ptr == conf_ptr || new_tokens_ptr == tokens_ptr || new_cand_ptr == cand_ptr ||
      new_masked_ptr == masked_ptr || new_known_ptr == known_ptr || new_cand_logp_ptr == cand_logp_ptr) {
    c.fail("the new state must not alias the round's state");
  }
  a.rows = rows;
  a.block_size = block_size;
  a.big_j = big_j;
  a.copies = copies;
  a.need_next = need_next;
  a.vocab = vocab;
  a.mask_id = mask_id;
  a.conf = as_ptr<const float>(round_conf_ptr);
  a.logits = as_ptr<const void>(logits_ptr);
  a.dtype = dtype;
  a.row_stride = row_stride;
  a.carry = as_ptr<float>(carry_ptr);
  a.workspace = as_ptr<std::uint8_t>(workspace_ptr);
  a.new_conf = as_ptr<float>(new_conf_ptr);
  a.new_masked = as_ptr<std::uint8_t>(new_masked_ptr);
  a.new_known = as_ptr<std::uint8_t>(new_known_ptr);
  a.new_tokens = as_ptr<std::int64_t>(new_tokens_ptr);
  a.new_choice = as_ptr<std::int64_t>(new_choice_ptr);
  a.new_cand = as_ptr<std::int64_t>(new_cand_ptr);
  a.new_cand_logp = as_ptr<float>(new_cand_logp_ptr);
  a.host = as_ptr<std::int64_t>(host_ptr);
  a.keep = as_ptr<std::int64_t>(keep_ptr);
  py::gil_scoped_release release;
  return selfspec_advance_cpu(a);
}

}  // namespace

void register_selfspec(py::module_& m) {
  m.def("selfspec_workspace_bytes", &workspace_bytes, py::arg("rows"), py::arg("block_size"), py::arg("nodes"),
        py::arg("big_j"),
        "Bytes of the workspace the self-speculative round needs (rows x block_size slots, nodes graph nodes, "
        "big_j candidates per slot).");
  m.def("selfspec_expand", &expand, py::arg("graph_ptr"), py::arg("nodes"), py::arg("max_rank"), py::arg("graph_cands"),
        py::arg("depth"), py::arg("num_parents"), py::arg("conf_ptr"), py::arg("masked_ptr"), py::arg("known_ptr"),
        py::arg("tokens_ptr"), py::arg("cand_ptr"), py::arg("cand_logp_ptr"), py::arg("lengths_ptr"), py::arg("rows"),
        py::arg("block_size"), py::arg("big_j"), py::arg("prune_to"), py::arg("mask_id"), py::arg("workspace_ptr"),
        py::arg("workspace_bytes"), py::arg("suffix_ptr"), py::arg("positions_ptr"), py::arg("words_ptr"),
        R"doc(Expand the draft graph at every row's state and lay out the copies to forward (CPU).

graph_ptr: the packed int64 tables (selfspec.h: assign [M, I], size [M], top_rank [M],
next_node [M, I, J], parent_ptr [M + 1], parent_idx [P]).  State, rows x block_size: conf
float32 (-1 where not masked), masked / known bool, tokens int64, cand int64 / cand_logp
float32 [rows, block_size, big_j]; lengths int64 [rows].  prune_to: non-root nodes kept per
row (-1: all).  Writes the workspace and, for S = copies + need_next segments of
block_size, suffix / positions int64 [rows, S block_size] and mask words int32
[rows, S block_size, ceil(S block_size / 32)] (room for nodes + 1 segments).
Returns (copies, need_next).)doc");
  m.def("selfspec_score", &score, py::arg("workspace_ptr"), py::arg("workspace_bytes"), py::arg("rows"),
        py::arg("block_size"), py::arg("nodes"), py::arg("big_j"), py::arg("copies"), py::arg("need_next"),
        py::arg("logits_ptr"), py::arg("dtype"), py::arg("row_stride"), py::arg("vocab"), py::arg("carry_ptr"),
        py::arg("shifted"), py::arg("logp_ptr"), py::arg("num_threads") = 0,
        R"doc(Score every slot of the forwarded copies, greedy (CPU), after selfspec_expand.

logits: [rows x S x block_size, vocab] of the forward (dtype 0 float32, 1 float16, 2
bfloat16); carry float32 [rows, vocab]; shifted: slot j scored by row j - 1 (slot 0 by the
carry, or for the next block's state by its anchor copy's last row).  Writes logp float32
[rows, S, block_size] (the choice's log-probability where masked, -inf elsewhere) and the
choices and candidates into the workspace.  num_threads: threads at most (0:
dspec.cpu.kernel_threads()).)doc");
  m.def("selfspec_advance", &advance, py::arg("graph_ptr"), py::arg("nodes"), py::arg("max_rank"),
        py::arg("graph_cands"), py::arg("depth"), py::arg("num_parents"), py::arg("conf_ptr"), py::arg("masked_ptr"),
        py::arg("known_ptr"), py::arg("tokens_ptr"), py::arg("cand_ptr"), py::arg("cand_logp_ptr"), py::arg("rows"),
        py::arg("block_size"), py::arg("big_j"), py::arg("copies"), py::arg("need_next"), py::arg("mask_id"),
        py::arg("round_conf_ptr"), py::arg("logits_ptr"), py::arg("dtype"), py::arg("row_stride"), py::arg("vocab"),
        py::arg("carry_ptr"), py::arg("workspace_ptr"), py::arg("workspace_bytes"), py::arg("new_conf_ptr"),
        py::arg("new_masked_ptr"), py::arg("new_known_ptr"), py::arg("new_tokens_ptr"), py::arg("new_choice_ptr"),
        py::arg("new_cand_ptr"), py::arg("new_cand_logp_ptr"), py::arg("host_ptr"), py::arg("keep_ptr"),
        R"doc(Walk the graph along the real steps and advance every row (CPU), after selfspec_score.

round_conf: exp of selfspec_score's logp.  Writes the next state (conf, masked, known,
tokens, choice, cand, cand_logp: new buffers), the carry of rows that commit a block, host
int64 [rows, 2 block_size + 4] (committed, steps, block tokens, nodes kept, last_step,
filled block) and keep int64 [rows, block_size] (the committed copy's rows, or -1).
Returns whether any row committed a block.)doc");
}

}  // namespace dspec
