// attention<P, cuda_backend> against attention<P> (the CPU backend) on the same inputs in the
// same process: y, lse, dx and the four accumulated weight gradients; causal and bidirectional;
// MHA, GQA, MQA; T = 1 and T not a multiple of the tiles; head_dim 8 to 256; recompute and
// save_all; bit-identical repeats; no device memory beyond the caller's; step equals the causal
// forward's rows; sliding windows; packed sequences; typed errors. Without a device it exits 77 (skipped).
//
// Tolerances, |got - want| / (|want| + 1e-2):
//   fp32: TF32 is off; sums in another order and the device's expf: 1e-5 relative.
//   bf16/fp16: see bf16_matches_cpu.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <memory>
#include <vector>

#include "cuda_test_support.cuh"

namespace mb = membound;

namespace {

using mbt::random_values;
using mbt::as_double;
using mbt::same_bits;
using mbt::from_bytes;
using mbt::to_bytes;

struct run_result {
  std::vector<std::uint8_t> y, saved, dx, gq, gk, gv, go, ys;  // raw bytes, for bit comparisons
};


// k: the device executor's kernel choices.
template <typename Precision, typename... Extra>
void compare(const mb::attention_shape& s, double tolerance, const mb::gpu::kernel_choices& k = {}) {
  using cpu_attn = mb::attention<Precision, Extra...>;
  using gpu_attn = mb::attention<Precision, Extra..., mb::cuda_backend>;
  using S = typename cpu_attn::storage_type;
  const std::size_t N = s.batch * s.seq, C = s.d_model;
  const std::size_t HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
  const auto x = random_values<S>(N * C, 1, 1.0f);
  const auto wq = random_values<S>(C * HD, 2, 0.3f);
  const auto wk = random_values<S>(C * KD, 3, 0.3f);
  const auto wv = random_values<S>(C * KD, 4, 0.3f);
  const auto wo = random_values<S>(HD * C, 5, 0.3f);
  const auto dy = random_values<S>(N * C, 6, 1.0f);
  const auto gq0 = random_values<S>(C * HD, 7, 0.1f);
  const auto gk0 = random_values<S>(C * KD, 8, 0.1f);
  const auto gv0 = random_values<S>(C * KD, 9, 0.1f);
  const auto go0 = random_values<S>(HD * C, 10, 0.1f);

  // CPU reference.
  mb::thread_pool pool(1);
  std::vector<S> y_c(N * C), dx_c(N * C), gq_c = gq0, gk_c = gk0, gv_c = gv0, go_c = go0;
  mbt::host_buffer saved_c(cpu_attn::saved_bytes(s));
  std::vector<std::uint8_t> ws_c(std::max(cpu_attn::forward_workspace_bytes(s, 1),
                                          cpu_attn::backward_workspace_bytes(s, 1)) + 256);
  void* wsp = ws_c.data();
  std::size_t wsn = ws_c.size();
  wsp = std::align(256, wsn - 256, wsp, wsn);
  const typename cpu_attn::weights wc{wq.data(), wk.data(), wv.data(), wo.data()};
  cpu_attn::forward(s, wc, x.data(), y_c.data(), saved_c.data(), saved_c.size(), wsp, wsn, pool);
  const float* lse_c = cpu_attn::saved_lse(s, saved_c.data());
  const std::vector<float> lse_cv(lse_c, lse_c + s.batch * s.heads * s.seq);
  cpu_attn::backward(s, wc, x.data(), saved_c.data(), saved_c.size(), dy.data(), dx_c.data(),
                     {gq_c.data(), gk_c.data(), gv_c.data(), go_c.data()}, wsp, wsn, pool);

  mb::cuda_executor ex;
  ex.set_kernels(k);
  mbt::device_buffer<S> dx_(x), dwq(wq), dwk(wk), dwv(wv), dwo(wo), ddy(dy), dy_(N * C),
      ddx(N * C);
  mbt::device_buffer<S> dgq(gq0), dgk(gk0), dgv(gv0), dgo(go0);
  mbt::device_buffer<std::uint8_t> dsaved(gpu_attn::saved_bytes(s));
  const std::size_t fws = gpu_attn::forward_workspace_bytes(s, 1);
  const std::size_t bws = gpu_attn::backward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> dws(std::max(fws, bws));
  const typename gpu_attn::weights wg{dwq.get(), dwk.get(), dwv.get(), dwo.get()};
  auto run = [&] {
    dgq.upload(gq0);
    dgk.upload(gk0);
    dgv.upload(gv0);
    dgo.upload(go0);
    gpu_attn::forward(s, wg, dx_.get(), dy_.get(), dsaved.get(), dsaved.size(), dws.get(), fws, ex);
    gpu_attn::backward(s, wg, dx_.get(), dsaved.get(), dsaved.size(), ddy.get(), ddx.get(),
                       {dgq.get(), dgk.get(), dgv.get(), dgo.get()}, dws.get(), bws, ex);
    ex.synchronize();
    return run_result{to_bytes(dy_.download()), dsaved.download(), to_bytes(ddx.download()),
                      to_bytes(dgq.download()), to_bytes(dgk.download()), to_bytes(dgv.download()),
                      to_bytes(dgo.download()), {}};
  };
  const run_result first = run();
  std::size_t free_before = 0, free_after = 0, total = 0;
  mb::cuda_check(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");
  const run_result second = run();
  mb::cuda_check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo");
  CHECK(free_after == free_before);  // nothing beyond saved + workspace
  // Deterministic: bit-identical repeats.
  CHECK(first.y == second.y);
  CHECK(first.saved == second.saved);
  CHECK(first.dx == second.dx);
  CHECK(first.gq == second.gq && first.gk == second.gk && first.gv == second.gv &&
        first.go == second.go);

  constexpr double floor = 1e-2;
  const float* lse_g = gpu_attn::saved_lse(s, first.saved.data());  // host copy, same layout
  const std::vector<float> lse_gv(lse_g, lse_g + s.batch * s.heads * s.seq);
  mbt::close_normwise("y", as_double(from_bytes<S>(first.y)), as_double(y_c), tolerance, floor);
  mbt::close_normwise("lse", as_double(lse_gv), as_double(lse_cv), tolerance, floor);
  mbt::close_normwise("dx", as_double(from_bytes<S>(first.dx)), as_double(dx_c), tolerance, floor);
  mbt::close_normwise("dWq", as_double(from_bytes<S>(first.gq)), as_double(gq_c), tolerance, floor);
  mbt::close_normwise("dWk", as_double(from_bytes<S>(first.gk)), as_double(gk_c), tolerance, floor);
  mbt::close_normwise("dWv", as_double(from_bytes<S>(first.gv)), as_double(gv_c), tolerance, floor);
  mbt::close_normwise("dWo", as_double(from_bytes<S>(first.go)), as_double(go_c), tolerance, floor);
}

// step over a cache of T positions reproduces the causal forward's rows.
template <typename Precision>
void step_matches_forward(const mb::attention_shape& s, double tolerance) {
  using gpu_attn = mb::attention<Precision, mb::cuda_backend>;
  using S = typename gpu_attn::storage_type;
  const std::size_t B = s.batch, T = s.seq, C = s.d_model;
  const std::size_t HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
  const auto x = random_values<S>(B * T * C, 11, 1.0f);
  const auto wq = random_values<S>(C * HD, 12, 0.3f);
  const auto wk = random_values<S>(C * KD, 13, 0.3f);
  const auto wv = random_values<S>(C * KD, 14, 0.3f);
  const auto wo = random_values<S>(HD * C, 15, 0.3f);
  mb::cuda_executor ex;
  mbt::device_buffer<S> dx_(x), dwq(wq), dwk(wk), dwv(wv), dwo(wo), dy_(B * T * C);
  const typename gpu_attn::weights wg{dwq.get(), dwk.get(), dwv.get(), dwo.get()};
  mbt::device_buffer<std::uint8_t> dsaved(gpu_attn::saved_bytes(s));
  const std::size_t fws = gpu_attn::forward_workspace_bytes(s, 1);
  const std::size_t sws = gpu_attn::step_workspace_bytes(s, T, 1);
  mbt::device_buffer<std::uint8_t> dws(std::max(fws, sws));
  gpu_attn::forward(s, wg, dx_.get(), dy_.get(), dsaved.get(), dsaved.size(), dws.get(), fws, ex);
  ex.synchronize();
  const std::vector<S> y_full = dy_.download();

  mbt::device_buffer<std::uint8_t> cache_bytes(gpu_attn::kv_cache_bytes(s, T));
  auto cache = gpu_attn::make_kv_cache(s, cache_bytes.get(), cache_bytes.size(), T);
  std::vector<S> y_steps(B * T * C);
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<S> xt(B * C);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t c = 0; c < C; ++c) xt[b * C + c] = x[(b * T + t) * C + c];
    mbt::device_buffer<S> dxt(xt), dyt(B * C);
    gpu_attn::step(s, wg, cache, dxt.get(), dyt.get(), dws.get(), sws, ex);
    ex.synchronize();
    const std::vector<S> yt = dyt.download();
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t c = 0; c < C; ++c) y_steps[(b * T + t) * C + c] = yt[b * C + c];
  }
  CHECK(cache.length == T);
  // The step's one-row GEMMs and decode kernel sum in another order than the T-row forward, and
  // y is a cancelling sum: its rounding scales with the terms, so the floor is 5% of max|y|.
  const std::vector<double> want_steps = as_double(y_full);
  mbt::close_normwise("step y", as_double(y_steps), want_steps, tolerance,
             std::max(1e-2, 5e-2 * mbt::max_abs(want_steps)));
}

