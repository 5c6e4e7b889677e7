"""The kernels' launch shapes: one table, read by every entry point at each call (``kernels.CONFIG`` is this
dict: ``miles-lp bench quantize --sweep`` and ``selfcheck --config`` change it in place).

Each entry records why it holds these values: the H200 measurements that chose them and the byte-identity check
run with exactly them.
"""

# Launch shapes: the fastest of `miles-lp bench quantize --sweep` on the H200 (2026-12-01, run 2, commit
# 7deb728, [16384, 8192] bf16; byte identity re-checked with exactly these: selfcheck --config). MXFP8 tiles are
# [32*BMB, 32*NB]; NVFP4 tiles [TA*TB, 16*NB]; ROWS = rows per program of the one-pass per-token kernel.
CONFIG = {
    # rowwise only (the codec hook, QuantLinear's qdq operand): STV 16 and FULL 1 (no load / store masks where the
    # tiles cover x), 12-01d run 1: 109.9 us against 111.0 for the 12-01c form in the same sweep, bench rows
    # rowwise 0.109 ms (0.91 of copy), qdq rowwise 0.196 ms (0.206 in 12-01c run 3)
    "mxfp8": {"BMB": 1, "NB": 8, "num_warps": 2, "STV": 16, "FULL": 1},
    # columnwise only: the 12-01c launch (the same SASS as then). With the rowwise entry's STV 16 / FULL 1 it
    # measured 0.141 ms against 0.106-0.111 in 12-01c (12-01d run 1, when one entry served both).
    "mxfp8_col": {"BMB": 1, "NB": 8, "num_warps": 2, "FULL": 0},
    # rowwise + columnwise in one pass. STV 16 (12-01d): the E4M3 tiles leave as 16-byte stores straight from
    # registers (the load then takes 16 elements per thread to match: no shared-memory re-layout; offline
    # sm_90 SASS at 32x256 / 2 warps 13.8 -> 12.9 per element, 16 -> 12 barriers, 46/42 -> 30/25 STS/LDS,
    # 168 registers with the cap, no spill). maxnreg: ptxas' cap, applied only without the decode outputs.
    # H200 12-01d run 1 sweep: 156.4 us against 159.5 for the 12-01c form (STV 0) in the same list; FULL 1 159.2
    # (the cap then spills 16 bytes); 1-warp 32x128 tiles 166-177. Bench row 0.155 ms, 0.86 of copy.
    "mxfp8_both": {"BMB": 1, "NB": 8, "num_warps": 2, "STV": 16, "maxnreg": 168, "FULL": 0},
    # (an "STV": 8 entry in either: the E4M3 tiles stored from the load's layout, 8-byte stores, no shared-memory
    # re-layout: offline sm_90 SASS of 32x256 / 2 warps row+col 13.8 -> 13.1 per element, 16 -> 6 barriers,
    # but 168 -> 239 registers (4 programs per SM instead of 6). H200 12-01c run 3: row+col slower, 168.7 vs
    # 158.9 us; rowwise 111.0 vs 111.9 us (noise); byte-identical; off.)
    "mxfp8_dq": {"BMB": 1, "NB": 8, "num_warps": 8},
    "nvfp4": {"TA": 16, "NB": 16, "num_warps": 2},
    "nvfp4_2d": {"TA": 2, "NB": 8, "num_warps": 2},
    "nvfp4_rows": {"ROWS": 1, "NB": 32, "num_warps": 1},  # rows longer than nvfp4_rows_reg.max_k: two loops
    # a whole row in registers, one read. Quantize only: 64 elements per thread, 0.144-0.145 vs 0.148-0.149 ms
    # (32) at [16384, 8192] in three runs; with the decode output (qdq, QuantLinear's per-token x) 64 was slower,
    # 0.415 vs 0.274 ms (12-01b run 3), so qdq keeps 32. Bytes checked by selfcheck with each as the default.
    "nvfp4_rows_reg": {"max_k": 16384, "el_per_thread": 64, "el_per_thread_dq": 32},
    # bf16 per-token rows read as int32 pairs (nvfp4_rows_pairs_kernel; rows up to nvfp4_rows_reg.max_k):
    # 19.1 SASS instructions per element at 64 elements/thread against the kernel above's 25.2 (offline
    # count, `python -m miles_lp.formats.kernels.sass`); RS rows per program, the next one's load in flight.
    # The sweep of 12-01c run 1 (42f2f46, [16384, 8192] bf16): quantize 64 el/thread, RS 1: 108.5 us with
    # EVICT (evict-first loads, streaming stores), 109.4 without (noise); 32: 115.7; RS 2 slower. qdq: 32
    # el/thread 165.9 us, 64: 175.6, RS 2: 209.8. Run 2 (e7615b2): ptxas capped at 80 registers (16 bytes of
    # spill, 6 programs per SM instead of 5) 106.5 us against 108.9 uncapped; the qdq form gains nothing from
    # the cap (166.7 us either way). Bytes checked with exactly these (selfcheck --config, both runs).
    # ENC 1 (12-01d): one clamp fewer in the E2M1 encode (min(|y|, 6); the sign from y, whose NaN is the GPU
    # multiply's canonical +NaN), the 16-block amax as a bf16x2 max tree on the raw pairs, the scale's
    # reciprocal by rcp.rn.f32; FULL 1: no masks when one program's row fills the tile (RS 1, K = 16 * NB).
    # Offline SASS 18.1 -> 15.7 per element (qdq 26.8 -> 23.7), 80 registers and no spill at the cap (16 bytes
    # before). ENC_dq: the same for the qdq form. H200 12-01d run 1 sweep: 92.2 us against 107.1 for the 12-01c
    # form (ENC 0, FULL 0) in the same list (ENC 1 alone 96.4, FULL 1 alone 100.4); qdq 158.4 vs 167.7.
    "nvfp4_pairs": {"enabled": True, "el_per_thread": 64, "RS": 1, "el_per_thread_dq": 32, "RS_dq": 1, "EVICT": 1,
                    "maxnreg": 80, "maxnreg_dq": 0, "ENC": 1, "ENC_dq": 1, "FULL": 1},
    # The same rows from a persistent grid (nvfp4_rows_persist_kernel, 12-01c round 2): "pps" programs per SM
    # (0: off, the one-row-per-program kernel above), each looping over every P-th row with the next row's
    # load issued during this row's work: STAGES > 1 Triton's pipeliner (cp.async into shared memory), PF 1 a
    # register prefetch. Offline (sm_90 SASS): STAGES 2 at 64 el/thread 96 registers (115 at STAGES 1, no
    # spill), 18.7 instructions per element with the loop. "_dq" keys: the qdq form. Measured on the H200
    # (12-01c run 3, bb28fa6): slower in every variant (best 118.6 us, 8/SM 3 stages, vs 107.6 for pps 0; qdq
    # 175.3 vs 166.6), byte-identical; so off.
    "nvfp4_persist": {"pps": 0, "STAGES": 2, "PF": 0, "pps_dq": 0, "STAGES_dq": 2, "PF_dq": 0},
    "nvfp4_dq": {"BM": 16, "NB": 8, "num_warps": 4},
    "amax": {"BM": 32, "BK": 256, "num_warps": 4},
}
