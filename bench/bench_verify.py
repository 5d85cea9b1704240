"""Benchmark dspec.verify_chain / verify_tree against plain PyTorch, the dspec reference and flashinfer.

Roofline bytes per case (what the op must read; the int64 outputs, < 0.1 %, are left out):
verify_chain ``B * (L + 1) * V * itemsize`` (one read of the target logits)
+ ``B * L * V * itemsize(draft_probs)`` when draft_probs are given; verify_tree
``B * N * V * itemsize``.  ``roofline_us = bytes / copy bandwidth`` and
``x_roofline = median / roofline_us``.

Modes: ``greedy`` (T = 0), ``t1`` (T = 1, one-hot drafts: draft_probs=None), ``t1_qbf16`` /
``t1_qfp32`` (T = 1 with draft_probs [B, L, V] in bf16 / fp32).  Target logits are bf16.
coins / sample_uniforms are generated before timing and passed in, so no timed call draws
random numbers (except the anchors' own torch.multinomial / flashinfer RNG, which are part
of how those are used), and ``dspec.config.validate_values`` is off (no host syncs).

Backends:
  torch        the dspec reference (backend="torch"), also the speedup baseline
  torch_plain  ANCHOR, not dspec: the straightforward PyTorch chain implementation (this
               file, ``plain_chain``): softmax over every position in float32, gather,
               compare, residual max(p - q, 0) for every position, torch.multinomial.  For
               trees the dspec reference (a plain vectorised walk) plays this part.
  triton       the fused dspec kernels (CUDA; on CPU only with TRITON_INTERPRET=1)
  flashinfer   ANCHOR, CUDA only, when ``import flashinfer`` works: torch.softmax of the
               target logits (/T) to float32 probs + draft_probs.float() +
               flashinfer.sampling.chain_speculative_sampling, timed together (chain, T > 0;
               for mode t1 a one-hot float32 draft_probs is built outside the timing)

Headline (GPU): verify_chain B=64 L=16 V=151936 T=1 with draft_probs (fp32; bf16 also shown):
targets >= 1.5x faster than flashinfer softmax + chain_speculative_sampling, and within 1.5x
of the roofline time.  Printed with PASS / FAIL / not-measured (also by summarize.py).

    python bench/bench_verify.py --device cpu --quick
    python bench/bench_verify.py --device cuda --out /tmp/res
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from tqdm import tqdm

import common

BENCH = "verify"
PROVIDED = ("torch", "triton")
PLAIN = "torch_plain"
FLASHINFER = "flashinfer"
KERNEL_BACKENDS = ("triton", "cuda")
CHAIN_MODES = ("t1_qfp32", "t1_qbf16", "t1", "greedy")  # headline modes first
TREE_MODES = ("greedy", "t1")
MODE_Q_DTYPE = {"t1_qbf16": torch.bfloat16, "t1_qfp32": torch.float32}
LOGITS_DTYPE = "bf16"
# (op, B, L, V, mode); the first is the headline proper, the second is shown next to it
HEADLINE = ("verify_chain", 64, 16, 151936, "t1_qfp32")
HEADLINE_ALSO = ("verify_chain", 64, 16, 151936, "t1_qbf16")
TARGET_VS_FLASHINFER = 1.5  # kernel >= 1.5x faster than flashinfer softmax + chain sampling
TARGET_X_ROOFLINE = 1.5  # kernel time <= 1.5x bytes / copy bandwidth
# plot colours for the two anchors this bench adds (common's default cycle would give
# torch_plain triton's blue); set here so summarize.py's plots get them too
common._COLORS.setdefault(PLAIN, "tab:purple")
common._COLORS.setdefault(FLASHINFER, "tab:brown")


def _temperature(mode: str) -> float:
    return 0.0 if mode == "greedy" else 1.0


# --------------------------------------------------------------------------------------
# the plain PyTorch anchor (NOT dspec): how verification is usually written in PyTorch
# --------------------------------------------------------------------------------------
def plain_chain(draft_tokens, target_logits, draft_probs, temperature, coins, generator=None):
    """Speculative-sampling chain verification, the straightforward multi-kernel way.

    Greedy: argmax of every position, compare, cumprod.  Sampling: softmax of the whole
    [B, L+1, V] in float32, q materialised (one-hot when draft_probs is None), accept with
    ``coin < min(1, p/q)``, the residual ``max(p - q, 0)`` normalised for *every* position,
    then ``torch.multinomial`` on the chosen row.  Returns (num_accepted [B], tokens [B, L+1]).
    """
    batch, length = draft_tokens.shape
    vocab = target_logits.shape[-1]
    dev = target_logits.device
    x = draft_tokens.long()
    rows = torch.arange(batch, device=dev)
    if temperature <= 0:
        target = target_logits.argmax(-1)  # [B, L+1]
        accept = x == target[:, :length]
        n = accept.long().cumprod(-1).sum(-1)
        final = target[rows, n]
    else:
        p = torch.softmax(target_logits.float() / temperature, dim=-1)  # [B, L+1, V] fp32
        q = (
            draft_probs.float() if draft_probs is not None else torch.nn.functional.one_hot(x, vocab).float()
        )  # [B, L, V]
        p_x = p[:, :length].gather(-1, x[..., None])[..., 0]
        q_x = q.gather(-1, x[..., None])[..., 0]
        accept = coins < torch.clamp(p_x / q_x, max=1.0)
        n = accept.long().cumprod(-1).sum(-1)
        residual = torch.clamp(p[:, :length] - q, min=0.0)  # every position
        residual = residual / residual.sum(-1, keepdim=True)
        dist = torch.cat([residual, p[:, length:]], dim=1)[rows, n]  # [B, V]
        ok = torch.isfinite(dist.sum(-1, keepdim=True)) & (dist.sum(-1, keepdim=True) > 0)
        dist = torch.where(ok, dist, p[rows, n])  # empty residual (p == q): sample p
        final = torch.multinomial(dist, 1, generator=generator)[:, 0]
    pos = torch.arange(length + 1, device=dev)
    tokens = torch.where(pos[None, :] < n[:, None], torch.cat([x, x.new_full((batch, 1), -1)], 1), -1)
    tokens[rows, n] = final
    return n, tokens


def load_flashinfer(device: str):
    """(module, None) or (None, "flashinfer unavailable: <reason>")."""
    if device != "cuda":
        return None, "flashinfer unavailable: CUDA only (device is cpu)"
    try:
        import flashinfer
        import flashinfer.sampling

        fn = flashinfer.sampling.chain_speculative_sampling
        inspect.signature(fn)
    except Exception as exc:  # noqa: BLE001 - any import/ABI failure just disables the anchor
        return None, f"flashinfer unavailable: {type(exc).__name__}: {exc}"
    return flashinfer, None


def flashinfer_chain_fn(fi, drafts_i32, logits, draft_probs, temperature, uniforms_full, generator):
    """softmax(logits / T) -> float32 probs, draft_probs.float(), chain_speculative_sampling.

    flashinfer <= 0.2.x takes ``uniform_samples`` [B, L+1] (passed pre-generated); later
    versions draw their own (``generator`` passed, created once outside the timing).
    Returns a zero-argument callable giving output_token_ids [B, L+1] (-1 padded).
    """
    fn = fi.sampling.chain_speculative_sampling
    params = inspect.signature(fn).parameters
    old_api = "uniform_samples" in params
    kw = {}
    if not old_api and "generator" in params:
        kw["generator"] = generator

    def run():
        x = logits if temperature == 1.0 else logits / temperature
        target_probs = torch.softmax(x, dim=-1, dtype=torch.float32)
        q = draft_probs.float()
        if old_api:
            out = fn(q, drafts_i32, uniforms_full, target_probs, **kw)
        else:
            out = fn(q, drafts_i32, target_probs, **kw)
        return out[0] if isinstance(out, (tuple, list)) else out

    return run


# --------------------------------------------------------------------------------------
# cases and inputs
# --------------------------------------------------------------------------------------
def groups(device: str, quick: bool, ops: set[str]) -> list[tuple]:
    """Shape groups (op, B, L or N, V, modes); every mode of a group shares its inputs.

    The headline group goes first, then V = 151936 before 32000, chain before tree, so a run
    cut short by a timeout still holds the most relevant rows."""
    if device == "cuda":
        if quick:
            chain = [(b, l, v) for v in (151936,) for l in (16,) for b in (1, 64)]
            tree = [(b, n, v) for v in (151936,) for n in (32,) for b in (1, 64)]
        else:
            chain = [(b, l, v) for v in (151936, 32000) for l in (16, 8, 4, 1) for b in (1, 8, 64, 256)]
            tree = [(b, n, v) for v in (151936, 32000) for n in (16, 32, 64) for b in (1, 8, 64)]
    else:
        if quick:
            chain = [(b, l, 32000) for l in (1, 4) for b in (1, 4)]
            tree = [(b, 16, 32000) for b in (1, 4)]
        else:
            chain = [(b, l, v) for v in (151936, 32000) for l in (4, 16) for b in (1, 8)]
            tree = [(b, n, v) for v in (151936, 32000) for n in (16, 32) for b in (1, 8)]
    out = []
    for vocab in dict.fromkeys([c[2] for c in chain] + [t[2] for t in tree]):
        if "verify_chain" in ops:
            out += [("verify_chain", b, l, v, CHAIN_MODES) for b, l, v in chain if v == vocab]
        if "verify_tree" in ops:
            out += [("verify_tree", b, n, v, TREE_MODES) for b, n, v in tree if v == vocab]
    head = [g for g in out if g[:4] == HEADLINE[:4]]
    return head + [g for g in out if g[:4] != HEADLINE[:4]]


def chain_inputs(batch, length, vocab, device, seed):
    """bf16 logits [B, L+1, V]; drafts: the target argmax for a random prefix of each row
    (so some are accepted), random ids after; coins [B, L], uniforms [B]."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    logits = common.random_logits(batch * (length + 1), vocab, common.DTYPES[LOGITS_DTYPE], device, seed=seed).view(
        batch, length + 1, vocab
    )
    target = logits[:, :length].argmax(-1)
    keep = torch.randint(0, length + 1, (batch,), generator=g, device=device)
    rand = torch.randint(0, vocab, (batch, length), generator=g, device=device)
    drafts = torch.where(torch.arange(length, device=device)[None, :] < keep[:, None], target, rand)
    coins = torch.rand(batch, length, generator=g, device=device)
    uniforms = torch.rand(batch, generator=g, device=device)
    return logits, drafts, coins, uniforms


