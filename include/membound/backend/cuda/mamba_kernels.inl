// The Mamba layer's kernels (the chunk-parallel selective scan, forward and reverse, and the elementwise parts).
// A fragment, not a header: mamba.cuh includes it inside namespace membound::gpu::mamba_detail, and
// tests/emulation/mamba_cuda_emulate.cpp includes the same text inside its emulation namespace,
// where the CUDA built-ins are host threads (tests/emulation/cuda_emulate.py mamba). One text, compiled
// by nvcc and by the emulation: change the kernels here.
// v rounded through storage S (the one rounding of a value that forward stores).
template <typename S>
__device__ inline float round_to(float v) {
  S tmp;
  st(&tmp, 0, v);
  return ld(&tmp, 0);
}

// Packed sequences (shape/packed_sequences.hpp; batch 1, the offsets in device memory): the conv
// reads no token of another sequence, and the scan's state and its dL/dh restart at each start.
// Token n's position in its sequence, and one past its sequence's last token.
__device__ inline std::size_t token_position(const packed_sequences& pk, std::size_t n, std::size_t T) {
  return pk.packed() ? n - pk.begin_of(n) : n % T;
}
__device__ inline std::size_t sequence_end(const packed_sequences& pk, std::size_t n, std::size_t T) {
  return pk.packed() ? pk.end_of(n) : (n / T + 1) * T;
}
// The factor a state takes across a chunk: exp(a·ΣΔ), where ΣΔ ≥ 0 (Δ = softplus(·)), or 0 when a
// packed sequence starts inside the chunk, which the chunk-local passes mark with ΣΔ = −1.
inline constexpr float chunk_restarts = -1.0f;
__device__ inline float chunk_decay(float a, float sum) {
  return sum < 0.0f ? 0.0f : expf(a * sum);
}

// c = conv(xi) + conv_b (rounded to S; written to c when compute), u = SiLU(c) into u (S) and, when
// given, uf (fp32). xi is the x half of xz (row stride 2·Di). When !compute, c is read.
template <typename S>
__global__ void conv_silu_kernel(const S* xz, const S* w, const S* bias, S* c, S* u,
                                 std::size_t N, std::size_t T, std::size_t Di, std::size_t K,
                                 bool compute, packed_sequences packing) {
  const std::size_t total = N * Di;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t n = idx / Di, i = idx % Di, t = token_position(packing, n, T);
    float cv;
    if (compute) {
      cv = ld(bias, i);
      for (std::size_t k = 0; k < K; ++k) {
        if (t + k < K - 1) continue;  // before the sequence's start
        cv += ld(w, i * K + k) * ld(xz, (n + k + 1 - K) * 2 * Di + i);
      }
      cv = round_to<S>(cv);
      st(c, idx, cv);
    } else {
      cv = ld(c, idx);
    }
    st(u, idx, membound::silu(cv));
  }
}

// Δ = softplus(dt + dt_bias), rounded to S.
template <typename S>
__global__ void delta_kernel(const float* dt, const S* bias, S* delta, std::size_t N,
                             std::size_t Di) {
  const std::size_t total = N * Di;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    st(delta, idx, membound::softplus(dt[idx] + ld(bias, idx % Di)));
  }
}

// The forward scan runs over chunks of L steps in parallel, in three kernels (h_t = e_t·h_{t−1} +
// Δ_t·u_t·B_t, e_t = exp(a·Δ_t); H_k: the state entering chunk k, H_0 = 0):
//   A  scan_chunk_local_kernel, per (b, chunk k < nch − 1, channel, state): chunk k's recurrence
//      from h = 0, its end state l_k written into the saved states' slot k (the slot of H_{k+1}),
//      and, for k ≥ 1, Σ_{t∈k} Δ_t per (b, k, channel) into dsum. The chunk's decay Π e_t is then
//      exp(a·ΣΔ): Δ is shared by a channel's state lanes, so one float per channel instead of Ns,
//      and one exp instead of a product of L rounded exps. Both are within ~L ulps of the exact
//      decay: ΣΔ's rounding (≤ L·u·ΣΔ) moves exp(a·ΣΔ) by ≤ P·|log P|·L·u ≤ L·u/e absolutely.
//   B  scan_chunk_combine_kernel, per (b, channel, state), over the chunks in order:
//      H_{k+1} = exp(a·ΣΔ_k)·H_k + l_k, in place in the saved states (H_1 = l_0 already).
//   C  scan_forward_kernel, per (b, chunk, channel, state): the chunk's recurrence from H_k, and
//      the outputs. The backward's rerun for y is this kernel alone, on the saved states.
// Packed sequences: A and C reset h to 0 at each start; A marks a chunk that holds a start with
// ΣΔ = −1 (chunk_restarts), so B's decay there is 0 (chunk_decay) and H_{k+1} = l_k. The saved
// entry states stay what the CPU saves, the state before any reset at the chunk's first step.
// The first chunk's states come out of A as the serial scan's bits; later ones differ from a serial
// scan by the rounding of the combine (a few ulps), and the backward recomputes from these very
// states, so forward and backward agree on them.

