"""Offline target features: the target's hidden states, computed once per training sequence.

A block drafter (DFlash, D2SD's VP drafter) is conditioned on the target's hidden states at a
few layers.  Recomputing them in every training step costs a full target forward per step,
about as much as the drafter's own step on a 30-layer target; SpecForge's and EAGLE's
offline mode compute them once and read them from disk.  :func:`build_features` runs the
frozen target over every sequence (batches of similar length, bf16 storage) and writes::

    <dir>/features.json   target, layer ids, hidden size, sequence count, progress
    <dir>/features.npy    int16 (bfloat16 bits) [total tokens, len(layer_ids) * hidden]

Sequence i's rows are ``offsets[i] .. offsets[i] + len(sequence i)`` (offsets are the
running sum of lengths, so the file lines up with the sequences it was built from, which
``features.json`` fingerprints).  The build checkpoints its progress every batch-group and
resumes.  :class:`FeatureCache` memory-maps the file and gathers a padded batch.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

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
    return json.loads(f.read_text()) if f.is_file() else None


@torch.no_grad()
def build_features(target, sequences, layer_ids, out_dir, *, batch_tokens: int = 8192,
                   progress: bool = True) -> "FeatureCache":
    """Compute (or finish computing) the features of ``sequences`` [(ids, prompt_len)] at
    target hidden-state indices ``layer_ids`` into ``out_dir``; returns the cache."""
    from tqdm.auto import tqdm
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layer_ids = [int(i) for i in layer_ids]
    hidden = target.config.hidden_size
    lengths = np.asarray([len(s) for s, _ in sequences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    fp = sequences_fingerprint(sequences)
    meta = _meta(out)
    want = {"target": str(target.name_or_path), "layer_ids": layer_ids, "hidden": hidden,
            "sequences": len(sequences), "fingerprint": fp, "tokens": int(offsets[-1]),
            "batch_tokens": int(batch_tokens)}
    order = np.argsort(-lengths, kind="stable")        # longest first: padding stays small
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = int(lengths[i])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(int(i))
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    if meta is None or any(meta.get(k) != v for k, v in want.items()):
        arr = np.lib.format.open_memmap(out / ARRAY, mode="w+", dtype=np.int16,
                                        shape=(int(offsets[-1]), len(layer_ids) * hidden))
        del arr
        meta = dict(want, batches=len(batches), done_batches=0, seconds=0.0)
        (out / META).write_text(json.dumps(meta, indent=1))
    arr = np.lib.format.open_memmap(out / ARRAY, mode="r+")
    bar = tqdm(total=int(offsets[-1]), desc="target features", unit="tok", disable=not progress)
    bar.update(int(sum(lengths[b].sum() for b in batches[:meta["done_batches"]])))
    t_save = time.perf_counter()
    t0 = t_save
    for k in range(meta["done_batches"], len(batches)):
        idx = batches[k]
        seqs = [list(sequences[i][0]) for i in idx]
        plan = target.plan(seqs)
        h = target(plan, logits=None, hidden_states=layer_ids, return_kv=False).hidden
        feats = torch.cat([x.to(torch.bfloat16) for x in h], dim=-1).view(torch.int16)
        for row, i in enumerate(idx):
            n = int(lengths[i])
            arr[offsets[i]:offsets[i] + n] = feats[row, :n].numpy()
        bar.update(int(lengths[idx].sum()))
        now = time.perf_counter()
        if now - t_save > 60 or k + 1 == len(batches):
            arr.flush()
            meta["done_batches"] = k + 1
            meta["seconds"] = round(meta["seconds"] + now - t0, 1)
            t0 = t_save = now
            tmp = out / (META + ".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, out / META)
    bar.close()
    del arr
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
            raise ValueError(f"features: {self.path} was built for other sequences "
                             f"({meta['sequences']} sequences, {meta['tokens']} tokens)")
        if meta.get("done_batches") != meta.get("batches"):
            raise ValueError(f"features: {self.path} is incomplete ({meta.get('done_batches')} of "
                             f"{meta.get('batches')} batches): run build_features to finish it")
        self.layer_ids = meta["layer_ids"]
        self.hidden = meta["hidden"]
        self.array = np.load(self.path / ARRAY, mmap_mode="r")

    def gather(self, indices, length: int, device="cpu") -> list[torch.Tensor]:
        """Hidden states of sequences ``indices`` padded (zeros) to ``length`` rows: one
        bfloat16 tensor [B, length, H] per layer id, as ``Output.hidden``."""
        width = len(self.layer_ids) * self.hidden
        out = torch.zeros(len(indices), length, width, dtype=torch.int16)
        for row, i in enumerate(indices):
            n = min(int(self.lengths[i]), length)
            out[row, :n] = torch.from_numpy(np.array(self.array[self.offsets[i]:self.offsets[i] + n]))
        x = out.view(torch.bfloat16).to(device)
        return list(x.unflatten(-1, (len(self.layer_ids), self.hidden)).unbind(-2))
