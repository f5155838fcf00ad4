{#- The consumer warpgroups of bwd_ws/dkdv_ws.cu.j2 at head dims 64 and 128: each owns 64 keys
    of the block and the whole head dim of their dK and dV. Included inside the kernel. -#}
    // Warp cw (0 .. 7) owns keys 16 cw .. 16 cw + 15 of the block in
    // the accumulator layout of wgmma.cuh (warp w of group g: keys g * 64 + 16 (w & 3) +
    // {lane / 4, + 8}; per n8 tile j, columns 8 j + 2 (lane & 3) + {0, 1}).
    const int key_w = cw * 16, col_w = 0;  // this warp's first key inside the block, its first dK/dV column

    auto step = [&](int it, auto masked) {
      const int j = {{ "j_walk++" if flashmask or walked else "it" }};  // the steps walked before this one: stage and phase
      const int st = j % kStages;
      const int h = h0 + it / n_m, m0 = (blocks.lo + it % n_m) * kBlockM;
      const u32 q_st = sQ(st), do_st = sdO(st);
      const float* s_lse = reinterpret_cast<const float*>(reinterpret_cast<const char*>(smem) + kOffStats) +
                           st * 2 * kBlockM;
      const float* s_d = s_lse + kBlockM;
{%- if softcap or alibi %}
      // Score modifiers (score_mods.cuh): the scores are softcapped before the mask and ALiBi's
      // bias is subtracted as P^T is formed, and dS^T = P^T (1 - t^2) (dP^T - D). This step's
      // ALiBi slope is read while the stage fills.
      const float slope = {{ "alibi_slopes[(long long)b * alibi_sb + h] * alibi_scale" if alibi else "0.f" }};
{%- endif %}
      mbar_wait<kHangTrap>(bar_full(st), (j / kStages) & 1);
{%- if zero_tail %}
      zero_q_tail(st, m0);  // (the sequence's last query block: rows past it zeroed)
{%- endif %}

      // S^T = K Q^T, then dP^T = V dO^T, for this group's 64 keys x the step's queries.
      // The empty asm keeps the compiler from hoisting the loop-invariant descriptors (64-bit
      // each, dozens of them) out of the step loop.
      u32 k_wg = sK + wg * 64 * 128, v_wg = sV + wg * 64 * 128;
      asm volatile("" : "+r"(k_wg), "+r"(v_wg));
      float s[kQT][4], dp[kQT][4];
      issue_sdp(s, dp, k_wg, v_wg, q_st, do_st);

      // Mask, then P^T = exp2(S^T c - LSE2) and dS^T = P^T (dP^T - D) (scaled at the end; LSE
      // and D are per query: per column), then dV += P^T dO and dK += dS^T Q with P^T and dS^T
      // from registers and dO, Q read MN-major (rows of queries). kOverlap: P^T is formed while
      // dP^T is in flight and dV is issued at once, so it runs while dS^T is formed.
      u32 pa[kQT / 2][4], dsa[kQT / 2][4];
      auto issue_rs = [&](float (&acc)[kDT][4], const u32 (&a)[kQT / 2][4], u32 b) {  // acc += a b
        fence_regs(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) wgmma_rs(acc, a[kk], wgmma_desc(b + kk * 16 * 128, kBlockM * 128, 1024));
      };
      auto issue_dv = [&] { issue_rs(acc_dv[0], pa, do_st); };
      auto issue_dk = [&] { issue_rs(acc_dk[0], dsa, q_st); };
{%- if softcap %}
      wgmma_wait<1>();  // S^T (softcapped while dP^T is still in flight)
{%- else %}
      if constexpr (kOverlap) wgmma_wait<1>();  // S^T
      else wgmma_wait<0>();
{%- endif %}
      fence_regs(s);
{%- if softcap %}
      apply_softcap<kQT>(s, softcap_scale);  // before the mask: a masked score stays -inf
{%- endif %}
      if constexpr (decltype(masked)::value)
        apply_mask_t<kQT, kIsLocal>(s, n0 + key_w, m0, info_i32(sInfo, kInfoSeqK), info_i32(sInfo, kInfoDiag),
                                    kIsLocal ? info_i32(sInfo, kInfoDiagLo) : 0);
{% if flashmask %}
      if constexpr (decltype(masked)::value)
        if ({{ "fm_part" if fm_window else "fm_class(it) == kFmMasked" }})
          apply_flashmask_t<kQT, kFlashMask, kIsCausal, !kIsCausal>(s, n0 + key_w, m0, info_i32(sInfo, kInfoSeqK),
                                                                   fm_idx + b * fm_sb + (h / fm_hdiv) * fm_sh, fm_ss, fm_sc);
{% endif %}
      if constexpr (kOverlap) {
{%- if softcap or alibi %}
        exp_mods_t<kIsBF16, kQT, kSoftcap, kAlibi>(s, pa, s_lse, scale_log2,  // s: P^T (1 - t^2)
                                                   AlibiT(n0 + key_w, m0 + {{ k_minus_q }}), slope);
{%- else %}
        exp_t(s, s_lse, scale_log2);
        c_to_a<kIsBF16, kQT>(pa, s);
{%- endif %}
        issue_dv();
        wgmma_commit();
        wgmma_wait<1>();  // dP^T (dV may still run)
        fence_regs(dp);
        ds_t(dp, s, s_d);
        c_to_a<kIsBF16, kQT>(dsa, dp);
        if constexpr (!kDqEarly) issue_dk();
      } else {
        // One pass, so each score's registers die as they are used.
{%- if softcap %}
        wgmma_wait<0>();  // dP^T
{%- endif %}
        fence_regs(dp);
{%- if softcap or alibi %}
        p_ds_mods_t<kIsBF16, kQT, kSoftcap, kAlibi>(s, dp, pa, dsa, s_lse, s_d, scale_log2,
                                                    AlibiT(n0 + key_w, m0 + {{ k_minus_q }}), slope);
{%- else %}
#pragma unroll
        for (int j = 0; j < kQT; ++j) {
          const float2 l = *reinterpret_cast<const float2*>(s_lse + j * 8 + (lane & 3) * 2);
          const float2 d = *reinterpret_cast<const float2*>(s_d + j * 8 + (lane & 3) * 2);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[j][e] = exp2_approx(fmaf(s[j][e], scale_log2, -((e & 1) ? l.y : l.x)));
            dp[j][e] = s[j][e] * (dp[j][e] - ((e & 1) ? d.y : d.x));
          }
        }
        c_to_a<kIsBF16, kQT>(pa, s);
        c_to_a<kIsBF16, kQT>(dsa, dp);
{%- endif %}
        issue_dv();
        if constexpr (!kDqEarly) issue_dk();
      }
      wgmma_commit();

      if constexpr (kDqAtomic) {
        // dS^T to this step's shared tile, swizzled (row = key, 16-byte chunk c of queries at
        // c ^ (key & 7)), published to both groups by a named barrier; then dQ = dS K with dS^T
        // and K read MN-major, added into the fp32 buffer. kDqT: dS instead (row = query, chunk c
        // of keys at c ^ (query & 7)), each 8 x 8 piece of dsa stored transposed by stmatrix;
        // then dQ^T = K^T dS^T.
        const u32 ds_st = sK + kOffDs + (j & 1) * kTileDs;
{%- if dq_t %}
        // Lanes 8 m .. 8 m + 7 address the rows of piece m of dsa[kk] (m & 1: keys + 8, m >> 1:
        // queries + 8): query 16 kk + 8 (m >> 1) + (lane & 7), chunk of keys key_w / 8 + (m & 1).
        {
          const int m = lane >> 3, qr = 8 * (m >> 1) + (lane & 7), ch = (key_w & 63) / 8 + (m & 1);
          const u32 base = ds_st + (key_w >> 6) * kBlockM * 128;
#pragma unroll
          for (int kk = 0; kk < kQT / 2; ++kk) {
            const int q = 16 * kk + qr;
            stsm_x4_trans(base + q * 128 + ((ch ^ (q & 7)) << 4), dsa[kk]);
          }
        }
{%- else %}
        char* tile = reinterpret_cast<char*>(smem) + kOffDs + (j & 1) * kTileDs;
#pragma unroll
        for (int kk = 0; kk < kQT / 2; ++kk)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = key_w + (lane >> 2) + (e & 1) * 8, c = 2 * kk + (e >> 1);  // 16-byte chunk
            *reinterpret_cast<u32*>(tile + tile_offset<kBlockN, kBlockM, true>(row, c) + (lane & 3) * 4) = dsa[kk][e];
          }
{%- endif %}
        fence_proxy_async();
        named_bar_sync<1, kConsumerThreads>();
{%- if dq_t %}
        float dq[kQT][4];
        u32 a_ds = ds_st, b_k = sK + wg * kBlockN * 128;
        asm volatile("" : "+r"(a_ds), "+r"(b_k));
        issue_dq(dq, a_ds, b_k);
{%- else %}
        float dq[8][4];
        u32 a_ds = ds_st + kDqQ * wg * kBlockN * 128, b_k = sK + kDqD * wg * kBlockN * 128;
        asm volatile("" : "+r"(a_ds), "+r"(b_k));
        issue_dq(dq, a_ds, b_k);
{%- endif %}
        if constexpr (kDqEarly) {  // dK += dS^T Q runs while dQ is added
          issue_dk();
          wgmma_commit();
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        fence_regs(dq);
        if constexpr (!kDqEarly) mbar_arrive(bar_empty(st));  // this thread's products have read the stage (Q, dO, LSE, D)
        // This group's 64 x 64 piece of the step's dQ (piece wg: queries 64 wg with kDqQ, columns
        // 64 wg with kDqD) in fragment order (bwd.cuh); kDqT: its 64 columns of every row.
        const int t = ctid & 127;
        if constexpr (kDqWriter) {
          // To the staged tile once the writer has read the previous step's, made visible to the
          // bulk copy (async proxy), then handed to the writer.
          if (j > 0) mbar_wait<kHangTrap>(bar_dq_empty, (j - 1) & 1);
{%- if dq_t %}
          // dQ^T's value e of n8 tile jj: column 64 wg + 16 (t / 32) + (t % 32) / 4 + 8 (e / 2) of
          // query row 8 jj + 2 (t % 4) + e % 2, to its swizzled place in the rows (conflict-free:
          // a warp's 32 values of one (jj, e) fill 8 chunks of 4 rows that the swizzle spreads
          // over all 32 banks).
          // Value e's row is q0 + (e & 1) and its chunk (c0 >> 2) + 2 (e >> 1) (q0 even; bit 1 of
          // c0 >> 2 is 0), so its swizzled chunk is x0 ^ e with x0 = (c0 >> 2) ^ q0, whatever the
          // tile jj (rows 8 jj: 4 KB apart). The staging tile is 64-byte aligned, so the XOR can
          // act on the address itself (bits 4-5).
          {
            const u32 c0 = 64 * wg + 16 * (t >> 5) + ((t >> 2) & 7), q0 = 2 * (t & 3);
            const u32 at0 = sDqW + q0 * (kHeadDim * 4) + (((c0 >> 2) ^ q0) << 4) + (c0 & 3) * 4;
#pragma unroll
            for (int jj = 0; jj < kQT; ++jj)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                asm volatile("st.shared.f32 [%0], %1;"
                             :: "r"(((at0 ^ (e << 4)) + (e & 1) * kHeadDim * 4) + jj * 8 * kHeadDim * 4), "f"(dq[jj][e])
                             : "memory");
          }
{%- else %}
          float* tile = reinterpret_cast<float*>(reinterpret_cast<char*>(smem) + kOffDqW) + wg * 4096;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            *reinterpret_cast<float4*>(frag_word(tile, j, t)) = make_float4(dq[j][0], dq[j][1], dq[j][2], dq[j][3]);
{%- endif %}
          fence_proxy_async();
          mbar_arrive(bar_dq_full);
        } else {
          red_add_frag(dq_accum + (info_i64(sInfo, kInfoStats) + (long long)h * head_rows + m0) * kHeadDim + wg * 4096,
                       dq, t);
        }
        if constexpr (kDqEarly) {
          wgmma_wait<0>();
          mbar_arrive(bar_empty(st));
        }
      } else {
        wgmma_wait<0>();
        mbar_arrive(bar_empty(st));
      }
      fence_regs(acc_dv[0]);
      fence_regs(acc_dk[0]);
      fence_regs(pa);
      fence_regs(dsa);
    };