// u = SiLU(c) of a tile's TT steps from row0 for the block's channels, into u_tile[cl·TT + tt]
// (when given), and with g_tile (the reverse scan) dL/dy = dg·SiLU(z) into it: once per (channel, step), lane s
// of a channel taking steps s, s + Ns, ... (each state lane computing all of them was an exp and a
// division per state and step, on the unit the scan is bound by). The same formula on the same
// operands: the same bits as before. Ends with a barrier; every thread of the block calls it,
// active or not, and the caller puts another barrier before the next tile's call rewrites them.
template <std::size_t TT, typename S>
__device__ inline void stage_silu(float* u_tile, const S* c, std::size_t row0, std::size_t nt, std::size_t Di,
                                  std::size_t ch, std::size_t cl, std::size_t s, std::size_t Ns, bool active,
                                  float* g_tile = nullptr, const float* dg = nullptr, const S* xz = nullptr) {
  if (active) {
    for (std::size_t tt = s; tt < nt; tt += Ns) {
      const std::size_t n = row0 + tt;
      if (u_tile != nullptr) u_tile[cl * TT + tt] = membound::silu(ld(c, n * Di + ch));
      if (g_tile != nullptr) g_tile[cl * TT + tt] = dg[n * Di + ch] * membound::silu(ld(xz, n * 2 * Di + Di + ch));
    }
  }
  __syncthreads();
}

// Phase A. Grid (channel blocks · (nch − 1), B), block cpb·Ns threads, thread = (channel, state);
// blockIdx.x = k·(channel blocks) + channel block. Inputs loaded per tile of TT steps first.
template <typename S>
__global__ void __launch_bounds__(mamba_max_d_state, 1)
    scan_chunk_local_kernel(const S* c, const S* delta, const S* xdbl, const S* a_log,
                            std::size_t T, std::size_t Di, std::size_t Ns, std::size_t R,
                            std::size_t L, std::size_t cpb, float* states, float* dsum,
                            packed_sequences packing) {
  constexpr std::size_t TT = mamba_forward_tile;
  static_assert(TT <= 32, "membound: a tile's sequence starts are one 32-bit mask");
  __shared__ float u_tile[mamba_scan_channels * TT];
  const std::size_t tid = threadIdx.x, cl = tid / Ns, s = tid % Ns;
  const std::size_t nchb = (Di + cpb - 1) / cpb, k = blockIdx.x / nchb;
  const std::size_t ch = (blockIdx.x % nchb) * cpb + cl;
  const std::size_t b = blockIdx.y;
  const bool active = cl < cpb && ch < Di;  // the others only meet the barriers
  const std::size_t ldx = R + 2 * Ns, nch = (T + L - 1) / L;
  const std::size_t t0 = k * L, t1 = t0 + L < T ? t0 + L : T;
  const float a = active ? -expf(ld(a_log, ch * Ns + s)) : 0.0f;
  float h = 0, sum = 0;
  bool restarts = false;
  for (std::size_t tb = t0; tb < t1; tb += TT) {
    const std::size_t nt = t1 - tb < TT ? t1 - tb : TT;
    const std::uint32_t starts = packing.starts_in(tb, nt);
    restarts = restarts || starts != 0;
    stage_silu<TT>(u_tile, c, b * T + tb, nt, Di, ch, cl, s, Ns, active);
    float dv[TT], uv[TT], bv[TT];
#pragma unroll
    for (std::size_t tt = 0; tt < TT; ++tt) {
      dv[tt] = 0;
      uv[tt] = 0;
      bv[tt] = 0;
      if (active && tt < nt) {
        const std::size_t n = b * T + tb + tt;
        dv[tt] = ld(delta, n * Di + ch);
        uv[tt] = u_tile[cl * TT + tt];
        bv[tt] = ld(xdbl, n * ldx + R + s);
      }
    }
    __syncthreads();  // u_tile is rewritten by the next tile
#pragma unroll
    for (std::size_t tt = 0; tt < TT; ++tt) {
      if (active && tt < nt) {
        if ((starts >> tt) & 1u) h = 0;  // a packed sequence starts here
        h = expf(a * dv[tt]) * h + (dv[tt] * uv[tt]) * bv[tt];
        sum += dv[tt];
      }
    }
  }
  if (!active) return;
  states[((b * (nch - 1) + k) * Di + ch) * Ns + s] = h;
  if (s == 0 && k > 0) dsum[(b * (nch - 2) + k - 1) * Di + ch] = restarts ? chunk_restarts : sum;
}

// Phase B. One thread per (b, channel, state): H_{k+1} = exp(a·ΣΔ_k)·H_k + l_k for k = 1 ..
// nch − 2, in place (slot k holds l_k, then H_{k+1}). Neighbouring threads read neighbouring
// words of every slot.
template <typename S>
__global__ void scan_chunk_combine_kernel(const S* a_log, const float* dsum, float* states,
                                          std::size_t B, std::size_t nch, std::size_t Di,
                                          std::size_t Ns) {
  const std::size_t per = Di * Ns, total = B * per;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t b = idx / per, r = idx % per, ch = r / Ns;
    const float a = -expf(ld(a_log, r));
    float* const slot = states + b * (nch - 1) * per + r;
    const float* const sums = dsum + b * (nch - 2) * Di + ch;
    float h = slot[0];
    for (std::size_t k = 1; k + 1 < nch; ++k) {
      h = chunk_decay(a, sums[(k - 1) * Di]) * h + slot[k * per];
      slot[k * per] = h;
    }
  }
}

