// "Every allocation in a layer goes through the caller's workspace": checked, for attention and
// Mamba, with Eigen's own
// guard. EIGEN_RUNTIME_NO_MALLOC makes every Eigen heap allocation call eigen_assert(false) while
// malloc is disallowed; eigen_assert is redirected to a recorder (not abort, and active in Release
// builds too, where NDEBUG would otherwise remove it), so the test reports what allocated.
#include <atomic>
#include <cstdio>
#include <string>

namespace membound_test {
inline std::atomic<int> eigen_assert_failures{0};
inline std::string first_eigen_assert;
inline void record_eigen_assert(const char* what) {
  if (eigen_assert_failures.fetch_add(1) == 0) first_eigen_assert = what;
}
}  // namespace membound_test

#define EIGEN_RUNTIME_NO_MALLOC
#define eigen_assert(x) \
  do {                  \
    if (!(x)) ::membound_test::record_eigen_assert(#x); \
  } while (false)

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "membound/membound.hpp"

using namespace membound;

namespace {

// Buffers are allocated before the guard is armed, as a trainer's would be.
struct aligned_bytes {
  explicit aligned_bytes(std::size_t n) : raw(n + 256) {}
  void* get() {
    return reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(raw.data()) + 255) &
                                   ~std::uintptr_t{255});
  }
  std::vector<unsigned char> raw;
};

template <typename Attention>
void run_without_heap(const attention_shape& s, std::size_t threads) {
  using S = typename Attention::storage_type;
  const std::size_t C = s.d_model, HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
  const std::size_t N = s.batch * s.seq, max_len = s.seq;
  auto fill = [](std::size_t n, float v) { return std::vector<S>(n, S(v)); };
  std::vector<S> wq = fill(C * HD, 0.01f), wk = fill(C * KD, 0.02f), wv = fill(C * KD, 0.03f),
                 wo = fill(HD * C, 0.01f);
  std::vector<S> x = fill(N * C, 0.5f), y = fill(N * C, 0), dy = fill(N * C, 0.1f),
                 dx = fill(N * C, 0);
  std::vector<S> gq = fill(wq.size(), 0), gk = fill(wk.size(), 0), gv = fill(wv.size(), 0),
                 go = fill(wo.size(), 0);
  std::vector<S> xt = fill(s.batch * C, 0.5f), yt = fill(s.batch * C, 0);
  thread_pool pool(threads);
  const std::size_t saved_n = Attention::saved_bytes(s);
  const std::size_t fws_n = Attention::forward_workspace_bytes(s, threads);
  const std::size_t bws_n = Attention::backward_workspace_bytes(s, threads);
  const std::size_t cache_n = Attention::kv_cache_bytes(s, max_len);
  const std::size_t sws_n = Attention::step_workspace_bytes(s, max_len, threads);
  aligned_bytes saved(saved_n), fws(fws_n), bws(bws_n), cache_mem(cache_n), sws(sws_n);
  const typename Attention::weights w{wq.data(), wk.data(), wv.data(), wo.data()};
  const typename Attention::gradients g{gq.data(), gk.data(), gv.data(), go.data()};
  auto cache = Attention::make_kv_cache(s, cache_mem.get(), cache_n, max_len);

  membound_test::eigen_assert_failures = 0;
  Eigen::internal::set_is_malloc_allowed(false);
  Attention::forward(s, w, x.data(), y.data(), saved.get(), saved_n, fws.get(), fws_n, pool);
  const int after_forward = membound_test::eigen_assert_failures.load();
  Attention::backward(s, w, x.data(), saved.get(), saved_n, dy.data(), dx.data(), g, bws.get(),
                      bws_n, pool);
  const int after_backward = membound_test::eigen_assert_failures.load();
  for (std::size_t t = 0; t < 3; ++t) {
    Attention::step(s, w, cache, xt.data(), yt.data(), sws.get(), sws_n, pool);
  }
  Eigen::internal::set_is_malloc_allowed(true);
  INFO("first Eigen assertion: " << membound_test::first_eigen_assert);
  CHECK(after_forward == 0);
  CHECK(after_backward - after_forward == 0);
  CHECK(membound_test::eigen_assert_failures.load() - after_backward == 0);
}

}  // namespace

