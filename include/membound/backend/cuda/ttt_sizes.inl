// The TTT inner loop's sizes and shared-memory placement (constexpr, host and device).
// A fragment, not a header: ttt.cuh includes it inside namespace membound::gpu, and
// tests/emulation/ttt_cuda_emulate.cpp includes the same text inside its emulation namespace,
// where the CUDA built-ins are host threads (tests/emulation/cuda_emulate.py ttt). One text, compiled
// by nvcc and by the emulation: change the kernels here.

// The decoding step's scratch per (batch, head) in fp32 elements: the effective state [SZ], then
// z1, x2, g1, z1b, x2b [F] (MLP), z2, xh2, g2, zb [D] (ttt_step_kernel's carve).
constexpr std::size_t ttt_step_elements(std::size_t SZ, std::size_t D, std::size_t F,
                                        bool mlp) noexcept {
  return SZ + (mlp ? 5 * F : 0) + 4 * D;
}

// The row stride of the staged q, k, v (and in the backward d_out, dq, dk, dv) rows: D rounded up
// to 8, plus 4. The tensor-core products read a fragment's 8 rows at one column; at a stride ≡ 4
// (mod 8) they fall in 8 different banks (2-way where a product reads the rows transposed), where
// at D = 64 they fell in one (8-way; 4-way transposed).
constexpr std::size_t ttt_row_stride(std::size_t D) noexcept { return (D + 7) / 8 * 8 + 4; }

// The inner loop (forward and backward kernels) keeps one (batch, head)'s working set in two
// parts: its "rows" (the mini-batch's q, k, v rows staged contiguously, [mb, D] each at row stride ttt_row_stride(D), and every
// per-mini-batch buffer) and its inner states (the running state [SZ]; in the backward also the
// group's entering states [gsz, SZ]; the running dL/d(state) [SZ] goes with the running state,
// else it stays in the partials). The launcher puts them in shared memory, hottest first
// (rows, then the running state, then the group's states), as far as the device's opt-in limit
// allows (ttt_placement); the rest streams through the CTA's slice of global scratch, which is
// always reserved at full size, so the plan does not depend on the device (the scratch is a few
// MB next to the N×C buffers). Placement only moves bytes: the sums and their order are the same,
// so every placement gives the same bits.
// TTT-Linear has no hidden layer (F = D) and no second attention matrix: its F-wide and second-
// layer buffers are empty.
//
// The forward's rows in fp32 elements, in carve order (ttt_detail::carve_forward): z1, x2, g1,
// z1b, x2b [mb, F] (MLP); z2, xh2, g2, zb [mb, D]; att1, p1 [mb, mb]; att2, p2 [mb, mb] (MLP);
// sig2, lrm [mb]; the staged q, k, v [mb, ttt_row_stride(D)].
constexpr std::size_t ttt_forward_rows(std::size_t D, std::size_t F, std::size_t mb,
                                       bool mlp) noexcept {
  const std::size_t f = mlp ? mb * F : 0, a2 = mlp ? mb * mb : 0;
  return 5 * f + 4 * mb * D + 2 * mb * mb + 2 * a2 + 2 * mb + 3 * mb * ttt_row_stride(D);
}
// The backward's rows: the forward's, then (ttt_detail::carve_backward) xhb [mb, D];
// dx2b, dz1b, dg1, dx2, dz1 [mb, F] (MLP); s1, s2 [mb, F]; dzb, dg2, dz2 [mb, D]; dp1 [mb, mb],
// dp2 [mb, mb] (MLP); de, dl [mb]; rowd [mb, 3·D]; the staged d_out, dq, dk, dv
// [mb, ttt_row_stride(D)].
constexpr std::size_t ttt_backward_rows(std::size_t D, std::size_t F, std::size_t mb,
                                        bool mlp) noexcept {
  const std::size_t f = mlp ? mb * F : 0, a2 = mlp ? mb * mb : 0;
  return ttt_forward_rows(D, F, mb, mlp) + mb * D + 5 * f + 2 * mb * F + 3 * mb * D +
         mb * mb + a2 + 2 * mb + 3 * mb * D + 4 * mb * ttt_row_stride(D);
}
// One (batch, head)'s slice of the forward's global scratch: the running state, then the rows.
constexpr std::size_t ttt_forward_elements(std::size_t SZ, std::size_t D, std::size_t F,
                                           std::size_t mb, bool mlp) noexcept {
  return SZ + ttt_forward_rows(D, F, mb, mlp);
}
// One (batch, head)'s slice of the backward's global scratch: the group's entering states
// [gsz, SZ], the running state [SZ], then the rows.
constexpr std::size_t ttt_backward_scratch_elements(std::size_t SZ, std::size_t D, std::size_t F,
                                                    std::size_t mb, std::size_t gsz,
                                                    bool mlp) noexcept {
  return (gsz + 1) * SZ + ttt_backward_rows(D, F, mb, mlp);
}

// Where the inner loop's parts live: bit set = in shared memory.
enum ttt_place : unsigned { ttt_rows_on_chip = 1, ttt_state_on_chip = 2, ttt_group_on_chip = 4 };
struct ttt_placement_t {
  unsigned place = 0;
  std::size_t shared_bytes = 0;  // the kernel's dynamic shared memory
};
// Greedy in order of use per mini-batch (rows, the running state, the group's states): a part goes
// on chip when it fits in `limit` bytes beside the hotter parts already there; on chip they lie in
// that order. group = 0 for the forward (it keeps no group).
constexpr ttt_placement_t ttt_placement(std::size_t rows, std::size_t state, std::size_t group,
                                        std::size_t limit) noexcept {
  ttt_placement_t p;
  const std::size_t parts[3] = {rows, state, group};
  const unsigned bits[3] = {ttt_rows_on_chip, ttt_state_on_chip, ttt_group_on_chip};
  std::size_t used = 0;
  for (int i = 0; i < 3; ++i) {
    if (parts[i] == 0) continue;
    // (The first test keeps the sum from wrapping.)
    if (parts[i] > limit / sizeof(float) || used + parts[i] > limit / sizeof(float)) continue;
    used += parts[i];
    p.place |= bits[i];
  }
  p.shared_bytes = used * sizeof(float);
  return p;
}

// Per (batch, head), the backward's partial parameter gradients: dS [SZ], dγ, dβ [D], dtok [mb].
constexpr std::size_t ttt_partial_elements(std::size_t SZ, std::size_t D, std::size_t mb) noexcept {
  return SZ + 2 * D + mb;
}
