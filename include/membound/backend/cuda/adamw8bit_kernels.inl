// The 8-bit AdamW step's kernel.
// A fragment, not a header: model.cuh includes it inside namespace membound::gpu::detail, and
// tests/emulation/adamw8bit_cuda_emulate.cpp includes the same text inside its emulation namespace,
// where the CUDA built-ins are host threads (tests/emulation/cuda_emulate.py adamw8bit). One text, compiled
// by nvcc and by the emulation: change the kernels here.
// Block b of the state; Threads = min(Block, adamw8bit_threads) threads. The loads of m, v and
// the stores of the codes are strided by the thread count (coalesced).
template <typename S, unsigned Block>
__global__ void __launch_bounds__(adamw8bit_threads)
    adamw8bit_kernel(S* w, const S* g, float* master, float* absmax_m, float* absmax_v,
                     std::uint8_t* qm, std::uint8_t* qv, std::size_t n, adamw8bit_tables tb,
                     adamw_coefficients<float> kd, adamw_coefficients<float> kn, float gs,
                     const unsigned* skip) {
  constexpr unsigned Threads = Block < adamw8bit_threads ? Block : adamw8bit_threads;
  constexpr unsigned per = Block / Threads;
  if (skip != nullptr && *skip != 0) return;
  __shared__ float code[2][256];
  __shared__ float mid[2][255];
  __shared__ float red[2][Threads];
  const unsigned tid = threadIdx.x;
  for (unsigned q = tid; q < 256; q += Threads) {
    code[0][q] = tb.code_m[q];
    code[1][q] = tb.code_v[q];
    if (q < 255) {
      mid[0][q] = tb.mid_m[q];
      mid[1][q] = tb.mid_v[q];
    }
  }
  __syncthreads();
  const std::size_t b = blockIdx.x, i0 = b * Block, i1 = n - i0 < Block ? n : i0 + Block;
  const float am = absmax_m[b], av = absmax_v[b];
  float mf[per], vf[per];
  float lm = 0.0f, lv = 0.0f;
  for (unsigned j = 0; j < per; ++j) {
    mf[j] = vf[j] = 0.0f;
    const std::size_t i = i0 + j * Threads + tid;
    if (i >= i1) continue;
    float m = code[0][qm[i]] * am;
    float v = code[1][qv[i]] * av;
    // The first span ending past i (spans sorted, apart); i is in it when it starts at or before i.
    unsigned lo = 0, hi = tb.spans;
    while (lo < hi) {
      const unsigned k = (lo + hi) / 2;
      if (tb.end[k] <= i) lo = k + 1;
      else hi = k;
    }
    // An element in no span (padding between tensors) keeps its weight and its moments.
    if (lo < tb.spans && tb.first[lo] <= i) {
      float p = master != nullptr ? master[i] : ld(w, i);
      adamw_step(tb.decay[lo] ? kd : kn, ld(g, i) * gs, m, v, p);
      if (master != nullptr) master[i] = p;
      st(w, i, p);
    }
    mf[j] = m;
    vf[j] = v;
    const float a = m < 0.0f ? -m : m;  // std::abs; std::max(x, y) is (x < y) ? y : x
    lm = lm < a ? a : lm;
    lv = lv < v ? v : lv;
  }
  red[0][tid] = lm;
  red[1][tid] = lv;
  __syncthreads();
  for (unsigned s = Threads / 2; s > 0; s /= 2) {
    if (tid < s) {
      red[0][tid] = red[0][tid] < red[0][tid + s] ? red[0][tid + s] : red[0][tid];
      red[1][tid] = red[1][tid] < red[1][tid + s] ? red[1][tid + s] : red[1][tid];
    }
    __syncthreads();
  }
  const float sm = red[0][0], sv = red[1][0];
  for (unsigned j = 0; j < per; ++j) {
    const std::size_t i = i0 + j * Threads + tid;
    if (i >= i1) continue;
    qm[i] = sm > 0.0f ? nearest_code(mid[0], mf[j] / sm) : tb.zero_m;
    qv[i] = sv > 0.0f ? nearest_code(mid[1], vf[j] / sv) : tb.zero_v;
  }
  if (tid == 0) {  // every thread read the old scales before the first barrier
    absmax_m[b] = sm;
    absmax_v[b] = sv;
  }
}
