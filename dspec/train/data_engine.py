"""The data engine: target-generated responses for training drafters and adapters.

A drafter learns the distribution it must predict at decoding time, so its training data is
the target's own continuations.  The engine draws prompts from three offline sources that
exclude every benchmark prompt, continues each with dspec's batched ``ar`` on the target
(greedy for most, sampled at T = 1 for ``sampled_fraction`` of them) and stores the results
as uint16 token shards outside the package.  ``method="diffusion"`` continues them instead with
a masked-diffusion model's own one-token-per-step ``diffusion`` (its default block size): the
fixed points that ``ssd`` / ``spiffy`` verify against, for self-consistency training of the
mask adapter (``dspec.train.mask_adapter``).  Sources:

- ``sharegpt``: human turns of ShareGPT conversations, in the target's chat template
  (SmolLM2's ChatML, as ``dspec generate`` and MT-Bench rows of ``bench_e2e`` use);
- ``stdlib``: a window of 4-16 lines of a standard-library source file, raw (code
  completion, as HumanEval rows are given);
- ``arithmetic``: training problems ``"Compute: a op b ="`` (seeds >= 1000), raw;
- ``gsm``: GSM8K-style word problems from ``reasoning_gym``'s ``gsm_symbolic`` generators
  (``pip install reasoning-gym==0.1.25``; its instruction suffix dropped), in the chat
  template (as MATH500 rows of ``bench_e2e`` are sent);
- ``code_def``: a standard-library function's signature and docstring, dedented, raw
  (what a HumanEval prompt is: the model writes the body);
- ``magpie``: the target writes the user turn itself (Magpie, Xu et al. 2024): given its chat
  template up to an open user turn, it samples an instruction at T = 1, then answers it. The
  instructions follow the model's own instruction-tuning distribution (SmolLM2's includes
  Magpie-Ultra), which is what MT-Bench-style questions look like to it;
- ``magpie_math``: the same, with the user turn opened by a competition-math opening
  (``"Let $"``, ``"Find"``, ``"How many"``, ...), so the model writes LaTeX problems, and
  closed by the request for a ``\\boxed{}`` answer that ``bench_e2e``'s MATH500 rows carry.

Held out: ShareGPT turns and stdlib files in ``dspec.train.data``'s held-out split; every
turn whose text equals an MT-Bench question; arithmetic problems of the evaluation sets
(``dspec.tasks.prompt_set("arithmetic", n, seed=0)``, the first 2,000) and the held-out
tenth of ``is_heldout_problem``; GSM problems and stdlib files ``is_heldout_text`` holds out.
HumanEval and MATH500 are not among the sources; a Magpie turn equal to an MT-Bench question,
a MATH500 problem or a HumanEval prompt is dropped from its batch.

Layout of ``out/``::

    manifest.json        config, target, machine, one entry per finished shard
    tokens-00000.npy     uint16 [tokens of the shard]: prompt + response, back to back
    rows-00000.npy       int64 [sequences, 5]: offset, length, prompt length, source id, sampled

A shard (``shard_batches`` calls of ``batch`` sequences) is written to temporary names and
renamed when its last call finishes, so an interrupted run resumes at the next shard.
Everything is a function of ``seed``: call c's prompts and its sampling generator depend on
(seed, c) only; greedy outputs are identical across runs on the same machine, dtype and batch.

CLI::

    python -m dspec.train.data_engine --target smollm2-135m --out data/smollm2-135m \\
        --tokens 2000000 --batch 64
    python -m dspec.train.data_engine --target smollm2-135m-bd --method diffusion \\
        --out data/smollm2-135m-bd-self --tokens 280000 --batch 64
    python -m dspec.train.data_engine --target smollm2-135m --out data/smollm2-135m-magpie \\
        --sources magpie=0.55,magpie_math=0.45 --tokens 1200000 --batch 64
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import tasks
from .._cli import dumps, run_command
from ..corpora import FORMAT, MANIFEST, GeneratedData, read_manifest
from .data import is_heldout_problem, is_heldout_text

__all__ = [
    "EngineConfig",
    "prompt_stream",
    "write_user_turns",
    "generate_shards",
    "GeneratedData",
    "parse_directory",
    "read_directories",
    "heldout_split",
    "parse_source_weights",
    "ENGINE_SOURCES",
]

# a shard row's source id is its index here: append new sources, never reorder
ENGINE_SOURCES = ("sharegpt", "stdlib", "arithmetic", "gsm", "code_def", "magpie", "magpie_math")
MAGPIE_SOURCES = ("magpie", "magpie_math")
MAGPIE_MATH_OPENINGS = (
    "Let $",
    "Find",
    "Compute",
    "If $",
    "What is the",
    "How many",
    "Suppose",
    "Evaluate",
    "Solve",
    "Determine",
    "Simplify",
    "In triangle $",
    "The sum of",
)
MAGPIE_MATH_CLOSE = "\nPut the final answer in \\boxed{}."
MAGPIE_TURN_TOKENS = 96  # a sampled user turn longer than this (or than the budget) is cut
EVAL_ARITHMETIC = 2000  # bench/eval problems drawn with seed 0: never trained on
GSM_SIZE = 1 << 24  # gsm_symbolic items are a function of (seed, index): draw indices
GSM_SUFFIX = " Give the result as your final answer. Do not include units."
MAX_DRAWS = 10_000  # gsm / code_def redraw prompts over budget: refuse a budget none fits
GENERATION_METHODS = ("ar", "diffusion")


@dataclass
class EngineConfig:
    """What to generate.

    tokens : response tokens wanted in all (generation stops at the first shard that
        reaches it).
    response_tokens : max new tokens per prompt; prompt_tokens : max prompt tokens.
    sources : source -> weight.  sampled_fraction : responses drawn at T = 1.
    batch : sequences per decoding call; shard_batches : calls per shard (the unit of resume).
    seed : everything else.
    method : ``"ar"`` (the target's autoregressive continuation) or ``"diffusion"`` (a
        masked-diffusion model's one-token-per-step decoding at its default block size).
    """

    tokens: int = 2_000_000
    response_tokens: int = 128
    prompt_tokens: int = 128
    sources: dict = field(default_factory=lambda: {"sharegpt": 0.45, "stdlib": 0.35, "arithmetic": 0.2})
    sampled_fraction: float = 0.25
    batch: int = 64
    shard_batches: int = 16
    seed: int = 0
    method: str = "ar"

    def __post_init__(self):
        for name in ("tokens", "response_tokens", "prompt_tokens", "batch", "shard_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        bad = set(self.sources) - set(ENGINE_SOURCES)
        if bad or not self.sources or any(w < 0 for w in self.sources.values()) or sum(self.sources.values()) <= 0:
            raise ValueError(f"sources must map some of {ENGINE_SOURCES} to weights >= 0, got {self.sources!r}")
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise ValueError(f"sampled_fraction must lie in [0, 1], got {self.sampled_fraction!r}")
        if self.method not in GENERATION_METHODS:
            raise ValueError(f"method must be one of {GENERATION_METHODS}, got {self.method!r}")


# ------------------------------------------------------------------------------ prompts


def _benchmark_texts(sets=("mtbench",)) -> set[str]:
    out = set()
    for name in sets:
        try:
            out |= {p.prompt.strip() for p in getattr(tasks, name)()}
        except ValueError:  # package absent: nothing to exclude from it
            pass
    return out


class PromptSources:
    """Training-split prompt texts per source, loaded once (deterministic order)."""

    def __init__(self, tokenizer, cfg: EngineConfig):
        self.tok = tokenizer
        self.cfg = cfg
        self.chat = tokenizer.token_to_id("<|im_start|>") is not None
        self.texts: dict[str, list] = {}
        if cfg.sources.get("sharegpt"):
            bench = _benchmark_texts()
            self.texts["sharegpt"] = [
                t
                for t in tasks.sharegpt_texts(roles=("human",))
                if t.strip() and not is_heldout_text(t) and t.strip() not in bench
            ]
        if cfg.sources.get("stdlib") or cfg.sources.get("code_def"):
            files = [
                f
                for f in tasks.stdlib_sources()
                if not is_heldout_text(f.read_text(encoding="utf-8", errors="replace"))
            ]
            self.texts["stdlib"] = files
            self._defs: dict = {}
        if cfg.sources.get("gsm"):
            try:
                import reasoning_gym
            except ImportError:
                raise ValueError("source 'gsm' needs reasoning_gym: pip install reasoning-gym==0.1.25") from None
            self.gsm = reasoning_gym.create_dataset("gsm_symbolic", size=GSM_SIZE, seed=cfg.seed)
        if cfg.sources.get("arithmetic"):
            evals = {p.prompt for p in tasks.prompt_set("arithmetic", EVAL_ARITHMETIC, seed=0)}
            self.arith_evals = evals
        if any(cfg.sources.get(s) for s in MAGPIE_SOURCES):
            if not self.chat:
                raise ValueError("sources 'magpie' / 'magpie_math' need a chat model (a tokenizer with <|im_start|>)")
            from ..models.embedded import chat_prompt

            head = chat_prompt([{"role": "user", "content": "\0"}], add_generation_prompt=False)
            self.magpie_head = head[: head.index("\0")]
            self.magpie_head_text = tokenizer.decode(tokenizer.encode(self.magpie_head))  # special tokens dropped
            self.magpie_tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
            self.magpie_close = tokenizer.encode(MAGPIE_MATH_CLOSE)
            self.magpie_end = tokenizer.token_to_id("<|im_end|>")
            self.magpie_bench = {t.strip() for t in _benchmark_texts(("mtbench", "math500", "humaneval"))}
            opened = max(len(tokenizer.encode(self.magpie_head + o)) for o in MAGPIE_MATH_OPENINGS)
            room = cfg.prompt_tokens - opened - len(self.magpie_tail) - len(self.magpie_close)
            if room < 8:
                raise ValueError(
                    f"prompt_tokens = {cfg.prompt_tokens} leaves a Magpie user turn {room} tokens; give at least 8"
                )
            self.magpie_room = min(MAGPIE_TURN_TOKENS, room)
        for name, items in self.texts.items():
            if not items:
                raise ValueError(f"source {name!r} has no training prompts (is its package installed?)")

    def _function_starts(self, path) -> list[str]:
        """Every documented function of a source file, from its ``def`` through its docstring
        and dedented: a HumanEval-style prompt whose completion is the body."""
        if path not in self._defs:
            import ast
            import textwrap

            src = path.read_text(encoding="utf-8", errors="replace")
            lines = src.splitlines(keepends=True)
            try:
                tree = ast.parse(src)
            except (SyntaxError, ValueError):
                tree = None
            starts = []
            for node in ast.walk(tree) if tree is not None else ():
                if (
                    isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and ast.get_docstring(node)
                    and len(node.body) > 1
                ):
                    doc = node.body[0]
                    starts.append(textwrap.dedent("".join(lines[node.lineno - 1 : doc.end_lineno])))
            self._defs[path] = starts
        return self._defs[path]

    def _cut(self, text: str, budget: int) -> str:
        ids = self.tok.encode(text)
        return text if len(ids) <= budget else self.tok.decode(ids[:budget])

    def draw(self, source: str, rng: random.Random, index: int) -> str:
        if source == "sharegpt":
            from ..models.embedded import chat_prompt

            text = self.texts["sharegpt"][rng.randrange(len(self.texts["sharegpt"]))]
            # the template with its default system turn costs ~30 tokens: cut the user turn so it fits
            text = self._cut(text, max(8, self.cfg.prompt_tokens - 48))
            return chat_prompt(text) if self.chat else text
        if source == "stdlib":
            f = self.texts["stdlib"][rng.randrange(len(self.texts["stdlib"]))]
            lines = f.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
            start = rng.randrange(max(1, len(lines) - 4))
            window = "".join(lines[start : start + rng.randint(4, 16)]) or "import os\n"
            return self._cut(window, self.cfg.prompt_tokens)
        if source == "gsm":
            from ..models.embedded import chat_prompt

            for _ in range(MAX_DRAWS):  # whole problems only: a cut one has no question
                q = self.gsm[rng.randrange(GSM_SIZE)]["question"].removesuffix(GSM_SUFFIX)
                text = chat_prompt(q) if self.chat else q
                if not is_heldout_text(q) and len(self.tok.encode(text)) <= self.cfg.prompt_tokens:
                    return text
            raise ValueError(
                f"source 'gsm': no problem fits prompt_tokens = {self.cfg.prompt_tokens} in {MAX_DRAWS} draws"
            )
        if source == "magpie":
            return self.magpie_head
        if source == "magpie_math":
            return self.magpie_head + MAGPIE_MATH_OPENINGS[rng.randrange(len(MAGPIE_MATH_OPENINGS))]
        if source == "code_def":
            for _ in range(MAX_DRAWS):
                f = self.texts["stdlib"][rng.randrange(len(self.texts["stdlib"]))]
                defs = self._function_starts(f)
                if defs:
                    text = defs[rng.randrange(len(defs))]
                    if len(self.tok.encode(text)) <= self.cfg.prompt_tokens:
                        return text
            raise ValueError(
                f"source 'code_def': no documented function fits prompt_tokens = "
                f"{self.cfg.prompt_tokens} in {MAX_DRAWS} draws"
            )
        while True:  # arithmetic
            p = tasks.arithmetic(1, seed=1000 + self.cfg.seed * 1_000_003 + index * 31 + rng.randrange(1 << 20))[0]
            if p.prompt not in self.arith_evals and not is_heldout_problem(p.prompt):
                return p.prompt


def prompt_stream(
    tokenizer, cfg: EngineConfig, call: int, *, sources: PromptSources | None = None
) -> list[tuple[list[int], int]]:
    """The prompts of ``ar`` call ``call`` (shard s holds calls s * shard_batches ..):
    ``cfg.batch`` (token ids, source id) pairs, a pure function of (cfg.seed, call).  A Magpie
    row's ids end in its open user turn: :func:`write_user_turns` has the target fill it."""
    src = sources or PromptSources(tokenizer, cfg)
    rng = random.Random(cfg.seed * 7_919 + call)
    names = [s for s in ENGINE_SOURCES if cfg.sources.get(s)]
    weights = [cfg.sources[s] for s in names]
    out = []
    for i in range(cfg.batch):
        name = rng.choices(names, weights)[0]
        ids = tokenizer.encode(src.draw(name, rng, call * cfg.batch + i))[: cfg.prompt_tokens]
        out.append((ids or tokenizer.encode("\n"), ENGINE_SOURCES.index(name)))
    return out


@torch.no_grad()
def write_user_turns(target, prompts, cfg: EngineConfig, call: int, sources: PromptSources):
    """Magpie rows of ``prompts``: the target samples each user turn (T = 1, up to the prompt
    budget, ended by ``<|im_end|>``), in one batched ``ar`` call seeded by (seed, call); the row
    becomes the whole chat prompt, up to the open assistant turn.  An empty turn, or one equal
    to a benchmark prompt, drops its row.  Other rows pass unchanged."""
    from ..decode.ar import decode_ar

    rows = [i for i, (_, s) in enumerate(prompts) if ENGINE_SOURCES[s] in MAGPIE_SOURCES]
    if not rows:
        return prompts
    gen = torch.Generator(device=target.device).manual_seed(cfg.seed * 1_000_003 + call + (1 << 40))
    turns, _ = decode_ar(
        target,
        [prompts[i][0] for i in rows],
        max_new_tokens=sources.magpie_room,
        temperature=1.0,
        generator=gen,
        eos_ids=[sources.magpie_end],
    )
    out = list(prompts)
    for i, turn in zip(rows, turns):
        ids, src = prompts[i]
        turn = turn[:-1] if turn and turn[-1] == sources.magpie_end else turn
        if ENGINE_SOURCES[src] == "magpie_math":
            turn = turn + sources.magpie_close
        text = target.tokenizer.decode(ids + turn).removeprefix(sources.magpie_head_text).strip()
        empty = not target.tokenizer.decode(turn).replace(MAGPIE_MATH_CLOSE, "").strip()
        out[i] = None if empty or text in sources.magpie_bench else (ids + turn + sources.magpie_tail, src)
    return [p for p in out if p is not None]


# ---------------------------------------------------------------------------- generation


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


@torch.no_grad()
def generate_shards(target, out, cfg: EngineConfig, *, target_name: str = "", progress: bool = True) -> dict:
    """Generate (or resume) shards into ``out`` until ``cfg.tokens`` response tokens exist.
    Returns the manifest."""
    from tqdm.auto import tqdm

    from ..cpu import machine as machine_record
    from ..decode.ar import decode_ar
    from ..decode.diffusion import decode_diffusion

    if target.tokenizer is None:
        raise ValueError("target: the engine needs a model with a tokenizer")
    if target.config.vocab_size > 65536:
        raise ValueError("target: uint16 shards need a vocabulary of at most 65,536 ids")
    if cfg.method == "diffusion" and getattr(target, "mask_token_id", None) is None:
        raise ValueError("target: method='diffusion' needs a masked-diffusion model (mask_token_id set)")
    decode = decode_ar if cfg.method == "ar" else decode_diffusion
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    if manifest is not None:
        manifest["config"] = {"method": "ar"} | manifest["config"]  # directories made before `method`
        if manifest["config"] != asdict(cfg) | {"tokens": manifest["config"]["tokens"]}:
            raise ValueError(
                f"out: {out} holds data of another config ({manifest['config']}); "
                "use another directory or the same settings"
            )
        manifest["config"]["tokens"] = cfg.tokens
    else:
        manifest = {
            "format": FORMAT,
            "config": asdict(cfg),
            "target": target_name or str(target.name_or_path),
            "dtype": str(target.dtype).replace("torch.", ""),
            "sources": list(ENGINE_SOURCES),
            "machine": machine_record(),
            "shards": [],
        }
    done = sum(s["response_tokens"] for s in manifest["shards"])
    sources = PromptSources(target.tokenizer, cfg) if done < cfg.tokens else None
    bar = tqdm(
        total=cfg.tokens,
        initial=min(done, cfg.tokens),
        desc="response tokens",
        unit="tok",
        disable=not progress,
        smoothing=0.1,
    )
    shard = len(manifest["shards"])
    while done < cfg.tokens:
        flat, rows, offset, resp, seconds, sampled_calls = [], [], 0, 0, 0.0, 0
        for call in range(shard * cfg.shard_batches, (shard + 1) * cfg.shard_batches):
            t0 = time.perf_counter()
            prompts = prompt_stream(target.tokenizer, cfg, call, sources=sources)
            prompts = write_user_turns(target, prompts, cfg, call, sources)
            # call c samples at T = 1 when the running share of sampled calls is below the target
            sampled = int((call + 1) * cfg.sampled_fraction) > int(call * cfg.sampled_fraction)
            gen = torch.Generator(device=target.device).manual_seed(cfg.seed * 1_000_003 + call)
            responses, _ = decode(
                target,
                [p for p, _ in prompts],
                max_new_tokens=cfg.response_tokens,
                temperature=1.0 if sampled else 0.0,
                generator=gen if sampled else None,
                eos_ids=target.eos_token_ids,
            )
            dt = time.perf_counter() - t0
            seconds += dt
            sampled_calls += sampled
            n = 0
            for (p, src), r in zip(prompts, responses):
                seq = list(p) + list(r)
                flat.extend(seq)
                rows.append((offset, len(seq), len(p), src, int(sampled)))
                offset += len(seq)
                n += len(r)
            resp += n
            bar.update(n)
            bar.set_postfix(shard=shard, tok_s=f"{n / dt:.0f}")
        names = (f"tokens-{shard:05d}.npy", f"rows-{shard:05d}.npy")
        for name, arr in zip(names, (np.asarray(flat, dtype=np.uint16), np.asarray(rows, dtype=np.int64))):
            tmp = out / (name + ".tmp")
            with open(tmp, "wb") as f:
                np.save(f, arr)
            os.replace(tmp, out / name)
        manifest["shards"].append(
            {
                "index": shard,
                "sequences": len(rows),
                "tokens": offset,
                "response_tokens": resp,
                "sampled_calls": sampled_calls,
                "seconds": round(seconds, 2),
            }
        )
        _write_json(out / MANIFEST, manifest)
        done += resp
        shard += 1
    bar.close()
    return manifest


# ------------------------------------------------------------------------------- reading


def parse_source_weights(text: str) -> dict[str, float]:
    """``"name=weight,..."`` (the CLIs' ``--sources``) -> {name: weight}; ValueError on any
    other shape (the caller's config checks the names and weights)."""
    return {k: float(v) for k, v in (item.split("=") for item in text.split(","))}


def parse_directory(spec) -> tuple[Path, int | tuple[int, int] | None]:
    """A ``--data`` entry: ``"DIR"`` (every shard), ``"DIR:N"`` (its first N shards) or
    ``"DIR:A-B"`` (shards A <= i < B) -> (path, None | N | (A, B)); ValueError when N is not
    a positive integer or the range is empty (the directory checks the upper bound)."""
    text = str(spec)
    head, sep, tail = text.rpartition(":")
    if not sep or not head or "/" in tail:
        return Path(text), None
    tail = tail.strip()
    a, dash, b = tail.partition("-")
    if dash and a.isdigit() and b.isdigit():
        start, stop = int(a), int(b)
        if not start < stop:
            raise ValueError(f"data: {text!r} asks for shards {start} <= i < {stop}; DIR:A-B needs A < B")
        return Path(head), (start, stop)
    if not tail.lstrip("-").isdigit():
        return Path(text), None
    n = int(tail)
    if n < 1:
        raise ValueError(f"data: {text!r} asks for {n} shards; DIR:N needs N >= 1")
    return Path(head), n


def read_directories(paths) -> tuple[list[tuple[list[int], int]], dict]:
    """The sequences of one or more engine directories (``"DIR"``, ``"DIR:N"``, its first N
    shards, or ``"DIR:A-B"``, shards A <= i < B), back to back in the order given, and their
    info (one directory's, or the totals with each directory's under ``"directories"``).

    Appending a directory keeps every earlier sequence's index, so a feature cache built over
    the first ones stays a valid prefix and ``heldout_split(start=<their count>)`` holds out
    only sequences of the new directories."""
    datas = [GeneratedData(*parse_directory(p)) for p in paths]
    if not datas:
        raise ValueError("data: no directory given")
    sequences = [s for d in datas for s in d]
    if len(datas) == 1:
        return sequences, datas[0].info
    infos = [d.info for d in datas]
    info = {"source": "; ".join(dict.fromkeys(i["source"] for i in infos)), "directories": infos}
    for key in ("shards", "sequences", "tokens", "response_tokens"):
        info[key] = sum(i[key] for i in infos)
    info["generation_s"] = round(sum(i["generation_s"] for i in infos), 1)
    return sequences, info


def heldout_split(count: int, held: int, *, seed: int, start: int = 0) -> tuple[list[int], list[int]]:
    """(held-out, training) indices of ``count`` sequences: ``held`` of the indices >= ``start``,
    drawn by a shuffle seeded with ``seed + 17``; every index < ``start`` trains.

    ``start = 0`` is the split of every round so far.  A later round on a directory resumed to
    more tokens passes the earlier sequence count as ``start``: its held-out sequences are
    then new ones, never seen by the weights it starts from.
    """
    if not 0 <= start < count:
        raise ValueError(f"heldout start must lie in [0, {count}), got {start}")
    order = list(range(start, count))
    random.Random(seed + 17).shuffle(order)
    held = max(1, min(int(held), len(order)))
    return order[:held], list(range(start)) + order[held:]


# ----------------------------------------------------------------------------------- CLI


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m dspec.train.data_engine",
        description="Generate target responses for drafter / adapter training.",
    )
    p.add_argument("--target", default="smollm2-135m", help="shipped name or checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (outside the package)")
    d = EngineConfig()
    p.add_argument("--tokens", type=int, default=d.tokens, help="response tokens wanted (default %(default)s)")
    p.add_argument(
        "--response-tokens", type=int, default=d.response_tokens, help="max new tokens per prompt (default %(default)s)"
    )
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="max prompt tokens (default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per decoding call (default %(default)s)")
    p.add_argument(
        "--shard-batches",
        type=int,
        default=d.shard_batches,
        help="decoding calls per shard, the unit of resume (default %(default)s)",
    )
    p.add_argument(
        "--sampled-fraction",
        type=float,
        default=d.sampled_fraction,
        help="share of decoding calls sampled at T = 1 (default %(default)s)",
    )
    p.add_argument(
        "--sources",
        default=None,
        help="source=weight,... of "
        + ", ".join(ENGINE_SOURCES)
        + " (default %s)" % ",".join(f"{k}={v}" for k, v in d.sources.items()),
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--method",
        default=d.method,
        choices=GENERATION_METHODS,
        help="ar: the target continues each prompt; diffusion: a masked-diffusion model's own "
        "one-token-per-step decoding (default %(default)s)",
    )
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the machine's)")
    p.add_argument("--threads", default=None, help="torch threads (default: dspec's policy)")
    args = p.parse_args(argv)
    import dspec

    from ..cpu import apply_threads

    apply_threads(args.threads)
    try:
        sources = d.sources
        if args.sources:
            try:
                sources = parse_source_weights(args.sources)
            except ValueError:
                raise ValueError(f"--sources must look like gsm=0.6,code_def=0.4, got {args.sources!r}") from None
        cfg = EngineConfig(
            tokens=args.tokens,
            sources=sources,
            response_tokens=args.response_tokens,
            prompt_tokens=args.prompt_tokens,
            batch=args.batch,
            shard_batches=args.shard_batches,
            sampled_fraction=args.sampled_fraction,
            seed=args.seed,
            method=args.method,
        )
        target = dspec.load(args.target, dtype=args.dtype)
        manifest = generate_shards(target, args.out, cfg, target_name=args.target)
    except ValueError as e:
        p.error(str(e))
    info = GeneratedData(args.out).info
    print(dumps(info, indent=1))
    return manifest


if __name__ == "__main__":
    import sys

    sys.exit(run_command(main))
