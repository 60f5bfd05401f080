// Learning-rate schedule (linear warm-up, then cosine decay to a floor), global-norm gradient
// clipping, and dynamic loss scaling for fp16: the small pieces of a training loop that every
// trainer gets subtly wrong when it writes them again.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <numbers>
#include <vector>

#include "membound/backend/cpu/model.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"

MEMBOUND_NAMESPACE_BEGIN

// lr(step) for step = 0, 1, ...: (step + 1)/warmup·peak during warm-up, then cosine from peak to
// min_lr over the remaining steps.
struct cosine_lr {
  double peak = 1e-3;
  double min_lr = 1e-4;
  std::uint64_t warmup = 0;
  std::uint64_t total = 1;

  double operator()(std::uint64_t step) const noexcept {
    if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
    if (total <= warmup || step >= total) return min_lr;
    const double t = static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
    return min_lr + 0.5 * (peak - min_lr) * (1.0 + std::cos(std::numbers::pi * t));
  }
};

// sum_squares(g, n, pool) and global_norm(g, n, pool): backend/cpu/model.hpp's (the host's
// gradient norm, which the trainer reaches through its backend's glue).
using cpu::global_norm;
using cpu::sum_squares;

// The factor that scales gradients of norm `norm` to at most max_norm (1 when already below;
// max_norm <= 0 disables clipping).
inline double clip_factor(double norm, double max_norm) noexcept {
  if (max_norm <= 0.0 || !(norm > max_norm)) return 1.0;
  return max_norm / norm;
}

// Dynamic loss scaling (fp16): gradients are computed of scale·loss; a step whose gradients hold
// inf/NaN is skipped and the scale halves; after `growth_interval` clean steps it doubles.
struct loss_scaler {
  double scale = 65536.0;
  std::uint64_t growth_interval = 2000;
  std::uint64_t clean_steps = 0;
  double min_scale = 1.0;
  double max_scale = 16777216.0;  // 2^24

  // Call with the (scaled) gradient norm; returns whether to apply the step.
  bool update(double scaled_grad_norm) noexcept {
    if (!std::isfinite(scaled_grad_norm)) {
      scale = std::max(min_scale, scale * 0.5);
      clean_steps = 0;
      return false;
    }
    if (++clean_steps >= growth_interval) {
      scale = std::min(max_scale, scale * 2.0);
      clean_steps = 0;
    }
    return true;
  }
};

MEMBOUND_NAMESPACE_END
