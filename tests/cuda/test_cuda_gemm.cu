// gpu::matmul, matmul_bt and matmul_at (backend/cuda/gemm.cuh) against cpu::matmul in double on
// the same arguments: every form, accumulate on and off, alpha, odd shapes, leading-dimension
// views and offset (less aligned) column slices, float output from bf16/fp16, TF32 on request,
// bit-identical repeats, the plan cache, matmul_at's own split-K (which shapes split, and that a
// split result keeps the same bounds), and every typed error. Exits 77 without a device.
//
// Error bounds, per element, against s = Σ|x||w| (times |alpha|, plus |y0| when accumulating),
// the scale of a dot product's rounding error (relative to |y| it is unbounded under
// cancellation):
//  - fp32: 1e-5 · s. Recursive fp32 summation errs by at most γ_K = K·u/(1 − K·u), u = 2^-24;
//    the largest fp32 K here is 130, so γ_K < 7.8e-6, plus two roundings for alpha and y0.
//  - bf16/fp16 inputs: products of 8- or 11-bit significands are exact in fp32, so only the fp32
//    sum errs: 2·(K + 2)·u·s, the factor 2 because tensor-core accumulation is not documented to
//    round to nearest. A bf16/fp16 output adds one rounding: u_out·(|want| + that), u_out = 2^-8
//    (bf16) or 2^-11 (fp16).
//  - TF32: each input loses up to 2^-10 relative (truncation allowed), 2^-9 for a product.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"

namespace mb = membound;
namespace gpu = membound::gpu;
using mbt::failures;

namespace {

constexpr double u32 = 1.0 / (1 << 24);

template <typename T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, float>) {
    return u32;
  } else if constexpr (std::is_same_v<T, mb::bf16>) {
    return 1.0 / (1 << 8);
  } else {
    return 1.0 / (1 << 11);
  }
}

// An executor, a plan cache and the workspace every GEMM on this device needs.
struct gemm_env {
  mb::cuda_executor exec;
  gpu::gemm_cache cache;
  std::size_t ws_bytes;
  mbt::device_buffer<unsigned char> ws;
  gemm_env() : ws_bytes(gpu::gemm_workspace_bytes(exec)), ws(ws_bytes + 256) {}
  gpu::gemm_context ctx(gpu::gemm_options o = {}) {
    return gpu::gemm_context(exec, cache, ws.get(), ws_bytes, o);
  }
};

// Deterministic values in [-1, 1], representable in T.
struct lcg {
  std::uint64_t s;
  double next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(s >> 11) / static_cast<double>(std::uint64_t{1} << 53) * 2.0 - 1.0;
  }
};

template <typename T>
T from_double(double v) {
  return mb::from_accum<T>(v);
}
template <typename T>
double to_double(T v) {
  return mb::to_accum<double>(v);
}