// Shapes: MHA, GQA, MQA; T = 1, T not a multiple of the tiles (64 rows, 32-row smem tiles);
// head_dim 64, 128, 256; causal and bidirectional.
void fp32_matches_cpu() {
  compare<mb::fp32_precision>({2, 37, 32, 4, 4, 8, true}, 1e-5);
  compare<mb::fp32_precision>({2, 37, 32, 4, 4, 8, false}, 1e-5);
  compare<mb::fp32_precision>({1, 1, 32, 2, 1, 64, true}, 1e-5);
  compare<mb::fp32_precision>({1, 100, 64, 4, 2, 64, true}, 1e-5);
  compare<mb::fp32_precision>({1, 100, 64, 4, 1, 64, false}, 1e-5);
  compare<mb::fp32_precision>({1, 70, 64, 2, 2, 128, true}, 1e-5);
  compare<mb::fp32_precision>({1, 33, 64, 2, 1, 256, true}, 1e-5);
  compare<mb::fp32_precision, mb::save_all>({2, 37, 32, 4, 2, 16, true}, 1e-5);
}

// bf16/fp16 on the fallback kernels (the WMMA forward, the SIMT backward: what devices before
// sm_80 and head_dim > 128 run): the device rounds O, dq, dk, dv to 16 bits (2^-8 relative each
// for bf16) before the GEMMs that read them, and the WMMA forward (D <= 128) rounds q, k, v and P
// too, where the CPU keeps fp32; as for the MLP, 4e-2 covers a chain of up to three such roundings.
void bf16_matches_cpu() {
  const mb::gpu::kernel_choices use{.attention = mb::gpu::attention_kernels::simt_wmma};
  compare<mb::bf16_precision>({2, 37, 32, 4, 2, 64, true}, 4e-2, use);
  compare<mb::bf16_precision>({1, 80, 64, 4, 4, 128, false}, 4e-2, use);
  compare<mb::fp16_precision>({1, 50, 32, 2, 1, 64, true}, 4e-2, use);
  compare<mb::bf16_precision>({1, 40, 32, 2, 1, 256, true}, 4e-2, use);  // D = 256: the SIMT forward
  // The choice is the executor's: one left at the default beside it still runs the mma kernels.
  mb::cuda_executor fallback, plain;
  fallback.set_kernels(use);
  CHECK(!mb::gpu::detail::use_mma<mb::bf16>(fallback, 64));
  int major = 0;
  mb::cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, plain.device()),
                 "cudaDeviceGetAttribute");
  if (major >= 8) CHECK(mb::gpu::detail::use_mma<mb::bf16>(plain, 64));
}