// Phase C. Grid (channel blocks · nch, B); block cpb·Ns threads, thread = (channel, state);
// blockIdx.x = k·(channel blocks) + channel block: chunk k from its entry state (0 for k = 0, else
// states[b, k − 1]). Writes g = (y) ⊙ SiLU(z) into gated (S); with dg, also dz = dg·y·SiLU'(z)
// into xz-shaped dxz's z half. Per tile of TT steps: the tile's inputs are loaded first
// (independent loads in flight together), then the recurrence; then lane s of each channel
// finishes steps s, s + Ns, ... (each y summed over lanes in order).
template <typename S>
__global__ void __launch_bounds__(mamba_max_d_state, 1)
    scan_forward_kernel(const S* xz, const S* c, const S* delta, const S* xdbl, const S* a_log,
                        const S* dskip, std::size_t T, std::size_t Di, std::size_t Ns,
                        std::size_t R, std::size_t L, std::size_t cpb, const float* states,
                        S* gated, const float* dg, S* dxz, packed_sequences packing) {
  constexpr std::size_t TT = mamba_forward_tile;
  // One row per step, padded by one word so that lanes reading different steps hit different banks.
  __shared__ float contrib[TT * (mamba_max_d_state + 1)];
  __shared__ float u_tile[mamba_scan_channels * TT];
  const std::size_t nthr = blockDim.x, pitch = nthr + 1, tid = threadIdx.x;
  const std::size_t cl = tid / Ns, s = tid % Ns;
  const std::size_t nchb = (Di + cpb - 1) / cpb, k = blockIdx.x / nchb;
  const std::size_t ch = (blockIdx.x % nchb) * cpb + cl;
  const std::size_t b = blockIdx.y;
  const bool active = cl < cpb && ch < Di;
  const std::size_t ldx = R + 2 * Ns, nch = (T + L - 1) / L;
  const std::size_t c0 = k * L, c1 = c0 + L < T ? c0 + L : T;
  const float a = active ? -expf(ld(a_log, ch * Ns + s)) : 0.0f;
  float h = (active && k > 0) ? states[((b * (nch - 1) + k - 1) * Di + ch) * Ns + s] : 0.0f;
  for (std::size_t t0 = c0; t0 < c1; t0 += TT) {
    const std::size_t nt = c1 - t0 < TT ? c1 - t0 : TT;
    const std::uint32_t starts = packing.starts_in(t0, nt);
    stage_silu<TT>(u_tile, c, b * T + t0, nt, Di, ch, cl, s, Ns, active);
    float dv[TT], uv[TT], bv[TT], cv[TT];
#pragma unroll
    for (std::size_t tt = 0; tt < TT; ++tt) {
      dv[tt] = 0;
      uv[tt] = 0;
      bv[tt] = 0;
      cv[tt] = 0;
      if (active && tt < nt) {
        const std::size_t n = b * T + t0 + tt;
        dv[tt] = ld(delta, n * Di + ch);
        uv[tt] = u_tile[cl * TT + tt];
        bv[tt] = ld(xdbl, n * ldx + R + s);
        cv[tt] = ld(xdbl, n * ldx + R + Ns + s);
      }
    }
#pragma unroll
    for (std::size_t tt = 0; tt < TT; ++tt) {
      float q = 0;
      if (active && tt < nt) {
        if ((starts >> tt) & 1u) h = 0;
        h = expf(a * dv[tt]) * h + (dv[tt] * uv[tt]) * bv[tt];
        q = cv[tt] * h;
      }
      contrib[tt * pitch + tid] = q;
    }
    __syncthreads();
    if (active) {  // y = Σ_s C·h in lane order, + D·u, then the gate
      const float dk = ld(dskip, ch);
      for (std::size_t tt = s; tt < nt; tt += Ns) {
        const std::size_t n = b * T + t0 + tt;
        float y = 0;
        for (std::size_t j = 0; j < Ns; ++j) y += contrib[tt * pitch + cl * Ns + j];
        y += dk * u_tile[cl * TT + tt];
        const float z = ld(xz, n * 2 * Di + Di + ch);
        st(gated, n * Di + ch, y * membound::silu(z));
        if (dg != nullptr) st(dxz, n * 2 * Di + Di + ch, dg[n * Di + ch] * y * membound::silu_grad(z));
      }
    }
    __syncthreads();  // contrib and u_tile are overwritten by the next tile
  }
}

