"""Spiffy draft graphs: offline calibration, JSON files, the per-model cache, shipped graphs.

A Spiffy draft graph (Agrawal et al. 2025, "Spiffy: Multiplying Diffusion LLM Acceleration
via Lossless Speculative Decoding") is a directed graph of *draft states*.  At a state S of
the one-token-per-step reference (the current block with its [MASK] slots, its logits
known), a candidate step ``(i, j)`` sets the masked slot of confidence rank i at S to its
j-th candidate token at S (j = 0: S's own choice, j >= 1: the next most likely tokens).
The root is S + (0, 0) -- S's exact step --; a node is the root plus a set of candidate
steps with distinct i; node b is a child of node a when b adds one step to a.  The same
state can be reached along several paths (steps applied in another order): the graph is a
DAG whose nodes may have several parents.

Calibration replays one-token-per-step greedy trajectories (via the lossless engine, so
exactly ``diffusion``'s) on a prompt set.  For every state S_t of a block and the steps
the reference takes from it, it expresses each later step relative to S_t's ranks,
``(i, j)``, and counts every state (set of steps) visited; the graph keeps the root and the
``graph_size`` most frequent states that stay connected to it (a greedy pick among the
children of the kept states, most frequent first).

Graphs are JSON files (:func:`save` / :func:`load`).  :func:`default_graph` finds one for a
model: a graph shipped in ``dspec/assets/spiffy/`` for a shipped model, else one cached in
``$DSPEC_CACHE_DIR/spiffy/`` (default ``~/.cache/dspec/spiffy/``) under the model's weight
fingerprint, block size and graph size, else it calibrates one (tqdm bar) and caches it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .selfspec import DraftGraph, check_common, decode_self_speculative

FORMAT_VERSION = 1
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "spiffy"


@dataclass(frozen=True)
class SpiffyGraph:
    """A calibrated draft graph and where it comes from.

    graph : the :class:`DraftGraph` (node 0 = root; ``graph.counts`` = visit counts).
    block_size : block size it was calibrated for.
    graph_size : D, draft nodes besides the root (``graph.num_nodes - 1``, may be fewer when
        calibration saw fewer states).
    meta : free-form provenance (model fingerprint, prompts, tokens, ...).
    """

    graph: DraftGraph
    block_size: int
    graph_size: int
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def nodes(self):
        return self.graph.nodes

    def to_json(self) -> dict:
        return {
            "format": "dspec-spiffy-graph",
            "version": FORMAT_VERSION,
            "block_size": self.block_size,
            "graph_size": self.graph_size,
            "nodes": [[list(s) for s in node] for node in self.graph.nodes],
            "counts": list(self.graph.counts) if self.graph.counts is not None else None,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: dict) -> "SpiffyGraph":
        if not isinstance(data, dict) or data.get("format") != "dspec-spiffy-graph":
            raise ValueError("not a dspec Spiffy graph file (format != 'dspec-spiffy-graph')")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"Spiffy graph format version {data.get('version')!r} is not supported (expected {FORMAT_VERSION})"
            )
        try:
            nodes = tuple(tuple((int(s[0]), int(s[1])) for s in node) for node in data["nodes"])
            counts = data.get("counts")
            counts = tuple(int(c) for c in counts) if counts is not None else None
            bs, d = int(data["block_size"]), int(data["graph_size"])
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(f"malformed Spiffy graph file: {e!r}") from None
        return cls(DraftGraph(nodes, counts), bs, d, dict(data.get("meta") or {}))


def save(graph: SpiffyGraph, path) -> Path:
    """Write ``graph`` as JSON to ``path`` (parent folders created); returns the path."""
    if not isinstance(graph, SpiffyGraph):
        raise ValueError(f"graph must be a SpiffyGraph, got {type(graph).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(graph.to_json(), indent=1))
    tmp.replace(path)  # atomic: concurrent readers never see half a file
    return path


def load(path) -> SpiffyGraph:
    """Read a graph written by :func:`save`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no Spiffy graph file at {str(path)!r}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from None
    return SpiffyGraph.from_json(data)


# ------------------------------------------------------------------------------ calibration


def default_prompts(model, n: int = 32, *, seed: int = 7) -> list[list[int]]:
    """Calibration prompts: ``dspec.tasks.arithmetic`` problems (seed apart from training's
    >= 1000) encoded by the model's tokenizer; seeded random ids without a tokenizer."""
    if model.tokenizer is not None:
        from ..tasks import arithmetic

        prompts = [model.tokenizer.encode(p.prompt) for p in arithmetic(n, seed=seed)]
        if all(prompts):
            return prompts
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    banned = {model.mask_token_id, *model.eos_token_ids}
    ids = [t for t in range(vocab) if t not in banned]
    return [[rng.choice(ids) for _ in range(rng.randint(3, 12))] for _ in range(n)]