def make_draft_probs(logits, length, dtype, seed):
    """softmax(target logits + N(0, 1) noise): a drafter that roughly agrees with the target."""
    g = torch.Generator(device=logits.device).manual_seed(seed + 2)
    x = logits[:, :length].float()
    x.add_(torch.randn(x.shape, generator=g, device=x.device))
    return torch.softmax(x, dim=-1).to(dtype)


def tree_inputs(batch, nodes, vocab, device, seed):
    """bf16 logits [B, N, V]; parents: each node hangs off one of the 4 nodes before it (a
    bushy tree a few levels deep); a node's token is its parent's target argmax with
    probability 0.6 (so paths get accepted), else random; coins [B, N], uniforms [B]."""
    g = torch.Generator(device=device).manual_seed(seed + 3)
    logits = common.random_logits(batch * nodes, vocab, common.DTYPES[LOGITS_DTYPE], device, seed=seed).view(
        batch, nodes, vocab
    )
    idx = torch.arange(nodes, device=device)
    back = (torch.rand(batch, nodes, generator=g, device=device) * idx.clamp(max=4)[None, :]).long()
    parents = idx[None, :] - 1 - back
    parents[:, 0] = -1
    argmax = logits.argmax(-1)
    from_parent = argmax.gather(1, parents.clamp(min=0))
    rand = torch.randint(0, vocab, (batch, nodes), generator=g, device=device)
    tokens = torch.where(torch.rand(batch, nodes, generator=g, device=device) < 0.6, from_parent, rand)
    coins = torch.rand(batch, nodes, generator=g, device=device)
    uniforms = torch.rand(batch, generator=g, device=device)
    return logits, tokens, parents, coins, uniforms


