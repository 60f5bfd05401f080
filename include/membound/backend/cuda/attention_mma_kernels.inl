// The tensor-core attention kernels (mma.sync forward, dQ, dK/dV).
// A fragment, not a header: attention_mma.cuh includes it inside namespace membound::gpu::detail, and
// tests/emulation/attention_cuda_emulate.cpp includes the same text inside its emulation namespace,
// where the CUDA built-ins are host threads (tests/emulation/cuda_emulate.py attention). One text, compiled
// by nvcc and by the emulation: change the kernels here.
// Fragment coordinates, PTX ISA "mma.m16n8k16": lane = 4·gr + tq. A (16×16, row-major): a[0]
// holds (gr, 2tq..2tq+1), a[1] (gr+8, 2tq..), a[2] (gr, 2tq+8..), a[3] (gr+8, 2tq+8..), low half
// first. B (16×8): b0 holds (k 2tq..2tq+1, n gr), b1 (k 2tq+8.., n gr). C/D (16×8): c[0], c[1] at
// (gr, 2tq), (gr, 2tq+1); c[2], c[3] at (gr+8, 2tq), (gr+8, 2tq+1).

// Two adjacent halves as one 32-bit word (even offsets from a 16-byte base). The tiles are written
// as halves; a __syncthreads separates every such write from these reads.
__device__ inline std::uint32_t lds32(const std::uint16_t* p) {
  return *reinterpret_cast<const std::uint32_t*>(p);
}
template <bool Bf16>
__device__ inline std::uint32_t pack_pair(float lo, float hi) {
  return static_cast<std::uint32_t>(half_bits<Bf16>(lo)) |
         (static_cast<std::uint32_t>(half_bits<Bf16>(hi)) << 16);
}

// Rows [r0, r0 + 64) × columns [0, DM) of a head slice of an fp32 [B·T, width] matrix (first
// column col0), as 16-bit bits: row-major at stride DM + 8 into rm, transposed at stride 72 into
// tr (either may be null). Rows past T and columns past D are zero, so padded products add 0.
template <bool Bf16, unsigned DM>
__device__ inline void mma_load_tile(std::uint16_t* rm, std::uint16_t* tr, const float* src,
                                     std::size_t b, std::size_t T, std::size_t r0,
                                     std::size_t width, std::size_t col0, std::size_t D) {
  constexpr std::size_t LD = mma_row_stride(DM);
  for (unsigned e = threadIdx.x; e < mma_tile * DM; e += mma_threads) {
    const unsigned r = e / DM, d = e % DM;
    const std::size_t row = r0 + r;
    const std::uint16_t h = half_bits<Bf16>(row < T && d < D ? src[(b * T + row) * width + col0 + d]
                                                             : 0.0f);
    if (rm != nullptr) rm[r * LD + d] = h;
    if (tr != nullptr) tr[d * mma_tr_stride + r] = h;
  }
}