// The mma.sync kernels (attention_mma.cuh), the default, on the same comparisons, and more shapes: T = 1, T
// past two tiles, head_dim 40 and 96 (padded to 64 and 128), MQA, save_all. They round P and dS
// to 16 bits as operands too (2^-8 each for bf16): still one more rounding in a chain the 4e-2
// covers (the host emulation measures 2.8e-3 for bf16 against a double attention on rounded
// inputs). On sm_80 and up they must be the ones that run.
void tensor_core_matches_cpu() {
  // The default without cuDNN; with it (this test links membound::cudnn where CMake found it),
  // the cuDNN path, whose own case is below: this one asks for the mma kernels by name.
  const mb::gpu::kernel_choices mma{.attention = mb::gpu::attention_kernels::tensor_core};
  mb::cuda_executor ex;
  ex.set_kernels(mma);
#if !defined(MEMBOUND_WITH_CUDNN)
  CHECK(mb::cuda_executor{}.kernels().attention == mb::gpu::attention_kernels::tensor_core);
#endif
  int major = 0, optin = 0;
  mb::cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ex.device()),
                 "cudaDeviceGetAttribute");
  mb::cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ex.device()),
                 "cudaDeviceGetAttribute");
  namespace gd = mb::gpu::detail;
  if (major < 8) {
    std::printf("  note: sm_%d: the tensor-core kernels need sm_80; this case ran the fallback\n", major * 10);
  } else {
    // Every head size below must really run the new kernels where the device has room for them.
    CHECK(gd::use_mma<mb::bf16>(ex, 64));
    CHECK(gd::use_mma<mb::fp16>(ex, 64));
    CHECK(gd::use_mma<mb::bf16>(ex, 40));
    if (static_cast<std::size_t>(optin) >= mb::gpu::mma_dkdv_smem_bytes(128)) {
      CHECK(gd::use_mma<mb::bf16>(ex, 128));
      CHECK(gd::use_mma<mb::fp16>(ex, 96));
    } else {
      std::printf("  note: %d B of opt-in shared memory: head sizes over 64 ran the fallback\n", optin);
    }
  }
  CHECK(!gd::use_mma<mb::bf16>(ex, 256));  // D = 256 stays on the SIMT kernels
  compare<mb::bf16_precision>({2, 37, 32, 4, 2, 64, true}, 4e-2, mma);
  compare<mb::bf16_precision>({1, 80, 64, 4, 4, 128, false}, 4e-2, mma);
  compare<mb::fp16_precision>({1, 50, 32, 2, 1, 64, true}, 4e-2, mma);
  compare<mb::bf16_precision>({1, 1, 32, 2, 1, 64, true}, 4e-2, mma);
  compare<mb::bf16_precision>({1, 150, 64, 4, 1, 40, true}, 4e-2, mma);
  compare<mb::fp16_precision>({2, 70, 64, 2, 2, 96, false}, 4e-2, mma);
  compare<mb::bf16_precision, mb::save_all>({2, 65, 32, 4, 2, 64, true}, 4e-2, mma);
  compare<mb::bf16_precision>({1, 40, 32, 2, 1, 256, true}, 4e-2, mma);  // falls back: SIMT
}