// The reverse scan runs over the same chunks of L in parallel, in three kernels. The running
// dL/dh splits as the forward's state does: with D_k the dL/dh entering chunk k from the right
// (D_{nch−1} = 0) and r_k chunk k's own reverse recurrence from dh = 0 (dh += gy_t·C_t, then
// dh ·= e_t, over the chunk's steps last first; gy = dg·SiLU(z) = dL/dy),
//   D_{k−1} = exp(a·ΣΔ_k)·D_k + r_k,
// and r_k needs no states (only gy, C and Δ):
//   A' scan_backward_local_kernel, per (b, chunk k ≥ 1, channel, state): r_k into the carry
//      buffer's slot k − 1, and for k ≤ nch − 2 the chunk's ΣΔ into dsum [B, nch − 2, Di];
//   B' scan_backward_combine_kernel, per (b, channel, state), chunks right to left: slot k − 1
//      becomes D_{k−1} (in place; slot nch − 2 = r_{nch−1} = D_{nch−2} already);
//   C' scan_backward_kernel, per (b, chunk, 64-channel block): the chunk's reverse recurrence
//      from D_k, on the chunk's states recomputed from its saved entry state, producing ddt, du,
//      the dB/dC partials and the chunk's dA/dD/d dt_bias partials.
// The decay is exp(a·ΣΔ), as in the forward's combine (same rounding bound), or 0 across a packed
// sequence's start (chunk_decay), where A' and C' also cut dh to 0 (no h before a start). The carry buffer is
// [B, nch, Di, Ns] fp32 (slot k: D_k; the last chunk's slot is not read, D_{nch−1} = 0) and C'
// overwrites each word it read with the chunk's dA partial of that (channel, state).

// Phase A'. Grid (channel blocks · (nch − 1), B), block cpb·Ns threads, thread = (channel,
// state); blockIdx.x = (k − 1)·(channel blocks) + channel block, for chunks k = 1 .. nch − 1
// (chunk 0's local dh would carry into nothing). Inputs loaded per tile of TT steps first.
template <typename S>
__global__ void __launch_bounds__(mamba_max_d_state, 1)
    scan_backward_local_kernel(const S* xz, const S* delta, const S* xdbl, const S* a_log,
                               const float* dg, std::size_t T, std::size_t Di, std::size_t Ns,
                               std::size_t R, std::size_t L, std::size_t cpb, float* carry,
                               float* dsum, packed_sequences packing) {
  constexpr std::size_t TT = mamba_backward_tile;
  static_assert(TT <= 32, "membound: a tile's sequence starts are one 32-bit mask");
  __shared__ float g_tile[mamba_scan_channels * TT];
  const std::size_t tid = threadIdx.x, cl = tid / Ns, s = tid % Ns;
  const std::size_t nchb = (Di + cpb - 1) / cpb, k = blockIdx.x / nchb + 1;
  const std::size_t ch = (blockIdx.x % nchb) * cpb + cl;
  const std::size_t b = blockIdx.y;
  const bool active = cl < cpb && ch < Di;  // the others only meet the barriers
  const std::size_t ldx = R + 2 * Ns, nch = (T + L - 1) / L;
  const std::size_t t0 = k * L, t1 = t0 + L < T ? t0 + L : T;
  const float a = active ? -expf(ld(a_log, ch * Ns + s)) : 0.0f;
  float dh = 0, sum = 0;
  bool restarts = false;
  for (std::size_t te = t1; te > t0;) {  // tiles of TT steps, last first
    const std::size_t ts = te - t0 > TT ? te - TT : t0, nt = te - ts;
    const std::uint32_t starts = packing.starts_in(ts, nt);
    restarts = restarts || starts != 0;
    stage_silu<TT>(nullptr, static_cast<const S*>(nullptr), b * T + ts, nt, Di, ch, cl, s, Ns, active, g_tile, dg,
                   xz);
    float dv[TT], gv[TT], cv[TT];
#pragma unroll
    for (std::size_t tt = 0; tt < TT; ++tt) {
      dv[tt] = 0;
      gv[tt] = 0;
      cv[tt] = 0;
      if (active && tt < nt) {
        const std::size_t n = b * T + ts + tt;
        dv[tt] = ld(delta, n * Di + ch);
        gv[tt] = g_tile[cl * TT + tt];  // dL/dy
        cv[tt] = ld(xdbl, n * ldx + R + Ns + s);
      }
    }
    __syncthreads();  // g_tile is rewritten by the next tile
#pragma unroll
    for (std::size_t q = 0; q < TT; ++q) {
      const std::size_t tt = TT - 1 - q;  // last step first
      if (active && tt < nt) {
        dh += gv[tt] * cv[tt];
        dh = (starts >> tt) & 1u ? 0.0f : dh * expf(a * dv[tt]);  // no h before a start
        sum += dv[tt];
      }
    }
    te = ts;
  }
  if (!active) return;
  carry[((b * nch + k - 1) * Di + ch) * Ns + s] = dh;
  if (s == 0 && k + 1 < nch) dsum[(b * (nch - 2) + k - 1) * Di + ch] = restarts ? chunk_restarts : sum;
}

