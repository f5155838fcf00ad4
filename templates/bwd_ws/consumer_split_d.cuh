{#- The consumer warpgroups of bwd_ws/dkdv_ws.cu.j2 at d = 256 (kSplitD): group wg forms S^T and
    dP^T for all 64 keys of the block and queries 32 wg .. 32 wg + 31 of the step, writes its part
    of P^T and dS^T to shared tiles, then owns head-dim columns 128 wg .. 128 wg + 127 of dK, dV
    and dQ. Included inside the kernel. -#}
    // Warp cw (0 .. 7), w = cw & 3, holds keys 16 w + {lane / 4, + 8}
    // of S^T and dP^T (the accumulator layout of wgmma.cuh) and of its group's dK, dV columns
    // 128 wg + 8 j + 2 (lane & 3) + {0, 1}.
    const int key_w = (cw & 3) * 16;        // this warp's first key inside the block
    const int col_w = wg * (kHeadDim / 2);  // and its group's first dK/dV/dQ column
    const int q_wg = wg * (kBlockM / 2);    // the group's first query of S^T and dP^T

    auto step = [&](int it, auto masked) {
      const int j = {{ "j_walk++" if flashmask or walked else "it" }};  // the steps walked before this one: stage and phase
      const int st = j % kStages;
      const int h = h0 + it / n_m, m0 = (blocks.lo + it % n_m) * kBlockM;
      const u32 q_st = sQ(st), do_st = sdO(st);
      const float* s_lse = reinterpret_cast<const float*>(reinterpret_cast<const char*>(smem) + kOffStats) +
                           st * 2 * kBlockM + q_wg;
      const float* s_d = s_lse + kBlockM;
      // This step parity's P^T and dS^T tiles, swizzled (row = key, 16-byte chunk c of queries at
      // c ^ (key & 7)). A group reaches the next step's barrier only after its products of this
      // step completed, so the other parity's tiles are free when a group writes them.
      const u32 p_st = sK + kOffDs + (j & 1) * 2 * kTileDs, ds_st = p_st + kTileDs;
      char* tile = reinterpret_cast<char*>(smem) + kOffDs + (j & 1) * 2 * kTileDs;
      auto tile_at = [&](int kk, int e) {  // this thread's word of A fragment pa[kk][e] in a tile
        return tile_offset<kBlockN, kBlockM, true>(key_w + (lane >> 2) + (e & 1) * 8, q_wg / 8 + 2 * kk + (e >> 1)) +
               (lane & 3) * 4;
      };
{%- if softcap or alibi %}
      // Score modifiers (score_mods.cuh): the scores are softcapped before the mask and ALiBi's
      // bias is subtracted as P^T is formed, and dS^T = P^T (1 - t^2) (dP^T - D). This step's
      // ALiBi slope is read while the stage fills.
      const float slope = {{ "alibi_slopes[(long long)b * alibi_sb + h] * alibi_scale" if alibi else "0.f" }};
      const AlibiT alibi(n0 + key_w, m0 + q_wg + {{ k_minus_q }});
{%- endif %}
      mbar_wait<kHangTrap>(bar_full(st), (j / kStages) & 1);
{%- if zero_tail %}
      zero_q_tail(st, m0);  // (the sequence's last query block: rows past it zeroed)
{%- endif %}

      // S^T = K Q^T, then dP^T = V dO^T, for the block's 64 keys x the group's 32 queries. The
      // empty asm keeps the compiler from hoisting the loop-invariant descriptors out of the loop.
      u32 k_s = sK, v_s = sV, q_g = q_st + q_wg * 128, do_g = do_st + q_wg * 128;
      asm volatile("" : "+r"(k_s), "+r"(v_s), "+r"(q_g), "+r"(do_g));
      float s[kQT][4], dp[kQT][4];
      issue_sdp(s, dp, k_s, v_s, q_g, do_g);

      // Mask, P^T = exp2(S^T c - LSE2) while dP^T is in flight, then dS^T = P^T (dP^T - D)
      // (scaled at the end; LSE and D are per query: per column).
      wgmma_wait<1>();
      fence_regs(s);
{%- if softcap %}
      apply_softcap<kQT>(s, softcap_scale);  // before the mask: a masked score stays -inf
{%- endif %}
      if constexpr (decltype(masked)::value)
        apply_mask_t<kQT, kIsLocal>(s, n0 + key_w, m0 + q_wg, info_i32(sInfo, kInfoSeqK),
                                    info_i32(sInfo, kInfoDiag), kIsLocal ? info_i32(sInfo, kInfoDiagLo) : 0);
{% if flashmask %}
      if constexpr (decltype(masked)::value)
        if ({{ "fm_part" if fm_window else "fm_class(it) == kFmMasked" }})
          apply_flashmask_t<kQT, kFlashMask, kIsCausal, !kIsCausal>(
              s, n0 + key_w, m0 + q_wg, info_i32(sInfo, kInfoSeqK), fm_idx + {{ batch }} * fm_sb + (h / fm_hdiv) * fm_sh,
              fm_ss, fm_sc);
{% endif %}
{%- if softcap or alibi %}
      u32 pa[kQT / 2][4], dsa[kQT / 2][4];
      exp_mods_t<kIsBF16, kQT, kSoftcap, kAlibi>(s, pa, s_lse, scale_log2, alibi, slope);  // s: P^T (1 - t^2)
{%- else %}
      exp_t(s, s_lse, scale_log2);
      u32 pa[kQT / 2][4], dsa[kQT / 2][4];
      c_to_a<kIsBF16, kQT>(pa, s);
{%- endif %}
      wgmma_wait<0>();
      fence_regs(dp);
      ds_t(dp, s, s_d);
      c_to_a<kIsBF16, kQT>(dsa, dp);
#pragma unroll
      for (int kk = 0; kk < kQT / 2; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          *reinterpret_cast<u32*>(tile + tile_at(kk, e)) = pa[kk][e];
          *reinterpret_cast<u32*>(tile + kTileDs + tile_at(kk, e)) = dsa[kk][e];
        }
      fence_proxy_async();
      named_bar_sync<1, kConsumerThreads>();  // both tiles are complete

      // kDqAtomic: dQ = dS K for the group's 128 columns (dS^T and K read MN-major) first, so
      // that its adds into the fp32 buffer run while dK += dS^T Q and dV += P^T dO do (P^T, dS^T
      // K-major as A; Q, dO MN-major as B, column blocks 2 wg and 2 wg + 1).
      u32 a_ds = ds_st, a_p = p_st, b_k = sK + 2 * wg * kBlockN * 128, b_q = q_st + 2 * wg * kBlockM * 128,
          b_do = do_st + 2 * wg * kBlockM * 128;
      asm volatile("" : "+r"(a_ds), "+r"(a_p), "+r"(b_k), "+r"(b_q), "+r"(b_do));
      float dq[kDT][4];
      if constexpr (kDqAtomic) issue_dq(dq, a_ds, b_k);
      fence_regs(acc_dk[0]);
      fence_regs(acc_dv[0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk)
        wgmma_ss_kv(acc_dk[0], wgmma_desc(a_ds + kk * 32, 16, 1024), wgmma_desc(b_q + kk * 16 * 128, kBlockM * 128, 1024), 1);
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk)
        wgmma_ss_kv(acc_dv[0], wgmma_desc(a_p + kk * 32, 16, 1024), wgmma_desc(b_do + kk * 16 * 128, kBlockM * 128, 1024), 1);
      wgmma_commit();
      if constexpr (kDqAtomic) {
        wgmma_wait<1>();
        fence_regs(dq);
        // The group's pieces 2 wg and 2 wg + 1 (columns 128 wg ...) of the step's dQ, in fragment
        // order (bwd.cuh). kDqOrdered: once turn warp 1 holds this step's turn (barrier
        // kBarTurn + wg), and then telling the turn warps that the adds are issued (kBarAdded +
        // wg), so that warp 2 passes the turn on (its release orders them first) while this
        // group goes on.
        const long long row = info_i64(sInfo, kInfoStats) + (long long)h * head_rows + m0;
{%- if dq_ordered %}
        named_bar_sync_at<kTurnThreads>(kBarTurn + wg);
{%- endif %}
{%- if dq_groups > 1 %}
        if (dq_store(it)) store_frag({{ dq_acc_at }} + 2 * wg * 4096, dq, ctid & 127);
        else
{%- endif %}
        red_add_frag({{ dq_acc_at }} + 2 * wg * 4096, dq, ctid & 127);
{%- if dq_ordered %}
        named_bar_arrive_at<kAddedThreads>(kBarAdded + wg);
{%- endif %}
      }
      wgmma_wait<0>();
      mbar_arrive(bar_empty(st));  // this thread's products have read the stage (Q, dO, LSE, D)
      fence_regs(acc_dk[0]);
      fence_regs(acc_dv[0]);
    };

