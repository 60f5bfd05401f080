// The sizes the model's bandwidth-bound kernels (model_kernels.inl) and their launchers share: the
// RMSNorm backward's row blocks, the cross-entropy's and the gradient norm's scratch, AdamW's
// segments, device inputs and launches.
// A fragment, not a header: model.cuh includes it inside namespace membound::gpu, and
// tests/emulation/model_cuda_emulate.cpp includes it inside its emulation namespace.

// The row kernels' CTA (RMSNorm, the embedding gather): 8 warps, a row per warp.
inline constexpr unsigned row_warps = 8, row_cta_threads = 32 * row_warps;

// The most shared memory RMSNorm's backward gives its warps' partials (8 · C floats, rounded up
// to whole passes): C up to 3072. Wider rows take the kernel with partials in device memory. A
// constant, not the device's limit, so that the kernel and its sums' shape follow C alone.
inline constexpr std::size_t rmsnorm_shared_partials_limit = std::size_t{99} * 1024;

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

// One launch of AdamW's kernel: up to adamw_segments_per_launch non-empty segments, the first
// CTA of each (a prefix sum), the decay of each.
struct adamw_batch {
  std::size_t offset[adamw_segments_per_launch];
  std::size_t count[adamw_segments_per_launch];
  std::size_t first_block[adamw_segments_per_launch + 1];
  float wd[adamw_segments_per_launch];
  unsigned segments;
  std::size_t blocks;  // CTAs of the launch
};

// The launches over `segments` in order, CTAs of per_block elements; an empty segment takes no
// CTA and no slot (each segment in exactly one launch, once).
inline std::vector<adamw_batch> adamw_batches(std::span<const adamw_segment> segments, std::size_t per_block,
                                              float decay) {
  std::vector<adamw_batch> out;
  std::size_t i = 0;
  while (i < segments.size()) {
    adamw_batch b{};
    while (i < segments.size() && b.segments < adamw_segments_per_launch) {
      const adamw_segment& sg = segments[i++];
      if (sg.count == 0) continue;
      b.offset[b.segments] = sg.offset;
      b.count[b.segments] = sg.count;
      b.first_block[b.segments] = b.blocks;
      b.wd[b.segments] = sg.decay ? decay : 0.0f;
      b.blocks += (sg.count + per_block - 1) / per_block;
      ++b.segments;
    }
    if (b.segments == 0) break;
    b.first_block[b.segments] = b.blocks;
    out.push_back(b);
  }
  return out;
}