def calibrate(
    model,
    prompts=None,
    block_size: int | None = None,
    graph_size: int = 16,
    *,
    max_new_tokens: int = 48,
    num_candidates: int = 3,
    max_depth: int | None = None,
    batch_size: int = 16,
    progress: bool = True,
) -> SpiffyGraph:
    """Calibrate a draft graph of ``graph_size`` draft nodes on ``prompts``.

    Parameters
    ----------
    model : a block-causal masked-diffusion ``Model``.
    prompts : list of prompts (token-id lists or strings); default :func:`default_prompts`.
    block_size : default the model's.
    graph_size : D >= 1, draft nodes besides the root.
    max_new_tokens : tokens decoded per prompt (greedy, one token per step).
    num_candidates : J >= 1, candidate ranks j considered (0..J-1).
    max_depth : longest path counted (default: block_size - 1 edges).
    batch_size : prompts decoded per batch.
    progress : tqdm bar over prompts.

    Returns
    -------
    SpiffyGraph whose nodes are the root and the D most frequent states connected to it.
    """
    bs = check_common(model, "spiffy", block_size)
    for name, value, low in (
        ("graph_size", graph_size, 1),
        ("max_new_tokens", max_new_tokens, 1),
        ("num_candidates", num_candidates, 1),
        ("batch_size", batch_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    depth = max_depth if max_depth is not None else max(bs - 1, 1)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
    prompts = default_prompts(model) if prompts is None else prompts
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts")
    ids = []
    for k, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError("string prompts need a model with a tokenizer")
            p = model.tokenizer.encode(p)
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompts[{k}] is empty")
        ids.append(p)

    counts: Counter = Counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc=f"spiffy calibration (block {bs}, D={graph_size})", unit="prompt")
    root_only = DraftGraph((((0, 0),),))
    for lo in range(0, len(ids), batch_size):
        chunk = ids[lo : lo + batch_size]
        states: dict[int, list] = {}

        def trace(ev, states=states):
            for a, b in enumerate(ev["rows"]):
                if ev["known"][a]:
                    states.setdefault(b, []).append((ev["order"][a], ev["cand"][a]))
                if ev["host"][a][0]:  # the block is complete
                    _count_block(states.pop(b, []), counts, num_candidates, depth)

        decode_self_speculative(
            model,
            chunk,
            graph=root_only,
            prune_to=None,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            generator=None,
            eos_ids=(),
            progress=None,
            block_size=bs,
            trace=trace,
            num_candidates=num_candidates,
        )
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    graph = select_graph(counts, graph_size)
    meta = {
        "fingerprint": fingerprint(model),
        "family": model.family,
        "shipped_name": getattr(model, "shipped_name", None),
        "prompts": len(ids),
        "max_new_tokens": max_new_tokens,
        "num_candidates": num_candidates,
        "max_depth": depth,
        "states_counted": int(counts[((0, 0),)]),
    }
    return SpiffyGraph(graph, bs, graph.num_nodes - 1, meta)


def _count_block(states, counts: Counter, num_candidates: int, depth: int) -> None:
    """Count the states visited from every state S_t of one block's trajectory.

    states : per state of the block, in order, (order, cand_by_rank) as the engine traced
    them; the reference's step at S_u is (slot order_u[0], token cand_u[0][0]).
    """
    steps = [(order[0], cand[0][0]) for order, cand in states]
    for t, (order, cand) in enumerate(states):
        rank = {slot: i for i, slot in enumerate(order)}
        node = [(0, 0)]
        counts[((0, 0),)] += 1
        for slot, tok in steps[t + 1 : t + 1 + depth]:
            i = rank[slot]
            row = cand[i][:num_candidates]
            if tok not in row:
                break
            node.append((i, row.index(tok)))
            counts[tuple(sorted(node))] += 1


def select_graph(counts: Counter, graph_size: int) -> DraftGraph:
    """The root and up to ``graph_size`` states connected to it, most frequent first.

    Greedy: repeatedly take the most frequent state (ties: fewer steps, then lexicographic)
    that has a parent among the states taken.  Nodes are returned parents first.
    """
    root = ((0, 0),)
    taken = {root}
    frontier = {}

    def push_children(node):
        for key, c in counts.items():
            if len(key) == len(node) + 1 and set(node) <= set(key) and key not in taken:
                frontier[key] = c

    push_children(root)
    while frontier and len(taken) < graph_size + 1:
        best = min(frontier, key=lambda k: (-frontier[k], len(k), k))
        del frontier[best]
        taken.add(best)
        push_children(best)
    nodes = sorted(taken, key=lambda k: (len(k), -counts.get(k, 0), k))
    return DraftGraph(tuple(nodes), tuple(int(counts.get(k, 0)) for k in nodes))


# ------------------------------------------------------------------------------ finding graphs


def fingerprint(model) -> str:
    """A short hash of the model's configuration and weights (cache key).  Hashing reads
    every weight (~0.2 s for SmolLM2-135M, once per ``generate`` call before), so the hash is
    kept on the model while its parameters are the same tensors, unmodified (their data
    pointers and version counters are part of the check)."""
    state = tuple((name, p.data_ptr(), p._version) for name, p in model.named_parameters())
    kept = model.__dict__.get("_dspec_weights_fingerprint")
    if kept is not None and kept[0] == state:
        return kept[1]
    h = hashlib.sha256(repr(model.config).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(flat[:4096].float().cpu().numpy().tobytes())
            h.update(repr(float(flat.double().sum())).encode())
    digest = h.hexdigest()[:16]
    model.__dict__["_dspec_weights_fingerprint"] = (state, digest)
    return digest


def cache_dir() -> Path:
    """``$DSPEC_CACHE_DIR/spiffy`` (default ``~/.cache/dspec/spiffy``)."""
    root = os.environ.get("DSPEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dspec")
    return Path(root) / "spiffy"


def graph_file_name(key: str, block_size: int, graph_size: int) -> str:
    return f"{key}-bs{block_size}-D{graph_size}.json"


def shipped_graph_path(model, block_size: int, graph_size: int) -> Path | None:
    """The graph shipped for a shipped model (``model.shipped_name``), or None."""
    name = getattr(model, "shipped_name", None)
    if not name:
        return None
    path = ASSETS / graph_file_name(name, block_size, graph_size)
    return path if path.is_file() else None


def default_graph(
    model, block_size: int, graph_size: int = 16, *, progress: bool = True, **calibrate_options
) -> SpiffyGraph:
    """A graph for ``model``: shipped, else cached, else calibrated now (and cached)."""
    key = fingerprint(model)
    shipped = shipped_graph_path(model, block_size, graph_size)
    if shipped is not None:
        graph = load(shipped)
        # a graph calibrated on other weights stays lossless but drafts worse: recalibrate
        if graph.meta.get("fingerprint") in (None, key):
            return graph
    path = cache_dir() / graph_file_name(key, block_size, graph_size)
    if path.is_file():
        try:
            return load(path)
        except ValueError:
            pass  # a corrupt cache entry: calibrate again
    graph = calibrate(model, None, block_size, graph_size, progress=progress, **calibrate_options)
    try:
        save(graph, path)
    except OSError:
        pass  # read-only home: use it uncached
    return graph


def main(argv=None) -> int:
    """``python -m dspec.decode.spiffy_graph MODEL [--block-sizes 4 8 16] [--graph-size 16]
    [--out DIR]``: calibrate graphs for a model (a shipped name or a checkpoint directory)
    and write them where :func:`default_graph` looks (the shipped folder for a shipped
    name, else the cache)."""
    import argparse

    from ..hub import load

    p = argparse.ArgumentParser(
        prog="python -m dspec.decode.spiffy_graph",
        description="Calibrate Spiffy draft graphs for a block-diffusion model.",
    )
    p.add_argument("model", help="shipped name (e.g. tiny-bd) or checkpoint directory")
    p.add_argument(
        "--block-sizes", type=int, nargs="+", default=None, help="block sizes to calibrate (default: the model's)"
    )
    p.add_argument("--graph-size", type=int, default=16, help="draft nodes D (default 16)")
    p.add_argument("--prompts", type=int, default=32, help="calibration prompts (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", default=None, help="output folder (default: shipped folder or cache)")
    args = p.parse_args(argv)
    model = load(args.model)
    shipped = getattr(model, "shipped_name", None)
    out = Path(args.out) if args.out else (ASSETS if shipped else cache_dir())
    key = shipped if (shipped and out == ASSETS) else fingerprint(model)
    for bs in args.block_sizes or [model.block_size]:
        graph = calibrate(
            model, default_prompts(model, args.prompts), bs, args.graph_size, max_new_tokens=args.max_new_tokens
        )
        path = save(graph, out / graph_file_name(key, bs, args.graph_size))
        print(f"block {bs}: {graph.graph_size} draft nodes -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