// Phase B'. One thread per (b, channel, state), chunks right to left: D_{k−1} = exp(a·ΣΔ_k)·D_k +
// r_k for k = nch − 2 .. 1, in place (slot k − 1 holds r_k, then D_{k−1}).
template <typename S>
__global__ void scan_backward_combine_kernel(const S* a_log, const float* dsum, float* carry,
                                             std::size_t B, std::size_t nch, std::size_t Di,
                                             std::size_t Ns) {
  const std::size_t per = Di * Ns, total = B * per;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t b = idx / per, r = idx % per, ch = r / Ns;
    const float a = -expf(ld(a_log, r));
    float* const slot = carry + b * nch * per + r;
    const float* const sums = dsum + b * (nch - 2) * Di + ch;
    float dh = slot[(nch - 2) * per];
    for (std::size_t k = nch - 2; k >= 1; --k) {
      dh = chunk_decay(a, sums[(k - 1) * Di]) * dh + slot[(k - 1) * per];
      slot[(k - 1) * per] = dh;
    }
  }
}

// h advanced from step t0 to step t1 (exclusive) of batch row b: the forward's recurrence, in its
// order and formula (so the states are the forward's bits), inputs loaded per tile of TT first.
template <typename S>
__device__ inline float mamba_advance(float h, float a, const S* c, const S* delta, const S* xdbl,
                                      std::size_t b, std::size_t ch, std::size_t s,
                                      std::size_t t0, std::size_t t1, std::size_t T,
                                      std::size_t Di, std::size_t ldx, std::size_t R,
                                      const packed_sequences& packing) {
  constexpr std::size_t TT = mamba_backward_tile;
  for (std::size_t tb = t0; tb < t1; tb += TT) {
    const std::size_t nt = t1 - tb < TT ? t1 - tb : TT;
    const std::uint32_t starts = packing.starts_in(tb, nt);
    float dv[TT], uv[TT], bv[TT];
#pragma unroll
    for (std::size_t tt = 0; tt < TT; ++tt) {
      dv[tt] = 0;
      uv[tt] = 0;
      bv[tt] = 0;
      if (tt < nt) {
        const std::size_t n = b * T + tb + tt;
        dv[tt] = ld(delta, n * Di + ch);
        uv[tt] = membound::silu(ld(c, n * Di + ch));
        bv[tt] = ld(xdbl, n * ldx + R + s);
      }
    }
#pragma unroll
    for (std::size_t tt = 0; tt < TT; ++tt) {
      if (tt < nt) h = expf(a * dv[tt]) * ((starts >> tt) & 1u ? 0.0f : h) + (dv[tt] * uv[tt]) * bv[tt];
    }
  }
  return h;
}