// cuDNN's fused attention (backend/cuda/cudnn_attention.cuh), where this test is built with it,
// on compare's checks (bit-identical repeats: its deterministic backward, the default; no device
// memory beyond the plan's slots). Tolerance: cuDNN rounds q, k, v, dO and P to 16 bits as the mma
// kernels do, and dq/dk once more before RoPE's inverse: the 4e-2 of the chain above. Where
// cuDNN cannot run a call (a window, packed sequences, save_all's forward, a plan that wants more
// workspace than the slots hold), our kernels run it and the report counts why. With
// MEMBOUND_EXPECT_CUDNN=1 (tools/gpu_session.sh sets it) libcudnn must load and run the forwards.
void cudnn_matches_cpu() {
  const mb::gpu::cudnn_attention_counts before = mb::gpu::cudnn_attention_report();
  if (!before.compiled) {
    std::printf("  note: built without cuDNN (no cudnn_frontend at configure): nothing to check\n");
    return;
  }
  const mb::gpu::kernel_choices use{.attention = mb::gpu::attention_kernels::cudnn};
  compare<mb::bf16_precision>({2, 128, 64, 4, 2, 64, true}, 4e-2, use);
  compare<mb::bf16_precision>({1, 256, 64, 4, 4, 128, false}, 4e-2, use);
  compare<mb::fp16_precision>({1, 37, 32, 2, 1, 64, true}, 4e-2, use);  // T not a multiple of any tile
  compare<mb::bf16_precision>({1, 1, 32, 2, 1, 64, true}, 4e-2, use);
  const mb::gpu::cudnn_attention_counts ran = mb::gpu::cudnn_attention_report();
  // Calls cuDNN cannot take: ours run them, counted.
  compare<mb::bf16_precision>({1, 150, 64, 4, 2, 64, true, 10000.0, 40}, 4e-2, use);  // a window
  compare<mb::bf16_precision, mb::save_all>({2, 65, 32, 4, 2, 64, true}, 4e-2, use);  // the forward
  compare<mb::fp32_precision>({1, 40, 32, 2, 1, 64, true}, 1e-5, use);  // fp32 storage: the SIMT kernels
  const mb::gpu::cudnn_attention_counts after = mb::gpu::cudnn_attention_report();
  std::printf("  cuDNN: %s %s; calls on cuDNN: %llu forward, %llu backward; on ours: %llu (last: %s)\n",
              after.loaded ? "loaded, version" : "not loaded:",
              after.loaded ? std::to_string(after.version).c_str() : after.library.c_str(),
              static_cast<unsigned long long>(after.forward_calls - before.forward_calls),
              static_cast<unsigned long long>(after.backward_calls - before.backward_calls),
              static_cast<unsigned long long>(after.fallbacks - before.fallbacks), after.last_fallback.c_str());
  CHECK(after.fallbacks >= ran.fallbacks + 10);  // the window's 4 calls, save_all's 2 forwards, fp32's 4
  const char* expect = std::getenv("MEMBOUND_EXPECT_CUDNN");
  if (expect != nullptr && std::string(expect) == "1") {
    CHECK(after.loaded);
    CHECK(ran.forward_calls >= before.forward_calls + 8);  // every forward of the first four shapes (two runs each)
  }
}

