{#- The consumer warpgroups of bwd_ws/dkdv_ws.cu.j2 at d = 256 (kSplitD): group wg forms S^T and
    dP^T for all 64 keys of the block and queries 32 wg .. 32 wg + 31 of the step, then owns
    head-dim columns 128 wg .. 128 wg + 127 of dK, dV (held as dK^T, dV^T) and dQ. Included
    inside the kernel. -#}
    // ---- Consumer warpgroups: warp cw (0 .. 7), w = cw & 3, holds keys 16 w + {lane / 4, + 8}
    // of its group's S^T (the accumulator layout of wgmma.cuh), and of dK^T / dV^T head-dim rows
    // 128 wg + 64 mi + 16 w + {lane / 4, + 8} (mi = 0, 1) by keys 8 j + 2 (lane & 3) + {0, 1}.
    setmaxnreg_inc<kConsumerRegs>();
    const int cw = warp - 4, wg = cw >> 2, ctid = tid - 128;
    const int key_w = (cw & 3) * 16;      // this warp's first key of S^T inside the block
    const int q_wg = wg * (kBlockM / 2);  // the group's first query of the step
    constexpr int kKT = kBlockN / 8;      // n8 tiles (keys) of dK^T / dV^T
    float acc_dk[2][kKT][4], acc_dv[2][kKT][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int j = 0; j < kKT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[mi][j][e] = acc_dv[mi][j][e] = 0.f;

    mbar_wait<kHangTrap>(bar_kv, 0);  // also with no step: the K/V copies land before the epilogue reuses them

    auto step = [&](int it, auto masked) {
      const int st = it % kStages;
      const int h = h0 + it / n_m, m0 = (blocks.lo + it % n_m) * kBlockM;
      const u32 q_st = sQ(st), do_st = sdO(st);
      const float* s_lse = reinterpret_cast<const float*>(reinterpret_cast<const char*>(smem) + kOffStats) +
                           st * 2 * kBlockM + q_wg;
      const float* s_d = s_lse + kBlockM;
      mbar_wait<kHangTrap>(bar_full(st), (it / kStages) & 1);

      // S^T = K Q^T, then dP^T = V dO^T, for the block's 64 keys x the group's 32 queries. The
      // empty asm keeps the compiler from hoisting the loop-invariant descriptors out of the loop.
      u32 k_s = sK, v_s = sV, q_g = q_st + q_wg * 128, do_g = do_st + q_wg * 128;
      asm volatile("" : "+r"(k_s), "+r"(v_s), "+r"(q_g), "+r"(do_g));
      float s[kQT][4], dp[kQT][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk)
        wgmma_ss(s, wgmma_desc(k_s + (kk >> 2) * kBlockN * 128 + (kk & 3) * 32, 16, 1024),
                 wgmma_desc(q_g + (kk >> 2) * kBlockM * 128 + (kk & 3) * 32, 16, 1024), kk > 0);
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk)
        wgmma_ss(dp, wgmma_desc(v_s + (kk >> 2) * kBlockN * 128 + (kk & 3) * 32, 16, 1024),
                 wgmma_desc(do_g + (kk >> 2) * kBlockM * 128 + (kk & 3) * 32, 16, 1024), kk > 0);
      wgmma_commit();

      // Mask, P^T = exp2(S^T c - LSE2) while dP^T is in flight, then dS^T = P^T (dP^T - D)
      // (scaled at the end; LSE and D are per query: per column).
      wgmma_wait<1>();
      fence_regs(s);
      if constexpr (decltype(masked)::value)
        apply_mask_t<kQT, kIsLocal>(s, n0 + key_w, m0 + q_wg, info_i32(sInfo, kInfoSeqK),
                                    info_i32(sInfo, kInfoDiag), kIsLocal ? info_i32(sInfo, kInfoDiagLo) : 0);
#pragma unroll
      for (int j = 0; j < kQT; ++j) {
        const float2 l = *reinterpret_cast<const float2*>(s_lse + j * 8 + (lane & 3) * 2);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = exp2_approx(fmaf(s[j][e], scale_log2, -((e & 1) ? l.y : l.x)));
      }
      u32 pa[kQT / 2][4], dsa[kQT / 2][4];
      c_to_a<kIsBF16, kQT>(pa, s);
      wgmma_wait<0>();
      fence_regs(dp);
#pragma unroll
      for (int j = 0; j < kQT; ++j) {
        const float2 d = *reinterpret_cast<const float2*>(s_d + j * 8 + (lane & 3) * 2);
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * (dp[j][e] - ((e & 1) ? d.y : d.x));
      }
      c_to_a<kIsBF16, kQT>(dsa, dp);

      // P^T and dS^T to this step parity's tiles, swizzled (row = key, 16-byte chunk c of
      // queries at c ^ (key & 7)), published to both groups by the named barrier. A group
      // reaches the next step's barrier only after its products of this step completed, so the
      // other parity's tiles are free when a group writes them.
      const u32 p_st = sK + kOffDs + (it & 1) * 2 * kTileDs, ds_st = p_st + kTileDs;
      char* tile = reinterpret_cast<char*>(smem) + kOffDs + (it & 1) * 2 * kTileDs;
#pragma unroll
      for (int kk = 0; kk < kQT / 2; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = key_w + (lane >> 2) + (e & 1) * 8, c = q_wg / 8 + 2 * kk + (e >> 1);
          const u32 off = tile_offset<kBlockN, kBlockM, true>(row, c) + (lane & 3) * 4;
          *reinterpret_cast<u32*>(tile + off) = pa[kk][e];
          *reinterpret_cast<u32*>(tile + kTileDs + off) = dsa[kk][e];
        }
      fence_proxy_async();
      named_bar_sync<1, kConsumerThreads>();

      // kDqAtomic: dQ = dS K for the group's 128 columns (dS^T and K read MN-major) first, so
      // that its adds into the fp32 buffer run while dK^T += Q^T dS and dV^T += dO^T P do (Q, dO
      // read MN-major as A, dS^T and P^T K-major as B; column block 2 wg + mi of Q and dO).
      u32 a_ds = ds_st, b_k = sK + 2 * wg * kBlockN * 128, p_b = p_st, q_a = q_st + 2 * wg * kBlockM * 128,
          do_a = do_st + 2 * wg * kBlockM * 128;
      asm volatile("" : "+r"(a_ds), "+r"(b_k), "+r"(p_b), "+r"(q_a), "+r"(do_a));
      float dq[kHeadDim / 16][4];
      if constexpr (kDqAtomic) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk)
          wgmma_ss_mn(dq, wgmma_desc(a_ds + kk * 16 * 128, kBlockN * 128, 1024),
                      wgmma_desc(b_k + kk * 16 * 128, kBlockN * 128, 1024), kk > 0);
        wgmma_commit();
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        fence_regs(acc_dk[mi]);
        fence_regs(acc_dv[mi]);
      }
      wgmma_fence();
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk)
          wgmma_ss_t(acc_dk[mi], wgmma_desc(q_a + mi * kBlockM * 128 + kk * 16 * 128, kBlockM * 128, 1024),
                     wgmma_desc(a_ds + kk * 32, 16, 1024), 1);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk)
          wgmma_ss_t(acc_dv[mi], wgmma_desc(do_a + mi * kBlockM * 128 + kk * 16 * 128, kBlockM * 128, 1024),
                     wgmma_desc(p_b + kk * 32, 16, 1024), 1);
      wgmma_commit();
      if constexpr (kDqAtomic) {
        wgmma_wait<1>();
        fence_regs(dq);
        float* dqa = dq_accum + (info_i64(sInfo, kInfoStats) + (long long)h * head_rows + m0) * kHeadDim;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = (cw & 3) * 16 + (lane >> 2) + r * 8;
#pragma unroll
          for (int j = 0; j < kHeadDim / 16; ++j) {
            const int col = wg * (kHeadDim / 2) + j * 8 + (lane & 3) * 2;
            red_add_f32x2(dqa + row * kHeadDim + col, dq[j][2 * r], dq[j][2 * r + 1]);
          }
        }
      }
      wgmma_wait<0>();
      mbar_arrive(bar_empty(st));  // this thread's products have read the stage (Q, dO, LSE, D)
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        fence_regs(acc_dk[mi]);
        fence_regs(acc_dv[mi]);
      }
    };

    // Per query head of the group: first the steps on the upper band edge (masked), then the
    // rest, the last ones masked again where they cross a window's lower edge. With a sequence
    // tail in this key block, every step is masked.
    for (int it = 0; it < n_iter; ++it) {
      const int m0 = (blocks.lo + it % n_m) * kBlockM;
      if (m0 < info_i32(sInfo, kInfoUnmasked) || (kIsLocal && m0 > info_i32(sInfo, kInfoLower))) step(it, Bool<true>{});
      else step(it, Bool<false>{});
    }
    named_bar_sync<1, kConsumerThreads>();  // both groups are done reading K, V, Q, dO, P^T and dS^T

    // Epilogue: dK^T (scaled) and dV^T transposed into padded rows of keys over the K and V
    // tiles (pairs of keys converted together, stored as two halves), then 16-byte stores.
    u16* tile_k = smem;
    u16* tile_v = smem + kBlockN * kSmemStride;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < kKT; ++j) {
          const int col = wg * (kHeadDim / 2) + mi * 64 + key_w + (lane >> 2) + r * 8;
          const int key = j * 8 + (lane & 3) * 2;
          const u32 k2 = pack2<kIsBF16>(acc_dk[mi][j][2 * r] * scale, acc_dk[mi][j][2 * r + 1] * scale);
          const u32 v2 = pack2<kIsBF16>(acc_dv[mi][j][2 * r], acc_dv[mi][j][2 * r + 1]);
          tile_k[key * kSmemStride + col] = static_cast<u16>(k2);
          tile_k[(key + 1) * kSmemStride + col] = static_cast<u16>(k2 >> 16);
          tile_v[key * kSmemStride + col] = static_cast<u16>(v2);
          tile_v[(key + 1) * kSmemStride + col] = static_cast<u16>(v2 >> 16);
        }
    named_bar_sync<1, kConsumerThreads>();
    const int keys = info_i32(sInfo, kInfoSeqK) - n0;
    store_tile<kBlockN, kHeadDim, kSmemStride, kConsumerThreads, true>(
        dk + b * dk_sb + hk * dk_sh + (long long)n0 * dk_ss, dk_ss, tile_k, keys, kHeadDim, ctid);
    store_tile<kBlockN, kHeadDim, kSmemStride, kConsumerThreads, true>(
        dv + b * dv_sb + hk * dv_sh + (long long)n0 * dv_ss, dv_ss, tile_v, keys, kHeadDim, ctid);