// Phase C'. Grid (64-channel blocks · nch, B), blockIdx.x = k·(64-channel blocks) + block; block
// cpb·Ns threads running the block's channels in groups of cpb, for chunk k only. No states in
// global memory: per group, the chunk's tiles of TT steps are split into mamba_backward_saved_states
// runs of m = ceil(tiles / checkpoints) tiles; a first pass from the saved entry state keeps the
// state at each run's start (the first run's, the entry state, in a register, the others in
// shared memory, each thread its own slots), then the tiles are walked last first: a tile's
// states are recomputed in registers from its run's checkpoint (through the run's earlier tiles
// when m > 1), and the reverse recurrence runs over them with dh starting at D_k (carry[b, k] for
// k < nch − 1, else 0). At L ≤ TT·checkpoints (128 by default) m = 1: one extra pass over the
// chunk, no hs. Writes, for its rows and channels: ddt = dΔ·σ(dt) (S), du (the scan's part, fp32),
// the dB/dC partial part[blk, n, 2·Ns] (summed over the block's channels in order; the chunks'
// rows are disjoint), and, summed over the chunk's steps, dA into carry[b, k, ch, ·] (over the
// D_k each thread read) and small[b, k, ch, ·] = (dD, d dt_bias), reduced over (b, k) in order by
// reduce_small_kernel.
template <typename S>
__global__ void __launch_bounds__(mamba_max_d_state, 1)
    scan_backward_kernel(const S* xz, const S* c, const S* delta, const S* xdbl, const S* a_log,
                         const S* dskip, const float* states, float* carry, const float* dg,
                         std::size_t T, std::size_t Di, std::size_t Ns, std::size_t R,
                         std::size_t L, std::size_t cpb, S* ddt, float* du, float* part,
                         float* small, packed_sequences packing) {
  constexpr std::size_t TT = mamba_backward_tile, NCK = mamba_backward_saved_states;
  // One row per step, padded by one word so that lanes reading different steps hit different banks.
  __shared__ float q_dd[TT * (mamba_max_d_state + 1)];
  __shared__ float q_du[TT * (mamba_max_d_state + 1)];
  __shared__ float q_b[TT * (mamba_max_d_state + 1)];
  __shared__ float q_c[TT * (mamba_max_d_state + 1)];
  // The runs' entry states 1 .. NCK − 1: ck[(j − 1)·threads + tid] (each thread its own words).
  __shared__ float ck[(NCK - 1) * mamba_max_d_state];
  // A tile's SiLU(c) and dL/dy per (channel, step) (stage_silu) live in q_b and q_c's words until
  // the tile's inputs are in registers (static shared memory is capped at 48 KiB: no room for two
  // more arrays).
  static_assert(mamba_scan_channels * TT <= TT * (mamba_max_d_state + 1), "membound: the staged tiles fit q_b");
  float* const u_tile = q_b;
  float* const g_tile = q_c;
  const std::size_t nthr = blockDim.x, pitch = nthr + 1, tid = threadIdx.x;
  const std::size_t cl = tid / Ns, s = tid % Ns;
  const std::size_t b = blockIdx.y, B = gridDim.y, N = B * T;
  const std::size_t nblk = (Di + mamba_scan_channels - 1) / mamba_scan_channels;
  const std::size_t k = blockIdx.x / nblk, blk = blockIdx.x % nblk;
  const std::size_t i0 = blk * mamba_scan_channels;
  const std::size_t i1 = i0 + mamba_scan_channels < Di ? i0 + mamba_scan_channels : Di;
  const std::size_t ldx = R + 2 * Ns, nch = (T + L - 1) / L;
  const std::size_t t0 = k * L, t1 = t0 + L < T ? t0 + L : T;
  const std::size_t ntiles = (t1 - t0 + TT - 1) / TT, m = (ntiles + NCK - 1) / NCK;
  float* const pblk = part + blk * N * 2 * Ns;
  for (std::size_t g0 = i0; g0 < i1; g0 += cpb) {
    const std::size_t ch = g0 + cl;
    const bool active = cl < cpb && ch < i1;
    const float a = active ? -expf(ld(a_log, ch * Ns + s)) : 0.0f;
    const float dk = active ? ld(dskip, ch) : 0.0f;
    // D_k, this thread's own word of the carry buffer (reused below for its dA partial).
    float* const my_carry = carry + ((b * nch + k) * Di + (active ? ch : 0)) * Ns + s;
    float dh = (active && k + 1 < nch) ? *my_carry : 0.0f;
    float da = 0, dd_acc = 0, dbias = 0;
    const float entry =
        (active && k > 0) ? states[((b * (nch - 1) + k - 1) * Di + ch) * Ns + s] : 0.0f;
    if (active) {  // the runs' entry states (run j starts at tile j·m)
      float h = entry;
      for (std::size_t j = 1; j * m < ntiles; ++j) {
        const std::size_t rs = t0 + (j - 1) * m * TT;
        h = mamba_advance(h, a, c, delta, xdbl, b, ch, s, rs, rs + m * TT, T, Di, ldx, R, packing);
        ck[(j - 1) * nthr + tid] = h;
      }
    }
    for (std::size_t ti = ntiles; ti-- > 0;) {  // tiles of TT steps, last first
      const std::size_t ts = t0 + ti * TT, nt = t1 - ts < TT ? t1 - ts : TT;
      // The state before the tile: its run's checkpoint, advanced over the run's earlier tiles.
      float h = 0;
      if (active) {
        const std::size_t j = ti / m, rs = t0 + j * m * TT;
        h = j == 0 ? entry : ck[(j - 1) * nthr + tid];
        h = mamba_advance(h, a, c, delta, xdbl, b, ch, s, rs, ts, T, Di, ldx, R, packing);
      }
      const std::uint32_t starts = packing.starts_in(ts, nt);
      stage_silu<TT>(u_tile, c, b * T + ts, nt, Di, ch, cl, s, Ns, active, g_tile, dg, xz);
      const float h_before = h;
      // The tile's inputs first (tt = t − ts), its states in registers, then the reverse
      // recurrence over them.
      float dv[TT], uv[TT], gv[TT], bv[TT], cv[TT], hv[TT], ev[TT];
#pragma unroll
      for (std::size_t tt = 0; tt < TT; ++tt) {
        dv[tt] = 0;
        uv[tt] = 0;
        gv[tt] = 0;
        bv[tt] = 0;
        cv[tt] = 0;
        if (active && tt < nt) {
          const std::size_t n = b * T + ts + tt;
          dv[tt] = ld(delta, n * Di + ch);
          uv[tt] = u_tile[cl * TT + tt];
          gv[tt] = g_tile[cl * TT + tt];  // dL/dy
          bv[tt] = ld(xdbl, n * ldx + R + s);
          cv[tt] = ld(xdbl, n * ldx + R + Ns + s);
        }
      }
      __syncthreads();  // q_b and q_c are written below
#pragma unroll
      for (std::size_t tt = 0; tt < TT; ++tt) {  // the forward's formula: its bits
        ev[tt] = expf(a * dv[tt]);
        if ((starts >> tt) & 1u) h = 0;
        h = ev[tt] * h + (dv[tt] * uv[tt]) * bv[tt];
        hv[tt] = h;
      }
#pragma unroll
      for (std::size_t q = 0; q < TT; ++q) {
        const std::size_t tt = TT - 1 - q;  // last step first
        float qdd = 0, qdu = 0, qb = 0, qc = 0;
        if (active && tt < nt) {
          const float d = dv[tt], u = uv[tt], gy = gv[tt], bt = bv[tt], ct = cv[tt];
          const bool start = (starts >> tt) & 1u;  // h_t does not depend on h_{t−1}
          const float hp = start ? 0.0f : (tt > 0 ? hv[tt - 1] : h_before);
          if (s == 0) dd_acc += gy * u;
          dh += gy * ct;  // y_t = C_t·h_t
          qc = gy * hv[tt];
          const float e = ev[tt];
          qdd = dh * (a * e * hp + bt * u);
          da += dh * d * e * hp;
          qdu = dh * bt;
          qb = dh * (d * u);
          dh = start ? 0.0f : dh * e;  // h_t depends on h_{t−1} through exp(Δ_t·a)
        }
        q_dd[tt * pitch + tid] = qdd;
        q_du[tt * pitch + tid] = qdu;
        q_b[tt * pitch + tid] = qb;
        q_c[tt * pitch + tid] = qc;
      }
      __syncthreads();
      if (active) {  // per (row, channel): Σ over the state lanes in order; lane s: steps s, s + Ns, ...
        for (std::size_t tt = s; tt < nt; tt += Ns) {
          const std::size_t n = b * T + ts + tt;
          float sdd = 0, sdu = 0;
          for (std::size_t j = 0; j < Ns; ++j) {
            sdd += q_dd[tt * pitch + cl * Ns + j];
            sdu += q_du[tt * pitch + cl * Ns + j];
          }
          const float d = ld(delta, n * Di + ch);
          const float gy = dg[n * Di + ch] * membound::silu(ld(xz, n * 2 * Di + Di + ch));
          const float v = sdd * membound::softplus_grad_from_output(d);
          dbias += v;
          st(ddt, n * Di + ch, v);
          du[n * Di + ch] = gy * dk + d * sdu;
        }
      }
      // per (row, state): Σ over this group's channels in order, added to the block's partial
      for (std::size_t p = tid; p < nt * Ns; p += nthr) {
        const std::size_t tt = p / Ns, j = p % Ns, n = b * T + ts + tt;
        float sb = 0, sc = 0;
        for (std::size_t kk = 0; kk < cpb && g0 + kk < i1; ++kk) {
          sb += q_b[tt * pitch + kk * Ns + j];
          sc += q_c[tt * pitch + kk * Ns + j];
        }
        float* dst = pblk + n * 2 * Ns;
        if (g0 == i0) {
          dst[j] = sb;
          dst[Ns + j] = sc;
        } else {
          dst[j] += sb;
          dst[Ns + j] += sc;
        }
      }
      __syncthreads();  // the tiles are overwritten next
    }
    // d dt_bias: each lane's partial over the steps it finished, summed over the lanes in order.
    q_dd[tid] = dbias;
    __syncthreads();
    if (active) {
      *my_carry = da;  // read (as D_k) by this thread only, before
      if (s == 0) {
        float* out = small + ((b * nch + k) * Di + ch) * 2;
        float sum = 0;
        for (std::size_t j = 0; j < Ns; ++j) sum += q_dd[cl * Ns + j];
        out[0] = dd_acc;
        out[1] = sum;
      }
    }
    __syncthreads();  // q_dd is the next group's tile
  }
}