void step_equals_forward() {
  step_matches_forward<mb::fp32_precision>({2, 40, 32, 4, 2, 64, true}, 1e-5);
  step_matches_forward<mb::fp32_precision>({1, 9, 32, 2, 1, 256, true}, 1e-5);
  // A window: the cache is a ring of W slots, wrapped several times over T = 40.
  step_matches_forward<mb::fp32_precision>({2, 40, 32, 4, 2, 64, true, 10000.0, 7}, 1e-5);
  step_matches_forward<mb::bf16_precision>({1, 40, 32, 2, 1, 64, true, 10000.0, 1}, 4e-2);
}

// Sliding windows on every kernel family (SIMT fp32, the WMMA/SIMT fallback, mma.sync): T = 150
// spans three 64-row tiles, so whole tiles fall outside the band and its edges cross tiles.
void sliding_window_matches_cpu() {
  const mb::gpu::kernel_choices fallback{.attention = mb::gpu::attention_kernels::simt_wmma};
  // (W = 1 would make dS exactly 0: its gradients are roundoff over a zero norm.)
  for (const std::size_t w : {std::size_t{2}, std::size_t{40}, std::size_t{64}, std::size_t{149}}) {
    compare<mb::fp32_precision>({1, 150, 64, 4, 2, 64, true, 10000.0, w}, 1e-5);
    compare<mb::fp32_precision>({1, 150, 64, 4, 2, 64, false, 10000.0, w}, 1e-5);
    compare<mb::bf16_precision>({1, 150, 64, 4, 2, 64, true, 10000.0, w}, 4e-2, fallback);
    compare<mb::bf16_precision>({1, 150, 64, 4, 2, 64, true, 10000.0, w}, 4e-2);
    compare<mb::fp16_precision>({2, 150, 64, 4, 1, 40, false, 10000.0, w}, 4e-2);
  }
}

