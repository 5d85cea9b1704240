"""Offline target features: the target's hidden states, computed once per training sequence.

A block drafter (DFlash, D2SD's VP drafter) is conditioned on the target's hidden states at a
few layers.  Recomputing them in every training step costs a full target forward per step,
about as much as the drafter's own step on a 30-layer target; SpecForge's and EAGLE's
offline mode compute them once and read them from disk.  :func:`build_features` runs the
frozen target over every sequence (batches of similar length, bf16 storage) and writes::

    <dir>/features.json     target, layer ids, hidden size, sequence count, its parts
    <dir>/features.npy      int16 (bfloat16 bits) [part tokens, len(layer_ids) * hidden]
    <dir>/features-<k>.npy  part k >= 1: the sequences appended after part k - 1 was built

Sequence i's rows are ``offsets[i] - offsets[first] ..`` of the part whose sequences
``first ..`` hold it (offsets are the running sum of lengths, so a part lines up with the
sequences it was built from, which its fingerprint records).  A data-engine directory only
grows (resumed to more tokens, the shards so far unchanged), so a build over more sequences
keeps every part whose sequences are still a prefix and computes only a new part for the
rest.  The build checkpoints its progress every minute and resumes.  :class:`FeatureCache`
memory-maps the parts and gathers a padded batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from bisect import bisect_right
from pathlib import Path

import numpy as np
import torch

from .._cli import dumps

__all__ = ["FeatureCache", "build_features", "sequences_fingerprint"]

META = "features.json"
ARRAY = "features.npy"


def sequences_fingerprint(sequences) -> str:
    """A short hash of [(ids, prompt_len)] (order, lengths and tokens)."""
    h = hashlib.sha256()
    for ids, plen in sequences:
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
        h.update(int(plen).to_bytes(8, "little"))
    return h.hexdigest()[:16]


def _meta(path: Path) -> dict | None:
    f = path / META
    if not f.is_file():
        return None
    meta = json.loads(f.read_text())
    if "parts" not in meta:  # written before parts existed: one part
        meta["parts"] = [
            {
                "file": ARRAY,
                "first": 0,
                "sequences": meta["sequences"],
                "tokens": meta["tokens"],
                "fingerprint": meta["fingerprint"],
                "batches": meta["batches"],
                "done_batches": meta["done_batches"],
                "seconds": meta.get("seconds", 0.0),
            }
        ]
    return meta


def _write_meta(out: Path, meta: dict) -> None:
    tmp = out / (META + ".tmp")
    tmp.write_text(dumps(meta, indent=1))
    os.replace(tmp, out / META)


def _length_batches(lengths: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Indices into ``lengths`` in batches of at most ``batch_tokens`` padded tokens, longest
    first so that padding stays small."""
    batches, cur, cur_max = [], [], 0
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(int(i))
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    return batches


