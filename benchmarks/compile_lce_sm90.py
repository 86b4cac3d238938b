"""Compile the LCE kernels and the matmul for sm_90 WITHOUT a GPU (triton.compile + ptxas -v) and print
registers, spills and shared memory per variant: a free check before spending device time.

    env -u TRITON_INTERPRET python -m benchmarks.compile_lce_sm90
"""

from __future__ import annotations

import sys


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget

    from benchmarks.compile_moe_sm90 import _ptxas_stats, _signature
    from hopperkern.lce import _kernels as K
    from hopperkern.lce import launch as L
    from hopperkern.lce import rl, sft
    from hopperkern.lce.sft import store_z_config
    from hopperkern.tuning import KernelConfig
    from hopperkern.matmul import _matmul_kernel

    failed = 0

    def comp(name, fn, vals, const, warps, stages, maxnreg=None):
        nonlocal failed
        sig, const, attrs = _signature(fn, vals, const)
        extra = {} if maxnreg is None else {"maxnreg": maxnreg}  # as the launch passes it
        try:
            k = triton.compile(triton.compiler.ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=warps, num_stages=stages, **extra))
            regs, spills = _ptxas_stats(k.asm["ptx"])
            print(f"ok   {name}: regs {regs} spills {spills} smem {k.metadata.shared // 1024}K")
        except Exception as exc:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

    N, V, H = 8192, 128256, 4096
    tiles = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 128, 8, 3)]
    for bn, bv, bk, w, st in tiles:
        for tma in (False, True):
            for fl in (False, True):
                tag = f"{bn}x{bv}x{bk} w{w} s{st} tma={int(tma)} flatten={int(fl)}"
                # STORE_Z (the 3-pass SFT forward: fp32 logits out, no entropy) runs with sft.store_z_config of
                # the tuned config: compiled once, for the tiles it keeps.
                cfg = KernelConfig(block_m=bn, block_n=bv, block_k=bk, num_warps=w, num_stages=st)
                # STORE_E (the 3-pass forwards without softcap: bf16 exponentials out), without the entropy and
                # with one reference logit per row (SFT, "e", E_REF, at 128 x 256: sft.store_e_config) and with the
                # entropy and per-tile maxima (log-probs and entropies, "et"). The stores
                # pick the label in their tiles below 128 x 256 (launch.label_by_mma); "-" is the no-grad forward.
                keeps = store_z_config(cfg) == cfg or (bn, bv, bk, w, st) == (128, 128, 64, 8, 4)
                for store in ("", "z", "e", "et") if keeps else ("", "e", "et"):
                    comp(f"lce_forward  {tag} store={store or '-'}", K.lce_forward_kernel,
                         dict(h_ptr="bf16", w_ptr="bf16", b_ptr="bf16", labels_ptr="i64", m_ptr="fp32",
                              s_ptr="fp32", t_ptr="fp32", sumz_ptr="fp32", zl_ptr="fp32",
                              z_ptr="bf16" if store[:1] == "e" else "fp32", mt_ptr="fp32", N=N, V=V,
                              H=H, S=17, tiles_per_split=30, stride_hn=H, stride_hk=1, stride_wv=H, stride_wk=1,
                              stride_zn=V, stride_mt=1024, softcap=1.0, inv_temp=1.0),
                         dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, GROUP_N=16, HAS_BIAS=False, SOFTCAP=False,
                              NEED_T=store in ("", "et"), NEED_SUMZ=False, FLATTEN=fl, H_TMA=tma, W_TMA=tma,
                              DOT_PRECISION="tf32", PICK_LABEL=bool(store) and bn * bv < L._LABEL_MMA_MIN_TILE,
                              LABEL_OUT=bool(store) and bn * bv < L._LABEL_MMA_MIN_TILE,
                              STORE_Z=store == "z",
                              STORE_E=store[:1] == "e", E_TMA=tma and store[:1] == "e", E_REF=store == "e",
                              E_OFFSET=L.E_OFFSET, E_CLAMP=L.E_CLAMP),
                         w, st)
                comp(f"lce_dlogits  {tag}", K.lce_dlogits_kernel,
                     dict(h_ptr="bf16", w_ptr="bf16", b_ptr="bf16", labels_ptr="i64", lse_ptr="fp64",
                          ent_ptr="fp32", gl_ptr="fp32", gp_ptr="fp32", ge_ptr="fp32", gz_ptr="fp32", d_ptr="bf16",
                          N=N, V=V, V_total=V, H=H, col_begin=0, ncols=8192, stride_hn=H, stride_hk=1, stride_wv=H,
                          stride_wk=1, stride_dn=8192, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                          softcap=1.0, inv_temp=1.0),
                     dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, GROUP_N=16, HAS_BIAS=False, SOFTCAP=False,
                          HAS_GL=False, HAS_GP=True, HAS_GE=True, HAS_GZ=False, NUM_PROGRAMS=132, FLATTEN=fl,
                          H_TMA=tma, W_TMA=tma, D_TMA=tma, DOT_PRECISION="tf32"),
                     w, st)
    # Softcap (launch.softcap_mode: 1 the exp form of tanh, 2 with its series near 0) in the no-grad forward and
    # the 4-pass backward at the widest tiles, TMA, flattened.
    bn, bv, bk, w, st = tiles[0]
    for mode in (1, 2):
        comp(f"lce_forward  {bn}x{bv}x{bk} w{w} s{st} tma=1 flatten=1 store=- softcap={mode}",
             K.lce_forward_kernel,
             dict(h_ptr="bf16", w_ptr="bf16", b_ptr="bf16", labels_ptr="i64", m_ptr="fp32", s_ptr="fp32",
                  t_ptr="fp32", sumz_ptr="fp32", zl_ptr="fp32", z_ptr="fp32", mt_ptr="fp32", N=N, V=V, H=H, S=17,
                  tiles_per_split=30, stride_hn=H, stride_hk=1, stride_wv=H, stride_wk=1, stride_zn=V,
                  stride_mt=1024, softcap=30.0, inv_temp=1.0),
             dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, GROUP_N=16, HAS_BIAS=False, SOFTCAP=mode,
                  NEED_T=True, NEED_SUMZ=False, FLATTEN=True, H_TMA=True, W_TMA=True,
                  DOT_PRECISION="tf32", PICK_LABEL=False, LABEL_OUT=False, STORE_Z=False, STORE_E=False,
                  E_TMA=False, E_REF=False, E_OFFSET=L.E_OFFSET, E_CLAMP=L.E_CLAMP),
             w, st)
        comp(f"lce_dlogits  {bn}x{bv}x{bk} w{w} s{st} tma=1 flatten=1 softcap={mode}", K.lce_dlogits_kernel,
             dict(h_ptr="bf16", w_ptr="bf16", b_ptr="bf16", labels_ptr="i64", lse_ptr="fp64", ent_ptr="fp32",
                  gl_ptr="fp32", gp_ptr="fp32", ge_ptr="fp32", gz_ptr="fp32", d_ptr="bf16", N=N, V=V, V_total=V, H=H,
                  col_begin=0, ncols=8192, stride_hn=H, stride_hk=1, stride_wv=H, stride_wk=1, stride_dn=8192,
                  ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=30.0, inv_temp=1.0),
             dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, GROUP_N=16, HAS_BIAS=False, SOFTCAP=mode, HAS_GL=False,
                  HAS_GP=True, HAS_GE=True, HAS_GZ=False, NUM_PROGRAMS=132, FLATTEN=True, H_TMA=True, W_TMA=True,
                  D_TMA=True, DOT_PRECISION="tf32"),
             w, st)
    # lce_label_mma_kernel in its shipped launch (launch._LABEL_MMA_*), at the forward's K steps.
    for bk in (64, 128):
        for tma in (False, True):
            for softcap in (0, 1, 2):
                comp(f"lce_label_mma {L._LABEL_MMA_ROWS}x{bk} w{L._LABEL_MMA_WARPS} s{L._LABEL_MMA_STAGES} "
                     f"tma={int(tma)} softcap={softcap}", K.lce_label_mma_kernel,
                     dict(h_ptr="bf16", w_ptr="bf16", b_ptr="bf16", labels_ptr="i64", zlab_ptr="fp32", N=N, V=V, H=H,
                          stride_hn=H, stride_hk=1, stride_wv=H, stride_wk=1, softcap=30.0, inv_temp=1.0),
                     dict(BLOCK_N=L._LABEL_MMA_ROWS, BLOCK_K=bk, HAS_BIAS=bool(softcap), SOFTCAP=softcap, H_TMA=tma,
                          DOT_PRECISION="tf32"), L._LABEL_MMA_WARPS, L._LABEL_MMA_STAGES)
    for softcap in (False, True):
        comp(f"lce_onehot   softcap={int(softcap)}", K.lce_onehot_kernel,
             dict(labels_ptr="i64", lse_ptr="fp64", ent_ptr="fp32", gl_ptr="fp32", gp_ptr="fp32", ge_ptr="fp32",
                  gz_ptr="fp32", logprob_ptr="fp32", d_ptr="bf16", N=N, V_total=V, col_begin=0, ncols=8192,
                  stride_dn=8192, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=30.0, inv_temp=1.0),
             dict(BLOCK_N=128, SOFTCAP=softcap, HAS_GL=True, HAS_GP=True, HAS_GE=True, HAS_GZ=True), 4, 1)
    warps = sft.DLOGITS_WARPS  # the shipped warps of the three d(logits) passes below
    for tma in (False, True):
        for softcap in (False, True):
            bn, bv = sft._DLOGITS_BLOCKS  # the shipped tiles
            comp(f"lce_sft_dlogits {bn}x{bv} w{warps} tma={int(tma)} softcap={int(softcap)}",
                 K.lce_sft_dlogits_kernel,
                 dict(z_ptr="fp32", labels_ptr="i64", lse_ptr="fp64", logprob_ptr="fp32", scale_ptr="fp32",
                      d_ptr="bf16", N=512, V=V, stride_zn=V, stride_dn=V, ignore_index=-100, label_smoothing=0.0,
                      z_loss=0.0, softcap=30.0, inv_temp=1.0),
                 dict(BLOCK_N=bn, BLOCK_V=bv, SOFTCAP=softcap, Z_TMA=tma, D_TMA=tma), warps, 1)
    # The 3-pass SFT path's launches beside its forward over exponentials (sft._forward_exp, sft._row_scaled).
    comp(f"lce_sft_rowscale {sft._ROWSCALE_BLOCK}", K.lce_sft_rowscale_kernel,
         dict(e_ptr="bf16", rho_ptr="fp32", ref_ptr="fp32", labels_ptr="i64", lse_ptr="fp64", logprob_ptr="fp32",
              scale_ptr="fp32", lab_ptr="fp32", N=N, V=V, stride_en=V, ignore_index=-100, z_loss=0.0,
              inv_temp=1.0),
         dict(BLOCK=sft._ROWSCALE_BLOCK, E_OFFSET=L.E_OFFSET, E_CLAMP=L.E_CLAMP, SPLIT_LABEL=True), 4, 1)
    bn, bh = sft._SCALE_TILES
    comp(f"lce_sft_dhidden {bn}x{bh}", K.lce_sft_dhidden_kernel,
         dict(acc_ptr="fp32", rho_ptr="fp32", lab_ptr="fp32", labels_ptr="i64", w_ptr="bf16", g_ptr="fp32",
              out_ptr="bf16", N=N, V=V, H=H, stride_an=H, stride_wv=H, stride_wk=1, stride_on=H),
         dict(BLOCK_N=bn, BLOCK_H=bh, HAS_G=True), 4, 1)
    comp(f"lce_label_sums {sft._LABEL_SUMS_BLOCK}x{sft._LABEL_SUMS_STEP}", K.lce_label_sums_kernel,
         dict(off_ptr="i64", perm_ptr="i64", lab_ptr="fp32", out_ptr="fp32", V=V),
         dict(BLOCK=sft._LABEL_SUMS_BLOCK, STEP=sft._LABEL_SUMS_STEP), 4, 1)
    bn, bv = sft._ROWS_TILES
    comp(f"lce_sft_rows {bn}x{bv}x64", K.lce_sft_rows_kernel,
         dict(h_ptr="bf16", w_ptr="bf16", b_ptr="bf16", d_ptr="bf16", ref_ptr="fp32", labels_ptr="i64",
              lse_ptr="fp64", logprob_ptr="fp32", scale_ptr="fp32", N=N, V=V, H=H, stride_hn=H, stride_hk=1,
              stride_wv=H, stride_wk=1, stride_dn=V, ignore_index=-100, z_loss=0.0, inv_temp=1.0),
         dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=64, HAS_BIAS=False, DOT_PRECISION="tf32", E_OFFSET=L.E_OFFSET,
              E_CLAMP=L.E_CLAMP), 4, 1)
    bn, bh = sft._SCALE_TILES
    comp(f"lce_row_scale {bn}x{bh}", K.lce_row_scale_kernel,
         dict(x_ptr="bf16", rho_ptr="fp32", out_ptr="bf16", N=N, H=H, stride_xn=H, stride_xk=1, stride_on=H),
         dict(BLOCK_N=bn, BLOCK_H=bh), 4, 1)
    for tma in (False, True):
        bn, bv = rl._BLOCKS  # the shipped tiles
        comp(f"lce_exp_dlogits {bn}x{bv} w{warps} tma={int(tma)}", K.lce_exp_dlogits_kernel,
             dict(d_ptr="bf16", out_ptr="bf16", mt_ptr="fp32", labels_ptr="i64", lse_ptr="fp64", ent_ptr="fp32",
                  gl_ptr="fp32", gp_ptr="fp32", ge_ptr="fp32", gz_ptr="fp32", logprob_ptr="fp32", N=512, V=V,
                  stride_dn=V, stride_on=V, stride_mt=1024, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, inv_temp=1.0),
             dict(BLOCK_N=bn, BLOCK_V=bv, FWD_BLOCK_V=256, HAS_GL=False, HAS_GP=True, HAS_GE=True, HAS_GZ=False,
                  D_TMA=tma, APPROX_MATH=True), warps, 1, maxnreg=rl._EXP_MAXNREG)
    # lce_dweight_kernel in its shipped launch shapes (sft.DW_TILES*: the 3-pass path; sft.DW_SPLIT_TILES*: the
    # chunked variant's split launches, SPLIT 1 storing a chunk's product and 2 adding it to the sum) and the
    # one-program-a-tile, whole-epilogue shapes beside them (the split epilogue's spills at 128 x 256).
    whole = dict(epi_sub=1, persistent=False, flatten=False)
    plain = [sft.DW_TILES, sft.DW_TILES_NARROW, sft.DW_TILES._replace(**whole)]
    split = [sft.DW_SPLIT_TILES, sft.DW_SPLIT_TILES_NARROW, sft.DW_SPLIT_TILES._replace(**whole)]
    for kind, shapes in (("plain", plain), ("split", split)):
        for t in shapes:
            for tma in (False, True) if kind == "plain" else (True,):
                for s in (0,) if kind == "plain" else (1, 2):
                    # With the label terms (bf16 exponentials) on the shipped shapes; fp32 d(logits) without.
                    for labels in (False, True) if t.persistent else (False,):
                        o_tma = tma and t.epi_tma
                        comp(f"lce_dweight {kind} split={s} {t.block_v}x{t.block_h}x{t.block_k} w{t.warps} "
                             f"s{t.stages} epi_sub={t.epi_sub} persistent={int(t.persistent)} "
                             f"flatten={int(t.flatten)} tma={int(tma)} epi_tma={int(o_tma)} labels={int(labels)}",
                             K.lce_dweight_kernel,
                             dict(d_ptr="bf16", h_ptr="bf16", g_ptr="fp32", out_ptr="i16" if s else "bf16",
                                  lo_ptr="i16" if s else "bf16", r_ptr="bf16", labels_ptr="i64", perm_ptr="i64",
                                  off_ptr="i64", lab_ptr="fp32", N=5504, V=V, H=H, stride_dn=V, stride_hn=H,
                                  stride_hk=1, stride_on=H, stride_rn=H, stride_rk=1),
                             dict(BLOCK_V=t.block_v, BLOCK_H=t.block_h, BLOCK_K=t.block_k, GROUP_V=t.group,
                                  D_TMA=tma, H_TMA=tma, O_TMA=o_tma, DOT_PRECISION="tf32", SPLIT=s,
                                  EPI_SUB=t.epi_sub, NUM_PROGRAMS=132 if t.persistent else 0, FLATTEN=t.flatten,
                                  HAS_LABELS=labels), t.warps, t.stages)
    for mean in (False, True):
        comp(f"lce_loss_scale mean={int(mean)}", K.lce_loss_scale_kernel,
             dict(labels_ptr="i64", scale_ptr="fp32", N=8192, ignore_index=-100), dict(MEAN=mean, BLOCK=4096), 8, 3)
    for has_scale in (False, True):
        for share in (False, True):
            comp(f"lce_loss_total scale={int(has_scale)} share={int(share)}", K.lce_loss_total_kernel,
                 dict(loss_ptr="fp32", scale_ptr="fp32", out_ptr="fp32", share_ptr="fp32", N=8192),
                 dict(HAS_SCALE=has_scale, SHARE=share, BLOCK=4096), 8, 3)
    comp("lce_split_finalize 1024", K.lce_split_finalize_kernel,
         dict(hi_ptr="i16", lo_ptr="i16", g_ptr="fp32", out_ptr="bf16", n=V * H), dict(BLOCK=sft._FINALIZE_BLOCK), 4, 1)
    for tma in (False, True):
        comp(f"matmul 64x64x32 tma={int(tma)}", _matmul_kernel,
             dict(a_ptr="bf16", b_ptr="bf16", c_ptr="bf16", M=1024, N=1024, K=1024, stride_am=1024, stride_ak=1,
                  stride_bk=1024, stride_bn=1, stride_cm=1024, stride_cn=1),
             dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, A_TMA=tma, B_TMA=tma, C_TMA=tma,
                  DOT_PRECISION="tf32"), 4, 3)
    print(f"compile_lce_sm90: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