# --------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------
def _rows_differ(a: torch.Tensor, b: torch.Tensor, per_element: bool = False) -> torch.Tensor:
    """[B] bool: rows of a and b that differ anywhere ([B, -1] elementwise with per_element)."""
    ne = (a != b).reshape(a.shape[0], -1)
    return ne if per_element else ne.any(-1)


#: how far a sampled final token may sit from the reference's draw: a draw is the first id
#: whose cumulative weight passes u * sum, and float32 sums over ~1e5 ids taken in another
#: order (a GPU scan, Triton tiles) move each boundary by a little of the total (1.2e-7,
#: 7e-7 and 1.2e-7 for the three ties seen at V = 151936 on an H100, Nov 2026)
TIE_TOLERANCE = 2e-6


def _check(name: str, got, ref, greedy: bool, vocab: int, reference_at=None) -> str:
    """dspec backends and every greedy run: exact equality with the torch reference, except
    that a sampled token may differ where it lies between the reference's draws with the
    uniform moved by -+``TIE_TOLERANCE`` (``reference_at(delta)``; a draw is monotone in u):
    a rounding tie, counted and named in the result.  torch_plain at T > 0: num_accepted
    (and path) and the accepted tokens must match; its final token comes from
    torch.multinomial, so only its range is checked."""
    n_g, n_r = got[0], ref[0]
    problems = []
    bad = int((n_g != n_r).sum())
    if bad:
        problems.append(f"num_accepted x{bad}")
    if len(ref) == 3:  # tree: path
        bad = int((got[1] != ref[1]).sum())
        if bad:
            problems.append(f"path x{bad}")
    t_g, t_r = got[-1], ref[-1]
    ties = ""
    if greedy or name != PLAIN:
        off = _rows_differ(t_g, t_r)
        if bool(off.any()) and not greedy and not problems and reference_at is not None:
            lo, hi = (tuple(reference_at(d)) for d in (-TIE_TOLERANCE, TIE_TOLERANCE))
            between = (torch.minimum(lo[-1], hi[-1]) <= t_g) & (t_g <= torch.maximum(lo[-1], hi[-1]))
            tied = off & between.reshape(between.shape[0], -1).all(-1)
            for i in range(len(got) - 1):  # the same acceptance (and path) at both ends
                tied &= ~_rows_differ(lo[i], got[i]) & ~_rows_differ(hi[i], got[i])
            if bool(tied.any()):
                ties = f" ({int(tied.sum())} rounding ties within {TIE_TOLERANCE:g} of u)"
                off &= ~tied
        bad = int(_rows_differ(t_g, t_r, per_element=True)[off].sum())
        if bad:
            problems.append(f"tokens x{bad}")
    elif not problems:
        pos = torch.arange(t_r.shape[1], device=t_r.device)[None, :]
        bad = int(((t_g != t_r) & (pos < n_r[:, None])).sum())
        if bad:
            problems.append(f"accepted tokens x{bad}")
        final = t_g.gather(1, n_g[:, None])
        if bool(((final < 0) | (final >= vocab)).any()):
            problems.append("final token out of range")
    return ("ok" + ties) if not problems else "MISMATCH " + ", ".join(problems) + ties


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ops", default="chain,tree", help="comma-separated subset of chain,tree (default both)")
    args = parser.parse_args(argv)
    device, bw = common.setup(args)
    import dspec
    from dspec.reference import verify as ref_verify

    ops = {("verify_" + o.strip().removeprefix("verify_")) for o in args.ops.split(",") if o.strip()}
    wanted = common.parse_backends(args.backends)
    fi, fi_reason = (
        (None, "flashinfer not requested (--backends)")
        if wanted is not None and FLASHINFER not in wanted
        else load_flashinfer(device)
    )
    backends = common.select(["torch", PLAIN] + common.available_backends(device, PROVIDED[1:]), wanted)
    if fi is not None:
        backends.append(FLASHINFER)
    reps, warmup = common.reps_for(args, device, default_gpu=20, default_cpu=5, quick=3)
    flush = not args.no_flush
    all_groups = groups(device, args.quick, ops)
    rec = common.Recorder(
        BENCH,
        args,
        device,
        bw,
        {
            "backends": list(backends),
            "reps": reps,
            "warmup": warmup,
            "flush_l2": flush,
            "logits": f"randn * 4, {LOGITS_DTYPE}",
            "modes": {
                "greedy": "T=0",
                "t1": "T=1, draft_probs=None (one-hot)",
                "t1_qbf16": "T=1, draft_probs bf16",
                "t1_qfp32": "T=1, draft_probs fp32",
            },
            "draft_probs": "softmax(target logits + N(0,1) noise)",
            "drafts": "target argmax for a random prefix of each row, random ids after",
            "tree": "parent of node i uniform among i-4..i-1; token = parent's argmax w.p. 0.6",
            "bytes": {
                "verify_chain": "B*(L+1)*V*itemsize + B*L*V*itemsize(draft_probs) if given",
                "verify_tree": "B*N*V*itemsize",
            },
            "flashinfer": "torch.softmax(logits/T, fp32) + draft_probs.float() + "
            "chain_speculative_sampling, timed together (T > 0 chain only; mode t1: "
            "one-hot fp32 draft_probs built outside the timing)",
        },
    )
    rec.payload["env"]["flashinfer"] = fi_reason or f"flashinfer {getattr(fi, '__version__', '?')}"
    print(f"backends: {backends}; {rec.payload['env']['flashinfer']}")
    print(f"{len(all_groups)} shape groups; reps={reps} warmup={warmup}", flush=True)

    for op, batch, size, vocab, modes in tqdm(all_groups, desc=BENCH, file=sys.stdout, mininterval=2):
        shape = f"B{batch} {'L' if op == 'verify_chain' else 'N'}{size} V{vocab}"
        try:
            if op == "verify_chain":
                logits, drafts, coins, uniforms = chain_inputs(batch, size, vocab, device, args.seed)
            else:
                logits, tree_tok, parents, coins, uniforms = tree_inputs(batch, size, vocab, device, args.seed)
        except RuntimeError as exc:
            rec.error(f"{op} {shape}: input allocation failed: {exc}")
            common.free_cuda(device)
            continue
        itemsize = logits.element_size()
        for mode in modes:
            temperature = _temperature(mode)
            greedy = temperature <= 0
            case = f"{shape} {mode}"
            q = None
            try:
                if op == "verify_chain" and mode in MODE_Q_DTYPE:
                    q = make_draft_probs(logits, size, MODE_Q_DTYPE[mode], args.seed)
            except RuntimeError as exc:
                rec.error(f"{op} {case}: draft_probs allocation failed: {exc}")
                continue
            nbytes = logits.numel() * itemsize + (q.numel() * q.element_size() if q is not None else 0)
            c_arg = None if greedy else coins
            u_arg = None if greedy else uniforms
            if op == "verify_chain":

                def reference(u=u_arg):
                    return ref_verify.verify_chain(
                        drafts, logits, draft_probs=q, temperature=temperature, coins=c_arg, sample_uniforms=u
                    )
            else:

                def reference(u=u_arg):
                    return ref_verify.verify_tree(
                        tree_tok, parents, logits, temperature=temperature, coins=c_arg, sample_uniforms=u
                    )

            def reference_at(delta):
                return reference((uniforms + delta).clamp(0.0, 1.0 - 2.0**-24))

            fns = {}
            for name in backends:
                if name == FLASHINFER:
                    if op != "verify_chain" or greedy:
                        continue  # flashinfer has no greedy chain / general tree verify here
                    try:
                        gen = torch.Generator(device=device).manual_seed(args.seed)
                        q_fi = (
                            q if q is not None else torch.nn.functional.one_hot(drafts.long(), vocab).float()
                        )  # built outside the timing
                        u_full = torch.rand(batch, size + 1, generator=gen, device=device)
                        fns[name] = flashinfer_chain_fn(fi, drafts.int(), logits, q_fi, temperature, u_full, gen)
                    except Exception as exc:  # noqa: BLE001
                        rec.payload["env"]["flashinfer_error"] = f"{type(exc).__name__}: {exc}"
                    continue
                if op == "verify_chain":
                    if name == PLAIN:
                        fns[name] = lambda: plain_chain(drafts, logits, q, temperature, c_arg)
                    else:
                        fns[name] = lambda name=name: dspec.verify_chain(
                            drafts,
                            logits,
                            draft_probs=q,
                            temperature=temperature,
                            coins=c_arg,
                            sample_uniforms=u_arg,
                            backend=name,
                        )
                else:
                    if name == PLAIN:  # the dspec reference is already the plain tree walk
                        continue
                    fns[name] = lambda name=name: dspec.verify_tree(
                        tree_tok,
                        parents,
                        logits,
                        temperature=temperature,
                        coins=c_arg,
                        sample_uniforms=u_arg,
                        backend=name,
                    )
            ref = None if args.no_check else reference()
            out_rows = []
            for name, fn in fns.items():
                try:
                    got = fn()  # also the first warm-up (Triton / flashinfer JIT compile here)
                    if name == FLASHINFER:
                        check = None  # its own RNG: not comparable token for token
                        mean_acc = float(((got >= 0).sum(-1) - 1).float().mean())
                    else:
                        got = tuple(got)
                        check = None if ref is None else _check(name, got, tuple(ref), greedy, vocab, reference_at)
                        mean_acc = float(got[0].float().mean())
                    t = common.time_fn(fn, device, reps=reps, warmup=warmup, flush=flush)
                except Exception as exc:  # noqa: BLE001 - one failing backend must not stop the run
                    if name == FLASHINFER:  # an optional anchor: note it, stop using it
                        rec.payload["env"]["flashinfer_error"] = f"{case}: {type(exc).__name__}: {exc}"
                        print(f"flashinfer failed, dropped: {exc!r}", file=sys.stderr)
                        backends.remove(FLASHINFER)
                    else:
                        rec.error(f"{op} {case} {name}: {type(exc).__name__}: {exc}")
                    common.free_cuda(device)
                    continue
                roof_us = nbytes / (rec.copy_GBs * 1e3)
                params = {
                    "B": batch,
                    ("L" if op == "verify_chain" else "N"): size,
                    "V": vocab,
                    "mode": mode,
                    "T": temperature,
                    "q_dtype": common.DTYPE_NAMES.get(q.dtype) if q is not None else None,
                }
                row = common.make_row(
                    op=op,
                    backend=name,
                    case=case,
                    params=params,
                    dtype=LOGITS_DTYPE,
                    timing=t,
                    bytes_moved=nbytes,
                    copy_GBs=rec.copy_GBs,
                    check=check,
                    extra={
                        "roofline_us": round(roof_us, 3),
                        "x_roofline": round(t["median_us"] / roof_us, 2),
                        "mean_accepted": round(mean_acc, 3),
                        "speedup_vs_plain": None,
                        "speedup_vs_flashinfer": None,
                    },
                )
                out_rows.append(row)
                by = {r["backend"]: r for r in out_rows}
                for r in out_rows:  # the same dicts as in rec.rows: updated in place
                    for base, field in ((PLAIN, "speedup_vs_plain"), (FLASHINFER, "speedup_vs_flashinfer")):
                        if base in by and r["median_us"] > 0:
                            r[field] = round(by[base]["median_us"] / r["median_us"], 2)
                rec.add([row])  # written per backend: a hung/killed later backend loses nothing
            q = ref = fns = None  # frees the tensors; not `del`: closures above read them
            common.free_cuda(device)
        logits = None  # frees the tensors; not `del`: closures above read them
        common.free_cuda(device)

    rec.finish(plot_kwargs={"panel_keys": ("op", "mode")}, no_plot=args.no_plot)
    cols = [
        "op",
        "case",
        "backend",
        "median_us",
        "p20_us",
        "p80_us",
        "GB_s",
        "x_roofline",
        "speedup_vs_torch",
        "speedup_vs_plain",
        "speedup_vs_flashinfer",
        "mean_accepted",
        "check",
    ]
    print(common.fmt_table(rec.rows, cols))
    print()
    print("\n".join(headline_lines(rec.payload)))
    return 1 if rec.payload["errors"] else 0