TEST_CASE("attention allocates nothing beyond its workspace: forward, backward and step") {
  // Sizes chosen so that unsplit products would need heap packing buffers (> 128 KiB):
  // C = 256 projections over 2·300 rows, and head_dim 256 score tiles.
  attention_shape wide;
  wide.batch = 2; wide.seq = 300; wide.d_model = 256; wide.heads = 8; wide.kv_heads = 4;
  wide.head_dim = 32;
  attention_shape deep;
  deep.batch = 1; deep.seq = 130; deep.d_model = 512; deep.heads = 2; deep.kv_heads = 1;
  deep.head_dim = 256;
  for (std::size_t threads : {1u, 2u}) {
    run_without_heap<attention<>>(wide, threads);
    run_without_heap<attention<fp64_precision>>(deep, threads);
    run_without_heap<attention<bf16_precision>>(wide, threads);
    run_without_heap<attention<fp64_precision, attention_tiles<64, 128>>>(deep, threads);
  }
}

namespace {

template <typename Block>
void mamba_without_heap(const mamba_shape& s, std::size_t threads) {
  using S = typename Block::storage_type;
  const std::size_t N = s.batch * s.seq, C = s.d_model, Di = s.d_inner, Ns = s.d_state;
  const std::size_t R = s.dt_rank, K = s.d_conv;
  auto fill = [](std::size_t n, float v) { return std::vector<S>(n, S(v)); };
  // One buffer per parameter, then the gradients: the order of weights/gradients.
  const std::size_t sizes[] = {C * 2 * Di, Di * K, Di, Di * (R + 2 * Ns), R * Di, Di, Di * Ns, Di,
                               Di * C};
  std::vector<std::vector<S>> p, g;
  for (std::size_t n : sizes) {
    p.push_back(fill(n, 0.05f));
    g.push_back(fill(n, 0));
  }
  const typename Block::weights w{p[0].data(), p[1].data(), p[2].data(), p[3].data(), p[4].data(),
                                  p[5].data(), p[6].data(), p[7].data(), p[8].data()};
  const typename Block::gradients gr{g[0].data(), g[1].data(), g[2].data(), g[3].data(), g[4].data(),
                                     g[5].data(), g[6].data(), g[7].data(), g[8].data()};
  std::vector<S> x = fill(N * C, 0.5f), y = fill(N * C, 0), dy = fill(N * C, 0.1f),
                 dx = fill(N * C, 0), xt = fill(s.batch * C, 0.5f), yt = fill(s.batch * C, 0);
  thread_pool pool(threads);
  const std::size_t saved_n = Block::saved_bytes(s), fws_n = Block::forward_workspace_bytes(s, threads),
                    bws_n = Block::backward_workspace_bytes(s, threads),
                    st_n = Block::state_bytes(s), sws_n = Block::step_workspace_bytes(s);
  aligned_bytes saved(saved_n), fws(fws_n), bws(bws_n), st_mem(st_n), sws(sws_n);
  auto st = Block::make_state(s, st_mem.get(), st_n);

  membound_test::eigen_assert_failures = 0;
  Eigen::internal::set_is_malloc_allowed(false);
  Block::forward(s, w, x.data(), y.data(), saved.get(), saved_n, fws.get(), fws_n, pool);
  Block::backward(s, w, x.data(), saved.get(), saved_n, dy.data(), dx.data(), gr, bws.get(), bws_n,
                  pool);
  for (std::size_t t = 0; t < 3; ++t) Block::step(s, w, st, xt.data(), yt.data(), sws.get(), sws_n, pool);
  Eigen::internal::set_is_malloc_allowed(true);
  INFO("first Eigen assertion: " << membound_test::first_eigen_assert);
  CHECK(membound_test::eigen_assert_failures.load() == 0);
}

}  // namespace

TEST_CASE("mamba allocates nothing beyond its workspace: forward, backward and step") {
  // d_model 256 over 2·300 rows: projections that unsplit would need heap packing buffers.
  const mamba_shape s = mamba_shape::defaults(2, 300, 256);
  for (std::size_t threads : {1u, 2u}) {
    mamba_without_heap<mamba<scan_chunk<64>>>(s, threads);
    mamba_without_heap<mamba<bf16_precision, save_all>>(s, threads);
    mamba_without_heap<mamba<fp64_precision, scan_chunk<32>>>(mamba_shape::defaults(1, 100, 64),
                                                              threads);
  }
}