@torch.no_grad()
def build_features(
    target, sequences, layer_ids, out_dir, *, batch_tokens: int = 8192, progress: bool = True
) -> "FeatureCache":
    """Compute (or finish, or extend) the features of ``sequences`` [(ids, prompt_len)] at
    target hidden-state indices ``layer_ids`` into ``out_dir``; returns the cache.  Parts
    built earlier for a prefix of ``sequences`` (same target, layers and batching) are kept."""
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layer_ids = [int(i) for i in layer_ids]
    hidden = target.config.hidden_size
    lengths = np.asarray([len(s) for s, _ in sequences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    setting = {
        "target": str(target.name_or_path),
        "layer_ids": layer_ids,
        "hidden": hidden,
        "batch_tokens": int(batch_tokens),
    }
    meta = _meta(out)
    parts = []
    if meta is not None and all(meta.get(k) == v for k, v in setting.items()):
        for part in meta["parts"]:
            first, stop = part["first"], part["first"] + part["sequences"]
            if (
                first != (parts[-1]["first"] + parts[-1]["sequences"] if parts else 0)
                or stop > len(sequences)
                or sequences_fingerprint(sequences[first:stop]) != part["fingerprint"]
            ):
                break
            parts.append(part)
    kept = {p["file"] for p in parts}
    for stale in out.glob("features*.npy"):
        if stale.name not in kept:
            stale.unlink()
    covered = parts[-1]["first"] + parts[-1]["sequences"] if parts else 0
    if covered < len(sequences):
        part_lengths = lengths[covered:]
        parts.append(
            {
                "file": ARRAY if not parts else f"features-{len(parts)}.npy",
                "first": covered,
                "sequences": len(sequences) - covered,
                "tokens": int(part_lengths.sum()),
                "fingerprint": sequences_fingerprint(sequences[covered:]),
                "batches": len(_length_batches(part_lengths, batch_tokens)),
                "done_batches": 0,
                "seconds": 0.0,
            }
        )
        arr = np.lib.format.open_memmap(
            out / parts[-1]["file"], mode="w+", dtype=np.int16, shape=(parts[-1]["tokens"], len(layer_ids) * hidden)
        )
        del arr
    meta = dict(
        setting,
        sequences=len(sequences),
        tokens=int(offsets[-1]),
        fingerprint=sequences_fingerprint(sequences),
        parts=parts,
    )
    _write_meta(out, meta)
    todo = [p for p in parts if p["done_batches"] < p["batches"]]
    bar = tqdm(total=sum(p["tokens"] for p in todo), desc="target features", unit="tok", disable=not progress)
    for part in todo:
        first = part["first"]
        batches = _length_batches(lengths[first : first + part["sequences"]], batch_tokens)
        arr = np.lib.format.open_memmap(out / part["file"], mode="r+")
        bar.update(int(sum(lengths[first + i] for b in batches[: part["done_batches"]] for i in b)))
        t0 = t_save = time.perf_counter()
        for k in range(part["done_batches"], len(batches)):
            idx = [first + i for i in batches[k]]
            plan = target.plan([list(sequences[i][0]) for i in idx])
            h = target(plan, logits=None, hidden_states=layer_ids, return_kv=False).hidden
            feats = torch.cat([x.to(torch.bfloat16) for x in h], dim=-1).view(torch.int16)
            for row, i in enumerate(idx):
                n, row0 = int(lengths[i]), int(offsets[i] - offsets[first])
                arr[row0 : row0 + n] = feats[row, :n].numpy()
            bar.update(int(lengths[idx].sum()))
            now = time.perf_counter()
            if now - t_save > 60 or k + 1 == len(batches):
                arr.flush()
                part["done_batches"] = k + 1
                part["seconds"] = round(part["seconds"] + now - t0, 1)
                t0 = t_save = now
                _write_meta(out, meta)
        del arr
    bar.close()
    return FeatureCache(out, sequences)


class FeatureCache:
    """Memory-mapped features of a fixed list of sequences (see the module docstring)."""

    def __init__(self, path, sequences):
        self.path = Path(path)
        meta = _meta(self.path)
        if meta is None:
            raise ValueError(f"features: {self.path} has no {META}")
        self.meta = meta
        self.lengths = np.asarray([len(s) for s, _ in sequences], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        if meta["sequences"] != len(sequences) or meta["tokens"] != int(self.offsets[-1]):
            raise ValueError(
                f"features: {self.path} was built for other sequences "
                f"({meta['sequences']} sequences, {meta['tokens']} tokens)"
            )
        undone = [p for p in meta["parts"] if p["done_batches"] != p["batches"]]
        if undone:
            raise ValueError(
                f"features: {self.path} is incomplete ({undone[0]['file']}: "
                f"{undone[0]['done_batches']} of {undone[0]['batches']} batches): "
                f"run build_features to finish it"
            )
        self.layer_ids = meta["layer_ids"]
        self.hidden = meta["hidden"]
        self.firsts = [p["first"] for p in meta["parts"]]
        self.arrays = [np.load(self.path / p["file"], mmap_mode="r") for p in meta["parts"]]

    def gather(self, indices, length: int, device="cpu") -> list[torch.Tensor]:
        """Hidden states of sequences ``indices`` padded (zeros) to ``length`` rows: one
        bfloat16 tensor [B, length, H] per layer id, as ``Output.hidden``."""
        width = len(self.layer_ids) * self.hidden
        out = torch.zeros(len(indices), length, width, dtype=torch.int16)
        for row, i in enumerate(indices):
            k = bisect_right(self.firsts, i) - 1
            start = int(self.offsets[i] - self.offsets[self.firsts[k]])
            n = min(int(self.lengths[i]), length)
            out[row, :n] = torch.from_numpy(np.array(self.arrays[k][start : start + n]))
        x = out.view(torch.bfloat16).to(device)
        return list(x.unflatten(-1, (len(self.layer_ids), self.hidden)).unbind(-2))