# --------------------------------------------------------------------------------------
# headline verdicts (also used by summarize.py)
# --------------------------------------------------------------------------------------
def _is(r: dict, key: tuple) -> bool:
    op, b, l, v, mode = key
    return r.get("op") == op and r.get("B") == b and r.get("L") == l and r.get("V") == v and r.get("mode") == mode


def headline_verdicts(payload: dict) -> list[dict]:
    """One entry per headline case x dspec kernel backend (or one 'not-measured' entry):
    {case, backend, median_us, x_roofline, speedup_vs_flashinfer, roofline, vs_flashinfer}."""
    rows = payload.get("results", [])
    env = payload.get("env", {})
    fi_env = env.get("flashinfer") or ""
    # why a headline case has no flashinfer row: a runtime error, not installed / not
    # requested, or (flashinfer loaded fine) that case simply did not get a flashinfer row
    fi_state = env.get("flashinfer_error") or (
        fi_env if "unavailable" in fi_env or "not requested" in fi_env else "no flashinfer row for this case"
    )
    out = []
    for key in (HEADLINE, HEADLINE_ALSO):
        case = f"B{key[1]} L{key[2]} V{key[3]} {key[4]}"
        hits = [r for r in rows if _is(r, key)]
        kernels = [r for r in hits if r["backend"] in KERNEL_BACKENDS]
        fi_row = next((r for r in hits if r["backend"] == FLASHINFER), None)
        if not kernels:
            why = "case not in this run" if not hits else "no triton/cuda row (CPU, or the kernel failed)"
            out.append(
                {
                    "case": case,
                    "backend": "-",
                    "median_us": None,
                    "x_roofline": None,
                    "speedup_vs_flashinfer": None,
                    "roofline": f"not-measured ({why})",
                    "vs_flashinfer": f"not-measured ({why})",
                    "flashinfer_us": fi_row["median_us"] if fi_row else None,
                }
            )
            continue
        for r in kernels:
            roof = "PASS" if r["x_roofline"] <= TARGET_X_ROOFLINE else "FAIL"
            if fi_row is None:
                vs = f"not-measured ({fi_state or 'no flashinfer row'})"
            else:
                vs = "PASS" if (r.get("speedup_vs_flashinfer") or 0) >= TARGET_VS_FLASHINFER else "FAIL"
            out.append(
                {
                    "case": case,
                    "backend": r["backend"],
                    "median_us": r["median_us"],
                    "x_roofline": r["x_roofline"],
                    "speedup_vs_flashinfer": r.get("speedup_vs_flashinfer"),
                    "roofline": roof,
                    "vs_flashinfer": vs,
                    "flashinfer_us": fi_row["median_us"] if fi_row else None,
                    "check": r.get("check"),
                }
            )
    return out


