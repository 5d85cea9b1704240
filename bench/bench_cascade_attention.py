"""Benchmark dspec.cascade_attention (shared prefix + tree-masked suffix) against PyTorch SDPA and flashinfer.

Work per case: B requests, each with its own prefix of P cached KV rows (``prefix_k/v
[T, Hkv, D]`` back to back, ``prefix_indptr``) and N suffix tokens under a *tree* mask:
K + 1 = 4 branches of N/4 tokens that share nothing but the prefix (block-diagonal causal
within each branch).  The dense bool [N, N] tree mask is packed once, outside the timing,
with ``dspec.pack_mask`` and passed as int32 words [B, N, ceil(N/32)]
(one tree per request, here all equal).  bf16 on GPU, fp32 on CPU.

Variants (backend names):
  triton          dspec.cascade_attention(backend="triton", max_prefix_len=P_max): the public
                  op, its own fused-vs-split choice (the chosen num_splits is recorded)
  triton_unchecked  the same with dspec.config.validate_values = False: no value checks,
                  so no host synchronisation (what CUDA-graph capture and engines get)
  triton_fused    dspec.kernels.cascade_attention.cascade_attention_triton(num_splits=1)
  triton_split8   the same with num_splits=8 (--splits): split prefix + suffix part + merge
  torch           the dspec reference (small cases only: B*Hq*N*(P+N) <= 2^27 on GPU)
Baselines (not dspec; their K/V layout and masks are built outside the timing):
  sdpa_dense      one F.scaled_dot_product_attention over keys [prefix_b ; suffix_b] per
                  request ([B, Hkv, S, D], S = P_max + N rounded up to 16, padding masked),
                  additive float mask [B, 1, g*N, S]; GQA: the g = Hq/Hkv query heads of a
                  KV group are folded into the query rows ([B, Hkv, g*N, D], mask rows
                  repeated g times), so K/V are read per KV head, never repeat_interleave'd
  sdpa_branch     one SDPA call per branch over [prefix_b ; branch tokens] (causal within the
                  branch, explicit additive mask; GQA folded the same way): the prefix is
                  read once per branch, as when each branch is its own sequence
  flashinfer_mask   (CUDA, if importable) BatchPrefillWithRaggedKVCacheWrapper over ragged
                  KV [prefix_b ; suffix_b] with custom_mask (bool [N, P_b + N] per request,
                  packed by plan()): one launch, prefix + suffix under one mask
  flashinfer_cascade  (CUDA, if importable) two ragged wrappers, prefix (no mask, read in
                  place from prefix_k/v) and suffix (custom_mask = the tree), return_lse,
                  + flashinfer.cascade.merge_state: the two-level cascade composition
On CUDA SDPA may use the cuDNN / memory-efficient / flash kernels, never the math one
(it would materialise [B, Hq, N, S] scores).  flashinfer's plan() runs outside the timing.

Metrics: median / p20 / p80 µs; ``tflops`` = 4 * Hq * D * (N * sum_b P_b + B * nnz(tree)) /
time; roofline bytes = prefix K+V read once (2 T Hkv D itemsize) + suffix q, k, v, out
(B N (2 Hq + 2 Hkv) D itemsize; the packed mask, < 0.1 %, not counted); ``roofline_us`` =
bytes / measured copy bandwidth; ``x_roofline`` = median / roofline_us;
``speedup_vs_best_baseline`` = the fastest measured baseline of the case / this median.
Every output (dspec and baselines) is checked against a float32 SDPA computed request by
request (``check``: ok / MISMATCH; bf16 atol = rtol = 2e-2, fp32 1e-3).  Cases whose
baseline would need more than --mem-limit-gib (40) GiB of GPU memory are listed in
``skipped`` ("skipped: memory") instead of being run.

Headline (targets on an H100): the public op (``triton``) within 1.3x of the roofline at
every case with prefix >= 4096, and never slower than the best baseline at any grid point;
PASS / FAIL / not-measured, plus a fused-vs-split table (which schedule wins per case).

CPU suite (``--device cpu``, the default there; ``--suite kernel`` runs the grid above on
CPU tensors instead, e.g. the Triton interpreter with TRITON_INTERPRET=1): see
``main_cpu``: dspec's C++ kernel (backend "cpp", through ``CascadeAttentionPlan.run`` as the
model calls it) vs the dspec torch reference vs PyTorch SDPA with an additive float mask.

    python bench/bench_cascade_attention.py --device cpu --quick --threads 1
    python bench/bench_cascade_attention.py --device cpu --threads 1      # the full CPU grid
    python bench/bench_cascade_attention.py --device cuda --out /tmp/res
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from tqdm import tqdm

import common

BENCH = "cascade_attention"
OP = "cascade_attention"
AUTO, FUSED = "triton", "triton_fused"
UNCHECKED = "triton_unchecked"  # AUTO with dspec.config.validate_values = False (no host syncs)
REF = "torch"
SDPA_DENSE, SDPA_BRANCH = "sdpa_dense", "sdpa_branch"
FI_MASK, FI_CASCADE = "flashinfer_mask", "flashinfer_cascade"
BASELINES = (SDPA_DENSE, SDPA_BRANCH, FI_MASK, FI_CASCADE)
BRANCHES = 4  # K + 1 branches of N / 4 tokens
TARGET_X_ROOFLINE = 1.3  # at prefix >= 4096
ROOFLINE_MIN_PREFIX = 4096
TARGET_VS_BASELINE = 1.0  # never slower than the best baseline
REF_MAX_WORK = 1 << 27  # dspec torch reference only when B*Hq*N*(P+N) <= this (GPU)
PLOT_KWARGS = {"metric": "median_us", "panel_keys": ("heads", "prefix")}  # also summarize.py
HEADS_GPU = ((32, 8, 128), (16, 16, 64))
HEADS_CPU = ((4, 2, 64), (2, 2, 64))
RAGGED_GPU = (500, 32768, 4096, 1000, 16384, 2000, 8192, 24576)  # B = 8, N = 64
RAGGED_CPU = (200, 64, 131)  # B = 3, N = 16
for _name, _color in (
    (FUSED, "tab:cyan"),
    (UNCHECKED, "tab:gray"),
    (SDPA_DENSE, "tab:red"),
    (SDPA_BRANCH, "tab:pink"),
    (FI_MASK, "tab:brown"),
    (FI_CASCADE, "tab:purple"),
):
    common._COLORS.setdefault(_name, _color)


class _Stopped(Exception):
    """Raised by the SIGTERM handler (the suite's `timeout`): finish with what was measured."""


def _on_term(signum, frame):
    raise _Stopped(f"signal {signum}")


# --------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------
def cases(device: str, quick: bool) -> list[dict]:
    """Grid in run order: first head config first, then prefix 4096, 32768, 512 (the
    headline's prefix >= 4096 first), then the ragged case of that head config."""
    if device == "cuda":
        heads = HEADS_GPU[:1] if quick else HEADS_GPU
        prefixes = (4096, 32768) if quick else (4096, 32768, 512)
        batches = (1, 64) if quick else (1, 8, 64)
        ns = (64,) if quick else (16, 64, 128)
        ragged, ragged_n = RAGGED_GPU, 64
    else:
        heads = HEADS_CPU
        prefixes = (64, 256) if quick else (512, 2048)
        batches = (1, 2) if quick else (1, 4)
        ns = (8, 16) if quick else (16, 64)
        ragged, ragged_n = RAGGED_CPU, 16
    out = []
    for hq, hkv, d in heads:
        for p in prefixes:
            for b in batches:
                for n in ns:
                    out.append({"Hq": hq, "Hkv": hkv, "D": d, "B": b, "N": n, "lens": [p] * b})
        out.append({"Hq": hq, "Hkv": hkv, "D": d, "B": len(ragged), "N": ragged_n, "lens": list(ragged)})
    return out


def case_name(c: dict) -> str:
    lens = c["lens"]
    p = f"P{lens[0]}" if len(set(lens)) == 1 else f"Pragged{min(lens)}-{max(lens)}"
    return f"{c['Hq']}/{c['Hkv']}/{c['D']} B{c['B']} {p} N{c['N']}"


def tree_mask_dense(n: int, device) -> torch.Tensor:
    """bool [N, N]: BRANCHES branches of N / BRANCHES tokens, causal within a branch, none across."""
    i = torch.arange(n, device=device)
    br = i // max(1, n // BRANCHES)
    return (br[:, None] == br[None, :]) & (i[None, :] <= i[:, None])


def make_inputs(c: dict, dtype, device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    b, n, hq, hkv, d = c["B"], c["N"], c["Hq"], c["Hkv"], c["D"]
    lens = torch.tensor(c["lens"], dtype=torch.int64)
    indptr = torch.zeros(b + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    total = int(indptr[-1])

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    import dspec

    tree = tree_mask_dense(n, device)
    words = dspec.pack_mask(tree)[None].expand(b, n, -1).contiguous()  # one tree per request
    return {
        "q": rnd(b, n, hq, d),
        "k": rnd(b, n, hkv, d),
        "v": rnd(b, n, hkv, d),
        "pk": rnd(total, hkv, d),
        "pv": rnd(total, hkv, d),
        "indptr": indptr.to(device),
        "indptr_host": indptr.tolist(),
        "tree": tree,
        "words": words,
        "max_p": int(lens.max()),
        "total": total,
    }


def work(c: dict, tree: torch.Tensor) -> tuple[float, int]:
    """(flops, roofline bytes) of a case at itemsize 1 for the bytes (multiply by itemsize)."""
    b, n, hq, hkv, d = c["B"], c["N"], c["Hq"], c["Hkv"], c["D"]
    total = sum(c["lens"])
    flops = 4.0 * hq * d * (n * total + b * int(tree.sum()))
    nbytes = 2 * total * hkv * d + b * n * (2 * hq + 2 * hkv) * d
    return flops, nbytes


def _ceil16(x: int) -> int:
    return (x + 15) // 16 * 16


def mem_estimates(c: dict, itemsize: int, splits: int) -> dict:
    """Bytes each variant needs on top of nothing (inputs included), for the memory skip."""
    b, n, hq, hkv, d = c["B"], c["N"], c["Hq"], c["Hkv"], c["D"]
    g = hq // hkv
    total, max_p = sum(c["lens"]), max(c["lens"])
    inputs = (2 * total * hkv * d + b * n * (2 * hq + 2 * hkv) * d) * itemsize
    s_dense = _ceil16(max_p + n)
    length = max(1, n // BRANCHES)
    s_branch = _ceil16(max_p + length)
    auto = inputs + b * n * hq * (2 * splits + 2) * (d + 1) * 4
    return {
        AUTO: auto,
        UNCHECKED: auto,
        FUSED: inputs,
        "split": inputs + b * n * hq * (splits + 1) * (d + 1) * 4,
        REF: inputs + 4 * (hq * n * (max_p + n) * 4 + 2 * (max_p + n) * hq * d * 4),
        SDPA_DENSE: inputs
        + (2 * b * hkv * s_dense * d + b * g * n * s_dense) * itemsize
        + 2 * b * n * hq * d * itemsize,
        SDPA_BRANCH: inputs
        + BRANCHES * (2 * b * hkv * s_branch * d + b * g * length * s_branch) * itemsize
        + 2 * b * n * hq * d * itemsize,
        FI_MASK: inputs + 2 * (total + b * n) * hkv * d * itemsize + 2 * b * n * (max_p + n) + (256 << 20),
        FI_CASCADE: inputs + 4 * b * n * hq * (d + 1) * 4 + (256 << 20),
    }


# --------------------------------------------------------------------------------------
# the baselines (not dspec)
# --------------------------------------------------------------------------------------
def fold(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, N, Hq, D] -> [B, Hkv, N*g, D], row n*g + j = token n, query head kvh*g + j."""
    b, n, hq, d = q.shape
    g = hq // hkv
    return q.view(b, n, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, n * g, d)


def unfold(o: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of fold: [B, Hkv, N*g, D] -> [B, N, Hq, D]."""
    b, hkv, rows, d = o.shape
    g = rows // n
    return o.view(b, hkv, n, g, d).permute(0, 2, 1, 3, 4).reshape(b, n, hkv * g, d)


def _kv_layout(x: dict, which: str, tok: torch.Tensor, s_pad: int) -> torch.Tensor:
    """[B, Hkv, s_pad, D]: rows [0, P_b) the request's prefix, [P_max, P_max + len) ``tok``."""
    src = x["pk"] if which == "k" else x["pv"]
    b, length = tok.shape[0], tok.shape[1]
    out = src.new_zeros(b, s_pad, src.shape[1], src.shape[2])
    ip = x["indptr_host"]
    for i in range(b):
        out[i, : ip[i + 1] - ip[i]] = src[ip[i] : ip[i + 1]]
    out[:, x["max_p"] : x["max_p"] + length] = tok
    return out.permute(0, 2, 1, 3).contiguous()


def _additive_mask(x: dict, suffix_vis: torch.Tensor, g: int, s_pad: int, dtype) -> torch.Tensor:
    """[B, 1, g*L, s_pad] additive (0 / -inf) mask for the _kv_layout keys; suffix_vis [L, L]."""
    b, length = len(x["indptr_host"]) - 1, suffix_vis.shape[0]
    dev = suffix_vis.device
    vis = torch.zeros(b, length, s_pad, dtype=torch.bool, device=dev)
    lens = torch.tensor(x["indptr_host"], device=dev).diff()
    vis[:, :, : x["max_p"]] = (torch.arange(x["max_p"], device=dev)[None, :] < lens[:, None])[:, None, :]
    vis[:, :, x["max_p"] : x["max_p"] + length] = suffix_vis
    vis = vis.repeat_interleave(g, dim=1)[:, None]
    mask = torch.zeros(vis.shape, dtype=dtype, device=dev)
    return mask.masked_fill_(~vis, float("-inf"))


def build_sdpa_dense(x: dict, hkv: int, scale: float):
    q, n = x["q"], x["q"].shape[1]
    g = q.shape[2] // hkv
    s_pad = _ceil16(x["max_p"] + n)
    kd, vd = _kv_layout(x, "k", x["k"], s_pad), _kv_layout(x, "v", x["v"], s_pad)
    mask = _additive_mask(x, x["tree"], g, s_pad, q.dtype)

    def run():
        o = F.scaled_dot_product_attention(fold(q, hkv), kd, vd, attn_mask=mask, scale=scale)
        return unfold(o, n)

    return run


def build_sdpa_branch(x: dict, hkv: int, scale: float):
    q, n = x["q"], x["q"].shape[1]
    g = q.shape[2] // hkv
    length = max(1, n // BRANCHES)
    s_pad = _ceil16(x["max_p"] + length)
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    mask = _additive_mask(x, causal, g, s_pad, q.dtype)
    kvs = [
        (
            _kv_layout(x, "k", x["k"][:, r * length : (r + 1) * length], s_pad),
            _kv_layout(x, "v", x["v"][:, r * length : (r + 1) * length], s_pad),
        )
        for r in range(n // length)
    ]

    def run():
        qf = fold(q, hkv)  # branch r = folded rows [r*L*g, (r+1)*L*g)
        outs = [
            F.scaled_dot_product_attention(
                qf[:, :, r * length * g : (r + 1) * length * g], kd, vd, attn_mask=mask, scale=scale
            )
            for r, (kd, vd) in enumerate(kvs)
        ]
        return unfold(torch.cat(outs, dim=2), n)

    return run


SDPA_FUSED = ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION")


def sdpa_context(device: str, names: tuple[str, ...] = SDPA_FUSED):
    """On CUDA: the fused SDPA kernels ``names`` but never MATH (it materialises the
    [B, H, rows, S] scores).  Returns (context manager, description)."""
    import contextlib

    if device != "cuda":
        return contextlib.nullcontext(), "default (CPU)"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return contextlib.nullcontext(), "default (no torch.nn.attention)"
    names = tuple(n for n in names if hasattr(SDPBackend, n))
    return sdpa_kernel([getattr(SDPBackend, n) for n in names]), ",".join(names)


def load_flashinfer(device: str):
    """(module, None) or (None, "flashinfer unavailable: <reason>")."""
    if device != "cuda":
        return None, "flashinfer unavailable: CUDA only (device is cpu)"
    try:
        import flashinfer
        import flashinfer.cascade
        import flashinfer.prefill

        flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper
        flashinfer.cascade.merge_state
    except Exception as exc:  # noqa: BLE001 - any import/ABI failure just disables the baseline
        return None, f"flashinfer unavailable: {type(exc).__name__}: {exc}"
    return flashinfer, None


def _fi_plan(fi, qo_indptr, kv_indptr, hq, hkv, d, dtype, scale, **kw):
    import inspect

    ws = torch.empty(128 << 20, dtype=torch.uint8, device=qo_indptr.device)
    w = fi.prefill.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    params = inspect.signature(w.plan).parameters
    extra = {k: v for k, v in (("q_data_type", dtype), ("kv_data_type", dtype), ("sm_scale", scale)) if k in params}
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, **kw, **extra)
    return w, ws


def build_flashinfer_mask(fi, x: dict, hkv: int, scale: float):
    q, k, v = x["q"], x["k"], x["v"]
    b, n, hq, d = q.shape
    dev = q.device
    ip = x["indptr_host"]
    ks, vs, masks = [], [], []
    for i in range(b):
        p = ip[i + 1] - ip[i]
        ks += [x["pk"][ip[i] : ip[i + 1]], k[i]]
        vs += [x["pv"][ip[i] : ip[i + 1]], v[i]]
        masks.append(torch.cat([torch.ones(n, p, dtype=torch.bool, device=dev), x["tree"]], 1).flatten())
    kc, vc = torch.cat(ks), torch.cat(vs)
    qo_indptr = torch.arange(b + 1, device=dev, dtype=torch.int32) * n
    kv_lens = torch.tensor([ip[i + 1] - ip[i] + n for i in range(b)], dtype=torch.int32)
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), kv_lens.cumsum(0).int()]).to(dev)
    w, ws = _fi_plan(fi, qo_indptr, kv_indptr, hq, hkv, d, q.dtype, scale, custom_mask=torch.cat(masks))
    qf = q.reshape(b * n, hq, d)

    def run():
        return w.run(qf, kc, vc).view(b, n, hq, d)

    run.keep = (w, ws, kc, vc)
    return run


def build_flashinfer_cascade(fi, x: dict, hkv: int, scale: float):
    q, k, v = x["q"], x["k"], x["v"]
    b, n, hq, d = q.shape
    dev = q.device
    qo_indptr = torch.arange(b + 1, device=dev, dtype=torch.int32) * n
    w_pre, ws1 = _fi_plan(fi, qo_indptr, x["indptr"].int(), hq, hkv, d, q.dtype, scale, causal=False)
    tree_flat = x["tree"].flatten().repeat(b)
    w_suf, ws2 = _fi_plan(fi, qo_indptr, qo_indptr, hq, hkv, d, q.dtype, scale, custom_mask=tree_flat)
    qf, kf, vf = q.reshape(b * n, hq, d), k.reshape(b * n, hkv, d), v.reshape(b * n, hkv, d)
    merge = fi.cascade.merge_state

    def run():
        o1, s1 = w_pre.run(qf, x["pk"], x["pv"], return_lse=True)
        o2, s2 = w_suf.run(qf, kf, vf, return_lse=True)
        return merge(o1, s1, o2, s2)[0].view(b, n, hq, d)

    run.keep = (w_pre, w_suf, ws1, ws2)
    return run


# --------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------
def check_reference(x: dict, hkv: int, scale: float) -> torch.Tensor:
    """float32 SDPA request by request (keys [prefix_b ; suffix_b], bool mask): [B, N, Hq, D]."""
    q = x["q"]
    b, n, hq, d = q.shape
    g = hq // hkv
    out = torch.empty(b, n, hq, d, dtype=torch.float32, device=q.device)
    ip = x["indptr_host"]
    for i in range(b):
        p = ip[i + 1] - ip[i]
        keys = torch.cat([x["pk"][ip[i] : ip[i + 1]], x["k"][i]]).float().permute(1, 0, 2)[None]
        vals = torch.cat([x["pv"][ip[i] : ip[i + 1]], x["v"][i]]).float().permute(1, 0, 2)[None]
        vis = torch.cat([torch.ones(n, p, dtype=torch.bool, device=q.device), x["tree"]], 1)
        vis = vis.repeat_interleave(g, 0)[None, None]
        o = F.scaled_dot_product_attention(fold(q[i : i + 1].float(), hkv), keys, vals, attn_mask=vis, scale=scale)
        out[i] = unfold(o, n)[0]
    return out


def check(got: torch.Tensor, ref: torch.Tensor) -> tuple[str, float]:
    tol = 1e-3 if got.dtype == torch.float32 else 2e-2
    err = (got.float() - ref).abs()
    bad = ~(err <= tol + tol * ref.abs())
    max_err = float(err.nan_to_num(float("inf")).max()) if err.numel() else 0.0
    if bool(bad.any()):
        return f"MISMATCH x{int(bad.sum())} max|d|={max_err:.2e}", max_err
    return "ok", max_err


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=tuple(common.DTYPES), default=None, help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--splits", type=int, default=8, help="num_splits of the forced-split variant")
    parser.add_argument(
        "--mem-limit-gib",
        type=float,
        default=40.0,
        help="skip a variant whose estimated GPU memory exceeds this (default 40)",
    )
    parser.add_argument("--match", default=None, help="only the cases whose name contains this, e.g. '32/8/128 B64'")
    parser.add_argument(
        "--suite",
        choices=("auto", "cpu", "kernel"),
        default="auto",
        help="cpu: the C++ CPU kernel vs the torch reference and SDPA (main_cpu); "
        "kernel: the grid of the module docstring; auto: cpu on --device cpu",
    )
    parser.add_argument(
        "--threads",
        default=None,
        help="CPU suite: torch intra-op threads, which dspec's C++ kernel uses too (default: dspec's auto policy)",
    )
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.suite in ("auto", "cpu"):
        return main_cpu(args)
    device, bw = common.setup(args)
    import dspec
    from dspec import _backend

    dtype = common.DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    dname = common.DTYPE_NAMES[dtype]
    split = f"triton_split{args.splits}"
    common._COLORS.setdefault(split, "tab:olive")
    wanted = common.parse_backends(args.backends)
    has_triton = bool(common.available_backends(device, ("triton",)))
    if has_triton:
        from dspec.kernels import cascade_attention as ca_mod  # Triton imported only when used
    fi, fi_reason = (
        (None, "flashinfer not requested (--backends)")
        if wanted is not None and not ({FI_MASK, FI_CASCADE} & wanted)
        else load_flashinfer(device)
    )
    variants = (
        ([AUTO, UNCHECKED, FUSED, split] if has_triton else [])
        + [REF, SDPA_DENSE, SDPA_BRANCH]
        + ([FI_MASK, FI_CASCADE] if fi is not None else [])
    )
    variants = common.select(variants, wanted)
    reps, warmup = common.reps_for(args, device, default_gpu=20, default_cpu=5, quick=3)
    flush = not args.no_flush
    sdpa_ctx_factory = lambda: sdpa_context(device)
    sdpa_kernels = sdpa_context(device)[1]
    mem_limit = int(args.mem_limit_gib * 2**30) if device == "cuda" else None
    all_cases = [c for c in cases(device, args.quick) if not args.match or args.match in case_name(c)]
    triton_note = (
        None
        if has_triton
        else (
            "triton skipped: "
            + ("not installed" if not _backend.triton_available() else "CPU without TRITON_INTERPRET=1")
        )
    )
    rec = common.Recorder(
        BENCH,
        args,
        device,
        bw,
        {
            "variants": list(variants),
            "dtype": dname,
            "reps": reps,
            "warmup": warmup,
            "flush_l2": flush,
            "suffix_mask": f"tree: {BRANCHES} branches of N/{BRANCHES} tokens sharing only the prefix "
            "(block-diagonal causal); dense bool [N, N] packed with "
            "dspec.pack_mask outside the timing, passed to dspec "
            "as int32 words [B, N, ceil(N/32)] (one tree per request)",
            "dspec_args": f"max_prefix_len=P_max passed (no host sync); split variant num_splits={args.splits}",
            "flops": "4*Hq*D*(N*sum_b P_b + B*nnz(tree))",
            "roofline_bytes": "(2*T*Hkv*D + B*N*(2*Hq + 2*Hkv)*D) * itemsize: prefix K+V once + "
            "suffix q, k, v, out (mask not counted)",
            "sdpa": "GQA folded into query rows [B, Hkv, g*N, D]; additive float mask; K/V layout and "
            f"masks built outside the timing; kernels allowed: {sdpa_kernels}",
            "flashinfer": "mask: BatchPrefillWithRaggedKVCacheWrapper custom_mask over [prefix_b; "
            "suffix_b] (KV concatenated outside the timing); cascade: ragged prefix "
            "(no mask) + ragged suffix (custom_mask tree), return_lse, merge_state; "
            "plan() outside the timing",
            "check": "vs float32 SDPA request by request; bf16/fp16 atol=rtol=2e-2, fp32 1e-3",
            "torch_reference": f"only when B*Hq*N*(P_max+N) <= {REF_MAX_WORK} on GPU",
            "mem_limit_GiB": args.mem_limit_gib if device == "cuda" else None,
            "triton": triton_note,
        },
    )
    rec.payload["skipped"] = []
    rec.payload["env"]["flashinfer"] = fi_reason or f"flashinfer {getattr(fi, '__version__', '?')}"
    print(f"variants: {variants}; {rec.payload['env']['flashinfer']}" + (f"; {triton_note}" if triton_note else ""))
    print(f"{len(all_cases)} cases, {dname}; reps={reps} warmup={warmup}", flush=True)

    def skip(case, backend, reason):
        rec.payload["skipped"].append({"case": case, "backend": backend, "reason": reason})

    stopped = None
    old_handler = signal.signal(signal.SIGTERM, _on_term)
    try:
        for c in tqdm(all_cases, desc=BENCH, file=sys.stdout, mininterval=2):
            name = case_name(c)
            hkv = c["Hkv"]
            scale = c["D"] ** -0.5
            est = mem_estimates(c, dtype.itemsize, args.splits)
            if mem_limit is not None and est[FUSED] > mem_limit:
                for v in variants:
                    skip(name, v, f"skipped: memory (inputs {est[FUSED] / 2**30:.1f} GiB)")
                continue
            try:
                x = make_inputs(c, dtype, device, args.seed)
                ref = check_reference(x, hkv, scale) if not args.no_check else None
            except torch.cuda.OutOfMemoryError as exc:
                skip(name, "*", f"skipped: OOM building inputs ({str(exc)[:80]})")
                common.free_cuda(device)
                continue
            flops, nbytes1 = work(c, x["tree"])
            nbytes = nbytes1 * dtype.itemsize
            roof_us = nbytes / (rec.copy_GBs * 1e3)
            params = {
                "heads": f"{c['Hq']}/{c['Hkv']}/{c['D']}",
                "prefix": name.split()[2],
                "Hq": c["Hq"],
                "Hkv": c["Hkv"],
                "D": c["D"],
                "B": c["B"],
                "N": c["N"],
                "P": c["lens"][0] if len(set(c["lens"])) == 1 else "ragged",
                "P_min": min(c["lens"]),
                "P_max": max(c["lens"]),
                "P_total": sum(c["lens"]),
            }
            dspec_kw = dict(prefix_k=x["pk"], prefix_v=x["pv"], prefix_indptr=x["indptr"])
            case_rows: list[dict] = []
            ref_work = c["B"] * c["Hq"] * c["N"] * (x["max_p"] + c["N"])
            for v in list(variants):
                need = est.get("split" if v == split else v, 0)
                if mem_limit is not None and need > mem_limit:
                    skip(name, v, f"skipped: memory (est. {need / 2**30:.1f} GiB > {args.mem_limit_gib:g})")
                    continue
                if v == REF and device == "cuda" and ref_work > REF_MAX_WORK:
                    skip(name, v, "skipped: torch reference only on small cases")
                    continue
                extra = {"num_splits": None}
                ctx = None
                fn = None
                try:

                    def public_op():
                        return dspec.cascade_attention(
                            x["q"], x["k"], x["v"], x["words"], **dspec_kw, max_prefix_len=x["max_p"], backend="triton"
                        )

                    if v == AUTO:
                        fn = public_op
                        # record the split count the op chooses (spy on choose_splits once)
                        chosen = []
                        orig = ca_mod.choose_splits
                        ca_mod.choose_splits = lambda *a, **k: chosen.append(orig(*a, **k)) or chosen[-1]
                        try:
                            got = fn()
                        finally:
                            ca_mod.choose_splits = orig
                        extra["num_splits"] = chosen[-1] if chosen else None
                    elif v == UNCHECKED:

                        def fn():
                            was, dspec.config.validate_values = dspec.config.validate_values, False
                            try:
                                return public_op()
                            finally:
                                dspec.config.validate_values = was

                        got = fn()
                    elif v in (FUSED, split):
                        ns = 1 if v == FUSED else args.splits
                        extra["num_splits"] = ns

                        def fn(ns=ns):
                            return ca_mod.cascade_attention_triton(
                                x["q"],
                                x["k"],
                                x["v"],
                                x["words"],
                                x["pk"],
                                x["pv"],
                                x["indptr"],
                                None,
                                False,
                                max_prefix_len=x["max_p"],
                                num_splits=ns,
                            )

                        got = fn()
                    elif v == REF:

                        def fn():
                            return dspec.cascade_attention(
                                x["q"], x["k"], x["v"], x["words"], **dspec_kw, backend="torch"
                            )

                        got = fn()
                    elif v in (SDPA_DENSE, SDPA_BRANCH):
                        fn = (build_sdpa_dense if v == SDPA_DENSE else build_sdpa_branch)(x, hkv, scale)
                        ctx = sdpa_ctx_factory
                        try:
                            with ctx()[0]:
                                got = fn()
                        except RuntimeError as exc:  # e.g. cuDNN picked but failing: efficient only
                            if device != "cuda" or isinstance(exc, torch.cuda.OutOfMemoryError):
                                raise
                            rec.payload["env"]["sdpa_fallback"] = f"{name} {v}: {type(exc).__name__}: {str(exc)[:200]}"
                            ctx = lambda: sdpa_context(device, ("EFFICIENT_ATTENTION",))
                            with ctx()[0]:
                                got = fn()
                        extra["sdpa_kernels"] = ctx()[1]
                    else:
                        build = build_flashinfer_mask if v == FI_MASK else build_flashinfer_cascade
                        fn = build(fi, x, hkv, scale)
                        got = fn()  # also the JIT compile, untimed
                    chk, err = check(got, ref) if ref is not None else (None, None)
                    del got
                    if ctx is not None:
                        with ctx()[0]:
                            t = common.time_fn(fn, device, reps=reps, warmup=warmup, flush=flush)
                    else:
                        t = common.time_fn(fn, device, reps=reps, warmup=warmup, flush=flush)
                except torch.cuda.OutOfMemoryError as exc:
                    skip(name, v, f"skipped: OOM ({str(exc)[:80]})")
                    fn = None
                    common.free_cuda(device)
                    continue
                except _Stopped:
                    raise
                except Exception as exc:  # noqa: BLE001 - one failing variant must not stop the run
                    if v in (FI_MASK, FI_CASCADE):
                        rec.payload["env"][f"{v}_error"] = f"{name}: {type(exc).__name__}: {exc}"
                        print(f"{v} failed, dropped: {exc!r}", file=sys.stderr)
                        variants.remove(v)
                    else:
                        rec.error(f"{name} {v}: {type(exc).__name__}: {exc}")
                    fn = None
                    common.free_cuda(device)
                    continue
                med = t["median_us"]
                extra.update(
                    {
                        "roofline_us": round(roof_us, 3),
                        "x_roofline": round(med / roof_us, 2),
                        "tflops": round(flops / (med * 1e6), 3),
                        "max_abs_err": None if err is None else float(f"{err:.3g}"),
                        "best_baseline": None,
                        "speedup_vs_best_baseline": None,
                    }
                )
                row = common.make_row(
                    op=OP,
                    backend=v,
                    case=name,
                    params=params,
                    dtype=dname,
                    timing=t,
                    bytes_moved=nbytes,
                    copy_GBs=rec.copy_GBs,
                    check=chk,
                    extra=extra,
                )
                case_rows.append(row)
                base = [r for r in case_rows if r["backend"] in BASELINES]
                if base:
                    best = min(base, key=lambda r: r["median_us"])
                    for r in case_rows:  # the same dicts as in rec.rows: updated in place
                        r["best_baseline"] = best["backend"]
                        r["speedup_vs_best_baseline"] = round(best["median_us"] / r["median_us"], 2)
                rec.add([row])
                fn = None
                common.free_cuda(device)
            x = ref = None  # frees the tensors; not `del`: closures above read them
            common.free_cuda(device)
    except _Stopped as exc:
        stopped = f"stopped by {exc} after {len({r['case'] for r in rec.rows})} cases"
        print(f"[{BENCH}] {stopped}", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, old_handler)

    rec.finish(no_plot=args.no_plot or stopped is not None, plot_kwargs=PLOT_KWARGS)
    if stopped:
        rec.payload["complete"] = False
        rec.payload["stopped"] = stopped
        common.write_json(rec.path, rec.payload)
    cols = [
        "case",
        "backend",
        "num_splits",
        "median_us",
        "p20_us",
        "p80_us",
        "tflops",
        "x_roofline",
        "speedup_vs_best_baseline",
        "speedup_vs_torch",
        "check",
    ]
    print(common.fmt_table(rec.rows, cols))
    if rec.payload["skipped"]:
        print(
            f"\n{len(rec.payload['skipped'])} skipped: "
            + "; ".join(f"{s['case']} {s['backend']}: {s['reason']}" for s in rec.payload["skipped"][:12])
            + (" ..." if len(rec.payload["skipped"]) > 12 else "")
        )
    print()
    print("\n".join(headline_lines(rec.payload)))
    print()
    print("\n".join(fused_split_lines(rec.payload)))
    return 1 if rec.payload["errors"] else 0


# --------------------------------------------------------------------------------------
# headline and fused-vs-split table (also used by summarize.py)
# --------------------------------------------------------------------------------------
def _by_case(rows: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r.get("op") == OP:
            out.setdefault(r["case"], {})[r["backend"]] = r
    return out


def headline_verdicts(payload: dict) -> list[dict]:
    """Two verdicts: roofline (P_min >= 4096) and vs the best baseline (every case)."""
    groups = _by_case(payload.get("results", []))
    auto = {c: g[AUTO] for c, g in groups.items() if AUTO in g}
    out = []
    on_gpu = payload.get("env", {}).get("device") == "cuda"
    # roofline
    rl = {c: r for c, r in auto.items() if (r.get("P_min") or 0) >= ROOFLINE_MIN_PREFIX}
    if not auto:
        out.append(
            {
                "target": f"<= {TARGET_X_ROOFLINE}x roofline at prefix >= {ROOFLINE_MIN_PREFIX}",
                "verdict": "not-measured (no triton rows: CPU, or the kernel failed)",
                "detail": "",
            }
        )
    elif not rl:
        out.append(
            {
                "target": f"<= {TARGET_X_ROOFLINE}x roofline at prefix >= {ROOFLINE_MIN_PREFIX}",
                "verdict": f"not-measured (no case with prefix >= {ROOFLINE_MIN_PREFIX})",
                "detail": "",
            }
        )
    else:
        bad = {c: r for c, r in rl.items() if r["x_roofline"] > TARGET_X_ROOFLINE}
        worst = max(rl.items(), key=lambda kv: kv[1]["x_roofline"])
        out.append(
            {
                "target": f"<= {TARGET_X_ROOFLINE}x roofline at prefix >= {ROOFLINE_MIN_PREFIX}",
                "verdict": "PASS" if not bad else "FAIL",
                "detail": f"{len(rl) - len(bad)}/{len(rl)} cases within; worst {worst[0]}: "
                f"{worst[1]['x_roofline']}x ({worst[1]['median_us']:.1f} us, "
                f"{worst[1]['tflops']} TFLOP/s)",
            }
        )
    # vs the best baseline
    target = f">= {TARGET_VS_BASELINE:g}x the best baseline at every grid point"
    if not auto:
        out.append({"target": target, "verdict": "not-measured (no triton rows)", "detail": ""})
    else:
        with_base = {c: r for c, r in auto.items() if r.get("speedup_vs_best_baseline") is not None}
        no_base = len(auto) - len(with_base)
        if not with_base:
            out.append({"target": target, "verdict": "not-measured (no baseline rows)", "detail": ""})
        else:
            bad = {c: r for c, r in with_base.items() if r["speedup_vs_best_baseline"] < TARGET_VS_BASELINE}
            worst = min(with_base.items(), key=lambda kv: kv[1]["speedup_vs_best_baseline"])
            out.append(
                {
                    "target": target,
                    "verdict": "PASS" if not bad else "FAIL",
                    "detail": f"{len(with_base) - len(bad)}/{len(with_base)} cases at or above; "
                    f"worst {worst[0]}: {worst[1]['speedup_vs_best_baseline']}x vs "
                    f"{worst[1]['best_baseline']}"
                    + (f"; {no_base} case(s) without any baseline row" if no_base else ""),
                }
            )
    if not on_gpu:  # Triton interpreter / CPU timings say nothing about the kernel targets
        for v in out:
            if v["verdict"] in ("PASS", "FAIL"):
                v["detail"] = f"would be {v['verdict']}: {v['detail']}"
                v["verdict"] = "not-measured (CPU run)"
    mism = [
        f"{r['case']} {r['backend']}" for g in groups.values() for r in g.values() if r.get("check") not in (None, "ok")
    ]
    out.append(
        {
            "target": "correctness vs float32 SDPA",
            "verdict": "ok" if not mism else "MISMATCH",
            "detail": ("; ".join(mism[:6]) + (" ..." if len(mism) > 6 else ""))
            if mism
            else f"{sum(len(g) for g in groups.values())} rows checked",
        }
    )
    return out


def headline_lines(payload: dict, markdown: bool = False) -> list[str]:
    env = payload.get("env", {})
    bw = payload["bandwidth"]["copy_GBs"]
    dev = env.get("device_name", "?")
    note = "" if "H100" in str(dev) else f" (targets are set for an H100; this device: {dev})"
    title = (
        f"HEADLINE cascade_attention (tree mask, {payload.get('config', {}).get('dtype')}; copy BW "
        f"{bw:.0f} GB/s): dspec triton (auto) <= {TARGET_X_ROOFLINE}x roofline at prefix >= "
        f"{ROOFLINE_MIN_PREFIX}, never slower than the best baseline{note}"
    )
    verdicts = headline_verdicts(payload)
    extra = [f"flashinfer: {env.get('flashinfer')}"]
    for k in (FI_MASK, FI_CASCADE):
        if env.get(f"{k}_error"):
            extra.append(f"{k} error: {env[f'{k}_error']}")
    if payload.get("stopped"):
        extra.append(f"run {payload['stopped']}: verdicts cover the cases measured")
    if markdown:
        lines = [f"## {title}", "", "| target | verdict | detail |", "|---|---|---|"]
        lines += [f"| {v['target']} | **{v['verdict']}** | {v['detail'] or '-'} |" for v in verdicts]
        return lines + [""] + [f"- {e}" for e in extra] + [""]
    return [title] + [f"  {v['target']}: [{v['verdict']}] {v['detail']}" for v in verdicts] + [f"  {e}" for e in extra]


def fused_split_lines(payload: dict, markdown: bool = False) -> list[str]:
    """Per case: auto (its splits), auto without value checks, fused, forced split µs; which schedule wins;
    auto / best."""
    groups = _by_case(payload.get("results", []))
    header = [
        "case",
        "auto µs (splits)",
        "unchecked µs",
        "fused µs",
        "split µs (splits)",
        "winner",
        "auto / best forced",
    ]
    lines = []
    for case, g in groups.items():
        fused = g.get(FUSED)
        split = next((r for b, r in g.items() if b.startswith("triton_split")), None)
        auto = g.get(AUTO)
        unchecked = g.get(UNCHECKED)
        if not (fused or split or auto):
            continue
        forced = [r for r in (fused, split) if r]
        best = min(forced, key=lambda r: r["median_us"]) if forced else None
        winner = "-"
        if fused and split:
            winner = "fused" if fused["median_us"] <= split["median_us"] else "split"
        ratio = round(auto["median_us"] / best["median_us"], 2) if auto and best else None
        lines.append(
            [
                case,
                f"{auto['median_us']:.1f} ({auto.get('num_splits')})" if auto else "-",
                f"{unchecked['median_us']:.1f}" if unchecked else "-",
                f"{fused['median_us']:.1f}" if fused else "-",
                f"{split['median_us']:.1f} ({split.get('num_splits')})" if split else "-",
                winner,
                "-" if ratio is None else f"{ratio}",
            ]
        )
    title = "Fused (num_splits=1) vs split prefix + merge, per case (auto = the op's own choice)"
    if not lines:
        return [f"## {title}", "", "no triton rows", ""] if markdown else [f"{title}: no triton rows"]
    n_f = sum(1 for x in lines if x[5] == "fused")
    n_s = sum(1 for x in lines if x[5] == "split")
    summary = f"fused wins {n_f}, split wins {n_s} of {n_f + n_s} cases with both"
    if markdown:
        out = [
            f"## {title}",
            "",
            summary,
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" for _ in header) + "|",
        ]
        return out + ["| " + " | ".join(x) + " |" for x in lines] + [""]
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(header)]
    return [f"{title}: {summary}", "  ".join(h.rjust(w) for h, w in zip(header, widths))] + [
        "  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in lines
    ]


# --------------------------------------------------------------------------------------
# CPU suite: the C++ kernel vs the torch reference vs SDPA
# --------------------------------------------------------------------------------------
CPU_BENCH = "cascade_attention_cpu"
CPU_HEADS = ((9, 3, 64), (32, 8, 128))
CPU_PREFIXES = (0, 512, 2048, 8192)
CPU_NS = (1, 4, 16, 64)
CPU_BATCHES = (1, 8)
CPU_DTYPES = ("fp32", "bf16")
CPU_QUICK = {"heads": ((9, 3, 64),), "prefixes": (0, 256), "ns": (1, 16), "batches": (1, 2), "dtypes": ("fp32", "bf16")}
CPP, SDPA = "cpp", "sdpa"
CPU_VARIANTS = (CPP, REF, SDPA)
# targets (the lead's): at N = 16, prefix 2048 cpp >= 3x the reference and >= 1.5x SDPA;
# nowhere slower than either
CPU_TARGET_CASE = {"N": 16, "P": 2048}
CPU_TARGET_VS_REF, CPU_TARGET_VS_SDPA = 3.0, 1.5
CPU_PLOT_KWARGS = {"metric": "median_us", "panel_keys": ("heads", "dtype", "B")}
CPU_TIME_BUDGET_S = 0.25  # per variant and case: reps = budget / one call, within bounds
common._COLORS.setdefault(SDPA, "tab:red")


def cpu_cases(quick: bool) -> list[dict]:
    g = (
        CPU_QUICK
        if quick
        else {"heads": CPU_HEADS, "prefixes": CPU_PREFIXES, "ns": CPU_NS, "batches": CPU_BATCHES, "dtypes": CPU_DTYPES}
    )
    return [
        {"Hq": hq, "Hkv": hkv, "D": d, "B": b, "N": n, "P": p, "dtype": dt}
        for dt in g["dtypes"]
        for hq, hkv, d in g["heads"]
        for b in g["batches"]
        for p in g["prefixes"]
        for n in g["ns"]
    ]


def cpu_case_name(c: dict) -> str:
    return f"{c['Hq']}/{c['Hkv']}/{c['D']} B{c['B']} P{c['P']} N{c['N']}"


def cpu_inputs(c: dict, dtype, seed: int) -> dict:
    """q, k, v [B, N, H, D]; the prefix of every request as ragged rows [B*P, Hkv, D] +
    indptr (cpp and the reference) and as one [B, Hkv, P + N, D] key / value tensor with
    the suffix appended (SDPA); a causal suffix mask, packed [N, ceil(N/32)] (dspec) and
    additive [1, 1, N, P + N] in the inputs' dtype (SDPA)."""
    import dspec

    g = torch.Generator().manual_seed(seed)
    b, n, hq, hkv, d, p = c["B"], c["N"], c["Hq"], c["Hkv"], c["D"], c["P"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = rnd(b, n, hq, d), rnd(b, n, hkv, d), rnd(b, n, hkv, d)
    pk, pv = rnd(b * p, hkv, d), rnd(b * p, hkv, d)
    indptr = torch.arange(b + 1, dtype=torch.int64) * p
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    words = dspec.pack_mask(causal)
    kd = torch.cat([pk.view(b, p, hkv, d), k], 1).transpose(1, 2).contiguous()
    vd = torch.cat([pv.view(b, p, hkv, d), v], 1).transpose(1, 2).contiguous()
    vis = torch.cat([torch.ones(n, p, dtype=torch.bool), causal], 1)
    additive = torch.zeros(vis.shape, dtype=dtype).masked_fill_(~vis, float("-inf"))[None, None]
    return {
        "q": q,
        "k": k,
        "v": v,
        "pk": pk,
        "pv": pv,
        "indptr": indptr,
        "words": words,
        "q_sdpa": q.transpose(1, 2).contiguous(),
        "k_sdpa": kd,
        "v_sdpa": vd,
        "mask_sdpa": additive,
    }


def cpu_variant(name: str, c: dict, x: dict, dtype):
    """fn() for variant ``name`` (everything layer-independent built here, outside the timing)."""
    import dspec
    from dspec.ops.attention import CascadeAttentionPlan

    has_prefix = c["P"] > 0
    pre = dict(prefix_k=x["pk"], prefix_v=x["pv"], prefix_indptr=x["indptr"]) if has_prefix else {}
    if name == CPP:
        plan = CascadeAttentionPlan(
            c["B"],
            c["N"],
            c["Hq"],
            c["Hkv"],
            c["D"],
            dtype,
            "cpu",
            x["words"],
            prefix_indptr=x["indptr"] if has_prefix else None,
            backend="cpp",
        )
        args = (x["q"], x["k"], x["v"]) + ((x["pk"], x["pv"]) if has_prefix else ())
        return lambda: plan.run(*args)
    if name == REF:
        return lambda: dspec.cascade_attention(x["q"], x["k"], x["v"], x["words"], backend="torch", **pre)
    scale = c["D"] ** -0.5
    return lambda: F.scaled_dot_product_attention(
        x["q_sdpa"], x["k_sdpa"], x["v_sdpa"], attn_mask=x["mask_sdpa"], scale=scale, enable_gqa=True
    )


CPU_SETTLE_S = 0.05


def cpu_time(fn, quick: bool, reps: int | None = None, warmup: int | None = None) -> dict:
    """Median / p20 / p80 over ``reps`` calls (default: as many as fit CPU_TIME_BUDGET_S,
    5..200; quick 3..20)."""
    # the previous variant's thread pool (torch's OpenMP workers after the reference or
    # SDPA, dspec's after cpp) spins for a while after its last call and takes a core from
    # the next variant: the reference timed just before cpp made a 41 us cpp case read 70 us
    time.sleep(CPU_SETTLE_S)
    t0 = time.perf_counter()
    fn()  # warm-up (allocations, caches)
    one = time.perf_counter() - t0
    if reps is None:
        lo, hi = (3, 20) if quick else (5, 200)
        reps = int(min(hi, max(lo, CPU_TIME_BUDGET_S / max(one, 1e-9))))
    return common.time_fn(fn, "cpu", reps=reps, warmup=1 if warmup is None else warmup, flush=False)


def main_cpu(args) -> int:
    """The CPU grid: prefix 0 / 512 / 2048 / 8192 x N 1 / 4 / 16 / 64 x batch 1 / 8, heads
    (Hq, Hkv, D) = (9, 3, 64) and (32, 8, 128), fp32 and bf16 (--quick: a small subset).

    Variants: ``cpp`` = ``CascadeAttentionPlan.run`` with backend "cpp" (the plan built
    outside the timing, as the model builds it once per forward; ragged prefix rows);
    ``torch`` = ``dspec.cascade_attention(backend="torch")`` (the reference); ``sdpa`` =
    ``F.scaled_dot_product_attention(q [B, Hq, N, D], K / V [B, Hkv, P + N, D],
    attn_mask=additive [1, 1, N, P + N], enable_gqa=True)`` with its K / V layout and mask
    built outside the timing.  The suffix mask is causal.  Timings are the median (and
    p20 / p80) of as many calls as fit 0.25 s per variant and case (at least 5, at most 200;
    no cache flush: a model calls the op back to back); each output is checked against the
    reference (fp32 atol = rtol = 1e-4, bf16 2e-2).  Results: bench/results/cpu/
    cascade_attention_cpu.json and .png; the verdicts of the targets are printed at the end.
    """
    import dspec
    from dspec.cpu import apply_threads

    threads = apply_threads(args.threads)
    device, bw = common.setup(args)
    wanted = common.parse_backends(args.backends)
    variants = [v for v in CPU_VARIANTS if wanted is None or v in wanted]
    if CPP in variants and not common.available_backends("cpu", ("cpp",)):
        print("dspec._C is not built: no cpp rows", file=sys.stderr)
        variants.remove(CPP)
    all_cases = [
        c
        for c in cpu_cases(args.quick)
        if (not args.match or args.match in cpu_case_name(c)) and (args.dtype is None or c["dtype"] == args.dtype)
    ]
    rec = common.Recorder(
        CPU_BENCH,
        args,
        device,
        bw,
        {
            "variants": variants,
            "threads": threads,
            "cpp_isa": {
                "fp32": dspec._backend.extension().cascade_attention_isa(0, 64),
                "bf16": dspec._backend.extension().cascade_attention_isa(2, 64),
            }
            if dspec._backend.cpp_available()
            else None,
            "suffix_mask": "causal; dspec: packed int32 words [N, ceil(N/32)] shared by the batch",
            "cpp": "CascadeAttentionPlan(backend='cpp').run(q, k, v, prefix_k, prefix_v); plan built outside "
            "the timing; prefix ragged rows [B*P, Hkv, D] + indptr",
            "torch": "dspec.cascade_attention(backend='torch') (the reference), same inputs",
            "sdpa": "F.scaled_dot_product_attention(q [B,Hq,N,D], K/V [B,Hkv,P+N,D], additive mask "
            "[1,1,N,P+N] in the inputs' dtype, enable_gqa=True); layout and mask built outside the timing",
            "timing": (
                f"median of {args.reps} calls"
                if args.reps
                else f"median of as many calls as fit {CPU_TIME_BUDGET_S}s (5..200, quick 3..20)"
            )
            + "; no cache flush",
            "flops": "4*Hq*D*N*(P + (N+1)/2) per request (causal suffix)",
            "check": "vs the torch reference; fp32 atol=rtol=1e-4, bf16 2e-2",
            "targets": f"N={CPU_TARGET_CASE['N']} P={CPU_TARGET_CASE['P']}: cpp >= {CPU_TARGET_VS_REF}x torch, "
            f">= {CPU_TARGET_VS_SDPA}x sdpa; cpp never slower than either",
        },
    )
    print(f"{len(all_cases)} cases x {variants}; threads={threads}", flush=True)
    stopped = None
    old_handler = signal.signal(signal.SIGTERM, _on_term)
    try:
        for c in tqdm(all_cases, desc=CPU_BENCH, file=sys.stdout, mininterval=2):
            dtype = common.DTYPES[c["dtype"]]
            name = cpu_case_name(c)
            x = cpu_inputs(c, dtype, args.seed)
            flops = 4.0 * c["Hq"] * c["D"] * c["N"] * (c["P"] + (c["N"] + 1) / 2) * c["B"]
            nbytes = (
                (2 * c["B"] * (c["P"] + c["N"]) * c["Hkv"] + 2 * c["B"] * c["N"] * c["Hq"]) * c["D"] * dtype.itemsize
            )
            params = {
                "heads": f"{c['Hq']}/{c['Hkv']}/{c['D']}",
                "Hq": c["Hq"],
                "Hkv": c["Hkv"],
                "D": c["D"],
                "B": c["B"],
                "N": c["N"],
                "P": c["P"],
            }
            ref_out = None
            case_rows = []
            for v in (REF,) + tuple(w for w in variants if w != REF):
                try:
                    fn = cpu_variant(v, c, x, dtype)
                    got = fn()
                    if v == SDPA:
                        got = got.transpose(1, 2)
                    if v == REF:
                        ref_out = got.float()
                    if v not in variants:
                        continue
                    chk, err = "ok", 0.0
                    if ref_out is not None:
                        tol = 1e-4 if dtype == torch.float32 else 2e-2
                        diff = (got.float() - ref_out).abs()
                        err = float(diff.max()) if diff.numel() else 0.0
                        if bool((diff > tol + tol * ref_out.abs()).any()):
                            chk = f"MISMATCH max|d|={err:.2e}"
                    t = cpu_time(fn, args.quick, args.reps, args.warmup)
                except _Stopped:
                    raise
                except Exception as exc:  # noqa: BLE001 - one failing variant must not stop the run
                    rec.error(f"{name} {c['dtype']} {v}: {type(exc).__name__}: {exc}")
                    continue
                row = common.make_row(
                    op=OP,
                    backend=v,
                    case=name,
                    params=params,
                    dtype=c["dtype"],
                    timing=t,
                    bytes_moved=int(nbytes),
                    copy_GBs=rec.copy_GBs,
                    check=chk,
                    extra={
                        "gflops": round(flops / (t["median_us"] * 1e3), 2),
                        "max_abs_err": float(f"{err:.3g}"),
                        "speedup_vs_sdpa": None,
                    },
                )
                case_rows.append(row)
            sd = next((r for r in case_rows if r["backend"] == SDPA), None)
            for r in case_rows:
                if sd is not None and r["median_us"] > 0:
                    r["speedup_vs_sdpa"] = round(sd["median_us"] / r["median_us"], 2)
            rec.add(case_rows)
            x = None  # frees the tensors; not `del`: closures above read them
    except _Stopped as exc:
        stopped = f"stopped by {exc} after {len({(r['case'], r['dtype']) for r in rec.rows})} cases"
        print(f"[{CPU_BENCH}] {stopped}", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    rec.payload["verdicts"] = cpu_verdicts(rec.payload)
    rec.finish(no_plot=args.no_plot or stopped is not None, plot_kwargs=CPU_PLOT_KWARGS)
    if stopped:
        rec.payload["complete"] = False
        rec.payload["stopped"] = stopped
        common.write_json(rec.path, rec.payload)
    cols = [
        "case",
        "dtype",
        "backend",
        "median_us",
        "p20_us",
        "p80_us",
        "gflops",
        "speedup_vs_torch",
        "speedup_vs_sdpa",
        "check",
    ]
    print(common.fmt_table(rec.rows, cols))
    print()
    print("\n".join(cpu_headline_lines(rec.payload)))
    return 1 if rec.payload["errors"] else 0


def cpu_verdicts(payload: dict) -> list[dict]:
    """The CPU targets: at N=16, P=2048 cpp >= 3x torch and >= 1.5x sdpa (every heads /
    dtype / batch measured there); cpp at least as fast as each at every measured case."""
    rows = [r for r in payload.get("results", []) if r.get("op") == OP]
    cpp = {(r["case"], r["dtype"]): r for r in rows if r["backend"] == CPP}
    out = []
    at = {k: r for k, r in cpp.items() if r["N"] == CPU_TARGET_CASE["N"] and r["P"] == CPU_TARGET_CASE["P"]}
    for field, target, base in (
        ("speedup_vs_torch", CPU_TARGET_VS_REF, REF),
        ("speedup_vs_sdpa", CPU_TARGET_VS_SDPA, SDPA),
    ):
        name = f"cpp >= {target:g}x {base} at N={CPU_TARGET_CASE['N']}, P={CPU_TARGET_CASE['P']}"
        got = {k: r[field] for k, r in at.items() if r.get(field) is not None}
        if not got:
            out.append({"target": name, "verdict": "not-measured", "detail": ""})
            continue
        worst = min(got.items(), key=lambda kv: kv[1])
        out.append(
            {
                "target": name,
                "verdict": "PASS" if worst[1] >= target else "FAIL",
                "detail": f"{sum(v >= target for v in got.values())}/{len(got)} cases; worst "
                f"{worst[0][0]} {worst[0][1]}: {worst[1]}x",
            }
        )
    for field, base in (("speedup_vs_torch", REF), ("speedup_vs_sdpa", SDPA)):
        name = f"cpp never slower than {base}"
        got = {k: r[field] for k, r in cpp.items() if r.get(field) is not None}
        if not got:
            out.append({"target": name, "verdict": "not-measured", "detail": ""})
            continue
        worst = min(got.items(), key=lambda kv: kv[1])
        out.append(
            {
                "target": name,
                "verdict": "PASS" if worst[1] >= 1.0 else "FAIL",
                "detail": f"{sum(v >= 1.0 for v in got.values())}/{len(got)} cases; worst "
                f"{worst[0][0]} {worst[0][1]}: {worst[1]}x",
            }
        )
    mism = [f"{r['case']} {r['dtype']} {r['backend']}" for r in rows if r.get("check") not in (None, "ok")]
    out.append(
        {
            "target": "correctness vs the torch reference",
            "verdict": "ok" if not mism else "MISMATCH",
            "detail": "; ".join(mism[:6]) if mism else f"{len(rows)} rows checked",
        }
    )
    return out


def cpu_headline_lines(payload: dict) -> list[str]:
    env = payload.get("env", {})
    cfg = payload.get("config", {})
    title = (
        f"HEADLINE cascade_attention CPU ({env.get('device_name')}, {cfg.get('threads')} thread(s), "
        f"cpp tiles: {cfg.get('cpp_isa')})"
    )
    return [title] + [
        f"  {v['target']}: [{v['verdict']}] {v['detail']}" for v in payload.get("verdicts") or cpu_verdicts(payload)
    ]


if __name__ == "__main__":
    sys.exit(main())
