// The Mamba scan's tiles and channels per CTA (constexpr, host and device).
// A fragment, not a header: mamba.cuh includes it inside namespace membound::gpu, and
// tests/emulation/mamba_cuda_emulate.cpp includes the same text inside its emulation namespace,
// where the CUDA built-ins are host threads (tests/emulation/cuda_emulate.py mamba). One text, compiled
// by nvcc and by the emulation: change the kernels here.

// Channels per backward scan block: the CPU's scan_channels, so dB/dC partials have the CPU's
// shape ([blocks, N, 2·Ns]) and size.
inline constexpr std::size_t mamba_scan_channels = 64;
// Threads per scan block aim at this many (channel, state) pairs.
inline constexpr std::size_t mamba_scan_lanes = 128;
// Time steps per shared-memory tile of the scan's cross-lane sums.
inline constexpr std::size_t mamba_forward_tile = 16;
inline constexpr std::size_t mamba_backward_tile = 8;
// States kept per thread for the reverse scan's recompute: a chunk's tiles run in at most this
// many runs, each recomputed from its entry state (the first in a register, the rest in shared
// memory: 15·256 floats, 15 KiB). At a chunk of ≤ 128 steps every tile has its own.
inline constexpr std::size_t mamba_backward_saved_states = 16;
// Rows per partial of the conv weight gradient.
inline constexpr std::size_t mamba_conv_rows = 256;
// The largest d_state (the CPU's max_d_state): a block then has 256 threads.
inline constexpr std::size_t mamba_max_d_state = 256;

// Channels a scan block runs at once: one thread per (channel, state).
constexpr std::size_t mamba_channels_per_block(std::size_t d_state) noexcept {
  if (d_state == 0) return 1;
  const std::size_t c = mamba_scan_lanes / d_state;
  return c == 0 ? 1 : (c > mamba_scan_channels ? mamba_scan_channels : c);
}
constexpr std::size_t mamba_blocks(std::size_t n, std::size_t per) noexcept {
  return per == 0 ? 0 : (n + per - 1) / per;
}
// Chunks of L steps over T (the CPU's scan_chunks): the forward scan runs them in parallel.
constexpr std::size_t mamba_chunks(std::size_t T, std::size_t L) noexcept {
  return L == 0 ? 0 : (T + L - 1) / L;
}
// The forward scan's Σ Δ per (b, chunk, channel) for chunks 1 .. nch − 2 (fp32 elements): the
// chunk's decay is exp(a·ΣΔ) (Δ does not depend on the state lane). Chunk 0's is never used (the
// state entering it is 0), and the last chunk's end state is never needed.
constexpr std::size_t mamba_chunk_sum_elements(std::size_t B, std::size_t T, std::size_t L,
                                               std::size_t Di) noexcept {
  const std::size_t nch = mamba_chunks(T, L);
  return nch < 2 ? 0 : B * (nch - 2) * Di;
}