// dx_dbl[n, R + j] = Σ_blk part[blk, n, j] for j < 2·Ns, the blocks in order.
template <typename S>
__global__ void reduce_bc_kernel(const float* part, S* dxdbl, std::size_t N, std::size_t Ns,
                                 std::size_t R, std::size_t nblk) {
  const std::size_t w = 2 * Ns, total = N * w, ldx = R + w;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t n = idx / w, j = idx % w;
    float v = 0;
    for (std::size_t k = 0; k < nblk; ++k) v += part[(k * N + n) * w + j];
    st(dxdbl, n * ldx + R + j, v);
  }
}

// The small parameters' gradients: the partials of the rows r = (b, chunk) (rows = batch ·
// chunks), da[r, ch, Ns] and small[r, ch, 2] = (dD, d dt_bias), summed over r in order and added
// once: dA_log = dA ⊙ A, dD, d dt_bias.
template <typename S>
__global__ void reduce_small_kernel(const float* da, const float* small, const S* a_log,
                                    S* g_a_log, S* g_d, S* g_dt_bias, std::size_t rows,
                                    std::size_t Di, std::size_t Ns) {
  const std::size_t w = Ns + 2, total = Di * w;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t ch = idx / w, j = idx % w;
    float v = 0;
    if (j < Ns) {
      for (std::size_t r = 0; r < rows; ++r) v += da[(r * Di + ch) * Ns + j];
    } else {
      for (std::size_t r = 0; r < rows; ++r) v += small[(r * Di + ch) * 2 + (j - Ns)];
    }
    if (j < Ns) {
      const std::size_t at = ch * Ns + j;
      st(g_a_log, at, ld(g_a_log, at) + v * -expf(ld(a_log, at)));
    } else if (j == Ns) {
      st(g_d, ch, ld(g_d, ch) + v);
    } else {
      st(g_dt_bias, ch, ld(g_dt_bias, ch) + v);
    }
  }
}