template <typename T>
std::vector<unsigned char> bytes_of_vector(const std::vector<T>& v) {
  std::vector<unsigned char> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// A row-major rows×cols matrix inside a buffer with leading dimension ld, `offset` elements in
// (a column slice); everything outside the view is NaN, which no correct GEMM reads or writes.
template <typename T>
struct host_matrix {
  std::size_t rows, cols, ld, offset;
  std::vector<T> data;
  host_matrix(std::size_t r, std::size_t c, std::size_t l, std::size_t off)
      : rows(r),
        cols(c),
        ld(l),
        offset(off),
        data(off + r * l, from_double<T>(std::numeric_limits<double>::quiet_NaN())) {}
  T& at(std::size_t i, std::size_t j) { return data[offset + i * ld + j]; }
  void fill(lcg& g) {
    for (std::size_t i = 0; i < rows; ++i) {
      for (std::size_t j = 0; j < cols; ++j) at(i, j) = from_double<T>(g.next());
    }
  }
  // The same layout in double, NaN outside the view as well.
  std::vector<double> widened(bool absolute) const {
    std::vector<double> d(data.size());
    for (std::size_t i = 0; i < data.size(); ++i) {
      d[i] = to_double(data[i]);
      if (absolute) d[i] = std::abs(d[i]);
    }
    return d;
  }
};

struct shape {
  std::size_t N, K, M;
};

// Row-major rows×cols of x, w (d for matmul_at) and y (g) for each form, as backend/cpu/gemm.hpp has them.
struct dims {
  std::size_t xr, xc, wr, wc, yr, yc;
};
dims operand_dims(gpu::gemm_op op, shape s) {
  switch (op) {
    case gpu::gemm_op::nn:
      return {s.N, s.K, s.K, s.M, s.N, s.M};
    case gpu::gemm_op::bt:
      return {s.N, s.K, s.M, s.K, s.N, s.M};
    case gpu::gemm_op::at:
      return {s.N, s.K, s.N, s.M, s.K, s.M};
  }
  return {};
}

template <typename T, typename Out>
void launch(const gpu::gemm_context& ctx, gpu::gemm_op op, const T* x, const T* w, Out* y, shape s,
            bool accumulate, mb::cpu::ld3 ld) {
  switch (op) {
    case gpu::gemm_op::nn:
      gpu::matmul(ctx, x, w, y, s.N, s.K, s.M, accumulate, ld);
      break;
    case gpu::gemm_op::bt:
      gpu::matmul_bt(ctx, x, w, y, s.N, s.K, s.M, accumulate, ld);
      break;
    case gpu::gemm_op::at:
      gpu::matmul_at(ctx, x, w, y, s.N, s.K, s.M, accumulate, ld);
      break;
  }
}

void reference(mb::thread_pool& pool, gpu::gemm_op op, const double* x, const double* w, double* y,
               shape s, mb::cpu::ld3 ld) {
  switch (op) {
    case gpu::gemm_op::nn:
      mb::cpu::matmul(pool, x, w, y, s.N, s.K, s.M, false, ld);
      break;
    case gpu::gemm_op::bt:
      mb::cpu::matmul_bt(pool, x, w, y, s.N, s.K, s.M, false, ld);
      break;
    case gpu::gemm_op::at:
      mb::cpu::matmul_at(pool, x, w, y, s.N, s.K, s.M, false, ld);
      break;
  }
}

struct case_options {
  bool accumulate = false;
  std::size_t pad = 0;     // extra elements per row of every operand
  std::size_t offset = 0;  // the views start this many elements into their buffers
  gpu::gemm_options gemm{};
};

// One GPU call against cpu::matmul* in double, with the bound from the header comment; also
// checks that nothing outside y's view changed (bitwise).
template <typename T, typename Out>
void check_case(gemm_env& e, gpu::gemm_op op, shape s, case_options o, std::uint64_t seed) {
  const dims d = operand_dims(op, s);
  const mb::cpu::ld3 ld{d.xc + o.pad, d.wc + o.pad, d.yc + o.pad};
  host_matrix<T> x(d.xr, d.xc, ld.x, o.offset), w(d.wr, d.wc, ld.w, o.offset);
  host_matrix<Out> y(d.yr, d.yc, ld.y, o.offset);
  lcg g{seed};
  x.fill(g);
  w.fill(g);
  if (o.accumulate) y.fill(g);  // else NaN: beta = 0 must not read y
  const std::vector<Out> y_before = y.data;

  mbt::device_buffer<T> dx(x.data), dw(w.data);
  mbt::device_buffer<Out> dy(y.data);
  launch(e.ctx(o.gemm), op, dx.get() + o.offset, dw.get() + o.offset, dy.get() + o.offset, s,
         o.accumulate, ld);
  e.exec.synchronize();
  const std::vector<Out> got = dy.download();

  mb::thread_pool pool(1);
  const std::vector<double> xd = x.widened(false), wd = w.widened(false);
  const std::vector<double> xa = x.widened(true), wa = w.widened(true);
  std::vector<double> prod(y.data.size(), 0.0), scale(y.data.size(), 0.0);
  reference(pool, op, xd.data() + o.offset, wd.data() + o.offset, prod.data() + o.offset, s, ld);
  reference(pool, op, xa.data() + o.offset, wa.data() + o.offset, scale.data() + o.offset, s, ld);

  const bool fp32_in = std::is_same_v<T, float>;
  const double k = static_cast<double>(op == gpu::gemm_op::at ? s.N : s.K);
  const double acc = fp32_in ? (o.gemm.allow_tf32 ? std::ldexp(1.0, -9) + 2 * (k + 2) * u32 : 1e-5)
                             : 2 * (k + 2) * u32;
  const double u_out = unit_roundoff<Out>();
  // Accumulating into a 16-bit y rounds twice on the GPU: measured on an H200 with cuBLASLt 13.0
  // (2026-11-26), beta = 0 is rounded once (tools/cuda_gemm_numerics.cu: every element equals
  // the exact product rounded to nearest) while with beta = 1 the error follows |alpha·sum|, not
  // |alpha·sum + y| (5.5 ulp of a result where the two cancel): the epilogue rounds alpha·sum to
  // the output type, then adds y and rounds again. The bound adds that first rounding.
  const bool rounds_twice = o.accumulate && !std::is_same_v<Out, float>;
  const double alpha = o.gemm.alpha;

  std::size_t bad = 0;
  for (std::size_t i = 0; i < d.yr; ++i) {
    for (std::size_t j = 0; j < d.yc; ++j) {
      const std::size_t at = o.offset + i * ld.y + j;
      const double y0 = o.accumulate ? to_double(y_before[at]) : 0.0;
      const double want = alpha * prod[at] + y0;
      const double sc = std::abs(alpha) * scale[at] + std::abs(y0);
      const double first = rounds_twice ? u_out * (std::abs(alpha * prod[at]) + acc * sc) : 0.0;
      const double bound = acc * sc + first + u_out * (std::abs(want) + acc * sc + first) + 1e-30;
      const double err = std::abs(to_double(got[at]) - want);
      if (!(err <= bound)) {
        if (bad++ == 0) {
          std::fprintf(
              stderr, "%s %s->%s N=%zu K=%zu M=%zu%s: [%zu,%zu] got %.9g want %.9g (bound %.3g)\n",
              gpu::gemm_op_name(op), mb::dtype_name<T>().data(), mb::dtype_name<Out>().data(), s.N,
              s.K, s.M, o.accumulate ? " accumulating" : "", i, j, to_double(got[at]), want, bound);
        }
      }
    }
  }
  CHECK(bad == 0);
  if (bad != 0) {
    // Name the kernel behind the miss: the plan the call used (the cache returns the same one).
    const gpu::gemm_problem p =
        gpu::detail::make_problem<T, Out>(op, s.N, s.K, s.M, ld, o.gemm);
    std::fprintf(stderr, "  %zu of %zu elements off; %s\n", bad, d.yr * d.yc,
                 e.cache.plan(e.exec, p, dx.get() + o.offset, dw.get() + o.offset,
                              dy.get() + o.offset).describe().c_str());
  }

  // Outside the view: untouched, bit for bit (the NaN padding included).
  std::vector<unsigned char> gb = bytes_of_vector(got), yb = bytes_of_vector(y_before);
  for (std::size_t i = 0; i < d.yr; ++i) {
    for (std::size_t j = 0; j < d.yc; ++j) {
      const std::size_t at = (o.offset + i * ld.y + j) * sizeof(Out);
      std::memset(gb.data() + at, 0, sizeof(Out));
      std::memset(yb.data() + at, 0, sizeof(Out));
    }
  }
  CHECK(gb == yb);
}

constexpr gpu::gemm_op all_ops[] = {gpu::gemm_op::nn, gpu::gemm_op::bt, gpu::gemm_op::at};

void test_fp32_shapes() {
  gemm_env e;
  const shape shapes[] = {{1, 1, 1}, {17, 33, 65}, {5, 7, 3}, {64, 130, 48}, {65, 9, 1}};
  std::uint64_t seed = 1;
  for (gpu::gemm_op op : all_ops) {
    for (shape s : shapes) {
      for (bool acc : {false, true}) {
        check_case<float, float>(e, op, s, {acc, 0, 0, {}}, seed++);
      }
    }
  }
  // alpha, as cpu::gemm's scalar.
  check_case<float, float>(e, gpu::gemm_op::nn, {17, 33, 65}, {true, 0, 0, {-0.5f, false}}, 99);
}

template <typename T>
void half_shapes() {
  gemm_env e;
  const shape shapes[] = {{1, 1, 1}, {17, 33, 65}, {64, 128, 96}, {32, 1000, 40}};
  std::uint64_t seed = 100;
  for (gpu::gemm_op op : all_ops) {
    for (shape s : shapes) {
      for (bool acc : {false, true}) {
        check_case<T, T>(e, op, s, {acc, 0, 0, {}}, seed++);
        check_case<T, float>(e, op, s, {acc, 0, 0, {}}, seed++);
      }
    }
  }
}
void test_bf16_shapes() { half_shapes<mb::bf16>(); }
void test_fp16_shapes() { half_shapes<mb::fp16>(); }

// Leading dimensions wider than the rows, and views starting one element into their buffers
// (4- or 2-byte aligned: the heuristic must pick an algorithm that reads them).
void test_leading_dimension_views() {
  gemm_env e;
  std::uint64_t seed = 500;
  for (gpu::gemm_op op : all_ops) {
    for (std::size_t pad : {std::size_t{3}, std::size_t{8}}) {
      for (std::size_t offset : {std::size_t{0}, std::size_t{1}}) {
        check_case<float, float>(e, op, {17, 33, 65}, {true, pad, offset, {}}, seed++);
        check_case<mb::bf16, mb::bf16>(e, op, {40, 72, 24}, {false, pad, offset, {}}, seed++);
        check_case<mb::fp16, float>(e, op, {40, 72, 24}, {true, pad, offset, {}}, seed++);
      }
    }
  }
}

void test_tf32_on_request() {
  gemm_env e;
  check_case<float, float>(e, gpu::gemm_op::nn, {64, 256, 64}, {false, 0, 0, {1.0f, true}}, 7);
  check_case<float, float>(e, gpu::gemm_op::at, {256, 64, 64}, {true, 0, 0, {1.0f, true}}, 8);
}

// Same inputs, same bits: twice through one plan, then through a fresh cache (the heuristic
// chooses again). K large against N·M is where a split-K algorithm would have been chosen.
template <typename T>
void repeat_bitwise(gpu::gemm_op op, shape s) {
  gemm_env e;
  const dims d = operand_dims(op, s);
  lcg g{42};
  std::vector<T> x(d.xr * d.xc), w(d.wr * d.wc);
  for (auto& v : x) v = from_double<T>(g.next());
  for (auto& v : w) v = from_double<T>(g.next());
  mbt::device_buffer<T> dx(x), dw(w), dy(d.yr * d.yc);
  const mb::cpu::ld3 ld{d.xc, d.wc, d.yc};
  launch(e.ctx(), op, dx.get(), dw.get(), dy.get(), s, false, ld);
  e.exec.synchronize();
  const std::vector<T> first = dy.download();
  launch(e.ctx(), op, dx.get(), dw.get(), dy.get(), s, false, ld);
  e.exec.synchronize();
  CHECK(bytes_of_vector(dy.download()) == bytes_of_vector(first));
  CHECK(e.cache.size() == 1);

  gemm_env fresh;
  mbt::device_buffer<T> dy2(d.yr * d.yc);
  launch(fresh.ctx(), op, dx.get(), dw.get(), dy2.get(), s, false, ld);
  fresh.exec.synchronize();
  CHECK(bytes_of_vector(dy2.download()) == bytes_of_vector(first));
}

void test_bitwise_repeats() {
  repeat_bitwise<float>(gpu::gemm_op::nn, {256, 256, 256});
  repeat_bitwise<mb::bf16>(gpu::gemm_op::at, {16384, 64, 64});  // weight gradient, long K
  repeat_bitwise<mb::bf16>(gpu::gemm_op::bt, {16, 8192, 32});
  repeat_bitwise<float>(gpu::gemm_op::at, {8192, 33, 17});
}

// matmul_at's split over N (gemm.cuh, "Split-K"): chosen from the shape and the workspace alone,
// and held to the same per-element bound as one dot product (a split sums the same products in
// another fixed order, in fp32, and rounds once). Repeats of split shapes are in bitwise_repeats.
void test_split_k() {
  gemm_env e;
  const std::size_t ws = e.ws_bytes;
  const auto problem = [](gpu::gemm_op op, std::size_t N, std::size_t K, std::size_t M) {
    return gpu::detail::make_problem<mb::bf16, mb::bf16>(op, N, K, M, {K, M, M}, {});
  };
  const gpu::split_k_plan small = gpu::split_k_for(problem(gpu::gemm_op::at, 16384, 64, 64), ws);
  CHECK(small.parts == 16);  // one 128×128 tile; 16 slices of the 1024-token minimum
  CHECK(small.depth == 1024);
  CHECK(small.partial_stride == 64 * 64);
  CHECK(gpu::split_k_for(problem(gpu::gemm_op::at, 16383, 64, 64), ws).parts == 1);  // no aligned split
  CHECK(gpu::split_k_for(problem(gpu::gemm_op::at, 1000, 64, 64), ws).parts == 1);   // too short
  CHECK(gpu::split_k_for(problem(gpu::gemm_op::at, 4096, 2048, 2048), ws).parts == 1);  // 256 tiles
  CHECK(gpu::split_k_for(problem(gpu::gemm_op::nn, 16384, 64, 64), ws).parts == 1);
  gpu::gemm_problem plain = problem(gpu::gemm_op::at, 16384, 64, 64);
  plain.split_k = false;  // what gpu::gemm() runs
  CHECK(gpu::split_k_for(plain, ws).parts == 1);

  std::uint64_t seed = 900;
  for (bool acc : {false, true}) {
    check_case<mb::bf16, mb::bf16>(e, gpu::gemm_op::at, {16384, 64, 64}, {acc, 0, 0, {}}, seed++);
    check_case<mb::bf16, float>(e, gpu::gemm_op::at, {16384, 64, 64}, {acc, 0, 0, {}}, seed++);
    check_case<mb::fp16, mb::fp16>(e, gpu::gemm_op::at, {8192, 40, 72}, {acc, 0, 0, {}}, seed++);
    check_case<float, float>(e, gpu::gemm_op::at, {8192, 33, 17}, {acc, 3, 1, {}}, seed++);
    check_case<mb::bf16, mb::bf16>(e, gpu::gemm_op::at, {16383, 64, 64}, {acc, 0, 0, {}}, seed++);
  }
  check_case<mb::bf16, float>(e, gpu::gemm_op::at, {16384, 64, 64}, {true, 8, 1, {-0.5f, false}}, seed++);
}

void test_plan_cache() {
  gemm_env e;
  mbt::device_buffer<float> x(64 * 64), w(64 * 64), y(64 * 64);
  gpu::matmul(e.ctx(), x.get(), w.get(), y.get(), 32, 32, 32, false);
  gpu::matmul(e.ctx(), x.get(), w.get(), y.get(), 32, 32, 32, true);  // beta is not in the plan
  CHECK(e.cache.size() == 1);
  gpu::matmul(e.ctx(), x.get(), w.get(), y.get(), 32, 32, 32, false, {64, 64, 64});
  CHECK(e.cache.size() == 2);
  gpu::matmul_bt(e.ctx(), x.get(), w.get(), y.get(), 32, 32, 32, false);
  CHECK(e.cache.size() == 3);
  gpu::matmul(e.ctx(), x.get() + 1, w.get(), y.get(), 32, 32, 32, false);  // less aligned x
  CHECK(e.cache.size() == 4);
  gpu::matmul(e.ctx({1.0f, true}), x.get(), w.get(), y.get(), 32, 32, 32, false);  // TF32
  CHECK(e.cache.size() == 5);
  e.exec.synchronize();
  e.cache.clear();
  CHECK(e.cache.size() == 0);
}

void test_errors() {
  gemm_env e;
  mbt::device_buffer<mb::bf16> x(64 * 64), w(64 * 64), y(64 * 64);
  const auto ctx = e.ctx();
  const std::size_t huge = static_cast<std::size_t>(-1);  // what a negative int becomes

  CHECK(EXPECT_THROW(mb::invalid_argument,
                     gpu::matmul(ctx, x.get(), w.get(), y.get(), 0, 8, 8, false))
            .find("'matmul: N'") != std::string::npos);
  EXPECT_THROW(mb::invalid_argument,
               gpu::matmul_bt(ctx, x.get(), w.get(), y.get(), 8, 0, 8, false));
  EXPECT_THROW(mb::invalid_argument,
               gpu::matmul_at(ctx, x.get(), w.get(), y.get(), 8, 8, huge, false));

  // Leading dimensions below the row width, per form.
  CHECK(EXPECT_THROW(mb::invalid_argument,
                     gpu::matmul(ctx, x.get(), w.get(), y.get(), 8, 16, 8, false, {15, 8, 8}))
            .find("ld.x") != std::string::npos);
  EXPECT_THROW(mb::invalid_argument,
               gpu::matmul(ctx, x.get(), w.get(), y.get(), 8, 16, 8, false, {16, 7, 8}));
  EXPECT_THROW(mb::invalid_argument,
               gpu::matmul_bt(ctx, x.get(), w.get(), y.get(), 8, 16, 8, false, {16, 15, 8}));
  EXPECT_THROW(mb::invalid_argument,
               gpu::matmul_at(ctx, x.get(), w.get(), y.get(), 8, 16, 8, false, {16, 8, 7}));

  // Null and misaligned operands.
  EXPECT_THROW(mb::invalid_argument, gpu::matmul(ctx, static_cast<const mb::bf16*>(nullptr),
                                                 w.get(), y.get(), 8, 8, 8, false));
  const auto* odd = reinterpret_cast<const mb::bf16*>(reinterpret_cast<const char*>(x.get()) + 1);
  CHECK(EXPECT_THROW(mb::invalid_argument, gpu::matmul(ctx, odd, w.get(), y.get(), 8, 8, 8, false))
            .find("aligned") != std::string::npos);

  // The output may not overlap an input.
  EXPECT_THROW(mb::invalid_argument,
               gpu::matmul(ctx, x.get(), w.get(), x.get() + 8, 8, 8, 8, false));

  // Workspace: missing, one byte short, misaligned.
  try {
    gpu::matmul(gpu::gemm_context(e.exec, e.cache, e.ws.get(), e.ws_bytes - 1), x.get(), w.get(),
                y.get(), 8, 8, 8, false);
    CHECK(false);
  } catch (const mb::workspace_too_small& err) {
    CHECK(err.required() == e.ws_bytes && err.given() == e.ws_bytes - 1);
  }
  EXPECT_THROW(mb::workspace_too_small,
               gpu::matmul(gpu::gemm_context(e.exec, e.cache, nullptr, e.ws_bytes), x.get(),
                           w.get(), y.get(), 8, 8, 8, false));
  CHECK(EXPECT_THROW(mb::invalid_argument,
                     gpu::matmul(gpu::gemm_context(e.exec, e.cache, e.ws.get() + 16, e.ws_bytes),
                                 x.get(), w.get(), y.get(), 8, 8, 8, false))
            .find("256") != std::string::npos);

  // Every refusal came before planning, so nothing was cached or launched.
  CHECK(e.cache.size() == 0);
  CHECK(gpu::gemm_workspace_bytes_for(9) == (std::size_t{32} << 20));
  CHECK(gpu::gemm_workspace_bytes_for(8) == (std::size_t{4} << 20));
}

}  // namespace

int main() {
  static const mbt::test_case cases[] = {
      {"fp32_shapes", test_fp32_shapes},
      {"bf16_shapes", test_bf16_shapes},
      {"fp16_shapes", test_fp16_shapes},
      {"leading_dimension_views", test_leading_dimension_views},
      {"tf32_on_request", test_tf32_on_request},
      {"bitwise_repeats", test_bitwise_repeats},
      {"split_k", test_split_k},
      {"plan_cache", test_plan_cache},
      {"errors", test_errors},
  };
  return mbt::run_suite("test_cuda_gemm", cases);
}
