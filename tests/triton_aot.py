"""Compile every Triton kernel ahead of time for real GPU targets (no GPU needed).

Run without TRITON_INTERPRET: the interpreter never lowers kernels, so type errors and
unsupported ops in the compiled path would otherwise only show up on a GPU machine.
Usage: python tests/triton_aot.py [sm ...]   (default: 80 90)
"""
import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dspec.kernels import boundary, token_stats, topk, verify  # noqa: E402

F32, I32, I64 = "*fp32", "*i32", "*i64"


def cases():
    for dt in ("*fp32", "*fp16", "*bf16"):
        for splits in (1, 4):
            yield (token_stats._token_stats_kernel,
                   dict(logits_ptr=dt, row_stride="i64", vocab="i32", cols_per_split="i32",
                        inv_t="fp32", part_f_ptr=F32, part_i_ptr=I32, token_ptr=I64, prob_ptr=F32,
                        margin_ptr=F32, entropy_ptr=F32, lse_ptr=F32),
                   dict(BLOCK=1024, NUM_SPLITS=splits), 4)
            for mass in (False, True):
                yield (topk._topk_kernel,
                       dict(logits_ptr=dt, row_stride="i64", vocab="i32", cols_per_split="i32",
                            inv_t="fp32", tau="fp32", part_key_ptr=I64, part_f_ptr=F32,
                            token_ptr=I64, val_ptr=F32, count_ptr=I64),
                       dict(K=32, KP=32, BLOCK=1024, NUM_SPLITS=splits, MASS=mass), 4)
    yield (token_stats._token_stats_merge_kernel,
           dict(part_f_ptr=F32, part_i_ptr=I32, inv_t="fp32", token_ptr=I64, prob_ptr=F32,
                margin_ptr=F32, entropy_ptr=F32, lse_ptr=F32),
           dict(NUM_SPLITS=5, SPLITS_PAD=8), 1)
    for mass in (False, True):
        yield (topk._topk_merge_kernel,
               dict(part_key_ptr=I64, part_f_ptr=F32, inv_t="fp32", tau="fp32", token_ptr=I64,
                    val_ptr=F32, count_ptr=I64),
               dict(K=17, KP=32, NUM_SPLITS=5, SPLITS_PAD=8, MASS=mass), 1)
    for dt in ("*fp32", "*bf16"):
        yield (boundary._boundary_kernel,
               dict(conf_ptr=dt, conf_stride="i64", batch="i32", length="i32", r_ptr=F32,
                    len_ptr=I64, rtop_ptr=F32, exp_ptr=F32),
               dict(K=4, ROWS=16, LP=128, WANT_R=True, WANT_TOP=True, WANT_EXP=True), 2)


    spec = dict(spec_row_ptr=I64, spec_qrow_ptr=I64, spec_mode_ptr=I32, spec_nex_ptr=I32,
                spec_excl_ptr=I64)
    for dt in ("*fp32", "*bf16"):
        for greedy, has_q in ((True, False), (False, False), (False, True)):
            yield (verify._chain_accept_kernel,
                   dict(draft_ptr=I64, draft_stride="i64", ndraft_ptr=I64, logits_ptr=dt,
                        vocab="i32", argmax_ptr=I64, prob_ptr=F32, q_ptr=dt, q_stride_b="i64",
                        q_stride_l="i64", coins_ptr=F32, length="i32", inv_t="fp32",
                        num_ptr=I64, out_ptr=I64, **spec, spec_pos_ptr=I64),
                   dict(LP=32, GREEDY=greedy, HAS_Q=has_q), 1)
        for greedy in (True, False):
            yield (verify._tree_walk_kernel,
                   dict(tok_ptr=I64, par_ptr=I64, nodes="i32", logits_ptr=dt, vocab="i32",
                        argmax_ptr=I64, prob_ptr=F32, coins_ptr=F32, inv_t="fp32", num_ptr=I64,
                        path_ptr=I64, out_ptr=I64, spec_row_ptr=I64, spec_mode_ptr=I32,
                        spec_nex_ptr=I32, spec_excl_ptr=I64, spec_pos_ptr=I64),
                   dict(EP=64, GREEDY=greedy), 1)
        for has_q in (False, True):
            draw = dict(logits_ptr=dt, vocab="i32", argmax_ptr=I64, prob_ptr=F32, q_ptr=dt,
                        inv_t="fp32", **spec)
            yield (verify._draw_tiles_kernel,
                   dict(draw, tile_w_ptr=F32, tile_p_ptr=F32, num_tiles="i32",
                        tiles_per_split="i32"),
                   dict(BLOCK=1024, EP=64, HAS_Q=has_q), 4)
            yield (verify._draw_pick_kernel,
                   dict(draw, spec_pos_ptr=I64, tile_w_ptr=F32, tile_p_ptr=F32, num_tiles="i32",
                        uniforms_ptr=F32, out_ptr=I64),
                   dict(BLOCK=1024, TP=256, EP=64, HAS_Q=has_q), 4)


def main(archs):
    n = 0
    for fn, sig, consts, warps in cases():
        signature = dict(sig, **{k: "constexpr" for k in consts})
        for arch in archs:
            src = ASTSource(fn=fn, signature=signature, constexprs=consts)
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": warps})
            assert compiled.asm.get("cubin"), fn.__name__
            n += 1
    print(f"compiled {n} kernel variants for sm_{'/sm_'.join(map(str, archs))}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [80, 90])