// A fragment: rows row0..row0+15, columns k0..k0+15 of a row-major tile of stride LD.
template <std::size_t LD>
__device__ inline void mma_frag_a(std::uint32_t (&a)[4], const std::uint16_t* tile, unsigned row0,
                                  unsigned k0, unsigned lane) {
  const std::uint16_t* p = tile + (row0 + (lane >> 2)) * LD + k0 + 2 * (lane & 3);
  a[0] = lds32(p);
  a[1] = lds32(p + 8 * LD);
  a[2] = lds32(p + 8);
  a[3] = lds32(p + 8 * LD + 8);
}
// B fragment of B[k][n] = tile[n][k]: columns n0..n0+7, k0..k0+15 (pairs run along k, the tile's
// rows).
template <std::size_t LD>
__device__ inline void mma_frag_b(std::uint32_t& b0, std::uint32_t& b1, const std::uint16_t* tile,
                                  unsigned n0, unsigned k0, unsigned lane) {
  const std::uint16_t* p = tile + (n0 + (lane >> 2)) * LD + k0 + 2 * (lane & 3);
  b0 = lds32(p);
  b1 = lds32(p + 8);
}
// The A operand for columns 16kk..16kk+15 of a 16×(8·NT) fp32 accumulator, rounded: the C layout
// of tiles 2kk and 2kk+1 is the A layout of their union.
template <bool Bf16, unsigned NT>
__device__ inline void mma_acc_to_a(std::uint32_t (&a)[4], const float (&c)[NT][4], unsigned kk) {
  a[0] = pack_pair<Bf16>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack_pair<Bf16>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack_pair<Bf16>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack_pair<Bf16>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// c += A·Bᵀ for the warp's 16 rows from row0 of the row-major tile `a` and the 8·NT rows of the
// row-major tile `b`, over DM = 16·KB columns (S = Q·Kᵀ, dP = dO·Vᵀ and their transposes).
template <bool Bf16, std::size_t LD, unsigned KB, unsigned NT>
__device__ inline void mma_rows_by_rows(float (&c)[NT][4], const std::uint16_t* a, unsigned row0,
                                        const std::uint16_t* b, unsigned lane) {
#pragma unroll
  for (unsigned n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
#pragma unroll
  for (unsigned kb = 0; kb < KB; ++kb) {
    std::uint32_t fa[4];
    mma_frag_a<LD>(fa, a, row0, 16 * kb, lane);
#pragma unroll
    for (unsigned n = 0; n < NT; ++n) {
      std::uint32_t b0, b1;
      mma_frag_b<LD>(b0, b1, b, 8 * n, 16 * kb, lane);
      mma_16816<Bf16>(c[n], fa, b0, b1);
    }
  }
}
// acc += P·B with P the warp's 16×(8·NT) accumulator rounded to operands (P, dS and their
// transposes) and B[k][n] = bt[n][k] from a transposed tile (V, K, dO, Q), n over DM = 8·DT.
template <bool Bf16, unsigned NT, unsigned DT>
__device__ inline void mma_acc_by_tile(float (&acc)[DT][4], const float (&p)[NT][4],
                                       const std::uint16_t* bt, unsigned lane) {
#pragma unroll
  for (unsigned kk = 0; kk < NT / 2; ++kk) {
    std::uint32_t a[4];
    mma_acc_to_a<Bf16, NT>(a, p, kk);
#pragma unroll
    for (unsigned n = 0; n < DT; ++n) {
      std::uint32_t b0, b1;
      mma_frag_b<mma_tr_stride>(b0, b1, bt, 8 * n, 16 * kk, lane);
      mma_16816<Bf16>(acc[n], a, b0, b1);
    }
  }
}

// The warp's accumulator rows (row0 + gr and row0 + gr + 8 of the batch's T) into an fp32
// [B·T, width] matrix from column col0; rows past T and columns past D are not written.
template <unsigned DT>
__device__ inline void mma_store_rows(float* dst, const float (&acc)[DT][4], std::size_t b,
                                      std::size_t T, std::size_t row0, std::size_t width,
                                      std::size_t col0, std::size_t D, unsigned lane) {
  const unsigned gr = lane >> 2, tq = lane & 3;
#pragma unroll
  for (unsigned r = 0; r < 2; ++r) {
    const std::size_t i = row0 + gr + 8 * r;
    if (i >= T) continue;
#pragma unroll
    for (unsigned n = 0; n < DT; ++n)
#pragma unroll
      for (unsigned c = 0; c < 2; ++c) {
        const std::size_t d = 8 * n + 2 * tq + c;
        if (d < D) dst[(b * T + i) * width + col0 + d] = acc[n][2 * r + c];
      }
  }
}

// The keys that the warp's rows row0 and row0 + 8 see, [kb, ke), read once per kernel (packed: a
// search of the offsets each); a row past T sees none. key_end(i) <= T.
__device__ inline void mma_row_keys(const attention_band& band, std::size_t T, std::size_t row0,
                                    std::size_t (&kb)[2], std::size_t (&ke)[2]) {
#pragma unroll
  for (unsigned r = 0; r < 2; ++r) {
    const std::size_t i = row0 + 8 * r;
    kb[r] = i < T ? band.key_begin(i) : 0;
    ke[r] = i < T ? band.key_end(i) : 0;
  }
}

// Forward: one CTA per (64 queries, head, batch), warp w owns query rows 16w..16w+15 of the
// block. Same outputs as flash_forward_kernel: o (S) and lse (natural log of the unscaled-score
// softmax sum plus the max, fp32). Causal: key tiles past the block's last row are never loaded.
template <typename S, unsigned DM>
__global__ void __launch_bounds__(mma_threads) flash_forward_mma_kernel(
    const float* q, const float* k, const float* v, S* o, float* lse, std::size_t T,
    std::size_t H, std::size_t Hkv, std::size_t D, attention_band band, float scale) {
  constexpr bool Bf16 = std::is_same_v<S, bf16>;
  constexpr std::size_t LD = mma_row_stride(DM);
  constexpr unsigned NT = mma_tile / 8, DT = DM / 8, KB = DM / 16;
  static_assert(DM % 16 == 0 && mma_threads == 2 * mma_tile, "membound: 4 warps of 16 rows");
  std::uint16_t* qs = reinterpret_cast<std::uint16_t*>(attn_mma_smem());
  std::uint16_t* ks = qs + mma_tile * LD;
  std::uint16_t* vt = ks + mma_tile * LD;
  const std::size_t q0 = static_cast<std::size_t>(blockIdx.x) * mma_tile;
  const std::size_t h = blockIdx.y, b = blockIdx.z, g = h / (H / Hkv);
  const std::size_t HD = H * D, KD = Hkv * D;
  const unsigned lane = threadIdx.x % 32, w0 = 16 * (threadIdx.x / 32);
  const unsigned gr = lane >> 2, tq = lane & 3;
  mma_load_tile<Bf16, DM>(qs, nullptr, q, b, T, q0, HD, h * D, D);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows gr and gr + 8 of the warp
  std::size_t kb[2], ke[2];
  mma_row_keys(band, T, q0 + w0 + gr, kb, ke);
  float acc[DT][4];
#pragma unroll
  for (unsigned n = 0; n < DT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const std::size_t last = q0 + mma_tile < T ? q0 + mma_tile : T;
  const std::size_t kv_end = band.key_end(last - 1);  // key tiles outside the band: never loaded
  for (std::size_t j0 = band.key_begin(q0) / mma_tile * mma_tile; j0 < kv_end; j0 += mma_tile) {
    __syncthreads();  // the previous K and V tiles are no longer read
    mma_load_tile<Bf16, DM>(ks, nullptr, k, b, T, j0, KD, g * D, D);
    mma_load_tile<Bf16, DM>(nullptr, vt, v, b, T, j0, KD, g * D, D);
    __syncthreads();
    float s[NT][4];
    mma_rows_by_rows<Bf16, LD, KB, NT>(s, qs, w0, ks, lane);  // S = Q·Kᵀ
    // Scale after the dot (as the backward recomputes it), mask, and the rows' tile maxima. A row
    // past T keeps m = -inf: its correction is 1 and its P row 0, never exp(-inf + inf).
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (unsigned n = 0; n < NT; ++n)
#pragma unroll
      for (unsigned e = 0; e < 4; ++e) {
        const std::size_t j = j0 + 8 * n + 2 * tq + (e & 1);
        const bool ok = kb[e >> 1] <= j && j < ke[e >> 1];
        s[n][e] = ok ? s[n][e] * scale : -INFINITY;
        mt[e >> 1] = fmaxf(mt[e >> 1], s[n][e]);
      }
    float corr[2];
#pragma unroll
    for (unsigned r = 0; r < 2; ++r) {
      mt[r] = fmaxf(mt[r], lane_xor(mt[r], 1));
      mt[r] = fmaxf(mt[r], lane_xor(mt[r], 2));
      const float m_new = fmaxf(m[r], mt[r]);
      corr[r] = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new);  // m = -inf first: 0, O is 0
      m[r] = m_new;
      l[r] *= corr[r];
    }
#pragma unroll
    for (unsigned n = 0; n < NT; ++n)
#pragma unroll
      for (unsigned e = 0; e < 4; ++e) {
        const float mr = m[e >> 1];
        const float p = mr == -INFINITY ? 0.0f : expf(s[n][e] - mr);  // masked: exp(-inf) = 0
        s[n][e] = p;
        l[e >> 1] += p;  // this lane's share of the row sum, in fp32 before rounding
      }
#pragma unroll
    for (unsigned n = 0; n < DT; ++n)
#pragma unroll
      for (unsigned e = 0; e < 4; ++e) acc[n][e] *= corr[e >> 1];
    mma_acc_by_tile<Bf16, NT, DT>(acc, s, vt, lane);  // O += P·V, P straight from the registers
  }
#pragma unroll
  for (unsigned r = 0; r < 2; ++r) {
    l[r] += lane_xor(l[r], 1);  // the quad's four shares; every lane gets the same sum
    l[r] += lane_xor(l[r], 2);
    const std::size_t i = q0 + w0 + gr + 8 * r;
    if (i >= T) continue;
    const float inv = 1.0f / l[r];  // l >= 1: the row's max contributes exp(0)
#pragma unroll
    for (unsigned n = 0; n < DT; ++n)
#pragma unroll
      for (unsigned c = 0; c < 2; ++c) {
        const std::size_t d = 8 * n + 2 * tq + c;
        if (d < D) st(o, (b * T + i) * HD + h * D + d, acc[n][2 * r + c] * inv);
      }
    if (tq == 0) lse[(b * H + h) * T + i] = m[r] + logf(l[r]);
  }
}

// dQ: one CTA per (64 queries, head, batch), warp w its 16 rows; key tiles in order up to the
// diagonal. dS = P ⊙ (dP − Δ)·scale with P = exp(S·scale − lse), dQ = dS·K.
template <typename S, unsigned DM>
__global__ void __launch_bounds__(mma_threads) flash_dq_mma_kernel(
    const float* q, const float* k, const float* v, const float* dout, const float* lse,
    const float* delta, float* dq, std::size_t T, std::size_t H, std::size_t Hkv, std::size_t D,
    attention_band band, float scale) {
  constexpr bool Bf16 = std::is_same_v<S, bf16>;
  constexpr std::size_t LD = mma_row_stride(DM);
  constexpr unsigned NT = mma_tile / 8, DT = DM / 8, KB = DM / 16;
  std::uint16_t* qs = reinterpret_cast<std::uint16_t*>(attn_mma_smem());
  std::uint16_t* dos = qs + mma_tile * LD;
  std::uint16_t* ks = dos + mma_tile * LD;
  std::uint16_t* vs = ks + mma_tile * LD;
  std::uint16_t* kt = vs + mma_tile * LD;
  const std::size_t q0 = static_cast<std::size_t>(blockIdx.x) * mma_tile;
  const std::size_t h = blockIdx.y, b = blockIdx.z, g = h / (H / Hkv);
  const std::size_t HD = H * D, KD = Hkv * D;
  const unsigned lane = threadIdx.x % 32, w0 = 16 * (threadIdx.x / 32);
  const unsigned gr = lane >> 2, tq = lane & 3;
  mma_load_tile<Bf16, DM>(qs, nullptr, q, b, T, q0, HD, h * D, D);
  mma_load_tile<Bf16, DM>(dos, nullptr, dout, b, T, q0, HD, h * D, D);
  float li[2], di[2];
  std::size_t kb[2], ke[2];
  mma_row_keys(band, T, q0 + w0 + gr, kb, ke);
#pragma unroll
  for (unsigned r = 0; r < 2; ++r) {
    const std::size_t i = q0 + w0 + gr + 8 * r;
    li[r] = i < T ? lse[(b * H + h) * T + i] : 0.0f;
    di[r] = i < T ? delta[(b * H + h) * T + i] : 0.0f;
  }
  float acc[DT][4];
#pragma unroll
  for (unsigned n = 0; n < DT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const std::size_t last = q0 + mma_tile < T ? q0 + mma_tile : T;
  const std::size_t kv_end = band.key_end(last - 1);  // key tiles outside the band: never loaded
  for (std::size_t j0 = band.key_begin(q0) / mma_tile * mma_tile; j0 < kv_end; j0 += mma_tile) {
    __syncthreads();
    mma_load_tile<Bf16, DM>(ks, kt, k, b, T, j0, KD, g * D, D);
    mma_load_tile<Bf16, DM>(vs, nullptr, v, b, T, j0, KD, g * D, D);
    __syncthreads();
    float s[NT][4], dp[NT][4];
    mma_rows_by_rows<Bf16, LD, KB, NT>(s, qs, w0, ks, lane);    // S = Q·Kᵀ
    mma_rows_by_rows<Bf16, LD, KB, NT>(dp, dos, w0, vs, lane);  // dP = dO·Vᵀ
#pragma unroll
    for (unsigned n = 0; n < NT; ++n)
#pragma unroll
      for (unsigned e = 0; e < 4; ++e) {
        const std::size_t j = j0 + 8 * n + 2 * tq + (e & 1);
        const bool ok = kb[e >> 1] <= j && j < ke[e >> 1];
        const float p = ok ? expf(s[n][e] * scale - li[e >> 1]) : 0.0f;
        s[n][e] = p * (dp[n][e] - di[e >> 1]) * scale;  // dS
      }
    mma_acc_by_tile<Bf16, NT, DT>(acc, s, kt, lane);  // dQ += dS·K
  }
  mma_store_rows<DT>(dq, acc, b, T, q0 + w0, HD, h * D, D, lane);
}

// dK, dV: one CTA per (64 keys, kv head, batch), warp w its 16 keys; the group's query heads, then
// the query tiles, in a fixed order. Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ as [keys, queries] so P and dS are
// A operands of dV += Pᵀ·dO and dK += dSᵀ·Q. Causal: query tiles before the block's first key
// are skipped.
template <typename S, unsigned DM>
__global__ void __launch_bounds__(mma_threads) flash_dkdv_mma_kernel(
    const float* q, const float* k, const float* v, const float* dout, const float* lse,
    const float* delta, float* dk, float* dv, std::size_t T, std::size_t H, std::size_t Hkv,
    std::size_t D, attention_band band, float scale) {
  constexpr bool Bf16 = std::is_same_v<S, bf16>;
  constexpr std::size_t LD = mma_row_stride(DM), LT = mma_tr_stride;
  constexpr unsigned NT = mma_tile / 8, DT = DM / 8, KB = DM / 16;
  float* ls = reinterpret_cast<float*>(attn_mma_smem());
  float* dl = ls + mma_tile;
  std::uint16_t* ks = reinterpret_cast<std::uint16_t*>(dl + mma_tile);
  std::uint16_t* vs = ks + mma_tile * LD;
  std::uint16_t* qs = vs + mma_tile * LD;
  std::uint16_t* dos = qs + mma_tile * LD;
  std::uint16_t* qt = dos + mma_tile * LD;
  std::uint16_t* dot = qt + DM * LT;
  const std::size_t k0 = static_cast<std::size_t>(blockIdx.x) * mma_tile;
  const std::size_t g = blockIdx.y, b = blockIdx.z, group = H / Hkv;
  const std::size_t HD = H * D, KD = Hkv * D;
  const unsigned lane = threadIdx.x % 32, w0 = 16 * (threadIdx.x / 32);
  const unsigned gr = lane >> 2, tq = lane & 3;
  mma_load_tile<Bf16, DM>(ks, nullptr, k, b, T, k0, KD, g * D, D);
  mma_load_tile<Bf16, DM>(vs, nullptr, v, b, T, k0, KD, g * D, D);
  float dka[DT][4], dva[DT][4];
  // The queries that see the warp's keys gr and gr + 8, [qb, qe), read once.
  std::size_t qb[2], qe[2];
#pragma unroll
  for (unsigned r = 0; r < 2; ++r) {
    const std::size_t j = k0 + w0 + gr + 8 * r;
    qb[r] = j < T ? band.query_begin(j) : 0;
    qe[r] = j < T ? band.query_end(j) : 0;
  }
#pragma unroll
  for (unsigned n = 0; n < DT; ++n)
#pragma unroll
    for (unsigned e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.0f;
  // Query tiles outside the block's band are skipped (k0 is a multiple of the query tile).
  const std::size_t i_begin = band.query_begin(k0) / mma_tile * mma_tile;
  const std::size_t i_end = band.query_end((k0 + mma_tile < T ? k0 + mma_tile : T) - 1);
  for (std::size_t hh = 0; hh < group; ++hh) {
    const std::size_t h = g * group + hh;
    for (std::size_t i0 = i_begin; i0 < i_end; i0 += mma_tile) {
      __syncthreads();  // the previous query tile is no longer read
      mma_load_tile<Bf16, DM>(qs, qt, q, b, T, i0, HD, h * D, D);
      mma_load_tile<Bf16, DM>(dos, dot, dout, b, T, i0, HD, h * D, D);
      for (unsigned r = threadIdx.x; r < mma_tile; r += mma_threads) {
        const std::size_t row = i0 + r;
        ls[r] = row < T ? lse[(b * H + h) * T + row] : 0.0f;
        dl[r] = row < T ? delta[(b * H + h) * T + row] : 0.0f;
      }
      __syncthreads();
      float st_[NT][4], dpt[NT][4];
      mma_rows_by_rows<Bf16, LD, KB, NT>(st_, ks, w0, qs, lane);   // Sᵀ = K·Qᵀ
      mma_rows_by_rows<Bf16, LD, KB, NT>(dpt, vs, w0, dos, lane);  // dPᵀ = V·dOᵀ
#pragma unroll
      for (unsigned n = 0; n < NT; ++n)
#pragma unroll
        for (unsigned e = 0; e < 4; ++e) {
          const unsigned c = 8 * n + 2 * tq + (e & 1);  // the query's row in the tile
          const std::size_t i = i0 + c;
          const bool ok = qb[e >> 1] <= i && i < qe[e >> 1];
          const float p = ok ? expf(st_[n][e] * scale - ls[c]) : 0.0f;
          st_[n][e] = p;
          dpt[n][e] = p * (dpt[n][e] - dl[c]) * scale;  // dSᵀ
        }
      mma_acc_by_tile<Bf16, NT, DT>(dva, st_, dot, lane);  // dV += Pᵀ·dO
      mma_acc_by_tile<Bf16, NT, DT>(dka, dpt, qt, lane);   // dK += dSᵀ·Q
    }
  }
  mma_store_rows<DT>(dk, dka, b, T, k0 + w0, KD, g * D, D, lane);
  mma_store_rows<DT>(dv, dva, b, T, k0 + w0, KD, g * D, D, lane);
}
