// The sizes the model's bandwidth-bound kernels (model_kernels.inl) and their launchers share: the
// RMSNorm backward's row blocks, the cross-entropy's and the gradient norm's scratch, AdamW's
// segments and device inputs.
// A fragment, not a header: model.cuh includes it inside namespace membound::gpu, and
// tests/emulation/model_cuda_emulate.cpp includes it inside its emulation namespace.

// The row kernels' CTA (RMSNorm, the embedding gather): 8 warps, a row per warp.
inline constexpr unsigned row_warps = 8, row_cta_threads = 32 * row_warps;

// RMSNorm backward reduces dweight over rows in blocks of this many rows: one [C] partial per block.
inline constexpr std::size_t rmsnorm_rows_per_block = 32;

constexpr std::size_t rmsnorm_backward_partials(std::size_t N) noexcept {
  return (N + rmsnorm_rows_per_block - 1) / rmsnorm_rows_per_block;
}
// Scratch of rmsnorm_backward: the per-row-block float partials of dweight.
constexpr std::size_t rmsnorm_backward_workspace_bytes(std::size_t N, std::size_t C) noexcept {
  return bytes_of<float>(rmsnorm_backward_partials(N), C);
}

// Scratch of cross_entropy_chunk: one double loss per row, summed in row order afterwards.
constexpr std::size_t cross_entropy_workspace_bytes(std::size_t rows) noexcept {
  return bytes_of<double>(rows);
}

// The gradient norm's first pass: a grid that depends on n alone (so the sum's shape does too).
inline constexpr std::size_t norm_threads = 256;
inline constexpr std::size_t norm_max_blocks = 1024;
constexpr std::size_t global_norm_blocks(std::size_t n) noexcept {
  const std::size_t b = (n + norm_threads * 8 - 1) / (norm_threads * 8);
  return b == 0 ? 1 : (b < norm_max_blocks ? b : norm_max_blocks);
}
// Scratch of global_norm: one double partial per first-pass block.
constexpr std::size_t global_norm_workspace_bytes(std::size_t n) noexcept {
  return bytes_of<double>(global_norm_blocks(n));
}

// One parameter range of the flat weight/gradient/state arrays, as model::parameters() lists them.
struct adamw_segment {
  std::size_t offset = 0;
  std::size_t count = 0;
  bool decay = true;  // matrices decay; norms and biases do not
};

// Device-side inputs of adamw_update, so a step needs no host round trip. With `norm` (the global
// norm of the gradients as stored, e.g. from global_norm) the gradient factor is
// clip_factor(*norm / loss_scale, max_norm) / loss_scale · grad_scale, the trainer's formula;
// without it, grad_scale alone. With `skip` the update does nothing while *skip != 0 (a
// non-finite flag from check_finite).
struct adamw_device_inputs {
  const double* norm = nullptr;
  double max_norm = 0;  // <= 0: no clipping
  double loss_scale = 1;
  const unsigned* skip = nullptr;
};

// At most this many segments go into one launch (a kernel parameter); more take several.
inline constexpr std::size_t adamw_segments_per_launch = 32;