def headline_lines(payload: dict, markdown: bool = False) -> list[str]:
    bw = payload["bandwidth"]["copy_GBs"]
    title = (
        f"HEADLINE verify_chain B=64 L=16 V=151936 bf16 logits, T=1 with draft_probs "
        f"(copy BW {bw:.0f} GB/s; targets: >= {TARGET_VS_FLASHINFER}x faster than flashinfer "
        f"softmax + chain_speculative_sampling, <= {TARGET_X_ROOFLINE}x the roofline time)"
    )
    verdicts = headline_verdicts(payload)
    if markdown:
        lines = [
            f"## {title}",
            "",
            "| case | backend | median µs | x roofline | flashinfer µs | x vs flashinfer "
            "| roofline target | flashinfer target |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in verdicts:
            lines.append(
                "| "
                + " | ".join(
                    str("-" if v[k] is None else v[k])
                    for k in (
                        "case",
                        "backend",
                        "median_us",
                        "x_roofline",
                        "flashinfer_us",
                        "speedup_vs_flashinfer",
                        "roofline",
                        "vs_flashinfer",
                    )
                )
                + " |"
            )
        return lines + [""]
    lines = [title]
    for v in verdicts:
        if v["median_us"] is None:
            lines.append(f"  {v['case']}: roofline {v['roofline']}; vs flashinfer {v['vs_flashinfer']}")
        else:
            sp = v["speedup_vs_flashinfer"]
            lines.append(
                f"  {v['case']} {v['backend']}: {v['median_us']:.1f} us, "
                f"{v['x_roofline']}x roofline [{v['roofline']}], "
                f"{'-' if sp is None else sp}x vs flashinfer [{v['vs_flashinfer']}]  "
                f"check={v.get('check')}"
            )
    return lines


if __name__ == "__main__":
    sys.exit(main())
