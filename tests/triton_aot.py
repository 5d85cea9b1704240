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

from dspec.kernels import boundary, cascade_attention, pack_mask, token_stats, topk, tree_mask, verify  # noqa: E402

F32, I32, I64 = "*fp32", "*i32", "*i64"


def cases():
    for dt in ("*fp32", "*fp16", "*bf16"):
        for splits in (1, 4):
            yield (
                token_stats._token_stats_kernel,
                dict(
                    logits_ptr=dt,
                    row_stride="i64",
                    vocab="i32",
                    cols_per_split="i32",
                    inv_t="fp32",
                    part_f_ptr=F32,
                    part_i_ptr=I32,
                    token_ptr=I64,
                    prob_ptr=F32,
                    margin_ptr=F32,
                    entropy_ptr=F32,
                    lse_ptr=F32,
                ),
                dict(BLOCK=1024, GROUP=4 if dt == "*fp32" else 8, NUM_SPLITS=splits),
                4,
            )
            for mass in (False, True):
                yield (
                    topk._topk_kernel,
                    dict(
                        logits_ptr=dt,
                        row_stride="i64",
                        vocab="i32",
                        cols_per_split="i32",
                        inv_t="fp32",
                        tau="fp32",
                        part_key_ptr=I64,
                        part_f_ptr=F32,
                        token_ptr=I64,
                        val_ptr=F32,
                        count_ptr=I64,
                    ),
                    dict(K=32, KP=32, BLOCK=1024, NUM_SPLITS=splits, MASS=mass),
                    4,
                )
    yield (
        token_stats._token_stats_merge_kernel,
        dict(
            part_f_ptr=F32,
            part_i_ptr=I32,
            inv_t="fp32",
            token_ptr=I64,
            prob_ptr=F32,
            margin_ptr=F32,
            entropy_ptr=F32,
            lse_ptr=F32,
        ),
        dict(NUM_SPLITS=5, SPLITS_PAD=8),
        1,
    )
    for mass in (False, True):
        yield (
            topk._topk_merge_kernel,
            dict(part_key_ptr=I64, part_f_ptr=F32, inv_t="fp32", tau="fp32", token_ptr=I64, val_ptr=F32, count_ptr=I64),
            dict(K=17, KP=32, NUM_SPLITS=5, SPLITS_PAD=8, MASS=mass),
            1,
        )
    for dt in ("*fp32", "*bf16"):
        yield (
            boundary._boundary_kernel,
            dict(
                conf_ptr=dt,
                conf_stride="i64",
                batch="i32",
                length="i32",
                r_ptr=F32,
                len_ptr=I64,
                rtop_ptr=F32,
                exp_ptr=F32,
            ),
            dict(K=4, ROWS=16, LP=128, WANT_R=True, WANT_TOP=True, WANT_EXP=True),
            2,
        )

    spec = dict(spec_row_ptr=I64, spec_qrow_ptr=I64, spec_mode_ptr=I32, spec_nex_ptr=I32, spec_excl_ptr=I64)
    for dt in ("*fp32", "*bf16"):
        for greedy, has_q in ((True, False), (False, False), (False, True)):
            yield (
                verify._chain_accept_kernel,
                dict(
                    draft_ptr=I64,
                    draft_stride="i64",
                    ndraft_ptr=I64,
                    logits_ptr=dt,
                    vocab="i32",
                    argmax_ptr=I64,
                    prob_ptr=F32,
                    q_ptr=dt,
                    q_stride_b="i64",
                    q_stride_l="i64",
                    coins_ptr=F32,
                    length="i32",
                    inv_t="fp32",
                    num_ptr=I64,
                    out_ptr=I64,
                    **spec,
                    spec_pos_ptr=I64,
                ),
                dict(LP=32, GREEDY=greedy, HAS_Q=has_q),
                1,
            )
        for has_q in (False, True):  # the block rule: R_j sums, then the accept
            chain = dict(
                draft_ptr=I64,
                draft_stride="i64",
                ndraft_ptr=I64,
                logits_ptr=dt,
                vocab="i32",
                argmax_ptr=I64,
                prob_ptr=F32,
                q_ptr=dt,
                q_stride_b="i64",
                q_stride_l="i64",
            )
            yield (
                verify._chain_block_sums_kernel,
                dict(chain, length="i32", inv_t="fp32", r_ptr=F32),
                dict(BLOCK=1024),
                4,
            )
            yield (
                verify._chain_block_accept_kernel,
                dict(
                    chain,
                    coins_ptr=F32,
                    r_ptr=F32,
                    length="i32",
                    inv_t="fp32",
                    num_ptr=I64,
                    out_ptr=I64,
                    **spec,
                    spec_pos_ptr=I64,
                    scale_ptr=F32,
                ),
                dict(LP=32, HAS_Q=has_q),
                1,
            )
        for greedy in (True, False):
            yield (
                verify._tree_walk_kernel,
                dict(
                    tok_ptr=I64,
                    par_ptr=I64,
                    nodes="i32",
                    logits_ptr=dt,
                    vocab="i32",
                    argmax_ptr=I64,
                    prob_ptr=F32,
                    coins_ptr=F32,
                    inv_t="fp32",
                    num_ptr=I64,
                    path_ptr=I64,
                    out_ptr=I64,
                    spec_row_ptr=I64,
                    spec_mode_ptr=I32,
                    spec_nex_ptr=I32,
                    spec_excl_ptr=I64,
                    spec_pos_ptr=I64,
                ),
                dict(EP=64, GREEDY=greedy),
                1,
            )
        for wor in (False, True):
            yield (
                verify._tree_walk_q_kernel,
                dict(
                    tok_ptr=I64,
                    par_ptr=I64,
                    nodes="i32",
                    logits_ptr=dt,
                    vocab="i32",
                    argmax_ptr=I64,
                    prob_ptr=F32,
                    q_ptr=dt,
                    q_stride_b="i64",
                    q_stride_n="i64",
                    resid_ptr=F32,
                    coins_ptr=F32,
                    inv_t="fp32",
                    num_ptr=I64,
                    path_ptr=I64,
                    out_ptr=I64,
                    **spec,
                    spec_pos_ptr=I64,
                ),
                dict(EP=64, BLOCK=1024, WOR=wor),
                4,
            )
        # (HAS_Q, RESID, HAS_SCALE): p, q's residual, the tree walk's residual row, the block
        # rule's scaled residual
        for has_q, resid, scaled in (
            (False, False, False),
            (True, False, False),
            (False, True, False),
            (True, False, True),
        ):
            draw = dict(
                logits_ptr=dt,
                vocab="i32",
                argmax_ptr=I64,
                prob_ptr=F32,
                q_ptr=F32 if resid else dt,
                inv_t="fp32",
                **spec,
            )
            scale = dict(scale_ptr=F32) if scaled else {}
            flags = dict(HAS_Q=has_q, RESID=resid, HAS_SCALE=scaled, **({} if scaled else {"scale_ptr": None}))
            yield (
                verify._draw_tiles_kernel,
                dict(draw, tile_w_ptr=F32, tile_p_ptr=F32, num_tiles="i32", tiles_per_split="i32", **scale),
                dict(BLOCK=1024, EP=64, **flags),
                4,
            )
            yield (
                verify._draw_pick_kernel,
                dict(
                    draw,
                    spec_pos_ptr=I64,
                    tile_w_ptr=F32,
                    tile_p_ptr=F32,
                    num_tiles="i32",
                    uniforms_ptr=F32,
                    out_ptr=I64,
                    **scale,
                ),
                dict(BLOCK=1024, TP=256, EP=64, **flags),
                4,
            )
    # attention kernels are the slow ones to compile: bf16 (tensor cores) and fp32 (upcast)
    for dt in ("*bf16", "*fp32"):
        for splits, prefix, has_mask in ((1, True, True), (4, True, True)):
            for head_dim in (64, 128):
                yield (
                    cascade_attention._cascade_kernel,
                    dict(
                        q_ptr=dt,
                        k_ptr=dt,
                        v_ptr=dt,
                        pk_ptr=dt,
                        pv_ptr=dt,
                        indptr_ptr=I32,
                        table_ptr=I32,
                        mask_ptr=I32,
                        out_ptr=dt,
                        lse_ptr=F32,
                        part_o_ptr=F32,
                        part_lse_ptr=F32,
                        n="i32",
                        num_kv_heads="i32",
                        group="i32",
                        scale_log2="fp32",
                        chunk="i32",
                        sq_b="i32",
                        sq_n="i32",
                        sq_h="i32",
                        sk_b="i32",
                        sk_n="i32",
                        sk_h="i32",
                        sv_b="i32",
                        sv_n="i32",
                        sv_h="i32",
                        spk_page="i32",
                        spk_t="i32",
                        spk_h="i32",
                        spv_page="i32",
                        spv_t="i32",
                        spv_h="i32",
                        s_table="i32",
                        sm_b="i32",
                        sm_n="i32",
                    ),
                    dict(
                        HEAD_DIM=head_dim,
                        D_PAD=head_dim,
                        BLOCK_M=64 if dt == "*fp32" else 128,
                        BLOCK_N=32 if dt == "*fp32" else 64,
                        NUM_SPLITS=splits,
                        SUFFIX_PART=splits if splits > 1 else 0,
                        HAS_PREFIX=prefix,
                        PAGE_SIZE=16 if splits > 1 else 0,
                        HAS_MASK=has_mask,
                        WRITE_LSE=True,
                        UPCAST=dt == "*fp32",
                    ),
                    {"num_warps": 4 if dt == "*fp32" else 8, "num_stages": 2},
                )
        yield (
            cascade_attention._merge_parts_kernel,
            dict(part_o_ptr=F32, part_lse_ptr=F32, out_ptr=dt, lse_ptr=F32, num_rows="i32"),
            dict(HEAD_DIM=128, D_PAD=128, PARTS=5, BLOCK_R=16, WRITE_LSE=True),
            4,
        )
        yield (
            cascade_attention._merge_states_kernel,
            dict(oa_ptr=dt, la_ptr=F32, ob_ptr=dt, lb_ptr=F32, out_ptr=dt, lse_ptr=F32, num_rows="i32"),
            dict(HEAD_DIM=80, D_PAD=128, BLOCK_R=16),
            4,
        )

    for rows, words in ((16, 8), (128, 1)):
        yield (
            pack_mask._pack_mask_kernel,
            dict(mask_ptr="*u8", mask_stride="i64", rows="i32", num_keys="i32", num_words="i32", words_ptr=I32),
            dict(ROWS=rows, WORDS=words),
            4,
        )
    yield (
        pack_mask._unpack_mask_kernel,
        dict(words_ptr=I32, words_stride="i64", rows="i32", num_keys="i32", out_ptr="*u8"),
        dict(ROWS=16, KEYS=256),
        4,
    )
    for par in (I32, I64):
        for np_, wp, rounds, warps in ((256, 8, 8, 4), (64, 2, 6, 1), (1, 1, 0, 1)):
            yield (
                tree_mask._tree_mask_kernel,
                dict(par_ptr=par, par_stride="i64", nodes="i32", num_words="i32", words_ptr=I32, depth_ptr=I64),
                dict(NP=np_, WP=wp, ROUNDS=rounds),
                warps,
            )


def main(archs):
    n = 0
    for fn, sig, consts, warps in cases():
        signature = dict(sig, **{k: "constexpr" for k in consts})
        for arch in archs:
            src = ASTSource(fn=fn, signature=signature, constexprs=consts)
            compiled = triton.compile(
                src,
                target=GPUTarget("cuda", arch, 32),
                options=warps if isinstance(warps, dict) else {"num_warps": warps},
            )
            assert compiled.asm.get("cubin"), fn.__name__
            # the launch configs the host code picks must fit an A100's 163 KB of shared memory
            assert compiled.metadata.shared <= 163 * 1024, (fn.__name__, consts, compiled.metadata.shared)
            n += 1
    print(f"compiled {n} kernel variants for sm_{'/sm_'.join(map(str, archs))}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [80, 90])