// Packed sequences on every kernel family (SIMT fp32, the WMMA/SIMT fallback, mma.sync) against
// the CPU backend's packed call, which tests/unit/test_attention.cpp holds equal to each sequence
// run alone. Lengths 1, 63, 0, 64, 65, 7 and 150 over T = 350: sequences that start and end inside
// tiles, a tile that holds four of them, an empty one, a long one among short ones.
void packed_matches_cpu() {
  static const std::int32_t offsets[] = {0, 1, 64, 64, 128, 193, 200, 350};
  const mb::gpu::kernel_choices fallback{.attention = mb::gpu::attention_kernels::simt_wmma};
  const auto packed = [&](bool causal, std::size_t window, std::size_t heads, std::size_t kv_heads,
                          std::size_t head_dim) {
    mb::attention_shape s{1, 350, 64, heads, kv_heads, head_dim, causal, 10000.0, window};
    s.offsets = offsets;
    s.sequences = 7;
    return s;
  };
  compare<mb::fp32_precision>(packed(true, 0, 4, 2, 64), 1e-5);
  compare<mb::fp32_precision>(packed(false, 0, 4, 2, 64), 1e-5);
  compare<mb::fp32_precision>(packed(true, 40, 4, 2, 64), 1e-5);  // a window inside sequences
  compare<mb::bf16_precision>(packed(true, 0, 4, 2, 64), 4e-2);
  compare<mb::bf16_precision>(packed(false, 0, 4, 1, 128), 4e-2);
  compare<mb::bf16_precision>(packed(true, 0, 4, 2, 64), 4e-2, fallback);
  compare<mb::fp16_precision, mb::save_all>(packed(true, 30, 2, 2, 40), 4e-2);
}

void typed_errors() {
  using gpu_attn = mb::attention<mb::fp32_precision, mb::cuda_backend>;
  const mb::attention_shape s{1, 4, 16, 2, 1, 8, true};
  mb::cuda_executor ex;
  mbt::device_buffer<float> x(64), y(64), w(512);
  mbt::device_buffer<std::uint8_t> saved(gpu_attn::saved_bytes(s));
  const std::size_t fws = gpu_attn::forward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> ws(fws);
  const gpu_attn::weights wt{w.get(), w.get(), w.get(), w.get()};
  EXPECT_THROW(mb::workspace_too_small,
               gpu_attn::forward(s, wt, x.get(), y.get(), saved.get(), saved.size(), ws.get(),
                                 fws - 1, ex));
  EXPECT_THROW(mb::invalid_argument,
               gpu_attn::forward(s, wt, nullptr, y.get(), saved.get(), saved.size(), ws.get(),
                                 fws, ex));
  EXPECT_THROW(mb::invalid_argument, gpu_attn::check({1, 4, 16, 2, 1, 12, true}));
  EXPECT_THROW(mb::invalid_argument, gpu_attn::check({1, 4, 16, 3, 2, 8, true}));
  CHECK(fws >= mb::gpu::gemm_workspace_bytes(ex));
  // Packed sequences: taken, and offsets that do not cover the tokens refused by name; the
  // workspace holds their device copy.
  const std::int32_t offsets[] = {0, 1, 4}, short_offsets[] = {0, 1, 3};
  mb::attention_shape packed = s;
  packed.offsets = offsets;
  packed.sequences = 2;
  CHECK(gpu_attn::can_implement(packed).ok);
  CHECK(gpu_attn::forward_workspace_bytes(packed, 1) >= fws + 3 * sizeof(std::int32_t));
  packed.offsets = short_offsets;
  CHECK(std::string(gpu_attn::can_implement(packed).argument) == "shape.offsets");
  EXPECT_THROW(mb::invalid_argument, gpu_attn::check(packed));
}

}  // namespace

int main() {
  static const mbt::test_case cases[] = {
      {"attention cuda_backend fp32 equals the CPU backend", fp32_matches_cpu},
      {"attention cuda_backend bf16/fp16 on the fallback kernels (WMMA/SIMT) within the stated bound", bf16_matches_cpu},
      {"attention cuda_backend tensor-core (mma.sync) kernels within the stated bound",
       tensor_core_matches_cpu},
      {"attention cuda_backend on cuDNN (where built with it) within the stated bound", cudnn_matches_cpu},
      {"attention cuda_backend step equals the causal forward's rows", step_equals_forward},
      {"attention cuda_backend sliding windows equal the CPU backend's", sliding_window_matches_cpu},
      {"attention cuda_backend packed sequences equal the CPU backend's", packed_matches_cpu},
      {"attention cuda_backend typed errors", typed_errors},
  };
  return mbt::run_suite("test_cuda_attention", cases);
}
