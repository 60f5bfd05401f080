// The tensor-core attention kernels' tiles, threads and shared-memory sizes (constexpr).
// A fragment, not a header: attention_mma.cuh includes it inside namespace membound::gpu, and
// tests/emulation/attention_cuda_emulate.cpp includes the same text inside its emulation namespace,
// where the CUDA built-ins are host threads (tests/emulation/cuda_emulate.py attention). One text, compiled
// by nvcc and by the emulation: change the kernels here.

// Rows per CTA (queries in the forward and dQ, keys in dK/dV) and per streamed tile; 4 warps of
// 16 rows each.
inline constexpr unsigned mma_tile = 64;
inline constexpr unsigned mma_threads = 128;

// Halves per shared row: a row-major [64, DM] tile at DM + 8, a transposed [DM, 64] one at 72.
constexpr std::size_t mma_row_stride(unsigned DM) noexcept { return std::size_t{DM} + 8; }
inline constexpr std::size_t mma_tr_stride = std::size_t{mma_tile} + 8;
constexpr std::size_t mma_rm_tile_bytes(unsigned DM) noexcept {
  return 2 * std::size_t{mma_tile} * mma_row_stride(DM);
}
constexpr std::size_t mma_tr_tile_bytes(unsigned DM) noexcept {
  return 2 * std::size_t{DM} * mma_tr_stride;
}
// forward: Q, K row-major, V transposed.     DM 64: 27.0 KiB, DM 128: 52.0 KiB
constexpr std::size_t mma_forward_smem_bytes(unsigned DM) noexcept {
  return 2 * mma_rm_tile_bytes(DM) + mma_tr_tile_bytes(DM);
}
// dQ: Q, dO, K, V row-major, K transposed.   DM 64: 45.0 KiB, DM 128: 86.0 KiB
constexpr std::size_t mma_dq_smem_bytes(unsigned DM) noexcept {
  return 4 * mma_rm_tile_bytes(DM) + mma_tr_tile_bytes(DM);
}
// dK/dV: lse and Δ of the query tile (fp32), K, V, Q, dO row-major, Q and dO transposed.
//                                            DM 64: 54.5 KiB, DM 128: 104.5 KiB
constexpr std::size_t mma_dkdv_smem_bytes(unsigned DM) noexcept {
  return 2 * sizeof(float) * mma_tile + 4 * mma_rm_tile_bytes(DM) + 2 * mma_tr_tile_bytes(DM);
}
// The launchers check the device's opt-in limit against dK/dV's bytes alone: the largest.
static_assert(mma_forward_smem_bytes(64) <= mma_dkdv_smem_bytes(64) &&
                  mma_dq_smem_bytes(64) <= mma_dkdv_smem_bytes(64) &&
                  mma_forward_smem_bytes(128) <= mma_dkdv_smem_bytes(128) &&
                  mma_dq_smem_bytes(128) <= mma_dkdv_smem_bytes(128),
              "membound: the dK/dV pass must need the most shared memory of the three");