// The conv's input gradient into dxz's x half: dxi[n, i] = Σ_k w[i, k]·dc[n + K−1−k, i] within the
// sequence, dc = du ⊙ SiLU'(c).
template <typename S>
__global__ void conv_backward_data_kernel(const float* du, const S* c, const S* w, S* dxz,
                                          std::size_t N, std::size_t T, std::size_t Di,
                                          std::size_t K, packed_sequences packing) {
  const std::size_t total = N * Di;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t n = idx / Di, i = idx % Di, end = sequence_end(packing, n, T);
    float v = 0;
    for (std::size_t k = 0; k < K; ++k) {
      if (n + K - 1 - k >= end) continue;  // that output lies past the sequence's end
      const std::size_t m = (n + K - 1 - k) * Di + i;
      v += ld(w, i * K + k) * (du[m] * membound::silu_grad(ld(c, m)));
    }
    st(dxz, n * 2 * Di + i, v);
  }
}

// The conv's weight and bias gradients, first pass: grid (channel blocks, row blocks), one thread
// per channel summing its rows in order into its own part[rb, i, 0..K] (K: the bias).
template <typename S>
__global__ void conv_backward_weight_kernel(const float* du, const S* c, const S* xz,
                                            float* part, std::size_t N, std::size_t T,
                                            std::size_t Di, std::size_t K, packed_sequences packing) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i >= Di) return;
  const std::size_t r0 = blockIdx.y * mamba_conv_rows;
  const std::size_t r1 = r0 + mamba_conv_rows < N ? r0 + mamba_conv_rows : N;
  float* out = part + (blockIdx.y * Di + i) * (K + 1);
  for (std::size_t k = 0; k <= K; ++k) out[k] = 0;
  for (std::size_t n = r0; n < r1; ++n) {
    const std::size_t t = token_position(packing, n, T);
    const float dc = du[n * Di + i] * membound::silu_grad(ld(c, n * Di + i));
    out[K] += dc;
    for (std::size_t k = 0; k < K; ++k) {
      if (t + k < K - 1) continue;
      out[k] += dc * ld(xz, (n + k + 1 - K) * 2 * Di + i);
    }
  }
}

// Second pass: Σ over the row blocks in order, added once into conv_w [Di, K] and conv_b [Di].
template <typename S>
__global__ void conv_reduce_kernel(const float* part, S* g_w, S* g_b, std::size_t nrb,
                                   std::size_t Di, std::size_t K) {
  const std::size_t w = K + 1, total = Di * w;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t i = idx / w, k = idx % w;
    float v = 0;
    for (std::size_t r = 0; r < nrb; ++r) v += part[(r * Di + i) * w + k];
    if (k < K) {
      st(g_w, i * K + k, ld(g_w, i * K + k) + v);
    } else {
      st(g_b, i, ld(g_b, i) + v);
    }
  }
}

// Decoding, conv: one thread per (b, i): c = conv_b + Σ_{k<K−1} w·window[k] + w[K−1]·xi (rounded
// to S), the window shifted by one, u = SiLU(c) into us (S, x_proj's input) and uf (fp32).
template <typename S>
__global__ void step_conv_kernel(const S* xz, const S* w, const S* bias, float* window, S* us,
                                 float* uf, std::size_t B, std::size_t Di, std::size_t K) {
  const std::size_t total = B * Di;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t b = idx / Di, i = idx % Di;
    float* cs = window + idx * (K - 1);
    const float xi = ld(xz, b * 2 * Di + i);
    float cv = ld(bias, i);
    for (std::size_t k = 0; k + 1 < K; ++k) cv += ld(w, i * K + k) * cs[k];
    cv += ld(w, i * K + K - 1) * xi;
    if (K > 1) {
      for (std::size_t k = 0; k + 2 < K; ++k) cs[k] = cs[k + 1];
      cs[K - 2] = xi;
    }
    cv = round_to<S>(cv);
    const float u = membound::silu(cv);
    st(us, idx, u);
    uf[idx] = u;
  }
}

// Decoding, scan: one thread per (b, i) over its Ns states (state [B, Di, Ns] fp32), in the
// forward's formula and summation order; the gate fused.
template <typename S>
__global__ void step_scan_kernel(const S* xz, const float* uf, const float* dt, const S* xdbl,
                                 const S* a_log, const S* dt_bias, const S* dskip, float* state,
                                 S* gated, std::size_t B, std::size_t Di, std::size_t Ns,
                                 std::size_t R) {
  const std::size_t total = B * Di, ldx = R + 2 * Ns;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t b = idx / Di, i = idx % Di;
    const float d = round_to<S>(membound::softplus(dt[idx] + ld(dt_bias, i)));
    const float u = uf[idx];
    float* h = state + idx * Ns;
    float y = 0;
    for (std::size_t j = 0; j < Ns; ++j) {
      const float a = -expf(ld(a_log, i * Ns + j));
      const float hv = expf(a * d) * h[j] + (d * u) * ld(xdbl, b * ldx + R + j);
      h[j] = hv;
      y += ld(xdbl, b * ldx + R + Ns + j) * hv;
    }
    y += ld(dskip, i) * u;
    st(gated, idx, y * membound::silu(ld(xz, b * 2 * Di + Di + i)));
  }
}