namespace {

template <typename Layer>
void ttt_without_heap(const ttt_shape& s, std::size_t threads) {
  using S = typename Layer::storage_type;
  const std::size_t N = s.batch * s.seq, C = s.width, H = s.heads, D = s.head_dim();
  const std::size_t mb = Layer::mini_batch, F = Layer::hidden(s);
  const std::size_t sizes[] = {C * C, C * C, C * C, H * D, H * D, H * D * F, H * F, H * C, H,
                               mb,    C,     C,     C * C, C * C, Layer::is_mlp ? H * F * D : 0,
                               Layer::is_mlp ? H * D : 0};
  std::vector<std::vector<S>> p, g;
  for (std::size_t n : sizes) {
    p.push_back(std::vector<S>(n, S(0.02f)));
    g.push_back(std::vector<S>(n, S(0.0f)));
  }
  const typename Layer::weights w{p[0].data(), p[1].data(), p[2].data(),  p[3].data(),  p[4].data(),
                                  p[5].data(), p[6].data(), p[7].data(),  p[8].data(),  p[9].data(),
                                  p[10].data(), p[11].data(), p[12].data(), p[13].data(),
                                  p[14].data(), p[15].data()};
  const typename Layer::gradients gr{g[0].data(), g[1].data(), g[2].data(),  g[3].data(),  g[4].data(),
                                     g[5].data(), g[6].data(), g[7].data(),  g[8].data(),  g[9].data(),
                                     g[10].data(), g[11].data(), g[12].data(), g[13].data(),
                                     g[14].data(), g[15].data()};
  std::vector<S> x(N * C, S(0.5f)), y(N * C), dy(N * C, S(0.1f)), dx(N * C),
      xt(s.batch * C, S(0.5f)), yt(s.batch * C);
  thread_pool pool(threads);
  const std::size_t saved_n = Layer::saved_bytes(s), fws_n = Layer::forward_workspace_bytes(s, threads),
                    bws_n = Layer::backward_workspace_bytes(s, threads),
                    st_n = Layer::state_bytes(s), sws_n = Layer::step_workspace_bytes(s);
  aligned_bytes saved(saved_n), fws(fws_n), bws(bws_n), st_mem(st_n), sws(sws_n);
  auto st = Layer::make_state(s, w, st_mem.get(), st_n);

  membound_test::eigen_assert_failures = 0;
  Eigen::internal::set_is_malloc_allowed(false);
  Layer::forward(s, w, x.data(), y.data(), saved.get(), saved_n, fws.get(), fws_n, pool);
  Layer::backward(s, w, x.data(), saved.get(), saved_n, dy.data(), dx.data(), gr, bws.get(), bws_n,
                  pool);
  for (std::size_t t = 0; t < 3; ++t) Layer::step(s, w, st, xt.data(), yt.data(), sws.get(), sws_n, pool);
  Eigen::internal::set_is_malloc_allowed(true);
  INFO("first Eigen assertion: " << membound_test::first_eigen_assert);
  CHECK(membound_test::eigen_assert_failures.load() == 0);
}

}  // namespace

TEST_CASE("ttt_linear and ttt_mlp allocate nothing beyond its workspace: forward, backward and step") {
  // Width 256 over 2·100 rows (projections past the stack-buffer limit unsplit); head_dim 128.
  ttt_shape s;
  s.batch = 2;
  s.seq = 100;
  s.width = 256;
  s.heads = 2;
  s.use_gate = true;
  for (std::size_t threads : {1u, 2u}) {
    ttt_without_heap<ttt_linear<>>(s, threads);
    ttt_without_heap<ttt_linear<bf16_precision, ttt_state_groups_all>>(s, threads);
    ttt_without_heap<ttt_linear<fp64_precision, ttt_mini_batch<8>>>(s, threads);
    ttt_without_heap<ttt_mlp<>>(s, threads);
    ttt_without_heap<ttt_mlp<bf16_precision, ttt_state_groups<2>>>(s, threads);
  }
}
