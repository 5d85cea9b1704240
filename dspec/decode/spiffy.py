"""Method ``spiffy``: lossless speculative decoding with a calibrated draft graph (Spiffy).

Equal to ``diffusion`` with one token per step (greedy: the same tokens; sampling: the same
distribution).  At a state S whose logits are known (from the previous forward):

- draft blocks are indexed by (position rank i, vocabulary rank j) at S: the masked slot of
  confidence rank i set to its j-th candidate token (j = 0 S's choice, then the next most
  likely); the draft graph (:mod:`dspec.decode.spiffy_graph`, calibrated offline on
  one-token-per-step trajectories and loaded at run time) says which sets of such steps to
  draft, rooted at S + (0, 0), S's exact step;
- online pruning keeps ``prune_to`` draft nodes per request and round: the best by the
  geometric mean of their steps' candidate probabilities at S, made monotone along paths
  (a node never scores above its best parent), so the kept graph stays connected;
- one forward verifies all kept nodes: each is one copy of the block, bidirectional within
  itself and blind to the others, all sharing the cached prefix (the
  :func:`dspec.masks.spiffy_draft_graph` shape with every draft standing in for the current
  block; the next block's first state rides along, attached to the most likely node that
  completes the block, which merges the reference's commit forward into verification);
- verification walks the graph: at an accepted node (its logits computed in this forward)
  the reference's real step is computed (argmax, or a fresh draw of the shared sampler)
  and the child adding exactly that step -- whichever parent path led there: nodes may have
  several parents -- is accepted; the walk stops where no kept child matches, and that
  node's logits are the next round's S (its step the next root).

Stats as ``ssd``; ``mean_accepted``: denoising steps committed per verification round of a
request (>= 1).
"""

from __future__ import annotations

from pathlib import Path

from . import spiffy_graph as graphs
from .bounds import MAX_GRAPH_NODES, check_max, check_rows
from .cpu_cost import cpu_block_copies
from .selfspec import DraftGraph, check_common, decode_self_speculative

OPTIONS = ("block_size", "graph_size", "prune_to", "graph")
DRAFTER = False
DEFAULT_GRAPH_SIZE = 16
DEFAULT_PRUNE_TO = 8


def paper_options(model, given: dict) -> dict:
    """``preset="paper"``: the draft graph's settings off the CPU -- ``graph_size`` 16 nodes
    (or the one given) of which ``min(8, graph_size)`` are verified a round -- free of the
    CPU's row budget (with a ``graph`` and no ``graph_size``, ``prune_to`` stays the default)."""
    if given.get("graph") is not None and given.get("graph_size") is None:
        return {}
    size = given.get("graph_size") or DEFAULT_GRAPH_SIZE
    return {"prune_to": min(DEFAULT_PRUNE_TO, size) if isinstance(size, int) else DEFAULT_PRUNE_TO}


def decode(
    model,
    prompts,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator=None,
    eos_ids=(),
    progress=None,
    block_size: int | None = None,
    graph_size: int | None = None,
    prune_to: int | None = None,
    graph=None,
):
    """Spiffy decoding of a ragged batch; returns (tokens per request, stats).

    Parameters
    ----------
    model : a block-causal masked-diffusion ``Model`` (SDAR, Fast-dLLM v2).
    prompts, max_new_tokens, temperature, generator, eos_ids, progress : as ``diffusion``.
    block_size : int >= 1, default the model's.
    graph_size : D in [1, ``MAX_GRAPH_NODES``], draft nodes of the calibrated graph (default
        16); selects the shipped / cached graph, or calibrates one on first use.
    prune_to : D* in [1, D], draft nodes verified per request and round (default
        min(8, D); on the CPU at most what keeps a round -- the root, the drafts and the
        next block's first state -- within 32 rows for one request decoded greedily, else 16
        per request, and 12 on AVX2 tiles (:func:`dspec.decode.cpu_cost.cpu_block_copies` -
        2: at block size 4 6 and 2 on the AMX / AVX-512 tiles).
    graph : a :class:`~dspec.decode.spiffy_graph.SpiffyGraph`, a ``DraftGraph`` or a path to
        a graph JSON file, instead of the default graph (then graph_size defaults to its
        size).

    Bounds (:mod:`dspec.decode.bounds`, checked before a graph is calibrated or a round's
    buffers are made): a round's buffers hold every graph node and the next block as block
    copies, so the longest prompt + ``(D + 2) * block_size`` must fit
    ``max_position_embeddings`` (and ``3 * block_size`` for the block size alone: the root,
    one draft, the next block); D is at most ``MAX_GRAPH_NODES``.

    Returns
    -------
    tokens : B lists of generated ids.
    stats : ``nfe``, ``mean_accepted``, ``accepted_hist``, ``drafts``, ``accepted_drafts``,
        ``rounds``, ``suffix_tokens`` (as ``ssd``), ``block_size``, ``graph_size``,
        ``prune_to``.
    """
    bs = check_common(model, "spiffy", block_size)
    if graph_size is not None and (isinstance(graph_size, bool) or not isinstance(graph_size, int) or graph_size < 1):
        raise ValueError(f"graph_size must be an int >= 1, got {graph_size!r}")
    check_max("graph_size", graph_size, MAX_GRAPH_NODES, "MAX_GRAPH_NODES")
    check_rows(model, prompts, "block_size", bs, 3 * bs, "3 * block_size")
    if graph is None:
        d = graph_size if graph_size is not None else DEFAULT_GRAPH_SIZE
        check_rows(
            model,
            prompts,
            "graph_size" if graph_size is not None else "block_size",
            d if graph_size is not None else bs,
            (d + 2) * bs,
            f"(graph_size + 2) * block_size with graph_size = {d}",
        )
        draft_graph = graphs.default_graph(model, bs, d, progress=progress is not None).graph
    else:
        if isinstance(graph, (str, Path)):
            graph = graphs.load(graph)
        if isinstance(graph, graphs.SpiffyGraph):
            draft_graph = graph.graph
        elif isinstance(graph, DraftGraph):
            draft_graph = graph
        else:
            raise ValueError(f"graph must be a SpiffyGraph, a DraftGraph or a path, got {type(graph).__name__}")
        d = draft_graph.num_nodes - 1
        if graph_size is not None and graph_size != d:
            raise ValueError(f"graph_size={graph_size} does not match the given graph's {d} draft nodes")
        check_max("graph (its draft nodes)", d, MAX_GRAPH_NODES, "MAX_GRAPH_NODES")
        check_rows(
            model,
            prompts,
            "graph",
            f"a graph of {d} draft nodes",
            (d + 2) * bs,
            f"(draft nodes + 2) * block_size with {d} draft nodes",
        )
    if prune_to is None:
        prune_to = min(DEFAULT_PRUNE_TO, max(d, 1))
        copies = cpu_block_copies(model, bs, len(prompts), temperature)  # + the root and the next block
        prune_to = min(prune_to, copies - 2) if copies is not None else prune_to
    if isinstance(prune_to, bool) or not isinstance(prune_to, int) or not 1 <= prune_to <= max(d, 1):
        raise ValueError(f"prune_to must be an int in [1, graph_size = {d}], got {prune_to!r}")
    tokens, stats = decode_self_speculative(
        model,
        prompts,
        graph=draft_graph,
        prune_to=prune_to,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=generator,
        eos_ids=eos_ids,
        progress=progress,
        block_size=bs,
    )
    stats.update(graph_size=draft_graph.num_nodes - 1, prune_to=prune_to)
    return tokens, stats
